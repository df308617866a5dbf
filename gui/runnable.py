"""The runnable version of a config: the same layout, small enough for this machine.

A config for 16 H100s running Llama-3 8B cannot run on a laptop, but its *layout* can: the
same dp/tp/pp, ZeRO stage, schedule, virtual stages, microbatches, recompute and precision,
on the tiny model with CPU ranks. Running that and predicting that exact config gives an
apples-to-apples comparison of the parts of the model that do not depend on scale (the
schedule's order, which categories a strategy shards, how activations count per stage).

Pure: engine only, no Qt.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from engine import Config, ConfigError
from engine.backend_limits import predict_only

LOCAL_MAX_RANKS = 8  # child processes this machine is asked to run at once
LOCAL_GPU = "cpu"
RUNNABLE_MODEL = "tiny"
MAX_LOCAL_PARAMS = 50_000_000  # above this a CPU run takes minutes per step


def _param_count(cfg: Config) -> int:
    from engine.model.params import param_counts

    return int(param_counts(cfg.model).total)


def too_large_reasons(cfg: Config) -> list[str]:
    """Why ``cfg`` cannot run on this machine as it is (empty: it can)."""
    reasons = []
    if cfg.cluster.gpu.name != LOCAL_GPU:
        reasons.append(f"GPU kind {cfg.cluster.gpu.name} (this machine runs {LOCAL_GPU} ranks)")
    world = cfg.parallel.world_size
    if world > LOCAL_MAX_RANKS:
        reasons.append(f"{world} ranks (more than {LOCAL_MAX_RANKS} local processes)")
    n = _param_count(cfg)
    if n > MAX_LOCAL_PARAMS:
        reasons.append(f"{cfg.model.preset or 'the model'} has {n / 1e6:,.0f} M parameters "
                       f"(local runs stay under {MAX_LOCAL_PARAMS / 1e6:.0f} M)")
    return reasons


@dataclass(frozen=True)
class Runnable:
    """What Run will execute for a config: itself, or its runnable version (or nothing)."""

    original: Config
    config: Config | None  # None: no runnable version exists (see ``problems``)
    reasons: list[str] = field(default_factory=list)  # why the original cannot run here
    changes: list[str] = field(default_factory=list)  # what the runnable version changed
    problems: list[str] = field(default_factory=list)  # why no runnable version exists

    @property
    def is_original(self) -> bool:
        return not self.reasons and self.config is not None

    def describe(self) -> str:
        if self.is_original:
            return ""
        if self.config is None:
            if not self.reasons:
                return "This layout cannot run with PyTorch's APIs (the prediction stands): " + "; ".join(self.problems)
            return ("Too large to run here (" + "; ".join(self.reasons) + ") and no runnable version keeps this "
                    "layout: " + "; ".join(self.problems))
        par = self.config.parallel
        layout = (f"dp {par.dp} × " + (f"cp {par.cp} × " if par.cp > 1 else "") + f"tp {par.tp} × pp {par.pp}, ZeRO {par.zero}, {par.schedule} v{par.virtual_stages} "
                  f"m{par.microbatches}, recompute {self.config.training.recompute}, {self.config.training.precision}")
        return ("Too large to run here (" + "; ".join(self.reasons) + "). Run executes the runnable version — "
                f"the same layout ({layout}) with " + ", ".join(self.changes) + " — and compares it with the "
                "prediction of that exact config, apples to apples.")


def runnable_version(cfg: Config) -> Runnable:
    """The config Run executes for ``cfg``: ``cfg`` itself when it fits this machine."""
    reasons = too_large_reasons(cfg)
    if not reasons:
        problems = predict_only(cfg)
        return Runnable(cfg, None, problems=problems) if problems else Runnable(cfg, cfg)
    d = copy.deepcopy(cfg.to_dict())
    par = d["parallel"]
    changes = []
    if cfg.model.preset != RUNNABLE_MODEL or _param_count(cfg) > MAX_LOCAL_PARAMS:
        from engine.model.presets import model_presets

        d["model"] = {"preset": RUNNABLE_MODEL, **model_presets()[RUNNABLE_MODEL]}
        changes.append(f"the {RUNNABLE_MODEL} model instead of {cfg.model.preset or 'the custom model'}")
    cp = par.get("cp", 1)
    tp_pp = par["tp"] * par["pp"] * cp  # the ranks one data-parallel replica needs
    if tp_pp > LOCAL_MAX_RANKS:
        return Runnable(cfg, None, reasons, problems=[
            f"tp × pp{' × cp' if cp > 1 else ''} = {tp_pp} ranks already exceeds the {LOCAL_MAX_RANKS} local ones"])
    if cp > 1 and par.get("cp_rotate") == "alltoall" and d["model"].get("attention") != "flash":
        par["cp_rotate"] = "allgather"
        changes.append("the all-gather K/V exchange instead of the ring (the ring runs with flash attention only; "
                       f"the {d['model'].get('preset') or 'run'}'s model has {d['model'].get('attention')} attention)")
    world = par["dp"] * tp_pp
    if world > LOCAL_MAX_RANKS:
        dp = max(1, LOCAL_MAX_RANKS // tp_pp)
        changes.append(f"dp {dp} instead of {par['dp']} ({dp * tp_pp} ranks instead of {world})")
        par["dp"] = dp
        world = dp * tp_pp
    if par.get("replicate", 1) > 1 and par["dp"] % par["replicate"]:
        par["replicate"] = 1
        changes.append("no replica groups (HSDP needs dp to be a multiple of them)")
    if cfg.model.experts > 0 and not d["model"].get("experts"):
        changes.append(_small_moe(cfg, d["model"], par))
    d["cluster"] = {"gpu": LOCAL_GPU, "gpus": world, "gpus_per_node": world}
    if cfg.cluster.gpu.name != LOCAL_GPU:
        changes.append(f"{world} CPU ranks instead of {cfg.cluster.gpu.name}")
    try:
        small = Config.from_dict(d)
    except ConfigError as exc:
        return Runnable(cfg, None, reasons, changes,
                        [str(p) for p in exc.problems] or [str(exc)])
    problems = predict_only(small)
    if problems:
        return Runnable(cfg, None, reasons, changes, problems)
    return Runnable(cfg, small, reasons, changes)


#: the runnable version of a mixture of experts: the runnable model with this many routed experts
RUNNABLE_EXPERTS = 8


def _small_moe(cfg: Config, model: dict, par: dict) -> str:
    """Make the runnable model (``model``, a dense preset's table) a small mixture of experts like
    ``cfg``'s: RUNNABLE_EXPERTS experts, top-k and shared experts at most 2 and 1, at most one
    leading dense block, and ep the largest degree that divides the experts, cfg's ep and the small
    layout's dp_shard·cp·tp. Returns the change in words."""
    m = cfg.model
    model.update(experts=RUNNABLE_EXPERTS, experts_per_token=min(m.experts_per_token, 2),
                 shared_experts=min(m.shared_experts, 1), dense_layers=min(m.dense_layers, 1),
                 expert_ffn_hidden=0, router_score=m.router_score)
    replicate = par.get("replicate", 1) or 1
    dense = (par["dp"] // replicate) * par.get("cp", 1) * par["tp"]
    ep = math.gcd(cfg.parallel.ep, RUNNABLE_EXPERTS, dense)
    par["ep"] = ep
    text = f"{RUNNABLE_EXPERTS} routed experts, top-{model['experts_per_token']} instead of {m.experts}, " \
        f"top-{m.experts_per_token}"
    return text + (f" (ep {ep} instead of {cfg.parallel.ep})" if ep != cfg.parallel.ep else "")
