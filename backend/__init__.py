"""Turning a Config into real multi-process PyTorch training, and measuring it per rank.

The launching and record-keeping modules import no torch themselves (the GUI uses them);
only the worker that runs inside each rank does (backend.train, backend.model,
backend.parallel, backend.measure).

    from backend import launch
    run = launch(cfg, out_dir="runs/x", steps=5, timeout_s=120)   # returns at once
    for ev in run.events(): ...        # started, rank_ready, step, measurement, finished|failed
    meas = run.measurement()           # Measurement: memory.per_rank, step, pipeline.per_rank
    run.cancel()                       # kills every process of the run

``backend.launch.run_cli(config_path, out_dir, steps, json_events)`` is ``shardscope run``.
"""

from backend.launch import Run, launch, run_cli
from backend.records import Measurement

__all__ = ["Measurement", "Run", "launch", "run_cli"]
