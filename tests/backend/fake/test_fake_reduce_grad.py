"""A pipelined FSDP2 rank of one stage at the schedule's REDUCE_GRAD, in the engine, against ``measure --fake`` of one
rank (seconds): after the stage's last backward each unit's post-backward reshards it and reduce-scatters its
accumulated gradient — the root's first — while every other unit's accumulated gradient and gathered parameters are
still there (``engine.memory.buffers._reduce_grad``, the REDUCE_GRAD moment of ``engine.memory.lifetimes``)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_the_reduce_grad_holds_the_roots_reduce_scatter_beside_every_accumulated_gradient(tmp_path):
    """Llama 3 8B (4 blocks) dp2 pp2 1F1B ZeRO-3, fp32 reduce, 2,048 tokens, rank 0 (the embeddings' stage): its peak
    is the REDUCE_GRAD, the token embeddings' 2,004 MiB reduce-scatter input and 250.5 MiB output beside 3.3 GiB of
    accumulated gradients, where the engine had none and read −7.3 % (11.83 GiB against 12.77); now exact."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": 4, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
        "parallel": {"dp": 2, "pp": 2, "zero": 3, "schedule": "1F1B", "microbatches": 4},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "fp32", "recompute": "full"}})
    r = rank_as_the_fake_holds_it(cfg, 0, tmp_path, rel=0.005)
    assert r.peak_moment.startswith("the schedule's REDUCE_GRAD")
    assert "fsdp_reduce_grad" in [t.kind for t in r.explain("comm_buffers")]
