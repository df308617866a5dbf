"""Metrics (only what the engine actually predicts) and the strategy explainer.

With a pinned baseline each metric also shows the baseline's value and the change
(``Step time: 412 ms (baseline 530 ms, −22 %)``), and the first row says which config the
baseline is.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QEvent, QRect, QSize, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QStaticText
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QSizePolicy, QTextBrowser, QVBoxLayout, QWidget

from engine.time.ops import clock_short
from gui.comparison import fmt_seconds
from gui.predicted import describe_config
from gui.widgets.memory_chart import fmt_bytes

# One short paragraph per strategy: what it shards, what it costs, when to pick it.
EXPLAINER: dict[str, tuple[str, str]] = {
    "ddp": ("Data parallel (DDP)",
            "Every rank holds the whole model, gradients and optimizer state and works on its own slice of the "
            "batch. After the backward pass the gradients are averaged with an all-reduce, overlapped with compute "
            "bucket by bucket. Cheapest in communication per byte of model; pick it whenever the model, its "
            "gradients and optimizer state fit on one GPU."),
    "dataparallel": ("Legacy DataParallel (nn.DataParallel)",
                     "One Python process drives every GPU of one node. Each step GPU 0 splits the batch, copies the "
                     "whole model out to the other GPUs, runs the copies in threads that take turns on the GIL, "
                     "pulls every output back to compute the loss, and sums every gradient onto itself before it "
                     "alone steps the optimizer. So GPU 0 holds more than the rest, and all traffic funnels "
                     "through it with nothing overlapped: adding GPUs adds work to GPU 0, and tokens/s falls behind "
                     "DDP. Use DDP (one process per GPU) instead; this is here to show why."),
    "zero1": ("ZeRO-1",
              "Like DDP, but each of the dp ranks keeps only 1/dp of the optimizer state (and fp32 master weights). "
              "Gradients are reduce-scattered, each rank updates its shard, and the new weights are all-gathered: "
              "about the same traffic as DDP. The easy win when Adam's 12 bytes per parameter are what overflows."),
    "zero2": ("ZeRO-2 / FSDP SHARD_GRAD_OP",
              "Also shards gradients: each rank keeps only the reduced gradient shard it will update. Same traffic "
              "as ZeRO-1, less memory; parameters are still whole on every rank, so compute is unchanged."),
    "zero3": ("ZeRO-3 / FSDP FULL_SHARD",
              "Shards parameters too. Each layer is all-gathered just before its forward and again before its "
              "backward, then freed, so a rank holds about 1/dp of the model plus one or two layers in full. "
              "Costs ~1.5× DDP's traffic and needs fast links to hide it; pick it when the model itself does not "
              "fit, before reaching for tensor or pipeline parallelism."),
    "tp": ("Tensor parallel (TP)",
           "Splits each matrix multiply across tp ranks (attention heads and the MLP's hidden units), so weights, "
           "gradients, optimizer state and most activations shrink by tp. Every layer pays two all-reduces in the "
           "forward and two in the backward, on the critical path: keep TP inside a node (NVLink) and usually ≤ 8."),
    "sp": ("Sequence parallel (with TP)",
           "The parts TP leaves replicated (norms, dropout, residuals) are split along the sequence instead, so "
           "their activations shrink by tp too. The all-reduces become reduce-scatter + all-gather of the same "
           "volume: more memory saved at no extra traffic. Turn it on whenever tp > 1."),
    "cp": ("Context parallel (CP)",
           "Splits every sequence over cp GPUs, so each holds seq_len / cp tokens of every activation — the lever "
           "for long context (32K to 256K tokens and beyond), where activations, not weights, fill memory. Torch's "
           "head-tail layout gives GPU i chunks i and 2·cp−1−i of 2·cp, balancing the causal work. Attention still "
           "needs every key: K and V are all-gathered once per layer ('allgather') or passed round a ring of cp − 1 "
           "steps ('alltoall'), overlapped with the blockwise attention; the backward sends dK and dV back. The cp "
           "GPUs also join the FSDP shard group (torchtitan's dp_shard_cp), so weights shard over dp·cp. Compose it "
           "with TP inside a node and FSDP across nodes."),
    "pp": ("Pipeline parallel (PP)",
           "Cuts the layers into stages on different ranks and streams microbatches through them, sending only "
           "activations between neighbours: the cheapest traffic of all, so it is what crosses slow inter-node "
           "links. The cost is the bubble: ranks idle while the pipeline fills and drains. More microbatches "
           "shrink the bubble; the first stage holds activations of up to pp microbatches at once."),
    "GPipe": ("GPipe schedule",
              "All forwards, then all backwards. Simple, but every rank holds the activations of all microbatches."),
    "1F1B": ("1F1B schedule",
             "After a warm-up, each rank alternates one forward and one backward, so at most pp microbatches are "
             "in flight: same bubble as GPipe, far less activation memory."),
    "Interleaved1F1B": ("Interleaved 1F1B",
                        "Each rank holds several non-adjacent stages (virtual stages), so the pipeline fills v times "
                        "faster and the bubble shrinks by v, for v times more point-to-point messages."),
    "LoopedBFS": ("Looped BFS",
                  "Several stages per rank, run breadth-first: all microbatches through a rank's first stage before "
                  "its next. Overlaps communication well; holds more activations than interleaved 1F1B."),
    "InterleavedZeroBubble": ("Interleaved zero bubble",
                              "Splits each backward into input-gradient (I) work, which the previous stage waits "
                              "for, and weight-gradient (W) work, which can wait; W fills what would be idle time."),
    "ZBVZeroBubble": ("ZBV zero bubble",
                      "Two stages per rank placed in a V (rank 0 holds the first and last stage) plus the I/W split: "
                      "close to zero bubble with 1F1B-like memory."),
    "DualPipeV": ("DualPipeV",
                  "DeepSeek's V-shaped schedule that runs a forward and a backward chunk side by side so one's "
                  "communication hides behind the other's compute; needs at least 2·pp microbatches."),
    "lora": ("LoRA fine-tuning",
             "Freezes the base weights and trains a small low-rank pair B·A beside each chosen Linear (rank r, "
             "scaled by alpha / r). Frozen weights need no gradients and no optimizer state, so instead of ~16 "
             "bytes per parameter the base costs only its storage; the adapters are usually well under 1 % of the "
             "model. Activations barely shrink: backward still has to pass gradients through the frozen layers. "
             "Pick it when full fine-tuning does not fit, or when many task-specific variants must share one base."),
    "qlora": ("QLoRA (4-bit base)",
              "LoRA with the frozen base stored in 4-bit NormalFloat (nf4), one scale per block of 64 weights, the "
              "scales themselves quantised again: about 0.5 bytes per base parameter. Weights are dequantised on "
              "the fly for each matmul, so compute gets a little slower; memory for the base drops about 4× from "
              "bf16. The way a 70B model is fine-tuned on a single large GPU."),
    "recompute": ("Activation recomputation",
                  "Drops activations in the forward and recomputes them in the backward. 'selective' recomputes only "
                  "the attention internals (cheap, large saving at long sequences); 'full' keeps only each layer's "
                  "input and costs about one extra forward (~33% more compute)."),
}


def active_strategies(cfg) -> list[str]:
    par, tr = cfg.parallel, cfg.training
    keys = []
    if par.dp_mode == "dataparallel":
        keys.append("dataparallel")
    elif par.dp > 1 or par.zero:
        keys.append({0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[par.zero])
    if par.cp > 1:
        keys.append("cp")
    if par.tp > 1:
        keys.append("tp")
    if par.sequence_parallel:
        keys.append("sp")
    if par.pp > 1:
        keys += ["pp", par.schedule]
    if tr.finetune == "lora":
        keys.append("lora")
        if tr.lora_base_dtype == "nf4":
            keys.append("qlora")
    if tr.recompute != "none":
        keys.append("recompute")
    return keys


#: what the memory chart's bars are made of, for a GPU user (shown under the strategies in use)
MEMORY_WORDS = (
    "<p><b>Allocated and reserved.</b> <i>Allocated</i>: live tensors at the peak, what "
    "<code>torch.cuda.max_memory_allocated()</code> reports (the coloured categories). <i>Reserved</i>: what the "
    "caching allocator holds, <code>torch.cuda.max_memory_reserved()</code>: the allocated blocks plus the free "
    "ones it keeps for reuse (sizes rounded up, segments split, freed blocks cached), the hatched cap. Above it, "
    "outside the allocator, the CUDA context and the collective library's (NCCL's) buffers, which only nvidia-smi "
    "shows. A rank fits when reserved + that overhead is within the card's capacity. "
    "<code>PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True</code> "
    "(conventions.expandable_segments) keeps reserved closer to allocated.</p>")
CPU_MEMORY_WORDS = (
    "<p><b>Allocated and reserved.</b> CPU ranks have no caching allocator and no CUDA context: what they "
    "reserve is what they allocate, the live tensors at the peak. On a GPU the same step also reserves the "
    "allocator's cached free blocks (<code>max_memory_reserved</code>) and the CUDA context and NCCL buffers.</p>")


def explainer_html(cfg) -> str:
    active = active_strategies(cfg)
    parts = ["<p><b>In this configuration:</b> "
             + (", ".join(EXPLAINER[k][0] for k in active if k in EXPLAINER) or "a single GPU, no parallelism")
             + ".</p>"]
    parts.append(CPU_MEMORY_WORDS if cfg.cluster.gpu.name == "cpu" else MEMORY_WORDS)
    for key in [*active, *(k for k in EXPLAINER if k not in active)]:
        if key not in EXPLAINER:
            continue
        title, text = EXPLAINER[key]
        style = "" if key in active else ' style="color:#777"'
        parts.append(f"<p{style}><b>{title}.</b> {text}</p>")
    return "".join(parts)


def _lora_trainable(cfg) -> str:
    """Adapter parameters against the model's, from engine.model.lora (the same count the memory uses)."""
    try:
        from engine.model.lora import adapter_params
        from engine.model.params import param_counts

        adapters = adapter_params(cfg.model, cfg.training.lora_rank, cfg.training.lora_targets)
        total = param_counts(cfg.model).total
    except Exception as exc:  # an engine limitation must not take the panel down
        return f"not predicted ({exc})"
    from gui.family import format_params

    return f"{format_params(adapters)} of {format_params(total)} parameters ({adapters / total * 100:.2f} %)"


def metric_rows(shown) -> list[tuple[str, str]]:
    """(name, value) for every metric the engine produced for this prediction (a ``gui.predicted.Predicted``)
    — nothing else."""
    cfg, pred = shown.config, shown.prediction
    rows = [
        ("Global batch", f"{cfg.global_batch_size:,} sequences · {cfg.tokens_per_step:,} tokens"),
        ("Layout", f"{cfg.parallel.world_size} ranks = dp {cfg.parallel.dp} × "
                   + (f"cp {cfg.parallel.cp} × " if cfg.parallel.cp > 1 else "")
                   + f"tp {cfg.parallel.tp} × pp {cfg.parallel.pp} on {cfg.cluster.nodes} node(s)"),
    ]
    step = None if pred is None else pred.step  # engine.time.step.StepTime
    if step is not None:
        seconds = step.seconds
        rows.append(("Step time", fmt_seconds(seconds)))
        rows.append(("Timed by", f"calibration of {Path(shown.calibrated_from).name}" if shown.calibrated_from
                     else clock_short(cfg)))
        rows.append(("Tokens/s", f"{cfg.tokens_per_step / seconds:,.0f}" if seconds > 0 else "—"))
        rows.append(("MFU", f"{step.mfu * 100:.1f}%"))
        if seconds > 0:
            # the parts that round to a whole percent (predict prints every part to the millisecond)
            parts = [f"{k.replace('_', ' ')} {v / seconds * 100:.0f}%" for k, v in step.breakdown.items()
                     if round(v / seconds * 100) >= 1]
            rows.append(("Step breakdown", " · ".join(parts)))
        per_pp = step.comm.per_pp_rank
        if per_pp:
            critical = per_pp[min(step.critical_pp_rank, len(per_pp) - 1)]
            dims = sorted({i.dim for i in critical.items})
            for dim in dims:
                rows.append((f"Comm · {dim}",
                             f"{fmt_bytes(critical.bytes_sent(dim))} in {fmt_seconds(critical.seconds(dim))}"
                             f" (rank {critical.rank})"))
    tl = None if pred is None else pred.pipeline  # engine.pipeline.timeline.Timeline
    if tl is not None:
        rows.append(("Pipeline bubble", f"{tl.bubble_fraction * 100:.1f}% ({cfg.conventions.bubble})"))
        rows.append(("Pipeline makespan", fmt_seconds(tl.makespan_s)))
    mem = None if pred is None else pred.memory
    if mem is not None and mem.per_rank:
        peak = mem.peak
        rows.append(("Peak memory", f"{fmt_bytes(peak.total)} on rank {peak.rank}"))
        rows.extend(device_rows(mem, cfg))
        if cfg.parallel.dp_mode == "dataparallel" and len(mem.per_rank) > 1:
            g0, gi = mem.per_rank[0].total, mem.per_rank[-1].total
            rows.append(("GPU 0 vs others", f"{fmt_bytes(g0)} vs {fmt_bytes(gi)} (+{fmt_bytes(g0 - gi)}: module, "
                                            ".grad, optimizer, the whole batch's loss)"))
    full_peak = shown.full_finetune_peak_bytes
    if cfg.training.finetune == "lora":
        rows.append(("Trainable (LoRA)", _lora_trainable(cfg)))
        if full_peak is not None:
            fits = mem is not None and full_peak <= mem.capacity_bytes
            rows.append(("Full fine-tune would need", f"{fmt_bytes(full_peak)} on the fullest rank"
                                                     f" ({'fits' if fits else 'does not fit'})"))
    if shown.calibrated_from:
        rows.append(("Time from", f"the calibration of run {Path(shown.calibrated_from).name}"))
    if shown.calibration_error:
        rows.append(("Calibration", shown.calibration_error))
    if shown.error:
        rows.append(("Prediction", shown.error))
    return rows


def device_rows(mem, cfg) -> list[tuple[str, str]]:
    """The fullest rank (by what the device must hold) as a GPU user reads it: allocated, reserved,
    the overhead outside the allocator, and the headroom that is left of the card."""
    # one rank of each group of identical ranks (the engine's groups: no walk over every rank)
    firsts = [g.first for g in mem.groups] if getattr(mem, "groups", None) else mem.per_rank
    worst = max(firsts, key=lambda r: (getattr(r, "device_bytes", r.total), -r.rank))
    allocated = getattr(worst, "allocated", worst.total)
    reserved = getattr(worst, "reserved", allocated)
    device = getattr(worst, "device_bytes", reserved)
    cpu = cfg.cluster.gpu.name == "cpu"
    # short enough to read without scrolling at 1280 × 800; "Strategies explained" says what each means
    rows = [("Allocated", f"{fmt_bytes(allocated)} on rank {worst.rank} (max_memory_allocated)")]
    if cpu:
        rows.append(("Reserved", f"{fmt_bytes(reserved)}: = allocated (CPU ranks have no caching allocator)"))
    else:
        rows.append(("Reserved", f"{fmt_bytes(reserved)} (max_memory_reserved): +{fmt_bytes(reserved - allocated)} "
                                 "cached"))
        rows.append(("Outside allocator", f"{fmt_bytes(device - reserved)} (CUDA context, collective buffers)"))
    head = mem.capacity_bytes - device
    rows.append(("Memory headroom", ("" if head >= 0 else "OVER by ") + fmt_bytes(abs(head))
                 + f" of {fmt_bytes(mem.capacity_bytes)}"))
    return rows


#: metric row -> (the PredictionDiff number its change is told by, how to write the baseline's value);
#: "peak.total" is diff.peak["total"]
ROW_CHANGES = {
    "Step time": ("step_seconds", fmt_seconds),
    "Tokens/s": ("tokens_per_s", lambda v: f"{v:,.0f}"),
    "MFU": ("mfu", lambda v: f"{v * 100:.1f}%"),
    "Pipeline bubble": ("bubble_fraction", lambda v: f"{v * 100:.1f}%"),
    "Pipeline makespan": ("makespan_s", fmt_seconds),
    "Peak memory": ("peak.total", fmt_bytes),
}
#: rows shown with the baseline's value only when it differs (no single number to take a change of)
ROWS_COMPARED_AS_TEXT = ("Global batch", "Layout", "Allocated", "Reserved", "Outside allocator", "Memory headroom",
                         "GPU 0 vs others", "Trainable (LoRA)", "Full fine-tune would need")


def format_change(change) -> str:
    """'−22 %' (a relative change), '+2.8 pt' for a fraction (MFU, bubble), 'same', or '' when unknown."""
    if change is None or change.delta is None:
        return ""
    if change.delta == 0:
        return "same"
    sign = "−" if change.delta < 0 else "+"
    if change.unit == "fraction":
        return f"{sign}{abs(change.delta) * 100:.1f} pt"
    if change.relative is None:
        return ""
    pct = abs(change.relative) * 100
    return f"{sign}{pct:.1f} %" if pct < 10 else f"{sign}{pct:.0f} %"


def _baseline_value(name: str, diff) -> str | None:
    """'530 ms (baseline …' part of a metric row: the baseline's value and the change; None when the
    row is not a number the differences have, or the baseline has no such number."""
    if name.startswith("Comm · "):
        dim = name.removeprefix("Comm · ")
        seconds, sent = diff.metrics.get(f"comm.{dim}.seconds"), diff.metrics.get(f"comm.{dim}.bytes_sent")
        if seconds is None or seconds.baseline is None:
            return None
        change = format_change(seconds)
        return (f"baseline {fmt_bytes(sent.baseline)} sent, {fmt_seconds(seconds.baseline)}"
                + (f", {change} time" if change else ""))
    if name not in ROW_CHANGES:
        return None
    key, fmt = ROW_CHANGES[name]
    change = diff.peak.get("total") if key == "peak.total" else diff.metrics.get(key)
    if change is None or change.baseline is None:
        return None
    text = format_change(change)
    return f"baseline {fmt(change.baseline)}" + (f", {text}" if text else "")


def rows_with_baseline(rows: list[tuple[str, str]], baseline_rows: list[tuple[str, str]], diff,
                       baseline_text: str) -> list[tuple[str, str]]:
    """The current rows, each number followed by the baseline's and the change (from ``diff``, a
    gui.predicted.PredictionDiff); a metric only the baseline has is listed as none now; the first row
    names the baseline's config (``baseline_text``)."""
    base = dict(baseline_rows)
    out = [("Baseline", baseline_text)]
    for name, value in rows:
        told = _baseline_value(name, diff)
        if told is not None:
            out.append((name, f"{value} ({told})"))
        elif name in ROWS_COMPARED_AS_TEXT and name in base and base[name] != value:
            out.append((name, f"{value} (baseline {base[name]})"))
        else:
            out.append((name, value))
    have = {name for name, _ in rows}
    for name, value in baseline_rows:
        if name not in have and (name in ROW_CHANGES or name.startswith("Comm · ")):
            out.append((name, f"none (baseline {value})"))
    return out


class MetricsTable(QWidget):
    """Name/value rows painted directly, values bold and wrapped.

    A rich-text QLabel cost ~6 ms per slider move (HTML parsed and laid out again, and its
    geometry update re-laid out the window); new numbers here only repaint this widget. It says
    how tall its rows are for a width (``heightForWidth``); the panel sizes it to that inside a
    scroll area (``MetricsPanel.fit_table``), so rows that do not fit scroll instead of being cut
    off, and no layout outside the scroll area ever hears of it.
    """

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("metrics")
        self.rows: list[tuple[str, str]] = []
        self.setMinimumWidth(250)
        policy = QSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        policy.setHeightForWidth(True)
        self.setSizePolicy(policy)
        self.bold = QFont(self.font())
        self.bold.setBold(True)
        self._layout_cache: tuple[int, list, list, int] | None = None  # (width, rows, layout, height)
        self._heights: dict[tuple[int, str], int] = {}  # a bold value's wrapped height per (value width, text)
        self._names: dict[str, QStaticText] = {}  # the rows' names, laid out once (the values change)

    def set_rows(self, rows: list[tuple[str, str]]) -> bool:
        """New rows; True when they changed (the holder then fits the height again). Only the rows whose
        text changed are repainted, and from the first row whose height changed (a value that now wraps)
        down (a slider move changes a few numbers: the model size, 6 of 15 rows)."""
        if rows == self.rows:
            return False
        before, (old_layout, old_height) = self.rows, self._row_heights(self.width())
        self.rows = list(rows)
        new_layout, new_height = self._row_heights(self.width())
        y = 2
        for i, (old, new, (key_w, value_w, h)) in enumerate(zip(before, self.rows, new_layout)):
            if old_layout[i][:2] != (key_w, value_w):  # the columns moved: every row
                self.update()
                return True
            if old_layout[i][2] != h:  # a row's height changed: it and every row below it
                self.update(0, y, self.width(), max(old_height, new_height) - y)
                return True
            if old != new:
                self.update(0, y, self.width(), h)
            y += h + 3
        if len(before) != len(self.rows):  # rows added or removed at the end
            self.update(0, y, self.width(), max(old_height, new_height) - y)
        return True

    def _row_heights(self, width: int) -> tuple[list[tuple[int, int, int]], int]:
        """(key width, value width, height) per row and the total height, for ``width``."""
        if not self.rows:
            return [], 0
        cached = self._layout_cache
        if cached is not None and cached[0] == width and cached[1] is self.rows:
            return cached[2], cached[3]
        fm, bfm = self.fontMetrics(), QFontMetrics(self.bold)
        key_w = max(fm.horizontalAdvance(k) for k, _ in self.rows) + 12
        value_w = max(40, width - key_w - 4)
        wrap = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop | Qt.TextFlag.TextWordWrap
        measured = self._heights
        if len(measured) > 512:  # values of a long session; the rows of the last few predictions recur
            measured.clear()
        out, y, line = [], 2, fm.height()
        for _, v in self.rows:
            h = measured.get((value_w, v))  # the bold value's height (``self.bold`` is fixed)
            if h is None:  # only a value not seen at this width is laid out (most rows keep their text)
                h = measured[value_w, v] = bfm.boundingRect(QRect(0, 0, value_w, 10_000), wrap, v).height()
            h = max(line, h)
            out.append((key_w, value_w, h))
            y += h + 3
        self._layout_cache = (width, self.rows, out, y)
        return out, y

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        return self._row_heights(width)[1]

    def minimumSizeHint(self) -> QSize:
        return QSize(250, 0)

    def text(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.rows)

    def sizeHint(self) -> QSize:
        return QSize(360, 300)

    def _name(self, key: str) -> QStaticText:
        name = self._names.get(key)
        if name is None:
            if len(self._names) > 256:  # names come from a fixed set; bounded all the same
                self._names.clear()
            name = self._names[key] = QStaticText(key)
            name.setTextFormat(Qt.TextFormat.PlainText)
        return name

    def paintEvent(self, event) -> None:
        if not self.rows:
            return
        p = QPainter(self)
        top = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop
        wrap = top | Qt.TextFlag.TextWordWrap
        key_color, value_color = QColor("#555"), self.palette().windowText().color()
        y = 2
        layout, _ = self._row_heights(self.width())
        region = event.region()
        for (k, v), (key_w, value_w, h) in zip(self.rows, layout):
            if not region.intersects(QRect(0, y, self.width(), h)):  # a row not repainted: unchanged
                y += h + 3
                continue
            p.setFont(self.font())
            p.setPen(key_color)
            p.drawStaticText(0, y, self._name(k))
            p.setFont(self.bold)
            p.setPen(value_color)
            p.drawText(QRect(key_w, y, value_w, h), wrap, v)
            y += h + 3
        p.end()


class MetricsPanel(QWidget):
    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        title = QLabel("Metrics")
        title.setObjectName("chartTitle")
        lay.addWidget(title)
        self.table = MetricsTable()
        self.scroll = QScrollArea()  # rows that do not fit scroll, never get cut off
        self.scroll.setWidget(self.table)
        self.scroll.setWidgetResizable(False)  # sized by fit_table: a new height moves no layout
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.viewport().installEventFilter(self)
        lay.addWidget(self.scroll, 1)
        # the explainer is a separate view; the window places it (a tab)
        self.explainer = QTextBrowser()
        self.explainer.setObjectName("explainer")
        self.rows: list[tuple[str, str]] = []
        self.baseline_rows: list[tuple[str, str]] = []  # metric_rows of the baseline, made once when pinned
        self.baseline_text = ""
        self._last = None  # the prediction shown
        state.predictionReady.connect(self.on_prediction)
        state.baselineChanged.connect(self.on_baseline)
        self._explainer_html = ""
        state.configChanged.connect(self._explain)
        self._explain(state.config)

    def _explain(self, cfg) -> None:
        html = explainer_html(cfg)
        if html != self._explainer_html:  # the strategy changed, not just a number: lay the text out again
            self._explainer_html = html
            self.explainer.setHtml(html)

    def table_holder(self) -> QWidget:
        return self

    def fit_table(self) -> None:
        """The table as wide as the view and as tall as its rows (at least the view's height)."""
        view = self.scroll.viewport()
        width = max(self.table.minimumWidth(), view.width())
        height = max(view.height(), self.table.heightForWidth(width))
        if self.table.width() != width or self.table.height() != height:
            self.table.resize(width, height)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.scroll.viewport() and event.type() == QEvent.Type.Resize:
            self.fit_table()
        return super().eventFilter(obj, event)

    def on_prediction(self, pred) -> None:
        self._last = pred
        self.rows = metric_rows(pred)
        diff = self.state.difference if self.baseline_rows else None
        if diff is not None and diff.current is pred:
            self.rows = rows_with_baseline(self.rows, self.baseline_rows, diff, self.baseline_text)
        if self.table.set_rows(self.rows):
            self.fit_table()

    def on_baseline(self, pred) -> None:
        if pred is None:
            self.baseline_rows, self.baseline_text = [], ""
        else:
            self.baseline_rows = metric_rows(pred)
            self.baseline_text = describe_config(pred.config) + (
                f" · timed with the calibration of {Path(pred.calibrated_from).name}" if pred.calibrated_from else "")
        if self._last is not None:
            self.on_prediction(self._last)
