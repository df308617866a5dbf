"""Integration: every pipeline schedule runs, times each F/B/I/W action, and executes the
planned order; 3-D PP×DP×TP on 8 ranks."""

from __future__ import annotations

import pytest

from engine.names import SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from engine.pipeline.layout import placement_style, stages_of_pp_rank

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")

from test_backend_strategies import FULL, NORM_PARAMS, col, exact, run_ok  # noqa: E402

KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


class _StandIn:
    """Just what a schedule reads from a stage to plan its order (no process group)."""

    def __init__(self, index, num_stages, pp, mapping):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
        self.submod = torch.nn.Linear(1, 1)
        self.stage_index_to_group_rank = mapping
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def planned_order(schedule: str, pp: int, v: int, m: int) -> dict[int, list[tuple]]:
    from torch.distributed.pipelining.schedules import get_schedule_class

    n = pp * v
    held = stages_of_pp_rank(n, pp, placement_style(schedule))
    mapping = {s: r for r, ss in enumerate(held) for s in ss}
    sched = get_schedule_class(schedule)([_StandIn(s, n, pp, mapping) for s in held[0]], n_microbatches=m,
                                         loss_fn=lambda a, b: a)
    out = {}
    for r, acts in sched.pipeline_order.items():
        flat = []
        for a in acts:
            for x in (getattr(a, "sub_actions", None) or [a]) if a is not None else []:
                kind = KIND.get(x.computation_type.name)
                if kind:
                    flat.append((kind, x.stage_index, x.microbatch_index))
        out[r] = flat
    return out


SETUPS = {
    "GPipe": (1, 2), "LoopedBFS": (2, 2), "Interleaved1F1B": (2, 4), "InterleavedZeroBubble": (2, 4),
    "ZBVZeroBubble": (2, 4), "DualPipeV": (2, 4),
}


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "1F1B"])  # 1F1B: the 3-D test
def test_schedule_runs_timed_in_planned_order(tmp_path, schedule):
    v, m = SETUPS[schedule]
    _, meas, _ = run_ok(tmp_path, steps=2, cluster={"gpus": 2},
                        parallel={"dp": 1, "tp": 1, "pp": 2, "schedule": schedule, "virtual_stages": v,
                                  "microbatches": m})
    assert sum(col(meas, "params")) == 4 * FULL
    held = stages_of_pp_rank(2 * v, 2, placement_style(schedule))
    assert [r.stage for r in meas.memory.per_rank] == [h[0] for h in held]
    plan = planned_order(schedule, 2, v, m) if schedule not in ("GPipe",) else None
    for r, prow in enumerate(meas.pipeline.per_rank):
        acts = prow.actions
        kinds = {a[0] for a in acts}
        if schedule in SPLIT_BACKWARD_SCHEDULES:  # DualPipeV also runs some full backwards
            assert {"F", "I", "W"} <= kinds <= {"F", "B", "I", "W"}
        else:
            assert kinds == {"F", "B"}
        assert sum(a[0] == "F" for a in acts) == m * v
        for _kind, stage, mb, start, end in acts:
            assert stage in held[r] and 0 <= mb < m and 0 <= start <= end
        starts = [a[3] for a in acts]
        assert starts == sorted(starts)
        if plan is not None:
            assert [tuple(a[:3]) for a in acts] == plan[r], f"rank {r}"


def test_three_d_pp_dp_tp_on_eight_ranks(tmp_path):
    _, meas, _ = run_ok(tmp_path, steps=2, timeout_s=240, cluster={"gpus": 8},
                        parallel={"dp": 2, "tp": 2, "pp": 2, "zero": 0, "schedule": "1F1B", "microbatches": 2})
    # ranks 0-3 hold stage 0 and ranks 4-7 stage 1; each stage's params split over tp = 2
    assert [r.stage for r in meas.memory.per_rank] == [0] * 4 + [1] * 4
    params = col(meas, "params")
    assert params[0] + params[1] + params[4] + params[5] == 4 * (FULL + NORM_PARAMS)
    assert params[0:2] == params[2:4]  # dp replicas hold the same
    for prow in meas.pipeline.per_rank:
        assert [a[0] for a in prow.actions].count("F") == 2


def test_ddp_stages_run_two_backwards_in_a_row(tmp_path):
    """DDP under GPipe (and 1F1B with microbatches = pp): the stage's backwards follow each other with no
    forward between them. The shape-inference forward used to arm DDP's reducer, so the first step
    recorded every parameter twice and the second step's forward failed torch's bucket-rebuild assertion."""
    _, meas, _ = run_ok(tmp_path, steps=2, cluster={"gpus": 4},
                        parallel={"dp": 2, "tp": 1, "pp": 2, "zero": 0, "schedule": "GPipe", "microbatches": 2})
    assert exact(meas, "grads") == col(meas, "params")  # fp32 DDP: a full gradient beside each parameter
    assert meas.step.losses[1] < meas.step.losses[0]
    # what the tracker saw that predates it: DDP's bucket (the Reducer writes each gradient into it, first
    # seen in the backward) and those of the stage's p2p receive buffers an op's output views; out of its
    # categories, counted once, at their exact sizes, in comm_buffers
    for r, row in zip(sorted(meas.ranks, key=lambda r: r["rank"]), meas.memory.per_rank):
        pre = r["memory"]["pre_existing"]
        assert max(pre.values()) == r["memory"]["exact"]["grads"]  # one bucket: every gradient, fp32
        assert sum(pre.values()) <= row.comm_buffers
        assert r["memory"]["tracker_peak"]["Temp"] < r["memory"]["exact"]["grads"]
