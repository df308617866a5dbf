"""``benchmarks/fake_actions.py``: the per-action recording of one fake rank against the engine's moments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.fake_helpers import interleaved_zero3_always

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fake_actions  # noqa: E402

CFG = interleaved_zero3_always(layers=4, seq_len=1024, dp=2)


@pytest.mark.integration
def test_each_action_of_the_fake_is_recorded_in_the_schedules_order_and_explained():
    doc = fake_actions.record(CFG, 0)
    fake = fake_actions.fake_actions(doc)
    engine = fake_actions.engine_actions(CFG, 0)
    # the rank's actions, as the engine's schedule orders them: 4 microbatches × (F, B) on each of stages 0 and 2
    assert [key for key, _, _ in fake] == [key for key, _ in engine]
    assert sorted(key for key, _, _ in fake) == sorted((k, s, mb) for k in "BF" for s in (0, 2) for mb in range(4))
    # its peak is inside an action (the step's optimizer states are small beside four microbatches), and what is alive
    # there adds up to it, the op and module of every tensor the step made known
    most, at = max((m, i) for _, m, i in fake)
    assert most == pytest.approx(doc["max_allocated"], rel=1e-5)  # (the replay rounds each request to 512 B)
    alive = fake_actions.explain(doc, at, top=10**6)
    assert sum(nbytes for nbytes, _, _ in alive) == most
    made = [g for _, _, g in alive if g[0] != "before the step"]
    assert made and all(op for _, op, _, _ in made)
    assert {"UNSHARDED_PARAM", "ACT"} <= {ref for ref, _, _, _ in made}
    # and the engine's most over the actions is the fake's within the sweep's 3 % (per action it is not: at 1,024
    # tokens a stage's F peaks at its root's and first block's copy-outs, which the engine's F moments leave out)
    assert max(e for _, e in engine) == pytest.approx(most, rel=0.03)
