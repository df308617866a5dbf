"""AdamW's step temporaries (engine.memory.states.optimizer_step_term) against torch's own AdamW on the
backend's model, in this process: MemTracker's optimizer state inside ``optimizer.step()`` beyond the
states, byte for byte, for the for-loop step (torch's CPU default) and the foreach step (its GPU
default; the foreach ops run on the CPU too), on dense and mixture-of-experts shapes."""

import pytest

torch = pytest.importorskip("torch")

from backend.model import Transformer  # noqa: E402
from engine import Config  # noqa: E402
from engine.memory import memory_per_rank  # noqa: E402

MODELS = [
    {"preset": "tiny"},
    # CPU sweep seed 2026 #03's shape: gelu MLP, a vocabulary smaller than f × h
    {"preset": "tiny", "layers": 3, "hidden": 192, "heads": 6, "kv_heads": 3, "ffn_hidden": 744, "vocab": 300,
     "mlp": "gelu"},
    {"preset": "tiny", "hidden": 96, "ffn_hidden": 520, "vocab": 700, "qk_norm": True, "bias": True},
    {"preset": "tiny", "layers": 3, "hidden": 32, "heads": 4, "kv_heads": 4, "ffn_hidden": 64, "vocab": 128,
     "seq_len": 16, "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 32, "shared_experts": 1,
     "dense_layers": 1},
]


def _measured_step_temporaries(cfg: Config, optimizer: str, foreach: bool) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    from backend.train import _optimizer_cls_and_kwargs

    torch.manual_seed(0)
    model = Transformer(cfg.model)
    params = [p for p in model.parameters() if p.requires_grad]
    cls, kw = _optimizer_cls_and_kwargs(optimizer, foreach)
    opt = cls(params, **kw)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # the states, as a training step leaves them
    states = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        opt.step()
    (per_kind,) = tracker.get_tracker_snapshot("peak").values()
    return sum(v for k, v in per_kind.items() if "OPT" in str(k).upper() and "TOTAL" not in str(k).upper()) - states


@pytest.mark.parametrize("model", MODELS, ids=["tiny", "gelu-v300", "qk-norm-bias", "moe"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_adamw_step_temporaries_are_what_torch_allocates(model, foreach):
    cfg = Config.from_dict({"model": model, "cluster": {"gpu": "h100-sxm" if foreach else "cpu", "gpus": 1},
                            "training": {"precision": "fp32"}})
    r = memory_per_rank(cfg).per_rank[0]
    (term,) = [t for t in r.catalogue("temporaries") if t.kind == "optimizer_step"]
    assert term.bytes == _measured_step_temporaries(cfg, "adamw", foreach) > 0


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum"])
def test_sgd_steps_in_place(optimizer):
    cfg = Config.from_dict({"model": MODELS[0], "cluster": {"gpu": "cpu", "gpus": 1},
                            "training": {"precision": "fp32", "optimizer": optimizer}})
    assert not [t for t in memory_per_rank(cfg).per_rank[0].catalogue("temporaries") if t.kind == "optimizer_step"]
    assert _measured_step_temporaries(cfg, optimizer, False) == 0


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum", "sgd"])
def test_the_clocks_one_tensor_step_is_torchs(optimizer):
    """engine.time.step.FOR_LOOP_OPTIMIZER against torch's own for-loop step with the backend's arguments: its
    aten calls per parameter tensor, and the bytes they move per element (each call's distinct tensors read,
    its output written; 0-d step counters move none), for fp32 parameters."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from backend.train import _optimizer_cls_and_kwargs
    from engine.time.step import FOR_LOOP_OPTIMIZER

    cls, kw = _optimizer_cls_and_kwargs(optimizer, foreach=False)
    params = [torch.nn.Parameter(torch.randn(48, 32)), torch.nn.Parameter(torch.randn(32))]
    opt = cls(params, **kw)

    def grads():
        for p in params:
            p.grad = torch.randn_like(p)
    grads()
    opt.step()  # the first step makes the states (SGD's momentum buffer is a clone of the gradient)
    grads()
    calls, moved = [], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__.startswith("_record_function") or "record_function" in str(func):
                return out
            calls.append(str(func))
            seen, nbytes = set(), 0
            for a in [*args, *(kwargs or {}).values()]:
                if isinstance(a, torch.Tensor) and a.dim() > 0 and a.untyped_storage().data_ptr() not in seen:
                    seen.add(a.untyped_storage().data_ptr())
                    nbytes += a.nbytes
            if isinstance(out, torch.Tensor) and out.dim() > 0:
                nbytes += out.nbytes
            moved.append(nbytes)
            return out
    with Count():
        opt.step()
    n_calls, fixed, per_p = FOR_LOOP_OPTIMIZER[optimizer]
    elements = sum(p.numel() for p in params)
    assert len(calls) == n_calls * len(params), calls
    assert sum(moved) == elements * (fixed + per_p * 4), calls
