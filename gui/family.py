"""The size slider's view of the engine's shape family (``engine.model.family``), and the one number formatter.

The family rule, its members and their exact parameter counts live in the engine; this module
only turns the GUI's model tables (plain dicts) into the engine's ModelSpecs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ModelSpec
from engine.model.family import MOE_SHAPE_FIELDS, SHAPE_FIELDS, Member, walk


def _spec(model: dict[str, Any]) -> ModelSpec:
    names = {f.name for f in dataclasses.fields(ModelSpec)} - {"preset"}
    return ModelSpec(**{k: v for k, v in model.items() if k in names})


def family_for(model: dict[str, Any], preset: dict[str, Any] | None, min_layers: int = 1, ep: int | None = None
               ) -> tuple[list[Member], int]:
    """The members the slider walks for a config's model table, and the index of the model as it is.

    The walk is along the preset's family; a shape outside it (a custom file) is inserted where
    its size puts it, so the slider always shows the config as it is. A model table that cannot
    be counted (a broken edit) shows the walk at the preset's own size. ``min_layers`` (the
    layout's pipeline stages): no member has fewer layers than the layout needs. ``ep`` (the
    layout's expert-parallel degree): a mixture of experts' members keep experts a multiple of it
    (an ep that does not divide the experts is a problem of the config: the walk then ignores it).
    A mixture of experts walks its experts and depth (``engine.model.family.ExpertFamily``).
    """
    # the preset's shape with the model's other fields (seq_len, vocab, ...): the slider changes
    # only the shape, so each member's count is exactly that of the config it would produce
    moe = bool(model.get("experts")) and preset is not None and bool(preset.get("experts"))
    shape = {k: preset[k] for k in (MOE_SHAPE_FIELDS if moe else SHAPE_FIELDS)} if preset is not None else {}
    for e in dict.fromkeys((ep, None)):  # an ep the experts refuse (a problem shown at ep) walks without it
        try:
            return walk(_spec({**model, **shape}), _spec(model), min_layers=min_layers, ep=e)
        except (ArithmeticError, KeyError, TypeError, ValueError):
            pass
    return walk(_spec(preset if preset is not None else model), min_layers=min_layers)


def format_params(n: float) -> str:
    """A parameter count in three significant figures: 8.03B, 124M, 512K."""
    units = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
    for k, (unit, div) in enumerate(units):
        if n >= div:
            v = n / div
            if v >= 999.5 and k > 0:  # 999.6M rounds to 1000M: say it as 1B
                unit, v = units[k - 1][0], v / 1000
            return f"{v:.3g}{unit}" if v < 999.5 else f"{v:,.0f}{unit}"
    return str(int(n))
