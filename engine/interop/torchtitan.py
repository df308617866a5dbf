"""torchtitan's configs and command lines ↔ ShardScope.

Three flavours, told apart by their keys (every key is read under all its names):

* **2024** — the ``train_configs/*.toml`` of torchtitan before 0.1 (its argparse ``config_manager.py``;
  the commit of the published H100 benchmarks, 9dec370, is one): ``training.batch_size``,
  ``training.data_parallel_shard_degree``, ``experimental.pipeline_parallel_degree``,
  ``float8.enable_float8_linear``, ``model.norm_type``;
* **0.1–0.2** — the job config TOML of the 0.1 and 0.2 releases (``torchtitan/config/job_config.py``):
  ``[parallelism]``, ``training.local_batch_size`` / ``global_batch_size``, ``model.converters``
  (``"float8"``, or ``"quantize.linear.float8"`` with ``[quantize.linear.float8]`` in 0.2);
* **0.3** — the command line of 0.3.0 (PyPI): ``--module llama3 --config llama3_8b`` names a Python
  config function (its defaults, read from 0.3.0's ``config_registry.py``, are in ``REGISTRY_03``),
  ``--section.key value`` overrides it, ``activation-checkpoint:full`` chooses the recomputation.

A command line may carry torchrun's own options (``--nnodes``, ``--nproc_per_node``: the world size),
``NGPU=8`` as ``run_train.sh`` takes it, ``--job.config_file PATH`` (read relative to ``base_dir``) and
overrides in any of torchtitan's spellings: ``--a.b=v``, ``--a.b v``, a bare flag for true,
``--a.no-b`` / ``--a.no_b`` for false, dashes or underscores.

What torchtitan fixes and ShardScope sets to match: FSDP2 when the data-parallel shard (or context)
degree exceeds one (ZeRO-3, HSDP with a replicate degree), DDP for replicas alone; sequence parallel
with every TP degree (0.3: unless ``enable_sequence_parallel`` is off); torchtitan's own layer split
for pipelines (``pipeline_split = "torchtitan"``) with 1 stage a rank for single-stage schedules and 2
for the others unless ``pipeline_parallel_layers_per_stage`` says otherwise; bf16 parameters and fp32
reduction unless ``mixed_precision_param`` / ``_reduce`` say otherwise; AdamW.
"""

from __future__ import annotations

import math
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import names
from engine.config import Config, ConfigError
from engine.interop import Exported, Imported, InteropError, launch_world, split_command
from engine.model.presets import model_presets

FLAVOUR_2024, FLAVOUR_02, FLAVOUR_03 = "2024", "0.1-0.2", "0.3"

#: canonical key (0.2's name) -> (type, the other names it has had)
KEYS: dict[str, tuple[type, tuple[str, ...]]] = {
    "model.name": (str, ()),
    "model.flavor": (str, ()),
    "model.norm_type": (str, ()),
    "model.converters": (list, ()),
    "training.local_batch_size": (int, ("training.batch_size",)),
    "training.global_batch_size": (int, ()),
    "training.seq_len": (int, ()),
    "training.mixed_precision_param": (str, ()),
    "training.mixed_precision_reduce": (str, ()),
    "training.enable_cpu_offload": (bool, ()),
    "training.disable_cuda_graphs": (bool, ()),
    "compile.enable": (bool, ("training.compile",)),
    "compile.components": (list, ()),
    "parallelism.data_parallel_replicate_degree": (int, ("training.data_parallel_replicate_degree",)),
    "parallelism.data_parallel_shard_degree": (int, ("training.data_parallel_shard_degree",)),
    "parallelism.tensor_parallel_degree": (int, ("training.tensor_parallel_degree",)),
    "parallelism.disable_loss_parallel": (bool, ("training.disable_loss_parallel",)),
    "parallelism.enable_async_tensor_parallel": (bool, ("experimental.enable_async_tensor_parallel",
                                                        "compile.enable_async_tensor_parallel")),
    "parallelism.enable_sequence_parallel": (bool, ()),
    "parallelism.pipeline_parallel_degree": (int, ("experimental.pipeline_parallel_degree",)),
    "parallelism.pipeline_parallel_schedule": (str, ("experimental.pipeline_parallel_schedule",)),
    "parallelism.pipeline_parallel_microbatches": (int, ("experimental.pipeline_parallel_microbatches",)),
    "parallelism.pipeline_parallel_microbatch_size": (int, ()),
    "parallelism.pipeline_parallel_layers_per_stage": (int, ()),
    "parallelism.pipeline_parallel_first_stage_less_layers": (int, ()),
    "parallelism.pipeline_parallel_last_stage_less_layers": (int, ()),
    "parallelism.pipeline_parallel_split_points": (list, ("experimental.pipeline_parallel_split_points",)),
    "parallelism.pipeline_parallel_schedule_csv": (str, ("experimental.pipeline_parallel_schedule_csv",)),
    "parallelism.module_fqns_per_model_part": (list, ()),
    "parallelism.context_parallel_degree": (int, ("experimental.context_parallel_degree",)),
    "parallelism.context_parallel_rotate_method": (str, ("experimental.context_parallel_rotate_method",)),
    "parallelism.expert_parallel_degree": (int, ()),
    "parallelism.expert_tensor_parallel_degree": (int, ()),
    "parallelism.fsdp_reshard_after_forward": (str, ()),
    "activation_checkpoint.mode": (str, ()),
    "activation_checkpoint.selective_ac_option": (str, ()),
    "float8.enable_float8_linear": (bool, ()),
    "float8.enable_fsdp_float8_all_gather": (bool, ("quantize.linear.float8.enable_fsdp_float8_all_gather",)),
    "float8.recipe_name": (str, ("quantize.linear.float8.recipe_name",)),
    "float8.force_recompute_fp8_weight_in_bwd": (bool, ("quantize.linear.float8.force_recompute_fp8_weight_in_bwd",)),
    "float8.scaling_type_input": (str, ()),
    "float8.scaling_type_weight": (str, ()),
    "float8.scaling_type_grad_output": (str, ()),
    "optimizer.name": (str, ()),
    "job.config_file": (str, ()),
}
_ALIAS = {alias: key for key, (_, aliases) in KEYS.items() for alias in (key, *aliases)}
#: keys that name a 2024 config (gone from 0.1's job_config.py)
_KEYS_2024 = {"training.batch_size", "training.data_parallel_shard_degree", "training.tensor_parallel_degree",
              "training.data_parallel_replicate_degree", "experimental.pipeline_parallel_degree",
              "experimental.context_parallel_degree", "float8.enable_float8_linear", "model.norm_type",
              "experimental.pipeline_parallel_microbatches"}
#: sections and keys that bear on neither memory nor step time
_IGNORED_SECTIONS = ("job", "profiling", "profiler", "metrics", "checkpoint", "comm", "lr_scheduler", "dataloader",
                     "validation", "validator", "fault_tolerance", "memory_estimation", "debug", "override", "ft")
_IGNORED_KEYS = {"optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.beta1", "optimizer.beta2",
                 "optimizer.fused", "optimizer.implementation", "optimizer.early_step_in_backward",
                 "training.steps", "training.warmup_steps", "training.max_norm", "training.dataset",
                 "training.dataset_path", "training.seed", "training.deterministic", "training.gc_freq",
                 "training.gc_debug", "model.tokenizer_path", "model.hf_assets_path", "hf_assets_path",
                 "compile.backend", "float8.precompute_float8_dynamic_scale_for_fsdp",
                 "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                 "quantize.linear.float8.filter_fqns", "float8.filter_fqns",
                 "activation_checkpoint.preserve_rng_state", "activation_checkpoint.determinism_check",
                 "activation_checkpoint.debug", "experimental.custom_import", "experimental.custom_args_module"}

#: (torchtitan model name, flavor) <-> ShardScope model preset
MODELS: dict[tuple[str, str], str] = {
    ("llama3", "8B"): "llama3-8b",
    ("llama3", "70B"): "llama3-70b",
    ("llama3", "405B"): "llama3-405b",
    ("llama2", "7B"): "llama2-7b",
    ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
    ("qwen3", "235B-A22B"): "qwen3-235b-a22b",
    ("deepseek_v3", "671B"): "deepseek-v3",
}
_PRESET_MODEL = {preset: key for key, preset in MODELS.items()}

#: torchtitan 0.3.0's config functions (torchtitan/models/*/config_registry.py), the fields ShardScope reads
REGISTRY_03: dict[str, dict[str, Any]] = {
    "llama3_8b": {"model.name": "llama3", "model.flavor": "8B", "training.local_batch_size": 1,
                  "training.seq_len": 8192, "activation_checkpoint.mode": "selective"},
    "llama3_70b": {"model.name": "llama3", "model.flavor": "70B", "training.local_batch_size": 8,
                   "training.seq_len": 8192, "parallelism.tensor_parallel_degree": 8,
                   "activation_checkpoint.mode": "full"},
    "llama3_405b": {"model.name": "llama3", "model.flavor": "405B", "training.local_batch_size": 2,
                    "training.seq_len": 8192, "parallelism.tensor_parallel_degree": 8,
                    "activation_checkpoint.mode": "full", "compile.enable": True,
                    "parallelism.enable_async_tensor_parallel": True,
                    "model.converters": ["float8"], "float8.recipe_name": "rowwise"},
    "qwen3_30b_a3b": {"model.name": "qwen3", "model.flavor": "30B-A3B", "training.local_batch_size": 2,
                      "training.seq_len": 4096, "activation_checkpoint.mode": "full"},
}
#: 0.3's activation-checkpoint subcommands
_AC_03 = {"activation-checkpoint:selective": "selective", "activation-checkpoint:full": "full",
          "activation-checkpoint:none": "none", "activation-checkpoint:memory-budget": "memory_budget"}
#: what torchtitan's defaults are where a config leaves a key out (job_config.py of 0.2; the 2024 argparse agrees)
_DEFAULTS = {"parallelism.data_parallel_replicate_degree": 1, "parallelism.data_parallel_shard_degree": -1,
             "parallelism.tensor_parallel_degree": 1, "parallelism.pipeline_parallel_degree": 1,
             "parallelism.context_parallel_degree": 1, "parallelism.expert_parallel_degree": 1,
             "parallelism.pipeline_parallel_schedule": "1F1B", "parallelism.pipeline_parallel_microbatch_size": 1,
             "parallelism.enable_sequence_parallel": True, "training.local_batch_size": 8,
             "training.global_batch_size": -1, "training.seq_len": 2048,
             "training.mixed_precision_param": "bfloat16", "training.mixed_precision_reduce": "float32",
             "activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2",
             "optimizer.name": "AdamW", "model.name": "llama3", "model.flavor": "debugmodel",
             "parallelism.enable_async_tensor_parallel": False, "compile.enable": False,
             "parallelism.context_parallel_rotate_method": "allgather",
             "parallelism.fsdp_reshard_after_forward": "default"}
_SCRIPTS = ("train.py", "torchtitan.train", "run_train.sh", "torchtitan/train.py")


# --------------------------------------------------------------------------- reading


def _value(key: str, raw: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise InteropError(f"torchtitan {key} = {raw!r}: allowed true or false")
    if kind is int:
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise InteropError(f"torchtitan {key} = {raw!r}: allowed an integer") from None
    if kind is list:
        if isinstance(raw, list):
            return [str(x) for x in raw]
        text = str(raw).strip().strip("[]")
        return [part.strip().strip("'\"") for part in text.split(",") if part.strip().strip("'\"")]
    return raw if isinstance(raw, str) else str(raw)


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _Reader:
    """Collects torchtitan settings under their canonical names, and what is ignored or unknown."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}
        self.seen: set[str] = set()
        self.ignored: list[str] = []
        self.unknown: list[str] = []

    def set(self, name: str, raw: Any) -> None:
        self.seen.add(name)
        key = _ALIAS.get(name)
        if key is not None:
            self.settings[key] = _value(name, raw, KEYS[key][0])
        elif name.split(".")[0] in _IGNORED_SECTIONS or name in _IGNORED_KEYS:
            self.ignored.append(name)
        else:
            self.unknown.append(f"{name} = {raw!r}")

    def toml(self, text: str, where: str) -> None:
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InteropError(f"{where}: not a torchtitan TOML job config: {exc}") from None
        for name, raw in _flatten(table).items():
            if name != "job.config_file":
                self.set(name, raw)


def _torchrun_world(tokens: list[str]) -> tuple[int | None, int | None, list[str]]:
    """``launch_world`` for torchtitan's scripts; ``CONFIG_FILE=`` before ``run_train.sh`` names the job config."""
    world, per_node, args, env = launch_world(tokens, _SCRIPTS)
    if "CONFIG_FILE" in env:
        args = [f"--job.config_file={env['CONFIG_FILE']}", *args]
    return world, per_node, args


def _read_args(reader: _Reader, args: list[str], read_file: Callable[[str], str]) -> str | None:
    """Apply torchtitan's command-line arguments; returns the 0.3 ``--config`` function's name, if any."""
    module = function = None
    later: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok in _AC_03:
            later.append(("activation_checkpoint.mode", _AC_03[tok]))
            continue
        if not tok.startswith("--"):
            reader.unknown.append(f"argument {tok!r}")
            continue
        name, eq, val = tok[2:].partition("=")
        name = name.replace("-", "_")
        if name in ("module", "config") or name == "job.config_file":
            if not eq:
                val, i = (args[i], i + 1) if i < len(args) else ("", i)
            if name == "module":
                module = val
            elif name == "config":
                function = val
            else:
                reader.toml(read_file(val), val)
            continue
        head, _, last = name.rpartition(".")
        negated = last.startswith("no_") and _ALIAS.get(f"{head}.{last[3:]}") is not None \
            and KEYS[_ALIAS[f"{head}.{last[3:]}"]][0] is bool
        if negated:
            later.append((f"{head}.{last[3:]}", False))
            continue
        key = _ALIAS.get(name)
        if not eq:
            if key is not None and KEYS[key][0] is bool:
                val = "true"
            elif i < len(args) and not args[i].startswith("--") and args[i] not in _AC_03:
                val, i = args[i], i + 1
            else:
                val = "true"
        later.append((name, val))
    if function is not None or module is not None:
        if function not in REGISTRY_03:
            raise InteropError(f"torchtitan --config = {function!r} (--module {module}): allowed "
                               f"{', '.join(sorted(REGISTRY_03))} (torchtitan 0.3.0's config functions ShardScope reads)")
        # 0.3's SelectiveAC is torchtitan's per-op policy (no layer option any more)
        reader.settings["activation_checkpoint.selective_ac_option"] = "op"
        for name, raw in REGISTRY_03[function].items():
            reader.settings[name] = raw
    for name, raw in later:
        reader.set(name, raw)
    return function


# --------------------------------------------------------------------------- mapping


def _get(s: dict[str, Any], key: str) -> Any:
    return s.get(key, _DEFAULTS.get(key))


def _flavour(reader: _Reader, function: str | None) -> str:
    if function is not None:
        return FLAVOUR_03
    return FLAVOUR_2024 if reader.seen & _KEYS_2024 else FLAVOUR_02


def _degrees(s: dict[str, Any], world: int | None) -> dict[str, int]:
    deg = {k: int(_get(s, f"parallelism.{k}_degree")) for k in
           ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel", "pipeline_parallel",
            "context_parallel", "expert_parallel")}
    inner = deg["data_parallel_replicate"] * deg["tensor_parallel"] * deg["pipeline_parallel"] * deg["context_parallel"]
    if deg["data_parallel_shard"] == -1:
        if world is None:
            raise InteropError("the world size: torchtitan's data_parallel_shard_degree = -1 takes what is left of "
                               "the GPUs; give --gpus N (torchrun's --nnodes × --nproc_per_node)")
        if world % inner:
            raise InteropError(f"the world size {world} is not a multiple of replicate × tp × pp × cp = {inner}")
        deg["data_parallel_shard"] = world // inner
    elif world is not None and world != inner * deg["data_parallel_shard"]:
        raise InteropError(f"torchtitan's degrees multiply to {inner * deg['data_parallel_shard']} GPUs, the world "
                           f"size is {world}: allowed degrees whose product is the world size")
    return deg


def _pipeline(s: dict[str, Any], deg: dict[str, int], layers: int, notes: list[str]) -> dict[str, Any]:
    pp = deg["pipeline_parallel"]
    if pp == 1:
        return {}
    schedule = str(_get(s, "parallelism.pipeline_parallel_schedule"))
    found = {n.lower(): n for n in names.SCHEDULES}.get(schedule.lower())
    if found is None:
        raise InteropError(f"torchtitan pipeline_parallel_schedule = {schedule!r}: allowed "
                           f"{', '.join(names.SCHEDULES)}")
    single = found in names.SINGLE_STAGE_SCHEDULES
    lps = s.get("parallelism.pipeline_parallel_layers_per_stage")
    if lps:
        first = int(s.get("parallelism.pipeline_parallel_first_stage_less_layers", 1))
        last = int(s.get("parallelism.pipeline_parallel_last_stage_less_layers", 1))
        stages = math.ceil((layers + first + last) / int(lps))
        if stages % pp or stages // pp < (1 if single else 2) or (single and stages != pp):
            raise InteropError(f"torchtitan pipeline_parallel_layers_per_stage = {lps}: {stages} stages over "
                               f"pipeline degree {pp} ({found}): allowed a value giving {'1' if single else '2 or more'} "
                               "stages a rank, the same on every rank")
        virtual = stages // pp
    else:
        virtual = 1 if single else 2
    for key in ("parallelism.pipeline_parallel_split_points", "parallelism.module_fqns_per_model_part",
                "parallelism.pipeline_parallel_schedule_csv"):
        if s.get(key):
            notes.append(f"{key} = {s[key]!r}: ShardScope cuts the stages by torchtitan's default split")
    for key in ("parallelism.pipeline_parallel_first_stage_less_layers",
                "parallelism.pipeline_parallel_last_stage_less_layers"):
        if int(s.get(key, 1)) != 1:
            notes.append(f"{key} = {s[key]}: ShardScope's torchtitan split weighs the embeddings and the head as one "
                         "layer each")
    return {"schedule": found, "virtual_stages": virtual, "pipeline_split": "torchtitan"}


def _batches(s: dict[str, Any], deg: dict[str, int], flavour: str, notes: list[str]) -> tuple[int, int]:
    """(micro_batch_size, microbatches) from the local and global batch and the pipeline's microbatching."""
    local = int(_get(s, "training.local_batch_size"))
    dp = deg["data_parallel_replicate"] * deg["data_parallel_shard"]
    glob = int(_get(s, "training.global_batch_size"))
    accumulation = 1 if glob in (-1, 0) else glob // (local * dp)
    if glob not in (-1, 0) and glob != accumulation * local * dp:
        raise InteropError(f"torchtitan training.global_batch_size = {glob}: allowed a multiple of local batch "
                           f"{local} × data-parallel degree {dp}")
    pp = deg["pipeline_parallel"]
    if pp == 1:
        return local, accumulation
    if flavour == FLAVOUR_2024:
        n = int(s.get("parallelism.pipeline_parallel_microbatches") or pp)
        if local % n:
            raise InteropError(f"torchtitan pipeline_parallel_microbatches = {n}: allowed a divisor of the local "
                               f"batch {local}")
        size = local // n
    else:
        size = int(_get(s, "parallelism.pipeline_parallel_microbatch_size"))
        if local % size:
            raise InteropError(f"torchtitan pipeline_parallel_microbatch_size = {size}: allowed a divisor of the "
                               f"local batch {local}")
        n = local // size
    if accumulation > 1:
        notes.append(f"training.global_batch_size = {glob}: torchtitan runs the pipeline schedule {accumulation} times "
                     f"a step; ShardScope runs it once with {n * accumulation} microbatches")
    return size, n * accumulation


def _recompute(s: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    mode = str(_get(s, "activation_checkpoint.mode"))
    if mode in ("none", "full"):
        return {"recompute": mode}
    if mode != "selective":
        raise InteropError(f"torchtitan activation_checkpoint.mode = {mode!r}: allowed none, selective, full "
                           "(ShardScope does not model the memory-budget partitioner)")
    option = str(_get(s, "activation_checkpoint.selective_ac_option"))
    if option == "op":
        return {"recompute": "selective-op"}
    if not option.isdigit() or int(option) < 1:
        raise InteropError(f"torchtitan activation_checkpoint.selective_ac_option = {option!r}: allowed 'op' or a "
                           "positive integer (every N-th block)")
    if int(option) == 1:
        return {"recompute": "full"}
    return {"recompute": "selective-layer", "recompute_every": int(option)}


def _float8(s: dict[str, Any], flavour: str, zero: int, notes: list[str]) -> dict[str, Any]:
    converters = [str(c) for c in s.get("model.converters") or []]
    on = bool(s.get("float8.enable_float8_linear")) or any(c in ("float8", "quantize.linear.float8")
                                                            for c in converters)
    for c in converters:
        if c not in ("float8", "quantize.linear.float8"):
            notes.append(f"model.converters: {c!r}: ShardScope models torchao float8 (tensorwise, rowwise) only")
    if not on:
        return {}
    recipe = s.get("float8.recipe_name") or "tensorwise"
    if flavour == FLAVOUR_2024:
        for key in ("float8.scaling_type_input", "float8.scaling_type_weight", "float8.scaling_type_grad_output"):
            if s.get(key, "dynamic") != "dynamic":
                notes.append(f"{key} = {s[key]!r}: ShardScope models dynamic tensorwise scaling")
    if recipe == "rowwise_with_gw_hp":
        notes.append("float8.recipe_name = 'rowwise_with_gw_hp': modelled as rowwise (its weight gradient in "
                     "high precision is not)")
        recipe = "rowwise"
    if recipe not in names.FLOAT8_KINDS:
        raise InteropError(f"torchtitan float8.recipe_name = {recipe!r}: allowed tensorwise, rowwise, "
                           "rowwise_with_gw_hp")
    if s.get("float8.force_recompute_fp8_weight_in_bwd"):
        notes.append("float8.force_recompute_fp8_weight_in_bwd = true: ShardScope does not model which float8 weights "
                     "the backward keeps or casts again")
    gather = bool(s.get("float8.enable_fsdp_float8_all_gather")) and recipe == "tensorwise" and zero == 3
    return {"float8": recipe, "float8_all_gather": gather}


def _precision(s: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    param = str(_get(s, "training.mixed_precision_param"))
    reduce = str(_get(s, "training.mixed_precision_reduce"))
    table = {"bfloat16": "bf16", "float32": "fp32"}
    if param not in table or reduce not in table:
        raise InteropError(f"torchtitan mixed_precision_param = {param!r}, mixed_precision_reduce = {reduce!r}: "
                           "allowed bfloat16 or float32")
    out = {"precision": "bf16-mixed" if param == "bfloat16" else "fp32", "grad_dtype": table[reduce]}
    name = str(_get(s, "optimizer.name"))
    if name == "Adam":
        notes.append("optimizer.name = 'Adam': modelled as adamw (the same two moments a parameter)")
    elif name != "AdamW":
        notes.append(f"optimizer.name = {name!r}: ShardScope models AdamW here (allowed AdamW, Adam)")
    out["optimizer"] = "adamw"
    return out


def _model(s: dict[str, Any], flavour: str) -> tuple[dict[str, Any], dict[str, Any]]:
    key = (str(_get(s, "model.name")), str(_get(s, "model.flavor")))
    if key not in MODELS:
        known = ", ".join(f"{n} {f}" for n, f in MODELS)
        raise InteropError(f"torchtitan model.name / model.flavor = {key[0]} / {key[1]}: allowed {known} (give a "
                           "Hugging Face config.json to `shardscope import hf` for another model)")
    conventions: dict[str, Any] = {}
    norm = s.get("model.norm_type")
    if flavour == FLAVOUR_2024:
        if norm in (None, "rmsnorm"):
            # torchtitan/models/norms.py of 2024: x.float(), pow, mean, rsqrt, type_as, x weight (torchtitan#985
            # replaced it with torch's nn.RMSNorm in March 2025)
            conventions["rms_norm"] = "fp32-composite"
        elif norm != "fused_rmsnorm":
            raise InteropError(f"torchtitan model.norm_type = {norm!r}: allowed rmsnorm, fused_rmsnorm")
    return {"preset": MODELS[key], "seq_len": int(_get(s, "training.seq_len"))}, conventions


def _to_config(reader: _Reader, flavour: str, world: int | None, cluster: dict[str, Any],
               extra: dict[str, dict[str, Any]]) -> Imported:
    s, notes, assumed = reader.settings, list(reader.unknown), []
    if s.get("training.enable_cpu_offload"):
        raise InteropError("torchtitan training.enable_cpu_offload = true: ShardScope does not model CPU offload "
                           "(allowed false)")
    model, conventions = _model(s, flavour)
    deg = _degrees(s, world)
    shard, replicate, cp = deg["data_parallel_shard"], deg["data_parallel_replicate"], deg["context_parallel"]
    zero = 3 if shard * cp > 1 else 0
    tp = deg["tensor_parallel"]
    parallel: dict[str, Any] = {
        "dp": shard * replicate, "tp": tp, "pp": deg["pipeline_parallel"], "cp": cp, "zero": zero,
        "replicate": replicate if zero == 3 else 1,
        "sequence_parallel": tp > 1 and bool(_get(s, "parallelism.enable_sequence_parallel")),
        "async_tp": tp > 1 and bool(s.get("parallelism.enable_async_tensor_parallel")) and bool(s.get("compile.enable")),
    }
    if bool(s.get("parallelism.enable_async_tensor_parallel")) and tp > 1 and not s.get("compile.enable"):
        notes.append("parallelism.enable_async_tensor_parallel = true without compile: torchtitan's async TP is a "
                     "torch.compile pass; modelled as plain TP")
    if deg["expert_parallel"] > 1:
        parallel["ep"] = deg["expert_parallel"]
    if int(s.get("parallelism.expert_tensor_parallel_degree", 1)) > 1:
        notes.append("parallelism.expert_tensor_parallel_degree > 1: ShardScope splits experts by ep only")
    if "parallelism.context_parallel_rotate_method" in s:
        parallel["cp_rotate"] = s["parallelism.context_parallel_rotate_method"]
    if zero == 3 and "parallelism.fsdp_reshard_after_forward" in s:
        parallel["fsdp_reshard_after_forward"] = s["parallelism.fsdp_reshard_after_forward"]
    if s.get("parallelism.disable_loss_parallel") and tp > 1:
        notes.append("parallelism.disable_loss_parallel = true: ShardScope keeps the logits vocabulary-parallel")
    parallel.update(_pipeline(s, deg, int(model_presets()[model["preset"]]["layers"]), notes))
    size, micro = _batches(s, deg, flavour, notes)
    parallel["microbatches"] = micro
    training: dict[str, Any] = {"micro_batch_size": size, **_precision(s, notes), **_recompute(s, notes)}
    compile_on = bool(s.get("compile.enable"))
    components = s.get("compile.components")
    if compile_on and components is not None and "model" not in components:
        notes.append(f"compile.components = {components!r}: ShardScope's compile is the model's")
        compile_on = False
    training["compile"] = compile_on
    training.update(_float8(s, flavour, zero, notes))
    if flavour == FLAVOUR_2024 and parallel["pp"] > 1:
        # pp_schedule.step() with its default return_outputs=True until torchtitan 0.2.1 (PR 1922, 2025/10)
        conventions["pipeline_outputs"] = "kept"
    if flavour == FLAVOUR_03:
        assumed.append("loss: torchtitan 0.3's ChunkedLossWrapper computes the loss by chunks; ShardScope keeps "
                       "the whole logits")
        if not s.get("training.disable_cuda_graphs"):
            notes.append("training.disable_cuda_graphs = false: torchtitan 0.3 captures the step in CUDA graphs; "
                         "ShardScope does not model their memory pool")
    raw = {"model": model, "cluster": {"gpus": world or _world_of(parallel), **cluster},
           "parallel": parallel, "training": training, "conventions": conventions}
    if "gpu" not in raw["cluster"] and "preset" not in raw["cluster"]:
        raw["cluster"]["gpu"] = "h100-sxm"
        assumed.append("cluster.gpu = h100-sxm: torchtitan's configs do not name the card (--gpu PRESET does)")
    if "gpus_per_node" not in raw["cluster"] and "preset" not in raw["cluster"]:
        raw["cluster"]["gpus_per_node"] = min(8, raw["cluster"]["gpus"])
    for section, fields in extra.items():
        raw.setdefault(section, {}).update(fields)
    try:
        config = Config.from_dict(raw)
    except ConfigError as exc:
        raise InteropError(f"the imported layout is not a valid ShardScope config: {exc}") from None
    return Imported(config, flavour, tuple(notes), tuple(sorted(set(reader.ignored))), tuple(assumed))


def _world_of(parallel: dict[str, Any]) -> int:
    return parallel["dp"] * parallel["tp"] * parallel["pp"] * parallel["cp"]


def read_torchtitan(text: str, args: list[str] | None = None,
                    base_dir: str | Path | None = None) -> tuple[_Reader, str, int | None, int | None]:
    """torchtitan's settings as it parses them (canonical names, ``KEYS``), before any mapping: the reader (its
    ``settings``, ``ignored``, ``unknown``), the flavour, the world size and the GPUs a node if the command says."""
    root = Path(base_dir) if base_dir is not None else Path.cwd()

    def read_file(path: str) -> str:
        try:
            return (root / path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InteropError(f"torchtitan --job.config_file {path}: cannot be read ({exc.strerror or exc})") from None

    reader = _Reader()
    world = per_node = None
    if _looks_like_toml(text):
        reader.toml(text, "the config")
        tokens = list(args or [])
    else:
        world, per_node, tokens = _torchrun_world(split_command(text))
        tokens += list(args or [])
    function = _read_args(reader, tokens, read_file)
    return reader, _flavour(reader, function), world, per_node


def import_torchtitan(text: str, *, args: list[str] | None = None, base_dir: str | Path | None = None,
                      gpus: int | None = None, cluster: dict[str, Any] | None = None,
                      extra: dict[str, dict[str, Any]] | None = None) -> Imported:
    """A torchtitan TOML job config or command line (``text``), with more command-line ``args`` applied after it,
    as a ShardScope config. ``base_dir``: where ``--job.config_file`` paths are read from; ``gpus``: the world size
    where the command does not give it; ``cluster``: [cluster] fields (gpu, gpus_per_node, ...); ``extra``: more
    ShardScope fields by section, set last."""
    reader, flavour, world, per_node = read_torchtitan(text, args, base_dir)
    cluster = dict(cluster or {})
    if per_node and "gpus_per_node" not in cluster and "preset" not in cluster:
        cluster["gpus_per_node"] = per_node
    return _to_config(reader, flavour, gpus or world, cluster, extra or {})


def _looks_like_toml(text: str) -> bool:
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return bool(table) and all(isinstance(v, dict) for v in table.values())


# --------------------------------------------------------------------------- writing


def _common(cfg: Config, notes: list[str]) -> dict[str, Any]:
    """The torchtitan settings (canonical names) of a ShardScope layout; what torchtitan cannot say goes to notes."""
    m, par, tr, conv = cfg.model, cfg.parallel, cfg.training, cfg.conventions
    if m.preset not in _PRESET_MODEL or cfg.model != Config.from_dict(
            {"model": {"preset": m.preset, "seq_len": m.seq_len}, "cluster": {"gpu": "cpu", "gpus": 1}}).model:
        raise InteropError(f"model: {m.preset or 'a custom model'} has no torchtitan model: allowed the presets "
                           f"{', '.join(sorted(_PRESET_MODEL))} as they stand")
    name, flavor = _PRESET_MODEL[m.preset]
    s: dict[str, Any] = {"model.name": name, "model.flavor": flavor, "training.seq_len": m.seq_len}
    if par.dp_mode != "ddp":
        notes.append(f"parallel.dp_mode = {par.dp_mode}: torchtitan runs one process a GPU")
    if par.zero in (1, 2):
        notes.append(f"parallel.zero = {par.zero}: torchtitan shards with FSDP2 (ZeRO-3) or replicates (DDP); "
                     "written as FSDP2")
    sharded = par.zero > 0
    if sharded and par.dp // par.replicate * par.cp == 1:
        notes.append(f"parallel.zero = {par.zero} over one shard (dp {par.dp}, replicate {par.replicate}, cp 1): "
                     "torchtitan applies no FSDP there" + (" and replicates with DDP" if par.replicate > 1 else ""))
    replicate = par.replicate if sharded else par.dp
    s["parallelism.data_parallel_replicate_degree"] = replicate
    s["parallelism.data_parallel_shard_degree"] = par.dp // replicate
    if not sharded and par.cp > 1:
        notes.append("parallel.zero = 0 with cp > 1: torchtitan shards over the context-parallel ranks (FSDP2)")
    for key, value in (("tensor_parallel", par.tp), ("pipeline_parallel", par.pp), ("context_parallel", par.cp),
                       ("expert_parallel", par.ep)):
        s[f"parallelism.{key}_degree"] = value
    if par.tp > 1:
        s["parallelism.enable_sequence_parallel"] = par.sequence_parallel
        s["parallelism.enable_async_tensor_parallel"] = par.async_tp
    if par.cp > 1:
        s["parallelism.context_parallel_rotate_method"] = par.cp_rotate
    if sharded and par.fsdp_reshard_after_forward != "default":
        s["parallelism.fsdp_reshard_after_forward"] = par.fsdp_reshard_after_forward
    if par.pp > 1:
        s["parallelism.pipeline_parallel_schedule"] = par.schedule
        s["parallelism.pipeline_parallel_microbatch_size"] = tr.micro_batch_size
        s["training.local_batch_size"] = tr.micro_batch_size * par.microbatches
        default_v = 1 if par.schedule in names.SINGLE_STAGE_SCHEDULES else 2
        if par.virtual_stages != default_v:
            stages = par.pp * par.virtual_stages
            lps = next((n for n in range(1, m.layers + 3) if math.ceil((m.layers + 2) / n) == stages), None)
            if par.virtual_stages < default_v:  # a multi-stage schedule with one stage a rank
                notes.append(f"parallel.virtual_stages = {par.virtual_stages} under {par.schedule}: torchtitan gives "
                             "a multi-stage schedule 2 or more stages a rank (written with its default, 2)")
            elif lps is None:
                notes.append(f"parallel.virtual_stages = {par.virtual_stages}: no torchtitan "
                             f"pipeline_parallel_layers_per_stage makes {stages} stages of {m.layers} layers")
            else:
                s["parallelism.pipeline_parallel_layers_per_stage"] = lps
        if par.pipeline_split != "torchtitan":
            notes.append(f"parallel.pipeline_split = {par.pipeline_split}: torchtitan cuts the stages its own way")
        if conv.pipeline_outputs == "kept":
            notes.append("conventions.pipeline_outputs = kept: torchtitan before 0.2.1 (return_outputs=True)")
    else:
        s["training.local_batch_size"] = tr.micro_batch_size
        if par.microbatches > 1:
            s["training.global_batch_size"] = tr.micro_batch_size * par.dp * par.microbatches
    if tr.precision == "fp16-mixed":
        notes.append("training.precision = fp16-mixed: torchtitan trains in bf16 or fp32; written as bf16")
    s["training.mixed_precision_param"] = "float32" if tr.precision == "fp32" else "bfloat16"
    if tr.grad_dtype != "fp32":
        notes.append(f"training.grad_dtype = {tr.grad_dtype}: torchtitan reduces gradients in float32")
    s["training.mixed_precision_reduce"] = "float32"
    if tr.optimizer != "adamw":
        notes.append(f"training.optimizer = {tr.optimizer}: written as torchtitan's AdamW")
    if tr.finetune != "full":
        notes.append("training.finetune = lora: torchtitan's LoRA is set in a config function, not a flag")
    ac = {"none": ("none", None), "full": ("full", None), "selective-op": ("selective", "op"),
          "selective-layer": ("selective", str(tr.recompute_every)), "selective": ("selective", "op")}[tr.recompute]
    if tr.recompute == "selective":
        notes.append("training.recompute = selective (the attention core only): written as torchtitan's per-op "
                     "selective checkpointing")
    s["activation_checkpoint.mode"], s["activation_checkpoint.selective_ac_option"] = ac
    s["compile.enable"] = tr.compile
    if tr.float8 != "none":
        s["float8.recipe_name"] = tr.float8
        s["float8.enable_fsdp_float8_all_gather"] = tr.float8_all_gather
    return s


def export_torchtitan_toml(cfg: Config) -> Exported:
    """The layout as a torchtitan 0.2 job config (``--job.config_file``), its run command in a comment."""
    import tomli_w

    notes: list[str] = []
    s = _common(cfg, notes)
    if cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel:
        notes.append("parallel.sequence_parallel = false: torchtitan 0.2 always runs sequence parallel with TP")
    if cfg.conventions.rms_norm != "fused":
        notes.append(f"conventions.rms_norm = {cfg.conventions.rms_norm}: torchtitan 0.2 uses torch's nn.RMSNorm")
    table: dict[str, Any] = {}
    for key, value in s.items():
        if key in ("parallelism.enable_sequence_parallel",) or value is None:
            continue
        if key.startswith("float8."):
            key = "quantize.linear." + key
        section, _, leaf = key.rpartition(".")
        node = table
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[leaf] = value
    if cfg.training.float8 != "none":
        table["model"]["converters"] = ["quantize.linear.float8"]
        if cfg.training.float8 == "tensorwise":
            del table["quantize"]["linear"]["float8"]["recipe_name"]  # None: tensorwise
    c = cfg.cluster
    head = [f"# A ShardScope layout as a torchtitan 0.2 job config ({cfg.model.preset} on {c.gpus} × {c.gpu.name}).",
            f"# run: torchrun --nnodes {c.nodes} --nproc_per_node {min(c.gpus, c.gpus_per_node)} "
            "-m torchtitan.train --job.config_file THIS_FILE.toml"]
    head += [f"# not expressed: {n}" for n in notes]
    return Exported("\n".join(head) + "\n\n" + tomli_w.dumps(table), tuple(notes))


def export_torchtitan_command(cfg: Config) -> Exported:
    """The layout as torchtitan 0.3's command line (``--module``/``--config`` and overrides)."""
    notes: list[str] = []
    s = _common(cfg, notes)
    name, flavor = _PRESET_MODEL[cfg.model.preset]
    function = next((f for f, d in REGISTRY_03.items() if (d["model.name"], d["model.flavor"]) == (name, flavor)), None)
    if function is None:
        raise InteropError(f"model: {cfg.model.preset} has no torchtitan 0.3 config function ShardScope knows: "
                           f"allowed {', '.join(_PRESET_MODEL[_preset_of(f)][0] + ' ' + _preset_of(f) for f in REGISTRY_03)}")
    base = {**_DEFAULTS, "activation_checkpoint.selective_ac_option": "op", **REGISTRY_03[function]}
    if cfg.training.float8 != ("rowwise" if base.get("model.converters") else "none"):
        notes.append(f"training.float8 = {cfg.training.float8}: torchtitan 0.3 sets float8 in its config functions "
                     f"({function} has {'rowwise' if base.get('model.converters') else 'none'}), not on the command line")
    if cfg.training.recompute == "selective-layer":
        notes.append("training.recompute = selective-layer: torchtitan 0.3 checkpoints per op or every block")
    if cfg.parallel.cp_rotate != "allgather" and cfg.parallel.cp > 1:
        notes.append("parallel.cp_rotate = alltoall: torchtitan 0.3 has no rotate method option")
    c = cfg.cluster
    words = ["torchrun", "--nnodes", str(c.nodes), "--nproc_per_node", str(min(c.gpus, c.gpus_per_node)),
             "-m", "torchtitan.train", "--module", name, "--config", function]
    for key, value in s.items():
        if key.startswith(("model.", "float8.", "activation_checkpoint.")) or key == "compile.enable":
            continue
        if value == base.get(key) or (key == "training.mixed_precision_reduce"):
            continue
        flag = "--" + ("compile.enable_async_tensor_parallel" if key == "parallelism.enable_async_tensor_parallel"
                       else key).replace("_", "-")
        if isinstance(value, bool):
            head, _, leaf = flag.rpartition(".")
            words.append(flag if value else f"{head}.no-{leaf}")
        else:
            words += [flag, str(value)]
    if cfg.parallel.pp > 1 or cfg.parallel.ep > 1:  # torchtitan 0.3's Trainer.Config refuses CUDA graphs with these
        words.append("--training.disable-cuda-graphs")
    if s["compile.enable"] != bool(base.get("compile.enable")):
        words.append("--compile.enable" if s["compile.enable"] else "--compile.no-enable")
    mode = s["activation_checkpoint.mode"]
    if mode != base["activation_checkpoint.mode"] or cfg.training.recompute == "selective-layer":
        words.append(f"activation-checkpoint:{'selective' if mode == 'selective' else mode}")
    text = " ".join(shlex.quote(w) for w in words) + "\n"
    return Exported("".join(f"# not expressed: {n}\n" for n in notes) + text, tuple(notes))


def _preset_of(function: str) -> str:
    d = REGISTRY_03[function]
    return MODELS[(d["model.name"], d["model.flavor"])]
