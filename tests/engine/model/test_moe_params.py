"""Exact parameter counts of the mixture-of-experts presets against their published figures.

Sources (total / active, as each publisher counts "active"):
* DeepSeek-V3: arXiv 2412.19437 abstract, "671B total parameters with 37B activated for each token";
  its README_WEIGHTS.md: main model 671B, "Activation parameters: 36.6B (including 0.9B for the
  output Head)" — the embedding lookup not counted — and the multi-token-prediction module's 11.5B
  unique parameters outside the 671B. The preset, like the 671B, has no MTP module.
* Qwen3-30B-A3B and Qwen3-235B-A22B: their Hugging Face model cards, "30.5B in total and 3.3B
  activated", "Non-Embedding: 29.9B"; "235B in total and 22B activated", "Non-Embedding: 234B".
* Mixtral 8x7B: Mistral AI's announcement, "46.7B total parameters but only uses 12.9B parameters
  per token" (embedding and head included).
* gpt-oss-20b / -120b: OpenAI's gpt-oss model card (arXiv 2508.10925), table 1: 20.91B total,
  3.61B active; 116.83B total, 5.13B active ("we count the unembedding, not the embedding").
"""

from __future__ import annotations

import pytest

from engine.config import ModelSpec
from engine.model.params import param_counts
from engine.model.presets import model_presets

MOE_PRESETS = ("deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b")


def spec(name: str) -> ModelSpec:
    return ModelSpec(**model_presets()[name], preset=name)


# name -> (published total, published active, which active convention, digits the figure is rounded to)
PUBLISHED = {
    "deepseek-v3": (671e9, 37e9, "without_embedding", 1e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, "with_embedding", 0.1e9),
    "qwen3-235b-a22b": (235e9, 22e9, "with_embedding", 1e9),
    "mixtral-8x7b": (46.7e9, 12.9e9, "with_embedding", 0.1e9),
    "gpt-oss-20b": (20.91e9, 3.61e9, "without_embedding", 0.01e9),
    "gpt-oss-120b": (116.83e9, 5.13e9, "without_embedding", 0.01e9),
}


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_presets_match_the_published_totals_and_active_counts(name):
    c = param_counts(spec(name))
    total, active, convention, step = PUBLISHED[name]
    assert abs(c.total - total) <= step / 2, (name, c.total)
    got = c.active if convention == "with_embedding" else c.active_without_embedding
    # Qwen's "3.3B" is 3.353B cut, not rounded, to one decimal
    assert abs(got - active) <= step / 2 or (name == "qwen3-30b-a3b" and 0 <= got - active < step), (name, got)


def test_the_exact_counts_are_pinned():
    got = {n: (param_counts(spec(n)).total, param_counts(spec(n)).active) for n in MOE_PRESETS}
    assert got == {
        "deepseek-v3": (671_026_404_352, 37_552_282_624),
        "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
        "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
        "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
        "gpt-oss-20b": (20_914_757_184, 4_187_440_704),
        "gpt-oss-120b": (116_829_156_672, 5_711_982_912),
    }


def test_non_embedding_counts_of_qwen3_match_the_cards():
    for name, non_embedding in (("qwen3-30b-a3b", 29.9e9), ("qwen3-235b-a22b", 234e9)):
        c = param_counts(spec(name))
        step = 0.1e9 if non_embedding < 100e9 else 1e9
        assert abs(c.total - c.embedding - c.head - non_embedding) <= step / 2


def test_mixtral_by_hand():
    """32 blocks of: attention 2·4096² + 2·4096·1024, router 4096·8, 8 experts of 3·4096·14336, 2 norms."""
    c = param_counts(spec("mixtral-8x7b"))
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    block = attention + 4096 * 8 + 8 * expert + 2 * 4096
    assert c.layer.total == block and c.layer.experts == 8 * expert and c.layer.router == 4096 * 8
    assert c.total == 32 * block + 2 * 32000 * 4096 + 4096
    assert c.active == 32 * (block - 6 * expert) + 2 * 32000 * 4096 + 4096


def test_deepseek_mla_and_dense_blocks_by_hand():
    c = param_counts(spec("deepseek-v3"))
    h = 7168
    mla = (h * 1536 + 1536 + 1536 * 128 * 192      # q_a_proj, q_a_layernorm, q_b_proj
           + h * (512 + 64) + 512 + 512 * 128 * 256  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
           + 128 * 128 * h)                           # o_proj
    assert c.layer.attention == mla == c.dense_layer.attention
    assert c.dense_layers == 3 and c.dense_layer.mlp == 3 * h * 18432
    assert c.layer.mlp == 3 * h * 2048  # the shared expert
    assert c.layer.router == 256 * h  # the balancing bias is a buffer, not a parameter
    assert c.layer.experts == 256 * 3 * h * 2048 and c.layer.active_experts == 8 * 3 * h * 2048


def test_gpt_oss_biases_sinks_and_router_bias():
    c = param_counts(spec("gpt-oss-20b"))
    h, q, kv, f = 2880, 64 * 64, 8 * 64, 2880
    assert c.layer.attention == h * q + 2 * h * kv + q * h + 64  # + one sink per head
    assert c.layer.biases == q + 2 * kv + h
    assert c.layer.router == 32 * h + 32
    assert c.layer.experts == 32 * (3 * h * f + 2 * f + h)


def test_qwen3_q_k_norms_and_head_size():
    c = param_counts(spec("qwen3-30b-a3b"))
    assert c.layer.norms == 2 * 2048 + 2 * 128
    assert c.layer.attention == 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048


def test_dense_models_have_no_expert_parts():
    c = param_counts(spec("llama2-7b"))
    assert c.total == 6_738_415_616 and c.active == c.total and c.experts == 0 and c.dense_layer is None


def test_predict_json_names_the_model_counts():
    from engine import Config
    from engine.predict import predict

    cfg = Config.from_dict({"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8}})
    out = predict(cfg).to_json()
    assert out["model"] == {"params": 6_738_415_616, "active_params": 6_738_415_616,
                            "active_params_without_embedding": 6_738_415_616 - 32000 * 4096, "expert_params": 0}
    assert "embedding" in out["conventions"]["active_params"]
