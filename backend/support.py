"""What PyTorch's APIs cannot compose, whatever the machine (no torch import: the GUI asks too).

The engine predicts every valid layout; these are the ones the backend cannot run with torch's
own APIs. Machine-dependent refusals (DataParallel without two CUDA GPUs, QLoRA without
bitsandbytes) stay with the code that applies them.
"""

from __future__ import annotations

from engine.config import Config


def composition_problems(cfg: Config) -> list[str]:
    """Each combination of ``cfg`` that torch's APIs cannot compose, in words, with what runs instead."""
    par, out = cfg.parallel, []
    if par.zero == 1 and par.tp > 1:
        out.append("ZeRO-1 with tp > 1: torch's ZeroRedundancyOptimizer does not take DTensor (TP) "
                   "parameters; use parallel.zero = 2 (fully_shard) with TP")
    if cfg.model.tied_embeddings and par.tp > 1:
        out.append("tied embeddings with tp > 1 are not supported; set model.tied_embeddings = false")
    if cfg.training.finetune == "lora" and par.tp > 1:
        out.append("LoRA with tp > 1: peft wraps nn.Linear, and the TP plan would have to shard its lora_A / "
                   "lora_B too; the engine predicts it, the backend runs LoRA with DDP, ZeRO-1, FSDP and PP")
    return out
