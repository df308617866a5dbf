"""Pipeline schedules as data: per pipeline rank, the ordered compute actions it executes.

For every schedule ShardScope offers, :func:`pipeline_actions` returns the order that
``torch.distributed.pipelining`` (torch 2.13) *executes*, without importing torch. The
order-generation algorithms are ports of torch's own code (``schedules.py``):

===================== =====================================================================
schedule              ported from
===================== =====================================================================
GPipe                 ``ScheduleGPipe._step_microbatches`` (the hard-coded loop that runs)
1F1B                  ``Schedule1F1B._step_microbatches`` (the loop that runs, *not*
                      ``_get_pipeline_order``: that one numbers the last rank's forwards
                      from 1 while the loop starts at 0)
LoopedBFS             ``ScheduleLoopedBFS._calculate_single_rank_operations``
Interleaved1F1B       ``ScheduleInterleaved1F1B._calculate_single_rank_operations``,
                      ``_get_warmup_ops`` (factor 2), ``_get_1f1b_rank_ops``
InterleavedZeroBubble ``ScheduleInterleavedZeroBubble._calculate_single_rank_operations``,
                      ``_get_warmup_ops`` (factor 1), ``_get_1f1b_rank_ops(enable_zero_bubble)``
                      (``_add_bubbles_to_actions`` only inserts idle slots: order unchanged)
ZBVZeroBubble         ``ScheduleZBVZeroBubble._calculate_single_rank_operations``
DualPipeV             ``ScheduleDualPipeV._calculate_single_rank_operations``; each
                      ``OVERLAP_F_B`` is flattened into its sub-actions, F then B, the order
                      the runtime executes them
===================== =====================================================================

The multi-stage runtime executes ``pipeline_order_with_comms``; lowering it (adding
send/recv, reduce-grad, unshard) never reorders compute actions, so the compute order here
is the order that runs. ``tests/test_schedules.py`` checks every schedule against torch.

Idle slots (torch's ``None`` entries) are dropped: *when* an action runs is the timeline
simulation's job (:mod:`engine.timeline`), with real durations, not unit time steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from engine.layout import placement_style, stage_to_pp_rank
from engine.names import SCHEDULES, SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES

#: Compute action kinds: forward, full backward, backward for inputs, backward for weights.
ACTION_KINDS: tuple[str, ...] = ("F", "B", "I", "W")


class Action(NamedTuple):
    """One compute action: ``kind`` in F/B/I/W, the global ``stage`` index and the ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:  # torch's spelling: stage, kind, microbatch ("2F0")
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True, eq=False)
class PipelinePlan:
    """The per-rank compute order of one schedule for (pp, microbatches, virtual stages).

    ``per_rank[r]`` lists what pipeline rank ``r`` executes, in order (compute actions only).
    ``stage_to_rank[s]`` is the pipeline rank that holds stage ``s``. Sequences are tuples so a
    cached plan cannot be changed by a caller. Plans compare by identity (they are cached).
    """

    schedule: str
    pp: int
    num_stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    per_rank: tuple[tuple[Action, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.pp

    @property
    def num_actions(self) -> int:
        return sum(len(a) for a in self.per_rank)

    @property
    def splits_backward(self) -> bool:
        """True when some backward runs as I + W (zero-bubble schedules)."""
        return any(a.kind == "I" for acts in self.per_rank for a in acts)

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def to_strings(self) -> list[list[str]]:
        """Per rank, torch-style action strings ("0F0", "3B1", ...): handy in tests and logs."""
        return [[str(a) for a in acts] for acts in self.per_rank]


# --------------------------------------------------------------------------- validation


def schedule_problems(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> list[str]:
    """Why torch would refuse this combination (empty when it is accepted).

    Mirrors ``engine.config._check_pipeline`` (which reports the same rules as ConfigError
    problems on the config fields) so that a bad combination never reaches the simulator.
    """
    out: list[str] = []
    if schedule not in SCHEDULES:
        return [f"unknown schedule {schedule!r}; allowed: {' | '.join(SCHEDULES)}"]
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        return [f"pp ({pp}), microbatches ({microbatches}) and virtual_stages ({virtual_stages}) must be ≥ 1"]
    if schedule in SINGLE_STAGE_SCHEDULES and virtual_stages != 1:
        out.append(f"virtual_stages = {virtual_stages}: schedule {schedule} runs one stage per rank; allowed: 1")
    if schedule in V_SCHEDULES and virtual_stages != 2:
        out.append(f"virtual_stages = {virtual_stages}: schedule {schedule} places two stages per rank; allowed: 2")
    if schedule == "1F1B" and microbatches < pp:
        out.append(f"microbatches = {microbatches}: schedule 1F1B needs microbatches ≥ pp ({pp})")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            out.append(f"microbatches = {microbatches}: schedule {schedule} needs a multiple of "
                       f"max(1, microbatches // pp) = {rounds}")
    if schedule == "DualPipeV" and microbatches < pp * virtual_stages:
        out.append(f"microbatches = {microbatches}: schedule DualPipeV needs microbatches ≥ "
                   f"number of stages ({pp * virtual_stages})")
    return out


# --------------------------------------------------------------------------- public entry


def pipeline_actions(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> PipelinePlan:
    """The compute order torch executes for ``schedule`` on ``pp`` ranks.

    ``virtual_stages`` is the number of stages per rank (2 for the V schedules). Raises
    ValueError for combinations torch rejects (see :func:`schedule_problems`). Results are
    cached: the same arguments return the same (immutable) plan object.
    """
    return _pipeline_actions(schedule, int(pp), int(microbatches), int(virtual_stages))


@lru_cache(maxsize=64)
def _pipeline_actions(schedule: str, pp: int, m: int, v: int) -> PipelinePlan:
    problems = schedule_problems(schedule, pp, m, v)
    if problems:
        raise ValueError(f"pipeline schedule {schedule} with pp={pp}, microbatches={m}, "
                         f"virtual_stages={v} is not runnable: " + "; ".join(problems))
    num_stages = pp * v
    owners = tuple(stage_to_pp_rank(num_stages, pp, placement_style(schedule)))
    gen = _GENERATORS[schedule]
    per_rank = tuple(tuple(gen(rank, pp, m, v)) for rank in range(pp))
    return PipelinePlan(schedule=schedule, pp=pp, num_stages=num_stages, microbatches=m,
                        stage_to_rank=owners, per_rank=per_rank)


@lru_cache(maxsize=16)
def single_rank_plan(schedule: str, microbatches: int) -> PipelinePlan:
    """pp = 1: no pipeline; gradient accumulation runs F then B for each microbatch in turn."""
    acts = []
    for mb in range(microbatches):
        acts.append(Action("F", 0, mb))
        acts.append(Action("B", 0, mb))
    return PipelinePlan(schedule=schedule, pp=1, num_stages=1, microbatches=microbatches,
                        stage_to_rank=(0,), per_rank=(tuple(acts),))


# --------------------------------------------------------------------------- generators
# Each returns rank's compute actions in execution order; arguments (rank, pp, m, v).


def _gpipe(rank: int, pp: int, m: int, v: int) -> list[Action]:
    # ScheduleGPipe._step_microbatches: all forwards, then all backwards, in microbatch order.
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int, v: int) -> list[Action]:
    # Schedule1F1B._step_microbatches: warm-up of min(m, num_stages - stage) forwards, then
    # "1B1F" (backward first) until the forwards run out, then the remaining backwards.
    warmup = min(m, pp - rank)
    out = [Action("F", rank, i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        out.append(Action("B", rank, bwd))
        bwd += 1
        if fwd == m:
            break
        out.append(Action("F", rank, fwd))
        fwd += 1
    while bwd < m:
        out.append(Action("B", rank, bwd))
        bwd += 1
    return out


def _looped_bfs(rank: int, pp: int, m: int, v: int) -> list[Action]:
    # ScheduleLoopedBFS._calculate_single_rank_operations
    stages = range(rank, pp * v, pp)
    out = [Action("F", s, mb) for s in stages for mb in range(m)]
    out += [Action("B", s, mb) for s in reversed(stages) for mb in reversed(range(m))]
    return out


def _warmup_ops(rank: int, v: int, per_round: int, pp: int, m: int, factor: int) -> int:
    # _get_warmup_ops
    return min((v - 1) * per_round + factor * ((pp - 1) - rank), m * v)


def _interleaved(rank: int, pp: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble._calculate_single_rank_operations
    # feeding _get_1f1b_rank_ops.
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = _warmup_ops(rank, v, per_round, pp, m, 1 if zero_bubble else 2)
    microbatch_ops = v * m
    fwd_bwd = microbatch_ops - warmup
    cooldown = microbatch_ops - fwd_bwd
    num_1f1b = rank  # zero bubble only: steps of plain 1F1B before W starts trailing

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    f_mb: dict[int, int] = defaultdict(int)
    b_mb: dict[int, int] = defaultdict(int)
    w_mb: dict[int, int] = defaultdict(int)
    backward_steps: list[int] = []
    w_count = 0
    bkind = "I" if zero_bubble else "B"
    out: list[Action] = []

    def weight() -> None:
        nonlocal w_count
        s = bwd_stage(backward_steps[w_count])
        out.append(Action("W", s, w_mb[s]))
        w_mb[s] += 1
        w_count += 1

    for op in range(warmup + fwd_bwd + cooldown):
        if op < warmup + fwd_bwd:
            s = fwd_stage(op)
            out.append(Action("F", s, f_mb[s]))
            f_mb[s] += 1
            if op < warmup:
                continue
        s = bwd_stage(op)
        out.append(Action(bkind, s, b_mb[s]))
        b_mb[s] += 1
        backward_steps.append(op)
        if zero_bubble and op - warmup >= num_1f1b:
            weight()
    while zero_bubble and w_count < len(backward_steps):
        weight()
    return out


def _interleaved_1f1b(rank: int, pp: int, m: int, v: int) -> list[Action]:
    return _interleaved(rank, pp, m, v, zero_bubble=False)


def _interleaved_zero_bubble(rank: int, pp: int, m: int, v: int) -> list[Action]:
    return _interleaved(rank, pp, m, v, zero_bubble=True)


def _zbv_zero_bubble(rank: int, pp: int, m: int, v: int) -> list[Action]:
    # ScheduleZBVZeroBubble._calculate_single_rank_operations: planned with at least 2pp-1
    # microbatches, then actions of microbatches ≥ m are dropped.
    n = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    f0 = f1 = b0 = b1 = 0
    out: list[Action] = []
    for _ in range(2 * (pp - rank) - 1):
        out.append(Action("F", c0, f0))
        f0 += 1
    for _ in range(rank):
        out.append(Action("F", c1, f1))
        f1 += 1
        out.append(Action("F", c0, f0))
        f0 += 1
    for _ in range(pp - rank):
        out += [Action("F", c1, f1), Action("I", c1, b1), Action("W", c1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(Action("F", c0, f0))
            f0 += 1
        out += [Action("I", c0, b0), Action("W", c0, b0)]
        b0 += 1
        out += [Action("F", c1, f1), Action("I", c1, b1), Action("W", c1, b1)]
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out.append(Action("I", c0, b0))
        b0 += 1
        out.append(Action("I", c1, b1))
        b1 += 1
    for _ in range(pp - rank):
        out.append(Action("I", c0, b0))
        b0 += 1
        out.append(Action("W", c0, w0))
        w0 += 1
    while w1 < b1:
        out.append(Action("W", c1, w1))
        w1 += 1
    while w0 < b0:
        out.append(Action("W", c0, w0))
        w0 += 1
    return [a for a in out if a.microbatch < m]


def _dualpipev(rank: int, pp: int, m: int, v: int) -> list[Action]:
    # ScheduleDualPipeV._calculate_single_rank_operations, OVERLAP_F_B flattened to F, B.
    s0, s1 = rank, 2 * pp - 1 - rank
    count: dict[tuple[int, str], int] = defaultdict(int)  # (stage, F|I|W) -> next microbatch
    weight_queue: list[tuple[int, int]] = []
    out: list[Action] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = count[key]
        out.append(Action(kind, stage, mb))
        if kind == "B":  # a full backward advances both the I and the W counters
            count[(stage, "I")] += 1
            count[(stage, "W")] += 1
        else:
            if kind == "I":
                weight_queue.append((stage, mb))
            count[key] = mb + 1

    def add_weight_if_pending() -> None:
        if weight_queue:
            stage, mb = weight_queue.pop(0)
            out.append(Action("W", stage, mb))
            count[(stage, "W")] += 1

    def overlap(f_stage: int, b_stage: int) -> None:  # OVERLAP_F_B: sub-actions F then B
        add(f_stage, "F")
        add(b_stage, "B")

    for _ in range((pp - rank - 1) * 2):
        add(s0, "F")
    for _ in range(rank + 1):
        add(s0, "F")
        add(s1, "F")
    for _ in range(pp - rank - 1):
        add(s1, "I")
        add_weight_if_pending()
        add(s1, "F")
    for i in range(m - pp * 2 + rank + 1):
        if i == 0 and rank == pp - 1:
            add(s0, "F")
            add(s1, "B")
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(pp - rank - 1):
        add(s1, "B")
        overlap(s1, s0)
    steps = rank + 1
    zb = False
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            zb = True
        add(s1, "I" if zb else "B")
        if i == steps // 2 and rank % 2 == 0:
            zb = True
        add(s0, "I" if zb else "B")
    for _ in range(pp - rank - 1):
        add_weight_if_pending()
        add(s0, "I" if zb else "B")
    for _ in range(rank + 1):
        add_weight_if_pending()
    return out


_GENERATORS = {
    "GPipe": _gpipe,
    "1F1B": _one_f_one_b,
    "LoopedBFS": _looped_bfs,
    "Interleaved1F1B": _interleaved_1f1b,
    "InterleavedZeroBubble": _interleaved_zero_bubble,
    "ZBVZeroBubble": _zbv_zero_bubble,
    "DualPipeV": _dualpipev,
}
assert set(_GENERATORS) == set(SCHEDULES)
assert SPLIT_BACKWARD_SCHEDULES <= set(SCHEDULES)
