"""Every config field a person can set, as a control generated from its declaration.

The hand-made controls (the size slider, the GPU count, the schedule, …) cover the fields people drag
most; every other field of ``engine.config.KNOBS`` gets one here, built from what the field declares:
a check box for a flag, a combo box over its choices, a spin box over its range, each with its doc and
the reason for its bounds as the tooltip, and its problem shown under it like any other control. A
section's generated fields sit in a folded group ("More model settings", …) inside one folded "More
settings", made when it is first opened and filled from the desired config only while it is open, so a
drag never pays for them (one toggle in the panel: its layout costs a drag nothing either).

A GPU's own fields (memory, peak FLOP/s, bandwidths: "what if this card had 96 GB?") make the GPU a custom
table of the chosen kind's fields; a measured expert load is edited as one list of fractions (a load given
per block or microbatch stays as the file gives it). A cluster preset and a Hugging Face config.json, which
fill other fields, replace what they fill (``gui.session.Session.edit``).
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
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.config import KNOBS, ClusterSpec, Conventions, GPUSpec, Knob, ModelSpec, ParallelSpec, TrainingSpec
from engine.model.presets import cluster_presets, gpu_presets

#: fields a hand-made control owns under another name
OWNED_BY = {"cluster.gpu.name": "cluster.gpu"}  # the GPU kind combo box

SECTIONS: tuple[tuple[str, str, type], ...] = (
    ("model", "More model settings", ModelSpec),
    ("cluster", "More cluster settings", ClusterSpec),
    ("cluster.gpu", "The GPU's own numbers", GPUSpec),
    ("parallel", "More parallelism settings", ParallelSpec),
    ("training", "More training settings", TrainingSpec),
    ("conventions", "Conventions", Conventions),
)
_INT_MAX = 2**31 - 1  # QSpinBox holds a C int



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
        self._section: dict[str, str] = {}  # path -> its section (cluster.gpu for the GPU's own fields)
        self._pending: dict[str, tuple] = {}  # section -> (its grid, its fields) until it is first opened
        self._desired: dict | None = None
        # one toggle in the panel: the sections' own toggles live in its body, laid out only when it is open
        self.all_toggle = QPushButton("▸ More settings: every other field")
        self.all_toggle.setObjectName("foldToggle")
        self.all_toggle.setFlat(True)
        self.all_toggle.setCheckable(True)
        outer.addWidget(self.all_toggle)
        self.all_body = QWidget()
        inner = QVBoxLayout(self.all_body)
        inner.setContentsMargins(0, 0, 0, 0)
        inner.setSpacing(0)
        self.all_body.hide()
        outer.addWidget(self.all_body)
        self.all_toggle.toggled.connect(self._open_all)
        for section, title, cls in SECTIONS:
            hints = typing.get_type_hints(cls)
            paths = [(f"{section}.{f.name}", f, hints[f.name]) for f in dataclasses.fields(cls)]
            paths = [(p, f, t) for p, f, t in paths
                     if p not in panel.controls and OWNED_BY.get(p) not in panel.controls]
            if not paths:
                continue
            toggle = QPushButton(f"▸ {title} ({len(paths)})")
            toggle.setObjectName("foldToggle")
            toggle.setFlat(True)
            toggle.setCheckable(True)
            inner.addWidget(toggle)
            body = QWidget()
            grid = QGridLayout(body)
            grid.setColumnStretch(1, 1)
            grid.setVerticalSpacing(2)
            grid.setContentsMargins(6, 0, 0, 6)
            body.hide()
            inner.addWidget(body)
            self.bodies[section], self.toggles[section] = body, toggle
            self._pending[section] = (grid, paths)
            for path, f, _ in paths:
                self._section[path] = section
                self._defaults[path] = None if f.default is dataclasses.MISSING else f.default
            count = len(paths)
            toggle.toggled.connect(lambda on, s=section, t=title, n=count: self._fold(s, t, n, on))

    def _build(self, section: str) -> None:
        """A section's rows, made when it is first opened: a folded section costs the window nothing."""
        grid, paths = self._pending.pop(section, (None, ()))
        for path, f, kind in paths:
            widget = self._control(path, KNOBS[path], kind)
            if widget is None:
                continue
            widget.setToolTip(tooltip(KNOBS[path]))
            self.widgets[path] = widget
            label = "" if isinstance(widget, QCheckBox) else f.name.replace("_", " ")
            self.panel._row(grid, label, path, widget)

    # ------------------------------------------------------------------ building

    def _control(self, path: str, k: Knob, kind) -> QWidget | None:
        edit = self.panel._edit
        if path == "cluster.preset":  # a cluster preset: the GPU kind and the links it names
            combo = QComboBox()
            combo.addItem("(none)", None)
            for name in cluster_presets():
                combo.addItem(name, name)
            combo.currentIndexChanged.connect(lambda i: i >= 0 and edit(path, combo.itemData(i)))
            return combo
        if path == "model.hf_config":  # a Hugging Face config.json: its architecture becomes the model
            line = QLineEdit()
            line.setPlaceholderText("path to a config.json (relative to the working directory)")
            line.editingFinished.connect(lambda: not line.isReadOnly() and edit(path, line.text().strip() or None))
            return line
        if kind is tuple:  # the measured expert load: one list of fractions
            line = QLineEdit()
            line.setPlaceholderText("none (balanced): or fractions, e.g. 0.4, 0.2, 0.2, 0.2")
            line.editingFinished.connect(lambda: self._list_edited(path, line))
            return line
        if kind is bool:
            box = QCheckBox(path.rsplit(".", 1)[1].replace("_", " "))
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

    def _list_edited(self, path: str, line: QLineEdit) -> None:
        """A list of numbers typed as ``0.4, 0.2, …`` (empty: none); what is not a number is the config's problem."""
        if line.isReadOnly():
            return
        words = [w.strip() for w in line.text().replace(";", ",").split(",") if w.strip()]
        try:
            value = [float(w) for w in words]
        except ValueError:
            value = words  # the config names the field and what it allows
        self.panel._edit(path, value)

    def _open_all(self, on: bool) -> None:
        self.all_toggle.setText(f"{'▾' if on else '▸'} More settings: every other field")
        self.all_body.setVisible(on)
        if on and self._desired is not None:
            self.sync(self._desired)

    def _fold(self, section: str, title: str, n: int, on: bool) -> None:
        if on and not self.all_toggle.isChecked():
            self.all_toggle.setChecked(True)
        if on and section in self._pending:
            self._build(section)
        self.toggles[section].setText(f"{'▾' if on else '▸'} {title} ({n})")
        self.bodies[section].setVisible(on)
        if on and self._desired is not None:
            self.sync(self._desired)

    def reveal(self, paths) -> None:
        """Open (and make) the folded sections that hold one of ``paths``: a problem under a closed fold would be
        unseen."""
        for path in paths:
            section = self._section.get(path)
            if section is not None and self.bodies[section].isHidden():
                self.toggles[section].setChecked(True)

    # ------------------------------------------------------------------ mirror

    def sync(self, desired: dict) -> None:
        """Show the desired config in the open sections (a folded one is filled when opened)."""
        self._desired = desired
        for path, widget in self.widgets.items():  # the made ones
            section = self._section[path]
            if self.bodies[section].isHidden() or self.all_body.isHidden():
                continue
            value = self._value(desired, section, path.rsplit(".", 1)[1], self._defaults[path])
            widget.blockSignals(True)
            try:
                if isinstance(widget, QLineEdit) and not isinstance(value, (list, tuple)):  # a path
                    if widget.text() != (value or "") and not widget.hasFocus():
                        widget.setText(value or "")
                elif isinstance(widget, QLineEdit):
                    nested = bool(value) and isinstance(value[0], (list, tuple))
                    widget.setReadOnly(nested)
                    text = ("per block / microbatch, as the file gives it" if nested else
                            ", ".join(f"{x:g}" if isinstance(x, (int, float)) else str(x) for x in value))
                    if widget.text() != text and not widget.hasFocus():
                        widget.setText(text)
                elif isinstance(widget, QCheckBox):
                    widget.setChecked(bool(value))
                elif isinstance(widget, QComboBox):
                    widget.setCurrentIndex(widget.findData(value))
                elif isinstance(value, (int, float)) and not isinstance(value, bool) and widget.value() != value:
                    widget.setValue(value)
            finally:
                widget.blockSignals(False)

    @staticmethod
    def _value(desired: dict, section: str, key: str, default: Any) -> Any:
        """A field's value in the desired config; the GPU's own fields from its table, or its kind's preset."""
        if section != "cluster.gpu":
            return desired.get(section, {}).get(key, default)
        gpu = desired.get("cluster", {}).get("gpu")
        table = gpu if isinstance(gpu, dict) else gpu_presets().get(gpu, {})
        return table.get(key, default)
