"""The planner in the window: the fastest layouts of the current model on the current GPUs, why
each wins or loses, and every fitting layout as tokens/s against peak memory per GPU.

A thin view over ``gui.planning``: Plan writes the window's config to a temporary file and runs
``shardscope plan --config … --json --all-fitting --progress`` as a child process (QProcess), so
the search never holds this process's GIL; its progress lines drive the bar, Cancel kills it.
Clicking a table row or a scatter point makes that layout the window's config through
``state.set_config``, so the charts and metrics redraw.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QProcess, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.plan.search import FITTING_SECONDS
from gui.child_process import start_child
from gui.planning import (
    DEFAULT_TOP,
    LAYOUT_COLUMN,
    TABLE_HEADERS,
    LineReader,
    PlanOutcome,
    PlanRequest,
    default_batch,
    job_key,
    job_text,
    progress_text,
)

POINT_COLOR = QColor(76, 120, 168, 110)  # every fitting layout
FRONT_COLOR = QColor("#E45756")  # the Pareto front
TOP_COLOR = QColor("#F58518")  # the top K (not on the front)


class PlannerPanel(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.outcome: PlanOutcome | None = None
        self.request: PlanRequest | None = None
        self.process: QProcess | None = None
        self._reader = LineReader()
        self._stderr: list[str] = []
        self._tmp: Path | None = None
        self._cancelled = False
        self._result_seen = False
        self._batch_for: tuple | None = None
        self.fitting_seconds = FITTING_SECONDS  # how long the scatter's sweep may run
        # search torchao float8 and torch.compile as the planner does by default; False keeps the config's own
        self.search_float8_compile = True

        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(self._build_bar())
        self.status = QLabel("Which layout should this job use? Plan ranks every valid one by predicted "
                             "tokens/s and shows every one that fits against its memory.")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        self.split = split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self._build_table())
        split.addWidget(self._build_plot())
        split.setSizes([860, 400])
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        lay.addWidget(split, 1)

        self.plan_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(self.cancel)
        self.table.cellClicked.connect(self.apply_row)
        self.table.cellActivated.connect(self.apply_row)
        self.table.currentCellChanged.connect(lambda row, *_: self._show_why(row))
        self.scatter.sigClicked.connect(self._point_clicked)
        state.configChanged.connect(self._config_changed)
        self._config_changed(state.config)
        app = QApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self.shutdown)

    # ------------------------------------------------------------------ building

    def _build_bar(self) -> QHBoxLayout:
        """The job, the global batch, top K, Plan, Cancel and the sweep's progress."""
        bar = QHBoxLayout()
        self.job = QLabel()
        self.job.setObjectName("chartTitle")
        # a long job ("Plan for llama3-8b on 16 × h100-sxm (8 per node)") wraps instead of widening the window
        # past 1280 px: its width is what the bar leaves it
        self.job.setWordWrap(True)
        self.job.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.job.setMinimumWidth(self.fontMetrics().horizontalAdvance("Plan for llama3-8b"))
        self.batch = QSpinBox()
        self.batch.setRange(1, 10_000_000)
        self.batch.setToolTip("Sequences per optimizer step, the same for every layout (so tokens/s compares "
                              "like with like); defaults to the planner's (about 4 Mi tokens, a multiple of "
                              "the GPU count, at most 8 per GPU)")
        self.top = QSpinBox()
        self.top.setRange(1, 100)
        self.top.setValue(DEFAULT_TOP)
        self.top.setToolTip("How many of the fastest layouts the table lists")
        self.plan_button = QPushButton("▶ Plan")
        self.plan_button.setToolTip("Rank every valid layout of this model on these GPUs by predicted "
                                    "throughput (shardscope plan, in a child process)")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        bar.addWidget(self.job, 3)
        bar.addWidget(QLabel("global batch"))
        bar.addWidget(self.batch)
        bar.addWidget(QLabel("top"))
        bar.addWidget(self.top)
        bar.addWidget(self.plan_button)
        bar.addWidget(self.cancel_button)
        bar.addWidget(self.progress, 1)
        return bar

    def _build_table(self) -> QWidget:
        """The top K with why each wins or loses, and under it the selected row's reasons."""
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        self.table = QTableWidget(0, len(TABLE_HEADERS))
        self.table.setHorizontalHeaderLabels(TABLE_HEADERS)
        self.table.resizeColumnsToContents()  # before the first plan: every title readable
        # the verdict column is often wider than the table's room: its title starts at its left edge, in
        # sight, and the column is as wide as its longest reason (the table scrolls instead of eliding it)
        self.table.horizontalHeaderItem(len(TABLE_HEADERS) - 1).setTextAlignment(
            Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        self._verdict_width = self.table.horizontalHeader().sectionSize(len(TABLE_HEADERS) - 1)
        self.table.viewport().installEventFilter(self)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 4)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setWordWrap(False)
        self.table.setToolTip("Click a layout to make it the window's config")
        ll.addWidget(self.table, 1)
        self.why = QLabel()
        self.why.setObjectName("hint")
        self.why.setWordWrap(True)
        self.why.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        ll.addWidget(self.why)
        return left

    def _build_plot(self) -> QWidget:
        """Every fitting layout: tokens/s against peak memory, the Pareto front, the card's capacity."""
        self.plot = pg.PlotWidget(background="w")
        self.plot.setMenuEnabled(False)
        # its view at least as tall as the vertical "tokens/s" label is long (at 1280 × 800 it was shorter)
        self.plot.setMinimumHeight(130)
        pi = self.plot.getPlotItem()
        pi.setLabel("bottom", "peak memory per GPU (GiB)")
        pi.getAxis("bottom").enableAutoSIPrefix(False)  # the unit is chosen per plan (PlanOutcome.memory_scale)
        pi.setLabel("left", "tokens/s")
        pi.getAxis("left").enableAutoSIPrefix(True)
        pi.showGrid(x=True, y=True, alpha=0.2)
        self.front_line = pg.PlotDataItem([], [], pen=pg.mkPen(FRONT_COLOR, width=1.5))
        pi.addItem(self.front_line)
        self.scatter = pg.ScatterPlotItem(size=7, pen=None, hoverable=True, hoverSize=11,
                                          hoverPen=pg.mkPen("k", width=1.5), tip=self._tip)
        pi.addItem(self.scatter)
        self.selected = pg.ScatterPlotItem(size=15, pen=pg.mkPen("k", width=2), brush=None, symbol="o")
        pi.addItem(self.selected)
        self._ringed: tuple[float, float] | None = None  # where the ring is (none yet)
        # the label hangs down from near the top, left of the line (the points are left of capacity): inside
        # the plot however short the plot is
        self.capacity_line = pg.InfiniteLine(angle=90, pen=pg.mkPen("#B00020", width=1, style=Qt.PenStyle.DashLine),
                                             label="capacity", labelOpts={"position": 0.97, "color": "#B00020",
                                                                          "anchors": [(1, 0), (1, 0)]})
        self.capacity_line.hide()
        pi.addItem(self.capacity_line, ignoreBounds=True)  # shown when the points reach it, never zoomed out to
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.plot, 1)
        self.legend = QLabel(  # under the plot, so it never hides a point
            f"<span style='color:{POINT_COLOR.name()}'>●</span> fits &nbsp; "
            f"<span style='color:{TOP_COLOR.name()}'>●</span> top K &nbsp; "
            f"<span style='color:{FRONT_COLOR.name()}'>●—</span> Pareto front &nbsp; ◯ the window's layout"
            " &nbsp;· hover: which layout · click: use it")
        self.legend.setToolTip("Pareto front: no other fitting layout is as fast with less memory per GPU, "
                               "or faster with as little")
        self.legend.setObjectName("hint")
        self.legend.setWordWrap(True)
        rl.addWidget(self.legend)
        return right

    # ------------------------------------------------------------------ the job

    @property
    def running(self) -> bool:
        return self.process is not None

    def _config_changed(self, cfg) -> None:
        self.job.setText(f"Plan for {job_text(cfg)}")
        key = (cfg.cluster.gpus, cfg.model.seq_len, cfg.global_batch_size)
        if key != self._batch_for:  # a new GPU count, sequence length or batch: the config's own batch
            self._batch_for = key
            self.batch.setValue(default_batch(cfg))
        self._mark_current()
        if self.outcome is not None and self.request is not None and not self.running \
                and job_key(cfg) != job_key(self.request.config):
            self._say(f"This plan is of {job_text(self.request.config)}; the window's job has changed since "
                      f"(its model, cluster, precision or conventions): Plan again for {job_text(cfg)}. "
                      "Clicking a layout below goes back to the planned job with that layout.")

    # ------------------------------------------------------------------ running the planner

    def start(self) -> None:
        """Plan the window's current config in a child process."""
        if self.process is not None:
            return
        cfg = self.state.config
        self.request = PlanRequest(cfg, global_batch=self.batch.value(), top=self.top.value(),
                                   fitting_seconds=self.fitting_seconds,
                                   search_float8_compile=self.search_float8_compile)
        self._tmp = Path(tempfile.mkdtemp(prefix="shardscope-plan-"))
        path = cfg.save(self._tmp / "job.toml")
        cmd = self.request.command(path)
        self._reader = LineReader()
        self._stderr = []
        self._cancelled = self._result_seen = False
        self.plan_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.progress.setRange(0, 0)  # busy until the sweep says how many
        self._say(f"Planning {job_text(cfg)}, global batch {self.request.global_batch} …")
        self.process = start_child(self, cmd, on_stdout=self._on_stdout, on_stderr=self._on_stderr,
                                   on_finished=self._on_finished, on_error=self._on_error)

    def cancel(self) -> None:
        """Stop a running plan: the child is killed (it holds nothing worth a clean shutdown)."""
        if self.process is None:
            return
        self._cancelled = True
        self.process.kill()

    def shutdown(self) -> None:
        """The application is quitting: end a running plan now and remove its temporary config."""
        proc = self.process
        if proc is None:
            return
        self._cancelled = True
        proc.kill()
        proc.waitForFinished(2000)
        if self.process is proc:  # finished was not delivered (no event loop any more)
            self._finish()

    def _on_stdout(self) -> None:
        if self.process is None:
            return
        for event in self._reader.feed(bytes(self.process.readAllStandardOutput().data())):
            self._event(event)

    def _on_stderr(self) -> None:
        if self.process is None:
            return
        text = bytes(self.process.readAllStandardError().data()).decode("utf-8", "replace")
        self._stderr += [line for line in text.splitlines() if line.strip()]

    def _event(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "progress":
            value, maximum, words = progress_text(event)
            self.progress.setRange(0, maximum)
            self.progress.setValue(value)
            self._say(words)
        elif kind == "result":
            self._result_seen = True
            self.show_result(PlanOutcome(event["result"]))
        elif kind == "error":
            self._result_seen = True
            self._say(f"cannot plan this config: {event.get('message', '?')}", alarm=True)

    def _on_error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.process is not None:
            self._say("the planner could not be started", alarm=True)
            self._finish()

    def _on_finished(self, exit_code: int, _status) -> None:
        if self.process is None:
            return
        if not self._cancelled:
            self._on_stdout()
            for event in self._reader.feed(b"", final=True):
                self._event(event)
        if self._cancelled:
            self._say("Plan cancelled.")
        elif not self._result_seen:
            tail = "; ".join((self._stderr or self._reader.text)[-3:])
            self._say(f"the planner exited with code {exit_code} without a result" + (f": {tail}" if tail else ""),
                      alarm=True)
        self._finish()

    def _finish(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            proc.deleteLater()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self.plan_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        done = self._result_seen and not self._cancelled
        self.progress.setRange(0, 1)
        self.progress.setValue(1 if done else 0)

    def _say(self, text: str, alarm: bool = False) -> None:
        self.status.setText(text)
        self.status.setProperty("alarm", alarm)
        self.status.style().unpolish(self.status)
        self.status.style().polish(self.status)

    # ------------------------------------------------------------------ drawing a result

    def show_result(self, outcome: PlanOutcome) -> None:
        self.outcome = outcome
        rows = outcome.rows()
        self.table.setUpdatesEnabled(False)
        self.table.clearContents()
        self.table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            why = "\n".join(outcome.why(i))
            for j, text in enumerate(row):
                item = QTableWidgetItem(text)
                if j not in (LAYOUT_COLUMN, len(row) - 1):  # numbers right-aligned; layout and reason read left to right
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                item.setToolTip(f"{row[LAYOUT_COLUMN]}\n{why}\nclick: make it the window's config")
                self.table.setItem(i, j, item)
        self.table.resizeColumnsToContents()
        self._verdict_width = self.table.horizontalHeader().sectionSize(len(TABLE_HEADERS) - 1)
        self._stretch_verdict_column()
        self.table.setUpdatesEnabled(True)
        self._fit_table()

        unit, scale = outcome.memory_scale()
        self.plot.getPlotItem().setLabel("bottom", f"peak memory per GPU ({unit})")
        xs, ys = outcome.xy()
        brushes = [pg.mkBrush(FRONT_COLOR if p.get("pareto") else TOP_COLOR if p.get("position") else POINT_COLOR)
                   for p in outcome.points]
        self.scatter.setData(x=xs, y=ys, data=list(range(len(xs))), brush=brushes)
        front = outcome.front()
        self.front_line.setData([xs[j] for j in front], [ys[j] for j in front])
        capacity = outcome.result.get("capacity_bytes")
        self.plot.getPlotItem().autoRange()
        # the line only where the points' range reaches it: beyond the view its label would hang over the
        # plot's edge (the view is never zoomed out to the capacity)
        (x0, x1), _ = self.plot.getPlotItem().getViewBox().viewRange()
        if capacity and xs and x0 <= capacity / scale <= x1:
            self.capacity_line.setValue(capacity / scale)
            self.capacity_line.show()
        else:
            self.capacity_line.hide()
        self._say(outcome.summary())
        self.why.setText("")
        self._mark_current()

    def _stretch_verdict_column(self) -> None:
        """The verdict column takes the rest of the table's width, or its full contents when wider."""
        header = self.table.horizontalHeader()
        last = len(TABLE_HEADERS) - 1
        room = self.table.viewport().width() - sum(header.sectionSize(i) for i in range(last))
        width = max(self._verdict_width, room)
        if header.sectionSize(last) != width:
            header.resizeSection(last, width)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.table.viewport() and event.type() == QEvent.Type.Resize:
            self._stretch_verdict_column()
        return super().eventFilter(obj, event)

    def _fit_table(self) -> None:
        """Give the table the width its columns need (the verdict column at least 220 px), the scatter the rest,
        as long as the scatter keeps a readable width."""
        total = sum(self.split.sizes())
        cols = len(TABLE_HEADERS)
        need = sum(self.table.columnWidth(c) for c in range(cols - 1)) + max(220, self.table.sizeHintForColumn(cols - 1))
        need += self.table.verticalScrollBar().sizeHint().width() + 2 * self.table.frameWidth() + 4
        if total and total - need >= 380:
            self.split.setSizes([need, total - need])

    def _tip(self, x: float, y: float, data) -> str:
        if self.outcome is None or data is None:
            return ""
        return self.outcome.point_tip(int(data))

    def _show_why(self, row: int) -> None:
        if self.outcome is None or not 0 <= row < len(self.outcome.entries):
            self.why.setText("")
            return
        e = self.outcome.entries[row]
        self.why.setText(f"#{e['position']} {e['label']}\n" + "\n".join(f"• {w}" for w in self.outcome.why(row)))

    def _ring(self, point: tuple[float, float] | None) -> None:
        """The ring around the window's layout at ``point`` (memory, tokens/s), or none; set only when it moves
        (every slider move of the window asks: a scatter item's ``setData`` lays out its spots again)."""
        if point != self._ringed:
            self._ringed = point
            self.selected.setData(*([[point[0]], [point[1]]] if point is not None else [[], []]))

    def _mark_current(self) -> None:
        """Ring the point (and select the row) of the layout the window shows, when it is one of the plan's."""
        cfg = self.state.config
        if self.outcome is None or (self.request is not None and job_key(cfg) != job_key(self.request.config)):
            self._ring(None)  # nothing of this plan is the window's layout: another job
            self.table.clearSelection()
            return
        j = self.outcome.point_of(cfg)
        if j is None:
            self._ring(None)
        else:
            p = self.outcome.points[j]
            self._ring((p["peak_bytes"] / self.outcome.memory_scale()[1], p["tokens_per_s"]))
        row = self.outcome.row_of(cfg)
        self.table.blockSignals(True)
        if row is None:
            self.table.clearSelection()
        else:
            self.table.selectRow(row)
        self.table.blockSignals(False)
        if row is not None:
            self._show_why(row)

    # ------------------------------------------------------------------ choosing a layout

    def apply_row(self, row: int, _column: int = 0) -> None:
        if self.outcome is None or not 0 <= row < len(self.outcome.entries):
            return
        self._apply(self.outcome.entry_config(row), self.outcome.entries[row]["label"])

    def apply_point(self, j: int) -> None:
        if self.outcome is None or not 0 <= j < len(self.outcome.points):
            return
        self._apply(self.outcome.point_config(j), self.outcome.points[j]["label"])

    def _point_clicked(self, item, points, ev=None) -> None:
        """Of the spots under the mouse, the one nearest to it on screen (ties: the front, then the fastest)."""
        if not len(points):
            return
        if ev is None:
            self.apply_point(int(points[0].data()))
            return
        at = item.mapToDevice(ev.pos())
        pts = self.outcome.points if self.outcome is not None else []

        def rank(spot):
            d = item.mapToDevice(spot.pos()) - at
            p = pts[int(spot.data())] if pts else {}
            return (round(d.x() ** 2 + d.y() ** 2, 3), not p.get("pareto"), -p.get("tokens_per_s", 0.0))

        self.apply_point(int(min(points, key=rank).data()))

    def _apply(self, cfg, label: str) -> None:
        self.state.set_config(cfg)
        self._say(f"The window now shows {label}. " + (self.outcome.summary() if self.outcome else ""))
