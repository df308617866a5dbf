"""Shared by the tests that hold one rank's prediction against ``measure --fake`` (tests/backend/fake)."""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine.config import Config
from engine.predict import predict


def rank_as_the_fake_holds_it(cfg: Config, rank: int, tmp_path, rel: float):
    """``cfg``'s predicted rank ``rank``, once its allocated bytes are within ``rel`` of the fake run's (seconds)."""
    r = next(x for x in predict(cfg).memory.per_rank if x.rank == rank)
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[rank], timeout_s=300)
    (row,) = reserved_rows(res)
    assert r.allocated == pytest.approx(row["max_allocated"], rel=rel)
    return r


def interleaved_zero3_always(layers: int, seq_len: int, dp: int) -> Config:
    """Llama 3 8B cut to ``layers`` blocks, dp × pp2 Interleaved1F1B v2 m4, ZeRO-3 resharding after every forward:
    every rank holds two stages (``engine.memory.lifetimes._kept_since_backward``)."""
    return Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": layers, "seq_len": seq_len},
        "cluster": {"gpu": "h100-96g", "gpus": 2 * dp, "gpus_per_node": 2 * dp},
        "parallel": {"dp": dp, "pp": 2, "zero": 3, "fsdp_reshard_after_forward": "always",
                     "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 4},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "recompute": "none"}})
