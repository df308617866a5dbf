"""Before Qt opens a window on X11: are the system libraries its xcb platform plugin needs there?

Without them Qt prints "Could not load the Qt platform plugin "xcb"… no Qt platform plugin could be
initialized" and aborts the process. This module asks the dynamic linker first (``ldd`` on the
plugin and on ``libQt6XcbQpa``, the library that carries most of the xcb dependencies) and names the
Debian/Ubuntu packages that provide what is missing, so the first command can say exactly what to
install. It imports no Qt (the point is to run before Qt does).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import socket
import subprocess
from pathlib import Path

#: Shared libraries Qt 6's xcb plugin loads, and the Debian/Ubuntu package of each (bookworm / 24.04 names).
DEBIAN_PACKAGES: dict[str, str] = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-xinput.so.0": "libxcb-xinput0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb.so.1": "libxcb1",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libX11.so.6": "libx11-6",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libOpenGL.so.0": "libopengl0",
    "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0",
    "libSM.so.6": "libsm6",
    "libICE.so.6": "libice6",
}
#: Every package the window needs on a minimal Debian/Ubuntu desktop (the README lists these).
WINDOW_PACKAGES: tuple[str, ...] = tuple(sorted(set(DEBIAN_PACKAGES.values())))

_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)


def qt_libraries() -> list[Path]:
    """The installed PySide6's xcb platform plugin and xcb integration library (those that exist)."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "Qt"
    paths = [root / "plugins" / "platforms" / "libqxcb.so", *sorted((root / "lib").glob("libQt6XcbQpa.so*"))]
    return [p for p in paths if p.is_file()][:2]


def missing_libraries(paths: list[Path] | None = None) -> list[str]:
    """Sonames the dynamic linker cannot find for ``paths`` (the xcb plugin by default), sorted."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    missing: set[str] = set()
    for path in qt_libraries() if paths is None else paths:
        try:
            out = subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        missing.update(_NOT_FOUND.findall(out))
    return sorted(missing)


def install_command(missing: list[str]) -> str:
    """The one apt-get line that installs what ``missing`` names (every window package if one is unknown)."""
    pkgs = sorted({DEBIAN_PACKAGES[m] for m in missing if m in DEBIAN_PACKAGES})
    if len(pkgs) < len(missing):
        pkgs = list(WINDOW_PACKAGES)
    return "sudo apt-get install " + " ".join(pkgs)


def xcb_problem(environ: dict[str, str]) -> str | None:
    """Why Qt's xcb plugin would abort here, with the command that fixes it; None when it can load.

    Only where Qt would pick xcb: an X display and no other platform asked for (``QT_QPA_PLATFORM``
    unset or "xcb"), and no Wayland session that Qt would prefer."""
    platform = environ.get("QT_QPA_PLATFORM", "")
    if platform not in ("", "xcb") or not environ.get("DISPLAY"):
        return None
    if not platform and environ.get("WAYLAND_DISPLAY"):
        return None
    missing = missing_libraries()
    display = display_problem(environ["DISPLAY"])
    if not missing:
        return display
    return (f"the window cannot open on this X display: Qt's xcb platform plugin needs system libraries that "
            f"are not installed ({', '.join(missing)}). Install them with:\n    {install_command(missing)}\n"
            "then run the command again. Meanwhile: shardscope gui --screenshot OUT.png renders the window "
            "offscreen, and the command line (shardscope --help) needs no display."
            + (f"\nAnd: {display}" if display else ""))


def display_problem(display: str, timeout_s: float = 2.0) -> str | None:
    """Why no X server answers at ``display`` (``[host]:number[.screen]``), or None when one does: Qt's xcb
    plugin aborts the process when it cannot connect ("could not connect to display"), with a hint about
    libxcb-cursor0 whether or not that is the cause. A local display is the socket /tmp/.X11-unix/X<number>
    (or its abstract twin); ``host:number`` is TCP port 6000 + number."""
    host, sep, rest = display.rpartition(":")
    number = rest.split(".", 1)[0]
    if not sep or not number.isdigit():
        return (f"DISPLAY={display!r} is not an X display name ([host]:number[.screen], e.g. :0): set it to one, or "
                "unset it and use the command line or shardscope gui --screenshot OUT.png")
    try:
        if host in ("", "unix"):
            path = f"/tmp/.X11-unix/X{number}"
            err = None
            for address in (path, "\0" + path):  # the file, then Linux's abstract socket of the same name
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(timeout_s)
                    try:
                        s.connect(address)
                        return None
                    except OSError as exc:
                        err = exc
            raise err
        with socket.create_connection((host, 6000 + int(number)), timeout=timeout_s):
            return None
    except OSError as exc:
        why = exc.strerror or exc.__class__.__name__
    return (f"DISPLAY={display} is set but no X server answers there ({why}): the window cannot open. Start "
            f"one (Xvfb {':' + number} &), run the window under xvfb-run (xvfb-run shardscope), or unset DISPLAY; "
            "the command line (shardscope --help) and shardscope gui --screenshot OUT.png need no display.")
