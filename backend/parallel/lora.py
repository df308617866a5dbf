"""LoRA / QLoRA with Hugging Face ``peft``: adapters on our module names, the base frozen.

``apply_lora`` runs after the pipeline cut and before data parallelism (DDP / ZeRO-1 / FSDP2),
like any ``apply_*``: ``peft.get_peft_model`` injects ``lora_A`` / ``lora_B`` into the Linears
``engine.model.lora.target_modules`` names (wq, wk, wv, wo / w1, w3, w2) *in place* and freezes every
other parameter, so the module returned is still our Transformer (its ``layers`` ModuleDict is
what ``apply_fsdp`` wraps). Adapters stay fp32 (peft's ``autocast_adapter_dtype``); the frozen
base is cast to bf16 when ``training.lora_base_dtype = "bf16"``, or its block Linears replaced by
bitsandbytes' ``Linear4bit`` (nf4, double quantisation) for ``"nf4"`` — CUDA only.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelSpec, TrainingSpec
from engine.model.lora import NF4_BLOCK, target_modules


def lora_refusal(training: TrainingSpec, cuda: bool) -> str | None:
    """Why this machine cannot run the LoRA part of a config (None when it can)."""
    if training.finetune != "lora":
        return None
    try:
        import peft  # noqa: F401
    except ImportError:
        return "training.finetune = 'lora' needs the peft package: pip install peft (it is in pyproject.toml)"
    if training.lora_base_dtype == "nf4":
        if not cuda:
            return ("training.lora_base_dtype = 'nf4' (QLoRA) needs bitsandbytes' 4-bit kernels on a CUDA GPU, and this "
                    "machine has none; the engine still predicts it (shardscope predict). To run here use "
                    "lora_base_dtype = 'fp32' (or 'bf16' with precision bf16-mixed)")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return "training.lora_base_dtype = 'nf4' needs bitsandbytes: pip install bitsandbytes"
    return None


def _quantise_nf4(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Replace every block Linear by bitsandbytes' Linear4bit (nf4, double-quantised), as QLoRA does."""
    import bitsandbytes as bnb

    blocks = getattr(model, "layers", {})
    for block in blocks.values():
        for child in list(block.modules()):
            for attr, lin in list(child.named_children()):
                if type(lin) is nn.Linear:
                    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                          compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                          device="cpu")
                    q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True, blocksize=NF4_BLOCK)
                    if lin.bias is not None:
                        q.bias = nn.Parameter(lin.bias.data.cpu(), requires_grad=False)
                    setattr(child, attr, q.to(lin.weight.device))  # .to(cuda) quantises


def apply_lora(model: nn.Module, spec: ModelSpec, training: TrainingSpec) -> nn.Module:
    """Inject peft LoRA adapters into ``model`` (a Transformer or a pipeline stage of one); returns it."""
    from peft import LoraConfig, get_peft_model

    base = training.lora_base_dtype
    compute = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(training.precision, torch.float32)
    if base == "nf4":
        _quantise_nf4(model, compute)
    config = LoraConfig(r=training.lora_rank, lora_alpha=training.lora_alpha,
                        target_modules=target_modules(spec, training.lora_targets), lora_dropout=0.0, bias="none")
    wrapped = get_peft_model(model, config)
    inner = wrapped.base_model.model  # our module, adapters injected in place, base frozen
    if base == "bf16":
        for p in inner.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return inner


def trainable(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters the optimizer steps (the adapters under LoRA; all of them otherwise)."""
    return [p for p in params if p.requires_grad]
