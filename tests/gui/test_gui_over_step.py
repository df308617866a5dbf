"""The memory chart's "over the step" toggle: each category at its own worst moment of the step instead of at
the rank's peak moment (ZeRO-3 on 4 ranks peaks in the forward, before any gradient exists)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine import default_config  # noqa: E402
from engine.memory import memory_per_rank  # noqa: E402
from gui.widgets.memory_chart import CATEGORY_COLORS, SEGMENTS  # noqa: E402

pytestmark = pytest.mark.gui


def colour_rows(chart, colour: str) -> int:
    """Rows of the chart's plot holding the colour (its bar segment's height in pixels)."""
    img = chart.plot.grab().toImage()
    w, h = img.width(), img.height()
    arr = np.frombuffer(img.constBits(), np.uint8).reshape(h, img.bytesPerLine() // 4, 4)[:, :w, 2::-1].astype(int)
    want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(arr - want).sum(axis=-1) < 12).any(axis=1).sum())


def test_over_the_step_shows_the_gradients_the_peak_moment_does_not_hold(window, qtbot):
    # two microbatches: the peak is the last backward's, before any unit's post-backward reduces (with one, the B's
    # own moment comes after its last block's post-backward, which made that block's sharded gradients)
    cfg = default_config().replace(parallel={"dp": 4, "pp": 1, "zero": 3, "microbatches": 2}, cluster={"gpus": 4})
    window.resize(1600, 1000)
    window.state.set_config(cfg)
    window.state.recompute_now()
    chart = window.memory
    QApplication.processEvents()
    rank = memory_per_rank(cfg).per_rank[0]
    assert rank.grads == 0 and rank.category_peaks()["grads"] > 0
    grads_col = SEGMENTS.index("grads")
    assert chart.groups[0].values["grads"] == 0 and colour_rows(chart, CATEGORY_COLORS["grads"]) == 0
    assert "own worst moment" not in chart.header.text()

    qtbot.mouseClick(chart.over_step_box, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: chart.groups[0].values["grads"] > 0, timeout=2000)
    QApplication.processEvents()
    peaks = rank.category_peaks()
    assert chart.groups[0].values == peaks
    assert "each category at its own worst moment of the step" in chart.header.text()
    assert colour_rows(chart, CATEGORY_COLORS["grads"]) > 0  # the gradients' segment is drawn now
    # the tooltip gives both readings of the hovered category
    top = sum(peaks[c] for c in SEGMENTS[:grads_col]) + peaks["grads"] / 2
    text = chart.explain_at(0, top / chart.unit)
    assert "grads" in text and "at the rank's peak moment" in text and "own worst moment of the step" in text
    # the verdict is still the rank's peak's
    assert chart.groups[0].allocated == rank.allocated and chart.groups[0].fits == rank.fits

    qtbot.mouseClick(chart.over_step_box, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: chart.groups[0].values["grads"] == 0, timeout=2000)
