"""Invariants of the MoE engine over random valid mixtures of experts (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import MEMORY_CATEGORIES, Config, ConfigError
from engine.model.params import param_counts, params_per_rank
from engine.predict import predict

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def moe_configs(draw):
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([2, 4, 8]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if experts % e == 0 and (dp * tp) % e == 0]))
    zero = draw(st.sampled_from([z for z in (0, 1, 2, 3) if not (ep > 1 and z == 1)]))
    layers = draw(st.integers(min_value=2 * pp, max_value=2 * pp + 3))
    return {
        "model": {"layers": layers, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 96, "vocab": 128,
                  "seq_len": 32, "experts": experts,
                  "experts_per_token": draw(st.integers(min_value=1, max_value=experts)),
                  "expert_ffn_hidden": draw(st.sampled_from([32, 48])),
                  "shared_experts": draw(st.sampled_from([0, 1])),
                  "dense_layers": draw(st.integers(min_value=0, max_value=layers - 1)),
                  "router_bias": draw(st.booleans()), "bias": draw(st.booleans())},
        "cluster": {"gpu": "h100-sxm", "gpus": dp * tp * pp},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "zero": zero, "microbatches": 2 * pp,
                     "sequence_parallel": tp > 1},
        "training": {"precision": "bf16-mixed"},
        "conventions": {"moe_imbalance": draw(st.sampled_from([1.0, 1.5]))},
    }


@SETTINGS
@given(moe_configs())
def test_every_rank_sums_its_categories_and_holds_its_experts(raw):
    try:
        cfg = Config.from_dict(raw)
    except ConfigError:
        assume(False)
    pred = predict(cfg)
    counts = param_counts(cfg.model)
    assert counts.active <= counts.total
    for r in pred.memory.per_rank:
        assert r.total == sum(getattr(r, c) for c in MEMORY_CATEGORIES) and r.total > 0
    par = cfg.parallel
    for row in params_per_rank(cfg):
        rp = row[0]
        moe_blocks = sum(st.moe_layers for st in rp.stages)
        per_expert = counts.layer.experts // cfg.model.experts
        if par.ep > 1:
            assert rp.experts == moe_blocks * (cfg.model.experts // par.ep) * per_expert
        assert sum(sum(a * b for a, b in u) * n for u, n in rp.unit_groups) == rp.total
    assert pred.step.seconds > 0 and 0 < pred.step.mfu < 1
    assert sum(pred.step.breakdown.values()) == pred.step.seconds or \
        abs(sum(pred.step.breakdown.values()) - pred.step.seconds) < 1e-9 * pred.step.seconds


@SETTINGS
@given(moe_configs())
def test_more_imbalance_never_costs_less(raw):
    try:
        cfg = Config.from_dict(raw)
    except ConfigError:
        assume(False)
    assume(cfg.parallel.ep > 1)
    worse = cfg.replace(conventions={"moe_imbalance": min(float(cfg.model.experts), 2 * cfg.conventions.moe_imbalance)})
    a, b = predict(cfg), predict(worse)
    assert b.step.seconds >= a.step.seconds * (1 - 1e-12)  # (float sums in another order)
    # each category at its own worst moment (the snapshot at the peak is another moment's once the peak moves: more
    # imbalance can move a ZeRO-2 rank's peak from a B, where its activations are, to an F with fewer)
    assert all(y.category_peaks()["activations"] >= x.category_peaks()["activations"] and y.allocated >= x.allocated
               for x, y in zip(a.memory.per_rank, b.memory.per_rank))
