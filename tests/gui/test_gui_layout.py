"""Nothing in the window is clipped at 1280 × 800 and above, and the window remembers its geometry.

``clipped(window)`` walks every visible widget of a window and returns one line per piece of text
that does not fit where it is drawn: QLabels (single-line: the text's advance within the contents
rectangle; word-wrapped: ``heightForWidth`` within the height), buttons, combo boxes, line edits
and spin boxes, tab bars, table headers and cells, custom-painted widgets that declare the height
they need (``heightForWidth``), and pyqtgraph text (TextItems, line labels, legends, axis ticks
and labels) against the visible area of their plot. It knows nothing of ShardScope's widgets, so it
runs unchanged on any window built of Qt widgets and pyqtgraph plots.
"""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QRect, QRectF, Qt  # noqa: E402
from PySide6.QtGui import QImage, QPainter, QTextDocument  # noqa: E402
from PySide6.QtGui import Qt as QtGuiNamespace  # noqa: E402  (mightBeRichText lives in QtGui)
from PySide6.QtWidgets import (  # noqa: E402
    QAbstractButton,
    QApplication,
    QComboBox,
    QLabel,
    QLineEdit,
    QStyle,
    QStyleOptionComboBox,
    QTabBar,
    QTableView,
    QTabWidget,
    QWidget,
)

from engine import default_config  # noqa: E402
from gui.app import make_window  # noqa: E402
from gui.runs import RunRecord  # noqa: E402
from gui.state import State  # noqa: E402

pytestmark = pytest.mark.gui

SIZES = [(1280, 800), (1600, 1000), (1920, 1080)]
SLACK_PX = 1  # rounding between font metrics and layout


# ---------------------------------------------------------------------------------------- checker


def _name(w: QWidget) -> str:
    chain, p = [], w
    while p is not None and len(chain) < 4:
        chain.append(p.objectName() or type(p).__name__)
        p = p.parentWidget()
    return "/".join(reversed(chain))


def _shown(w: QWidget) -> bool:
    """Visible on screen: shown, not zero-sized, and not scrolled or split entirely out of view
    (its rectangle, clipped by every ancestor's, is not empty)."""
    if not w.isVisible() or w.width() <= 0 or w.height() <= 0:
        return False
    rect, p = QRect(w.rect()), w
    while p.parentWidget() is not None and not p.isWindow():
        rect = QRect(p.mapToParent(rect.topLeft()), rect.size()).intersected(p.parentWidget().rect())
        if rect.isEmpty():
            return False
        p = p.parentWidget()
    return True


def _label_problem(label: QLabel) -> str | None:
    text = label.text()
    if not text.strip() or not _shown(label):
        return None
    rich = label.textFormat() == Qt.TextFormat.RichText or (
        label.textFormat() == Qt.TextFormat.AutoText and QtGuiNamespace.mightBeRichText(text))
    if label.wordWrap():
        need = label.heightForWidth(label.width())
        if need > label.height() + SLACK_PX:
            return f"wrapped text needs {need} px of height, has {label.height()}: {text!r}"
        return None
    cr = label.contentsRect()
    fm = label.fontMetrics()
    if rich:
        doc = QTextDocument()
        doc.setDefaultFont(label.font())
        doc.setDocumentMargin(0)
        doc.setHtml(text)
        width, height = doc.idealWidth(), doc.size().height()
    else:
        lines = text.split("\n")
        width = max(fm.horizontalAdvance(line) for line in lines)
        height = fm.height() * len(lines)
    width += label.indent() if label.indent() > 0 else 0
    if width > cr.width() + SLACK_PX:
        return f"single-line text needs {width:.0f} px, has {cr.width()}: {text!r}"
    if height > cr.height() + SLACK_PX:
        return f"text needs {height:.0f} px of height, has {cr.height()}: {text!r}"
    return None


def _button_problem(b: QAbstractButton) -> str | None:
    if not b.text() or not _shown(b):
        return None
    need = b.minimumSizeHint().width() if b.minimumSizeHint().isValid() else b.sizeHint().width()
    need = max(need, b.sizeHint().width()) if b.sizeHint().isValid() else need
    if need > b.width() + SLACK_PX:
        return f"button needs {need} px, has {b.width()}: {b.text()!r}"
    return None


def _combo_problem(box: QComboBox) -> str | None:
    text = box.currentText()
    if not text or not _shown(box):
        return None
    opt = QStyleOptionComboBox()
    box.initStyleOption(opt)
    field = box.style().subControlRect(QStyle.ComplexControl.CC_ComboBox, opt,
                                       QStyle.SubControl.SC_ComboBoxEditField, box)
    need = box.fontMetrics().horizontalAdvance(text)
    if need > field.width() + SLACK_PX:
        return f"combo box text needs {need} px, its field has {field.width()}: {text!r}"
    return None


def _line_edit_problem(edit: QLineEdit) -> str | None:
    if not _shown(edit):
        return None
    text = edit.text() or edit.placeholderText()
    if not text:
        return None
    m = edit.textMargins()
    room = edit.contentsRect().width() - m.left() - m.right() - 4  # QLineEdit's own 2 px each side
    need = edit.fontMetrics().horizontalAdvance(text)
    if need > room + SLACK_PX:
        what = "text" if edit.text() else "placeholder"
        return f"line edit {what} needs {need} px, has {room}: {text!r}"
    return None


def _tab_bar_problem(bar: QTabBar) -> list[str]:
    out = []
    if not _shown(bar):
        return out
    for i in range(bar.count()):
        r = bar.tabRect(i)
        if r.width() < bar.tabSizeHint(i).width() - SLACK_PX or not bar.rect().contains(r):
            out.append(f"tab {i} is cut or elided ({r.width()} of {bar.tabSizeHint(i).width()} px): "
                       f"{bar.tabText(i)!r}")
    return out


def _table_problems(table: QTableView) -> list[str]:
    out = []
    if not _shown(table):
        return out
    model = table.model()
    header = table.horizontalHeader()
    margin = table.style().pixelMetric(QStyle.PixelMetric.PM_HeaderMargin, None, header)
    hfm = header.fontMetrics()
    cell_margin = 2 * (table.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, table) + 1)
    fm = table.fontMetrics()
    first = max(0, table.rowAt(0))
    last = table.rowAt(table.viewport().height() - 1)
    last = model.rowCount() - 1 if last < 0 else last
    for col in range(model.columnCount()):
        if table.isColumnHidden(col):
            continue
        width = header.sectionSize(col)
        title = str(model.headerData(col, Qt.Orientation.Horizontal) or "")
        if header.isVisible() and title and hfm.horizontalAdvance(title) + 2 * margin > width + SLACK_PX:
            out.append(f"column {col} header needs {hfm.horizontalAdvance(title) + 2 * margin} px, has {width}: "
                       f"{title!r}")
        if table.wordWrap():
            continue  # wrapped cells break between words; the row height is the view's business
        for row in range(first, last + 1):
            text = str(model.index(row, col).data() or "")
            if text and fm.horizontalAdvance(text) + cell_margin > width + SLACK_PX:
                out.append(f"cell ({row}, {col}) needs {fm.horizontalAdvance(text) + cell_margin} px, has {width}: "
                           f"{text!r}")
    return out


def _declared_height_problem(w: QWidget) -> str | None:
    """A custom-painted widget without a layout that says how tall its content is for a width."""
    if w.layout() is not None or w.findChildren(QWidget) or not _shown(w):
        return None
    if not w.sizePolicy().hasHeightForWidth() and not w.hasHeightForWidth():
        return None
    need = w.heightForWidth(w.width())
    if need > w.height() + SLACK_PX:
        text = w.text() if callable(getattr(w, "text", None)) else ""
        return f"painted content needs {need} px of height, has {w.height()}: {str(text)[:80]!r}"
    return None


def _plot_problems(plot) -> list[str]:
    """pyqtgraph text of one PlotWidget against its visible area (and its view box for items in it)."""
    import pyqtgraph as pg

    out = []
    if not _shown(plot):
        return out
    scene = plot.scene()
    visible = plot.mapToScene(plot.viewport().rect()).boundingRect()
    boxes = [item for item in scene.items() if isinstance(item, pg.ViewBox)]
    for item in scene.items():
        if not item.isVisible() or not _visible_chain(item):
            continue
        if isinstance(item, pg.TextItem):
            text = item.toPlainText()
            if not text.strip():
                continue
            rect = item.mapRectToScene(item.boundingRect())
            vb = item.getViewBox() if hasattr(item, "getViewBox") else None
            area = vb.sceneBoundingRect() if isinstance(vb, pg.ViewBox) else visible
            if not _inside(rect, area):
                out.append(f"text item outside its plot area ({_fmt_rect(rect)} not in {_fmt_rect(area)}): "
                           f"{text!r}")
        elif isinstance(item, pg.LegendItem):
            rect = item.sceneBoundingRect()
            vb = next((b for b in boxes if b.sceneBoundingRect().intersects(rect)), None)
            area = vb.sceneBoundingRect() if vb is not None else visible
            if item.items and not _inside(rect, area):
                names = [label.text for _, label in item.items]
                out.append(f"legend outside its plot area ({_fmt_rect(rect)} not in {_fmt_rect(area)}): {names}")
        elif isinstance(item, pg.AxisItem):
            out += _axis_problems(item, visible)
        elif isinstance(item, pg.LabelItem) and item.text:
            rect = item.sceneBoundingRect()
            need = item.item.boundingRect()
            if need.width() > rect.width() + SLACK_PX or not _inside(rect, visible):
                out.append(f"label item cut ({need.width():.0f} px in {rect.width():.0f}): {item.text!r}")
    return out


def _visible_chain(item) -> bool:
    p = item
    while p is not None:
        if not p.isVisible():
            return False
        p = p.parentItem()
    return True


def _axis_problems(axis, visible: QRectF) -> list[str]:
    out = []
    if not axis.isVisible() or not axis.style.get("showValues", True):
        return out
    area = axis.mapRectToScene(QRectF(axis.geometry().translated(-axis.geometry().topLeft())))
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    p = QPainter(image)
    try:
        specs = axis.generateDrawSpecs(p)
    finally:
        p.end()
    if specs is None:
        return out
    _, _, texts = specs
    rects = []
    for rect, _flags, text in texts:
        r = axis.mapRectToScene(QRectF(rect))
        rects.append((r, text))
        vertical = axis.orientation in ("left", "right")
        # across the axis: inside the axis's own strip; along it: inside the visible plot
        across_ok = (r.left() >= area.left() - SLACK_PX and r.right() <= area.right() + SLACK_PX) if vertical else \
            (r.top() >= area.top() - SLACK_PX and r.bottom() <= area.bottom() + SLACK_PX)
        if not across_ok or not _inside(r, visible):
            out.append(f"{axis.orientation} axis tick label cut ({_fmt_rect(r)} in {_fmt_rect(area)}): {text!r}")
    for i, (a, ta) in enumerate(rects):
        for b, tb in rects[i + 1:]:
            if a.adjusted(1, 1, -1, -1).intersects(b.adjusted(1, 1, -1, -1)):
                out.append(f"{axis.orientation} axis tick labels overlap: {ta!r} and {tb!r}")
    if axis.label.isVisible() and axis.labelText:
        m = axis.label.document().documentMargin()  # blank space around the text, not text
        r = axis.label.mapRectToScene(axis.label.boundingRect().adjusted(m, m, -m, -m))
        if not _inside(r, visible):
            out.append(f"{axis.orientation} axis label outside the plot ({_fmt_rect(r)}): {axis.labelText!r}")
    return out


def _inside(rect: QRectF, area: QRectF) -> bool:
    return area.adjusted(-SLACK_PX, -SLACK_PX, SLACK_PX, SLACK_PX).contains(rect)


def _fmt_rect(r) -> str:
    return f"{r.x():.0f},{r.y():.0f} {r.width():.0f}×{r.height():.0f}"


def clipped(window: QWidget) -> list[str]:
    """Every piece of text in ``window`` that is cut, one line each naming the widget and the text."""
    import pyqtgraph as pg

    QApplication.processEvents()
    problems: list[str] = []
    for w in [window, *window.findChildren(QWidget)]:
        if not _shown(w):
            continue
        found: list[str | None] = []
        if isinstance(w, QLabel):
            found.append(_label_problem(w))
        elif isinstance(w, QAbstractButton):
            found.append(_button_problem(w))
        elif isinstance(w, QComboBox):
            found.append(_combo_problem(w))
        elif isinstance(w, QLineEdit):
            found.append(_line_edit_problem(w))
        elif isinstance(w, QTabBar):
            found += _tab_bar_problem(w)
        elif isinstance(w, QTableView):
            found += _table_problems(w)
        elif isinstance(w, pg.PlotWidget):
            found += _plot_problems(w)
        else:
            found.append(_declared_height_problem(w))
        problems += [f"{_name(w)}: {p}" for p in found if p]
    return problems


def tab_widgets(window: QWidget) -> list[QTabWidget]:
    return window.findChildren(QTabWidget)


def clipped_in_every_tab(window: QWidget) -> list[str]:
    """``clipped`` with each page of every tab widget shown in turn (the first page shown again after)."""
    problems = clipped(window)
    for tabs in tab_widgets(window):
        current = tabs.currentIndex()
        for i in range(tabs.count()):
            if i == current:
                continue
            tabs.setCurrentIndex(i)
            problems += [f"[tab {tabs.tabText(i)!r}] {p}" for p in clipped(window)]
        tabs.setCurrentIndex(current)
    return sorted(set(problems), key=problems.index)


# ---------------------------------------------------------------------------------------- window states


@pytest.fixture
def window(qtbot, tmp_path):
    from gui.app import _application

    _application()  # the application's style sheet: bold titles are wider than plain ones
    w = make_window(State(default_config(), runs_dir=tmp_path / "runs"))
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    w.state.recompute_now()
    return w


def at_size(window, width: int, height: int) -> None:
    window.resize(width, height)
    for _ in range(3):
        QApplication.processEvents()


def big_model_on_one_gpu(state, finetune: str = "full") -> None:
    """A 7B model on one H100: over capacity under full fine-tuning, the full-fine-tune line under LoRA."""
    state.edit("model.preset", "llama2-7b")
    state.edit("cluster.gpu", "h100-sxm")
    state.edit("parallel.pp", 1)
    state.edit("cluster.gpus", 1)
    state.edit("training.precision", "bf16-mixed")
    state.edit("training.grad_dtype", "bf16")
    state.edit("training.finetune", finetune)
    state.recompute_now()


def many_ranks_over_capacity(state, pp: int = 16) -> None:
    """``pp`` pipeline ranks of a 70B model on H100s that do not fit: 'over by' labels and many ticks."""
    from engine import Config

    d = default_config().to_dict()
    d["model"] = {"preset": "llama3-70b"}
    d["cluster"] = {"gpu": "h100-sxm", "gpus": pp, "gpus_per_node": 8}
    d["parallel"].update(dp=1, tp=1, pp=pp, microbatches=2 * pp, schedule="1F1B", virtual_stages=1)
    d["training"].update(precision="bf16-mixed", micro_batch_size=1)
    d["training"].pop("grad_dtype", None)
    state.set_config(Config.from_dict(d))
    state.recompute_now()
    assert state.config.parallel.pp == pp and any(not r.fits for r in state.prediction.prediction.memory.per_rank)


def show_measurement(state, tmp_path) -> None:
    """A finished run's measurement of the current config, drawn as a run found on disk would be."""
    from test_gui_run import stand_in_measurement

    out = tmp_path / "runs" / "run-layout"
    out.mkdir(parents=True)
    record = RunRecord(state.config, out, status="finished", measurement=stand_in_measurement(state.config))
    assert state.show_run(record)
    QApplication.processEvents()


def report(problems: list[str]) -> str:
    return "\n".join(["clipped text:", *problems])


# ---------------------------------------------------------------------------------------- tests


def test_checker_names_the_widget_and_text_it_finds_cut(qtbot):
    """The checker reports a label whose text does not fit, a wrapped label too short, and a cut header."""
    from PySide6.QtWidgets import QTableWidget, QVBoxLayout

    host = QWidget()
    qtbot.addWidget(host)
    lay = QVBoxLayout(host)
    short = QLabel("a label far too long for the forty pixels it is given")
    short.setObjectName("tooNarrow")
    short.setFixedWidth(40)
    wrapped = QLabel("wrapped words " * 20)
    wrapped.setWordWrap(True)
    wrapped.setFixedSize(120, 20)
    table = QTableWidget(1, 1)
    table.setHorizontalHeaderLabels(["a header wider than its column"])
    table.horizontalHeader().resizeSection(0, 30)
    fits = QLabel("ok")
    import pyqtgraph as pg

    plot = pg.PlotWidget()
    plot.setXRange(0, 1, padding=0)
    plot.setYRange(0, 1, padding=0)
    outside = pg.TextItem("a text item hanging over the top", anchor=(0, 1))
    outside.setPos(0.5, 1.0)
    plot.addItem(outside)
    for w in (short, wrapped, table, fits, plot):
        lay.addWidget(w)
    host.resize(400, 300)
    host.show()
    qtbot.waitExposed(host)
    problems = clipped(host)
    assert any("tooNarrow" in p and "far too long" in p for p in problems), problems
    assert any("wrapped text needs" in p for p in problems), problems
    assert any("a header wider" in p for p in problems), problems
    assert any("a text item hanging" in p for p in problems), problems
    assert not any("'ok'" in p for p in problems)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_nothing_is_clipped_in_the_default_window(window, size):
    at_size(window, *size)
    assert window.size().width() == size[0]
    problems = clipped_in_every_tab(window)
    window.grab().save(f"/tmp/layout-{size[0]}x{size[1]}.png", "PNG")
    assert not problems, report(problems)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_nothing_is_clipped_with_labels_over_capacity_and_lora(window, size):
    at_size(window, *size)
    big_model_on_one_gpu(window.state)  # one bar over capacity: its "over by" label and the capacity line
    problems = [f"[7B full] {p}" for p in clipped(window)]
    big_model_on_one_gpu(window.state, "lora")  # LoRA's knobs, the full fine-tune line and its label
    problems += [f"[7B LoRA] {p}" for p in clipped(window)]
    many_ranks_over_capacity(window.state, 4)
    problems += [f"[70B pp4] {p}" for p in clipped(window)]
    many_ranks_over_capacity(window.state, 16)
    problems += [f"[70B pp16] {p}" for p in clipped(window)]
    window.grab().save(f"/tmp/layout-{size[0]}x{size[1]}-loaded.png", "PNG")
    assert not problems, report(problems)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_nothing_is_clipped_with_a_measurement_and_cluster_targets(window, size, tmp_path):
    at_size(window, *size)
    show_measurement(window.state, tmp_path)
    assert window.run_panel.table.rowCount() > 0
    problems = [f"[measured] {p}" for p in clipped(window)]
    for kind in ("slurm", "hosts"):
        window.run_panel.set_target(kind)
        problems += [f"[{kind}] {p}" for p in clipped(window)]
    window.run_panel.set_target("local")
    QApplication.processEvents()
    window.grab().save(f"/tmp/layout-{size[0]}x{size[1]}-measured.png", "PNG")
    assert not problems, report(problems)


@pytest.mark.parametrize("size", SIZES[:1], ids=lambda s: f"{s[0]}x{s[1]}")
def test_nothing_is_clipped_under_dataparallel_and_with_problems(window, qtbot, size):
    at_size(window, *size)
    c = window.controls
    c.dp_mode.setCurrentIndex(c.dp_mode.findData("dataparallel"))  # a problem under DP mode and an offer
    qtbot.waitUntil(lambda: c.errors["parallel.dp_mode"].isVisible(), timeout=2000)
    problems = [f"[problem] {p}" for p in clipped(window)]
    c.dataparallel_fix.click()
    qtbot.waitUntil(lambda: window.state.config.parallel.dp_mode == "dataparallel", timeout=2000)
    window.state.recompute_now()
    qtbot.waitUntil(lambda: bool(window.scaling.rows), timeout=2000)
    problems += [f"[dataparallel] {p}" for p in clipped_in_every_tab(window)]
    assert not problems, report(problems)


# ---------------------------------------------------------------------------------------- geometry
# Each open runs in its own process on a virtual screen layout of the offscreen platform
# (QT_QPA_PLATFORM=offscreen:configfile=…): the screens a window opens on are fixed per process.

OPEN_WINDOW = r"""
import json, sys
from PySide6.QtCore import QRect, QSettings
from PySide6.QtWidgets import QApplication, QSplitter
from engine import default_config
from gui.app import _application, make_window
from gui.state import State

args = json.loads(sys.argv[1])
_application()
settings = QSettings(args["ini"], QSettings.Format.IniFormat)
w = make_window(State(default_config(), runs_dir=args["runs"]), settings=settings)
w.show()
QApplication.processEvents()
out = {"frame": w.frameGeometry().getRect(), "geometry": w.geometry().getRect(),
       "screen": w.screen().availableGeometry().getRect(),
       "splitters": {s.objectName(): s.sizes() for s in w.findChildren(QSplitter) if s.objectName()}}
if "move_to" in args:
    w.setGeometry(QRect(*args["move_to"]))
    QApplication.processEvents()
    outer = w.findChild(QSplitter, "outerSplitter")
    outer.setSizes([args["controls_px"], outer.width() - args["controls_px"] - outer.handleWidth()])
    QApplication.processEvents()
    out["moved"] = w.geometry().getRect()
    out["moved_splitters"] = {s.objectName(): s.sizes() for s in w.findChildren(QSplitter) if s.objectName()}
w.close()
print(json.dumps(out))
"""


def open_window(tmp_path, screens: list[tuple[int, int, int, int]], **args) -> dict:
    """Open (and close) the window in a fresh process whose screens are ``screens`` (x, y, w, h)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tmp_path.mkdir(parents=True, exist_ok=True)
    layout = tmp_path / f"screens-{len(list(tmp_path.glob('screens-*')))}.json"
    layout.write_text(json.dumps({"screens": [
        {"name": f"screen{i}", "x": x, "y": y, "width": w, "height": h, "logicalDpi": 96, "logicalBaseDpi": 96,
         "dpr": 1} for i, (x, y, w, h) in enumerate(screens)]}))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "QT_QPA_PLATFORM": f"offscreen:configfile={layout}",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    args = {"ini": str(tmp_path / "shardscope.ini"), "runs": str(tmp_path / "runs"), **args}
    done = subprocess.run([sys.executable, "-c", OPEN_WINDOW, json.dumps(args)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


FULL_HD = (0, 0, 1920, 1080)


def test_first_open_is_sized_to_the_screen_and_centred(tmp_path):
    for screen in (FULL_HD, (0, 0, 1600, 1000)):
        first = open_window(tmp_path / f"{screen[2]}", [screen])
        x, y, w, h = first["frame"]
        sx, sy, sw, sh = first["screen"]
        assert (sw, sh) == screen[2:]
        assert w >= 0.85 * sw and h >= 0.85 * sh, first  # not Qt's default two thirds
        assert sx <= x and sy <= y and x + w <= sx + sw and y + h <= sy + sh, first
        assert abs((x + w / 2) - (sx + sw / 2)) <= 3 and abs((y + h / 2) - (sy + sh / 2)) <= 3, first


def test_geometry_and_splitters_are_saved_on_close_and_restored(tmp_path):
    first = open_window(tmp_path, [FULL_HD], move_to=[100, 80, 1400, 900], controls_px=480)
    assert (tmp_path / "shardscope.ini").exists()
    assert first["moved"] == [100, 80, 1400, 900]
    again = open_window(tmp_path, [FULL_HD])
    assert again["geometry"] == first["moved"]
    assert again["splitters"] == first["moved_splitters"]
    assert again["splitters"]["outerSplitter"][0] == 480


def test_a_saved_geometry_off_every_screen_falls_back_to_the_screen_sized_default(tmp_path):
    default = open_window(tmp_path / "fresh", [FULL_HD])
    two_screens = [FULL_HD, (1920, 0, 1920, 1080)]
    left = open_window(tmp_path, two_screens, move_to=[2100, 100, 1400, 900], controls_px=300)
    assert left["moved"] == [2100, 100, 1400, 900]  # on the second screen when it closed
    again = open_window(tmp_path, [FULL_HD])  # the second screen is gone
    assert again["frame"] == default["frame"]
    assert again["splitters"] == default["splitters"]  # the default layout, not the saved one


def test_windows_without_settings_keep_none(qtbot, tmp_path):
    """make_window without settings (tests, benchmarks, --screenshot) reads and writes no settings."""
    w = make_window(State(default_config(), runs_dir=tmp_path / "runs"))
    qtbot.addWidget(w)
    assert w.settings is None
    w.show()
    w.close()
    assert w.settings is None


def test_screenshot_keeps_its_fixed_size(tmp_path, qtbot):
    from PySide6.QtGui import QImage

    from gui.app import run_app

    out = tmp_path / "shot.png"
    assert run_app(screenshot=str(out)) == 0
    image = QImage(str(out))
    assert (image.width(), image.height()) == (1600, 1000)


def show_readme_plan(window) -> None:
    """The README screenshot's state: its job (Llama-3 8B on 16 H100s) in the window and the planner's
    result for it on the Planner tab (planned in this process: the top 10 and a sweep of fitting layouts)."""
    from pathlib import Path

    from engine import Config
    from engine.plan.search import plan_config
    from gui.planning import PlanOutcome

    cfg = Config.load(Path(__file__).resolve().parents[2] / "assets" / "examples" / "llama3-8b-16gpu.toml")
    window.state.set_config(cfg)
    window.state.recompute_now()
    result = plan_config(cfg, top=10, global_batch=128, all_fitting=True, fitting_limit=200)
    window.tabs.setCurrentWidget(window.planner)
    QApplication.processEvents()
    window.planner.show_result(PlanOutcome(result.to_json()))
    window.planner.table.selectRow(0)
    QApplication.processEvents()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_nothing_is_clipped_in_the_planner_result_of_the_readme_screenshot(window, size):
    at_size(window, *size)
    show_readme_plan(window)
    problems = [f"[plan] {p}" for p in clipped(window)]
    window.grab().save(f"/tmp/layout-{size[0]}x{size[1]}-plan.png", "PNG")
    assert not problems, report(problems)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_planners_numbers_are_in_sight_and_its_job_does_not_widen_the_window(window, size):
    """Issue 27, item 6: at 1280 × 800 the planner table's tokens/s, step, MFU and peak columns were cut and the
    job's title ("Plan for llama3-8b on 16 × h100-sxm (8 per node)") held the window 68 px wider than asked.
    The numbers come before the layout (the table scrolls to the rest); the title wraps."""
    at_size(window, *size)
    show_readme_plan(window)
    at_size(window, *size)
    assert (window.width(), window.height()) == size
    table = window.planner.table
    assert table.horizontalScrollBar().value() == 0
    view = table.viewport().width()
    from gui.planning import TABLE_HEADERS

    for name in ("tokens/s", "step", "MFU", "peak"):
        col = TABLE_HEADERS.index(name)
        assert table.columnViewportPosition(col) + table.columnWidth(col) <= view, (name, view)


def test_a_barrier_keeps_the_tallest_height_its_label_needed(qtbot):
    """A hint that wraps to two lines on one slider step and one on the next must not re-lay out the
    window on every step: the barrier grows when its label needs more height and never shrinks."""
    from PySide6.QtCore import QEvent, QObject
    from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

    from gui.widgets.barrier import LayoutBarrier

    host = QWidget()
    qtbot.addWidget(host)
    label = QLabel("short")
    label.setWordWrap(True)
    barrier = LayoutBarrier(label)
    lay = QVBoxLayout(host)
    lay.addWidget(barrier)
    host.resize(120, 200)
    host.show()
    qtbot.waitExposed(host)
    one_line = barrier.height()
    label.setText("a hint long enough to wrap onto a second line at this width, and a third")
    qtbot.waitUntil(lambda: barrier.height() > one_line)
    tall = barrier.height()

    requests = []

    class Count(QObject):
        def eventFilter(self, obj, ev):
            if ev.type() == QEvent.Type.LayoutRequest:
                requests.append(ev)
            return False

    counter = Count()
    host.installEventFilter(counter)
    label.setText("short")
    qtbot.wait(50)
    assert barrier.height() == tall
    assert requests == []  # the window's layout was not asked to move anything


@pytest.mark.parametrize("example", [None, "llama3-8b-16gpu.toml"], ids=["default", "16 H100s"])
@pytest.mark.parametrize("size", [(1280, 800), (1920, 1080)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_metric_reads_without_scrolling(window, qtbot, size, example):
    """Issue 27, item 6: at 1280 × 800 "Peak memory" and the rows below it needed scrolling; the metrics
    now stand beside both charts."""
    from pathlib import Path

    from engine import Config

    if example:
        window.state.set_config(Config.load(Path(__file__).resolve().parents[2] / "assets" / "examples" / example))
        window.state.recompute_now()
    at_size(window, *size)
    # the example's prediction shown and nothing left in flight (a late one re-lays the metrics out)
    qtbot.waitUntil(lambda: not window.state.predicting and window.metrics._last is not None
                    and window.metrics._last.config == window.state.config, timeout=10000)
    qtbot.wait(50)
    names = [name for name, _ in window.metrics.table.rows]
    assert "Peak memory" in names and "Step time" in names
    assert window.metrics.scroll.verticalScrollBar().maximum() == 0, f"the metrics need scrolling: {names}"
