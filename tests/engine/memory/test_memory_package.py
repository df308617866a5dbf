"""engine.memory as a package: the activation table, in-flight counts from the schedules' action
lists, and the machine-readable fields of every Term."""

from dataclasses import replace

import pytest

from engine import Config
from engine.memory import Term, memory_per_rank
from engine.memory.activations import SAVED_TENSORS, _Shape, layer_activation_terms
from engine.names import MEMORY_CATEGORIES, SCHEDULES
from engine.pipeline.schedules import microbatches_in_flight, schedule_problems

# ---------------------------------------------------------------- activation table

SHAPE = _Shape(s=1024, b=2, h=512, a=8, kv=512, f=2048, t=2, sp=False, act=2, dropout=True, flash=False,
               swiglu=False)
VARIANTS = [SHAPE, replace(SHAPE, flash=True), replace(SHAPE, dropout=False), replace(SHAPE, swiglu=True),
            replace(SHAPE, sp=True), replace(SHAPE, torch_ops=True, resid=2, rope=True, head_dim=64,
                                                composite_norm=True),
            replace(SHAPE, lora_r=8, lora_mods=("wq", "wv")), replace(SHAPE, flash=True, lora_r=8, lora_mods=("w2",))]


def test_every_saved_tensor_is_declared_once():
    keys = [(r.label, r.part) for r in SAVED_TENSORS]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("sh", VARIANTS)
def test_selective_removes_exactly_the_rows_that_name_it(sh):
    none, _ = layer_activation_terms(sh)
    sel, _ = layer_activation_terms(replace(sh, recompute="selective"))
    named = {r.label_for(sh) for r in SAVED_TENSORS if "selective" in r.recomputed_by}
    assert [t for t in none if t[0] not in named] == list(sel)
    assert {t[0] for t in none} - {t[0] for t in sel} == named & {t[0] for t in none}
    assert named & {t[0] for t in none}  # something is recomputed in every variant here


@pytest.mark.parametrize("sh", VARIANTS)
def test_formula_is_the_rows_summed_by_basis(sh):
    terms, formula = layer_activation_terms(sh)
    s, b = sh.s, sh.b
    env = {"h": sh.h, "h/t": sh.h / sh.t, "kv/t": sh.kv / sh.t, "f/t": sh.f / sh.t, "as/t": sh.a * s / sh.t,
           "a/t": sh.a / sh.t, "1/t": 1 / sh.t, "d/2b": sh.head_dim / 2 / b, "s/b": s / b, "r": sh.lora_r}
    assert formula.startswith("s·b·(") and formula.endswith(")")
    total = 0.0
    for part in formula[5:-1].split(" + "):
        basis = next((k for k in sorted(env, key=len, reverse=True) if part.endswith(k)), None)
        coef = int(part[: -len(basis)]) if basis else int(part)
        total += coef * (env[basis] if basis else 1)
    assert total * s * b == pytest.approx(sum(x for _, x, _ in terms))


def test_korthikanti_table2_from_the_table():
    # Table 2 (f = 4h, eager, dropout, 16-bit): sbh(34 + 5as/h) / t-variants
    s, b, h, a, t = 2048, 1, 1024, 16, 4
    base = _Shape(s=s, b=b, h=h, a=a, kv=h, f=4 * h, t=1, sp=False, act=2, dropout=True, flash=False,
                  swiglu=False)

    def total(sh):
        return sum(x for _, x, _ in layer_activation_terms(sh)[0])

    sbh = s * b * h
    assert total(base) == sbh * (34 + 5 * a * s / h)
    assert total(replace(base, t=t)) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert total(replace(base, t=t, sp=True)) == sbh / t * (34 + 5 * a * s / h)
    assert total(replace(base, t=t, recompute="selective")) == sbh * (10 + 24 / t)
    assert total(replace(base, t=t, sp=True, recompute="selective")) == sbh * 34 / t


# ---------------------------------------------------------------- in flight, against the old replays

OLD_IN_FLIGHT = {  # (schedule, rank, pp, v, m) -> counts with unit bytes (1, 2, ...)
    ('DualPipeV', 0, 2, 2, 4): (4, 1),
    ('DualPipeV', 0, 2, 2, 5): (4, 1),
    ('DualPipeV', 0, 2, 2, 6): (4, 1),
    ('DualPipeV', 0, 2, 2, 8): (4, 1),
    ('DualPipeV', 0, 2, 2, 9): (4, 1),
    ('DualPipeV', 0, 2, 2, 10): (4, 1),
    ('DualPipeV', 0, 2, 2, 12): (4, 1),
    ('DualPipeV', 0, 3, 2, 6): (6, 1),
    ('DualPipeV', 0, 3, 2, 8): (6, 1),
    ('DualPipeV', 0, 3, 2, 9): (6, 1),
    ('DualPipeV', 0, 3, 2, 10): (6, 1),
    ('DualPipeV', 0, 3, 2, 12): (6, 1),
    ('DualPipeV', 0, 4, 2, 8): (8, 1),
    ('DualPipeV', 0, 4, 2, 9): (8, 1),
    ('DualPipeV', 0, 4, 2, 10): (8, 1),
    ('DualPipeV', 0, 4, 2, 12): (8, 1),
    ('DualPipeV', 0, 5, 2, 10): (10, 1),
    ('DualPipeV', 0, 5, 2, 12): (10, 1),
    ('DualPipeV', 1, 2, 2, 4): (3, 2),
    ('DualPipeV', 1, 2, 2, 5): (3, 2),
    ('DualPipeV', 1, 2, 2, 6): (3, 2),
    ('DualPipeV', 1, 2, 2, 8): (3, 2),
    ('DualPipeV', 1, 2, 2, 9): (3, 2),
    ('DualPipeV', 1, 2, 2, 10): (3, 2),
    ('DualPipeV', 1, 2, 2, 12): (3, 2),
    ('DualPipeV', 1, 3, 2, 6): (5, 2),
    ('DualPipeV', 1, 3, 2, 8): (5, 2),
    ('DualPipeV', 1, 3, 2, 9): (5, 2),
    ('DualPipeV', 1, 3, 2, 10): (5, 2),
    ('DualPipeV', 1, 3, 2, 12): (5, 2),
    ('DualPipeV', 1, 4, 2, 8): (7, 2),
    ('DualPipeV', 1, 4, 2, 9): (7, 2),
    ('DualPipeV', 1, 4, 2, 10): (7, 2),
    ('DualPipeV', 1, 4, 2, 12): (7, 2),
    ('DualPipeV', 1, 5, 2, 10): (9, 2),
    ('DualPipeV', 1, 5, 2, 12): (9, 2),
    ('DualPipeV', 2, 3, 2, 6): (4, 3),
    ('DualPipeV', 2, 3, 2, 8): (4, 3),
    ('DualPipeV', 2, 3, 2, 9): (4, 3),
    ('DualPipeV', 2, 3, 2, 10): (4, 3),
    ('DualPipeV', 2, 3, 2, 12): (4, 3),
    ('DualPipeV', 2, 4, 2, 8): (6, 3),
    ('DualPipeV', 2, 4, 2, 9): (6, 3),
    ('DualPipeV', 2, 4, 2, 10): (6, 3),
    ('DualPipeV', 2, 4, 2, 12): (6, 3),
    ('DualPipeV', 2, 5, 2, 10): (8, 3),
    ('DualPipeV', 2, 5, 2, 12): (8, 3),
    ('DualPipeV', 3, 4, 2, 8): (5, 4),
    ('DualPipeV', 3, 4, 2, 9): (5, 4),
    ('DualPipeV', 3, 4, 2, 10): (5, 4),
    ('DualPipeV', 3, 4, 2, 12): (5, 4),
    ('DualPipeV', 3, 5, 2, 10): (7, 4),
    ('DualPipeV', 3, 5, 2, 12): (7, 4),
    ('DualPipeV', 4, 5, 2, 10): (6, 5),
    ('DualPipeV', 4, 5, 2, 12): (6, 5),
    ('Interleaved1F1B', 0, 2, 2, 4): (3, 2),
    ('Interleaved1F1B', 0, 2, 2, 6): (3, 2),
    ('Interleaved1F1B', 0, 2, 2, 8): (3, 2),
    ('Interleaved1F1B', 0, 2, 2, 10): (3, 2),
    ('Interleaved1F1B', 0, 2, 2, 12): (3, 2),
    ('Interleaved1F1B', 0, 2, 3, 4): (3, 2, 2),
    ('Interleaved1F1B', 0, 2, 3, 6): (3, 2, 2),
    ('Interleaved1F1B', 0, 2, 3, 8): (3, 2, 2),
    ('Interleaved1F1B', 0, 2, 3, 10): (3, 2, 2),
    ('Interleaved1F1B', 0, 2, 3, 12): (3, 2, 2),
    ('Interleaved1F1B', 0, 3, 2, 4): (4, 4),
    ('Interleaved1F1B', 0, 3, 2, 5): (5, 5),
    ('Interleaved1F1B', 0, 3, 2, 6): (5, 3),
    ('Interleaved1F1B', 0, 3, 2, 8): (5, 4),
    ('Interleaved1F1B', 0, 3, 2, 9): (5, 3),
    ('Interleaved1F1B', 0, 3, 2, 12): (5, 3),
    ('Interleaved1F1B', 0, 3, 3, 4): (4, 4, 4),
    ('Interleaved1F1B', 0, 3, 3, 5): (5, 5, 5),
    ('Interleaved1F1B', 0, 3, 3, 6): (5, 3, 3),
    ('Interleaved1F1B', 0, 3, 3, 8): (5, 4, 4),
    ('Interleaved1F1B', 0, 3, 3, 9): (5, 3, 3),
    ('Interleaved1F1B', 0, 3, 3, 12): (5, 3, 3),
    ('Interleaved1F1B', 0, 4, 2, 4): (4, 4),
    ('Interleaved1F1B', 0, 4, 2, 5): (5, 5),
    ('Interleaved1F1B', 0, 4, 2, 6): (6, 6),
    ('Interleaved1F1B', 0, 4, 2, 8): (7, 4),
    ('Interleaved1F1B', 0, 4, 2, 10): (7, 5),
    ('Interleaved1F1B', 0, 4, 2, 12): (7, 4),
    ('Interleaved1F1B', 0, 4, 3, 4): (4, 4, 4),
    ('Interleaved1F1B', 0, 4, 3, 5): (5, 5, 5),
    ('Interleaved1F1B', 0, 4, 3, 6): (6, 6, 6),
    ('Interleaved1F1B', 0, 4, 3, 8): (7, 4, 4),
    ('Interleaved1F1B', 0, 4, 3, 10): (7, 5, 5),
    ('Interleaved1F1B', 0, 4, 3, 12): (7, 4, 4),
    ('Interleaved1F1B', 0, 5, 2, 4): (4, 4),
    ('Interleaved1F1B', 0, 5, 2, 5): (5, 5),
    ('Interleaved1F1B', 0, 5, 2, 6): (6, 6),
    ('Interleaved1F1B', 0, 5, 2, 8): (8, 8),
    ('Interleaved1F1B', 0, 5, 2, 9): (9, 9),
    ('Interleaved1F1B', 0, 5, 2, 10): (9, 5),
    ('Interleaved1F1B', 0, 5, 2, 12): (9, 6),
    ('Interleaved1F1B', 0, 5, 3, 4): (4, 4, 4),
    ('Interleaved1F1B', 0, 5, 3, 5): (5, 5, 5),
    ('Interleaved1F1B', 0, 5, 3, 6): (6, 6, 6),
    ('Interleaved1F1B', 0, 5, 3, 8): (8, 8, 8),
    ('Interleaved1F1B', 0, 5, 3, 9): (9, 9, 9),
    ('Interleaved1F1B', 0, 5, 3, 10): (9, 5, 5),
    ('Interleaved1F1B', 0, 5, 3, 12): (9, 6, 6),
    ('Interleaved1F1B', 1, 2, 2, 4): (2, 1),
    ('Interleaved1F1B', 1, 2, 2, 6): (2, 1),
    ('Interleaved1F1B', 1, 2, 2, 8): (2, 1),
    ('Interleaved1F1B', 1, 2, 2, 10): (2, 1),
    ('Interleaved1F1B', 1, 2, 2, 12): (2, 1),
    ('Interleaved1F1B', 1, 2, 3, 4): (2, 2, 1),
    ('Interleaved1F1B', 1, 2, 3, 6): (2, 2, 1),
    ('Interleaved1F1B', 1, 2, 3, 8): (2, 2, 1),
    ('Interleaved1F1B', 1, 2, 3, 10): (2, 2, 1),
    ('Interleaved1F1B', 1, 2, 3, 12): (2, 2, 1),
    ('Interleaved1F1B', 1, 3, 2, 4): (4, 3),
    ('Interleaved1F1B', 1, 3, 2, 5): (5, 3),
    ('Interleaved1F1B', 1, 3, 2, 6): (3, 3),
    ('Interleaved1F1B', 1, 3, 2, 8): (4, 3),
    ('Interleaved1F1B', 1, 3, 2, 9): (3, 3),
    ('Interleaved1F1B', 1, 3, 2, 12): (3, 3),
    ('Interleaved1F1B', 1, 3, 3, 4): (4, 4, 3),
    ('Interleaved1F1B', 1, 3, 3, 5): (5, 5, 3),
    ('Interleaved1F1B', 1, 3, 3, 6): (3, 3, 3),
    ('Interleaved1F1B', 1, 3, 3, 8): (4, 4, 3),
    ('Interleaved1F1B', 1, 3, 3, 9): (3, 3, 3),
    ('Interleaved1F1B', 1, 3, 3, 12): (3, 3, 3),
    ('Interleaved1F1B', 1, 4, 2, 4): (4, 4),
    ('Interleaved1F1B', 1, 4, 2, 5): (5, 5),
    ('Interleaved1F1B', 1, 4, 2, 6): (6, 5),
    ('Interleaved1F1B', 1, 4, 2, 8): (5, 4),
    ('Interleaved1F1B', 1, 4, 2, 10): (5, 5),
    ('Interleaved1F1B', 1, 4, 2, 12): (5, 4),
    ('Interleaved1F1B', 1, 4, 3, 4): (4, 4, 4),
    ('Interleaved1F1B', 1, 4, 3, 5): (5, 5, 5),
    ('Interleaved1F1B', 1, 4, 3, 6): (6, 6, 5),
    ('Interleaved1F1B', 1, 4, 3, 8): (5, 4, 4),
    ('Interleaved1F1B', 1, 4, 3, 10): (5, 5, 5),
    ('Interleaved1F1B', 1, 4, 3, 12): (5, 4, 4),
    ('Interleaved1F1B', 1, 5, 2, 4): (4, 4),
    ('Interleaved1F1B', 1, 5, 2, 5): (5, 5),
    ('Interleaved1F1B', 1, 5, 2, 6): (6, 6),
    ('Interleaved1F1B', 1, 5, 2, 8): (8, 7),
    ('Interleaved1F1B', 1, 5, 2, 9): (9, 7),
    ('Interleaved1F1B', 1, 5, 2, 10): (7, 5),
    ('Interleaved1F1B', 1, 5, 2, 12): (7, 6),
    ('Interleaved1F1B', 1, 5, 3, 4): (4, 4, 4),
    ('Interleaved1F1B', 1, 5, 3, 5): (5, 5, 5),
    ('Interleaved1F1B', 1, 5, 3, 6): (6, 6, 6),
    ('Interleaved1F1B', 1, 5, 3, 8): (8, 8, 7),
    ('Interleaved1F1B', 1, 5, 3, 9): (9, 9, 7),
    ('Interleaved1F1B', 1, 5, 3, 10): (7, 5, 5),
    ('Interleaved1F1B', 1, 5, 3, 12): (7, 6, 6),
    ('Interleaved1F1B', 2, 3, 2, 4): (4, 1),
    ('Interleaved1F1B', 2, 3, 2, 5): (5, 1),
    ('Interleaved1F1B', 2, 3, 2, 6): (3, 1),
    ('Interleaved1F1B', 2, 3, 2, 8): (4, 1),
    ('Interleaved1F1B', 2, 3, 2, 9): (3, 1),
    ('Interleaved1F1B', 2, 3, 2, 12): (3, 1),
    ('Interleaved1F1B', 2, 3, 3, 4): (4, 4, 1),
    ('Interleaved1F1B', 2, 3, 3, 5): (5, 5, 1),
    ('Interleaved1F1B', 2, 3, 3, 6): (3, 3, 1),
    ('Interleaved1F1B', 2, 3, 3, 8): (4, 4, 1),
    ('Interleaved1F1B', 2, 3, 3, 9): (3, 3, 1),
    ('Interleaved1F1B', 2, 3, 3, 12): (3, 3, 1),
    ('Interleaved1F1B', 2, 4, 2, 4): (4, 3),
    ('Interleaved1F1B', 2, 4, 2, 5): (5, 3),
    ('Interleaved1F1B', 2, 4, 2, 6): (6, 3),
    ('Interleaved1F1B', 2, 4, 2, 8): (4, 3),
    ('Interleaved1F1B', 2, 4, 2, 10): (5, 3),
    ('Interleaved1F1B', 2, 4, 2, 12): (4, 3),
    ('Interleaved1F1B', 2, 4, 3, 4): (4, 4, 3),
    ('Interleaved1F1B', 2, 4, 3, 5): (5, 5, 3),
    ('Interleaved1F1B', 2, 4, 3, 6): (6, 6, 3),
    ('Interleaved1F1B', 2, 4, 3, 8): (4, 4, 3),
    ('Interleaved1F1B', 2, 4, 3, 10): (5, 5, 3),
    ('Interleaved1F1B', 2, 4, 3, 12): (4, 4, 3),
    ('Interleaved1F1B', 2, 5, 2, 4): (4, 4),
    ('Interleaved1F1B', 2, 5, 2, 5): (5, 5),
    ('Interleaved1F1B', 2, 5, 2, 6): (6, 5),
    ('Interleaved1F1B', 2, 5, 2, 8): (8, 5),
    ('Interleaved1F1B', 2, 5, 2, 9): (9, 5),
    ('Interleaved1F1B', 2, 5, 2, 10): (5, 5),
    ('Interleaved1F1B', 2, 5, 2, 12): (6, 5),
    ('Interleaved1F1B', 2, 5, 3, 4): (4, 4, 4),
    ('Interleaved1F1B', 2, 5, 3, 5): (5, 5, 5),
    ('Interleaved1F1B', 2, 5, 3, 6): (6, 6, 5),
    ('Interleaved1F1B', 2, 5, 3, 8): (8, 8, 5),
    ('Interleaved1F1B', 2, 5, 3, 9): (9, 9, 5),
    ('Interleaved1F1B', 2, 5, 3, 10): (5, 5, 5),
    ('Interleaved1F1B', 2, 5, 3, 12): (6, 6, 5),
    ('Interleaved1F1B', 3, 4, 2, 4): (4, 1),
    ('Interleaved1F1B', 3, 4, 2, 5): (5, 1),
    ('Interleaved1F1B', 3, 4, 2, 6): (6, 1),
    ('Interleaved1F1B', 3, 4, 2, 8): (4, 1),
    ('Interleaved1F1B', 3, 4, 2, 10): (5, 1),
    ('Interleaved1F1B', 3, 4, 2, 12): (4, 1),
    ('Interleaved1F1B', 3, 4, 3, 4): (4, 4, 1),
    ('Interleaved1F1B', 3, 4, 3, 5): (5, 5, 1),
    ('Interleaved1F1B', 3, 4, 3, 6): (6, 6, 1),
    ('Interleaved1F1B', 3, 4, 3, 8): (4, 4, 1),
    ('Interleaved1F1B', 3, 4, 3, 10): (5, 5, 1),
    ('Interleaved1F1B', 3, 4, 3, 12): (4, 4, 1),
    ('Interleaved1F1B', 3, 5, 2, 4): (4, 3),
    ('Interleaved1F1B', 3, 5, 2, 5): (5, 3),
    ('Interleaved1F1B', 3, 5, 2, 6): (6, 3),
    ('Interleaved1F1B', 3, 5, 2, 8): (8, 3),
    ('Interleaved1F1B', 3, 5, 2, 9): (9, 3),
    ('Interleaved1F1B', 3, 5, 2, 10): (5, 3),
    ('Interleaved1F1B', 3, 5, 2, 12): (6, 3),
    ('Interleaved1F1B', 3, 5, 3, 4): (4, 4, 3),
    ('Interleaved1F1B', 3, 5, 3, 5): (5, 5, 3),
    ('Interleaved1F1B', 3, 5, 3, 6): (6, 6, 3),
    ('Interleaved1F1B', 3, 5, 3, 8): (8, 8, 3),
    ('Interleaved1F1B', 3, 5, 3, 9): (9, 9, 3),
    ('Interleaved1F1B', 3, 5, 3, 10): (5, 5, 3),
    ('Interleaved1F1B', 3, 5, 3, 12): (6, 6, 3),
    ('Interleaved1F1B', 4, 5, 2, 4): (4, 1),
    ('Interleaved1F1B', 4, 5, 2, 5): (5, 1),
    ('Interleaved1F1B', 4, 5, 2, 6): (6, 1),
    ('Interleaved1F1B', 4, 5, 2, 8): (8, 1),
    ('Interleaved1F1B', 4, 5, 2, 9): (9, 1),
    ('Interleaved1F1B', 4, 5, 2, 10): (5, 1),
    ('Interleaved1F1B', 4, 5, 2, 12): (6, 1),
    ('Interleaved1F1B', 4, 5, 3, 4): (4, 4, 1),
    ('Interleaved1F1B', 4, 5, 3, 5): (5, 5, 1),
    ('Interleaved1F1B', 4, 5, 3, 6): (6, 6, 1),
    ('Interleaved1F1B', 4, 5, 3, 8): (8, 8, 1),
    ('Interleaved1F1B', 4, 5, 3, 9): (9, 9, 1),
    ('Interleaved1F1B', 4, 5, 3, 10): (5, 5, 1),
    ('Interleaved1F1B', 4, 5, 3, 12): (6, 6, 1),
    ('InterleavedZeroBubble', 0, 2, 2, 4): (2, 2),
    ('InterleavedZeroBubble', 0, 2, 2, 6): (2, 2),
    ('InterleavedZeroBubble', 0, 2, 2, 8): (2, 2),
    ('InterleavedZeroBubble', 0, 2, 2, 10): (2, 2),
    ('InterleavedZeroBubble', 0, 2, 2, 12): (2, 2),
    ('InterleavedZeroBubble', 0, 2, 3, 4): (2, 2, 2),
    ('InterleavedZeroBubble', 0, 2, 3, 6): (2, 2, 2),
    ('InterleavedZeroBubble', 0, 2, 3, 8): (2, 2, 2),
    ('InterleavedZeroBubble', 0, 2, 3, 10): (2, 2, 2),
    ('InterleavedZeroBubble', 0, 2, 3, 12): (2, 2, 2),
    ('InterleavedZeroBubble', 0, 3, 2, 4): (4, 3),
    ('InterleavedZeroBubble', 0, 3, 2, 5): (5, 3),
    ('InterleavedZeroBubble', 0, 3, 2, 6): (3, 3),
    ('InterleavedZeroBubble', 0, 3, 2, 8): (4, 3),
    ('InterleavedZeroBubble', 0, 3, 2, 9): (3, 3),
    ('InterleavedZeroBubble', 0, 3, 2, 12): (3, 3),
    ('InterleavedZeroBubble', 0, 3, 3, 4): (4, 4, 3),
    ('InterleavedZeroBubble', 0, 3, 3, 5): (5, 5, 3),
    ('InterleavedZeroBubble', 0, 3, 3, 6): (3, 3, 3),
    ('InterleavedZeroBubble', 0, 3, 3, 8): (4, 4, 3),
    ('InterleavedZeroBubble', 0, 3, 3, 9): (3, 3, 3),
    ('InterleavedZeroBubble', 0, 3, 3, 12): (3, 3, 3),
    ('InterleavedZeroBubble', 0, 4, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 0, 4, 2, 5): (5, 4),
    ('InterleavedZeroBubble', 0, 4, 2, 6): (6, 4),
    ('InterleavedZeroBubble', 0, 4, 2, 8): (4, 4),
    ('InterleavedZeroBubble', 0, 4, 2, 10): (5, 4),
    ('InterleavedZeroBubble', 0, 4, 2, 12): (4, 4),
    ('InterleavedZeroBubble', 0, 4, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 0, 4, 3, 5): (5, 5, 4),
    ('InterleavedZeroBubble', 0, 4, 3, 6): (6, 6, 4),
    ('InterleavedZeroBubble', 0, 4, 3, 8): (4, 4, 4),
    ('InterleavedZeroBubble', 0, 4, 3, 10): (5, 5, 4),
    ('InterleavedZeroBubble', 0, 4, 3, 12): (4, 4, 4),
    ('InterleavedZeroBubble', 0, 5, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 0, 5, 2, 5): (5, 5),
    ('InterleavedZeroBubble', 0, 5, 2, 6): (6, 5),
    ('InterleavedZeroBubble', 0, 5, 2, 8): (8, 5),
    ('InterleavedZeroBubble', 0, 5, 2, 9): (9, 5),
    ('InterleavedZeroBubble', 0, 5, 2, 10): (5, 5),
    ('InterleavedZeroBubble', 0, 5, 2, 12): (6, 5),
    ('InterleavedZeroBubble', 0, 5, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 0, 5, 3, 5): (5, 5, 5),
    ('InterleavedZeroBubble', 0, 5, 3, 6): (6, 6, 5),
    ('InterleavedZeroBubble', 0, 5, 3, 8): (8, 8, 5),
    ('InterleavedZeroBubble', 0, 5, 3, 9): (9, 9, 5),
    ('InterleavedZeroBubble', 0, 5, 3, 10): (5, 5, 5),
    ('InterleavedZeroBubble', 0, 5, 3, 12): (6, 6, 5),
    ('InterleavedZeroBubble', 1, 2, 2, 4): (2, 2),
    ('InterleavedZeroBubble', 1, 2, 2, 6): (2, 2),
    ('InterleavedZeroBubble', 1, 2, 2, 8): (2, 2),
    ('InterleavedZeroBubble', 1, 2, 2, 10): (2, 2),
    ('InterleavedZeroBubble', 1, 2, 2, 12): (2, 2),
    ('InterleavedZeroBubble', 1, 2, 3, 4): (2, 2, 2),
    ('InterleavedZeroBubble', 1, 2, 3, 6): (2, 2, 2),
    ('InterleavedZeroBubble', 1, 2, 3, 8): (2, 2, 2),
    ('InterleavedZeroBubble', 1, 2, 3, 10): (2, 2, 2),
    ('InterleavedZeroBubble', 1, 2, 3, 12): (2, 2, 2),
    ('InterleavedZeroBubble', 1, 3, 2, 4): (4, 3),
    ('InterleavedZeroBubble', 1, 3, 2, 5): (5, 3),
    ('InterleavedZeroBubble', 1, 3, 2, 6): (3, 3),
    ('InterleavedZeroBubble', 1, 3, 2, 8): (4, 3),
    ('InterleavedZeroBubble', 1, 3, 2, 9): (3, 3),
    ('InterleavedZeroBubble', 1, 3, 2, 12): (3, 3),
    ('InterleavedZeroBubble', 1, 3, 3, 4): (4, 4, 3),
    ('InterleavedZeroBubble', 1, 3, 3, 5): (5, 5, 3),
    ('InterleavedZeroBubble', 1, 3, 3, 6): (3, 3, 3),
    ('InterleavedZeroBubble', 1, 3, 3, 8): (4, 4, 3),
    ('InterleavedZeroBubble', 1, 3, 3, 9): (3, 3, 3),
    ('InterleavedZeroBubble', 1, 3, 3, 12): (3, 3, 3),
    ('InterleavedZeroBubble', 1, 4, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 1, 4, 2, 5): (5, 4),
    ('InterleavedZeroBubble', 1, 4, 2, 6): (6, 4),
    ('InterleavedZeroBubble', 1, 4, 2, 8): (4, 4),
    ('InterleavedZeroBubble', 1, 4, 2, 10): (5, 4),
    ('InterleavedZeroBubble', 1, 4, 2, 12): (4, 4),
    ('InterleavedZeroBubble', 1, 4, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 1, 4, 3, 5): (5, 5, 4),
    ('InterleavedZeroBubble', 1, 4, 3, 6): (6, 6, 4),
    ('InterleavedZeroBubble', 1, 4, 3, 8): (4, 4, 4),
    ('InterleavedZeroBubble', 1, 4, 3, 10): (5, 5, 4),
    ('InterleavedZeroBubble', 1, 4, 3, 12): (4, 4, 4),
    ('InterleavedZeroBubble', 1, 5, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 1, 5, 2, 5): (5, 5),
    ('InterleavedZeroBubble', 1, 5, 2, 6): (6, 5),
    ('InterleavedZeroBubble', 1, 5, 2, 8): (8, 5),
    ('InterleavedZeroBubble', 1, 5, 2, 9): (9, 5),
    ('InterleavedZeroBubble', 1, 5, 2, 10): (5, 5),
    ('InterleavedZeroBubble', 1, 5, 2, 12): (6, 5),
    ('InterleavedZeroBubble', 1, 5, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 1, 5, 3, 5): (5, 5, 5),
    ('InterleavedZeroBubble', 1, 5, 3, 6): (6, 6, 5),
    ('InterleavedZeroBubble', 1, 5, 3, 8): (8, 8, 5),
    ('InterleavedZeroBubble', 1, 5, 3, 9): (9, 9, 5),
    ('InterleavedZeroBubble', 1, 5, 3, 10): (5, 5, 5),
    ('InterleavedZeroBubble', 1, 5, 3, 12): (6, 6, 5),
    ('InterleavedZeroBubble', 2, 3, 2, 4): (4, 3),
    ('InterleavedZeroBubble', 2, 3, 2, 5): (5, 3),
    ('InterleavedZeroBubble', 2, 3, 2, 6): (3, 3),
    ('InterleavedZeroBubble', 2, 3, 2, 8): (4, 3),
    ('InterleavedZeroBubble', 2, 3, 2, 9): (3, 3),
    ('InterleavedZeroBubble', 2, 3, 2, 12): (3, 3),
    ('InterleavedZeroBubble', 2, 3, 3, 4): (4, 4, 3),
    ('InterleavedZeroBubble', 2, 3, 3, 5): (5, 5, 3),
    ('InterleavedZeroBubble', 2, 3, 3, 6): (3, 3, 3),
    ('InterleavedZeroBubble', 2, 3, 3, 8): (4, 4, 3),
    ('InterleavedZeroBubble', 2, 3, 3, 9): (3, 3, 3),
    ('InterleavedZeroBubble', 2, 3, 3, 12): (3, 3, 3),
    ('InterleavedZeroBubble', 2, 4, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 2, 4, 2, 5): (5, 4),
    ('InterleavedZeroBubble', 2, 4, 2, 6): (6, 4),
    ('InterleavedZeroBubble', 2, 4, 2, 8): (4, 4),
    ('InterleavedZeroBubble', 2, 4, 2, 10): (5, 4),
    ('InterleavedZeroBubble', 2, 4, 2, 12): (4, 4),
    ('InterleavedZeroBubble', 2, 4, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 2, 4, 3, 5): (5, 5, 4),
    ('InterleavedZeroBubble', 2, 4, 3, 6): (6, 6, 4),
    ('InterleavedZeroBubble', 2, 4, 3, 8): (4, 4, 4),
    ('InterleavedZeroBubble', 2, 4, 3, 10): (5, 5, 4),
    ('InterleavedZeroBubble', 2, 4, 3, 12): (4, 4, 4),
    ('InterleavedZeroBubble', 2, 5, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 2, 5, 2, 5): (5, 5),
    ('InterleavedZeroBubble', 2, 5, 2, 6): (6, 5),
    ('InterleavedZeroBubble', 2, 5, 2, 8): (8, 5),
    ('InterleavedZeroBubble', 2, 5, 2, 9): (9, 5),
    ('InterleavedZeroBubble', 2, 5, 2, 10): (5, 5),
    ('InterleavedZeroBubble', 2, 5, 2, 12): (6, 5),
    ('InterleavedZeroBubble', 2, 5, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 2, 5, 3, 5): (5, 5, 5),
    ('InterleavedZeroBubble', 2, 5, 3, 6): (6, 6, 5),
    ('InterleavedZeroBubble', 2, 5, 3, 8): (8, 8, 5),
    ('InterleavedZeroBubble', 2, 5, 3, 9): (9, 9, 5),
    ('InterleavedZeroBubble', 2, 5, 3, 10): (5, 5, 5),
    ('InterleavedZeroBubble', 2, 5, 3, 12): (6, 6, 5),
    ('InterleavedZeroBubble', 3, 4, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 3, 4, 2, 5): (5, 4),
    ('InterleavedZeroBubble', 3, 4, 2, 6): (6, 4),
    ('InterleavedZeroBubble', 3, 4, 2, 8): (4, 4),
    ('InterleavedZeroBubble', 3, 4, 2, 10): (5, 4),
    ('InterleavedZeroBubble', 3, 4, 2, 12): (4, 4),
    ('InterleavedZeroBubble', 3, 4, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 3, 4, 3, 5): (5, 5, 4),
    ('InterleavedZeroBubble', 3, 4, 3, 6): (6, 6, 4),
    ('InterleavedZeroBubble', 3, 4, 3, 8): (4, 4, 4),
    ('InterleavedZeroBubble', 3, 4, 3, 10): (5, 5, 4),
    ('InterleavedZeroBubble', 3, 4, 3, 12): (4, 4, 4),
    ('InterleavedZeroBubble', 3, 5, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 3, 5, 2, 5): (5, 5),
    ('InterleavedZeroBubble', 3, 5, 2, 6): (6, 5),
    ('InterleavedZeroBubble', 3, 5, 2, 8): (8, 5),
    ('InterleavedZeroBubble', 3, 5, 2, 9): (9, 5),
    ('InterleavedZeroBubble', 3, 5, 2, 10): (5, 5),
    ('InterleavedZeroBubble', 3, 5, 2, 12): (6, 5),
    ('InterleavedZeroBubble', 3, 5, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 3, 5, 3, 5): (5, 5, 5),
    ('InterleavedZeroBubble', 3, 5, 3, 6): (6, 6, 5),
    ('InterleavedZeroBubble', 3, 5, 3, 8): (8, 8, 5),
    ('InterleavedZeroBubble', 3, 5, 3, 9): (9, 9, 5),
    ('InterleavedZeroBubble', 3, 5, 3, 10): (5, 5, 5),
    ('InterleavedZeroBubble', 3, 5, 3, 12): (6, 6, 5),
    ('InterleavedZeroBubble', 4, 5, 2, 4): (4, 4),
    ('InterleavedZeroBubble', 4, 5, 2, 5): (5, 5),
    ('InterleavedZeroBubble', 4, 5, 2, 6): (6, 5),
    ('InterleavedZeroBubble', 4, 5, 2, 8): (8, 5),
    ('InterleavedZeroBubble', 4, 5, 2, 9): (9, 5),
    ('InterleavedZeroBubble', 4, 5, 2, 10): (5, 5),
    ('InterleavedZeroBubble', 4, 5, 2, 12): (6, 5),
    ('InterleavedZeroBubble', 4, 5, 3, 4): (4, 4, 4),
    ('InterleavedZeroBubble', 4, 5, 3, 5): (5, 5, 5),
    ('InterleavedZeroBubble', 4, 5, 3, 6): (6, 6, 5),
    ('InterleavedZeroBubble', 4, 5, 3, 8): (8, 8, 5),
    ('InterleavedZeroBubble', 4, 5, 3, 9): (9, 9, 5),
    ('InterleavedZeroBubble', 4, 5, 3, 10): (5, 5, 5),
    ('InterleavedZeroBubble', 4, 5, 3, 12): (6, 6, 5),
    ('ZBVZeroBubble', 0, 2, 2, 4): (3, 1),
    ('ZBVZeroBubble', 0, 2, 2, 5): (3, 1),
    ('ZBVZeroBubble', 0, 2, 2, 6): (3, 1),
    ('ZBVZeroBubble', 0, 2, 2, 8): (3, 1),
    ('ZBVZeroBubble', 0, 2, 2, 9): (3, 1),
    ('ZBVZeroBubble', 0, 2, 2, 10): (3, 1),
    ('ZBVZeroBubble', 0, 2, 2, 12): (3, 1),
    ('ZBVZeroBubble', 0, 3, 2, 4): (4, 1),
    ('ZBVZeroBubble', 0, 3, 2, 5): (5, 1),
    ('ZBVZeroBubble', 0, 3, 2, 6): (5, 1),
    ('ZBVZeroBubble', 0, 3, 2, 8): (5, 1),
    ('ZBVZeroBubble', 0, 3, 2, 9): (5, 1),
    ('ZBVZeroBubble', 0, 3, 2, 10): (5, 1),
    ('ZBVZeroBubble', 0, 3, 2, 12): (5, 1),
    ('ZBVZeroBubble', 0, 4, 2, 4): (4, 1),
    ('ZBVZeroBubble', 0, 4, 2, 5): (5, 1),
    ('ZBVZeroBubble', 0, 4, 2, 6): (6, 1),
    ('ZBVZeroBubble', 0, 4, 2, 8): (7, 1),
    ('ZBVZeroBubble', 0, 4, 2, 9): (7, 1),
    ('ZBVZeroBubble', 0, 4, 2, 10): (7, 1),
    ('ZBVZeroBubble', 0, 4, 2, 12): (7, 1),
    ('ZBVZeroBubble', 0, 5, 2, 4): (4, 1),
    ('ZBVZeroBubble', 0, 5, 2, 5): (5, 1),
    ('ZBVZeroBubble', 0, 5, 2, 6): (6, 1),
    ('ZBVZeroBubble', 0, 5, 2, 8): (8, 1),
    ('ZBVZeroBubble', 0, 5, 2, 9): (9, 1),
    ('ZBVZeroBubble', 0, 5, 2, 10): (9, 1),
    ('ZBVZeroBubble', 0, 5, 2, 12): (9, 1),
    ('ZBVZeroBubble', 1, 2, 2, 4): (2, 2),
    ('ZBVZeroBubble', 1, 2, 2, 5): (2, 2),
    ('ZBVZeroBubble', 1, 2, 2, 6): (2, 2),
    ('ZBVZeroBubble', 1, 2, 2, 8): (2, 2),
    ('ZBVZeroBubble', 1, 2, 2, 9): (2, 2),
    ('ZBVZeroBubble', 1, 2, 2, 10): (2, 2),
    ('ZBVZeroBubble', 1, 2, 2, 12): (2, 2),
    ('ZBVZeroBubble', 1, 3, 2, 4): (4, 2),
    ('ZBVZeroBubble', 1, 3, 2, 5): (4, 2),
    ('ZBVZeroBubble', 1, 3, 2, 6): (4, 2),
    ('ZBVZeroBubble', 1, 3, 2, 8): (4, 2),
    ('ZBVZeroBubble', 1, 3, 2, 9): (4, 2),
    ('ZBVZeroBubble', 1, 3, 2, 10): (4, 2),
    ('ZBVZeroBubble', 1, 3, 2, 12): (4, 2),
    ('ZBVZeroBubble', 1, 4, 2, 4): (4, 2),
    ('ZBVZeroBubble', 1, 4, 2, 5): (5, 2),
    ('ZBVZeroBubble', 1, 4, 2, 6): (6, 2),
    ('ZBVZeroBubble', 1, 4, 2, 8): (6, 2),
    ('ZBVZeroBubble', 1, 4, 2, 9): (6, 2),
    ('ZBVZeroBubble', 1, 4, 2, 10): (6, 2),
    ('ZBVZeroBubble', 1, 4, 2, 12): (6, 2),
    ('ZBVZeroBubble', 1, 5, 2, 4): (4, 2),
    ('ZBVZeroBubble', 1, 5, 2, 5): (5, 2),
    ('ZBVZeroBubble', 1, 5, 2, 6): (6, 2),
    ('ZBVZeroBubble', 1, 5, 2, 8): (8, 2),
    ('ZBVZeroBubble', 1, 5, 2, 9): (8, 2),
    ('ZBVZeroBubble', 1, 5, 2, 10): (8, 2),
    ('ZBVZeroBubble', 1, 5, 2, 12): (8, 2),
    ('ZBVZeroBubble', 2, 3, 2, 4): (3, 3),
    ('ZBVZeroBubble', 2, 3, 2, 5): (3, 3),
    ('ZBVZeroBubble', 2, 3, 2, 6): (3, 3),
    ('ZBVZeroBubble', 2, 3, 2, 8): (3, 3),
    ('ZBVZeroBubble', 2, 3, 2, 9): (3, 3),
    ('ZBVZeroBubble', 2, 3, 2, 10): (3, 3),
    ('ZBVZeroBubble', 2, 3, 2, 12): (3, 3),
    ('ZBVZeroBubble', 2, 4, 2, 4): (4, 3),
    ('ZBVZeroBubble', 2, 4, 2, 5): (5, 3),
    ('ZBVZeroBubble', 2, 4, 2, 6): (5, 3),
    ('ZBVZeroBubble', 2, 4, 2, 8): (5, 3),
    ('ZBVZeroBubble', 2, 4, 2, 9): (5, 3),
    ('ZBVZeroBubble', 2, 4, 2, 10): (5, 3),
    ('ZBVZeroBubble', 2, 4, 2, 12): (5, 3),
    ('ZBVZeroBubble', 2, 5, 2, 4): (4, 3),
    ('ZBVZeroBubble', 2, 5, 2, 5): (5, 3),
    ('ZBVZeroBubble', 2, 5, 2, 6): (6, 3),
    ('ZBVZeroBubble', 2, 5, 2, 8): (7, 3),
    ('ZBVZeroBubble', 2, 5, 2, 9): (7, 3),
    ('ZBVZeroBubble', 2, 5, 2, 10): (7, 3),
    ('ZBVZeroBubble', 2, 5, 2, 12): (7, 3),
    ('ZBVZeroBubble', 3, 4, 2, 4): (4, 4),
    ('ZBVZeroBubble', 3, 4, 2, 5): (4, 4),
    ('ZBVZeroBubble', 3, 4, 2, 6): (4, 4),
    ('ZBVZeroBubble', 3, 4, 2, 8): (4, 4),
    ('ZBVZeroBubble', 3, 4, 2, 9): (4, 4),
    ('ZBVZeroBubble', 3, 4, 2, 10): (4, 4),
    ('ZBVZeroBubble', 3, 4, 2, 12): (4, 4),
    ('ZBVZeroBubble', 3, 5, 2, 4): (4, 4),
    ('ZBVZeroBubble', 3, 5, 2, 5): (5, 4),
    ('ZBVZeroBubble', 3, 5, 2, 6): (6, 4),
    ('ZBVZeroBubble', 3, 5, 2, 8): (6, 4),
    ('ZBVZeroBubble', 3, 5, 2, 9): (6, 4),
    ('ZBVZeroBubble', 3, 5, 2, 10): (6, 4),
    ('ZBVZeroBubble', 3, 5, 2, 12): (6, 4),
    ('ZBVZeroBubble', 4, 5, 2, 4): (4, 4),
    ('ZBVZeroBubble', 4, 5, 2, 5): (5, 5),
    ('ZBVZeroBubble', 4, 5, 2, 6): (5, 5),
    ('ZBVZeroBubble', 4, 5, 2, 8): (5, 5),
    ('ZBVZeroBubble', 4, 5, 2, 9): (5, 5),
    ('ZBVZeroBubble', 4, 5, 2, 10): (5, 5),
    ('ZBVZeroBubble', 4, 5, 2, 12): (5, 5),
}
# computed at the commit before engine.memory became a package, with its own replays
# (engine.memory._in_flight with unit bytes (1, 2, ...) per local stage)


def test_in_flight_from_action_lists_equals_the_old_replays():
    for (sc, r, p, v, m), counts in OLD_IN_FLIGHT.items():
        assert microbatches_in_flight(sc, r, p, v, m, tuple(range(1, v + 1))) == counts, (sc, r, p, v, m)


def test_in_flight_closed_forms():
    for p in (2, 3, 4):
        for m in (4, 8):
            assert [microbatches_in_flight("1F1B", r, p, 1, m) for r in range(p)] == [(min(m, p - r),)
                                                                                    for r in range(p)]
            assert microbatches_in_flight("GPipe", 1, p, 1, m) == (m,)
            assert microbatches_in_flight("LoopedBFS", 0, p, 2, m, [1, 1]) == (m, m)
    assert microbatches_in_flight("GPipe", 0, 1, 1, 8) == (1,)
    with pytest.raises(ValueError, match="allowed"):
        microbatches_in_flight("Nope", 0, 2, 1, 4)


def test_in_flight_agrees_with_the_memory_terms():
    for sc in SCHEDULES:
        v = 2 if sc in ("ZBVZeroBubble", "DualPipeV", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble") else 1
        if schedule_problems(sc, 2, 4, v):
            continue
        c = Config.from_dict({"model": {"preset": "tiny", "layers": 4}, "cluster": {"gpus": 2},
                              "parallel": {"pp": 2, "schedule": sc, "virtual_stages": v, "microbatches": 4}})
        for rank in memory_per_rank(c).per_rank:
            layer = [t for t in rank.explain("activations") if t.kind == "layers"]
            assert [t.stage for t in layer] == list(rank.stages)
            units = [t.bytes // t.in_flight if t.in_flight else 0 for t in layer]
            assert all(t.in_flight >= 0 for t in layer)
            if all(units):
                assert len(microbatches_in_flight(sc, rank.pp_rank, 2, v, 4, units)) == len(layer)


# ---------------------------------------------------------------- Term fields

UNTRACKED = {"runtime_context", "collective_buffers", "allocator_slack"}


@pytest.mark.parametrize("extra", [
    {"parallel": {"dp": 2, "zero": 3}},
    {"parallel": {"dp": 2, "pp": 2, "microbatches": 4}, "conventions": {"allocator_slack_fraction": 0.1}},
    {"parallel": {"tp": 2, "dp": 2, "sequence_parallel": True}, "training": {"precision": "bf16-mixed"}},
    {"parallel": {"dp": 2, "zero": 1}, "conventions": {"state_accounting": "zero-paper"}},
    {"parallel": {"dp": 2}, "training": {"finetune": "lora"}},
])
def test_every_term_says_its_category_and_trackability(extra):
    d = {"model": {"preset": "tiny"}, "cluster": {"preset": "dgx-h100"}}
    for k, v in extra.items():
        d[k] = v
    rep = memory_per_rank(Config.from_dict(d))
    seen_untracked = set()
    for rank in rep.per_rank:
        for c in MEMORY_CATEGORIES:
            for t in rank.explain(c):
                assert isinstance(t, Term) and t.category == c and t.kind
                assert t.tracked == (t.kind not in UNTRACKED), t
                if not t.tracked:
                    assert c == "overhead"
                    seen_untracked.add(t.kind)
                if t.in_flight is not None:
                    assert t.stage is not None or t.kind == "autocast_weight_casts"
                assert set(t.to_json()) == {"label", "bytes", "formula", "category", "tracked", "stage",
                                            "in_flight", "kind"}
    assert {"runtime_context", "collective_buffers"} <= seen_untracked


def test_a_term_filed_under_another_category_is_refused():
    from engine.memory.report import _Body

    terms = {c: [] for c in MEMORY_CATEGORIES}
    terms["params"].append(Term("x", 1, "1", "grads"))
    with pytest.raises(ValueError, match="sits in 'params'"):
        _Body(terms, (0,), 0)


def test_in_flight_states_for_many_virtual_stages_match_a_plain_replay():
    """Many local stages overflow the one-integer state key; the row path must agree with a replay."""
    from engine.pipeline.schedules import _frontier, in_flight_states, pipeline_actions

    for sc, p, v, m in (("Interleaved1F1B", 4, 16, 32), ("InterleavedZeroBubble", 2, 16, 16),
                        ("ZBVZeroBubble", 3, 2, 6)):
        plan = pipeline_actions(sc, p, m, v)
        for r in range(p):
            local = plan.stages_of_rank(r)
            held, states = [0] * len(local), set()
            for a in plan.per_rank[r]:
                if a.kind == "F":
                    held[local.index(a.stage)] += 1
                    states.add(tuple(held))
                elif a.kind in "BW":
                    held[local.index(a.stage)] -= 1
            assert in_flight_states(sc, r, p, v, m) == _frontier(states), (sc, r)
