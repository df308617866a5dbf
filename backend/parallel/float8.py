"""Float8 training of the blocks' Linear layers with torchao (``training.float8``).

As torchtitan's ``Float8LinearConverter`` does it: ``torchao.float8.convert_to_float8_training``
swaps ``nn.Linear`` for ``Float8Linear`` with the recipe named by the config ("tensorwise" or
"rowwise" scaling), skipping every Linear with a dimension not divisible by 16 (the float8
matmul's alignment) and the output head (torchtitan filters it by name in its large configs:
the vocabulary projection stays in bf16). ``training.float8_all_gather`` turns on torchao's
``enable_fsdp_float8_all_gather`` (FSDP2 all-gathers the weights already cast to float8;
tensorwise only), and then the scales of the next step's weights are precomputed after every
optimizer step with ``precompute_float8_dynamic_scale_for_fsdp`` (one all-reduce for all of
them instead of one per weight), as torchtitan's float8 post-optimizer hook does.

Conversion happens first, on the whole stage module, before TP / recompute / compile / FSDP
wrap it (torchtitan converts at model build). Float8 runs under bf16 (autocast, or FSDP2's bf16
parameters): engine.config refuses it otherwise. torchao's CUDA-only extensions are not needed:
``torch._scaled_mm`` has a CPU kernel.
"""

from __future__ import annotations

import warnings

from torch import nn

FLOAT8_ALIGNMENT = 16


def float8_config(kind: str, all_gather: bool):
    """torchao's Float8LinearConfig for ``training.float8`` = ``kind``."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    if kind not in ("tensorwise", "rowwise"):
        raise ValueError(f"training.float8 must be tensorwise | rowwise to convert, got {kind!r}")
    cfg = Float8LinearConfig.from_recipe_name(kind)
    if all_gather:
        cfg = dataclasses.replace(cfg, enable_fsdp_float8_all_gather=True)
    return cfg


def converts(module: nn.Module, fqn: str) -> bool:
    """Which Linears become Float8Linear: inside a transformer block, every dimension a multiple of 16."""
    if not isinstance(module, nn.Linear):
        return False
    return (fqn.startswith("layers.") and module.in_features % FLOAT8_ALIGNMENT == 0
            and module.out_features % FLOAT8_ALIGNMENT == 0)


def apply_float8(model: nn.Module, kind: str, all_gather: bool = False) -> None:
    """Swap the block Linears of ``model`` (a Transformer or a pipeline stage) for torchao's Float8Linear."""
    if kind == "none":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's CUDA extensions do not load on a CPU build
        from torchao.float8 import convert_to_float8_training
    convert_to_float8_training(model, config=float8_config(kind, all_gather), module_filter_fn=converts)


def precompute_scales(modules: list[nn.Module]) -> None:
    """After the optimizer step: the float8 scales of FSDP2's float8-gathered weights, in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for m in modules:
        precompute_float8_dynamic_scale_for_fsdp(m)


def float8_linear_count(model: nn.Module) -> int:
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())
