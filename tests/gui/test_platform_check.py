"""First launch: the xcb plugin's missing system libraries are named, with the one install command."""

from __future__ import annotations

import pytest

from gui import platform_check as pc


def test_install_command_names_the_debian_packages():
    assert pc.install_command(["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]) == \
        "sudo apt-get install libxcb-icccm4 libxcb-keysyms1"
    # an unknown soname: install the whole list the README gives
    cmd = pc.install_command(["libsomething-new.so.3"])
    assert cmd.split()[3:] == list(pc.WINDOW_PACKAGES)
    assert "libxcb-cursor0" in pc.WINDOW_PACKAGES


def test_only_checked_where_qt_would_use_xcb():
    assert pc.xcb_problem({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"}) is None
    assert pc.xcb_problem({}) is None  # no display at all: the CLI says so separately
    assert pc.xcb_problem({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}) is None


def test_the_installed_plugin_is_checked_with_the_dynamic_linker():
    libs = pc.qt_libraries()
    if not libs:
        pytest.skip("PySide6 without an xcb plugin")
    assert libs[0].name == "libqxcb.so"
    missing = pc.missing_libraries()
    assert all(m.endswith(tuple(f".so.{i}" for i in range(10))) for m in missing)
    problem = pc.xcb_problem({"DISPLAY": ":0"})
    if missing:  # as on this project's CI machines: libxcb-icccm4 and libxcb-keysyms1 are not installed
        assert problem is not None and pc.install_command(missing) in problem
        assert all(m in problem for m in missing)
    else:  # the libraries are there: what is left is whether an X server answers at :0
        assert problem is None or "no X server answers" in problem


def test_a_display_nobody_answers_is_named_before_qt_aborts():
    """With DISPLAY set and no X server there Qt's xcb plugin aborts (exit 134) with a hint about
    libxcb-cursor0, installed or not: the check connects first and says what to do."""
    import socket

    with socket.socket() as s:  # a TCP port nothing listens on: X display number port - 6000
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if port <= 6000:
        pytest.skip("no free port above 6000")
    problem = pc.display_problem(f"127.0.0.1:{port - 6000}", timeout_s=1.0)
    assert problem is not None and "no X server answers" in problem and "xvfb-run" in problem
    assert "no X server answers" in pc.display_problem(":987654")  # no such local socket
    assert "not an X display name" in pc.display_problem("nonsense")


def test_a_display_that_answers_passes():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        if port <= 6000:
            pytest.skip("no free port above 6000")
        assert pc.display_problem(f"127.0.0.1:{port - 6000}.0") is None
