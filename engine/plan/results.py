"""The planner's results and the words beside them: the ranked layouts (``PlanEntry``), the fitting
layouts' points (``FitPoint``), what was pruned (``PlanCounts``), the whole answer (``PlanResult``), a
layout's name and Config, and :func:`explain`, why each ranked layout ranks where it does. Shared by
the dense planner (``engine.plan.search``) and the mixture-of-experts planner (``engine.plan.moe``), so
neither imports the other's internals."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.backend_limits import predict_only
from engine.config import Config
from engine.memory import GIB


class PlanError(ValueError):
    """A planner argument that cannot be used; ``argument`` names it (``model``, ``gpus``, ...)."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.message = message


class PlanCancelled(Exception):
    """``plan(..., cancelled=...)`` was told to stop; nothing is returned."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PlanEntry:
    """One ranked layout with the engine's full numbers and why it ranks where it does."""

    position: int  # 1 = fastest
    config: Config
    seconds: float
    tokens_per_s: float
    mfu: float
    breakdown: dict[str, float]  # engine.time.step.BREAKDOWN_KEYS, sums to seconds
    peak_bytes: int  # the rank that needs the most memory
    peak_rank: int
    capacity_bytes: int
    why: tuple[str, ...] = ()

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def layout(self) -> dict[str, Any]:
        return _layout_of(self.config)

    def label(self) -> str:
        return layout_label(self.config)

    @property
    def predict_only(self) -> list[str]:
        """Why ShardScope's backend cannot run this layout (``engine.backend_limits``); empty: it can."""
        return predict_only(self.config)

    def to_json(self) -> dict:
        return {"position": self.position, "layout": self.layout, "label": self.label(),
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "breakdown": self.breakdown, "peak_bytes": self.peak_bytes, "peak_rank": self.peak_rank,
                "capacity_bytes": self.capacity_bytes, "headroom_bytes": self.headroom_bytes,
                "why": list(self.why), "predict_only": self.predict_only, "config": self.config.to_dict()}


@dataclass(frozen=True)
class FitPoint:
    """One fitting layout of the all-fitting sweep: the engine's full numbers, lighter than a PlanEntry."""

    config: Config
    seconds: float
    tokens_per_s: float
    mfu: float
    peak_bytes: int  # the rank that needs the most memory
    peak_rank: int
    position: int = 0  # its place in the top K, 0 when it is not in it
    pareto: bool = False  # no other fitting layout is as fast with less memory, or faster with as little

    @property
    def layout(self) -> dict[str, Any]:
        return _layout_of(self.config)

    def label(self) -> str:
        return layout_label(self.config)

    def to_json(self) -> dict:
        return {"label": self.label(), "layout": self.layout, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "peak_bytes": self.peak_bytes,
                "peak_rank": self.peak_rank, "position": self.position, "pareto": self.pareto}


@dataclass(frozen=True)
class PlanCounts:
    """How many layouts went where (the search's own accounting)."""

    enumerated: int = 0  # valid layouts in the grid (schedule rules applied)
    skipped_global_batch: int = 0  # (tp, pp) pairs whose dp does not divide the global batch
    memory_bound_rejected: int = 0  # cannot fit: the closed-form lower bound already exceeds capacity
    pruned_by_time_bound: int = 0  # cannot reach the top K: bound above the K-th best step
    pipelines_simulated: int = 0  # distinct pipeline shapes simulated for the tighter bound
    fully_evaluated: int = 0  # memory_per_rank ran
    did_not_fit: int = 0  # ... and said it does not fit
    rejected_by_validation: int = 0  # Config refused it (should stay 0: the grid follows the rules)
    fitting_timed: int = 0  # step_time ran
    predict_only_skipped: int = 0  # runnable_only: left out, the backend cannot run them (engine.backend_limits)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PlanResult:
    model: str
    gpus: int
    gpu: str
    gpus_per_node: int
    global_batch: int  # sequences per step, the same for every layout
    tokens_per_step: int
    capacity_bytes: int
    entries: tuple[PlanEntry, ...]
    counts: PlanCounts
    elapsed_s: float
    exhaustive: bool = False  # True: every layout was fully evaluated (no pruning)
    notes: tuple[str, ...] = field(default=())
    # the all-fitting sweep (all_fitting=True); empty otherwise
    all_fitting: bool = False
    fitting: tuple[FitPoint, ...] = ()  # fastest first; the top K are among them
    fitting_candidates: int = 0  # layouts that pass the memory lower bound (what the sweep would evaluate)
    fitting_evaluated: int = 0  # ... of which the sweep fully evaluated this many
    fitting_stopped: str = ""  # why the sweep stopped early ('' = it evaluated every candidate)
    base: Config | None = None  # the config every layout is made from (layout_config(base, layout))

    @property
    def best(self) -> PlanEntry | None:
        return self.entries[0] if self.entries else None

    def to_json(self) -> dict:
        out = {"model": self.model, "gpus": self.gpus, "gpu": self.gpu, "gpus_per_node": self.gpus_per_node,
               "global_batch": self.global_batch, "tokens_per_step": self.tokens_per_step,
               "capacity_bytes": self.capacity_bytes, "elapsed_s": self.elapsed_s,
               "exhaustive": self.exhaustive, "counts": self.counts.to_json(), "notes": list(self.notes),
               "entries": [e.to_json() for e in self.entries]}
        if self.all_fitting:
            out["fitting"] = {"candidates": self.fitting_candidates, "evaluated": self.fitting_evaluated,
                              "stopped": self.fitting_stopped, "points": [p.to_json() for p in self.fitting]}
            out["base_config"] = self.base.to_dict() if self.base is not None else None
        return out


def _layout_of(cfg: Config) -> dict[str, Any]:
    par, tr = cfg.parallel, cfg.training
    out = {"dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "zero": par.zero,
           "sequence_parallel": par.sequence_parallel, "schedule": par.schedule if par.pp > 1 else None,
           "virtual_stages": par.virtual_stages, "microbatches": par.microbatches,
           "micro_batch_size": tr.micro_batch_size, "recompute": tr.recompute, "float8": tr.float8,
           "compile": tr.compile}
    if par.ep > 1:  # expert parallelism (a layout without "ep" has ep = 1)
        out["ep"] = par.ep
    return out


LAYOUT_KEYS = ("dp", "tp", "pp", "zero", "sequence_parallel", "schedule", "virtual_stages", "microbatches",
               "micro_batch_size", "recompute")


def layout_config(base: Config, layout: dict[str, Any]) -> Config:
    """The Config of a planner layout (``PlanEntry.layout`` / ``FitPoint.layout`` / their JSON) on ``base``
    (``PlanResult.base``): the same Config the planner evaluated (``cp``, ``float8`` and ``compile`` are
    optional: 1, "none" and false when left out).
    Raises ConfigError if it is not valid."""
    missing = [k for k in LAYOUT_KEYS if k not in layout]
    if missing:
        raise PlanError("layout", f"missing {', '.join(missing)}; a layout has {', '.join(LAYOUT_KEYS)}")
    return base.replace(
        parallel={"dp": layout["dp"], "tp": layout["tp"], "pp": layout["pp"], "cp": layout.get("cp", 1),
                  "zero": layout["zero"],
                  "sequence_parallel": layout["sequence_parallel"], "schedule": layout["schedule"] or "1F1B",
                  "virtual_stages": layout["virtual_stages"], "microbatches": layout["microbatches"],
                  "ep": layout.get("ep", 1)},
        training={"micro_batch_size": layout["micro_batch_size"], "recompute": layout["recompute"],
                  "float8": layout.get("float8", "none"), "compile": layout.get("compile", False)})


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (tokens_per_s, peak_bytes) pairs: True where no other point is at least as fast with at most as
    much memory and strictly better in one (higher tokens/s is better, lower peak memory is better)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][1], -points[i][0]))
    out = [False] * len(points)
    best_speed = -math.inf  # the fastest point seen with strictly less (or equal, earlier) memory
    k = 0
    while k < len(order):
        j = k  # a run of equal peak memory: only its fastest can be on the front
        while j < len(order) and points[order[j]][1] == points[order[k]][1]:
            j += 1
        top = points[order[k]][0]
        if top > best_speed:
            for t in range(k, j):
                if points[order[t]][0] == top:
                    out[order[t]] = True
            best_speed = top
        k = j
    return out


def layout_label(cfg: Config) -> str:
    """A compact name of a layout: ``dp16 tp8 pp8 ZeRO-1 +SP Interleaved1F1B v2 m64 b1 recompute=selective``,
    then ``float8=rowwise`` and ``compile`` where they are on."""
    par, tr = cfg.parallel, cfg.training
    parts = ([f"dp{par.dp}", f"tp{par.tp}", f"pp{par.pp}"] + ([f"cp{par.cp}"] if par.cp > 1 else [])
             + ([f"ep{par.ep}"] if par.ep > 1 else []) + [f"ZeRO-{par.zero}"])
    if par.sequence_parallel:
        parts.append("+SP")
    if par.pp > 1:
        parts.append(par.schedule + (f" v{par.virtual_stages}" if par.virtual_stages > 1 else ""))
    parts += [f"m{par.microbatches}", f"b{tr.micro_batch_size}", f"recompute={tr.recompute}"]
    if tr.float8 != "none":
        parts.append(f"float8={tr.float8}")
    if tr.compile:
        parts.append("compile")
    return " ".join(parts)


_NICE = {"compute": "compute", "tp_comm": "TP communication", "cp_comm": "exposed CP communication",
         "pipeline_bubble": "pipeline bubble",
         "dp_comm_exposed": "exposed DP communication", "optimizer": "optimizer step",
         "ep_comm": "EP all-to-all"}  # ep_comm: in the breakdown only when ep > 1


def _diff(a: Config, b: Config) -> str:
    """What differs between two layouts, as 'pp 4→8, b 1→2'."""
    la, lb = _fields(a), _fields(b)
    return ", ".join(f"{k} {la[k]}→{lb[k]}" for k in la if la[k] != lb[k])


def _fields(cfg: Config) -> dict[str, Any]:
    par, tr = cfg.parallel, cfg.training
    return {"dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep, "ZeRO": par.zero,
            "SP": "on" if par.sequence_parallel else "off",
            "schedule": par.schedule if par.pp > 1 else "-", "v": par.virtual_stages, "m": par.microbatches,
            "b": tr.micro_batch_size, "recompute": tr.recompute, "float8": tr.float8,
            "compile": "on" if tr.compile else "off"}


def _readable(nbytes: float) -> str:
    """GiB with one decimal, or MiB (KiB) where that would read 0.0 (the CPU default's 20 MiB peaks)."""
    if abs(nbytes) >= 0.1 * GIB:
        return f"{nbytes / GIB:.1f} GiB"
    if abs(nbytes) >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def explain(best: list, capacity: int) -> tuple[PlanEntry, ...]:
    out = []
    if not best:
        return ()
    top_s, top_st, top_cfg = best[0][0], best[0][4], best[0][3]
    for pos, (seconds, _, _i, cfg, st, mem) in enumerate(best, start=1):
        peak = mem.peak
        bd = st.breakdown
        why = []
        head = capacity - peak.total
        share = 100 * head / capacity
        why.append(f"memory: peak {_readable(peak.total)} on rank {peak.rank} of {_readable(capacity)} — "
                   f"headroom {_readable(head)} ({share:.0f}%)" if share < 99.5 else
                   f"memory: peak {_readable(peak.total)} on rank {peak.rank}, under 1% of {_readable(capacity)}")
        if head < 0.05 * capacity:
            why[-1] += "; tight"
        shares = ", ".join(f"{_NICE[k]} {100 * bd[k] / seconds:.0f}%" for k in ("compute", "tp_comm", "cp_comm",
                                                                          "ep_comm", "pipeline_bubble",
                                                                          "dp_comm_exposed")
                           if bd.get(k, 0.0) > 0)
        why.append(f"step {seconds:.3f} s = {shares}; MFU {100 * st.mfu:.1f}%")
        if pos == 1:
            lost = sorted(((bd.get(k, 0.0), k) for k in _NICE if k != "compute"), reverse=True)
            if lost[0][0] > 0:
                why.append(f"fastest; its largest loss is {_NICE[lost[0][1]]} ({lost[0][0]:.3f} s)")
            else:
                why.append("fastest; nothing but compute on the critical path")
        else:
            deltas = sorted(((bd.get(k, 0.0) - top_st.breakdown.get(k, 0.0), k) for k in _NICE), reverse=True)
            worse = [f"+{d:.3f} s {_NICE[k]}" for d, k in deltas if d > 1e-4 * seconds][:2]
            better = [f"{-d:.3f} s {_NICE[k]}" for d, k in deltas[::-1] if d < -1e-4 * seconds][:1]
            text = f"{100 * (seconds / top_s - 1):.1f}% slower than #1"
            change = _diff(top_cfg, cfg)
            if change:
                text += f" ({change})"
            if worse:
                text += ": " + ", ".join(worse)
            if better:
                text += f"; gains {better[0]}"
            why.append(text)
        out.append(PlanEntry(position=pos, config=cfg, seconds=seconds, tokens_per_s=st.tokens_per_s, mfu=st.mfu,
                             breakdown=dict(bd), peak_bytes=peak.total, peak_rank=peak.rank,
                             capacity_bytes=capacity, why=tuple(why)))
    return tuple(out)
