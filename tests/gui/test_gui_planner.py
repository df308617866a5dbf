"""The planner panel, driven offscreen: a real child `shardscope plan`, real clicks, the window's config."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QPointF, Qt  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine import Config, default_config  # noqa: E402
from engine.memory import memory_per_rank  # noqa: E402
from engine.plan.results import layout_label  # noqa: E402
from engine.time.step import step_time  # noqa: E402
from gui.planning import LAYOUT_COLUMN  # noqa: E402

pytestmark = pytest.mark.gui

EIGHT_H100 = {"model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 8, "gpus_per_node": 8},
              "parallel": {"dp": 8}}


@pytest.fixture
def window(window, qtbot):
    """The shared window (tests/conftest.py) on its Planner tab; a running plan is cancelled after."""
    w = window
    w.tabs.setCurrentWidget(w.planner)
    QApplication.processEvents()
    yield w
    if w.planner.running:
        w.planner.cancel()
        qtbot.waitUntil(lambda: not w.planner.running, timeout=10000)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_plan_shows_top_layouts_and_every_fitting_one_and_a_click_applies_it(window, qtbot):
    panel, state = window.planner, window.state
    state.set_config(Config.from_dict(EIGHT_H100))
    assert "tiny on 8 × h100-sxm" in panel.job.text()
    assert panel.batch.value() == state.config.global_batch_size  # the job's own: its layout is planned
    panel.batch.setValue(4)  # 1,995 fitting layouts, enough for a front (16 made 4,415: twice the time)
    panel.fitting_seconds = 900  # a loaded machine must not cut the sweep short: only its count decides
    # the config's own float8/compile only: searching them (the default) multiplies this job's fitting
    # layouts past the sweep's limit, and this test wants every fitting one evaluated
    panel.search_float8_compile = False
    qtbot.mouseClick(panel.plan_button, Qt.MouseButton.LeftButton)
    assert panel.request.command("job.toml")[-5:] == ["--float8", "none", "--compile", "off", "--progress"]
    assert panel.running and not panel.plan_button.isEnabled() and panel.cancel_button.isEnabled()
    qtbot.waitUntil(lambda: not panel.running, timeout=180000)
    out = panel.outcome
    assert out is not None, panel.status.text()
    assert out.result["global_batch"] == 4 and out.result["gpus"] == 8

    # the table: the top 10 with why each wins or loses
    assert panel.table.rowCount() == 10
    assert panel.table.item(0, LAYOUT_COLUMN).text() == out.entries[0]["label"]
    assert panel.table.item(0, 6).text() == "fastest"
    assert panel.table.item(1, 6).text().startswith("+")
    assert "slower than #1" in panel.table.item(1, 6).toolTip()  # every reason, in the tooltip
    panel.table.setCurrentCell(3, 1)  # ... and under the table for the selected row
    assert all(w in panel.why.text() for w in out.entries[3]["why"])
    # the scatter: one item holding every fitting layout the sweep evaluated, the front drawn as a line
    assert out.stopped == "" and out.evaluated == out.candidates
    assert len(panel.scatter.data) == len(out.points) > 100
    front = out.front()
    assert 0 < len(front) < len(out.points) and len(panel.front_line.xData) == len(front)
    assert {p["label"] for p in out.points if p["position"]} == {e["label"] for e in out.entries}
    tip = panel.scatter.opts["tip"](x=0.0, y=0.0, data=front[0])
    assert out.points[front[0]]["label"] in tip and "tokens/s" in tip and "Pareto" in tip
    assert "Click a row or a point" in panel.status.text()

    # clicking a table row makes that layout the window's config (and the charts follow)
    row = 2
    rect = panel.table.visualRect(panel.table.model().index(row, 1))
    qtbot.mouseClick(panel.table.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert state.config == out.entry_config(row)
    assert layout_label(state.config) == out.entries[row]["label"]
    qtbot.waitUntil(lambda: state.prediction is not None and state.prediction.config == state.config, timeout=5000)
    assert panel.table.selectedItems() and panel.table.selectedItems()[0].row() == row

    # clicking a scatter point (one off the top 10, on the front) does the same
    j = next(j for j in front if not out.points[j]["position"])
    p = out.points[j]
    vb = panel.plot.getPlotItem().getViewBox()
    unit, scale = out.memory_scale()
    assert panel.plot.getPlotItem().getAxis("bottom").labelText == f"peak memory per GPU ({unit})"
    where = panel.plot.mapFromScene(vb.mapViewToScene(QPointF(p["peak_bytes"] / scale, p["tokens_per_s"])))
    under = {int(s.data()) for s in panel.scatter.pointsAt(QPointF(p["peak_bytes"] / scale, p["tokens_per_s"]))}
    assert j in under
    qtbot.mouseClick(panel.plot.viewport(), Qt.MouseButton.LeftButton, pos=where)
    xs, ys = out.xy()

    clicked = panel.plot.mapToScene(where)

    def pixels_off(k):  # how far point k is drawn from the click
        d = vb.mapViewToScene(QPointF(xs[k], ys[k])) - clicked
        return d.x() ** 2 + d.y() ** 2

    nearest = {k for k in under if pixels_off(k) <= pixels_off(j) + 1e-3}  # j, or one drawn as near the click
    qtbot.waitUntil(lambda: state.config in {out.point_config(k) for k in nearest}, timeout=3000)
    cfg = state.config
    chosen = next(k for k in nearest if out.point_config(k) == cfg)
    assert layout_label(cfg) == out.points[chosen]["label"]
    # the point is what the engine says of that config
    assert memory_per_rank(cfg).peak.total == out.points[chosen]["peak_bytes"]
    assert step_time(cfg).tokens_per_s == pytest.approx(out.points[chosen]["tokens_per_s"], rel=1e-12)
    assert len(panel.selected.data) == 1  # the window's layout is ringed

    # another job in the window: the plan says it is of the old one
    state.set_config(default_config())
    assert "Plan again for tiny on 4 × cpu" in panel.status.text()
    assert len(panel.selected.data) == 0


def test_cancel_stops_a_running_plan(window, qtbot):
    panel, state = window.planner, window.state
    state.set_config(Config.from_dict(EIGHT_H100))  # the default batch: thousands of layouts to evaluate
    panel.start()
    pid = panel.process.processId()
    assert pid > 0 and _alive(pid)
    qtbot.waitUntil(lambda: panel.progress.maximum() > 0 or not panel.running, timeout=60000)  # the sweep began
    assert panel.running, "the plan ended before it could be cancelled"
    tmp = panel._tmp
    qtbot.mouseClick(panel.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not panel.running, timeout=10000)
    qtbot.waitUntil(lambda: not _alive(pid), timeout=5000)  # the child process ended
    assert panel.outcome is None and panel.table.rowCount() == 0
    assert "cancelled" in panel.status.text()
    assert panel.plan_button.isEnabled() and not panel.cancel_button.isEnabled()
    assert tmp is not None and not tmp.exists()
    assert state.config == Config.from_dict(EIGHT_H100)  # nothing was applied


def test_a_config_the_planner_refuses_says_why(window, qtbot):
    panel, state = window.planner, window.state
    state.set_config(default_config().replace(training={"finetune": "lora"}))
    panel.start()
    qtbot.waitUntil(lambda: not panel.running, timeout=60000)
    assert "LoRA" in panel.status.text() and panel.status.property("alarm") is True
    assert panel.outcome is None


def test_screenshot_with_plan_shows_the_planner_result(window, tmp_path):
    out = tmp_path / "shot.png"
    window.planner.fitting_seconds = 2.0  # the table and the file are read here, not the whole sweep's scatter
    assert window.screenshot(out, width=1280, height=800, plan=True) == 0
    assert window.tabs.currentWidget() is window.planner
    assert window.planner.outcome is not None and window.planner.table.rowCount() > 0
    assert out.stat().st_size > 10_000
