import os

import pytest

# Qt tests run without a display.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture
def window(qtbot, tmp_path):
    """The ShardScope window on the embedded default, offscreen at 1500 × 950, with its first prediction
    drawn; runs go to a temporary directory."""
    from PySide6.QtWidgets import QApplication

    from engine import default_config
    from gui.app import make_window
    from gui.state import State

    w = make_window(State(default_config(), runs_dir=tmp_path / "runs"))
    qtbot.addWidget(w)
    w.resize(1500, 950)
    w.show()
    qtbot.waitExposed(w)
    w.state.recompute_now()
    QApplication.processEvents()
    return w
