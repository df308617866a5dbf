"""LoRA / QLoRA in the engine: config rules, adapter counts, frozen-base memory — hand-worked numbers.

The tiny preset: h = 128, 8 heads of 16, 4 KV heads (kv_dim 64), SwiGLU f = 352, 8 layers,
V = 512, s = 64, RMSNorm, no biases: Ψ = 1,607,808 parameters.
"""

from __future__ import annotations

import pytest

from engine import ConfigError, default_config
from engine.config import Config
from engine.memory import memory_per_rank
from engine.memory.lifetimes import PARTIAL_STATE_KINDS
from engine.model.lora import adapter_params, adapter_params_per_layer, nf4_bytes, nf4_bytes_per_param, target_modules
from engine.model.params import param_counts

BASE = 1_607_808
# r = 4, per block: wq 4·(128+128) + wk 4·(128+64) + wv 4·(128+64) + wo 4·(128+128) = 3,584
#                   w1 4·(128+352) + w3 4·(128+352) + w2 4·(352+128)                 = 5,760
ATTN, MLP = 3_584, 5_760



def _grads(row) -> int:
    """A rank's gradients whole: plain ``.grad`` (no FSDP2) exists from the first backward on, so a
    peak before it holds none (``engine.memory.lifetimes.lifetime_overrides``); without a moment's share of
    them (``PARTIAL_STATE_KINDS``)."""
    return sum(t.bytes for t in row.catalogue("grads") if t.kind not in PARTIAL_STATE_KINDS)

def tiny(**training):
    return default_config().replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1},
                                    training={"finetune": "lora", "lora_rank": 4, **training})


def test_adapter_count_is_r_times_din_plus_dout_per_linear():
    """peft's lora_A is r × d_in and lora_B is d_out × r: r·(d_in + d_out) elements per adapted Linear.

    2·r·(d_in + d_out), sometimes quoted, is the bytes of both tensors in a 16-bit dtype, not their
    element count (tests/backend/test_lora_backend.py counts what peft really creates on our model).
    """
    model = default_config().model
    assert param_counts(model).total == BASE
    assert adapter_params_per_layer(model, 4, "attention") == ATTN
    assert adapter_params_per_layer(model, 4, "mlp") == MLP
    assert adapter_params_per_layer(model, 4, "all") == ATTN + MLP
    assert adapter_params(model, 4, "all") == 8 * 9_344 == 74_752
    assert target_modules(model, "mlp") == ["w1", "w3", "w2"]
    gelu = model.__class__(**{**model.__dict__, "mlp": "gelu"})
    assert target_modules(gelu, "mlp") == ["w1", "w2"]  # no gate under GELU


def test_frozen_base_has_no_grads_or_optimizer_state_ddp():
    for row in memory_per_rank(tiny()).per_rank:
        assert row.params == 4 * BASE + 4 * 74_752 == 6_730_240  # fp32 base + fp32 adapters
        assert _grads(row) == 4 * 74_752 == 299_008  # adapters only (from the first backward on)
        assert row.optimizer == 8 * 74_752 == 598_016  # AdamW's two states, adapters only
        assert row.comm_buffers == 4 * 74_752  # DDP buckets cover trainable parameters only
    full = memory_per_rank(default_config().replace(cluster={"gpus": 2},
                                                    parallel={"dp": 2, "pp": 1, "microbatches": 1})).per_rank[0]
    assert _grads(full) == 4 * BASE and full.optimizer == 8 * BASE


def test_lora_under_fsdp_shards_base_and_adapters():
    # every dim 0 is even (A's is r = 4), so ZeRO-3 over 2 ranks halves both exactly
    cfg = tiny().replace(parallel={"zero": 3})
    for row in memory_per_rank(cfg).per_rank:
        assert row.params == 4 * BASE // 2 + 4 * 74_752 // 2 == 3_365_120
        # the adapters' sharded gradients are FSDP2's, made only in each unit's post-backward (torch 2.13,
        # torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce:
        # "fsdp_param.sharded_param.grad = new_sharded_dtensor_grad"): none at a peak inside the backward
        assert [t.bytes for t in row.catalogue("grads")] == [4 * 74_752 // 2]
        assert row.grads == (4 * 74_752 // 2 if "the end of the backward" in row.peak_moment else 0)
        assert row.optimizer == 8 * 74_752 // 2


def test_zero1_partitions_the_adapters_only():
    rows = memory_per_rank(tiny().replace(parallel={"zero": 1})).per_rank
    assert sum(r.optimizer for r in rows) == 8 * 74_752
    assert all(_grads(r) == 4 * 74_752 for r in rows)


def test_targets_change_the_count_and_the_activations():
    att = memory_per_rank(tiny(lora_targets="attention")).per_rank[0]
    assert _grads(att) == 4 * 8 * ATTN
    full = memory_per_rank(default_config().replace(cluster={"gpus": 2},
                                                    parallel={"dp": 2, "pp": 1, "microbatches": 1})).per_rank[0]
    # frozen Linears keep no input for a weight gradient: MLP input and down input go (2·s·b·h + ... bytes)
    assert att.activations < full.activations
    labels = [t.label for t in att.explain("activations")]
    assert any("first block saves nothing for norm1" in x for x in labels)
    assert not any("token ids" in x for x in labels) and not any(x.endswith("head input") for x in labels)


def test_lora_per_layer_activation_terms_hand_worked():
    """fp32, eager, b = 2, s = 64, h = 128, f = 352, targets = attention: the MLP's frozen Linears save
    neither the MLP input (4·s·b·h) nor the down input (4·s·b·f); the frozen RMSNorm weights need no
    x̂ = x·rstd (torch's composite RMSNorm on CPU keeps it only for the weight's gradient: 2 × 4·s·b·h);
    four adapters save A's output 4·s·b·r."""
    from engine.memory import activation_terms_per_layer

    full_cfg = default_config().replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1})
    full = {t.label: t.bytes for t in activation_terms_per_layer(full_cfg)[0]}
    att = {t.label: t.bytes for t in activation_terms_per_layer(tiny(lora_targets="attention"))[0]}
    s, b, h, f, r = 64, 2, 128, 352, 4
    assert full["MLP input (norm2 output)"] == 4 * s * b * h
    assert full["down input"] == 4 * s * b * f
    assert "MLP input (norm2 output)" not in att and "down input" not in att
    lora_label = next(k for k in att if k.startswith("LoRA"))
    assert att[lora_label] == 4 * 4 * s * b * r  # 4 adapted Linears × fp32 × s·b·r
    assert not any("x̂" in k for k in att)
    assert sum(att.values()) == sum(full.values()) - 4 * s * b * h - 4 * s * b * f - 2 * 4 * s * b * h + 16 * s * b * r


def test_nf4_base_bytes_hand_worked():
    # 4096 × 4096: 8,388,608 B of codes + 262,144 8-bit absmax + 4·1,024 fp32 second-level + 4 offset
    assert nf4_bytes(4096 * 4096) == 8_388_608 + 262_144 + 4_096 + 4
    assert nf4_bytes(4096 * 11008) == 22_544_384 + 704_512 + 11_008 + 4
    assert nf4_bytes_per_param() == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    cfg = Config.from_dict({"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 1},
                            "training": {"precision": "bf16-mixed", "finetune": "lora", "lora_rank": 16,
                                         "lora_base_dtype": "nf4"}})
    row = memory_per_rank(cfg).per_rank[0]
    per_block = 4 * nf4_bytes(4096 * 4096) + 3 * nf4_bytes(4096 * 11008)
    unquantised = 2 * (2 * 32_000 * 4096 + 2 * 4096 * 32 + 4096)  # embeddings, head, norms in bf16
    adapters = adapter_params(cfg.model, 16, "all")
    assert per_block == 104_399_132
    assert row.params == 32 * per_block + unquantised + 4 * adapters
    assert _grads(row) == 4 * adapters


def test_seven_b_full_finetune_vs_lora_on_one_card():
    """The issue's picture: 7B full fine-tuning needs ~16 B/param on every DDP card; LoRA fits one."""
    common = {"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "a100-80g"}}
    full = Config.from_dict({**common, "cluster": {"gpu": "a100-80g", "gpus": 8}, "parallel": {"dp": 8},
                             "training": {"precision": "bf16-mixed"}})
    lora = Config.from_dict({**common, "cluster": {"gpu": "a100-80g", "gpus": 1},
                             "training": {"precision": "bf16-mixed", "finetune": "lora", "lora_base_dtype": "bf16",
                                          "recompute": "full"}})
    f, lo = memory_per_rank(full).per_rank[0], memory_per_rank(lora).per_rank[0]
    assert f.params + _grads(f) + f.optimizer >= 16 * 6_738_415_616 and not f.fits
    assert lo.params < 2.1 * 6_738_415_616 and lo.fits


@pytest.mark.parametrize("raw, field, words", [
    ({"training": {"finetune": "qlora"}}, "training.finetune", "allowed: full | lora"),
    ({"training": {"finetune": "lora", "lora_rank": 0}}, "training.lora_rank", "at least 1"),
    ({"training": {"finetune": "lora", "lora_alpha": 0}}, "training.lora_alpha", "greater than 0"),
    ({"training": {"finetune": "lora", "lora_targets": "qkv"}}, "training.lora_targets", "attention | mlp | all"),
    ({"training": {"finetune": "lora", "lora_base_dtype": "int8"}}, "training.lora_base_dtype", "fp32 | bf16 | nf4"),
    ({"training": {"finetune": "lora", "lora_base_dtype": "bf16"}}, "training.lora_base_dtype", "bf16-mixed"),
    ({"training": {"finetune": "lora", "lora_rank": 4096}}, "training.lora_rank", "min(model.hidden"),
    ({"parallel": {"zero": 3}, "training": {"finetune": "lora", "lora_base_dtype": "nf4"}},
     "training.lora_base_dtype", "zero"),
])
def test_lora_config_problems_name_the_field(raw, field, words):
    base = {"model": {"preset": "tiny"}, "cluster": {"preset": "local-cpu", "gpus": 2},
            "parallel": {"dp": 2}, "training": {"precision": "fp32"}}
    merged = {k: {**base.get(k, {}), **raw.get(k, {})} for k in set(base) | set(raw)}
    with pytest.raises(ConfigError) as e:
        Config.from_dict(merged)
    assert field in e.value.fields()
    assert any(words in p.message for p in e.value.problems if p.field == field), str(e.value)


def test_lora_fields_round_trip_through_toml_and_json():
    cfg = tiny(lora_alpha=8, lora_targets="mlp")
    assert Config.loads_toml(cfg.dumps_toml()) == cfg
    assert Config.loads_json(cfg.dumps_json()) == cfg
    assert default_config().training.finetune == "full"  # old files keep meaning full fine-tuning


def test_lora_composes_with_tp_and_pp_in_the_engine():
    cfg = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"preset": "local-cpu", "gpus": 4},
                            "parallel": {"dp": 1, "tp": 2, "pp": 2, "microbatches": 2},
                            "training": {"precision": "fp32", "finetune": "lora", "lora_rank": 4}})
    rows = memory_per_rank(cfg).per_rank
    # per TP rank: column-parallel A full, B split; row-parallel A split, B full; 4 blocks per stage
    r, h, q, kv, f = 4, 128, 128, 64, 352
    col = lambda d_out: r * h + (d_out // 2) * r  # noqa: E731
    row = lambda d_in: r * (d_in // 2) + h * r  # noqa: E731
    per_block = col(q) + 2 * col(kv) + row(q) + 2 * col(f) + row(f)
    for rm in rows:
        assert _grads(rm) == 4 * 4 * per_block
        assert rm.optimizer == 8 * 4 * per_block
