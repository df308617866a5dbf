"""Integration: a rank that raises, a rank killed, a hang past the timeout, a cancel — each ends
as a failed record naming the rank (when known) with its log tail, and leaves no process."""

from __future__ import annotations

import time

import pytest

from engine import default_config

pytestmark = pytest.mark.integration

pytest.importorskip("torch")

from test_backend_strategies import processes_of  # noqa: E402

from backend.launch import launch  # noqa: E402
from backend.records import RunDir  # noqa: E402

TWO_RANKS = default_config().replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1})


def failed_run(tmp_path, fault, timeout_s=90, steps=3):
    run = launch(TWO_RANKS, tmp_path / "run", steps=steps, timeout_s=timeout_s,
                 env={"SHARDSCOPE_FAULT": fault} if fault else None)
    res = run.wait(timeout_s + 60)
    assert res is not None and res["event"] == "failed"
    assert processes_of(run.path) == []
    events = RunDir(run.path).read_events()
    assert events[-1]["event"] == "failed" and events[0]["event"] == "started"
    return res


def test_rank_that_raises(tmp_path):
    res = failed_run(tmp_path, "raise@1:2")
    assert res["rank"] == 1
    assert "injected fault on rank 1 at step 2" in res["reason"]
    assert "RuntimeError" in res["log_tail"]


def test_rank_killed(tmp_path):
    res = failed_run(tmp_path, "kill@1:2")
    assert res["rank"] == 1
    assert "SIGKILL" in res["reason"]


def test_hang_past_timeout(tmp_path):
    t0 = time.monotonic()
    res = failed_run(tmp_path, "hang@0:2", timeout_s=15)
    assert "timed out after 15 s" in res["reason"]
    assert time.monotonic() - t0 < 45


def test_cancel_stops_every_process(tmp_path):
    run = launch(TWO_RANKS, tmp_path / "run", steps=1000, timeout_s=120)
    for ev in run.events(timeout_s=90):
        if ev["event"] == "step":
            break
    run.cancel()
    assert run.result["event"] == "failed" and run.result["reason"] == "cancelled"
    assert processes_of(run.path) == []
