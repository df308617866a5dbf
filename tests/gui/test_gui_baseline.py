"""Pin a prediction as the baseline in the window: the memory chart, the metrics and the timeline
show the current prediction beside it, with the differences; clearing restores the single view."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QApplication  # noqa: E402

from engine.names import MEMORY_CATEGORIES  # noqa: E402
from gui.comparison import (
    fmt_bytes,  # noqa: E402
    fmt_seconds,  # noqa: E402
)
from gui.widgets.metrics import format_change  # noqa: E402
from tests.gui.test_gui_window import drag_slider, image  # noqa: E402

pytestmark = pytest.mark.gui

K = len(MEMORY_CATEGORIES)


def test_pin_drag_compare_and_clear(window, qtbot):
    chart, metrics, state = window.memory, window.metrics, window.state
    n = len(chart.groups)
    single = image(chart.plot)
    assert chart.stacks.box_count() == K * n and not chart.baseline_stacks.isVisible()
    assert not window.clear_baseline_action.isEnabled()
    assert "baseline" not in chart.legend.text() and "baseline" not in metrics.table.text()

    count = state.recompute_count
    window.pin_action.trigger()
    pinned = state.baseline
    assert pinned is state.prediction and state.recompute_count == count  # fresh: pinned as it is
    assert window.clear_baseline_action.isEnabled()
    # the baseline's bars join the chart: one more stack per rank group, in the lighter colours
    assert chart.stacks.box_count() == K * n and chart.baseline_stacks.isVisible()
    assert chart.stacks.box_count() + chart.baseline_stacks.box_count() == 2 * K * n
    assert image(chart.plot) != single
    assert "baseline (tiny · 4× cpu · dp2 tp1 pp2 ZeRO-0" in chart.legend.text()
    assert "(same as baseline)" in chart.header.text()  # same config: no change yet
    text = metrics.table.text()
    assert text.startswith("Baseline: tiny · 4× cpu · dp2 tp1 pp2 ZeRO-0")
    assert "(baseline " in text and "same" in text
    assert "baseline makespan" in window.timeline.header.text()
    # clearing at the same config gives back exactly the single view, pixel for pixel
    window.clear_baseline_action.trigger()
    assert image(chart.plot) == single and not chart.baseline_stacks.isVisible()
    window.pin_action.trigger()
    assert state.baseline is pinned  # the same, still fresh prediction

    # a real drag: one doubling of width and depth
    hidden = state.config.model.hidden
    count = state.recompute_count
    drag_slider(window.controls.size.slider, 3)
    qtbot.waitUntil(lambda: state.config.model.hidden > hidden and state.recompute_count > count, timeout=3000)
    QApplication.processEvents()
    assert state.baseline is pinned  # survives the drag, and was not predicted again
    diff = state.difference
    assert diff.current is state.prediction and diff.peak["total"].delta > 0
    assert chart.baseline_stacks.box_count() == chart.stacks.box_count() == K * len(chart.groups)
    assert f"of {fmt_bytes(chart.capacity_bytes)} (+{fmt_bytes(diff.peak['total'].delta)}" in chart.header.text()
    assert f"vs baseline {fmt_bytes(pinned.prediction.memory.peak.total)})" in chart.header.text()
    # the metrics: each number, the baseline's and the change
    step = diff.metrics["step_seconds"]
    expected = (f"Step time: {fmt_seconds(step.current)} (baseline {fmt_seconds(step.baseline)}, "
                f"{format_change(step)})")
    assert expected in metrics.table.text().splitlines()
    assert format_change(step).startswith("+")  # a bigger model steps slower
    assert any(line.startswith("Peak memory:") and "(baseline " in line and "+" in line
               for line in metrics.table.text().splitlines())
    assert f"baseline makespan {fmt_seconds(pinned.prediction.pipeline.makespan_s)}" in window.timeline.header.text()
    # hovering the baseline bar says what it is
    off, _ = chart._base_span
    rank, values = chart.baseline_groups[0]
    hover = chart.explain_at(0 + off, float(values[0]) / chart.unit / 2)
    assert hover.startswith(f"baseline · rank {rank} · params")
    compared = image(chart.plot)

    window.clear_baseline_action.trigger()
    assert state.baseline is None and not window.clear_baseline_action.isEnabled()
    assert not chart.baseline_stacks.isVisible() and chart.stacks.box_count() == K * len(chart.groups)
    assert "baseline" not in chart.legend.text() and "vs baseline" not in chart.header.text()
    assert "baseline" not in metrics.table.text() and "baseline" not in window.timeline.header.text()
    assert image(chart.plot) != compared


def test_pin_shortcut_and_a_stale_config(window, qtbot):
    """Pinning right after an edit pins the edited config's prediction (computed once, not again)."""
    state = window.state
    state.edit("parallel.zero", 1)
    assert state.session.stale
    window.pin_action.trigger()
    assert state.baseline.config.parallel.zero == 1 and state.prediction is state.baseline
    count = state.recompute_count
    QApplication.processEvents()  # the queued recomputation, if any, finds nothing stale to redo
    assert state.recompute_count == count
    assert window.pin_action.shortcut().toString() == "Ctrl+B"
