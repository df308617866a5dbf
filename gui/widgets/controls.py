"""The controls: every knob of a Config, each with its problem shown right under it."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine import names
from engine.config import FIELD_RANGES
from engine.config.problems import NO_VALUE
from engine.model.presets import gpu_presets, model_presets
from gui.family import family_for, format_params
from gui.widgets.all_fields import GeneratedControls
from gui.widgets.barrier import LayoutBarrier
from gui.widgets.moe_controls import ExpertControls


def nice_values(lo: int, hi: int) -> list[int]:
    """1..8, then 2^k and 1.5·2^k: the counts people actually pick."""
    out = set(range(lo, min(hi, 8) + 1))
    p = 8
    while p <= hi:
        out.update(v for v in (p, p * 3 // 2) if lo <= v <= hi)
        p *= 2
    return sorted(out)


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, p = [], 1
    while p <= hi:
        if p >= lo:
            out.append(p)
        p *= 2
    return out


class StepSlider(QWidget):
    """A slider over a list of allowed values, with the value printed beside it."""

    valueChosen = Signal(int)

    def __init__(self, values: list[int], parent=None, fmt=None):
        super().__init__(parent)
        self.values = list(values)
        self.fmt = fmt or (lambda v: f"{v:,}")
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, len(self.values) - 1)
        self.slider.setPageStep(1)
        self.label = QLabel()
        # fixed in both directions: a new value repaints the label without re-laying out the window
        self.label.setFixedSize(self.label.fontMetrics().horizontalAdvance("≈888.8M") + 4,
                                self.label.sizeHint().height())
        self.label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.slider, 1)
        lay.addWidget(self.label)
        self.slider.valueChanged.connect(self._moved)

    def _moved(self, index: int) -> None:
        v = self.values[index]
        self.label.setText(self.fmt(v))
        self.valueChosen.emit(v)

    def value(self) -> int:
        return self.values[self.slider.value()]

    def set_value(self, v: int) -> None:
        if v not in self.values:
            self.values = sorted({*self.values, v})
            self.slider.blockSignals(True)
            self.slider.setRange(0, len(self.values) - 1)
            self.slider.blockSignals(False)
        self.slider.blockSignals(True)
        self.slider.setValue(self.values.index(v))
        self.slider.blockSignals(False)
        self.label.setText(self.fmt(v))


def tokens_label(n: int) -> str:
    """A sequence length as the field says it: 131,072 up to a million tokens, then 1M, 2M, … (2²⁰ each)."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n:,}"


#: the sequence-length slider: powers of two from 16 to the field's bound (model.seq_len's range)
SEQ_LEN_VALUES = powers_of_two(16, int(FIELD_RANGES["model.seq_len"].hi))

CP_ROTATE_LABELS = {"allgather": "all-gather K/V", "alltoall": "ring (all-to-all)"}


ZERO_LABELS = {
    0: "DDP",
    1: "ZeRO-1",
    2: "ZeRO-2 (SHARD_GRAD_OP)",
    3: "ZeRO-3 (FSDP FULL_SHARD)",
}


DP_MODE_LABELS = {
    "ddp": "DDP (one process per GPU)",
    "dataparallel": "DataParallel (legacy, one process)",
}
FINETUNE_LABELS = {"full": "Full (every weight trains)", "lora": "LoRA (frozen base, adapters train)"}
LORA_TARGET_LABELS = {"attention": "attention (q, k, v, o)", "mlp": "MLP (gate, up, down)", "all": "attention + MLP"}
LORA_BASE_LABELS = {"fp32": "fp32", "bf16": "bf16", "nf4": "nf4 (QLoRA, 4-bit)"}
LORA_KEYS = ("training.lora_rank", "training.lora_alpha", "training.lora_targets", "training.lora_base_dtype")


def _describe_change(path: str, value) -> str:
    key = path.split(".", 1)[1]
    if key == "zero":
        return "sharding DDP"
    if key == "sequence_parallel":
        return "sequence parallel off"
    if key == "gpus":
        return f"GPU count {value} (one node)"
    return f"{key.replace('_', ' ')} {value}"


class ControlsPanel(QWidget):
    """Writes edits to the State; mirrors the State's desired config and its problems."""

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.controls: dict[str, QWidget] = {}
        self.errors: dict[str, QLabel] = {}
        self.row_labels: dict[str, QLabel] = {}
        self._family: list = []
        self._syncing = False

        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        self.banner = QLabel()
        self.banner.setObjectName("problemBanner")
        self.banner.setWordWrap(True)
        self.banner.hide()
        outer.addWidget(self.banner)
        self._build_model(outer)
        self.moe = ExpertControls(self, outer)  # experts, top-k, ep: gui.widgets.moe_controls
        self._build_cluster(outer)
        self._build_parallelism(outer)
        self._build_training(outer)
        self.more = GeneratedControls(self, outer)  # every other field: gui.widgets.all_fields
        self._lora_shown: bool | None = None
        outer.addStretch(1)

        state.desiredChanged.connect(self.sync)
        state.problemsChanged.connect(self.show_problems)
        self.sync(state.desired)

    # ------------------------------------------------------------------ building

    def _build_model(self, outer: QVBoxLayout) -> None:
        _, grid = self._group("Model", outer)
        self.preset = QComboBox()
        self.preset.addItems(list(model_presets()))
        self.preset.currentTextChanged.connect(lambda t: self._edit("model.preset", t))
        self._row(grid, "Preset", "model.preset", self.preset)
        self.size = StepSlider([0])
        self.size.valueChosen.connect(self._size_moved)
        self.size_label = QLabel()
        self.size_label.setObjectName("hint")
        self.size_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.size_label.setWordWrap(True)  # a large model's shape takes two lines in a narrow column
        self._row(grid, "Size", "model.size", self.size, hint=LayoutBarrier(self.size_label))
        self.seq_len = StepSlider(SEQ_LEN_VALUES, fmt=tokens_label)
        self.seq_len.valueChosen.connect(lambda v: self._edit("model.seq_len", v))
        self._row(grid, "Sequence length", "model.seq_len", self.seq_len)

    def _build_cluster(self, outer: QVBoxLayout) -> None:
        _, grid = self._group("Cluster", outer)
        self.gpu = QComboBox()
        self.gpu.addItems(list(gpu_presets()))
        self.gpu.currentTextChanged.connect(lambda t: self._edit("cluster.gpu", t))
        self._row(grid, "GPU kind", "cluster.gpu", self.gpu)
        self.gpus = StepSlider(nice_values(1, 16384))
        self.gpus.valueChosen.connect(lambda v: self._edit("cluster.gpus", v))
        self._row(grid, "GPU count", "cluster.gpus", self.gpus)
        self.gpus_per_node = self._spin(1, 64, "cluster.gpus_per_node")
        self._row(grid, "GPUs per node", "cluster.gpus_per_node", self.gpus_per_node)

    def _build_parallelism(self, outer: QVBoxLayout) -> None:
        _, grid = self._group("Parallelism", outer)
        self.dp_mode = self._choice(names.DP_MODES, DP_MODE_LABELS, "parallel.dp_mode")
        self.dp_mode.setToolTip("DDP: one process per GPU, gradients all-reduced. DataParallel: the legacy "
                                "torch.nn.DataParallel, one process drives every GPU of one node from GPU 0.")
        self.dataparallel_offer = QWidget()
        offer = QHBoxLayout(self.dataparallel_offer)
        offer.setContentsMargins(0, 0, 0, 0)
        self.dataparallel_hint = QLabel()
        self.dataparallel_hint.setObjectName("hint")
        self.dataparallel_hint.setWordWrap(True)
        self.dataparallel_fix = QPushButton("Set them")
        self.dataparallel_fix.setToolTip("Change the layout so nn.DataParallel can drive it: every GPU a replica")
        self.dataparallel_fix.clicked.connect(self.state.use_dataparallel)
        offer.addWidget(self.dataparallel_hint, 1)
        offer.addWidget(self.dataparallel_fix)
        self.dataparallel_offer.hide()
        self._row(grid, "DP mode", "parallel.dp_mode", self.dp_mode, hint=self.dataparallel_offer)
        for key, label in (("dp", "Data parallel (dp)"), ("cp", "Context parallel (cp)"), ("tp", "Tensor parallel (tp)"),
                           ("pp", "Pipeline parallel (pp)")):
            spin = self._spin(1, 16384, f"parallel.{key}")
            setattr(self, key, spin)
            self._row(grid, label, f"parallel.{key}", spin)
        self.cp.setToolTip("Each sequence split over cp GPUs (head-tail: chunks i and 2·cp−1−i of 2·cp); "
                           "attention exchanges K and V between them. Needs seq_len divisible by 2·cp.")
        self.cp_rotate = self._choice(names.CP_ROTATE_METHODS, CP_ROTATE_LABELS, "parallel.cp_rotate")
        self.cp_rotate.setToolTip("How K and V move between the cp ranks (torch's set_rotate_method): all-gather "
                                  "them once per layer, or pass chunks round a ring in cp − 1 all-to-all steps")
        self._row(grid, "CP exchange", "parallel.cp_rotate", self.cp_rotate)
        self.zero = QComboBox()
        for stage in names.ZERO_STAGES:
            self.zero.addItem(ZERO_LABELS.get(stage, f"ZeRO-{stage}"), stage)
        self.zero.currentIndexChanged.connect(lambda i: self._edit("parallel.zero", self.zero.itemData(i)))
        self._row(grid, "Sharding", "parallel.zero", self.zero)
        self.sp = QCheckBox("sequence parallel (with TP)")
        self.sp.toggled.connect(lambda b: self._edit("parallel.sequence_parallel", bool(b)))
        self._row(grid, "", "parallel.sequence_parallel", self.sp)
        self.schedule = QComboBox()
        self.schedule.addItems(list(names.SCHEDULES))
        self.schedule.currentTextChanged.connect(lambda t: self._edit("parallel.schedule", t))
        self._row(grid, "Schedule", "parallel.schedule", self.schedule)
        self.virtual_stages = self._spin(1, 16, "parallel.virtual_stages")
        self._row(grid, "Virtual stages", "parallel.virtual_stages", self.virtual_stages)
        self.microbatches = StepSlider(nice_values(1, 2048))
        self.microbatches.valueChosen.connect(lambda v: self._edit("parallel.microbatches", v))
        self._row(grid, "Microbatches", "parallel.microbatches", self.microbatches)

    def _build_training(self, outer: QVBoxLayout) -> None:
        _, grid = self._group("Training", outer)
        self.micro_batch_size = self._spin(1, 4096, "training.micro_batch_size")
        self._row(grid, "Micro-batch size", "training.micro_batch_size", self.micro_batch_size)
        for key, label, choices in (
            ("precision", "Precision", names.PRECISIONS),
            ("optimizer", "Optimizer", names.OPTIMIZERS),
            ("recompute", "Recompute", names.RECOMPUTE_KINDS),
        ):
            box = QComboBox()
            box.addItems(list(choices))
            box.currentTextChanged.connect(lambda t, k=key: self._edit(f"training.{k}", t))
            setattr(self, key, box)
            self._row(grid, label, f"training.{key}", box)
        self.finetune = self._choice(names.FINETUNE_KINDS, FINETUNE_LABELS, "training.finetune")
        self._row(grid, "Fine-tuning", "training.finetune", self.finetune)
        self.lora_rank = self._spin(1, 4096, "training.lora_rank")
        self.lora_rank.setToolTip("r: each adapted Linear gains B·A with r·(d_in + d_out) trainable parameters")
        self._row(grid, "LoRA rank", "training.lora_rank", self.lora_rank)
        self.lora_alpha = QDoubleSpinBox()
        self.lora_alpha.setRange(0.01, 4096.0)
        self.lora_alpha.setDecimals(2)
        self.lora_alpha.setKeyboardTracking(False)
        self.lora_alpha.setToolTip("The adapter's output is scaled by alpha / rank (no effect on memory)")
        self.lora_alpha.valueChanged.connect(lambda v: self._edit("training.lora_alpha", float(v)))
        self._row(grid, "LoRA alpha", "training.lora_alpha", self.lora_alpha)
        self.lora_targets = self._choice(names.LORA_TARGETS, LORA_TARGET_LABELS, "training.lora_targets")
        self._row(grid, "LoRA targets", "training.lora_targets", self.lora_targets)
        self.lora_base_dtype = self._choice(names.LORA_BASE_DTYPES, LORA_BASE_LABELS, "training.lora_base_dtype")
        self.lora_base_dtype.setToolTip("How the frozen base weights are stored: nf4 is QLoRA's 4-bit NormalFloat "
                                        "(blocks of 64 with a quantisation constant each)")
        self._row(grid, "Base weights", "training.lora_base_dtype", self.lora_base_dtype)

    def _group(self, title: str, outer: QVBoxLayout) -> tuple[QGroupBox, QGridLayout]:
        box = QGroupBox(title)
        grid = QGridLayout(box)
        grid.setColumnStretch(1, 1)
        grid.setVerticalSpacing(2)
        outer.addWidget(box)
        return box, grid

    def _row(self, grid: QGridLayout, label: str, key: str, widget: QWidget, hint: QLabel | None = None) -> None:
        r = grid.rowCount()
        name = QLabel(label)
        grid.addWidget(name, r, 0)
        grid.addWidget(widget, r, 1)
        self.row_labels[key] = name
        if hint is not None:
            r += 1
            grid.addWidget(hint, r, 1)
        err = QLabel()
        err.setObjectName("problem")
        err.setWordWrap(True)
        err.hide()
        grid.addWidget(err, r + 1, 0, 1, 2)
        self.controls[key] = widget
        self.errors[key] = err

    def _choice(self, values, labels: dict[str, str], key: str) -> QComboBox:
        """A combo box over the engine's names, showing words; the item data is the config value."""
        box = QComboBox()
        for v in values:
            box.addItem(labels.get(v, v), v)
        box.currentIndexChanged.connect(lambda i: self._edit(key, box.itemData(i)))
        return box

    def _spin(self, lo: int, hi: int, key: str) -> QSpinBox:
        spin = QSpinBox()
        spin.setRange(lo, hi)
        spin.setKeyboardTracking(False)
        spin.valueChanged.connect(lambda v: self._edit(key, int(v)))
        return spin

    # ------------------------------------------------------------------ edits

    def _edit(self, path: str, value: Any) -> None:
        if not self._syncing:
            self.state.edit(path, value)

    def _size_moved(self, index_value: int) -> None:
        member = self._family[self.size.slider.value()]
        self._show_size(member)
        self._edit("model.size", member.shape())

    def _show_size(self, member) -> None:
        """The member's exact parameter count (engine.model.params) beside the slider, its shape below."""
        self.size.label.setText(format_params(member.params))
        self.size.label.setToolTip(f"{member.params:,} parameters")
        s = member.spec
        text = f"{s.layers} layers × {s.hidden} hidden, {s.heads} heads ({s.kv_heads} KV), FFN {s.ffn_hidden}"
        if s.experts > 0:  # a mixture of experts: its experts, and what one token passes through
            text = (f"{s.layers} layers × {s.hidden} hidden, {s.experts} experts (top-{s.experts_per_token}) "
                    f"of FFN {s.expert_hidden} · {format_params(member.active)} active")
        self.size_label.setText(text)

    # ------------------------------------------------------------------ mirror

    def sync(self, desired: dict) -> None:
        """Show the desired config (the controls never disagree with the State)."""
        self._syncing = True
        try:
            model, cl, par, tr = desired["model"], desired["cluster"], desired["parallel"], desired["training"]
            presets = model_presets()
            preset = model.get("preset")
            self._set_combo(self.preset, preset if preset in presets else None)
            stages = par.get("pp", 1) * par.get("virtual_stages", 1)
            stages = stages if isinstance(stages, int) and stages > 0 else 1
            ep = par.get("ep", 1)
            self._family, index = family_for(model, presets.get(preset), min_layers=stages,
                                             ep=ep if isinstance(ep, int) and ep > 0 else None)
            self.size.values = list(range(len(self._family)))
            self.size.slider.blockSignals(True)
            self.size.slider.setRange(0, len(self._family) - 1)
            self.size.slider.setValue(index)
            self.size.slider.blockSignals(False)
            self._show_size(self._family[index])
            self.seq_len.set_value(int(model["seq_len"]))
            gpu = cl.get("gpu")
            kind = gpu if isinstance(gpu, str) else gpu.get("name") if isinstance(gpu, dict) else None
            self._set_combo(self.gpu, kind)  # a custom GPU (a table) shows the kind its numbers started from
            self.gpus.set_value(int(cl["gpus"]))
            self._set_spin(self.gpus_per_node, cl["gpus_per_node"])
            for key in ("dp", "tp", "pp", "virtual_stages"):
                self._set_spin(getattr(self, key), par[key])
            self._set_spin(self.cp, par.get("cp", 1))
            self._set_data(self.cp_rotate, par.get("cp_rotate", "allgather"))
            i = self.zero.findData(par.get("zero", 0))
            self.zero.blockSignals(True)
            self.zero.setCurrentIndex(max(0, i))
            self.zero.blockSignals(False)
            self.sp.blockSignals(True)
            self.sp.setChecked(bool(par.get("sequence_parallel", False)))
            self.sp.blockSignals(False)
            self._set_combo(self.schedule, par["schedule"])
            self.microbatches.set_value(int(par["microbatches"]))
            self._set_spin(self.micro_batch_size, tr["micro_batch_size"])
            for key in ("precision", "optimizer", "recompute"):
                self._set_combo(getattr(self, key), tr[key])
            self._set_data(self.dp_mode, par.get("dp_mode", "ddp"))
            self._set_data(self.finetune, tr.get("finetune", "full"))
            self._set_spin(self.lora_rank, tr.get("lora_rank", 16))
            if self.lora_alpha.value() != float(tr.get("lora_alpha", 32.0)):
                self.lora_alpha.blockSignals(True)
                self.lora_alpha.setValue(float(tr.get("lora_alpha", 32.0)))
                self.lora_alpha.blockSignals(False)
            self._set_data(self.lora_targets, tr.get("lora_targets", "all"))
            self._set_data(self.lora_base_dtype, tr.get("lora_base_dtype", "fp32"))
            self._show_lora(tr.get("finetune") == "lora")
            self._offer_dataparallel(par.get("dp_mode") == "dataparallel")
            self.moe.sync(model, par)
            self.more.sync(desired)
        finally:
            self._syncing = False

    def _show_lora(self, on: bool) -> None:
        """LoRA's own knobs appear only under LoRA (toggled on a change, not on every sync)."""
        if on == self._lora_shown:
            return
        self._lora_shown = on
        for key in LORA_KEYS:
            self.controls[key].setVisible(on)
            self.row_labels[key].setVisible(on)

    def _offer_dataparallel(self, chosen: bool) -> None:
        """Under DataParallel: say in words what the layout must change, with a button that does it."""
        changes = self.state.dataparallel_changes() if chosen else {}
        if changes:
            words = ", ".join(_describe_change(k, v) for k, v in changes.items())
            text = (f"nn.DataParallel is one process on one node: it needs {words}; "
                    "every GPU then becomes a data-parallel replica.")
            if text != self.dataparallel_hint.text():
                self.dataparallel_hint.setText(text)
        if self.dataparallel_offer.isHidden() == bool(changes):
            self.dataparallel_offer.setVisible(bool(changes))

    @staticmethod
    def _set_data(box: QComboBox, value) -> None:
        box.blockSignals(True)
        box.setCurrentIndex(box.findData(value))
        box.blockSignals(False)

    @staticmethod
    def _set_combo(box: QComboBox, text: str | None) -> None:
        box.blockSignals(True)
        if text is None:
            box.setCurrentIndex(-1)
        else:
            box.setCurrentText(text)
        box.blockSignals(False)

    @staticmethod
    def _set_spin(spin: QSpinBox, value: int) -> None:
        if spin.value() == int(value):  # QSpinBox.setValue repaints its box and line edit even when unchanged
            return
        spin.blockSignals(True)
        spin.setValue(int(value))
        spin.blockSignals(False)

    def show_problems(self, problems: dict) -> None:
        """Each problem in words beside the control that owns its field; the rest in a banner."""
        self.more.reveal(key for key, items in problems.items() if items)
        for key, label in self.errors.items():
            items = problems.get(key, [])
            text = "\n".join(f"⚠ {p.message}" + (f" ({p.field} = {p.value!r})" if p.value is not None and p.value is not NO_VALUE else "")
                             for p in items)
            if text == label.text() and label.isHidden() != bool(items):
                continue  # unchanged: don't touch (re-polishing costs milliseconds per move)
            label.setText(text)
            label.setVisible(bool(items))
            widget = self.controls[key]
            widget.setProperty("invalid", bool(items))
            widget.style().unpolish(widget)
            widget.style().polish(widget)
        rest = [p for key, items in problems.items() if key not in self.errors for p in items]
        if problems:
            head = "Not valid, the charts show the last valid configuration."
            self.banner.setText(head + "".join(f"\n⚠ {p}" for p in rest))
            self.banner.show()
        elif not self.banner.isHidden():
            self.banner.hide()

    def problem_text(self, key: str) -> str:
        label = self.errors[key]
        return label.text() if label.isVisible() or not label.isHidden() else ""
