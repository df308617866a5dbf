"""The README's example outputs are what the commands they show print today.

Each fenced block of the README that starts with ``$ shardscope predict|plan|validate ...`` is run
(in this process, through the CLI's ``main``) and compared line by line: a line ``...`` (or `` ...``)
stands for any number of lines, and a plan's wall time (``; 0.92 s``) is not compared. A prediction
that moves fails here until the README is refreshed:

    .venv/bin/python tests/test_readme.py --refresh    # rewrite those blocks from the commands
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = ("predict", "plan")  # validate's example reads a file the README writes with cat
ELLIPSIS = re.compile(r"^\s*\.\.\.\s*$")
TIME = re.compile(r"; \d+\.\d+ s$")


def blocks(text: str) -> list[tuple[int, int, str, list[str]]]:
    """(first line index, end index, command, the block's output lines) of each example block."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```") and i + 1 < len(lines) and lines[i + 1].startswith("$ shardscope "):
            cmd = lines[i + 1][2:]
            j = i + 2
            while not lines[j].startswith("```"):
                j += 1
            if shlex.split(cmd)[1] in COMMANDS:
                out.append((i + 2, j, cmd, lines[i + 2:j]))
            i = j
        i += 1
    return out


def run(cmd: str) -> list[str]:
    from gui.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.chdir(ROOT):
        assert main(shlex.split(cmd)[1:]) == 0, cmd
    return buf.getvalue().rstrip("\n").splitlines()


def matches(shown: list[str], printed: list[str]) -> bool:
    """Whether the README's lines are the printed ones, ``...`` standing for any run of lines."""
    def norm(line: str) -> str:
        return TIME.sub("", line.rstrip())

    if not shown:
        return not printed
    if ELLIPSIS.match(shown[0]):
        return any(matches(shown[1:], printed[k:]) for k in range(len(printed) + 1))
    return bool(printed) and norm(shown[0]) == norm(printed[0]) and matches(shown[1:], printed[1:])


def refreshed(shown: list[str], printed: list[str]) -> list[str]:
    """The block's lines from ``printed``, keeping its shape: the lines before its first ``...``,
    the ``...``, and as many lines after it as it shows, from the end."""
    cut = next((k for k, line in enumerate(shown) if ELLIPSIS.match(line)), None)
    if cut is None:
        return printed
    tail = len(shown) - cut - 1
    return printed[:cut] + [shown[cut]] + (printed[len(printed) - tail:] if tail else [])


@pytest.mark.parametrize("block", blocks(README.read_text(encoding="utf-8")), ids=lambda b: b[2])
def test_the_readme_shows_what_the_command_prints(block):
    _, _, cmd, shown = block
    printed = run(cmd)
    assert matches(shown, printed), (f"README.md's output of `{cmd}` is not what it prints now; "
                                     "refresh it: .venv/bin/python tests/test_readme.py --refresh\n"
                                     + "\n".join(printed))


if __name__ == "__main__" and "--refresh" in sys.argv:
    sys.path.insert(0, str(ROOT))
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    for start, end, cmd, shown in reversed(blocks(text)):
        lines[start:end] = refreshed(shown, run(cmd))
    README.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"refreshed {len(blocks(text))} example(s) in {README}")
