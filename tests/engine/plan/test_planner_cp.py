"""The planner searches context parallelism for long sequences; `shardscope plan --seq-len`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_planner import _first_fitting, _Row

from engine.memory import memory_per_rank
from engine.plan.grid import _Planner
from engine.plan.results import PlanError, layout_config
from engine.plan.search import (
    LONG_SEQUENCE_TOKENS,
    SEARCHED_COMPILE,
    _base_config,
    default_cp_degrees,
    default_float8_kinds,
    plan,
)
from engine.plan.space import _key
from engine.time.step import step_time

ROOT = Path(__file__).resolve().parents[3]

# every layout of this grid is evaluated in a few seconds: a long sequence on 8 GPUs that mostly
# does not fit without context parallelism
CASE = dict(model="llama2-7b", gpus=8, gpu="a100-40g", gpus_per_node=4, global_batch=4, max_virtual_stages=2,
            seq_len=32768, schedules=("1F1B", "Interleaved1F1B"), recompute=("none", "full", "selective-layer"))


@pytest.fixture(scope="module")
def brute_force():
    kw = CASE
    base = _base_config(kw["model"], kw["gpus"], kw["gpu"], kw["gpus_per_node"], None, None, kw["seq_len"])
    cps = default_cp_degrees(kw["gpus"], kw["seq_len"])
    pl = _Planner(base, kw["global_batch"], (0, 1, 2, 3), kw["schedules"], kw["recompute"],
                  kw["max_virtual_stages"], None, cps, float8=default_float8_kinds(base), compile=SEARCHED_COMPILE)
    g = pl.grid()
    rows = []
    for i in range(len(g.mem_lb)):
        cfg = pl.config(g, i)  # raises if the grid held an invalid layout
        mem = memory_per_rank(cfg)
        st = step_time(cfg)
        if i % 16 == 0:  # the simulated bound is the step's own makespan (test_planner._brute_force)
            assert pl.makespan(cfg) == st.timeline.makespan_s, cfg
        rows.append(_Row(cfg=cfg, key=_key(g, i), mem=mem, peak=mem.peak.total, seconds=st.seconds,
                         mem_lb=g.mem_lb[i], bound0=g.makespan_lb[i] + g.rest_lb[i],
                         bound1=st.timeline.makespan_s + g.rest_lb[i]))
    return rows


def test_default_cp_degrees():
    assert default_cp_degrees(64, LONG_SEQUENCE_TOKENS - 1) == (1,)
    assert default_cp_degrees(64, 131072) == (1, 2, 4, 8, 16, 32, 64)
    assert default_cp_degrees(16, 3 * 2**14) == (1, 2, 4, 8, 16)
    assert default_cp_degrees(64, 16384 + 8) == (1, 2, 4)  # 16392 = 8·2049: 2·cp must divide it


def test_the_grid_holds_cp_layouts_and_its_bounds_never_exceed_the_engine(brute_force):
    rows = brute_force
    cps = {r["cfg"].parallel.cp for r in rows}
    assert cps == {1, 2, 4, 8}
    assert any(r["fits"] for r in rows) and any(not r["fits"] for r in rows)
    for r in rows:
        assert r["mem_lb"] <= r["peak"] * (1 + 1e-9), r["cfg"].parallel
        assert r["bound0"] <= r["seconds"] * (1 + 1e-9), r["cfg"].parallel
        assert r["bound1"] <= r["seconds"] * (1 + 1e-9), r["cfg"].parallel
    assert not any(r["cfg"].parallel.cp > 1 and r["cfg"].parallel.zero == 1 for r in rows)


@pytest.mark.parametrize("top", [1, 5])
def test_ranking_with_cp_equals_brute_force(brute_force, top):
    expected = _first_fitting(brute_force, top)
    result = plan(**CASE, top=top)
    assert [e.config for e in result.entries] == [r["cfg"] for r in expected]
    assert result.counts.enumerated == len(brute_force)
    assert result.counts.rejected_by_validation == 0
    assert any(e.config.parallel.cp > 1 for e in result.entries)
    e = result.entries[0]
    assert layout_config(result.base, e.layout) == e.config  # the layout dict carries cp


def test_short_sequences_keep_cp_one_and_say_so():
    result = plan("llama3-8b", 8, top=3)
    assert all(e.config.parallel.cp == 1 for e in result.entries)
    assert any("context parallelism not searched" in n for n in result.notes)


def test_seq_len_and_cp_errors_name_the_argument():
    with pytest.raises(PlanError) as err:
        plan("llama3-8b", 8, seq_len=0)
    assert err.value.argument == "seq_len"
    with pytest.raises(PlanError) as err:
        plan("llama3-8b", 8, seq_len=2**25)
    assert err.value.argument == "seq_len"
    with pytest.raises(PlanError) as err:
        plan("llama3-8b", 8, cp=(0,))
    assert err.value.argument == "cp"


def test_cli_plan_seq_len_ranks_cp_layouts():
    out = subprocess.run([sys.executable, "-m", "gui.cli", "plan", "--model", "llama3-8b", "--gpus", "64",
                          "--seq-len", "131072", "--top", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if re.match(r"\s*\d+\s+dp\d", line)]
    assert len(rows) == 5
    assert all(" cp" in row for row in rows[:3])  # the fastest layouts split the sequence
    assert "64 × 131072 tokens" in out.stdout
    assert "context parallelism searched" in out.stdout
