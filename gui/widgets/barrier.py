"""A layout barrier: text that changes on every slider move must not re-lay out the window.

``QLabel.setText`` always calls ``updateGeometry()``, which invalidates the parent's layout and,
up the chain, the whole window's: every header, hint and metrics label changing on a slider move
made Qt lay out every widget of the window again (several ms of the 16 ms frame). A label held
by a :class:`LayoutBarrier` is positioned by ``resizeEvent`` instead of a layout, so its geometry
updates stop at the barrier; the barrier asks its own parent for a new layout only when the
label needs more height than it has had (a wrapped line more). It keeps the tallest height it has
needed: a hint that wraps to one line on one slider step and two on the next would otherwise re-lay
out, and repaint, the whole window on every step of a drag (measured: the model-size slider's hint,
every widget of the window painted per move).
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QSize
from PySide6.QtWidgets import QSizePolicy, QWidget


class LayoutBarrier(QWidget):
    def __init__(self, child: QWidget, parent: QWidget | None = None,
                 horizontal: QSizePolicy.Policy = QSizePolicy.Policy.Ignored):
        super().__init__(parent)
        self.child = child
        child.setParent(self)
        self.setSizePolicy(horizontal, QSizePolicy.Policy.Fixed)
        self._hint = child.sizeHint()
        self._height = self._hint.height()

    def _needed_height(self) -> int:
        c = self.child
        if c.hasHeightForWidth() and self.width() > 0:
            # a wrapped label's height at this width; its minimumSizeHint (one line, at any width) is never
            # taller, and laid out the text a second time on every change (~50 µs a label)
            return max(c.heightForWidth(self.width()), c.minimumHeight())
        return c.sizeHint().height()

    def sizeHint(self) -> QSize:
        return QSize(self._hint.width(), self._height)

    def minimumSizeHint(self) -> QSize:
        return QSize(0, self._height)

    def resizeEvent(self, event) -> None:
        self.child.setGeometry(self.rect())
        self._refit()

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.LayoutRequest:  # the child's geometry changed: stop here
            self._refit()
            return True
        return super().event(event)

    def _refit(self) -> None:
        h = self._needed_height()
        if h > self._height:
            self._height = h
            self.updateGeometry()  # only now does the surrounding layout need to move
