"""The command line as a user meets it: real subprocesses, real exit codes, no tracebacks."""

import subprocess
import sys
from pathlib import Path

import pytest

from assets import PRESETS_DIR

ROOT = Path(__file__).resolve().parents[2]


def shardscope(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "gui.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_validate_accepts_the_default_and_a_preset_file(tmp_path):
    from engine import Config

    f = tmp_path / "llama.toml"
    f.write_text('[model]\npreset = "llama3-70b"\n[cluster]\npreset = "h100-pod-64"\n[parallel]\ntp = 8\npp = 4\n'
                 'schedule = "Interleaved1F1B"\nvirtual_stages = 2\nmicrobatches = 8\n')
    Config.load(f)
    out = shardscope("validate", str(PRESETS_DIR / "default.toml"), str(f))
    assert out.returncode == 0, out.stderr
    assert "valid" in out.stdout and "llama3-70b" in out.stdout and "dp=2" in out.stdout


def test_validate_rejects_with_field_names_and_no_traceback(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[model]\npreset = "tiny"\nmlp = "relu"\n[cluster]\ngpus = 4\n[parallel]\ntp = 3\n')
    out = shardscope("validate", str(f))
    assert out.returncode == 2
    assert "model.mlp" in out.stderr and "allowed: gelu | swiglu" in out.stderr
    assert "parallel.tp" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_missing_file_is_a_clean_error(tmp_path):
    out = shardscope("validate", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "not found" in out.stderr and "Traceback" not in out.stderr
    out = shardscope("predict", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "not found" in out.stderr and "Traceback" not in out.stderr


def test_bad_arguments_exit_non_zero():
    out = shardscope("validate")
    assert out.returncode == 2 and "usage" in out.stderr
    out = shardscope("frobnicate")
    assert out.returncode == 2


def test_presets_lists_the_names():
    out = shardscope("presets")
    assert out.returncode == 0
    for name in ("tiny", "llama3-405b", "h100-sxm", "mi300x", "local-cpu"):
        assert name in out.stdout


@pytest.mark.parametrize("cmd", [["plan", "--model", "llama3-8b", "--gpus", "8"]])
def test_every_command_is_there(cmd):
    out = shardscope(*cmd)
    assert out.returncode == 0 and out.stdout, out.stderr


def test_no_display_is_a_clear_message_not_a_qt_abort():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    out = subprocess.run([sys.executable, "-m", "gui.cli"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env=env)
    assert out.returncode == 2 and "no display" in out.stderr and "xvfb-run" in out.stderr


def test_missing_qt_system_libraries_are_named_with_the_install_command():
    """On an X display without the libraries Qt's xcb plugin needs, the first command says what to install
    (instead of Qt's abort). The project's machines lack libxcb-icccm4 and libxcb-keysyms1."""
    import os

    from gui.platform_check import install_command, missing_libraries

    missing = missing_libraries()
    if not missing:
        pytest.skip("every library of Qt's xcb plugin is installed here")
    env = {k: v for k, v in os.environ.items() if k not in ("WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["DISPLAY"] = ":97"  # a display Qt would try; nothing listens there, and nothing needs to
    out = subprocess.run([sys.executable, "-m", "gui.cli"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    assert install_command(missing) in out.stderr and "Traceback" not in out.stderr


def test_gui_runs_dir_that_is_a_file_is_refused_before_any_window(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    out = shardscope("gui", "--runs-dir", str(f))
    assert out.returncode == 2
    assert "--runs-dir" in out.stderr and "not a directory" in out.stderr and "Traceback" not in out.stderr
