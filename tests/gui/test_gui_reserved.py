"""What the GPU really holds, in the window: the memory chart's reserved caps and overhead, its
tooltip, the metrics' allocated and reserved, and the comparison view's reserved and tracker notes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QEvent, QPoint, QPointF, Qt  # noqa: E402
from PySide6.QtGui import QColor, QMouseEvent  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine import Config, default_config  # noqa: E402
from engine.predict import predict  # noqa: E402
from gui.comparison import RESERVED, comparison_rows, fmt_bytes  # noqa: E402
from gui.runs import RunRecord  # noqa: E402
from gui.widgets.memory_chart import CATEGORY_COLORS, RESERVED_FILL, RESERVED_LINE, segment_bytes  # noqa: E402

pytestmark = pytest.mark.gui

EXAMPLES = Path(__file__).resolve().parents[2] / "assets" / "examples"
GIB = 2**30


def show(window, cfg: Config) -> None:
    window.resize(1920, 1080)
    window.state.set_config(cfg)
    window.state.recompute_now()
    for _ in range(3):
        QApplication.processEvents()


def pixel_rows(chart, value_bytes: float) -> float:
    """The y pixel (in the plot widget) of ``value_bytes`` on the chart's scale."""
    vb = chart.plot.getPlotItem().getViewBox()
    scene = vb.mapViewToScene(QPointF(0, value_bytes / chart.unit / chart.y_scale))
    return chart.plot.mapFromScene(scene).y()


def colours_between(chart, x: float, low_bytes: float, high_bytes: float) -> list[QColor]:
    """The colours drawn in the plot at bar position ``x`` between two heights (bytes), 1 px beyond each."""
    image = chart.plot.grab().toImage()
    vb = chart.plot.getPlotItem().getViewBox()
    px = int(chart.plot.mapFromScene(vb.mapViewToScene(QPointF(x, 0))).x())
    top, bottom = pixel_rows(chart, high_bytes), pixel_rows(chart, low_bytes)
    return [image.pixelColor(px + dx, y) for y in range(int(top) - 1, int(bottom) + 2) for dx in (-6, 0, 6)]


def near(c: QColor, hex_colour: str, tol: int = 10) -> bool:
    h = QColor(hex_colour)
    return abs(c.red() - h.red()) <= tol and abs(c.green() - h.green()) <= tol and abs(c.blue() - h.blue()) <= tol


def test_chart_draws_reserved_above_the_allocated_stack_and_overhead_above_it(window):
    show(window, Config.load(EXAMPLES / "llama3-8b-16gpu.toml"))  # 16 H100s: reserved > allocated on rank 0
    chart = window.memory
    g = chart.groups[0]
    rm = window.state.prediction.prediction.memory.per_rank[g.ranks[0]]
    assert (g.allocated, g.reserved, g.device_bytes) == (rm.allocated, rm.reserved, rm.device_bytes)
    assert g.reserved - g.allocated > 0.5 * GIB and g.untracked > 0
    # the bar is allocated by category, the reserved cap, then the overhead outside the allocator
    seg = segment_bytes([g])[0]
    assert seg[:-2].sum() == pytest.approx(g.allocated) and seg[-2] == pytest.approx(g.reserved - g.allocated)
    assert seg.sum() == pytest.approx(g.device_bytes)
    cap = colours_between(chart, 0, g.allocated, g.reserved)
    assert sum(near(c, RESERVED_FILL) or near(c, RESERVED_LINE) for c in cap) >= 6, [c.name() for c in cap]
    above = colours_between(chart, 0, g.reserved, g.device_bytes)
    assert any(near(c, CATEGORY_COLORS["overhead"]) for c in above), [c.name() for c in above]
    assert "reserved, not allocated" in chart.legend.text()
    # the header names the fullest group (on this example the last stage's: its loss and kept logits)
    worst = max(chart.groups, key=lambda x: (x.device_bytes, x.total))
    assert (f"fullest {fmt_bytes(worst.allocated)} allocated, {fmt_bytes(worst.reserved)} reserved, "
            f"{fmt_bytes(worst.device_bytes)} on the device of {fmt_bytes(chart.capacity_bytes)}") in chart.header.text()


def test_no_reserved_cap_where_reserved_is_allocated(window):
    """CPU ranks reserve what they allocate: nothing of the reserved marking is drawn above the stack."""
    show(window, default_config())
    chart = window.memory
    g = chart.groups[0]
    assert g.reserved == g.allocated and g.untracked == 0
    band = colours_between(chart, 0, g.allocated, g.allocated)
    assert not any(near(c, RESERVED_FILL, 4) or near(c, RESERVED_LINE, 4) for c in band), [c.name() for c in band]
    assert not chart.reserved_caps.boundingRect().height() > 0


def hover(chart, x: float, y_bytes: float) -> str:
    """A real mouse move over the chart at bar ``x``, height ``y_bytes``; the chart's hover text."""
    vb = chart.plot.getPlotItem().getViewBox()
    pos = chart.plot.mapFromScene(vb.mapViewToScene(QPointF(x, y_bytes / chart.unit / chart.y_scale)))
    QTest.qWait(50)  # pyqtgraph's scene drops mouse moves closer than its rate limit
    port = chart.plot.viewport()
    local = QPointF(QPoint(int(pos.x()), int(pos.y())))
    QApplication.sendEvent(port, QMouseEvent(QEvent.Type.MouseMove, local, QPointF(port.mapToGlobal(local)),
                                             Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                                             Qt.KeyboardModifier.NoModifier))
    QApplication.processEvents()
    return chart.hover_text


def test_tooltip_names_allocated_reserved_overhead_and_capacity_in_gib(window):
    show(window, Config.load(EXAMPLES / "llama3-8b-16gpu.toml"))
    chart = window.memory
    g = chart.groups[0]
    text = hover(chart, 0, g.values["params"] / 2)
    assert text.startswith(f"{g.label} · params")
    for line in (f"allocated {g.allocated / GIB:.2f} GiB (live tensors at the peak: max_memory_allocated)",
                 f"reserved {g.reserved / GIB:.2f} GiB (what the caching allocator holds: max_memory_reserved)",
                 f"overhead {g.untracked / GIB:.2f} GiB (CUDA context, collective buffers",
                 f"reserved + overhead {g.device_bytes / GIB:.2f} GiB of capacity {chart.capacity_bytes / GIB:.2f} "
                 "GiB: fits"):
        assert line in text, text
    cap = hover(chart, 0, (g.allocated + g.reserved) / 2)  # on the hatched cap
    assert cap.startswith(f"{g.label} · reserved, not allocated: ")
    top = hover(chart, 0, g.reserved + g.untracked / 2)  # the overhead above it
    assert top.startswith(f"{g.label} · overhead") and "runtime context" in top


def test_over_capacity_counts_reserved_and_overhead(window):
    d = Config.load(EXAMPLES / "llama3-8b-16gpu.toml").to_dict()
    d["cluster"].update(gpus=4, gpus_per_node=4)
    d["parallel"].update(dp=1, tp=1, pp=4, sequence_parallel=False, zero=0)
    show(window, Config.from_dict(d))
    chart = window.memory
    over = [g for g in chart.groups if not g.fits]
    assert over and all(g.device_bytes > chart.capacity_bytes for g in over)
    assert chart.over_labels[0].toPlainText().replace("\n", " ") == \
        f"over by {fmt_bytes(over[0].device_bytes - chart.capacity_bytes)}"
    assert "does NOT fit (over by" in chart.explain_at(chart.groups.index(over[0]), over[0].values["params"] / 2
                                                      / chart.unit)


def test_metrics_and_explainer_name_allocated_and_reserved(window):
    show(window, Config.load(EXAMPLES / "llama3-8b-16gpu.toml"))
    mem = window.state.prediction.prediction.memory
    worst = max(mem.per_rank, key=lambda r: (r.device_bytes, -r.rank))
    rows = dict(window.metrics.rows)
    assert rows["Allocated"] == f"{fmt_bytes(worst.allocated)} on rank {worst.rank} (max_memory_allocated)"
    assert rows["Reserved"] == (f"{fmt_bytes(worst.reserved)} (max_memory_reserved): "
                                f"+{fmt_bytes(worst.reserved - worst.allocated)} cached")
    assert rows["Memory headroom"].startswith(fmt_bytes(mem.capacity_bytes - worst.device_bytes))
    html = window.metrics.explainer.toPlainText()
    assert "max_memory_allocated" in html and "max_memory_reserved" in html
    show(window, default_config())
    assert "CPU ranks have no caching allocator" in dict(window.metrics.rows)["Reserved"]


# ------------------------------------------------------------------------------------ comparison


def cpu_record(cfg: Config, out: Path, notes: list[str]) -> RunRecord:
    """A finished CPU run of ``cfg`` whose ranks say what their tracker could not see (``memory.notes``)."""
    from test_gui_run import stand_in_measurement

    measurement = stand_in_measurement(cfg)
    for r in measurement["ranks"]:
        r["memory"] = {"notes": list(notes)}
    out.mkdir(parents=True)
    return RunRecord(cfg, out, status="finished", measurement=measurement)


COMPILED = ("training.compile: torch.compile does not run under PyTorch's MemTracker, so the measured step ran "
            "the transformer blocks eagerly")


def test_comparison_on_a_cpu_run_says_reserved_is_not_measured_and_shows_the_notes(window, tmp_path):
    cfg = window.state.config
    record = cpu_record(cfg, tmp_path / "runs" / "run-cpu", [COMPILED])
    assert window.state.show_run(record)
    QApplication.processEvents()
    panel = window.run_panel
    table = [[panel.table.item(i, j).text() for j in range(panel.table.columnCount())]
             for i in range(panel.table.rowCount())]
    reserved = [row for row in table if row[1] == RESERVED]
    assert len(reserved) == len(record.measurement["ranks"])
    for row in reserved:
        assert row[3] == "not measured" and row[4] == "—"
        assert "reserved: not measured (CPU ranks have no caching allocator)" in row[5]
    # the notes stand beside the numbers the tracker measured, not beside the exact states
    by_quantity = {}
    for row in table:
        by_quantity.setdefault(row[1], []).append(row[5])
    for q in ("activations", "temporaries", "total", RESERVED):
        assert all(COMPILED in n for n in by_quantity[q]), q
    for q in ("params", "grads", "optimizer"):
        assert not any(COMPILED in n for n in by_quantity[q]), q
    assert f"measured memory (ranks 0, 1, 2, 3): {COMPILED}" in panel.notes_label.text()
    # no number that was not measured: the CSV's measured cell is the words, too
    csv = panel.export_csv(tmp_path / "cmp.csv").read_text(encoding="utf-8")
    assert "not measured" in csv


def test_comparison_on_a_cuda_run_compares_reserved_with_max_memory_reserved(tmp_path):
    cfg = default_config()
    from test_gui_run import stand_in_measurement

    pred = predict(cfg)
    measurement = stand_in_measurement(cfg)
    for r in measurement["ranks"]:
        rm = pred.memory.per_rank[r["rank"]]
        r["max_memory_allocated"] = int(rm.allocated * 1.1)
        r["max_memory_reserved"] = int(rm.reserved * 1.25)
    rows, _, _ = comparison_rows(pred, measurement)
    reserved = [row for row in rows if row.quantity == RESERVED]
    assert len(reserved) == len(measurement["ranks"])
    for row in reserved:
        rm = pred.memory.per_rank[int(row.rank)]
        assert row.predicted == rm.reserved and row.measured == int(rm.reserved * 1.25)
        assert row.error == pytest.approx((1 / 1.25 - 1) * 100, abs=0.01)
        assert "max_memory_reserved" in row.note
    assert any(row.quantity == "allocated (max_memory_allocated)" for row in rows)


def test_comparison_on_a_simulated_run_compares_reserved_with_the_modelled_allocator(tmp_path):
    cfg = default_config()
    from test_gui_run import stand_in_measurement

    pred = predict(cfg)
    measurement = stand_in_measurement(cfg)
    for r in measurement["ranks"]:
        r["allocator"] = {"max_reserved": int(pred.memory.per_rank[r["rank"]].reserved * 1.5)}
    rows, _, _ = comparison_rows(pred, measurement, simulated=True)
    reserved = [row for row in rows if row.quantity == RESERVED]
    assert len(reserved) == len(measurement["ranks"])
    for row in reserved:
        rm = pred.memory.per_rank[int(row.rank)]
        assert row.measured == int(rm.reserved * 1.5) and "modelled caching allocator" in row.note
    del measurement["ranks"][0]["allocator"]
    rows, _, _ = comparison_rows(pred, measurement, simulated=True)
    row = next(r for r in rows if r.quantity == RESERVED and r.rank == "0")
    assert row.measured == "not measured" and "simulated run" in row.note


def test_the_legend_names_what_the_device_has(window):
    """CPU ranks have no caching allocator and no CUDA context: the legend said "overhead on top: CUDA
    context" on the embedded default (issue 27, item 5); a GPU job's legend names both."""
    show(window, default_config())
    text = window.memory.legend.text()
    assert "CPU ranks: no caching allocator, no CUDA context" in text and "overhead on top" not in text
    show(window, Config.load(EXAMPLES / "llama3-8b-16gpu.toml"))
    text = window.memory.legend.text()
    assert "reserved, not allocated" in text and "CUDA context, collective buffers" in text
    assert "CPU ranks" not in text
