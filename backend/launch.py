"""Launching ranks with torchrun and following them (no torch imported here, ever).

``launch(cfg, out_dir)`` starts torchrun (``python -m backend.torchrun_loopback --nproc-per-node=N
-m backend.worker``: torchrun with its rendezvous on loopback only) in its own process group, and
returns a :class:`Run` at once. Where the ranks use this interpreter, the agent is forked from this
process's fork server (backend.forkserver), which imported torch and the backend once: a process that
launches many runs (the tests, benchmarks/accuracy.py) pays those imports once, not per run. A monitor
thread starts the agent, forwards the ranks' events into ``events.jsonl`` (and :meth:`Run.events`),
enforces the timeout, and writes the final ``measurement.json`` and a ``finished`` or ``failed`` event. Cancelling, a timeout or a rank
failure ends every process: the agent's group and each rank's own group (torchrun starts
ranks in new sessions) get SIGTERM, then SIGKILL; ranks also carry a parent-death signal.

Legacy ``parallel.dp_mode = "dataparallel"`` (``nn.DataParallel``) starts ONE process
(``--nproc-per-node=1``, :func:`processes_for`) that drives ``parallel.dp`` GPUs; everything else
(records, events, timeout, cancel) is the same. That process writes one measurement record per
GPU, so the run still assembles ``parallel.dp`` rows. Where it cannot run (fewer than two CUDA
GPUs) the process refuses and the record says why (backend.train.check_supported).

Multi-node runs go through an existing scheduler (a Slurm batch script running torchrun with
c10d rendezvous) or per-host torchrun commands: see :mod:`backend.cluster`.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from backend import forkserver
from backend.blame import blame
from backend.events import describe
from backend.records import (
    TERMINAL_EVENTS,
    Measurement,
    RunDir,
    RunDirTaken,
    append_jsonl,
    assemble,
    disk_full,
    iter_new_lines,
    runs_root,
    tail,
)
from backend.torchrun_loopback import AGENT_PRELOAD, forked_main
from engine.backend_limits import predict_only
from engine.config import Config, ConfigError
from engine.time.ops import profile_record

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STEPS = 5
DEFAULT_TIMEOUT_S = 300.0
KILL_GRACE_S = 3.0
#: after a rank reports failure, how long torchrun gets to wind down before we end it
FAILURE_GRACE_S = 5.0
#: a run that has said nothing for this long says what it is doing (a ``phase`` event): no phase of a
#: run is silent for more than about this (the ranks' imports, the measured step)
HEARTBEAT_S = 2.0


def default_run_dir(base: str | Path | None = None) -> Path:
    """A new run's directory: a timestamp under ``base`` (default ``backend.records.runs_root()``)."""
    return Path(runs_root() if base is None else base) / _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def processes_for(cfg: Config) -> int:
    """Processes torchrun starts for ``cfg``: one per rank, or one for nn.DataParallel (it drives every GPU)."""
    return 1 if cfg.parallel.dp_mode == "dataparallel" else cfg.parallel.world_size


def _this_interpreter(python: str) -> bool:
    """Whether ``python`` is the interpreter running this process, with its site-packages."""
    return os.path.realpath(python) == os.path.realpath(sys.executable) and not sys.flags.no_site


def _has_torch(python: str) -> bool:
    if _this_interpreter(python):
        return importlib.util.find_spec("torch") is not None
    try:
        rc = subprocess.run([python, "-c", "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"],
                            capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return False
    return rc == 0


def torch_missing(python: str) -> str:
    """What to do when ``python`` (the ranks' interpreter) has no torch."""
    return (f"torch is not installed for {python}: install it with `{python} -m pip install 'torch>=2.6'` "
            "(on a machine without a GPU add --index-url https://download.pytorch.org/whl/cpu for the CPU build; "
            "see README, 'Installing torch deliberately') to run configurations")


forkserver.want(AGENT_PRELOAD)


class _ForkedAgent:
    """The torchrun agent forked from the fork server (backend.torchrun_loopback.forked_main), behind the
    part of subprocess.Popen's interface that :class:`Run` uses."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path):
        self._proc = forkserver.context().Process(target=forked_main, args=(args, str(log_path), env),
                                                  daemon=False, name="torchrun-agent")
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("torchrun agent", timeout)
        return self.returncode


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


class Run:
    """A launched (or refused) run. Iterate :meth:`events`, or :meth:`wait` for the end."""

    def __init__(self, run_dir: RunDir | None, cfg: Config | None, steps: int, timeout_s: float,
                 path: Path | None = None):
        self.dir = run_dir  # None: refused before a directory was claimed (nothing on disk)
        self.path = run_dir.path if run_dir is not None else Path(path)
        self.refused = False  # refused before anything started (a user mistake: exit 2)
        self.write_error: str | None = None  # the first record this process could not write
        self.cfg = cfg
        self.steps = steps
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | _ForkedAgent | None = None
        self._queue: queue.Queue[dict] = queue.Queue()
        self._last_said = time.monotonic()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_pids: dict[int, int] = {}
        self.result: dict | None = None  # the terminal event

    # ----------------------------------------------------------------- public

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result["event"] == "finished"

    def events(self, timeout_s: float | None = None) -> Iterator[dict]:
        """Yield each event as it happens, ending with ``finished``, ``failed`` or ``cancelled``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                ev = self._queue.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                continue
            yield ev
            if ev["event"] in TERMINAL_EVENTS:
                return

    def wait(self, timeout_s: float | None = None) -> dict | None:
        """Block until the run ends; returns the terminal event (None if still running)."""
        self._done.wait(timeout_s)
        return self.result

    def cancel(self) -> None:
        """Stop every process of the run (SIGTERM, then SIGKILL); the record ends with a ``cancelled`` event."""
        self._cancel.set()
        self._done.wait(KILL_GRACE_S + 30)

    def measurement(self) -> Measurement:
        """The assembled measurement (after a successful run)."""
        self.wait()
        if not self.dir.measurement.exists():
            reason = self.result.get("reason") if self.result else "no result"
            raise RuntimeError(f"run {self.path} has no measurement: {reason}")
        return Measurement.load(self.dir.measurement)

    # ----------------------------------------------------------------- internals

    def _emit(self, event: str, **fields) -> dict:
        obj = {"event": event, "time": time.time(), **fields}
        if self.dir is not None and self.write_error is None:
            try:
                append_jsonl(self.dir.events, obj)
            except OSError as exc:  # a full or vanished disk: the run goes on being followed in memory
                self.write_error = f"cannot write {self.dir.events}: {exc.strerror or exc}"
        if event in TERMINAL_EVENTS and self.write_error and event != "finished":
            obj["reason"] = f"{obj.get('reason')}; {self.write_error}"
        self._queue.put(obj)
        self._last_said = time.monotonic()
        if event in TERMINAL_EVENTS:
            self.result = obj
            self._done.set()
        return obj

    def _start(self, python: str, extra_env: dict[str, str] | None) -> None:
        cfg = self.cfg
        world = cfg.parallel.world_size  # measurement rows (GPUs)
        procs = processes_for(cfg)  # processes torchrun starts
        cmd, env = local_torchrun(python, procs, "backend.worker",
                                  ["--run-dir", str(self.path.resolve()), "--steps", str(self.steps)],
                                  {"PYTHONUNBUFFERED": "1",
                                   "TORCHELASTIC_ERROR_FILE": str(self.dir.logs / "error.json"),
                                   **(extra_env or {})})
        extra = {} if procs == world else {"processes": procs, "dp_mode": cfg.parallel.dp_mode}
        self._emit("started", world=world, steps=self.steps, command=cmd, run_dir=str(self.path), **extra)
        log = open(self.dir.agent_log, "ab")  # noqa: SIM115 - closed by the monitor

        def spawn() -> None:
            if _this_interpreter(python):  # forked from the fork server (the first: after the server's imports)
                self.proc = _ForkedAgent(cmd[3:], env, self.dir.agent_log)  # cmd: python -m backend.torchrun_loopback ...
            else:
                self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)

        self._thread = threading.Thread(target=self._monitor, args=(log, procs), kwargs={"rows": world, "spawn": spawn},
                                        daemon=True, name=f"shardscope-run-{self.path.name}")
        self._thread.start()

    def _spawn(self, spawn, start: float) -> None:
        """Start the agent (``spawn``) in a thread of its own, saying every few seconds that it is starting:
        the first agent forked in a process waits for the fork server to import torch and the backend."""
        failure: list[BaseException] = []

        def run() -> None:
            try:
                spawn()
            except BaseException as exc:  # noqa: BLE001 - reported as the run's failure below
                failure.append(exc)

        starter = threading.Thread(target=run, daemon=True, name=f"shardscope-spawn-{self.path.name}")
        starter.start()
        while starter.is_alive():
            starter.join(0.1)
            if starter.is_alive() and time.monotonic() - self._last_said > HEARTBEAT_S:
                self._emit("phase", message=f"starting torchrun (importing torch and the backend) … "
                                            f"{time.monotonic() - start:.0f} s")
        if failure:
            raise failure[0]

    def _kill_all(self) -> None:
        """SIGTERM the agent's group and every rank's group, then SIGKILL what is left."""
        groups = []
        if self.proc is not None:
            groups.append(self.proc.pid)
        groups += list(self._worker_pids.values())
        for g in groups:
            _kill_group(g, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline:
            if (self.proc is None or self.proc.poll() is not None) and not any(
                    _alive(p) for p in self._worker_pids.values()):
                break
            time.sleep(0.05)
        for g in groups:
            _kill_group(g, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in self._worker_pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _poll_ranks(self, world: int, offsets: dict[int, int], rank_events: dict[int, list[dict]]) -> None:
        for r in range(world):
            new, offsets[r] = iter_new_lines(self.dir.rank_events(r), offsets.get(r, 0))
            for ev in new:
                rank_events.setdefault(r, []).append(ev)
                if "pid" in ev:
                    self._worker_pids[r] = int(ev["pid"])
                kind = ev.get("event")
                if kind == "rank_ready":
                    self._emit("rank_ready", rank=r, stages=ev.get("stages"), pid=ev.get("pid"))
                elif kind == "step":
                    self._emit("step", **{k: ev[k] for k in ("k", "n", "loss", "seconds") if k in ev})
                elif kind == "failed":
                    self._queue.put({"event": "rank_failed", "rank": r, "reason": ev.get("reason")})

    def _monitor(self, log, world: int, spawn=None, rows: int | None = None) -> None:
        """Start the agent (``spawn``), follow ``world`` processes; on success assemble ``rows`` measurement
        records (default: world)."""
        start = time.monotonic()
        offsets: dict[int, int] = {}
        rank_events: dict[int, list[dict]] = {}
        reason = None
        first_failure_at = None
        try:
            if spawn is not None:
                self._spawn(spawn, start)
            while True:
                self._poll_ranks(world, offsets, rank_events)
                rc = self.proc.poll()
                if rc is not None:
                    break
                if self._cancel.is_set():
                    reason = "cancelled"
                    break
                if time.monotonic() - start > self.timeout_s:
                    last = max((e["k"] for evs in rank_events.values() for e in evs if e.get("event") == "step"),
                               default=0)
                    reason = (f"timed out after {self.timeout_s:g} s (last completed step {last} of "
                              f"{self.steps}); every process was killed")
                    break
                if first_failure_at is None and any(e.get("event") == "failed" for evs in rank_events.values()
                                                     for e in evs):
                    first_failure_at = time.monotonic()
                if first_failure_at is not None and time.monotonic() - first_failure_at > FAILURE_GRACE_S:
                    break
                if time.monotonic() - self._last_said > HEARTBEAT_S:
                    self._emit("phase", message=phase_of(rank_events, world, self.steps, time.monotonic() - start))
                time.sleep(0.1)
            if self.proc.poll() is None:
                self._kill_all()
            rc = self.proc.returncode
            # anything the ranks wrote while we were stopping
            self._poll_ranks(world, offsets, rank_events)
            self._kill_all()  # ranks live in their own sessions: make sure none outlives the run
            log.close()
            if reason is None and rc == 0:
                self._finish(rows or world, time.monotonic() - start)
            elif reason == "cancelled":
                self._emit("cancelled", reason="cancelled by the user; every process was stopped")
            else:
                self._fail(reason, rc, rank_events)
        except Exception as exc:  # noqa: BLE001 - the record must always end
            try:
                self._kill_all()
            finally:
                self._emit("failed", reason=f"launcher error: {type(exc).__name__}: {exc}", rank=None,
                           log_tail=tail(self.dir.agent_log))

    def _finish(self, world: int, seconds: float) -> None:
        records = []
        missing = []
        for r in range(world):
            p = self.dir.rank_measurement(r)
            if p.exists():
                records.append(json.loads(p.read_text(encoding="utf-8")))
            else:
                missing.append(r)
        if missing:
            self._emit("failed", reason=f"ranks {missing} exited without a measurement", rank=missing[0],
                       log_tail=tail(self.dir.rank_log(missing[0])))
            return
        meas = assemble(records)
        from backend.records import write_json_atomic

        write_json_atomic(self.dir.measurement, meas.to_dict())
        write_json_atomic(self.dir.device_profile, profile_record(self.cfg))  # the clock this machine's run is read by
        losses = meas.step.losses
        self._emit("measurement", path=str(self.dir.measurement), step_seconds=meas.step.seconds,
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   total_bytes=[r.total for r in meas.memory.per_rank])
        self._emit("finished", seconds=seconds)

    def _fail(self, reason: str | None, rc: int | None, rank_events: dict[int, list[dict]]) -> None:
        rank, why = blame(rank_events, tail(self.dir.agent_log, 400))
        if reason is None:
            reason = f"rank {rank} {why}" if rank is not None else f"torchrun exited with code {rc}"
        full = disk_full(self.path)
        if full:
            reason = f"{reason}; {full}"
        log_path = self.dir.rank_log(rank) if rank is not None else self.dir.agent_log
        log_tail = tail(log_path) or tail(self.dir.agent_log)
        self._emit("failed", reason=reason, rank=rank, exit_code=rc, log_tail=log_tail)


def refused_run(out_dir: Path, reason: str, cfg: Config | None = None, steps: int = 0) -> Run:
    """A launch refused before anything started: a Run that has already failed, with nothing
    written to disk (``out_dir`` is not created)."""
    run = Run(None, cfg, steps, 0.0, path=out_dir)
    run.refused = True
    run._emit("failed", reason=reason, rank=None, log_tail="")
    return run


def local_torchrun(python: str, nproc: int, module: str, args: list[str],
                   extra_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a one-node torchrun of ``module`` on this machine with every
    listening socket on loopback (:mod:`backend.torchrun_loopback`: torchrun with its rendezvous
    stores served on 127.0.0.1; gloo and NCCL bootstrap on ``lo``)."""
    cmd = [python, "-m", "backend.torchrun_loopback", "--nnodes=1", f"--nproc-per-node={nproc}",
           "--rdzv-backend=shardscope-loopback", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4()}",
           "--max-restarts=0", "--local-addr=127.0.0.1", "--monitor-interval=0.2", "-m", module, *args]
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
        "NCCL_SOCKET_IFNAME": env.get("NCCL_SOCKET_IFNAME", "lo"),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    env.update(extra_env or {})
    return cmd, env


def prepare(cfg: Config | str | Path, out_dir: str | Path | None) -> tuple[Path, Config | None, Run | None]:
    """The requested run directory and the Config of a launch — or, when the config cannot be read or
    is one the backend cannot run on any machine (``engine.backend_limits.predict_only``: what the
    ranks would refuse once started), a refused Run (every launcher, local or cluster, starts here;
    :func:`claim` then takes the directory)."""
    out = Path(out_dir) if out_dir is not None else default_run_dir()
    if not isinstance(cfg, Config):
        try:
            cfg = Config.load(cfg)
        except ConfigError as exc:
            return out, None, refused_run(out, str(exc))
    why = predict_only(cfg)
    if why:
        return out, cfg, refused_run(out, "predict only, the backend cannot run it: " + "; ".join(why), cfg)
    return out, cfg, None


def claim(out: Path, source: Config | str | Path, fresh: bool = False) -> tuple[RunDir | None, str | None]:
    """Claim the run directory (:meth:`RunDir.claim`): the RunDir, or None and why it was refused.

    ``source`` is what the launch was given: a config file inside ``out`` may stay there (the window
    writes its config into the directory it runs in). Nothing is written when it is refused."""
    config_file = None if isinstance(source, Config) else Path(source)
    try:
        if fresh:
            return RunDir.claim_fresh(out, config_file), None
        return RunDir.claim(out, config_file), None
    except RunDirTaken as exc:
        return None, f"--out {exc}"
    except OSError as exc:
        return None, f"cannot create the run directory {out}: {exc.strerror or exc}"


def launch(cfg: Config | str | Path, out_dir: str | Path | None = None, steps: int = DEFAULT_STEPS,
           timeout_s: float = DEFAULT_TIMEOUT_S, python: str | None = None,
           env: dict[str, str] | None = None, fresh: bool = False) -> Run:
    """Start the ranks of ``cfg`` (a Config or a config file) and return the :class:`Run` at once.

    Never raises for a bad job: an invalid config, a bad ``steps``, a run directory that is taken
    (:meth:`RunDir.claim`) or a Python without torch gives a Run that has already failed with the
    reason (``run.refused``), having written nothing. ``python`` is the interpreter the ranks use
    (default: this one); ``env`` adds environment variables for the ranks; ``fresh``: run in a new
    sub-directory of ``out_dir``.
    """
    source = cfg
    out, cfg, refused = prepare(cfg, out_dir)
    if refused is not None:
        return refused
    if steps < 1:
        return refused_run(out, f"steps = {steps}: must be at least 1", cfg)
    python = python or sys.executable
    if not _has_torch(python):
        return refused_run(out, torch_missing(python), cfg, steps)
    run_dir, why = claim(out, source, fresh)
    if run_dir is None:
        return refused_run(out, why, cfg, steps)
    try:
        cfg.save(run_dir.config)
    except OSError as exc:
        return refused_run(out, f"cannot write {run_dir.config}: {exc.strerror or exc}", cfg, steps)
    run = Run(run_dir, cfg, steps, timeout_s)
    run._start(python, env)
    return run


def run_cli(config_path: str | Path, out_dir: str | Path | None = None, steps: int = DEFAULT_STEPS,
            json_events: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, stream=None,
            fresh: bool = False) -> int:
    """``shardscope run``: launch, print progress (or one JSON event per line), return an exit code
    (:func:`follow_cli`)."""
    run = launch(config_path, out_dir, steps=steps, timeout_s=timeout_s, fresh=fresh)
    return follow_cli(run, json_events, stream)


#: the exit code of a run the user cancelled (as a shell reports a command stopped by Ctrl-C)
EXIT_CANCELLED = 130


def phase_of(rank_events: dict[int, list[dict]], world: int, steps: int, elapsed: float) -> str:
    """What a local run is doing, from its ranks' events so far (``world`` processes)."""
    def count(kind: str) -> int:
        return sum(any(e.get("event") == kind for e in rank_events.get(r, ())) for r in range(world))

    started, ready, done = count("rank_started"), count("rank_ready"), count("rank_done")
    last = max((e.get("k", 0) for evs in rank_events.values() for e in evs if e.get("event") == "step"), default=0)
    if ready == 0 and started < world:
        what = f"starting the ranks: {started} of {world} processes up (torchrun, python, importing torch)"
    elif ready < world:
        what = (f"starting the ranks: {ready} of {world} ready (importing torch, the process groups, building "
                "and wrapping the model)")
    elif last < steps:
        what = f"running step {last + 1}/{steps}"
    elif done < world:
        what = (f"measuring memory: one more, untimed step under torch's MemTracker ({done} of {world} ranks "
                "done)")
    else:
        what = "collecting the measurement: the ranks are exiting"
    return f"{what} … {elapsed:.0f} s"


def follow_cli(run: Run, json_events: bool = False, stream=None, cancel_wait_s: float | None = None) -> int:
    """Print a run's events as they happen (words, or one JSON object per line) and return the exit
    code: 0 finished, 1 failed, 2 refused before it started (the reason on stderr: a user mistake),
    130 cancelled. Ctrl-C or SIGTERM (the window's Cancel) cancels the run: every process is stopped,
    the record ends ``cancelled``, and that is printed."""
    stream = stream or sys.stdout

    def show(ev: dict) -> None:
        stream.write((json.dumps(ev) if json_events else describe(ev)) + "\n")
        stream.flush()

    if run.refused:
        if json_events:
            show(run.result)
        else:
            print(f"shardscope: {run.result['reason']}", file=sys.stderr)
        return 2
    previous = _sigterm_raises_interrupt()
    try:
        try:
            for ev in run.events():
                show(ev)
        except KeyboardInterrupt:
            if not json_events:
                stream.write("cancelling: stopping every process of the run ...\n")
                stream.flush()
            run.cancel()
            res = run.wait(cancel_wait_s)
            if res is not None:
                show(res)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result = run.wait() or {}
    return {"finished": 0, "cancelled": EXIT_CANCELLED}.get(result.get("event"), 1)


def _sigterm_raises_interrupt():
    """SIGTERM (the window's Cancel, a `kill`) ends the CLI like Ctrl-C, so the run is cancelled and
    recorded instead of its agent being orphaned; returns the previous handler (None off the main thread)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        return None
