"""Run the current config for real, watch it, and compare what was measured to the prediction."""

from __future__ import annotations

import csv
from pathlib import Path

from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QListWidget,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.names import MEMORY_CATEGORIES
from gui.state import predict
from gui.widgets.memory_chart import fmt_bytes
from gui.widgets.timeline import actions_from_measurement


def comparison_rows(record, prediction) -> list[tuple[str, str, float, float, float | None]]:
    """(rank, quantity, predicted, measured, error %) for every rank and category measured.

    ``prediction`` must be the prediction of ``record.config`` itself (apples to apples).
    Error % = (predicted - measured) / measured.
    """
    rows = []
    meas = record.measurement or {}
    mem = prediction.memory if prediction is not None else None
    if mem is not None:
        predicted = {int(r.rank): r for r in mem.per_rank}
        for entry in meas.get("memory", {}).get("per_rank", []):
            rank = int(entry.get("rank", -1))
            if rank not in predicted:
                continue
            for c in (*MEMORY_CATEGORIES, "total"):
                if c not in entry:
                    continue
                p, m = float(getattr(predicted[rank], c)), float(entry[c])
                err = (p - m) / m * 100 if m else None
                rows.append((str(rank), c, p, m, err))
    tl = prediction.timeline if prediction is not None else None
    if tl is not None and meas.get("pipeline"):
        par = record.config.parallel
        acts = actions_from_measurement(meas, par.dp, par.tp)
        if len(acts):
            m = float(acts.end_s.max())
            p = float(tl.makespan_s)
            rows.append(("all", "pipeline makespan (s)", p, m, (p - m) / m * 100 if m else None))
    return rows


class RunPanel(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.rows: list = []
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        bar = QHBoxLayout()
        self.run_button = QPushButton("▶ Run")
        self.run_button.setObjectName("runButton")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.status = QLabel("Runs this configuration as real multi-process training.")
        self.status.setWordWrap(True)
        bar.addWidget(self.run_button)
        bar.addWidget(self.cancel_button)
        bar.addWidget(self.progress, 1)
        lay.addLayout(bar)
        lay.addWidget(self.status)
        split = QSplitter()
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(5000)
        self.log.setPlaceholderText("live log")
        self.runs = QListWidget()
        self.runs.setMaximumWidth(180)
        split.addWidget(self.runs)
        split.addWidget(self.log)
        self.table = QTableWidget(0, 5)
        self.table.setHorizontalHeaderLabels(["rank", "quantity", "predicted", "measured", "error %"])
        self.table.verticalHeader().hide()
        split.addWidget(self.table)
        split.setSizes([140, 300, 420])
        lay.addWidget(split, 1)
        self.run_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(state.cancel_run)
        self.runs.currentRowChanged.connect(self._show_run)
        state.runEvent.connect(self.on_event)
        state.runFinished.connect(self.on_finished)
        state.runsChanged.connect(self._list_runs)

    def start(self) -> None:
        if self.state.running:
            return
        self.log.clear()
        self.table.setRowCount(0)
        record = self.state.start_run()
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.progress.setRange(0, 0)  # busy until the first step says how many
        self.status.setText(f"Starting {record.name} …")
        for line in record.log:
            self.log.appendPlainText(line)

    def on_event(self, record, event: dict) -> None:
        kind = event.get("event")
        self.log.appendPlainText(record.log[-1] if kind != "log" else event.get("text", ""))
        if kind == "step" and record.steps:
            self.progress.setRange(0, record.steps)
            self.progress.setValue(record.step)
            self.status.setText(f"{record.name}: step {record.step} of {record.steps}")
        elif kind == "started":
            self.status.setText(f"{record.name}: started")

    def on_finished(self, record) -> None:
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        self.progress.setRange(0, max(1, record.steps))
        self.progress.setValue(record.steps if record.status == "finished" else 0)
        self.log.appendPlainText(record.log[-1])
        words = {"finished": "finished: measured memory and timeline are drawn over the prediction",
                 "cancelled": "cancelled", "failed": f"failed: {record.reason}"}
        self.status.setText(f"{record.name} {words.get(record.status, record.status)}")
        self.status.setProperty("alarm", record.status == "failed")
        self.show_comparison(record)

    def show_comparison(self, record) -> None:
        if record.measurement is None:
            self.rows = []
            self.table.setRowCount(0)
            return
        pred = self.state.prediction
        if pred is None or pred.config != record.config:
            pred = predict(record.config)
        self.rows = comparison_rows(record, pred)
        self.table.setRowCount(len(self.rows))
        for i, (rank, qty, p, m, err) in enumerate(self.rows):
            is_bytes = qty in MEMORY_CATEGORIES or qty == "total"
            cells = [rank, qty, fmt_bytes(p) if is_bytes else f"{p:.4g}", fmt_bytes(m) if is_bytes else f"{m:.4g}",
                     "—" if err is None else f"{err:+.1f}"]
            for j, text in enumerate(cells):
                self.table.setItem(i, j, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()

    def _list_runs(self) -> None:
        self.runs.blockSignals(True)
        self.runs.clear()
        for r in self.state.runs:
            self.runs.addItem(f"{r.name} · {r.status}")
        self.runs.blockSignals(False)

    def _show_run(self, row: int) -> None:
        if not 0 <= row < len(self.state.runs):
            return
        record = self.state.runs[row]
        self.log.setPlainText("\n".join(record.log))
        self.show_comparison(record)

    def export_csv(self, path: str | Path) -> Path:
        path = Path(path)
        with path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["rank", "quantity", "predicted", "measured", "error_percent"])
            for rank, qty, p, m, err in self.rows:
                w.writerow([rank, qty, p, m, "" if err is None else f"{err:.3f}"])
        return path
