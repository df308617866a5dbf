"""Activation recompute with PyTorch's checkpoint wrappers.

"full": every transformer block is recomputed in the backward.
"selective": only the attention core (scores, softmax, weighted sum: the large, cheap part,
Megatron's selective recompute) is recomputed.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_recompute(model: nn.Module, kind: str) -> None:
    if kind == "none":
        return
    for name, block in list(model.layers.named_children()):
        if kind == "full":
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
        elif kind == "selective":
            attn = block.attention
            attn.core = checkpoint_wrapper(attn.core, preserve_rng_state=False)
        else:
            raise ValueError(f"unknown recompute kind {kind!r}")
