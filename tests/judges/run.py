"""Run a judge script (tests/judges/*_judge.py) in the judges' venv: ``make test`` builds ``.venv-judges``
(torchtitan 0.3.0, DeepSpeed, their dependencies); ``SHARDSCOPE_JUDGES`` names another. Missing, a test skips
saying so, except under CI (``CI`` set), where it fails."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def judges_python() -> Path:
    venv = Path(os.environ.get("SHARDSCOPE_JUDGES") or ROOT / ".venv-judges")
    return (venv if venv.is_absolute() else ROOT / venv) / "bin" / "python"


def run_judge(script: str, payload, path: str = "") -> list:
    """Run ``script`` with ``payload`` (JSON) on its standard input; ``path``: a folder of the judges' venv put on
    PYTHONPATH (a second torchtitan beside the first)."""
    python = judges_python()
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{python}: the judges' venv is missing (make test builds it)")
        pytest.skip(f"{python}: no judges' venv (make test builds it)")
    done = subprocess.run([str(python), str(ROOT / "tests" / "judges" / script)], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=900, cwd=python.parent.parent,
                          env={**os.environ, "PYTHONPATH": str(python.parent.parent / path) if path else ""})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
