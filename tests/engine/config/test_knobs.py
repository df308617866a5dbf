"""Each config field is declared once (``engine.config.knob``): its doc, its allowed values and its group
travel with it, and validation reads them from there."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from engine import Config, ConfigError, default_config
from engine import config as c
from engine.config.sections import _declared

SECTIONS = (("model", c.ModelSpec), ("cluster", c.ClusterSpec), ("cluster.gpu", c.GPUSpec),
            ("parallel", c.ParallelSpec), ("training", c.TrainingSpec), ("conventions", c.Conventions))
#: string fields a person names freely: presets, a file, a GPU kind (checked against the presets when read)
FREE_TEXT = {"model.preset", "model.hf_config", "cluster.preset", "cluster.gpu.name"}
#: fields whose allowed values another field narrows: a rule says which (grad_dtype under fp32 is fp32 only)
NARROWED = {"training.grad_dtype"}


def _fields():
    for section, cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", hints[f.name], f


def test_every_field_is_declared_with_a_doc_and_its_allowed_values():
    seen = set()
    for path, kind, f in _fields():
        k = f.metadata.get("knob")
        assert isinstance(k, c.Knob), f"{path} is not declared with knob(...)"
        assert k.doc.strip() and "names." not in k.doc, f"{path}: a one-line doc, in words"
        assert k.group, f"{path}: a group"
        if kind in (int, float):
            assert k.range is not None and k.range.source, f"{path}: a range with the reason for its bounds"
        if kind in (str, str | None) and path not in FREE_TEXT:
            assert k.choices, f"{path}: its choices"
        assert c.KNOBS[path] is k
        seen.add(path)
    assert seen == set(c.KNOBS)
    assert c.FIELD_RANGES == {p: k.range for p, k in c.KNOBS.items() if k.range is not None}


@pytest.mark.parametrize("path", [p for p, k in c.KNOBS.items() if isinstance(k.choices, (tuple, dict))
                                  and not p.startswith("cluster.") and p not in NARROWED])
def test_a_value_outside_a_fields_choices_is_refused_with_the_declared_ones(path):
    section, key = path.split(".")
    raw = default_config().to_dict()
    raw.setdefault(section, {})[key] = "no-such-value"
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw)
    problem = next(p for p in err.value.problems if p.field == path)
    assert problem.message.startswith(f"allowed: {c.KNOBS[path].allowed()}")


def test_a_mapping_of_choices_says_what_each_value_means():
    k = c.KNOBS["conventions.state_accounting"]
    assert isinstance(k.choices, dict) and set(k.choices) == {"pytorch", "zero-paper"}
    assert k.allowed().startswith("pytorch (what torch's autocast")


def test_a_new_knob_is_one_declaration():
    """A section declared with knob(...) is read by the same machinery: its knobs by path, its ranges."""

    @dataclasses.dataclass(frozen=True)
    class Extra:
        width: int = c.knob(4, doc="a width", range=c.Range(1, 8, "eight is plenty"), group="extra")
        mode: str = c.knob("a", doc="a mode", choices=("a", "b"), group="extra")

    knobs = _declared(Extra, "extra")
    assert list(knobs) == ["extra.width", "extra.mode"]
    assert knobs["extra.width"].range.describe() == "1 … 8" and knobs["extra.mode"].allowed() == "a | b"
    assert Extra().width == 4
