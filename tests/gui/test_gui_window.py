"""The ShardScope window, driven offscreen: real sliders, real charts, real pixels."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QEvent, QPoint, QPointF, Qt  # noqa: E402
from PySide6.QtGui import QImage, QMouseEvent  # noqa: E402
from PySide6.QtWidgets import QApplication, QSlider, QStyle, QStyleOptionSlider  # noqa: E402

from gui.app import run_app  # noqa: E402

pytestmark = pytest.mark.gui


def image(widget) -> QImage:
    QApplication.processEvents()
    return widget.grab().toImage()


def drag_slider(slider: QSlider, steps: int) -> None:
    """Press on the handle, move the mouse ``steps`` positions along the groove, release."""
    opt = QStyleOptionSlider()
    slider.initStyleOption(opt)
    style = slider.style()
    handle = style.subControlRect(QStyle.ComplexControl.CC_Slider, opt, QStyle.SubControl.SC_SliderHandle, slider)
    groove = style.subControlRect(QStyle.ComplexControl.CC_Slider, opt, QStyle.SubControl.SC_SliderGroove, slider)
    span = groove.width() - handle.width()
    px_per_step = span / max(1, slider.maximum() - slider.minimum())
    start = handle.center()
    target = slider.value() + steps
    end = QPoint(int(round(start.x() + steps * px_per_step)), start.y())

    def send(kind, pos, buttons):
        p = QPointF(pos)
        ev = QMouseEvent(kind, p, QPointF(slider.mapToGlobal(pos)), Qt.MouseButton.LeftButton, buttons,
                         Qt.KeyboardModifier.NoModifier)
        QApplication.sendEvent(slider, ev)

    send(QEvent.Type.MouseButtonPress, start, Qt.MouseButton.LeftButton)
    n = max(1, abs(steps))
    for i in range(1, n + 1):
        x = start.x() + (end.x() - start.x()) * i / n
        send(QEvent.Type.MouseMove, QPoint(int(round(x)), start.y()), Qt.MouseButton.LeftButton)
    send(QEvent.Type.MouseButtonRelease, end, Qt.MouseButton.NoButton)
    assert slider.value() == target, f"drag ended at {slider.value()}, wanted {target}"


def test_dragging_microbatches_changes_model_timeline_and_pixels(window, qtbot):
    before = image(window.timeline.plot)
    boxes_before = window.timeline.boxes.box_count()
    assert window.state.config.parallel.microbatches == 4
    drag_slider(window.controls.microbatches.slider, 4)  # 4 -> 8
    qtbot.waitUntil(lambda: window.state.config.parallel.microbatches == 8, timeout=2000)
    qtbot.waitUntil(lambda: window.timeline.boxes.box_count() != boxes_before, timeout=2000)
    assert window.timeline.boxes.box_count() == 2 * 2 * 8  # pp ranks × (F, B) × microbatches
    assert image(window.timeline.plot) != before
    assert "32 actions" in window.timeline.header.text()


def test_dragging_model_size_changes_memory_chart(window, qtbot):
    hidden = window.state.config.model.hidden
    peak_before = max(g.total for g in window.memory.groups)
    before = image(window.memory.plot)
    drag_slider(window.controls.size.slider, 3)  # one doubling of width and depth
    qtbot.waitUntil(lambda: window.state.config.model.hidden > hidden, timeout=2000)
    qtbot.waitUntil(lambda: max(g.total for g in window.memory.groups) > peak_before, timeout=2000)
    assert image(window.memory.plot) != before
    assert f"{window.state.config.model.layers} layers" in window.controls.size_label.text()


def test_metrics_repaint_only_changed_rows_and_the_screen_shows_every_new_number(window, qtbot):
    """A slider move repaints only the metrics rows whose text changed; what the window shows (its backing
    store, grabbed from the screen) must then equal the table drawn afresh, row for row."""
    table = window.metrics.table
    for steps in (1, 1, -1):
        rows = list(table.rows)
        drag_slider(window.controls.size.slider, steps)
        qtbot.waitUntil(lambda rows=rows: table.rows != rows, timeout=2000)
        for _ in range(3):
            QApplication.processEvents()
        changed = sum(a != b for a, b in zip(rows, table.rows))
        assert 0 < changed < len(table.rows)  # some rows keep their text: the partial repaint is exercised
        shown = window.screen().grabWindow(window.winId())
        pos = table.mapTo(window, QPoint(0, 0))
        on_screen = shown.copy(pos.x(), pos.y(), table.width(), table.height()).toImage()
        fresh = table.grab().toImage()
        assert on_screen.convertToFormat(QImage.Format.Format_RGB32) == fresh.convertToFormat(QImage.Format.Format_RGB32)


def test_invalid_tp_is_explained_next_to_tp_and_charts_keep_last_valid(window, qtbot):
    valid = window.state.config
    boxes = window.timeline.boxes.box_count()
    window.controls.tp.setValue(3)  # tiny: 8 heads, 4 KV heads -> tp must divide 4
    qtbot.waitUntil(lambda: window.controls.errors["parallel.tp"].isVisible(), timeout=2000)
    text = window.controls.errors["parallel.tp"].text()
    assert "must divide" in text and "allowed" in text
    assert window.state.config == valid
    assert window.timeline.boxes.box_count() == boxes
    assert window.controls.banner.isVisible()
    window.controls.tp.setValue(1)
    qtbot.waitUntil(lambda: not window.controls.errors["parallel.tp"].isVisible(), timeout=2000)
    assert not window.controls.banner.isVisible()


def test_gpu_count_that_tp_pp_cannot_divide_is_shown_at_gpu_count(window, qtbot):
    gpus = window.controls.gpus
    gpus.slider.setValue(gpus.values.index(3))  # dp·tp·pp with pp = 2 cannot make 3
    qtbot.waitUntil(lambda: window.controls.errors["cluster.gpus"].isVisible(), timeout=2000)
    assert "must equal cluster.gpus (3)" in window.controls.errors["cluster.gpus"].text()
    gpus.slider.setValue(gpus.values.index(8))  # dp follows: 8 / (1·2) = 4
    qtbot.waitUntil(lambda: window.state.config.parallel.dp == 4, timeout=2000)
    assert not window.controls.errors["cluster.gpus"].isVisible()


def test_schedule_needing_virtual_stages_is_explained(window, qtbot):
    window.controls.schedule.setCurrentText("ZBVZeroBubble")
    qtbot.waitUntil(lambda: window.controls.errors["parallel.virtual_stages"].isVisible(), timeout=2000)
    assert "two stages per rank" in window.controls.errors["parallel.virtual_stages"].text()
    window.controls.virtual_stages.setValue(2)
    qtbot.waitUntil(lambda: window.state.config.parallel.schedule == "ZBVZeroBubble", timeout=2000)
    qtbot.waitUntil(lambda: "I" in {"FBIW"[k] for k in window.timeline.predicted.kind.tolist()}, timeout=2000)


def test_memory_hover_explains_the_segment(window):
    chart = window.memory
    g = chart.groups[0]
    y = g.values["params"] / chart.unit / 2
    text = chart.explain_at(0, y)
    assert text.startswith(f"{g.label} · params")
    assert "•" in text  # the engine's terms


def test_over_capacity_is_unmistakable(window, qtbot):
    window.controls.preset.setCurrentText("llama3-8b")  # on 24 GiB CPU "GPUs" it does not fit
    window.state.recompute_now()
    assert any(not g.fits for g in window.memory.groups)
    assert "do NOT fit" in window.memory.header.text()
    assert window.memory.header.property("alarm") is True


def test_burst_of_edits_recomputes_once(window, qtbot):
    count = window.state.recompute_count
    for v in (1, 2, 3, 4, 6, 8, 4):
        window.state.edit("parallel.microbatches", v)
    qtbot.waitUntil(lambda: window.state.recompute_count > count, timeout=2000)
    QApplication.processEvents()
    assert window.state.recompute_count == count + 1


def test_timeline_zoom_shows_labels_only_when_wide(window, qtbot):
    window.state.edit("parallel.microbatches", 64)
    window.state.recompute_now()
    vb = window.timeline.plot.getPlotItem().getViewBox()
    image(window.timeline.plot)
    wide_labels = window.timeline.boxes.labels_drawn
    vb.setXRange(0, 1 / 20, padding=0)  # x runs 0..1 over the step (the axis is scaled to seconds)
    image(window.timeline.plot)
    assert window.timeline.boxes.labels_drawn > 0
    assert window.timeline.boxes.labels_drawn <= wide_labels or wide_labels == 0


def test_save_and_open_config_round_trip(window, tmp_path):
    window.state.edit("parallel.microbatches", 8)
    path = tmp_path / "job.toml"
    window.state.save(path)
    window.state.edit("parallel.microbatches", 2)
    window.open_config(path)
    assert window.state.config.parallel.microbatches == 8
    assert window.controls.microbatches.value() == 8


def test_screenshot_writes_a_png(tmp_path, qtbot):
    out = tmp_path / "shot.png"
    assert run_app(screenshot=str(out)) == 0
    assert out.stat().st_size > 10_000
    img = QImage(str(out))
    assert img.width() >= 1200 and img.height() >= 800
    for w in QApplication.topLevelWidgets():
        w.close()


def one_h100(state, preset: str = "llama2-7b") -> None:
    """``preset`` on one H100 with bf16 mixed precision (full fine-tuning does not fit a 7B model there)."""
    state.edit("model.preset", preset)
    state.edit("cluster.gpu", "h100-sxm")
    state.edit("parallel.pp", 1)
    state.edit("cluster.gpus", 1)
    state.edit("training.precision", "bf16-mixed")
    state.edit("training.grad_dtype", "bf16")
    assert state.config.parallel.world_size == 1, state.problems
    state.recompute_now()


def test_lora_makes_a_7b_model_fit_one_card_and_the_chart_shows_it(window, qtbot):
    one_h100(window.state)
    chart = window.memory
    assert any(not g.fits for g in chart.groups) and chart.header.property("alarm") is True
    assert window.controls.lora_rank.isHidden()  # LoRA's knobs appear only under LoRA
    before = image(chart.plot)
    box = window.controls.finetune
    box.setCurrentIndex(box.findData("lora"))
    qtbot.waitUntil(lambda: window.state.config.training.finetune == "lora", timeout=2000)
    window.state.recompute_now()
    # with the frozen base in fp32 (the default) autocast casts every frozen weight anew in each forward and the
    # matmuls save those casts: still over the card; a bf16 base (what LoRA recipes load) fits
    assert window.state.config.training.lora_base_dtype == "fp32" and any(not g.fits for g in chart.groups)
    base = window.controls.lora_base_dtype
    base.setCurrentIndex(base.findData("bf16"))
    qtbot.waitUntil(lambda: window.state.config.training.lora_base_dtype == "bf16", timeout=2000)
    window.state.recompute_now()
    assert all(g.fits for g in chart.groups)
    assert chart.header.property("alarm") is False
    assert "LoRA" in chart.header.text()
    assert chart.full_line.isVisible()  # the full fine-tune's peak stays drawn beside the LoRA bars
    assert "does NOT fit" in chart.full_label.toPlainText()
    assert chart.full_finetune_peak > chart.capacity_bytes
    assert image(chart.plot) != before
    assert not window.controls.lora_rank.isHidden()
    assert "Trainable (LoRA)" in window.metrics.table.text()
    in_this_config = window.metrics.explainer.toPlainText().splitlines()[0]
    assert "LoRA fine-tuning" in in_this_config  # the explainer names it among the active strategies
    box.setCurrentIndex(box.findData("full"))  # and back
    qtbot.waitUntil(lambda: window.state.config.training.finetune == "full", timeout=2000)
    window.state.recompute_now()
    assert any(not g.fits for g in chart.groups) and not chart.full_line.isVisible()


def test_lora_base_dtype_problem_is_shown_under_its_control(window, qtbot):
    window.state.edit("training.finetune", "lora")
    assert window.state.config.training.precision == "fp32"
    box = window.controls.lora_base_dtype
    box.setCurrentIndex(box.findData("bf16"))  # a bf16 base needs mixed precision
    qtbot.waitUntil(lambda: window.controls.errors["training.lora_base_dtype"].isVisible(), timeout=2000)
    assert "bf16-mixed" in window.controls.errors["training.lora_base_dtype"].text()
    assert window.state.config.training.lora_base_dtype == "fp32"  # charts keep the last valid config
    box.setCurrentIndex(box.findData("nf4"))
    qtbot.waitUntil(lambda: window.state.config.training.lora_base_dtype == "nf4", timeout=2000)
    assert not window.controls.errors["training.lora_base_dtype"].isVisible()
    from gui.widgets.metrics import active_strategies

    assert active_strategies(window.state.config)[-2:] == ["lora", "qlora"]


def test_choosing_dataparallel_explains_offers_and_shows_gpu0_and_scaling(window, qtbot):
    c = window.controls
    c.dp_mode.setCurrentIndex(c.dp_mode.findData("dataparallel"))  # the default layout has pp = 2
    qtbot.waitUntil(lambda: c.errors["parallel.dp_mode"].isVisible(), timeout=2000)
    assert "parallel.pp = 2" in c.errors["parallel.dp_mode"].text()
    assert not c.dataparallel_offer.isHidden() and "pp 1" in c.dataparallel_hint.text()
    c.dataparallel_fix.click()
    qtbot.waitUntil(lambda: window.state.config.parallel.dp_mode == "dataparallel", timeout=2000)
    par = window.state.config.parallel
    assert (par.tp, par.pp, par.dp) == (1, 1, window.state.config.cluster.gpus)
    assert not c.errors["parallel.dp_mode"].isVisible() and c.dataparallel_offer.isHidden()
    window.state.recompute_now()
    chart = window.memory
    assert chart.groups[0].ranks == [0] and chart.groups[0].total > chart.groups[-1].total  # GPU 0's extra load
    assert chart._ticks[0][1].startswith("GPU 0: +")  # its extra load, under its bar
    assert "nn.DataParallel" in chart.header.text()
    assert "python gil exposed" in window.metrics.table.text()
    assert window.tabs.currentWidget() is window.scaling  # why it stops scaling, shown when chosen
    qtbot.waitUntil(lambda: bool(window.scaling.rows), timeout=2000)
    assert [r["gpus"] for r in window.scaling.rows][:3] == [1, 2, 4]
    assert len(window.scaling.dp_curve.getData()[0]) == len(window.scaling.rows)
    assert "of DDP" in window.scaling.text.text()
    assert window.metrics.explainer.toPlainText().index("Legacy DataParallel") < \
        window.metrics.explainer.toPlainText().index("ZeRO-1")  # active: first, not greyed at the end


def test_predictions_run_off_the_gui_thread_and_the_latest_request_wins(window, qtbot):
    """A prediction runs on the worker thread while the event loop goes on turning; a request made
    while one is in flight is predicted after it, and only the current config's prediction is shown
    (the one in flight for an older config is dropped)."""
    import threading

    from conftest import settle

    state = window.state
    shown, threads = [], []
    state.predictionReady.connect(lambda p: shown.append(p.config))
    real = state._predict_in_worker

    release = threading.Event()

    def traced(cfg, calibration):
        threads.append(threading.current_thread())
        release.wait(5)  # the first request stays in flight until the second one has been made
        real(cfg, calibration)

    state._predict_in_worker = traced
    ticks = []
    timer = window.startTimer(1)
    window.timerEvent = lambda ev: ticks.append(ev.timerId())
    state.edit("cluster.gpus", 8)  # a first request...
    qtbot.waitUntil(lambda: len(threads) == 1, timeout=2000)  # ...its worker starts
    state.edit("parallel.microbatches", 8)  # ...and another while it runs
    qtbot.wait(20)  # the event loop turns while the first is in flight
    release.set()
    settle(state)
    window.killTimer(timer)
    # every prediction ran on the one worker thread (a thread started per prediction made the GUI thread
    # wait in Thread.start while the new thread held the interpreter)
    assert threads and all(t is not threading.main_thread() for t in threads) and len(set(threads)) == 1
    assert state.prediction.config == state.config and shown[-1] == state.config
    assert state.config.parallel.microbatches == 8
    assert all(c == state.config for c in shown)  # the older config's prediction was never shown
    assert ticks  # the event loop turned while predicting


def test_the_prediction_worker_outlives_a_closed_window():
    """A window closed while its prediction ran makes that prediction's signal raise RuntimeError (its
    QObject is gone); the worker thread goes on to the next request."""
    import threading

    from gui.state import _WORKER

    def gone():
        raise RuntimeError("Internal C++ object (State) already deleted.")

    done = threading.Event()
    _WORKER.submit(gone)
    _WORKER.submit(done.set)
    assert done.wait(5)


def test_edit_menu_undoes_a_slider_drag_with_ctrl_z_and_file_new_resets(window, qtbot):
    """Issue 27, item 3: Ctrl+Z takes back the whole drag of a slider, Ctrl+Shift+Z (Redo) repeats it,
    File → New goes back to the embedded default — each enabled only when it can do something."""
    from engine import default_config

    state = window.state
    assert not window.undo_action.isEnabled() and not window.redo_action.isEnabled()
    start = state.config
    slider = window.controls.size.slider
    step = 1 if slider.value() < slider.maximum() else -1
    for _ in (1, 2):
        slider.setValue(slider.value() + step)
        QApplication.processEvents()
    assert state.config != start and window.undo_action.isEnabled()
    qtbot.keyClick(window, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    QApplication.processEvents()
    assert state.config == start and window.redo_action.isEnabled()
    window.redo_action.trigger()
    assert state.config != start
    window.new_config()
    assert state.config == default_config() and window.current_path is None
