"""The ShardScope window: controls on the left, memory and pipeline in the middle, metrics and
the strategy explainer on the right, the run panel below.

``run_app`` is what ``shardscope`` and ``shardscope gui`` call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from assets import ASSETS_DIR


def _qt():
    """Import Qt only when a window is wanted (the CLI starts fast without it)."""
    import pyqtgraph as pg
    from PySide6 import QtCore, QtGui, QtWidgets

    pg.setConfigOptions(antialias=False, foreground="#333")
    return QtCore, QtGui, QtWidgets


def make_window(state=None, config=None, settings=None, runs_dir: str | Path | None = None):
    """The main window over ``state`` (or a new State of ``config`` keeping its runs under ``runs_dir``:
    default the per-user data folder, ``backend.records.runs_root``). ``settings`` (a QSettings) is where it restores and saves its
    geometry; None (the default) keeps none."""
    from gui.main_window import MainWindow
    from gui.state import State

    if state is None:
        state = State(config, runs_dir=runs_dir)
    return MainWindow(state, settings=settings)


def user_settings():
    """The user's own settings store: organisation and application "ShardScope"."""
    _qt()
    from PySide6.QtCore import QSettings

    return QSettings("ShardScope", "ShardScope")


def _application():
    _, _, QtWidgets = _qt()
    app = QtWidgets.QApplication.instance()
    if app is None:
        app = QtWidgets.QApplication(sys.argv[:1])
        app.setApplicationName("ShardScope")
        app.setOrganizationName("ShardScope")
    style = ASSETS_DIR / "style.qss"
    if style.exists():
        app.setStyleSheet(style.read_text(encoding="utf-8"))
    return app


def run_app(config_path: str | None = None, screenshot: str | None = None, settings=None,
            plan: bool = False, runs_dir: str | Path | None = None) -> int:
    """Open the window on ``config_path`` (or the embedded default), sized to the screen on a first
    open and as it was left afterwards (``settings``, default the user's: see ``user_settings``).

    With ``screenshot`` set: render offscreen at 1600×1000, write the PNG and return 0 without
    entering the event loop (no settings read or written); ``plan`` runs the Planner tab's plan
    first and shows it.
    """
    from engine import Config, default_config

    if screenshot and "QT_QPA_PLATFORM" not in os.environ:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    app = _application()
    cfg = Config.load(config_path) if config_path else default_config()
    if screenshot:
        window = make_window(config=cfg, runs_dir=runs_dir)
    else:
        window = make_window(config=cfg, settings=settings if settings is not None else user_settings(),
                             runs_dir=runs_dir)
    if config_path:
        window.current_path = Path(config_path)
    if screenshot:
        return window.screenshot(screenshot, plan=plan)
    window.show()
    window.state.schedule_recompute()
    return app.exec()
