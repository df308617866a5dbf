"""Why legacy nn.DataParallel stops scaling: tokens/s against the GPU count, beside DDP.

The numbers are the session's (``gui.predicted.dataparallel_scaling``: ``engine.legacy_dp.scaling``): the
same job on N = 1, 2, 4, … GPUs of one node, once as nn.DataParallel (GPU 0 scatters, gathers, reduces
and steps, nothing overlapped, the replicas' Python serialised on the GIL) and once as DDP. Worked out only while the view is
on screen and a drag has paused, so it never sits on the slider-to-repaint path.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from gui.comparison import fmt_bytes

DDP_COLOR = "#4C78A8"
DATAPARALLEL_COLOR = "#D62728"


def scaling_summary(rows: list[dict]) -> str:
    if not rows:
        return ""
    last = rows[-1]
    dp, ddp = last["dataparallel_tokens_per_s"], last["ddp_tokens_per_s"]
    first = rows[0]["dataparallel_tokens_per_s"]
    speedup = dp / first if first else 0.0
    return (f"At {last['gpus']} GPUs nn.DataParallel reaches {dp:,.0f} tokens/s, {dp / ddp * 100:.0f} % of DDP's "
            f"{ddp:,.0f} ({speedup:.1f}× one GPU, DDP {ddp / rows[0]['ddp_tokens_per_s']:.1f}×). GPU 0 holds "
            f"{fmt_bytes(last['gpu0_bytes'])}, every other GPU {fmt_bytes(last['other_gpu_bytes'])}: the scatter, "
            "gather, loss and gradient reduce all go through GPU 0 and grow with N, with nothing overlapped.")


class ScalingView(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.rows: list[dict] = []
        self._computed_for = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        title = QLabel("Why nn.DataParallel stops scaling: tokens/s vs GPUs of one node")
        title.setObjectName("chartTitle")
        lay.addWidget(title)
        self.plot = pg.PlotWidget(background="w")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        pi = self.plot.getPlotItem()
        pi.getViewBox().setMouseEnabled(x=False, y=False)
        pi.layout.setContentsMargins(1, 8, 1, 1)  # the top tick's label is not cut in half
        pi.setLabel("bottom", "GPUs (one node)")
        pi.setLabel("left", "tokens/s")
        pi.getAxis("left").enableAutoSIPrefix(True)
        pi.addLegend(offset=(10, 5))
        self.ddp_curve = pi.plot([], [], pen=pg.mkPen(DDP_COLOR, width=2), symbol="o", symbolSize=6,
                                 symbolBrush=DDP_COLOR, name="DDP (one process per GPU)")
        self.dp_curve = pi.plot([], [], pen=pg.mkPen(DATAPARALLEL_COLOR, width=2), symbol="s", symbolSize=6,
                                symbolBrush=DATAPARALLEL_COLOR, name="nn.DataParallel (GPU 0 drives all)")
        lay.addWidget(self.plot, 1)
        self.text = QLabel()
        self.text.setObjectName("hint")
        self.text.setWordWrap(True)
        lay.addWidget(self.text)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(100)  # after a drag pauses
        self._timer.timeout.connect(self.refresh)
        state.configChanged.connect(lambda _cfg: self._timer.start() if self.isVisible() else None)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self._computed_for != self.state.config:
            self.refresh()

    def refresh(self) -> None:
        cfg = self.state.config
        self._timer.stop()
        if cfg == self._computed_for:
            return
        self._computed_for = cfg
        self.rows, why = self.state.session.dataparallel_scaling()
        xs = [r["gpus"] for r in self.rows]
        self.ddp_curve.setData(xs, [r["ddp_tokens_per_s"] for r in self.rows])
        self.dp_curve.setData(xs, [r["dataparallel_tokens_per_s"] for r in self.rows])
        if xs:
            self.plot.getPlotItem().getAxis("bottom").setTicks([[(x, str(x)) for x in xs], []])
        self.text.setText(why or scaling_summary(self.rows))
