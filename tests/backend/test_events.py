"""backend.events.describe: every event kind the backend emits has words, never a JSON dict."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from backend.events import SENTENCES, describe

ROOT = Path(__file__).resolve().parents[2]
#: every way the backend writes an event: Run._emit / RunDir.emit / RankWriter.event, or a dict literal
EMITS = re.compile(r"""(?:_emit|\.emit|\.event)\(\s*["']([a-z_]+)["']|["']event["']\s*:\s*["']([a-z_]+)["']""")

#: one realistic event of each kind, with the fields the backend gives it
SAMPLES: list[dict] = [
    {"event": "started", "time": 1.0, "world": 4, "steps": 5, "command": ["python", "-m", "torch.distributed.run"],
     "run_dir": "runs/a"},
    {"event": "started", "time": 1.0, "world": 2, "steps": 1, "command": ["python"], "run_dir": "runs/a",
     "processes": 1, "dp_mode": "dataparallel"},
    {"event": "started", "time": 1.0, "world": 8, "steps": 3, "nodes": 2, "per_node": 4, "target": "slurm",
     "command": ["sbatch", "--parsable", "x.sbatch"], "run_dir": "runs/a"},
    {"event": "started", "time": 1.0, "world": 64, "simulated": True, "ranks": [0, 8, 16], "run_dir": "runs/f"},
    {"event": "started", "world": 4, "steps": 3},  # a stand-in backend gives no more
    {"event": "rank_ready", "time": 1.0, "rank": 1, "stages": [1], "pid": 123},
    {"event": "step", "time": 1.0, "k": 2, "n": 5, "loss": 5.5, "seconds": 0.0123},
    {"event": "measurement", "time": 1.0, "path": "runs/a/measurement.json", "step_seconds": 0.01,
     "first_loss": 6.0, "last_loss": 5.0, "total_bytes": [2**20, 2**21]},
    {"event": "measurement", "time": 1.0, "path": "m.json", "simulated": True, "total_bytes": [2**30]},
    {"event": "measurement", "time": 1.0, "path": "m.json", "step_seconds": 0.01, "first_loss": None,
     "last_loss": None, "total_bytes": [1], "nodes": ["n1", "n2"]},
    {"event": "finished", "time": 1.0, "seconds": 12.5},
    {"event": "finished"},
    {"event": "failed", "time": 1.0, "reason": "rank 1 failed: RuntimeError: boom", "rank": 1, "exit_code": 1,
     "log_tail": "Traceback ...\nRuntimeError: boom"},
    {"event": "failed", "time": 1.0, "reason": "timed out", "rank": None, "job_state": "TIMEOUT", "log_tail": ""},
    {"event": "cancelled", "time": 1.0, "reason": "cancelled by the user; every process was stopped"},
    {"event": "rank_failed", "rank": 2, "reason": "ValueError: x"},
    {"event": "rank_started", "time": 1.0, "rank": 0, "pid": 99},
    {"event": "rank_done", "time": 1.0, "rank": 0, "seconds": 3.2},
    {"event": "rank_done", "time": 1.0, "rank": 0},
    {"event": "submitted", "time": 1.0, "job_id": "42", "script": "runs/a/job.sbatch"},
    {"event": "job_state", "time": 1.0, "job_id": "42", "state": "PENDING", "reason": "Resources", "nodes": None,
     "source": "scontrol"},
    {"event": "job_state", "time": 1.0, "job_id": "42", "state": "RUNNING", "reason": "None", "nodes": "n[1-2]",
     "source": "scontrol"},
    {"event": "rank_node", "time": 1.0, "rank": 3, "node": "n2", "node_rank": 1, "local_rank": 1},
    {"event": "node_command", "time": 1.0, "host": "a", "node": 0, "argv": ["torchrun"], "shell": "torchrun ..."},
    {"event": "waiting", "time": 1.0, "message": "start the command above on each host"},
    {"event": "phase", "time": 1.0, "message": "running step 2/5 … 7 s"},
    {"event": "log", "text": "a printed line"},
]


def emitted_kinds() -> set[str]:
    kinds = set()
    for path in (ROOT / "backend").rglob("*.py"):
        for m in EMITS.finditer(path.read_text(encoding="utf-8")):
            kinds.add(m.group(1) or m.group(2))
    return kinds


def test_every_kind_the_backend_emits_has_a_sentence():
    kinds = emitted_kinds()
    assert {"started", "step", "finished", "failed", "submitted", "job_state", "rank_node", "node_command",
            "waiting", "rank_ready", "measurement", "rank_failed", "rank_started", "rank_done"} <= kinds
    assert kinds <= set(SENTENCES), f"no words for {sorted(kinds - set(SENTENCES))}"
    assert kinds <= {e["event"] for e in SAMPLES}, "add a sample of the new kind below"


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e["event"])
def test_each_event_is_a_sentence_without_json(event):
    text = describe(event)
    assert text.strip() and "{" not in text and "}" not in text, text
    assert json.dumps(event) not in text


def test_the_words_say_what_happened():
    by_kind = {e["event"]: describe(e) for e in reversed(SAMPLES)}  # the first sample of each kind
    assert by_kind["started"] == "started 4 ranks, 5 steps -> runs/a"
    assert by_kind["step"] == "step 2/5  loss 5.5000  12.3 ms"
    assert by_kind["finished"] == "finished in 12.5 s"
    assert by_kind["failed"].startswith("FAILED (rank 1): rank 1 failed") and "--- log tail ---" in by_kind["failed"]
    assert by_kind["submitted"] == "submitted Slurm job 42 (runs/a/job.sbatch)"
    assert by_kind["job_state"] == "job 42: PENDING (Resources)"
    assert by_kind["measurement"] == "measured: step 10.0 ms; MiB per rank: 1.0, 2.0  (runs/a/measurement.json)"
    assert describe(SAMPLES[1]).startswith("started 1 process driving 2 GPUs (nn.DataParallel)")
    assert describe(SAMPLES[2]).startswith("started 8 ranks on 2 node(s) (slurm), 3 steps")
    assert describe(SAMPLES[3]).startswith("simulating ranks 0, 8, 16 of 64 on a fake process group")


def test_an_unknown_kind_is_still_words():
    text = describe({"event": "rebalanced", "time": 3.0, "ranks": [0, 1], "why": {"slow": "rank 1"}})
    assert text == "rebalanced  ranks 0, 1, why slow rank 1"


def test_a_silent_run_says_which_phase_it_is_in():
    """backend.launch emits a ``phase`` event when a run has said nothing for HEARTBEAT_S: what the
    ranks' own events say they are doing, from torchrun's start to the processes' exit."""
    from backend.launch import phase_of

    ev = lambda kind, **kw: {"event": kind, **kw}  # noqa: E731
    assert phase_of({}, 4, 5, 1.2).startswith("starting the ranks: 0 of 4 processes up")
    started = {r: [ev("rank_started", pid=100 + r)] for r in range(4)}
    assert "0 of 4 ready" in phase_of(started, 4, 5, 3.0)
    ready = {r: evs + [ev("rank_ready")] for r, evs in started.items()}
    assert phase_of(ready, 4, 5, 6.0) == "running step 1/5 … 6 s"
    ready[0] += [ev("step", k=k, n=5) for k in range(1, 6)]
    assert phase_of(ready, 4, 5, 8.0).startswith("measuring memory: one more, untimed step")
    assert "(0 of 4 ranks done)" in phase_of(ready, 4, 5, 8.0)
    done = {r: evs + [ev("rank_done")] for r, evs in ready.items()}
    assert phase_of(done, 4, 5, 9.4) == "collecting the measurement: the ranks are exiting … 9 s"
    assert describe({"event": "phase", "message": "running step 2/5 … 7 s"}) == "running step 2/5 … 7 s"
