"""Boxes in view coordinates, filled and hatched in device pixels (the hatching looks the same at
every scale of a chart): the memory chart's reserved caps and its routed-experts band."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPen


class HatchedBoxesItem(pg.GraphicsObject):
    """Boxes [x0, x1] × [y0, y1], each filled, hatched and outlined (``outline``: the whole rectangle;
    a subclass may draw less of it)."""

    def __init__(self, fill: str, hatch: str, line: str, line_width: float):
        super().__init__()
        self._rects: list[QRectF] = []
        self._key: tuple = ()
        self._bounds = QRectF()
        self._fill = QBrush(QColor(fill))
        self._hatch = QBrush(QColor(hatch), Qt.BrushStyle.BDiagPattern)
        self._pen = QPen(QColor(line), line_width)
        self._pen.setCosmetic(True)
        self.paint_count = 0

    def set_boxes(self, x0, x1, y0, y1) -> None:
        key = tuple(tuple(map(float, v)) for v in (x0, x1, y0, y1))
        if key == self._key:
            return
        self._key = key
        self.prepareGeometryChange()
        self._rects = [QRectF(a, c, b - a, d - c) for a, b, c, d in zip(*key) if d > c]
        bounds = QRectF()
        for r in self._rects:
            bounds = bounds.united(r)
        self._bounds = bounds
        self.update()

    def box_count(self) -> int:
        return len(self._rects)

    def boundingRect(self) -> QRectF:
        return self._bounds

    def outline(self, p, d: QRectF) -> None:
        p.drawRect(d)

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
            self.outline(p, d)
        p.restore()
