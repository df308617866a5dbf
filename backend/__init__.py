"""Turning a Config into real multi-process PyTorch training, and measuring it per rank.

The launching and record-keeping modules import no torch themselves (the GUI uses them);
only the worker that runs inside each rank does.
"""
