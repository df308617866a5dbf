"""What ShardScope's backend cannot run, whatever the machine: the layouts the engine predicts but no
run can check, which ``predict``, the planner and the window mark "predict only" with the reason.

The engine predicts every valid layout. These are the combinations torch's own APIs cannot compose
(``composition_problems``), the model fields the backend's model does not build
(``model_problems``) and the mixture-of-experts layouts its expert code does not run
(``moe_problem``); the backend refuses each with the same words before it builds anything
(backend.train.check_supported, backend.model.refuse_unsupported). Machine-dependent refusals
(DataParallel without two CUDA GPUs, QLoRA without bitsandbytes) stay with
the code that applies them. No torch import: the window and the CLI ask too.
"""

from __future__ import annotations

from engine.config import Config, ModelSpec
from engine.names import SPLIT_BACKWARD_SCHEDULES
from engine.wrapping import reshard_after_forward

#: model fields the backend's model does not build, with what each would need
UNBUILT_MODEL_FIELDS = {
    "qkv_bias": "biases on q, k and v only",
    "attention_sinks": "a learned sink logit per head",
    "sliding_window": "sliding-window attention masks",
}


def predict_only(cfg: Config) -> list[str]:
    """Why the backend cannot run ``cfg`` on any machine, in words (empty: it can): what the engine
    predicts for it no run can check."""
    out = model_problems(cfg.model) + composition_problems(cfg)
    why = moe_problem(cfg)
    return out + ([why] if why else [])


def model_problems(spec: ModelSpec) -> list[str]:
    """Each field of ``spec`` the backend's model does not build (the engine predicts it)."""
    out = []
    if spec.attention == "mla":
        out.append("model.attention = 'mla': the backend does not build multi-head latent attention; "
                   "allowed for a run: eager | flash")
    if spec.experts and spec.router_groups > 1:
        out.append(f"model.router_groups = {spec.router_groups}: the backend's router does not "
                   "limit routing to expert groups; allowed for a run: 1")
    for key, what in UNBUILT_MODEL_FIELDS.items():
        if getattr(spec, key):
            out.append(f"model.{key} = {getattr(spec, key)!r}: the backend does not build {what}; "
                       f"allowed for a run: {'0' if key == 'sliding_window' else 'false'}")
    return out


def moe_problem(cfg: Config) -> str | None:
    """Why the backend cannot run this mixture-of-experts layout (None when it can)."""
    par, m, tr = cfg.parallel, cfg.model, cfg.training
    if m.experts == 0:
        return None
    if par.ep == 1 and par.tp > 1:
        return ("model.experts with parallel.ep = 1 and parallel.tp > 1: the experts would be split by TP "
                "(expert tensor parallelism, torchtitan's etp = tp), which the backend does not apply; it runs "
                "experts unsplit by TP (etp = 1): set parallel.ep to a divisor of dp_shard·tp that TP ranks share, "
                f"e.g. parallel.ep = {par.tp}")
    if par.tp > 1 and par.sequence_parallel:
        return ("model.experts with parallel.sequence_parallel: the backend splits an MoE block's tokens over "
                "the TP ranks itself and does not run sequence-parallel norms around it; set "
                "parallel.sequence_parallel = false")
    if par.ep > 1 and par.zero == 1:
        return ("parallel.ep > 1 with parallel.zero = 1: ZeroRedundancyOptimizer partitions the state over the "
                "data-parallel ranks, which hold different experts; use parallel.zero = 0, 2 or 3")
    if tr.compile:
        return ("model.experts with training.compile: the expert loop's token counts change every step "
                "(dynamic shapes); set training.compile = false")
    if tr.finetune == "lora":
        return "model.experts with training.finetune = 'lora': LoRA adapters on experts are not built; use 'full'"
    if tr.float8 != "none":
        return "model.experts with training.float8: the grouped experts have no float8 path; set training.float8 = 'none'"
    if par.dp_mode == "dataparallel":
        return "model.experts with parallel.dp_mode = 'dataparallel': use 'ddp'"
    if par.cp > 1:
        return ("model.experts with parallel.cp > 1: the backend's context-parallel attention and its MoE dispatch "
                "have not been run together (the engine predicts the layout); set parallel.cp = 1 to run")
    if (tr.recompute == "selective-op" and par.pp > 1 and par.zero in (2, 3)
            and not reshard_after_forward(par.zero, par.fsdp_reshard_after_forward, True)):
        return ("model.experts with training.recompute = 'selective-op', parallel.pp > 1 and FSDP experts that stay "
                "gathered after their forward (zero = 2, or zero = 3 whose fsdp_reshard_after_forward is 'default' "
                "or 'never' under a pipeline): the routed experts are their own FSDP unit inside each block's "
                "checkpoint, a microbatch whose forward found them gathered all-gathers them again in its recompute, "
                "and torch's selective checkpoint replays the forward's ops by their count (torch/utils/checkpoint.py: "
                "\"invocation index ... encountered during backward but not found in storage\"; torchtitan issue "
                "3427); use zero = 3 with parallel.fsdp_reshard_after_forward = 'always', or training.recompute = "
                "'full', 'selective-layer', 'selective' or 'none'")
    if tr.recompute == "selective-op" and par.zero in (2, 3) and par.expert_shard_degree == 1:
        return ("model.experts with training.recompute = 'selective-op' and FSDP experts on one rank of their mesh "
                f"(parallel.zero = {par.zero}, efsdp = dp_shard·cp·tp / ep = 1): the routed experts are their own "
                "FSDP unit inside each block's checkpoint, and on a one-rank mesh the recompute's ops are not the "
                "forward's, which torch's selective checkpoint replays by their count (torch/utils/checkpoint.py: "
                "\"invocation index ... encountered during backward but not found in storage\"; measured on CPU "
                "ranks: dp 4 with ep 4, dp 2 with ep 2 and dp 1 failed, dp 4 with ep 2 ran); use an ep that leaves "
                "each expert on at least two data-parallel ranks (efsdp ≥ 2), parallel.zero = 0, or "
                "training.recompute = 'full', 'selective-layer', 'selective' or 'none'")
    if (tr.recompute == "selective-op" and par.pp > 1 and par.zero in (2, 3) and par.ep > 1
            and par.schedule in ("1F1B", "Interleaved1F1B")):
        return ("model.experts with training.recompute = 'selective-op', parallel.ep > 1 and parallel.schedule = "
                f"'{par.schedule}' over FSDP experts (parallel.zero = {par.zero}): a stage's backward runs after a "
                "later microbatch's forward, so the recompute finds the expert-parallel experts' FSDP unit in "
                "another state than the forward did and all-gathers it a different number of times, which torch's "
                "selective checkpoint replays by their count (torch/utils/checkpoint.py: \"invocation index ... "
                "encountered during backward but not found in storage\"; PyTorch's fix keeps FSDP2's all-gather "
                "internals out of the replay, pytorch/pytorch#196862; measured on CPU ranks: dp 4 ep 2 pp 2 ZeRO-3 "
                "resharding 'always' failed under 1F1B and Interleaved1F1B, ran under GPipe and LoopedBFS); use "
                "parallel.schedule = 'GPipe' or 'LoopedBFS', or training.recompute = 'full', 'selective-layer', "
                "'selective' or 'none'")
    return None


def composition_problems(cfg: Config) -> list[str]:
    """Each combination of ``cfg`` that torch's APIs cannot compose, in words, with what runs instead."""
    par, tr, out = cfg.parallel, cfg.training, []
    if tr.recompute == "selective-op" and par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES:
        out.append(f"training.recompute = 'selective-op' with parallel.schedule = {par.schedule!r}: a zero-bubble "
                   "schedule runs each block's backward twice (its input gradient, then its weight gradient), and "
                   "torch's selective activation checkpoint can be backwarded once only (torch/utils/checkpoint.py: "
                   "\"Trying to backward an extra time\"); use 'selective-layer', 'full' or 'none' with it, or a "
                   "schedule without a split backward")
    if cfg.model.tied_embeddings and par.tp > 1:
        out.append("tied embeddings with tp > 1 are not supported; set model.tied_embeddings = false")
    if tr.finetune == "lora" and par.tp > 1:
        out.append("LoRA with tp > 1: peft wraps nn.Linear, and the TP plan would have to shard its lora_A / "
                   "lora_B too; the engine predicts it, the backend runs LoRA with DDP, ZeRO-1, FSDP and PP")
    if par.async_tp is True:
        out.append("parallel.async_tp: torch's async TP (torch._inductor.config._micro_pipeline_tp after "
                   "enable_symm_mem_for_group on the TP group) rewrites the sequence-parallel all-gather + "
                   "matmul into symm_mem::fused_all_gather_matmul / fused_matmul_reduce_scatter over CUDA "
                   "symmetric memory; those ops have no CPU kernel and a CPU build cannot allocate the "
                   "symmetric-memory workspace (get_symm_mem_workspace), so gloo ranks cannot run it and the "
                   "backend does not apply it; set parallel.async_tp = false (the same training, TP collectives "
                   "not overlapped)")
    if (par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES and par.zero == 3
            and par.fsdp_reshard_after_forward == "always"):
        out.append(f"parallel.fsdp_reshard_after_forward = 'always' with parallel.schedule = {par.schedule!r}: torch's "
                   "stage_backward_input takes a stage's parameter groups from its parameters after the forward, "
                   "which FSDP2 has resharded back to DTensors that the autograd graph does not hold, so no block "
                   "of a later stage ever gets a weight gradient (measured in tests/backend/test_fsdp2_pipelining.py; "
                   "the first stage runs a full backward and trains); use 'default' or 'never' (no resharding "
                   "after forward under pipelining), or a schedule without a split backward")
    if tr.float8 in ("tensorwise", "rowwise") and tr.finetune == "lora":
        out.append("training.float8 with LoRA: peft wraps the same nn.Linear layers torchao swaps for "
                   "Float8Linear; the backend runs float8 on full fine-tuning only")
    return out
