"""Run the current config for real (or simulate it at scale), watch it, and compare what was
measured to the prediction of that exact config.

The comparison is ``engine.compare.measured`` (see gui.comparison): per rank and category predicted,
measured, error % and the known cause of a difference; then pipeline makespan, bubble, action
order, and step time. Recent runs (every directory under runs/, and any opened) are listed
with their status; selecting one loads its config and draws its measurement.
"""

from __future__ import annotations

import csv
from pathlib import Path

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPlainTextEdit,
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

from backend.records import RunStatus
from gui.comparison import Row, comparison_rows
from gui.runnable import Runnable, runnable_version
from gui.runs import RunRecord, RunTarget

TARGET_LABELS = {"local": "This machine", "slurm": "Slurm (sbatch)", "hosts": "Hosts (one command each)"}
TARGET_NOTES = {
    "local": "",
    "slurm": "One torchrun per node through srun; the run directory must be on a filesystem every node shares.",
    "hosts": "Prints one command per host (start each yourself); the first host holds the rendezvous.",
}
HEADERS = ["rank", "quantity", "predicted", "measured", "error %", "why it differs / note"]



class WrappedLabel(QLabel):
    """A word-wrapped label whose minimum height follows its text at its current width.

    A wrapped QLabel in a row layout is given the height of its size hint (computed for another
    width), so on a short tab the splitter below could squeeze it under its text; this one asks
    for ``heightForWidth(width())`` whenever its width or text changes."""

    def __init__(self, text: str = "", parent: QWidget | None = None):
        super().__init__(text, parent)
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)

    def _fit(self) -> None:
        need = self.heightForWidth(self.width()) if self.width() > 0 else -1
        if need > 0 and need != self.minimumHeight():
            self.setMinimumHeight(need)

    def setText(self, text: str) -> None:
        super().setText(text)
        self._fit()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

class RunPanel(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.comparison = None
        self.current: RunRecord | None = None  # the run whose comparison is shown
        self.runnable: Runnable | None = None  # what Run executes for the current config
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        bar = QHBoxLayout()
        self.run_button = QPushButton("▶ Run")
        self.run_button.setObjectName("runButton")
        self.simulate_button = QPushButton("Simulate at scale (fake PG)")
        self.simulate_button.setToolTip(
            "Measure memory of this exact config at full scale without the hardware: the real backend code "
            "path on a fake process group with fake tensors, one rank per pipeline stage (shardscope measure "
            "--fake). Memory only: fake tensors do no arithmetic, so there is no step time.")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.calibrate_box = QCheckBox("Use this run's calibration")
        self.calibrate_box.setEnabled(False)
        self.calibrate_box.setToolTip("Time the step and the pipeline with the durations, efficiency and "
                                      "bandwidths this run measured on this machine (engine.compare.calibrate)")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        for w in (self.run_button, self.simulate_button, self.cancel_button):
            bar.addWidget(w)
        bar.addWidget(self.progress, 1)
        bar.addWidget(self.calibrate_box)
        lay.addLayout(bar)
        lay.addLayout(self._target_row())
        lay.addWidget(self.target_note)  # its own line: the target's fields need the row's width
        self.status = QLabel("Runs this configuration as real multi-process training.")
        self.status.setWordWrap(True)
        lay.addWidget(self.status)
        offer = QHBoxLayout()
        self.runnable_note = WrappedLabel()
        self.runnable_note.setObjectName("note")
        self.back_button = QPushButton("Back to your config")
        self.back_button.hide()
        offer.addWidget(self.runnable_note, 1)
        offer.addWidget(self.back_button)
        lay.addLayout(offer)

        split = QSplitter()
        split.setObjectName("runSplitter")
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        title = QLabel("Recent runs")
        title.setObjectName("hint")
        ll.addWidget(title)
        self.runs = QListWidget()
        # a run's name and its status ("20261204-191200 · finished · simulated") wrap in the narrow list
        # instead of ending in "· fir" (the whole path in the tooltip)
        self.runs.setWordWrap(True)
        self.runs.setTextElideMode(Qt.TextElideMode.ElideNone)
        self.runs.setToolTip("Every run directory under runs/ and any opened with File → Open run…; "
                             "select one to load its config and draw its measurement")
        ll.addWidget(self.runs, 1)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(5000)
        self.log.setPlaceholderText("live log")
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        self.table_title = QLabel("Predicted vs measured (error % = (predicted − measured) / measured)")
        self.table_title.setObjectName("hint")
        rl.addWidget(self.table_title)
        self.table = QTableWidget(0, len(HEADERS))
        self.table.setHorizontalHeaderLabels(HEADERS)
        # the note column is often wider than the view: its title starts at its left edge, in sight
        self.table.horizontalHeaderItem(len(HEADERS) - 1).setTextAlignment(
            Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 4)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(False)
        # columns as wide as their contents; the note column takes the rest of the width, or
        # its full text when that is wider (the table then scrolls instead of eliding it)
        self.table.resizeColumnsToContents()
        self._note_width = self.table.horizontalHeader().sectionSize(len(HEADERS) - 1)
        self.table.viewport().installEventFilter(self)
        rl.addWidget(self.table, 1)
        self.notes_label = QLabel()
        self.notes_label.setObjectName("hint")
        self.notes_label.setWordWrap(True)
        self.notes_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notes_label.hide()
        rl.addWidget(self.notes_label)
        split.addWidget(left)
        split.addWidget(self.log)
        split.addWidget(right)
        split.setSizes([160, 220, 710])  # the comparison table gets the room
        split.setStretchFactor(2, 1)
        lay.addWidget(split, 1)

        self.run_button.clicked.connect(self.start)
        self.simulate_button.clicked.connect(self.simulate)
        self.cancel_button.clicked.connect(state.cancel_run)
        self.back_button.clicked.connect(state.back_from_runnable)
        self.calibrate_box.toggled.connect(self._toggle_calibration)
        self.runs.currentRowChanged.connect(self._show_run)
        state.runEvent.connect(self.on_event)
        state.runFinished.connect(self.on_finished)
        state.runsChanged.connect(self._list_runs)
        state.measurementShown.connect(self.on_shown)
        # what Run will execute is worked out after a drag pauses, off the slider-to-repaint path
        self._runnable_timer = QTimer(self)
        self._runnable_timer.setSingleShot(True)
        self._runnable_timer.setInterval(80)
        self._runnable_timer.timeout.connect(self._refresh_runnable)
        state.configChanged.connect(self._config_changed)
        state.calibrationChanged.connect(self._calibration_changed)
        self._list_runs()
        self._refresh_runnable()

    # ------------------------------------------------------------------ target

    def _target_row(self) -> QHBoxLayout:
        """Where Run sends the config: this machine, a Slurm job, or hosts; Dry run only prints."""
        row = QHBoxLayout()
        self.target_box = QComboBox()
        for kind, label in TARGET_LABELS.items():
            self.target_box.addItem(label, kind)
        self.partition = QLineEdit()
        self.partition.setPlaceholderText("partition")
        self.nodes = QSpinBox()
        self.nodes.setRange(0, 4096)
        self.nodes.setSpecialValueText("nodes: from config")
        self.nodes.setPrefix("nodes ")
        self.gpus_per_node = QSpinBox()
        self.gpus_per_node.setRange(0, 64)
        self.gpus_per_node.setSpecialValueText("GPUs/node: from config")
        self.gpus_per_node.setPrefix("GPUs/node ")
        self.time_limit = QLineEdit()
        self.time_limit.setPlaceholderText("time, e.g. 00:30:00")
        self.account = QLineEdit()
        self.account.setPlaceholderText("account")
        self.hosts = QLineEdit()
        self.hosts.setPlaceholderText("hosts: node1,node2[:port]")
        self.dry_run_button = QPushButton("Dry run")
        self.dry_run_button.setToolTip("Print the sbatch script (Slurm) or the per-host commands into the log, "
                                       "without submitting anything")
        self.target_note = QLabel()
        self.target_note.setObjectName("hint")
        self.target_note.setWordWrap(True)
        row.addWidget(QLabel("Target"))
        for w in (self.target_box, self.partition, self.nodes, self.gpus_per_node, self.time_limit, self.account,
                  self.hosts, self.dry_run_button):
            row.addWidget(w)
        row.addStretch(1)
        self.slurm_fields = (self.partition, self.time_limit, self.account)
        self.target_box.currentIndexChanged.connect(self._target_changed)
        for edit in (self.partition, self.time_limit, self.account, self.hosts):
            edit.textChanged.connect(self._update_buttons)
        self.dry_run_button.clicked.connect(self.dry_run)
        for w, chars in ((self.partition, 12), (self.time_limit, 16), (self.account, 12), (self.hosts, 26)):
            w.setMaximumWidth(w.fontMetrics().horizontalAdvance("m" * chars))
            # never narrower than the placeholder that says what goes in it
            w.setMinimumWidth(min(w.maximumWidth(), w.fontMetrics().horizontalAdvance(w.placeholderText()) + 16))
        for spin in (self.nodes, self.gpus_per_node):
            spin.setMinimumWidth(spin.sizeHint().width())  # "from config" stays readable
        self._target_changed()
        return row

    def target(self) -> RunTarget:
        return RunTarget(kind=self.target_box.currentData(), partition=self.partition.text(),
                         nodes=self.nodes.value(), gpus_per_node=self.gpus_per_node.value(),
                         time=self.time_limit.text(), account=self.account.text(), hosts=self.hosts.text())

    def set_target(self, kind: str) -> None:
        self.target_box.setCurrentIndex(self.target_box.findData(kind))

    def _target_changed(self, *_args) -> None:
        kind = self.target_box.currentData()
        for w in self.slurm_fields:
            w.setVisible(kind == "slurm")
        self.hosts.setVisible(kind == "hosts")
        for w in (self.nodes, self.gpus_per_node):
            w.setVisible(kind != "local")
        self.dry_run_button.setVisible(kind != "local")
        if hasattr(self, "run_button") and self.runnable is not None:
            self._refresh_runnable()

    # ------------------------------------------------------------------ runnable version

    def _config_changed(self, cfg) -> None:
        self._show_runnable_result(cfg)
        self._runnable_timer.start()  # coalesce: a drag's moves cost one refresh when it pauses

    def _show_runnable_result(self, cfg) -> bool:
        """While the window shows a runnable version's result: say so, and offer the way back."""
        before, shown = self.state.before_runnable, self.state.shown
        if before is not None and cfg == before:
            self.state.before_runnable = before = None
        self.back_button.setVisible(before is not None)
        if before is not None and shown is not None and cfg == shown.config:
            self.runnable_note.setText(
                f"Showing the runnable version of {before.model.preset or 'your model'} on {before.parallel.world_size}"
                f" × {before.cluster.gpu.name}: the prediction, the overlays and the table are all of this exact "
                "config.")
            self.runnable_note.show()
            return True
        return False

    def _refresh_runnable(self) -> None:
        """Work out what Run executes for the current config (itself, or its runnable version)."""
        self._runnable_timer.stop()
        cfg = self.state.config
        if self.runnable is None or self.runnable.original != cfg:
            self.runnable = runnable_version(cfg)
        r = self.runnable
        target = self.target()
        if target.kind != "local":  # a cluster runs the config itself, at its own scale
            self.run_button.setText("▶ Submit to Slurm" if target.kind == "slurm" else "▶ Run on hosts")
            self.run_button.setToolTip(f"Run this exact configuration on {target.describe()}")
            if not self._show_runnable_result(cfg):
                self.runnable_note.hide()
        elif r.is_original:
            self.run_button.setText("▶ Run")
            self.run_button.setToolTip("Run this configuration as real multi-process training")
            if not self._show_runnable_result(cfg):
                self.runnable_note.hide()
        else:
            self.run_button.setText("▶ Run runnable version" if r.config is not None else "▶ Run")
            self.run_button.setToolTip(r.describe())
            self.runnable_note.setText(r.describe())
            self.runnable_note.show()
        self._update_buttons()

    def _update_buttons(self, *_args) -> None:
        running = self.state.running
        target = self.target()
        problem = target.problem()
        if target.kind == "local":
            can_run = self.runnable is not None and self.runnable.config is not None
        else:
            can_run = not problem
        self.run_button.setEnabled(not running and can_run)
        self.dry_run_button.setEnabled(not running and not problem)
        self.simulate_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        note = f"⚠ {problem}" if problem else TARGET_NOTES.get(target.kind, "")
        if note != self.target_note.text():
            self.target_note.setText(note)
        if self.target_note.isHidden() == bool(note):
            self.target_note.setVisible(bool(note))

    # ------------------------------------------------------------------ launching

    def start(self) -> None:
        """Run the config (or, when it is too large for this machine, its runnable version)."""
        self._refresh_runnable()  # never run what an earlier config would have run
        target = self.target()
        if target.kind != "local":
            if self.state.running or target.problem():
                return
            record = self.state.start_run(self.state.config, target=target)
            self._started(record, f"Starting on {target.describe()}: ")
            return
        if self.state.running or self.runnable.config is None:
            return
        r = self.runnable
        if r.is_original:
            record = self.state.start_run()
        else:
            record = self.state.start_run(r.config, runnable_of=r.original)
        self._started(record, "Starting the runnable version " if not r.is_original else "Starting ")

    def dry_run(self) -> None:
        """Print what the target would run (the sbatch script, or one command per host); submit nothing."""
        target = self.target()
        if self.state.running or target.kind == "local" or target.problem():
            return
        record = self.state.start_run(self.state.config, target=target, dry_run=True)
        self._started(record, f"Dry run for {target.describe()} (nothing is submitted): ")

    def simulate(self) -> None:
        """Simulate the current config at full scale on a fake process group (memory only)."""
        if self.state.running:
            return
        record = self.state.start_simulation()
        self._started(record, f"Simulating {self.state.config.parallel.world_size} ranks on a fake process group: ")

    def _started(self, record, words: str) -> None:
        self.log.clear()
        self._clear_table()
        self._update_buttons()
        self.progress.setRange(0, 0)  # busy until the first step says how many
        self.status.setText(f"{words}{record.name} …")
        self.status.setProperty("alarm", False)
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
        elif kind in ("submitted", "job_state", "waiting"):
            self.status.setText(f"{record.name}: {record.log[-1]}")

    def on_finished(self, record) -> None:
        self._update_buttons()
        self.progress.setRange(0, max(1, record.steps))
        self.progress.setValue(max(1, record.steps) if record.status == RunStatus.FINISHED else 0)
        self.log.setPlainText("\n".join(record.log))
        what = "simulated memory is" if record.simulated else "measured memory and timeline are"
        words = {RunStatus.FINISHED: f"finished: {what} drawn over the prediction",
                 RunStatus.CANCELLED: "cancelled", RunStatus.FAILED: f"failed: {record.reason}",
                 RunStatus.DRY_RUN: f"dry run: {'the sbatch script' if record.target.kind == 'slurm' else 'the per-host commands'}"
                            f" in the log (saved as {record.out_dir.name}/dry-run.txt); nothing was submitted"}
        text = f"{record.name} {words.get(record.status, record.status)}"
        if record.status == RunStatus.FINISHED and record.runnable_of is not None:
            text += " — this was the runnable version (tiny model, CPU ranks); the table compares it with the " \
                    "prediction of that same config"
        self.status.setText(text)
        self.status.setProperty("alarm", record.status == "failed")
        self.show_comparison(record)

    # ------------------------------------------------------------------ showing a run

    def on_shown(self, record) -> None:
        self.show_comparison(record)
        row = self.state.runs.index(record) if record in self.state.runs else -1
        if row >= 0 and self.runs.currentRow() != row:
            self.runs.blockSignals(True)
            self.runs.setCurrentRow(row)
            self.runs.blockSignals(False)

    def _clear_table(self) -> None:
        self.rows, self.notes, self.comparison = [], [], None
        self.table.setRowCount(0)
        self._fit_columns()
        self.notes_label.hide()

    def show_comparison(self, record) -> None:
        """engine.compare.measured of the run's measurement with the prediction of the config that ran."""
        self.current = record
        self._calibration_enabled()
        if record.config is None or record.load_measurement() is None:
            self._clear_table()
            self.table_title.setText(f"{record.name}: nothing measured" + (f" ({record.reason})" if record.reason
                                                                           else ""))
            return
        pred = self.state.predict_for(record.config)
        try:
            self.rows, self.notes, self.comparison = comparison_rows(
                pred.prediction, record.measurement, simulated=record.simulated, calibrated_from=pred.calibrated_from)
        except (KeyError, TypeError, ValueError) as exc:
            self._clear_table()
            self.table_title.setText(f"{record.name}: the measurement cannot be compared ({exc})")
            return
        kind = "simulated" if record.simulated else "measured"
        title = f"{record.name}: predicted vs {kind} (error % = (predicted − measured) / measured)"
        if record.runnable_of is not None:
            title += " · runnable version: predicted for the same tiny/CPU config"
        if pred.calibrated_from:
            title += f" · time calibrated from {Path(pred.calibrated_from).name}"
        self.table_title.setText(title)
        self.table.setUpdatesEnabled(False)
        self.table.setRowCount(len(self.rows))
        for i, row in enumerate(self.rows):
            for j, text in enumerate(row.cells()):
                item = QTableWidgetItem(text)
                if j in (2, 3, 4):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if j == 5 and text:
                    item.setToolTip(text)
                self.table.setItem(i, j, item)
        self._fit_columns()
        self.table.setUpdatesEnabled(True)
        if self.notes:
            self.notes_label.setText("\n".join(f"• {n}" for n in self.notes))
            self.notes_label.show()
        else:
            self.notes_label.hide()

    def _fit_columns(self) -> None:
        self.table.resizeColumnsToContents()
        self._note_width = self.table.horizontalHeader().sectionSize(len(HEADERS) - 1)
        self._stretch_note_column()

    def _stretch_note_column(self) -> None:
        header = self.table.horizontalHeader()
        last = len(HEADERS) - 1
        room = self.table.viewport().width() - sum(header.sectionSize(i) for i in range(last))
        width = max(self._note_width, room)
        if header.sectionSize(last) != width:
            header.resizeSection(last, width)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.table.viewport() and event.type() == QEvent.Type.Resize:
            self._stretch_note_column()
        return super().eventFilter(obj, event)

    def _list_runs(self) -> None:
        self.runs.blockSignals(True)
        current = self.current
        self.runs.clear()
        for r in self.state.runs:
            self.runs.addItem(r.label)
            item = self.runs.item(self.runs.count() - 1)
            item.setToolTip(f"{r.out_dir}\n{r.reason}" if r.reason else str(r.out_dir))
        if current in self.state.runs:
            self.runs.setCurrentRow(self.state.runs.index(current))
        self.runs.blockSignals(False)

    def _show_run(self, row: int) -> None:
        """Selecting a run loads its config and draws its measurement; a run without one shows its log."""
        if not 0 <= row < len(self.state.runs):
            return
        record = self.state.runs[row]
        self.log.setPlainText("\n".join(record.log))
        if not self.state.show_run(record):
            self.show_comparison(record)

    # ------------------------------------------------------------------ calibration

    def _calibration_enabled(self) -> None:
        r = self.current
        usable = (r is not None and r.status == RunStatus.FINISHED and not r.simulated
                  and r.config is not None)
        self.calibrate_box.blockSignals(True)
        self.calibrate_box.setChecked(self.state.calibration_run is not None and self.state.calibration_run is r)
        self.calibrate_box.blockSignals(False)
        self.calibrate_box.setEnabled(usable or self.state.calibration_run is not None)

    def _toggle_calibration(self, on: bool) -> None:
        try:
            self.state.set_calibration(self.current if on else None)
        except (OSError, ValueError) as exc:  # CalibrationError is a ValueError
            self.calibrate_box.blockSignals(True)
            self.calibrate_box.setChecked(False)
            self.calibrate_box.blockSignals(False)
            self.status.setText(f"cannot calibrate from {self.current.name if self.current is not None else 'no run'}: {exc}")
            self.status.setProperty("alarm", True)

    def _calibration_changed(self, record) -> None:
        if record is None:
            self.status.setText("Predictions are analytic again (no calibration).")
        else:
            self.status.setText(f"Step and pipeline are now timed with the calibration of {record.name}; "
                                "untick to go back to the analytic model.")
        self.status.setProperty("alarm", False)
        if self.current is not None:
            self.show_comparison(self.current)

    # ------------------------------------------------------------------ export

    def export_csv(self, path: str | Path) -> Path:
        path = Path(path)
        with path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["rank", "quantity", "predicted", "measured", "error_percent", "unit", "note"])
            for r in self.rows:
                w.writerow([r.rank, r.quantity, "" if r.predicted is None else r.predicted,
                            "" if r.measured is None else r.measured,
                            "" if r.error is None else f"{r.error:.3f}", r.unit, r.note])
            for n in self.notes:
                w.writerow(["", "note", "", "", "", "", n])
        return path
