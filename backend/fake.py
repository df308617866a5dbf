"""Measure huge configurations without the hardware: simulate ranks in child processes (no torch here).

``simulate(cfg)`` runs ``backend.fake_worker --run-dir D --rank R`` once per chosen rank (by
default one rank per pipeline stage: dp = 0, tp = 0, and its last cp-rank where they differ), each in a
process of its own forked from a fork server (backend.forkserver: multiprocessing's "forkserver", started once per process, which imports
torch and the backend once: ``RANK_PRELOAD``), and stores what they report as
a run directory with the same ``measurement.json`` as a real run, marked ``"simulated": true``.
Each worker runs the real backend code path (model, apply_* strategies, Trainer's step and
MemTracker measurement) on a fake process group with fake tensors: see backend.fake_worker.

    from backend.fake import simulate
    res = simulate(cfg, out_dir="runs/x")        # SimulatedRun; raises SimulationError on failure
    res.measurement.memory.per_rank[0].activations
    res.warnings, res.not_covered                # tracker cross-check, what a simulation leaves out
    res.records[0]["allocator"]["max_reserved"]  # the modelled caching allocator's max_memory_reserved

``measure_cli`` is ``shardscope measure CONFIG --fake``.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from backend import forkserver, worker
from backend.records import (
    Measurement,
    RunDir,
    RunDirTaken,
    assemble,
    read_jsonl,
    runs_root,
    tail,
    write_json_atomic,
)
from engine.config import Config
from engine.memory.activations import cp_ranks_differ
from engine.names import MEMORY_CATEGORIES
from engine.pipeline.layout import rank_of

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT_S = 300.0


class SimulationError(RuntimeError):
    """A simulated rank failed; the message carries the reason and the tail of its log."""


@dataclass
class SimulatedRun:
    path: Path
    ranks: list[int]
    measurement: Measurement
    seconds: float
    warnings: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[dict]:
        return self.measurement.ranks


def default_ranks(cfg: Config) -> list[int]:
    """One rank per pipeline rank (its first DP replica and TP shard): each distinct stage set; and where
    the cp-ranks differ (the per-op policy over the ring attention, ``engine.memory.activations.cp_ranks_differ``)
    the last cp-rank of each too, the one that saves the most."""
    par = cfg.parallel
    cps = (0, par.cp - 1) if cp_ranks_differ(cfg) else (0,)
    return [rank_of(p, 0, 0, par.dp, par.tp, c, par.cp) for p in range(par.pp) for c in cps]


def _default_run_dir() -> Path:
    import datetime as _dt

    return runs_root() / (_dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f") + "-fake")


#: what every simulated rank imports before its work; the fork server imports it once (3-4 s of CPU a rank
#: on this 2-core machine, which each rank's own interpreter paid before)
RANK_PRELOAD = ["backend.fake_worker", "backend.measure", "torch.distributed._tools.mem_tracker",
                "torch.testing._internal.distributed.fake_pg", *worker.PRELOAD]


forkserver.want(RANK_PRELOAD)


def _simulated_rank(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """One simulated rank, forked from the fork server: its own session (so that it can be stopped as a
    group, as a child process was), its output to its log, the environment a child process had."""
    forkserver.as_child_process(REPO_ROOT, log_path, env)
    gc.freeze()  # the server's imports: out of the rank's collections (as backend.torchrun_loopback does)
    code = 1
    try:
        from backend import fake_worker

        code = fake_worker.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _RankProcess:
    """A simulated rank's process, forked (``python=None``) or a fresh interpreter (``python``)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str], python: str | None):
        self.proc = self.log = None
        if python is None:
            self.proc = forkserver.context().Process(target=_simulated_rank, args=(argv, str(log_path), env),
                                               daemon=False)
            self.proc.start()
        else:
            self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop() / poll()
            self.proc = subprocess.Popen([python, "-m", "backend.fake_worker", *argv], cwd=str(REPO_ROOT), env=env,
                                         stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        rc = self.proc.poll() if self.log is not None else self.proc.exitcode
        if rc is not None and self.log is not None:
            self.log.close()
        return rc

    def stop(self) -> None:
        _kill_group(self.pid)
        if self.log is not None:
            self.proc.wait()
            self.log.close()
        else:
            self.proc.kill()  # (stopped before its setsid, the group above did not exist yet)
            self.proc.join()


def _kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)


def expandable_segments_of(cfg: Config) -> bool:
    """The allocator convention of ``cfg`` (``conventions.expandable_segments`` where the config
    has that field), else False: torch's default."""
    return bool(getattr(getattr(cfg, "conventions", None), "expandable_segments", False))


def simulate(cfg: Config | str | Path, out_dir: str | Path | None = None, ranks: list[int] | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, python: str | None = None, real_tensors: bool = False,
             jobs: int | None = None, expandable_segments: bool | None = None, fresh: bool = False) -> SimulatedRun:
    """Simulate ``ranks`` of ``cfg`` (default :func:`default_ranks`), each in a child process.

    ``real_tensors`` runs the same path with real tensors (the reference the fake ones are
    checked against; only for small configs). ``jobs``: how many ranks run at once (default:
    the CPU count). ``expandable_segments``: the caching-allocator convention each rank's
    allocations are replayed with (None: :func:`expandable_segments_of` the config). ``out_dir`` is
    claimed as a real run's is (:meth:`RunDir.claim`; ``fresh``: a new sub-directory of it). Raises
    ValueError for a rank outside the world, RunDirTaken (a ValueError) or OSError for a run directory
    that cannot be had (nothing written), SimulationError when a rank fails or times out (every child
    is killed).
    """
    config_file = None
    if not isinstance(cfg, Config):
        config_file, cfg = Path(cfg), Config.load(cfg)
    world = cfg.parallel.world_size
    ranks = sorted(set(default_ranks(cfg) if ranks is None else ranks))
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"rank {bad[0]} is outside the world of {world} ranks (0..{world - 1})")
    if expandable_segments is None:
        expandable_segments = expandable_segments_of(cfg)
    out = Path(out_dir) if out_dir is not None else _default_run_dir()
    run = RunDir.claim_fresh(out, config_file) if fresh else RunDir.claim(out, config_file)
    cfg.save(run.config)
    run.emit("started", world=world, simulated=True, ranks=ranks, run_dir=str(run.path))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    if python is not None and os.path.abspath(python) == os.path.abspath(sys.executable):
        python = None  # this interpreter (not merely the same binary: a venv's python links to its base's)
    jobs = max(1, jobs or os.cpu_count() or 1)
    start = time.monotonic()
    pending = list(ranks)
    running: dict[int, _RankProcess] = {}
    failure: str | None = None
    try:
        while (pending or running) and failure is None:
            while pending and len(running) < jobs:
                r = pending.pop(0)
                argv = ["--run-dir", str(run.path.resolve()), "--rank", str(r)]
                if real_tensors:
                    argv.append("--real-tensors")
                if expandable_segments:
                    argv.append("--expandable-segments")
                running[r] = _RankProcess(argv, run.rank_log(r), env, python)
            for r, proc in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[r]
                if rc != 0 or not run.rank_measurement(r).exists():
                    reasons = [e.get("reason") for e in read_jsonl(run.rank_events(r)) if e.get("event") == "failed"]
                    why = reasons[-1] if reasons else f"exited with code {rc}"
                    failure = f"rank {r}: {why}\n--- log tail ---\n{tail(run.rank_log(r))}"
            if failure is None and time.monotonic() - start > timeout_s:
                failure = f"timed out after {timeout_s:g} s; every simulated rank was stopped"
            time.sleep(0.05)
    finally:
        for proc in running.values():
            proc.stop()
    seconds = time.monotonic() - start
    if failure is not None:
        run.emit("failed", reason=failure.split("\n", 1)[0], log_tail=failure, simulated=True)
        raise SimulationError(failure)

    records = [json.loads(run.rank_measurement(r).read_text(encoding="utf-8")) for r in ranks]
    meas = assemble(records)
    warnings = [f"rank {rec['rank']}: {w}" for rec in records for w in rec["cross_check"]["warnings"]]
    not_covered = list(dict.fromkeys(n for rec in records for n in rec["not_covered"]))
    doc = meas.to_dict()
    doc.update({"simulated": True, "simulated_ranks": ranks, "fake_tensors": not real_tensors,
                "warnings": warnings, "not_covered": not_covered})
    write_json_atomic(run.measurement, doc)
    run.emit("measurement", path=str(run.measurement), simulated=True,
             total_bytes=[r.total for r in meas.memory.per_rank])
    run.emit("finished", seconds=seconds)
    return SimulatedRun(run.path, ranks, meas, seconds, warnings, not_covered)


# --------------------------------------------------------------------------- comparison


def comparison(cfg: Config, meas: Measurement) -> list[dict]:
    """Per simulated rank and category (and total): predicted, measured, measured − predicted."""
    from engine.predict import predict

    pred = {r.rank: r for r in predict(cfg).memory.per_rank}
    rows = []
    for m in meas.memory.per_rank:
        p = pred[m.rank]
        for c in (*MEMORY_CATEGORIES, "total"):
            pv, mv = int(getattr(p, c)), int(getattr(m, c))
            rows.append({"rank": m.rank, "stage": m.stage, "category": c, "predicted": pv, "measured": mv,
                         "difference": mv - pv})
    return rows


def render(cfg: Config, res: SimulatedRun) -> str:
    rows = comparison(cfg, res.measurement)
    big = max((max(x["predicted"], x["measured"]) for x in rows), default=0) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    lines = [f"simulated ranks {', '.join(map(str, res.ranks))} of {cfg.parallel.world_size} "
             f"in {res.seconds:.1f} s (fake process group + fake tensors) -> {res.path}"]
    for rec in res.records:
        r = rec["rank"]
        lines.append("")
        lines.append(f"rank {r} (pp {rec['coords']['pp']}, stages {','.join(map(str, rec['stages']))}"
                     + (f", microbatches in flight {rec['in_flight']}" if rec.get("in_flight") else "")
                     + f"): {unit}, {rec['seconds']['total']:.1f} s, peak RSS {rec['peak_rss_bytes'] / 2**20:.0f} MiB")
        lines.append(f"  {'category':<13}{'predicted':>11}{'simulated':>11}{'sim - pred':>12}")
        for row in (x for x in rows if x["rank"] == r):
            lines.append(f"  {row['category']:<13}{row['predicted'] / scale:>11.3f}{row['measured'] / scale:>11.3f}"
                         f"{row['difference'] / scale:>+12.3f}")
        alloc = rec.get("allocator")
        if alloc:
            mode = "expandable segments" if alloc["expandable_segments"] else "default segments"
            need = " without the device's capacity" if alloc.get("oom") else ""
            lines.append(f"  caching allocator (modelled, {mode}){need}: allocated {alloc['max_allocated'] / scale:.3f}, "
                         f"reserved {alloc['max_reserved'] / scale:.3f} {unit} at most; "
                         f"{alloc['segments']} segments at the end")
            if alloc.get("oom"):
                lines.append(f"  out of memory: {alloc['oom']}")
    if res.warnings:
        lines.append("")
        lines.append("tracker cross-check (params / grads / optimizer are reported from exact local bytes):")
        lines += [f"  {w}" for w in res.warnings]
    lines.append("")
    lines.append("not covered by a simulation:")
    lines += [f"  - {n}" for n in res.not_covered]
    return "\n".join(lines)


def reserved_rows(res: SimulatedRun) -> list[dict]:
    """Per simulated rank: the modelled caching allocator's max allocated and max reserved bytes."""
    return [{"rank": rec["rank"], "max_allocated": rec["allocator"]["max_allocated"],
             "max_reserved": rec["allocator"]["max_reserved"],
             "expandable_segments": rec["allocator"]["expandable_segments"], "oom": rec["allocator"]["oom"]}
            for rec in res.records if rec.get("allocator")]


def measure_cli(config_path: str | Path, ranks: list[int] | None = None, out_dir: str | Path | None = None,
                json_out: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, stream=None,
                expandable_segments: bool | None = None, fresh: bool = False) -> int:
    """``shardscope measure CONFIG --fake``: 0 done, 1 the simulation failed, 2 the run directory
    cannot be had (taken, or a disk that refuses it).

    Raises ConfigError for the caller to report as a user mistake.
    """
    stream = stream or sys.stdout
    cfg = Config.load(config_path)
    try:
        res = simulate(config_path, out_dir, ranks=ranks, timeout_s=timeout_s, expandable_segments=expandable_segments,
                       fresh=fresh)
    except SimulationError as exc:
        print(f"shardscope: simulation failed: {exc}", file=sys.stderr)
        return 1
    except RunDirTaken as exc:
        print(f"shardscope: --out {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"shardscope: cannot write the run directory {out_dir or runs_root()}: {exc.strerror or exc}"
              + (f" ({exc.filename})" if exc.filename else ""), file=sys.stderr)
        return 2
    if json_out:
        doc = json.loads(Path(res.path, "measurement.json").read_text(encoding="utf-8"))
        doc["run_dir"] = str(res.path)
        doc["comparison"] = comparison(cfg, res.measurement)
        doc["reserved"] = reserved_rows(res)
        stream.write(json.dumps(doc, indent=1) + "\n")
    else:
        stream.write(render(cfg, res) + "\n")
    return 0
