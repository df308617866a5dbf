"""The one state object of the window: the Config, the latest Prediction and the runs.

Widgets read from it and write to it, never to each other. Edits go through
:meth:`State.edit`; the *desired* config (what the controls show) may be invalid, the
*valid* config (what the charts show) is the last one that passed every rule. Prediction is
recomputed on a zero-delay timer, so a burst of slider moves costs one recomputation.

Runs are child processes (``python -m gui.cli run CFG --out DIR --json``) streaming one
JSON event per line; a simulation at scale is ``python -m gui.cli measure CFG --fake --out DIR
--json``. This process never imports torch. Every run directory under ``runs/`` (and any opened
by hand) is listed with its status from ``events.jsonl``; showing one loads its config and draws
its measurement over the prediction of that config.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QTimer, Signal

from backend.records import read_jsonl
from engine import Config, ConfigError, Problem

# Which control a field belongs to: the first prefix that matches wins.
FIELD_CONTROLS: tuple[tuple[str, str], ...] = (
    ("model.preset", "model.preset"),
    ("model.seq_len", "model.seq_len"),
    ("model.", "model.size"),
    ("model", "model.size"),
    ("cluster.gpus_per_node", "cluster.gpus_per_node"),
    ("cluster.gpus", "cluster.gpus"),
    ("cluster.", "cluster.gpu"),
    ("parallel.replicate", "parallel.zero"),
    ("parallel.fsdp", "parallel.zero"),
    ("parallel.", None),  # parallel.<key> -> the control of that key
    ("training.grad_dtype", "training.precision"),
    ("training.", None),
)


def control_for_field(name: str) -> str:
    """The control that owns a Problem's field (``model.kv_heads`` -> ``model.size``)."""
    for prefix, control in FIELD_CONTROLS:
        if name == prefix or name.startswith(prefix):
            return control if control is not None else name
    return "general"


@dataclass
class Prediction:
    """What the engine said about one valid Config. A part is None when the engine lacks it."""

    config: Config
    memory: Any | None = None  # engine.memory.MemoryReport
    timeline: Any | None = None  # engine.timeline.Timeline
    step: Any | None = None  # engine step-time model, when it exists
    missing: dict[str, str] = field(default_factory=dict)  # part -> why it is not there
    seconds: float = 0.0
    engine: Any | None = None  # the engine.predict.Prediction itself (what engine.compare takes)
    calibrated_from: str | None = None  # run directory whose calibration timed this prediction
    full_finetune_peak_bytes: int | None = None  # LoRA only: the fullest rank's memory under full fine-tuning


def _full_finetune_peak(cfg: Config) -> int | None:
    """Under LoRA: what the fullest rank would hold if every weight trained (same layout), by the
    same memory model engine.predict picks for the layout (nn.DataParallel has its own)."""
    if cfg.training.finetune != "lora":
        return None
    if cfg.parallel.dp_mode == "dataparallel":
        fn = _engine_function("engine.legacy_dp", "memory")
    else:
        fn = _engine_function("engine.memory", "memory_per_rank")
    try:
        report = fn(cfg.replace(training={"finetune": "full"})) if fn is not None else None
    except Exception:  # the same layout may not be valid under full fine-tuning: no marker then
        return None
    return None if report is None else int(max(r.total for r in report.per_rank))


def _engine_function(module: str, name: str):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(mod, name, None)


def predict(cfg: Config, calibration=None) -> Prediction:
    """Ask every engine model that exists; record why a part is missing instead of faking it.

    ``calibration`` (an ``engine.calibrate.Calibration``) times the step and the pipeline with
    what a run measured on this machine; memory is the same either way.
    """
    t0 = time.perf_counter()
    pred = Prediction(config=cfg)
    whole = _engine_function("engine.predict", "predict")
    if calibration is not None:
        try:
            p = calibration.predict(cfg)
        except Exception as exc:  # a calibration that cannot time this config: say so, use the analytic one
            pred.missing["calibration"] = f"the calibration could not time this config: {exc}"
        else:
            pred.memory, pred.step, pred.timeline, pred.engine = p.memory, p.step, p.pipeline, p
            pred.calibrated_from = str(calibration.source)
            pred.full_finetune_peak_bytes = _full_finetune_peak(cfg)
            pred.seconds = time.perf_counter() - t0
            return pred
    if whole is not None:
        try:
            p = whole(cfg)
        except Exception:  # fall back to asking part by part, so one failing model hides only its part
            pass
        else:
            pred.memory, pred.step, pred.timeline, pred.engine = p.memory, p.step, p.pipeline, p
            pred.full_finetune_peak_bytes = _full_finetune_peak(cfg)
            pred.seconds = time.perf_counter() - t0
            return pred
    for part, module, name in (
        ("memory", "engine.memory", "memory_per_rank"),
        ("timeline", "engine.timeline", "pipeline_prediction"),
        ("step", "engine.step", "step_time"),
    ):
        fn = _engine_function(module, name)
        if fn is None:
            pred.missing[part] = f"{module}.{name} is not in this build of the engine yet"
            continue
        try:
            setattr(pred, part, fn(cfg))
        except Exception as exc:  # an engine limitation must not take the window down
            pred.missing[part] = f"{module}.{name} could not predict this config: {exc}"
    pred.seconds = time.perf_counter() - t0
    return pred


TARGETS = ("local", "slurm", "hosts")  # the values of `shardscope run --target`
DRY_RUN_FILE = "dry-run.txt"  # what a dry run printed (the sbatch script or the per-host commands)


@dataclass(frozen=True)
class RunTarget:
    """Where Run sends the config: this machine, a Slurm job (sbatch), or hosts the user starts
    one command on each. Empty fields are left to the CLI (its defaults come from the config)."""

    kind: str = "local"  # one of TARGETS
    partition: str = ""
    nodes: int = 0  # 0: from the config's cluster
    gpus_per_node: int = 0  # 0: from the config's cluster
    time: str = ""  # Slurm time limit, e.g. 00:30:00
    account: str = ""
    hosts: str = ""  # a,b[,...] for kind = "hosts"

    def problem(self) -> str:
        """Why this target cannot be used as filled in ('' when it can)."""
        if self.kind not in TARGETS:
            return f"unknown target {self.kind!r}"
        if self.kind == "hosts" and not [h for h in self.hosts.split(",") if h.strip()]:
            return "name the hosts (a,b,…): the first hosts the rendezvous"
        return ""

    def cli_args(self) -> list[str]:
        """The ``shardscope run`` options for this target (nothing for this machine)."""
        if self.kind == "local":
            return []
        args = ["--target", self.kind]
        if self.kind == "slurm":
            for flag, value in (("--partition", self.partition.strip()), ("--time", self.time.strip()),
                                ("--account", self.account.strip())):
                if value:
                    args += [flag, value]
        if self.kind == "hosts":
            args += ["--hosts", ",".join(h.strip() for h in self.hosts.split(",") if h.strip())]
        if self.nodes:
            args += ["--nodes", str(self.nodes)]
        if self.gpus_per_node:
            args += ["--gpus-per-node", str(self.gpus_per_node)]
        return args

    def describe(self) -> str:
        if self.kind == "slurm":
            return "a Slurm job" + (f" on partition {self.partition.strip()}" if self.partition.strip() else "")
        if self.kind == "hosts":
            return f"hosts {self.hosts.strip()}"
        return "this machine"


@dataclass
class RunRecord:
    """One launch of the backend (or one run directory found on disk): its config, where it
    writes, what it said."""

    config: Config | None  # None: the directory's config.toml could not be read (see reason)
    out_dir: Path
    status: str = "starting"  # starting | running | finished | failed | cancelled | incomplete
    events: list[dict] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    measurement: dict | None = None
    reason: str = ""
    step: int = 0
    steps: int = 0
    simulated: bool = False  # fake process group + fake tensors (memory only)
    runnable_of: Config | None = None  # the config this run is the runnable version of
    from_disk: bool = False  # found under runs/ or opened, not launched by this window
    target: RunTarget = field(default_factory=RunTarget)
    dry_run: bool = False  # printed what it would submit, submitted nothing
    printed: list[str] = field(default_factory=list)  # the child's stdout lines that were not events

    @property
    def name(self) -> str:
        return self.out_dir.name

    @property
    def label(self) -> str:
        kind = " · simulated" if self.simulated else (" · runnable version" if self.runnable_of is not None else "")
        if self.target.kind != "local":
            kind += f" · {self.target.kind}"
        return f"{self.name} · {self.status}{kind}"

    def load_measurement(self) -> dict | None:
        """Read measurement.json when it is not in memory yet (a run found on disk)."""
        if self.measurement is None:
            path = self.out_dir / "measurement.json"
            if path.exists():
                try:
                    self.measurement = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                    self.reason = self.reason or f"measurement.json is not readable: {exc}"
            if isinstance(self.measurement, dict) and self.measurement.get("simulated"):
                self.simulated = True
        return self.measurement


def read_run_dir(path: str | Path) -> RunRecord:
    """A run directory as a RunRecord: status from events.jsonl, config from config.toml.

    The measurement is read when the run is shown (:meth:`RunRecord.load_measurement`).
    """
    d = Path(path)
    events = read_jsonl(d / "events.jsonl")
    try:
        cfg: Config | None = Config.load(d / "config.toml")
        reason = ""
    except (ConfigError, OSError, ValueError) as exc:
        cfg, reason = None, f"config.toml is not readable: {exc}"
    record = RunRecord(config=cfg, out_dir=d, events=events, reason=reason, from_disk=True)
    has_measurement = (d / "measurement.json").exists()
    record.simulated = any(e.get("simulated") for e in events)
    terminal = [e for e in events if e.get("event") in ("finished", "failed")]
    dry = d / DRY_RUN_FILE
    if cfg is None:
        record.status = "unreadable"
    elif not events and dry.exists():
        record.status, record.dry_run = "dry run", True
        record.reason = "nothing was submitted"
    elif terminal and terminal[-1].get("event") == "failed":
        record.status = "failed"
        record.reason = str(terminal[-1].get("reason", "the run failed"))
    elif has_measurement:
        record.status = "finished"
    elif terminal:
        record.status = "failed"
        record.reason = "finished without a measurement.json"
    else:
        record.status = "incomplete" if events else "empty"
        record.reason = "no finished or failed event: the run was interrupted (or is still running elsewhere)"
    for e in events:
        if e.get("event") == "step":
            record.step = int(e.get("step", e.get("k", record.step)) or 0)
            record.steps = int(e.get("steps", e.get("n", record.steps)) or 0)
    record.log = [f"# {d}"] + [_describe_event(e) for e in events]
    if record.dry_run:
        try:
            record.log += dry.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            record.log.append(f"{dry} is not readable: {exc}")
    if record.reason:
        record.log.append(f"-- {record.status}: {record.reason}")
    return record


class State(QObject):
    """Owns the Config, the latest Prediction and the runs; widgets listen to its signals."""

    configChanged = Signal(object)  # the new valid Config
    desiredChanged = Signal(object)  # the desired config dict (controls mirror it)
    problemsChanged = Signal(object)  # dict control -> list[Problem]; empty when valid
    predictionReady = Signal(object)  # Prediction
    runEvent = Signal(object, object)  # RunRecord, event dict
    runFinished = Signal(object)  # RunRecord
    runsChanged = Signal()
    measurementShown = Signal(object)  # RunRecord drawn over the prediction of its config
    calibrationChanged = Signal(object)  # RunRecord whose calibration times predictions, or None

    def __init__(self, config: Config | None = None, runs_dir: str | Path = "runs", parent=None):
        super().__init__(parent)
        from engine import default_config

        self.config: Config = config if config is not None else default_config()
        self.desired: dict[str, Any] = self.config.to_dict()
        self.problems: dict[str, list[Problem]] = {}
        self.prediction: Prediction | None = None
        self.runs: list[RunRecord] = []
        self.runs_dir = Path(runs_dir)
        self.touched: str | None = None
        self._process: QProcess | None = None
        self._active: RunRecord | None = None
        self._stdout_buffer = b""
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._recompute)
        self.recompute_count = 0
        self.shown: RunRecord | None = None  # the run whose measurement is drawn
        self.before_runnable: Config | None = None  # the config shown before a runnable version's result
        self.calibration = None  # engine.calibrate.Calibration
        self.calibration_run: RunRecord | None = None
        self.scan_runs()

    # ------------------------------------------------------------------ config

    def edit(self, path: str, value: Any) -> bool:
        """Change one field of the desired config (``"parallel.tp"``, 2). True when valid.

        The data-parallel degree follows the GPU count: changing tp, pp or the GPU count
        sets dp = gpus / (tp·pp) when that divides; changing dp sets the GPU count.
        """
        desired = copy.deepcopy(self.desired)
        section, _, key = path.partition(".")
        if path == "model.preset":
            from engine.presets import model_presets

            desired["model"] = {"preset": value, **model_presets()[value]}
        elif path == "model.size":
            desired["model"].update(value)  # a dict of shape fields from the family
        elif path == "cluster.gpu":
            cl = desired["cluster"]
            # links follow the GPU kind's platform: let the parser fill them in again
            desired["cluster"] = {"gpu": value, "gpus": cl["gpus"], "gpus_per_node": cl["gpus_per_node"]}
        else:
            desired[section][key] = value
        par, cl = desired["parallel"], desired["cluster"]
        if path in ("parallel.tp", "parallel.pp", "cluster.gpus"):
            tp_pp = par["tp"] * par["pp"]
            if cl["gpus"] % tp_pp == 0:
                par["dp"] = cl["gpus"] // tp_pp
        elif path == "parallel.dp":
            cl["gpus"] = par["dp"] * par["tp"] * par["pp"]
        self.touched = path
        return self.set_desired(desired)

    def dataparallel_changes(self) -> dict[str, Any]:
        """What legacy nn.DataParallel needs changed in the desired config (path -> new value):
        one process over the GPUs of one node, so no tp, pp, sharding or HSDP replication."""
        par, cl = self.desired["parallel"], self.desired["cluster"]
        want = {"parallel.tp": 1, "parallel.pp": 1, "parallel.zero": 0, "parallel.replicate": 1,
                "parallel.sequence_parallel": False, "parallel.virtual_stages": 1}
        changes = {k: v for k, v in want.items() if par.get(k.split(".")[1]) != v}
        gpus = cl.get("gpus")
        per_node = cl.get("gpus_per_node")
        if isinstance(gpus, int) and isinstance(per_node, int) and gpus > per_node:
            changes["cluster.gpus"] = per_node
        return changes

    def use_dataparallel(self) -> bool:
        """Switch to legacy nn.DataParallel and make the layout one it can run (dp = every GPU)."""
        desired = copy.deepcopy(self.desired)
        for path, value in self.dataparallel_changes().items():
            section, _, key = path.partition(".")
            desired[section][key] = value
        par, cl = desired["parallel"], desired["cluster"]
        par["dp_mode"] = "dataparallel"
        par["dp"] = cl["gpus"]
        self.touched = "parallel.dp_mode"
        return self.set_desired(desired)

    def set_desired(self, desired: dict[str, Any]) -> bool:
        self.desired = desired
        try:
            cfg = self._fast_config(desired) or Config.from_dict(desired)
        except ConfigError as exc:
            self.problems = self._attribute(exc.problems)
            self.desiredChanged.emit(self.desired)
            self.problemsChanged.emit(self.problems)
            return False
        self.problems = {}
        self.desiredChanged.emit(self.desired)
        self.problemsChanged.emit(self.problems)
        if cfg != self.config:
            self.config = cfg
            self.configChanged.emit(cfg)
            self.schedule_recompute()
        return True

    def _fast_config(self, desired: dict[str, Any]) -> Config | None:
        """``config.replace(...)`` with what differs from the valid config, when that is all plain
        fields (no preset or GPU kind to resolve): the same rules, without re-parsing a file."""
        current = self.config.to_dict()
        updates: dict[str, dict[str, Any]] = {}
        for section in ("model", "cluster", "parallel", "training", "conventions"):
            want, have = desired.get(section, {}), current.get(section, {})
            if set(want) != set(have):
                return None
            diff = {k: v for k, v in want.items() if v != have[k]}
            if diff:
                if any(k in ("preset", "gpu") for k in diff):
                    return None
                updates[section] = diff
        if desired.get("schema_version") != current.get("schema_version"):
            return None
        return self.config.replace(**updates) if updates else self.config

    def set_config(self, cfg: Config) -> None:
        """Replace everything (a file was opened)."""
        self.config = cfg
        self.touched = None
        self.desired = cfg.to_dict()
        self.problems = {}
        self.desiredChanged.emit(self.desired)
        self.problemsChanged.emit(self.problems)
        self.configChanged.emit(cfg)
        self.schedule_recompute()

    def _attribute(self, problems: list[Problem]) -> dict[str, list[Problem]]:
        """Problems grouped by the control that shows them.

        A world-size mismatch is reported by the config on ``parallel.dp``; when the person
        just moved tp, pp or the GPU count (and dp could not follow), show it there.
        """
        out: dict[str, list[Problem]] = {}
        par, cl = self.desired["parallel"], self.desired["cluster"]
        for p in problems:
            control = control_for_field(p.field)
            if (p.field == "parallel.dp" and self.touched in ("parallel.tp", "parallel.pp", "cluster.gpus")
                    and isinstance(cl.get("gpus"), int) and cl["gpus"] % (par["tp"] * par["pp"])):
                control = self.touched
            out.setdefault(control, []).append(p)
        return out

    def load(self, path: str | Path) -> None:
        self.set_config(Config.load(path))

    def save(self, path: str | Path) -> Path:
        return self.config.save(path)

    # ------------------------------------------------------------------ prediction

    def schedule_recompute(self) -> None:
        """Coalesce: however many edits arrive before the event loop turns, compute once."""
        self._timer.start()

    def recompute_now(self) -> Prediction:
        self._timer.stop()
        self._recompute()
        assert self.prediction is not None
        return self.prediction

    def _recompute(self) -> None:
        self.recompute_count += 1
        self.prediction = predict(self.config, self.calibration)
        self.predictionReady.emit(self.prediction)

    def set_calibration(self, record: RunRecord | None) -> None:
        """Time predictions with what ``record`` measured (``load_calibration``), or analytically (None).

        Raises ``engine.calibrate.CalibrationError`` / OSError when the run cannot calibrate.
        """
        if record is None:
            self.calibration, self.calibration_run = None, None
        else:
            from engine.calibrate import load_calibration

            self.calibration = load_calibration(record.out_dir)
            self.calibration_run = record
        self.recompute_now()
        self.calibrationChanged.emit(record)

    def predict_for(self, cfg: Config) -> Prediction:
        """The prediction of ``cfg`` as the window currently predicts (calibrated or not)."""
        pred = self.prediction
        source = None if self.calibration is None else str(self.calibration.source)
        if pred is not None and pred.config == cfg and pred.engine is not None and pred.calibrated_from == source:
            return pred
        return predict(cfg, self.calibration)

    # ------------------------------------------------------------------ recorded runs

    def scan_runs(self) -> list[RunRecord]:
        """Add every run directory under ``runs_dir`` not listed yet (oldest first)."""
        known = {r.out_dir.resolve() for r in self.runs}
        found = []
        if self.runs_dir.is_dir():
            for d in sorted(self.runs_dir.iterdir()):
                if d.is_dir() and (d / "config.toml").exists() and d.resolve() not in known:
                    found.append(read_run_dir(d))
        if found:
            self.runs[:0] = found  # what ran before this window opened comes first
            self.runsChanged.emit()
        return found

    def open_run(self, path: str | Path) -> RunRecord:
        """List a run directory (File → Open run…) and show it; an already listed one is re-read."""
        d = Path(path)
        if not (d / "config.toml").exists():
            raise FileNotFoundError(f"{d} has no config.toml: not a run directory")
        for i, r in enumerate(self.runs):
            if r.out_dir.resolve() == d.resolve():
                if r.from_disk:
                    self.runs[i] = read_run_dir(d)
                record = self.runs[i]
                break
        else:
            record = read_run_dir(d)
            self.runs.append(record)
        self.runsChanged.emit()
        self.show_run(record)
        return record

    def show_run(self, record: RunRecord) -> bool:
        """Load the run's config into the window and draw its measurement over that config's
        prediction. False when there is nothing to draw (no config or no measurement)."""
        if record.config is None or self.running and record is self._active:
            return False
        record.load_measurement()
        if record.measurement is None:
            return False
        self.shown = record
        if record.config != self.config:
            self.set_config(record.config)
            self.recompute_now()  # draw the measurement over its own config's prediction, not a stale one
        self.measurementShown.emit(record)
        return True

    def back_from_runnable(self) -> None:
        """Return to the config a runnable version was made from."""
        if self.before_runnable is not None:
            cfg, self.before_runnable = self.before_runnable, None
            self.set_config(cfg)

    # ------------------------------------------------------------------ runs

    @property
    def running(self) -> bool:
        return self._process is not None

    def run_command(self, config_path: Path, out_dir: Path, target: RunTarget | None = None,
                    dry_run: bool = False) -> list[str]:
        """``python -m gui.cli run CFG --out DIR [target options] [--dry-run] --json``."""
        extra = (target or RunTarget()).cli_args() + (["--dry-run"] if dry_run else [])
        return [sys.executable, "-m", "gui.cli", "run", str(config_path), "--out", str(out_dir), *extra, "--json"]

    def simulate_command(self, config_path: Path, out_dir: Path) -> list[str]:
        return [sys.executable, "-m", "gui.cli", "measure", str(config_path), "--fake", "--out", str(out_dir),
                "--json"]

    def start_simulation(self, cfg: Config | None = None) -> RunRecord:
        """Simulate ``cfg`` at full scale on a fake process group (memory only) in a child process."""
        return self.start_run(cfg, simulate=True)

    def start_run(self, cfg: Config | None = None, *, simulate: bool = False,
                  runnable_of: Config | None = None, target: RunTarget | None = None,
                  dry_run: bool = False) -> RunRecord:
        """Launch ``cfg`` (default: the current config) as a child process; events stream in.

        ``runnable_of``: the (too large) config ``cfg`` is the runnable version of. ``target``:
        where it runs (default this machine); ``dry_run``: print the sbatch script or the per-host
        commands into the log (and ``dry-run.txt``) without submitting anything.
        """
        if self._process is not None:
            raise RuntimeError("a run is already in progress")
        target = target or RunTarget()
        if dry_run and target.kind == "local":
            raise ValueError("a dry run needs a Slurm or hosts target")
        if target.problem():
            raise ValueError(target.problem())
        cfg = cfg or self.config
        suffix = "-fake" if simulate else ("-dry" if dry_run else "")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S") + suffix
        out_dir = self.runs_dir / stamp
        n = 1
        while out_dir.exists():
            n += 1
            out_dir = self.runs_dir / f"{stamp}-{n}"
        out_dir.mkdir(parents=True)
        cfg_path = cfg.save(out_dir / "config.toml")
        record = RunRecord(config=cfg, out_dir=out_dir, simulated=simulate, runnable_of=runnable_of,
                           target=target, dry_run=dry_run)
        self.runs.append(record)
        self._active = record
        proc = QProcess(self)
        if simulate:
            cmd = self.simulate_command(cfg_path, out_dir)
        else:
            cmd = self.run_command(cfg_path, out_dir, target, dry_run)
        proc.setProgram(cmd[0])
        proc.setArguments(cmd[1:])
        proc.setWorkingDirectory(str(Path(__file__).resolve().parent.parent))
        proc.readyReadStandardOutput.connect(self._on_stdout)
        proc.readyReadStandardError.connect(self._on_stderr)
        proc.finished.connect(self._on_finished)
        proc.errorOccurred.connect(self._on_error)
        self._process = proc
        self._stdout_buffer = b""
        record.log.append("$ " + " ".join(cmd))
        proc.start()
        self.runsChanged.emit()
        return record

    def cancel_run(self) -> None:
        if self._process is None or self._active is None:
            return
        self._active.status = "cancelled"
        self._active.reason = "cancelled by the user"
        proc = self._process
        if (self._active.simulated or self._active.target.kind != "local") and proc.processId() > 0:
            # SIGINT: `measure --fake` stops its simulated ranks in a finally block (SIGTERM would orphan
            # them); a cluster run treats it as Ctrl-C: scancel the job, or stop following the hosts
            os.kill(proc.processId(), signal.SIGINT)
        else:
            proc.terminate()  # SIGTERM: the backend stops its ranks; never block the window on it

        def force() -> None:
            if self._process is proc and proc.state() != QProcess.ProcessState.NotRunning:
                proc.kill()

        QTimer.singleShot(5000, force)

    def _on_stdout(self) -> None:
        proc, record = self._process, self._active
        if proc is None or record is None:
            return
        self._stdout_buffer += bytes(proc.readAllStandardOutput().data())
        self._consume_stdout()

    def _consume_stdout(self, final: bool = False) -> None:
        """Buffered stdout as events, one JSON object a line; other lines are printed text (a dry
        run's script). ``final``: the process ended, so a last line without newline counts too."""
        record = self._active
        if record is None or record.simulated:
            return  # simulated: one JSON document at the end (measurement.json has it all), not an event stream
        *lines, self._stdout_buffer = self._stdout_buffer.split(b"\n")
        if final and self._stdout_buffer:
            lines.append(self._stdout_buffer)
            self._stdout_buffer = b""
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip()
            if not line.strip():
                if record.printed:  # keep a script's blank lines
                    record.printed.append("")
                    record.log.append("")
                    self.runEvent.emit(record, {"event": "log", "text": ""})
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                record.printed.append(line)
                record.log.append(line)
                self.runEvent.emit(record, {"event": "log", "text": line})
                continue
            if not isinstance(event, dict):
                continue
            self._apply_event(record, event)

    def _apply_event(self, record: RunRecord, event: dict) -> None:
        record.events.append(event)
        kind = event.get("event")
        if kind == "started":
            record.status = "running"
            record.steps = int(event.get("steps", record.steps) or 0)
        elif kind == "step":  # the backend may name them step/steps or k/n
            record.step = int(event.get("step", event.get("k", record.step)))
            record.steps = int(event.get("steps", event.get("n", record.steps)))
        elif kind == "submitted" and record.status == "starting":
            record.status = "submitted"
        elif kind == "job_state" and event.get("state") == "RUNNING" and record.status in ("starting", "submitted"):
            record.status = "running"
        elif kind == "failed":
            record.status = "failed"
            record.reason = str(event.get("reason", "the run failed"))
        elif kind == "finished":
            if record.status != "failed":
                record.status = "finished"
        record.log.append(_describe_event(event))
        self.runEvent.emit(record, event)

    def _on_stderr(self) -> None:
        if self._process is None or self._active is None:
            return
        text = bytes(self._process.readAllStandardError().data()).decode("utf-8", "replace")
        for line in text.splitlines():
            if line.strip():
                self._active.log.append(line)
                self.runEvent.emit(self._active, {"event": "log", "text": line})

    def _on_error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._active is not None:
            self._active.status = "failed"
            self._active.reason = "the backend could not be started"
            self._finish()

    def _on_finished(self, exit_code: int, exit_status) -> None:
        self._on_stdout()
        self._consume_stdout(final=True)  # a last line without newline (a printed script ends so)
        record = self._active
        if record is None:
            return
        if record.dry_run and record.status not in ("failed", "cancelled"):
            if exit_code == 0:
                record.status, record.reason = "dry run", "nothing was submitted"
                (record.out_dir / DRY_RUN_FILE).write_text("\n".join(record.printed) + "\n", encoding="utf-8")
            else:
                record.status = "failed"
                record.reason = record.reason or f"the dry run exited with code {exit_code}"
            self._finish()
            return
        if record.status not in ("failed", "cancelled"):
            if exit_code != 0:
                record.status = "failed"
                record.reason = record.reason or f"the backend exited with code {exit_code}"
            else:
                record.status = "finished"
        if record.status == "finished":
            path = record.out_dir / "measurement.json"
            try:
                record.measurement = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                record.status = "failed"
                record.reason = f"no readable measurement.json: {exc}"
            else:
                if record.simulated:
                    record.measurement["simulated"] = True
                    ranks = [r.get("rank") for r in record.measurement.get("memory", {}).get("per_rank", [])]
                    record.log.append(f"simulated ranks {ranks} on a fake process group (memory only)")
                    record.log += [f"tracker: {w}" for w in record.measurement.get("warnings") or []]
                    record.log += [f"not covered: {n}" for n in record.measurement.get("not_covered") or []]
        self._finish()

    def _finish(self) -> None:
        record = self._active
        proc = self._process
        self._process = None
        self._active = None
        if proc is not None:
            proc.deleteLater()
        if record is not None:
            record.log.append(f"-- {record.status}" + (f": {record.reason}" if record.reason else ""))
            self.runFinished.emit(record)
            self.runsChanged.emit()
            # draw it, unless the person has moved on to another config meanwhile (it stays in the list)
            if record.status == "finished" and record.measurement is not None and record.config is not None:
                if record.config == self.config:
                    self.show_run(record)
                elif record.runnable_of is not None and record.runnable_of == self.config:
                    self.before_runnable = self.config
                    self.show_run(record)


CLUSTER_EVENTS = ("submitted", "job_state", "rank_node", "node_command", "waiting")


def _describe_event(event: dict) -> str:
    kind = event.get("event", "?")
    if kind in CLUSTER_EVENTS:
        from backend.cluster.follow import human  # the CLI's own words (no torch: launch/records only)

        try:
            return human(event)
        except (KeyError, TypeError):
            pass
    if kind == "step":
        parts = [f"step {event.get('step', event.get('k'))}/{event.get('steps', event.get('n'))}"]
        if "loss" in event:
            parts.append(f"loss {event['loss']:.4f}" if isinstance(event["loss"], (int, float)) else f"loss {event['loss']}")
        if "seconds" in event and isinstance(event["seconds"], (int, float)):
            parts.append(f"{event['seconds'] * 1e3:.1f} ms")
        return "  ".join(parts)
    if kind == "failed":
        return f"failed: {event.get('reason', '')}"
    rest = {k: v for k, v in event.items() if k != "event"}
    return f"{kind} {json.dumps(rest)}" if rest else str(kind)
