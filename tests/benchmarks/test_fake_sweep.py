"""benchmarks/fake_sweep.py: random full-size layouts against measure --fake (no fake run is launched here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine import Config, default_config
from engine.backend_limits import predict_only
from engine.model.presets import model_presets
from engine.names import RECOMPUTE_KINDS, SCHEDULES
from engine.predict import predict

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("fake_sweep", ROOT / "benchmarks" / "fake_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def forty(sweep):
    return sweep.draw_layouts(40, 0, max_layers=16)


def _texts(layouts: dict[str, Config]) -> list[tuple[str, str]]:
    return [(name, cfg.dumps_toml()) for name, cfg in layouts.items()]


def test_draws_are_deterministic_per_seed_and_differ_across_seeds(sweep):
    a = sweep.draw_layouts(6, 3, max_layers=8)
    assert _texts(a) == _texts(sweep.draw_layouts(6, 3, max_layers=8))
    assert _texts(a) != _texts(sweep.draw_layouts(6, 4, max_layers=8))
    assert len(a) == 6


def test_every_draw_is_distinct_valid_runnable_and_fits(sweep, forty):
    assert len(forty) == 40
    assert len({sweep.config_hash(c) for c in forty.values()}) == 40
    for name, cfg in forty.items():
        again = Config.from_dict(cfg.to_dict())  # validates again, from what a fake run reads back
        assert sweep.config_hash(again) == sweep.config_hash(cfg), name
        assert predict_only(cfg) == [], name
        assert sweep.refusal(cfg) is None, name
        assert cfg.cluster.gpu.name == "h100-96g"


def test_the_parallel_draw_reaches_every_schedule_and_stage_count(sweep):
    import random

    rng = random.Random(0)
    draws = [sweep._draw_parallel(rng, moe=False) for _ in range(500)]
    pipelined = [p for p in draws if p["pp"] > 1]
    assert {p["schedule"] for p in pipelined} == set(SCHEDULES)
    assert {p["virtual_stages"] for p in pipelined} == {1, 2, 3, 4}


def test_forty_draws_cover_the_space(forty):
    """What is kept (valid, runnable, fits: the engine's say, so which draws survive moves with it)
    still spans the space; every schedule is reached by the draw itself (the test above)."""
    cfgs = list(forty.values())
    pipelined = [c for c in cfgs if c.parallel.pp > 1]
    assert len({c.parallel.schedule for c in pipelined}) >= len(SCHEDULES) - 2
    assert {c.parallel.zero for c in cfgs} == {0, 1, 2, 3}
    assert {c.training.recompute for c in cfgs} == set(RECOMPUTE_KINDS)
    assert {c.parallel.virtual_stages for c in pipelined} >= {1, 2, 3}
    assert any(c.model.experts and c.parallel.ep > 1 for c in cfgs)
    assert any(not c.model.experts for c in cfgs)
    for knob in (lambda c: c.parallel.replicate > 1, lambda c: c.parallel.cp > 1, lambda c: c.parallel.tp > 1,
                 lambda c: c.training.float8 != "none", lambda c: c.training.compile, lambda c: c.training.lora):
        assert any(knob(c) for c in cfgs)
    assert {c.model.preset for c in cfgs} >= {"llama3-405b", "qwen3-235b-a22b", "llama3-8b", "mixtral-8x7b"}


def test_max_layers_is_respected_and_full_size_keeps_the_presets(sweep, forty):
    for name, cfg in forty.items():
        preset = model_presets()[cfg.model.preset]["layers"]
        assert cfg.model.layers <= 16, name
        if preset > 16:  # cut: a multiple of the stages, full width kept
            assert cfg.model.layers % cfg.parallel.num_stages == 0, name
            assert cfg.model.hidden == model_presets()[cfg.model.preset]["hidden"]
        assert f" L{cfg.model.layers} " in name
    for cfg in sweep.draw_layouts(4, 0).values():
        assert cfg.model.layers == model_presets()[cfg.model.preset]["layers"]


def _rows_of(rank: int, stage: int, allocated: tuple, reserved: tuple, **categories) -> dict:
    """One row as ``fake_vs_engine.rows_of`` gives it (GiB in, bytes out)."""
    cats = {c: (0, 0) for c in ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries",
                                "overhead")}
    cats.update({c: (int(e * GIB), int(f * GIB)) for c, (e, f) in categories.items()})
    return {"rank": rank, "stage": stage, "peak_moment": "somewhere",
            "categories": cats, "allocated": tuple(int(x * GIB) for x in allocated),
            "reserved": tuple(int(x * GIB) for x in reserved)}


def test_rows_are_ranked_worst_first_and_counted_against_the_bounds(sweep):
    doc = {"reserved": [{"rank": 0, "oom": None}, {"rank": 8, "oom": "CUDA out of memory"}]}
    rows = sweep.flat_rows("A", "h1", [
        _rows_of(0, 0, (10.2, 10.0), (12.0, 12.3), activations=(5.0, 4.9), overhead=(3.0, 0.0)),  # +2 %, -2.4 %
        _rows_of(8, 1, (10.0, 10.0), (11.0, 10.0), temporaries=(2.0, 1.0)),  # reserved +10 %, a category +100 %
    ], doc)
    rows += sweep.flat_rows("B", "h2", [_rows_of(0, 0, (9.0, 10.0), (10.0, 10.0), activations=(0.5, 0.9))], {})
    rows.append({"layout": "C", "hash": "h3", "failed": "failed: RuntimeError: boom"})
    ranked = sweep.rank_rows(rows)
    assert [(r["layout"], r.get("rank")) for r in ranked] == [("C", None), ("A", 8), ("B", 0), ("A", 0)]
    a0 = ranked[-1]
    assert a0["allocated_error"] == pytest.approx(0.02, abs=1e-6)
    assert a0["within"] == {"allocated": True, "reserved": True, "categories": True}
    assert a0["worst_category"] == "activations"  # overhead: no fake run has it, never judged
    assert ranked[1]["worst_category"] == "temporaries" and ranked[1]["oom"]
    assert ranked[1]["within"] == {"allocated": True, "reserved": False, "categories": False}
    assert ranked[2]["worst_category"] is None  # under 1 GiB on both sides
    assert ranked[2]["within"]["allocated"] is False  # -10 %
    s = sweep.summary(ranked)
    assert (s["layouts"], s["ranks"], s["failed_layouts"]) == (3, 3, 1)
    assert (s["allocated_within"], s["reserved_within"], s["categories_within"]) == (2, 2, 2)
    assert sweep.summary_line(s).startswith(
        "3 layouts, 3 simulated ranks: allocated within 3 % on 2/3, reserved within 5 % on 2/3, "
        "categories >1 GiB within 5 % on 2/3")
    table = sweep.render(ranked)
    assert table.splitlines()[1].startswith("C ") and "failed: RuntimeError: boom" in table
    assert "fake OOM" in table and "∞" not in table
    assert sweep.render_markdown(ranked).count("\n") == len(ranked) + 1


def test_rows_from_a_document_shaped_like_measure_fake(sweep):
    """A hand-made --json document around the engine's own tiny prediction: the real rows_of path."""
    cfg = default_config().replace(cluster={"gpus": 4}, parallel={"dp": 2, "pp": 2, "schedule": "1F1B",
                                                                  "microbatches": 2})
    pred = {r.rank: r for r in predict(cfg).memory.per_rank}
    doc = {"simulated_ranks": [0, 2], "memory": {"per_rank": []}, "reserved": []}
    for rank, scale in ((0, 1.0), (2, 1.25)):  # rank 2's fake peak is 25 % above the engine's
        p = pred[rank]
        doc["memory"]["per_rank"].append({"rank": rank, "stage": rank // 2, **{c: int(getattr(p, c))
                                          for c in ("params", "grads", "optimizer", "activations",
                                                    "comm_buffers", "temporaries")}})
        doc["reserved"].append({"rank": rank, "max_allocated": int(p.allocated * scale),
                                "max_reserved": int(p.reserved), "oom": None})
    rows = sweep.rank_rows(sweep.flat_rows("tiny", "k", sweep.rows_of(cfg, doc), doc))
    assert [r["rank"] for r in rows] == [2, 0]
    assert rows[0]["allocated_error"] == pytest.approx(1 / 1.25 - 1, abs=1e-6)
    assert rows[1]["allocated_error"] == 0 and rows[1]["reserved_error"] == 0
    assert sweep.summary(rows)["allocated_within"] == 1


def test_the_cache_is_keyed_by_the_config_and_failures_are_rows(sweep, tmp_path, monkeypatch):
    cfg = next(iter(sweep.draw_layouts(1, 5, max_layers=4).values()))
    key = sweep.config_hash(cfg)
    assert key != sweep.config_hash(cfg, expandable=True)
    assert key == sweep.config_hash(Config.loads_toml(cfg.dumps_toml()))
    calls = []

    def failing(config, out, timeout_s, reuse, expandable):
        calls.append(Path(config))
        assert Config.load(config) == cfg and out == tmp_path / key
        raise SystemExit(f"{config}: measure --fake failed (exit 1):\nshardscope: simulation failed: x\n"
                         "Traceback ...\nValueError: the last line\n\n")

    monkeypatch.setattr(sweep, "simulate", failing)
    assert sweep.run_layout(cfg, tmp_path, 60, False, False, False) == (None, "failed: ValueError: the last line", False)
    assert sweep.run_layout(cfg, tmp_path, 60, False, False, False)[1:] == ("failed: ValueError: the last line", True)
    assert len(calls) == 1
    (tmp_path / key).mkdir(exist_ok=True)
    (tmp_path / key / "events.jsonl").write_text("{}\n")  # a taken run directory is cleared before a retry
    monkeypatch.setattr(sweep, "simulate", lambda config, out, *a, **k: {"simulated_ranks": [], "x": out.name})
    doc, why, cached = sweep.run_layout(cfg, tmp_path, 60, False, True, False)
    assert (doc, why, cached) == ({"simulated_ranks": [], "x": key}, None, False)
    assert not (tmp_path / key).exists() and not (tmp_path / f"{key}.failed.json").exists()
    (tmp_path / f"{key}.json").write_text(json.dumps({"cached": True}))
    assert sweep.run_layout(cfg, tmp_path, 60, False, False, False) == ({"cached": True}, None, True)


def test_list_prints_the_draws_and_their_keys(sweep, capsys):
    assert sweep.main(["--n", "3", "--seed", "2", "--max-layers", "4", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(x.split("  ", 1)[0]) == 16 for x in lines)
    assert [x.split("  ", 1)[1] for x in lines] == list(sweep.draw_layouts(3, 2, max_layers=4))
