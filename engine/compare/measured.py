"""Predicted vs measured, per rank and category: ``compare(prediction, measurement)``.

Pure (numpy + standard library): the measurement is the dict of a run's ``measurement.json``
(``backend.records.Measurement.to_dict()``), the prediction an ``engine.predict.Prediction``
or its ``to_json(explain=True)`` dict. Both carry the same category names, so a comparison
is a subtraction; what this module adds is the bookkeeping and the *reasons*.

Sign convention: ``error = predicted − measured`` (positive: the model says more than the
run used); ``relative = error / measured`` (``None`` when the measured value is 0 and the
predicted is not; 0 when both are 0).

Known causes of a difference are attached as notes next to the number they explain, never
subtracted silently: the runtime context (CUDA/ROCm context, outside PyTorch's allocator,
so PyTorch's MemTracker never sees it; a CPU/gloo run has none), collective-library
communicator buffers (NCCL's own allocations, also outside the tracker), and for time
the CPU-oversubscription and analytic-throughput caveats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.memory.lifetimes import PARTIAL_STATE_KINDS
from engine.memory.per_rank import plain_grads_late
from engine.names import MEMORY_CATEGORIES
from engine.pipeline.schedules import ACTION_KINDS
from engine.time.ops import clock_description
from engine.wrapping import wrapping_plan

#: Why the measurement (MemTracker) cannot see a term, by the term's ``kind``; every term with
#: ``tracked`` False is counted as untracked, and a difference of that size is expected.
UNTRACKED_NOTES: dict[str, str] = {
    "runtime_context": "the runtime context (CUDA/ROCm context) is allocated by the driver, outside "
                       "PyTorch's allocator; MemTracker never sees it (compare nvidia-smi instead)",
    "collective_buffers": "collective-library buffers are allocated by NCCL itself, outside PyTorch's allocator; "
                          "MemTracker never sees them",
    "allocator_slack": "allocator slack (reserved but unallocated) is not a tensor; MemTracker counts tensors only",
}
_UNTRACKED_OTHER = "outside PyTorch's allocator: MemTracker never sees it"


def _rel(pred: float, meas: float) -> float | None:
    if meas == 0:
        return 0.0 if pred == 0 else None
    return (pred - meas) / meas


@dataclass(frozen=True)
class Cell:
    """One predicted-vs-measured number (bytes or seconds) with its error and any known cause."""

    predicted: float
    measured: float
    notes: tuple[str, ...] = ()
    untracked: float = 0.0  # predicted bytes that the measurement cannot see (terms with tracked = False)

    @property
    def error(self) -> float:
        return self.predicted - self.measured

    @property
    def relative(self) -> float | None:
        return _rel(self.predicted, self.measured)

    @property
    def relative_tracked(self) -> float | None:
        """Relative error counting only what the measurement can see (predicted − untracked)."""
        return _rel(self.predicted - self.untracked, self.measured)

    def to_json(self) -> dict:
        out = {"predicted": self.predicted, "measured": self.measured, "error": self.error,
               "relative": self.relative}
        if self.untracked:
            out["untracked"] = self.untracked
            out["relative_tracked"] = self.relative_tracked
        if self.notes:
            out["notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class RankComparison:
    rank: int
    stage: int
    categories: dict[str, Cell]  # MEMORY_CATEGORIES
    peak: Cell  # total bytes at the peak (sum of categories on both sides)
    #: the measured max_memory_reserved (CUDA runs; a simulation's modelled caching allocator) and,
    #: where the prediction has one, its predicted ``reserved``; None when the measurement has none
    reserved: dict | None = None
    # tracked bytes at the peak: predicted ``allocated`` vs MemTracker's tensors (CPU run) or
    # torch.cuda.max_memory_allocated() (CUDA run); None for a prediction without ``allocated``
    allocated: Cell | None = None

    @property
    def reserved_cell(self) -> Cell | None:
        """``reserved`` as a Cell where both sides have it."""
        r = self.reserved
        if not r or r.get("predicted") is None:
            return None
        return Cell(float(r["predicted"]), float(r["measured"]), (f"measured: {r['source']}",))

    def to_json(self) -> dict:
        out = {"rank": self.rank, "stage": self.stage,
               "categories": {c: v.to_json() for c, v in self.categories.items()}, "peak": self.peak.to_json()}
        if self.reserved is not None:
            out["reserved"] = dict(self.reserved)
        if self.allocated is not None:
            out["allocated"] = self.allocated.to_json()
        return out


def measured_reserved(rank_record: dict | None) -> tuple[float, str] | None:
    """A rank record's max reserved bytes and where they come from: ``torch.cuda.max_memory_reserved``
    of a CUDA run, or the modelled caching allocator's replay of a simulated rank."""
    if not rank_record:
        return None
    if rank_record.get("max_memory_reserved") is not None:
        return float(rank_record["max_memory_reserved"]), "torch.cuda.max_memory_reserved"
    alloc = rank_record.get("allocator")
    if isinstance(alloc, dict) and alloc.get("max_reserved") is not None:
        return float(alloc["max_reserved"]), "modelled caching allocator (simulated rank)"
    return None


def _reserved_json(prow: dict, rank_record: dict | None) -> dict | None:
    found = measured_reserved(rank_record)
    if found is None:
        return None
    out: dict = {"measured": found[0], "source": found[1]}
    if prow.get("reserved") is not None:
        p = float(prow["reserved"])
        out.update(predicted=p, error=p - found[0], relative=_rel(p, found[0]))
    return out


@dataclass(frozen=True)
class TimelineComparison:
    """The measured actions of one (global) rank against its pipeline rank's predicted ones."""

    rank: int
    pp_rank: int
    order_identical: bool
    first_difference: int | None  # index of the first action where the orders differ
    matched: int  # actions present on both sides
    start_error_s: np.ndarray  # predicted − measured start of each matched action, measured order
    end_error_s: np.ndarray
    predicted_busy_s: float
    measured_busy_s: float
    # per action kind (F, B, I, W) over the matched actions: (predicted seconds, measured seconds, actions), summed
    kind_durations: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        def stats(a: np.ndarray) -> dict:
            if a.size == 0:
                return {"mean_abs": None, "max_abs": None}
            return {"mean_abs": float(np.mean(np.abs(a))), "max_abs": float(np.max(np.abs(a)))}
        return {"rank": self.rank, "pp_rank": self.pp_rank, "order_identical": self.order_identical,
                "first_difference": self.first_difference, "matched": self.matched,
                "start_error_s": stats(self.start_error_s), "end_error_s": stats(self.end_error_s),
                "busy_s": {"predicted": self.predicted_busy_s, "measured": self.measured_busy_s},
                "durations_by_kind_s": {k: {"predicted": p, "measured": m, "actions": n}
                                        for k, (p, m, n) in self.kind_durations.items()}}


@dataclass(frozen=True)
class Comparison:
    memory: list[RankComparison]
    step: Cell  # seconds
    makespan: Cell | None  # seconds; pipeline runs only
    bubble: Cell | None  # share-of-total (idle / (ranks · makespan)); pipeline runs only
    timeline: list[TimelineComparison]
    notes: list[str] = field(default_factory=list)

    # ----------------------------------------------------------------- summaries

    def max_relative(self, category: str, tracked: bool = True) -> float | None:
        """Largest |relative error| of one category (or "peak", "allocated", "reserved") over the ranks;
        None if undefined."""
        vals = []
        for r in self.memory:
            cell = (r.reserved_cell if category == "reserved" else getattr(r, category)
                    if category in ("peak", "allocated") else r.categories[category])
            if cell is None:
                continue
            rel = cell.relative_tracked if tracked else cell.relative
            if rel is None:
                if cell.predicted != cell.measured:
                    return math.inf
                continue
            vals.append(abs(rel))
        return max(vals) if vals else 0.0

    def action_kinds(self) -> dict[str, Cell]:
        """Per action kind (F, B, I, W, in that order), the mean duration of one action over the matched actions of
        every measured rank: predicted and measured, the error per kind the timeline's lanes show."""
        total: dict[str, list] = {}
        for t in self.timeline:
            for k, (p, m, n) in t.kind_durations.items():
                acc = total.setdefault(k, [0.0, 0.0, 0])
                acc[0], acc[1], acc[2] = acc[0] + p, acc[1] + m, acc[2] + n
        return {k: Cell(total[k][0] / total[k][2], total[k][1] / total[k][2],
                        (f"mean of one action over {total[k][2]} matched actions, every measured rank",))
                for k in ACTION_KINDS if k in total and total[k][2]}

    @property
    def orders_identical(self) -> bool | None:
        return None if not self.timeline else all(t.order_identical for t in self.timeline)

    def summary(self) -> dict:
        out: dict[str, Any] = {c: self.max_relative(c) for c in MEMORY_CATEGORIES}
        out["peak"] = self.max_relative("peak")
        out["peak_untracked_included"] = self.max_relative("peak", tracked=False)
        out["allocated"] = self.max_relative("allocated")
        out["reserved"] = self.max_relative("reserved") if any(r.reserved_cell for r in self.memory) else None
        out["step"] = self.step.relative
        out["bubble_error"] = None if self.bubble is None else self.bubble.error
        out["makespan"] = None if self.makespan is None else self.makespan.relative
        out["orders_identical"] = self.orders_identical
        return out

    def to_json(self) -> dict:
        return {
            "summary": self.summary(),
            "memory": {"per_rank": [r.to_json() for r in self.memory]},
            "pipeline": None if self.bubble is None else {
                "makespan_s": self.makespan.to_json(), "bubble_fraction": self.bubble.to_json(),
                "orders_identical": self.orders_identical, "per_rank": [t.to_json() for t in self.timeline],
                "action_kinds_s": {k: c.to_json() for k, c in self.action_kinds().items()}},
            "step": {"seconds": self.step.to_json()},
            "notes": list(self.notes),
            "conventions": {
                "error": "predicted − measured", "relative": "error / measured",
                "relative_tracked": "(predicted − bytes the measurement cannot see) / measured − 1",
                "bubble": "share of total: idle / (ranks · makespan), both sides",
                "peak": "sum of the categories at the peak (measured: MemTracker's peak snapshot "
                        "with exact params/grads/optimizer)",
                "allocated": "tracked bytes at the peak (measured: torch.cuda.max_memory_allocated() on CUDA, "
                             "MemTracker's tensors on CPU)",
                "reserved": "the caching allocator's most reserved bytes (measured: "
                            "torch.cuda.max_memory_reserved(); CUDA runs only)"},
        }


# --------------------------------------------------------------------------- compare


def _as_prediction_json(pred) -> tuple[dict, Any]:
    if isinstance(pred, dict):
        return pred, None
    return pred.to_json(explain=True), pred.config


def _as_measurement_json(meas) -> dict:
    if isinstance(meas, dict):
        return meas
    if hasattr(meas, "to_dict"):
        return meas.to_dict()
    raise TypeError(f"measurement must be a dict (measurement.json) or have to_dict(), not {type(meas).__name__}")


def _untracked(explain: dict | None, category: str) -> tuple[float, tuple[str, ...]]:
    """Bytes of the category's terms that the measurement cannot see (``tracked`` False), and why."""
    if not explain:
        return 0.0, ()
    total, notes = 0.0, []
    for term in explain.get(category, []):
        if term.get("tracked", True) or not term.get("bytes", 0):
            continue
        total += term["bytes"]
        why = UNTRACKED_NOTES.get(term.get("kind", ""), _UNTRACKED_OTHER)
        if why not in notes:
            notes.append(why)
    return total, tuple(notes)


def _memory_notes(category: str, pred: float, meas: float, measured_detail: dict | None,
                  device: str | None) -> list[str]:
    notes = []
    if category == "overhead" and meas == 0 and device == "cpu":
        notes.append("CPU/gloo run: there is no CUDA context, and MemTracker sees only tensors, so measured "
                     "overhead is 0")
    if category == "comm_buffers" and measured_detail is not None:
        raw = measured_detail.get("memory", {}).get("tracker_peak", {})
        if raw and not any(k in raw for k in ("All Gather", "Reduce Scatter", "Unsharded Param")) \
                and measured_detail.get("memory", {}).get("exact", {}).get("grads"):
            notes.append("measured comm_buffers = the DDP Reducer's flat bucket copy of the gradients, added by the "
                         "backend (MemTracker does not tag DDP's buckets); gloo/NCCL internal buffers are not visible")
    if category == "temporaries" and pred != meas:
        notes.append("measured temporaries are what MemTracker tags Temp at the overall peak moment; the model "
                     "counts only large named temporaries (logits at the loss)")
    return notes


def _plain_grads_late(cfg) -> bool:
    """Whether the prediction's plain gradients live from the first backward on
    (``engine.memory.per_rank.plain_grads_late``); False without a config (an older prediction dict)."""
    if cfg is None:
        return False

    return plain_grads_late(cfg, wrapping_plan(cfg))


def _plain_grads_measured(exact: float, rank_detail: dict | None) -> tuple[float, list[str]]:
    """The measured grads where plain ``.grad`` exists from the first backward on: what MemTracker tagged
    Gradient at its peak (its post-accumulate-grad hook tags each as AccumulateGrad makes it), never more
    than the exact size the record's categories carry; the exact size where the tracker has no such tag."""
    raw = ((rank_detail or {}).get("memory") or {}).get("tracker_peak") or {}
    if "Gradient" not in raw:
        return exact, []
    seen = float(min(exact, raw["Gradient"]))
    if seen == exact:
        return exact, []
    return seen, [f"measured grads: what MemTracker tagged Gradient at its peak ({seen:,.0f} B of {exact:,.0f}): "
                  "zero_grad(set_to_none=True) dropped the last step's, and each .grad is made as the first "
                  "backward reaches its parameter"]


#: MemTracker's names of what the backend counts in comm_buffers
_TRACKER_COMM = ("All Gather", "Reduce Scatter", "Unsharded Param", "Unsharded Grad")


def _compiled_saved_delta(rank_detail: dict | None) -> tuple[float, str] | None:
    """Under training.compile: (compiled − eager saved-for-backward bytes at their peak, the note saying
    so), from the backend's ``memory.saved_for_backward``; None without it. MemTracker cannot run inside
    a compiled block, so the measured step ran the blocks eagerly; the blocks' saved tensors were
    counted by saved_tensors_hooks over that eager step and over one compiled step."""
    saved = ((rank_detail or {}).get("memory") or {}).get("saved_for_backward")
    if not saved or "compiled" not in saved or "eager" not in saved:
        return None
    eager, compiled = float(saved["eager"]), float(saved["compiled"])
    return compiled - eager, (
        "training.compile: measured = MemTracker's activations of the eager step with the blocks' saved tensors "
        f"as the compiled blocks save them (saved_tensors_hooks at their peak: {compiled:,.0f} B compiled vs "
        f"{eager:,.0f} B eager); the tracker cannot see inside a compiled block")


#: how a compiled run's measurement notes begin (backend.parallel.compile.COMPILED_MEMORY_NOTE)
COMPILED_NOTE_MARK = "training.compile:"

#: the note on a compiled run's activations without a saved-tensor count (an older measurement)
COMPILED_UNMEASURED = ("training.compile: the measured step ran the blocks eagerly and this measurement has no "
                       "count of what the compiled blocks save (memory.saved_for_backward): the activations "
                       "measured are the eager blocks', not the compiled ones predicted")


def _allocated_cell(prow: dict, rank_detail: dict, cells: dict[str, Cell], compiled_delta: float = 0.0) -> Cell | None:
    """Allocated bytes of one rank: the prediction's ``allocated`` against
    torch.cuda.max_memory_allocated() on a CUDA run; on a CPU run against the larger of the measured
    categories' sum and MemTracker's own peak total plus the buffers the backend adds that it never
    sees. None where the prediction has no such number (an older prediction dict). (Reserved:
    ``_reserved_json``.)"""
    if "allocated" not in prow:
        return None
    p_alloc = float(prow["allocated"])
    if "max_memory_allocated" in rank_detail:
        return Cell(p_alloc, float(rank_detail["max_memory_allocated"]), ("measured: torch.cuda.max_memory_allocated()",))
    mem = rank_detail.get("memory") or {}
    raw = mem.get("tracker_peak") or {}
    notes = ["tensors at the peak: predicted tracked bytes vs MemTracker's peak (it counts tensors only); a CPU "
             "run has no caching allocator, so reserved = allocated"]
    if "Total" in raw and "categories" in mem:
        # the tracker's own total at its peak, plus what the backend adds that the tracker never sees
        # (the pipeline's p2p receive buffers, DDP's buckets: measured comm_buffers beyond the tracker's)
        # The larger of the two: the categories count the states whole (exact sizes), which the tracker's
        # total may miss (ZeroRedundancyOptimizer's states, sharded gradients not yet allocated), and the
        # tracker's total keeps what the categories drop when the exact sizes replace its Parameter /
        # Gradient (under pipelining plain MemTracker tags FSDP2's unsharded copies so).
        added = mem["categories"].get("comm_buffers", 0) - sum(raw.get(k, 0) for k in _TRACKER_COMM)
        summed = float(sum(cells[c].measured for c in MEMORY_CATEGORIES))
        m_alloc = max(summed, float(raw["Total"] + compiled_delta + max(0, added)))
        if m_alloc > 1.01 * summed:
            notes.append("the measured categories sum to less than the tracker's own peak total (+ the buffers it "
                         "never sees): the exact params / grads replace what the tracker tagged Parameter / "
                         "Gradient, which under pipelining (plain MemTracker) includes FSDP2's unsharded copies")
    else:
        m_alloc = float(sum(cells[c].measured for c in MEMORY_CATEGORIES))
    return Cell(p_alloc, m_alloc, tuple(notes))


def _device_of(meas: dict) -> str | None:
    ranks = meas.get("ranks") or []
    if not ranks:
        return None
    return "cuda" if any("max_memory_allocated" in r for r in ranks) else "cpu"


def compare(pred, measurement) -> Comparison:
    """Compare a Prediction (or its ``to_json(explain=True)`` dict) with a run's measurement dict."""
    pj, cfg = _as_prediction_json(pred)
    mj = _as_measurement_json(measurement)
    device = _device_of(mj)
    notes: list[str] = []

    # ---- memory
    pred_rows = {int(r["rank"]): r for r in pj["memory"]["per_rank"]}
    plain_late = _plain_grads_late(cfg)
    detail = {int(r["rank"]): r for r in (mj.get("ranks") or []) if "rank" in r}
    rows: list[RankComparison] = []
    missing = []
    for mrow in sorted(mj["memory"]["per_rank"], key=lambda r: r["rank"]):
        rank = int(mrow["rank"])
        prow = pred_rows.get(rank)
        if prow is None:
            missing.append(rank)
            continue
        cells: dict[str, Cell] = {}
        compiled = _compiled_saved_delta(detail.get(rank))
        for c in MEMORY_CATEGORIES:
            p, m = float(prow.get(c, 0)), float(mrow.get(c, 0))
            untracked, why = _untracked(prow.get("explain"), c)
            extra = _memory_notes(c, p, m, detail.get(rank), device)
            if c == "grads" and plain_late:
                m, why_m = _plain_grads_measured(m, detail.get(rank))
                extra = extra + why_m
            if c == "activations" and compiled is not None:
                m, extra = m + compiled[0], extra + [compiled[1]]
            elif c == "activations" and COMPILED_NOTE_MARK in " ".join(
                    ((detail.get(rank) or {}).get("memory") or {}).get("notes") or ()):
                extra.append(COMPILED_UNMEASURED)
            cells[c] = Cell(p, m, tuple(why) + tuple(extra), untracked)
        p_peak = float(sum(cells[c].predicted for c in MEMORY_CATEGORIES))
        m_peak = float(sum(cells[c].measured for c in MEMORY_CATEGORIES))
        peak_notes = []
        if any(cells[c].untracked for c in MEMORY_CATEGORIES):
            peak_notes.append("includes predicted bytes the measurement cannot see; see relative_tracked")
        allocated = _allocated_cell(prow, detail.get(rank) or {}, cells, compiled[0] if compiled else 0.0)
        rows.append(RankComparison(rank, int(mrow.get("stage", prow.get("stage", 0))), cells,
                                   Cell(p_peak, m_peak, tuple(peak_notes),
                                        float(sum(cells[c].untracked for c in MEMORY_CATEGORIES))),
                                   _reserved_json(prow, detail.get(rank)), allocated))
    if missing:
        notes.append(f"measured ranks {missing} have no predicted row (different world size?)")
    if len(pred_rows) > len(mj["memory"]["per_rank"]):
        notes.append(f"the prediction has {len(pred_rows)} ranks, the measurement {len(mj['memory']['per_rank'])}")

    notes.extend(_state_notes(rows, cfg, detail))

    # ---- pipeline
    ppj = pj.get("pipeline") or {}
    pp = int(ppj.get("pp", len(ppj.get("per_rank", [])) or 1))
    measured_actions = [r for r in (mj.get("pipeline") or {}).get("per_rank", []) if r.get("actions")]
    timeline: list[TimelineComparison] = []
    makespan = bubble = None
    if pp > 1 and measured_actions:
        world = max(len(mj["memory"]["per_rank"]), 1)
        pred_by_pp = {int(r["pp_rank"]): r for r in ppj["per_rank"]}
        ends, busy = [], []
        starts = []
        for mr in sorted(measured_actions, key=lambda r: r["rank"]):
            rank = int(mr["rank"])
            coords = (detail.get(rank) or {}).get("coords")
            pp_rank = int(coords["pp"]) if coords else rank * pp // world
            timeline.append(_compare_actions(rank, pp_rank, pred_by_pp[pp_rank]["actions"], mr["actions"]))
            acts = mr["actions"]
            starts.append(min(a[3] for a in acts))
            ends.append(max(a[4] for a in acts))
            busy.append(sum(a[4] - a[3] for a in acts))
        m_span = max(ends) - min(starts)
        m_bubble = float(sum(m_span - b for b in busy) / (len(busy) * m_span)) if m_span > 0 else 0.0
        p_span = float(ppj["makespan_s"])
        makespan = Cell(p_span, m_span, ("measured: first action start to last action end over all ranks",))
        bubble = Cell(float(ppj["bubble_fraction"]), m_bubble,
                      ("share of total time: idle / (ranks · makespan); measured over every global rank",))
        if not all(t.order_identical for t in timeline):
            notes.append("the measured action order differs from the predicted plan on some rank "
                         "(first_difference gives the index)")
    elif pp > 1:
        notes.append("the measurement has no pipeline actions: timeline and bubble not compared")

    # ---- step
    step_notes = []
    if cfg is not None and getattr(cfg.cluster.gpu, "name", "") == "cpu":
        step_notes.append(f"CPU ranks: timed by the {clock_description(cfg)}, each action slowed by the ranks "
                          "sharing the machine's cores; per-op overhead the op lists do not count (the modules' "
                          "Python, small tensors' kernels) and gloo's collectives on shared cores are what it "
                          "misses — calibrate (shardscope predict --calibration RUN_DIR)")
    step = Cell(float(pj["step"]["seconds"]), float(mj["step"]["seconds"]), tuple(step_notes))
    return Comparison(rows, step, makespan, bubble, timeline, notes)


def states_exact(pred, measurement) -> bool:
    """Parameters, gradients and optimizer states at their exact sizes on every measured rank: the
    prediction's whole terms of each (alive at its peak or not: plain gradients come with the first
    backward, FSDP2's sharded ones with the reducing post-backward) against the run's exact sizes
    (``memory.exact``; the measured categories where a record has none). ``pred``: a Prediction
    (its terms), not its JSON."""
    mj = _as_measurement_json(measurement)
    detail = {int(r["rank"]): r for r in (mj.get("ranks") or []) if "rank" in r}
    rows = {r.rank: r for r in pred.memory.per_rank}
    for mrow in mj["memory"]["per_rank"]:
        rank = int(mrow["rank"])
        if rank not in rows:
            return False
        exact = (((detail.get(rank) or {}).get("memory") or {}).get("exact")) or mrow
        for c in ("params", "grads", "optimizer"):
            if sum(t.bytes for t in rows[rank].catalogue(c) if t.kind not in PARTIAL_STATE_KINDS) != int(exact.get(c, 0)):
                return False
    return True


def _state_notes(rows: list[RankComparison], cfg, detail: dict) -> list[str]:
    """Known reasons why params / grads / optimizer differ (the model says ZeRO, torch does ...)."""
    out = []
    err = {c: [r for r in rows if r.categories[c].error] for c in ("params", "grads", "optimizer")}
    raw_keys = {k for d in detail.values() for k in (d.get("memory", {}).get("tracker_peak") or {})}
    if err["params"] and "Sharded Param" in raw_keys:
        out.append("params: FSDP2 (fully_shard) keeps the parameters sharded and holds the unsharded compute copy "
                   "as 'Unsharded Param' (the backend counts it in comm_buffers); ShardScope's ZeRO-2 accounting "
                   "reports that copy as params — compare the peak, not the split")
    if err["optimizer"] and cfg is not None and cfg.parallel.zero == 1:
        p = sum(r.categories["optimizer"].predicted for r in rows)
        m = sum(r.categories["optimizer"].measured for r in rows)
        if p == m:
            out.append("optimizer: torch's ZeroRedundancyOptimizer gives each rank whole parameters (largest first, "
                       "to the least-loaded rank), not an even flat split like DeepSpeed's ZeRO-1 that the model "
                       "assumes; the sum over ranks is exact")
    if err["grads"] and cfg is not None and cfg.parallel.tp > 1:
        t, m = cfg.parallel.tp, cfg.model
        full_emb = m.vocab * m.hidden * cfg.training.grad_bytes
        if all(r.categories["grads"].error == -(full_emb - full_emb // t) for r in err["grads"]):
            out.append("grads: with TP the token embedding's gradient is materialised at full vocab × hidden on "
                       "every TP rank (torch keeps it replicated); the model counts it sharded by tp")
    return out


def _compare_actions(rank: int, pp_rank: int, predicted: list, measured: list) -> TimelineComparison:
    pk = [(a[0], int(a[1]), int(a[2])) for a in predicted]
    mk = [(a[0], int(a[1]), int(a[2])) for a in measured]
    first = next((i for i, (x, y) in enumerate(zip(pk, mk)) if x != y), None)
    if first is None and len(pk) != len(mk):
        first = min(len(pk), len(mk))
    p_at = {k: a for k, a in zip(pk, predicted)}
    m0 = min((a[3] for a in measured), default=0.0)  # measured times count from the step's start;
    p0 = min((a[3] for a in predicted), default=0.0)  # align the first action of each side
    se, ee = [], []
    kinds: dict[str, tuple[float, float, int]] = {}
    for k, a in zip(mk, measured):
        if k in p_at:
            p = p_at[k]
            se.append((p[3] - p0) - (a[3] - m0))
            ee.append((p[4] - p0) - (a[4] - m0))
            was = kinds.get(k[0], (0.0, 0.0, 0))
            kinds[k[0]] = (was[0] + float(p[4] - p[3]), was[1] + float(a[4] - a[3]), was[2] + 1)
    return TimelineComparison(
        rank, pp_rank, first is None, first, len(se), np.asarray(se), np.asarray(ee),
        float(sum(a[4] - a[3] for a in predicted)), float(sum(a[4] - a[3] for a in measured)), kinds)
