"""House rules: engine imports neither torch nor Qt; backend never Qt; gui never torch.

Checked two ways: statically over every module's import statements, and dynamically by
importing the package in a fresh interpreter and looking at sys.modules.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QT = {"PySide6", "pyqtgraph", "shiboken6", "PyQt5", "PyQt6"}
FORBIDDEN = {"engine": QT | {"torch"}, "backend": QT, "gui": {"torch"}}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_static_imports_respect_layering(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_roots(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offenders, "\n".join(offenders)


def test_engine_allows_only_numpy_and_stdlib():
    allowed = set(sys.stdlib_module_names) | {"numpy", "engine", "assets", "tomli_w"}
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        bad = imported_roots(path) - allowed
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offenders, "\n".join(offenders)


def test_guard_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom torch.distributed import init_process_group\n")
    assert "torch" in imported_roots(bad)


MODULES = {
    "engine": ["engine", "engine.config", "engine.pipeline.layout", "engine.model.presets"],
    "gui": ["gui.cli"],
    "backend": ["backend"],
}


@pytest.mark.parametrize("package", sorted(MODULES))
def test_runtime_imports_respect_layering(package):
    mods = [m for m in MODULES[package]]
    for extra in sorted((ROOT / package).rglob("*.py")):  # every module of every room
        parts = extra.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name not in mods and name != "backend.worker":
            mods.append(name)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"bad = sorted(r for r in {sorted(FORBIDDEN[package])!r} if r in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{package} pulled in {out.stdout.strip()}"
