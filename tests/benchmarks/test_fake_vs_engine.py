"""benchmarks/fake_vs_engine.py: the engine's peak beside measure --fake's, per simulated rank."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine import default_config
from engine.predict import predict

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("fake_vs_engine", ROOT / "benchmarks" / "fake_vs_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_error_is_relative_to_the_simulated_peak():
    bench = _bench()
    assert bench.error(105, 100) == pytest.approx(0.05)
    assert bench.error(69, 100) == pytest.approx(-0.31)
    assert bench.error(0, 0) == 0.0


@pytest.mark.integration
def test_rows_put_the_engine_beside_the_simulated_ranks(tmp_path, capsys):
    pytest.importorskip("torch")
    bench = _bench()
    cfg = default_config().replace(cluster={"gpus": 4}, parallel={"dp": 2, "tp": 1, "pp": 2, "zero": 3,
                                                                  "schedule": "1F1B", "microbatches": 2})
    path = tmp_path / "tiny-pp2.toml"
    cfg.save(path)
    assert bench.main([str(path), "--out", str(tmp_path / "runs"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["tiny-pp2"]
    pred = {r.rank: r for r in predict(cfg).memory.per_rank}
    assert [r["rank"] for r in rows] == [0, 2]  # one rank per stage
    doc = json.loads((tmp_path / "runs" / "tiny-pp2.json").read_text())
    sim = {r["rank"]: r for r in doc["reserved"]}
    for r in rows:
        assert r["allocated"] == [pred[r["rank"]].allocated, sim[r["rank"]]["max_allocated"]]
        assert r["reserved"] == [pred[r["rank"]].reserved, sim[r["rank"]]["max_reserved"]]
        assert r["categories"]["params"][0] == pred[r["rank"]].params == r["categories"]["params"][1]
    # --reuse reads the cached document instead of simulating again
    (tmp_path / "runs" / "tiny-pp2").rename(tmp_path / "moved")
    assert bench.main([str(path), "--out", str(tmp_path / "runs"), "--reuse"]) == 0
    text = capsys.readouterr().out
    assert "rank 2 (stage 1" in text and "allocated" in text and "reserved" in text
