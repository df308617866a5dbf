"""The size slider's family of a mixture of experts (engine.model.family.ExpertFamily): experts and depth grow,
the width stays, counts are exact and every member is valid for the layout it was walked for."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest

from engine import Config
from engine.config import ModelSpec
from engine.memory import memory_per_rank
from engine.model.family import ExpertFamily, family_of, largest_fitting_model, walk
from engine.model.params import param_counts
from engine.model.presets import model_presets

MOE = {name: ModelSpec(**fields, preset=name) for name, fields in model_presets().items() if fields.get("experts")}
STEP = 2 ** (1 / 3)
WIDTH = ("hidden", "heads", "kv_heads", "ffn_hidden", "expert_ffn_hidden", "experts_per_token", "shared_experts",
         "dense_layers", "head_size", "attention", "kv_lora_rank", "q_lora_rank", "router_groups", "vocab")


def test_there_are_moe_presets_to_walk():
    assert {"deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"} <= set(MOE)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("ep", [None, 1, 4, 8])
def test_the_walk_is_exact_increasing_and_keeps_the_width(name, ep):
    base = MOE[name]
    if ep is not None and base.experts % ep:
        pytest.skip("ep must divide the base's experts")
    members, index = walk(base, ep=ep)
    assert members[index].spec == base and members[index].params == param_counts(base).total
    assert all(a.params < b.params for a, b in itertools.pairwise(members))
    for m in members:
        assert m.params == param_counts(m.spec).total
        assert m.spec.experts % (ep or 1) == 0 and m.spec.experts >= m.spec.experts_per_token
        assert m.spec.layers > m.spec.dense_layers
        assert all(getattr(m.spec, k) == getattr(base, k) for k in WIDTH), name
        assert set(m.shape()) == {"layers", "hidden", "heads", "kv_heads", "ffn_hidden", "experts"}
    assert len({m.spec.experts for m in members}) > 3  # the experts grow, not only the depth
    sizes = [m.params for m in members]
    assert statistics.median(b / a for a, b in itertools.pairwise(sizes)) == pytest.approx(STEP, rel=0.05)
    assert sizes[-1] >= 30 * sizes[index] and sizes[0] <= sizes[index] / 4


@pytest.mark.parametrize("name", MOE)
def test_every_member_is_a_valid_config_under_the_layout_it_was_walked_for(name):
    base = MOE[name]
    ep = 8 if base.experts % 8 == 0 else 1
    members, _ = walk(base, ep=ep, min_layers=4)
    for m in members[::3]:
        Config.from_dict({"model": dataclasses.asdict(m.spec) | {"preset": None},
                          "cluster": {"gpu": "h100-sxm", "gpus": 32},
                          "parallel": {"dp": 8, "pp": 4, "ep": ep, "microbatches": 8}})
        assert m.spec.layers >= 4


def test_group_limited_routing_keeps_enough_experts_for_top_k():
    fam = ExpertFamily(MOE["deepseek-v3"])  # top-8 from the best 4 of 8 groups: at least 16 experts
    first = next(fam.members())
    assert first.spec.experts == 16 and first.spec.layers == 4  # 3 dense blocks lead
    with pytest.raises(ValueError, match="experts"):
        ExpertFamily(model_presets_spec("llama3-8b"))
    assert isinstance(family_of(MOE["mixtral-8x7b"]), ExpertFamily)


def model_presets_spec(name: str) -> ModelSpec:
    return ModelSpec(**model_presets()[name], preset=name)


def test_a_custom_expert_count_is_inserted_exactly():
    base = MOE["qwen3-30b-a3b"]
    custom = dataclasses.replace(base, experts=100, preset=None)
    members, index = walk(base, custom)
    assert members[index].spec == custom and members[index].params == param_counts(custom).total


def test_largest_fitting_moe_model_fits_while_the_next_member_does_not():
    cfg = Config.from_dict({"model": {"preset": "qwen3-30b-a3b", "seq_len": 4096}, "cluster": {"gpu": "h100-sxm", "gpus": 8},
                            "parallel": {"dp": 8, "ep": 8, "zero": 3}})
    spec, n = largest_fitting_model(cfg)
    assert spec.experts % 8 == 0 and n == param_counts(spec).total
    assert memory_per_rank(dataclasses.replace(cfg, model=spec)).fits
    members = list(family_of(cfg.model, tp=1, min_layers=1, ep=8).members(max_params=n * 1.2))
    bigger = [m for m in members if m.params > n][:1]
    assert bigger and not memory_per_rank(dataclasses.replace(cfg, model=bigger[0].spec)).fits
