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


def stand_in_backend(tmp_path, cfg, *, sleep_s: float = 0.0) -> str:
    """A script that prints the backend's events and writes a measurement.json for ``cfg``."""
    from engine.memory import memory_per_rank
    from engine.timeline import pipeline_prediction

    mem = memory_per_rank(cfg)
    tl = pipeline_prediction(cfg)
    par = cfg.parallel
    measurement = {
        # "measured" = predicted × 1.1, so every error is -9.1 %
        "memory": {"per_rank": [{"rank": r.rank, "stage": list(r.stages)[0],
                                 **{c: int(getattr(r, c) * 1.1) for c in
                                    ("params", "grads", "optimizer", "activations", "comm_buffers",
                                     "temporaries", "overhead")},
                                 "total": int(r.total * 1.1)} for r in mem.per_rank]},
        "pipeline": {"per_rank": [{"rank": tl.global_ranks[p],
                                   "actions": [[k, s, m, 100 + a * 1.2, 100 + b * 1.2]
                                               for k, s, m, a, b in tl.actions_of_rank(p)]}
                                  for p in range(par.pp)]},
    }
    script = tmp_path / "backend.py"
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


@pytest.fixture
def window(qtbot, tmp_path):
    w = make_window(State(default_config(), runs_dir=tmp_path / "runs"))
    qtbot.addWidget(w)
    w.resize(1500, 950)
    w.show()
    w.state.recompute_now()
    return w


def use_backend(state, script):
    state.run_command = lambda cfg_path, out_dir: [sys.executable, script, str(cfg_path), "--out", str(out_dir)]


def test_run_streams_events_and_overlays_measurements(window, qtbot, tmp_path):
    use_backend(window.state, stand_in_backend(tmp_path, window.state.config))
    mem_before = window.memory.plot.grab().toImage()
    with qtbot.waitSignal(window.state.runFinished, timeout=20000) as blocker:
        qtbot.mouseClick(window.run_panel.run_button, __import__("PySide6.QtCore").QtCore.Qt.MouseButton.LeftButton)
    record = blocker.args[0]
    assert record.status == "finished", record.log
    assert "step 3/3" in window.run_panel.log.toPlainText()
    assert window.run_panel.progress.value() == 3
    # measured memory beside the predicted bars, measured timeline as a second lane
    assert window.memory.measured_by_rank
    assert window.memory.plot.grab().toImage() != mem_before
    assert len(window.timeline.measured) == len(window.timeline.predicted)
    assert "measured step" in window.timeline.header.text()
    # the comparison table: every rank × category, error -9.1 %
    rows = window.run_panel.rows
    assert {r[1] for r in rows} >= {"params", "activations", "total", "pipeline makespan (s)"}
    mem_errors = [r[4] for r in rows if r[1] == "total"]
    assert all(abs(e - (-100 / 11)) < 0.1 for e in mem_errors)
    assert window.run_panel.table.rowCount() == len(rows)
    csv_path = window.run_panel.export_csv(tmp_path / "cmp.csv")
    assert csv_path.read_text().startswith("rank,quantity,predicted,measured,error_percent")
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
    QApplication.processEvents()
    assert window.memory.measured_by_rank
    assert len(window.timeline.measured) > 0
    assert any(r[1] == "total" for r in window.run_panel.rows)
