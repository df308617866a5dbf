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


# --------------------------------------------------------------------------- a recomputed block's backward


def _block_backward_growth(kind: str) -> int:
    """MemTracker on the 2-block tiny model (fp32, one microbatch, this process): how much the tracker's
    activations grow from the last block's pre-backward moment to its backward's peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from backend.model import Transformer
    from backend.parallel.recompute import apply_recompute
    from backend.train import loss_fn

    cfg = _two_blocks(kind)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    apply_recompute(model, kind, 2)
    x = torch.randint(0, cfg.model.vocab, (cfg.training.micro_batch_size, cfg.model.seq_len))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss_fn(model(x), x).backward()
    stats = next(s for m, s in tracker.memory_tracking.items() if s.mod_fqn.endswith("layers.1"))

    def act(state: str) -> int:
        (snap,) = (v for k, v in stats.snapshots.items() if getattr(k, "value", k) == state)
        return sum(b for k, b in snap[-1][torch.device("cpu")].items() if getattr(k, "value", k) == "Activation")

    return act("Peak-Backward") - act("Pre-Backward")


def _two_blocks(recompute: str) -> Config:
    return _cfg(precision="fp32", recompute=recompute).replace(model={"layers": 2})


def _row_bytes(cfg: Config, label: str) -> int:
    from engine.memory.activations import layer_activation_terms, shape_of

    return next(x for lab, x, _ in layer_activation_terms(shape_of(cfg))[0] if lab == label)


def _recomputed_term(cfg: Config) -> int:
    (rank,) = predict(cfg).memory.per_rank
    return next(t.bytes for t in rank.explain("activations") if t.kind == "recomputed_block")


def test_per_op_recompute_holds_the_none_set_instead_of_its_stash():
    """The replay of a per-op checkpointed block re-saves what no recompute keeps and consumes the
    block's stash; at the backward's peak its first op (w2's) has freed the down input already, which
    the engine's per-action timeline does not resolve."""
    cfg = _two_blocks("selective-op")
    down = _row_bytes(_two_blocks("none"), "down input")
    assert _block_backward_growth("selective-op") == _recomputed_term(cfg) - down


def test_full_recompute_counts_the_kept_block_input_twice():
    """Measured: a fully checkpointed block's backward adds its saved tensors less the block input (the
    checkpoint's kept input, which norm1's replay saves again as the same tensor) and less the down
    input freed by the peak; the engine's recomputed block is the whole block (an over-count by the
    block input, kept: fixing it moves the recorded golden totals of every full-recompute entry)."""
    cfg = _two_blocks("full")
    down = _row_bytes(_two_blocks("none"), "down input")
    kept = _row_bytes(_two_blocks("none"), "norm1 input")
    assert _block_backward_growth("full") == _recomputed_term(cfg) - kept - down
