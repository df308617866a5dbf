"""Hugging Face accelerate's config file (``accelerate config`` → ``default_config.yaml``) ↔ ShardScope.

accelerate's file says how the processes run — ``distributed_type`` (NO, MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED),
``num_processes`` over ``num_machines``, ``mixed_precision``, ``fsdp_config`` (version 1 or 2),
``deepspeed_config``, ``parallelism_config`` (HSDP, TP, CP sizes) and ``dynamo_config`` — but not the model, the
batch or the sequence, which live in the training script: the import takes those as ShardScope fields
(``extra``: the model preset or Hugging Face config, ``training.micro_batch_size``, ``model.seq_len``) and names
every one it had to assume.

The mapping, from accelerate 1.x (``commands/config/cluster.py``, ``utils/launch.py``) and what torch does with it:
FSDP version 2 is ``fully_shard``: ``fsdp_reshard_after_forward`` true is ZeRO-3, false ZeRO-2 (ShardScope's
ZeRO-2 *is* ``fully_shard(reshard_after_forward=False)``); version 1's ``FULL_SHARD`` / ``SHARD_GRAD_OP`` /
``NO_SHARD`` / ``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2`` are ZeRO-3 / ZeRO-2 / DDP / ZeRO-3 and ZeRO-2 replicated
over the machines. ``fsdp_activation_checkpointing`` checkpoints every wrapped block (full recompute).
``mixed_precision: fp8`` with the torchao backend is torchao's float8 (tensorwise, its default config).
DeepSpeed's ZeRO stages are modelled as PyTorch's (ZeroRedundancyOptimizer, FSDP2): its buckets are not.
"""

from __future__ import annotations

from typing import Any

from engine.config import Config
from engine.interop import Imported, InteropError, build_config
from engine.interop.deepspeed import read_deepspeed

_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED")
_SHARDING_V1 = {"FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False),
                "HYBRID_SHARD": (3, True), "HYBRID_SHARD_ZERO2": (2, True)}
_PRECISION = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed", "fp8": "bf16-mixed"}
#: keys that bear on neither memory nor step time
_IGNORED = {"compute_environment", "machine_rank", "main_process_ip", "main_process_port", "main_training_function",
            "rdzv_backend", "same_network", "gpu_ids", "enable_cpu_affinity", "debug", "downcast_bf16", "tpu_env",
            "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
            "fsdp_sync_module_states", "fsdp_use_orig_params", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
            "zero3_save_16bit_model", "zero3_init_flag", "gradient_clipping", "deepspeed_multinode_launcher",
            "deepspeed_hostfile", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
            "dynamo_use_regional_compilation", "fsdp_min_num_params"}
#: the Hugging Face decoder layer class each preset's model wraps (transformers' modeling files)
LAYER_CLASSES = {"llama2-7b": "LlamaDecoderLayer", "llama3-8b": "LlamaDecoderLayer", "llama3-70b": "LlamaDecoderLayer",
                 "llama3-405b": "LlamaDecoderLayer", "mixtral-8x7b": "MixtralDecoderLayer",
                 "qwen3-30b-a3b": "Qwen3MoeDecoderLayer", "qwen3-235b-a22b": "Qwen3MoeDecoderLayer",
                 "deepseek-v3": "DeepseekV3DecoderLayer", "gpt2-124m": "GPT2Block", "gpt-oss-20b": "GptOssDecoderLayer",
                 "gpt-oss-120b": "GptOssDecoderLayer"}


def _checked(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or "distributed_type" not in raw:
        raise InteropError("not an accelerate config: distributed_type is missing (allowed "
                           f"{', '.join(_DISTRIBUTED)})")
    return raw


def _world(raw: dict[str, Any]) -> tuple[int, int]:
    machines = int(raw.get("num_machines") or 1)
    procs = int(raw.get("num_processes") or 1)
    if procs < 1 or machines < 1 or procs % machines:
        raise InteropError(f"accelerate num_processes = {procs}, num_machines = {machines}: allowed a process count "
                           "(all machines together) that the machines divide")
    return procs, procs // machines


def _fsdp(fsdp: dict[str, Any], machines: int, notes: list[str]) -> tuple[dict[str, Any], bool]:
    """(parallel fields, activation checkpointing) of an FSDP plugin config."""
    if str(fsdp.get("fsdp_offload_params", False)).lower() == "true":
        raise InteropError("accelerate fsdp_config.fsdp_offload_params = true: ShardScope does not model CPU offload "
                           "(allowed false)")
    version = int(fsdp.get("fsdp_version", 1))
    if version == 2:
        reshard = fsdp.get("fsdp_reshard_after_forward", True)
        if not isinstance(reshard, bool):
            raise InteropError(f"accelerate fsdp_config.fsdp_reshard_after_forward = {reshard!r}: allowed true or "
                               "false (FSDP version 2)")
        zero, hybrid = (3 if reshard else 2), False
    elif version == 1:
        strategy = str(fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")))
        strategy = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "HYBRID_SHARD_ZERO2"}.get(strategy, strategy)
        if strategy not in _SHARDING_V1:
            raise InteropError(f"accelerate fsdp_config.fsdp_sharding_strategy = {strategy!r}: allowed "
                               f"{', '.join(_SHARDING_V1)}")
        zero, hybrid = _SHARDING_V1[strategy]
        notes.append("fsdp_config.fsdp_version = 1: FSDP1's flat parameters modelled as FSDP2's per-parameter "
                     "shards")
    else:
        raise InteropError(f"accelerate fsdp_config.fsdp_version = {version}: allowed 1, 2")
    policy = fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy != "TRANSFORMER_BASED_WRAP":
        notes.append(f"fsdp_config.fsdp_auto_wrap_policy = {policy}: ShardScope wraps each transformer block")
    par: dict[str, Any] = {"zero": zero}
    if hybrid:
        par["replicate"] = machines
    return par, bool(fsdp.get("fsdp_activation_checkpointing", False))


def _deepspeed(ds: dict[str, Any], notes: list[str], read_file) -> tuple[dict[str, Any], int]:
    """(parallel fields, gradient accumulation) of a DeepSpeed plugin config."""
    if ds.get("deepspeed_config_file"):
        got = read_deepspeed(read_file(ds["deepspeed_config_file"]))
        notes.extend(got["notes"])
        return {"zero": got["zero"]}, int(got["accumulation"] or 1)
    for key in ("offload_optimizer_device", "offload_param_device"):
        if str(ds.get(key, "none")).lower() not in ("none", ""):
            raise InteropError(f"accelerate deepspeed_config.{key} = {ds[key]!r}: ShardScope does not model offload "
                               "(allowed none)")
    stage = int(ds.get("zero_stage", 0))
    if stage not in (0, 1, 2, 3):
        raise InteropError(f"accelerate deepspeed_config.zero_stage = {stage}: allowed 0, 1, 2, 3")
    notes.append(f"deepspeed_config.zero_stage = {stage}: DeepSpeed's ZeRO modelled as PyTorch's (its buckets are not)")
    return {"zero": stage}, int(ds.get("gradient_accumulation_steps", 1) or 1)


def import_accelerate(raw: dict[str, Any], *, extra: dict[str, dict[str, Any]] | None = None,
                      cluster: dict[str, Any] | None = None, read_file=None) -> Imported:
    """accelerate's config (the YAML file as parsed: gui.interop_files reads it) as a ShardScope config. ``extra``: the
    fields the file cannot hold (``model``, ``training.micro_batch_size``, ...), set last; ``cluster``: the card and
    links."""
    raw = _checked(raw)
    notes: list[str] = []
    assumed: list[str] = []
    ignored = sorted(k for k in raw if k in _IGNORED or k.startswith("tpu_"))
    kind = str(raw["distributed_type"])
    if kind not in _DISTRIBUTED:
        raise InteropError(f"accelerate distributed_type = {kind}: allowed {', '.join(_DISTRIBUTED)} (Megatron-LM's "
                           "plugin and XLA are not modelled)")
    gpus, per_node = _world(raw)
    machines = gpus // per_node
    precision = str(raw.get("mixed_precision") or "no")
    if precision not in _PRECISION:
        raise InteropError(f"accelerate mixed_precision = {precision}: allowed {', '.join(_PRECISION)}")
    parallel: dict[str, Any] = {"dp": gpus, "zero": 0}
    training: dict[str, Any] = {"precision": _PRECISION[precision]}
    recompute = False
    if kind == "FSDP":
        fsdp_par, recompute = _fsdp(raw.get("fsdp_config") or {}, machines, notes)
        parallel.update(fsdp_par)
    elif kind == "DEEPSPEED":
        ds_par, accumulation = _deepspeed(raw.get("deepspeed_config") or {}, notes, read_file or _no_file)
        parallel.update(ds_par, microbatches=accumulation)
    pc = {k.removeprefix("parallelism_config_"): v for k, v in (raw.get("parallelism_config") or {}).items()}
    if pc:
        tp, cp = int(pc.get("tp_size", 1)), int(pc.get("cp_size", 1))
        rep, shard = int(pc.get("dp_replicate_size", 1)), int(pc.get("dp_shard_size", 1))
        if rep * shard * tp * cp != gpus:
            raise InteropError(f"accelerate parallelism_config: dp_replicate {rep} × dp_shard {shard} × tp {tp} × cp "
                               f"{cp} = {rep * shard * tp * cp}, num_processes = {gpus}: allowed sizes whose product "
                               "is num_processes")
        parallel.update(dp=rep * shard, tp=tp, cp=cp)
        if rep > 1 and parallel["zero"] > 0:
            parallel["replicate"] = rep
        if cp > 1:
            parallel["cp_rotate"] = str(pc.get("cp_comm_strategy", "allgather"))
    if precision == "fp8":
        fp8 = raw.get("fp8_config") or {}
        backend = str(fp8.get("backend", "AO")).upper()
        if backend not in ("AO", "TORCHAO"):
            notes.append(f"fp8_config.backend = {backend}: modelled as torchao's float8 (tensorwise)")
        # accelerate's AORecipeKwargs: torchao's Float8LinearConfig, FSDP2 float8 all-gather unless turned off
        gather = str(fp8.get("enable_fsdp_float8_all_gather", True)).lower() == "true"
        training.update(float8="tensorwise", float8_all_gather=gather and parallel["zero"] in (2, 3))
    training["recompute"] = "full" if recompute else "none"
    dynamo = str((raw.get("dynamo_config") or {}).get("dynamo_backend", raw.get("dynamo_backend", "NO"))).upper()
    training["compile"] = dynamo not in ("NO", "NONE")
    if training["compile"] and dynamo != "INDUCTOR":
        notes.append(f"dynamo_config.dynamo_backend = {dynamo}: modelled as inductor")
    for key in sorted(set(raw) - _IGNORED - {"distributed_type", "num_processes", "num_machines", "mixed_precision",
                                            "fsdp_config", "deepspeed_config", "parallelism_config", "dynamo_config",
                                            "fp8_config", "megatron_lm_config", "mpirun_config", "ipex_config"}):
        if not key.startswith("tpu_") and raw[key] not in (None, {}, [], False):
            notes.append(f"{key} = {raw[key]!r}: ShardScope has no equivalent")
    if kind == "MULTI_CPU":
        cluster = {"gpu": "cpu", **(cluster or {})}
    return build_config(parallel, training, gpus, per_node, cluster or {}, extra or {}, "accelerate", notes, assumed,
                  tuple(ignored))


def _no_file(path: str) -> str:
    raise InteropError(f"accelerate deepspeed_config.deepspeed_config_file = {path!r}: give the file's folder")


def export_accelerate(cfg: Config) -> tuple[dict[str, Any], list[str], list[str]]:
    """The layout as accelerate's config (FSDP version 2 for ZeRO-2/3, MULTI_GPU for DDP, DeepSpeed for ZeRO-1): the
    file's table, the lines for its head comment (the training script's part: batch, accumulation, model) and what
    it cannot express (gui.interop_files writes the YAML)."""
    par, tr, c = cfg.parallel, cfg.training, cfg.cluster
    notes: list[str] = []
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if par.zero in (2, 3):
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": par.zero == 3, "fsdp_offload_params": False,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": LAYER_CLASSES.get(cfg.model.preset or "", "DecoderLayer"),
            "fsdp_activation_checkpointing": tr.recompute == "full", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True}
        if cfg.model.preset not in LAYER_CLASSES:
            notes.append("model: a custom model: fsdp_transformer_layer_cls_to_wrap is your decoder layer's class")
        if par.zero == 3 and par.fsdp_reshard_after_forward == "never":
            notes.append("parallel.fsdp_reshard_after_forward = never: accelerate's false is ZeRO-2 here")
    elif par.zero == 1:
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {"zero_stage": 1, "gradient_accumulation_steps": par.microbatches,
                                   "offload_optimizer_device": "none", "offload_param_device": "none"}
        notes.append("parallel.zero = 1: written as DeepSpeed's ZeRO-1 (ShardScope models PyTorch's "
                     "ZeroRedundancyOptimizer)")
    else:
        out["distributed_type"] = "MULTI_CPU" if c.gpu.name == "cpu" else ("MULTI_GPU" if c.gpus > 1 else "NO")
    precision = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}[tr.precision]
    if tr.float8 != "none":
        precision = "fp8"
        out["fp8_config"] = {"backend": "AO", "enable_fsdp_float8_all_gather": tr.float8_all_gather}
        if tr.float8 != "tensorwise":
            notes.append(f"training.float8 = {tr.float8}: accelerate's fp8 (torchao's default config) is tensorwise")
    out["mixed_precision"] = precision
    out["num_machines"] = c.nodes
    out["num_processes"] = c.gpus
    out["machine_rank"] = 0
    if par.tp > 1 or par.cp > 1 or par.replicate > 1:
        if par.zero not in (2, 3):
            notes.append(f"parallel.zero = {par.zero} with tp or cp: accelerate's parallelism_config takes its sizes "
                         "with FSDP version 2 only")
        replicate = par.replicate if par.zero else 1
        out["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": replicate,
            # the pipeline's ranks (accelerate has none) data-parallel too, so the sizes multiply to num_processes
            "parallelism_config_dp_shard_size": par.dp * par.pp // replicate,
            "parallelism_config_tp_size": par.tp, "parallelism_config_cp_size": par.cp}
        if par.cp > 1:
            out["parallelism_config"]["parallelism_config_cp_comm_strategy"] = par.cp_rotate
    if tr.compile:
        out["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    if c.gpus % c.nodes or c.gpus // c.nodes != min(c.gpus, c.gpus_per_node):
        notes.append(f"cluster.gpus_per_node = {c.gpus_per_node}: accelerate spreads num_processes evenly over "
                     "num_machines")
    notes += _not_in_accelerate(cfg)
    head = [f"A ShardScope layout as accelerate's config ({cfg.model.preset or 'custom model'} on {c.gpus} × "
            f"{c.gpu.name}): accelerate launch --config_file THIS.yaml train.py",
            f"the training script's part: per-device batch {tr.micro_batch_size}, gradient accumulation "
            f"{par.microbatches}, sequence {cfg.model.seq_len}"]
    return out, head, notes


def _not_in_accelerate(cfg: Config) -> list[str]:
    par, tr = cfg.parallel, cfg.training
    notes = []
    if par.pp > 1:
        notes.append(f"parallel.pp = {par.pp}: accelerate's config has no pipeline parallelism; its ranks are written "
                     "as data parallel")
    if par.ep > 1:
        notes.append(f"parallel.ep = {par.ep}: accelerate's config has no expert parallelism")
    if par.sequence_parallel:
        notes.append("parallel.sequence_parallel = true: accelerate's TP is the model's tp_plan")
    if par.async_tp:
        notes.append("parallel.async_tp = true: not in accelerate's config")
    if tr.recompute not in ("none", "full"):
        notes.append(f"training.recompute = {tr.recompute}: accelerate checkpoints whole blocks or none"
                     + ("" if par.zero in (2, 3) else " (with FSDP)"))
    elif tr.recompute == "full" and par.zero not in (2, 3):
        notes.append("training.recompute = full: accelerate checkpoints blocks through its FSDP plugin only")
    if par.zero in (2, 3) and tr.precision != "fp32" and tr.grad_dtype != tr.precision[:4]:
        # accelerate's FullyShardedDataParallelPlugin.set_mixed_precision: param_dtype = reduce_dtype
        notes.append(f"training.grad_dtype = {tr.grad_dtype}: accelerate's FSDP policy reduces in the parameters' "
                     f"{tr.precision[:4]}")
    if tr.optimizer != "adamw":
        notes.append(f"training.optimizer = {tr.optimizer}: the training script's")
    if tr.finetune != "full":
        notes.append("training.finetune = lora: the training script's (peft)")
    if par.dp_mode != "ddp":
        notes.append(f"parallel.dp_mode = {par.dp_mode}: accelerate runs one process a GPU")
    return notes
