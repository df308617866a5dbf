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


@pytest.mark.parametrize("model", [{}, {"shared_experts": 0, "mlp": "gelu"}])
def test_moe_rows_on_16_bit_parameters_are_the_tensors_autograd_saves(model):
    """FSDP2's mixed precision runs the blocks on 16-bit parameters without autocast: the norm output reaches the
    router in bf16, and ``x_TD.float()`` is a copy — the router keeps its fp32 copy (4 B an element, not the
    norm output's 2) and its gate weight's, the shared experts the norm output itself."""
    spec = {**MOE, **model}
    par = {"dp": 2, "ep": 1, "tp": 1, "pp": 1, "zero": 3, "microbatches": 1}
    cfg = default_config().replace(model=spec, cluster={"gpus": 2}, parallel=par, training={"precision": "bf16-mixed"})
    from engine.memory.activations import _moe_autocast

    assert not _moe_autocast(cfg)
    torch.manual_seed(0)
    moe = moe_modules(Transformer(cfg.model))[0].to(torch.bfloat16)
    tr = cfg.training
    x = torch.randn(tr.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, dtype=torch.bfloat16,
                    requires_grad=True)
    rows, _ = moe_layer_terms(cfg)
    (router_input,) = [b for label, b, _ in rows if label.startswith("MoE: router input")]
    gate = 4 * cfg.model.hidden * cfg.model.experts  # ``w.float()`` of the 16-bit gate weight: a copy too
    assert router_input == 4 * tr.micro_batch_size * cfg.model.seq_len * cfg.model.hidden + gate
    shared_input = [b for label, b, _ in rows if label.startswith("MoE: shared experts' input")]
    # the census leaves the block's input out: the shared experts' row is that storage
    assert saved_bytes(moe, x) + sum(shared_input) == sum(b for _, b, _ in rows)
    assert bool(shared_input) == bool(spec["shared_experts"])


class _LiveStorages:
    """Bytes of the storages made while it is active and still alive (weak references): what a
    forward keeps, whoever holds it (autograd's saved tensors, a selective checkpoint's stash)."""

    def __init__(self, existing):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        outer.add(t.untyped_storage())
                return out

        self.mode, self.skip, self.live = Mode(), {s.data_ptr() for s in existing}, {}

    def add(self, st) -> None:
        import weakref

        key = st.data_ptr()
        if key and key not in self.skip and key not in self.live:
            self.live[key] = st.nbytes()
            weakref.finalize(st, self.live.pop, key, None)

    def bytes(self) -> int:
        import gc

        gc.collect()  # garbage in a reference cycle is not kept by the forward: gone before counting
        return sum(self.live.values())


@pytest.mark.parametrize("model", [{}, {"shared_experts": 0, "mlp": "gelu"}, {"experts": 2, "shared_experts": 0},
                                   {"bias": True, "router_bias": True}])
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_block_under_per_op_recompute_keeps_the_policy_stash(model, ep, one_rank_group):
    """A whole MoE block under the backend's per-op selective checkpoint keeps the engine's attention
    half and its MoE rows under that policy (``_moe_sac_terms``): the router's logits where its matmul
    count is odd, top-k's outputs, the saved matmuls of each local expert by the counter's parity, the
    shared experts' — and nothing of the dispatch, all-to-all or combine. Through the planned
    (balanced) dispatch the fake worker uses; under ep the block holds rank 0's experts (two experts
    over ep 2: one local expert, an odd count) and runs the all-to-all over a one-rank group."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from backend.parallel.recompute import _op_sac_context
    from engine.memory.activations import layer_activation_terms, shape_of

    spec = {**MOE, **model}
    par = {"dp": 2 if ep > 1 else 1, "ep": ep, "tp": 1, "pp": 1, "zero": 0, "microbatches": 2}
    cfg = default_config().replace(model=spec, cluster={"gpus": par["dp"]}, parallel=par,
                                   training={"recompute": "selective-op"})
    assert cfg.training.precision == "fp32"  # no autocast: the run's dtypes are the engine's
    torch.manual_seed(0)
    model_ = Transformer(cfg.model)
    block = model_.layers["1"]  # the first MoE block (dense_layers = 1)
    n = cfg.training.micro_batch_size * cfg.model.seq_len
    send = split_copies(n * cfg.model.experts_per_token, planned_load(cfg))
    assert len(set(send)) == 1  # a balanced load splits evenly here: the engine's n_r is the run's
    if ep > 1:  # rank 0 of the group: its E/ep experts, each receiving ep ranks' copies over the all-to-all
        local = cfg.model.experts // ep
        block.feed_forward.experts.keep(0, local)
        block.feed_forward.dispatch = PlannedDispatch([ep * c for c in send[:local]], 1, one_rank_group)
    else:
        block.feed_forward.dispatch = PlannedDispatch(send, 1, None)
    wrapped = checkpoint_wrapper(block, context_fn=_op_sac_context, preserve_rng_state=False, early_stop=False)
    x = torch.randn(cfg.training.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    live = _LiveStorages([p.untyped_storage() for p in model_.parameters()] + [x.untyped_storage()])
    with live.mode:
        y = wrapped(x)
    kept = live.bytes() - y.untyped_storage().nbytes()
    terms, _ = layer_activation_terms(shape_of(cfg))
    attention_half = sum(b for label, b, part in terms if part != "mlp" and not label.startswith("norm1 input"))
    rows, _ = moe_layer_terms(cfg)
    assert kept == attention_half + sum(b for _, b, _ in rows)
    y.sum().backward()  # the stash is what the backward needs: it runs


@pytest.mark.parametrize("model", [{"shared_experts": 0}, {"shared_experts": 0, "mlp": "gelu"}, {}])
def test_moe_rows_under_autocast_are_what_autograd_saves(model):
    """Under ``torch.autocast`` (the backend's bf16-mixed on plain parameters) the router runs in fp32 on an
    fp32 copy of its input, each expert Linear casts its input itself, and each expert's weights, slices of
    the grouped parameters and not leaves, are cast on every forward (autocast caches casts of leaves only):
    the rows hold the census byte for byte. The shared experts' cached weight casts are counted once a step
    (``_autocast_cast_terms``); the census of a block with them holds two 16-bit s·b·h tensors more than
    the rows (not analysed)."""
    spec = {**MOE, **model}
    cfg = default_config().replace(model=spec, cluster={"gpus": 1}, training={"precision": "bf16-mixed"},
                                   parallel={"dp": 1, "ep": 1, "tp": 1, "pp": 1, "zero": 0, "microbatches": 2})
    torch.manual_seed(0)
    moe = moe_modules(Transformer(cfg.model))[0]
    x = torch.randn(cfg.training.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        census = saved_bytes(moe, x)
    rows, _ = moe_layer_terms(cfg)
    # the census leaves ``x`` out; in a block it is the norm2 output the router saves (its row, as above). (Without
    # it the rows matched only while they counted the weighted outputs in 16 bits: they are in the block input's
    # dtype, fp32 here, and at top-2 the 2 bytes short of n·k·h equal the router input's 4·n·h)
    (router_input,) = [b for label, b, _ in rows if label.startswith("MoE: router input")]
    gap = 2 * 2 * cfg.model.seq_len * cfg.training.micro_batch_size * cfg.model.hidden if cfg.model.shared_experts else 0
    assert census + router_input == sum(b for _, b, _ in rows) + gap


@pytest.mark.parametrize("batch", [1, 2])
def test_a_tp_ranks_router_input_is_the_whole_norm_output_with_one_sample(batch):
    """Under TP with ep each TP rank routes its 1/t slice of the sequence (``SequenceShard.split``: dim 1's chunk,
    ``.contiguous()``). With one sample a microbatch that chunk is contiguous already — a view — so the router's
    saved fp32 input (``x_TD.float()`` of it, itself) keeps the whole norm output's storage alive: the engine's row
    is 4·s·b·h then, 4·(s·b/t)·h with more samples (the slice a copy)."""
    from backend.parallel.expert_parallel import _SplitSequence

    cfg = default_config().replace(model=MOE, cluster={"gpus": 2}, training={"micro_batch_size": batch},
                                   parallel={"dp": 1, "tp": 2, "ep": 2, "pp": 1, "zero": 0, "microbatches": 1})
    s, h = cfg.model.seq_len, cfg.model.hidden
    x = torch.randn(batch, s, h)
    part = _SplitSequence.apply(x, None, 1, 2).reshape(-1, h).float()
    assert (part.untyped_storage().nbytes() == x.untyped_storage().nbytes()) == (batch == 1)
    (router_input,) = [b for label, b, _ in moe_layer_terms(cfg)[0] if label.startswith("MoE: router input")]
    assert router_input == part.untyped_storage().nbytes()
