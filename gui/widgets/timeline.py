"""The pipeline timeline: one row per pipeline rank, F/B/I/W boxes coloured by kind.

All boxes are painted by one :class:`BoxesItem` (a pyqtgraph GraphicsObject) that keeps one
native QRectF array per colour and paints each with a single ``QPainter.drawRects`` call;
outlines are dropped when boxes are narrower than a few pixels and microbatch numbers are
drawn only on boxes wide enough to hold them. Per-box graphics items do not scale to the
hundred thousand boxes of a 64-rank × 512-microbatch schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics, QImage, QPen
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.pipeline.schedules import ACTION_KINDS
from gui.colors import IDLE_COLOR, KIND_COLORS
from gui.comparison import fmt_seconds
from gui.widgets.axis import lean_plot
from gui.widgets.barrier import LayoutBarrier

KINDS = ("F", "B", "I", "W")
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grads)", "W": "backward (weight grads)"}

OUTLINE_MIN_PX = 4.0  # narrower boxes are painted without an outline
OUTLINE_RGBA = (40, 40, 40, 170)  # a dark, translucent edge: the box's own colour shows through
LABEL_MIN_PX = 18.0  # narrower boxes get no microbatch number
MAX_LABELS = 2500
RASTER_MIN_BOXES = 4096  # with this many boxes or more ...
RASTER_MAX_PX = 3.0  # ... narrower than this (median, device pixels) they are painted as pixel rows

try:  # native QRectF arrays (pyqtgraph >= 0.13): no Python QRectF per box
    from pyqtgraph.Qt.internals import PrimitiveArray
except ImportError:  # pragma: no cover - older pyqtgraph
    PrimitiveArray = None


@dataclass
class Actions:
    """Flat arrays, one entry per action."""

    row: np.ndarray  # int: pipeline rank
    kind: np.ndarray  # int codes into KINDS (F, B, I, W)
    stage: np.ndarray
    microbatch: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray

    def __len__(self) -> int:
        return int(self.row.size)

    @classmethod
    def empty(cls) -> Actions:
        z = np.zeros(0)
        return cls(z.astype(int), z.astype(int), z.astype(int), z.astype(int), z, z)


_CODE = {k: i for i, k in enumerate(KINDS)}


@lru_cache(maxsize=256)
def _brush(name: str, alpha: int) -> QBrush:
    c = QColor(name)
    c.setAlpha(alpha)
    return QBrush(c)


@lru_cache(maxsize=256)
def _coloured_pen(name: str) -> QPen:
    """A box outlined in its own colour, 2 px (the measured memory's bars)."""
    pen = QPen(QColor(name), 2)
    pen.setCosmetic(True)
    return pen


@lru_cache(maxsize=256)
def _outline_pen(fill: str, alpha: int) -> QPen:
    """The outline of boxes filled with the colour ``fill`` at ``alpha``: :data:`OUTLINE_RGBA` as it shows
    over an opaque fill, painted opaque. Qt's raster engine strokes a translucent cosmetic pen several times
    slower than an opaque one (``benchmarks/bench_gui.py``: the memory chart's 56 bars 0.68 → 0.10 ms a
    paint); over a translucent fill the translucent pen is kept (what shows through it is not known here).
    One pen per colour, made once."""
    r, g, b, a = OUTLINE_RGBA
    if alpha == 255:
        k = a / 255
        f = QColor(fill)
        color = QColor(*(round(k * o + (1 - k) * c) for o, c in zip((r, g, b), (f.red(), f.green(), f.blue()))))
    else:
        color = QColor(r, g, b, a)
    pen = QPen(color)
    pen.setCosmetic(True)
    pen.setWidthF(0.8)
    return pen


def _median(values: np.ndarray) -> float:
    """The median of a non-empty array (0 for an empty one) without np.median's overhead: the upper
    middle for an even count, which is what the paint thresholds need."""
    if values.size == 0:
        return 0.0
    k = values.size // 2
    return float(np.partition(values, k)[k])


def _kind_codes(tl) -> np.ndarray:
    """Kind codes in KINDS order, from the engine's codes (``kind_code``) or letters (``kind``)."""
    code = getattr(tl, "kind_code", None)
    if code is not None:
        remap = np.array([_CODE.get(str(k)[:1], 0) for k in ACTION_KINDS])
        return remap[np.asarray(code, dtype=int)]
    return np.array([_CODE.get(str(k)[:1], 0) for k in np.asarray(tl.kind).tolist()], dtype=int)


def kind_errors(predicted: Actions, measured: Actions) -> list[tuple[str, float]]:
    """Per action kind present in both: (kind, the predicted mean duration's error against the measured mean),
    in KINDS order — how far the clock is off per kind of action, on one scale."""
    out = []
    for code, kind in enumerate(KINDS):
        p, m = predicted.kind == code, measured.kind == code
        if p.any() and m.any():
            mean_m = float((measured.end_s[m] - measured.start_s[m]).mean())
            if mean_m > 0:
                mean_p = float((predicted.end_s[p] - predicted.start_s[p]).mean())
                out.append((kind, (mean_p - mean_m) / mean_m))
    return out


def actions_from_timeline(tl) -> Actions:
    """The engine's Timeline as flat arrays (rows are pipeline ranks)."""
    row = np.asarray(tl.rank).astype(int)
    return Actions(row=row, kind=_kind_codes(tl), stage=np.asarray(tl.stage).astype(int),
                   microbatch=np.asarray(tl.microbatch).astype(int),
                   start_s=np.asarray(tl.start_s, dtype=float), end_s=np.asarray(tl.end_s, dtype=float))


def actions_from_measurement(measurement: dict, dp: int, tp: int, cp: int = 1) -> Actions:
    """The measured pipeline of one replica (dp = cp = tp = 0) as flat arrays, time from 0.

    measurement.json: ``pipeline.per_rank = [{rank, actions: [[kind, stage, mb, start_s, end_s], ...]}]``.
    """
    per_rank = (measurement or {}).get("pipeline", {}).get("per_rank", [])
    rows, kinds, stages, mbs, starts, ends = [], [], [], [], [], []
    for entry in per_rank:
        rank = int(entry.get("rank", 0))
        if (rank // (tp * cp)) % dp != 0 or (rank // tp) % cp != 0 or rank % tp != 0:
            continue  # another replica of the same pipeline rank (rank order [pp, dp, cp, tp])
        pp_index = rank // (dp * cp * tp)
        for a in entry.get("actions", []):
            kind, stage, mb, s, e = a[:5]
            rows.append(pp_index)
            kinds.append(_CODE.get(str(kind)[:1], 0))
            stages.append(int(stage))
            mbs.append(int(mb))
            starts.append(float(s))
            ends.append(float(e))
    if not rows:
        return Actions.empty()
    start = np.asarray(starts)
    t0 = start.min()
    return Actions(np.asarray(rows), np.asarray(kinds, dtype=int), np.asarray(stages), np.asarray(mbs),
                   start - t0, np.asarray(ends) - t0)


class BoxesItem(pg.GraphicsObject):
    """Every box of a timeline, one drawRects call per colour; boxes narrower than a few pixels, when
    there are thousands of them, are rasterised to one row of pixels per lane instead (numpy), which
    costs the same whatever the box count."""

    def __init__(self, alpha: int = 255, outline: bool = False):
        super().__init__()
        self.alpha = alpha
        self.coloured_outline = outline  # outline each box in its own colour (measured memory)
        # per colour: [brush, native rects (built when first drawn), median width, index, pen or None,
        # (x0, x1, y0, y1), outline pen]; the background rows first, index None
        self._layers: list[list] = []
        self._bounds = QRectF()
        self._x0 = self._x1 = self._y0 = self._y1 = np.zeros(0)
        self._labels = np.zeros(0, dtype=int)
        self._font = QFont()
        self._font.setPointSizeF(7.5)
        self.paint_count = 0
        self.show_labels = True
        self._row_h = 0.0
        self._median_w = 0.0
        self.labels_drawn = 0
        self.outlined_layers = 0
        self.rasterised = False  # the last paint drew pixel rows, not rectangles
        self._lanes = None  # (distinct y0 + i·y1, each box's index into them), background first
        self._lane_key = None  # the layers' sizes and tops and bottoms those lanes were computed of

    def set_boxes(self, x0, x1, y0, y1, colors: list[str], color_index, labels=None, *, background=None) -> None:
        """Boxes [x0, x1] × [y0, y1]; ``color_index[i]`` picks ``colors``; optional row backgrounds."""
        self.prepareGeometryChange()
        self._x0, self._x1 = np.asarray(x0, float), np.asarray(x1, float)
        self._y0, self._y1 = np.asarray(y0, float), np.asarray(y1, float)
        self._labels = np.asarray(labels) if labels is not None else None
        color_index = np.asarray(color_index, int)
        self._row_h = _median(self._y1 - self._y0)
        self._median_w = _median(self._x1 - self._x0)
        self._layers = []
        if background is not None:
            bx0, bx1, by0, by1 = (np.asarray(a, float) for a in background)
            self._layers.append([_brush(IDLE_COLOR, 255), None, 0.0, None, None, (bx0, bx1, by0, by1), None])
        # the boxes grouped by colour (views of one reordering, not a copy per colour)
        order = np.argsort(color_index, kind="stable")
        ends = np.cumsum(np.bincount(color_index, minlength=len(colors))[:len(colors)])
        x0s, x1s, y0s, y1s = self._x0[order], self._x1[order], self._y0[order], self._y1[order]
        for ci, name in enumerate(colors):
            a, b = (int(ends[ci - 1]) if ci else 0), int(ends[ci])
            if a == b:
                continue
            pen = _coloured_pen(name) if self.coloured_outline else None
            box = (x0s[a:b], x1s[a:b], y0s[a:b], y1s[a:b])
            self._layers.append([_brush(name, self.alpha), None, _median(box[1] - box[0]), order[a:b], pen, box,
                                 _outline_pen(name, self.alpha)])
        lanes = (tuple(len(layer[5][0]) for layer in self._layers),  # every layer's tops and bottoms, in order
                 np.concatenate([layer[5][2] for layer in self._layers] or [np.zeros(0)]),
                 np.concatenate([layer[5][3] for layer in self._layers] or [np.zeros(0)]))
        before = self._lane_key
        if before is None or before[0] != lanes[0] or not (np.array_equal(before[1], lanes[1])
                                                           and np.array_equal(before[2], lanes[2])):
            self._lanes = None  # the pixel rows' data are computed again when first painted
        self._lane_key = lanes
        if self._x0.size or background is not None:
            xs = [self._x0, self._x1] + ([bx0, bx1] if background is not None else [])
            ys = [self._y0, self._y1] + ([by0, by1] if background is not None else [])
            xs = np.concatenate(xs)
            ys = np.concatenate(ys)
            self._bounds = QRectF(xs.min(), ys.min(), max(xs.max() - xs.min(), 1e-12), max(ys.max() - ys.min(), 1e-12))
        else:
            self._bounds = QRectF()
        self.update()

    @staticmethod
    def _rects(x0, x1, y0, y1):
        n = x0.size
        if PrimitiveArray is not None:
            arr = PrimitiveArray(QRectF, 4)
            arr.resize(n)
            mem = arr.ndarray()
            mem[:, 0] = x0
            mem[:, 1] = y0
            mem[:, 2] = x1 - x0
            mem[:, 3] = y1 - y0
            return arr
        return [QRectF(a, c, b - a, d - c) for a, b, c, d in zip(x0, x1, y0, y1)]

    def boundingRect(self) -> QRectF:
        return self._bounds

    def box_count(self) -> int:
        return int(self._x0.size)

    def paint(self, p, *args) -> None:
        self.paint_count += 1
        t = p.transform()
        sx = abs(t.m11()) or 1.0
        row_px = abs(t.m22()) * self._row_h
        self.outlined_layers = 0
        self.rasterised = (self._x0.size >= RASTER_MIN_BOXES and self._median_w * sx < RASTER_MAX_PX
                           and self._paint_raster(p, t))
        if self.rasterised:
            return
        for layer in self._layers:
            brush, rects, median_w, idx, pen, box = layer[:6]
            if pen is not None:
                p.setPen(pen)
            elif idx is not None and median_w * sx >= OUTLINE_MIN_PX and row_px >= OUTLINE_MIN_PX:
                p.setPen(layer[6])
                self.outlined_layers += 1
            else:
                p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(brush)
            if rects is None:
                rects = layer[1] = self._rects(*box)
            if PrimitiveArray is not None:
                p.drawRects(*rects.drawargs())
            else:
                p.drawRects(rects)
        if self.show_labels:
            self._paint_labels(p, sx, row_px)

    def _paint_raster(self, p, t) -> bool:
        """Paint every layer as pixel rows: one row of device pixels per lane (boxes sharing their top
        and bottom pixel), each pixel the colour of the last layer whose box covers its centre (as Qt fills
        rectangles), stretched to the lane's height. Boxes never vanish: each covers at least one pixel. False when the
        transform is not a plain scale and shift (the rectangles are drawn then)."""
        if t.m12() or t.m21() or not self._layers:
            return False
        sx, dx, sy, dy = t.m11(), t.dx(), t.m22(), t.dy()
        vb = self.getViewBox()
        left, right = self._bounds.left(), self._bounds.right()
        if vb is not None:
            vr = vb.viewRect()
            left, right = max(left, vr.left()), min(right, vr.right())
        d0, d1 = sorted((left * sx + dx, right * sx + dx))
        x_dev = int(np.floor(d0))
        width = int(np.ceil(d1)) - x_dev
        if width <= 0:
            return True
        if width > 16384:
            return False
        boxes = [layer[5] for layer in self._layers]
        if self._lanes is None:  # the distinct (y0, y1) of every box, kept while the rows stay as they are
            y = self._lane_key[1] + 1j * self._lane_key[2]
            self._lanes = np.unique(y, return_inverse=True)
        distinct, box_lane = self._lanes
        ya, yb = distinct.real * sy + dy, distinct.imag * sy + dy
        top = np.rint(np.minimum(ya, yb)).astype(np.int64)
        height = np.maximum(np.rint(np.maximum(ya, yb)).astype(np.int64) - top, 1)
        # lanes that fall on the same device rows are one row of pixels
        lanes, merged = np.unique((top + (1 << 30)) << 20 | np.minimum(height, (1 << 20) - 1), return_inverse=True)
        lane_of = merged[box_lane]
        n_px = lanes.size * width
        image = np.zeros(n_px, dtype=np.uint32)  # transparent
        at = 0
        for layer, (x0, x1, _, _) in zip(self._layers, boxes):
            lane = lane_of[at:at + x0.size]
            at += x0.size
            a, b = x0 * sx + dx - x_dev, x1 * sx + dx - x_dev
            if sx < 0:
                a, b = b, a
            c0 = np.ceil(a - 0.5).astype(np.int64)  # the pixels whose centres the box covers, as Qt fills
            c1 = np.maximum(np.ceil(b - 0.5).astype(np.int64), c0 + 1)
            keep = (c1 > 0) & (c0 < width)
            if not keep.any():
                continue
            base = lane[keep] * width
            start = base + np.clip(c0[keep], 0, width)
            stop = base + np.clip(c1[keep], 0, width)
            cover = np.cumsum(np.bincount(start, minlength=n_px + 1)[:n_px]
                              - np.bincount(stop, minlength=n_px + 1)[:n_px])
            image[cover > 0] = layer[0].color().rgba()
        rows = image.reshape(lanes.size, width)
        qimage = QImage(rows.data, width, lanes.size, 4 * width, QImage.Format.Format_ARGB32)
        tops = (lanes >> 20) - (1 << 30)
        heights = lanes & ((1 << 20) - 1)
        p.save()
        p.resetTransform()
        for k in range(lanes.size):
            p.drawImage(QRectF(x_dev, float(tops[k]), width, float(heights[k])), qimage, QRectF(0, k, width, 1))
        p.restore()
        return True

    def _paint_labels(self, p, sx: float, row_px: float) -> None:
        self.labels_drawn = 0
        if self._x0.size == 0 or row_px < 10 or self._labels is None:
            return
        wide = (self._x1 - self._x0) * sx >= LABEL_MIN_PX
        vb = self.getViewBox()
        if vb is not None:
            vr = vb.viewRect()
            wide &= (self._x1 > vr.left()) & (self._x0 < vr.right()) & (self._y1 > vr.top()) & (self._y0 < vr.bottom())
        idx = np.flatnonzero(wide)[:MAX_LABELS]
        if idx.size == 0:
            return
        t = p.transform()
        p.save()
        p.resetTransform()
        p.setFont(self._font)
        p.setPen(QColor("white"))
        for i in idx:
            a = t.map(QPointF(self._x0[i], self._y0[i]))
            b = t.map(QPointF(self._x1[i], self._y1[i]))
            p.drawText(QRectF(a, b).normalized(), Qt.AlignmentFlag.AlignCenter, str(int(self._labels[i])))
        p.restore()
        self.labels_drawn = int(idx.size)


class TimelineView(QWidget):
    """The predicted pipeline (and, after a run, the measured one as a lane under each row)."""

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.predicted = Actions.empty()
        self.measured = Actions.empty()
        self.makespan_s = 0.0
        self.bubble_fraction: float | None = None
        self._ticks: list = []
        self._rows = -1
        self.scale_s = 1.0  # seconds per x unit: x runs 0..1 over the step
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.header = QLabel("Pipeline")
        self.header.setObjectName("chartTitle")
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.header.setWordWrap(True)
        head = QHBoxLayout()
        head.addWidget(LayoutBarrier(self.header), 1)
        lay.addLayout(head)
        lay.addWidget(self._legend())
        self.plot = lean_plot(steady_axes=("left",))  # the time axis moves with nearly every prediction
        pi = self.plot.getPlotItem()
        pi.getViewBox().invertY(True)
        pi.setLabel("bottom", "time", units="s")
        pi.getAxis("left").setStyle(tickLength=0)
        pi.getViewBox().setMouseEnabled(x=True, y=True)
        self.boxes = BoxesItem()
        self.plot.addItem(self.boxes)
        self._tick_rows = 0
        self._tick_px = QFontMetrics(self.plot.font()).height()
        pi.getViewBox().sigResized.connect(self._fit_ticks)
        pi.getViewBox().sigYRangeChanged.connect(self._fit_ticks)
        self.note = QLabel()
        self.note.setObjectName("note")
        self.note.setWordWrap(True)
        self.note.hide()
        # what the cursor is over: kind, stage, microbatch, start, end, duration, predicted and measured
        self.hover = QLabel(" ")
        self.hover.setObjectName("hover")
        self.hover.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.hover.setWordWrap(True)  # predicted and measured side by side take two lines when narrow
        self._lanes: tuple = ((0.1, 0.9), None)
        lay.addWidget(self.plot, 1)
        lay.addWidget(LayoutBarrier(self.hover))
        lay.addWidget(self.note)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
        state.predictionReady.connect(self.on_prediction)
        state.measurementShown.connect(self.on_run_finished)
        state.baselineChanged.connect(self.on_baseline)

    @staticmethod
    def _legend() -> QLabel:
        parts = [f'<span style="color:{KIND_COLORS[k]}">■</span>&nbsp;{k} {KIND_NAMES[k]}' for k in KINDS]
        parts.append('<span style="color:#BBBBBB">■</span>&nbsp;idle')
        lab = QLabel(" &nbsp;".join(parts))  # a swatch and its name never part
        lab.setObjectName("legend")
        return lab

    def on_prediction(self, pred) -> None:
        if pred.prediction is None:
            self.predicted = Actions.empty()
            self.makespan_s, self.bubble_fraction = 0.0, None
            self.note.setText(pred.error)
            self.note.show()
        else:
            tl = pred.prediction.pipeline
            self.predicted = actions_from_timeline(tl)
            self.makespan_s = float(getattr(tl, "makespan_s", self.predicted.end_s.max() if len(self.predicted) else 0))
            self.bubble_fraction = getattr(tl, "bubble_fraction", None)
            self.note.hide()
        self.calibrated_from = pred.calibrated_from
        # a measurement belongs to the config it ran; drop it when the prediction moves on
        if self.measured_config is not None and self.measured_config != pred.config:
            self.measured = Actions.empty()
            self.measured_config = None
        self.redraw()

    measured_config = None
    calibrated_from: str | None = None
    baseline_makespan_s: float | None = None  # the pinned baseline's pipeline step, for the header

    def on_baseline(self, pred) -> None:
        tl = None if pred is None or pred.prediction is None else pred.prediction.pipeline
        self.baseline_makespan_s = None if tl is None else float(tl.makespan_s)
        self._update_header(len(self.measured) > 0)

    def on_run_finished(self, record) -> None:
        if record.measurement is None:
            return
        par = record.config.parallel
        self.measured = actions_from_measurement(record.measurement, par.dp, par.tp, par.cp)
        self.measured_config = record.config
        self.redraw()

    def redraw(self) -> None:
        pp = self.state.config.parallel.pp
        rows = max(pp, int(self.predicted.row.max()) + 1 if len(self.predicted) else 0)
        has_measured = len(self.measured) > 0
        if has_measured:
            pred_lane, meas_lane = (0.06, 0.50), (0.54, 0.94)
        else:
            pred_lane, meas_lane = (0.1, 0.9), None
        self._lanes = (pred_lane, meas_lane)
        span = max(self.makespan_s, float(self.measured.end_s.max()) if has_measured else 0.0)
        # x is drawn in units of the span and the axis scaled back to seconds: a new makespan then
        # changes the axis only, not the view (a view change costs pyqtgraph a second paint)
        scale = span if span > 0 else 1.0
        xs0, xs1, ys0, ys1, ci, labels = [], [], [], [], [], []
        for acts, lane, offset in ((self.predicted, pred_lane, 0), (self.measured, meas_lane, len(KINDS))):
            if lane is None or len(acts) == 0:
                continue
            xs0.append(acts.start_s / scale)
            xs1.append(acts.end_s / scale)
            ys0.append(acts.row + lane[0])
            ys1.append(acts.row + lane[1])
            ci.append(acts.kind + offset)
            labels.append(acts.microbatch)
        colors = [KIND_COLORS[k] for k in KINDS] + [_lighter(KIND_COLORS[k]) for k in KINDS]
        if xs0:
            r = np.arange(rows, dtype=float)
            bg = [np.zeros(rows), np.full(rows, (self.makespan_s or span) / scale), r + pred_lane[0], r + pred_lane[1]]
            if has_measured:
                mspan = float(self.measured.end_s.max()) / scale
                bg = [np.concatenate([bg[0], np.zeros(rows)]), np.concatenate([bg[1], np.full(rows, mspan)]),
                      np.concatenate([bg[2], r + meas_lane[0]]), np.concatenate([bg[3], r + meas_lane[1]])]
            self.boxes.set_boxes(np.concatenate(xs0), np.concatenate(xs1), np.concatenate(ys0), np.concatenate(ys1),
                                 colors, np.concatenate(ci), np.concatenate(labels), background=bg)
        else:
            self.boxes.set_boxes([], [], [], [], colors, [], [])
        self._tick_rows = rows
        vb = self.plot.getPlotItem().getViewBox()
        if scale != self.scale_s:
            self.scale_s = scale
            self.plot.getPlotItem().getAxis("bottom").setScale(scale)
        if rows != self._rows:
            self._rows = rows
            vb.setLimits(xMin=-0.05, xMax=1.05, yMin=-0.5, yMax=rows + 0.5, minXRange=1e-4, maxXRange=1.1)
            vb.setRange(xRange=(0, 1), yRange=(0, rows), padding=0.01)
        self._fit_ticks()
        self._update_header(has_measured)

    def _fit_ticks(self, *_args) -> None:
        """Row labels on the left axis, as many as fit the plot's height without overlapping:
        every ``step``-th rank, and the "measured" lane's own label when the lanes are tall enough."""
        rows = self._tick_rows
        if rows <= 0:
            return
        pred_lane, meas_lane = self._lanes
        vb = self.plot.getPlotItem().getViewBox()
        y0, y1 = vb.viewRange()[1]
        row_px = vb.height() / max(1e-9, abs(y1 - y0))
        label_px = self._tick_px + 2
        step = max(1, rows // 16)
        while step < rows and step * row_px < label_px:
            step *= 2
        both = meas_lane is not None and (meas_lane[0] + meas_lane[1] - pred_lane[0] - pred_lane[1]) / 2 * row_px \
            >= label_px
        ticks = []
        for r in range(0, rows, step):
            ticks.append((r + (pred_lane[0] + pred_lane[1]) / 2,
                          f"rank {r}" + (" predicted" if both else "")))
            if both:
                ticks.append((r + (meas_lane[0] + meas_lane[1]) / 2, "measured"))
        if ticks != self._ticks:  # re-setting ticks makes the axis lay itself out again
            self._ticks = ticks
            self.plot.getPlotItem().getAxis("left").setTicks([ticks, []])

    # ------------------------------------------------------------------ hover

    def action_at(self, x: float, y: float) -> tuple[str, int] | None:
        """The action drawn at view coordinates (x in step fractions, y in rows): (lane, index), lane
        "predicted" or "measured", index into that lane's Actions; None over idle time or between lanes."""
        row = int(np.floor(y))
        frac = y - row
        t = x * self.scale_s
        for name, acts, lane in (("predicted", self.predicted, self._lanes[0]),
                                 ("measured", self.measured, self._lanes[1])):
            if lane is None or not len(acts) or not lane[0] <= frac <= lane[1]:
                continue
            hit = np.flatnonzero((acts.row == row) & (acts.start_s <= t) & (acts.end_s >= t))
            if hit.size:
                return name, int(hit[0])
        return None

    def describe_action(self, lane: str, i: int) -> str:
        """Kind, stage, microbatch, start, end and duration of one action, with its counterpart in the
        other lane (same rank, kind, stage and microbatch) when a measurement is shown."""
        acts, other = (self.predicted, self.measured) if lane == "predicted" else (self.measured, self.predicted)
        kind = KINDS[int(acts.kind[i])]
        row, stage, mb = int(acts.row[i]), int(acts.stage[i]), int(acts.microbatch[i])

        def times(a: Actions, j: int) -> str:
            s0, s1 = float(a.start_s[j]), float(a.end_s[j])
            return f"{fmt_seconds(s0)} → {fmt_seconds(s1)} ({fmt_seconds(s1 - s0)})"

        text = (f"rank {row} · {kind} {KIND_NAMES[kind]} · stage {stage} · microbatch {mb} · "
                f"{lane} {times(acts, i)}")
        if len(other):
            twin = np.flatnonzero((other.row == row) & (other.kind == acts.kind[i]) & (other.stage == stage)
                                  & (other.microbatch == mb))
            other_name = "measured" if lane == "predicted" else "predicted"
            text += f" · {other_name} {times(other, int(twin[0]))}" if twin.size else f" · not in the {other_name}"
        return text

    def _on_mouse_moved(self, scene_pos) -> None:
        vb = self.plot.getPlotItem().getViewBox()
        if not vb.sceneBoundingRect().contains(scene_pos):
            self.hover.setText(" ")
            return
        p = vb.mapSceneToView(scene_pos)
        hit = self.action_at(p.x(), p.y())
        self.hover.setText(self.describe_action(*hit) if hit else " ")

    def _update_header(self, has_measured: bool) -> None:
        if not len(self.predicted):
            self.header.setText("Pipeline")
            return
        # the makespan: the pipeline's own span; Metrics' "Step time" adds the exposed DP communication and
        # the optimizer step to it
        text = f"Pipeline · {len(self.predicted):,} actions · makespan {fmt_seconds(self.makespan_s)}"
        if self.bubble_fraction is not None:
            conv = self.state.config.conventions.bubble
            text += f" · bubble {self.bubble_fraction * 100:.1f}% ({conv})"
        if self.calibrated_from:
            text += f" · timed with the calibration of {Path(self.calibrated_from).name}"
        if has_measured:
            text += f" · measured makespan {fmt_seconds(float(self.measured.end_s.max()))}"
            errors = kind_errors(self.predicted, self.measured)
            if errors:
                text += " (predicted vs measured: " + ", ".join(f"{k} {e * 100:+.0f}%" for k, e in errors) + ")"
        if self.baseline_makespan_s is not None:
            text += f" · baseline makespan {fmt_seconds(self.baseline_makespan_s)}"
        self.header.setText(text)


def _lighter(name: str) -> str:
    c = QColor(name).lighter(145)
    return c.name()


