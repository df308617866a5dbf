"""DeepSpeed's JSON config ↔ ShardScope.

Read as DeepSpeed documents it (deepspeed.ai/docs/config-json, ``deepspeed/runtime/config.py``): the batch
(``train_batch_size`` = ``train_micro_batch_size_per_gpu`` × ``gradient_accumulation_steps`` × data-parallel ranks),
``zero_optimization.stage``, ``bf16`` / ``fp16``, ``communication_data_type``, the optimizer and AutoTP's
``tensor_parallel.autotp_size``. Offload of parameters, optimizer states or checkpoints to CPU or NVMe is refused
by name (ShardScope does not model it). ``"auto"`` (Hugging Face Trainer's placeholder) counts as not given.

DeepSpeed's ZeRO stages are modelled as PyTorch's — ZeroRedundancyOptimizer for stage 1, ``fully_shard`` without
and with resharding for stages 2 and 3 — which hold the same states; DeepSpeed's own buckets
(``reduce_bucket_size``, ``allgather_bucket_size``, ``stage3_prefetch_bucket_size``) are not, and the import says so.
The model, the sequence and the card are not in the file: the import takes them as ShardScope fields.
"""

from __future__ import annotations

import json
from typing import Any

from engine.config import Config
from engine.interop import Exported, Imported, InteropError, build_config

_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "fusedadam": "adamw", "sgd": "sgd-momentum"}
_IGNORED = {"steps_per_print", "wall_clock_breakdown", "gradient_clipping", "prescale_gradients",
            "gradient_predivide_factor", "dump_state", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
            "scheduler", "checkpoint", "memory_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
            "aio", "comms_logger", "elasticity", "seed", "data_efficiency", "curriculum_learning", "amp",
            "_comment", "_not_expressed"}
_ZERO_IGNORED = {"stage", "offload_optimizer", "offload_param", "overlap_comm", "contiguous_gradients",
                 "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save", "sub_group_size",
                 "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
                 "memory_efficient_linear", "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
                 "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"}
_BUCKETS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "reduce_scatter",
            "allgather_partitions")


def _given(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    return None if value == "auto" else value


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") in (True, "true", "auto")


def read_deepspeed(text: str) -> dict[str, Any]:
    """The fields of a DeepSpeed JSON config ShardScope reads: zero, accumulation, micro-batch, batch, precision,
    grad dtype, optimizer, tp, and the notes (what does not carry over)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InteropError(f"not a DeepSpeed config (JSON): {exc}") from None
    if not isinstance(raw, dict):
        raise InteropError("not a DeepSpeed config: the file must hold a JSON object")
    notes: list[str] = []
    zero_cfg = raw.get("zero_optimization") or {}
    if not isinstance(zero_cfg, dict):
        raise InteropError(f"DeepSpeed zero_optimization = {zero_cfg!r}: allowed an object")
    for key in ("offload_optimizer", "offload_param"):
        device = str((zero_cfg.get(key) or {}).get("device", "none")).lower()
        if device not in ("none", ""):
            raise InteropError(f"DeepSpeed zero_optimization.{key}.device = {device!r}: ShardScope does not model "
                               "offload (allowed none)")
    if (raw.get("activation_checkpointing") or {}).get("cpu_checkpointing"):
        raise InteropError("DeepSpeed activation_checkpointing.cpu_checkpointing = true: ShardScope does not model "
                           "offload (allowed false)")
    stage = zero_cfg.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise InteropError(f"DeepSpeed zero_optimization.stage = {stage!r}: allowed 0, 1, 2, 3")
    if stage:
        notes.append(f"zero_optimization.stage = {stage}: DeepSpeed's ZeRO modelled as PyTorch's (ZeroRedundancyOptimizer"
                     ", fully_shard); its buckets are not")
    for key in _BUCKETS:
        if key in zero_cfg:
            notes.append(f"zero_optimization.{key} = {zero_cfg[key]!r}: DeepSpeed's buckets are not modelled")
    for key in sorted(set(zero_cfg) - _ZERO_IGNORED - set(_BUCKETS)):
        notes.append(f"zero_optimization.{key} = {zero_cfg[key]!r}: ShardScope has no equivalent")
    if _enabled(raw.get("fp16")) and _enabled(raw.get("bf16")):
        raise InteropError("DeepSpeed fp16.enabled and bf16.enabled are both true: allowed one of them")
    precision = "fp16-mixed" if _enabled(raw.get("fp16")) else ("bf16-mixed" if _enabled(raw.get("bf16")) else "fp32")
    comm = _given(raw, "communication_data_type")
    grad = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", None: None}.get(comm, "?")
    if grad == "?":
        raise InteropError(f"DeepSpeed communication_data_type = {comm!r}: allowed fp32, fp16, bf16")
    opt = raw.get("optimizer") or {}
    name = str(opt.get("type", "AdamW")) if isinstance(opt, dict) else "AdamW"
    optimizer = _OPTIMIZERS.get(name.lower())
    if optimizer is None:
        notes.append(f"optimizer.type = {name!r}: modelled as adamw (ShardScope models AdamW, SGD)")
        optimizer = "adamw"
    elif name.lower() in ("adam", "fusedadam"):
        notes.append(f"optimizer.type = {name!r}: modelled as adamw (the same two moments a parameter)")
    tp = int(((raw.get("tensor_parallel") or {}).get("autotp_size")) or 1)
    for key in sorted(set(raw) - _IGNORED - {"train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps", "zero_optimization", "fp16", "bf16",
                                            "communication_data_type", "optimizer", "tensor_parallel",
                                            "activation_checkpointing", "data_types"}):
        notes.append(f"{key} = {raw[key]!r}: ShardScope has no equivalent")
    return {"zero": stage, "accumulation": _given(raw, "gradient_accumulation_steps"),
            "micro": _given(raw, "train_micro_batch_size_per_gpu"), "batch": _given(raw, "train_batch_size"),
            "precision": precision, "grad_dtype": grad, "optimizer": optimizer, "tp": tp, "notes": notes,
            "ignored": tuple(sorted(k for k in raw if k in _IGNORED))}


def _batch(ds: dict[str, Any], gpus: int | None) -> tuple[int, int, int]:
    """(micro-batch, accumulation, data-parallel ranks) from what the file gives and the world size, as
    DeepSpeed's ``_configure_train_batch_size`` completes the three."""
    micro, acc, batch, tp = ds["micro"], ds["accumulation"], ds["batch"], ds["tp"]
    dp = gpus // tp if gpus else None
    if gpus and gpus % tp:
        raise InteropError(f"DeepSpeed tensor_parallel.autotp_size = {tp}: allowed a divisor of the world size {gpus}")
    if batch and micro and acc:
        if dp is None:
            dp = batch // (micro * acc)
        if batch != micro * acc * dp:
            raise InteropError(f"DeepSpeed train_batch_size = {batch}: allowed train_micro_batch_size_per_gpu {micro} "
                               f"× gradient_accumulation_steps {acc} × data-parallel ranks {dp}")
        return micro, acc, dp
    if dp is None:
        raise InteropError("the world size: DeepSpeed's config does not hold it; give --gpus N")
    if batch and micro:
        acc = batch // (micro * dp)
    elif batch and acc:
        micro = batch // (acc * dp)
    micro, acc = micro or 1, acc or 1
    if batch and batch != micro * acc * dp:
        raise InteropError(f"DeepSpeed train_batch_size = {batch}: allowed a multiple of the {dp} data-parallel ranks")
    return micro, acc, dp


def import_deepspeed(text: str, *, gpus: int | None = None, extra: dict[str, dict[str, Any]] | None = None,
                     cluster: dict[str, Any] | None = None) -> Imported:
    """A DeepSpeed JSON config as a ShardScope config; ``gpus``: the world size (the launcher's, not the file's)."""
    ds = read_deepspeed(text)
    micro, acc, dp = _batch(ds, gpus)
    extra = {k: dict(v) for k, v in (extra or {}).items()}
    assumed: list[str] = []
    if ds["micro"] is None and ds["batch"] is None and "micro_batch_size" not in extra.get("training", {}):
        extra.setdefault("training", {})["micro_batch_size"] = 1
        assumed.append("training.micro_batch_size = 1: the file gives no batch (--set training.micro_batch_size=N)")
    parallel = {"dp": dp, "tp": ds["tp"], "zero": ds["zero"], "microbatches": acc}
    training: dict[str, Any] = {"micro_batch_size": micro, "precision": ds["precision"], "optimizer": ds["optimizer"]}
    if ds["grad_dtype"] and ds["precision"] != "fp32":
        training["grad_dtype"] = ds["grad_dtype"]
    got = build_config(parallel, training, dp * ds["tp"], min(8, dp * ds["tp"]), dict(cluster or {}), extra, "DeepSpeed",
                 list(ds["notes"]), assumed, ds["ignored"])
    return got


def export_deepspeed(cfg: Config) -> Exported:
    """The layout as a DeepSpeed JSON config (the fields DeepSpeed's file holds; the rest named)."""
    par, tr = cfg.parallel, cfg.training
    notes: list[str] = []
    # DeepSpeed takes the data-parallel ranks as world / autotp_size: the pipeline's and context-parallel ranks
    # (which its file cannot say) count as data parallel there
    out: dict[str, Any] = {
        "train_batch_size": tr.micro_batch_size * par.microbatches * par.dp * par.pp * par.cp,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": par.microbatches,
        "zero_optimization": {"stage": par.zero, "offload_optimizer": {"device": "none"},
                              "offload_param": {"device": "none"}},
        "optimizer": {"type": "AdamW" if tr.optimizer == "adamw" else "SGD"},
    }
    if tr.precision == "bf16-mixed":
        out["bf16"] = {"enabled": True}
    elif tr.precision == "fp16-mixed":
        out["fp16"] = {"enabled": True}
    if tr.precision != "fp32":
        out["communication_data_type"] = tr.grad_dtype
    if par.tp > 1:
        out["tensor_parallel"] = {"autotp_size": par.tp}
        if par.sequence_parallel or par.async_tp:
            notes.append("parallel.sequence_parallel = true: DeepSpeed's AutoTP shards the Linears only")
    if tr.optimizer == "sgd":
        notes.append("training.optimizer = sgd: DeepSpeed's SGD keeps momentum")
    for field, value, why in (
            ("parallel.pp", par.pp, "DeepSpeed's pipeline is the model's (PipelineModule), not the file's; its ranks "
                                    "are written as data parallel"),
            ("parallel.cp", par.cp, "DeepSpeed's sequence parallelism (Ulysses) is not torch's context parallel; its "
                                    "ranks are written as data parallel"),
            ("parallel.ep", par.ep, "DeepSpeed-MoE's expert parallelism is the model's, not the file's"),
            ("parallel.replicate", par.replicate, "DeepSpeed's hpZ is not HSDP")):
        if value > 1:
            notes.append(f"{field} = {value}: {why}")
    if par.dp_mode != "ddp":
        notes.append(f"parallel.dp_mode = {par.dp_mode}: DeepSpeed runs one process a GPU")
    if par.zero == 3 and par.fsdp_reshard_after_forward == "never":
        notes.append("parallel.fsdp_reshard_after_forward = never: DeepSpeed's stage 3 reshards")
    if tr.recompute != "none":
        notes.append(f"training.recompute = {tr.recompute}: the model's (gradient checkpointing), not the file's")
    if tr.float8 != "none":
        notes.append(f"training.float8 = {tr.float8}: not in DeepSpeed's config")
    if tr.compile:
        notes.append("training.compile = true: DeepSpeed's compile is the engine's call (engine.compile())")
    if tr.finetune != "full":
        notes.append("training.finetune = lora: the model's (peft)")
    head = {"_comment": f"A ShardScope layout as DeepSpeed's config: {cfg.model.preset or 'custom model'}, sequence "
                        f"{cfg.model.seq_len}, on {cfg.cluster.gpus} GPUs (deepspeed --num_gpus "
                        f"{min(cfg.cluster.gpus, cfg.cluster.gpus_per_node)} --num_nodes {cfg.cluster.nodes})",
            **({"_not_expressed": notes} if notes else {})}
    return Exported(json.dumps({**head, **out}, indent=2) + "\n", tuple(notes))
