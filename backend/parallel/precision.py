"""Precision: bf16/fp16 mixed via FSDP's MixedPrecisionPolicy, else torch.autocast."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from engine.config import TrainingSpec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COMPUTE = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def fsdp_mp_policy(training: TrainingSpec) -> MixedPrecisionPolicy:
    """fp32 -> no policy; mixed -> low-precision compute params, reduce in grad_dtype."""
    if training.precision not in _COMPUTE:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=_COMPUTE[training.precision],
                                reduce_dtype=_DTYPES[training.grad_dtype])


def autocast_context(training: TrainingSpec, device_type: str, fsdp: bool):
    """Autocast for the non-FSDP strategies under mixed precision (FSDP casts by its policy)."""
    if training.precision not in _COMPUTE or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_COMPUTE[training.precision])
