"""gui.session.Session without a window: edits, problems, prediction, runs and their events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.events import describe
from backend.records import RunStatus
from engine import default_config
from gui.runs import RunRecord, RunTarget, apply_event, read_run_dir
from gui.session import Session

ROOT = Path(__file__).resolve().parents[2]


class Heard:
    """Every notification a session sends, in order."""

    def __init__(self, session: Session):
        self.calls: list[tuple] = []
        for name in ("desired", "problems", "config", "prediction", "runs", "run_event", "run_finished", "shown",
                     "calibration"):
            session.subscribe(name, lambda *args, _name=name: self.calls.append((_name, *args)))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def session(tmp_path):
    return Session(default_config(), runs_dir=tmp_path / "runs")


def test_the_session_imports_no_qt():
    code = ("import sys, gui.session; s = gui.session.Session(runs_dir='no-such-dir'); s.recompute(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_edit_changes_the_config_and_dp_follows_the_gpu_count(session):
    heard = Heard(session)
    assert session.stale and session.prediction is None
    assert session.edit("cluster.gpus", 8)
    assert session.config.cluster.gpus == 8 and session.config.parallel.dp == 4  # 8 / (tp 1 · pp 2)
    assert session.desired["parallel"]["dp"] == 4
    assert heard.names() == ["desired", "problems", "config"]
    assert heard.calls[2][1] is session.config and session.stale
    assert session.edit("parallel.dp", 1)  # dp sets the GPU count
    assert session.config.cluster.gpus == 2


def test_an_invalid_edit_keeps_the_last_valid_config_and_names_its_control(session):
    valid = session.config
    heard = Heard(session)
    assert not session.edit("parallel.tp", 3)  # 4 GPUs: dp cannot follow, and 3 does not divide the heads
    assert session.config is valid
    assert session.desired["parallel"]["tp"] == 3  # the controls show what the person asked for
    assert "config" not in heard.names() and heard.names() == ["desired", "problems"]
    problems = session.problems
    assert set(problems) == {"parallel.tp"}  # the world-size mismatch is shown where the person moved
    assert {p.field for p in problems["parallel.tp"]} == {"parallel.dp", "parallel.tp"}
    assert not session.edit("model.hidden", -5)  # a shape field belongs to the size control
    assert "model.size" in session.problems and session.config is valid
    assert session.edit("model.hidden", valid.model.hidden) is False  # tp 3 is still wrong
    assert session.edit("parallel.tp", 1) and not session.problems
    assert session.config == valid


def test_prediction_follows_the_valid_config(session):
    heard = Heard(session)
    first = session.recompute()
    assert not session.stale and session.prediction is first and first.config == session.config
    assert first.prediction is not None and not first.error and not first.calibration_error
    assert heard.calls[-1] == ("prediction", first)
    session.edit("parallel.microbatches", 8)
    assert session.stale and session.prediction is first
    second = session.recompute()
    assert second.config.parallel.microbatches == 8 and session.recompute_count == 2
    assert second.prediction.pipeline.microbatches == 8
    assert session.predict_for(session.config) is second  # the current prediction is reused
    other = default_config()
    assert session.predict_for(other).config == other


def test_dataparallel_switch_makes_a_layout_it_can_run(session):
    assert session.dataparallel_changes() == {"parallel.pp": 1}
    assert session.use_dataparallel()
    par = session.config.parallel
    assert (par.dp_mode, par.tp, par.pp, par.dp) == ("dataparallel", 1, 1, session.config.cluster.gpus)


def _write_run(d: Path, cfg, events, measurement=None):
    d.mkdir(parents=True)
    cfg.save(d / "config.toml")
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "st')
    if measurement is not None:
        (d / "measurement.json").write_text(json.dumps(measurement))


def _measurement(cfg) -> dict:
    from engine.predict import predict

    pred = predict(cfg)
    rows = [{"rank": r.rank, "stage": list(r.stages)[0], **{c: int(getattr(r, c)) for c in
            ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries", "overhead")},
             "total": int(r.total)} for r in pred.memory.per_rank]
    return {"memory": {"per_rank": rows}, "pipeline": {"per_rank": []},
            "step": {"seconds": pred.step.seconds, "per_step": [], "losses": []}, "ranks": []}


def test_scanning_a_runs_dir_lists_each_run_with_its_status(tmp_path):
    runs = tmp_path / "runs"
    cfg = default_config().replace(parallel={"microbatches": 8})
    _write_run(runs / "a", cfg, [{"event": "started", "steps": 3}, {"event": "step", "k": 3, "n": 3, "loss": 5.0,
                                                                     "seconds": 0.1}, {"event": "finished"}],
               _measurement(cfg))
    _write_run(runs / "b", default_config(), [{"event": "started"}, {"event": "failed", "reason": "rank 1 died"}])
    _write_run(runs / "c", default_config(), [{"event": "started"}])
    _write_run(runs / "d", default_config(), [])
    (runs / "e").mkdir()
    (runs / "e" / "config.toml").write_text("not = [toml")
    (runs / "not-a-run").mkdir()
    session = Session(default_config(), runs_dir=runs)
    assert [(r.name, r.status) for r in session.runs] == [
        ("a", RunStatus.FINISHED), ("b", RunStatus.FAILED), ("c", RunStatus.INCOMPLETE), ("d", RunStatus.EMPTY),
        ("e", RunStatus.UNREADABLE)]
    a = session.runs[0]
    assert (a.step, a.steps) == (3, 3) and a.label == "a · finished"
    assert "step 3/3  loss 5.0000  100.0 ms" in a.log  # the CLI's words, not JSON
    assert not any("{" in line for r in session.runs for line in r.log)
    assert "rank 1 died" in session.runs[1].reason
    heard = Heard(session)
    assert session.scan_runs() == []  # nothing new
    _write_run(runs / "f", default_config(), [{"event": "finished"}], _measurement(default_config()))
    assert [r.name for r in session.scan_runs()] == ["f"] and heard.names() == ["runs"]
    # showing a run loads its config and predicts it, then says what is drawn
    assert session.show_run(a)
    assert session.config == cfg and session.shown is a and session.prediction.config == cfg
    assert heard.names()[-2:] == ["prediction", "shown"]
    failed = next(r for r in session.runs if r.name == "b")
    assert not session.show_run(failed) and session.shown is a  # failed: nothing to draw


def test_run_events_are_applied_to_a_record(tmp_path):
    record = RunRecord(config=default_config(), out_dir=tmp_path / "r")
    assert record.status is RunStatus.STARTING
    for event in ({"event": "submitted", "job_id": "7", "script": "job.sbatch"},
                  {"event": "job_state", "job_id": "7", "state": "RUNNING", "nodes": "n1"}):
        apply_event(record, event)
    assert record.status == RunStatus.RUNNING
    apply_event(record, {"event": "started", "world": 4, "steps": 5})
    apply_event(record, {"event": "step", "k": 2, "n": 5, "loss": 5.5, "seconds": 0.01})
    assert (record.status, record.step, record.steps) == (RunStatus.RUNNING, 2, 5)
    apply_event(record, {"event": "failed", "reason": "rank 1 failed: boom", "rank": 1})
    apply_event(record, {"event": "finished", "seconds": 1.0})  # a failure is not undone
    assert record.status == RunStatus.FAILED and record.reason == "rank 1 failed: boom"
    assert record.log == [describe(e) for e in record.events]
    assert record.log[0] == "submitted Slurm job 7 (job.sbatch)"


def test_a_launched_run_from_output_lines_to_a_shown_measurement(session):
    heard = Heard(session)
    record = session.begin_run(session.config)
    assert session.running and session.active is record and record in session.runs
    assert (record.out_dir / "config.toml").exists()
    with pytest.raises(RuntimeError, match="already in progress"):
        session.begin_run()
    session.launched(["python", "-m", "gui.cli", "run"])
    for line in (json.dumps({"event": "started", "world": 4, "steps": 2}), "not json: printed text", "",
                 json.dumps({"event": "step", "k": 1, "n": 2, "loss": 6.0, "seconds": 0.2}),
                 json.dumps({"event": "finished", "seconds": 3.0})):
        session.take_line(line)
    session.take_error_line("a warning on stderr")
    assert record.log[1:] == ["started 4 ranks, 2 steps", "not json: printed text", "", "step 1/2  loss 6.0000  200.0 ms",
                              "finished in 3.0 s", "a warning on stderr"]
    assert record.printed == ["not json: printed text", ""]
    kinds = [c[2]["event"] for c in heard.calls if c[0] == "run_event"]
    assert kinds == ["started", "log", "log", "step", "finished", "log"]
    (record.out_dir / "measurement.json").write_text(json.dumps(_measurement(session.config)))
    session.exited(0)
    assert record.status == RunStatus.FINISHED and record.measurement is not None
    assert not session.running and session.shown is record
    assert record.log[-1] == "-- finished"
    assert heard.names()[-3:] == ["run_finished", "runs", "shown"]


def test_a_run_that_exits_badly_or_is_cancelled(session):
    record = session.begin_run()
    session.exited(3)
    assert record.status == RunStatus.FAILED and record.reason == "the backend exited with code 3"
    record = session.begin_run()
    assert session.cancelled() is record
    session.exited(-15)
    assert record.status == RunStatus.CANCELLED and record.log[-1] == "-- cancelled: cancelled by the user"
    with pytest.raises(ValueError, match="dry run needs a Slurm or hosts target"):
        session.begin_run(dry_run=True)
    with pytest.raises(ValueError, match="name the hosts"):
        session.begin_run(target=RunTarget("hosts"))


def test_a_record_written_before_loads_and_an_unknown_status_is_a_clear_error(tmp_path):
    old = read_run_dir(_run_from_before(tmp_path))
    assert old.status == "finished" and old.status is RunStatus.FINISHED  # str-valued: old comparisons hold
    assert json.dumps({"status": old.status}) == '{"status": "finished"}'
    assert RunStatus.parse("dry run") is RunStatus.DRY_RUN
    with pytest.raises(ValueError, match=r"run status 'done' is not one of 'starting', .*'unreadable'"):
        RunStatus.parse("done")
    with pytest.raises(ValueError, match="run status 'done'"):
        RunRecord(config=None, out_dir=tmp_path, status="done")
    assert RunRecord(config=None, out_dir=tmp_path, status="running").status is RunStatus.RUNNING


def _run_from_before(tmp_path: Path) -> Path:
    """A run directory as the backend wrote it before RunStatus existed."""
    d = tmp_path / "runs" / "20250101-000000"
    _write_run(d, default_config(), [{"event": "started", "time": 1.0, "world": 4, "steps": 1,
                                      "command": ["python"], "run_dir": str(d)},
                                     {"event": "finished", "time": 2.0, "seconds": 1.0}],
               _measurement(default_config()))
    return d


def test_undo_takes_back_a_drag_of_one_control_in_one_step_and_redo_repeats_it(monkeypatch):
    """Issue 27, item 3: no undo, no redo, no reset. Edits of one field within a second are one step (a
    slider's drag); another field, or a pause, starts the next."""
    import gui.session as session_module

    clock = [100.0]
    monkeypatch.setattr(session_module.time, "monotonic", lambda: clock[0])
    s = Session(default_config())
    start = s.config
    assert not s.can_undo and not s.undo()
    for mb in (2, 4, 8):  # a drag: three values of one field within a second
        clock[0] += 0.1
        assert s.edit("parallel.microbatches", mb)
    clock[0] += 5.0
    assert s.edit("training.recompute", "full")
    assert s.config.parallel.microbatches == 8 and s.config.training.recompute == "full"
    assert s.undo() and s.config.training.recompute == start.training.recompute
    assert s.config.parallel.microbatches == 8
    assert s.undo() and s.config == start  # the whole drag in one step
    assert not s.can_undo and s.can_redo
    assert s.redo() and s.config.parallel.microbatches == 8
    assert s.redo() and s.config.training.recompute == "full" and not s.can_redo
    clock[0] += 5.0
    assert s.undo()  # something to redo again ...
    assert s.can_redo
    s.edit("parallel.microbatches", 2)  # ... until a new change: it forgets what could be redone
    assert not s.can_redo
    s.reset_to_default()
    assert s.config == default_config() and s.can_undo
    assert s.undo() and s.config != default_config()  # the reset itself is undoable


def test_undo_goes_back_over_an_invalid_edit_and_a_replaced_config():
    s = Session(default_config())
    start = s.config
    assert not s.edit("parallel.tp", 3)  # invalid: the controls show it, the config stays
    assert s.problems and s.config == start
    assert s.undo() and not s.problems and s.desired == start.to_dict()
    other = start.replace(training={"micro_batch_size": 1})
    s.set_config(other)  # a file opened, a run shown, a planner row applied
    assert s.config == other
    assert s.undo() and s.config == start


def test_runs_go_to_the_per_user_data_folder_by_default_whatever_the_current_directory(tmp_path, monkeypatch):
    """Issue 27, item 1: the window and the CLI keep runs in one place, absolute: $SHARDSCOPE_RUNS_DIR, else
    platformdirs' per-user data folder; a relative runs_dir is taken where the window starts."""
    import platformdirs

    from backend.launch import default_run_dir
    from backend.records import RUNS_DIR_ENV, runs_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUNS_DIR_ENV, raising=False)
    assert runs_root() == platformdirs.user_data_path("shardscope", appauthor=False) / "runs"
    monkeypatch.setenv(RUNS_DIR_ENV, "elsewhere/runs")
    assert runs_root() == tmp_path / "elsewhere" / "runs"
    assert Session(default_config()).runs_dir == tmp_path / "elsewhere" / "runs"
    assert default_run_dir().parent == tmp_path / "elsewhere" / "runs"
    assert Session(default_config(), runs_dir="mine").runs_dir == tmp_path / "mine"
