"""A split backward's weight pass over checkpointed blocks, measured on the backend's blocks: torch's
``stage_backward_weight`` runs one ``autograd.grad`` per parameter group and the checkpoint recomputes its block
for each, keeping in every recompute what no node run so far has freed. After the first group the live
recomputed tensors are exactly ``engine.memory.activations.weight_pass_block``'s (the input path's tensors and
every weight's but the first group's), and the pass's peak is ``weight_pass_bytes`` to a few per cent (the
weight gradient being computed and the graph's release order, which the engine does not model)."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine import default_config
from engine.memory.activations import (
    shape_of,
    split_backward_group_grads,
    weight_groups,
    weight_pass_block,
    weight_pass_bytes,
    weight_pass_casts,
    weight_pass_fresh,
)

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402


class _Live(TorchDispatchMode):
    """The storages the ops under it create, while alive: from ``start()`` on, the bytes of those made since
    (``live``, ``bytes``) and which were alive when their total was highest (``at_peak``). What existed
    before (the weights and the stage input, the forward's autocast casts) is not the pass's, even where an
    op of the pass returns a view of it."""

    def __init__(self, before: set[int]):
        super().__init__()
        self.seen = set(before)
        self.live: dict[int, int] = {}
        self.bytes = self.peak = 0
        self.at_peak: dict[int, int] = {}
        self.counting = False

    def start(self) -> None:
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if not st.nbytes() or key in self.seen:
                    continue
                self.seen.add(key)
                weakref.finalize(st, self.seen.discard, key)
                if self.counting:
                    self.live[key] = st.nbytes()
                    self.bytes += st.nbytes()
                    weakref.finalize(st, self._free, key)
                    if self.bytes > self.peak:
                        self.peak, self.at_peak = self.bytes, dict(self.live)
        return out

    def _free(self, key: int) -> None:
        self.bytes -= self.live.pop(key)


#: the backend's dense blocks the weight pass is measured on: SwiGLU with GQA, GELU, per-head q/k norms
DENSE_BLOCKS = [
    {"hidden": 128, "heads": 4, "kv_heads": 2, "ffn_hidden": 352, "seq_len": 64},
    {"hidden": 96, "heads": 6, "kv_heads": 3, "ffn_hidden": 264, "seq_len": 48, "mlp": "gelu"},
    {"hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 160, "seq_len": 32, "qk_norm": True},
]


def _cfg(bf16: bool, blocks: int, lora: str = "", **model):
    cfg = default_config().replace(parallel={"pp": 1, "dp": 1, "microbatches": 1}, cluster={"gpus": 1})
    return cfg.replace(model={"layers": blocks, **model},
                       training={"micro_batch_size": 2, "recompute": "full",
                                 **({"finetune": "lora", "lora_targets": lora, "lora_rank": 8} if lora else {}),
                                 **({"precision": "bf16-mixed"} if bf16 else {"precision": "fp32"})})


def _stage(cfg):
    """``cfg``'s blocks under full recompute and their parameters (peft's adapters first under LoRA, as the
    backend builds it), a stage input that needs a gradient, the live-bytes tracker counting from what exists
    now (the weights, the input), and the autocast context that spans the step, backward included, as the
    training loop has it."""
    from backend.model import Transformer
    from backend.parallel.recompute import apply_recompute

    spec = cfg.model
    torch.manual_seed(0)
    model = Transformer(spec)
    if cfg.training.finetune == "lora":
        from backend.parallel.lora import apply_lora

        model = apply_lora(model, spec, cfg.training)
    apply_recompute(model, "full")
    blocks = list(model.layers.values())
    params = [p for blk in blocks for p in blk.parameters()]
    x = torch.randn(cfg.training.micro_batch_size, spec.seq_len, spec.hidden, requires_grad=True)
    live = _Live({t.untyped_storage().data_ptr() for t in [*params, x]})
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.training.precision != "fp32")
    return blocks, params, x, live, autocast


def _measured(cfg) -> tuple[list[int], int]:
    """The weight pass of a stage of ``cfg``'s blocks fed a hidden state that needs a gradient (a later
    stage): the live bytes it made after each parameter group, and at its peak (the weights' gradients left
    out, and what existed before it: the weights, the stage input the checkpoint keeps)."""
    import torch.distributed.pipelining._backward as pipelining_backward

    blocks, params, x, live, autocast = _stage(cfg)
    with live:
        with autocast:
            h = x
            for blk in blocks:
                h = blk(h)
            _, groups = pipelining_backward.stage_backward_input([h], [torch.randn_like(h)], [x], iter(params))
            after = []
            grad = torch.autograd.grad

            def grads_of(out=()) -> set[int]:
                return ({t.untyped_storage().data_ptr() for t in out if t is not None}
                        | {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None})

            def one_group(*args, **kwargs):
                out = grad(*args, **kwargs)
                after.append(sum(n for k, n in live.live.items() if k not in grads_of(out)))
                return out

            live.start()
            pipelining_backward.torch.autograd.grad = one_group
            gc.collect()
            gc.disable()  # the checkpoint's frames are freed by reference counts; no collection mid-pass
            try:
                pipelining_backward.stage_backward_weight(iter(params), groups)
            finally:
                gc.enable()
                pipelining_backward.torch.autograd.grad = grad
    return after, sum(n for k, n in live.at_peak.items() if k not in grads_of())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("model", DENSE_BLOCKS, ids=["swiglu-gqa", "gelu", "qk_norm"])
def test_the_weight_pass_holds_what_the_engine_says(model, bf16):
    for blocks in (1, 2):
        cfg = _cfg(bf16, blocks, **model)
        sh = shape_of(cfg)
        res = 4 if bf16 else sh.act
        kept, frees = weight_pass_block(sh, res)
        first = weight_groups(sh)[0]
        after, peak = _measured(cfg)
        # after the first group: one recompute, the first group's own tensors freed, every other kept
        assert after[0] == kept + sum(n for g, n in frees if g != first), (kept, frees)
        # the pass's peak, its working tensors included (the weight gradient being made: up to 0.5 of a
        # recompute here, at these tiny widths)
        predicted, _, _ = weight_pass_bytes(sh, res, blocks, weight_pass_casts(cfg, sh, bf16))
        assert 0.94 <= peak / predicted <= 1.06, (blocks, peak, predicted)  # measured: 0.957 ... 1.049


@pytest.mark.parametrize("model", DENSE_BLOCKS, ids=["swiglu-gqa", "gelu", "qk_norm"])
def test_each_groups_recompute_ends_holding_everything_the_block_saved(model, monkeypatch):
    """A non-reentrant checkpoint stops its recompute only once it has packed as many tensors as the forward saved
    (torch/utils/checkpoint.py's early stop counts every position, a released holder's too), and until that stop
    unwinds it the recompute's own graph holds what the pack hook returned: at the end of the k-th group's recompute
    the pass holds the k − 1 earlier recomputes' stored tensors and the whole block's saved tensors — exactly
    ``weight_pass_bytes``' (k − 1) × alive + full on one fp32 block (the weights' gradients left out)."""
    import torch.utils.checkpoint as checkpoint

    cfg = _cfg(False, 1, **model)
    sh = shape_of(cfg)
    kept, frees = weight_pass_block(sh, sh.act)
    groups = weight_groups(sh)
    order = {g: i for i, g in enumerate(groups)}
    full = kept + sum(n for _, n in frees)
    blocks, params, x, live, autocast = _stage(cfg)
    ends = []

    class Stop(checkpoint._StopRecomputationError):
        def __init__(self, *args):
            super().__init__(*args)
            if live.counting:  # not the I's own recompute
                ends.append(live.bytes - sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None))

    monkeypatch.setattr(checkpoint, "_StopRecomputationError", Stop)
    with live, autocast:
        _forward_input_weight(blocks, params, x, live)
    assert len(ends) == len(groups)
    for k, end in enumerate(ends, start=1):
        alive = kept + sum(n for g, n in frees if order[g] >= k - 1)
        if groups[k - 1] == "w3":  # SwiGLU's up projection, last though its node lies above w2's: far less
            assert end < 0.7 * ((k - 1) * alive + full), (end, (k - 1) * alive + full)
        else:
            assert end == (k - 1) * alive + full, (groups[k - 1], end, (k - 1) * alive + full)


def test_lora_on_every_linear_holds_what_the_engine_says():
    """Under LoRA the groups are the adapters' (each A, then B); fp32, every Linear adapted: after the first
    group exactly the engine's, the peak within a few per cent. (Attention-only LoRA keeps less, bf16 LoRA
    more: not modelled, see ``weight_pass_block``.)"""
    cfg = _cfg(False, 1, lora="all", hidden=128, heads=4, kv_heads=2, ffn_hidden=352, seq_len=64)
    sh = shape_of(cfg)
    kept, frees = weight_pass_block(sh, sh.act)
    groups = weight_groups(sh)
    assert groups[:4] == ("wq.A", "wq.B", "wk.A", "wk.B") and len(groups) == 14
    after, peak = _measured(cfg)
    assert after[0] == kept + sum(n for g, n in frees if g != groups[0])
    predicted, _, _ = weight_pass_bytes(sh, sh.act, 1)
    assert 0.99 <= peak / predicted <= 1.04, (peak, predicted)  # measured 1.014


def _measured_with_keeps(cfg) -> tuple[int, int]:
    """The I and then the weight pass of a stage of ``cfg``'s blocks, counting from the I on: what the I left
    alive for the W (its kept gradients and the stage input's gradient) and the pass's peak with them (the
    weights' gradients left out)."""
    import torch.distributed.pipelining._backward as pipelining_backward

    blocks, params, x, live, autocast = _stage(cfg)
    with live, autocast:
        h = x
        for blk in blocks:
            h = blk(h)
        live.start()
        _, groups = pipelining_backward.stage_backward_input([h], [torch.randn_like(h)], [x], iter(params))
        del h
        gc.collect()
        kept = live.bytes
        live.peak, live.at_peak = live.bytes, dict(live.live)
        gc.disable()  # the checkpoint's frames are freed by reference counts; no collection mid-pass
        try:
            pipelining_backward.stage_backward_weight(iter(params), groups)
        finally:
            gc.enable()
        grads = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    return kept, sum(n for k, n in live.at_peak.items() if k not in grads)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("model", [
    {"hidden": 128, "heads": 4, "kv_heads": 2, "ffn_hidden": 352, "seq_len": 64},
    {"hidden": 96, "heads": 6, "kv_heads": 3, "ffn_hidden": 264, "seq_len": 48, "mlp": "gelu"},
], ids=["swiglu-gqa", "gelu"])
def test_the_weight_pass_drops_what_the_input_pass_kept_as_it_goes(model, bf16):
    """What the I keeps for the W is ``split_backward_group_grads`` per block and the input's gradient, exactly;
    ``stage_backward_weight`` drops each group's share once its ``autograd.grad`` has run, so the pass's peak
    with them is its recomputes less what it has dropped by then (``weight_pass_bytes``' ``freed``), not its
    recomputes on top of all it was kept: measured 0.95 … 1.05 of the rule (0.87 … 0.98 with nothing dropped)."""
    for blocks in (1, 3):
        cfg = _cfg(bf16, blocks, **model)
        sh = shape_of(cfg)
        res = 4 if bf16 else sh.act
        sbh = cfg.local_seq_len * cfg.training.micro_batch_size * cfg.model.hidden
        keeps = split_backward_group_grads(cfg, sh.act, res, sbh)
        kept, peak = _measured_with_keeps(cfg)
        assert kept == blocks * sum(keeps.values()) + res * sbh
        recomputes, _, freed = weight_pass_bytes(sh, res, blocks, weight_pass_casts(cfg, sh, bf16), keeps)
        assert freed > 0
        assert 0.94 <= peak / (kept + recomputes - freed) <= 1.06, (blocks, peak, kept + recomputes - freed)


def _measured_later(cfg) -> int:
    """The weight pass's peak as ``_measured``'s, but at a W after the stage's first: every weight holds a gradient
    already, so ``stage_backward_weight`` adds each fresh ``dw`` in (``weight.grad += dw``) and ``dw`` is a tensor of
    its own, counted here (the ``.grad``s existed before: not the pass's)."""
    blocks, params, x, live, autocast = _stage(cfg)
    with live, autocast:
        _forward_input_weight(blocks, params, x, live, grads_first=True)
    return live.peak


def _forward_input_weight(blocks, params, x, live, grads_first: bool = False) -> None:
    """The blocks' forward, ``stage_backward_input`` and, counted from its start, ``stage_backward_weight`` (the
    cyclic collector paused: the checkpoint's frames are freed by reference counts). ``grads_first``: every weight
    holds a gradient before the pass (a W after the stage's first)."""
    import torch.distributed.pipelining._backward as pipelining_backward

    h = x
    for blk in blocks:
        h = blk(h)
    if grads_first:
        for p in params:
            p.grad = torch.zeros_like(p)
    _, groups = pipelining_backward.stage_backward_input([h], [torch.randn_like(h)], [x], iter(params))
    live.start()
    gc.collect()
    gc.disable()
    try:
        pipelining_backward.stage_backward_weight(iter(params), groups)
    finally:
        gc.enable()


@pytest.mark.parametrize("model", [
    {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn_hidden": 704, "seq_len": 4},
    {"hidden": 192, "heads": 6, "kv_heads": 3, "ffn_hidden": 528, "seq_len": 4, "mlp": "gelu"},
    {"hidden": 128, "heads": 4, "kv_heads": 4, "ffn_hidden": 320, "seq_len": 8, "qk_norm": True},
], ids=["swiglu-gqa", "gelu", "qk_norm"])
def test_a_later_weight_pass_holds_its_fresh_weight_gradients(model):
    """Weights that hold a gradient already (a stage's W after its first): ``stage_backward_weight`` keeps the
    previous group's ``dweights`` through the next group's ``autograd.grad`` (the name is rebound only when it
    returns) and makes this group's at its node: the pass's peak is ``weight_pass_bytes`` with
    ``weight_pass_fresh`` exactly (measured on widths where the weights outweigh the tokens, fp32; 1.1 … 2.5 × the
    rule without them)."""
    for blocks in (1, 2):
        cfg = _cfg(False, blocks, **model)
        sh = shape_of(cfg)
        fresh = weight_pass_fresh(cfg, sh, sh.act)
        without, _, _ = weight_pass_bytes(sh, sh.act, blocks, {})
        predicted, _, _ = weight_pass_bytes(sh, sh.act, blocks, {}, fresh=fresh)
        peak = _measured_later(cfg)
        assert peak == predicted, (blocks, peak, predicted, without)
        assert peak > 1.05 * without


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_block_with_experts_holds_what_the_engine_says(bf16):
    """A checkpointed block with experts (4 experts, top-2) under the weight pass: after each parameter group
    but the last (where the graph goes) the live recomputed tensors are exactly ``moe_weight_pass_block``'s —
    the graph above the weights' nodes gone with the I (router scores, the combine's tensors), the experts'
    weights cast anew by every recompute under autocast — and the peak within a few per cent."""
    from engine.memory.activations import moe_split_backward_group_grads, moe_weight_pass_block

    cfg = _cfg(bf16, 1, hidden=64, heads=4, kv_heads=2, ffn_hidden=160, seq_len=64, experts=4,
               experts_per_token=2, expert_ffn_hidden=96)
    sh = shape_of(cfg)
    res = 4 if bf16 else sh.act
    kept, frees, groups, above = moe_weight_pass_block(cfg, sh, res)
    assert groups[-4:] == ("router", "w1", "w2", "w3") and above > 0
    after, peak = _measured(cfg)
    order = {g: i for i, g in enumerate(groups)}
    predicted = [k * (kept + sum(n for g, n in frees if order[g] >= k)) for k in range(1, len(groups) + 1)]
    assert after[:-1] == predicted[:-1]
    total, _, _ = weight_pass_bytes(sh, res, 1, None, None, (kept, frees, groups, above))
    assert 0.94 <= peak / total <= 1.1, (peak, total)  # measured 0.99 (fp32), 1.01 (bf16) since session 60 (1.05, 1.08 before)
    # what the I keeps for it: each group's output gradient (router, experts' matmuls) and the input's
    sbh = cfg.local_seq_len * cfg.training.micro_batch_size * cfg.model.hidden
    keeps = moe_split_backward_group_grads(cfg, sh.act, res, sbh)
    i_kept, peak_with = _measured_with_keeps(cfg)
    assert i_kept == sum(keeps.values()) + res * sbh
    total, _, freed = weight_pass_bytes(sh, res, 1, None, keeps, (kept, frees, groups, above))
    assert freed > 0 and 0.94 <= peak_with / (i_kept + total - freed) <= 1.1, (peak_with, i_kept + total - freed)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_an_earlier_block_with_experts_keeps_its_graph_above_the_weights(bf16):
    """Two checkpointed blocks with experts: the second block's checkpoint holds its input with its ``grad_fn``
    (``_CheckpointFrame.save_inputs``), so the first block's graph outlives the I whole, and each of its
    recomputes in the W also keeps what the nodes above its weights saved (the router's scores, the combine's
    tensors: ``moe_weight_pass_block``'s ``above``) — exactly, after each of its groups; the pass's peak within a
    few per cent of ``weight_pass_bytes``."""
    from engine.memory.activations import moe_weight_pass_block

    cfg = _cfg(bf16, 2, hidden=64, heads=4, kv_heads=2, ffn_hidden=160, seq_len=64, experts=4,
               experts_per_token=2, expert_ffn_hidden=96)
    sh = shape_of(cfg)
    res = 4 if bf16 else sh.act
    kept, frees, groups, above = moe_weight_pass_block(cfg, sh, res)
    after, peak = _measured(cfg)
    order = {g: i for i, g in enumerate(groups)}
    first = [k * (kept + above + sum(n for g, n in frees if order[g] >= k)) for k in range(1, len(groups) + 1)]
    assert after[:len(groups)] == first
    # the last block's recomputes, beside the first block's (its graph above the weights gone with the I)
    last = [len(groups) * (kept + above) + k * (kept + sum(n for g, n in frees if order[g] >= k))
            for k in range(1, len(groups))]
    assert after[len(groups):-1] == last
    total, _, _ = weight_pass_bytes(sh, res, 2, None, None, (kept, frees, groups, above))
    assert 0.94 <= peak / total <= 1.1, (peak, total)


def test_the_loss_log_probabilities_go_with_the_input_pass():
    """A last stage's split backward: ``stage_backward_input`` runs the loss's backward with the graph retained,
    then detaches the loss, so the graph above the head's matmul (the node the head weight's group keeps) goes,
    and with it the log-probabilities cross_entropy saved; what stays for the W is the head matmul's output
    gradient (its group's ``grads``). The engine frees them after the I (``lifetimes.LOSS_AT_INPUT_KINDS``)."""
    import torch.distributed.pipelining._backward as pipelining_backward

    from engine.memory.lifetimes import LOSS_AT_INPUT_KINDS

    assert "log_probabilities" in LOSS_AT_INPUT_KINDS
    torch.manual_seed(0)
    tokens, hidden, vocab = 64, 16, 4096
    x = torch.randn(tokens, hidden, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab)
    target = torch.randint(0, vocab, (tokens,))
    live = _Live({t.untyped_storage().data_ptr() for t in [x, target, *head.parameters()]})
    sheet = tokens * vocab * 4  # one fp32 tokens × vocabulary tensor
    with live:
        live.start()
        logits = head(x)
        loss = torch.nn.functional.cross_entropy(logits, target)
        del logits  # the stage's own reference; the log-probabilities stay, saved by log_softmax
        gc.collect()
        assert sheet <= live.bytes < sheet + 4096
        _, groups = pipelining_backward.stage_backward_input([loss], None, [x], iter(head.parameters()))
        gc.collect()
        # the logits' gradient kept for the W and the input's gradient: no log-probabilities beside them
        assert sheet <= live.bytes < sheet + 4096 + x.numel() * 4
        pipelining_backward.stage_backward_weight(iter(head.parameters()), groups)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_a_later_weight_pass_over_experts_that_recompute_nothing_holds_what_the_engine_says(bf16, mlp):
    """A block with experts, no recompute, its weights holding a gradient (a later W of a stage of plain
    parameters): ``stage_backward_weight`` runs the router's, then w1's, w2's, w3's groups, each ``autograd.grad``
    summing its experts' full-size select_backward gradients out of place beside the previous group's ``dw``
    (rebound only when the next call returns), after the groups before it dropped what they saved and what the I
    kept for them, and its own node had run two experts. The pass's most above its start is
    ``experts_weight_pass_peak`` within one routed row (the experts' loads are the router's, the rule takes them
    even), at w2 (16 local experts, where the full-size gradients outweigh the tokens' tensors; measured 384 B
    under in fp32 SwiGLU, 32 B under autocast)."""
    import torch.distributed.pipelining._backward as pipelining_backward

    from backend.model import Transformer
    from engine.memory.activations import experts_weight_pass_peak, moe_split_backward_group_grads

    cfg = _cfg(bf16, 1, hidden=64, heads=4, kv_heads=2, ffn_hidden=160, seq_len=16, experts=16,
               experts_per_token=2, expert_ffn_hidden=96, mlp=mlp)
    cfg = cfg.replace(training={"recompute": "none"})
    sh = shape_of(cfg)
    res = 4 if bf16 else sh.act
    sbh = cfg.local_seq_len * cfg.training.micro_batch_size * cfg.model.hidden
    predicted, at = experts_weight_pass_peak(cfg, sh, res, bf16, moe_split_backward_group_grads(cfg, sh.act, res, sbh))
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    blk = next(iter(model.layers.values()))
    params = list(blk.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    x = torch.randn(cfg.training.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    live = _Live({t.untyped_storage().data_ptr() for t in [*params, *(p.grad for p in params), x]})
    with live, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        live.start()
        h = blk(x)
        _, groups = pipelining_backward.stage_backward_input([h], [torch.randn_like(h)], [x], iter(params))
        del h
        gc.collect()
        start = live.bytes
        live.peak = start
        gc.disable()
        try:
            pipelining_backward.stage_backward_weight(iter(params), groups)
        finally:
            gc.enable()
    row = max(cfg.model.hidden, cfg.model.expert_ffn_hidden) * 4  # one routed row of a matmul's saved input, fp32
    assert abs(live.peak - start - predicted) <= row, (live.peak - start, predicted, at)
    assert at == "w2"
