"""The routed experts' part of each rank's parameters, drawn inside the memory chart's params segment.

The engine splits a mixture of experts' parameters into the rest and the routed experts (a params
term of kind ``expert_parameters``; same total). The chart draws that part as a darker, hatched
band at the bottom of each bar's params segment (params is the bottom category), names it in the
legend and explains it on hover. Gradients and optimizer states are not split by the engine, so
they are not split here either.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPen

from gui.comparison import fmt_bytes

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


class ExpertBandItem(pg.GraphicsObject):
    """Boxes [x0, x1] × [0, y1] in view coordinates, filled and hatched in device pixels (the hatching
    looks the same at every scale of the chart)."""

    def __init__(self):
        super().__init__()
        self._rects: list[QRectF] = []
        self._key: tuple = ()
        self._bounds = QRectF()
        self._fill = QBrush(QColor(EXPERT_FILL))
        self._hatch = QBrush(QColor(EXPERT_HATCH), Qt.BrushStyle.BDiagPattern)
        self._pen = QPen(QColor(EXPERT_FILL), 1.0)
        self._pen.setCosmetic(True)
        self.paint_count = 0

    def set_bands(self, x0, x1, y1) -> None:
        key = (tuple(map(float, x0)), tuple(map(float, x1)), tuple(map(float, y1)))
        if key == self._key:
            return
        self._key = key
        self.prepareGeometryChange()
        self._rects = [QRectF(a, 0.0, b - a, h) for a, b, h in zip(*key) if h > 0]
        bounds = QRectF()
        for r in self._rects:
            bounds = bounds.united(r)
        self._bounds = bounds
        self.update()

    def clear(self) -> None:
        self.set_bands((), (), ())

    def band_count(self) -> int:
        return len(self._rects)

    def boundingRect(self) -> QRectF:
        return self._bounds

    def paint(self, p, *args) -> None:
        self.paint_count += 1
        if not self._rects:
            return
        t = p.transform()
        p.save()
        p.resetTransform()
        p.setPen(self._pen)
        for r in self._rects:
            d = t.mapRect(r).normalized()
            p.fillRect(d, self._fill)
            p.fillRect(d, self._hatch)
            p.drawRect(d)
        p.restore()


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
    from gui.widgets.memory_chart import explain_text

    return head + "\n" + explain_text(g.sample, "params")
