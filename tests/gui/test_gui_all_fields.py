"""Every config field a person can set has a control: the hand-made ones, and one generated from each
other field's declaration (gui.widgets.all_fields), which edits the config and shows its problem."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QApplication, QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox  # noqa: E402

from engine.config import KNOBS  # noqa: E402
from gui.widgets.all_fields import FILE_ONLY, has_control  # noqa: E402
from tests.conftest import settle  # noqa: E402

pytestmark = pytest.mark.gui


def test_every_field_a_person_can_set_has_a_control(window):
    controls = window.controls.controls
    without = [p for p in KNOBS if has_control(p) and p not in controls]
    assert without == []
    # what only the file sets says why, and is few: a path, a list, a custom GPU's table, a cluster preset
    assert all(FILE_ONLY.values()) and len([p for p in KNOBS if not has_control(p)]) <= 12
    generated = window.controls.more.widgets
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
    assert more.bodies["training"].isHidden()
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
    assert more.bodies["training"].isHidden()
    combo = more.widgets["training.float8"]
    combo.setCurrentIndex(combo.findData("tensorwise"))  # the embedded default runs on CPU ranks: no float8
    QApplication.processEvents()
    assert not more.bodies["training"].isHidden()
    text = window.controls.problem_text("training.float8")
    assert "float8 training" in text and "training.float8 = 'tensorwise'" in text
    assert window.state.config.training.float8 == "none"  # the charts keep the last valid config
