"""Data parallelism: DDP, ZeRO-1 (ZeroRedundancyOptimizer; TensorParallelZeRO1 with TP), ZeRO-2/3 and HSDP
(fully_shard).

ZeRO-2 is ``fully_shard(reshard_after_forward=False)`` (parameters stay gathered between
forward and backward, gradients and optimizer state sharded); ZeRO-3 reshards after the
forward as ``parallel.fsdp_reshard_after_forward`` says (torchtitan's "default": not under
pipelining) — the flags come from engine.wrapping's plan. HSDP: the same calls on the 2-D
(dp_replicate, dp_shard) mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from backend.measure import local_tensor
from backend.model import moe_modules
from backend.parallel.expert_parallel import expert_param_names, expert_params


def apply_ddp(model: nn.Module, dp_group, bucket_cap_mb: float, device: torch.device) -> nn.Module:
    """Wrap in DistributedDataParallel over the data-parallel group (gradients all-reduced)."""
    device_ids = [device.index] if device.type == "cuda" else None
    names = expert_param_names(model)
    if names:  # routed experts: their replicas are the efsdp ranks, not dp (sync_expert_grads)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return DistributedDataParallel(model, process_group=dp_group, bucket_cap_mb=bucket_cap_mb,
                                   device_ids=device_ids, broadcast_buffers=False)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """DDP semantics for DTensor (TP) parameters: FSDP2-based ``replicate`` on the dp mesh (routed
    experts left out: their replicas are the efsdp ranks, not dp)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    ignored = set(expert_params(model)) or None  # experts: summed over efsdp only (sync_expert_grads)
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
    return replicate(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool, root_reshard_after_forward: bool,
               expert_mesh: DeviceMesh | None = None, expert_divide_factor: int = 1) -> nn.Module:
    """fully_shard each transformer block, then the root (embeddings, final norm, head).

    Under expert parallelism (``expert_mesh`` given) a block with experts first gets ``fully_shard``
    on its routed experts over ``expert_mesh`` (efsdp; the dp mesh without expert parallelism), their
    gradients divided by ``expert_divide_factor`` (the dense data-parallel degree: torchtitan's
    ``fsdp_gradient_divide_factor``) instead of the expert mesh's size, then on the block as usual
    (the dense parts over dp). The experts' shards split the expert dimension when there are at least
    as many local experts as efsdp ranks, else dim 1 (f of w1 / w3, h of w2), as torchtitan places
    them. Without expert parallelism the routed experts belong to their block's unit (sharded on dim
    0 over dp, padded where the experts do not divide it), as torchtitan's ``apply_fsdp`` wraps them
    only when ``ep_degree > 1`` and as the engine's parameter placement (``engine.model.params``) lays them.

    The flags are engine.wrapping's plan (blocks and root alike): ZeRO-2 keeps them gathered;
    ZeRO-3 follows ``parallel.fsdp_reshard_after_forward`` ("default" reshards except under PP,
    where per-microbatch all-gathers would not overlap; "always"; "never").
    """
    for block in model.layers.values():
        for moe in moe_modules(block) if expert_mesh is not None else ():
            mesh = expert_mesh
            # torchtitan's placement: split the expert dimension when every rank gets an expert, else dim 1
            dim = 0 if moe.experts.num_experts >= mesh.shape[-1] else 1  # the shard dim (HSDP: the last)
            fully_shard(moe.experts, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=mp_policy, shard_placement_fn=lambda _p, d=dim: Shard(d))
            # FSDP2 averages over the expert mesh; the mean over replicas divides by dp instead.
            # (set_gradient_divide_factor would do it with ReduceOp.PREMUL_SUM, which gloo lacks.)
            moe.experts.grad_scale = mesh.size() / expert_divide_factor
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=root_reshard_after_forward, mp_policy=mp_policy)
    return model


def dataparallel_refusal(cfg, cuda_devices: int) -> str | None:
    """Why a ``parallel.dp_mode = "dataparallel"`` run cannot start on this machine (None when it can).

    ``nn.DataParallel`` drives several CUDA GPUs from one process (the launcher starts one process
    for it: backend.launch.processes_for); it needs at least two CUDA GPUs, and ``parallel.dp`` of them.
    """
    n = cfg.parallel.dp
    if cuda_devices < 2 or cuda_devices < n:
        return (f"parallel.dp_mode = 'dataparallel' (legacy torch.nn.DataParallel) drives {n} CUDA GPUs from one "
                f"process, and this machine has {cuda_devices} CUDA GPU(s): it needs at least "
                f"{max(2, n)}. The prediction (GPU 0's extra load, the traffic through it, the step) is in "
                "shardscope predict; to train, use parallel.dp_mode = 'ddp' (DistributedDataParallel, one "
                "process per GPU: faster, balanced, and what PyTorch recommends)")
    return None


def apply_dataparallel(model: nn.Module, gpus: int) -> nn.Module:
    """Legacy single-process data parallelism over CUDA GPUs 0..gpus-1 (kept for comparison only).

    ``model`` must already live on cuda:0 (nn.DataParallel's source device); outputs gather there.
    """
    return nn.DataParallel(model, device_ids=list(range(gpus)), output_device=0)


def dataparallel_rows(before: list[int], after_forward: list[int], peak: list[int], exact: dict[str, int],
                      replica_param_bytes: int) -> list[dict[str, int]]:
    """Per-GPU memory categories of one nn.DataParallel step, from the CUDA allocator of each GPU.

    ``before`` / ``after_forward`` / ``peak``: ``torch.cuda.memory_allocated(i)`` before the step's
    forward, after its forward and loss (before backward), and ``max_memory_allocated(i)`` over the
    step (peak stats reset before it). ``exact``: the module's params / grads / optimizer bytes, all
    on GPU 0. Each row sums to that GPU's peak (when nothing is negative). The split:

    * GPU 0: params, grads, optimizer exact; overhead = what was allocated before the step besides
      params and optimizer state (buffers); activations = after_forward − before (replica 0's saved
      activations and the whole batch's gathered logits and loss); temporaries = the rest of the
      peak (the backward's transients: replica 0's gradients before the reduce-add, the logits'
      gradient), minus the ``.grad`` the reduce-add leaves.
    * GPU i > 0: params = the replica's broadcast copies (``replica_param_bytes``: the module's
      parameters, copied whole — a size, not a separate measurement); activations = after_forward −
      before − params; temporaries = peak − after_forward (the replica's gradients until they are
      reduce-added onto GPU 0, activation gradients: the allocator cannot tell these apart, so the
      replica's gradients are reported here, not in grads); overhead = what it held before the step;
      grads = optimizer = 0.
    """
    rows = []
    for i, (b, f, p) in enumerate(zip(before, after_forward, peak, strict=True)):
        row = dict.fromkeys(("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries",
                             "overhead"), 0)
        if i == 0:
            row.update({k: exact[k] for k in ("params", "grads", "optimizer")})
            row["overhead"] = max(0, b - exact["params"] - exact["optimizer"])
            row["activations"] = max(0, f - b)
            row["temporaries"] = max(0, p - f - exact["grads"])
        else:
            row["params"] = replica_param_bytes
            row["overhead"] = b
            row["activations"] = max(0, f - b - replica_param_bytes)
            row["temporaries"] = max(0, p - f)
        rows.append(row)
    return rows


def make_zero1_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], dp_group,
                         **kwargs) -> torch.optim.Optimizer:
    """ZeRO-1: each data-parallel rank keeps the optimizer state of its share of the parameters
    (torch's ZeroRedundancyOptimizer; for DTensor (TP) parameters, which it refuses,
    :class:`TensorParallelZeRO1`, the same partition of the local shards)."""
    params = list(params)
    if any(isinstance(p, DTensor) for p in params):
        return TensorParallelZeRO1(params, optimizer_cls, dp_group, **kwargs)
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, process_group=dp_group, **kwargs)


class TensorParallelZeRO1(torch.optim.Optimizer):
    """ZeRO-1 over the data-parallel group for DTensor (TP) parameters, which torch's
    ZeroRedundancyOptimizer refuses ("does not take DTensor"). The same partition as its
    ``_partition_parameters`` (whole tensors, largest first by the local shard's numel, a stable sort,
    each to the dp-rank with the fewest elements so far, the lowest on ties; engine.model.params.
    zero_redundancy_partition): each dp-rank keeps ``optimizer_class``'s state for its own and steps them
    (``optim``, as ZeroRedundancyOptimizer's), then every parameter's local shard is broadcast from its
    owner over the group, as its ``_sync_params``. The gradients are already reduced over dp (FSDP2's
    ``replicate``)."""

    def __init__(self, params: list[nn.Parameter], optimizer_class: type[torch.optim.Optimizer], group,
                 **defaults):
        import torch.distributed as dist

        self.group = group
        sizes = [0] * dist.get_world_size(group)
        owner: dict[int, int] = {}
        largest_first = sorted(params, key=lambda t: local_tensor(t).numel(), reverse=True)
        for p in largest_first:
            r = sizes.index(min(sizes))
            owner[id(p)] = r
            sizes[r] += local_tensor(p).numel()
        me = dist.get_rank(group)
        self.owners = [(p, dist.get_global_rank(group, owner[id(p)])) for p in params]
        # in the order ZeroRedundancyOptimizer gives its local optimizer (largest first): a for-loop
        # step's temporaries follow it (engine.memory.states.optimizer_step_term)
        mine = [p for p in largest_first if owner[id(p)] == me]
        super().__init__(params, defaults)
        if mine:  # else no state at all (measure reads ``optimizer.state``, empty)
            self.optim = optimizer_class(mine, **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist

        if hasattr(self, "optim"):
            self.optim.step()
        for p, src in self.owners:
            dist.broadcast(local_tensor(p), src=src, group=self.group)

