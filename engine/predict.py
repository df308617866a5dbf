"""``predict(cfg)``: everything the engine says about one config, in one object.

A Prediction has the same shape and category names as a backend Measurement
(``memory.per_rank[i]`` with the seven categories and ``total``; ``pipeline.per_rank[r].actions``
as ``[kind, stage, microbatch, start_s, end_s]``), so comparing is a subtraction.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import legacy_dp
from engine.backend_limits import predict_only
from engine.config import Config
from engine.memory import MemoryReport, memory_per_rank
from engine.model.params import param_counts
from engine.names import MEMORY_CATEGORIES
from engine.pipeline.timeline import Timeline
from engine.time.comm import CommReport, MeasuredLinks
from engine.time.durations import StageDurations
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


def predict(cfg: Config, durations: StageDurations | None = None,
            links: MeasuredLinks | None = None) -> Prediction:
    """Memory per rank, pipeline timeline, communication and step time for ``cfg``; the only
    constructor of a :class:`Prediction`.

    ``durations`` (measured per-stage seconds) replaces the analytic F/B/W times and ``links``
    (measured α and B per collective) the cluster's intra-node links: the calibration hooks.
    """
    if wrapping_plan(cfg).legacy:  # legacy nn.DataParallel: its own memory and step model

        return Prediction(config=cfg, memory=legacy_dp.memory(cfg), step=predicted_step(cfg, durations, links))
    return Prediction(config=cfg, memory=memory_per_rank(cfg), step=predicted_step(cfg, durations, links))


# --------------------------------------------------------------------------- text


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def render_table(pred: Prediction, explain: bool = False) -> str:
    """A readable report: memory per distinct rank group (GiB), pipeline and step time."""
    mem = pred.memory
    cats = list(MEMORY_CATEGORIES)
    groups = mem.distinct_groups()
    unit, scale = _unit(max(g.first.total for g in groups))

    def _gib(n: float) -> str:
        return f"{n / scale:.2f}"

    head = ["ranks", "stages"] + cats + ["total", "allocated", "reserved", "fits"]
    rows = []
    for group in groups:
        r = group.first
        rows.append([group.label, ",".join(map(str, r.stages))]
                    + [_gib(getattr(r, c)) for c in cats]
                    + [_gib(r.total), _gib(r.allocated), _gib(r.reserved), "yes" if r.fits else "NO"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    cpu = pred.config.cluster.gpu.name == "cpu"
    lines = [f"memory per rank ({unit}), capacity {_gib(mem.capacity_bytes)} {unit}"
             f" ({pred.config.cluster.gpu.name}):"]
    lines.append("  categories at each rank's peak moment; allocated = its tensors (max_memory_allocated), "
                 + ("reserved = allocated (CPU ranks: no caching allocator)" if cpu else
                    "reserved = the caching allocator's segments (max_memory_reserved); fits: reserved + "
                    "runtime context + collective buffers ≤ capacity"))
    m = pred.config.model
    if m.experts > 0:
        c = param_counts(m)
        par = pred.config.parallel
        lines.insert(0, f"model: {c.total / 1e9:.1f}B parameters, {c.active / 1e9:.1f}B active per token "
                        f"({c.active_without_embedding / 1e9:.1f}B without the embedding); {m.experts} experts, "
                        f"top-{m.experts_per_token}, {m.moe_layers} MoE blocks; ep {par.ep}: "
                        f"{m.experts // par.ep} expert(s) per rank per block")
    lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row, group in zip(rows, groups):
        lines.append("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)))
        if explain:
            if group.first.peak_moment:
                lines.append(f"      peak at {group.first.peak_moment}")
            for c in cats:
                for t in group.first.explain(c):
                    lines.append(f"      {c:<12} {t.bytes / scale:10.4f} {unit}  {t.label}: {t.formula}")
    tl, st = pred.pipeline, pred.step
    conv = pred.config.conventions.bubble
    lines.append("")
    lines.append(f"pipeline: {pred.config.parallel.schedule if pred.config.parallel.pp > 1 else 'none (pp = 1)'}, "
                 f"makespan {tl.makespan_s * 1e3:.2f} ms, bubble {tl.bubble(conv) * 100:.1f} % ({conv})")
    lines.append(f"step: {st.seconds * 1e3:.2f} ms, {st.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {st.mfu * 100:.1f} %, HFU {st.hfu * 100:.1f} %")
    lines.append("  breakdown: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in st.breakdown.items()))
    comm = pred.comm.per_pp_rank[st.critical_pp_rank]
    per_dim = {d: comm.bytes_sent(d) for d in ("dp", "cp", "tp", "pp", "ep") if comm.bytes_sent(d)}
    if per_dim:
        lines.append("  communication sent per step by rank "
                     f"{comm.rank}: " + ", ".join(f"{d} {b / 2**30:.3f} GiB" for d, b in per_dim.items()))
    why = pred.predict_only
    if why:
        lines.append("")
        lines.append("predict only: ShardScope's backend cannot run this layout, so no run can check it:")
        lines.extend(f"  - {w}" for w in why)
    return "\n".join(lines)
