"""The memory chart: per rank (or per group of identical ranks) a stacked bar by category.

Each bar is what the device holds, bottom to top: the allocated tensors by category (what
``torch.cuda.max_memory_allocated()`` reports), a hatched cap up to what the caching allocator
reserves (``max_memory_reserved()``: allocated plus its cached free blocks), and the untracked
overhead above it (the CUDA context and the collective library's buffers, outside the
allocator). The GPU's capacity is a dashed line; a rank whose reserved + overhead is over it
gets a red frame and an "over by …" label. Hovering a segment shows how the engine arrived at it (its ``explain()`` terms).
After a run, measured memory stands as an outlined bar beside each predicted one. A pinned
baseline stands as a thinner, lighter stack on the left of each group (the baseline's fullest
rank among the group's ranks), and the header says how the peak moved from the baseline's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QLineF, Qt
from PySide6.QtGui import QTransform
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QSizePolicy, QToolTip, QVBoxLayout, QWidget

from engine.names import MEMORY_CATEGORIES
from gui.colors import CATEGORY_COLORS, OVER_COLOR, RESERVED_FILL, RESERVED_LINE
from gui.comparison import explain_text, fmt_bytes
from gui.predicted import describe_config, memory_of
from gui.widgets.axis import lean_plot
from gui.widgets.barrier import LayoutBarrier
from gui.widgets.expert_band import LEGEND_HTML as EXPERT_LEGEND
from gui.widgets.expert_band import ExpertBandItem, expert_bytes
from gui.widgets.expert_band import hover_text as expert_hover_text
from gui.widgets.hatched import HatchedBoxesItem
from gui.widgets.timeline import BoxesItem

GIB = float(2**30)

BASELINE_COLORS = {  # each category's colour, halfway to white: the same hue, lighter, never white itself
    c: "#" + "".join(f"{round(int(v[i:i + 2], 16) * 0.55 + 255 * 0.45):02X}" for i in (1, 3, 5))
    for c, v in CATEGORY_COLORS.items()}
FULL_FT_COLOR = "#555"  # the dotted line: what the fullest rank would hold under full fine-tuning (LoRA)
TOP_MARGIN_PX = 8  # above the plot: half a tick label hangs over the top of the axis
MAX_OVER_LABELS = 16  # "over by …" labels are drawn when there are at most this many bars




def _compress(ranks: list[int]) -> str:
    """[0,1,2,3,8] -> '0-3, 8'."""
    out, start, prev = [], None, None
    for r in ranks:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


@dataclass
class RankGroup:
    """Ranks whose predicted memory is identical in every category."""

    ranks: list[int]
    values: dict[str, int]
    total: int
    fits: bool
    sample: object  # one RankMemory of the group, for explain()
    measured: dict[str, float] = field(default_factory=dict)
    allocated: int = 0  # tracked bytes at the peak (torch.cuda.max_memory_allocated())
    reserved: int = 0  # the caching allocator's reserve (torch.cuda.max_memory_reserved())
    device_bytes: int = 0  # reserved + the untracked overhead (CUDA context, collective buffers)

    @property
    def untracked(self) -> int:
        """The overhead outside the caching allocator: CUDA context and collective-library buffers."""
        return max(0, self.device_bytes - self.reserved)

    @property
    def label(self) -> str:
        return f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {_compress(self.ranks)}"


def group_ranks(report) -> list[RankGroup]:
    """Ranks with identical categories, allocated, reserved and device bytes, in rank order. The
    engine's groups of identical ranks (``MemoryReport.distinct_groups``) are read, not every rank:
    a window at 16,384 GPUs does not build 16,384 rank objects per slider move."""
    engine_groups = getattr(report, "distinct_groups", None)
    members = ([(g.first, g.ranks) for g in engine_groups()] if engine_groups is not None
               else [(rm, (rm.rank,)) for rm in report.per_rank])
    groups: dict[tuple, RankGroup] = {}
    for rm, ranks in members:
        values = {c: int(getattr(rm, c)) for c in MEMORY_CATEGORIES}
        total = int(getattr(rm, "total", sum(values.values())))
        allocated = int(getattr(rm, "allocated", total))
        reserved = int(getattr(rm, "reserved", allocated))
        device = int(getattr(rm, "device_bytes", reserved))
        key = (*values.values(), allocated, reserved, device)
        if key in groups:
            groups[key].ranks.extend(int(r) for r in ranks)
        else:
            fits = bool(getattr(rm, "fits", device <= report.capacity_bytes))
            groups[key] = RankGroup([int(r) for r in ranks], values, total, fits, rm, allocated=allocated,
                                    reserved=reserved, device_bytes=device)
    for g in groups.values():
        g.ranks.sort()
    return sorted(groups.values(), key=lambda g: g.ranks[0])


#: the segments of a bar, bottom to top: the categories but overhead (the tensors), the reserved cap
#: (reserved − allocated: the caching allocator's blocks beyond the live tensors), then overhead (the
#: CUDA context and collective buffers outside the allocator, and any overhead the tracker sees)
SEGMENTS = (*(c for c in MEMORY_CATEGORIES if c != "overhead"), "reserved", "overhead")
RESERVED_SEGMENT = len(SEGMENTS) - 2


def segment_bytes(groups: list[RankGroup]) -> np.ndarray:
    """groups × SEGMENTS, in bytes: what each bar is made of, bottom to top (they sum to max(total,
    reserved + untracked overhead))."""
    k = len(SEGMENTS) - 2
    out = np.zeros((len(groups), len(SEGMENTS)))
    if not groups:
        return out
    out[:, :k] = [[g.values[c] for c in SEGMENTS[:k]] for g in groups]
    allocated, reserved, untracked = np.array([(g.allocated, g.reserved, g.untracked) for g in groups], float).T
    tensors = out[:, :k].sum(axis=1)
    tracked_overhead = np.maximum(0.0, allocated - tensors)  # none in today's model
    out[:, k] = np.maximum(0.0, reserved - tensors - tracked_overhead)
    out[:, k + 1] = tracked_overhead + untracked
    return out


class ReservedCapsItem(HatchedBoxesItem):
    """The reserved caps: light boxes from allocated up to reserved, hatched, outlined by the reserved
    level and the cap's sides."""

    def __init__(self):
        super().__init__(RESERVED_FILL, RESERVED_LINE, RESERVED_LINE, 1.2)

    def set_caps(self, x0, x1, y0, y1) -> None:
        self.set_boxes(x0, x1, y0, y1)

    def outline(self, p, d) -> None:
        p.drawLines([QLineF(d.topLeft(), d.topRight()), QLineF(d.topLeft(), d.bottomLeft()),
                     QLineF(d.topRight(), d.bottomRight())])


class _Scale(NamedTuple):
    """One redraw's geometry: n bar groups at x, the predicted bars at xp and the measured at xm, their width,
    the bars' values, tops and totals, capacity, the full fine-tune line (all in the view's 0..1), the top of
    the scale in the chart's unit, and the groups that do not fit."""

    n: int
    x: np.ndarray
    xp: np.ndarray
    xm: np.ndarray
    width: float
    has_measured: bool
    has_base: bool
    values: np.ndarray
    top_of: np.ndarray
    totals: np.ndarray
    cap: float
    top: float
    full: float | None
    full_in_view: bool
    over: list[int]
    show_over: bool


class MemoryChart(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.groups: list[RankGroup] = []
        self.capacity_bytes = 0
        self.report = None
        self.measured_by_rank: dict[int, dict[str, float]] = {}
        self.measured_config = None
        self.measured_label = ""
        self.hover_text = ""
        self.full_scale = False
        self._ticks: list = []
        self.unit, self.unit_name = GIB, "GiB"
        self.y_scale = 1.0  # chart units (self.unit) per view unit: the view spans 0..1
        self._frames: tuple | None = None
        self._cap_text = ""
        self._view: tuple | None = None
        self.capacity_in_view = True
        self.full_finetune_peak: int | None = None  # LoRA: the fullest rank under full fine-tuning
        self.dataparallel = False  # legacy nn.DataParallel: rank r is GPU r, GPU 0 is the heavy one
        self.over_step = False  # each category at its own worst moment of the step (the toggle), not at the peak
        self.snapshot_groups: list[RankGroup] = []  # the groups at their peak moment (``groups`` is what is drawn)
        # the pinned baseline: per rank and category (bytes), arranged once when it is pinned
        self.baseline = None
        self.baseline_text = ""  # the baseline's config in words
        self._base_values: np.ndarray | None = None  # ranks × categories
        self._base_row: dict[int, int] = {}  # rank -> row of _base_values
        self.baseline_groups: list[tuple[int, np.ndarray] | None] = []  # per group: (baseline rank, values)
        self._base_span: tuple[float, float] = (0.0, 0.0)  # x offset of the baseline bar from its group, width
        self._base_key: tuple | None = None  # what the baseline boxes were last set from
        self._base_scale = 0.0
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        head = QHBoxLayout()
        self.header = QLabel("Memory per rank")
        self.header.setObjectName("chartTitle")
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.header.setWordWrap(True)  # a narrow chart gets the verdict on a second line, not cut off
        head.addWidget(LayoutBarrier(self.header), 1)
        # each category at its own worst moment of the step instead of at the rank's peak moment
        self.over_step_box = QCheckBox("over the step")
        self.over_step_box.setObjectName("overStep")
        self.over_step_box.setToolTip(
            "Off: every bar is the rank's peak moment, each category as it is then (a category can read 0 there "
            "that the step fills at another moment: ZeRO-3's gradients at a forward peak).\nOn: each category at its "
            "own worst moment of the step; those moments need not coincide, so a bar can stand above the rank's "
            "allocated peak. Allocated, reserved and fits stay the rank's peak's.")
        self.over_step_box.toggled.connect(self._set_over_step)
        head.addWidget(self.over_step_box)
        lay.addLayout(head)
        # a swatch and its name never part (a no-break space between them); the items break between them
        legend = " &nbsp;".join(f'<span style="color:{CATEGORY_COLORS.get(c, "#888")}">■</span>&nbsp;{c}'
                                     for c in MEMORY_CATEGORIES)
        self._categories_html = legend
        self._legend_html = legend + self._device_legend(cpu=False)
        self._cpu = False  # the shown prediction's GPU kind is the CPU (gloo ranks: no allocator, no context)
        self.legend = QLabel()
        self.legend.setWordWrap(True)  # a long run name wraps instead of widening the chart
        self._set_legend()
        self.legend.setObjectName("legend")
        lay.addWidget(self.legend)
        self.plot = lean_plot()
        pi = self.plot.getPlotItem()
        pi.getAxis("left").enableAutoSIPrefix(False)
        pi.getViewBox().setMouseEnabled(x=False, y=False)
        pi.layout.setContentsMargins(1, TOP_MARGIN_PX, 1, 1)  # the top tick's label is not cut in half
        lay.addWidget(self.plot, 1)
        self.note = QLabel()
        self.note.setObjectName("note")
        self.note.setWordWrap(True)
        self.note.hide()
        lay.addWidget(self.note)
        self._build_items(pi)
        self.plot.scene().sigMouseMoved.connect(self._hover)
        state.predictionReady.connect(self.on_prediction)
        state.measurementShown.connect(self.on_run_finished)
        state.baselineChanged.connect(self.on_baseline)

    # ------------------------------------------------------------------ data

    def on_prediction(self, pred) -> None:
        """``pred``: a ``gui.predicted.Predicted`` (the engine's Prediction and what the window adds)."""
        if pred.prediction is None:
            self.report, self.groups, self.snapshot_groups = None, [], []
            self.expert_band.clear()
            self.note.setText(pred.error)
            self.note.show()
        else:
            memory = pred.prediction.memory
            self.report = memory
            cpu = pred.config.cluster.gpu.name == "cpu"
            if cpu != self._cpu:  # the legend names what this device has (set when it changes, not per redraw)
                self._cpu = cpu
                self._legend_html = self._categories_html + self._device_legend(cpu)
                self._set_legend()
            self.capacity_bytes = int(memory.capacity_bytes)
            self.snapshot_groups = group_ranks(memory)
            self.groups = self._shown_groups()
            self.note.hide()
        self.full_finetune_peak = pred.full_finetune_peak_bytes
        self.dataparallel = getattr(pred.config.parallel, "dp_mode", "ddp") == "dataparallel"
        if self.measured_config is not None and self.measured_config != pred.config:
            self.measured_by_rank, self.measured_config, self.measured_label = {}, None, ""
            self._set_legend()
        self.redraw()

    def _shown_groups(self) -> list[RankGroup]:
        """The bars: the groups at their peak moment, or (``over_step``) with each category at its own worst
        moment of the step (``RankMemory.category_peaks``)."""
        if not self.over_step:
            return self.snapshot_groups
        out = []
        for g in self.snapshot_groups:
            peaks = g.sample.category_peaks() if hasattr(g.sample, "category_peaks") else g.values
            out.append(dataclasses.replace(g, values={c: int(peaks[c]) for c in MEMORY_CATEGORIES},
                                           total=int(sum(peaks[c] for c in MEMORY_CATEGORIES))))
        return out

    def _set_over_step(self, on: bool) -> None:
        self.over_step = bool(on)
        self.groups = self._shown_groups()
        self._frames = None
        self.redraw()

    @staticmethod
    def _device_legend(cpu: bool) -> str:
        """What stands above the categories: a GPU's allocator reserve and overhead; nothing on CPU ranks."""
        if cpu:
            return " &nbsp;· CPU ranks: no caching allocator, no CUDA context"
        return (f' &nbsp;<span style="color:{RESERVED_LINE}">▨</span>&nbsp;reserved, not allocated '
                "(caching allocator) · overhead on top: CUDA context, collective buffers")

    def _set_legend(self) -> None:
        """The legend names what the outlined bars are (set when a measurement comes or goes, not per redraw)."""
        outlined = self.measured_label or "measured"
        text = self._legend_html + f" &nbsp;· outlined bars: {outlined} · red frame: over capacity"
        if getattr(self, "_experts_shown", False):
            text = text.replace(self._legend_html, self._legend_html + EXPERT_LEGEND, 1)
        if self.baseline_text:
            text += f" · thin light bars: baseline ({self.baseline_text})"
        self.legend.setText(text)

    def on_baseline(self, pred) -> None:
        """A baseline was pinned (its prediction) or cleared (None): arrange its numbers once."""
        self.baseline = pred
        self._base_key = None  # boxes set again from this baseline
        mem = memory_of(pred)
        if pred is None or mem is None or not mem.per_rank:
            self._base_values, self._base_row = None, {}
        else:
            self._base_values = np.array([[getattr(r, c) for c in MEMORY_CATEGORIES] for r in mem.per_rank], float)
            self._base_row = {int(r.rank): i for i, r in enumerate(mem.per_rank)}
        self.baseline_text = "" if pred is None else describe_config(pred.config)
        self._set_legend()
        self.redraw()

    def _baseline_of_groups(self) -> list[tuple[int, np.ndarray] | None]:
        """Per group: the baseline's fullest rank among the group's ranks and its bytes per category
        (None when the baseline has none of those ranks)."""
        values, row = self._base_values, self._base_row
        totals = values.sum(axis=1)
        out: list[tuple[int, np.ndarray] | None] = []
        for g in self.groups:
            rows = [row[r] for r in g.ranks if r in row]
            if not rows:
                out.append(None)
                continue
            best = rows[int(np.argmax(totals[rows]))]
            out.append((g.ranks[rows.index(best)], values[best]))
        return out

    def on_run_finished(self, record) -> None:
        if record.measurement is None:
            return
        per_rank = record.measurement.get("memory", {}).get("per_rank", [])
        self.measured_by_rank = {int(e["rank"]): {c: float(e.get(c, 0) or 0) for c in (*MEMORY_CATEGORIES, "total")}
                                 for e in per_rank if "rank" in e}
        self.measured_config = record.config
        self.measured_label = f"{'simulated' if record.simulated else 'measured'} ({record.name})"
        self._set_legend()
        self.redraw()

    # ------------------------------------------------------------------ drawing

    def _build_items(self, pi) -> None:
        """Persistent items: re-adding pyqtgraph items on every slider move costs milliseconds."""
        self.stacks = BoxesItem()  # predicted segments, one drawRects per category colour
        self.reserved_caps = ReservedCapsItem()  # allocated up to reserved, per bar
        self.measured_stacks = BoxesItem(alpha=70, outline=True)
        # the baseline's segments, in bytes and scaled into the view by the item's transform: a move
        # that only rescales the chart then sets a transform, not the boxes again
        self.baseline_stacks = BoxesItem()
        self.baseline_stacks.setVisible(False)
        self.frames = pg.BarGraphItem(x=[], height=[], width=0.1, brush=None, pen=pg.mkPen(OVER_COLOR, width=3))
        self.capacity_line = pg.InfiniteLine(
            pos=0, angle=0, pen=pg.mkPen("#222", width=1.5, style=Qt.PenStyle.DashLine), label="",
            labelOpts={"position": 0.02, "color": "#222", "anchors": [(0, 1), (0, 1)],
                                     "fill": (255, 255, 255, 210)})  # readable over a bar that crosses it
        self.off_scale = pg.TextItem("", color="#222", anchor=(0, 0))
        self.full_line = pg.InfiniteLine(pos=0, angle=0,
                                         pen=pg.mkPen(FULL_FT_COLOR, width=1.5, style=Qt.PenStyle.DotLine))
        self.full_label = pg.TextItem("", color=FULL_FT_COLOR, anchor=(1, 1))
        self.full_line.setVisible(False)
        self.full_label.setVisible(False)
        self.over_labels = [pg.TextItem("", color=OVER_COLOR, anchor=(0.5, 1.0)) for _ in range(MAX_OVER_LABELS)]
        for item in (self.stacks, self.reserved_caps, self.measured_stacks, self.baseline_stacks, self.frames,
                     self.capacity_line, self.full_line, self.full_label, self.off_scale, *self.over_labels):
            pi.addItem(item)
        # sizes in pixels of the text drawn above bars and lines (TextItems ignore the view's scale)
        probe = pg.TextItem("over by\n888.88 GiB")
        self._over_size = (probe.boundingRect().width(), probe.boundingRect().height())
        probe.setText("capacity 88.88 GiB")
        self._line_label_h = probe.boundingRect().height()
        self._fitted: dict[int, tuple[str, float]] = {}  # id(item) -> (text, wrap width) last set
        self._view_px: tuple[float, float] = (0.0, 0.0)
        pi.getViewBox().sigResized.connect(self._view_resized)
        # the routed experts' part of params, over the bottom of each params segment
        self.expert_band = ExpertBandItem()
        self.expert_bytes: list[int] = []  # per group: the routed experts' parameter bytes
        self._experts_of: object = None  # the report expert_bytes was read from
        self._experts_shown = False
        pi.addItem(self.expert_band)

    def _fit_text(self, item, text: str, room_px: float) -> None:
        """Set ``item``'s text, wrapped to ``room_px`` when wider (only when text or room changed)."""
        room_px = max(60.0, float(int(room_px)))
        if self._fitted.get(id(item)) == (text, room_px):
            return
        self._fitted[id(item)] = (text, room_px)
        item.setTextWidth(-1)
        item.setText(text)
        if item.boundingRect().width() > room_px:
            item.setTextWidth(room_px)

    def _view_resized(self, vb) -> None:
        """A taller or narrower plot moves where the labels fit: lay the chart out again."""
        if self.groups and (vb.width(), vb.height()) != self._view_px:
            self.redraw()

    def redraw(self) -> None:
        if not self.groups:
            self.header.setText("Memory per rank")
            for item in (self.stacks, self.reserved_caps, self.measured_stacks, self.baseline_stacks, self.frames,
                         self.capacity_line, self.full_line, self.full_label, self.off_scale, *self.over_labels):
                item.setVisible(False)
            return
        sc = self._scale()
        self._draw_bars(sc)
        self._draw_lines(sc)
        self._set_header(sc.over)

    def _scale(self) -> _Scale:
        """Where the bars go and the view's scale: the unit, the top (capacity, the fullest bar, the baseline,
        the measured bars and every label inside the plot), the bars' values in the view's 0..1."""
        pi = self.plot.getPlotItem()
        n = len(self.groups)
        x = np.arange(n, dtype=float)
        has_measured = bool(self.measured_by_rank)
        self.baseline_groups = self._baseline_of_groups() if self._base_values is not None else []
        has_base = any(b is not None for b in self.baseline_groups)
        base_peak = max((float(b[1].sum()) for b in self.baseline_groups if b is not None), default=0.0)
        segments = segment_bytes(self.groups)
        peak_bytes = max(float(segments.sum(axis=1).max()), self._measured_max() * GIB, base_peak)
        unit = (GIB, "GiB") if peak_bytes >= 0.5 * GIB else (2.0**20, "MiB")
        if unit != (self.unit, self.unit_name):
            self.unit, self.unit_name = unit
            pi.setLabel("left", f"{self.unit_name} per rank")
        width = 0.38 if has_measured else 0.7
        xp = x - 0.2 if has_measured else x
        xm = x + 0.2
        if has_base:  # a thin baseline bar on the left of each group, the current (and measured) beside it
            self._base_span = (-0.3, 0.16) if has_measured else (-0.25, 0.2)
            width = 0.32 if has_measured else 0.45
            xp = x - 0.02 if has_measured else x + 0.1
            xm = x + 0.3
        values = segments / self.unit
        top_of = np.cumsum(values, axis=1)
        totals = top_of[:, -1]
        cap = self.capacity_bytes / self.unit
        peak = max(float(totals.max()), self._measured_max() * GIB / self.unit, base_peak / self.unit)
        self.capacity_in_view = peak >= 0.2 * cap or self.full_scale
        top = (max(cap, peak) if self.capacity_in_view else peak) * 1.15
        full = None if self.full_finetune_peak is None else self.full_finetune_peak / self.unit
        full_in_view = full is not None and full <= 3 * top  # LoRA beside full fine-tuning, when the scale allows
        if full_in_view:
            top = max(top, full * 1.08)
        over = [i for i, g in enumerate(self.groups) if not g.fits]
        vb = pi.getViewBox()
        view_w, view_h = max(1.0, vb.width()), max(1.0, vb.height())
        self._view_px = (vb.width(), vb.height())
        slot_px = view_w / (n + 0.2)  # the x range is -0.6 .. n - 0.4
        show_over = n <= MAX_OVER_LABELS and slot_px >= self._over_size[0] + 4
        # texts first: how tall they are decides how much room the view leaves above the bars
        above: list[tuple[float, float]] = []  # (value, pixels of text drawn above it)
        if over and show_over:
            above.append((float(totals[over].max()), self._over_size[1]))
        if self.capacity_in_view:
            above.append((cap, self._line_label_h))
        else:
            self._fit_text(self.off_scale, f"▲ {self.state.config.cluster.gpu.name} capacity "
                           f"{fmt_bytes(self.capacity_bytes)} is above this scale (the fullest rank uses "
                           f"{peak / cap * 100:.1f}% of it)", view_w * (n - 0.4 + 0.55) / (n + 0.2) - 6)
            above.append((peak, self.off_scale.boundingRect().height()))
        if full_in_view:
            fits_full = self.full_finetune_peak <= self.capacity_bytes
            self._fit_text(self.full_label, f"without LoRA (full fine-tune): {fmt_bytes(self.full_finetune_peak)} "
                           f"on the fullest rank — {'fits' if fits_full else 'does NOT fit'}",
                           view_w * (n - 0.45 + 0.6) / (n + 0.2) - 6)
            above.append((full, self.full_label.boundingRect().height()))
        for value, text_px in above:  # every label inside the plot, whatever its height in pixels
            top = max(top, value / max(0.4, 1.0 - (text_px + 4) / view_h))
        # The view always spans y = 0..1 and the left axis is scaled by `top`: a new peak then
        # changes the axis only, not the view (a view change costs pyqtgraph a second paint).
        if top != self.y_scale:
            self.y_scale = top
            pi.getAxis("left").setScale(top)
        values, top_of, totals, cap = values / top, top_of / top, totals / top, cap / top
        return _Scale(n, x, xp, xm, width, has_measured, has_base, values, top_of, totals, cap, top, full,
                      full_in_view, over, show_over)

    def _draw_bars(self, sc: _Scale) -> None:
        """The stacks by category with their reserved caps, the baseline's, the experts' band, the frames and
        labels of the ranks that do not fit, the measured bars."""
        n, x, xp, xm, width, values, top_of, totals, top, over = (
            sc.n, sc.x, sc.xp, sc.xm, sc.width, sc.values, sc.top_of, sc.totals, sc.top, sc.over)
        has_measured, has_base, show_over = sc.has_measured, sc.has_base, sc.show_over
        bottom_of = top_of - values
        drawn = [j for j in range(len(SEGMENTS)) if j != RESERVED_SEGMENT]  # one box per category and bar
        k = len(drawn)
        cat = np.tile([MEMORY_CATEGORIES.index(SEGMENTS[j]) for j in drawn], n)
        xs = np.repeat(xp, k)
        colors = [CATEGORY_COLORS.get(c, "#888") for c in MEMORY_CATEGORIES]
        self.stacks.set_boxes(xs - width / 2, xs + width / 2, bottom_of[:, drawn].ravel(), top_of[:, drawn].ravel(),
                              colors, cat)
        self.reserved_caps.set_caps(xp - width / 2, xp + width / 2, bottom_of[:, RESERVED_SEGMENT],
                                    top_of[:, RESERVED_SEGMENT])
        self.reserved_caps.setVisible(True)
        if has_base:
            self._draw_baseline(x, top)
        if self.baseline_stacks.isVisible() != has_base:
            self.baseline_stacks.setVisible(has_base)
        self.stacks.setVisible(True)
        self._draw_experts(xp, width, top)
        frames = (tuple(xp[over]), tuple(totals[over]), width)
        if frames != self._frames:  # BarGraphItem re-records its picture on every setOpts
            self._frames = frames
            self.frames.setOpts(x=xp[over], y0=np.zeros(len(over)), height=totals[over], width=width * 1.08)
        self.frames.setVisible(bool(over))
        for k, label in enumerate(self.over_labels):
            if k < len(over) and show_over:
                i = over[k]
                label.setText(f"over by\n{fmt_bytes(self.groups[i].device_bytes - self.capacity_bytes)}")
                label.setPos(xp[i], totals[i])
                label.setVisible(True)
            elif label.isVisible():
                label.setVisible(False)
        if has_measured:
            self._draw_measured(xm, width)
        else:
            self.measured_stacks.setVisible(False)

    def _draw_lines(self, sc: _Scale) -> None:
        """The capacity and full fine-tune lines, the view's range, the off-scale note, the rank ticks."""
        pi = self.plot.getPlotItem()
        n, cap, top, full, full_in_view = sc.n, sc.cap, sc.top, sc.full, sc.full_in_view
        self.capacity_line.setValue(cap)
        self.capacity_line.setVisible(self.capacity_in_view)
        cap_text = f"{self.state.config.cluster.gpu.name} capacity {fmt_bytes(self.capacity_bytes)}"
        if cap_text != self._cap_text and self.capacity_in_view:  # a hidden label ignores a new text
            self._cap_text = cap_text
            self.capacity_line.label.setFormat(cap_text)
        if full_in_view:
            self.full_line.setValue(full / top)
            self.full_label.setPos(n - 0.45, full / top)
        if self.full_line.isVisible() != full_in_view:
            self.full_line.setVisible(full_in_view)
            self.full_label.setVisible(full_in_view)
        if self._view != (n, 1.0):
            self._view = (n, 1.0)
            pi.setYRange(0, 1.0, padding=0)
            pi.setXRange(-0.6, n - 0.4, padding=0)
        if not self.capacity_in_view:
            self.off_scale.setPos(-0.55, 1.0)
        self.off_scale.setVisible(not self.capacity_in_view)
        step = max(1, n // 12)
        tick = self._gpu_tick if self.dataparallel else self._tick
        ticks = [(i, tick(g)) for i, g in enumerate(self.groups) if i % step == 0]
        if ticks != self._ticks:
            self._ticks = ticks
            pi.getAxis("bottom").setTicks([ticks, []])

    def _set_header(self, over: list[int]) -> None:
        """The chart's one-line verdict: the fullest rank's bytes, and which ranks do not fit."""
        worst = max(self.groups, key=lambda g: (g.device_bytes, g.total))
        verdict = (f"{sum(len(self.groups[i].ranks) for i in over)} rank(s) do NOT fit" if over
                   else f"all ranks fit · headroom {fmt_bytes(self.capacity_bytes - worst.device_bytes)} on the fullest")
        # short: the header shares its row with the metrics panel; the chart itself carries the words
        extra = (" · LoRA" if self.full_finetune_peak is not None else "") + \
            (" · nn.DataParallel" if self.dataparallel else "") + \
            (" · bars: each category at its own worst moment of the step" if self.over_step else "")
        # the header, not a text item in the plot: a QGraphicsTextItem re-laid out per move costs ~0.4 ms
        diff = self._peak_difference()
        self.header.setText(f"Memory per rank · fullest {fmt_bytes(worst.allocated)} allocated, "
                            f"{fmt_bytes(worst.reserved)} reserved, {fmt_bytes(worst.device_bytes)} on the device "
                            f"of {fmt_bytes(self.capacity_bytes)}{f' ({diff})' if diff else ''} · {verdict}{extra}")
        if self.header.property("alarm") != bool(over):
            self.header.setProperty("alarm", bool(over))
            self.header.style().unpolish(self.header)
            self.header.style().polish(self.header)

    def _draw_experts(self, xp, width, top) -> None:
        """The routed experts' bytes (read once per prediction) as a band at the bottom of each bar."""
        if self._experts_of is not self.report:
            self._experts_of = self.report
            self.expert_bytes = [expert_bytes(g.sample) for g in self.groups]
        shown = any(self.expert_bytes)
        if shown:
            h = [b / self.unit / top for b in self.expert_bytes]
            self.expert_band.set_bands(xp - width / 2, xp + width / 2, h)
        else:
            self.expert_band.clear()
        if shown != self._experts_shown:
            self._experts_shown = shown
            self._set_legend()

    def _draw_baseline(self, x, top) -> None:
        """The baseline's stacks (bytes) beside the groups, in the lighter colours, scaled into the view."""
        off, bw = self._base_span
        key = (len(x), off, bw, tuple(None if b is None else b[0] for b in self.baseline_groups), id(self.baseline))
        if key != self._base_key:
            self._base_key = key
            k = len(MEMORY_CATEGORIES)
            rows = [(i, b[1]) for i, b in enumerate(self.baseline_groups) if b is not None]
            vals = np.array([v for _, v in rows], float)
            tops = np.cumsum(vals, axis=1)
            bx = np.repeat(x[[i for i, _ in rows]] + off, k)
            colors = [BASELINE_COLORS.get(c, "#ccc") for c in MEMORY_CATEGORIES]
            self.baseline_stacks.set_boxes(bx - bw / 2, bx + bw / 2, (tops - vals).ravel(), tops.ravel(), colors,
                                           np.tile(np.arange(k), len(rows)))
        scale = 1.0 / (self.unit * top)
        if scale != self._base_scale:
            self._base_scale = scale
            self.baseline_stacks.setTransform(QTransform.fromScale(1.0, scale))

    def _peak_difference(self) -> str:
        """'−3.2 GiB, −12 % vs baseline 27.5 GiB': how the fullest rank moved from the baseline's fullest."""
        diff = self.state.difference if self.baseline is not None else None
        change = diff.peak["total"] if diff is not None else None
        if change is None or change.delta is None:
            return ""
        if change.delta == 0:
            return "same as baseline"
        sign = "−" if change.delta < 0 else "+"
        rel = f", {sign}{abs(change.relative) * 100:.0f} %" if change.relative is not None else ""
        return f"{sign}{fmt_bytes(abs(change.delta))}{rel} vs baseline {fmt_bytes(change.baseline)}"

    @staticmethod
    def _tick(g: RankGroup) -> str:
        if len(g.ranks) == 1:
            return f"r{g.ranks[0]}"
        return f"r{_compress(g.ranks)}" if len(g.ranks) <= 4 else f"r{g.ranks[0]}… (×{len(g.ranks)})"

    def _gpu_tick(self, g: RankGroup) -> str:
        """nn.DataParallel has one process: its ranks are the GPUs of the node; GPU 0 carries more."""
        if g.ranks == [0]:
            if len(self.groups) > 1:
                return f"GPU 0: +{fmt_bytes(g.total - self.groups[-1].total)} (scatters, gathers, steps)"
            return "GPU 0"
        return f"GPU {_compress(g.ranks)}"

    def measured_for_group(self, g: RankGroup) -> dict[str, float] | None:
        rows = [self.measured_by_rank[r] for r in g.ranks if r in self.measured_by_rank]
        if not rows:
            return None
        return {k: float(np.mean([row[k] for row in rows])) for k in rows[0]}

    def _measured_max(self) -> float:
        vals = [m.get("total", 0) for m in self.measured_by_rank.values()]
        return max(vals, default=0.0) / GIB

    def _draw_measured(self, xm, width) -> None:
        """Measured memory as outlined, lightly filled stacks beside the predicted ones."""
        x0, x1, y0, y1, cat = [], [], [], [], []
        for i, g in enumerate(self.groups):
            m = self.measured_for_group(g)
            if m is None:
                continue
            acc = 0.0
            for k, c in enumerate(MEMORY_CATEGORIES):
                h = m.get(c, 0.0) / self.unit / self.y_scale
                x0.append(xm[i] - width / 2)
                x1.append(xm[i] + width / 2)
                y0.append(acc)
                y1.append(acc + h)
                cat.append(k)
                acc += h
        colors = [CATEGORY_COLORS.get(c, "#888") for c in MEMORY_CATEGORIES]
        self.measured_stacks.set_boxes(x0, x1, y0, y1, colors, cat)
        self.measured_stacks.setVisible(bool(x0))

    # ------------------------------------------------------------------ hover

    def segment_at(self, x: float, y: float) -> tuple[RankGroup, str] | None:
        """The (group, segment) under a point in chart coordinates (y in the chart's unit): a category,
        or "reserved" for the cap from allocated up to reserved."""
        i = int(round(x))
        if not 0 <= i < len(self.groups):
            return None
        g = self.groups[i]
        acc = 0.0
        for name, b in zip(SEGMENTS, segment_bytes([g])[0]):
            h = b / self.unit
            if acc <= y < acc + h:
                return g, name
            acc += h
        return None

    def baseline_segment_at(self, x: float, y: float) -> tuple[int, str, float] | None:
        """(baseline rank, category, bytes) of the baseline bar under a point (y in the chart's unit)."""
        i = int(round(x))
        if not 0 <= i < len(self.baseline_groups) or self.baseline_groups[i] is None:
            return None
        off, bw = self._base_span
        if abs(x - (i + off)) > bw / 2:
            return None
        rank, values = self.baseline_groups[i]
        acc = 0.0
        for c, v in zip(MEMORY_CATEGORIES, values):
            h = v / self.unit
            if acc <= y < acc + h:
                return rank, c, float(v)
            acc += h
        return None

    def explain_at(self, x: float, y: float) -> str:
        base = self.baseline_segment_at(x, y)
        if base is not None:
            rank, c, nbytes = base
            return f"baseline · rank {rank} · {c}: {fmt_bytes(nbytes)}\n({self.baseline_text})"
        expert = expert_hover_text(self, x, y)  # the routed experts' band inside params
        if expert:
            return expert
        hit = self.segment_at(x, y)
        if hit is None:
            return ""
        g, c = hit
        if c == "reserved":
            head = (f"{g.label} · reserved, not allocated: {fmt_bytes(g.reserved - g.allocated)} predicted — "
                    "blocks the caching allocator holds beyond the live tensors (segment rounding, splitting, "
                    "freed blocks kept for reuse)")
            body = ""
        else:
            head = f"{g.label} · {c}: {fmt_bytes(g.values[c])} predicted"
            at_peak = int(getattr(g.sample, c, g.values[c]))
            over = g.sample.category_peaks()[c] if hasattr(g.sample, "category_peaks") else at_peak
            if over != at_peak:  # what the other reading of the bar says
                head += (f" ({fmt_bytes(at_peak)} at the rank's peak moment, {fmt_bytes(over)} at its own worst "
                         "moment of the step)")
            m = self.measured_for_group(g)
            if m is not None:
                head += f", {fmt_bytes(m.get(c, 0))} measured"
            body = explain_text(g.sample, c)
        return head + ("\n" + body if body else "") + "\n" + self.device_text(g)

    def device_text(self, g: RankGroup) -> str:
        """Allocated, reserved, overhead and capacity of one bar, in GiB, as a GPU user reads them."""
        def gib(n: float) -> str:
            return f"{n / GIB:.2f} GiB"
        verdict = "fits" if g.fits else f"does NOT fit (over by {gib(g.device_bytes - self.capacity_bytes)})"
        return (f"allocated {gib(g.allocated)} (live tensors at the peak: max_memory_allocated)\n"
                f"reserved {gib(g.reserved)} (what the caching allocator holds: max_memory_reserved)\n"
                f"overhead {gib(g.untracked)} (CUDA context, collective buffers: outside the allocator)\n"
                f"reserved + overhead {gib(g.device_bytes)} of capacity {gib(self.capacity_bytes)}: {verdict}")

    def _hover(self, pos) -> None:
        vb = self.plot.getPlotItem().getViewBox()
        if not self.groups or not vb.sceneBoundingRect().contains(pos):
            return
        p = vb.mapSceneToView(pos)
        text = self.explain_at(p.x(), p.y() * self.y_scale)
        self.hover_text = text
        if text:
            QToolTip.showText(self.plot.mapToGlobal(self.plot.mapFromScene(pos)), text, self.plot)
        else:
            QToolTip.hideText()
