"""A pipelined stage's first backward with plain gradients (DDP), in the engine against ``measure --fake`` of one rank
(seconds): the B walks its blocks making each one's ``.grad`` as it goes while every microbatch of GPipe's forwards
is still alive, so under full recompute (a block keeps only its input) the walk holds the most at the stage's first
block — the late-backward moment of the rank's first B (``engine.memory.lifetimes._with_first_late_moment``,
``engine.memory.buffers._plain_late_backward``)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_the_first_backward_peaks_late_in_its_walk(tmp_path):
    """Llama 2 7B, 4 blocks, dp2 pp2 GPipe m8 DDP fp32 full recompute, last stage: its first B late in its walk,
    eight microbatches' stage outputs beside a block's and the head's gradients. The session-start engine peaked at a
    later B's loss moment, −1.9 %; the golden corpus's entry 16 (32 blocks, pp8) −2.9 → −0.3 % with this moment."""
    cfg = Config.from_dict({
        "model": {"preset": "llama2-7b", "layers": 4, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
        "parallel": {"dp": 2, "pp": 2, "zero": 0, "schedule": "GPipe", "microbatches": 8},
        "training": {"micro_batch_size": 1, "precision": "fp32", "recompute": "full"}})
    r = rank_as_the_fake_holds_it(cfg, 2, tmp_path, rel=0.012)
    assert r.peak_moment.startswith("late in stage 1 B of microbatch 0")
    assert "plain_late_grads" in {t.kind for t in r.explain("grads")}
