"""Pipeline: the microbatches whose activations a stage holds at its rank's peak.

They come from ``engine.pipeline.schedules``' action lists, the per-rank order torch executes
(``engine.pipeline.schedules.microbatches_in_flight``): a stage-microbatch is alive from its F until its
full backward B, or until its W where the backward is split (I then W: torch's
``stage_backward_input`` retains the whole autograd graph until the weight gradient); an
overlapped DualPipeV F+B runs the F first. The peak is the non-dominated state maximising
Σ count × bytes per microbatch of the local stage. That gives GPipe m; 1F1B min(m, p − r);
LoopedBFS m per local stage; Interleaved1F1B and InterleavedZeroBubble torch's warm-up;
ZBVZeroBubble and DualPipeV about 2p and 2p + 1 stage-microbatches per rank (the ZB-V paper's
"1F1B peak on every rank", and DualPipe's PP + 1). DualPipe's doubled parameters belong to the
bidirectional DualPipe with two model copies; torch ships only DualPipeV, whose 2p stages are
distinct, so no parameter is doubled.
"""

from __future__ import annotations

from engine.pipeline.schedules import in_flight_states, microbatches_in_flight

__all__ = ["IN_FLIGHT_RULE", "in_flight_states", "microbatches_in_flight"]

#: the rule of each schedule, in words (MemoryReport.conventions["pipeline_in_flight"])
IN_FLIGHT_RULE = {
    "GPipe": "all m microbatches (every forward before any backward)",
    "LoopedBFS": "all m microbatches on every local stage (breadth-first)",
    "1F1B": "min(m, p − r) on pp-rank r",
    "Interleaved1F1B": "torch's interleaved order replayed: warm-up (v−1)·m_round + 2(p−1−r) forwards",
    "InterleavedZeroBubble": "torch's order replayed: warm-up (v−1)·m_round + (p−1−r), each microbatch held until its W",
    "ZBVZeroBubble": "torch's ZB-V order replayed (about 2p stage-microbatches per rank, held until W)",
    "DualPipeV": "torch's DualPipeV order replayed (about 2p + 1 stage-microbatches per rank)",
}
