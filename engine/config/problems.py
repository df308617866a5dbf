"""A config's problems: each names the field, its value and what is allowed; ``ConfigError`` lists them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the field (dotted path), its value, and why."""

    field: str
    value: Any
    message: str

    def __str__(self) -> str:
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
