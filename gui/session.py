"""The window's model, in plain Python: the Config being edited, the latest Prediction, the runs.

A :class:`Session` holds two configs: the *desired* one (what the controls show, a dict that
may break a rule) and the *valid* one (what the charts show, the last one that passed every
rule). :meth:`Session.edit` changes one field and applies the layout rules that tie fields
together; a problem is attributed to the control that shows it. The prediction of the valid
config is recomputed on request (:meth:`Session.recompute`), optionally timed with a run's
calibration.

A prediction (a :class:`gui.predicted.Predicted`) can be pinned as the *baseline*
(:meth:`Session.pin_baseline`): it stays while the person edits, and :attr:`Session.difference` (a
:class:`gui.predicted.PredictionDiff`) says what changed from it, per memory category and rank and for the
step, throughput, pipeline and communication numbers. It is predicted once, when pinned (and
once more when a calibration changes how predictions are timed), never per edit.

Runs are records (:class:`gui.runs.RunRecord`): found under ``runs/`` (status from ``events.jsonl``),
opened by hand, or launched. The session turns a launched child's output lines into events
applied to the record; starting and stopping the child process is the caller's job (the Qt
adapter, :class:`gui.state.State`).

No Qt here: listeners subscribe to named notifications (:data:`NOTIFICATIONS`) with plain
callbacks, so the whole model is driven and tested without a window.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from backend.records import RunStatus, runs_root
from engine import Config, ConfigError, Problem, default_config
from engine.model.family import SHAPE_FIELDS
from engine.model.hf_config import HFConfigError, read_hf_config
from engine.model.presets import cluster_presets, gpu_presets, model_presets
from gui.predicted import (
    Predicted,
    PredictionDiff,
    compare_predictions,
    dataparallel_scaling,
    predict,
    prepared,
)
from gui.runs import DRY_RUN_FILE, RunRecord, RunTarget, apply_event, read_run_dir

# Which control a field belongs to: the first prefix that matches wins.
FIELD_CONTROLS: tuple[tuple[str, str | None], ...] = (
    ("model.preset", "model.preset"),
    ("model.seq_len", "model.seq_len"),
    ("model.experts_per_token", "model.experts_per_token"),
    ("model.experts", "model.experts"),
    *((f"model.{k}", "model.size") for k in SHAPE_FIELDS),  # what the size slider writes
    ("model.", None),  # model.<key> -> the control of that key (gui.widgets.all_fields: every other field)
    ("model", "model.size"),
    ("cluster.gpus_per_node", "cluster.gpus_per_node"),
    ("cluster.gpus", "cluster.gpus"),
    ("cluster.gpu.name", "cluster.gpu"),  # the GPU kind
    ("cluster.gpu.", None),  # a GPU's own numbers (a custom GPU's table) -> their controls
    ("cluster.gpu", "cluster.gpu"),
    ("cluster.", None),
    ("parallel.replicate", "parallel.zero"),
    ("parallel.fsdp", "parallel.zero"),
    ("parallel.", None),  # parallel.<key> -> the control of that key
    ("training.grad_dtype", "training.precision"),
    ("training.", None),
    ("conventions.", None),
)


#: fields whose change makes dp follow the GPU count (dp = gpus / (cp·tp·pp))
LAYOUT_FIELDS = ("parallel.tp", "parallel.cp", "parallel.pp", "cluster.gpus")


def control_for_field(name: str) -> str:
    """The control that owns a Problem's field (``model.kv_heads`` -> ``model.size``)."""
    for prefix, control in FIELD_CONTROLS:
        if name == prefix or name.startswith(prefix):
            return control if control is not None else name
    return "general"


def _sections_copy(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` with each section a new dict: what an edit changes (a section's fields) is its own, what it
    replaces whole (a custom GPU table, a list of conventions) is shared with the desired config before it —
    which the undo history keeps, and nothing changes in place."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in desired.items()}


# --------------------------------------------------------------------------- the session


#: what a Session tells its listeners, and with what
NOTIFICATIONS = {
    "desired": "the desired config dict (the controls mirror it)",
    "problems": "dict control -> list[Problem]; empty when the desired config is valid",
    "config": "the new valid Config (its prediction is stale until recompute)",
    "prediction": "the new Predicted (the engine's Prediction and what the window adds beside it)",
    "runs": "the list of runs changed (no argument)",
    "run_event": "RunRecord, event dict (a line the child printed is {'event': 'log', 'text': ...})",
    "run_finished": "RunRecord",
    "shown": "RunRecord whose measurement is drawn over the prediction of its config",
    "calibration": "RunRecord whose calibration times predictions, or None",
    "baseline": "the pinned baseline Predicted, or None when it was cleared",
}


class Session:
    """The Config being edited, the last valid one, the latest Prediction and the runs."""

    def __init__(self, config: Config | None = None, runs_dir: str | Path | None = None):
        self.config: Config = config if config is not None else default_config()
        self.desired: dict[str, Any] = self.config.to_dict()
        self.problems: dict[str, list[Problem]] = {}
        self.prediction: Predicted | None = None
        self.stale = True  # the prediction is not of the current config yet
        self.recompute_count = 0
        self.runs: list[RunRecord] = []
        # absolute: a run's child process starts in the repository root (gui.child_process), so a path
        # relative to where the window was started would name another directory there
        self.runs_dir = Path(runs_root() if runs_dir is None else runs_dir).expanduser().absolute()
        self.touched: str | None = None  # the field the person moved last
        self._undo: list[dict[str, Any]] = []  # desired configs before each change, oldest first
        self._redo: list[dict[str, Any]] = []
        self._last_change: tuple[str | None, float] = (None, 0.0)  # (field, monotonic time) of the last change
        self.active: RunRecord | None = None  # the run whose child process is running
        self.shown: RunRecord | None = None  # the run whose measurement is drawn
        self.before_runnable: Config | None = None  # the config shown before a runnable version's result
        self.calibration = None  # engine.compare.calibrate.Calibration
        self.calibration_run: RunRecord | None = None
        self.baseline: Predicted | None = None  # the pinned prediction the current one is compared with
        self._difference: PredictionDiff | None = None
        self._listeners: dict[str, list[Callable[..., Any]]] = {name: [] for name in NOTIFICATIONS}
        self.scan_runs()

    # ------------------------------------------------------------------ listeners

    def subscribe(self, name: str, callback: Callable[..., Any]) -> None:
        """Call ``callback`` on every ``name`` notification (one of :data:`NOTIFICATIONS`)."""
        if name not in self._listeners:
            raise ValueError(f"unknown notification {name!r}: one of {', '.join(NOTIFICATIONS)}")
        self._listeners[name].append(callback)

    def _notify(self, name: str, *args: Any) -> None:
        for callback in self._listeners[name]:
            callback(*args)

    # ------------------------------------------------------------------ config

    def edit(self, path: str, value: Any) -> bool:
        """Change one field of the desired config (``"parallel.tp"``, 2). True when valid.

        The data-parallel degree follows the GPU count: changing tp, cp, pp or the GPU count
        sets dp = gpus / (cp·tp·pp) when that divides; changing dp sets the GPU count.
        """
        desired = _sections_copy(self.desired)
        section, _, key = path.partition(".")
        if path == "model.preset":
            desired["model"] = {"preset": value, **model_presets()[value]}
            if not desired["model"].get("experts"):
                desired["parallel"]["ep"] = 1  # a dense model has no experts to split
        elif path == "model.size":
            desired["model"].update(value)  # a dict of shape fields from the family
        elif path == "cluster.gpu":
            cl = desired["cluster"]
            # links follow the GPU kind's platform: let the parser fill them in again
            desired["cluster"] = {"gpu": value, "gpus": cl["gpus"], "gpus_per_node": cl["gpus_per_node"]}
        elif path == "cluster.preset":  # the preset's GPU kind and links; the GPU count stays the layout's
            cl = desired["cluster"]
            table = cluster_presets().get(value, {}) if isinstance(value, str) else {}
            desired["cluster"] = {**cl, **table, "gpus": cl["gpus"], "preset": value}
            if not value:
                desired["cluster"].pop("preset")
        elif path == "model.hf_config":  # the config.json's architecture, at the sequence length shown
            model = {k: v for k, v in desired["model"].items() if k not in ("hf_config", "preset")}
            try:
                fields = read_hf_config(Path(value).expanduser()) if value else {}
            except (HFConfigError, TypeError, ValueError):
                fields = {}  # the config says why (model.hf_config), the fields shown stay
            desired["model"] = {**model, **fields, "seq_len": model["seq_len"]}
            if value:
                desired["model"]["hf_config"] = value
        elif path.startswith("cluster.gpu."):  # one of the GPU's own numbers: a custom table of its kind's
            gpu = desired["cluster"]["gpu"]
            table = dict(gpu) if isinstance(gpu, dict) else {"name": gpu, **gpu_presets().get(gpu, {})}
            table[path.rsplit(".", 1)[1]] = value
            desired["cluster"]["gpu"] = table
        else:
            desired[section][key] = value
        par, cl = desired["parallel"], desired["cluster"]
        if path in LAYOUT_FIELDS:
            tp_pp = par["tp"] * par["pp"] * par.get("cp", 1)
            if cl["gpus"] % tp_pp == 0:
                par["dp"] = cl["gpus"] // tp_pp
        elif path == "parallel.dp":
            cl["gpus"] = par["dp"] * par["tp"] * par["pp"] * par.get("cp", 1)
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

    def dataparallel_scaling(self) -> tuple[list[dict], str]:
        """nn.DataParallel against DDP on 1, 2, 4, … GPUs of one node for the valid config (``dataparallel_scaling``)."""
        return dataparallel_scaling(self.config)

    def use_dataparallel(self) -> bool:
        """Switch to legacy nn.DataParallel and make the layout one it can run (dp = every GPU)."""
        desired = _sections_copy(self.desired)
        for path, value in self.dataparallel_changes().items():
            section, _, key = path.partition(".")
            desired[section][key] = value
        par, cl = desired["parallel"], desired["cluster"]
        par["dp_mode"] = "dataparallel"
        par["dp"] = cl["gpus"]
        self.touched = "parallel.dp_mode"
        return self.set_desired(desired)

    def set_desired(self, desired: dict[str, Any], *, remember: bool = True) -> bool:
        """Take ``desired`` as what the controls show; when it is valid it becomes the config. The desired
        config before it is kept for :meth:`undo` (``remember``)."""
        if remember and desired != self.desired:
            self._remember(self.desired)
        self.desired = desired
        try:
            cfg = self._fast_config(desired) or Config.from_dict(desired)
        except ConfigError as exc:
            self.problems = self._attribute(exc.problems)
            self._notify("desired", self.desired)
            self._notify("problems", self.problems)
            return False
        self.problems = {}
        self._notify("desired", self.desired)
        self._notify("problems", self.problems)
        if cfg != self.config:
            self.config = cfg
            self.stale = True
            self._notify("config", cfg)
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

    # ------------------------------------------------------------------ undo, redo

    #: a change of the same field within this many seconds of the last is one step (a slider's drag)
    UNDO_MERGE_S = 1.0
    UNDO_DEPTH = 200

    def _remember(self, before: dict[str, Any]) -> None:
        now = time.monotonic()
        last_field, last_t = self._last_change
        if not (self._undo and self.touched is not None and self.touched == last_field
                and now - last_t < self.UNDO_MERGE_S):
            self._undo.append(before)
            del self._undo[:-self.UNDO_DEPTH]
        self._redo.clear()
        self._last_change = (self.touched, now)

    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    def undo(self) -> bool:
        """Back to the desired config before the last change (a drag of one control is one change)."""
        if not self._undo:
            return False
        self._redo.append(self.desired)
        self._restore(self._undo.pop())
        return True

    def redo(self) -> bool:
        """The change :meth:`undo` took back, again."""
        if not self._redo:
            return False
        self._undo.append(self.desired)
        self._restore(self._redo.pop())
        return True

    def _restore(self, desired: dict[str, Any]) -> None:
        self.touched = None
        self._last_change = (None, 0.0)
        self.set_desired(copy.deepcopy(desired), remember=False)

    def reset_to_default(self) -> None:
        """The embedded default config (undoable)."""
        self.set_config(default_config())

    def set_config(self, cfg: Config) -> None:
        """Replace everything (a file was opened, a run was shown); undoable."""
        if cfg.to_dict() != self.desired:
            self.touched = None
            self._remember(self.desired)
        self.config = cfg
        self.touched = None
        self.desired = cfg.to_dict()
        self.problems = {}
        self.stale = True
        self._notify("desired", self.desired)
        self._notify("problems", self.problems)
        self._notify("config", cfg)

    def _attribute(self, problems: list[Problem]) -> dict[str, list[Problem]]:
        """Problems grouped by the control that shows them.

        A world-size mismatch is reported by the config on ``parallel.dp``; when the person
        just moved tp, pp or the GPU count (and dp could not follow), show it there.
        """
        out: dict[str, list[Problem]] = {}
        par, cl = self.desired["parallel"], self.desired["cluster"]
        for p in problems:
            control = control_for_field(p.field)
            if (p.field == "parallel.dp" and self.touched in LAYOUT_FIELDS
                    and isinstance(cl.get("gpus"), int)
                    and cl["gpus"] % (par["tp"] * par["pp"] * par.get("cp", 1))):
                control = self.touched
            out.setdefault(control, []).append(p)
        return out

    def load(self, path: str | Path) -> None:
        self.set_config(Config.load(path))

    def save(self, path: str | Path) -> Path:
        return self.config.save(path)

    # ------------------------------------------------------------------ prediction

    def recompute(self) -> Predicted:
        """Predict the valid config now (calibrated when a calibration is set)."""
        return self.accept(prepared(predict(self.config, self.calibration)))

    def request(self) -> tuple[Config, Any]:
        """What a prediction made elsewhere (the window's worker thread) needs: the config and the
        calibration as they are now."""
        return self.config, self.calibration

    def accept(self, pred: Predicted) -> Predicted | None:
        """A prediction made of ``request()``'s config, taken as the current one; None (dropped) when
        the config or the calibration changed meanwhile: a later request will bring the current one."""
        source = None if self.calibration is None else str(self.calibration.source)
        timed_as_asked = pred.calibrated_from == source or bool(pred.calibration_error)  # (or it could not be)
        if pred.config != self.config or not timed_as_asked:
            return None
        self.recompute_count += 1
        self.prediction = pred
        self.stale = False
        self._notify("prediction", self.prediction)
        return self.prediction

    def set_calibration(self, record: RunRecord | None) -> None:
        """Time predictions with what ``record`` measured (``load_calibration``), or analytically (None).

        Raises ``engine.compare.calibrate.CalibrationError`` / OSError when the run cannot calibrate.
        """
        if record is None:
            self.calibration, self.calibration_run = None, None
        else:
            from engine.compare.calibrate import load_calibration

            self.calibration = load_calibration(record.out_dir)
            self.calibration_run = record
        retimed = self.baseline is not None
        if retimed:  # both sides timed the same way: the baseline's config again, under this calibration
            self.baseline = predict(self.baseline.config, self.calibration)
        self.recompute()
        self._notify("calibration", record)
        if retimed:
            self._notify("baseline", self.baseline)

    # ------------------------------------------------------------------ baseline

    def pin_baseline(self) -> Predicted:
        """Keep the current prediction (of the valid config; predicted first when stale) as the
        baseline that every later prediction is compared with (:attr:`difference`).

        The baseline stays through edits, opened configs and shown runs (comparing across them is
        its point). A calibration set or cleared re-times it (its config predicted again once,
        with the session's calibration), so the difference never mixes analytic and calibrated
        times; its memory is the same either way. Only :meth:`clear_baseline` drops it.
        """
        pred = self.prediction if self.prediction is not None and not self.stale else self.recompute()
        self.baseline = pred
        self._notify("baseline", pred)
        return pred

    def clear_baseline(self) -> None:
        """Drop the baseline (nothing is compared any more)."""
        if self.baseline is not None:
            self.baseline = None
            self._difference = None
            self._notify("baseline", None)

    @property
    def difference(self) -> PredictionDiff | None:
        """The current prediction against the baseline (None without either); computed once per
        pair, when first read after a new prediction."""
        base, cur = self.baseline, self.prediction
        if base is None or cur is None:
            return None
        diff = self._difference
        if diff is None or diff.baseline is not base or diff.current is not cur:
            diff = self._difference = compare_predictions(base, cur)
        return diff

    def predict_for(self, cfg: Config) -> Predicted:
        """The prediction of ``cfg`` as the session currently predicts (calibrated or not)."""
        pred = self.prediction
        source = None if self.calibration is None else str(self.calibration.source)
        if pred is not None and pred.config == cfg and pred.prediction is not None and pred.calibrated_from == source:
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
            self._notify("runs")
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
        self._notify("runs")
        self.show_run(record)
        return record

    def show_run(self, record: RunRecord) -> bool:
        """Load the run's config and draw its measurement over that config's prediction. False
        when there is nothing to draw (no config, no measurement, or the run is still going)."""
        if record.config is None or record is self.active:
            return False
        record.load_measurement()
        if record.measurement is None:
            return False
        self.shown = record
        if record.config != self.config:
            self.set_config(record.config)
            self.recompute()  # draw the measurement over its own config's prediction, not a stale one
        self._notify("shown", record)
        return True

    def back_from_runnable(self) -> None:
        """Return to the config a runnable version was made from."""
        if self.before_runnable is not None:
            cfg, self.before_runnable = self.before_runnable, None
            self.set_config(cfg)

    # ------------------------------------------------------------------ a launched run

    @property
    def running(self) -> bool:
        return self.active is not None

    def begin_run(self, cfg: Config | None = None, *, simulate: bool = False, runnable_of: Config | None = None,
                  target: RunTarget | None = None, dry_run: bool = False) -> RunRecord:
        """A new run directory under ``runs_dir`` with ``cfg`` (default: the current config) saved
        in it, and its record, now the active run. The caller starts the child process.

        ``runnable_of``: the (too large) config ``cfg`` is the runnable version of. ``target``:
        where it runs (default this machine); ``dry_run``: print the sbatch script or the per-host
        commands without submitting anything.
        """
        if self.active is not None:
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
        cfg.save(out_dir / "config.toml")
        record = RunRecord(config=cfg, out_dir=out_dir, simulated=simulate, runnable_of=runnable_of,
                           target=target, dry_run=dry_run)
        self.runs.append(record)
        self.active = record
        return record

    def launched(self, command: list[str]) -> None:
        """The active run's child was started with ``command``."""
        assert self.active is not None
        self.active.log.append("$ " + " ".join(command))
        self._notify("runs")

    def take_line(self, line: str) -> None:
        """One line the active run's child printed on stdout: a JSON event, or printed text (a dry
        run's script). A simulation prints one JSON document at the end, not events: ignored."""
        record = self.active
        if record is None or record.simulated:
            return
        line = line.rstrip()
        if not line.strip():
            if record.printed:  # keep a script's blank lines
                self._printed(record, "")
            return
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            self._printed(record, line)
            return
        if isinstance(event, dict):
            apply_event(record, event)
            self._notify("run_event", record, event)

    def take_error_line(self, line: str) -> None:
        """One line the active run's child printed on stderr: into the log."""
        if self.active is not None and line.strip():
            self.active.log.append(line)
            self._notify("run_event", self.active, {"event": "log", "text": line})

    def _printed(self, record: RunRecord, line: str) -> None:
        record.printed.append(line)
        record.log.append(line)
        self._notify("run_event", record, {"event": "log", "text": line})

    def cancelled(self) -> RunRecord | None:
        """The person cancelled the active run (the caller stops its child)."""
        record = self.active
        if record is not None:
            record.status = RunStatus.CANCELLED
            record.reason = "cancelled by the user"
        return record

    def could_not_start(self) -> None:
        """The active run's child could not be started."""
        if self.active is not None:
            self.active.status = RunStatus.FAILED
            self.active.reason = "the backend could not be started"
            self._end()

    def exited(self, exit_code: int) -> None:
        """The active run's child ended with ``exit_code``: conclude the record (a finished run
        reads its measurement.json; a dry run keeps what it printed as dry-run.txt)."""
        record = self.active
        if record is None:
            return
        ended = (RunStatus.FAILED, RunStatus.CANCELLED)
        if record.dry_run and record.status not in ended:
            if exit_code == 0:
                record.status, record.reason = RunStatus.DRY_RUN, "nothing was submitted"
                (record.out_dir / DRY_RUN_FILE).write_text("\n".join(record.printed) + "\n", encoding="utf-8")
            else:
                record.status = RunStatus.FAILED
                record.reason = record.reason or f"the dry run exited with code {exit_code}"
            self._end()
            return
        if record.status not in ended:
            if exit_code != 0:
                record.status = RunStatus.FAILED
                record.reason = record.reason or f"the backend exited with code {exit_code}"
            else:
                record.status = RunStatus.FINISHED
        if record.status == RunStatus.FINISHED:
            path = record.out_dir / "measurement.json"
            try:
                record.measurement = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                record.status = RunStatus.FAILED
                record.reason = f"no readable measurement.json: {exc}"
            else:
                if record.simulated:
                    record.measurement["simulated"] = True
                    ranks = [r.get("rank") for r in record.measurement.get("memory", {}).get("per_rank", [])]
                    record.log.append(f"simulated ranks {ranks} on a fake process group (memory only)")
                    record.log += [f"tracker: {w}" for w in record.measurement.get("warnings") or []]
                    record.log += [f"not covered: {n}" for n in record.measurement.get("not_covered") or []]
        self._end()

    def _end(self) -> None:
        record, self.active = self.active, None
        if record is None:
            return
        record.log.append(f"-- {record.status}" + (f": {record.reason}" if record.reason else ""))
        self._notify("run_finished", record)
        self._notify("runs")
        # draw it, unless the person has moved on to another config meanwhile (it stays in the list)
        if record.status == RunStatus.FINISHED and record.measurement is not None and record.config is not None:
            if record.config == self.config:
                self.show_run(record)
            elif record.runnable_of is not None and record.runnable_of == self.config:
                self.before_runnable = self.config
                self.show_run(record)
