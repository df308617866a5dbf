"""The launchers' files as text, for the CLI and the window: engine.interop reads and writes their
contents (dicts, JSON, TOML, command lines); YAML, which the engine does not parse, is read and written here.

``import_text(fmt, text, ...)`` → :class:`engine.interop.Imported`; ``export_text(fmt, cfg, form)`` →
:class:`engine.interop.Exported`. Both raise :class:`engine.interop.InteropError` with one message that names the
field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import Config, ConfigError
from engine.interop import Exported, Imported, InteropError
from engine.interop.accelerate import export_accelerate, import_accelerate
from engine.interop.deepspeed import export_deepspeed, import_deepspeed
from engine.interop.megatron import export_megatron, import_megatron
from engine.interop.torchtitan import export_torchtitan_command, export_torchtitan_toml, import_torchtitan

IMPORT_FORMATS = ("torchtitan", "accelerate", "deepspeed", "megatron", "hf")
EXPORT_FORMATS = ("torchtitan", "accelerate", "deepspeed", "megatron")
#: what each export writes: (form, file suffix, description)
EXPORT_FORMS = {"torchtitan": (("command", ".sh", "torchtitan 0.3 command line"),
                               ("toml", ".toml", "torchtitan 0.2 job config")),
                "accelerate": (("command", ".yaml", "accelerate config"),),
                "deepspeed": (("command", ".json", "DeepSpeed config"),),
                "megatron": (("command", ".sh", "Megatron-LM command line"),)}


def read_accelerate(text: str) -> dict[str, Any]:
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InteropError(f"not an accelerate config (YAML): {exc}") from None
    return raw if isinstance(raw, dict) else {"_not_a_table": raw}


def accelerate_yaml(cfg: Config) -> Exported:
    import yaml

    table, head, notes = export_accelerate(cfg)
    lines = [f"# {h}" for h in head] + [f"# not expressed: {n}" for n in notes]
    return Exported("\n".join(lines) + "\n" + yaml.safe_dump(table, sort_keys=False), tuple(notes))


def import_text(fmt: str, text: str, *, path: str | Path | None = None, base: Path | None = None,
                args: list[str] | None = None, gpus: int | None = None, cluster: dict | None = None,
                extra: dict | None = None) -> Imported:
    """A launcher's file (``text``; ``path`` for a Hugging Face config.json, ``base`` the folder paths inside it are
    read from) as a ShardScope config."""
    base = base or Path.cwd()
    cluster, extra = dict(cluster or {}), dict(extra or {})
    if fmt != "torchtitan" and args:
        raise InteropError(f"{' '.join(args)}: only torchtitan's import takes the launcher's own arguments (use "
                           "--set SECTION.FIELD=VALUE)")
    if fmt == "torchtitan":
        return import_torchtitan(text, args=list(args or []), base_dir=base, gpus=gpus, cluster=cluster, extra=extra)
    if fmt == "accelerate":
        if gpus is not None:
            raise InteropError("--gpus: accelerate's config gives num_processes (edit it there)")
        return import_accelerate(read_accelerate(text), extra=extra, cluster=cluster,
                                 read_file=lambda p: (base / p).read_text(encoding="utf-8"))
    if fmt == "deepspeed":
        return import_deepspeed(text, gpus=gpus, extra=extra, cluster=cluster)
    if fmt == "megatron":
        return import_megatron(text, gpus=gpus, extra=extra, cluster=cluster)
    if fmt == "hf":
        return _import_hf(Path(path) if path else None, gpus, cluster, extra)
    raise InteropError(f"format {fmt!r}: allowed {', '.join(IMPORT_FORMATS)}")


def _import_hf(path: Path | None, gpus: int | None, cluster: dict, extra: dict) -> Imported:
    if path is None:
        raise InteropError("hf: the config.json's path is needed (its model is read from the file)")
    if "preset" in extra.get("model", {}):
        raise InteropError("--model: the Hugging Face config is the model (drop --model)")
    raw = {"model": {"hf_config": str(Path(path).resolve()), **extra.get("model", {})},
           "cluster": {"gpus": gpus or 1, **({} if ("gpu" in cluster or "preset" in cluster) else {"gpu": "h100-sxm"}),
                       **cluster, **extra.get("cluster", {})},
           **{k: v for k, v in extra.items() if k not in ("model", "cluster")}}
    assumed = [] if ("gpu" in cluster or "preset" in cluster) else ["cluster.gpu = h100-sxm (--gpu names the card)"]
    try:
        return Imported(Config.from_dict(raw), "Hugging Face config.json", (), (), tuple(assumed))
    except ConfigError as exc:
        raise InteropError(f"the imported layout is not a valid ShardScope config: {exc}") from None


def export_text(fmt: str, cfg: Config, form: str = "command") -> Exported:
    if fmt == "torchtitan":
        return export_torchtitan_toml(cfg) if form == "toml" else export_torchtitan_command(cfg)
    if form != "command":
        raise InteropError(f"--as {form}: torchtitan's only (allowed for {fmt}: command)")
    if fmt == "accelerate":
        return accelerate_yaml(cfg)
    if fmt == "deepspeed":
        return export_deepspeed(cfg)
    if fmt == "megatron":
        return export_megatron(cfg)
    raise InteropError(f"format {fmt!r}: allowed {', '.join(EXPORT_FORMATS)}")
