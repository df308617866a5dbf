"""Emulated cluster hosts for the cluster tests, on this machine only.

* :class:`NetnsPair` — two network namespaces joined by a veth pair, each end named ``ss0``,
  addresses 10.231.0.1 and 10.231.0.2 that exist only inside these namespaces.
* :class:`SlurmCluster` — munge + slurmctld + two slurmd (nodes n1, n2), slurmctld and n1 in
  the first namespace, n2 in the second, every file in a temp dir; clients run in the first
  namespace (:meth:`SlurmCluster.client`).

Everything started is recorded by PID and stopped by PID in ``close()``, which also deletes
the namespaces; each wait is bounded. See shared/reference/cluster-testing.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SUBNET = "10.231.0"
IFNAME = "ss0"


def missing_tools(*names: str) -> list[str]:
    return [n for n in names if shutil.which(n) is None]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=check)


class NetnsPair:
    """Two namespaces ``ss<pid>a``/``ss<pid>b`` with a veth between them (``ss0`` in each)."""

    def __init__(self) -> None:
        tag = f"ss{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
        self.names = [f"{tag}a", f"{tag}b"]
        self.addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.created: list[str] = []
        try:
            for n in self.names:
                _run("ip", "netns", "add", n)
                self.created.append(n)
                _run("ip", "-n", n, "link", "set", "lo", "up")
            a, b = f"{tag}x", f"{tag}y"
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            for end, ns, addr in ((a, self.names[0], self.addrs[0]), (b, self.names[1], self.addrs[1])):
                _run("ip", "link", "set", end, "netns", ns)
                _run("ip", "-n", ns, "link", "set", end, "name", IFNAME)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _run("ip", "-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.close()
            raise

    def enter(self, i: int) -> list[str]:
        """Argv prefix that runs a command in namespace i (nsenter: keeps /sys as it is)."""
        return ["nsenter", f"--net=/run/netns/{self.names[i]}"]

    def close(self) -> None:
        for n in self.created:
            # what still runs in it first: a job step's slurmstepd outlives its slurmd (its own session), and
            # one left behind (a cancelled job's) kept the next run's 2-node jobs PENDING until they timed out
            pids = _run("ip", "netns", "pids", n, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", n, check=False)  # deleting a namespace deletes its veth end
        self.created = []


def stop_pids(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM each recorded pid, wait (bounded), then SIGKILL what is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


SLURM_CONF = """\
ClusterName=shardscope-test
SlurmctldHost={host}({ctl_addr})
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
KillWait=2
InactiveLimit=0
SlurmctldTimeout=10
SlurmdTimeout=10
MpiDefault=none
NodeName=n1 NodeAddr={addr1} NodeHostname={host} Port=6818 CPUs=1 State=UNKNOWN
NodeName=n2 NodeAddr={addr2} NodeHostname={host} Port=6819 CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munge + slurmctld + slurmd n1 (namespace 0) + slurmd n2 (namespace 1)."""

    def __init__(self, net: NetnsPair, start_timeout_s: float = 30.0):
        import socket

        self.net = net
        self.dir = Path(tempfile.mkdtemp(prefix="shardscope-slurm-"))
        os.chmod(self.dir, 0o755)  # munged (user munge) must reach its socket directory
        self.conf = self.dir / "slurm.conf"
        self.pids: list[int] = []
        self._logs = []
        try:
            self._start(socket.gethostname().split(".")[0], start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def client(self) -> list[str]:
        """Argv prefix for Slurm clients (sbatch, scontrol, ...): the controller's namespace."""
        return self.net.enter(0)

    def _spawn(self, argv: list[str], log: str, **kw) -> subprocess.Popen:
        f = open(self.dir / log, "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(f)
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                             start_new_session=True, **kw)
        self.pids.append(p.pid)
        return p

    def _start(self, host: str, timeout_s: float) -> None:
        d = self.dir
        munge = d / "munge"
        munge.mkdir(mode=0o755)
        for sub in ("state", "spool/n1", "spool/n2"):
            (d / sub).mkdir(parents=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        self.munge_socket = munge / "munge.sock"
        self._spawn(["munged", "-F", f"--socket={self.munge_socket}",
                     f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                     f"--seed-file={munge}/munged.seed"], "munged.out", user="munge", group="munge",
                    extra_groups=[])
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged did not create its socket")
        self.conf.write_text(SLURM_CONF.format(host=host, ctl_addr=self.net.addrs[0], munge_socket=self.munge_socket,
                                               d=d, addr1=self.net.addrs[0], addr2=self.net.addrs[1]))
        self._spawn([*self.net.enter(0), "slurmctld", "-D", "-c", "-f", str(self.conf)], "slurmctld.out")
        for i, node in enumerate(("n1", "n2")):
            self._spawn([*self.net.enter(i), "slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd.{node}.out")
        self._wait(lambda: self.node_states() == {"n1": "idle", "n2": "idle"}, timeout_s,
                   "the two slurmd did not register as idle nodes")

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout_s:g} s; logs in {self.dir}:\n{self.logs()}")

    def node_states(self) -> dict[str, str]:
        p = subprocess.run([*self.client(), "sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                           env=self.env, timeout=10)
        return dict(line.split() for line in p.stdout.splitlines() if len(line.split()) == 2)

    def logs(self) -> str:
        out = []
        for p in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            lines = p.read_text(errors="replace").splitlines()[-15:]
            out.append(f"--- {p.name} ---\n" + "\n".join(lines))
        return "\n".join(out)

    def close(self) -> None:
        if self.conf.exists() and self.pids:
            subprocess.run([*self.client(), "scancel", "--full", "--user=root"], capture_output=True, env=self.env,
                           timeout=10, check=False)
            time.sleep(0.5)
        stop_pids(list(reversed(self.pids)))
        self.pids = []
        for f in self._logs:
            f.close()
        self._logs = []
        shutil.rmtree(self.dir, ignore_errors=True)
