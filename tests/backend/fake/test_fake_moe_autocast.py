"""A block with routed experts under autocast (fp32 parameters, bf16 compute), checked against ``measure --fake`` of
one rank (seconds): its attention half keeps the dense block's casts of the norm output but w3's (the experts' rows
hold their own), and the experts' backward peaks once the first expert's chain and the second's down projection
have run (``engine.memory.activations.moe_backward_terms``)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
@pytest.mark.parametrize("rank", [8, 56])
def test_experts_under_autocast_hold_what_the_fake_holds(tmp_path, rank):
    """Mixtral 8x7B (8 blocks) s4K b2 tp8 ep2 pp8 1F1B, four local experts a rank, no recompute: the engine read
    +3.4 % (stage 1, seven microbatches of a third norm-output cast) and +3.6 % (the last stage, where the backward
    had freed a quarter of one expert's weight casts where the fake has freed four of them; seed 20261234 #09)."""
    cfg = Config.from_dict({
        "model": {"preset": "mixtral-8x7b", "layers": 8, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 64, "gpus_per_node": 8},
        "parallel": {"tp": 8, "pp": 8, "ep": 2, "schedule": "1F1B", "microbatches": 8},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "none"}})
    rank_as_the_fake_holds_it(cfg, rank, tmp_path, rel=0.015)
