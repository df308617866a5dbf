"""A shareable report: one self-contained HTML file — no script, no network, the charts as inline SVG —
with the layout, the metrics, the memory per rank against the card, the pipeline timeline, the planner's top layouts
(if asked) and, with a run, predicted vs measured with the errors.

    shardscope report CONFIG [--run RUN_DIR] [--plan [--top K]] -o report.html
    File → Export report… in the window (the window's config, its last run, its last plan)

Qt-free, so the command line needs no display; the colours are the window's (gui/colors.py).
"""

from __future__ import annotations

import datetime as _dt
import html
from typing import Any

from engine.config import Config
from engine.names import MEMORY_CATEGORIES
from gui.colors import CATEGORY_COLORS, IDLE_COLOR, KIND_COLORS, OVER_COLOR, RESERVED_FILL, RESERVED_LINE

GIB = float(2**30)
MAX_BARS = 48  # ranks drawn in the memory chart; beyond, identical neighbours are merged
MAX_LANES = 64  # pipeline ranks drawn in the timeline
MAX_BOXES = 20000  # actions drawn (a 405B interleaved schedule has tens of thousands: the first ones are drawn)
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse} td,th{padding:3px 10px;text-align:right;border-bottom:1px solid #eee}
th{background:#f6f6f6} td:first-child,th:first-child{text-align:left}
pre{background:#f8f8f8;padding:10px;overflow-x:auto;font-size:12px} .muted{color:#777} .bad{color:#c00}
.legend span{display:inline-block;margin-right:14px} .legend i{display:inline-block;width:11px;height:11px;
margin-right:4px;vertical-align:-1px}
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _legend(colors: dict[str, str], names: dict[str, str] | None = None) -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{_e((names or {}).get(k, k))}</span>'
                    for k, c in colors.items())
    return f'<div class="legend">{items}</div>'


def _bars(per_rank: list[dict]) -> list[tuple[str, dict]]:
    """(label, row) per bar: every rank, or with more than MAX_BARS, runs of identical ranks merged."""
    if len(per_rank) <= MAX_BARS:
        return [(f"r{r['rank']}", r) for r in per_rank]
    merged: list[tuple[list[int], dict]] = []
    for r in per_rank:
        key = tuple(r[c] for c in MEMORY_CATEGORIES) + (r["reserved"],)
        if merged and tuple(merged[-1][1][c] for c in MEMORY_CATEGORIES) + (merged[-1][1]["reserved"],) == key:
            merged[-1][0].append(r["rank"])
        else:
            merged.append(([r["rank"]], r))
    merged = merged[:MAX_BARS]
    return [(f"r{ranks[0]}" + (f"–{ranks[-1]}" if len(ranks) > 1 else ""), row) for ranks, row in merged]


def memory_svg(memory: dict) -> str:
    """Stacked bars per rank (categories at their peak), the reserved cap above them, the card's capacity line."""
    bars = _bars(memory["per_rank"])
    cap = memory["capacity_bytes"] / GIB
    top = max([cap] + [r["reserved"] / GIB for _, r in bars] + [r["total"] / GIB for _, r in bars]) * 1.08 or 1.0
    w, h, left, bottom = 1100, 340, 56, 44
    bw = (w - left - 10) / max(len(bars), 1)
    y = lambda gib: 10 + (h - bottom - 10) * (1 - gib / top)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
             f'aria-label="memory per rank">']
    for i in range(6):
        v = top * i / 5
        parts.append(f'<line x1="{left}" x2="{w - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{v:.1f}</text>')
    parts.append(f'<text x="12" y="{h / 2}" font-size="11" transform="rotate(-90 12 {h / 2})" '
                 'text-anchor="middle">GiB</text>')
    for i, (label, r) in enumerate(bars):
        x, base = left + i * bw + bw * 0.12, 0.0
        width = bw * 0.76
        if r["reserved"] > r["total"]:
            parts.append(f'<rect x="{x:.1f}" y="{y(r["reserved"] / GIB):.1f}" width="{width:.1f}" '
                         f'height="{y(r["total"] / GIB) - y(r["reserved"] / GIB):.1f}" fill="{RESERVED_FILL}" '
                         f'stroke="{RESERVED_LINE}" stroke-width="0.6"><title>{_e(label)} reserved '
                         f'{r["reserved"] / GIB:.2f} GiB</title></rect>')
        for c in MEMORY_CATEGORIES:
            v = r[c] / GIB
            if v <= 0:
                continue
            parts.append(f'<rect x="{x:.1f}" y="{y(base + v):.1f}" width="{width:.1f}" '
                         f'height="{y(base) - y(base + v):.1f}" fill="{CATEGORY_COLORS[c]}">'
                         f'<title>{_e(label)} {c} {v:.2f} GiB</title></rect>')
            base += v
        if len(bars) <= 24 or i % max(1, len(bars) // 24) == 0:
            parts.append(f'<text x="{x + width / 2:.1f}" y="{h - bottom + 16}" font-size="10" '
                         f'text-anchor="middle">{_e(label)}</text>')
    parts.append(f'<line x1="{left}" x2="{w - 10}" y1="{y(cap):.1f}" y2="{y(cap):.1f}" stroke="{OVER_COLOR}" '
                 f'stroke-dasharray="6 4"/><text x="{w - 12}" y="{y(cap) - 4:.1f}" font-size="11" '
                 f'text-anchor="end" fill="{OVER_COLOR}">capacity {cap:.1f} GiB</text></svg>')
    return "".join(parts)


def timeline_svg(pipeline: dict) -> str:
    """One lane per pipeline rank, each action a box from its start to its end (microbatch number inside)."""
    lanes = pipeline["per_rank"][:MAX_LANES]
    end = max((a[4] for lane in lanes for a in lane["actions"]), default=0.0) or 1.0
    w, lane_h, left = 1100, 22, 56
    h = 30 + lane_h * len(lanes)
    x = lambda t: left + (w - left - 10) * t / end  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
             f'aria-label="pipeline timeline">']
    drawn = 0
    for i, lane in enumerate(lanes):
        top = 4 + i * lane_h
        parts.append(f'<rect x="{left}" y="{top}" width="{w - left - 10}" height="{lane_h - 4}" fill="{IDLE_COLOR}"/>'
                     f'<text x="{left - 6}" y="{top + 13}" font-size="11" text-anchor="end">pp{lane["pp_rank"]}</text>')
        for kind, stage, mb, start, stop in lane["actions"]:
            if drawn >= MAX_BOXES:
                break
            drawn += 1
            bw = x(stop) - x(start)
            parts.append(f'<rect x="{x(start):.2f}" y="{top}" width="{max(bw, 0.3):.2f}" height="{lane_h - 4}" '
                         f'fill="{KIND_COLORS.get(kind, "#888")}" stroke="#333" stroke-width="{0.4 if bw > 4 else 0}">'
                         f'<title>{kind} stage {stage} microbatch {mb}: {start * 1e3:.2f}–{stop * 1e3:.2f} ms'
                         f'</title></rect>')
            if bw > 16:
                parts.append(f'<text x="{x(start) + bw / 2:.1f}" y="{top + 13}" font-size="10" fill="#fff" '
                             f'text-anchor="middle">{mb}</text>')
    for i in range(6):
        t = end * i / 5
        anchor = "start" if i == 0 else ("end" if i == 5 else "middle")
        parts.append(f'<text x="{x(t):.1f}" y="{h - 8}" font-size="10" text-anchor="{anchor}">{t * 1e3:.1f} ms</text>')
    parts.append("</svg>")
    note = "" if drawn < MAX_BOXES else f'<p class="muted">the first {MAX_BOXES:,} actions are drawn</p>'
    more = (f'<p class="muted">{len(pipeline["per_rank"]) - len(lanes)} more pipeline ranks not drawn</p>'
            if len(pipeline["per_rank"]) > len(lanes) else "")
    return "".join(parts) + note + more


def _metrics(cfg: Config, pred: dict) -> str:
    step, mem, pipe = pred["step"], pred["memory"], pred["pipeline"]
    peak = max(mem["per_rank"], key=lambda r: r["reserved"])
    rows = [("step time", f"{step['seconds'] * 1e3:,.2f} ms"), ("tokens / s (all GPUs)", f"{step['tokens_per_s']:,.0f}"),
            ("tokens / s per GPU", f"{step['tokens_per_s'] / cfg.cluster.gpus:,.1f}"), ("MFU", f"{step['mfu']:.1%}"),
            ("HFU", f"{step['hfu']:.1%}"), ("pipeline bubble", f"{pipe['bubble']:.1%} ({pipe['bubble_convention']})"),
            ("peak memory (worst rank, reserved)", f"{peak['reserved'] / GIB:,.2f} GiB on rank {peak['rank']} of "
                                                   f"{mem['capacity_bytes'] / GIB:,.1f} GiB"),
            ("fits", "yes" if all(r["fits"] for r in mem["per_rank"]) else '<span class="bad">no</span>')]
    rows += [(f"step: {k}", f"{v * 1e3:,.2f} ms") for k, v in step["breakdown"].items()]
    body = "".join(f"<tr><td>{_e(k)}</td><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def build_report(cfg: Config, *, comparison_text: str | None = None, plan_text: str | None = None,
                 title: str | None = None, source: str | None = None) -> str:
    """The report's HTML. ``comparison_text``: a run's predicted vs measured table (gui.text.comparison_table);
    ``plan_text``: the planner's table (gui.text.plan_table)."""
    import tomli_w

    from engine.interop import compact_dict
    from engine.predict import predict
    from gui.predicted import describe_config

    pred = predict(cfg)
    data = pred.to_json()
    name = title or f"ShardScope report — {cfg.model.preset or 'custom model'} on {cfg.cluster.gpus} × " \
                    f"{cfg.cluster.gpu.name}"
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    out = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(name)}</title>'
           f"<style>{_CSS}</style></head><body>",
           f"<h1>{_e(name)}</h1>",
           f'<p class="muted">{_e(describe_config(cfg))} · made {stamp}{" from " + _e(source) if source else ""}</p>',
           "<h2>Metrics (predicted)</h2>", _metrics(cfg, data),
           "<h2>Memory per rank (predicted, at each rank's peak)</h2>", memory_svg(data["memory"]),
           _legend({**CATEGORY_COLORS, "reserved": RESERVED_FILL}),
           f"<h2>Pipeline timeline (predicted, {_e(data['pipeline']['schedule'])}, "
           f"{data['pipeline']['microbatches']} microbatches)</h2>", timeline_svg(data["pipeline"]),
           _legend(KIND_COLORS, {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"})]
    if pred.predict_only:
        out.append("<h2>Predict only</h2><ul>" + "".join(f"<li>{_e(r)}</li>" for r in pred.predict_only) + "</ul>")
    if comparison_text:
        out.append(f"<h2>Predicted vs measured</h2><pre>{_e(comparison_text)}</pre>")
    if plan_text:
        out.append(f"<h2>The planner's top layouts</h2><pre>{_e(plan_text)}</pre>")
    out.append(f"<h2>The layout (ShardScope config)</h2><pre>{_e(tomli_w.dumps(compact_dict(cfg)))}</pre>")
    out.append('<p class="muted">Made by ShardScope: predictions by its analytic engine; conventions: '
               + "; ".join(f"{_e(k)}: {_e(v)}" for k, v in pred.conventions.items()) + "</p></body></html>\n")
    return "".join(out)
