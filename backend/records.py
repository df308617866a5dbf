"""The run directory and its records (no torch).

::

    RUN_DIR/
      config.toml          the Config that ran (Config.save: write-then-rename)
      events.jsonl         one JSON object per line, appended as it happens
      measurement.json     assembled when the run finishes (write-then-rename)
      device-profile.json  beside it: the clock and device profile that time this config on this machine
      logs/torchrun.log    the launcher agent's output
      logs/rank{r}.log     each rank's stdout and stderr
      ranks/rank{r}.events.jsonl, ranks/rank{r}.measurement.json   what each rank reports

Events: ``started`` {world, steps, command}, ``rank_ready`` {rank, stages, pid}, ``step``
{k, n, loss, seconds}, ``measurement`` {path, ...summary}, then ``finished`` {seconds} or
``failed`` {reason, rank, log_tail} or ``cancelled`` {reason} (stopped by the user); a cluster run adds ``submitted``, ``job_state``,
``rank_node``, ``node_command`` and ``waiting``. Each carries ``event`` and ``time`` (Unix
seconds); :func:`backend.events.describe` says each in words.
A reader tolerates a torn last line, so a crash at any moment leaves a readable record.

A run directory is written once: :meth:`RunDir.claim` creates it for one run and refuses a
directory that already holds anything (an earlier run, a second writer, someone's files); its
``.shardscope-run`` file, created exclusively, is the claim.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import platformdirs

from engine.names import MEMORY_CATEGORIES

TERMINAL_EVENTS = ("finished", "failed", "cancelled")
#: the file whose exclusive creation claims a run directory for one run (kept: it names the owner)
CLAIM_FILE = ".shardscope-run"


class RunDirTaken(ValueError):
    """``--out`` names a directory that cannot hold this run (an earlier run, a run being written,
    someone's files, or a path that is not a directory); nothing was written."""


class RunStatus(StrEnum):
    """Where a run stands. String-valued: ``RunStatus.FINISHED == "finished"``, and JSON and labels
    show the plain word."""

    STARTING = "starting"      # launched, no event yet
    SUBMITTED = "submitted"    # a Slurm job is queued
    RUNNING = "running"        # the ranks started (or the job runs)
    FINISHED = "finished"      # ended with a measurement.json
    FAILED = "failed"          # ended without one; the record's reason says why
    CANCELLED = "cancelled"    # stopped by the user
    DRY_RUN = "dry run"        # printed what it would submit, submitted nothing
    INCOMPLETE = "incomplete"  # found on disk with events but no end: interrupted or still running elsewhere
    EMPTY = "empty"            # found on disk without any event
    UNREADABLE = "unreadable"  # found on disk, its config.toml cannot be read

    @classmethod
    def parse(cls, value: str | RunStatus) -> RunStatus:
        """The status named ``value``; ValueError naming the allowed words for anything else."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"run status {value!r} is not one of {allowed}") from None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename: a reader sees the old
    file or the whole new one; on an error (a full disk) the temporary file is removed and it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


#: below this many free bytes a run's file system counts as full (a rank's log line, an event, a record)
DISK_FULL_BYTES = 1 << 20


def disk_full(path: Path) -> str | None:
    """A sentence when the file system holding ``path`` has (almost) no space left, else None."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= DISK_FULL_BYTES:
        return None
    return (f"the file system holding {path} is full ({free:,} bytes free): free some space, or run with "
            "--out on another disk")


def append_jsonl(path: Path, obj: dict) -> None:
    line = json.dumps(obj, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def _json_objects(lines) -> list[dict]:
    """The JSON objects among ``lines`` (a torn or garbled line is skipped)."""
    out = []
    for line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of ``path`` (a torn or garbled line is skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return _json_objects(text.splitlines())


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class RunDir:
    """Paths of a run directory. Opening one (``RunDir(path)``, as a rank does) creates what is
    missing of it; a launcher starts a run with :meth:`claim` instead."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.logs = self.path / "logs"
        self.ranks = self.path / "ranks"
        for d in (self.path, self.logs, self.ranks):
            d.mkdir(parents=True, exist_ok=True)

    @classmethod
    def claim(cls, path: str | Path, config_file: str | Path | None = None) -> RunDir:
        """Create ``path`` for one new run, or raise :class:`RunDirTaken` having written nothing.

        ``path`` must not exist, or be an empty directory, or hold only ``config.toml`` when that
        is ``config_file``, the config being run (the window prepares a run that way). The claim
        file is created with O_EXCL, so of two launches into one directory exactly one proceeds.
        OSError (a read-only or full file system) propagates for the caller to word.
        """
        path = Path(path)
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                raise RunDirTaken(f"{path} exists and is not a directory")
            own = Path(config_file).resolve() if config_file is not None else None
            found = sorted(p.name for p in path.iterdir()
                           if not (p.name == "config.toml" and own is not None and p.resolve() == own))
            if found:
                what = ("an earlier run" if {"events.jsonl", "measurement.json", CLAIM_FILE} & set(found)
                        else "files")
                shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
                raise RunDirTaken(f"{path} already holds {what} ({shown}); nothing was changed. Choose a new "
                                  "directory, or ask for a fresh sub-directory of it (shardscope run --fresh)")
        else:
            path.mkdir(parents=True, exist_ok=True)  # a racing launch is stopped by the claim file below
        try:
            fd = os.open(path / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise RunDirTaken(f"{path} is being written by another run (it holds {CLAIM_FILE}); "
                              "nothing was changed") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")
        return cls(path)

    @classmethod
    def claim_fresh(cls, parent: str | Path, config_file: str | Path | None = None) -> RunDir:
        """A new timestamped sub-directory of ``parent`` (``--fresh``), claimed as :meth:`claim` does."""
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        for n in range(1, 1000):
            path = Path(parent) / (stamp if n == 1 else f"{stamp}-{n}")
            if not path.exists():
                try:
                    return cls.claim(path, config_file)
                except RunDirTaken:
                    continue  # another launch took it between the look and the claim
        raise RunDirTaken(f"no free sub-directory of {parent} for {stamp}")

    config = property(lambda self: self.path / "config.toml")
    events = property(lambda self: self.path / "events.jsonl")
    measurement = property(lambda self: self.path / "measurement.json")
    device_profile = property(lambda self: self.path / "device-profile.json")  # what timed the run's prediction
    agent_log = property(lambda self: self.logs / "torchrun.log")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_events(self, rank: int) -> Path:
        return self.ranks / f"rank{rank}.events.jsonl"

    def rank_measurement(self, rank: int) -> Path:
        return self.ranks / f"rank{rank}.measurement.json"

    def emit(self, event: str, **fields: Any) -> dict:
        obj = {"event": event, "time": time.time(), **fields}
        append_jsonl(self.events, obj)
        return obj

    def read_events(self) -> list[dict]:
        return read_jsonl(self.events)


class RankWriter:
    """What a rank writes (used inside the worker; no torch here either)."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.dir = RunDir(run_dir)
        self.rank = rank

    def event(self, event: str, **fields: Any) -> None:
        append_jsonl(self.dir.rank_events(self.rank),
                     {"event": event, "time": time.time(), "rank": self.rank, **fields})

    def measurement(self, obj: dict) -> None:
        write_json_atomic(self.dir.rank_measurement(self.rank), obj)


# --------------------------------------------------------------------------- Measurement


@dataclass
class MemoryRank:
    """Bytes per category for one rank; the keys of ``shardscope predict --json``."""

    rank: int
    stage: int
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    comm_buffers: int = 0
    temporaries: int = 0
    overhead: int = 0
    total: int = 0


@dataclass
class Memory:
    per_rank: list[MemoryRank] = field(default_factory=list)


@dataclass
class PipelineRank:
    rank: int
    actions: list[list] = field(default_factory=list)  # [kind, stage, microbatch, start_s, end_s]


@dataclass
class Pipeline:
    per_rank: list[PipelineRank] = field(default_factory=list)


@dataclass
class Step:
    seconds: float  # median over the timed steps of the slowest rank's step time
    per_step: list[float] = field(default_factory=list)  # slowest rank per step
    losses: list[float] = field(default_factory=list)


@dataclass
class Measurement:
    """Same shape and category names as the engine's prediction (memory / pipeline / step)."""

    memory: Memory
    step: Step
    pipeline: Pipeline
    ranks: list[dict] = field(default_factory=list)  # per-rank detail: tracker peak, exact, RSS, ...

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        return cls(
            memory=Memory([MemoryRank(**r) for r in d["memory"]["per_rank"]]),
            step=Step(**d["step"]),
            pipeline=Pipeline([PipelineRank(**r) for r in d["pipeline"]["per_rank"]]),
            ranks=d.get("ranks", []),
        )

    @classmethod
    def load(cls, path: str | Path) -> Measurement:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def assemble(rank_records: list[dict]) -> Measurement:
    """Combine what every rank reported into one Measurement (ranks in order)."""
    recs = sorted(rank_records, key=lambda r: r["rank"])
    per_rank = []
    for r in recs:
        cats = r["memory"]["categories"]
        row = MemoryRank(rank=r["rank"], stage=r["stages"][0],
                         **{c: int(cats.get(c, 0)) for c in MEMORY_CATEGORIES})
        row.total = sum(getattr(row, c) for c in MEMORY_CATEGORIES)
        per_rank.append(row)
    n = min(len(r["step_seconds"]) for r in recs) if recs else 0
    per_step = [max(r["step_seconds"][i] for r in recs) for i in range(n)]
    losses = next((r["losses"] for r in recs if r["rank"] == 0), [])
    timed = sorted(per_step[1:] if len(per_step) > 1 else per_step)  # first step warms up
    median = timed[len(timed) // 2] if timed else 0.0
    pipeline = Pipeline([PipelineRank(rank=r["rank"], actions=r.get("actions", [])) for r in recs]
                        if any(r.get("actions") for r in recs) else [])
    detail = [{k: v for k, v in r.items() if k not in ("actions",)} for r in recs]
    return Measurement(memory=Memory(per_rank), step=Step(median, per_step, losses), pipeline=pipeline,
                       ranks=detail)


def expert_token_totals(meas: Measurement | dict) -> list[dict[str, list[int]]]:
    """Per timed step, the tokens each expert of each MoE block received from every rank
    (``{block: [count per expert]}``, blocks as strings), as the ranks recorded them; [] for a
    dense run."""
    ranks = meas.ranks if isinstance(meas, Measurement) else meas.get("ranks", [])
    first = next((r for r in ranks if r.get("expert_tokens")), None)
    return [s["total"] for s in first["expert_tokens"]] if first else []


def expert_imbalance(meas: Measurement | dict) -> float | None:
    """The measured step's load imbalance: the busiest expert's tokens over the mean, the largest
    over the MoE blocks (``conventions.moe_imbalance``'s definition); None for a dense run."""
    ranks = meas.ranks if isinstance(meas, Measurement) else meas.get("ranks", [])
    totals = next((r["memory"]["expert_tokens"]["total"] for r in ranks
                   if r.get("memory", {}).get("expert_tokens")), None)
    if not totals:
        return None
    return max(max(c) * len(c) / sum(c) for c in totals.values() if sum(c))


def iter_new_lines(path: Path, offset: int) -> tuple[list[dict], int]:
    """Complete JSON lines appended to ``path`` since byte ``offset``; returns (objects, new offset)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    return _json_objects(data[: end + 1].splitlines()), offset + end + 1


def events_of(path: str | Path) -> Iterator[dict]:
    yield from read_jsonl(Path(path))


#: where runs go when no --out / --runs-dir says: this environment variable, else the per-user data folder
RUNS_DIR_ENV = "SHARDSCOPE_RUNS_DIR"


def runs_root() -> Path:
    """Where the window and the CLI keep runs by default: ``$SHARDSCOPE_RUNS_DIR``, else the per-user data
    folder's ``runs`` (platformdirs: ``~/.local/share/shardscope/runs`` on Linux), absolute, so a run is
    found whatever directory a command or the window was started in."""
    env = os.environ.get(RUNS_DIR_ENV)
    if env:
        return Path(env).expanduser().absolute()
    return platformdirs.user_data_path("shardscope", appauthor=False) / "runs"
