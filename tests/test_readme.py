"""The README's example outputs are what the commands they show print today, and its field reference is
what the config declares.

Each fenced block of the README that starts with ``$ shardscope predict|plan|validate ...`` is run
(in this process, through the CLI's ``main``) and compared line by line: a line ``...`` (or `` ...``)
stands for any number of lines, and a plan's wall time (``; 0.92 s``) is not compared. A prediction
that moves fails here until the README is refreshed:

    .venv/bin/python tests/test_readme.py --refresh    # rewrite those blocks from the commands

The reference of every config field (between the ``config-reference`` markers) is written from the
fields' declarations (``engine.config.KNOBS``: type, default, allowed values, doc); ``--refresh``
rewrites it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = ("predict", "plan", "import", "export")  # validate's example reads a file the README writes with cat
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


REFERENCE_BEGIN = "<!-- config-reference: written from engine.config's declarations by tests/test_readme.py --refresh -->"
REFERENCE_END = "<!-- config-reference: end -->"


def _toml(value) -> str:
    """A default as the config file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return "[]" if value == () else repr(value)


def config_reference() -> str:
    """One table per section: every field's type, default, allowed values and doc, from its declaration."""
    from engine import config as c

    def kind(t) -> str:
        t = typing.get_type_hints(owner)[t] if isinstance(t, str) else t
        return {int: "integer", float: "number", bool: "true / false", str: "string", tuple: "list"}.get(
            t, "string or table" if t is c.GPUSpec else "string (optional)" if t == (str | None) else str(t))

    out = []
    for section, owner in (("model", c.ModelSpec), ("cluster", c.ClusterSpec), ("cluster.gpu", c.GPUSpec),
                           ("parallel", c.ParallelSpec), ("training", c.TrainingSpec),
                           ("conventions", c.Conventions)):
        out += ["", f"`[{section}]`" + (" (a table in place of a GPU name)" if section == "cluster.gpu" else ""), "",
                "| field | type | default | allowed | what it is |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(owner):
            k = c.KNOBS[f"{section}.{f.name}"]
            if f.default is not dataclasses.MISSING:
                default = "—" if f.default is None else f"`{_toml(f.default)}`"
            else:
                default = "from the preset" if section in ("model", "cluster", "cluster.gpu") else "—"
            if k.range is not None:
                allowed = k.range.describe() + (f" ({k.range.note})" if k.range.note else "")
            elif k.choices:
                allowed = k.allowed()
            elif f.type in (bool, "bool"):
                allowed = "true | false"
            else:
                allowed = ""
            doc = k.doc + (f" — bounds: {k.range.source}" if k.range is not None else "")
            row = [f"`{f.name}`", kind(f.name), default, allowed.replace("|", "\\|"), doc.replace("|", "\\|")]
            out.append("| " + " | ".join(row) + " |")
    return "\n".join([REFERENCE_BEGIN, *out, "", REFERENCE_END])


def reference_span(text: str) -> tuple[int, int]:
    """(start, end) of the README's field reference, markers included."""
    start = text.index(REFERENCE_BEGIN)
    return start, text.index(REFERENCE_END, start) + len(REFERENCE_END)


def test_the_readme_lists_every_config_field_as_declared():
    text = README.read_text(encoding="utf-8")
    start, end = reference_span(text)
    assert text[start:end] == config_reference(), (
        "README.md's config reference is not what engine.config declares; refresh it: "
        ".venv/bin/python tests/test_readme.py --refresh")


if __name__ == "__main__" and "--refresh" in sys.argv:
    sys.path.insert(0, str(ROOT))
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    for start, end, cmd, shown in reversed(blocks(text)):
        lines[start:end] = refreshed(shown, run(cmd))
    text = "\n".join(lines) + "\n"
    start, end = reference_span(text)
    README.write_text(text[:start] + config_reference() + text[end:], encoding="utf-8")
    print(f"refreshed {len(blocks(text))} example(s) and the config reference in {README}")
