"""Every config field a person can set has a control: the hand-made ones, and one generated from each
other field's declaration (gui.widgets.all_fields), which edits the config and shows its problem."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QApplication, QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox  # noqa: E402

from engine.config import KNOBS  # noqa: E402
from gui.widgets.all_fields import OWNED_BY  # noqa: E402
from tests.conftest import settle  # noqa: E402

pytestmark = pytest.mark.gui
ROOT_HF = Path(__file__).resolve().parents[2] / "assets" / "hf_configs" / "llama3-8b" / "config.json"


def test_every_field_a_person_can_set_has_a_control(window):
    more = window.controls.more
    assert more.widgets == {}  # made when a fold is first opened: a folded section costs the window nothing
    for toggle in more.toggles.values():
        toggle.setChecked(True)
    controls = window.controls.controls
    without = [p for p in KNOBS if p not in controls and OWNED_BY.get(p) not in controls]
    assert without == []
    generated = more.widgets
    for path in ("training.compile", "training.float8", "conventions.compute_efficiency", "model.dropout",
                 "parallel.async_tp", "cluster.intra_node_bandwidth_gb_per_s"):
        assert path in generated, path
    assert isinstance(generated["training.compile"], QCheckBox)
    assert isinstance(generated["training.float8"], QComboBox)
    assert isinstance(generated["conventions.compute_efficiency"], QDoubleSpinBox)
    assert isinstance(generated["model.vocab"], QSpinBox)
    # the tooltip is the declaration: the doc, the allowed values and why
    tip = generated["conventions.compute_efficiency"].toolTip()
    assert KNOBS["conventions.compute_efficiency"].doc in tip and "achieved / peak FLOP/s" in tip


def test_a_generated_control_edits_the_config(window, qtbot):
    more = window.controls.more
    toggle = more.toggles["training"]
    assert more.bodies["training"].isHidden() and more.all_body.isHidden()
    qtbot.mouseClick(more.all_toggle, Qt.MouseButton.LeftButton)  # "More settings", then its training fold
    QApplication.processEvents()
    qtbot.mouseClick(toggle, Qt.MouseButton.LeftButton)
    assert not more.bodies["training"].isHidden()
    box = more.widgets["training.compile"]
    assert not box.isChecked() and window.state.config.training.compile is False
    box.click()  # as a click on it does (QAbstractButton.click: press, release, toggled)
    settle(window.state)
    assert window.state.config.training.compile is True
    assert window.state.prediction.config.training.compile is True
    spin = more.widgets["training.recompute_every"]
    spin.setValue(3)
    assert window.state.config.training.recompute_every == 3


def test_a_problem_opens_the_fold_that_holds_its_control(window):
    more = window.controls.more
    assert more.bodies["training"].isHidden() and "training.float8" not in more.widgets  # not made yet
    window.state.edit("training.float8", "tensorwise")  # as an opened file would (fp32 on CPU ranks: refused)
    QApplication.processEvents()
    assert not more.bodies["training"].isHidden() and not more.all_body.isHidden()
    combo = more.widgets["training.float8"]
    assert combo.currentData() == "tensorwise"  # the control shows what was asked, its problem under it
    text = window.controls.problem_text("training.float8")
    assert "float8 training" in text and "training.float8 = 'tensorwise'" in text
    assert window.state.config.training.float8 == "none"  # the charts keep the last valid config


def test_a_gpus_own_number_makes_a_custom_gpu_of_its_kind(window):
    """'What if this card had more memory?': the GPU's own fields edit a table of the chosen kind's numbers."""
    more = window.controls.more
    more.toggles["cluster.gpu"].setChecked(True)
    memory = more.widgets["cluster.gpu.memory_gib"]
    before = window.state.config.cluster.gpu
    assert memory.value() == before.memory_gib
    memory.setValue(before.memory_gib * 2)
    settle(window.state)
    gpu = window.state.config.cluster.gpu
    assert gpu.memory_gib == before.memory_gib * 2 and gpu.name == before.name
    assert gpu.peak_bf16_tflops == before.peak_bf16_tflops  # the rest of the kind's numbers kept
    assert window.state.prediction.prediction.memory.capacity_bytes == gpu.memory_bytes
    assert window.controls.gpu.currentText() == before.name
    assert window.state.config.to_dict()["cluster"]["gpu"]["memory_gib"] == before.memory_gib * 2  # the file's table


def test_the_expert_load_is_typed_as_a_list_and_junk_is_the_configs_problem(window):
    more = window.controls.more
    more.toggles["conventions"].setChecked(True)
    line = more.widgets["conventions.moe_expert_load"]
    line.setText("0.5, lots")
    line.editingFinished.emit()
    QApplication.processEvents()
    assert "conventions.moe_expert_load" in window.controls.problem_text("conventions.moe_expert_load")
    assert window.state.config.conventions.moe_expert_load == ()


def test_a_cluster_preset_and_a_hugging_face_config_fill_what_they_name(window, tmp_path):
    more = window.controls.more
    more.toggles["cluster"].setChecked(True)
    preset = more.widgets["cluster.preset"]
    preset.setCurrentIndex(preset.findData("dgx-h100"))
    settle(window.state)
    cl = window.state.config.cluster
    assert (cl.preset, cl.gpu.name, cl.intra_node_bandwidth_gb_per_s) == ("dgx-h100", "h100-sxm", 450.0)
    assert cl.gpus == 4  # the layout's GPU count stays
    hf = tmp_path / "config.json"
    hf.write_text(ROOT_HF.read_text())
    more.toggles["model"].setChecked(True)
    line = more.widgets["model.hf_config"]
    line.setText(str(hf))
    line.editingFinished.emit()
    settle(window.state)
    model = window.state.config.model
    assert model.hf_config is not None and model.seq_len == 64  # the architecture, at the length shown
