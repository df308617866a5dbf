"""A measured per-expert load (``conventions.moe_expert_load``): each EP rank computes the routed
copies of its own experts, so EP ranks hold different activations. Hand-worked on the tiny preset
with 4 experts of top-2 over ep 2 (rank r owns experts 2r, 2r+1)."""

from __future__ import annotations

import pytest

from engine import Config
from engine.config import ConfigError
from engine.memory import memory_per_rank
from engine.memory.conventions import conventions_of
from engine.model.routing import ep_rank_loads, routed_factor
from engine.predict import predict

TINY_MOE = {"preset": "tiny", "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 96, "dense_layers": 2}
LOAD = [0.4, 0.3, 0.2, 0.1]


def cfg(parallel=None, conventions=None, gpus=4, model=None) -> Config:
    raw = {"model": {**TINY_MOE, **(model or {})}, "cluster": {"gpu": "cpu", "gpus": gpus},
           "parallel": parallel or {"ep": 2, "dp": 4}}
    if conventions:
        raw["conventions"] = conventions
    return Config.from_dict(raw)


def term(report, rank: int, category: str, kind: str):
    """A rank's terms of ``kind``, each at its largest (alive at the peak or not: where the gradients
    made in the first backward outweigh a light ep-rank's activations, its peak is the end of the
    backward, which holds no block's)."""
    return [t for t in report.per_rank[rank].catalogue(category) if t.kind == kind]


def test_each_ep_rank_routes_the_copies_of_its_experts_by_hand():
    c = cfg(conventions={"moe_expert_load": LOAD})
    assert ep_rank_loads(c) == pytest.approx((0.7, 0.3))
    assert routed_factor(c, 0) == pytest.approx(1.4) and routed_factor(c, 1) == pytest.approx(0.6)
    assert routed_factor(c) == pytest.approx(1.4)  # the busiest rank's, for the all-to-all time
    base = memory_per_rank(cfg())
    mem = memory_per_rank(c)
    n, k, h, f, act = 64, 2, 128, 96, 2  # s·b tokens, top-k, hidden, expert ffn, bf16
    # the dispatched token, its SwiGLU internals, its permutation index and the expert output index_copy keeps
    per_copy = 2 * act * h + 4 * act * f + 8 + act * h  # autocast: w1's and w3's own casts of each copy
    # the ep group's 2·n·k = 256 routed copies: rank 0 gets 0.7 of them (180 after rounding up
    # 179.2), rank 1 0.3 (77 from 76.8); balanced is n·k = 128 each
    routed = {0: 180, 1: 77}
    (bal,) = term(base, 0, "activations", "moe_layers")
    for rank in range(4):  # dp 4 over ep 2: ranks 0, 2 are ep-rank 0; 1, 3 are ep-rank 1
        (got,) = term(mem, rank, "activations", "moe_layers")
        assert got.bytes - bal.bytes == 6 * (routed[rank % 2] - n * k) * per_copy  # 6 MoE blocks
        recv = term(mem, rank, "comm_buffers", "moe_all_to_all")
        assert [t.bytes for t in recv] == [act * n * k * h, act * routed[rank % 2] * h]
    # only the routed tokens differ: states are the same on both ep ranks
    assert mem.per_rank[0].params == mem.per_rank[1].params == base.per_rank[0].params
    acts = [sum(t.bytes for t in r.catalogue("activations")) for r in (mem.per_rank[0], base.per_rank[0], mem.per_rank[1])]
    assert acts[0] > acts[1] > acts[2]


def test_a_balanced_load_predicts_what_no_load_does():
    balanced = cfg(conventions={"moe_expert_load": [0.25] * 4})
    plain = cfg()
    a, b = predict(balanced), predict(plain)
    assert [r.total for r in a.memory.per_rank] == [r.total for r in b.memory.per_rank]
    assert [r.activations for r in a.memory.per_rank] == [r.activations for r in b.memory.per_rank]
    assert a.step.seconds == b.step.seconds


def test_without_ep_every_expert_is_local():
    c = cfg({"dp": 4}, conventions={"moe_expert_load": LOAD})
    assert [r.total for r in memory_per_rank(c).per_rank] == [r.total for r in memory_per_rank(cfg({"dp": 4})).per_rank]


def test_the_busiest_rank_times_the_all_to_all():
    skewed = predict(cfg(conventions={"moe_expert_load": LOAD}))
    same = predict(cfg(conventions={"moe_imbalance": 1.4}))
    assert skewed.step.seconds == pytest.approx(same.step.seconds)


def test_with_tp_and_pp_the_ep_rank_is_the_rank_mod_ep():
    c = cfg({"ep": 2, "tp": 2, "dp": 2}, conventions={"moe_expert_load": LOAD})
    mem = memory_per_rank(c)
    # every activation term of the rank at its largest (the catalogue): on this tiny model the peak is
    # the end of the backward, when no activation is alive
    acts = [sum(t.bytes for t in r.catalogue("activations")) for r in mem.per_rank]
    assert acts[0] == acts[2] and acts[1] == acts[3] and acts[0] > acts[1]
    c = cfg({"ep": 2, "pp": 2, "dp": 2, "microbatches": 2}, conventions={"moe_expert_load": LOAD})
    acts = [r.activations for r in memory_per_rank(c).per_rank]
    assert acts[0] > acts[1] and acts[2] > acts[3]


def test_the_load_is_stated_beside_the_numbers_and_round_trips(tmp_path):
    c = cfg(conventions={"moe_expert_load": LOAD})
    assert "measured per-expert load" in conventions_of(c)["moe_load"] and "0.700" in conventions_of(c)["moe_load"]
    path = c.save(tmp_path / "job.toml")
    assert Config.load(path) == c
    assert "moe_expert_load" not in cfg().dumps_toml()


@pytest.mark.parametrize("load, conventions, message", [
    ([0.5, 0.5], {}, "one fraction per expert"),
    ([0.5, 0.5, 0.5, -0.5], {}, "≥ 0"),
    ([0.4, 0.3, 0.2, 0.2], {}, "sum to 1"),
    ("0.25", {}, "list of numbers"),
    ([0.25, 0.25, 0.25, True], {}, "list of numbers"),
    (LOAD, {"moe_imbalance": 1.5}, "moe_imbalance = 1"),
    (LOAD, {"moe_capacity_factor": 1.25}, "moe_capacity_factor = 0"),
])
def test_a_bad_load_is_refused_naming_the_field(load, conventions, message):
    with pytest.raises(ConfigError) as err:
        cfg(conventions={"moe_expert_load": load, **conventions})
    assert "conventions.moe_expert_load" in str(err.value) and message in str(err.value)


def test_a_dense_model_refuses_a_load():
    with pytest.raises(ConfigError, match="conventions.moe_expert_load"):
        Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 1},
                          "conventions": {"moe_expert_load": [1.0]}})


def test_the_planner_bounds_hold_under_a_skewed_load():
    from dataclasses import replace

    from engine.plan.moe import moe_candidates, moe_layout_config
    from engine.plan.search import _base_config
    from engine.time.step import step_time
    from tests.engine.plan.test_moe_planner import SMALL

    base = _base_config(SMALL, 16, "h100-sxm", 8, None, None)
    load = [2.0 / 96] * 32 + [1.0 / 96] * 32  # the first half of the experts gets twice the tokens
    base = replace(base, conventions=replace(base.conventions, moe_expert_load=tuple(load)))
    cands, _ = moe_candidates(base, 32, (0, 2, 3), ("none", "full"), None)
    assert {c[2]["ep"] for c in cands} >= {2, 4, 8}
    for step_lb, mem_lb, lay in cands[::7]:
        cfg = moe_layout_config(base, lay)
        assert mem_lb <= memory_per_rank(cfg).peak.total, lay
        assert step_lb <= step_time(cfg).seconds, lay


# --------------------------------------------------------------------------- per block, per microbatch

SKEW, FLAT = [0.4, 0.3, 0.2, 0.1], [0.25] * 4  # ep-rank 0 gets 0.7 of the copies, or half


def test_a_per_block_load_averages_the_blocks_of_a_stage():
    """6 MoE blocks: three at the skewed load, three balanced — the mean of the two whole-model loads."""
    blocks = cfg(conventions={"moe_expert_load": [SKEW] * 3 + [FLAT] * 3})
    skew, flat = cfg(conventions={"moe_expert_load": SKEW}), cfg()
    for rank in (0, 1):
        (b,) = term(memory_per_rank(blocks), rank, "activations", "moe_layers")
        (s,) = term(memory_per_rank(skew), rank, "activations", "moe_layers")
        (f,) = term(memory_per_rank(flat), rank, "activations", "moe_layers")
        assert abs(b.bytes - (s.bytes + f.bytes) / 2) <= 6  # one rounding per block
        assert "6 MoE blocks" in b.formula


def test_a_per_microbatch_load_follows_the_microbatch_alive_at_the_peak():
    """No pipeline, two microbatches: the peak is at the second microbatch's loss (the two hold as
    much activation, and the second's moment also holds the gradients the first backward made), so
    its load is the one the activations follow; the other microbatch's does not matter."""
    par = {"ep": 2, "dp": 4, "microbatches": 2}
    last_skewed = cfg(par, conventions={"moe_expert_load": [[FLAT] * 6, [SKEW] * 6]})
    first_skewed = cfg(par, conventions={"moe_expert_load": [[SKEW] * 6, [FLAT] * 6]})
    skew, flat = cfg(par, conventions={"moe_expert_load": SKEW}), cfg(par)
    for rank in (0, 1):
        act = lambda c, rank=rank: memory_per_rank(c).per_rank[rank].activations  # noqa: E731
        assert act(last_skewed) == act(skew)
        assert act(first_skewed) == act(flat)
        assert "microbatch 1" in memory_per_rank(skew).per_rank[rank].peak_moment


@pytest.mark.parametrize("load, message", [
    ([[0.25] * 4] * 5, "one list per MoE block"),
    ([[[0.25] * 4] * 6] * 3, "one entry per microbatch"),
    ([[0.25] * 4] * 5 + [[0.5, 0.5, 0.5, 0.5]], "sum to 1"),
    ([[0.25] * 4, 0.25], "list of numbers"),
])
def test_a_bad_nested_load_is_refused_naming_the_field(load, message):
    with pytest.raises(ConfigError) as err:
        cfg({"ep": 2, "dp": 4, "microbatches": 1}, conventions={"moe_expert_load": load})
    assert "conventions.moe_expert_load" in str(err.value) and message in str(err.value)


def test_a_nested_load_round_trips(tmp_path):
    c = cfg({"ep": 2, "dp": 4, "microbatches": 2}, conventions={"moe_expert_load": [[SKEW] * 6, [FLAT] * 6]})
    assert Config.load(c.save(tmp_path / "job.toml")) == c
