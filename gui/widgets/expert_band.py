"""The routed experts' part of each rank's parameters, drawn inside the memory chart's params segment.

The engine splits a mixture of experts' parameters into the rest and the routed experts (a params
term of kind ``expert_parameters``; same total). The chart draws that part as a darker, hatched
band at the bottom of each bar's params segment (params is the bottom category), names it in the
legend and explains it on hover. Gradients and optimizer states are not split by the engine, so
they are not split here either.
"""

from __future__ import annotations

from gui.comparison import explain_text, fmt_bytes
from gui.widgets.hatched import HatchedBoxesItem

EXPERT_FILL = "#1F3A5F"  # the params blue, darker
EXPERT_HATCH = "#8FB3DA"
EXPERT_KIND = "expert_parameters"
LEGEND_HTML = f'&nbsp;&nbsp;<span style="color:{EXPERT_FILL}">▨</span> routed experts (their part of params)'


def expert_bytes(rank_memory) -> int:
    """Bytes of the routed experts' parameters on one rank (0 for a dense model)."""
    explain = getattr(rank_memory, "explain", None)
    if explain is None:
        return 0
    return int(sum(t.bytes for t in explain("params") if getattr(t, "kind", None) == EXPERT_KIND))


class ExpertBandItem(HatchedBoxesItem):
    """The bands [x0, x1] × [0, y1] in view coordinates."""

    def __init__(self):
        super().__init__(EXPERT_FILL, EXPERT_HATCH, EXPERT_FILL, 1.0)

    def set_bands(self, x0, x1, y1) -> None:
        self.set_boxes(x0, x1, [0.0] * len(y1), y1)

    def clear(self) -> None:
        self.set_bands((), (), ())

    def band_count(self) -> int:
        return self.box_count()


def hover_text(chart, x: float, y: float) -> str:
    """The tooltip over a bar's expert band (``y`` in the chart's unit), or "" elsewhere."""
    i = int(round(x))
    bands = getattr(chart, "expert_bytes", [])
    if not 0 <= i < len(bands) or bands[i] <= 0 or not 0 <= y < bands[i] / chart.unit:
        return ""
    g = chart.groups[i]
    cfg = chart.state.config
    ep = cfg.parallel.ep
    experts = cfg.model.experts
    where = (f"{experts // ep} of {experts} experts per MoE block (ep = {ep})" if ep > 1
             else f"all {experts} experts of each MoE block" + (f", split by tp = {cfg.parallel.tp}"
                                                                 if cfg.parallel.tp > 1 else ""))
    head = (f"{g.label} · params · routed experts: {fmt_bytes(bands[i])} of {fmt_bytes(g.values['params'])} "
            f"params predicted ({where})")
    return head + "\n" + explain_text(g.sample, "params")
