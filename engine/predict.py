"""``predict(cfg)``: everything the engine says about one config, in one object.

A Prediction has the same shape and category names as a backend Measurement
(``memory.per_rank[i]`` with the seven categories and ``total``; ``pipeline.per_rank[r].actions``
as ``[kind, stage, microbatch, start_s, end_s]``), so comparing is a subtraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine import legacy_dp
from engine.backend_limits import predict_only
from engine.config import Config, ConfigError
from engine.memory import MemoryReport, memory_per_rank
from engine.model.params import param_counts
from engine.names import MEMORY_CATEGORIES
from engine.pipeline.timeline import Timeline
from engine.time.comm import CommReport, MeasuredLinks
from engine.time.durations import StageDurations
from engine.time.ops import clock_description
from engine.time.step import StepTime, step_time
from engine.wrapping import wrapping_plan


@dataclass(frozen=True)
class Prediction:
    config: Config
    memory: MemoryReport
    step: StepTime

    @property
    def pipeline(self) -> Timeline:
        return self.step.timeline

    @property
    def comm(self) -> CommReport:
        return self.step.comm

    @property
    def predict_only(self) -> list[str]:
        """Why ShardScope's backend cannot run this layout on any machine (``engine.backend_limits``);
        empty where a run can check the prediction."""
        return predict_only(self.config)

    @property
    def conventions(self) -> dict[str, str]:
        conv = dict(self.memory.conventions)
        c = self.config.conventions
        conv["bubble"] = (f"{c.bubble}: idle / (makespan × ranks)" if c.bubble == "share-of-total"
                          else f"{c.bubble}: idle / busy (Narayanan 2021)")
        conv["compute_efficiency"] = f"{c.compute_efficiency:g} of peak FLOP/s for analytic durations"
        conv["clock"] = clock_description(self.config)
        conv["active_params"] = ("per token: every parameter but the routed experts a token is not sent to, "
                                 "embedding and head included (Mixtral, Qwen3); active_params_without_embedding "
                                 "leaves out the input embedding lookup (gpt-oss, DeepSeek-V3)")
        conv["step_time"] = ("pipeline makespan (TP collectives inside F/B) + exposed DP communication "
                             "+ memory-bound optimizer step")
        return conv

    def to_json(self, explain: bool = False) -> dict:
        mem = self.memory.to_json()
        if explain:
            for row, rank in zip(mem["per_rank"], self.memory.per_rank):
                row["explain"] = {c: [t.to_json() for t in rank.explain(c)] for c in MEMORY_CATEGORIES}
        counts = param_counts(self.config.model)
        return {
            "model": {"params": counts.total, "active_params": counts.active,
                      "active_params_without_embedding": counts.active_without_embedding,
                      "expert_params": counts.experts},
            "memory": mem,
            "pipeline": self.pipeline.to_json(self.config.conventions.bubble),
            "communication": self.comm.to_json(),
            "step": self.step.to_json(),
            "conventions": self.conventions,
            "predict_only": self.predict_only,
        }


def predicted_step(cfg: Config, durations: StageDurations | None = None,
                   links: MeasuredLinks | None = None) -> StepTime:
    """The step model the wrapping plan of ``cfg`` selects: legacy ``nn.DataParallel``'s
    (engine.legacy_dp) or the per-rank one (engine.time.step). predict() builds on it; calibration
    fits call it directly when they need only the step, many times over."""
    if wrapping_plan(cfg).legacy:
        return legacy_dp.step(cfg, durations, links)
    return step_time(cfg, durations, links)


def predicted_memory(cfg: Config) -> MemoryReport:
    """The memory model the wrapping plan of ``cfg`` selects: legacy ``nn.DataParallel``'s
    (engine.legacy_dp) or the per-rank one (engine.memory). Kept per config (a MemoryReport is frozen
    and its lazy parts, the ranks' reserves, are computed once either way): a drag back and forth over a
    slider finds its positions' reports here, as it finds their replays, placements and durations in
    the caches below them (the 8-rank × 32-microbatch window: 1.0 of a revisited prediction's 1.85 ms)."""
    return _predicted_memory(cfg)


@lru_cache(maxsize=32)
def _predicted_memory(cfg: Config) -> MemoryReport:
    return legacy_dp.memory(cfg) if wrapping_plan(cfg).legacy else memory_per_rank(cfg)


def full_finetune_peak_bytes(cfg: Config) -> int | None:
    """Under LoRA: what the fullest rank would hold if every weight trained (the same layout, the memory
    model its wrapping plan selects); None without LoRA, or where the layout is not valid under full
    fine-tuning."""
    if cfg.training.finetune != "lora":
        return None
    try:
        full = cfg.replace(training={"finetune": "full"})
    except ConfigError:
        return None
    return int(predicted_memory(full).peak.total)


def predict(cfg: Config, durations: StageDurations | None = None,
            links: MeasuredLinks | None = None) -> Prediction:
    """Memory per rank, pipeline timeline, communication and step time for ``cfg``; the only
    constructor of a :class:`Prediction`.

    ``durations`` (measured per-stage seconds) replaces the analytic F/B/W times and ``links``
    (measured α and B per collective) the cluster's intra-node links: the calibration hooks.
    """
    return Prediction(config=cfg, memory=predicted_memory(cfg), step=predicted_step(cfg, durations, links))
