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
