"""Reference for the plan generators: ShardScope's original step-by-step ports of torch 2.13.

These are the per-rank generators ``engine/pipeline/schedules.py`` used before it switched to the
closed-form/numpy generators (commit history: "schedules: closed-form generators"). They are a
literal, line-by-line port of torch's loops and were checked against torch by
``tests/engine/pipeline/test_schedules.py``; they stay here, unoptimised, so that the fast generators can be
compared with them over a wide (pp, microbatches, v) grid without torch installed.

Each function returns rank's compute actions in execution order; arguments (rank, pp, m, v).
"""

from __future__ import annotations

from collections import defaultdict

from engine.pipeline.schedules import Action


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


REFERENCE_GENERATORS = {
    "GPipe": _gpipe,
    "1F1B": _one_f_one_b,
    "LoopedBFS": _looped_bfs,
    "Interleaved1F1B": _interleaved_1f1b,
    "InterleavedZeroBubble": _interleaved_zero_bubble,
    "ZBVZeroBubble": _zbv_zero_bubble,
    "DualPipeV": _dualpipev,
}
