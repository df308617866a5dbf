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

**Link calibration** (``shardscope calibrate --links``, backend.linkbench): a micro-benchmark
times all-reduce / all-gather / reduce-scatter / send-recv over a sweep of sizes, every rank
at once at the given world size, and a matmul per rank. :func:`fit_links` fits α and B per
collective and group size by least squares on the ring formulas of engine.time.comm (relative
residuals, so small and large buffers weigh alike); :class:`LinkCalibration` keeps them
(``links.json`` in the run directory) with the per-rank FLOP/s. Given to :func:`calibrate`
(or :meth:`Calibration.with_links`) they replace the cluster's α and B for every collective
the prediction charges and for the p2p sends; alone, :meth:`LinkCalibration.predict` is the
analytic model with measured links and the measured matmul throughput as the peak.
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
from engine.model.params import params_per_rank
from engine.pipeline.layout import split_layers
from engine.predict import Prediction, predict, predicted_step
from engine.time.comm import COLLECTIVES, LinkFit, MeasuredLinks, bus_factor, ring_seconds, trainable_local
from engine.time.durations import StageDurations, activation_bytes_per_microbatch, stage_durations
from engine.time.ops import op_durations
from engine.time.step import optimizer_seconds, optimizer_tensors, tp_stage_seconds
from engine.wrapping import wrapping_plan

LINKS_FILE = "links.json"

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
    links: LinkCalibration | None = None  # measured α and B per collective (shardscope calibrate --links)
    busy_fraction: float | None = None  # Σ busy / (ranks × makespan) of the source's pipeline actions

    def with_links(self, links: LinkCalibration) -> Calibration:
        """This calibration with measured links for every collective and send."""
        return dataclasses.replace(self, links=links, notes=self.notes + (f"links measured by {links.source}",))

    # ----------------------------------------------------------------- contention

    def _share(self, cfg: Config, busy: float = 1.0) -> float:
        """Share of a core each *working* rank gets: ``cores / (world × busy)``, at most 1 (1 on
        GPUs). ``busy`` is the layout's busy fraction: ranks idle in pipeline bubbles (blocked
        in a receive) lend their core to the others, so on average ``world × busy`` ranks compete."""
        if self.cores is None or cfg.cluster.gpu.name != "cpu":
            return 1.0
        return min(1.0, self.cores / (cfg.parallel.world_size * max(busy, 1e-3)))

    def speed_factor(self, cfg: Config, busy: float = 1.0) -> float:
        """Target compute throughput over the source's from core sharing: the source at its
        measured busy fraction, the target at ``busy`` (1: every rank always working)."""
        return self._share(cfg, busy) / self._share(self.config, self.busy_fraction or 1.0)

    def _all_busy_factor(self, cfg: Config) -> float:
        """Core sharing when every rank works at once in both layouts (the optimizer step, collectives)."""
        return self._share(cfg) / self._share(self.config)

    # ----------------------------------------------------------------- applying

    def same_stages(self, cfg: Config) -> bool:
        """Does ``cfg`` cut the model into the same stages with the same per-microbatch work?"""
        a, b = self.config, cfg
        pa, pb = a.parallel, b.parallel
        return (self.measured is not None and a.model == b.model and a.training == b.training
                and (pa.pp, pa.virtual_stages, pa.tp, pa.sequence_parallel) == (pb.pp, pb.virtual_stages, pb.tp,
                                                                              pb.sequence_parallel)
                and _stage_wrapping(a) == _stage_wrapping(b))

    def config_for(self, cfg: Config, busy: float = 1.0) -> Config:
        """``cfg`` with this machine's calibrated efficiency and bandwidths (core sharing is the
        calibration's own ``speed_factor`` at the target's busy fraction ``busy``; the optimizer's
        memory bandwidth and a fitted link scale as every rank working at once: the analytic
        ``cluster.cpu_cores`` is switched off)."""
        k = self.speed_factor(cfg, busy)
        k_all = self._all_busy_factor(cfg)
        eff = min(1.0, max(1e-6, self.compute_efficiency * k))
        cluster: dict = {"cpu_cores": 0}
        if self.memory_bytes_per_s is not None:
            cluster["gpu"] = dataclasses.replace(cfg.cluster.gpu,
                                                 hbm_bandwidth_gb_per_s=self.memory_bytes_per_s * k_all / 1e9)
        if self.link_bytes_per_s is not None:
            cluster["intra_node_bandwidth_gb_per_s"] = self.link_bytes_per_s * k_all / 1e9
        return cfg.replace(conventions={"compute_efficiency": eff, "clock": self.config.conventions.clock},
                           cluster=cluster)

    def durations_for(self, cfg: Config, busy: float = 1.0) -> StageDurations:
        """Per-stage seconds for ``cfg`` at busy fraction ``busy``: measured when the stages match,
        else analytic FLOPs / efficiency."""
        cal = self.config_for(cfg, busy)
        k = self.speed_factor(cfg, busy)
        analytic = stage_durations(cal)
        p2p = analytic.p2p_s
        if self.p2p_s is not None and len(p2p):
            scale = activation_bytes_per_microbatch(cfg) / activation_bytes_per_microbatch(self.config)
            p2p = np.where(p2p > 0, self.p2p_s * scale, 0.0)
        elif self.links is not None and len(p2p):
            one = self.links.p2p_seconds(cfg, activation_bytes_per_microbatch(cfg))
            if one is not None:
                p2p = np.where(p2p > 0, one, 0.0)
        if self.same_stages(cfg):
            m = self.measured
            return StageDurations.of(m.num_stages, m.forward_s / k, m.backward_s / k, m.backward_input_s / k,
                                     m.backward_weight_s / k, p2p, source="calibrated: measured per stage")
        # the clock's durations on the machine as the config describes it: the measured speeds already hold what
        # the run's memory-bound ops took, so the bandwidth fitted to the optimizer's tail stays out of them
        base = clock_durations(cfg.replace(cluster={"cpu_cores": 0}, conventions={"clock": self.config.conventions.clock}))
        ef, eb = self.forward_efficiency * k, self.backward_efficiency * k
        return StageDurations.of(base.num_stages, base.forward_s / ef, base.backward_s / eb,
                                 base.backward_input_s / eb, base.backward_weight_s / eb, p2p,
                                 source=f"calibrated: the {cal.conventions.clock} clock's durations / measured speed")

    def predict(self, cfg: Config) -> Prediction:
        """``engine.predict`` for ``cfg`` with this calibration (and its measured links).

        On shared CPU cores the target's busy fraction decides how fast each working rank
        computes, and the predicted timeline decides the busy fraction: a fixed point, found by
        iterating from "every rank always busy" (uniformly scaled durations leave the fraction
        unchanged, so a few rounds settle it; pp = 1 is busy throughout and needs one)."""
        links = None if self.links is None else self.links.links_for(cfg)
        busy = 1.0
        for _ in range(8):
            c, d = self.config_for(cfg, busy), self.durations_for(cfg, busy)
            if self.cores is None or self.busy_fraction is None or cfg.cluster.gpu.name != "cpu":
                break
            new = timeline_busy_fraction(predicted_step(c, d, links).timeline)
            if abs(new - busy) < 1e-3:
                break
            busy = new
        return predict(c, d, links)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "clock": self.config.conventions.clock,  # what the efficiencies are over: the FLOPs at peak, or the ops
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
            "links": None if self.links is None else self.links.to_json(),
            "busy_fraction": self.busy_fraction,
        }


# --------------------------------------------------------------------------- deriving


def _stage_layers(cfg: Config, num_stages: int) -> np.ndarray:
    return np.array([len(r) for r in split_layers(cfg.model.layers, num_stages, cfg.parallel.pipeline_split)], dtype=np.float64)


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


def timeline_busy_fraction(timeline) -> float:
    """Σ busy / (pp ranks × makespan) of a predicted timeline (DP/TP replicas work alike)."""
    busy = np.asarray(timeline.busy_s, dtype=np.float64)
    span = float(timeline.makespan_s)
    return float(busy.sum() / (len(busy) * span)) if span > 0 and len(busy) else 1.0


def measured_busy_fraction(meas: dict) -> float | None:
    """Σ busy / (ranks × makespan) of a run's timed pipeline actions: the share of rank-time spent
    computing, the makespan from the first action's start to the last one's end; None without actions."""
    per_rank = [r.get("actions", []) for r in (meas.get("pipeline") or {}).get("per_rank", [])]
    per_rank = [a for a in per_rank if a]
    if not per_rank:
        return None
    start = min(float(a[3]) for acts in per_rank for a in acts)
    end = max(float(a[4]) for acts in per_rank for a in acts)
    busy = sum(float(a[4]) - float(a[3]) for acts in per_rank for a in acts)
    return min(1.0, busy / (len(per_rank) * (end - start))) if end > start else None


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


def calibrate(cfg: Config, measurement: dict, source: str = "given", cores: int | None = None,
              links: LinkCalibration | None = None) -> Calibration:
    """Derive a :class:`Calibration` from a run of ``cfg`` and its measurement dict; with
    ``links`` (a link calibration of the same machine) the communication it takes out of the
    measured times, and the one it predicts, use the measured α and B."""
    meas = measurement if isinstance(measurement, dict) else measurement.to_dict()
    # core sharing is scaled by the calibration itself; the run's clock stays (under "ops" the measured speeds
    # are over the op lists' durations on the device profile, under "efficiency" over the FLOPs at the peak)
    cfg = cfg.replace(cluster={"cpu_cores": 0})
    lk = None if links is None else links.links_for(cfg)
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
            return predicted_step(cfg.replace(conventions={"compute_efficiency": min(e, 1.0)}), _scaled(cfg, e),
                                  lk).seconds
        eff = _bisect_log(step_at, step_s, 1e-6, 1e3)
        if eff is None:
            eff = cfg.conventions.compute_efficiency
            notes.append("the step could not be matched by compute alone (communication/optimizer already exceed "
                         "it); efficiency left at the config's")
        else:
            notes.append("no pipeline actions (pp = 1): one compute efficiency fitted so the predicted step "
                         "equals the measured one (communication and optimizer analytic)")
        return Calibration(source, cfg, eff, eff, eff, cores, None, None, None, None, step_s, tuple(notes), links)

    # ---- per-stage durations, TP communication taken out (the engine adds it back)
    tp_f, tp_b = tp_stage_seconds(cfg, num_stages, lk)
    f = med["F"] - tp_f
    split = not np.all(np.isnan(med["I"]))
    if split:
        i = med["I"] - tp_b
        w = med["W"]
        # a split schedule may still run full B for some stages/microbatches
        b = np.where(np.isnan(med["B"]), i + w, med["B"] - tp_b)
    else:
        b = med["B"] - tp_b
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

    base = clock_durations(cfg)
    eff_f = float(base.forward_s.sum() / measured.forward_s.sum())
    eff_b = float(base.backward_s.sum() / measured.backward_s.sum())
    eff = float((base.forward_s.sum() + base.backward_s.sum())
                / (measured.forward_s.sum() + measured.backward_s.sum()))
    if eff > 1 and cfg.conventions.clock != "ops":
        notes.append(f"achieved {eff:.2f}× the preset's peak FLOP/s: the GPU preset's peak is too low for this "
                     "machine (durations are used as measured)")
    if cfg.conventions.clock == "ops":
        notes.append(f"ran at {eff:.2f}× the speed of the clock from ops on its device profile (forward "
                     f"{eff_f:.2f}, backward {eff_b:.2f}); other layouts: their ops' durations over these")

    # ---- optimizer tail -> memory bandwidth
    per_step = (meas.get("step") or {}).get("per_step") or [step_s]
    last_end = max((a[4] for r in meas["pipeline"]["per_rank"] for a in r.get("actions", [])), default=0.0)
    tail = float(per_step[-1]) - float(last_end)
    held = params_per_rank(cfg)
    opt = max(optimizer_seconds(cfg, trainable_local(cfg, held[p][0]), optimizer_tensors(cfg, held[p][0]))
              for p in range(par.pp))
    mem_bw = None
    if tail > 0 and opt > 0:
        mem_bw = cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9 * opt / tail
        notes.append(f"memory bandwidth from the {tail * 1e3:.2f} ms after the last action (optimizer step, "
                     "modelled memory-bound)")

    p2p = _p2p_wait(meas)
    busy = measured_busy_fraction(meas) if on_cpu else None
    if busy is not None and cores:
        notes.append(f"busy fraction {busy:.2f} (Σ action time / (ranks × makespan)): about {busy * par.world_size:.1f} "
                     f"of {par.world_size} ranks computed at once on {cores} cores; compute is rescaled to the "
                     "target's predicted busy fraction")
    cal = Calibration(source, cfg, eff, eff_f, eff_b, cores, mem_bw, None, p2p, measured, step_s, (), links, busy)

    # ---- link bandwidth: the exposed DP reduction in each stage's last backward
    link = None
    if links is not None:
        notes.append(f"links measured by {links.source}: α and B per collective replace the cluster's")
    elif par.dp > 1 and dp_excess > 0:
        bw0 = cfg.cluster.intra_node_bytes_per_s

        def exposed_with(bw: float) -> float:
            c = dataclasses.replace(cal, link_bytes_per_s=bw)
            b = cal.busy_fraction or 1.0
            return predicted_step(c.config_for(cfg, b), c.durations_for(cfg, b)).breakdown["dp_comm_exposed"]

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


def _stage_wrapping(cfg: Config) -> tuple[bool, str]:
    """What of the wrapping plan changes a stage's measured seconds: whether ``fully_shard``
    gathers and reshards around it, and how mixed precision runs (autocast or FSDP2's policy)."""
    plan = wrapping_plan(cfg)
    return plan.sharded, plan.mixed_precision


def clock_durations(cfg: Config) -> StageDurations:
    """The stages' durations the config's clock gives before any calibration: under ``clock = "ops"`` the ops on
    the device profile (engine.time.ops.op_durations), under ``"efficiency"`` the FLOPs at the whole peak. A run's
    measured durations over these are its speeds (``Calibration.forward_efficiency`` …): what corrects the
    clock on this machine."""
    if cfg.conventions.clock == "ops":
        return op_durations(cfg)
    return stage_durations(cfg.replace(conventions={"compute_efficiency": 1.0}))


def _scaled(cfg: Config, eff: float) -> StageDurations:
    """The clock's durations at a speed that may exceed 1 (the config field may not)."""
    base = clock_durations(cfg)
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


# --------------------------------------------------------------------------- links


def _ring_terms(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, bus factor) of one ``kind`` collective over ``n`` ranks (engine.time.comm's ring)."""
    if kind == "p2p":
        return 1.0, 1.0
    return (2.0 * (n - 1) if kind == "all_reduce" else n - 1.0), bus_factor(kind, n)


def fit_alpha_beta(kind: str, n: int, sizes_bytes, seconds) -> tuple[float, float]:
    """α (s per ring step) and B (bytes/s) with ``ring_seconds(kind, S, n, B, α)`` ≈ the measured
    seconds, least squares on relative residuals, both ≥ 0 (B = inf when size does not matter)."""
    steps, factor = _ring_terms(kind, n)
    S = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if len(S) == 0 or len(S) != len(t) or np.any(t <= 0):
        raise CalibrationError(f"{kind} over {n} ranks: need positive times for every size")
    A = np.stack([np.full_like(S, steps), factor * S], axis=1) / t[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if alpha < 0:  # bandwidth alone
        alpha, inv_b = 0.0, float(np.sum(A[:, 1]) / np.sum(A[:, 1] ** 2))
    if inv_b <= 0:  # latency alone
        alpha, inv_b = float(np.sum(A[:, 0]) / np.sum(A[:, 0] ** 2)), 0.0
    return float(alpha), (math.inf if inv_b == 0 else float(1.0 / inv_b))


def fit_links(samples: list[dict]) -> tuple[LinkFit, ...]:
    """One :class:`LinkFit` per (collective, group size) from benchmark samples
    ``{"kind", "n", "bytes", "seconds": [...]}`` (the median of each sample's times is fitted). Where CPU
    ranks measured a (collective, group size) as training pays it (``"mode": "busy"``,
    backend.linkbench_worker), those samples are the ones fitted: a step calls its collectives after its
    compute, not after a barrier."""
    busy = {(smp["kind"], int(smp["n"])) for smp in samples if smp.get("mode") == "busy"}
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for smp in samples:
        if smp["kind"] not in COLLECTIVES or not smp["seconds"]:
            continue
        if ((smp["kind"], int(smp["n"])) in busy) != (smp.get("mode") == "busy"):
            continue
        groups.setdefault((smp["kind"], int(smp["n"])), []).append((float(smp["bytes"]),
                                                                      float(np.median(smp["seconds"]))))
    fits = []
    for (kind, n), pts in sorted(groups.items()):
        a, b = fit_alpha_beta(kind, n, [p[0] for p in pts], [p[1] for p in pts])
        fits.append(LinkFit(kind, n, a, b))
    return tuple(fits)


@dataclass(frozen=True)
class LinkCalibration:
    """What ``shardscope calibrate --links`` measured on this machine at ``world`` ranks."""

    source: str
    world: int
    cores: int | None  # CPU cores the ranks shared; None on GPUs
    backend: str  # gloo | nccl
    fits: tuple[LinkFit, ...]
    flops_per_rank: dict[str, float]  # "fp32" / "bf16": median per-rank matmul FLOP/s, every rank at once
    notes: tuple[str, ...] = ()

    def _over(self, world: int) -> float:
        return 1.0 if not self.cores else max(1.0, world / self.cores)

    def links_for(self, cfg: Config) -> MeasuredLinks:
        """The fits for ``cfg``: α multiplied and B divided by its core sharing relative to the benchmark's."""
        scale = 1.0 if cfg.cluster.gpu.name != "cpu" else self._over(cfg.parallel.world_size) / self._over(self.world)
        return MeasuredLinks(self.fits, scale)

    def p2p_seconds(self, cfg: Config, size_bytes: float) -> float | None:
        found = self.links_for(cfg).lookup("p2p", 2)
        return None if found is None else ring_seconds("p2p", size_bytes, 2, *found)

    def config_for(self, cfg: Config) -> Config:
        """``cfg`` with the measured matmul throughput as the peak (per core on CPU: the
        benchmark's per-rank rate times its core sharing) and the benchmark's core count."""
        over = self._over(self.world)
        gpu = cfg.cluster.gpu
        peaks = {}
        for key, dtype in (("peak_fp32_tflops", "fp32"), ("peak_bf16_tflops", "bf16")):
            if self.flops_per_rank.get(dtype):
                peaks[key] = self.flops_per_rank[dtype] * over / 1e12
        cluster: dict = {"gpu": dataclasses.replace(gpu, **peaks)}
        if gpu.name == "cpu" and self.cores:
            cluster["cpu_cores"] = self.cores
        return cfg.replace(cluster=cluster)

    def predict(self, cfg: Config) -> Prediction:
        """The analytic prediction with measured links and measured throughput (no training run)."""
        c = self.config_for(cfg)
        return predict(c, None, self.links_for(cfg))

    def to_json(self) -> dict:
        return {"source": self.source, "world": self.world, "cores": self.cores, "backend": self.backend,
                "flops_per_rank": self.flops_per_rank, "notes": list(self.notes),
                "fits": [{"kind": f.kind, "group_size": f.group_size, "alpha_us": f.latency_s * 1e6,
                          "bandwidth_gb_per_s": None if math.isinf(f.bytes_per_s) else f.bytes_per_s / 1e9}
                         for f in self.fits]}

    @classmethod
    def from_json(cls, data: dict, source: str | None = None) -> LinkCalibration:
        try:
            fits = tuple(LinkFit(f["kind"], int(f["group_size"]), float(f["alpha_us"]) * 1e-6,
                                 math.inf if f["bandwidth_gb_per_s"] is None else float(f["bandwidth_gb_per_s"]) * 1e9)
                         for f in data["fits"])
            return cls(source or data.get("source", "given"), int(data["world"]), data.get("cores"),
                       data.get("backend", "?"), fits, {k: float(v) for k, v in data["flops_per_rank"].items()},
                       tuple(data.get("notes", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"not a link calibration ({type(exc).__name__}: {exc})") from None


def links_from_benchmark(raw: dict, source: str = "given", cores: int | None = None) -> LinkCalibration:
    """Fit a :class:`LinkCalibration` from the benchmark's raw record (backend.linkbench_worker)."""
    on_cpu = raw.get("device", "cpu") == "cpu"
    flops = {}
    for dtype in ("float32", "bfloat16"):
        # the largest shape: the machine's throughput (the model's own efficiency stays a convention)
        rows = [m for m in raw.get("matmul", []) if m["dtype"] == dtype]
        if rows:
            big = max(rows, key=lambda m: math.prod(m["shape"]))
            flops["fp32" if dtype == "float32" else "bf16"] = float(np.median(big["flops_per_s_per_rank"]))
    return LinkCalibration(source, int(raw["world"]), (cores or _default_cores()) if on_cpu else None,
                           raw.get("backend", "?"), fit_links(raw["samples"]), flops)


def load_links(path: str | Path) -> LinkCalibration:
    """A link calibration from a run directory (its ``links.json``) or the file itself."""
    p = Path(path)
    f = p / LINKS_FILE if p.is_dir() else p
    if not f.exists():
        raise FileNotFoundError(f"{p} has no {LINKS_FILE} (run `shardscope calibrate --links --out {p}`)"
                                if p.is_dir() else f"link calibration not found: {p}")
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{f} is not valid JSON: {exc}") from None
    return LinkCalibration.from_json(data, source=str(p))
