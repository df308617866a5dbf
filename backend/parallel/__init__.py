"""One small ``apply_*`` function per strategy, composed on one DeviceMesh (pp, dp, [cp,] tp).

Order (torchtitan's): cut the pipeline stage -> LoRA -> TP -> CP -> recompute -> data parallel
(DDP / ZeRO-1 / FSDP / replicate / nn.DataParallel), composed by ``parallelize`` as the config's
wrapping plan (engine.wrapping) says. Every function uses PyTorch's own API for its strategy.
"""

from backend.parallel.context_parallel import ContextParallel, apply_cp
from backend.parallel.data_parallel import apply_ddp, apply_fsdp, apply_replicate, make_zero1_optimizer
from backend.parallel.dims import ParallelDims
from backend.parallel.parallelize import build_optimizer, parallelize
from backend.parallel.pipeline import apply_pp, build_schedule
from backend.parallel.precision import autocast_context, fsdp_mp_policy
from backend.parallel.recompute import apply_recompute
from backend.parallel.tensor_parallel import apply_tp

__all__ = [
    "ContextParallel",
    "ParallelDims",
    "apply_cp",
    "apply_ddp",
    "apply_fsdp",
    "apply_pp",
    "apply_recompute",
    "apply_replicate",
    "apply_tp",
    "autocast_context",
    "build_optimizer",
    "build_schedule",
    "fsdp_mp_policy",
    "make_zero1_optimizer",
    "parallelize",
]
