"""Context parallelism's ring attention under torchtitan's per-op policy: each cp step's flash call is an op of the
save list, so every step's output and log-sum-exp is saved, and the steps' query spans depend on the cp-rank
(``engine.memory.activations._Shape.ring_halves``): checked against ``measure --fake`` of the first and the last
cp-rank (seconds)."""

from __future__ import annotations

import pytest

from backend.fake import default_ranks
from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it

CFG = {
    "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 16384},
    "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 8},
    "parallel": {"dp": 1, "cp": 4},
    "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "selective-op"},
}


def test_the_fake_runs_the_first_and_the_last_cp_rank_where_they_differ():
    cfg = Config.from_dict(CFG)
    assert default_ranks(cfg) == [0, 3]
    plain = Config.from_dict({**CFG, "training": {**CFG["training"], "recompute": "none"}})
    assert default_ranks(plain) == [0]


@pytest.mark.integration
@pytest.mark.parametrize("rank", [0, 3])
def test_each_cp_rank_keeps_every_ring_steps_output(tmp_path, rank):
    """cp-rank 0 saves its step 0's output over every query and three over the tail half (2.5 × s·b·h a block),
    cp-rank 3 four whole ones (4 ×): the engine, one body per cp-rank, within 1 % of the fake on each."""
    r = rank_as_the_fake_holds_it(Config.from_dict(CFG), rank, tmp_path, rel=0.01)
    (ring,) = [t for t in r.explain("activations") if t.kind == "layers"]
    assert f"ρ = (cp + 1 + {rank})/2" in ring.formula
