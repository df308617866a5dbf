"""Tensor parallelism with parallelize_module (Megatron-style plan, torchtitan's names).

Attention: wq/wk/wv column-parallel, wo row-parallel; MLP: w1/w3 column, w2 row. A block with
experts splits its shared experts as an MLP; its router and routed experts stay whole on every TP
rank (backend.parallel.expert_parallel splits the block's tokens over TP instead). With
sequence parallelism the norms run SequenceParallel on sequence shards, the blocks gather the
sequence at their input, and the head's output stays vocab-sharded for loss_parallel.

Float8 (``training.float8``): torchao's Float8Linear layers take the same plan, their TP collectives in
the compute dtype (bf16), as torchtitan runs its rowwise recipe; torchao's Float8ColwiseParallel /
Float8RowwiseParallel (float8 all-gathers of the activations, torchtitan's tensorwise TP) are not used,
and the engine predicts what this plan holds (tests/backend/test_backend_torchtitan_knobs.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from backend.model import MoE


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``model`` (a whole model or a pipeline stage) over ``tp_mesh`` in place."""
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
        if model.pos_embeddings is not None:
            # positions are (1, seq): the sequence dim is 1, as for the tokens
            top["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if sp else Replicate(),
            use_local_output=not sp,
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
        }
        if block.attention.q_norm is not None:
            # Qwen3's q and k norms act on each rank's own heads (the wq / wk outputs, local, viewed as
            # (b, s, heads / tp, head_dim)): their head_dim weights replicate over TP and their gradients,
            # partial per rank, are summed over it. torchtitan's Qwen3 plan: SequenceParallel(sequence_dim=2)
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        ffn = "feed_forward"
        if isinstance(block.feed_forward, MoE):  # experts unsplit by TP (etp = 1); shared experts TP'd
            ffn = "feed_forward.shared_experts" if block.feed_forward.shared_experts is not None else None
        if ffn is not None:
            plan[f"{ffn}.w1"] = ColwiseParallel()
            plan[f"{ffn}.w2"] = RowwiseParallel(output_layouts=act)
            if hasattr(block.get_submodule(ffn), "w3"):
                plan[f"{ffn}.w3"] = ColwiseParallel()
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)
