"""``parallelize``: one pipeline stage (or the whole model) wrapped as the config's wrapping plan says.

The one place the backend composes strategies (torchtitan's ``parallelize_llama`` shape), in
their order: expert parallelism of a mixture of experts (this rank's experts kept, the all-to-all
dispatch installed), LoRA adapters where configured (before data parallelism, which must see the frozen
base), float8 Linears (torchao, as torchtitan converts at model build), tensor parallelism, context
parallelism (attention over the sequence shard: backend.parallel.context_parallel),
activation recompute, ``torch.compile`` per block, then the data-parallel wrapper the plan names —
``fully_shard`` with the plan's reshard policy, FSDP2's ``replicate``, DistributedDataParallel,
legacy ``nn.DataParallel``, or none — with the plan's MixedPrecisionPolicy where an FSDP2 wrapper
holds the model. ``build_optimizer`` makes the optimizer the plan implies (ZeroRedundancyOptimizer
for ZeRO-1, plain otherwise) and ``backend.parallel.precision.autocast_context`` is the precision
context of the forward and loss. ``backend.train.Trainer`` and the fake-scale trainer
(``backend.fake_worker``) both build their stage modules here, so what is predicted
(``engine.wrapping`` is read by the engine too) is what runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from backend.model import moe_modules
from backend.parallel.compile import apply_compile
from backend.parallel.context_parallel import apply_cp
from backend.parallel.data_parallel import (
    apply_dataparallel,
    apply_ddp,
    apply_fsdp,
    apply_replicate,
    make_zero1_optimizer,
)
from backend.parallel.dims import ParallelDims
from backend.parallel.expert_parallel import apply_expert_parallel, expert_params, sync_expert_grads
from backend.parallel.float8 import apply_float8
from backend.parallel.lora import apply_lora, trainable
from backend.parallel.precision import fsdp_mp_policy
from backend.parallel.recompute import apply_recompute
from backend.parallel.tensor_parallel import apply_tp
from engine.config import Config
from engine.wrapping import WrappingPlan


def parallelize(model: nn.Module, cfg: Config, plan: WrappingPlan, dims: ParallelDims, device: torch.device,
                materialize: Callable[[nn.Module], contextlib.AbstractContextManager] | None = None,
                blocks_before: int = 0) -> nn.Module:
    """``model`` (a Transformer or one pipeline stage of it) with every strategy of ``plan`` applied;
    ``blocks_before``: the blocks of this rank's earlier stages (where per-layer recompute counts from).

    ``materialize(module)``: a context entered once the parameters must be real — after
    ``fully_shard`` (which shards meta parameters as they are) and before the wrappers that copy
    parameters at construction (DDP's buckets, ``replicate``, ``nn.DataParallel``); the wrapper is
    built inside it. The fake-scale trainer allocates its (fake) tensors there; a real model is
    already materialised (the default: no context).
    """
    tr = cfg.training
    if moe_modules(model):
        par = cfg.parallel
        apply_expert_parallel(model, par.ep, dims.expert_mesh("ep").get_local_rank() if par.ep > 1 else 0,
                              dims.expert_mesh("ep").get_group() if par.ep > 1 else None,
                              dims["tp"].get_group() if par.tp > 1 else None)
    if tr.finetune == "lora":
        model = apply_lora(model, cfg.model, tr)
    apply_float8(model, tr.float8, tr.float8_all_gather)
    if plan.tensor_parallel:
        apply_tp(model, dims["tp"], plan.sequence_parallel)
    if cfg.parallel.cp > 1:  # attention over the sharded sequence; the dp wrappers below reduce over dp·cp
        apply_cp(model, dims.context_parallel(cfg.model, device))
    apply_recompute(model, tr.recompute, tr.recompute_every, blocks_before)
    if tr.compile:
        apply_compile(model)
    if plan.data_parallel == "fully_shard":
        model = apply_fsdp(model, dims["dp"], fsdp_mp_policy(plan), plan.reshard_after_forward,
                           plan.root_reshard_after_forward,
                           expert_mesh=dims.expert_mesh("efsdp") if cfg.parallel.ep > 1 else None,
                           expert_divide_factor=cfg.parallel.dp)
    with (materialize or _already_real)(model):
        if plan.data_parallel == "replicate":
            model = apply_replicate(model, dims["dp"], fsdp_mp_policy(plan))
        elif plan.data_parallel == "ddp":
            model = apply_ddp(model, dims.dp_group(), cfg.conventions.ddp_bucket_mb, device)
        elif plan.data_parallel == "dataparallel":
            model = apply_dataparallel(model, cfg.parallel.dp)  # the model lives on cuda:0
    return model


def build_optimizer(params: list[nn.Parameter], plan: WrappingPlan, dims: ParallelDims,
                    optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters (LoRA: the adapters only; the frozen base has no
    state): sharded by ZeroRedundancyOptimizer where the plan says ZeRO-1, plain otherwise
    (``fully_shard``'s parameters are already shards)."""
    stepped = trainable(params)
    if kwargs.get("foreach") and len({type(p.data) for p in stepped}) > 1:
        # torch's multi-tensor step groups its tensors by device and dtype only, and a foreach op refuses
        # DTensors mixed with plain tensors ("got mixed torch.Tensor and DTensor": a TP layout without
        # FSDP2 whose routed experts or norms stay plain). torch's own CUDA default would take that path
        # and fail; such a rank steps parameter by parameter (engine.memory.states.optimizer_foreach already
        # says so for the layouts it knows, and predicts that step; this check keeps any other one running)
        kwargs["foreach"] = False
    if plan.zero_redundancy_optimizer:
        return make_zero1_optimizer(stepped, optimizer_cls, dims.dp_group(), **kwargs)
    return optimizer_cls(stepped, **kwargs)


def expert_grad_sync(modules: list[nn.Module], cfg: Config, plan: WrappingPlan,
                     dims: ParallelDims) -> Callable[[], None] | None:
    """What must run between the backward and the optimizer step for the routed experts' gradients:
    where no FSDP2 ``fully_shard`` reduces them (DDP, ``replicate`` and no wrapper leave them out), a sum
    over their efsdp replicas and a division by dp; where it does over their own mesh, the sharded
    gradients rescaled to the mean over dp (``scale_expert_grads``). None when nothing is needed."""
    par = cfg.parallel
    if plan.data_parallel == "fully_shard":
        scaled = [(moe.experts.grad_scale, list(moe.experts.parameters())) for m in modules for moe in moe_modules(m)
                  if moe.experts.grad_scale != 1.0]
        return (lambda: scale_expert_grads(scaled)) if scaled else None
    # ranks holding the same experts: efsdp (with the HSDP replicas) under expert parallelism, else dp;
    # with tp > 1 and dp = 1 they may be TP ranks that routed different slices of the same batch
    replicas = par.dp * par.tp // par.ep if par.ep > 1 else par.dp
    params = [p for m in modules for p in expert_params(m)]
    if not params or (replicas == 1 and par.dp == 1):
        return None
    group = (dims.expert_dp_group() if par.ep > 1 else dims.dp_group()) if replicas > 1 else None
    return lambda: sync_expert_grads(params, group, replicas, par.dp)


def scale_expert_grads(scaled: list[tuple[float, list[nn.Parameter]]]) -> None:
    """FSDP2 averages the routed experts' gradients over their own (efsdp) mesh; the mean over the data
    replicas divides by dp instead: each expert unit's sharded gradients times its ``grad_scale``, in place,
    once the backward has reduced them. (torchtitan's ``set_gradient_divide_factor`` does it inside the
    reduce-scatter with ReduceOp.PREMUL_SUM, which gloo lacks; scaling the unsharded gradient in the
    autograd graph instead made a full-size copy of every expert weight's gradient.)"""
    for scale, params in scaled:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)


@contextlib.contextmanager
def _already_real(model: nn.Module):
    yield
