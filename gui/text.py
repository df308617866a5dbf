"""The command line's text: a prediction's table, a comparison's and a plan's.

Kept beside the command line (``gui.cli``), not in the engine, which returns numbers and types; the
window draws the same numbers its own way. Plain strings: no Qt, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.memory import GIB
from engine.model.params import param_counts
from engine.names import MEMORY_CATEGORIES
from engine.time.ops import clock_description, op_table

if TYPE_CHECKING:
    from engine.compare.measured import Comparison, RankComparison
    from engine.plan.results import PlanResult
    from engine.predict import Prediction


# --------------------------------------------------------------------------- a prediction


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def prediction_table(pred: Prediction, explain: bool = False, over_step: bool = False) -> str:
    """A readable report: memory per distinct rank group (GiB), pipeline and step time. ``over_step``: each
    category at its own worst moment of the step (``RankMemory.category_peaks``) instead of at the rank's peak."""
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
        values = r.category_peaks() if over_step else {c: getattr(r, c) for c in cats}
        rows.append([group.label, ",".join(map(str, r.stages))]
                    + [_gib(values[c]) for c in cats]
                    + [_gib(r.total), _gib(r.allocated), _gib(r.reserved), "yes" if r.fits else "NO"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    cpu = pred.config.cluster.gpu.name == "cpu"
    lines = [f"memory per rank ({unit}), capacity {_gib(mem.capacity_bytes)} {unit}"
             f" ({pred.config.cluster.gpu.name}):"]
    what = ("each category at its own worst moment of the step (the moments need not coincide: the categories can "
            "sum past the total); total, allocated and reserved at the rank's peak" if over_step
            else "categories at each rank's peak moment (--over-step: each at its own worst moment)")
    lines.append(f"  {what}; allocated = its tensors (max_memory_allocated), "
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
    lines.append(f"  timed by the {clock_description(pred.config)}")
    comm = pred.comm.per_pp_rank[st.critical_pp_rank]
    per_dim = {d: comm.bytes_sent(d) for d in ("dp", "cp", "tp", "pp", "ep") if comm.bytes_sent(d)}
    if per_dim:
        lines.append("  communication sent per step by rank "
                     f"{comm.rank}: " + ", ".join(f"{d} {b / 2**30:.3f} GiB" for d, b in per_dim.items()))
    if explain and pred.config.conventions.clock == "ops":
        lines.append("  the ops one microbatch runs on one rank (per block; the head's and the embedding's once):")
        for where, phase, name, gflop, mb, kernels, us in op_table(pred.config):
            lines.append(f"      {where:<9} {phase}  {name:<40} {gflop:10.3f} GFLOP {mb:10.2f} MB {kernels:4d} kernels "
                         f"{us:10.1f} µs")
    why = pred.predict_only
    if why:
        lines.append("")
        lines.append("predict only: ShardScope's backend cannot run this layout, so no run can check it:")
        lines.extend(f"  - {w}" for w in why)
    return "\n".join(lines)


# --------------------------------------------------------------------------- a comparison


def _fmt_bytes(n: float) -> str:
    a = abs(n)
    if a >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if a >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    if a >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:.0f} B"


def _fmt_rel(r: float | None) -> str:
    if r is None:
        return "n/a"
    return f"{r * 100:+.1f} %"


def comparison_table(cmp: Comparison) -> str:
    """A readable table: per rank (identical ranks merged) and category, then pipeline and step."""
    lines = ["memory per rank: predicted vs measured (error = predicted − measured, relative to measured)"]
    groups: list[list[RankComparison]] = []
    for r in cmp.memory:
        key = (r.stage, tuple((c.predicted, c.measured) for c in r.categories.values()))
        for g in groups:
            if (g[0].stage, tuple((c.predicted, c.measured) for c in g[0].categories.values())) == key:
                g.append(r)
                break
        else:
            groups.append([r])
    head = ("ranks", "category", "predicted", "measured", "error", "relative")
    table = []
    all_notes: list[str] = []
    for g in groups:
        ranks = [r.rank for r in g]
        label = (f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
                 else ",".join(map(str, ranks)))
        r = g[0]
        extra = [(name, cell) for name, cell in (("allocated", r.allocated), ("reserved", r.reserved_cell)) if cell]
        for c, cell in list(r.categories.items()) + [("peak", r.peak)] + extra:
            marks = ""
            for n in cell.notes:
                if n not in all_notes:
                    all_notes.append(n)
                marks += f"[{all_notes.index(n) + 1}]"
            rel = _fmt_rel(cell.relative)
            if cell.untracked:
                rel += f" ({_fmt_rel(cell.relative_tracked)} tracked)"
            table.append((label, c, _fmt_bytes(cell.predicted), _fmt_bytes(cell.measured),
                          _fmt_bytes(cell.error), rel + (" " + marks if marks else "")))
            label = ""
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(head)]
    lines.append("  " + "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for row in table:
        lines.append("  " + "  ".join(v.ljust(w) if i < 2 else v.rjust(w)
                                      for i, (v, w) in enumerate(zip(row, widths))).rstrip())
    if cmp.bubble is not None:
        lines.append("")
        lines.append(f"pipeline: makespan {cmp.makespan.predicted * 1e3:.2f} ms predicted, "
                     f"{cmp.makespan.measured * 1e3:.2f} ms measured ({_fmt_rel(cmp.makespan.relative)}); "
                     f"bubble {cmp.bubble.predicted * 100:.1f} % predicted, {cmp.bubble.measured * 100:.1f} % "
                     f"measured ({cmp.bubble.error * 100:+.1f} points)")
        lines.append(f"  action order identical to the plan on every rank: {'yes' if cmp.orders_identical else 'NO'}")
        kinds = cmp.action_kinds()
        if kinds:
            lines.append("  one action, mean over the matched actions: " + "; ".join(
                f"{k} {c.predicted * 1e3:.2f} ms predicted, {c.measured * 1e3:.2f} ms measured ({_fmt_rel(c.relative)})"
                for k, c in kinds.items()))
        for t in cmp.timeline:
            j = t.to_json()
            order = "same order" if t.order_identical else f"order differs at action {t.first_difference}"
            se, ee = j["start_error_s"], j["end_error_s"]
            lines.append(f"  rank {t.rank} (pp {t.pp_rank}): {order}, {t.matched} actions; start error mean "
                         f"{(se['mean_abs'] or 0) * 1e3:.2f} ms max {(se['max_abs'] or 0) * 1e3:.2f} ms, end error mean "
                         f"{(ee['mean_abs'] or 0) * 1e3:.2f} ms max {(ee['max_abs'] or 0) * 1e3:.2f} ms; busy "
                         f"{t.predicted_busy_s * 1e3:.2f} ms predicted, {t.measured_busy_s * 1e3:.2f} ms measured")
    lines.append("")
    marks = ""
    for n in cmp.step.notes:
        if n not in all_notes:
            all_notes.append(n)
        marks += f"[{all_notes.index(n) + 1}]"
    lines.append(f"step: {cmp.step.predicted * 1e3:.2f} ms predicted, {cmp.step.measured * 1e3:.2f} ms measured "
                 f"({_fmt_rel(cmp.step.relative)}) {marks}".rstrip())
    for n in cmp.notes:
        lines.append(f"note: {n}")
    if all_notes:
        lines.append("")
        lines.extend(f"[{i + 1}] {n}" for i, n in enumerate(all_notes))
    return "\n".join(lines)


# --------------------------------------------------------------------------- a plan


def plan_table(result: PlanResult) -> str:
    lines = [f"{result.model} on {result.gpus} × {result.gpu} ({result.gpus_per_node} per node); "
             f"global batch {result.global_batch} × {result.tokens_per_step // result.global_batch} tokens"]
    c = result.counts
    lines.append(f"{c.enumerated:,} valid layouts: {c.memory_bound_rejected:,} cannot fit (memory bound), "
                 f"{c.pruned_by_time_bound:,} cannot reach the top {len(result.entries) or '-'} (time bound), "
                 f"{c.fully_evaluated:,} fully evaluated ({c.did_not_fit:,} did not fit); "
                 f"{result.elapsed_s:.2f} s")
    if c.predict_only_skipped:
        lines.append(f"--runnable: {c.predict_only_skipped:,} layouts left out that ShardScope's backend cannot run")
    if not result.entries:
        lines.append("no layout the backend can run fits: leave out --runnable to see what the engine predicts"
                     if c.predict_only_skipped else
                     "no layout fits: try more GPUs, a GPU with more memory, or a smaller --global-batch")
        return "\n".join(lines)
    hdr = f"{'#':>2}  {'layout':<84} {'tokens/s':>11} {'step s':>8} {'MFU':>6} {'peak GiB':>9} {'free GiB':>9}"
    lines += ["", hdr, "-" * len(hdr)]
    reasons: dict[str, list[int]] = {}  # why a layout is predict only -> the positions it marks
    for e in result.entries:
        why_not = e.predict_only
        lines.append(f"{e.position:>2}  {e.label():<84} {e.tokens_per_s:>11,.0f} {e.seconds:>8.3f} "
                     f"{100 * e.mfu:>5.1f}% {e.peak_bytes / GIB:>9.1f} {e.headroom_bytes / GIB:>9.1f}"
                     + ("  predict only" if why_not else ""))
        for w in e.why:
            lines.append(f"      {w}")
        for w in why_not:
            reasons.setdefault(w, []).append(e.position)
    lines += [""] + [f"note: {n}" for n in result.notes]
    for w, at in reasons.items():
        lines.append(f"predict only ({', '.join(f'#{p}' for p in at)}): the backend cannot run it: {w} "
                     "(--runnable leaves such layouts out)")
    return "\n".join(lines)
