"""FSDP2's replicate ignores the routed experts: their gradients are autograd's plain ones, made block by block as
the one backward walks the blocks, beside FSDP2's own units reduced unit by unit
(``engine.memory.buffers._unit_by_unit_reduce``): checked against ``measure --fake`` of one rank (seconds)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_layer_0s_recompute_meets_every_later_blocks_expert_gradients(tmp_path):
    """Mixtral 8x7B (8 blocks) s16K dp8 tp2 ep8 replicate, full recompute, one microbatch: the step peaks in layer 0's
    backward, its recompute beside seven blocks' fp32 expert gradients (3 × 224 MiB a block). The engine, which laid
    them at the end of the backward only, read −8.3 % (seed 20261228 #723aa7aa, dp16)."""
    cfg = Config.from_dict({
        "model": {"preset": "mixtral-8x7b", "layers": 8, "seq_len": 16384},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 8, "tp": 2, "ep": 8, "zero": 0},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "bf16", "recompute": "full"}})
    rank = rank_as_the_fake_holds_it(cfg, 0, tmp_path, rel=0.02)
    assert rank.peak_moment.startswith("late in")
    assert "plain_late_grads" in {t.kind for t in rank.explain("grads")}
