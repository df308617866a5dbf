"""The TP collectives the optimizer step runs (engine.time.comm.sp_partial_gradients): the backend's model sharded by
its own TP plan (backend.parallel.tensor_parallel) over 2 ranks of a fake process group in this process, one forward
and backward, then torch's one-tensor optimizer step as the backend builds it, its collectives counted by DTensor's
CommDebugMode — against the engine's item for the same layout."""

import pytest

torch = pytest.importorskip("torch")

from engine import Config  # noqa: E402
from engine.time.comm import communication  # noqa: E402

TINY = {"preset": "tiny", "layers": 3, "hidden": 16, "heads": 4, "kv_heads": 2, "ffn_hidden": 32, "vocab": 32,
        "seq_len": 8}


@pytest.fixture(scope="module")
def tp_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def _step_all_reduces(cfg: Config, mesh, sp: bool) -> int:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from backend.model import Transformer
    from backend.parallel.tensor_parallel import apply_tp
    from backend.train import _optimizer_cls_and_kwargs

    torch.manual_seed(0)
    model = Transformer(cfg.model)
    apply_tp(model, mesh, sequence_parallel=sp)
    tokens = torch.randint(0, cfg.model.vocab, (1, cfg.model.seq_len))
    out = model(tokens)
    (out.to_local() if isinstance(out, DTensor) else out).float().sum().backward()
    cls, kw = _optimizer_cls_and_kwargs(cfg.training.optimizer, False)  # CPU ranks: the one-tensor step
    opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
    with CommDebugMode() as comm:
        opt.step()
    return sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum", "sgd"])
@pytest.mark.parametrize("sp", [True, False])
def test_the_optimizer_step_all_reduces_the_sequence_parallel_norms_partial_gradients(tp_mesh, optimizer, sp):
    """Under SP the norms run on sequence shards, so each one's weight gradient is a Partial DTensor, and every op of
    the step that reads it all-reduces it: AdamW's lerp_ once and addcmul_(grad, grad) twice, SGD's add_ once — 3 × 7
    and 7 all-reduces for 3 blocks and the final norm; without SP none."""
    cfg = Config.from_dict({"model": TINY, "cluster": {"preset": "local-cpu", "gpus": 2},
                            "parallel": {"dp": 1, "tp": 2, "pp": 1, "sequence_parallel": sp, "microbatches": 1},
                            "training": {"micro_batch_size": 1, "optimizer": optimizer}})
    predicted = sum(i.calls for i in communication(cfg).per_pp_rank[0].items if i.phase == "step" and i.dim == "tp")
    measured = _step_all_reduces(cfg, tp_mesh, sp)
    assert measured == predicted
    assert predicted == ((3 if optimizer == "adamw" else 1) * (2 * 3 + 1) if sp else 0)
