"""How a config field is declared once (``knob``): its doc, its allowed values — a ``Range`` with the reason for
its bounds, or choices — and its group. Validation, its messages, the README's field reference and the window
read these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric field: ``lo … hi``, either end open or closed.

    ``source`` says where the bound comes from; ``note`` is added to the error message.
    """

    lo: float
    hi: float
    source: str
    lo_open: bool = False  # the value must be greater than lo (lo itself is not allowed)
    hi_open: bool = False  # the value must be less than hi
    note: str = ""

    def contains(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below  # False for NaN

    def describe(self) -> str:
        lo = f"greater than {_num(self.lo)}" if self.lo_open else _num(self.lo)
        hi = f"less than {_num(self.hi)}" if self.hi_open else _num(self.hi)
        return f"{lo} … {hi}"

    def message(self, value: float) -> str:
        """``allowed: lo … hi`` and which end the value breaks (nothing more for NaN)."""
        if self.lo_open and not value > self.lo:
            hint = f"must be greater than {_num(self.lo)}"
        elif not self.lo_open and value < self.lo:
            hint = f"must be at least {_num(self.lo)}"
        elif self.hi_open and not value < self.hi:
            hint = f"must be less than {_num(self.hi)}"
        elif not self.hi_open and value > self.hi:
            hint = f"must be at most {_num(self.hi)}"
        else:
            hint = "must be a finite number"
        note = f" ({self.note})" if self.note else ""
        return f"allowed: {self.describe()}; {hint}{note}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


_ONE_SECOND_US = 1e6


_BANDWIDTH = Range(0, 1e5, "NVLink 5 moves 900 GB/s per GPU and direction, an 8×800 Gb/s node 100 GB/s per GPU: "
                   "100 TB/s is 100× the fastest link", lo_open=True)


_LATENCY = Range(0, _ONE_SECOND_US, "a round trip across continents is ~100 ms (1e5 µs): one second is 10× that")


_NO_DEFAULT = dataclasses.MISSING


@dataclass(frozen=True)
class Knob:
    """What a config field is, declared with it (``knob``): its one-line doc, its allowed values (a
    numeric ``range`` with the reason for its bounds, or string ``choices``, a tuple or a mapping of
    each value to what it means) and its ``group`` within its section. Validation, its messages, the
    README's field reference and the window read these."""

    doc: str
    range: Range | None = None
    choices: tuple[str, ...] | dict[str, str] | None = None
    group: str = ""

    def allowed(self) -> str:
        """The choices as the error messages and the reference write them: ``a | b`` (``a (what a means)``)."""
        if isinstance(self.choices, dict):
            return " | ".join(f"{k} ({v})" for k, v in self.choices.items())
        return " | ".join(self.choices or ())


def knob(default: Any = _NO_DEFAULT, *, doc: str, range: Range | None = None,
         choices: tuple[str, ...] | dict[str, str] | None = None, group: str = "") -> Any:
    """A dataclass field with its :class:`Knob` (``field(default=..., metadata={"knob": ...})``)."""
    meta = {"knob": Knob(doc, range, choices, group)}
    return field(metadata=meta) if default is _NO_DEFAULT else field(default=default, metadata=meta)
