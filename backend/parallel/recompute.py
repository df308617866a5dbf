"""Activation recompute with PyTorch's checkpoint wrappers (``training.recompute``).

"full": every transformer block is recomputed in the backward.
"selective": only the attention core (scores, softmax, weighted sum: the large, cheap part,
Megatron's selective recompute) is recomputed.
"selective-op": torchtitan's per-op selective checkpointing of every block
(``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with its save list,
``save_ops()``): the outputs of the compute-intensive ops, attention and reduce-scatters are
saved, every other matmul is recomputed (the first, third, ... mm of a block's forward are
saved), everything else is recomputed. torchtitan counts the matmuls separately for the forward
and the recompute pass; torch 2.13 calls the policy in the forward only (the recompute replays
the forward's decisions by index, ``ctx.is_recompute`` is always False), and so does this port.
"selective-layer": a full checkpoint of every ``recompute_every``-th block of each stage
module, as torchtitan's layer SAC counts them: the blocks are numbered 1, 2, ... in their order
within the module (a pipeline stage's own blocks), and block k is checkpointed when
k % recompute_every == 0 — with N = 2 the second, fourth, ... block.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


@functools.cache
def save_ops() -> frozenset:
    """torchtitan's default save list, with the ops torch 2.13 registers: the partitioner's
    compute-intensive ops (mm, addmm, bmm, _scaled_mm, SDPA flash / efficient, ...), the SDPA
    variants (cuDNN, math, overrideable, and CPU's flash kernel), max (the amax of float8 scaling),
    linear (backends that keep it a leaf op), topk, flex attention, inductor's compiled code (a
    compiled region inside the checkpoint), and the reduce-scatter / all-to-all collectives."""
    # imported here: the partitioner pulls in dynamo and inductor (≈ 0.9 s of every rank's start)
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops.update({
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.max.default,
        aten.linear.default,
        aten.topk.default,
        torch._higher_order_ops.flex_attention,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    })
    compiled = getattr(torch._higher_order_ops, "inductor_compiled_code", None)
    if compiled is not None:
        ops.add(compiled)
    return frozenset(ops)




def __getattr__(name: str):
    if name == "SAVE_OPS":  # computed on first use: the partitioner's import is slow
        return save_ops()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the matmuls of which every second one is recomputed (aten.linear where a backend keeps it whole)
MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def op_sac_policy():
    """A fresh per-block policy: save ``save_ops()``' outputs except every second mm, recompute the rest.

    The mm count is kept per pass ("forward" and "recompute") as torchtitan's ``SelectiveAC``
    policy keeps it; torch 2.13 asks the policy in the forward only."""
    meta = {"forward": 0, "recompute": 0}
    save = save_ops()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in MM_OPS:
            meta[mode] += 1
        if func in save:
            if func in MM_OPS and meta[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_context():
    return create_selective_checkpoint_contexts(op_sac_policy())


def layer_sac_blocks(names: list[str], every: int, before: int = 0) -> list[str]:
    """The block names (in module order) that "selective-layer" checkpoints: the k-th (from 1, counting
    ``before`` blocks of the rank's earlier stages first) where k % every == 0 — torchtitan's counter is
    process-wide, incremented per block as AC is applied to the rank's model parts in order
    (``engine.model.recompute.checkpointed_per_stage`` predicts the same)."""
    if every < 1:
        raise ValueError(f"training.recompute_every must be >= 1, got {every!r}")
    return [name for k, name in enumerate(names, start=before + 1) if k % every == 0]


def apply_recompute(model: nn.Module, kind: str, every: int = 2, before: int = 0) -> None:
    """Wrap ``model.layers``' blocks (in place) as recompute ``kind`` says; ``every`` is
    ``training.recompute_every`` ("selective-layer" only), ``before`` the blocks of the rank's earlier
    pipeline stages (the per-layer counter runs on through them)."""
    if kind == "none":
        return
    blocks = list(model.layers.named_children())
    if kind == "selective-layer":
        chosen = set(layer_sac_blocks([name for name, _ in blocks], every, before))
    for name, block in blocks:
        if kind == "full":
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
        elif kind == "selective":
            attn = block.attention
            attn.core = checkpoint_wrapper(attn.core, preserve_rng_state=False)
        elif kind == "selective-op":
            model.layers.register_module(name, checkpoint_wrapper(
                block, context_fn=_op_sac_context, preserve_rng_state=False, early_stop=False))
        elif kind == "selective-layer":
            if name in chosen:
                model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
        else:
            raise ValueError(f"unknown recompute kind {kind!r}; allowed: none | selective | full | "
                             "selective-op | selective-layer")
