"""LoRA step time and traffic, hand-worked on the tiny preset (engine.time.durations, engine.time.comm, engine.time.step).

Tiny: h = 128, 8 layers, Ψ = 1,607,808; r = 4 on every Linear: 9,344 adapter elements per block,
Ψ_lora = 74,752. fp32 adapters (peft), PyTorch state accounting (the default).
The frozen base still computes input gradients (the gradient must reach the adapters), but no
weight gradient: W covers the adapters only, the DP gradient traffic moves adapter gradients only,
the optimizer steps the adapters only; FSDP still gathers the frozen base.
"""

from __future__ import annotations

import pytest

from engine import default_config
from engine.model.params import params_per_rank
from engine.time.comm import communication, trainable_local
from engine.time.durations import adapter_elements_per_block, flops_per_token, stage_durations
from engine.time.step import BREAKDOWN_KEYS, optimizer_seconds, step_time

PSI, PER_BLOCK, LORA = 1_607_808, 9_344, 74_752
S, B, LAYERS = 64, 2, 8
TOKENS = S * B


def tiny(zero=0, **training):
    return default_config().replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1, "zero": zero},
                                    training={"finetune": "lora", "lora_rank": 4, **training},
                                    conventions={"clock": "efficiency"})  # the FLOP clock, worked by hand


def full(zero=0):
    return tiny(zero).replace(training={"finetune": "full"})


def items(cfg):
    return {i.what.split(" (")[0]: i for i in communication(cfg).per_pp_rank[0].items}


def test_adapter_elements_and_trainable_local():
    cfg = tiny()
    assert adapter_elements_per_block(cfg) == PER_BLOCK
    assert trainable_local(cfg, params_per_rank(cfg)[0][0]) == LORA
    assert trainable_local(full(), params_per_rank(full())[0][0]) == PSI
    assert adapter_elements_per_block(full()) == 0


def test_ddp_all_reduces_adapter_gradients_only():
    ddp = items(tiny())["DDP gradient all-reduce"]
    assert (ddp.calls, ddp.size_bytes) == (1, LORA * 4) == (1, 299_008)  # Ψ_lora × 4 B (fp32 adapter grads)
    assert ddp.bytes_sent == 2 * (2 - 1) / 2 * 299_008
    assert items(full())["DDP gradient all-reduce"].size_bytes == PSI * 4
    # bf16-mixed under autocast: the adapters are fp32 parameters, so their gradients are fp32 on the wire
    assert items(tiny(precision="bf16-mixed"))["DDP gradient all-reduce"].size_bytes == LORA * 4


def test_zero1_reduces_and_broadcasts_adapters_only():
    it = items(tiny(zero=1))
    assert it["ZeRO-1 gradient all-reduce"].size_bytes == LORA * 4
    assert it["ZeRO-1 parameter all-gather"].size_bytes == LORA * 4  # only the adapters are stepped


def test_fsdp_gathers_the_frozen_base_but_reduce_scatters_adapters_only():
    it = items(tiny(zero=3))
    ag, rs = it["FSDP parameter all-gather"], it["FSDP gradient reduce-scatter"]
    # 10 units (embedding, 8 blocks, norm + head), gathered in forward and backward: (Ψ + Ψ_lora) × 4 B / 10
    assert (ag.calls, ag.size_bytes) == (20, (PSI + LORA) * 4 / 10) == (20, 673_024)
    # only the 8 blocks hold adapters: 8 reduce-scatters of 9,344 × 4 B
    assert (rs.calls, rs.size_bytes) == (8, PER_BLOCK * 4) == (8, 37_376)
    # under mixed precision FSDP2 reduces in training.grad_dtype (MixedPrecisionPolicy.reduce_dtype)
    bf = items(tiny(zero=3, precision="bf16-mixed", grad_dtype="bf16"))["FSDP gradient reduce-scatter"]
    assert bf.size_bytes == PER_BLOCK * 2
    fu = items(full(zero=3))["FSDP gradient reduce-scatter"]
    assert fu.calls == 10 and fu.size_bytes * 10 == pytest.approx(PSI * 4)


def test_backward_weight_is_the_adapters_input_gradient_unchanged_plus_adapters():
    cfg = tiny()
    lo, fu = stage_durations(cfg), stage_durations(full())
    fl = flops_per_token(cfg)
    rate = cfg.cluster.gpu.peak_flops("fp32") * cfg.conventions.compute_efficiency
    adapter = 2 * PER_BLOCK  # FLOPs per token of one block's adapters (x·Aᵀ·Bᵀ): 2·r·Σ(d_in + d_out)
    # W: the adapters' weight gradients only — no base matmuls, no head
    assert lo.backward_weight_s[0] == pytest.approx(TOKENS * LAYERS * adapter / rate)
    assert fu.backward_weight_s[0] == pytest.approx(TOKENS * (LAYERS * fl.matmuls + fl.head) / rate)
    # I: the frozen base's input gradients as in full fine-tuning, plus the adapters' input gradients
    assert lo.backward_input_s[0] - fu.backward_input_s[0] == pytest.approx(TOKENS * LAYERS * adapter / rate)
    assert lo.forward_s[0] - fu.forward_s[0] == pytest.approx(TOKENS * LAYERS * adapter / rate)
    assert lo.backward_s[0] == pytest.approx(lo.backward_input_s[0] + lo.backward_weight_s[0])
    assert lo.backward_s[0] < 0.6 * fu.backward_s[0]


def test_optimizer_steps_the_adapters_only():
    cfg = tiny()
    st = step_time(cfg)
    # AdamW on fp32 adapters: read grad 4 + param 4 + m, v 8; write param 4 + m, v 8 = 28 B per adapter element
    over = 2 / cfg.cluster.cpu_cores if cfg.cluster.cpu_cores else 1.0
    expected = LORA * 28 / (cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9) * max(1.0, over)
    assert st.optimizer_s == pytest.approx(expected)
    assert optimizer_seconds(cfg, LORA) == pytest.approx(expected)
    assert step_time(full()).optimizer_s > 20 * st.optimizer_s


def test_lora_step_hand_worked_flops_and_breakdown():
    cfg = tiny()
    st = step_time(cfg)
    assert set(st.breakdown) == set(BREAKDOWN_KEYS)
    assert sum(st.breakdown.values()) == pytest.approx(st.seconds)
    fl = flops_per_token(cfg)
    a = 2 * PER_BLOCK
    # F + I + W of one step: forward with adapters, every input gradient (head included), adapter weight grads
    per_token = (LAYERS * (fl.block + a) + fl.head) + (LAYERS * (fl.matmuls + 2 * fl.attention_core + a) + fl.head) \
        + LAYERS * a
    tokens = cfg.tokens_per_step
    assert st.model_flops == pytest.approx(tokens * per_token)
    assert st.hardware_flops == st.model_flops
    assert 0 < st.mfu <= st.hfu < 1
    ref = step_time(full())
    assert st.seconds < ref.seconds and st.model_flops < ref.model_flops
    assert st.dp_comm_s < ref.dp_comm_s
    rec = step_time(tiny(recompute="full"))
    assert rec.hardware_flops == pytest.approx(rec.model_flops + tokens * LAYERS * (fl.block + a))


def test_lora_under_tp_counts_local_adapter_flops():
    cfg = default_config().replace(cluster={"gpus": 4}, parallel={"dp": 1, "tp": 2, "pp": 2, "microbatches": 2},
                                   training={"finetune": "lora", "lora_rank": 4})
    r, h, q, kv, f = 4, 128, 128, 64, 352
    col = lambda d_out: r * h + (d_out // 2) * r  # noqa: E731 - A replicated, B split
    row = lambda d_in: r * (d_in // 2) + h * r  # noqa: E731 - A split, B replicated
    assert adapter_elements_per_block(cfg) == col(q) + 2 * col(kv) + row(q) + 2 * col(f) + row(f)
    st = step_time(cfg)
    assert sum(st.breakdown.values()) == pytest.approx(st.seconds)
    assert st.breakdown["dp_comm_exposed"] == 0.0
