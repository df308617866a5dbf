"""Thousands of narrow timeline boxes are painted as pixel rows: the same picture as the rectangles."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

import pyqtgraph as pg  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402

from gui.widgets import timeline  # noqa: E402

pytestmark = pytest.mark.gui


def pixels(widget) -> np.ndarray:
    image = widget.grab().toImage().convertToFormat(QImage.Format.Format_RGB32)
    w, h = image.width(), image.height()
    return np.frombuffer(image.constBits(), np.uint8).reshape(h, image.bytesPerLine() // 4, 4)[:, :w, 2::-1].astype(int)  # B, G, R in memory


def draw(qtbot, monkeypatch, raster: bool):
    """48 rows of 240 boxes each (F then B alternating, random widths of 1-4 px at 800 px), idle rows behind."""
    monkeypatch.setattr(timeline, "RASTER_MIN_BOXES", 1000 if raster else 10**9)
    rng = np.random.default_rng(5)
    rows, per_row = 48, 240
    widths = rng.uniform(0.5, 2.0, size=(rows, per_row))
    ends = np.cumsum(widths, axis=1)
    starts = ends - widths * 0.8
    scale = float(ends.max())
    row = np.repeat(np.arange(rows), per_row).astype(float)
    kind = np.tile(np.arange(per_row) % 2, rows)
    plot = pg.PlotWidget(background="w")
    qtbot.addWidget(plot)
    plot.resize(900, 500)
    item = timeline.BoxesItem()
    plot.addItem(item)
    r = np.arange(rows, dtype=float)
    item.set_boxes(starts.ravel() / scale, ends.ravel() / scale, row + 0.1, row + 0.9, ["#4C78A8", "#F58518"], kind,
                   np.zeros(rows * per_row, dtype=int), background=[np.zeros(rows), np.ones(rows), r + 0.1, r + 0.9])
    vb = plot.getPlotItem().getViewBox()
    vb.invertY(True)
    vb.setRange(xRange=(0, 1), yRange=(0, rows), padding=0.01)
    plot.show()
    qtbot.waitExposed(plot)
    image = pixels(plot)
    return item, image


def test_narrow_boxes_paint_as_pixel_rows_with_the_rectangles_picture(qtbot, monkeypatch):
    item, rects = draw(qtbot, monkeypatch, raster=False)
    assert not item.rasterised and item.box_count() == 48 * 240
    item, rows = draw(qtbot, monkeypatch, raster=True)
    assert item.rasterised
    same = (np.abs(rects - rows).sum(axis=-1) < 30).mean()
    assert same > 0.95, f"only {same:.1%} of the pixels agree"
    # both colours show, in about the same amounts as the rectangles give them
    for colour in ((0x4C, 0x78, 0xA8), (0xF5, 0x85, 0x18)):
        a = (np.abs(rects - colour).sum(axis=-1) < 30).sum()
        b = (np.abs(rows - colour).sum(axis=-1) < 30).sum()
        assert a > 1000 and abs(a - b) < 0.1 * a, (colour, a, b)


def test_wide_boxes_stay_rectangles(qtbot, monkeypatch):
    monkeypatch.setattr(timeline, "RASTER_MAX_PX", 0.1)  # every box is "wide" now
    item, _ = draw(qtbot, monkeypatch, raster=True)
    assert not item.rasterised
