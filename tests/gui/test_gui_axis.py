"""The charts' lean axis draws what pyqtgraph's own AxisItem draws: every tick, every label, the same
rectangles, for random ranges, scales, lengths and the explicit-ticks path."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

import pyqtgraph as pg  # noqa: E402
from PySide6.QtGui import QPainter, QPicture  # noqa: E402

from gui.widgets.axis import LeanAxis  # noqa: E402

pytestmark = pytest.mark.gui


def specs(axis):
    picture = QPicture()
    p = QPainter(picture)
    try:
        out = axis.generateDrawSpecs(p)
    finally:
        p.end()
    axis_spec, ticks, texts = out
    pen, a, b = axis_spec
    return ((pen.color().rgba(), a.x(), a.y(), b.x(), b.y()),
            [(t[0].color().rgba(), t[1].x(), t[1].y(), t[2].x(), t[2].y()) for t in ticks],
            [(r.x(), r.y(), r.width(), r.height(), int(f), s) for r, f, s in texts])


def pair(qtbot, orientation, size):
    plots = []
    for axis in (pg.AxisItem(orientation), LeanAxis(orientation)):
        w = pg.PlotWidget(background="w", axisItems={orientation: axis})
        w.resize(*size)
        qtbot.addWidget(w)
        w.show()
        plots.append((w, axis))
    plots[0][1].setStyle(maxTickLevel=plots[1][1].style["maxTickLevel"])  # as the charts' axes are styled
    qtbot.waitExposed(plots[1][0])
    return plots


@pytest.mark.parametrize("orientation", ["left", "bottom"])
def test_lean_axis_draws_what_pyqtgraph_draws(qtbot, orientation):
    rng = random.Random(20261204)
    plots = pair(qtbot, orientation, (700, 420))
    compared = 0
    for trial in range(60):
        lo = rng.choice([0.0, rng.uniform(-1e3, 1e3), -rng.uniform(0, 1e-2)])
        hi = lo + 10 ** rng.uniform(-4, 6)
        scale = rng.choice([1.0, 10 ** rng.uniform(-9, 9)])
        size = (rng.randint(200, 1400), rng.randint(150, 900))
        drawn = []
        for w, axis in plots:
            w.resize(*size)
            axis.setScale(scale)
            axis.enableAutoSIPrefix(trial % 3 == 0)
            axis.setStyle(maxTickLevel=trial % 3)  # the charts draw two levels; every level the same
            if orientation == "left":
                w.getPlotItem().setYRange(lo, hi, padding=0)
            else:
                w.getPlotItem().setXRange(lo, hi, padding=0)
            if trial % 7 == 6:  # the explicit-ticks path (the timeline's rank labels, the chart's bar names)
                axis.setTicks([[(lo + (hi - lo) * k / 4, f"r{k}") for k in range(5)], []])
            else:
                axis.setTicks(None)
        qtbot.wait(1)
        drawn = [specs(axis) for _, axis in plots]
        assert drawn[1] == drawn[0], (trial, lo, hi, scale, size)
        if trial % 10 == 0:  # and the same pixels: the lean axis draws its specifications straight on screen
            shots = [w.grab().toImage() for w, _ in plots]
            assert shots[1] == shots[0], (trial, lo, hi, scale, size)
        compared += len(drawn[0][1])
    assert compared > 60 * 5  # ticks were drawn, not empty lists compared


def test_lean_axis_falls_back_where_it_does_not_lean(qtbot):
    plots = pair(qtbot, "left", (500, 400))
    for w, _ in plots:
        w.getPlotItem().showGrid(x=True, y=True, alpha=0.4)
        w.getPlotItem().setYRange(0, 37, padding=0)
    qtbot.wait(1)
    assert not plots[1][1]._lean()
    assert specs(plots[1][1]) == specs(plots[0][1])
