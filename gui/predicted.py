"""What the window shows of a config: the engine's :class:`engine.predict.Prediction` and what the window
adds beside it (:class:`Predicted`), a pinned baseline's differences (:class:`PredictionDiff`), a config in
words, and nn.DataParallel's scaling beside DDP. Plain Python, no Qt."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine import Config
from engine.legacy_dp import scaling
from engine.names import MEMORY_CATEGORIES
from engine.predict import Prediction, full_finetune_peak_bytes
from engine.predict import predict as engine_predict


@dataclass
class Predicted:
    """One valid Config as the window shows it: the engine's :class:`engine.predict.Prediction`
    (``prediction``; None where the engine could not predict the config, ``error`` says why) and what
    the window adds beside it: how long the prediction took, which run's calibration timed it (or why
    that calibration could not, and the analytic times are shown instead) and, under LoRA, the fullest
    rank's bytes under full fine-tuning."""

    config: Config
    prediction: Prediction | None = None
    error: str = ""
    seconds: float = 0.0
    calibrated_from: str | None = None  # run directory whose calibration timed this prediction
    calibration_error: str = ""  # why the session's calibration could not time this config
    full_finetune_peak_bytes: int | None = None  # LoRA only: the fullest rank's memory under full fine-tuning


def memory_of(shown: Predicted | None):
    """The engine's MemoryReport of ``shown`` (None without a prediction)."""
    return None if shown is None or shown.prediction is None else shown.prediction.memory


def predict(cfg: Config, calibration=None) -> Predicted:
    """engine.predict of ``cfg`` (timed by ``calibration``, an ``engine.compare.calibrate.Calibration``,
    when given and able to; memory is the same either way), with what the window adds beside it."""
    t0 = time.perf_counter()
    shown = Predicted(config=cfg)
    if calibration is not None:
        try:
            shown.prediction = calibration.predict(cfg)
            shown.calibrated_from = str(calibration.source)
        except Exception as exc:  # a calibration that cannot time this config: say so, use the analytic one
            shown.calibration_error = f"the calibration could not time this config: {exc}"
    if shown.prediction is None:
        try:
            shown.prediction = engine_predict(cfg)
        except Exception as exc:  # an engine limitation must not take the window down: it says why instead
            shown.error = f"engine.predict could not predict this config: {exc}"
    if shown.prediction is not None:
        shown.full_finetune_peak_bytes = full_finetune_peak_bytes(cfg)
    shown.seconds = time.perf_counter() - t0
    return shown


def prepared(shown: Predicted) -> Predicted:
    """``shown`` with everything the window draws computed: each distinct rank's reserved bytes (the
    caching-allocator replay, computed when first read) included, so that a prediction made off the
    GUI thread costs the GUI thread nothing when it is drawn."""
    memory = memory_of(shown)
    if memory is not None:
        for group in getattr(memory, "groups", None) or ():
            group.first.reserved  # noqa: B018 - computed now, kept by the body
    return shown


@dataclass(frozen=True)
class Change:
    """One number of a baseline prediction against the current one. ``None`` on a side: that
    prediction has no such number (a part the engine could not predict, a rank it does not have)."""

    name: str
    baseline: float | None
    current: float | None
    unit: str  # "bytes", "s", "tokens/s" or "fraction" (MFU, bubble: a share of 1)

    @property
    def delta(self) -> float | None:
        """current − baseline."""
        if self.baseline is None or self.current is None:
            return None
        return self.current - self.baseline

    @property
    def relative(self) -> float | None:
        """(current − baseline) / baseline; None when either side is missing or the baseline is 0."""
        if self.delta is None or not self.baseline:
            return None
        return self.delta / self.baseline


def _rank_bytes(rank_memory) -> dict[str, float]:
    out = {c: float(getattr(rank_memory, c)) for c in MEMORY_CATEGORIES}
    out["total"] = float(rank_memory.total)
    return out


def _bytes_changes(base: dict[str, float] | None, cur: dict[str, float] | None) -> dict[str, Change]:
    return {c: Change(c, None if base is None else base[c], None if cur is None else cur[c], "bytes")
            for c in (*MEMORY_CATEGORIES, "total")}


def _critical_comm(step) -> Any | None:
    """The RankComm of the pipeline rank that sets the step time (what the metrics panel shows)."""
    per_pp = step.comm.per_pp_rank if step is not None else ()
    return per_pp[min(step.critical_pp_rank, len(per_pp) - 1)] if per_pp else None


def _scalar_metrics(shown: Predicted) -> dict[str, tuple[float, str]]:
    """The step, throughput, pipeline and communication numbers of one prediction, by name."""
    out: dict[str, tuple[float, str]] = {}
    pred = shown.prediction
    step, tl = (None, None) if pred is None else (pred.step, pred.pipeline)
    if step is not None:
        out["step_seconds"] = (float(step.seconds), "s")
        tokens = shown.config.tokens_per_step / step.seconds if step.seconds > 0 else 0.0
        out["tokens_per_s"] = (float(tokens), "tokens/s")
        out["mfu"] = (float(step.mfu), "fraction")
        for key, seconds in step.breakdown.items():
            out[f"breakdown.{key}"] = (float(seconds), "s")
        critical = _critical_comm(step)
        if critical is not None:
            for dim in sorted({i.dim for i in critical.items}):
                out[f"comm.{dim}.seconds"] = (float(critical.seconds(dim)), "s")
                out[f"comm.{dim}.bytes_sent"] = (float(critical.bytes_sent(dim)), "bytes")
    if tl is not None:
        out["bubble_fraction"] = (float(tl.bubble_fraction), "fraction")
        out["makespan_s"] = (float(tl.makespan_s), "s")
    return out


#: the order of PredictionDiff.metrics (comm.* and breakdown.* follow, sorted)
METRIC_ORDER = ("step_seconds", "tokens_per_s", "mfu", "bubble_fraction", "makespan_s")


@dataclass
class PredictionDiff:
    """A pinned baseline prediction against the current one, in the engine's own terms.

    ``peak``: per memory category (and ``total``) of each prediction's fullest rank (the two may
    be different ranks: ``baseline_peak_rank``, ``current_peak_rank``). ``metrics``: step seconds,
    tokens/s, MFU, bubble fraction, pipeline makespan, the step breakdown (``breakdown.<key>``)
    and the critical pipeline rank's communication per dimension (``comm.<dim>.seconds``,
    ``comm.<dim>.bytes_sent``). ``per_rank``: every category of every rank either has, by rank
    number (computed when first read: it is the one part whose size grows with the world).
    """

    baseline: Predicted
    current: Predicted
    peak: dict[str, Change]
    metrics: dict[str, Change]
    baseline_peak_rank: int | None
    current_peak_rank: int | None

    @property
    def per_rank(self) -> dict[int, dict[str, Change]]:
        cached = self.__dict__.get("_per_rank")
        if cached is None:
            base = {int(r.rank): _rank_bytes(r) for r in (memory_of(self.baseline) or _NO_MEMORY).per_rank}
            cur = {int(r.rank): _rank_bytes(r) for r in (memory_of(self.current) or _NO_MEMORY).per_rank}
            cached = {rank: _bytes_changes(base.get(rank), cur.get(rank)) for rank in sorted(base.keys() | cur.keys())}
            self.__dict__["_per_rank"] = cached
        return cached


class _NoMemory:
    per_rank = ()


_NO_MEMORY = _NoMemory()


def _peak(shown: Predicted):
    mem = memory_of(shown)
    return mem.peak if mem is not None and mem.per_rank else None


def compare_predictions(baseline: Predicted, current: Predicted) -> PredictionDiff:
    """What changed from ``baseline`` to ``current`` (see :class:`PredictionDiff`)."""
    bp, cp = _peak(baseline), _peak(current)
    peak = _bytes_changes(None if bp is None else _rank_bytes(bp), None if cp is None else _rank_bytes(cp))
    bm, cm = _scalar_metrics(baseline), _scalar_metrics(current)
    extra = sorted((bm.keys() | cm.keys()) - set(METRIC_ORDER))
    metrics = {}
    for name in (*METRIC_ORDER, *extra):
        if name in bm or name in cm:
            unit = (bm.get(name) or cm.get(name))[1]
            metrics[name] = Change(name, bm[name][0] if name in bm else None, cm[name][0] if name in cm else None, unit)
    return PredictionDiff(baseline, current, peak, metrics,
                          None if bp is None else int(bp.rank), None if cp is None else int(cp.rank))


def dataparallel_scaling(cfg: Config) -> tuple[list[dict], str]:
    """(rows of engine.legacy_dp.scaling, '') or ([], why there are none for this config)."""
    par = cfg.parallel
    if par.tp != 1 or par.pp != 1 or par.zero != 0 or par.replicate != 1:
        return [], ("nn.DataParallel replicates the whole model over one node's GPUs: with tp = pp = 1 and "
                    "DDP sharding (DP mode → DataParallel offers to set them) this view compares it with DDP.")
    try:
        return scaling(cfg), ""
    except Exception as exc:  # an engine limitation must not take the window down
        return [], f"engine.legacy_dp.scaling could not predict this config: {exc}"


def describe_config(cfg: Config) -> str:
    """A config in words, to say what a baseline is: model, GPUs and layout
    (``tiny · 4× cpu · dp2 tp1 pp2 ZeRO-0 1F1B m4 b2 recompute=none``)."""
    from engine.plan.results import layout_label

    model = cfg.model.preset or f"custom {cfg.model.layers}×{cfg.model.hidden}"
    extra = ""
    if cfg.parallel.dp_mode == "dataparallel":
        extra += " nn.DataParallel"
    if cfg.training.finetune == "lora":
        extra += f" LoRA r{cfg.training.lora_rank}" + (" nf4" if cfg.training.lora_base_dtype == "nf4" else "")
    return (f"{model} · {cfg.cluster.gpus}× {cfg.cluster.gpu.name} · {layout_label(cfg)} · "
            f"{cfg.training.precision}{extra}")
