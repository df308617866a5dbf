"""A child process of the window (a run, a plan): started one way, read one line at a time.

``Lines`` (no Qt) turns the bytes a child writes into whole decoded lines; ``start_child`` starts
a QProcess in the repository root with its stdout, stderr, finished and error signals connected.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class Lines:
    """Bytes in, whole lines out (decoded, the newline dropped); ``final`` flushes a last unterminated line."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if final and self._buffer:
            lines.append(self._buffer)
            self._buffer = b""
        return [raw.decode("utf-8", "replace") for raw in lines]


def start_child(parent, cmd: list[str], *, on_stdout: Callable, on_stderr: Callable, on_finished: Callable,
                on_error: Callable):
    """Start ``cmd`` as a QProcess owned by ``parent``, in the repository root; returns it."""
    from PySide6.QtCore import QProcess

    proc = QProcess(parent)
    proc.setProgram(cmd[0])
    proc.setArguments(cmd[1:])
    proc.setWorkingDirectory(str(REPO_ROOT))
    proc.readyReadStandardOutput.connect(on_stdout)
    proc.readyReadStandardError.connect(on_stderr)
    proc.finished.connect(on_finished)
    proc.errorOccurred.connect(on_error)
    proc.start()
    return proc
