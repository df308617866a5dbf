"""Following a run whose ranks run elsewhere: on Slurm nodes or on hosts the user started.

:class:`ClusterRun` is a :class:`backend.launch.Run` (same ``events()``, ``wait()``,
``cancel()``, ``measurement()``) whose ranks are not children of this process. Its monitor
reads the per-rank files under ``ranks/`` of the shared run directory, forwards them into
``events.jsonl``, asks the scheduler (a :class:`Job`) how the job stands, and ends the record
with ``finished`` (``measurement.json`` assembled as for a local run, each rank's entry under
``ranks`` carrying the ``node`` it ran on) or ``failed`` with the scheduler's own reason.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from backend.launch import Run, blame, follow_cli
from backend.records import RunDir, assemble, tail, write_json_atomic
from engine.config import Config

#: how often the scheduler is asked (the rank files are read every 0.1 s)
POLL_S = 0.5
#: after the job ended, how long rank files may take to show up on a shared filesystem
SETTLE_S = 10.0
#: after a rank reported failure (no scheduler to tell us), how long before the run is failed
FAILURE_GRACE_S = 5.0
#: after scancel, how long to wait for the scheduler to say the job ended
CANCEL_WAIT_S = 30.0


class ClusterError(ValueError):
    """A cluster request that cannot be made (bad node counts, no hosts): a user mistake."""


def node_layout(cfg: Config, nodes: int | None = None, per_node: int | None = None) -> tuple[int, int]:
    """(nodes, ranks per node) for ``cfg``'s world, from the overrides or the config's cluster."""
    if cfg.parallel.dp_mode == "dataparallel":
        raise ClusterError("parallel.dp_mode = 'dataparallel' runs one process on one machine; "
                           "use --target local, or dp_mode = 'ddp' to run across nodes")
    world = cfg.parallel.world_size
    for name, v in (("--nodes", nodes), ("--gpus-per-node", per_node)):
        if v is not None and v < 1:
            raise ClusterError(f"{name} {v}: must be at least 1")
    if nodes is None and per_node is None:
        per_node = min(cfg.cluster.gpus_per_node, world)
        nodes = -(-world // per_node)
    elif nodes is None:
        nodes = world // per_node if world % per_node == 0 else 0
    elif per_node is None:
        per_node = world // nodes if world % nodes == 0 else 0
    if nodes * per_node != world:
        raise ClusterError(f"the layout has {world} ranks (dp × tp × pp × replicate); "
                           f"{nodes or '?'} node(s) × {per_node or '?'} per node does not make {world}")
    return nodes, per_node


def config_for_layout(cfg: Config, nodes: int, per_node: int) -> Config:
    """The config as it will run: cluster.gpus_per_node set to the ranks per node actually used."""
    if cfg.cluster.gpus_per_node == per_node and cfg.cluster.gpus == nodes * per_node:
        return cfg
    return cfg.replace(cluster={"gpus": nodes * per_node, "gpus_per_node": per_node})


#: pending reasons that never clear by waiting: the job asks for more than the partition,
#: account or QOS allows (Slurm queues it anyway unless EnforcePartLimits is set)
HOPELESS_REASONS = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed", "DependencyNeverSatisfied",
    "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit", "QOSMaxGRESPerJob",
})


@dataclass
class JobState:
    """What the scheduler says about a job."""

    state: str                 # Slurm's JobState (PENDING, RUNNING, COMPLETED, TIMEOUT, ...)
    reason: str | None = None  # Slurm's Reason field
    exit_code: str | None = None
    nodes: str | None = None
    source: str = "scontrol"

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING")

    @property
    def terminal(self) -> bool:
        return self.state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED",
                                  "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED", "RESV_DEL_HOLD",
                                  "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "UNKNOWN")

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"

    @property
    def hopeless(self) -> bool:
        """Pending for a reason that only an administrator can change (Slurm keeps such jobs queued)."""
        return self.state == "PENDING" and (self.reason or "") in HOPELESS_REASONS


class Job:
    """The scheduler side of a cluster run. The base class is "no scheduler" (plain hosts)."""

    name = "hosts"
    job_id: str | None = None

    def poll(self) -> JobState | None:
        return None

    def cancel(self) -> None:
        pass

    def failure(self, st: JobState, cancelled: bool) -> str:
        return f"job ended {st.state}"

    def log_tail(self) -> str:
        return ""


class ClusterRun(Run):
    """A run whose ranks live on other nodes; this process follows the shared run directory."""

    def __init__(self, run_dir: RunDir, cfg: Config, steps: int, timeout_s: float, world: int):
        super().__init__(run_dir, cfg, steps, timeout_s)
        self.world = world
        self.job: Job | None = None
        self.nodes: dict[int, dict] = {}

    def _kill_all(self) -> None:  # never signal pids that belong to other machines
        pass

    def follow(self, job: Job) -> None:
        self.job = job
        self._thread = threading.Thread(target=self._follow, daemon=True, name=f"shardscope-follow-{self.path.name}")
        self._thread.start()

    # ----------------------------------------------------------------- internals

    def _poll_all(self, offsets: dict[int, int], rank_events: dict[int, list[dict]]) -> None:
        seen = {r: len(evs) for r, evs in rank_events.items()}
        self._poll_ranks(self.world, offsets, rank_events)
        for r, evs in rank_events.items():
            for ev in evs[seen.get(r, 0):]:
                if ev.get("event") == "rank_node":
                    facts = {k: v for k, v in ev.items() if k not in ("event", "time", "rank")}
                    self.nodes[r] = facts
                    self._emit("rank_node", rank=r, **facts)

    def _ranks_done(self, rank_events: dict[int, list[dict]]) -> bool:
        return all(any(e.get("event") == "rank_done" for e in rank_events.get(r, ()))
                   and self.dir.rank_measurement(r).exists() for r in range(self.world))

    def _follow(self) -> None:
        job = self.job
        offsets: dict[int, int] = {}
        rank_events: dict[int, list[dict]] = {}
        start = time.monotonic()
        running_since: float | None = None
        last: JobState | None = None
        next_poll = 0.0
        reason = None
        cancelled = False
        cancel_sent_at = None
        first_failure_at = None
        try:
            while True:
                self._poll_all(offsets, rank_events)
                now = time.monotonic()
                st = None
                if now >= next_poll:
                    next_poll = now + POLL_S
                    st = job.poll()
                    if st is not None and (last is None or (st.state, st.reason) != (last.state, last.reason)):
                        self._emit("job_state", job_id=job.job_id, state=st.state, reason=st.reason,
                                   nodes=st.nodes, source=st.source)
                    if st is not None:
                        last = st
                if last is not None and last.terminal:
                    break
                if last is not None and last.hopeless and reason is None:
                    reason = (f"Slurm will not run the job as asked: it stays {last.state} with "
                              f"Reason={last.reason}; cancelled it")
                    cancel_sent_at = now
                    job.cancel()
                if last is not None and last.running and running_since is None:
                    running_since = now
                if self._cancel.is_set() and cancel_sent_at is None:
                    cancelled = True
                    reason = "cancelled"
                    cancel_sent_at = now
                    job.cancel()
                elapsed = now - (running_since if running_since is not None else start)
                if reason is None and self.timeout_s and elapsed > self.timeout_s and (
                        running_since is not None or job.job_id is None):
                    lastk = max((e["k"] for evs in rank_events.values() for e in evs if e.get("event") == "step"),
                                default=0)
                    reason = (f"timed out after {self.timeout_s:g} s (last completed step {lastk} of "
                              f"{self.steps})")
                    cancel_sent_at = now
                    job.cancel()
                if cancel_sent_at is not None and (job.job_id is None or now - cancel_sent_at > CANCEL_WAIT_S):
                    break
                if job.job_id is None:  # no scheduler: the rank files are all we have
                    if self._ranks_done(rank_events):
                        break
                    if first_failure_at is None and any(e.get("event") == "failed" for evs in rank_events.values()
                                                         for e in evs):
                        first_failure_at = now
                    if first_failure_at is not None and now - first_failure_at > FAILURE_GRACE_S:
                        break
                time.sleep(0.1)
            self._conclude(last, reason, cancelled, offsets, rank_events, time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001 - the record must always end
            try:
                job.cancel()
            finally:
                self._emit("failed", reason=f"launcher error: {type(exc).__name__}: {exc}", rank=None,
                           log_tail=job.log_tail())

    def _conclude(self, st: JobState | None, reason: str | None, cancelled: bool, offsets, rank_events,
                  seconds: float) -> None:
        job = self.job
        ok = reason is None and (st.ok if st is not None else True)
        if ok:  # the files may reach this machine a little after the job ended
            deadline = time.monotonic() + SETTLE_S
            while not self._ranks_done(rank_events) and time.monotonic() < deadline:
                time.sleep(0.2)
                self._poll_all(offsets, rank_events)
        self._poll_all(offsets, rank_events)
        if ok and (st is not None or self._ranks_done(rank_events)):
            self._finish(self.world, seconds)
            return
        rank, why = blame(rank_events, job.log_tail())
        parts = []
        if reason is not None:
            parts.append(reason)
        if st is not None and st.terminal:
            parts.append(job.failure(st, cancelled))
        elif st is not None:
            parts.append(f"{job.name} job {job.job_id} was {st.state} when we stopped following it")
        # a rank's own failure leads only when Slurm did not end the job itself (time limit, node, cancel)
        if rank is not None and not cancelled and (st is None or st.state in ("FAILED", "COMPLETED", "UNKNOWN")):
            parts.insert(0, f"rank {rank} {why}")
        if job.job_id is None and reason is not None:
            parts.append("stopped following the run; the torchrun processes on the hosts are yours to stop")
        if not parts:
            parts.append("the ranks stopped without finishing")
        log_tail = (tail(self.dir.rank_log(rank)) if rank is not None else "") or job.log_tail()
        self._emit("cancelled" if cancelled else "failed", reason="; ".join(parts), rank=rank,
                   job_state=st.state if st is not None else None, log_tail=log_tail)

    def _finish(self, world: int, seconds: float) -> None:
        records, missing = [], []
        for r in range(world):
            p = self.dir.rank_measurement(r)
            if p.exists():
                rec = json.loads(p.read_text(encoding="utf-8"))
                if r in self.nodes:
                    rec["node"] = self.nodes[r]
                records.append(rec)
            else:
                missing.append(r)
        if missing:
            self._emit("failed", reason=f"ranks {missing} left no measurement in {self.dir.ranks} "
                                        "(is the run directory on a filesystem every node shares?)",
                       rank=missing[0], log_tail=tail(self.dir.rank_log(missing[0])) or self.job.log_tail())
            return
        meas = assemble(records)
        write_json_atomic(self.dir.measurement, meas.to_dict())
        losses = meas.step.losses
        self._emit("measurement", path=str(self.dir.measurement), step_seconds=meas.step.seconds,
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   total_bytes=[r.total for r in meas.memory.per_rank],
                   nodes=[self.nodes.get(r, {}).get("node") for r in range(world)])
        self._emit("finished", seconds=seconds)


def cluster_run_cli(run: Run, json_events: bool = False, stream=None) -> int:
    """Print a cluster run's events like ``shardscope run`` does (:func:`backend.launch.follow_cli`):
    Ctrl-C cancels (scancel, or stop following the hosts)."""
    return follow_cli(run, json_events, stream, cancel_wait_s=CANCEL_WAIT_S + 10)
