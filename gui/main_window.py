"""The main window: lays the views out around one State and offers the session actions."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QRect, QSettings, Qt
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QWidget,
)

from engine import ConfigError
from gui.predicted import describe_config
from gui.state import State
from gui.widgets.controls import ControlsPanel
from gui.widgets.load_balance import LoadBalanceView
from gui.widgets.memory_chart import MemoryChart
from gui.widgets.metrics import MetricsPanel
from gui.widgets.planner_panel import PlannerPanel
from gui.widgets.run_panel import RunPanel
from gui.widgets.scaling import ScalingView
from gui.widgets.timeline import TimelineView

SCREEN_FRACTION = 0.9  # a first open fills this much of the screen's available area, centred
MIN_ON_SCREEN_PX = (200, 100)  # a saved geometry must show at least this much on some screen



#: the file dialogs' filters for the launchers' configs, and the format each imports as (gui/interop_files.py)
_LAUNCHER_FILTERS = (("torchtitan job config or command (*.toml *.sh *.txt)", "torchtitan"),
                     ("accelerate config (*.yaml *.yml)", "accelerate"),
                     ("DeepSpeed config (*.json)", "deepspeed"),
                     ("Megatron-LM command line (*.sh *.txt)", "megatron"),
                     ("Hugging Face config.json (config.json)", "hf"))

class MainWindow(QMainWindow):
    """``settings``: where the window keeps its geometry and splitter positions between opens
    (restored here, saved on close); None keeps nothing (tests, benchmarks, screenshots)."""

    def __init__(self, state: State, parent: QWidget | None = None, settings: QSettings | None = None):
        super().__init__(parent)
        self.state = state
        self.settings = settings
        self.current_path: Path | None = None
        self.setWindowTitle("ShardScope")
        self.controls = ControlsPanel(state)
        scroll = QScrollArea()
        scroll.setWidget(self.controls)
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setMinimumWidth(self.controls.sizeHint().width() + scroll.verticalScrollBar().sizeHint().width() + 4)
        self.memory = MemoryChart(state)
        self.timeline = TimelineView(state)
        self.metrics = MetricsPanel(state)
        self.run_panel = RunPanel(state)
        self.scaling = ScalingView(state)

        # the two charts one above the other, the metrics beside both (at 1280 × 800 beside the memory chart
        # alone they needed scrolling)
        charts = QSplitter(Qt.Orientation.Vertical)
        charts.setObjectName("chartsColumn")
        charts.addWidget(self.memory)
        charts.addWidget(self.timeline)
        charts.setSizes([350, 310])
        top = QSplitter(Qt.Orientation.Horizontal)
        top.setObjectName("chartsAndMetrics")
        top.addWidget(charts)
        holder = self.metrics.table_holder()
        holder.setMinimumWidth(330)  # its value column keeps a readable width; the charts take the rest
        top.addWidget(holder)
        top.setStretchFactor(0, 1)
        top.setSizes([880, 360])
        self.tabs = QTabWidget()
        self.tabs.addTab(self.run_panel, "Run && compare")
        self.load_balance = LoadBalanceView(state)  # a run's tokens per expert (mixtures of experts)
        self.tabs.addTab(self.load_balance, "Expert load")
        self.tabs.addTab(self.metrics.explainer, "Strategies explained")
        self.tabs.addTab(self.scaling, "DataParallel vs DDP")
        self.planner = PlannerPanel(state)
        self.tabs.addTab(self.planner, "Planner")
        self._dp_mode = state.config.parallel.dp_mode
        middle = QSplitter(Qt.Orientation.Vertical)
        middle.setObjectName("chartsOverTabs")
        middle.addWidget(top)
        middle.addWidget(self.tabs)
        middle.setSizes([660, 300])
        outer = QSplitter(Qt.Orientation.Horizontal)
        outer.setObjectName("outerSplitter")
        outer.addWidget(scroll)
        outer.addWidget(middle)
        outer.setSizes([360, 1240])
        outer.setStretchFactor(1, 1)
        self.setCentralWidget(outer)
        self._menus()
        self.statusBar().showMessage("Drag a control: memory and pipeline follow at once.")
        # methods, not lambdas: Qt drops a method's connection with its window, so a prediction that finishes after
        # the window is gone (the state outlives it) reaches no deleted status bar
        state.predictionReady.connect(self._show_predicted)
        # a prediction longer than a frame runs on while the window keeps answering: say so, quietly
        state.predictingChanged.connect(self._show_predicting)
        self.statusBar().setSizeGripEnabled(False)
        state.configChanged.connect(self._config_changed)
        self._title()
        self.restore_geometry()

    # ------------------------------------------------------------------ geometry

    def default_geometry(self) -> QRect:
        """The first open: most of the available area of the screen, centred on it."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        avail = screen.availableGeometry()
        w = min(avail.width(), max(int(avail.width() * SCREEN_FRACTION), 1280))
        h = min(avail.height(), max(int(avail.height() * SCREEN_FRACTION), 800))
        rect = QRect(0, 0, w, h)
        rect.moveCenter(avail.center())
        return rect

    def _splitters(self) -> list[QSplitter]:
        return [s for s in self.findChildren(QSplitter) if s.objectName()]

    @staticmethod
    def _on_a_screen(rect: QRect) -> bool:
        for screen in QGuiApplication.screens():
            seen = screen.availableGeometry().intersected(rect)
            if seen.width() >= MIN_ON_SCREEN_PX[0] and seen.height() >= MIN_ON_SCREEN_PX[1]:
                return True
        return False

    def restore_geometry(self) -> bool:
        """The saved geometry and splitter positions, or the screen-sized default when there are
        none or the saved window would be off every screen now attached. True when restored."""
        s = self.settings
        rect = s.value("window/rect") if s is not None else None
        geometry = s.value("window/geometry") if s is not None else None
        if isinstance(rect, QRect) and geometry and self._on_a_screen(rect) and self.restoreGeometry(geometry):
            for splitter in self._splitters():
                state = s.value(f"splitters/{splitter.objectName()}")
                if state:
                    splitter.restoreState(state)
            return True
        default = self.default_geometry()
        self.resize(default.size())
        self.move(default.topLeft())
        return False

    def save_geometry(self) -> None:
        s = self.settings
        if s is None:
            return
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/rect", self.normalGeometry() if self.isMaximized() else self.geometry())
        for splitter in self._splitters():
            s.setValue(f"splitters/{splitter.objectName()}", splitter.saveState())
        s.sync()

    def closeEvent(self, event) -> None:
        self.save_geometry()
        super().closeEvent(event)

    # ------------------------------------------------------------------ menus

    def _menus(self) -> None:
        file = self.menuBar().addMenu("&File")
        for text, slot, key in (
            ("&New (the embedded default)", self.new_config, QKeySequence.StandardKey.New),
            ("&Open config…", self.open_dialog, QKeySequence.StandardKey.Open),
            ("&Save config as…", self.save_dialog, QKeySequence.StandardKey.Save),
            ("Open &run…", self.open_run_dialog, None),
            ("&Import a launcher's config…", self.import_dialog, "Ctrl+I"),
            ("Export memory chart as PNG…", lambda: self.export_dialog(self.memory.plot, "memory.png"), None),
            ("Export timeline as PNG…", lambda: self.export_dialog(self.timeline.plot, "timeline.png"), None),
            ("Export comparison table as CSV…", self.export_csv_dialog, None),
            ("Export &report (HTML)…", self.report_dialog, None),
            ("&Quit", self.close, QKeySequence.StandardKey.Quit),
        ):
            action = QAction(text, self)
            action.triggered.connect(slot)
            if key is not None:
                action.setShortcut(key)
            file.addAction(action)
            if text.startswith("Export comparison"):
                self._export_layout_menu(file)
        edit = self.menuBar().addMenu("&Edit")
        self.undo_action = QAction("&Undo", self)
        self.undo_action.setShortcut(QKeySequence.StandardKey.Undo)
        self.undo_action.triggered.connect(self.state.undo)
        self.redo_action = QAction("&Redo", self)
        self.redo_action.setShortcut(QKeySequence.StandardKey.Redo)
        self.redo_action.triggered.connect(self.state.redo)
        self.reset_action = QAction("Reset to the embedded default", self)
        self.reset_action.triggered.connect(self.state.reset_to_default)
        for a in (self.undo_action, self.redo_action, self.reset_action):
            edit.addAction(a)
        self.state.desiredChanged.connect(lambda _d: self._history_changed())
        self._history_changed()
        run = self.menuBar().addMenu("&Run")
        a = QAction("Run this configuration", self)
        a.setShortcut("Ctrl+R")
        a.triggered.connect(self.run_panel.start)
        run.addAction(a)
        s = QAction("Simulate at scale (fake PG)", self)
        s.triggered.connect(self.run_panel.simulate)
        run.addAction(s)
        c = QAction("Cancel run", self)
        c.triggered.connect(self.state.cancel_run)
        run.addAction(c)
        self._baseline_menu()

    def _history_changed(self) -> None:
        """Undo and redo are enabled only when there is something to undo or redo."""
        self.undo_action.setEnabled(self.state.can_undo)
        self.redo_action.setEnabled(self.state.can_redo)

    def new_config(self) -> None:
        """File → New: the embedded default, no file behind it (undoable)."""
        self.state.reset_to_default()
        self.current_path = None

    def _baseline_menu(self) -> None:
        """Pin the current prediction as the baseline the charts and metrics compare with, or clear it."""
        menu = self.menuBar().addMenu("&Baseline")
        self.pin_action = QAction("Pin as baseline", self)
        self.pin_action.setShortcut("Ctrl+B")
        self.pin_action.setToolTip("Keep this prediction; later ones are drawn and listed beside it")
        self.pin_action.triggered.connect(self.state.pin_baseline)
        self.clear_baseline_action = QAction("Clear baseline", self)
        self.clear_baseline_action.setShortcut("Ctrl+Shift+B")
        self.clear_baseline_action.triggered.connect(self.state.clear_baseline)
        self.clear_baseline_action.setEnabled(False)
        menu.addAction(self.pin_action)
        menu.addAction(self.clear_baseline_action)
        self.state.baselineChanged.connect(self._baseline_changed)

    def _baseline_changed(self, pred) -> None:
        self.clear_baseline_action.setEnabled(pred is not None)
        if pred is not None:
            self.statusBar().showMessage(f"baseline pinned: {describe_config(pred.config)}")

    def _show_predicted(self, p) -> None:
        self.statusBar().showMessage(f"predicted in {p.seconds * 1e3:.1f} ms")

    def _show_predicting(self, busy: bool) -> None:
        if busy:
            self.statusBar().showMessage("predicting…")

    def _config_changed(self, cfg) -> None:
        self._title()
        if cfg.parallel.dp_mode != self._dp_mode:
            self._dp_mode = cfg.parallel.dp_mode
            if self._dp_mode == "dataparallel":  # the person just chose it: show why it stops scaling
                self.tabs.setCurrentWidget(self.scaling)

    def _title(self) -> None:
        name = self.current_path.name if self.current_path else "untitled"
        m = self.state.config.model
        self.setWindowTitle(f"ShardScope — {name} — {m.preset or 'custom'} on {self.state.config.parallel.world_size} ranks")

    # ------------------------------------------------------------------ session

    def open_config(self, path: str | Path) -> None:
        self.state.load(path)
        self.current_path = Path(path)
        self._title()

    def open_dialog(self) -> None:
        """File → Open: a ShardScope config, or (by the filter chosen) a launcher's config, imported."""
        path, chosen = QFileDialog.getOpenFileName(self, "Open config", "", "Configs (*.toml *.json);;"
                                                   + ";;".join(f for f, _ in _LAUNCHER_FILTERS))
        if not path:
            return
        fmt = dict(_LAUNCHER_FILTERS).get(chosen)
        if fmt is not None:
            self.import_launcher(path, fmt)
            return
        try:
            self.open_config(path)
        except ConfigError as exc:
            QMessageBox.warning(self, "Not a valid config", str(exc))

    def open_run_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open run directory", str(self.state.runs_dir))
        if path:
            try:
                self.state.open_run(path)
            except (OSError, ConfigError) as exc:
                QMessageBox.warning(self, "Not a run directory", str(exc))

    def save_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save config", str(self.current_path or "config.toml"),
                                              "TOML (*.toml);;JSON (*.json)")
        if path:
            self.state.save(path)
            self.current_path = Path(path)
            self._title()

    def export_dialog(self, widget, default: str) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export PNG", default, "PNG (*.png)")
        if path:
            widget.grab().save(path, "PNG")

    def export_csv_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export table", "comparison.csv", "CSV (*.csv)")
        if path:
            self.run_panel.export_csv(path)

    # ------------------------------------------------------------------ the launchers' languages

    def _export_layout_menu(self, file) -> None:
        from gui.interop_files import EXPORT_FORMS

        menu = file.addMenu("Export &layout as…")
        for fmt, forms in EXPORT_FORMS.items():
            for form, suffix, description in forms:
                action = QAction(f"{description} ({suffix})…", self)
                action.triggered.connect(lambda _=False, f=fmt, k=form, x=suffix, d=description:
                                         self.export_layout_dialog(f, k, x, d))
                menu.addAction(action)

    def import_dialog(self) -> None:
        path, chosen = QFileDialog.getOpenFileName(self, "Import a launcher's config", "",
                                                   ";;".join(f for f, _ in _LAUNCHER_FILTERS))
        if path:
            self.import_launcher(path, dict(_LAUNCHER_FILTERS).get(chosen, "torchtitan"))

    def import_launcher(self, path: str | Path, fmt: str) -> list[str]:
        """Make the launcher's file the window's config (undoable). What the file does not hold — accelerate's and
        DeepSpeed's model, batch and sequence, every format's card — is the window's current one. Returns the
        fields that did not carry over (also shown in a message box)."""
        from engine.interop import InteropError
        from gui.interop_files import import_text

        cur = self.state.config
        extra = {}
        if fmt in ("accelerate", "deepspeed"):  # their files hold no model; accelerate's no batch either
            extra = {"model": cur.to_dict()["model"]}
            if fmt == "accelerate":
                extra["training"] = {"micro_batch_size": cur.training.micro_batch_size}
        cluster = {"gpu": cur.to_dict()["cluster"]["gpu"]}
        try:
            text = Path(path).read_text(encoding="utf-8")
            got = import_text(fmt, text, path=path, base=Path(path).parent, cluster=cluster, extra=extra,
                              gpus=cur.cluster.gpus if fmt in ("deepspeed", "hf") else None)
        except (OSError, UnicodeDecodeError, InteropError) as exc:
            QMessageBox.warning(self, "Cannot import", str(exc))
            return []
        self.state.set_config(got.config)
        self.current_path = None
        self._title()
        lines = [f"not expressed: {n}" for n in got.not_expressed] + [f"assumed: {n}" for n in got.assumed]
        self.statusBar().showMessage(f"imported {fmt}: {Path(path).name}"
                                     + (f" — {len(lines)} field(s) did not carry over" if lines else ""))
        if lines:
            QMessageBox.information(self, f"Imported from {fmt}", "\n".join(lines))
        return lines

    def export_layout_dialog(self, fmt: str, form: str, suffix: str, description: str) -> None:
        path, _ = QFileDialog.getSaveFileName(self, f"Export layout as {description}", f"layout{suffix}",
                                              f"{description} (*{suffix})")
        if path:
            self.export_layout(path, fmt, form)

    def export_layout(self, path: str | Path, fmt: str, form: str = "command") -> list[str]:
        """Write the window's layout in a launcher's language; returns (and shows) what it cannot express."""
        from engine.interop import InteropError
        from gui.interop_files import export_text

        try:
            got = export_text(fmt, self.state.config, form)
            Path(path).write_text(got.text, encoding="utf-8")
        except (OSError, InteropError) as exc:
            QMessageBox.warning(self, "Cannot export", str(exc))
            return []
        self.statusBar().showMessage(f"exported {fmt}: {path}")
        if got.not_expressed:
            QMessageBox.information(self, f"Exported as {fmt}", "Not expressed:\n" + "\n".join(got.not_expressed))
        return list(got.not_expressed)

    def report_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export report", "report.html", "HTML (*.html)")
        if path:
            self.export_report(path)

    def export_report(self, path: str | Path) -> Path:
        """The shareable report of the window's config, with the run on screen and the planner's last result."""
        from gui.report import build_report
        from gui.text import comparison_table

        cmp = self.run_panel.comparison
        outcome = self.planner.outcome
        plan = None
        if outcome is not None and outcome.entries:
            plan = "\n".join(f"#{e['position']:<3} {e['label']:<60} {e['seconds'] * 1e3:10.2f} ms "
                              f"{e['tokens_per_s']:12,.0f} tok/s  MFU {e['mfu']:.1%}" for e in outcome.entries)
        text = build_report(self.state.config, comparison_text=comparison_table(cmp) if cmp is not None else None,
                            plan_text=plan, source=str(self.current_path) if self.current_path else None)
        path = Path(path)
        path.write_text(text, encoding="utf-8")
        self.statusBar().showMessage(f"report written: {path}")
        return path

    # ------------------------------------------------------------------ screenshot

    def screenshot(self, path: str | Path, width: int = 1600, height: int = 1000, plan: bool = False,
                   plan_timeout_s: float = 600.0) -> int:
        """Render the window to ``path``; with ``plan``, first run the planner tab's plan for the
        config and show its result (the README's picture)."""
        import time

        self.resize(width, height)
        self.show()
        self.state.recompute_now()
        app = QApplication.instance()
        for _ in range(3):
            app.processEvents()
        if plan:
            self.tabs.setCurrentWidget(self.planner)
            self.planner.start()
            end = time.monotonic() + plan_timeout_s
            while self.planner.running and time.monotonic() < end:
                app.processEvents()
                time.sleep(0.02)
            if self.planner.outcome is not None and self.planner.table.rowCount():
                self.planner.table.selectRow(0)
            for _ in range(3):
                app.processEvents()
        ok = self.grab().save(str(path), "PNG")
        return 0 if ok else 1
