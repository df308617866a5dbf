"""Integration: a 2-node torchrun job across two network namespaces, no Slurm.

``shardscope run --target hosts --hosts 10.231.0.1,10.231.0.2`` prints one command per
host and follows the run directory; the test starts each printed command inside its own
namespace (as a user would on each host) and checks the measurement came from both.
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
from cluster_helpers import IFNAME, NetnsPair, missing_tools

pytestmark = pytest.mark.integration
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[3]
TWO_RANKS = """\
schema_version = 1
[model]
preset = "tiny"
[cluster]
preset = "local-cpu"
gpus = 2
[parallel]
dp = 2
pp = 1
microbatches = 1
[training]
precision = "fp32"
"""


@pytest.fixture()
def net():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if missing_tools("ip", "nsenter"):
        pytest.skip(f"missing {missing_tools('ip', 'nsenter')} (apt-get install iproute2 util-linux)")
    try:
        pair = NetnsPair()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}")
    try:
        yield pair
    finally:
        pair.close()


def test_two_hosts_in_two_namespaces(net, tmp_path):
    cfg = tmp_path / "two.toml"
    cfg.write_text(TWO_RANKS)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    follower = subprocess.Popen(
        [sys.executable, "-m", "gui.cli", "run", str(cfg), "--target", "hosts", "--hosts", ",".join(net.addrs),
         "--steps", "3", "--timeout", "90", "--json", "--out", str(run_dir)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    nodes: list[subprocess.Popen] = []
    try:
        commands = []
        for line in follower.stdout:
            ev = json.loads(line)
            if ev["event"] == "node_command":
                commands.append(ev)
            if ev["event"] == "waiting":
                break
        assert [c["host"] for c in commands] == net.addrs
        assert "--rdzv-conf=is_host=1" in commands[0]["shell"] and "--local-addr=10.231.0.2" in commands[1]["shell"]
        for i, c in enumerate(commands):  # each "host" runs exactly the printed line
            nodes.append(subprocess.Popen(
                [*net.enter(i), "env", f"GLOO_SOCKET_IFNAME={IFNAME}", "bash", "-c", c["shell"]],
                stdout=open(tmp_path / f"node{i}.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True))
        rest, err = follower.communicate(timeout=120)
        events = [json.loads(x) for x in rest.splitlines()]
        assert follower.returncode == 0, (events[-1:], err, [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)])
        assert [n.wait(timeout=30) for n in nodes] == [0, 0]
    finally:
        for p in [follower, *nodes]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    meas = json.loads((run_dir / "measurement.json").read_text())
    where = [r["node"] for r in meas["ranks"]]
    # one rank in each namespace: the ranks' own /proc/self/ns/net are the two namespaces made here
    assert sorted(w["netns"] for w in where) == sorted(f"net:[{os.stat(f'/run/netns/{n}').st_ino}]"
                                                       for n in net.names), where
    assert sorted(w["node_rank"] for w in where) == [0, 1]
    assert len(meas["step"]["per_step"]) == 3
    ends = [e["event"] for e in events]
    assert ends[-2:] == ["measurement", "finished"] and ends.count("rank_node") == 2
    assert time.monotonic() - t0 < 90
