"""The optimizer step's tensors in the allocator replay, checked against ``measure --fake`` of one rank (seconds):
AdamW's multi-tensor step makes the square root of every second moment, one tensor per parameter, after the
backward has freed the activations; where the cache the backward left has no block for one, the reserve grows
(``engine.memory.lifetimes._Laying._optimizer_step``)."""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine.config import Config
from engine.predict import predict


@pytest.mark.integration
def test_the_step_grows_the_reserve_as_the_fake_does(tmp_path):
    """GPT-2 (6 blocks) s2K dp16 pp2 InterleavedZeroBubble v3, tensorwise float8, no recompute: without the step's
    tensors the replay reserved −5.6 % of the fake's (seed 20261226, rank 0); with them +1.9 %."""
    cfg = Config.from_dict({
        "model": {"preset": "gpt2-124m", "layers": 6, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
        "parallel": {"dp": 16, "pp": 2, "schedule": "InterleavedZeroBubble", "virtual_stages": 3, "microbatches": 4},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "recompute": "none", "float8": "tensorwise"}})
    r = next(x for x in predict(cfg).memory.per_rank if x.rank == 0)
    (row,) = reserved_rows(simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300))
    assert r.allocated == pytest.approx(row["max_allocated"], rel=0.03)
    assert r.reserved == pytest.approx(row["max_reserved"], rel=0.04)
