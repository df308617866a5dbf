"""How a config is wrapped for training: one pure plan, read by the engine and the backend.

Which torch wrapper holds the model's data-parallel replicas (DDP, FSDP2's ``fully_shard`` with
its reshard policy, FSDP2's ``replicate``, legacy ``nn.DataParallel``, or none), whether the
optimizer state is sharded by ``ZeroRedundancyOptimizer``, and how mixed precision is done
(``torch.autocast`` around the forward and loss, or FSDP2's ``MixedPrecisionPolicy`` casting the
parameters it gathers) with which reduce dtype. The memory model, the step model and the
backend's ``parallelize`` all read this plan, so what is predicted is what runs.

The rules (torch 2.13's APIs decide them):
* ``parallel.dp_mode = "dataparallel"``: ``nn.DataParallel`` over the node's GPUs, autocast.
* ZeRO-2 / ZeRO-3 (any dp, HSDP when ``replicate`` > 1): ``fully_shard`` per block and on the
  root; ZeRO-3 reshards after forward, ZeRO-2 does not; under pipelining the root is never
  resharded after forward (the schedule drives its gradient sync, resharding adds all-gathers).
* dp > 1 with TP parameters (DTensors), ZeRO-0 or -1: FSDP2's ``replicate`` — DDP semantics
  for DTensors, which ``DistributedDataParallel`` cannot take. ZeRO-1 with TP is refused by the
  backend (``ZeroRedundancyOptimizer`` takes no DTensors).
* dp > 1 otherwise: ``DistributedDataParallel``; ZeRO-1 adds ``ZeroRedundancyOptimizer``.
* Mixed precision is FSDP2's ``MixedPrecisionPolicy`` (param dtype = the 16-bit compute dtype,
  reduce dtype = ``training.grad_dtype``) wherever an FSDP2 wrapper holds the model, and
  ``torch.autocast`` everywhere else. Never both.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import Config

#: ``WrappingPlan.data_parallel`` values.
DATA_PARALLEL_WRAPPERS = ("none", "ddp", "fully_shard", "replicate", "dataparallel")
#: ``WrappingPlan.mixed_precision`` values.
MIXED_PRECISION_KINDS = ("none", "autocast", "fsdp2-policy")

_COMPUTE_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}


@dataclass(frozen=True)
class WrappingPlan:
    """How one config's model is wrapped; every field is a plain name or flag (no torch)."""

    data_parallel: str  # DATA_PARALLEL_WRAPPERS
    zero_redundancy_optimizer: bool  # ZeRO-1: ZeroRedundancyOptimizer shards the optimizer state
    reshard_after_forward: bool | None  # fully_shard's policy for the blocks (None: no fully_shard)
    root_reshard_after_forward: bool | None  # ... for the root (embeddings, final norm, head)
    hsdp: bool  # fully_shard on the 2-D (replicate, shard) mesh
    mixed_precision: str  # MIXED_PRECISION_KINDS
    compute_dtype: str  # fp32 | bf16 | fp16: the dtype matmuls run in
    reduce_dtype: str  # dtype the data-parallel gradient reduction runs in
    tensor_parallel: bool
    sequence_parallel: bool
    pipelined: bool

    @property
    def fsdp2(self) -> bool:
        """An FSDP2 wrapper (``fully_shard`` or ``replicate``) holds the model."""
        return self.data_parallel in ("fully_shard", "replicate")

    @property
    def autocast(self) -> bool:
        return self.mixed_precision == "autocast"

    @property
    def sharded(self) -> bool:
        """``fully_shard`` holds the model (parameters, gradients and optimizer state sharded)."""
        return self.data_parallel == "fully_shard"

    @property
    def optimizer_sharded(self) -> bool:
        """Each data-parallel rank steps only its shard of the optimizer state (ZeRO-1, -2, -3)."""
        return self.zero_redundancy_optimizer or self.sharded

    @property
    def legacy(self) -> bool:
        """Legacy ``nn.DataParallel``: one process drives the node's GPUs."""
        return self.data_parallel == "dataparallel"

    def describe(self) -> str:
        """The plan in one line, as the explainer and the run log show it."""
        wrap = {"none": "no data-parallel wrapper", "ddp": "DistributedDataParallel",
                "replicate": "FSDP2 replicate (DDP semantics for TP DTensors)",
                "dataparallel": "nn.DataParallel (one process, legacy)"}.get(self.data_parallel)
        if self.data_parallel == "fully_shard":
            wrap = (f"fully_shard{' (HSDP)' if self.hsdp else ''}, reshard after forward: blocks "
                    f"{'yes' if self.reshard_after_forward else 'no'}, root "
                    f"{'yes' if self.root_reshard_after_forward else 'no'}")
        parts = [wrap]
        if self.zero_redundancy_optimizer:
            parts.append("ZeroRedundancyOptimizer")
        parts.append({"none": "fp32", "autocast": f"torch.autocast({self.compute_dtype})",
                      "fsdp2-policy": f"MixedPrecisionPolicy(param {self.compute_dtype}, "
                                      f"reduce {self.reduce_dtype})"}[self.mixed_precision])
        return "; ".join(parts)


def wrapping_plan(cfg: Config) -> WrappingPlan:
    """The wrapping plan of ``cfg`` (see the module docstring for the rules)."""
    par, tr = cfg.parallel, cfg.training
    pipelined = par.pp > 1
    if par.dp_mode == "dataparallel":
        dp_wrap = "dataparallel"
    elif par.zero in (2, 3):
        dp_wrap = "fully_shard"
    elif par.dp > 1 and par.tp > 1:
        dp_wrap = "replicate"
    elif par.dp > 1:
        dp_wrap = "ddp"
    else:
        dp_wrap = "none"
    sharded = dp_wrap == "fully_shard"
    compute = _COMPUTE_DTYPE[tr.precision]
    if compute == "fp32":
        mixed = "none"
    elif dp_wrap in ("fully_shard", "replicate"):
        mixed = "fsdp2-policy"
    else:
        mixed = "autocast"
    return WrappingPlan(
        data_parallel=dp_wrap,
        zero_redundancy_optimizer=par.zero == 1 and par.dp > 1 and dp_wrap != "dataparallel",
        reshard_after_forward=(par.zero == 3) if sharded else None,
        root_reshard_after_forward=(par.zero == 3 and not pipelined) if sharded else None,
        hsdp=sharded and par.replicate > 1,
        mixed_precision=mixed,
        compute_dtype=compute,
        # an FSDP2 policy reduces in grad_dtype; DDP and autocast reduce the gradients' own dtype,
        # which autocast keeps at the fp32 parameter dtype
        reduce_dtype=tr.grad_dtype if mixed == "fsdp2-policy" else "fp32",
        tensor_parallel=par.tp > 1,
        sequence_parallel=par.sequence_parallel,
        pipelined=pipelined,
    )
