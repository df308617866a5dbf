"""What the backend's model saves for backward, counted by ``backend.measure.SavedTensorPeak``
(saved_tensors_hooks, unique storages, parameters left out), against the engine's saved-tensor table:
the whole tiny model for one microbatch in this process. Exact up to the loss's own inputs (the int64
labels and the scalar it saves), which the engine does not count."""

from __future__ import annotations

import warnings

import pytest

from engine import Config, default_config
from engine.predict import predict

torch = pytest.importorskip("torch")


def _cfg(**training) -> Config:
    return default_config().replace(cluster={"gpus": 1}, parallel={"dp": 1, "pp": 1, "microbatches": 1, "zero": 0},
                                    training={"micro_batch_size": 2, **training})


def _saved_by_the_model(cfg: Config, compiled: bool = False) -> tuple[int, int]:
    """(peak saved bytes of one forward + backward, bytes the loss saves of its own: labels and scalar)."""
    from backend.measure import SavedTensorPeak
    from backend.model import Transformer
    from backend.parallel.float8 import apply_float8
    from backend.train import loss_fn

    torch.manual_seed(0)
    spec = cfg.model
    model = Transformer(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_float8(model, cfg.training.float8)
    if compiled:
        from backend.parallel.compile import apply_compile

        apply_compile(model)
    x = torch.randint(0, spec.vocab, (cfg.training.micro_batch_size, spec.seq_len))
    y = torch.randint(0, spec.vocab, x.shape)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.training.precision == "bf16-mixed")
    for _ in range(2 if compiled else 1):  # compiled: the second call runs the compiled graphs
        with SavedTensorPeak(model.parameters()) as saved, autocast:
            loss = loss_fn(model(x), y)
            loss.backward()
    return saved.peak, y.numel() * 8 + 4


def _predicted_activations(cfg: Config) -> int:
    (rank,) = predict(cfg).memory.per_rank
    return rank.activations


def test_counter_follows_saved_tensors_until_autograd_frees_them():
    from backend.measure import SavedTensorPeak

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorPeak(lin.parameters()) as saved:
        y = torch.relu(lin(x)).sin()  # addmm saves x (its weight is a parameter); relu and sin its output
        assert saved.live == 2 * 4 * 8 * 4
        y.sum().backward()
    assert saved.live == 0 and saved.peak == 2 * 4 * 8 * 4


@pytest.mark.parametrize("training", [
    {"precision": "fp32"},
    {"precision": "bf16-mixed", "grad_dtype": "bf16"},
    # torchao's Float8Linear under CPU autocast: its inputs saved uncast (fp32), no block weight casts
    {"precision": "bf16-mixed", "grad_dtype": "bf16", "float8": "rowwise"},
    {"precision": "bf16-mixed", "grad_dtype": "bf16", "float8": "tensorwise"},
], ids=["fp32", "bf16-autocast", "float8-rowwise", "float8-tensorwise"])
def test_the_engine_predicts_what_the_model_saves(training):
    if training.get("float8"):
        pytest.importorskip("torchao")
    cfg = _cfg(**training)
    saved, loss_inputs = _saved_by_the_model(cfg)
    assert saved - loss_inputs == _predicted_activations(cfg)


@pytest.mark.integration
def test_the_engine_predicts_what_the_compiled_blocks_save():
    cfg = _cfg(precision="fp32", compile=True)
    saved, loss_inputs = _saved_by_the_model(cfg, compiled=True)
    assert saved - loss_inputs == _predicted_activations(cfg)
    eager, _ = _saved_by_the_model(_cfg(precision="fp32"))
    assert saved < eager
