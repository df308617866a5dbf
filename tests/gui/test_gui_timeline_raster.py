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


def test_outlines_are_the_dark_edge_as_it_shows_over_the_box_painted_opaque():
    """A box's outline is OUTLINE_RGBA composited over the box's fill, made opaque (Qt strokes opaque
    cosmetic pens several times faster): over F's #4C78A8 = (76, 120, 168), 170/255 of (40, 40, 40) and
    85/255 of the fill give (52, 67, 83); over a translucent fill the translucent edge stays."""
    pen = timeline._outline_pen("#4C78A8", 255)
    c = pen.color()
    assert (c.red(), c.green(), c.blue(), c.alpha()) == (52, 67, 83, 255)
    assert pen.isCosmetic()
    faint = timeline._outline_pen("#4C78A8", 70).color()
    assert (faint.red(), faint.green(), faint.blue(), faint.alpha()) == timeline.OUTLINE_RGBA


def test_wide_boxes_are_outlined_in_their_blended_edge_colour(qtbot, monkeypatch):
    """On screen: the pixels along the boxes' edges are the blended edge colours, not the translucent grey."""
    monkeypatch.setattr(timeline, "RASTER_MAX_PX", 0.1)
    plot = pg.PlotWidget(background="w")
    plot.setAntialiasing(False)  # as the window draws (gui.app)
    qtbot.addWidget(plot)
    plot.resize(600, 300)
    item = timeline.BoxesItem()
    plot.addItem(item)
    item.set_boxes([0.1, 0.55], [0.45, 0.9], [0.2, 0.2], [0.8, 0.8], ["#4C78A8", "#F58518"], [0, 1], [0, 1])
    plot.getPlotItem().getViewBox().setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
    plot.show()
    qtbot.waitExposed(plot)
    image = pixels(plot)
    for fill in ("#4C78A8", "#F58518"):
        pen = timeline._outline_pen(fill, 255)
        edge = np.array([pen.color().red(), pen.color().green(), pen.color().blue()])
        # Qt strokes a cosmetic pen thinner than a pixel at its width's opacity: 0.8 of the edge over white
        # where the edge lies outside the fill (the right and bottom sides)
        rgb = np.rint(pen.widthF() * edge + (1 - pen.widthF()) * 255)
        assert (np.abs(image - rgb).sum(axis=-1) <= 3).sum() > 200, (fill, rgb)
    assert item.outlined_layers == 2
