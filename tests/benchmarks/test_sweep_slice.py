"""A fixed-seed slice of the accuracy sweep (``benchmarks/accuracy.py --sweep``), run on real CPU
ranks: tiny models of random shapes in random layouts that no memory rule was fitted on. A rule
fitted on one layout that breaks a neighbour fails here, not in the next session's sweep.

Each drawn layout runs for real (torchrun, gloo, two steps and the measured step, as the sweep runs
them) and is compared with the engine as the sweep compares it: parameters, gradients and optimizer
states at their exact sizes on every rank, the tracked peak within 5 %. Activations are printed by the sweep, not
asserted here (their bounds are not met yet: see the README's "Layouts it was not fitted on").

Known misses are strict xfails that name the mechanism: when a fix makes one pass, the xfail fails
and is removed in the same commit.
"""

import json
import sys
from pathlib import Path

import pytest

from engine.compare.measured import compare, states_exact
from engine.predict import predict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from accuracy import sweep_layouts  # noqa: E402

pytestmark = pytest.mark.integration

SEED = 31
#: the first six layouts of seed 31; the slice runs four of them (about 40 s of CPU on this machine)
LAYOUTS = list(sweep_layouts(6, SEED).items())
#: (layout 0, MoE under ZeRO-3 without EP, was one until the backend wrapped the routed experts in their block's
#: FSDP unit as torchtitan does and as the engine lays them: it passes since)
KNOWN_MISSES: dict[int, str] = {}
SLICE = [0, 1, 2, 5]

TRACKED_PEAK = 0.05


def test_the_slice_is_what_the_sweep_draws():
    # the slice is the sweep's own draw, not layouts chosen for it: same names, same configs
    again = list(sweep_layouts(6, SEED).items())
    assert [n for n, _ in again] == [n for n, _ in LAYOUTS]
    assert [c.to_dict() for _, c in again] == [c.to_dict() for _, c in LAYOUTS]
    assert all(n.startswith(f"s{SEED}#") for n, _ in LAYOUTS)


@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xfail(reason=KNOWN_MISSES[i], strict=True))
                               if i in KNOWN_MISSES else i for i in SLICE])
def test_a_layout_no_rule_was_fitted_on(i, tmp_path):
    from backend.launch import launch

    name, cfg = LAYOUTS[i]
    run = launch(cfg, tmp_path / "run", steps=2, timeout_s=300)
    result = run.wait()
    assert run.ok, f"{name}: {result}"
    measured = json.loads((tmp_path / "run" / "measurement.json").read_text())
    pred = predict(cfg)
    cmp = compare(pred, measured)
    # the states at their exact sizes (whole: which of them a peak holds is the tracked peak's business)
    assert states_exact(pred, measured), f"{name}: " + "; ".join(
        f"rank {r.rank} {c} {r.categories[c]}" for r in cmp.memory for c in ("params", "grads", "optimizer")
        if r.categories[c].error)
    peak = cmp.summary()["allocated"]
    assert abs(peak) <= TRACKED_PEAK, f"{name}: tracked peak {peak:+.1%} (bound ±{TRACKED_PEAK:.0%})"
