"""ZeRO-3 resharding after every forward on a rank of several pipeline stages: each stage's units are kept gathered
from its backward to its next forward or its REDUCE_GRAD, and its own forward gathers its root and current block
(``engine.memory.lifetimes._kept_since_backward``, ``engine.memory.buffers._stage_by_stage_units``): checked
against ``measure --fake`` (seconds)."""

from __future__ import annotations

import pytest

from tests.fake_helpers import interleaved_zero3_always, rank_as_the_fake_holds_it

CFG = interleaved_zero3_always(layers=8, seq_len=4096, dp=4)


@pytest.mark.integration
def test_a_stages_forward_finds_the_other_stages_units_kept_since_its_backward(tmp_path):
    """Rank 0 (stages 0 and 2, two blocks each) peaks in stage 2's last F: stage 0's every unit kept gathered since
    its B just before, stage 2's root and last block and one block's all-gather output. The engine held every
    stage's units from the rank's first backward on, and the rank's two largest units (the embeddings and a block)
    as its current ones: +7.0 %."""
    rank = rank_as_the_fake_holds_it(CFG, 0, tmp_path, rel=0.01)
    assert rank.peak_moment.startswith("stage 2 F of microbatch 3")
    held = {(t.kind, t.stage) for t in rank.explain("comm_buffers") if t.bytes > 0}
    assert {("fsdp_stage_kept_params", 0), ("fsdp_stage_current_params", 2),
            ("fsdp_stage_forward_all_gather_output", 2)} <= held
    assert ("fsdp_stage_kept_params", 2) not in held and ("fsdp_stage_current_params", 0) not in held
