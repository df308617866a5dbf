"""An axis that lays out its ticks and labels with less Python per repaint than pyqtgraph's.

The memory chart's value axis and the timeline's time axis change their scale with every prediction,
so pyqtgraph regenerates their drawing on every repaint during a drag; its ``generateDrawSpecs`` builds
a ``Point`` per tick end, asks the painter for every label's bounding rectangle and the item for its own
bounding rectangle once per label. ``LeanAxis`` computes the same specifications (a test compares them
field by field) with plain ``QPointF``s, the item's rectangle once, and each label's measured rectangle
remembered per font and text (tick labels recur: "0", "20", "40" …). Orientations other than left and
bottom, grids and ``stopAxisAtTick`` take pyqtgraph's own path.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from math import ceil

import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPen, QPicture
from PySide6.QtWidgets import QGraphicsItem, QGraphicsView

#: what ``LeanAxis.picture`` holds once its specifications are generated (they are drawn directly)
_DIRECT = QPicture()
#: labels measured per (font, text); bounded so a long session cannot grow it without end
_MAX_MEASURED = 4096
_ALIGN_CENTER = Qt.AlignmentFlag.AlignCenter
_LEFT_FLAGS = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter | Qt.TextFlag.TextDontClip
_BOTTOM_FLAGS = Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop | Qt.TextFlag.TextDontClip


def _near(ordered: list[float], v: float, atol: float) -> bool:
    """Whether a value of the sorted ``ordered`` lies within ``atol`` of ``v`` (the nearest two decide)."""
    i = bisect_left(ordered, v)
    return (i < len(ordered) and abs(ordered[i] - v) <= atol) or (i > 0 and abs(ordered[i - 1] - v) <= atol)


class LeanAxis(pg.AxisItem):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._measured: dict[tuple[str, str], QRectF] = {}
        self._specs = None  # generateDrawSpecs' last answer (drawn by paint)
        # labelled and minor ticks, not pyqtgraph's third level between the minor ones: the timeline's
        # time axis had 62 ticks for 7 labels, each a pen and a line to draw on every new scale
        self.setStyle(maxTickLevel=1)

    def _updateLabel(self) -> None:  # noqa: N802 - pyqtgraph's name
        """pyqtgraph's, without laying out the axis title again when its text is what it was: a new scale
        (every prediction) re-set the same HTML ("time (s)", "GiB per rank"), ~0.1 ms a chart."""
        html = self.labelString()
        if html != getattr(self, "_label_html", None):
            self._label_html = html
            self.label.setHtml(html)
            self._adjustSize()
        self.picture = None
        self.update()

    def paint(self, p, opt, widget) -> None:
        """pyqtgraph's, the specifications drawn straight onto the painter: pyqtgraph records them into a
        QPicture and plays it back, and on a new scale (every prediction) the recording cost more than
        drawing them (the timeline's time axis 0.24 → 0.17 ms). pyqtgraph still says when to generate them
        again, by dropping its picture (``self.picture = None``)."""
        if not self._lean():
            if self.picture is _DIRECT:
                self.picture = None
            super().paint(p, opt, widget)
            return
        if self.picture is None:
            p.save()
            if self.style["tickFont"]:
                p.setFont(self.style["tickFont"])
            self._specs = self.generateDrawSpecs(p)
            p.restore()
            self.picture = _DIRECT
        if self.picture is _DIRECT:
            if self._specs is not None:
                p.save()
                self.drawPicture(p, *self._specs)
                p.restore()
        else:
            self.picture.play(p)

    def _lean(self) -> bool:
        return (self.orientation in ("left", "bottom") and self.grid is False
                and self.style["stopAxisAtTick"] == (False, False) and isinstance(self.style["tickAlpha"], (type(None), int)))

    def _text_rect(self, p, text: str) -> QRectF:
        key = (p.font().key(), text)
        rect = self._measured.get(key)
        if rect is None:
            if len(self._measured) >= _MAX_MEASURED:
                self._measured.clear()
            rect = p.boundingRect(QRectF(0, 0, 100, 100), _ALIGN_CENTER, text)
            rect.setHeight(rect.height() * 0.8)  # as pyqtgraph: the painter's rectangle is a bit too tall
            self._measured[key] = rect
        return QRectF(rect)

    def tickValues(self, minVal: float, maxVal: float, size: float):  # noqa: N803 - pyqtgraph's signature
        """pyqtgraph's tick values, its ``np.isclose`` over a handful of ticks written as the comparison it
        makes (``|a − b| ≤ atol``, rtol 0): numpy's per-call cost is most of this method's time."""
        if self.logMode:
            return super().tickValues(minVal, maxVal, size)
        min_v, max_v = sorted((minVal, maxVal))
        min_v *= self.scale
        max_v *= self.scale
        ticks = []
        seen: list[float] = []  # sorted
        for spacing, offset in self.tickSpacing(min_v, max_v, size):
            start = (ceil((min_v - offset) / spacing) * spacing) + offset
            num = int((max_v - start) / spacing) + 1
            atol = spacing / self.scale * 0.01
            values = [(k * spacing + start) / self.scale for k in range(num)]
            values = [v for v in values if not _near(seen, v, atol)]
            for v in values:
                insort(seen, v)
            ticks.append((spacing / self.scale, values))
        return ticks

    def generateDrawSpecs(self, p):  # noqa: C901 - pyqtgraph's algorithm, kept in its order
        if not self._lean():
            return super().generateDrawSpecs(p)
        if self.style["tickFont"] is not None:
            p.setFont(self.style["tickFont"])
        bounds = self.mapRectFromParent(self.geometry())
        left = self.orientation == "left"
        if left:
            span = (QPointF(bounds.right() - 1.0, bounds.top() - 1.0), QPointF(bounds.right() - 1.0, bounds.bottom() + 1.0))
            tick_stop, tick_dir, axis = bounds.right(), -1, 0
        else:
            span = (QPointF(bounds.left() - 1.0, bounds.top() + 1.0), QPointF(bounds.right() + 1.0, bounds.top() + 1.0))
            tick_stop, tick_dir, axis = bounds.top(), 1, 1
        tick_start = tick_stop  # no grid: the ticks start at the axis's edge
        points = [self.mapToDevice(pt) for pt in span]
        if None in points:
            return None
        d = points[1] - points[0]
        length_px = (d.x() ** 2 + d.y() ** 2) ** 0.5
        if length_px == 0:
            return None

        if self._tickLevels is None:
            tick_levels = self.tickValues(self.range[0], self.range[1], length_px)
            tick_strings = None
        else:
            tick_levels = [(None, [v for v, _ in level]) for level in self._tickLevels]
            tick_strings = [[s for _, s in level] for level in self._tickLevels]

        dif = self.range[1] - self.range[0]
        if dif == 0:
            x_scale, offset = 1, 0
        elif axis == 0:
            x_scale = -bounds.height() / dif
            offset = self.range[0] * x_scale - bounds.height()
        else:
            x_scale = bounds.width() / dif
            offset = self.range[0] * x_scale
        x_range = [x * x_scale - offset for x in self.range]
        x_min, x_max = min(x_range), max(x_range)

        positions: list[list[float | None]] = []
        tick_specs = []
        base_pen = self.tickPen()
        solid = base_pen.brush().style() == Qt.BrushStyle.SolidPattern
        for i, (_, ticks) in enumerate(tick_levels):
            level_pos: list[float | None] = []
            positions.append(level_pos)
            tick_length = self.style["tickLength"] / ((i * 0.5) + 1.0)
            alpha = self.style["tickAlpha"]
            if alpha is None:
                alpha = 255 / (i + 1)
            elif alpha > 255 or alpha < 0:
                raise ValueError("lineAlpha should be [0..255]")
            pen = base_pen
            if solid:
                pen = QPen(base_pen)
                color = QColor(pen.color())
                color.setAlpha(int(alpha))
                pen.setColor(color)
            end = tick_stop + tick_length * tick_dir
            for v in ticks:
                x = (v * x_scale) - offset
                if x < x_min or x > x_max:
                    level_pos.append(None)
                    continue
                level_pos.append(x)
                if axis == 0:
                    tick_specs.append((pen, QPointF(tick_start, x), QPointF(end, x)))
                else:
                    tick_specs.append((pen, QPointF(x, tick_start), QPointF(x, end)))
        axis_spec = (self.pen(), span[0], span[1])

        if not self.style["showValues"]:
            return axis_spec, tick_specs, []
        text_specs, last_text_size2 = self._text_specs(p, tick_levels, tick_strings, positions, length_px, tick_stop,
                                                       axis, left)
        self._updateMaxTextSize(last_text_size2)
        return axis_spec, tick_specs, text_specs

    def _text_specs(self, p, tick_levels, tick_strings, positions, length_px: float, tick_stop: float, axis: int,
                    left: bool) -> tuple[list, float]:
        """The labels' rectangles, flags and texts, level by level until the text fills the axis (pyqtgraph's
        ``textFillLimits``), and the last drawn level's text size across the axis."""
        text_offset = self.style["tickTextOffset"][axis]
        text_size2 = last_text_size2 = 0
        text_rects: list[QRectF] = []
        text_specs: list = []
        own = self.boundingRect()
        flags = _LEFT_FLAGS if left else _BOTTOM_FLAGS
        label_offset = max(0, self.style["tickLength"]) + text_offset
        for i in range(min(len(tick_levels), self.style["maxTextLevel"] + 1)):
            if tick_strings is None:
                spacing, values = tick_levels[i]
                strings = self.tickStrings(values, self.autoSIPrefixScale * self.scale, spacing)
            else:
                strings = list(tick_strings[i])
            if len(strings) == 0:
                continue
            for j in range(len(strings)):
                if positions[i][j] is None:
                    strings[j] = None
            rects = []
            for s in strings:
                if s is None:
                    rects.append(None)
                else:
                    rects.append(self._text_rect(p, s))
                    text_rects.append(rects[-1])
            if text_rects:
                if axis == 0:
                    text_size = sum(r.height() for r in text_rects)
                    text_size2 = max(r.width() for r in text_rects)
                else:
                    text_size = sum(r.width() for r in text_rects)
                    text_size2 = max(r.height() for r in text_rects)
            else:
                text_size = text_size2 = 0
            if i > 0:
                fill = float(text_size) / length_px
                if any(len(text_specs) >= n and fill >= limit for n, limit in self.style["textFillLimits"]):
                    break
            last_text_size2 = text_size2
            for j, s in enumerate(strings):
                if s is None:
                    continue
                x = positions[i][j]
                height, width = rects[j].height(), rects[j].width()
                if left:
                    rect = QRectF(tick_stop - label_offset - width, x - (height / 2), width, height)
                else:
                    rect = QRectF(x - width / 2.0, tick_stop + label_offset, width, height)
                if own & rect != rect:
                    continue
                text_specs.append((rect, flags, s))
        return text_specs, last_text_size2


def lean_plot(steady_axes: tuple[str, ...] = ("left", "bottom")) -> pg.PlotWidget:
    """A white plot with ``LeanAxis`` on the left and at the bottom, no menu, no auto-range button, that
    repaints its whole viewport on every change.

    The charts that take every prediction change nearly every item at once; Qt's default (pyqtgraph's
    too), the minimal update, clips the repaint to the union of the items' dirty rectangles, a region of
    many rectangles that every fill and stroke is then clipped to scanline by scanline: on the 8-rank
    timeline, 512 outlined boxes took 0.67 ms to draw under it and 0.23 ms clipped to one rectangle (the
    whole window's slider-to-repaint 8.5 → 7.3 ms). The ``steady_axes``, those whose scale most
    predictions leave where it was (ranks; memory below the card's capacity), are drawn once into a pixmap
    and blitted until pyqtgraph asks for a new drawing (``update()``: a new scale, ticks or size): 0.08 ms
    a repaint saved, 0.05 ms more when the scale did move (pixels identical, compared)."""
    plot = pg.PlotWidget(background="w", axisItems={"left": LeanAxis("left"), "bottom": LeanAxis("bottom")})
    plot.setViewportUpdateMode(QGraphicsView.ViewportUpdateMode.FullViewportUpdate)
    for name in steady_axes:
        plot.getPlotItem().getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
    plot.setMenuEnabled(False)
    plot.hideButtons()
    return plot
