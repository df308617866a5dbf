"""The one description of a training job that engine, backend and GUI share.

A :class:`Config` is frozen and always valid: constructing one with values that break
a rule raises :class:`ConfigError`, which lists *every* problem at once, each naming
the field, the value and what is allowed. Files (TOML or JSON) are read with the
standard library's ``tomllib`` / ``json``; loading never executes anything.

File format (the product's public contract; keys may be added, never renamed)::

    schema_version = 1
    [model]      preset, hf_config, layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq_len,
                 tied_embeddings, mlp, norm, attention ("eager" | "flash" | "mla"), position,
                 bias, dropout, head_size (0 = hidden / heads), qkv_bias, qk_norm, attention_sinks,
                 sliding_window (0 = none), full_attention_every (0 = every layer slides)
                 mixture of experts (experts = 0: a dense model): experts, experts_per_token,
                 expert_ffn_hidden (0 = ffn_hidden), shared_experts, dense_layers,
                 router_score ("softmax" | "sigmoid"), router_bias, router_balance_bias,
                 norm_topk_prob, routed_scaling_factor, router_aux_loss, router_groups,
                 router_topk_groups
                 multi-head latent attention (attention = "mla"): kv_lora_rank,
                 q_lora_rank (0 = no query compression), qk_rope_head_dim, qk_nope_head_dim,
                 v_head_dim
    [cluster]    preset, gpu (a preset name or a table), gpus, gpus_per_node,
                 intra_node_bandwidth_gb_per_s, intra_node_latency_us,
                 inter_node_bandwidth_gb_per_s, inter_node_latency_us, cpu_cores,
                 cpu_wake_latency_us
    [parallel]   dp, tp, pp, cp, cp_rotate ("allgather" | "alltoall"), zero (or fsdp =
                 "FULL_SHARD" | ...), replicate,
                 sequence_parallel, schedule, virtual_stages, microbatches,
                 dp_mode ("ddp" | "dataparallel": legacy single-process nn.DataParallel),
                 async_tp, fsdp_reshard_after_forward ("default" | "always" | "never"),
                 pipeline_split ("even" | "torchtitan"),
                 ep (expert parallel: the experts of each MoE layer split over ep ranks)
    [training]   micro_batch_size, precision, grad_dtype, optimizer, recompute ("none" |
                 "selective" | "full" | "selective-op" | "selective-layer"), recompute_every,
                 float8 ("none" | "tensorwise" | "rowwise"), float8_all_gather, compile,
                 finetune ("full" | "lora"), lora_rank, lora_alpha,
                 lora_targets ("attention" | "mlp" | "all"), lora_base_dtype ("fp32" | "bf16" | "nf4")
    [conventions] the switchable conventions (overhead lines, bucket size, bubble,
                 moe_imbalance, moe_capacity_factor, moe_expert_load (a list of floats), ...)

``model.hf_config`` names a Hugging Face ``config.json`` (relative to the config file, or
absolute; engine.model.hf_config reads it): its architecture fills the model fields, and any field
given beside it in [model] overrides it.

Each field is declared once with its doc and allowed values (``engine.config.knobs.knob``; the sections:
``engine.config.sections``); ``engine.config.rules`` checks them and the rules between fields,
``engine.config.parsing`` reads and writes the files. A value outside its range or choices is a problem
that names the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from assets import PRESETS_DIR
from engine.config.knobs import Knob, Range, knob
from engine.config.parsing import _parse, _unparse
from engine.config.problems import NO_VALUE, ConfigError, Problem, unknown_key
from engine.config.rules import (
    MAX_BREADTH_FIRST_BLOCKS,
    MAX_PIPELINE_BLOCKS,
    MAX_PP_LAYERS,
    MAX_STAGE_MICROBATCHES,
    check,
    step_size_problems,
)
from engine.config.sections import (
    _SECTIONS,
    FIELD_RANGES,
    KNOBS,
    SCHEMA_VERSION,
    ClusterSpec,
    Conventions,
    GPUSpec,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
)

__all__ = [
    "FIELD_RANGES", "KNOBS", "MAX_BREADTH_FIRST_BLOCKS", "MAX_PIPELINE_BLOCKS", "MAX_PP_LAYERS",
    "MAX_STAGE_MICROBATCHES", "SCHEMA_VERSION", "ClusterSpec", "Config", "ConfigError", "Conventions", "GPUSpec",
    "Knob", "ModelSpec", "ParallelSpec", "Problem", "Range", "TrainingSpec", "check", "default_config", "knob",
    "step_size_problems",
]


@dataclass(frozen=True)
class Config:
    """A whole training job. Always valid: construction checks every rule."""

    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    conventions: Conventions = field(default_factory=Conventions)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        problems = check(self.model, self.cluster, self.parallel, self.training, self.conventions)
        if self.schema_version != SCHEMA_VERSION:
            problems.append(
                Problem("schema_version", self.schema_version, f"allowed: {SCHEMA_VERSION}")
            )
        if problems:
            raise ConfigError(problems)

    # ----------------------------------------------------------------- derived

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.parallel.dp * self.parallel.microbatches * self.training.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.seq_len

    @property
    def local_seq_len(self) -> int:
        """Tokens of one sequence on one rank: model.seq_len / parallel.cp (context parallelism splits
        the sequence; every op outside attention sees only these)."""
        return self.model.seq_len // self.parallel.cp

    # ----------------------------------------------------------------- changing

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A new, validated Config with some fields changed: ``cfg.replace(parallel={"tp": 2})``.

        Raises ConfigError (naming every field at fault) if the result is invalid.
        """
        unknown = set(sections) - set(_SECTIONS)
        if unknown:
            raise ConfigError(
                [Problem(k, NO_VALUE, f"unknown section; allowed: {', '.join(_SECTIONS)}") for k in sorted(unknown)]
            )
        changed = {}
        problems: list[Problem] = []
        for name, updates in sections.items():
            current = getattr(self, name)
            allowed = {f.name for f in dataclasses.fields(current)}
            for key in updates:
                if key not in allowed:
                    problems.append(
                        Problem(f"{name}.{key}", updates[key], unknown_key(key, allowed))
                    )
            if not problems:
                changed[name] = dataclasses.replace(current, **updates)
        if problems:
            raise ConfigError(problems)
        return dataclasses.replace(self, **changed)

    # ----------------------------------------------------------------- files

    @classmethod
    def from_dict(cls, raw: dict[str, Any], base_dir: str | Path | None = None) -> Config:
        """Parse and validate ``raw``; relative paths in it (model.hf_config) are taken from
        ``base_dir`` (the working directory when None)."""
        return cls(**_parse(raw, Path(base_dir) if base_dir is not None else None))

    def to_dict(self) -> dict[str, Any]:
        return _unparse(self)

    @classmethod
    def load(cls, path: str | Path) -> Config:
        """Read a ``.toml`` or ``.json`` file. Errors name the file and every problem."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([Problem("file", str(path), f"cannot be read: {exc.strerror or exc}")]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError([Problem("file", str(path), f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                                       f"offset {exc.start}): save it as UTF-8")]) from None
        except ValueError as exc:  # a path with a NUL character
            raise ConfigError([Problem("file", str(path), f"cannot be read: {exc}")]) from None
        if path.suffix.lower() == ".json":
            return cls.loads_json(text, base_dir=path.parent)
        return cls.loads_toml(text, base_dir=path.parent)

    @classmethod
    def loads_toml(cls, text: str, base_dir: str | Path | None = None) -> Config:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([Problem("file", NO_VALUE, f"is not valid TOML: {exc}")]) from None
        except RecursionError:
            raise ConfigError([Problem("file", NO_VALUE, "is nested too deeply to be a config")]) from None
        return cls.from_dict(raw, base_dir)

    @classmethod
    def loads_json(cls, text: str, base_dir: str | Path | None = None) -> Config:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError([Problem("file", NO_VALUE, f"is not valid JSON: {exc}")]) from None
        except RecursionError:
            raise ConfigError([Problem("file", NO_VALUE, "is nested too deeply to be a config")]) from None
        if not isinstance(raw, dict):
            raise ConfigError([Problem("file", NO_VALUE, "must hold a JSON object at the top level")])
        return cls.from_dict(raw, base_dir)

    def dumps_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    def dumps_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write as TOML or JSON by the file's suffix, atomically (write, then rename)."""
        path = Path(path)
        text = self.dumps_json() if path.suffix.lower() == ".json" else self.dumps_toml()
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        except BaseException:  # a full or read-only disk leaves nothing behind
            tmp.unlink(missing_ok=True)
            raise
        return path


def default_config() -> Config:
    """The embedded default: the tiny model on local CPU ranks (assets/presets/default.toml)."""

    return Config.load(PRESETS_DIR / "default.toml")
