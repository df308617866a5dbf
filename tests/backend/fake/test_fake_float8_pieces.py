"""Eager float8's casts are tensors of their own, none larger than a cast's fp32 copy (torchao 0.18's
``hp_tensor_to_float8_dynamic``: ``.to(float32)``, ``* scale``, the clamp, the float8 result), so the allocation
events lay a forward's and a B's float8 terms in pieces of that size (``Terms.float8_piece`` → ``Grain.f8_piece``),
not as one request the caching allocator must find a segment for; checked against ``measure --fake`` of one rank."""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine.config import Config
from engine.predict import predict


@pytest.mark.integration
def test_float8_casts_reserve_what_their_tensors_do(tmp_path):
    """Llama 3 405B cut to 8 blocks, s32K tp8 SP pp8 1F1B tensorwise float8 (fake seed 20261276 #23 at m8), the last
    stage: its first block's MLP backward under float8 (6.4 GiB of casts and gradients, each at most 2 GiB: the fp32
    copy of 32,768 × 16,384 tokens) laid as one request made the replay reserve a fresh segment for it, twice
    (reserved +22.5 % at m32); in pieces, as the fake's tensors are, within 5 %."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-405b", "layers": 8, "seq_len": 32768},
        "cluster": {"gpu": "h100-96g", "gpus": 512, "gpus_per_node": 8},
        "parallel": {"dp": 8, "tp": 8, "sequence_parallel": True, "pp": 8, "schedule": "1F1B", "microbatches": 8},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "fp32", "recompute": "none",
                     "float8": "tensorwise"}})
    r = next(x for x in predict(cfg).memory.per_rank if x.rank == 448)  # its peak is a loss; the casts come after
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[448], timeout_s=300)
    (row,) = reserved_rows(res)
    assert r.allocated == pytest.approx(row["max_allocated"], rel=0.01)
    assert r.reserved == pytest.approx(row["max_reserved"], rel=0.05)
