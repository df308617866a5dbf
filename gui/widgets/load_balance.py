"""The expert load of a run: tokens per routed expert in the run's last step, and its imbalance.

A bar per expert (one MoE block, or every block summed), the mean as a dashed line, the busiest
expert in red, and the imbalance (max / mean: ``conventions.moe_imbalance``'s definition) in the
header. "No run yet" until a run is shown; a run whose records have no token counts says so. The
measured imbalance can be taken as the prediction's convention with one button.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from gui.load_balance import ExpertLoad, expert_load
from gui.widgets.barrier import LayoutBarrier

BAR_COLOR = "#4C78A8"
BUSIEST_COLOR = "#D62728"
MEAN_COLOR = "#222"
ALL_BLOCKS = -1  # the block selector's "every block summed"
NO_RUN = "No run yet: run a mixture-of-experts configuration (Run && compare) to see how its tokens spread over the experts."


class LoadBalanceView(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.load: ExpertLoad | None = None
        self.record = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        head = QHBoxLayout()
        self.header = QLabel(NO_RUN)
        self.header.setObjectName("chartTitle")
        self.header.setWordWrap(True)
        self.header.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        head.addWidget(LayoutBarrier(self.header), 1)
        self.block = QComboBox()
        self.block.setToolTip("One MoE block's experts, or every block's tokens summed per expert index")
        self.block.currentIndexChanged.connect(lambda _: self.redraw())
        head.addWidget(self.block)
        self.use = QPushButton("Use as imbalance")
        self.use.setToolTip("Predict with this run's imbalance (conventions.moe_imbalance: the busiest expert "
                            "over the mean, the largest over the blocks)")
        self.use.clicked.connect(self.use_imbalance)
        head.addWidget(self.use)
        lay.addLayout(head)
        self.plot = pg.PlotWidget(background="w")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        pi = self.plot.getPlotItem()
        pi.getViewBox().setMouseEnabled(x=False, y=False)
        pi.setLabel("left", "tokens")
        pi.setLabel("bottom", "expert")
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=BAR_COLOR, pen=None)
        self.busiest = pg.BarGraphItem(x=[], height=[], width=0.8, brush=BUSIEST_COLOR, pen=None)
        self.mean_line = pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen(MEAN_COLOR, width=1.5,
                                                                         style=Qt.PenStyle.DashLine))
        for item in (self.bars, self.busiest, self.mean_line):
            pi.addItem(item)
        lay.addWidget(self.plot, 1)
        state.measurementShown.connect(self.show_record)
        self.show_load(None)

    # ------------------------------------------------------------------ data

    def show_record(self, record) -> None:
        """A run was shown: draw the tokens its last step routed to each expert."""
        self.record = record
        load = expert_load(getattr(record, "measurement", None))
        if load is None:
            self.show_load(None, f"Run {record.name} recorded no tokens per expert (a dense model, a simulated "
                                 "run, or a run from before they were recorded).")
        else:
            self.show_load(load)

    def show_load(self, load: ExpertLoad | None, why: str = NO_RUN) -> None:
        self.load = load
        self.block.blockSignals(True)
        self.block.clear()
        if load is not None:
            self.block.addItem("all MoE blocks", ALL_BLOCKS)
            for b in load.blocks:
                self.block.addItem(f"block {b}", b)
            worst = load.worst_block()
            self.block.setCurrentIndex(0 if worst is None else list(load.blocks).index(worst) + 1)
        self.block.blockSignals(False)
        for w in (self.block, self.use, self.plot):
            w.setVisible(load is not None)
        if load is None:
            self.header.setText(why)
        self.redraw()

    def selected(self) -> int:
        data = self.block.currentData()
        return ALL_BLOCKS if data is None else int(data)

    def counts(self) -> tuple[int, ...]:
        """The drawn tokens per expert (the selected block, or every block summed)."""
        if self.load is None:
            return ()
        b = self.selected()
        return self.load.summed() if b == ALL_BLOCKS else self.load.blocks[b]

    # ------------------------------------------------------------------ drawing

    def redraw(self) -> None:
        counts = np.asarray(self.counts(), float)
        if self.load is None or counts.size == 0:
            self.bars.setOpts(x=[], height=[])
            self.busiest.setOpts(x=[], height=[])
            self.mean_line.setVisible(False)
            return
        x = np.arange(counts.size, dtype=float)
        top = int(np.argmax(counts))
        rest = np.ones(counts.size, bool)
        rest[top] = False
        self.bars.setOpts(x=x[rest], height=counts[rest], width=0.8)
        self.busiest.setOpts(x=x[[top]], height=counts[[top]], width=0.8)
        mean = float(counts.mean())
        self.mean_line.setValue(mean)
        self.mean_line.setVisible(True)
        pi = self.plot.getPlotItem()
        pi.setXRange(-0.6, counts.size - 0.4, padding=0)
        pi.setYRange(0, max(1.0, float(counts.max())) * 1.1, padding=0)
        b = self.selected()
        ratio = ExpertLoad.ratio(counts.tolist())
        worst = self.load.worst_block()
        overall = self.load.imbalance()
        what = "every MoE block summed" if b == ALL_BLOCKS else f"block {b}"
        text = (f"Expert load · run {self.record.name if self.record else ''} · step {self.load.step} · {what}: "
                f"busiest expert {top} got {int(counts[top]):,} tokens, mean {mean:,.1f}")
        if ratio is not None:
            text += f" → imbalance {ratio:.2f}×"
        if overall is not None and worst is not None:
            text += f" · largest over the blocks {overall:.2f}× (block {worst})"
        self.header.setText(text)
        self.use.setEnabled(overall is not None)
        if overall is not None:
            self.use.setText(f"Use {overall:.2f}× as imbalance")

    def use_imbalance(self) -> None:
        """Predict with the run's measured imbalance (conventions.moe_imbalance)."""
        overall = self.load.imbalance() if self.load is not None else None
        if overall is not None:
            self.state.edit("conventions.moe_imbalance", round(overall, 4))
