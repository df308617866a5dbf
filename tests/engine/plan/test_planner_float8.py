"""The planner's float8 and torch.compile axes: timed as engine.time.step times them, ranked as predict ranks."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_planner import _first_fitting, _Row

from engine import Config
from engine.memory import memory_per_rank
from engine.plan.grid import _Planner
from engine.plan.results import PlanError, layout_config
from engine.plan.search import _base_config, default_float8_kinds, plan, plan_config
from engine.plan.space import _key
from engine.predict import predict
from engine.time.step import step_time

ROOT = Path(__file__).resolve().parents[3]

# a grid small enough to evaluate every layout: 7B on 4 H100s, every float8 kind, compile on and off
CASE = dict(model="llama2-7b", gpus=4, gpu="h100-sxm", gpus_per_node=4, global_batch=8, max_virtual_stages=2,
            zero=(0, 3), schedules=("1F1B", "Interleaved1F1B"),
            recompute=("none", "full", "selective-op", "selective-layer"))


@pytest.fixture(scope="module")
def brute():
    base = _base_config(CASE["model"], CASE["gpus"], CASE["gpu"], CASE["gpus_per_node"], None, None)
    pl = _Planner(base, CASE["global_batch"], CASE["zero"], CASE["schedules"], CASE["recompute"],
                  CASE["max_virtual_stages"], None, float8=default_float8_kinds(base), compile=(False, True))
    g = pl.grid()
    rows = []
    for i in range(len(g.mem_lb)):
        cfg = pl.config(g, i)
        mem = memory_per_rank(cfg)
        st = step_time(cfg)
        if i % 16 == 0:  # the simulated bound is the step's own makespan (test_planner._brute_force)
            assert pl.makespan(cfg) == st.timeline.makespan_s, cfg
        rows.append(_Row(cfg=cfg, key=_key(g, i), mem=mem, peak=mem.peak.total, seconds=st.seconds,
                         mem_lb=g.mem_lb[i], bound0=g.makespan_lb[i] + g.rest_lb[i],
                         bound1=st.timeline.makespan_s + g.rest_lb[i]))
    return rows


def test_the_grid_holds_every_float8_kind_and_compile_setting(brute):
    kinds = {(r["cfg"].training.float8, r["cfg"].training.compile) for r in brute}
    assert kinds == {(k, c) for k in ("none", "tensorwise", "rowwise") for c in (False, True)}


def test_bounds_never_exceed_the_engine_under_float8_and_compile(brute):
    for r in brute:
        assert r["mem_lb"] <= r["peak"] * (1 + 1e-9), r["cfg"].training
        assert r["bound0"] <= r["seconds"] * (1 + 1e-9), r["cfg"].training
        assert r["bound1"] <= r["seconds"] * (1 + 1e-9), r["cfg"].training
    # the simulated bound is float8 / compile's step up to the DP / optimizer maximum, not bf16's
    on = [r for r in brute if r["cfg"].training.float8 != "none" or r["cfg"].training.compile]
    assert sum(r["bound1"] >= 0.98 * r["seconds"] for r in on) > 0.9 * len(on)


@pytest.mark.parametrize("top", [1, 9])
def test_ranking_equals_predict_over_every_layout(brute, top):
    expected = _first_fitting(brute, top)
    result = plan(**CASE, top=top)
    assert [e.config for e in result.entries] == [r["cfg"] for r in expected]
    assert result.counts.enumerated == len(brute)
    assert result.counts.rejected_by_validation == 0
    for e in result.entries:  # the ranked numbers are predict's
        assert predict(e.config).step.seconds == e.seconds
    assert result.best.config.training.float8 != "none" and result.best.config.training.compile


def test_float8_is_searched_only_where_the_gpu_has_float8_tensor_cores():
    a100 = plan("llama2-7b", 8, "a100-80g", 8, top=3, global_batch=8, max_virtual_stages=2)
    assert {e.config.training.float8 for e in a100.entries} == {"none"}
    assert any("float8 not searched: a100-80g has no float8 tensor cores" in n for n in a100.notes)
    assert a100.best.config.training.compile  # compile is searched on every GPU
    with pytest.raises(PlanError) as info:
        plan("llama2-7b", 8, "a100-80g", 8, top=3, float8=("none", "rowwise"))
    assert info.value.argument == "float8" and "no float8 tensor cores" in str(info.value)
    fp32 = plan("tiny", 2, "h100-sxm", 2, top=2, training={"precision": "fp32"})
    assert {e.config.training.float8 for e in fp32.entries} == {"none"}
    with pytest.raises(PlanError, match="compile"):
        plan("tiny", 2, "h100-sxm", 2, compile=("on",))
    with pytest.raises(PlanError, match="float8"):
        plan("tiny", 2, "h100-sxm", 2, float8=("fp8",))


def test_options_restrict_the_search_and_the_layout_shows_them():
    only = plan("llama2-7b", 8, "h100-sxm", 8, top=4, global_batch=8, max_virtual_stages=2,
                float8=("rowwise",), compile=(False,))
    assert {(e.config.training.float8, e.config.training.compile) for e in only.entries} == {("rowwise", False)}
    e = only.best
    assert e.layout["float8"] == "rowwise" and e.layout["compile"] is False
    assert "float8=rowwise" in e.label() and "compile" not in e.label()
    assert layout_config(only.base, e.layout) == e.config
    assert e.to_json()["layout"]["float8"] == "rowwise"
    # a config with float8 / compile on plans the same job: its own knobs are what is searched
    cfg = Config.from_dict({"model": {"preset": "llama2-7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8},
                            "parallel": {"dp": 8, "zero": 3},
                            "training": {"float8": "tensorwise", "float8_all_gather": True, "compile": True}})
    again = plan_config(cfg, top=4, global_batch=8, max_virtual_stages=2, float8=("rowwise",), compile=(False,))
    assert [x.config for x in again.entries] == [x.config for x in only.entries]


def shardscope(*args):
    return subprocess.run([sys.executable, "-m", "gui.cli", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_cli_float8_and_compile_flags():
    out = shardscope("--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--top", "2", "--float8", "none,tensorwise",
                     "--compile", "on", "--json")
    assert out.returncode == 0, out.stderr
    import json

    doc = json.loads(out.stdout)
    assert {(e["layout"]["float8"], e["layout"]["compile"]) for e in doc["entries"]} <= {("none", True),
                                                                                         ("tensorwise", True)}
    bad = shardscope("--model", "tiny", "--gpus", "2", "--compile", "yes")
    assert bad.returncode == 2 and "--compile" in bad.stderr and "on, off" in bad.stderr
    bad = shardscope("--model", "tiny", "--gpus", "2", "--gpu", "a100-80g", "--float8", "rowwise")
    assert bad.returncode == 2 and "--float8" in bad.stderr and "no float8 tensor cores" in bad.stderr
    helptext = subprocess.run([sys.executable, "-m", "gui.cli", "plan", "--help"], capture_output=True, text=True,
                              cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    assert "--float8" in helptext and "float8 tensor cores" in helptext and "--compile" in helptext
