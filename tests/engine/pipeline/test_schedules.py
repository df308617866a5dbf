"""Pipeline schedules as data: the order must equal what torch.distributed.pipelining runs.

torch is imported here (tests may), never in engine/. How torch's order is obtained without a
process group:

* GPipe and 1F1B (``PipelineScheduleSingle``) execute a hard-coded loop in
  ``_step_microbatches``, not their ``pipeline_order``. We *run* that loop with a recording
  stand-in stage (no tensors, no p2p: every ``get_*_ops`` returns no ops) and compare against
  the forward/backward calls it makes.

  Quirk of torch 2.13: ``Schedule1F1B.pipeline_order`` (from ``_get_pipeline_order``) numbers
  the last rank's forwards from 1 (its warm-up is empty, so ``forward_mb`` starts at 0 and is
  incremented *before* the first steady-state forward) and never plans forward 0 there, while
  the executed loop starts at 0. ``test_1f1b_pipeline_order_quirk`` pins that down so we notice
  when torch fixes it.

* The multi-stage schedules execute ``pipeline_order_with_comms``; we read its compute
  actions (flattening ``OVERLAP_F_B`` sub-actions, dropping None and comm/reduce actions) and
  also check that the lowering kept ``pipeline_order``'s compute order.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from schedules_reference import REFERENCE_GENERATORS

from engine import Config, ConfigError
from engine.names import SCHEDULES, SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES
from engine.pipeline.layout import stage_to_pp_rank
from engine.pipeline.schedules import (
    Action,
    PipelinePlan,
    _pipeline_actions,
    pipeline_actions,
    schedule_problems,
    single_rank_plan,
)

try:
    from torch.distributed.pipelining import schedules as torch_schedules
except ImportError:  # the torch comparisons skip; the reference comparison below still runs
    torch_schedules = None
needs_torch = pytest.mark.skipif(torch_schedules is None, reason="torch is not installed")
_COMPUTE = {"F", "B", "I", "W"}


# --------------------------------------------------------------------------- torch side


def _stand_in(stage_index: int, num_stages: int, pp: int, rank: int):
    return types.SimpleNamespace(
        stage_index=stage_index, num_stages=num_stages, group_size=pp, group_rank=rank, submod=None,
        stage_index_to_group_rank={}, is_first=stage_index == 0, is_last=stage_index == num_stages - 1)


class _RecordingStage:
    """Enough of a _PipelineStageBase for PipelineScheduleSingle._step_microbatches to run."""

    def __init__(self, stage_index: int, num_stages: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.calls: list[Action] = []

    def get_fwd_recv_ops(self, i): return []
    def get_fwd_send_ops(self, i): return []
    def get_bwd_recv_ops(self, i): return []
    def get_bwd_send_ops(self, i): return []
    def perform_reduce_grad(self, *a, **k): pass

    def forward_one_chunk(self, i, *args, **kwargs):
        self.calls.append(Action("F", self.stage_index, i))

    def backward_one_chunk(self, i, *args, **kwargs):
        self.calls.append(Action("B", self.stage_index, i))


def _torch_executed_single(name: str, pp: int, m: int) -> list[list[Action]]:
    cls = torch_schedules.get_schedule_class(name)
    out = []
    for rank in range(pp):
        stage = _RecordingStage(rank, pp)
        sched = cls(stage, m)
        sched._stage_forward_initialized = True  # skip shape inference: nothing to infer
        sched._step_microbatches()
        out.append(stage.calls)
    return out


def _flatten(actions) -> list[Action]:
    flat = []
    for a in actions:
        if a is None:
            continue
        for x in (a.sub_actions if a.sub_actions is not None else (a,)):
            if x.computation_type.value in _COMPUTE:
                flat.append(Action(x.computation_type.value, x.stage_index, x.microbatch_index))
    return flat


def _torch_multi(name: str, pp: int, m: int, v: int):
    cls = torch_schedules.get_schedule_class(name)
    ns = pp * v
    owners = stage_to_pp_rank(ns, pp, "v" if name in V_SCHEDULES else "loop")
    stages = [_stand_in(s, ns, pp, 0) for s in range(ns) if owners[s] == 0]
    return cls(stages, m)


def _torch_executed_multi(name: str, pp: int, m: int, v: int) -> list[list[Action]]:
    sched = _torch_multi(name, pp, m, v)
    executed = [_flatten(sched.pipeline_order_with_comms[r]) for r in range(pp)]
    planned = [_flatten(sched.pipeline_order[r]) for r in range(pp)]
    assert executed == planned, "torch's lowering reordered compute actions"
    return executed


# --------------------------------------------------------------------------- the grid

MICROBATCHES = (1, 2, 3, 4, 5, 6, 8, 9, 12)


def _grid():
    for name in SCHEDULES:
        for pp in (2, 3, 4):
            vs = (1,) if name in SINGLE_STAGE_SCHEDULES else (2,) if name in V_SCHEDULES else (1, 2, 3)
            for v in vs:
                for m in MICROBATCHES:
                    if not schedule_problems(name, pp, m, v):
                        yield name, pp, m, v


GRID = list(_grid())


@needs_torch
@pytest.mark.parametrize("name", SCHEDULES)
def test_order_equals_what_torch_runs(name):
    combos = [g for g in GRID if g[0] == name]
    assert len(combos) >= 8
    for _, pp, m, v in combos:
        plan = pipeline_actions(name, pp, m, v)
        if name in SINGLE_STAGE_SCHEDULES:
            expected = _torch_executed_single(name, pp, m)
        else:
            expected = _torch_executed_multi(name, pp, m, v)
        got = [list(acts) for acts in plan.per_rank]
        assert got == expected, f"{name} pp={pp} m={m} v={v}"
        assert list(plan.stage_to_rank) == stage_to_pp_rank(pp * v, pp, "v" if name in V_SCHEDULES else "loop")


@needs_torch
def test_1f1b_pipeline_order_quirk():
    """torch 2.13: Schedule1F1B's planned order numbers the last rank's forwards from 1."""
    pp, m = 3, 4
    sched = torch_schedules.Schedule1F1B(_stand_in(pp - 1, pp, pp, pp - 1), m)
    planned_last = [a for a in _flatten(sched.pipeline_order[pp - 1]) if a.kind == "F"]
    executed_last = [a for a in _torch_executed_single("1F1B", pp, m)[pp - 1] if a.kind == "F"]
    assert [a.microbatch for a in executed_last] == [0, 1, 2, 3]
    if [a.microbatch for a in planned_last] == [0, 1, 2, 3]:
        pytest.fail("torch fixed Schedule1F1B.pipeline_order; the quirk note can go")
    assert planned_last[0].microbatch == 1
    # we follow what runs
    assert [a.microbatch for a in pipeline_actions("1F1B", pp, m, 1).per_rank[pp - 1] if a.kind == "F"] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- the reference port

# The generators in engine/pipeline/schedules.py are closed forms (numpy ranges per phase) of torch's
# loops. tests/schedules_reference.py keeps the literal step-by-step ports they replaced; the
# torch test above covers a small grid, this one a wide one (no torch needed), so a closed form
# cannot drift from the loop it summarises on sizes torch's grid does not reach.

def _wide_grid():
    for name in SCHEDULES:
        vs = (1,) if name in SINGLE_STAGE_SCHEDULES else (2,) if name in V_SCHEDULES else (1, 2, 3, 4)
        for pp in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16):
            for v in vs:
                for m in (*range(1, 27), 31, 32, 33, 40, 48, 63, 64, 65, 96, 100):
                    if not schedule_problems(name, pp, m, v):
                        yield name, pp, m, v


@pytest.mark.parametrize("name", SCHEDULES)
def test_closed_forms_equal_the_reference_port(name):
    combos = [g for g in _wide_grid() if g[0] == name]
    assert len(combos) > 100
    ref = REFERENCE_GENERATORS[name]
    for _, pp, m, v in combos:
        plan = _pipeline_actions.__wrapped__(name, pp, m, v)  # uncached: a fresh generation
        expected = tuple(tuple(ref(rank, pp, m, v)) for rank in range(pp))
        assert plan.per_rank == expected, f"{name} pp={pp} m={m} v={v}"


def test_arrays_and_actions_are_the_same_plan():
    plan = pipeline_actions("ZBVZeroBubble", 3, 7, 2)
    offsets, kind, stage, mb = plan.arrays
    assert offsets.tolist() == [0, *np.cumsum([len(a) for a in plan.per_rank]).tolist()]
    flat = [a for acts in plan.per_rank for a in acts]
    assert [("F", "B", "I", "W")[k] for k in kind.tolist()] == [a.kind for a in flat]
    assert stage.tolist() == [a.stage for a in flat] and mb.tolist() == [a.microbatch for a in flat]
    assert plan.num_actions == len(flat) and plan.splits_backward
    # and the other way round: a plan given as actions gets the same arrays
    again = PipelinePlan("x", plan.pp, plan.num_stages, plan.microbatches, plan.stage_to_rank, plan.per_rank)
    assert all(np.array_equal(a, b) for a, b in zip(again.arrays, plan.arrays))
    with pytest.raises(ValueError, match="kind"):
        _ = PipelinePlan("x", 1, 1, 1, (0,), ((Action("X", 0, 0),),)).arrays
    with pytest.raises(AttributeError):
        plan.pp = 4
    with pytest.raises(ValueError):
        kind[0] = 1  # read-only: a cached plan cannot be changed by a caller


# --------------------------------------------------------------------------- rejections


def _cfg(schedule: str, pp: int, m: int, v: int) -> Config:
    return Config.from_dict({
        "model": {"preset": "tiny", "layers": 24},
        "cluster": {"preset": "local-cpu", "gpus": pp},
        "parallel": {"dp": 1, "tp": 1, "pp": pp, "schedule": schedule, "virtual_stages": v, "microbatches": m},
    })


def _torch_accepts(name: str, pp: int, m: int, v: int) -> bool:
    try:
        if name in SINGLE_STAGE_SCHEDULES:
            if v != 1:
                return False  # one stage per rank by construction
            torch_schedules.get_schedule_class(name)(_RecordingStage(0, pp), m)
        else:
            _torch_multi(name, pp, m, v)
    except (ValueError, RuntimeError, AssertionError):
        return False
    return True


@needs_torch
def test_config_rejects_exactly_what_torch_rejects():
    checked_rejects = 0
    for name in SCHEDULES:
        for pp in (2, 3, 4):
            for v in (1, 2, 3):
                for m in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11):
                    accepted = _torch_accepts(name, pp, m, v)
                    assert accepted == (not schedule_problems(name, pp, m, v)), (name, pp, m, v)
                    if accepted:
                        _cfg(name, pp, m, v)  # must construct
                        continue
                    checked_rejects += 1
                    with pytest.raises(ConfigError) as err:
                        _cfg(name, pp, m, v)
                    assert err.value.fields() & {"parallel.microbatches", "parallel.virtual_stages"}
                    with pytest.raises(ValueError):
                        pipeline_actions(name, pp, m, v)
    assert checked_rejects > 50


def test_dualpipev_rejection_message_is_clear():
    with pytest.raises(ConfigError) as err:
        _cfg("DualPipeV", 2, 3, 2)
    assert "parallel.microbatches" in err.value.fields()
    assert "number of stages" in str(err.value)


# --------------------------------------------------------------------------- plan invariants


@pytest.mark.parametrize("name,pp,m,v", [g for g in GRID if g[2] in (4, 8)])
def test_every_stage_and_microbatch_done_once(name, pp, m, v):
    plan = pipeline_actions(name, pp, m, v)
    seen = {}
    for rank, acts in enumerate(plan.per_rank):
        for a in acts:
            assert plan.stage_to_rank[a.stage] == rank
            seen[a] = seen.get(a, 0) + 1
    assert all(c == 1 for c in seen.values())
    for s in range(plan.num_stages):
        for mb in range(m):
            assert Action("F", s, mb) in seen
            has_b = Action("B", s, mb) in seen
            has_iw = Action("I", s, mb) in seen and Action("W", s, mb) in seen
            assert has_b != has_iw


def test_plans_are_cached_and_immutable():
    a = pipeline_actions("Interleaved1F1B", 4, 8, 2)
    assert a is pipeline_actions("Interleaved1F1B", 4, 8, 2)
    assert isinstance(a.per_rank, tuple) and isinstance(a.per_rank[0], tuple)
    assert a.to_strings()[0][0] == "0F0"


def test_single_rank_plan_is_gradient_accumulation():
    plan = single_rank_plan("1F1B", 3)
    assert plan.to_strings() == [["0F0", "0B0", "0F1", "0B1", "0F2", "0B2"]]


def test_in_flight_after_the_first_backward():
    """The states a forward leaves after the rank's first backward (where FSDP2 already holds the
    accumulated unsharded gradients): 1F1B's steady state refills the warm-up's pp − r; a
    breadth-first schedule and a single microbatch have none; pp = 1 runs the next microbatch."""
    from engine.pipeline.schedules import in_flight_states_after_first_backward as late

    assert late("1F1B", 0, 4, 1, 8) == ((4,),)
    assert late("1F1B", 3, 4, 1, 8) == ((1,),)
    assert late("1F1B", 0, 4, 1, 4) == ()  # four warm-up forwards, then only backwards
    assert late("GPipe", 0, 4, 1, 8) == ()
    assert late("GPipe", 0, 1, 1, 8) == ((1,),) and late("1F1B", 0, 1, 1, 1) == ()
    # the same, action by action in plain Python: the non-dominated states after each forward that
    # runs after the rank's first B or I
    for sc, v in (("Interleaved1F1B", 2), ("DualPipeV", 2), ("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2)):
        for r in range(4):
            seen = set(_states_after_first_backward(sc, r, 4, v, 8))
            frontier = {a for a in seen if not any(b != a and all(x >= y for x, y in zip(b, a)) for b in seen)}
            assert late(sc, r, 4, v, 8) == tuple(sorted(frontier)), (sc, r)


def _states_after_first_backward(schedule, rank, pp, v, m):
    plan = pipeline_actions(schedule, pp, m, v)
    a = plan.arrays
    mine = list(plan.stages_of_rank(rank))
    held, backward_ran = [0] * v, False
    for i in range(int(a.offsets[rank]), int(a.offsets[rank + 1])):
        kind, at = "FBIW"[int(a.kind[i])], mine.index(int(a.stage[i]))
        if kind == "F":
            held[at] += 1
            if backward_ran:
                yield tuple(held)
        elif kind in ("B", "W"):
            held[at] -= 1
        backward_ran = backward_ran or kind in ("B", "I")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_split_backward_in_flight_is_the_most_kept_between_i_and_w(name):
    """Per rank and local stage, the most microbatches whose I has run and whose W has not (the W's own
    moment still holding its microbatch), walked action by action: what a split backward keeps from I to
    W at once (engine.memory.lifetimes' iw); 0 on every stage of a schedule without the split."""
    from engine.pipeline.schedules import split_backward_in_flight

    for pp, v, m in ((2, 2, 4), (4, 2, 8), (3, 2, 6), (4, 1, 8), (2, 3, 6), (4, 2, 5)):
        if schedule_problems(name, pp, m, v):
            continue
        plan = pipeline_actions(name, pp, m, v)
        a = plan.arrays
        got = split_backward_in_flight(name, pp, v, m)
        for r in range(pp):
            mine = list(plan.stages_of_rank(r))
            held, most = [0] * len(mine), [0] * len(mine)
            for i in range(int(a.offsets[r]), int(a.offsets[r + 1])):
                kind, at = "FBIW"[int(a.kind[i])], mine.index(int(a.stage[i]))
                most[at] = max(most[at], held[at])  # this action's moment: every I before it, its own W too
                held[at] += {"I": 1, "W": -1}.get(kind, 0)
            assert got[r] == tuple(most), (name, pp, v, m, r)
            if name not in SPLIT_BACKWARD_SCHEDULES:
                assert set(most) == {0}
