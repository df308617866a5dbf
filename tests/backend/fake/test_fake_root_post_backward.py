"""Unpipelined FSDP2 over several microbatches: the end of the last backward, before the root unit's post-backward
(``engine.memory.buffers._root_post_backward_after_accumulation``), checked against ``measure --fake`` of one rank
(seconds)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_the_last_backward_ends_with_the_root_still_to_reduce(tmp_path):
    """Llama 3 70B dp2 tp4 SP ZeRO-1 (FSDP2's replicate, a bf16 all-reduce) over two microbatches: the step peaks at
    the token embedding's fresh full V·h gradient, beside every block's fp32 gradients and bf16 all-reduce outputs,
    the root gathered with its accumulated gradients. The end laid the sharded gradients alone (seed 20261229
    #ba54a928, Llama 3 405B dp4: −11.3 %)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-70b", "layers": 4, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 8, "gpus_per_node": 8},
        "parallel": {"dp": 2, "tp": 4, "zero": 1, "sequence_parallel": True, "microbatches": 2},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "bf16",
                     "recompute": "selective-layer", "recompute_every": 4}})
    rank = rank_as_the_fake_holds_it(cfg, 0, tmp_path, rel=0.02)
    assert "end of the backward" in rank.peak_moment
    assert "fsdp_root_reduce_accumulated" in {t.kind for t in rank.explain("comm_buffers")}
