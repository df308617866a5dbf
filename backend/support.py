"""What PyTorch's APIs cannot compose, whatever the machine (no torch import: the GUI asks too).

The engine predicts every valid layout; these are the ones the backend cannot run with torch's
own APIs. Machine-dependent refusals (DataParallel without two CUDA GPUs, QLoRA without
bitsandbytes) stay with the code that applies them.
"""

from __future__ import annotations

from engine.config import Config


def cp_rotate_refusal(cfg: Config, device_type: str) -> str | None:
    """Why ``parallel.cp_rotate`` cannot run on ``device_type`` ("cpu", "cuda"), or None.

    The ring (``"alltoall"``) is torch's ``context_parallel``, whose sharding strategies exist for
    the CUDA SDPA kernels only; elsewhere the backend runs the all-gather K/V variant."""
    par, model = cfg.parallel, cfg.model
    if par.cp == 1 or par.cp_rotate == "allgather" or (device_type == "cuda" and model.attention == "flash"):
        return None
    return (f"parallel.cp_rotate = {par.cp_rotate!r} on {device_type} with {model.attention} attention: torch's ring "
            "(alltoall) runs inside its context_parallel on the CUDA SDPA kernels (flash attention on CUDA) only; "
            "allowed here: 'allgather' (the all-gather K/V variant the backend runs on CPU and for eager attention)")


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
    tr = cfg.training
    if par.async_tp is True:
        out.append("parallel.async_tp: torch's async TP (torch._inductor.config._micro_pipeline_tp after "
                   "enable_symm_mem_for_group on the TP group) rewrites the sequence-parallel all-gather + "
                   "matmul into symm_mem::fused_all_gather_matmul / fused_matmul_reduce_scatter over CUDA "
                   "symmetric memory; those ops have no CPU kernel and a CPU build cannot allocate the "
                   "symmetric-memory workspace (get_symm_mem_workspace), so gloo ranks cannot run it and the "
                   "backend does not apply it; set parallel.async_tp = false (the same training, TP collectives "
                   "not overlapped)")
    if tr.float8 in ("tensorwise", "rowwise") and par.tp > 1:
        out.append("training.float8 with tp > 1: torchao's float8 tensor parallelism needs its own "
                   "Float8ColwiseParallel / Float8RowwiseParallel plan (float8 DTensor all-gathers), which "
                   "the backend's TP plan does not use; run float8 with DDP / FSDP / PP (tp = 1)")
    if tr.float8 in ("tensorwise", "rowwise") and tr.finetune == "lora":
        out.append("training.float8 with LoRA: peft wraps the same nn.Linear layers torchao swaps for "
                   "Float8Linear; the backend runs float8 on full fine-tuning only")
    return out
