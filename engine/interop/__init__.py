"""The launchers' languages: read the configs people already have, write the layout they chose.

Each format is a module with ``import_*`` (text → :class:`Imported`: a ShardScope config plus every
field it could not express, named) and ``export_*`` (config → text plus the same list the other
way). Nothing here imports torch, Qt or the launchers themselves: the formats are read as text; the
tests hold the launchers' own parsers up against these readers.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from engine.config import Config, ConfigError


@dataclass(frozen=True)
class Imported:
    """What an importer made of a launcher's config: the ShardScope config and, field by field, what
    did not carry over (``not_expressed``: it bears on memory or time and ShardScope has no equivalent;
    ``ignored``: keys that bear on neither — logging, checkpoints, data, the learning rate)."""

    config: Config
    flavour: str
    not_expressed: tuple[str, ...] = field(default_factory=tuple)
    ignored: tuple[str, ...] = field(default_factory=tuple)
    assumed: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Exported:
    """A layout in a launcher's language: ``text`` (a file or a command line), and each config field the
    format cannot express, named (also written into ``text`` as comments where the format has them)."""

    text: str
    not_expressed: tuple[str, ...] = field(default_factory=tuple)


class InteropError(ValueError):
    """A launcher's config that cannot become a ShardScope config: the message names the field, its value
    and what is allowed."""


def compact_dict(cfg: Config) -> dict:
    """``cfg`` as a short file: the model by its preset (with the fields that differ from it), the cluster's card,
    size and links, and of the other sections only what differs from their defaults (``dp`` and ``grad_dtype``
    always). ``Config.from_dict(compact_dict(cfg)) == cfg``."""
    import dataclasses

    full = cfg.to_dict()
    out: dict = {"schema_version": full["schema_version"]}
    model = full["model"]
    if cfg.model.preset is not None:
        base = Config.from_dict({"model": {"preset": cfg.model.preset}, "cluster": {"gpu": "cpu", "gpus": 1}})
        ref = base.to_dict()["model"]
        model = {"preset": cfg.model.preset, **{k: v for k, v in model.items() if k != "preset" and ref.get(k) != v}}
    out["model"] = model
    cluster = full["cluster"]
    ref_cluster = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {
        "gpu": cluster["gpu"], "gpus": cfg.cluster.gpus, "gpus_per_node": cfg.cluster.gpus_per_node}}).to_dict()["cluster"]
    keep = ("gpu", "gpus", "gpus_per_node", "preset")
    out["cluster"] = {k: v for k, v in cluster.items() if k in keep or ref_cluster.get(k) != v}
    for section in ("parallel", "training", "conventions"):
        spec = getattr(cfg, section)
        defaults = {f.name: f.default for f in dataclasses.fields(spec)}
        always = {"parallel": ("dp",), "training": ("grad_dtype",), "conventions": ()}[section]
        table = {k: v for k, v in full[section].items() if k in always or v != _plain(defaults.get(k))}
        if table:
            out[section] = table
    return out


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def build_config(parallel: dict[str, Any], training: dict[str, Any], gpus: int, per_node: int, cluster: dict[str, Any],
           extra: dict[str, dict[str, Any]], flavour: str, notes: list[str], assumed: list[str],
           ignored: tuple[str, ...]) -> Imported:
    """The config from what a launcher's file said and what the user added (``extra``), naming each field that had
    to be assumed because neither said it."""
    raw: dict[str, Any] = {"model": {}, "cluster": {"gpus": gpus, "gpus_per_node": per_node, **cluster},
                           "parallel": parallel, "training": training}
    for section, fields in extra.items():
        raw.setdefault(section, {}).update(fields)
    if not raw["model"]:
        raise InteropError(f"the model: {flavour}'s config does not hold it; give --model PRESET or --hf "
                           "CONFIG.json")
    if "gpu" not in raw["cluster"] and "preset" not in raw["cluster"]:
        raw["cluster"]["gpu"] = "h100-sxm"
        assumed.append(f"cluster.gpu = h100-sxm: {flavour}'s config does not name the card (--gpu names it)")
    if "micro_batch_size" not in raw["training"]:
        raw["training"]["micro_batch_size"] = 1
        assumed.append(f"training.micro_batch_size = 1: the batch is the training script's, not {flavour}'s "
                       "(--set training.micro_batch_size=N)")
    if raw["model"].get("preset") and "seq_len" not in raw["model"]:
        assumed.append("model.seq_len: the preset's (--set model.seq_len=N)")
    try:
        config = Config.from_dict(raw)
    except ConfigError as exc:
        raise InteropError(f"the imported layout is not a valid ShardScope config: {exc}") from None
    return Imported(config, flavour, tuple(notes), ignored, tuple(assumed))


def split_command(text: str) -> list[str]:
    """A shell command line as its words: backslash continuations joined, ``#`` comments dropped."""
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise InteropError(f"the command line cannot be split into words: {exc}") from None


def launch_world(tokens: list[str], scripts: tuple[str, ...]) -> tuple[int | None, int | None, list[str],
                                                                        dict[str, str]]:
    """From a launch command's words: the world size and GPUs a node (torchrun's ``--nnodes`` ×
    ``--nproc_per_node``, or ``NGPU=`` / ``NNODES=`` assigned before the command), the arguments after the script
    (the first word ending in one of ``scripts``; all of them where there is none) and the ``NAME=value``
    assignments before the command, whose ``$NAME`` / ``${NAME}`` the later words have expanded."""
    env: dict[str, str] = {}
    while tokens and "=" in tokens[0] and tokens[0].split("=", 1)[0].isupper():
        name, val = tokens.pop(0).split("=", 1)
        env[name] = val
    for name, val in env.items():
        tokens = [t.replace("${" + name + "}", val).replace("$" + name, val) for t in tokens]
    script = next((i for i, tok in enumerate(tokens) if tok.endswith(scripts)), None)
    before, args = (tokens[:script], tokens[script + 1:]) if script is not None else ([], tokens)
    opts: dict[str, str] = {}
    for i, tok in enumerate(before):
        name, eq, val = tok.partition("=")
        if name.startswith("--"):
            opts[name.replace("-", "_")] = val if eq else (before[i + 1] if i + 1 < len(before) else "")
    per_node = opts.get("__nproc_per_node") or env.get("NGPU")
    nnodes = (opts.get("__nnodes") or env.get("NNODES") or "1").split(":")[-1]
    if not (per_node and per_node.isdigit() and nnodes.isdigit()):
        return None, None, args, env
    return int(nnodes) * int(per_node), int(per_node), args, env
