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


def _engine_imports() -> dict[str, tuple[set[str], set[str]]]:
    """Per engine module: (engine modules it imports at module level, those it imports inside a function).
    ``from engine import names`` counts as the module ``engine.names``; imports under ``if TYPE_CHECKING:``
    (annotations only, never run) are left out."""
    mods = {}
    for path in (ROOT / "engine").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def targets(node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names if a.name in mods}
        if not node.module or node.level:
            return set()
        subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods}
        own = node.module in mods and len(subs) < len(node.names)
        return subs | ({node.module} if own else set())

    def visit(node, in_function: bool, top: set[str], inner: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top).update(targets(child))
            elif isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)), top, inner)

    out = {}
    for name, path in mods.items():
        top, inner = set(), set()
        visit(ast.parse(path.read_text()), False, top, inner)
        out[name] = (top - {name}, inner - {name})
    return out


def test_engine_rooms_import_at_module_level_and_in_no_circle():
    """The engine's rooms import one another at the top of a module, never inside a function (an import
    hidden in a function is how a circle is kept open), and the module-level imports form no circle."""
    graph = _engine_imports()
    hidden = sorted(f"{m} imports {', '.join(sorted(inner))} inside a function" for m, (_, inner) in graph.items()
                    if inner)
    assert not hidden, "\n".join(hidden)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m][0]):
            if n == "engine":  # the package's __init__ re-exports the config: every module reaches it
                continue
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (found := walk(n, path + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = walk(m, [])
            assert circle is None, "import circle: " + " -> ".join(circle[circle.index(circle[-1]):])


def test_the_circle_check_sees_a_circle(tmp_path, monkeypatch):
    root = tmp_path / "engine"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("")
    (root / "a" / "x.py").write_text("from engine.a.y import f\n")
    (root / "a" / "y.py").write_text("def f():\n    from engine.a.x import g\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _engine_imports()
    assert graph["engine.a.x"][0] == {"engine.a.y"}
    assert graph["engine.a.y"][1] == {"engine.a.x"}
    with pytest.raises(AssertionError, match="inside a function"):
        test_engine_rooms_import_at_module_level_and_in_no_circle()
    (root / "a" / "y.py").write_text("from engine.a.x import g\n")
    with pytest.raises(AssertionError, match="import circle: engine.a.x -> engine.a.y -> engine.a.x"):
        test_engine_rooms_import_at_module_level_and_in_no_circle()
