"""The planner over layouts with expert parallelism: its bounds hold for the engine's own numbers,
pruning finds what the exhaustive search finds, the layouts carry ep."""

from __future__ import annotations

import pytest

from engine.config import ModelSpec
from engine.memory import memory_per_rank
from engine.model.presets import model_presets
from engine.plan.moe import moe_candidates, moe_layout_config
from engine.plan.results import layout_config
from engine.plan.search import _base_config, plan
from engine.time.step import step_time

# large experts on a small model: sharding them by ep beats gathering them with FSDP
SMALL = ModelSpec(**{**model_presets()["tiny"], "experts": 64, "experts_per_token": 2, "expert_ffn_hidden": 2048,
                     "dense_layers": 1, "seq_len": 1024, "hidden": 1024, "ffn_hidden": 2048, "vocab": 4096})


@pytest.mark.parametrize("clock", ["efficiency", "ops"])
def test_bounds_hold_for_every_layout_of_a_small_grid(clock):
    """Under either clock (the clock from ops times the experts' grouped GEMMs at one expert's size, the
    router and the dispatch: none runs faster than the bound's rate)."""
    base = _base_config(SMALL, 16, "h100-sxm", 8, None, {"clock": clock})
    cands, counts = moe_candidates(base, 32, (0, 1, 2, 3), ("none", "selective", "full"), None)
    assert counts["enumerated"] == len(cands) > 50
    assert {c[2]["ep"] for c in cands} >= {1, 2, 4, 8, 16}
    for step_lb, mem_lb, lay in cands[::9]:
        cfg = moe_layout_config(base, lay)
        assert cfg.conventions.clock == clock
        assert mem_lb <= memory_per_rank(cfg).peak.total, lay
        assert step_lb <= step_time(cfg).seconds, lay


@pytest.mark.parametrize("clock", ["efficiency", "ops"])
def test_pruning_finds_what_the_exhaustive_search_finds(clock):
    grid = {"zero": (2, 3), "recompute": ("none", "full"), "micro_batch_sizes": (1,), "conventions": {"clock": clock}}
    fast = plan(SMALL, 16, "h100-sxm", top=5, global_batch=32, **grid)
    full = plan(SMALL, 16, "h100-sxm", top=5, global_batch=32, exhaustive=True, **grid)
    assert [(e.label(), e.seconds) for e in fast.entries] == [(e.label(), e.seconds) for e in full.entries]
    assert fast.counts.fully_evaluated < full.counts.fully_evaluated


def test_layouts_carry_ep_and_round_trip():
    result = plan(SMALL, 16, "h100-sxm", top=10, global_batch=32)
    assert result.entries
    assert any(e.config.parallel.ep > 1 for e in result.entries)
    for e in result.entries:
        assert layout_config(result.base, e.layout) == e.config
        if e.config.parallel.ep > 1:
            assert f"ep{e.config.parallel.ep}" in e.label()
    assert any("ep searched" in n for n in result.notes)


def test_all_fitting_is_refused_for_moe_by_name():
    from engine.plan.results import PlanError

    with pytest.raises(PlanError, match="all_fitting"):
        plan(SMALL, 16, "h100-sxm", all_fitting=True)
