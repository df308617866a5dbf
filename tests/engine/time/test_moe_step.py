"""Step time of a mixture of experts: active FLOPs in MFU, the busiest rank's experts in the stage
durations, EP all-to-alls on the critical path, dense and MoE blocks per stage by layer."""

from __future__ import annotations

import pytest

from engine import Config
from engine.predict import predict
from engine.time.comm import all_to_all_seconds, ep_layer_collectives, ep_span
from engine.time.durations import block_flops, model_flops_per_token, stage_block_counts, stage_durations

TINY_MOE = {"preset": "tiny", "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 96, "dense_layers": 2}


def cfg(parallel=None, conventions=None, model=None, gpus=4) -> Config:
    raw = {"model": {**TINY_MOE, **(model or {})}, "cluster": {"gpu": "cpu", "gpus": gpus},
           "parallel": parallel or {}}
    if conventions:
        raw["conventions"] = conventions
    return Config.from_dict(raw)


def test_moe_block_flops_by_hand():
    c = cfg()
    h, s, a, d = 128, 64, 8, 16
    f = block_flops(c, True)
    assert f.projections == 2.0 * (h * 128 + 2 * h * 64 + 128 * h)
    assert f.attention_core == 2.0 * s * a * (d + d) == 4.0 * s * h
    assert f.mlp == 2.0 * 4 * h + 2 * 2.0 * 3 * h * 96  # router + top-2 SwiGLU experts
    dense = block_flops(c, False)
    assert dense.mlp == 2.0 * 3 * h * 352
    assert model_flops_per_token(c) == 3 * (2 * dense.block + 6 * f.block + 2.0 * h * 512)


def test_dense_and_moe_blocks_are_counted_per_stage():
    c = cfg({"pp": 4, "dp": 1, "microbatches": 4})
    dense, moe = stage_block_counts(c, 4)
    assert dense.tolist() == [2, 0, 0, 0] and moe.tolist() == [0, 2, 2, 2]
    d = stage_durations(c)
    assert d.forward_s[0] != d.forward_s[1]  # a dense pair weighs more than a MoE pair here
    assert d.forward_s[1] == d.forward_s[2]


def test_imbalance_slows_the_experts_not_the_mfu_numerator():
    base, skew = cfg({"ep": 2, "dp": 4}), cfg({"ep": 2, "dp": 4}, conventions={"moe_imbalance": 2.0})
    a, b = predict(base).step, predict(skew).step
    assert b.model_flops == a.model_flops and b.seconds > a.seconds
    assert stage_durations(skew).forward_s[0] > stage_durations(base).forward_s[0]


def test_ep_all_to_alls_are_on_the_critical_path():
    c = cfg({"ep": 4, "dp": 4})
    st = predict(c).step
    assert st.breakdown["ep_comm"] > 0
    assert sum(st.breakdown.values()) == pytest.approx(st.seconds)
    calls = ep_layer_collectives(c)
    size = 64 * 2 * 128 * 2  # n·k·h bf16
    assert calls == [("dispatch and combine", "forward", 2, size), ("dispatch and combine gradients", "backward", 2, size)]
    one = all_to_all_seconds(c, size, ep_span(c))
    assert st.breakdown["ep_comm"] == pytest.approx(6 * 4 * one)
    items = [i for i in predict(c).comm.per_pp_rank[0].items if i.dim == "ep"]
    assert sum(i.calls for i in items) == 6 * 4
    assert "ep_comm" not in predict(cfg({"dp": 4})).step.breakdown


def test_all_to_all_across_nodes_sends_the_remote_share_over_the_network():
    c = Config.from_dict({"model": {"preset": "mixtral-8x7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 16},
                          "parallel": {"ep": 8, "dp": 16, "zero": 3}})
    span = ep_span(c)
    assert (span.size, span.nodes, span.local) == (8, 1, 8)
    wide = Config.from_dict({"model": {"preset": "mixtral-8x7b", "experts": 16}, "cluster": {"gpu": "h100-sxm",
                             "gpus": 16}, "parallel": {"ep": 16, "dp": 16, "zero": 3}})
    span = ep_span(wide)
    assert (span.size, span.nodes, span.local) == (16, 2, 8)
    size = 1e9
    cl = wide.cluster
    expected = max(size * 7 / 16 / cl.intra_node_bytes_per_s, size * 8 / 16 / cl.inter_node_bytes_per_s) \
        + 15 * cl.inter_node_latency_us * 1e-6
    assert all_to_all_seconds(wide, size, span) == pytest.approx(expected)


def test_mfu_counts_active_flops_of_deepseek():
    c = Config.from_dict({"model": {"preset": "deepseek-v3"}, "cluster": {"gpu": "h100-sxm", "gpus": 256},
                          "parallel": {"ep": 32, "zero": 3, "pp": 8, "microbatches": 16},
                          "training": {"precision": "bf16-mixed", "recompute": "full"}})
    per_token = model_flops_per_token(c)
    # 6 × the active parameters without the embedding lookup (36.6B: DeepSeek's own count) + the
    # attention core 3 × 61 × 2·s·a·(d_qk + d_v); only norms (not matmuls) separate the two
    from engine.model.params import param_counts

    core = 2.0 * 4096 * 128 * (192 + 128)
    expected = 6 * param_counts(c.model).active_without_embedding + 3 * 61 * core
    assert per_token == pytest.approx(expected, rel=1e-4)
    assert predict(c).step.model_flops == c.tokens_per_step * per_token


def test_experts_reduce_over_efsdp_and_the_rest_over_dp():
    c = Config.from_dict({"model": {"preset": "mixtral-8x7b", "seq_len": 4096},
                          "cluster": {"gpu": "h100-sxm", "gpus": 16},
                          "parallel": {"dp": 16, "ep": 8, "zero": 3, "microbatches": 4},
                          "training": {"precision": "bf16-mixed"}})
    items = [i for i in predict(c).comm.per_pp_rank[0].items if i.dim == "dp"]
    experts = [i for i in items if "experts" in i.what]
    dense = [i for i in items if "experts" not in i.what]
    assert {i.group_size for i in experts} == {2} and {i.group_size for i in dense} == {16}
    # efsdp = 16 / 8: the two members sit 8 ranks apart, on the two nodes
    assert {i.link for i in experts} == {"inter-node"}
    rs = next(i for i in experts if i.collective == "reduce_scatter")
    per_expert = 3 * 4096 * 14336
    assert rs.calls == 32 and rs.size_bytes == per_expert * 2  # one expert per rank per block, bf16 gradients


def test_the_size_slider_keeps_a_moe_preset():
    from engine.config import ModelSpec
    from engine.model.family import walk
    from engine.model.presets import model_presets

    for name in ("deepseek-v3", "gpt-oss-20b", "mixtral-8x7b"):
        base = ModelSpec(**model_presets()[name], preset=name)
        members, index = walk(base)
        assert members[index].spec == base
