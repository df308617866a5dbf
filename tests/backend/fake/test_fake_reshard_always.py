"""Pipelined ZeRO-3 resharding after every forward (``parallel.fsdp_reshard_after_forward = "always"``), one block a
stage: a backward regathers its units at its start with no next block to prefetch, and the last stage's forward
reshards what the backward before it kept gathered (``engine.memory.lifetimes.lifetime_overrides``,
``engine.memory.buffers._every_unit_gathered``): checked against ``measure --fake`` (seconds)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it

CFG = Config.from_dict({
    "model": {"preset": "llama3-8b", "layers": 4, "seq_len": 4096},
    "cluster": {"gpu": "h100-96g", "gpus": 8, "gpus_per_node": 8},
    "parallel": {"dp": 2, "pp": 4, "zero": 3, "fsdp_reshard_after_forward": "always", "schedule": "1F1B",
                 "microbatches": 8},
    "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "selective-op"}})


@pytest.mark.integration
def test_a_one_block_stage_holds_no_all_gather_output_in_its_backward(tmp_path):
    """Stage 0 peaks in a later B: its block and root regathered, their all-gather output freed by the copy-out
    before the block's backward runs (the engine laid the largest unit's output there: +8.9 %)."""
    rank = rank_as_the_fake_holds_it(CFG, 0, tmp_path, rel=0.01)
    assert " B of microbatch" in rank.peak_moment
    assert "all_gather_output" not in {t.kind for t in rank.explain("comm_buffers")}


@pytest.mark.integration
def test_the_last_stages_loss_follows_a_forward_that_resharded_its_units(tmp_path):
    """The last stage peaks at a later microbatch's loss, right after its forward resharded every unit the backward
    before had kept gathered (the engine laid them all there: +7.1 %): no unit is gathered at that loss (the units a
    backward keeps live only to the stage's next forward, ``after_a_backward``)."""
    rank = rank_as_the_fake_holds_it(CFG, 6, tmp_path, rel=0.01)
    assert rank.peak_moment.endswith("the loss (action 4 of 16)")
    kinds = {t.kind for t in rank.explain("comm_buffers")}
    assert not kinds & {"fsdp_unsharded_params", "fsdp_units_kept_after_backward", "fsdp_units_kept_in_a_backward"}
