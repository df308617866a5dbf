"""Unit tests of the cluster targets without a cluster: the sbatch script and the per-host
commands (--dry-run), node counts, and how each way a Slurm job can end becomes a record."""

from __future__ import annotations

import json
import subprocess

import pytest

from backend.cluster import ClusterError, node_layout
from backend.cluster.follow import ClusterRun, JobState
from backend.cluster.slurm import SlurmJob, parse_sacct, parse_scontrol, sbatch_script, submit
from backend.records import RunDir
from engine import Config, default_config
from gui.cli import main

TWO = default_config().replace(cluster={"gpus": 2, "gpus_per_node": 1}, parallel={"dp": 2, "pp": 1, "microbatches": 1})


@pytest.fixture()
def two_toml(tmp_path):
    p = tmp_path / "two.toml"
    TWO.save(p)
    return p


def test_dry_run_prints_the_sbatch_script(two_toml, tmp_path, capsys):
    rc = main(["run", str(two_toml), "--target", "slurm", "--nodes", "2", "--partition", "gpu", "--time", "00:10:00",
               "--account", "proj", "--steps", "4", "--out", str(tmp_path / "r"), "--dry-run"])
    script = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "r").exists()  # nothing written, nothing submitted
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=00:10:00", "#SBATCH --account=proj", "#SBATCH --no-requeue",
                 f"#SBATCH --output={tmp_path / 'r'}/logs/slurm-%j.log"):
        assert line in script
    assert "--gpus-per-node" not in script  # CPU ranks ask Slurm for no GPUs
    assert "srun --kill-on-bad-exit=1" in script and "/logs/node-%n.log" in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$head_addr:$rdzv_port" --rdzv-id="$SLURM_JOB_ID"' in script
    assert "--nnodes=2 --nproc-per-node=1" in script and "-m backend.cluster.rank" in script
    assert "--steps 4" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_gpu_cluster_asks_for_gpus_per_node(tmp_path):
    cfg = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"preset": "h100-pod-64", "gpus": 16},
                            "parallel": {"dp": 16}})
    nodes, per_node = node_layout(cfg)
    assert (nodes, per_node) == (2, 8)
    script = sbatch_script(cfg, tmp_path / "r", nodes=nodes, per_node=per_node)
    assert "#SBATCH --gpus-per-node=8" in script and "--nnodes=2 --nproc-per-node=8" in script


def test_dry_run_hosts_prints_each_command(two_toml, tmp_path, capsys):
    rc = main(["run", str(two_toml), "--target", "hosts", "--hosts", "a:29400,b", "--out", str(tmp_path / "r"),
               "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    a, b = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert "--rdzv-endpoint=a:29400" in a and "--rdzv-endpoint=a:29400" in b
    assert "--rdzv-conf=is_host=1 --local-addr=a" in a and "--rdzv-conf=is_host=0 --local-addr=b" in b
    assert "--rdzv-id=r" in a and "--nnodes=2 --nproc-per-node=1" in b


@pytest.mark.parametrize("args, message", [
    (["--target", "slurm", "--nodes", "3"], "3 node(s)"),
    (["--target", "slurm", "--nodes", "0"], "--nodes 0: must be at least 1"),
    (["--target", "hosts"], "--target hosts needs --hosts"),
    (["--target", "hosts", "--hosts", "a,a"], "names a host twice"),
    (["--target", "hosts", "--hosts", "a,b,c"], "3 node(s)"),
    (["--dry-run"], "--dry-run needs --target slurm"),
])
def test_bad_cluster_requests_are_usage_errors(two_toml, args, message, capsys):
    assert main(["run", str(two_toml), *args]) == 2
    assert message in capsys.readouterr().err


def test_node_layout():
    assert node_layout(TWO) == (2, 1)
    assert node_layout(TWO, nodes=1) == (1, 2)
    assert node_layout(TWO, per_node=2) == (1, 2)
    with pytest.raises(ClusterError):
        node_layout(TWO, nodes=2, per_node=2)


def test_parse_slurm_answers():
    st = parse_scontrol("JobId=7 JobName=shardscope-r UserId=root(0) JobState=TIMEOUT Reason=TimeLimit "
                        "Dependency=(null) ExitCode=0:15 RunTime=00:01:02 TimeLimit=00:01:00 NodeList=n[1-2]\n")
    assert (st.state, st.reason, st.exit_code, st.nodes, st.terminal) == ("TIMEOUT", "TimeLimit", "0:15", "n[1-2]",
                                                                          True)
    st = parse_sacct("CANCELLED by 0|None|0:0|n[1-2]\n")
    assert (st.state, st.source, st.terminal, st.ok) == ("CANCELLED", "sacct", True, False)
    assert JobState("PENDING", "Resources").terminal is False and not JobState("PENDING", "Resources").hopeless
    assert JobState("PENDING", "PartitionNodeLimit").hopeless


class FakeSlurm(SlurmJob):
    """The scheduler answers a fixed sequence of states (the last one repeats)."""

    def __init__(self, run_dir, states):
        super().__init__(run_dir)
        self.job_id = "7"
        self.states = list(states)
        self.cancelled = False

    def poll(self):
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def cancel(self):  # as scancel does: the job ends CANCELLED
        self.cancelled = True
        self.states = [JobState("CANCELLED", "None", "0:15", "n[1-2]")]


def follow(tmp_path, states, slurm_log="", ranks=()):
    d = RunDir(tmp_path / "run")
    TWO.save(d.config)
    (d.logs / "slurm-7.log").write_text(slurm_log)
    for r, node in ranks:
        rec = {"rank": r, "stages": [0], "memory": {"categories": {"params": 10}}, "step_seconds": [0.1, 0.2],
               "losses": [3.0, 2.0]}
        d.rank_measurement(r).write_text(json.dumps(rec))
        with open(d.rank_events(r), "a") as f:
            f.write(json.dumps({"event": "rank_node", "time": 0, "rank": r, "node": node}) + "\n")
            f.write(json.dumps({"event": "rank_done", "time": 0, "rank": r}) + "\n")
    run = ClusterRun(d, TWO, 2, 60, 2)
    job = FakeSlurm(d, states)
    run.follow(job)
    return run, run.wait(60), job


@pytest.mark.parametrize("state, reason, stepd, expect", [
    ("TIMEOUT", "TimeLimit", "slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:01:00 DUE TO TIME "
                             "LIMIT ***", "ended TIMEOUT (Reason=TimeLimit)"),
    ("NODE_FAIL", "NodeDown", "", "ended NODE_FAIL (Reason=NodeDown)"),
    ("FAILED", "NonZeroExitCode", "srun: error: n2: task 1: Exited with exit code 1",
     "ended FAILED (Reason=NonZeroExitCode), ExitCode=1:0"),
    ("OUT_OF_MEMORY", "OutOfMemory", "", "ended OUT_OF_MEMORY"),
])
def test_each_way_a_job_ends_is_a_failed_record(tmp_path, state, reason, stepd, expect):
    run, res, _ = follow(tmp_path, [JobState("PENDING", "Priority"), JobState("RUNNING"),
                                    JobState(state, reason, "1:0" if state == "FAILED" else "0:0", "n[1-2]")],
                         slurm_log=f"shardscope: job 7\n{stepd}\n")
    assert res["event"] == "failed" and res["job_state"] == state
    assert expect in res["reason"] and (stepd in res["reason"])
    states = [e["state"] for e in run.dir.read_events() if e["event"] == "job_state"]
    assert states == ["PENDING", "RUNNING", state]


def test_completed_job_assembles_with_nodes(tmp_path):
    run, res, _ = follow(tmp_path, [JobState("RUNNING"), JobState("COMPLETED", "None", "0:0")],
                         ranks=[(0, "n1"), (1, "n2")])
    assert res["event"] == "finished", res
    meas = json.loads(run.dir.measurement.read_text())
    assert [r["node"]["node"] for r in meas["ranks"]] == ["n1", "n2"]


def test_completed_job_without_rank_files_says_shared_filesystem(tmp_path, monkeypatch):
    monkeypatch.setattr("backend.cluster.follow.SETTLE_S", 0.5)
    _, res, _ = follow(tmp_path, [JobState("COMPLETED", "None", "0:0")])
    assert res["event"] == "failed" and "filesystem every node shares" in res["reason"]


def test_cancel_scancels_and_waits_for_slurm(tmp_path):
    d = RunDir(tmp_path / "run")
    run = ClusterRun(d, TWO, 2, 60, 2)
    job = FakeSlurm(d, [JobState("RUNNING")])
    run.follow(job)
    run.cancel()
    assert job.cancelled and run.result["reason"].startswith("cancelled; Slurm job 7 ended CANCELLED")


def test_hopeless_pending_job_is_cancelled(tmp_path):
    _, res, job = follow(tmp_path, [JobState("PENDING", "PartitionNodeLimit")])
    assert job.cancelled and "Reason=PartitionNodeLimit" in res["reason"]


def test_no_sbatch_on_path(tmp_path):
    run = submit(TWO, tmp_path / "r", env={"PATH": str(tmp_path)})
    res = run.wait(5)
    assert res["event"] == "failed" and "sbatch not found" in res["reason"]


def test_legacy_dataparallel_is_refused_for_cluster_targets():
    from backend.cluster.follow import ClusterError, node_layout
    from engine import Config

    cfg = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 2},
                            "parallel": {"dp": 2, "dp_mode": "dataparallel"}})
    with pytest.raises(ClusterError, match="one process on one machine"):
        node_layout(cfg)
