"""The mixture-of-experts, expert-parallel and multi-head-latent-attention fields of a Config:
defaults keep a dense model as it was, bad values name the field and what is allowed."""

from __future__ import annotations

import pytest

from engine import Config, ConfigError

MOE = {"preset": "llama2-7b", "experts": 8, "experts_per_token": 2}


def make(model=None, parallel=None, cluster=None, conventions=None) -> Config:
    raw = {"model": model or dict(MOE), "cluster": {"gpu": "h100-sxm", "gpus": 8, **(cluster or {})},
           "parallel": parallel or {}}
    if conventions:
        raw["conventions"] = conventions
    return Config.from_dict(raw)


def problems(**sections) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        make(**sections)
    return {p.field: p.message for p in info.value.problems}


def test_dense_defaults_and_file_unchanged():
    cfg = Config.from_dict({"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8}})
    assert cfg.model.experts == 0 and not cfg.model.moe and cfg.model.moe_layers == 0
    assert cfg.parallel.ep == 1
    written = cfg.to_dict()
    for key in ("experts", "experts_per_token", "kv_lora_rank", "head_size", "hf_config"):
        assert key not in written["model"]
    assert "ep" not in written["parallel"] and "moe_imbalance" not in written["conventions"]


def test_moe_fields_round_trip(tmp_path):
    cfg = make(model={**MOE, "dense_layers": 1, "shared_experts": 1, "expert_ffn_hidden": 1024,
                      "router_score": "sigmoid", "router_balance_bias": True},
               parallel={"ep": 4}, conventions={"moe_imbalance": 1.5})
    assert cfg.model.moe_layers == 31 and cfg.model.expert_hidden == 1024
    assert not cfg.model.is_moe_layer(0) and cfg.model.is_moe_layer(1)
    assert cfg.parallel.expert_shard_degree == 2  # efsdp = dp_shard·tp / ep = 8 / 4
    for suffix in (".toml", ".json"):
        assert Config.load(cfg.save(tmp_path / f"c{suffix}")) == cfg


def test_expert_ffn_hidden_zero_means_ffn_hidden():
    assert make().model.expert_hidden == 11008


def test_ep_must_divide_experts_and_the_dense_region():
    p = problems(model={**MOE, "experts": 6}, parallel={"ep": 4})
    assert "must divide model.experts (6)" in p["parallel.ep"] and "allowed: 1, 2, 3, 6" in p["parallel.ep"]
    # 8 GPUs as tp 2 · pp 2 · dp 2: the dense region dp_shard·tp = 4 cannot hold ep 8
    p = problems(parallel={"ep": 8, "tp": 2, "pp": 2, "dp": 2})
    assert "dp_shard·cp·tp = 2·1·2 = 4" in p["parallel.ep"]
    assert "allowed: 1, 2, 4" in p["parallel.ep"]


def test_ep_spans_tp_ranks_as_torchtitan_lays_it_out():
    cfg = make(parallel={"ep": 8, "tp": 2, "dp": 4})
    assert cfg.parallel.expert_shard_degree == 1
    # HSDP: the dense region is dp / replicate · tp
    cfg = make(parallel={"ep": 2, "dp": 8, "replicate": 2, "zero": 3})
    assert cfg.parallel.expert_shard_degree == 2
    p = problems(parallel={"ep": 8, "dp": 8, "replicate": 2, "zero": 3})
    assert "dp_shard·cp·tp = 4·1·1 = 4" in p["parallel.ep"]


def test_ep_needs_experts():
    p = problems(model={"preset": "llama2-7b"}, parallel={"ep": 2})
    assert "model.experts > 0" in p["parallel.ep"]


def test_top_k_and_dense_layers_are_bounded_by_the_model():
    p = problems(model={**MOE, "experts_per_token": 9, "dense_layers": 32})
    assert "allowed: 1 … 8" in p["model.experts_per_token"]
    assert "allowed: 0 … 31" in p["model.dense_layers"]


def test_router_score_and_booleans_name_the_allowed_values():
    p = problems(model={**MOE, "router_score": "relu"})
    assert p["model.router_score"] == "allowed: softmax | sigmoid"
    p = problems(model={**MOE, "router_bias": 1})
    assert "must be true or false" in p["model.router_bias"]


def test_tp_without_ep_splits_the_experts():
    p = problems(model={**MOE, "expert_ffn_hidden": 1004}, parallel={"tp": 8, "dp": 1})
    assert "must divide model.expert_ffn_hidden (1004)" in p["parallel.tp"]
    assert "allowed: 1, 2, 4" in p["parallel.tp"]
    make(model={**MOE, "expert_ffn_hidden": 1004}, parallel={"tp": 8, "dp": 1, "ep": 8})  # EP: experts whole


def test_imbalance_is_at_most_the_expert_count():
    p = problems(conventions={"moe_imbalance": 9.0})
    assert "allowed: 1 … model.experts (8)" in p["conventions.moe_imbalance"]
    p = problems(conventions={"moe_imbalance": 0.5})
    assert "allowed: 1 … 1048576" in p["conventions.moe_imbalance"]


def test_mla_needs_its_ranks_and_one_kv_head_per_head():
    p = problems(model={"preset": "llama2-7b", "attention": "mla", "kv_heads": 8, "qk_rope_head_dim": 3,
                        "head_size": 64})
    assert set(p) == {"model.kv_lora_rank", "model.v_head_dim", "model.qk_rope_head_dim", "model.head_size",
                      "model.kv_heads"}
    cfg = make(model={"preset": "llama2-7b", "attention": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                      "qk_nope_head_dim": 128, "v_head_dim": 128})
    assert cfg.model.head_dim == 192


def test_head_size_frees_hidden_from_heads():
    cfg = make(model={"preset": "llama2-7b", "hidden": 2880, "heads": 64, "kv_heads": 8, "head_size": 64})
    assert cfg.model.head_dim == 64 and cfg.model.kv_dim == 512
    p = problems(model={"preset": "llama2-7b", "hidden": 2900, "heads": 64, "kv_heads": 8})
    assert "model.head_size" in p["model.hidden"]


def test_context_parallel_ranks_join_the_dense_region_once():
    cfg = make(model={**MOE, "seq_len": 4096}, parallel={"dp": 4, "cp": 2, "ep": 8, "zero": 3})
    assert cfg.parallel.expert_shard_degree == 1  # dp_shard·cp·tp / ep = 4·2·1 / 8
    cfg = make(model={**MOE, "seq_len": 4096}, parallel={"dp": 4, "cp": 2, "ep": 4, "zero": 3})
    assert cfg.parallel.expert_shard_degree == 2
