"""Integration: SIGKILL a rank of DDP, TP and PP layouts mid-run (what the OOM killer does) — the
failed record blames the killed rank and says the others' errors followed it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from engine import default_config

pytestmark = pytest.mark.integration

pytest.importorskip("torch")

from test_backend_strategies import processes_of  # noqa: E402

from backend.launch import launch  # noqa: E402
from backend.records import RunDir  # noqa: E402

BASE = default_config()
LAYOUTS = {
    "DDP dp2": BASE.replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1}),
    "TP tp2": BASE.replace(cluster={"gpus": 2}, parallel={"dp": 1, "tp": 2, "pp": 1, "microbatches": 1}),
    "PP pp2 1F1B": BASE.replace(cluster={"gpus": 2}, parallel={"dp": 1, "pp": 2, "microbatches": 4}),
}
# each layout once, rank 0 and rank 1 both killed somewhere (every launch costs CI ~10 s)
CASES = [("DDP dp2", 1), ("TP tp2", 0), ("PP pp2 1F1B", 1), ("default dp2×pp2", 0)]


def _events(path):
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def kill_mid_run(run, rank: int, deadline_s: float = 90.0) -> None:
    """After the first step, SIGKILL ``rank``'s worker half a step into the next one."""
    rd = RunDir(run.path)
    end = time.monotonic() + deadline_s
    pid = seconds = None
    while time.monotonic() < end:
        pid = next((e["pid"] for e in _events(rd.rank_events(rank)) if e.get("event") == "rank_ready"), pid)
        step = next((e for e in _events(rd.rank_events(0)) if e.get("event") == "step"), None)
        if pid and step:
            seconds = float(step["seconds"])
            break
        time.sleep(0.02)
    assert pid and seconds is not None, "the run never finished its first step"
    time.sleep(seconds * 0.5)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("layout", "rank"), CASES, ids=[f"{n}-rank{r}" for n, r in CASES])
def test_killed_rank_is_blamed(tmp_path, layout, rank):
    cfg = BASE if layout.startswith("default") else LAYOUTS[layout]
    run = launch(cfg, tmp_path / "run", steps=40, timeout_s=120)
    kill_mid_run(run, rank)
    res = run.wait(180)
    assert res is not None and res["event"] == "failed"
    assert res["rank"] == rank, res["reason"]
    assert res["reason"].startswith(f"rank {rank} was killed by SIGKILL, a signal the launcher did not send")
    assert processes_of(run) == []
