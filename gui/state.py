"""The window's Qt side of the session: signals, the coalesced recomputation, the run's child process.

:class:`gui.session.Session` holds the model (the config being edited and the last valid one,
the prediction, the runs) in plain Python. :class:`State` is the QObject the widgets talk to:
it forwards reads and writes to the session, turns the session's notifications into Qt
signals, coalesces recomputation with one queued call (a burst of slider moves costs one
prediction) and runs it on a worker thread, one at a time, the latest request winning (the GUI
thread never waits for the engine; a prediction longer than a frame emits ``predictingChanged``),
and owns the :class:`QProcess` of a run, feeding its stdout and stderr lines to the session.

Runs are child processes (``python -m gui.cli run CFG --out DIR --json``) streaming one
JSON event per line; a simulation at scale is ``python -m gui.cli measure CFG --fake --out DIR
--json``. This process never imports torch.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, Qt, QTimer, Signal

from engine import Config
from gui import runs as _runs
from gui.child_process import Lines, start_child
from gui.predicted import Predicted, predict, prepared
from gui.runs import DRY_RUN_FILE, TARGETS, RunRecord, RunTarget, read_run_dir  # noqa: F401 - importable from here
from gui.session import FIELD_CONTROLS, Session, control_for_field  # noqa: F401 - as before

#: after a cancel, how long the child gets to stop its ranks before it is killed
KILL_AFTER_MS = 5000
#: a prediction still running after this long shows as "predicting…" (about a frame)
SLOW_PREDICTION_MS = 50


class _Worker:
    """One daemon thread for the process that runs the predictions handed to it, in order. Starting a
    thread per prediction made the GUI thread wait in ``Thread.start`` until the new thread had taken the
    interpreter, which it held for the whole prediction, and its exit competed with the repaint after it."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn, *args) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True, name="shardscope-predict")
                self._thread.start()
        self._jobs.put((fn, args))

    def _work(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                fn(*args)
            except RuntimeError:  # the window that asked has been closed: its signal's object is gone
                pass


_WORKER = _Worker()


def _forward(name: str, writable: bool = False) -> property:
    """An attribute of the State that is the session's ``name``."""

    def get(self):
        return getattr(self.session, name)

    def set_(self, value):
        setattr(self.session, name, value)

    return property(get, set_ if writable else None, doc=f"the session's {name}")


class State(QObject):
    """The session as a QObject: widgets read it, write to it and listen to its signals."""

    configChanged = Signal(object)  # the new valid Config
    desiredChanged = Signal(object)  # the desired config dict (controls mirror it)
    problemsChanged = Signal(object)  # dict control -> list[Problem]; empty when valid
    predictionReady = Signal(object)  # Predicted (gui.session)
    runEvent = Signal(object, object)  # RunRecord, event dict
    runFinished = Signal(object)  # RunRecord
    runsChanged = Signal()
    measurementShown = Signal(object)  # RunRecord drawn over the prediction of its config
    calibrationChanged = Signal(object)  # RunRecord whose calibration times predictions, or None
    baselineChanged = Signal(object)  # the pinned baseline Predicted, or None when cleared
    predictingChanged = Signal(bool)  # a prediction has been running longer than a frame (True), or is done
    _predicted = Signal(object)  # a worker thread's Predicted (queued to this object's thread)
    _recompute_soon = Signal()  # queued to this object: the coalesced recomputation

    config = _forward("config")
    desired = _forward("desired")
    problems = _forward("problems")
    prediction = _forward("prediction")
    runs = _forward("runs")
    runs_dir = _forward("runs_dir")
    touched = _forward("touched")
    recompute_count = _forward("recompute_count")
    shown = _forward("shown")
    before_runnable = _forward("before_runnable", writable=True)
    calibration = _forward("calibration")
    calibration_run = _forward("calibration_run")
    baseline = _forward("baseline")
    difference = _forward("difference")  # gui.predicted.PredictionDiff of the prediction against the baseline

    def __init__(self, config: Config | None = None, runs_dir: str | Path | None = None, parent=None):
        super().__init__(parent)
        # a queued call, not a zero-delay timer: the event loop delivers posted calls before the window's
        # repaint (Qt posts those at low priority) and timers after it, so the prediction starts first
        # and the moved control repaints while the worker predicts
        self._recompute_posted = False
        self._recompute_soon.connect(self._recompute_if_posted, Qt.ConnectionType.QueuedConnection)
        # predictions run on a worker thread, one at a time; the latest request wins (a result whose
        # config is no longer the current one is dropped and the current one predicted next)
        self._working = False
        self._again = False
        self._predicted.connect(self._take_prediction)
        self._slow = QTimer(self)
        self._slow.setSingleShot(True)
        self._slow.setInterval(SLOW_PREDICTION_MS)
        self._slow.timeout.connect(lambda: self.predictingChanged.emit(True))
        self._process: QProcess | None = None
        self._stdout = Lines()
        self.session = Session(config, runs_dir)
        s = self.session
        s.subscribe("desired", self.desiredChanged.emit)
        s.subscribe("problems", self.problemsChanged.emit)
        s.subscribe("config", self._config_changed)
        s.subscribe("prediction", self._prediction_ready)
        s.subscribe("runs", self.runsChanged.emit)
        s.subscribe("run_event", self.runEvent.emit)
        s.subscribe("run_finished", self.runFinished.emit)
        s.subscribe("shown", self.measurementShown.emit)
        s.subscribe("calibration", self.calibrationChanged.emit)
        s.subscribe("baseline", self.baselineChanged.emit)

    def _config_changed(self, cfg: Config) -> None:
        self.configChanged.emit(cfg)
        self.schedule_recompute()

    def _prediction_ready(self, pred: Predicted) -> None:
        self._recompute_posted = False  # fresh: a recomputation still queued would repeat it
        self.predictionReady.emit(pred)

    # ------------------------------------------------------------------ config (the session's)

    def edit(self, path: str, value: Any) -> bool:
        return self.session.edit(path, value)

    def set_desired(self, desired: dict[str, Any]) -> bool:
        return self.session.set_desired(desired)

    def dataparallel_changes(self) -> dict[str, Any]:
        return self.session.dataparallel_changes()

    def use_dataparallel(self) -> bool:
        return self.session.use_dataparallel()

    def set_config(self, cfg: Config) -> None:
        self.session.set_config(cfg)

    def undo(self) -> bool:
        return self.session.undo()

    def redo(self) -> bool:
        return self.session.redo()

    def reset_to_default(self) -> None:
        self.session.reset_to_default()

    @property
    def can_undo(self) -> bool:
        return self.session.can_undo

    @property
    def can_redo(self) -> bool:
        return self.session.can_redo

    def load(self, path: str | Path) -> None:
        self.session.load(path)

    def save(self, path: str | Path) -> Path:
        return self.session.save(path)

    # ------------------------------------------------------------------ prediction

    def schedule_recompute(self) -> None:
        """Coalesce: however many edits arrive before the event loop turns, compute once."""
        if not self._recompute_posted:
            self._recompute_posted = True
            self._recompute_soon.emit()

    def _recompute_if_posted(self) -> None:
        if self._recompute_posted:
            self._recompute_posted = False
            self._recompute()

    def recompute_now(self) -> Predicted:
        """Predict the current config on this thread, now (a prediction still running elsewhere is
        dropped when it arrives: its config has been predicted)."""
        self._recompute_posted = False
        return self.session.recompute()

    @property
    def predicting(self) -> bool:
        """A prediction is running on the worker thread."""
        return self._working

    def _recompute(self) -> None:
        """Predict the current config on a worker thread (the GUI thread never waits for the engine)."""
        if self._working:
            self._again = True
            return
        cfg, calibration = self.session.request()
        if self.session.prediction is not None and self.session.prediction.config == cfg and not self.session.stale:
            return
        self._working = True
        self._slow.start()
        _WORKER.submit(self._predict_in_worker, cfg, calibration)

    def _predict_in_worker(self, cfg: Config, calibration) -> None:
        try:
            pred = prepared(predict(cfg, calibration))
        except Exception as exc:  # noqa: BLE001 - the window shows what is missing instead of dying
            pred = Predicted(config=cfg, error=f"the prediction failed: {exc}")
        self._predicted.emit(pred)

    def _take_prediction(self, pred: Predicted) -> None:
        self._working = False
        self._slow.stop()
        self.predictingChanged.emit(False)
        if self.session.accept(pred) is None or self._again:
            self._again = False
            if self.session.prediction is None or self.session.prediction.config != self.session.config:
                self._recompute()

    def set_calibration(self, record: RunRecord | None) -> None:
        self.session.set_calibration(record)

    def predict_for(self, cfg: Config) -> Predicted:
        return self.session.predict_for(cfg)

    def pin_baseline(self) -> Predicted:
        return self.session.pin_baseline()

    def clear_baseline(self) -> None:
        self.session.clear_baseline()

    # ------------------------------------------------------------------ recorded runs

    def scan_runs(self) -> list[RunRecord]:
        return self.session.scan_runs()

    def open_run(self, path: str | Path) -> RunRecord:
        return self.session.open_run(path)

    def show_run(self, record: RunRecord) -> bool:
        return self.session.show_run(record)

    def back_from_runnable(self) -> None:
        self.session.back_from_runnable()

    # ------------------------------------------------------------------ the run's child process

    @property
    def running(self) -> bool:
        return self._process is not None

    @property
    def _active(self) -> RunRecord | None:
        return self.session.active

    def run_command(self, config_path: Path, out_dir: Path, target: RunTarget | None = None,
                    dry_run: bool = False) -> list[str]:
        return _runs.run_command(config_path, out_dir, target, dry_run)

    def simulate_command(self, config_path: Path, out_dir: Path) -> list[str]:
        return _runs.simulate_command(config_path, out_dir)

    def start_simulation(self, cfg: Config | None = None) -> RunRecord:
        """Simulate ``cfg`` at full scale on a fake process group (memory only) in a child process."""
        return self.start_run(cfg, simulate=True)

    def start_run(self, cfg: Config | None = None, *, simulate: bool = False,
                  runnable_of: Config | None = None, target: RunTarget | None = None,
                  dry_run: bool = False) -> RunRecord:
        """Launch ``cfg`` (default: the current config) as a child process; events stream in
        (see :meth:`Session.begin_run` for the options)."""
        if self._process is not None:
            raise RuntimeError("a run is already in progress")
        record = self.session.begin_run(cfg, simulate=simulate, runnable_of=runnable_of, target=target,
                                        dry_run=dry_run)
        cfg_path = record.out_dir / "config.toml"
        if simulate:
            cmd = self.simulate_command(cfg_path, record.out_dir)
        else:
            cmd = self.run_command(cfg_path, record.out_dir, record.target, dry_run)
        self._stdout = Lines()
        self.session.launched(cmd)
        self._process = start_child(self, cmd, on_stdout=self._on_stdout, on_stderr=self._on_stderr,
                                    on_finished=self._on_finished, on_error=self._on_error)
        return record

    def cancel_run(self) -> None:
        record = self.session.active
        if self._process is None or record is None:
            return
        self.session.cancelled()
        proc = self._process
        if (record.simulated or record.target.kind != "local") and proc.processId() > 0:
            # SIGINT: `measure --fake` stops its simulated ranks in a finally block (SIGTERM would orphan
            # them); a cluster run treats it as Ctrl-C: scancel the job, or stop following the hosts
            os.kill(proc.processId(), signal.SIGINT)
        else:
            proc.terminate()  # SIGTERM: the backend stops its ranks; never block the window on it

        def force() -> None:
            if self._process is proc and proc.state() != QProcess.ProcessState.NotRunning:
                proc.kill()

        QTimer.singleShot(KILL_AFTER_MS, force)

    def _on_stdout(self) -> None:
        if self._process is None:
            return
        self._consume_stdout(bytes(self._process.readAllStandardOutput().data()))

    def _consume_stdout(self, data: bytes = b"", final: bool = False) -> None:
        """Stdout, one line at a time, to the session. ``final``: the process ended, so a last line
        without newline counts too."""
        for line in self._stdout.feed(data, final):
            self.session.take_line(line)

    def _on_stderr(self) -> None:
        if self._process is None:
            return
        text = bytes(self._process.readAllStandardError().data()).decode("utf-8", "replace")
        for line in text.splitlines():
            self.session.take_error_line(line)

    def _release(self) -> None:
        proc, self._process = self._process, None
        if proc is not None:
            proc.deleteLater()

    def _on_error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._process is not None:
            self._release()
            self.session.could_not_start()

    def _on_finished(self, exit_code: int, exit_status) -> None:
        if self._process is None:
            return
        self._on_stdout()
        self._consume_stdout(final=True)  # a last line without newline (a printed script ends so)
        self._release()
        self.session.exited(exit_code)
