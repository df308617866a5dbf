"""Memory per rank, per pipeline stage, by category — with the terms behind every number.

``memory_per_rank(cfg)`` answers "does it fit, and on which GPU does it not?". Every rank of
the world is listed; each category of each rank expands into named terms
(``RankMemory.explain(category)``), each with its bytes, the formula that produced it and, in
fields, its category, whether PyTorch's tracker can see it, its stage and microbatches in
flight. (The largest model of a shape family that fits: ``engine.model.family``.) The conventions are stated in ``MemoryReport.conventions`` and documented in the
module that applies them, one idea per module:

  report       Term, one rank's body, RankMemory, MemoryReport
  states       model states: "pytorch" and "zero-paper" accountings, LoRA adapters
  activations  the table of tensors each op saves for backward (Korthikanti et al. 2022)
  in_flight    microbatches in flight from engine.pipeline.schedules' action lists
  buffers      DDP buckets, FSDP2 units and collectives, pipeline p2p buffers
  overhead     runtime context, collective-library buffers, allocator slack
  conventions  the conventions in words
  per_rank     memory_per_rank: the body of each rank, assembled
"""

from engine.memory.activations import activation_bytes_per_layer, activation_terms_per_layer
from engine.memory.conventions import conventions_of
from engine.memory.in_flight import microbatches_in_flight
from engine.memory.per_rank import memory_per_rank
from engine.memory.report import GIB, MB, MIB, MemoryReport, RankMemory, Term, _Body

__all__ = [
    "GIB",
    "MB",
    "MIB",
    "MemoryReport",
    "RankMemory",
    "Term",
    "_Body",
    "activation_bytes_per_layer",
    "activation_terms_per_layer",
    "conventions_of",
    "memory_per_rank",
    "microbatches_in_flight",
]
