"""Precision, as the wrapping plan says: FSDP2's MixedPrecisionPolicy, torch.autocast, or neither.

``engine.wrapping.WrappingPlan.mixed_precision`` decides: ``"fsdp2-policy"`` (an FSDP2 wrapper,
``fully_shard`` or ``replicate``, casts the parameters it gathers to the compute dtype and reduces
gradients in the reduce dtype), ``"autocast"`` (everything else under mixed precision), ``"none"``
(fp32). Never both casts at once.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from engine.wrapping import WrappingPlan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(plan: WrappingPlan) -> torch.dtype:
    """The dtype the matmuls run in (fp32, or the 16-bit dtype of mixed precision)."""
    return DTYPES[plan.compute_dtype]


def fsdp_mp_policy(plan: WrappingPlan) -> MixedPrecisionPolicy:
    """The FSDP2 policy of the plan: compute-dtype parameters, reduce in the plan's reduce dtype
    (the default policy, no casts, unless the plan's mixed precision is ``"fsdp2-policy"``)."""
    if plan.mixed_precision != "fsdp2-policy":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[plan.compute_dtype], reduce_dtype=DTYPES[plan.reduce_dtype])


def autocast_context(plan: WrappingPlan, device_type: str):
    """``torch.autocast`` in the compute dtype where the plan's mixed precision is ``"autocast"``."""
    if plan.mixed_precision != "autocast":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[plan.compute_dtype])
