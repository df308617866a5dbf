"""Integration against a real Slurm on this machine: munge + slurmctld + two slurmd (n1, n2),
each slurmd in its own network namespace (tests/cluster_helpers.py).

A 2-node job of the tiny preset through ``shardscope run --target slurm`` (one rank per
node, gloo) whose ranks report different nodes; a job Slurm rejects (bad partition, too many
nodes); a rank that raises on one node; Ctrl-C (scancel); a node that goes down under a running job (NODE_FAIL). Each ends
as a record with Slurm's own words. Skipped, with the reason, where Slurm or namespaces are
not to be had (.ci/run installs slurm-wlm and munge).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import IFNAME, NetnsPair, SlurmCluster, missing_tools
from test_cluster_hosts import TWO_RANKS

pytestmark = pytest.mark.integration
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[3]
TOOLS = ("ip", "nsenter", "munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("starting munged/slurmctld/slurmd and network namespaces needs root")
    if missing_tools(*TOOLS):
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing_tools(*TOOLS))}): "
                    "apt-get install slurm-wlm munge iproute2, as .ci/run does")
    try:
        net = NetnsPair()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}")
    cluster = None
    try:
        try:
            cluster = SlurmCluster(net)
        except RuntimeError as exc:
            pytest.skip(f"slurmctld/slurmd could not be started here: {exc}")
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        net.close()


#: Ctrl-C reaches the run however the tests were started: a background job of a non-interactive shell (CI started
#: with ``cmd &``) has SIGINT ignored, its children inherit that across exec, and Python then installs no
#: KeyboardInterrupt handler — the run would go on and its job hold both nodes (the tests after it PENDING)
DEFAULT_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execvp(sys.argv[1], sys.argv[1:])"]


def shardscope_run(slurm: SlurmCluster, tmp_path: Path, *args: str, config: str = TWO_RANKS,
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    """``shardscope run CONFIG --target slurm ...`` in the controller's namespace (where sbatch can reach it), SIGINT
    at its default (``DEFAULT_SIGINT``)."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(config)
    env = {**slurm.env, "GLOO_SOCKET_IFNAME": IFNAME, **(env or {})}
    return subprocess.Popen([*DEFAULT_SIGINT, *slurm.client(), sys.executable, "-m", "gui.cli", "run", str(cfg), "--target", "slurm",
                             "--out", str(tmp_path / "run"), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]


def finish(p: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def test_two_node_job_measures_both_nodes(slurm, tmp_path):
    t0 = time.monotonic()
    p = shardscope_run(slurm, tmp_path, "--nodes", "2", "--steps", "3", "--timeout", "90")
    out, err = finish(p)
    assert p.returncode == 0, (out, err, slurm.logs())
    assert "submitted Slurm job" in out and "RUNNING" in out and "finished in" in out
    run = tmp_path / "run"
    meas = json.loads((run / "measurement.json").read_text())
    assert sorted(r["node"]["node"] for r in meas["ranks"]) == ["n1", "n2"]  # one rank on each Slurm node
    assert len({r["node"]["netns"] for r in meas["ranks"]}) == 2  # and really in two network namespaces
    assert len(meas["step"]["per_step"]) == 3 and len(meas["memory"]["per_rank"]) == 2
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds[:2] == ["started", "submitted"] and kinds[-2:] == ["measurement", "finished"]
    states = [e["state"] for e in events(tmp_path) if e["event"] == "job_state"]
    assert states[-1] == "COMPLETED"
    assert list((run / "logs").glob("slurm-*.log")) and len(list((run / "logs").glob("node-*.log"))) == 2
    # the run compares against the prediction like a local one
    cmp = subprocess.run([sys.executable, "-m", "gui.cli", "compare", str(run), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    assert time.monotonic() - t0 < 90


def test_rejected_partition(slurm, tmp_path):
    p = shardscope_run(slurm, tmp_path, "--nodes", "2", "--partition", "no-such-partition")
    out, err = finish(p, 60)
    assert p.returncode == 1
    last = events(tmp_path)[-1]
    assert last["event"] == "failed"
    assert "Slurm rejected the job" in last["reason"] and "Invalid partition name specified" in last["reason"]
    assert "Invalid partition name specified" in out


def test_rejected_too_many_nodes(slurm, tmp_path):
    three = TWO_RANKS.replace("gpus = 2", "gpus = 3").replace("dp = 2", "dp = 3")
    p = shardscope_run(slurm, tmp_path, "--nodes", "3", config=three)
    finish(p, 60)
    assert p.returncode == 1
    last = events(tmp_path)[-1]
    assert last["event"] == "failed"
    # sbatch rejects it where EnforcePartLimits is set; else (as here) Slurm queues it for ever, PartitionConfig
    assert "Reason=PartitionConfig" in last["reason"], last["reason"]
    assert _squeue(slurm) == ""


def _wait_for_step(tmp_path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (tmp_path / "run" / "events.jsonl").exists() and any(e["event"] == "step" for e in events(tmp_path)):
            return
        time.sleep(0.3)
    raise AssertionError(f"no step within {timeout_s} s: {events(tmp_path)}")


def _squeue(slurm: SlurmCluster) -> str:
    return subprocess.run([*slurm.client(), "squeue", "-h"], env=slurm.env, capture_output=True, text=True,
                          timeout=10).stdout.strip()


def test_ctrl_c_cancels_the_job(slurm, tmp_path):
    t0 = time.monotonic()
    p = shardscope_run(slurm, tmp_path, "--nodes", "2", "--steps", "10000", "--timeout", "90")
    try:
        _wait_for_step(tmp_path)
        p.send_signal(signal.SIGINT)  # nsenter passes it on to shardscope
        out, err = finish(p, 60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (out, err)  # as a shell reports a command stopped by Ctrl-C
    last = events(tmp_path)[-1]
    assert last["event"] == "cancelled" and last["reason"].startswith("cancelled"), last
    assert "ended CANCELLED" in last["reason"] and last["job_state"] == "CANCELLED"
    assert "CANCELLED: cancelled" in out
    assert time.monotonic() - t0 < 90
    assert _squeue(slurm) == ""


def test_rank_failure_on_a_node(slurm, tmp_path):
    """Rank 1 raises at step 2 (the backend's fault hook; sbatch passes the environment on)."""
    p = shardscope_run(slurm, tmp_path, "--nodes", "2", "--steps", "5", "--timeout", "90",
                       env={"SHARDSCOPE_FAULT": "raise@1:2"})
    out, err = finish(p, 90)
    assert p.returncode == 1, (out, err)
    last = events(tmp_path)[-1]
    assert last["event"] == "failed" and last["rank"] == 1 and last["job_state"] == "FAILED", last
    assert last["reason"].startswith("rank 1 failed: RuntimeError: injected fault on rank 1 at step 2")
    assert "ended FAILED" in last["reason"] and "RuntimeError" in last["log_tail"]


def test_node_failure(slurm, tmp_path):
    """n2 goes DOWN under a running job: Slurm kills the job as NODE_FAIL, and the record says so."""
    p = shardscope_run(slurm, tmp_path, "--nodes", "2", "--steps", "10000", "--timeout", "90")
    try:
        _wait_for_step(tmp_path)
        subprocess.run([*slurm.client(), "scontrol", "update", "nodename=n2", "state=down", "reason=lost power"],
                       env=slurm.env, check=True, timeout=10)
        out, err = finish(p, 60)
    finally:
        if p.poll() is None:
            p.kill()
        subprocess.run([*slurm.client(), "scontrol", "update", "nodename=n2", "state=resume"], env=slurm.env,
                       capture_output=True, timeout=10)  # ReturnToService=2 may have resumed it already
    assert p.returncode == 1, (out, err)
    last = events(tmp_path)[-1]
    assert last["event"] == "failed" and last["job_state"] == "NODE_FAIL", last
    assert "ended NODE_FAIL" in last["reason"], last["reason"]
