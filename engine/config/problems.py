"""A config's problems: each names the field, its value and what is allowed; ``ConfigError`` lists them all."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any


class _NoValue:
    """The value of a problem about a whole file or section, which has no one value to show."""

    def __repr__(self) -> str:
        return "(no value)"


#: a Problem's value where there is none to show (a file that is not TOML, a section that is missing)
NO_VALUE = _NoValue()


def unknown_key(key: str, allowed) -> str:
    """The message for a key no section declares: the allowed keys, the closest first where one is near."""
    allowed = sorted(allowed)
    near = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.75)
    hint = f"did you mean {near[0]}? " if near else ""
    return f"unknown key; {hint}allowed: {', '.join(allowed)}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the field (dotted path), its value, and why."""

    field: str
    value: Any
    message: str

    def __str__(self) -> str:
        if self.value is NO_VALUE:
            return f"{self.field}: {self.message}"
        shown = repr(self.value)
        if len(shown) > 80:  # a 400-digit number or a pasted file: its ends say enough
            shown = f"{shown[:40]}…{shown[-12:]} ({len(shown)} characters)"
        return f"{self.field} = {shown}: {self.message}"


class ConfigError(ValueError):
    """A config that breaks one or more rules. ``problems`` lists every one of them."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")

    def fields(self) -> set[str]:
        return {p.field for p in self.problems}
