"""Every config field a person can set, as a control generated from its declaration.

The hand-made controls (the size slider, the GPU count, the schedule, …) cover the fields people drag
most; every other field of ``engine.config.KNOBS`` gets one here, built from what the field declares:
a check box for a flag, a combo box over its choices, a spin box over its range, each with its doc and
the reason for its bounds as the tooltip, and its problem shown under it like any other control. A
section's generated fields sit in a folded group ("More model settings", …), filled from the desired
config only while it is open, so a drag never pays for them.

Left to the config file (``FILE_ONLY``), with the reason: what is a path, a table or a measured list.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QGridLayout,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.config import KNOBS, ClusterSpec, Conventions, Knob, ModelSpec, ParallelSpec, TrainingSpec

#: fields with no control in the window, and why: they are set in the config file
FILE_ONLY: dict[str, str] = {
    "model.hf_config": "a Hugging Face config.json path, read when the file is loaded",
    "cluster.preset": "a cluster preset fills the links when the file is loaded",
    "conventions.moe_expert_load": "a measured per-expert load: a list (from a run's records) in the file",
}
#: a custom GPU is a [cluster.gpu] table in the file; the window picks a GPU kind (its presets)
FILE_ONLY_PREFIXES = ("cluster.gpu.",)

SECTIONS: tuple[tuple[str, str, type], ...] = (
    ("model", "More model settings", ModelSpec),
    ("cluster", "More cluster settings", ClusterSpec),
    ("parallel", "More parallelism settings", ParallelSpec),
    ("training", "More training settings", TrainingSpec),
    ("conventions", "Conventions", Conventions),
)
_INT_MAX = 2**31 - 1  # QSpinBox holds a C int


def has_control(path: str) -> bool:
    """Whether the window gives ``path`` a control (hand-made or generated)."""
    return path not in FILE_ONLY and not path.startswith(FILE_ONLY_PREFIXES)


def tooltip(k: Knob) -> str:
    """The field's doc, and what it allows with the reason for the bounds."""
    text = k.doc
    if k.range is not None:
        text += f"\nallowed: {k.range.describe()} — {k.range.source}"
    elif isinstance(k.choices, dict):
        text += "\n" + "\n".join(f"{v}: {meaning}" for v, meaning in k.choices.items())
    return text


class GeneratedControls:
    """Builds one folded group per section on ``panel`` (a ControlsPanel) for every field without a
    hand-made control, and mirrors the desired config into the open ones."""

    def __init__(self, panel, outer: QVBoxLayout) -> None:
        self.panel = panel
        self.widgets: dict[str, QWidget] = {}  # path -> its generated control
        self.bodies: dict[str, QWidget] = {}  # section -> its folded body
        self.toggles: dict[str, QPushButton] = {}
        self._defaults: dict[str, Any] = {}
        self._desired: dict | None = None
        for section, title, cls in SECTIONS:
            hints = typing.get_type_hints(cls)
            paths = [(f"{section}.{f.name}", f, hints[f.name]) for f in dataclasses.fields(cls)]
            paths = [(p, f, t) for p, f, t in paths if has_control(p) and p not in panel.controls]
            if not paths:
                continue
            toggle = QPushButton(f"▸ {title} ({len(paths)})")
            toggle.setObjectName("foldToggle")
            toggle.setFlat(True)
            toggle.setCheckable(True)
            outer.addWidget(toggle)
            body = QWidget()
            grid = QGridLayout(body)
            grid.setColumnStretch(1, 1)
            grid.setVerticalSpacing(2)
            grid.setContentsMargins(6, 0, 0, 6)
            body.hide()
            outer.addWidget(body)
            self.bodies[section], self.toggles[section] = body, toggle
            count = len(paths)
            toggle.toggled.connect(lambda on, s=section, t=title, n=count: self._fold(s, t, n, on))
            for path, f, kind in paths:
                widget = self._control(path, KNOBS[path], kind)
                if widget is None:
                    continue
                widget.setToolTip(tooltip(KNOBS[path]))
                self.widgets[path] = widget
                self._defaults[path] = None if f.default is dataclasses.MISSING else f.default
                label = "" if isinstance(widget, QCheckBox) else path.split(".", 1)[1].replace("_", " ")
                panel._row(grid, label, path, widget)

    # ------------------------------------------------------------------ building

    def _control(self, path: str, k: Knob, kind) -> QWidget | None:
        edit = self.panel._edit
        if kind is bool:
            box = QCheckBox(path.split(".", 1)[1].replace("_", " "))
            box.toggled.connect(lambda on: edit(path, bool(on)))
            return box
        if k.choices:
            combo = QComboBox()
            for value in k.choices:
                combo.addItem(str(value), value)
            combo.currentIndexChanged.connect(lambda i: i >= 0 and edit(path, combo.itemData(i)))
            return combo
        if kind is int and k.range is not None:
            spin = QSpinBox()
            lo = int(k.range.lo) + (1 if k.range.lo_open else 0)
            spin.setRange(lo, min(int(k.range.hi) - (1 if k.range.hi_open else 0), _INT_MAX))
            spin.setKeyboardTracking(False)
            spin.valueChanged.connect(lambda v: edit(path, int(v)))
            return spin
        if kind is float and k.range is not None:
            spin = QDoubleSpinBox()
            spin.setDecimals(4)
            step = 10.0 ** -spin.decimals()
            spin.setRange(k.range.lo + (step if k.range.lo_open else 0.0),
                          k.range.hi - (step if k.range.hi_open else 0.0))
            spin.setKeyboardTracking(False)
            spin.valueChanged.connect(lambda v: edit(path, float(v)))
            return spin
        return None  # a type with no generated control (none today: test_gui_all_fields holds it)

    def _fold(self, section: str, title: str, n: int, on: bool) -> None:
        self.toggles[section].setText(f"{'▾' if on else '▸'} {title} ({n})")
        self.bodies[section].setVisible(on)
        if on and self._desired is not None:
            self.sync(self._desired)

    def reveal(self, paths) -> None:
        """Open the folded sections that hold one of ``paths`` (a problem under a closed fold would be unseen)."""
        for path in paths:
            section = path.split(".", 1)[0]
            if path in self.widgets and self.bodies[section].isHidden():
                self.toggles[section].setChecked(True)

    # ------------------------------------------------------------------ mirror

    def sync(self, desired: dict) -> None:
        """Show the desired config in the open sections (a folded one is filled when opened)."""
        self._desired = desired
        for path, widget in self.widgets.items():
            section, key = path.split(".", 1)
            if self.bodies[section].isHidden():
                continue
            value = desired.get(section, {}).get(key, self._defaults[path])
            widget.blockSignals(True)
            try:
                if isinstance(widget, QCheckBox):
                    widget.setChecked(bool(value))
                elif isinstance(widget, QComboBox):
                    widget.setCurrentIndex(widget.findData(value))
                elif isinstance(value, (int, float)) and not isinstance(value, bool) and widget.value() != value:
                    widget.setValue(value)
            finally:
                widget.blockSignals(False)
