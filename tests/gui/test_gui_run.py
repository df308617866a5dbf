"""Run panel: launch, stream, overlay, compare, cancel.

A stand-in backend (a tiny script that speaks the backend's JSON-line protocol) checks the
window's side without torch; the end-to-end test runs the tiny preset through the real
backend (``python -m gui.cli run``) when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QApplication  # noqa: E402

from engine import default_config  # noqa: E402
from gui.app import make_window  # noqa: E402
from gui.state import State  # noqa: E402

pytestmark = pytest.mark.gui


CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")


def stand_in_measurement(cfg, *, ranks=None) -> dict:
    """measurement.json for ``cfg``: every category "measured" = predicted × 1.1 (error -9.1 %),
    overhead 0 (a CPU/gloo run has no CUDA context), timeline stretched by 1.2."""
    from engine.predict import predict

    pred = predict(cfg)
    tl = pred.pipeline
    par = cfg.parallel
    rows = [r for r in pred.memory.per_rank if ranks is None or r.rank in ranks]
    per_rank = []
    for r in rows:
        row = {"rank": r.rank, "stage": list(r.stages)[0], **{c: int(getattr(r, c) * 1.1) for c in CATEGORIES},
               "overhead": 0}
        row["total"] = sum(row[c] for c in (*CATEGORIES, "overhead"))
        per_rank.append(row)
    return {
        "memory": {"per_rank": per_rank},
        "pipeline": {"per_rank": [{"rank": tl.global_ranks[p],
                                   "actions": [[k, s, m, a * 1.2, b * 1.2] for k, s, m, a, b in tl.actions_of_rank(p)]}
                                  for p in range(par.pp)] if ranks is None else []},
        "step": {"seconds": pred.step.seconds * 1.2, "per_step": [pred.step.seconds * 1.2] * 3, "losses": []},
        "ranks": [{"rank": r.rank} for r in rows],
    }


def stand_in_backend(tmp_path, cfg, *, sleep_s: float = 0.0, name: str = "backend.py") -> str:
    """A script that prints the backend's events and writes a measurement.json for ``cfg``."""
    measurement = stand_in_measurement(cfg)
    script = tmp_path / name
    script.write_text(textwrap.dedent(f"""
        import json, sys, time, pathlib
        out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
        print(json.dumps({{"event": "started", "world": 4, "steps": 3}}), flush=True)
        for k in range(1, 4):
            time.sleep({sleep_s})
            print(json.dumps({{"event": "step", "k": k, "n": 3, "loss": 6.0 - k, "seconds": 0.1}}), flush=True)
        (out / "measurement.json").write_text({json.dumps(json.dumps(measurement))})
        print(json.dumps({{"event": "finished"}}), flush=True)
    """))
    return str(script)


def stand_in_simulator(tmp_path, cfg) -> str:
    """`measure --fake` stand-in: one rank per pipeline stage, marked simulated, one JSON document out."""
    from backend.fake import default_ranks

    ranks = default_ranks(cfg)
    measurement = stand_in_measurement(cfg, ranks=set(ranks))
    measurement.update(simulated=True, simulated_ranks=ranks, warnings=[],
                       not_covered=["the CUDA context and NCCL buffers"])
    script = tmp_path / "simulator.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, pathlib
        out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
        assert "--fake" in sys.argv and "--json" in sys.argv
        doc = json.loads({json.dumps(json.dumps(measurement))})
        (out / "measurement.json").write_text(json.dumps(doc))
        print(json.dumps(doc, indent=1), flush=True)  # several lines: not an event stream
    """))
    return str(script)


@pytest.fixture
def window(qtbot, tmp_path):
    w = make_window(State(default_config(), runs_dir=tmp_path / "runs"))
    qtbot.addWidget(w)
    w.resize(1500, 950)
    w.show()
    w.state.recompute_now()
    return w


def use_backend(state, script):
    state.run_command = lambda cfg_path, out_dir, *_target: [sys.executable, script, str(cfg_path), "--out",
                                                               str(out_dir)]


def test_run_streams_events_and_overlays_measurements(window, qtbot, tmp_path):
    use_backend(window.state, stand_in_backend(tmp_path, window.state.config))
    mem_before = window.memory.plot.grab().toImage()
    with qtbot.waitSignal(window.state.runFinished, timeout=20000) as blocker:
        qtbot.mouseClick(window.run_panel.run_button, __import__("PySide6.QtCore").QtCore.Qt.MouseButton.LeftButton)
    record = blocker.args[0]
    assert record.status == "finished", record.log
    log = window.run_panel.log.toPlainText()
    assert "step 3/3" in log
    assert "started 4 ranks, 3 steps" in log and '{"' not in log  # the events in words, not JSON
    assert window.run_panel.progress.value() == 3
    # measured memory beside the predicted bars, measured timeline as a second lane
    assert window.memory.measured_by_rank
    assert window.memory.plot.grab().toImage() != mem_before
    assert len(window.timeline.measured) == len(window.timeline.predicted)
    assert "measured makespan" in window.timeline.header.text()
    # each action kind's predicted mean duration against the measured mean, on the header
    tl = window.timeline
    for code, kind in ((0, "F"), (1, "B")):
        p, m = tl.predicted.kind == code, tl.measured.kind == code
        mp, mm = (tl.predicted.end_s - tl.predicted.start_s)[p].mean(), (tl.measured.end_s - tl.measured.start_s)[m].mean()
        assert f"{kind} {(mp - mm) / mm * 100:+.0f}%" in tl.header.text(), tl.header.text()
    # the comparison table is engine.compare.measured's: every rank × category, error -9.1 %, with the causes
    from engine.compare.measured import compare
    from engine.predict import predict

    cmp = compare(predict(record.config), record.measurement)
    rows = window.run_panel.rows
    assert {r.quantity for r in rows} >= {"params", "activations", "total", "pipeline makespan", "bubble",
                                          "action order identical?", "step time"}
    params = [r for r in rows if r.quantity == "params"]
    assert len(params) == len(cmp.memory) == record.config.parallel.world_size
    assert all(abs(r.error - (-100 / 11)) < 0.1 for r in params)
    overhead = next(r for r in rows if r.quantity == "overhead")
    assert "CPU/gloo run" in overhead.note  # engine.compare.measured's explanation, shown beside the number
    order = next(r for r in rows if r.quantity == "action order identical?")
    assert order.measured == "yes"
    # one action's mean duration per kind, predicted against measured, beside the timeline header's error
    for kind, cell in cmp.action_kinds().items():
        row = next(r for r in rows if r.quantity == f"{kind} action (mean)")
        assert (row.predicted, row.measured) == pytest.approx((cell.predicted, cell.measured))
        assert row.error == pytest.approx(cell.relative * 100)
    assert {"F action (mean)", "B action (mean)"} <= {r.quantity for r in rows}
    bubble = next(r for r in rows if r.quantity == "bubble")
    assert bubble.predicted == pytest.approx(cmp.bubble.predicted) and bubble.measured == pytest.approx(cmp.bubble.measured)
    step = next(r for r in rows if r.quantity == "step time")
    assert step.error == pytest.approx(cmp.step.relative * 100)
    assert window.run_panel.table.rowCount() == len(rows)
    table_text = [window.run_panel.table.item(i, 5).text() for i in range(len(rows))]
    assert any("CPU/gloo run" in t for t in table_text)
    csv_path = window.run_panel.export_csv(tmp_path / "cmp.csv")
    assert csv_path.read_text().startswith("rank,quantity,predicted,measured,error_percent")
    # the calibration toggle: this run's timings re-time the prediction (step and timeline)
    analytic_step = window.state.prediction.prediction.step.seconds
    assert window.run_panel.calibrate_box.isEnabled()
    window.run_panel.calibrate_box.setChecked(True)
    assert window.state.prediction.calibrated_from == str(record.out_dir)
    assert window.state.prediction.prediction.step.seconds != pytest.approx(analytic_step)
    assert "calibration" in window.timeline.header.text()
    assert "calibrated" in window.run_panel.table_title.text()
    window.run_panel.calibrate_box.setChecked(False)
    assert window.state.prediction.calibrated_from is None
    assert window.state.prediction.prediction.step.seconds == pytest.approx(analytic_step)
    # moving on to another config drops the overlay (it belongs to the config that ran)
    window.state.edit("parallel.microbatches", 8)
    window.state.recompute_now()
    assert not window.memory.measured_by_rank and len(window.timeline.measured) == 0


def test_cancel_stops_the_run(window, qtbot, tmp_path):
    use_backend(window.state, stand_in_backend(tmp_path, window.state.config, sleep_s=5))
    window.run_panel.start()
    assert window.run_panel.cancel_button.isEnabled()
    qtbot.waitUntil(lambda: window.state._active is not None and window.state._active.status == "running",
                    timeout=10000)
    with qtbot.waitSignal(window.state.runFinished, timeout=10000) as blocker:
        qtbot.mouseClick(window.run_panel.cancel_button, __import__("PySide6.QtCore").QtCore.Qt.MouseButton.LeftButton)
    assert blocker.args[0].status == "cancelled"
    assert window.run_panel.run_button.isEnabled()
    assert "cancelled" in window.run_panel.status.text()
    assert not window.memory.measured_by_rank


def _backend_available() -> bool:
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("backend.launch") is not None


@pytest.mark.integration
@pytest.mark.skipif(not _backend_available(), reason="the backend (torch + backend.launch) is not installed")
def test_tiny_preset_end_to_end_through_the_backend(window, qtbot):
    with qtbot.waitSignal(window.state.runFinished, timeout=240000) as blocker:
        window.run_panel.start()
    record = blocker.args[0]
    assert record.status == "finished", "\n".join(record.log[-20:])
    # the live log says each event in the CLI's words (backend.events.describe); events.jsonl keeps the JSON
    from backend.events import describe
    from backend.records import read_jsonl

    events = read_jsonl(record.out_dir / "events.jsonl")
    assert [e["event"] for e in events][0] == "started" and events[-1]["event"] == "finished"
    log = window.run_panel.log.toPlainText()
    for event in events:
        assert describe(event) in log
    assert '{"' not in log
    assert f"started {record.config.parallel.world_size} ranks, " in log and "finished in " in log
    QApplication.processEvents()
    assert window.memory.measured_by_rank
    assert len(window.timeline.measured) > 0
    assert any(r.quantity == "total" for r in window.run_panel.rows)
    # a real CPU run calibrates: the step is re-timed with what it measured
    window.run_panel.calibrate_box.setChecked(True)
    assert window.state.prediction.calibrated_from == str(record.out_dir)
    step = next(r for r in window.run_panel.rows if r.quantity == "step time")
    assert "calibrated" in step.note


def test_simulate_at_scale_is_shown_like_a_measurement(window, qtbot, tmp_path):
    cfg = window.state.config
    script = stand_in_simulator(tmp_path, cfg)
    window.state.simulate_command = lambda cfg_path, out_dir: [sys.executable, script, str(cfg_path), "--fake",
                                                               "--out", str(out_dir), "--json"]
    with qtbot.waitSignal(window.state.runFinished, timeout=20000) as blocker:
        window.run_panel.simulate_button.click()
    record = blocker.args[0]
    assert record.status == "finished", record.log
    assert record.simulated and record.measurement["simulated"] is True
    assert record.out_dir.name.endswith("-fake")
    QApplication.processEvents()
    # drawn over the prediction like a run, and compared, memory only
    from backend.fake import default_ranks

    assert set(window.memory.measured_by_rank) == set(default_ranks(cfg))
    assert "outlined bars: simulated" in window.memory.legend.text()
    rows = window.run_panel.rows
    assert {r.rank for r in rows if r.quantity == "total"} == {str(r) for r in default_ranks(cfg)}
    step = next(r for r in rows if r.quantity == "step time")
    assert step.measured is None and "fake tensors" in step.note
    assert any("simulated" in n for n in window.run_panel.notes)
    assert "simulated" in window.run_panel.runs.item(window.run_panel.runs.count() - 1).text()
    assert not window.run_panel.calibrate_box.isEnabled()  # a simulation has no timings to calibrate from


def _write_run(d, cfg, events, measurement=None):
    d.mkdir(parents=True)
    cfg.save(d / "config.toml")
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "st')  # torn line
    if measurement is not None:
        (d / "measurement.json").write_text(json.dumps(measurement))


def test_recent_runs_are_listed_with_status_and_selecting_one_shows_it(qtbot, tmp_path):
    from engine import Config

    runs = tmp_path / "runs"
    measured_cfg = default_config().replace(parallel={"microbatches": 8})
    _write_run(runs / "20260101-000000", measured_cfg,
               [{"event": "started", "steps": 3}, {"event": "step", "k": 3, "n": 3}, {"event": "finished"}],
               stand_in_measurement(measured_cfg))
    _write_run(runs / "20260101-000100", default_config(),
               [{"event": "started"}, {"event": "failed", "reason": "rank 1 died (exit 9)"}])
    _write_run(runs / "20260101-000200", default_config(), [{"event": "started"}])
    w = make_window(State(default_config(), runs_dir=runs))
    qtbot.addWidget(w)
    w.show()
    w.state.recompute_now()
    labels = [w.run_panel.runs.item(i).text() for i in range(w.run_panel.runs.count())]
    assert labels == ["20260101-000000 · finished", "20260101-000100 · failed", "20260101-000200 · incomplete"]
    # at 1280 × 800 each label is whole in the narrow list: it wraps where it does not fit (issue 27, item 6)
    from PySide6.QtCore import Qt as _Qt

    w.resize(1280, 800)
    QApplication.processEvents()
    lst = w.run_panel.runs
    for i in range(lst.count()):
        rect = lst.visualItemRect(lst.item(i))
        room = min(rect.right(), lst.viewport().width()) - rect.left()
        need = lst.fontMetrics().boundingRect(0, 0, room, 10_000, int(_Qt.TextFlag.TextWordWrap), labels[i])
        assert need.width() <= room and need.height() <= rect.height() + 1, (labels[i], rect, room, need)
    w.run_panel.runs.setCurrentRow(1)  # a failed run: its log and reason, nothing drawn
    assert "rank 1 died" in w.run_panel.log.toPlainText()
    assert not w.memory.measured_by_rank
    w.run_panel.runs.setCurrentRow(0)  # the finished one: its config, its measurement, its comparison
    assert w.state.config == measured_cfg and w.controls.microbatches.value() == 8
    assert w.memory.measured_by_rank and len(w.timeline.measured) > 0
    assert any(r.quantity == "total" for r in w.run_panel.rows)
    # File → Open run… on a directory outside runs/
    elsewhere = tmp_path / "elsewhere" / "run-a"
    other = Config.from_dict({**default_config().to_dict(), "parallel": {**default_config().to_dict()["parallel"],
                                                                       "microbatches": 2}})
    _write_run(elsewhere, other, [{"event": "finished"}], stand_in_measurement(other))
    w.state.open_run(elsewhere)
    assert w.run_panel.runs.count() == 4 and w.run_panel.runs.currentRow() == 3
    assert w.state.config == other and w.memory.measured_by_rank


def test_too_large_config_runs_its_runnable_version(window, qtbot, tmp_path):
    from engine import Config
    from gui.runnable import runnable_version

    big = Config.load("assets/examples/llama3-8b-16gpu.toml")
    window.state.set_config(big)
    window.state.recompute_now()
    panel = window.run_panel
    qtbot.waitUntil(lambda: panel.run_button.text() == "▶ Run runnable version", timeout=2000)
    assert panel.runnable_note.isVisible()
    note = panel.runnable_note.text()
    assert "h100-sxm" in note and "tiny" in note and "apples to apples" in note
    small = runnable_version(big).config
    p, q = small.parallel, big.parallel
    assert (p.tp, p.pp, p.zero, p.schedule, p.virtual_stages, p.microbatches, p.sequence_parallel) == \
        (q.tp, q.pp, q.zero, q.schedule, q.virtual_stages, q.microbatches, q.sequence_parallel)
    assert small.training.recompute == big.training.recompute and small.training.precision == big.training.precision
    assert small.cluster.gpu.name == "cpu" and small.model.preset == "tiny" and p.world_size <= 8
    use_backend(window.state, stand_in_backend(tmp_path, small))
    with qtbot.waitSignal(window.state.runFinished, timeout=20000) as blocker:
        panel.run_button.click()
    record = blocker.args[0]
    assert record.status == "finished" and record.config == small and record.runnable_of == big
    QApplication.processEvents()
    # the window now shows the runnable config with its measurement, compared with its own prediction
    assert window.state.config == small
    assert window.memory.measured_by_rank and len(window.timeline.measured) > 0
    assert "runnable" in panel.table_title.text() and "runnable" in panel.status.text()
    params = [r for r in panel.rows if r.quantity == "params"]
    assert all(abs(r.error - (-100 / 11)) < 0.1 for r in params)  # apples to apples: exactly the stand-in's 1.1×
    assert panel.back_button.isVisible()
    panel.back_button.click()
    assert window.state.config == big and not panel.back_button.isVisible()


def test_slurm_dry_run_passes_the_target_and_shows_the_sbatch_script(window, qtbot, tmp_path):
    panel = window.run_panel
    assert panel.dry_run_button.isHidden()  # this machine: nothing to dry-run
    panel.set_target("slurm")
    assert not panel.dry_run_button.isHidden() and not panel.partition.isHidden() and panel.hosts.isHidden()
    assert "Slurm" in panel.run_button.text()
    panel.partition.setText("gpu")
    panel.nodes.setValue(2)
    panel.time_limit.setText("00:30:00")
    panel.account.setText("proj")
    with qtbot.waitSignal(window.state.runFinished, timeout=30000) as blocker:
        panel.dry_run_button.click()
        args = window.state._process.arguments()  # what the QProcess was given
    assert args[:3] == ["-m", "gui.cli", "run"]
    opts = args[3:]
    for flag, value in (("--target", "slurm"), ("--partition", "gpu"), ("--nodes", "2"), ("--time", "00:30:00"),
                        ("--account", "proj")):
        assert opts[opts.index(flag) + 1] == value
    assert "--dry-run" in opts and "--json" in opts and "--hosts" not in opts
    record = blocker.args[0]
    assert record.status == "dry run" and record.dry_run, record.log
    log = panel.log.toPlainText()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=00:30:00", "#SBATCH --account=proj", "#SBATCH --nodes=2"):
        assert line in log
    assert 'bash -c "$per_node"\n-- dry run' in log  # the script's last line has no newline: still shown
    assert "nothing was submitted" in panel.status.text()
    script = (record.out_dir / "dry-run.txt").read_text()
    assert script.startswith("#!/bin/bash") and "#SBATCH --partition=gpu" in script
    assert not (record.out_dir / "measurement.json").exists()
    again = State(default_config(), runs_dir=tmp_path / "runs")  # found on disk later: still a dry run
    assert [r.status for r in again.runs] == ["dry run"]
    assert "#SBATCH --partition=gpu" in "\n".join(again.runs[0].log)


def test_hosts_target_needs_hosts_and_dry_run_prints_one_command_per_host(window, qtbot):
    panel = window.run_panel
    panel.set_target("hosts")
    assert not panel.run_button.isEnabled() and not panel.dry_run_button.isEnabled()
    assert "name the hosts" in panel.target_note.text()
    panel.hosts.setText("a, b")
    assert panel.run_button.isEnabled() and panel.dry_run_button.isEnabled()
    with qtbot.waitSignal(window.state.runFinished, timeout=30000) as blocker:
        panel.dry_run_button.click()
        args = window.state._process.arguments()
    assert args[args.index("--target") + 1] == "hosts" and args[args.index("--hosts") + 1] == "a,b"
    assert "--partition" not in args and "--dry-run" in args
    assert blocker.args[0].status == "dry run", blocker.args[0].log
    log = panel.log.toPlainText()
    assert "# on a (node 0):" in log and "# on b (node 1):" in log
    assert "--rdzv-endpoint=a:29500" in log


def test_cluster_events_are_described_and_cancel_is_ctrl_c():
    from backend.events import describe
    from gui.state import RunRecord, RunTarget

    assert describe({"event": "submitted", "job_id": "42", "script": "x.sbatch"}).startswith(
        "submitted Slurm job 42")
    assert "PENDING (Resources)" in describe({"event": "job_state", "job_id": "42", "state": "PENDING",
                                              "reason": "Resources"})
    assert RunTarget().cli_args() == []
    assert RunTarget("slurm", nodes=2, gpus_per_node=4).cli_args() == ["--target", "slurm", "--nodes", "2",
                                                                        "--gpus-per-node", "4"]
    assert RunTarget("hosts").problem()
    assert "· slurm" in RunRecord(config=None, out_dir=__import__("pathlib").Path("r"),
                                  target=RunTarget("slurm")).label


@pytest.mark.integration
@pytest.mark.skipif(not _backend_available(), reason="the backend (torch + backend.launch) is not installed")
def test_a_window_started_outside_the_repository_runs_into_its_own_runs_dir(qtbot, tmp_path, monkeypatch):
    """The run's child process starts in the repository root (gui.child_process): a window started
    elsewhere, keeping its runs in the relative default ``runs``, must still find the config it wrote
    there (it read "config file not found: runs/<stamp>/config.toml" before runs_dir was absolute)."""
    monkeypatch.chdir(tmp_path)
    w = make_window(State(default_config(), runs_dir="runs"))
    qtbot.addWidget(w)
    w.show()
    w.state.recompute_now()
    assert w.state.runs_dir == tmp_path / "runs"
    with qtbot.waitSignal(w.state.runFinished, timeout=240000) as blocker:
        w.run_panel.start()
    record = blocker.args[0]
    assert record.status == "finished", "\n".join(record.log[-20:])
    assert record.out_dir.parent == tmp_path / "runs" and (record.out_dir / "measurement.json").exists()
