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
is the order that runs. ``tests/engine/pipeline/test_schedules.py`` checks every schedule against torch.

Idle slots (torch's ``None`` entries) are dropped: *when* an action runs is the timeline
simulation's job (:mod:`engine.pipeline.timeline`), with real durations, not unit time steps.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from engine.config import step_size_problems
from engine.names import SCHEDULES, SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES
from engine.pipeline.layout import placement_style, stage_to_pp_rank

#: Compute action kinds: forward, full backward, backward for inputs, backward for weights.
ACTION_KINDS: tuple[str, ...] = ("F", "B", "I", "W")


class Action(NamedTuple):
    """One compute action: ``kind`` in F/B/I/W, the global ``stage`` index and the ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:  # torch's spelling: stage, kind, microbatch ("2F0")
        return f"{self.stage}{self.kind}{self.microbatch}"


class PlanArrays(NamedTuple):
    """A plan as flat integer arrays, rank-major, each rank in execution order: rank ``r``'s
    actions are ``[offsets[r], offsets[r+1])``; ``kind`` codes index ACTION_KINDS."""

    offsets: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray


class PipelinePlan:
    """The per-rank compute order of one schedule for (pp, microbatches, virtual stages).

    ``per_rank[r]`` lists what pipeline rank ``r`` executes, in order (compute actions only).
    ``stage_to_rank[s]`` is the pipeline rank that holds stage ``s``. ``arrays`` is the same
    order as flat integer arrays (:class:`PlanArrays`) — what the timeline uses. A plan is
    made from either one; the other is derived on first use. Sequences are tuples and arrays
    are read-only so a cached plan cannot be changed by a caller. Plans compare by identity
    (they are cached).
    """

    __slots__ = ("schedule", "pp", "num_stages", "microbatches", "stage_to_rank", "_per_rank", "_arrays",
                 "__weakref__")

    def __init__(self, schedule: str, pp: int, num_stages: int, microbatches: int,
                 stage_to_rank: tuple[int, ...], per_rank: tuple[tuple[Action, ...], ...] | None = None,
                 *, arrays: PlanArrays | None = None):
        if (per_rank is None) == (arrays is None):
            raise TypeError("PipelinePlan needs exactly one of per_rank and arrays")
        if arrays is not None:
            for a in arrays:
                a.setflags(write=False)
        else:
            per_rank = tuple(tuple(Action(*a) for a in acts) for acts in per_rank)
        for name, value in (("schedule", schedule), ("pp", pp), ("num_stages", num_stages),
                            ("microbatches", microbatches), ("stage_to_rank", tuple(stage_to_rank)),
                            ("_per_rank", per_rank), ("_arrays", arrays)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"PipelinePlan is immutable (cannot set {name!r})")

    def __repr__(self) -> str:
        return (f"PipelinePlan(schedule={self.schedule!r}, pp={self.pp}, num_stages={self.num_stages}, "
                f"microbatches={self.microbatches}, actions={self.num_actions})")

    @property
    def per_rank(self) -> tuple[tuple[Action, ...], ...]:
        if self._per_rank is None:
            a = self._arrays
            letters = np.array(ACTION_KINDS)[a.kind].tolist()
            stage, mb, o = a.stage.tolist(), a.microbatch.tolist(), a.offsets.tolist()
            per_rank = tuple(tuple(map(Action, letters[o[r]:o[r + 1]], stage[o[r]:o[r + 1]], mb[o[r]:o[r + 1]]))
                             for r in range(len(o) - 1))
            object.__setattr__(self, "_per_rank", per_rank)
        return self._per_rank

    @property
    def arrays(self) -> PlanArrays:
        """Raises ValueError when an action's kind is not one of ACTION_KINDS."""
        if self._arrays is None:
            object.__setattr__(self, "_arrays", _arrays_of(self._per_rank))
        return self._arrays

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.pp

    @property
    def num_actions(self) -> int:
        if self._arrays is not None:
            return len(self._arrays.kind)
        return sum(len(a) for a in self._per_rank)

    @property
    def splits_backward(self) -> bool:
        """True when some backward runs as I + W (zero-bubble schedules)."""
        return bool(np.any(self.arrays.kind == ACTION_KINDS.index("I")))

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def to_strings(self) -> list[list[str]]:
        """Per rank, torch-style action strings ("0F0", "3B1", ...): handy in tests and logs."""
        return [[str(a) for a in acts] for acts in self.per_rank]


def _arrays_of(per_rank) -> PlanArrays:
    lengths = [len(a) for a in per_rank]
    offsets = np.zeros(len(per_rank) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = [a for acts in per_rank for a in acts]
    code = {k: i for i, k in enumerate(ACTION_KINDS)}
    try:
        kind = np.fromiter((code[a[0]] for a in flat), dtype=np.int64, count=len(flat))
    except KeyError as e:
        raise ValueError(f"plan has an action kind {e.args[0]!r} outside {ACTION_KINDS}") from None
    stage = np.fromiter((a[1] for a in flat), dtype=np.int64, count=len(flat))
    mb = np.fromiter((a[2] for a in flat), dtype=np.int64, count=len(flat))
    return PlanArrays(offsets, kind, stage, mb)


# --------------------------------------------------------------------------- validation


def schedule_problems(schedule: str, pp: int, microbatches: int, virtual_stages: int,
                      layers: int | None = None) -> list[str]:
    """Why torch would refuse this combination, or the engine (a step too long to simulate in about a
    second: ``engine.config.step_size_problems``, with ``layers`` when given); empty when accepted.

    Mirrors ``engine.config.rules._check_pipeline`` (which reports the same rules as ConfigError
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
    out += [f"{field.split('.')[1]} = {microbatches if field.endswith('microbatches') else pp}: {why}"
            for field, why in step_size_problems(schedule, pp, virtual_stages, microbatches, layers)]
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
    parts = [gen(rank, pp, m, v) for rank in range(pp)]
    offsets = np.zeros(pp + 1, dtype=np.int64)
    np.cumsum([len(p[0]) for p in parts], out=offsets[1:])
    arrays = PlanArrays(offsets, *(np.concatenate([p[i] for p in parts]) for i in range(3)))
    return PipelinePlan(schedule, pp, num_stages, m, owners, arrays=arrays)


@lru_cache(maxsize=16)
def single_rank_plan(schedule: str, microbatches: int) -> PipelinePlan:
    """pp = 1: no pipeline; gradient accumulation runs F then B for each microbatch in turn."""
    m = microbatches
    arrays = PlanArrays(np.array([0, 2 * m], dtype=np.int64), np.tile(np.array([_F, _B], dtype=np.int64), m),
                        np.zeros(2 * m, dtype=np.int64), np.repeat(np.arange(m, dtype=np.int64), 2))
    return PipelinePlan(schedule, 1, 1, m, (0,), arrays=arrays)


# --------------------------------------------------------------------------- generators
# Each returns rank's compute actions in execution order as integer arrays (kind codes into
# ACTION_KINDS, stage, microbatch); arguments (rank, pp, m, v). They are closed forms of
# torch's step-by-step loops: each phase of a loop (warm-up, steady state, cool-down) emits a
# regular pattern, written here as a few numpy ranges. tests/schedules_reference.py keeps the
# literal loop ports; tests/engine/pipeline/test_schedules.py checks the two agree on a wide grid and that
# both agree with torch.

_F, _B, _I, _W = range(4)
_EMPTY = np.zeros(0, dtype=np.int64)


class _Seq:
    """Appends runs of actions; ``kind``/``stage`` may be scalars (broadcast over ``mb``)."""

    __slots__ = ("kind", "stage", "mb")

    def __init__(self) -> None:
        self.kind: list[np.ndarray] = []
        self.stage: list[np.ndarray] = []
        self.mb: list[np.ndarray] = []

    def run(self, kind, stage, mb) -> None:
        mb = np.asarray(mb, dtype=np.int64)
        self.kind.append(np.broadcast_to(np.asarray(kind, dtype=np.int64), mb.shape))
        self.stage.append(np.broadcast_to(np.asarray(stage, dtype=np.int64), mb.shape))
        self.mb.append(mb)

    def rows(self, *cols, keep=None) -> None:
        """Row i emits cols[0][i], cols[1][i], ... (each col a (kind, stage, mb) triple of
        equal-length arrays or scalars); ``keep`` (rows × cols bools) drops entries."""
        n = max(np.size(c[2]) for c in cols)
        k = np.empty((n, len(cols)), dtype=np.int64)
        s = np.empty_like(k)
        b = np.empty_like(k)
        for j, (ck, cs, cb) in enumerate(cols):
            k[:, j], s[:, j], b[:, j] = ck, cs, cb
        if keep is None:
            self.kind.append(k.ravel())
            self.stage.append(s.ravel())
            self.mb.append(b.ravel())
        else:
            self.kind.append(k[keep])
            self.stage.append(s[keep])
            self.mb.append(b[keep])

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.mb:
            return _EMPTY, _EMPTY, _EMPTY
        return np.concatenate(self.kind), np.concatenate(self.stage), np.concatenate(self.mb)


def _r(a: int, b: int) -> np.ndarray:
    return np.arange(a, b, dtype=np.int64)


def _gpipe(rank: int, pp: int, m: int, v: int):
    # ScheduleGPipe._step_microbatches: all forwards, then all backwards, in microbatch order.
    q = _Seq()
    q.run(_F, rank, _r(0, m))
    q.run(_B, rank, _r(0, m))
    return q.arrays()


def _one_f_one_b(rank: int, pp: int, m: int, v: int):
    # Schedule1F1B._step_microbatches: warm-up of w = min(m, num_stages - stage) forwards,
    # then "1B1F" (backward first) until the forwards run out — pairs (B k, F w+k) — then the
    # remaining w backwards.
    w = min(m, pp - rank)
    q = _Seq()
    q.run(_F, rank, _r(0, w))
    q.rows((_B, rank, _r(0, m - w)), (_F, rank, _r(w, m)))
    q.run(_B, rank, _r(m - w, m))
    return q.arrays()


def _looped_bfs(rank: int, pp: int, m: int, v: int):
    # ScheduleLoopedBFS._calculate_single_rank_operations: every forward of each local stage
    # in turn, then the backwards, stages and microbatches reversed.
    stages = _r(rank, pp * v)[::pp]
    q = _Seq()
    q.run(_F, np.repeat(stages, m), np.tile(_r(0, m), v))
    q.run(_B, np.repeat(stages[::-1], m), np.tile(_r(0, m)[::-1], v))
    return q.arrays()


def _warmup_ops(rank: int, v: int, per_round: int, pp: int, m: int, factor: int) -> int:
    # _get_warmup_ops
    return min((v - 1) * per_round + factor * ((pp - 1) - rank), m * v)


def _interleaved(rank: int, pp: int, m: int, v: int, zero_bubble: bool):
    # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble._calculate_single_rank_operations
    # feeding _get_1f1b_rank_ops. Op j's forward runs local chunk (j // per_round) % v; the
    # j-th backward runs the chunks in reverse; per chunk, microbatches count up, so the
    # microbatch of the j-th forward (and of the j-th backward) is
    # (j // (per_round·v))·per_round + j % per_round (m is a multiple of per_round).
    # Order: w warm-up forwards, then per op (forward j+w if any, backward j), then for zero
    # bubble the weight of backward j - rank after backward j (once j ≥ rank: rank steps of
    # plain 1F1B first), and the weights still owed at the end.
    rounds = max(1, m // pp)
    per_round = m // rounds
    w = _warmup_ops(rank, v, per_round, pp, m, 1 if zero_bubble else 2)
    total = v * m
    j = _r(0, total)
    mb = (j // (per_round * v)) * per_round + j % per_round
    chunk = (j // per_round) % v
    f_stage = chunk * pp + rank
    b_stage = (v - 1 - chunk) * pp + rank
    q = _Seq()
    q.run(_F, f_stage[:w], mb[:w])
    if not zero_bubble:
        q.rows((_F, f_stage[w:], mb[w:]), (_B, b_stage[: total - w], mb[: total - w]))
        q.run(_B, b_stage[total - w:], mb[total - w:])
        return q.arrays()
    fi = np.minimum(j + w, total - 1)  # forward j + w, where there is one
    wi = np.maximum(j - rank, 0)  # weight j - rank, once j ≥ rank
    keep = np.ones((total, 3), dtype=bool)
    keep[:, 0] = j < total - w
    keep[:, 2] = j >= rank
    q.rows((_F, f_stage[fi], mb[fi]), (_I, b_stage, mb), (_W, b_stage[wi], mb[wi]), keep=keep)
    tail = slice(max(0, total - rank), total)
    q.run(_W, b_stage[tail], mb[tail])
    return q.arrays()


def _interleaved_1f1b(rank: int, pp: int, m: int, v: int):
    return _interleaved(rank, pp, m, v, zero_bubble=False)


def _interleaved_zero_bubble(rank: int, pp: int, m: int, v: int):
    return _interleaved(rank, pp, m, v, zero_bubble=True)


def _zbv_zero_bubble(rank: int, pp: int, m: int, v: int):
    # ScheduleZBVZeroBubble._calculate_single_rank_operations: planned with n = max(2pp-1, m)
    # microbatches, then actions of microbatches ≥ m are dropped. Chunks c0 = rank and
    # c1 = 2pp-1-rank; the phases of torch's loop, with the microbatch counters worked out:
    n = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    a = 2 * (pp - rank) - 1  # warm-up forwards of c0
    k = n - pp  # iterations of the steady loop (it runs until c1's forwards reach n)
    q = _Seq()
    q.run(_F, c0, _r(0, a))
    q.rows((_F, c1, _r(0, rank)), (_F, c0, _r(a, a + rank)))
    q.rows((_F, c1, _r(rank, pp)), (_I, c1, _r(0, pp - rank)), (_W, c1, _r(0, pp - rank)))
    i = _r(0, k)
    f0 = a + rank + i  # c0's forwards stop at n
    keep = np.ones((k, 6), dtype=bool)
    keep[:, 0] = f0 < n
    b1 = pp - rank + i
    q.rows((_F, c0, f0), (_I, c0, i), (_W, c0, i), (_F, c1, pp + i), (_I, c1, b1), (_W, c1, b1), keep=keep)
    b1 = pp - rank + k
    q.rows((_I, c0, _r(k, k + rank)), (_I, c1, _r(b1, b1 + rank)))
    q.rows((_I, c0, _r(k + rank, k + pp)), (_W, c0, _r(k, k + pp - rank)))
    q.run(_W, c1, _r(b1, b1 + rank))
    q.run(_W, c0, _r(k + pp - rank, k + pp))
    kind, stage, mb = q.arrays()
    ok = mb < m
    return kind[ok], stage[ok], mb[ok]


def _dualpipev(rank: int, pp: int, m: int, v: int):
    # ScheduleDualPipeV._calculate_single_rank_operations, OVERLAP_F_B flattened to F, B.
    # Chunks s0 = rank, s1 = 2pp-1-rank. Per chunk, forwards count up, and B and I share one
    # backward counter; a W runs the oldest pending I (a FIFO queue). Phases of torch's loop:
    s0, s1 = rank, 2 * pp - 1 - rank
    c = pp - rank - 1
    q = _Seq()
    q.run(_F, s0, _r(0, 2 * c))  # warm-up
    f0 = 2 * c
    q.rows((_F, s0, _r(f0, f0 + rank + 1)), (_F, s1, _r(0, rank + 1)))
    f0, f1 = f0 + rank + 1, rank + 1
    # I s1 then its W at once (the queue holds just that one), then F s1
    q.rows((_I, s1, _r(0, c)), (_W, s1, _r(0, c)), (_F, s1, _r(f1, f1 + c)))
    b0, b1, f1 = 0, c, f1 + c
    steady = max(0, m - pp * 2 + rank + 1)  # overlap(s0, s1) then overlap(s1, s0)
    q.rows((_F, s0, _r(f0, f0 + steady)), (_B, s1, _r(b1, b1 + steady)),
           (_F, s1, _r(f1, f1 + steady)), (_B, s0, _r(b0, b0 + steady)))
    f0, b1, f1, b0 = f0 + steady, b1 + steady, f1 + steady, b0 + steady
    q.rows((_B, s1, _r(b1, b1 + c)), (_F, s1, _r(f1, f1 + c)), (_B, s0, _r(b0, b0 + c)))
    b1, f1, b0 = b1 + c, f1 + c, b0 + c
    # cool-down: rank+1 steps of (s1, s0) backwards, split into I from the middle step on
    steps = rank + 1
    ks: list[int] = []
    ss: list[int] = []
    ms: list[int] = []
    queue_s: list[int] = []
    queue_m: list[int] = []
    zb = False
    for i in range(steps):
        for stage in (s1, s0):
            if i == steps // 2 and (rank % 2 == 1) == (stage == s1):
                zb = True
            mb = b1 if stage == s1 else b0
            ks.append(_I if zb else _B)
            ss.append(stage)
            ms.append(mb)
            if zb:
                queue_s.append(stage)
                queue_m.append(mb)
            if stage == s1:
                b1 += 1
            else:
                b0 += 1
    q.run(np.array(ks, dtype=np.int64), np.array(ss, dtype=np.int64), np.array(ms, dtype=np.int64))
    # then c steps of (W of the oldest I, I s0), then the W still queued
    qs = np.array(queue_s + [s0] * c, dtype=np.int64)
    qm = np.concatenate([np.array(queue_m, dtype=np.int64), _r(b0, b0 + c)])
    q.rows((_W, qs[:c], qm[:c]), (_I, s0, _r(b0, b0 + c)))
    q.run(_W, qs[c:], qm[c:])
    return q.arrays()


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


def sends_held(schedule: str) -> str:
    """What the schedule keeps of its sends to other ranks in torch 2.13 (torch/distributed/pipelining/
    schedules.py). A send is a plain ``dist.isend`` (``_batch_p2p`` coalesces no all-send batch), whose Work
    holds its tensor until the Work goes (gloo's ``SendWork::tensor_``; NCCL's ``WorkNCCL::outputs_``, which
    ``wait()`` keeps). "all": every send's Work is kept to the end of the schedule's actions — the multi-stage
    runtime's ``send_ops``, GPipe's ``fwd_sends_to_wait`` and ``bwd_sends_to_wait`` — so each forward's output
    outlives its backward and each backward's input gradient is kept; "last_backward": 1F1B keeps the last
    backward's input gradients (its ``bwd_sends`` list, then ``send_work``) until the next backward's send
    replaces them, and each forward's output no longer than its ``fwd_cache`` does."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; allowed: {' | '.join(SCHEDULES)}")
    return "last_backward" if schedule == "1F1B" else "all"


# --------------------------------------------------------------------------- microbatches in flight


def microbatches_in_flight(schedule: str, pp_rank: int, pp: int, virtual_stages: int, microbatches: int,
                           unit_bytes=None) -> tuple[int, ...]:
    """Microbatches each local stage of ``pp_rank`` holds at the rank's activation peak (local stage order).

    Derived from the action lists above: a stage-microbatch is alive from its F until its full
    backward B, or until its W where the backward is split (I then W: torch's
    ``stage_backward_input`` keeps the autograd graph until the weight gradient); an overlapped
    DualPipeV F+B pair runs the F first (the generator already flattened it so). Of the states
    after each F, the peak is the non-dominated one maximising Σ count × ``unit_bytes`` (one
    entry per local stage, the bytes one microbatch costs there; all 1 when omitted). Closed
    forms where the order makes them obvious: pp = 1 → 1 (gradient accumulation, one at a time),
    GPipe and LoopedBFS m on every local stage, 1F1B min(m, pp − r). Cached per
    (schedule, rank, pp, v, m): the GUI asks on every slider move.
    """
    v = virtual_stages
    if unit_bytes is None:
        unit_bytes = (1,) * (1 if pp == 1 else v)
    if pp == 1:
        return (1,) * len(unit_bytes)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; allowed: {' | '.join(SCHEDULES)}")
    if schedule in ("GPipe", "LoopedBFS"):
        return (microbatches,) * len(unit_bytes)
    if schedule == "1F1B":
        return (min(microbatches, pp - pp_rank),)
    states = in_flight_states(schedule, pp_rank, pp, v, microbatches)
    return max(states, key=lambda st: sum(n * u for n, u in zip(st, unit_bytes)))


@lru_cache(maxsize=4096)
def in_flight_states(schedule: str, pp_rank: int, pp: int, virtual_stages: int,
                     microbatches: int) -> tuple[tuple[int, ...], ...]:
    """Live microbatches per local stage after each forward of ``pp_rank``, non-dominated states only
    (only these can be a weighted peak), sorted. See :func:`microbatches_in_flight`."""
    return _plan_in_flight_states(schedule, pp, virtual_stages, microbatches)[pp_rank]


@lru_cache(maxsize=1024)
def _plan_in_flight_states(schedule: str, pp: int, v: int, m: int,
                           after_first_backward: bool = False) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """:func:`in_flight_states` of every rank of one plan (``after_first_backward``: only the forwards
    after the rank's first B or I, as :func:`in_flight_states_after_first_backward`)."""
    rank, held, is_f, late_f = _plan_held(schedule, pp, v, m)
    return _frontiers(rank, held, late_f if after_first_backward else is_f, pp, v, m)


@lru_cache(maxsize=16)
def _plan_held(schedule: str, pp: int, v: int, m: int):
    """One pass over a plan's action arrays: each action's rank, the microbatches each local stage holds
    after it, and which actions are forwards (all; those after the rank's first B or I). Both
    :func:`_plan_in_flight_states` of a plan read it (the planner asks for both, one after the other)."""
    plan = pipeline_actions(schedule, pp, m, v)
    a = plan.arrays
    n = len(a.kind)
    # +1 at F; −1 at a full backward B or at a W (a split backward's I frees nothing; schedules
    # without the split have no W)
    held, rank = _running_counts(plan, v, np.where(a.kind == _F, 1, np.where((a.kind == _B) | (a.kind == _W), -1, 0)))
    start = a.offsets[:-1]
    is_f = a.kind == _F
    first_bwd = np.minimum.reduceat(np.where((a.kind == _B) | (a.kind == _I), np.arange(n), n), start)
    late_f = is_f & (np.arange(n) > first_bwd[rank])
    return rank, held, is_f, late_f


def _running_counts(plan: PipelinePlan, v: int, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each action's rank, and per local stage of that rank (its column: the stage's place among the rank's
    stages) the running sum of ``delta`` over the rank's actions up to and including it: [actions, v]."""
    a = plan.arrays
    n = len(a.kind)
    position = np.zeros(plan.num_stages, dtype=np.int64)
    for r in range(plan.pp):
        position[plan.stages_of_rank(r)] = np.arange(v)
    onehot = np.zeros((n, v), dtype=np.int64)
    onehot[np.arange(n), position[a.stage]] = delta
    held = np.cumsum(onehot, axis=0)
    rank = np.repeat(np.arange(plan.pp), np.diff(a.offsets))
    start = a.offsets[:-1]
    before = np.where(start[:, None] > 0, held[np.maximum(start - 1, 0)], 0)  # the sum before each rank's first action
    return held - before[rank], rank


def _frontiers(rank: np.ndarray, held: np.ndarray, chosen: np.ndarray, pp: int, v: int,
               m: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the non-dominated states ``held`` after the ``chosen`` actions, sorted."""
    # distinct (rank, state) pairs, sorted by rank then state: as one integer key each where that fits
    base = m + 1
    if pp * base**v < 2**62:
        weights = base ** np.arange(v, dtype=np.int64)
        keys = np.unique(rank[chosen] * base**v + held[chosen] @ weights)
        owner = keys // base**v
        states = (keys % base**v)[:, None] // weights % base
    else:
        rows = np.unique(np.column_stack([rank[chosen], held[chosen]]), axis=0)
        owner, states = rows[:, 0], rows[:, 1:]
    bounds = np.searchsorted(owner, np.arange(pp + 1))
    if v == 1:  # one local stage: its largest count
        return tuple(((int(states[hi - 1, 0]),),) if hi > lo else () for lo, hi in zip(bounds[:-1], bounds[1:]))
    out = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        u = states[lo:hi]
        if hi - lo > 1:
            # u[j] dominates u[i]: every column ≥ (the rows are distinct, so one is strictly greater)
            dominated = ((u[None, :, :] >= u[:, None, :]).all(axis=2) & ~np.eye(len(u), dtype=bool)).any(axis=1)
            u = u[~dominated]
        out.append(tuple(sorted(map(tuple, u.tolist()))))
    return tuple(out)


@lru_cache(maxsize=512)
def split_backward_in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, per local stage: the most microbatches between their I and their W at once (what a split
    backward keeps of each from I to W, ``engine.memory.lifetimes.Moments.iw``: made by each I, freed
    after its W); all 0 where the schedule has no split backward."""
    plan = pipeline_actions(schedule, pp, m, v)
    a = plan.arrays
    if not (a.kind == _I).any():
        return ((0,) * v,) * pp
    # an I's microbatch is kept from the next action on, until its W's own moment: the most at once is the
    # running count's maximum after an I
    counts, _ = _running_counts(plan, v, np.where(a.kind == _I, 1, np.where(a.kind == _W, -1, 0)))
    most = np.maximum.reduceat(counts, a.offsets[:-1], axis=0)
    return tuple(map(tuple, np.maximum(most, 0).tolist()))


def in_flight_states_after_first_backward(schedule: str, pp_rank: int, pp: int, virtual_stages: int,
                                          microbatches: int) -> tuple[tuple[int, ...], ...]:
    """Live microbatches per local stage after each forward of ``pp_rank`` that runs after the rank's
    first backward (B or I), non-dominated states only; empty where none does (GPipe, LoopedBFS,
    m = 1). What lives from the first backward on (``engine.memory.lifetimes``' after_first_backward:
    FSDP2's unsharded gradients) is alive beside each of them; pp = 1: the next microbatch's forward."""
    if pp == 1:
        return ((1,),) if microbatches > 1 else ()
    return _plan_in_flight_states(schedule, pp, virtual_stages, microbatches, True)[pp_rank]


def _frontier(states) -> tuple[tuple[int, ...], ...]:
    """The states no other state dominates, sorted."""
    kept: list[tuple[int, ...]] = []
    for a in sorted(states, key=sum, reverse=True):  # a dominator always has a larger sum
        if not any(all(x >= y for x, y in zip(b, a)) for b in kept):
            kept.append(a)
    return tuple(sorted(kept))
