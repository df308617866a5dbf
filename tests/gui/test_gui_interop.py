"""The window's File → Import a launcher's config, Export layout as…, Export report, driven offscreen
through the menus' own actions (the file dialogs answered)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QFileDialog, QMessageBox  # noqa: E402

from engine import Config  # noqa: E402

pytestmark = pytest.mark.gui
ROOT = Path(__file__).resolve().parents[2]


def _action(window, text: str):
    for menu_action in window.menuBar().actions():
        for action in menu_action.menu().actions():
            if action.text().replace("&", "").startswith(text):
                return action
            if action.menu() is not None:
                for sub in action.menu().actions():
                    if sub.text().replace("&", "").startswith(text):
                        return sub
    raise AssertionError(f"no menu action {text!r}")


def test_import_an_accelerate_config_through_the_file_menu(window, qtbot, monkeypatch):
    shown = []
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (
        str(ROOT / "assets" / "examples" / "interop" / "accelerate-fsdp2.yaml"), "accelerate config (*.yaml *.yml)"))
    monkeypatch.setattr(QMessageBox, "information", lambda *a: shown.append(a[2]))
    before = window.state.config
    _action(window, "Import a launcher's config").trigger()
    cfg = window.state.config
    assert (cfg.cluster.gpus, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.replicate, cfg.parallel.zero) == \
        (16, 8, 2, 2, 3)
    assert cfg.model == before.model  # accelerate's file has no model: the window's stays
    assert shown == []  # the model, batch and card are the window's: nothing assumed, nothing left out
    assert window.statusBar().currentMessage() == "imported accelerate: accelerate-fsdp2.yaml"
    assert window.state.can_undo
    qtbot.waitUntil(lambda: window.memory.plot.isVisible(), timeout=2000)


def test_an_import_the_window_cannot_take_says_why(window, monkeypatch, tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}')
    warned = []
    monkeypatch.setattr(QMessageBox, "warning", lambda *a: warned.append(a[2]))
    before = window.state.config
    assert window.import_launcher(bad, "deepspeed") == []
    assert "offload_param.device" in warned[0] and window.state.config == before


def test_export_layout_as_each_format_and_the_report(window, monkeypatch, tmp_path):
    told = []
    monkeypatch.setattr(QMessageBox, "information", lambda *a: told.append(a[2]))
    window.state.set_config(Config.load(ROOT / "assets" / "examples" / "llama3-8b-16gpu.toml"))
    for text, name in (("torchtitan 0.3 command line", "a.sh"), ("torchtitan 0.2 job config", "a.toml"),
                       ("accelerate config", "a.yaml"), ("DeepSpeed config", "a.json")):
        target = tmp_path / name
        monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, t=target, **k: (str(t), ""))
        _action(window, text).trigger()
        assert target.read_text().strip(), name
    assert "torchrun --nnodes 2 --nproc_per_node 8 -m torchtitan.train" in (tmp_path / "a.sh").read_text()
    assert any("parallel.pp = 4" in t for t in told)  # accelerate and DeepSpeed cannot say the pipeline
    report = tmp_path / "report.html"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(report), ""))
    _action(window, "Export report").trigger()
    html = report.read_text()
    assert html.count("<svg") == 2 and "<script" not in html  # self-contained: nothing fetched, nothing run
    assert not any(s in html for s in ('src="http', "<link", "@import", "url(http"))
    assert "llama3-8b" in html and "Pipeline timeline" in html


def test_file_open_takes_a_launcher_config_by_its_filter(window, monkeypatch):
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (
        str(ROOT / "assets" / "examples" / "interop" / "deepspeed-zero3.json"), "DeepSpeed config (*.json)"))
    monkeypatch.setattr(QMessageBox, "information", lambda *a: None)
    warned = []
    monkeypatch.setattr(QMessageBox, "warning", lambda *a: warned.append(a[2]))
    _action(window, "Open config").trigger()  # the window's 4 ranks cannot hold its 256-sequence batch of 4 × 2
    assert "train_batch_size = 256" in warned[0]
    window.state.set_config(Config.load(ROOT / "assets" / "examples" / "llama3-8b-16gpu.toml").replace(
        cluster={"gpus": 32}, parallel={"dp": 32, "tp": 1, "pp": 1, "sequence_parallel": False, "virtual_stages": 1,
                                        "schedule": "1F1B"}))
    _action(window, "Open config").trigger()
    cfg = window.state.config
    assert (cfg.parallel.zero, cfg.training.micro_batch_size, cfg.parallel.microbatches) == (3, 4, 2)
