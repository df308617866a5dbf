"""The engine's MoE activation rows (``engine.memory.activations.moe_layer_terms``) against what
autograd really saves in one ``backend.model.MoE`` block: a saved-tensor census (every tensor the
forward packs for backward, one count per storage, the block's parameters and its input left out),
without expert parallelism (LocalDispatch) and with the all-to-all dispatch (AllToAllDispatch over a
one-rank gloo group, so every routed copy is local: the balanced n_r = n·k of an ep-2 prediction).
The block's input is the norm output the engine counts as the router input."""

from __future__ import annotations

import pytest

from engine import default_config
from engine.memory.activations import moe_layer_terms

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend.model import Transformer, moe_modules  # noqa: E402
from backend.parallel.expert_parallel import AllToAllDispatch, PlannedDispatch, planned_load, split_copies  # noqa: E402

MOE = {"experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 128, "shared_experts": 1, "dense_layers": 1}


def saved_bytes(moe, x) -> int:
    """Bytes of the distinct storages one forward of ``moe`` saves for backward (params and ``x`` left out)."""
    skip = {p.untyped_storage().data_ptr() for p in moe.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return sum(seen.values())


@pytest.fixture
def one_rank_group():
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("model", [{}, {"shared_experts": 0, "mlp": "gelu"}, {"norm_topk_prob": False}])
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_rows_are_the_tensors_autograd_saves(model, ep, planned, one_rank_group):
    """Also through the planned dispatch the fake worker uses (a balanced load, the same tensors)."""
    spec = {**MOE, **model}
    par = {"dp": 2 if ep > 1 else 1, "ep": ep, "tp": 1, "pp": 1, "zero": 0, "microbatches": 2}
    cfg = default_config().replace(model=spec, cluster={"gpus": par["dp"]}, parallel=par)
    torch.manual_seed(0)
    moe = moe_modules(Transformer(cfg.model))[0]
    if planned:  # every copy local on the one rank: the ep-2 prediction's balanced n_r = n·k
        n = cfg.training.micro_batch_size * cfg.model.seq_len
        send = split_copies(n * cfg.model.experts_per_token, planned_load(cfg))
        moe.dispatch = PlannedDispatch(send, 1, one_rank_group if ep > 1 else None)
    elif ep > 1:
        moe.dispatch = AllToAllDispatch(one_rank_group, 1)
    tr = cfg.training
    x = torch.randn(tr.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    rows, _ = moe_layer_terms(cfg)
    (router_input,) = [b for label, b, _ in rows if label.startswith("MoE: router input")]
    assert saved_bytes(moe, x) + router_input == sum(b for _, b, _ in rows)
