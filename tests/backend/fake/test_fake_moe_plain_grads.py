"""A mixture of experts with plain gradients (DDP, ZeRO-1) in an unpipelined step of one microbatch, in the engine
against ``measure --fake`` of one rank (seconds): no ``.grad`` exists while the backward runs, so the experts' input
buffers (the sums of their select_backward outputs) are temporaries of their own beside the fresh ones, and the B's
moment holds the gradients autograd made before it — the head's and final norm's
(``engine.memory.activations._expert_buffers_held``, ``engine.memory.buffers._plain_early_backward``); the late
moment (layer 0's backward) holds the experts' buffers only where layer 0 has experts
(``engine.memory.lifetimes.lifetime_overrides``' ``moe_late_dense``)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


def _mixtral(dense_layers: int) -> Config:
    return Config.from_dict({
        "model": {"preset": "mixtral-8x7b", "layers": 2, "seq_len": 512, "dense_layers": dense_layers},
        "cluster": {"gpu": "h100-96g", "gpus": 8, "gpus_per_node": 8},
        "parallel": {"dp": 8, "zero": 1},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "recompute": "none"}})


@pytest.mark.integration
def test_the_experts_buffers_and_the_heads_gradient_at_the_b_moment(tmp_path):
    """Layer 0 dense, layer 1 with experts: the peak is in layer 1's experts, beside the head's 0.49 GiB fp32 gradient
    and w1's, w2's, w3's 1.75 GiB fp32 sums with two fresh select_backward outputs. The session-start engine read
    −13.9 % (two buffers, no gradient: the optimizer step its peak)."""
    r = rank_as_the_fake_holds_it(_mixtral(1), 0, tmp_path, rel=0.005)
    assert r.peak_moment.startswith("stage 0 B of microbatch 0")
    assert "plain_early_grads" in {t.kind for t in r.explain("grads")}


@pytest.mark.integration
def test_the_experts_buffers_at_the_late_moment_where_layer_0_has_experts(tmp_path):
    """Both blocks with experts: the late moment (layer 0's backward, layer 1's gradients made) holds layer 0's
    buffers; the session-start engine read −11.4 %."""
    r = rank_as_the_fake_holds_it(_mixtral(0), 0, tmp_path, rel=0.005)
    assert r.peak_moment.startswith("late in stage 0 B")
