"""Timeline hover: the action under the cursor, predicted and measured, from real mouse moves."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QEvent, QPoint, QPointF, Qt  # noqa: E402
from PySide6.QtGui import QMouseEvent  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from gui.widgets.timeline import actions_from_measurement  # noqa: E402

pytestmark = pytest.mark.gui


def hover_over(view, lane_y: float, row: int, t0: float, t1: float) -> str:
    """Move the mouse to the middle of a box (seconds t0..t1 on ``row``) and read the hover line."""
    QTest.qWait(50)  # pyqtgraph's scene drops mouse moves closer than its rate limit; and a redraw's new
    # view range is laid out by then (the mapping below reads it)
    vb = view.plot.getPlotItem().getViewBox()
    x = (t0 + t1) / 2 / view.scale_s
    scene = vb.mapViewToScene(QPointF(x, row + lane_y))
    pos = view.plot.mapFromScene(scene)
    port = view.plot.viewport()
    local = QPointF(QPoint(int(pos.x()), int(pos.y())))
    QApplication.sendEvent(port, QMouseEvent(QEvent.Type.MouseMove, local, QPointF(port.mapToGlobal(local)),
                                             Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                                             Qt.KeyboardModifier.NoModifier))
    QApplication.processEvents()
    return view.hover.text()


def test_hover_names_the_predicted_action(window):
    view = window.timeline
    acts = view.predicted
    # the first forward of pipeline rank 1 (stage 1, microbatch 0)
    i = next(j for j in range(len(acts)) if acts.row[j] == 1 and acts.kind[j] == 0 and acts.microbatch[j] == 0)
    text = hover_over(view, 0.5, 1, float(acts.start_s[i]), float(acts.end_s[i]))
    assert text.startswith("rank 1 · F forward · stage 1 · microbatch 0 · predicted ")
    assert "→" in text and "(" in text
    assert "measured" not in text  # nothing measured yet
    # idle time before rank 1's first forward says nothing
    assert hover_over(view, 0.5, 1, 0.0, float(acts.start_s[i]) * 0.2).strip() == ""


def test_hover_shows_predicted_and_measured_side_by_side(window):
    view = window.timeline
    pred = view.predicted
    # a measurement shaped as measurement.json: the predicted actions of replica 0, each 1.5× longer
    par = window.state.config.parallel
    per_rank = {}
    for j in range(len(pred)):
        rank = int(pred.row[j]) * par.dp * par.tp
        a = ["FBIW"[int(pred.kind[j])], int(pred.stage[j]), int(pred.microbatch[j]),
             10.0 + 1.5 * float(pred.start_s[j]), 10.0 + 1.5 * float(pred.end_s[j])]
        per_rank.setdefault(rank, []).append(a)
    meas = {"pipeline": {"per_rank": [{"rank": r, "actions": a} for r, a in per_rank.items()]}}
    view.measured = actions_from_measurement(meas, par.dp, par.tp)
    view.measured_config = window.state.config
    view.redraw()
    i = next(j for j in range(len(pred)) if pred.row[j] == 0 and pred.kind[j] == 1 and pred.microbatch[j] == 2)
    text = hover_over(view, view._lanes[0][0] + 0.2, 0, float(pred.start_s[i]), float(pred.end_s[i]))
    assert text.startswith("rank 0 · B backward · stage 0 · microbatch 2 · predicted ")
    assert " · measured " in text
    m = view.measured
    k = next(j for j in range(len(m)) if m.row[j] == 0 and m.kind[j] == 1 and m.microbatch[j] == 2)
    text = hover_over(view, view._lanes[1][0] + 0.2, 0, float(m.start_s[k]), float(m.end_s[k]))
    assert text.startswith("rank 0 · B backward · stage 0 · microbatch 2 · measured ")
    assert " · predicted " in text


def test_durations_read_without_exponents():
    """Metrics printed "2.1e+03 s" for a 35-minute step (issue 27, item 5)."""
    from gui.comparison import fmt_seconds

    assert [fmt_seconds(x) for x in (2100, 59, 7200, 0.0978, 1.23e-5)] == \
        ["35 min", "59 s", "2 h", "97.8 ms", "12.3 µs"]
    assert "e+" not in fmt_seconds(3.6e8) and "e-" not in fmt_seconds(1e-9)
