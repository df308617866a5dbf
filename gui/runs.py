"""Runs as the window keeps them: where a run goes (:class:`RunTarget`), the command that launches it, and its
record (:class:`RunRecord`: found under ``runs/``, opened by hand or launched), to which each event of the
run is applied. Plain Python, no Qt."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from backend.events import describe
from backend.records import TERMINAL_EVENTS, RunStatus, read_jsonl
from engine import Config, ConfigError

TARGETS = ("local", "slurm", "hosts")  # the values of `shardscope run --target`


DRY_RUN_FILE = "dry-run.txt"  # what a dry run printed (the sbatch script or the per-host commands)


@dataclass(frozen=True)
class RunTarget:
    """Where Run sends the config: this machine, a Slurm job (sbatch), or hosts the user starts
    one command on each. Empty fields are left to the CLI (its defaults come from the config)."""

    kind: str = "local"  # one of TARGETS
    partition: str = ""
    nodes: int = 0  # 0: from the config's cluster
    gpus_per_node: int = 0  # 0: from the config's cluster
    time: str = ""  # Slurm time limit, e.g. 00:30:00
    account: str = ""
    hosts: str = ""  # a,b[,...] for kind = "hosts"

    def problem(self) -> str:
        """Why this target cannot be used as filled in ('' when it can)."""
        if self.kind not in TARGETS:
            return f"unknown target {self.kind!r}: one of {', '.join(TARGETS)}"
        if self.kind == "hosts" and not [h for h in self.hosts.split(",") if h.strip()]:
            return "name the hosts (a,b,…): the first hosts the rendezvous"
        return ""

    def cli_args(self) -> list[str]:
        """The ``shardscope run`` options for this target (nothing for this machine)."""
        if self.kind == "local":
            return []
        args = ["--target", self.kind]
        if self.kind == "slurm":
            for flag, value in (("--partition", self.partition.strip()), ("--time", self.time.strip()),
                                ("--account", self.account.strip())):
                if value:
                    args += [flag, value]
        if self.kind == "hosts":
            args += ["--hosts", ",".join(h.strip() for h in self.hosts.split(",") if h.strip())]
        if self.nodes:
            args += ["--nodes", str(self.nodes)]
        if self.gpus_per_node:
            args += ["--gpus-per-node", str(self.gpus_per_node)]
        return args

    def describe(self) -> str:
        if self.kind == "slurm":
            return "a Slurm job" + (f" on partition {self.partition.strip()}" if self.partition.strip() else "")
        if self.kind == "hosts":
            return f"hosts {self.hosts.strip()}"
        return "this machine"


def run_command(config_path: Path, out_dir: Path, target: RunTarget | None = None,
                dry_run: bool = False) -> list[str]:
    """``python -m gui.cli run CFG --out DIR [target options] [--dry-run] --json``."""
    extra = (target or RunTarget()).cli_args() + (["--dry-run"] if dry_run else [])
    return [sys.executable, "-m", "gui.cli", "run", str(config_path), "--out", str(out_dir), *extra, "--json"]


def simulate_command(config_path: Path, out_dir: Path) -> list[str]:
    """``python -m gui.cli measure CFG --fake --out DIR --json``: one JSON document at the end."""
    return [sys.executable, "-m", "gui.cli", "measure", str(config_path), "--fake", "--out", str(out_dir), "--json"]


@dataclass
class RunRecord:
    """One launch of the backend (or one run directory found on disk): its config, where it
    writes, what it said."""

    config: Config | None  # None: the directory's config.toml could not be read (see reason)
    out_dir: Path
    status: RunStatus = RunStatus.STARTING
    events: list[dict] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    measurement: dict | None = None
    reason: str = ""
    step: int = 0
    steps: int = 0
    simulated: bool = False  # fake process group + fake tensors (memory only)
    runnable_of: Config | None = None  # the config this run is the runnable version of
    from_disk: bool = False  # found under runs/ or opened, not launched by this window
    target: RunTarget = field(default_factory=RunTarget)
    dry_run: bool = False  # printed what it would submit, submitted nothing
    printed: list[str] = field(default_factory=list)  # the child's stdout lines that were not events

    def __post_init__(self) -> None:
        self.status = RunStatus.parse(self.status)

    @property
    def name(self) -> str:
        return self.out_dir.name

    @property
    def label(self) -> str:
        kind = " · simulated" if self.simulated else (" · runnable version" if self.runnable_of is not None else "")
        if self.target.kind != "local":
            kind += f" · {self.target.kind}"
        return f"{self.name} · {self.status}{kind}"

    def load_measurement(self) -> dict | None:
        """Read measurement.json when it is not in memory yet (a run found on disk)."""
        if self.measurement is None:
            path = self.out_dir / "measurement.json"
            if path.exists():
                try:
                    self.measurement = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                    self.reason = self.reason or f"measurement.json is not readable: {exc}"
            if isinstance(self.measurement, dict) and self.measurement.get("simulated"):
                self.simulated = True
        return self.measurement


def apply_event(record: RunRecord, event: dict) -> None:
    """One event of a run (the backend's JSON line) applied to its record: status, progress, log."""
    record.events.append(event)
    kind = event.get("event")
    if kind == "started":
        record.status = RunStatus.RUNNING
        record.steps = int(event.get("steps", record.steps) or 0)
    elif kind == "step":
        record.step = int(event.get("k", record.step))
        record.steps = int(event.get("n", record.steps))
    elif kind == "submitted" and record.status == RunStatus.STARTING:
        record.status = RunStatus.SUBMITTED
    elif kind == "job_state" and event.get("state") == "RUNNING" and record.status in (RunStatus.STARTING,
                                                                                        RunStatus.SUBMITTED):
        record.status = RunStatus.RUNNING
    elif kind == "failed":
        record.status = RunStatus.FAILED
        record.reason = str(event.get("reason", "the run failed"))
    elif kind == "cancelled":
        record.status = RunStatus.CANCELLED
        record.reason = str(event.get("reason", "cancelled by the user"))
    elif kind == "finished" and record.status != RunStatus.FAILED:
        record.status = RunStatus.FINISHED
    record.log.append(describe(event))


def read_run_dir(path: str | Path) -> RunRecord:
    """A run directory as a RunRecord: status from events.jsonl, config from config.toml.

    The measurement is read when the run is shown (:meth:`RunRecord.load_measurement`).
    """
    d = Path(path)
    events = read_jsonl(d / "events.jsonl")
    try:
        cfg: Config | None = Config.load(d / "config.toml")
        reason = ""
    except (ConfigError, OSError, ValueError) as exc:
        cfg, reason = None, f"config.toml is not readable: {exc}"
    record = RunRecord(config=cfg, out_dir=d, events=events, reason=reason, from_disk=True)
    has_measurement = (d / "measurement.json").exists()
    record.simulated = any(e.get("simulated") for e in events)
    terminal = [e for e in events if e.get("event") in TERMINAL_EVENTS]
    dry = d / DRY_RUN_FILE
    if cfg is None:
        record.status = RunStatus.UNREADABLE
    elif not events and dry.exists():
        record.status, record.dry_run = RunStatus.DRY_RUN, True
        record.reason = "nothing was submitted"
    elif terminal and terminal[-1].get("event") == "failed":
        record.status = RunStatus.FAILED
        record.reason = str(terminal[-1].get("reason", "the run failed"))
    elif terminal and terminal[-1].get("event") == "cancelled":
        record.status = RunStatus.CANCELLED
        record.reason = str(terminal[-1].get("reason", "cancelled by the user"))
    elif has_measurement:
        record.status = RunStatus.FINISHED
    elif terminal:
        record.status = RunStatus.FAILED
        record.reason = "finished without a measurement.json"
    else:
        record.status = RunStatus.INCOMPLETE if events else RunStatus.EMPTY
        record.reason = "no finished or failed event: the run was interrupted (or is still running elsewhere)"
    for e in events:
        if e.get("event") == "step":
            record.step = int(e.get("k", record.step) or 0)
            record.steps = int(e.get("n", record.steps) or 0)
    record.log = [f"# {d}"] + [describe(e) for e in events]
    if record.dry_run:
        try:
            record.log += dry.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            record.log.append(f"{dry} is not readable: {exc}")
    if record.reason:
        record.log.append(f"-- {record.status}: {record.reason}")
    return record
