"""Integration: a rank that raises, a rank killed, a hang past the timeout, a cancel — each ends
as a failed record naming the rank (when known) with its log tail, and leaves no process."""

from __future__ import annotations

import os
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
    assert processes_of(run) == []
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


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of every TCP socket these processes
    listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            pass
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, one of theirs
                    out.append(cols[1].rsplit(":", 1)[0])
    return out


#: 127.0.0.0/8 (little-endian hex), ::1, and 127.0.0.0/8 mapped into IPv6
def _loopback(addr: str) -> bool:
    return (len(addr) == 8 and addr.endswith("7F")) or addr == "0" * 24 + "01000000" or (
        addr.startswith("0000000000000000FFFF0000") and addr.endswith("7F"))


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_run_listens_on_loopback_only_and_a_cancel_stops_every_process(tmp_path):
    run = launch(TWO_RANKS, tmp_path / "run", steps=1000, timeout_s=120)
    for ev in run.events(timeout_s=90):
        if ev["event"] == "step":
            break
    # the agent's rendezvous stores and gloo's sockets: nothing on another interface
    pids = processes_of(run)
    addresses = listening_addresses(pids)
    assert len(pids) >= 3 and len(addresses) >= 2, (pids, addresses)  # the agent's two stores at least
    assert [a for a in addresses if not _loopback(a)] == []
    # on a machine without CUDA the ranks are forked from the agent (backend.torchrun_loopback), which
    # imported what they import before their first step
    ranks = dict(run._worker_pids)
    assert len(ranks) == 2 and all(_parent(pid) == run.proc.pid for pid in ranks.values()), (ranks, run.proc.pid)
    # and the agent is forked from this process's fork server, which imported torch and the backend once
    from multiprocessing import forkserver

    assert _parent(run.proc.pid) == forkserver._forkserver._forkserver_pid != os.getpid()
    run.cancel()
    assert run.result["event"] == "cancelled" and "cancelled by the user" in run.result["reason"]
    assert processes_of(run) == []
    events = RunDir(run.path).read_events()
    assert events[-1]["event"] == "cancelled"

    from gui.runs import read_run_dir

    assert read_run_dir(run.path).status == "cancelled"  # and so it reads back from disk


def test_a_run_that_fills_its_disk_says_so(tmp_path):
    from tests.gui.test_safety import tiny_filesystem

    with tiny_filesystem(tmp_path, "32k") as fs:  # room for the config and the first records only
        run = launch(TWO_RANKS, fs / "run", steps=3, timeout_s=90)
        res = run.wait(150)
        assert res is not None and res["event"] == "failed", res
        assert f"the file system holding {fs / 'run'} is full" in res["reason"], res["reason"]
        assert processes_of(run) == []


def test_the_agents_rendezvous_names_its_methods_as_torch_does_without_reading_source():
    """backend.torchrun_loopback swaps dynamic_rendezvous.get_method_name (inspect.stack: every frame's
    source read, 0.7 s of the agent per launch) for one that reads the frame's name: the same name at
    every depth torch asks, and torch's fallback past the top of the stack."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from backend.torchrun_loopback import _method_name

    torch_own = dynamic_rendezvous.get_method_name
    assert torch_own is not _method_name  # main() patches it in the agent's process only

    def record_a_step(depth):  # as the handler's _record does: the caller's caller named
        return torch_own(depth), _method_name(depth)

    def next_rendezvous(depth):
        return record_a_step(depth)

    for depth in (1, 2, 3):
        theirs, ours = next_rendezvous(depth)
        assert ours == theirs, depth
    assert next_rendezvous(2)[1] == "next_rendezvous"
    assert _method_name(10_000) == "no_method_name"


def test_a_forked_rank_runs_its_modules_main_and_only_a_failure_ends_it_early(monkeypatch):
    """backend.torchrun_loopback.run_module: ``python -m module args`` as ``module.main(args)`` in the forked
    agent; 0 is handed back to torchrun's wrapper as a return value, any other status exits the rank."""
    import sys
    import types

    from backend.torchrun_loopback import run_module

    seen = []
    mod = types.ModuleType("shardscope_fake_rank")
    mod.main = lambda argv: seen.append(list(argv)) or (3 if "--fail" in argv else 0)
    monkeypatch.setitem(sys.modules, "shardscope_fake_rank", mod)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert run_module("shardscope_fake_rank", "--run-dir", "d") == 0
    assert seen == [["--run-dir", "d"]] and sys.argv == ["shardscope_fake_rank", "--run-dir", "d"]
    with pytest.raises(SystemExit) as exc:
        run_module("shardscope_fake_rank", "--fail")
    assert exc.value.code == 3
