"""LoRA through peft on the backend's model, and the two runs the issue asks for (DDP and FSDP, 2 ranks,
tiny preset, fp32 + AdamW): loss falls, params / grads / optimizer match the prediction to the byte.
(Legacy nn.DataParallel's refusal without two CUDA GPUs is tests/backend/test_legacy_dp_backend.py's.)"""

from __future__ import annotations

import pytest

from engine import default_config
from engine.memory import memory_per_rank
from engine.model.lora import adapter_params, target_modules
from engine.model.params import param_counts

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

TINY = default_config().model


@pytest.mark.parametrize("targets", ["attention", "mlp", "all"])
def test_peft_creates_exactly_the_engine_adapter_count(targets):
    """peft's lora_A (r × d_in) + lora_B (d_out × r) per adapted Linear = r·(d_in + d_out): the engine's
    count. (The issue's 2·r·(d_in + d_out) is the bytes of both tensors at 16 bits, not elements.)"""
    from backend.model import Transformer
    from backend.parallel.lora import apply_lora

    training = default_config().training.__class__(finetune="lora", lora_rank=4, lora_targets=targets,
                                                   precision="fp32", grad_dtype="fp32")
    model = apply_lora(Transformer(TINY), TINY, training)
    train = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in train) == adapter_params(TINY, 4, targets)
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == param_counts(TINY).total
    names = {n.split(".")[3] for n, p in model.named_parameters() if p.requires_grad}
    assert names == set(target_modules(TINY, targets))
    assert all(n.endswith(("lora_A.default.weight", "lora_B.default.weight"))
               for n, p in model.named_parameters() if p.requires_grad)


def test_nf4_and_tp_are_refused_with_reasons():
    from backend.parallel.lora import lora_refusal

    tr = default_config().training.__class__(finetune="lora", lora_base_dtype="nf4", precision="bf16-mixed")
    why = lora_refusal(tr, cuda=False)
    assert "CUDA" in why and "predicts" in why and "lora_base_dtype = 'fp32'" in why
    assert lora_refusal(default_config().training, cuda=False) is None


def _lora_run(tmp_path, zero: int):
    from test_backend_strategies import exact, run_ok

    training = {"finetune": "lora", "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all"}
    cfg, meas, _ = run_ok(tmp_path, steps=4, cluster={"gpus": 2},
                          parallel={"dp": 2, "pp": 1, "microbatches": 1, "zero": zero}, training=training)
    pred = memory_per_rank(cfg).per_rank
    for key in ("params", "grads", "optimizer"):  # the states at their exact sizes, whole
        assert exact(meas, key) == [sum(t.bytes for t in r.catalogue(key)) for r in pred], key
    assert meas.step.losses[-1] < meas.step.losses[0]
    return cfg, meas, pred


@pytest.mark.integration
def test_lora_ddp_two_ranks_matches_prediction_to_the_byte(tmp_path):
    from test_backend_strategies import exact

    _, meas, pred = _lora_run(tmp_path, zero=0)
    lora = adapter_params(TINY, 4, "all")
    assert exact(meas, "grads") == [4 * lora] * 2  # the base has no gradient
    assert [r.grads for r in meas.memory.per_rank] == [r.grads for r in pred]  # at the peak
    assert [r.optimizer for r in meas.memory.per_rank] == [8 * lora] * 2  # nor optimizer state
    assert [r.comm_buffers for r in meas.memory.per_rank] == [r.comm_buffers for r in pred]  # buckets: adapters


@pytest.mark.integration
def test_lora_fsdp_two_ranks_matches_prediction_to_the_byte(tmp_path):
    from test_backend_strategies import exact

    _, meas, _ = _lora_run(tmp_path, zero=3)
    lora = adapter_params(TINY, 4, "all")
    # sharded over 2 (the exact bytes: at the tracker's peak FSDP2's post-backward has not made them yet)
    assert exact(meas, "grads") == [2 * lora] * 2
