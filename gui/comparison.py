"""The comparison table's rows: ``engine.compare.measured`` laid out for a table (no Qt, no arithmetic).

Every number and every explanation comes from :func:`engine.compare.measured.compare`; this module only
chooses the rows, their units and their words. The widgets' shared wording lives here too: bytes
(:func:`fmt_bytes`) and the engine's terms behind one number (:func:`explain_text`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.compare.measured import Comparison, compare

BYTES, SECONDS, SHARE, TEXT = "bytes", "seconds", "share", "text"


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    """Seconds as a person reads them, the one formatter of the product: three significant digits in µs,
    ms, s, min or h, never an exponent ("2.1e+03 s" read as 35 min)."""
    a = abs(s)

    def digits(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    for unit, size in (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3)):
        if a >= size:
            return f"{digits(s / size)} {unit}"
    return f"{digits(s * 1e6)} µs"


@dataclass(frozen=True)
class Row:
    """One line of the comparison table.

    ``error`` is the relative error in percent ((predicted − measured) / measured) for bytes and
    seconds, the difference in percentage points for a share, and None where it is undefined.
    """

    rank: str
    quantity: str
    predicted: float | str | None
    measured: float | str | None
    error: float | None
    note: str = ""
    unit: str = BYTES

    def _fmt(self, v) -> str:
        if v is None:
            return "—"
        if isinstance(v, str):
            return v
        if self.unit == BYTES:
            return fmt_bytes(v)
        if self.unit == SECONDS:
            return fmt_seconds(v)
        if self.unit == SHARE:
            return f"{v * 100:.1f} %"
        return f"{v:.4g}"

    def cells(self) -> list[str]:
        if self.error is None:
            err = "—"
        elif self.unit == SHARE:
            err = f"{self.error:+.1f} pts"
        else:
            err = f"{self.error:+.1f}"
        return [self.rank, self.quantity, self._fmt(self.predicted), self._fmt(self.measured), err, self.note]


def _pct(rel: float | None) -> float | None:
    return None if rel is None else rel * 100


ALLOCATED = "allocated (max_memory_allocated)"  # a CUDA run: what torch.cuda reports
ALLOCATED_TENSORS = "allocated (tensors at the peak)"  # a CPU or simulated run: MemTracker's peak
RESERVED = "reserved (max_memory_reserved)"
NOT_MEASURED = "not measured"
#: measured categories that do not come from the tracker (the tensors counted themselves, and the
#: overhead no tracker sees): a measurement's ``memory.notes`` (what the tracker could not see) do
#: not concern them
EXACT_CATEGORIES = ("params", "grads", "optimizer", "overhead")  # (overhead: no tensors at all)


def _predicted_reserved(engine_prediction) -> dict[int, float]:
    """rank -> predicted reserved bytes, from a Prediction or its JSON dict ({} when it has none)."""
    memory = engine_prediction.get("memory") if isinstance(engine_prediction, dict) else \
        getattr(engine_prediction, "memory", None)
    if memory is None:
        return {}
    rows = memory.get("per_rank", []) if isinstance(memory, dict) else memory.per_rank
    out = {}
    for r in rows:
        rank, reserved = (r.get("rank"), r.get("reserved")) if isinstance(r, dict) else (r.rank, r.reserved)
        if reserved is not None:
            out[int(rank)] = float(reserved)
    return out


def why_reserved_not_measured(measurement: dict, simulated: bool) -> str:
    """Why a run's measurement has no max_memory_reserved, in words."""
    ranks = measurement.get("ranks") or []
    if any("max_memory_allocated" in r for r in ranks):
        return f"reserved: {NOT_MEASURED} (the run did not report torch.cuda.max_memory_reserved())"
    if simulated:
        return f"reserved: {NOT_MEASURED} (the simulated run did not replay its allocations through the allocator model)"
    return f"reserved: {NOT_MEASURED} (CPU ranks have no caching allocator)"


def measured_memory_notes(measurement: dict) -> dict[int, list[str]]:
    """rank -> what that rank's memory measurement could not see (its record's ``memory.notes``)."""
    out: dict[int, list[str]] = {}
    for r in measurement.get("ranks") or []:
        notes = ((r.get("memory") or {}).get("notes") or []) if isinstance(r, dict) else []
        if "rank" in r and notes:
            out[int(r["rank"])] = [str(n) for n in notes]
    return out


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def comparison_rows(engine_prediction, measurement: dict, *, simulated: bool = False,
                    calibrated_from: str | None = None) -> tuple[list[Row], list[str], Comparison]:
    """(rows, notes for the whole comparison, the Comparison itself).

    ``engine_prediction`` must be ``engine.predict`` (or a calibration's predict) of the config
    that ran — the same config, so the comparison is apples to apples.
    """
    cmp = compare(engine_prediction, measurement)
    rows: list[Row] = []
    predicted_reserved = _predicted_reserved(engine_prediction)
    unmeasured_reserve = why_reserved_not_measured(measurement, simulated)
    tracker_notes = measured_memory_notes(measurement)
    for rc in cmp.memory:
        blind = tracker_notes.get(rc.rank, [])  # what this rank's tracker could not see
        cells = [*rc.categories.items(), ("total", rc.peak)]
        if rc.allocated is not None:
            cuda = any("max_memory_allocated" in r for r in measurement.get("ranks") or [])
            cells.append((ALLOCATED if cuda else ALLOCATED_TENSORS, rc.allocated))
        if rc.reserved_cell is not None:  # torch.cuda.max_memory_reserved, or a simulation's modelled allocator
            cells.append((RESERVED, rc.reserved_cell))
        for name, cell in cells:
            notes = list(cell.notes)
            if cell.untracked:
                tracked = cell.relative_tracked
                notes.insert(0, f"{fmt_bytes(cell.untracked)} of the prediction is invisible to the tracker; "
                                f"counting only what it sees: "
                                + ("n/a" if tracked is None else f"{tracked * 100:+.1f} %"))
            if name not in EXACT_CATEGORIES:
                notes.extend(blind)
            rows.append(Row(str(rc.rank), name, cell.predicted, cell.measured, _pct(cell.relative),
                            "; ".join(notes), BYTES))
        if rc.reserved_cell is None and rc.reserved is not None:  # measured, but the prediction has none
            rows.append(Row(str(rc.rank), RESERVED, None, float(rc.reserved["measured"]), None,
                            "; ".join([f"measured: {rc.reserved['source']}; the prediction has no reserved",
                                       *blind]), BYTES))
        elif rc.reserved is None and rc.rank in predicted_reserved:
            rows.append(Row(str(rc.rank), RESERVED, predicted_reserved[rc.rank], NOT_MEASURED, None,
                            "; ".join([unmeasured_reserve, *blind]), BYTES))
    if cmp.makespan is not None:
        rows.append(Row("all", "pipeline makespan", cmp.makespan.predicted, cmp.makespan.measured,
                        _pct(cmp.makespan.relative), "; ".join(cmp.makespan.notes), SECONDS))
    if cmp.bubble is not None:
        rows.append(Row("all", "bubble", cmp.bubble.predicted, cmp.bubble.measured, cmp.bubble.error * 100,
                        "; ".join(cmp.bubble.notes), SHARE))
    if cmp.timeline:
        same = cmp.orders_identical
        rows.append(Row("all", "action order identical?", "plan", "yes" if same else "NO", None,
                        "measured order of F/B/I/W actions against the schedule's plan, every rank", TEXT))
        for kind, cell in cmp.action_kinds().items():  # the error per action kind the timeline's lanes show
            rows.append(Row("all", f"{kind} action (mean)", cell.predicted, cell.measured, _pct(cell.relative),
                            "; ".join(cell.notes), SECONDS))
        for t in cmp.timeline:
            j = t.to_json()
            se, ee = j["start_error_s"], j["end_error_s"]
            order = "same order" if t.order_identical else f"differs at action {t.first_difference}"
            note = (f"{t.matched} actions matched; start error mean {fmt_seconds(se['mean_abs'] or 0)}, "
                    f"max {fmt_seconds(se['max_abs'] or 0)}; end error mean {fmt_seconds(ee['mean_abs'] or 0)}, "
                    f"max {fmt_seconds(ee['max_abs'] or 0)}")
            rows.append(Row(str(t.rank), f"actions (pp rank {t.pp_rank})", fmt_seconds(t.predicted_busy_s) + " busy",
                            order, None, note, TEXT))
    step_notes = list(cmp.step.notes)
    if calibrated_from:
        step_notes.insert(0, f"time calibrated from {calibrated_from}")
    if simulated:
        rows.append(Row("all", "step time", cmp.step.predicted, None, None,
                        "simulated on fake tensors: no arithmetic is done, so there is no step time to compare",
                        SECONDS))
    else:
        rows.append(Row("all", "step time", cmp.step.predicted, cmp.step.measured, _pct(cmp.step.relative),
                        "; ".join(step_notes), SECONDS))
    notes = list(cmp.notes)
    by_note: dict[str, list[int]] = {}
    for rank, lines in sorted(tracker_notes.items()):
        for line in lines:
            by_note.setdefault(line, []).append(rank)
    for line, ranks in by_note.items():
        notes.append(f"measured memory ({_ranks_text(ranks)}): {line}")
    if simulated:
        ranks = ", ".join(rc.rank.__str__() for rc in cmp.memory)
        notes.insert(0, f"simulated (fake process group + fake tensors): ranks {ranks} through the real backend "
                        "code path; memory only")
        for extra in ("warnings", "not_covered"):
            for line in measurement.get(extra) or []:
                notes.append(("tracker: " if extra == "warnings" else "not covered: ") + str(line))
    return rows, notes, cmp


def explain_text(rank_memory, category: str) -> str:
    """The engine's terms behind one number, one line each."""
    explain = getattr(rank_memory, "explain", None)
    if explain is None:
        return ""
    lines = []
    for term in explain(category):
        label = getattr(term, "label", None) or (term.get("label") if isinstance(term, dict) else str(term))
        nbytes = getattr(term, "bytes", None)
        if nbytes is None and isinstance(term, dict):
            nbytes = term.get("bytes")
        formula = getattr(term, "formula", None)
        if formula is None and isinstance(term, dict):
            formula = term.get("formula")
        line = f"• {label}"
        if nbytes is not None:
            line += f": {fmt_bytes(nbytes)}"
        if formula:
            line += f"  = {formula}"
        lines.append(line)
    return "\n".join(lines)
