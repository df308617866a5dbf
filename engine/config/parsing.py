"""Reading a config file's tables (TOML or JSON, the product's public format) into the sections, each
mistake a problem that names the field; and writing a Config back."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from engine import names
from engine.config.problems import NO_VALUE, ConfigError, Problem, unknown_key
from engine.config.rules import (
    check,
)
from engine.config.sections import (
    _SECTIONS,
    SCHEMA_VERSION,
    ClusterSpec,
    Conventions,
    GPUSpec,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
    _field_types,
)
from engine.model.hf_config import HFConfigError, read_hf_config
from engine.model.presets import cluster_presets, gpu_presets, model_presets

_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               tuple: "a list of numbers"}


def _nested_numbers(value: Any, depth: int) -> bool:
    """Lists of numbers nested at most ``depth`` deep, every leaf a number at the same depth."""
    if not isinstance(value, (list, tuple)) or depth == 0:
        return False
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return True
    return all(_nested_numbers(x, depth - 1) for x in value)


def _deep_float(value: Any) -> Any:
    return tuple(_deep_float(x) for x in value) if isinstance(value, (list, tuple)) else float(value)


def _coerce(p: list[Problem], path: str, value: Any, kind: type) -> tuple[bool, Any]:
    try:
        return _coerce_number(p, path, value, kind)
    except OverflowError:  # an integer of hundreds of digits given where a float goes
        p.append(Problem(path, value, f"is too large for a number (at most about {_MAX_FLOAT:.3g})"))
        return False, None


_MAX_FLOAT = 1.7976931348623157e308


def _coerce_number(p: list[Problem], path: str, value: Any, kind: type) -> tuple[bool, Any]:
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return True, value
    if kind in (bool, str) and isinstance(value, kind):
        return True, value
    if kind is tuple and isinstance(value, (list, tuple)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return True, tuple(float(x) for x in value)
    if kind is tuple and path.endswith("moe_expert_load") and _nested_numbers(value, 3):
        return True, _deep_float(value)  # per block, or per microbatch and block
    p.append(Problem(path, value, f"must be {_KIND_NAMES.get(kind, kind.__name__)}"))
    return False, None


def _table(p: list[Problem], raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        p.append(Problem(key, value, "must be a table"))
        return {}
    return value


def _read_fields(p: list[Problem], section: str, table: dict, cls: type, skip: set[str]) -> dict[str, Any]:
    """Type-check a table against a dataclass; unknown keys are problems that name the key."""
    types = _field_types(cls)
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in skip:
            continue
        if key not in types:
            allowed = sorted(set(types) | skip)
            p.append(Problem(f"{section}.{key}", value, unknown_key(key, allowed)))
            continue
        ok, v = _coerce(p, f"{section}.{key}", value, types[key])
        if ok:
            out[key] = v
    return out


def _parse(raw: dict[str, Any], base_dir: Path | None = None) -> dict[str, Any]:
    """The sections of ``raw``, each field read and checked; raises ConfigError with every problem."""
    p: list[Problem] = []
    if not isinstance(raw, dict):
        raise ConfigError([Problem("file", NO_VALUE, "must hold a table at the top level")])
    if ("model_type" in raw or "architectures" in raw) and not set(raw) & set(_SECTIONS):
        raise ConfigError([Problem("file", NO_VALUE, "is a Hugging Face model config (config.json: model_type, "
                                   "architectures), not a ShardScope config: name it in one — [model] hf_config = "
                                   "\"PATH/config.json\" — beside the [cluster] and [parallel] you want")])
    for key in raw:
        if key not in _SECTIONS and key != "schema_version":
            p.append(Problem(key, raw[key], unknown_key(key, ("schema_version", *_SECTIONS))))
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION or isinstance(version, bool):
        p.append(Problem("schema_version", version, f"allowed: {SCHEMA_VERSION}"))

    model = _parse_model(p, _table(p, raw, "model"), base_dir)
    cluster_raw = _table(p, raw, "cluster")
    parallel_raw = _table(p, raw, "parallel")
    par = _parse_parallel(p, parallel_raw)
    cluster = _parse_cluster(p, cluster_raw, par)
    inner = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)
    if cluster is not None and "dp" not in par and inner > 0 and cluster.gpus % inner == 0:
        par["dp"] = max(1, cluster.gpus // inner)
    parallel = ParallelSpec(**par)
    tr = _read_fields(p, "training", _table(p, raw, "training"), TrainingSpec, set())
    if "grad_dtype" not in tr:
        tr["grad_dtype"] = names.DEFAULT_GRAD_DTYPE.get(tr.get("precision", TrainingSpec.precision), "fp32")
    training = TrainingSpec(**tr)
    conventions = Conventions(**_read_fields(p, "conventions", _table(p, raw, "conventions"), Conventions, set()))

    if model is not None and cluster is not None:
        p.extend(check(model, cluster, parallel, training, conventions))
    if p:
        # keep order, drop exact duplicates
        seen, unique = set(), []
        for prob in p:
            k = (prob.field, repr(prob.value), prob.message)
            if k not in seen:
                seen.add(k)
                unique.append(prob)
        raise ConfigError(unique)
    return {"model": model, "cluster": cluster, "parallel": parallel, "training": training,
            "conventions": conventions}


def _parse_model(p: list[Problem], table: dict, base_dir: Path | None = None) -> ModelSpec | None:
    presets = model_presets()
    base: dict[str, Any] = {}
    preset = table.get("preset")
    bad_preset = False
    if preset is not None:
        if not isinstance(preset, str) or preset not in presets:
            near = difflib.get_close_matches(str(preset), list(presets), n=1, cutoff=0.75)
            p.append(Problem("model.preset", preset, "unknown preset; " + (f"did you mean {near[0]}? " if near else "")
                             + f"allowed: {', '.join(presets)}"))
            bad_preset = True
        else:
            base = dict(presets[preset])
    hf_path = table.get("hf_config")
    if hf_path is not None:
        if preset is not None:
            p.append(Problem("model.hf_config", hf_path, "names the architecture as model.preset does: give one "
                             "of them, not both"))
        hf = _read_hf(p, hf_path, base_dir)
        if hf is None:
            return None
        base, hf_path = hf
    fields = _read_fields(p, "model", table, ModelSpec, {"preset", "hf_config"})
    merged = {**base, **fields}
    if hf_path is not None:
        merged["hf_config"] = hf_path
    if base and preset is not None and hf_path is None:
        merged["preset"] = preset
    required = [f.name for f in dataclasses.fields(ModelSpec) if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in merged]
    if missing:
        if not bad_preset:  # an unknown preset's problem already says what to give
            p.append(Problem("model", NO_VALUE, f"missing {', '.join(missing)} (give them, or name a preset: "
                             f"{', '.join(presets)})" if table else
                             f"no [model] section: name a preset ([model] preset = \"tiny\": {', '.join(presets)}), "
                             "point at a Hugging Face config.json (hf_config = \"PATH\") or give its shape ("
                             f"{', '.join(missing)})"))
        return None
    return ModelSpec(**merged)


def _read_hf(p: list[Problem], value: Any, base_dir: Path | None) -> tuple[dict[str, Any], str] | None:
    """The fields of the Hugging Face config.json ``value`` names (relative to ``base_dir``, the
    config file's folder, else the working directory) and its resolved path."""

    if not isinstance(value, str) or not value:
        p.append(Problem("model.hf_config", value, "must be the path of a Hugging Face config.json (a string)"))
        return None
    if "\x00" in value:
        p.append(Problem("model.hf_config", value, "a file path cannot hold a NUL character"))
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    try:
        fields = read_hf_config(path)
    except HFConfigError as err:
        for message in err.messages:
            p.append(Problem("model.hf_config", value, message))
        return None
    return fields, str(path.resolve())


def _parse_parallel(p: list[Problem], table: dict) -> dict[str, Any]:
    table = dict(table)
    fsdp = table.pop("fsdp", None)
    par = _read_fields(p, "parallel", table, ParallelSpec, set())
    if fsdp is not None:
        if not isinstance(fsdp, str) or fsdp not in names.FSDP_STRATEGIES:
            p.append(Problem("parallel.fsdp", fsdp, f"allowed: {' | '.join(names.FSDP_STRATEGIES)}"))
        else:
            zero, hybrid = names.FSDP_STRATEGIES[fsdp]
            if "zero" in par and par["zero"] != zero:
                p.append(Problem("parallel.zero", par["zero"], f"disagrees with parallel.fsdp = {fsdp!r} (ZeRO-{zero})"))
            par["zero"] = zero
            if hybrid and par.get("replicate", 1) == 1:
                p.append(Problem("parallel.replicate", par.get("replicate", 1),
                                 f"fsdp = {fsdp!r} needs parallel.replicate > 1 (HSDP replica count)"))
    return par


def _parse_gpu(p: list[Problem], value: Any) -> GPUSpec | None:
    presets = gpu_presets()
    if isinstance(value, str):
        if value not in presets:
            p.append(Problem("cluster.gpu", value, f"unknown GPU; allowed: {', '.join(presets)}"))
            return None
        return GPUSpec(name=value, **presets[value])
    if isinstance(value, dict):
        value = dict(value)
        base_name = value.pop("preset", None)
        base: dict[str, Any] = {}
        if base_name is not None:
            if not isinstance(base_name, str) or base_name not in presets:
                p.append(Problem("cluster.gpu.preset", base_name, f"unknown GPU; allowed: {', '.join(presets)}"))
            else:
                base = {"name": base_name, **presets[base_name]}
        fields = _read_fields(p, "cluster.gpu", value, GPUSpec, set())
        merged = {**base, **fields}
        merged.setdefault("name", "custom")
        missing = [f.name for f in dataclasses.fields(GPUSpec) if f.default is dataclasses.MISSING and f.name not in merged]
        if missing:
            p.append(Problem("cluster.gpu", NO_VALUE, f"missing {', '.join(missing)}"))
            return None
        return GPUSpec(**merged)
    p.append(Problem("cluster.gpu", value, f"must be a GPU preset name ({', '.join(presets)}) or a table"))
    return None


def _parse_cluster(p: list[Problem], table: dict, par: dict[str, Any]) -> ClusterSpec | None:
    presets = cluster_presets()
    table = dict(table)
    preset = table.pop("preset", None)
    base: dict[str, Any] = {}
    if preset is not None:
        if not isinstance(preset, str) or preset not in presets:
            p.append(Problem("cluster.preset", preset, f"unknown preset; allowed: {', '.join(presets)}"))
            preset = None
        else:
            base = dict(presets[preset])
    gpu_value = table.pop("gpu", base.pop("gpu", "cpu"))
    gpu = _parse_gpu(p, gpu_value)
    fields = _read_fields(p, "cluster", table, ClusterSpec, {"preset", "gpu"})
    if gpu is None:
        return None
    merged = {**base, **fields}
    if "gpus" not in fields:
        inner = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)
        if "dp" in par:
            merged["gpus"] = par["dp"] * inner
        elif "gpus" not in merged:
            merged["gpus"] = inner
    merged.setdefault("gpus_per_node", min(merged["gpus"], 8) if merged["gpus"] > 0 else 1)
    merged.setdefault("intra_node_bandwidth_gb_per_s", gpu.intra_node_bandwidth_gb_per_s)
    merged.setdefault("inter_node_bandwidth_gb_per_s", gpu.inter_node_bandwidth_gb_per_s)
    merged.setdefault("intra_node_latency_us", 20.0 if gpu.name == "cpu" else 2.0)
    merged.setdefault("inter_node_latency_us", 50.0 if gpu.name == "cpu" else 5.0)
    return ClusterSpec(gpu=gpu, preset=preset, **merged)


def _asdict_without_none(obj: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if getattr(obj, f.name) is not None and f.name not in drop}


#: Fields a file names only when they differ from their defaults (the mixture-of-experts, MLA and
#: recent attention fields): a dense model's file reads as it did before they existed.
_WRITTEN_WHEN_SET: dict[type, tuple[str, ...]] = {
    ModelSpec: ("head_size", "qkv_bias", "qk_norm", "attention_sinks", "sliding_window", "full_attention_every", "experts",
                "experts_per_token", "expert_ffn_hidden", "shared_experts", "dense_layers", "router_score",
                "router_bias", "router_balance_bias", "norm_topk_prob", "routed_scaling_factor",
                "router_aux_loss", "router_groups", "router_topk_groups", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim"),
    ParallelSpec: ("ep",),
    ClusterSpec: ("cpu_wake_latency_us",),
    Conventions: ("moe_imbalance", "moe_capacity_factor", "moe_expert_load"),
}


def _drop_defaults(obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    for key in _WRITTEN_WHEN_SET.get(type(obj), ()):
        if key in out and out[key] == defaults[key]:
            del out[key]
    return out


def _unparse(cfg) -> dict[str, Any]:
    """``cfg`` (a Config) as the file writes it: defaults left out where a preset gives them."""
    # hf_config is provenance only: every field it gave is written out, so the file stands alone
    model = _drop_defaults(cfg.model, _asdict_without_none(cfg.model, drop=("preset", "hf_config")))
    if cfg.model.preset is not None:
        model = {"preset": cfg.model.preset, **model}
    cl = cfg.cluster
    gpu = cl.gpu
    presets = gpu_presets()
    if gpu.name in presets and GPUSpec(name=gpu.name, **presets[gpu.name]) == gpu:
        gpu_value: Any = gpu.name
    else:
        gpu_value = _asdict_without_none(gpu)
    cluster: dict[str, Any] = {}
    if cl.preset is not None:
        cluster["preset"] = cl.preset
    cluster["gpu"] = gpu_value
    cluster.update(_drop_defaults(cl, _asdict_without_none(cl, drop=("gpu", "preset"))))
    return {
        "schema_version": cfg.schema_version,
        "model": model,
        "cluster": cluster,
        "parallel": _drop_defaults(cfg.parallel, _asdict_without_none(cfg.parallel)),
        "training": _asdict_without_none(cfg.training),
        "conventions": _drop_defaults(cfg.conventions, _asdict_without_none(cfg.conventions)),
    }
