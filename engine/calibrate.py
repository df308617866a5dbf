"""Calibration: learn this machine's throughput from a finished run, then predict with it.

``calibrate(cfg, measurement)`` reads a run (its Config and the dict of its
``measurement.json``) and derives what the analytic model guesses:

* **per-stage F/B/I/W seconds** — means over microbatches of the timed pipeline actions of the
  slowest rank holding the stage (PP runs; the step ends with the slowest replica), without each stage's last backward when dp > 1: that one
  carries the exposed DP gradient reduction. TP collectives run inside F/B;
  the engine adds them back itself, so their analytic time is taken out here.
* **forward / backward efficiency** — analytic FLOP time at 100 % of peak over measured time
  (the achieved share of the GPU kind's peak FLOP/s), and the combined
  ``conventions.compute_efficiency``. Without pipeline actions (pp = 1) one efficiency is
  fitted so that the predicted step equals the measured step.
* **memory bandwidth** (``cluster.gpu.hbm_bandwidth_gb_per_s``) — from the tail of the step
  after the last pipeline action (the optimizer step, memory-bound in the model).
* **link bandwidth** (``cluster.intra_node_bandwidth_gb_per_s``) — fitted so that the model's
  exposed DP communication equals the measured excess of the last backward over the others
  (dp > 1); **p2p seconds** from the waits between a stage's output and the next stage's input.

Local CPU ranks share the machine's cores: with ``world > cores`` each rank gets about
``cores / world`` of a core. A calibration records the cores (``os.cpu_count`` where the
run happened, or given) and scales throughput by ``min(1, cores / world)`` from the source
layout to the target one, so a 2-rank prediction from a 4-rank run on 2 cores is not off by
2×. On GPUs every rank has its own device and the factor is 1.

``Calibration.predict(other_cfg)`` predicts another layout of the same model on the same
machine: the same stage layout reuses the measured per-stage seconds; any other layout
scales the analytic per-stage FLOPs by the measured efficiencies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.config import Config
from engine.durations import StageDurations, activation_bytes_per_microbatch, stage_durations
from engine.layout import split_layers
from engine.params import params_per_rank
from engine.predict import Prediction, predict
from engine.step import optimizer_seconds, step_time, tp_seconds_per_layer

_KINDS = ("F", "B", "I", "W")


class CalibrationError(ValueError):
    """A run that cannot be calibrated from (no measurement, no timed step)."""


@dataclass(frozen=True)
class Calibration:
    source: str  # where it came from (a run directory, or "given")
    config: Config  # the layout that ran
    compute_efficiency: float  # combined achieved / peak FLOP/s of the source layout (may exceed 1)
    forward_efficiency: float
    backward_efficiency: float
    cores: int | None  # CPU cores the ranks shared; None on GPUs
    memory_bytes_per_s: float | None  # fitted hbm bandwidth (optimizer step), None: analytic
    link_bytes_per_s: float | None  # fitted intra-node bandwidth, None: analytic
    p2p_s: float | None  # measured p2p time per stage boundary, None: analytic
    measured: StageDurations | None  # per-stage means (TP comm taken out), PP runs only
    step_seconds: float  # the measured step
    notes: tuple[str, ...] = ()

    # ----------------------------------------------------------------- contention

    def _share(self, cfg: Config) -> float:
        """Share of a core each rank gets (1 on GPUs or when ranks ≤ cores)."""
        if self.cores is None or cfg.cluster.gpu.name != "cpu":
            return 1.0
        return min(1.0, self.cores / cfg.parallel.world_size)

    def speed_factor(self, cfg: Config) -> float:
        """Target throughput over source throughput from core sharing alone."""
        return self._share(cfg) / self._share(self.config)

    # ----------------------------------------------------------------- applying

    def same_stages(self, cfg: Config) -> bool:
        """Does ``cfg`` cut the model into the same stages with the same per-microbatch work?"""
        a, b = self.config, cfg
        pa, pb = a.parallel, b.parallel
        return (self.measured is not None and a.model == b.model and a.training == b.training
                and (pa.pp, pa.virtual_stages, pa.tp, pa.sequence_parallel) == (pb.pp, pb.virtual_stages, pb.tp,
                                                                              pb.sequence_parallel)
                and (pa.zero in (2, 3)) == (pb.zero in (2, 3)))

    def config_for(self, cfg: Config) -> Config:
        """``cfg`` with this machine's calibrated efficiency and bandwidths."""
        k = self.speed_factor(cfg)
        eff = min(1.0, max(1e-6, self.compute_efficiency * k))
        cluster: dict = {}
        if self.memory_bytes_per_s is not None:
            cluster["gpu"] = dataclasses.replace(cfg.cluster.gpu,
                                                 hbm_bandwidth_gb_per_s=self.memory_bytes_per_s * k / 1e9)
        if self.link_bytes_per_s is not None:
            cluster["intra_node_bandwidth_gb_per_s"] = self.link_bytes_per_s * k / 1e9
        return cfg.replace(conventions={"compute_efficiency": eff}, **({"cluster": cluster} if cluster else {}))

    def durations_for(self, cfg: Config) -> StageDurations:
        """Per-stage seconds for ``cfg``: measured when the stages match, else analytic FLOPs / efficiency."""
        cal = self.config_for(cfg)
        k = self.speed_factor(cfg)
        analytic = stage_durations(cal)
        p2p = analytic.p2p_s
        if self.p2p_s is not None and len(p2p):
            scale = activation_bytes_per_microbatch(cfg) / activation_bytes_per_microbatch(self.config)
            p2p = np.where(p2p > 0, self.p2p_s * scale, 0.0)
        if self.same_stages(cfg):
            m = self.measured
            return StageDurations.of(m.num_stages, m.forward_s / k, m.backward_s / k, m.backward_input_s / k,
                                     m.backward_weight_s / k, p2p, source="calibrated: measured per stage")
        base = stage_durations(cal.replace(conventions={"compute_efficiency": 1.0}))
        ef, eb = self.forward_efficiency * k, self.backward_efficiency * k
        return StageDurations.of(base.num_stages, base.forward_s / ef, base.backward_s / eb,
                                 base.backward_input_s / eb, base.backward_weight_s / eb, p2p,
                                 source="calibrated: analytic FLOPs / measured efficiency")

    def predict(self, cfg: Config) -> Prediction:
        """``engine.predict`` for ``cfg`` with this calibration."""
        return predict(self.config_for(cfg), self.durations_for(cfg))

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "compute_efficiency": self.compute_efficiency,
            "forward_efficiency": self.forward_efficiency,
            "backward_efficiency": self.backward_efficiency,
            "cores": self.cores,
            "memory_gb_per_s": None if self.memory_bytes_per_s is None else self.memory_bytes_per_s / 1e9,
            "link_gb_per_s": None if self.link_bytes_per_s is None else self.link_bytes_per_s / 1e9,
            "p2p_s": self.p2p_s,
            "measured_durations": None if self.measured is None else self.measured.to_json(),
            "step_seconds": self.step_seconds,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------- deriving


def _stage_layers(cfg: Config, num_stages: int) -> np.ndarray:
    return np.array([len(r) for r in split_layers(cfg.model.layers, num_stages)], dtype=np.float64)


def _action_means(meas: dict, num_stages: int, drop_last_backward: bool) -> tuple[dict[str, np.ndarray], float]:
    """Seconds per (kind, stage): the mean over a rank's microbatches, of the slowest rank holding
    the stage (the step ends with the slowest DP/TP replica); NaN where absent. Also the mean excess
    of each rank-stage's last backward over its other backwards.

    With dp > 1 the last backward of a stage carries the exposed DP gradient reduction (DDP's
    Reducer, FSDP's reduce-scatter); it is left out of the means and returned as the excess.
    """
    samples: dict[tuple[str, int], list[float]] = {}  # per (kind, stage): one mean per rank
    excess = []
    for r in (meas.get("pipeline") or {}).get("per_rank", []):
        acts = r.get("actions", [])
        mine: dict[tuple[str, int], list[float]] = {}
        last: dict[int, int] = {}
        for j, (kind, stage, _mb, _s, _e) in enumerate(acts):
            if kind in ("B", "W"):
                last[int(stage)] = j
        skip = set(last.values()) if drop_last_backward else set()
        rest: dict[int, list[float]] = {}
        for j, (kind, stage, _mb, start, end) in enumerate(acts):
            if j in skip:
                continue
            mine.setdefault((kind, int(stage)), []).append(float(end) - float(start))
            if kind in ("B", "W"):
                rest.setdefault(int(stage), []).append(float(end) - float(start))
        for stage, j in last.items():
            if j in skip and rest.get(stage):
                excess.append(float(acts[j][4]) - float(acts[j][3]) - float(np.mean(rest[stage])))
        for key, v in mine.items():
            samples.setdefault(key, []).append(float(np.mean(v)))
    out = {}
    for kind in _KINDS:
        out[kind] = np.array([float(np.max(samples[(kind, s)])) if (kind, s) in samples else np.nan
                              for s in range(num_stages)])
    return out, (float(np.mean(excess)) if excess else 0.0)


def _p2p_wait(meas: dict) -> float | None:
    """Median wait between F(s-1, mb) ending on one rank and F(s, mb) starting on the next, when the
    receiver was idle (its previous action ended earlier): the transfer's time."""
    ranks = {int(r["rank"]): r for r in (meas.get("ranks") or []) if "coords" in r}
    acts = {int(r["rank"]): r.get("actions", []) for r in (meas.get("pipeline") or {}).get("per_rank", [])}
    if not ranks or not acts:
        return None
    by_coords = {(c["coords"]["pp"], c["coords"]["dp"], c["coords"]["tp"]): rank for rank, c in ranks.items()}
    ends: dict[tuple[int, str, int, int], float] = {}
    for rank, a in acts.items():
        for kind, stage, mb, _s, e in a:
            ends[(rank, kind, int(stage), int(mb))] = float(e)
    gaps = []
    for rank, a in acts.items():
        c = ranks.get(rank, {}).get("coords")
        if c is None:
            continue
        prev_end = 0.0
        for kind, stage, mb, s, e in a:
            if kind == "F" and stage > 0:
                sender = next((by_coords.get((pp, c["dp"], c["tp"])) for pp in range(c["pp"] - 1, -1, -1)
                               if (by_coords.get((pp, c["dp"], c["tp"])), "F", stage - 1, mb) in ends), None)
                if sender is not None and sender != rank:
                    sent = ends[(sender, "F", stage - 1, mb)]
                    if sent >= prev_end:
                        gaps.append(max(0.0, float(s) - sent))
            prev_end = float(e)
    return float(np.median(gaps)) if gaps else None


def _bisect_log(f, target: float, lo: float, hi: float, iters: int = 60) -> float | None:
    """x in [lo, hi] with f(x) = target for a decreasing f (log-scale bisection); None if not bracketed."""
    flo, fhi = f(lo), f(hi)
    if not (fhi <= target <= flo):
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        mid = (a + b) / 2
        if f(math.exp(mid)) > target:
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def _default_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def calibrate(cfg: Config, measurement: dict, source: str = "given", cores: int | None = None) -> Calibration:
    """Derive a :class:`Calibration` from a run of ``cfg`` and its measurement dict."""
    meas = measurement if isinstance(measurement, dict) else measurement.to_dict()
    step_s = float((meas.get("step") or {}).get("seconds") or 0.0)
    if not step_s > 0:
        raise CalibrationError("the measurement has no timed step (step.seconds is 0)")
    par = cfg.parallel
    on_cpu = cfg.cluster.gpu.name == "cpu"
    if on_cpu and cores is None:
        cores = _default_cores()
    if not on_cpu:
        cores = None
    notes: list[str] = []
    num_stages = 1 if par.pp == 1 else par.num_stages
    med, dp_excess = _action_means(meas, num_stages, par.dp > 1) if par.pp > 1 else (None, 0.0)
    have_actions = med is not None and not np.all(np.isnan(med["F"]))

    if not have_actions:
        # pp = 1: one efficiency, fitted to the whole step with analytic communication
        def step_at(e: float) -> float:
            return step_time(cfg.replace(conventions={"compute_efficiency": min(e, 1.0)}), _scaled(cfg, e)).seconds
        eff = _bisect_log(step_at, step_s, 1e-6, 1e3)
        if eff is None:
            eff = cfg.conventions.compute_efficiency
            notes.append("the step could not be matched by compute alone (communication/optimizer already exceed "
                         "it); efficiency left at the config's")
        else:
            notes.append("no pipeline actions (pp = 1): one compute efficiency fitted so the predicted step "
                         "equals the measured one (communication and optimizer analytic)")
        return Calibration(source, cfg, eff, eff, eff, cores, None, None, None, None, step_s, tuple(notes))

    # ---- per-stage durations, TP communication taken out (the engine adds it back)
    layers = _stage_layers(cfg, num_stages)
    tp_f, tp_b = tp_seconds_per_layer(cfg)
    f = med["F"] - layers * tp_f
    split = not np.all(np.isnan(med["I"]))
    if split:
        i = med["I"] - layers * tp_b
        w = med["W"]
        # a split schedule may still run full B for some stages/microbatches
        b = np.where(np.isnan(med["B"]), i + w, med["B"] - layers * tp_b)
    else:
        b = med["B"] - layers * tp_b
    for name, arr, raw in (("F", f, med["F"]), ("B", b, med["B"] if not split else b)):
        if np.any(np.isnan(arr)):
            raise CalibrationError(f"the measurement lacks {name} actions for some stage")
        floor = 0.1 * np.nan_to_num(raw, nan=0.0)
        if np.any(arr < floor):
            notes.append(f"analytic TP communication exceeds 90 % of a measured {name}; kept 10 % of it as compute")
        arr[:] = np.maximum(arr, floor)
    if split:
        i, w = np.nan_to_num(i, nan=0.0), np.nan_to_num(w, nan=0.0)
        measured = StageDurations.of(num_stages, f, b, i, w, source="measured")
    else:
        measured = StageDurations.of(num_stages, f, backward_s=b, source="measured")

    base = stage_durations(cfg.replace(conventions={"compute_efficiency": 1.0}))
    eff_f = float(base.forward_s.sum() / measured.forward_s.sum())
    eff_b = float(base.backward_s.sum() / measured.backward_s.sum())
    eff = float((base.forward_s.sum() + base.backward_s.sum())
                / (measured.forward_s.sum() + measured.backward_s.sum()))
    if eff > 1:
        notes.append(f"achieved {eff:.2f}× the preset's peak FLOP/s: the GPU preset's peak is too low for this "
                     "machine (durations are used as measured)")

    # ---- optimizer tail -> memory bandwidth
    per_step = (meas.get("step") or {}).get("per_step") or [step_s]
    last_end = max((a[4] for r in meas["pipeline"]["per_rank"] for a in r.get("actions", [])), default=0.0)
    tail = float(per_step[-1]) - float(last_end)
    held = params_per_rank(cfg)
    opt = max(optimizer_seconds(cfg, held[p][0].total) for p in range(par.pp))
    mem_bw = None
    if tail > 0 and opt > 0:
        mem_bw = cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9 * opt / tail
        notes.append(f"memory bandwidth from the {tail * 1e3:.2f} ms after the last action (optimizer step, "
                     "modelled memory-bound)")

    p2p = _p2p_wait(meas)
    cal = Calibration(source, cfg, eff, eff_f, eff_b, cores, mem_bw, None, p2p, measured, step_s, ())

    # ---- link bandwidth: the exposed DP reduction in each stage's last backward
    link = None
    if par.dp > 1 and dp_excess > 0:
        bw0 = cfg.cluster.intra_node_bytes_per_s

        def exposed_with(bw: float) -> float:
            c = dataclasses.replace(cal, link_bytes_per_s=bw)
            return step_time(c.config_for(cfg), c.durations_for(cfg)).breakdown["dp_comm_exposed"]

        link = _bisect_log(exposed_with, dp_excess, bw0 * 1e-4, bw0 * 1e4)
        if link is None:
            notes.append("link bandwidth not fitted: the model's exposed DP communication cannot reach the "
                         f"measured {dp_excess * 1e3:.2f} ms")
        else:
            notes.append(f"intra-node bandwidth {link / 1e9:.3g} GB/s: the model's exposed DP communication "
                         f"equals the measured excess of the last backward ({dp_excess * 1e3:.2f} ms)")
    else:
        notes.append("no exposed DP reduction measured (dp = 1 or no excess): analytic link kept")
    return dataclasses.replace(cal, link_bytes_per_s=link, notes=tuple(notes))


def _scaled(cfg: Config, eff: float) -> StageDurations:
    """Analytic durations at an efficiency that may exceed 1 (the config field may not)."""
    base = stage_durations(cfg.replace(conventions={"compute_efficiency": 1.0}))
    return StageDurations.of(base.num_stages, base.forward_s / eff, base.backward_s / eff,
                             base.backward_input_s / eff, base.backward_weight_s / eff, base.p2p_s,
                             source="calibrated")


def load_calibration(run_dir: str | Path, cores: int | None = None) -> Calibration:
    """Calibrate from a run directory (its ``config.toml`` and ``measurement.json``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    cfg_path, meas_path = run_dir / "config.toml", run_dir / "measurement.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{run_dir} has no config.toml (not a run directory?)")
    if not meas_path.exists():
        raise FileNotFoundError(f"{run_dir} has no measurement.json (the run failed or has not finished)")
    try:
        meas = json.loads(meas_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{meas_path} is not valid JSON: {exc}") from None
    return calibrate(Config.load(cfg_path), meas, source=str(run_dir), cores=cores)
