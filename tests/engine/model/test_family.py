"""The one shape family (engine.model.family): exact sizes, valid members, the slider's walk, the capacity search."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

import pytest

from engine import Config
from engine.config import ModelSpec
from engine.memory import memory_per_rank
from engine.model.family import Family, largest_fitting_model, step_of, walk
from engine.model.params import param_counts
from engine.model.presets import model_presets

# The shape family walks dense decoders (head_dim = hidden / heads); the mixture-of-experts presets
# are not members of one.
PRESETS = {name: ModelSpec(**fields, preset=name) for name, fields in model_presets().items()
           if not fields.get("experts") and not fields.get("head_size") and fields.get("attention") != "mla"}
STEP = 2 ** (1 / 3)


def first_members(base: ModelSpec, tp: int | None = None, min_layers: int = 1, max_factor: float = 64):
    return list(Family(base, tp, min_layers).members(max_params=param_counts(base).total * max_factor))


def tps_of(base: ModelSpec) -> list[int | None]:
    g = math.gcd(base.heads, base.kv_heads, base.ffn_hidden)
    return [None, *(t for t in (1, 2, 4, 8, 16) if g % t == 0)]


@pytest.mark.parametrize("name", PRESETS)
def test_member_counts_are_exact_and_strictly_increase(name):
    base = PRESETS[name]
    for tp in tps_of(base):
        members = first_members(base, tp)
        assert len(members) > 5
        for m in members:
            assert m.params == param_counts(m.spec).total
        assert all(a.params < b.params for a, b in itertools.pairwise(members)), (name, tp)


@pytest.mark.parametrize("name", PRESETS)
def test_the_base_preset_is_a_member_exactly(name):
    base = PRESETS[name]
    for tp in tps_of(base):
        assert base in [m.spec for m in first_members(base, tp)], (name, tp)
    members, index = walk(base)
    assert members[index].spec == base and members[index].params == param_counts(base).total


@pytest.mark.parametrize("name", PRESETS)
def test_every_member_is_valid_for_the_layouts_it_claims(name):
    base = PRESETS[name]
    for tp in tps_of(base):
        step = step_of(base, tp)
        claimed = [t for t in (1, 2, 4, 8, 16) if step % t == 0]
        for m in first_members(base, tp, max_factor=8)[::3]:
            s = m.spec
            assert s.head_dim == base.head_dim and s.heads // s.kv_heads == base.heads // base.kv_heads
            assert s.hidden == s.heads * s.head_dim
            assert s.vocab == base.vocab and s.seq_len == base.seq_len and s.mlp == base.mlp
            for t in claimed:
                assert s.heads % t == 0 and s.kv_heads % t == 0 and s.ffn_hidden % t == 0
            t = claimed[-1]
            Config(model=s, cluster=dataclasses.replace(ONE_GPU.cluster, gpus=t, gpus_per_node=t),
                   parallel=dataclasses.replace(ONE_GPU.parallel, dp=1, tp=t))


ONE_GPU = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 1}})


def test_usual_tp_degrees_stay_valid_without_a_given_tp():
    assert step_of(PRESETS["llama3-8b"]) == 8 and step_of(PRESETS["tiny"]) == 4  # tiny's 4 KV heads allow ≤ 4
    assert step_of(PRESETS["llama3-8b"], tp=2) == 2


@pytest.mark.parametrize("name", PRESETS)
def test_the_slider_walks_in_steps_near_a_third_of_a_doubling(name):
    base = PRESETS[name]
    members, index = walk(base)
    p0 = param_counts(base).total
    sizes = [m.params for m in members]
    ratios = [b / a for a, b in itertools.pairwise(sizes)]
    assert all(r > 1 for r in ratios)
    assert statistics.median(ratios) == pytest.approx(STEP, rel=0.03)
    # a long step only across a gap of the family itself: no member it skips would split it into two
    # steps of at least half a step each (gpt2's 256-wide members end at 16M, its 512-wide begin at 29M)
    pool = [m.params for m in first_members(base, max_factor=100)]
    for a, b in itertools.pairwise(sizes):
        if b / a > STEP**1.5:
            assert not [m for m in pool if a * STEP**0.5 <= m <= b / STEP**0.5], (name, a, b)
    # away from the smallest members (where one more layer or the embeddings are a big share) every
    # step is within half a step of 2^(1/3). Not for tiny: one of its 128-wide layers is 11 % of it and
    # the next width's (256) is 42 % of that width's smallest member, so its family is too coarse.
    grown = [r for a, r in zip(sizes, ratios, strict=False) if a >= p0 / 4]
    if name != "tiny":
        assert grown and all(STEP**0.5 <= r <= STEP**1.5 for r in grown), (name, grown)
    assert sizes[-1] >= 30 * p0  # the walk reaches far up ...
    assert sizes[0] <= p0 / 4  # ... and down


def test_a_model_off_the_family_is_inserted_exactly():
    base = PRESETS["llama3-8b"]
    custom = dataclasses.replace(base, layers=33, preset=None)
    members, index = walk(base, custom)
    assert members[index].spec == custom and members[index].params == param_counts(custom).total
    assert all(a.params <= b.params for a, b in itertools.pairwise(members))


LAYOUTS = [
    ({"preset": "llama2-7b"}, "a100-80g", {"dp": 8, "zero": 3}),
    ({"preset": "llama3-8b"}, "h100-sxm", {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4}),
    ({"preset": "tiny"}, "rtx4090", {"dp": 1}),
    ({"preset": "gpt2-124m"}, "a100-40g", {"dp": 4, "tp": 2, "zero": 1}),
]


@pytest.mark.parametrize(("model", "gpu", "parallel"), LAYOUTS, ids=[f"{m['preset']}-{g}" for m, g, _ in LAYOUTS])
def test_largest_fitting_model_fits_while_the_next_member_does_not(model, gpu, parallel):
    par = {"tp": 1, "pp": 1, **parallel}
    cfg = Config.from_dict({"model": model, "cluster": {"gpu": gpu, "gpus": par["dp"] * par["tp"] * par["pp"]},
                            "parallel": par, "training": {"precision": "bf16-mixed"}})
    found = largest_fitting_model(cfg)
    assert found is not None
    spec, n = found
    assert n == param_counts(spec).total
    assert memory_per_rank(dataclasses.replace(cfg, model=spec)).fits
    family = Family(cfg.model, tp=cfg.parallel.tp, min_layers=cfg.parallel.num_stages)
    after = next(m for m in family.members() if m.params > n)
    assert not memory_per_rank(dataclasses.replace(cfg, model=after.spec)).fits
    assert spec.head_dim == cfg.model.head_dim and spec.heads % cfg.parallel.tp == 0


def test_largest_fitting_model_is_none_when_the_smallest_member_does_not_fit():
    cfg = Config.from_dict({"model": {"preset": "llama3-405b"},
                            "cluster": {"gpu": {"preset": "h100-sxm", "memory_gib": 0.01}, "gpus": 1}})
    assert largest_fitting_model(cfg) is None


# --------------------------------------------------------------------------- the window


@pytest.mark.gui
def test_dragging_the_size_slider_shows_the_exact_count(qtbot, window):
    pytest.importorskip("PySide6")
    pytest.importorskip("pytestqt")
    from gui.family import format_params
    from tests.gui.test_gui_window import drag_slider

    w = window
    label = w.controls.size.label
    assert label.text() == format_params(param_counts(w.state.config.model).total) == "1.61M"
    before = w.state.config.model
    drag_slider(w.controls.size.slider, 2)
    qtbot.waitUntil(lambda: w.state.config.model != before, timeout=2000)
    exact = param_counts(w.state.config.model).total
    assert label.text() == format_params(exact) and exact > param_counts(before).total
    assert label.toolTip() == f"{exact:,} parameters"
    assert "≈" not in label.text()
