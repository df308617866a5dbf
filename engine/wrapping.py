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
  root. ZeRO-2 never reshards after forward. ZeRO-3 follows ``parallel.fsdp_reshard_after_forward``
  as torchtitan's ``get_fsdp_reshard_after_forward_policy`` does: "default" reshards after forward
  except under pipelining (per-microbatch all-gathers there are expensive and not overlapped),
  "always" and "never" say so; blocks and root get the same flag.
* Under pipelining torch's ``PipelineStage.backward_maybe_with_nosync`` calls
  ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` before every
  backward (the schedule's REDUCE_GRAD reshards and reduce-scatters once at the end): FSDP2's
  parameters stay unsharded from a stage's first backward on (``unsharded_after_first_backward``)
  and its unsharded gradients accumulate over every microbatch. Wherever FSDP2 accumulates
  unsharded gradients without sync (pipelining; gradient accumulation with m > 1), its
  ``FSDPParam.to_accumulated_grad_if_needed`` keeps them in the reduce dtype when that differs
  from the parameter dtype (``grad_accumulation_dtype``: bf16 params with fp32 reduce: 4 B).
* float8 (torchao ``convert_to_float8_training``, ``training.float8``): the blocks' Linears run
  their matmuls in float8; with ``training.float8_all_gather`` FSDP2 casts each Linear weight's
  shard to float8 before gathering it (tensorwise scaling: one fp32 scale per weight), so it
  gathers and holds those weights in 1 byte (``all_gather_dtype`` "fp8"); norms, biases,
  embeddings and the head (torchtitan leaves "output" in high precision) stay in the compute dtype.
* dp·cp > 1 (the gradient group: context-parallel ranks reduce their gradients too) with TP
  parameters (DTensors), ZeRO-0 or -1: FSDP2's ``replicate`` — DDP semantics
  for DTensors, which ``DistributedDataParallel`` cannot take. ZeRO-1 with TP is refused by the
  backend (``ZeroRedundancyOptimizer`` takes no DTensors).
* dp·cp > 1 otherwise: ``DistributedDataParallel``; ZeRO-1 adds ``ZeroRedundancyOptimizer``.
  ZeRO-2 / -3 shard over (dp / replicate)·cp (torchtitan's dp_shard_cp mesh).
* Mixed precision is FSDP2's ``MixedPrecisionPolicy`` (param dtype = the 16-bit compute dtype,
  reduce dtype = ``training.grad_dtype``) wherever an FSDP2 wrapper holds the model, and
  ``torch.autocast`` everywhere else. Never both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.config import Config
from engine.names import DTYPE_BYTES
from engine.pipeline.schedules import pipeline_actions

#: ``WrappingPlan.data_parallel`` values.
DATA_PARALLEL_WRAPPERS = ("none", "ddp", "fully_shard", "replicate", "dataparallel")
#: ``WrappingPlan.mixed_precision`` values.
MIXED_PRECISION_KINDS = ("none", "autocast", "fsdp2-policy")

_COMPUTE_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
#: bytes per element of the dtypes a plan names (the shared table plus float8)
PLAN_DTYPE_BYTES: dict[str, int] = {**DTYPE_BYTES, "fp8": 1}


def reshard_after_forward(zero: int, policy: str, pipelined: bool) -> bool:
    """fully_shard's ``reshard_after_forward`` for ZeRO-2/3 under ``parallel.fsdp_reshard_after_forward``
    (names.RESHARD_POLICIES): ZeRO-2 never; ZeRO-3 "always", "never", or "default" = not pipelined."""
    if zero != 3:
        return False
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        return not pipelined
    raise ValueError(f"unknown reshard policy {policy!r}; allowed: default | always | never")


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
    reshard_policy: str = "default"  # parallel.fsdp_reshard_after_forward as the config gives it
    # FSDP2 under pipelining: parameters stay unsharded from a stage's first backward on, and the
    # unsharded gradients of every unit accumulate until the end of the step
    unsharded_after_first_backward: bool = False
    grad_accumulation_dtype: str | None = None  # dtype FSDP2 accumulates unsharded gradients in (None: no FSDP2)
    all_gather_dtype: str | None = None  # dtype FSDP2 gathers the blocks' Linear weights in (None: no FSDP2)
    float8: str = "none"  # names.FLOAT8_KINDS: torchao float8 Linears in the blocks

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
    def float8_all_gather(self) -> bool:
        """FSDP2 gathers the blocks' Linear weights in float8 (1 byte each, plus one fp32 scale)."""
        return self.all_gather_dtype == "fp8"

    @property
    def gathered_bytes(self) -> int:
        """Bytes per element FSDP2 gathers for everything that is not a float8 Linear weight."""
        return PLAN_DTYPE_BYTES[self.compute_dtype]

    @property
    def converts_gradients(self) -> bool:
        """FSDP2 accumulates unsharded gradients in another dtype than the parameters' (it converts each fresh
        gradient into it at a post-backward: ``FSDPParam.to_accumulated_grad_if_needed``)."""
        return self.grad_accumulation_dtype not in (None, self.compute_dtype)

    @property
    def grad_accumulation_bytes(self) -> int:
        """Bytes per element of FSDP2's unsharded gradients accumulated without sync."""
        return PLAN_DTYPE_BYTES[self.grad_accumulation_dtype or self.compute_dtype]

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
                    f"{'yes' if self.root_reshard_after_forward else 'no'} (policy {self.reshard_policy})")
        parts = [wrap]
        if self.unsharded_after_first_backward:
            parts.append("pipelined: unsharded from the first backward, gradients accumulated in "
                         f"{self.grad_accumulation_dtype}")
        if self.float8 != "none":
            parts.append(f"float8 Linears ({self.float8})" + (", float8 all-gather" if self.float8_all_gather else ""))
        if self.zero_redundancy_optimizer:
            parts.append("ZeroRedundancyOptimizer")
        parts.append({"none": "fp32", "autocast": f"torch.autocast({self.compute_dtype})",
                      "fsdp2-policy": f"MixedPrecisionPolicy(param {self.compute_dtype}, "
                                      f"reduce {self.reduce_dtype})"}[self.mixed_precision])
        return "; ".join(parts)


def data_parallel_wrapper(zero: int, dp_cp: int, tp: int) -> str:
    """The data-parallel wrapper of a ``ddp``-mode layout (DATA_PARALLEL_WRAPPERS): ZeRO-2/3 ``fully_shard``; over
    dp·cp ranks with TP, FSDP2's ``replicate`` (DTensor parameters); else DDP over dp·cp (context-parallel ranks too),
    or none."""
    if zero in (2, 3):
        return "fully_shard"
    if dp_cp > 1:
        return "replicate" if tp > 1 else "ddp"
    return "none"


def wrapping_plan(cfg: Config) -> WrappingPlan:
    """The wrapping plan of ``cfg`` (see the module docstring for the rules)."""
    par, tr = cfg.parallel, cfg.training
    pipelined = par.pp > 1
    dp_wrap = "dataparallel" if par.dp_mode == "dataparallel" else data_parallel_wrapper(par.zero, par.dp_cp, par.tp)
    sharded = dp_wrap == "fully_shard"
    fsdp2 = dp_wrap in ("fully_shard", "replicate")
    compute = _COMPUTE_DTYPE[tr.precision]
    reshard = reshard_after_forward(par.zero, par.fsdp_reshard_after_forward, pipelined) if sharded else None
    if compute == "fp32":
        mixed = "none"
    elif dp_wrap in ("fully_shard", "replicate"):
        mixed = "fsdp2-policy"
    else:
        mixed = "autocast"
    reduce = tr.grad_dtype if mixed == "fsdp2-policy" else "fp32"
    return WrappingPlan(
        data_parallel=dp_wrap,
        zero_redundancy_optimizer=par.zero == 1 and par.dp_cp > 1 and dp_wrap != "dataparallel",
        reshard_after_forward=reshard,
        root_reshard_after_forward=reshard,
        hsdp=sharded and par.replicate > 1,
        mixed_precision=mixed,
        compute_dtype=compute,
        # an FSDP2 policy reduces in grad_dtype; DDP and autocast reduce the gradients' own dtype,
        # which autocast keeps at the fp32 parameter dtype
        reduce_dtype=reduce,
        tensor_parallel=par.tp > 1,
        sequence_parallel=par.sequence_parallel,
        pipelined=pipelined,
        reshard_policy=par.fsdp_reshard_after_forward,
        unsharded_after_first_backward=fsdp2 and pipelined,
        # to_accumulated_grad_if_needed: the reduce dtype when it differs from the parameter dtype
        grad_accumulation_dtype=reduce if fsdp2 else None,
        all_gather_dtype=("fp8" if tr.float8_all_gather and sharded else compute) if fsdp2 else None,
        float8=tr.float8,
    )


def forwards_before_first_backward(schedule: str, pp_rank: int, pp: int, virtual_stages: int,
                                   microbatches: int) -> tuple[int, ...]:
    """Forwards each local stage of ``pp_rank`` runs before its own first backward (B or I), in local
    stage order, from ``engine.pipeline.schedules``' action lists. Under pipelining FSDP2 gathers a unit that
    reshards after forward once per such forward and once more in that first backward; from then on
    it stays unsharded. A stage also "holds a forward after its first backward" exactly when its
    count is below the microbatches (:func:`forward_after_first_backward`).
    """
    if pp == 1:
        return (microbatches,)
    return _forwards_before_first_backward(schedule, pp, virtual_stages, microbatches)[pp_rank]


@lru_cache(maxsize=1024)
def _forwards_before_first_backward(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:

    plan = pipeline_actions(schedule, pp, m, v)
    out = []
    for rank, actions in enumerate(plan.per_rank):
        stages = plan.stages_of_rank(rank)
        counts = dict.fromkeys(stages, 0)
        done: set[int] = set()
        for a in actions:
            if a.kind == "F" and a.stage not in done:
                counts[a.stage] += 1
            elif a.kind in ("B", "I"):
                done.add(a.stage)
        out.append(tuple(counts[s] for s in stages))
    return tuple(out)


def forward_after_first_backward(cfg: Config, pp_rank: int) -> bool:
    """Some local stage of ``pp_rank`` runs a forward after its first backward: under pipelining its
    peak (the most microbatches in flight) can come when FSDP2 already holds every unit unsharded."""
    par = cfg.parallel
    if par.pp == 1:
        return False
    counts = forwards_before_first_backward(par.schedule, pp_rank, par.pp, par.virtual_stages, par.microbatches)
    return any(c < par.microbatches for c in counts)
