"""predict(): one object, the JSON contract of `shardscope predict --json`, and the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from assets import PRESETS_DIR
from engine import Config, default_config
from engine.names import MEMORY_CATEGORIES
from engine.predict import predict
from gui.text import prediction_table

ROOT = Path(__file__).resolve().parents[2]


def big():
    return Config.from_dict({
        "model": {"preset": "llama3-70b"}, "cluster": {"preset": "h100-pod-64"},
        "parallel": {"tp": 8, "pp": 4, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 8,
                     "zero": 1, "sequence_parallel": True},
    })


@pytest.mark.parametrize("cfg", [default_config(), big()], ids=["default", "llama3-70b-3d"])
def test_json_contract(cfg):
    data = predict(cfg).to_json()
    json.dumps(data)  # plain JSON
    mem = data["memory"]
    assert len(mem["per_rank"]) == cfg.parallel.world_size
    assert [r["rank"] for r in mem["per_rank"]] == list(range(cfg.parallel.world_size))
    for row in mem["per_rank"]:
        assert {"rank", "stage", "total", *MEMORY_CATEGORIES} <= set(row)
        assert row["total"] == sum(row[c] for c in MEMORY_CATEGORIES)
    assert mem["capacity_bytes"] == cfg.cluster.gpu.memory_bytes
    pipe = data["pipeline"]
    assert {"schedule", "makespan_s", "bubble_fraction", "per_rank"} <= set(pipe)
    assert len(pipe["per_rank"]) == cfg.parallel.pp
    for r in pipe["per_rank"]:
        assert {"rank", "busy_s", "idle_s", "actions"} <= set(r)
        for kind, stage, mb, start, end in r["actions"]:
            assert stage >= 0 and mb >= 0
            assert kind in "FBIW" and 0 <= start <= end <= pipe["makespan_s"] + 1e-12
    step = data["step"]
    assert step["seconds"] == pytest.approx(sum(step["breakdown"].values()))
    assert data["conventions"]["bubble"]


def test_explain_terms_sum_to_each_category():
    data = predict(big()).to_json(explain=True)
    row = data["memory"]["per_rank"][0]
    for c in MEMORY_CATEGORIES:
        assert sum(t["bytes"] for t in row["explain"][c]) == row[c]
        assert all(t["formula"] for t in row["explain"][c])


def test_table_lists_every_distinct_rank_group():
    text = prediction_table(predict(big()))
    # stages 0 and 3: the two dp-ranks' ZeroRedundancyOptimizer shares differ (TensorParallelZeRO1 over each
    # TP shard's tensors), so each is its own group; stages 1 and 2 share equally
    for label in ("0-7", "8-15", "16-31", "32-47", "48-55", "56-63", "MFU", "bubble"):
        assert label in text


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gui.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_predict_json_and_table(tmp_path):
    out = cli("predict", str(PRESETS_DIR / "default.toml"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["memory"]["per_rank"]) == 4
    out = cli("predict", str(PRESETS_DIR / "default.toml"))
    assert out.returncode == 0 and "memory per rank" in out.stdout and "step:" in out.stdout


def test_cli_predict_invalid_config_never_reaches_the_formulas(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[model]\npreset = "tiny"\n[cluster]\ngpus = 4\n[parallel]\npp = 4\nschedule = "DualPipeV"\n'
                 'virtual_stages = 2\nmicrobatches = 4\n')
    out = cli("predict", str(f), "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert "parallel.microbatches" in out.stderr and "DualPipeV" in out.stderr
