"""Data parallelism: DDP, ZeRO-1 (ZeroRedundancyOptimizer), ZeRO-2/3 and HSDP (fully_shard).

ZeRO-2 is ``fully_shard(reshard_after_forward=False)`` (parameters stay gathered between
forward and backward, gradients and optimizer state sharded); ZeRO-3 reshards after the
forward. HSDP: the same calls on the 2-D (dp_replicate, dp_shard) mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_group, bucket_cap_mb: float, device: torch.device) -> nn.Module:
    """Wrap in DistributedDataParallel over the data-parallel group (gradients all-reduced)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_group, bucket_cap_mb=bucket_cap_mb,
                                   device_ids=device_ids, broadcast_buffers=False)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """DDP semantics for DTensor (TP) parameters: FSDP2-based ``replicate`` on the dp mesh."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in model.layers.values():
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
    return replicate(model, mesh=dp_mesh, mp_policy=mp_policy)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero: int, mp_policy: MixedPrecisionPolicy,
               pipelined: bool = False) -> nn.Module:
    """fully_shard each transformer block, then the root. zero=2 keeps params gathered after forward."""
    reshard = zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    # The root holds embeddings / final norm / head; under PP the schedule drives its own
    # gradient sync, and resharding the root after forward would only add all-gathers.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard and not pipelined, mp_policy=mp_policy)
    return model


def dataparallel_refusal(cfg, cuda_devices: int) -> str:
    """Why a ``parallel.dp_mode = "dataparallel"`` run does not start on this machine (always a reason).

    ``nn.DataParallel`` drives several CUDA GPUs from one process; it needs at least two (and
    ``parallel.dp`` of them). Where they exist, the launcher still starts one process per GPU,
    which is DDP's model, so the run is refused there too until the launcher starts one process.
    """
    n = cfg.parallel.dp
    if cuda_devices < 2 or cuda_devices < n:
        return (f"parallel.dp_mode = 'dataparallel' (legacy torch.nn.DataParallel) drives {n} CUDA GPUs from one "
                f"process, and this machine has {cuda_devices} CUDA GPU(s): it needs at least "
                f"{max(2, n)}. The prediction (GPU 0's extra load, the traffic through it, the step) is in "
                "shardscope predict; to train, use parallel.dp_mode = 'ddp' (DistributedDataParallel, one "
                "process per GPU: faster, balanced, and what PyTorch recommends)")
    return ("parallel.dp_mode = 'dataparallel': the launcher starts one process per GPU (torchrun), while "
            "nn.DataParallel needs a single process driving all of them; run it as DDP "
            "(parallel.dp_mode = 'ddp'), or see engine.legacy_dp for the prediction")


def apply_dataparallel(model: nn.Module, gpus: int) -> nn.Module:
    """Legacy single-process data parallelism over CUDA GPUs 0..gpus-1 (kept for comparison only)."""
    return nn.DataParallel(model, device_ids=list(range(gpus)), output_device=0)


def make_zero1_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], dp_group,
                         **kwargs) -> ZeroRedundancyOptimizer:
    """ZeRO-1: each data-parallel rank keeps the optimizer state of its share of the parameters."""
    return ZeroRedundancyOptimizer(list(params), optimizer_class=optimizer_cls, process_group=dp_group,
                                   **kwargs)
