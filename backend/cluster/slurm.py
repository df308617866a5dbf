"""Running a Config on Slurm: an sbatch script, submitted, followed, cancelled (no torch here).

The batch script runs one ``torchrun`` per node with ``srun`` (so Slurm starts, signals and
accounts every node's processes), with torchrun's c10d rendezvous at the first node's
``NodeAddr`` and the job id as the rendezvous id. Each node's torchrun output goes to
``logs/node-<node index>.log``, the batch script's to ``logs/slurm-<jobid>.log``; the ranks write
the usual records under ``ranks/``. The run directory (and this checkout and its Python)
must be on a filesystem every node shares.

The job is followed with ``scontrol show job`` (``sacct`` once scontrol has forgotten it,
where accounting is on). A rejected submission, a job that ends FAILED, TIMEOUT, NODE_FAIL,
CANCELLED, OUT_OF_MEMORY, PREEMPTED or BOOT_FAIL is a ``failed`` record carrying Slurm's
own words (sbatch's error, the job's State and Reason, slurmstepd's ``***`` line).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from backend.cluster.follow import ClusterError, ClusterRun, Job, JobState, config_for_layout, node_layout
from backend.launch import DEFAULT_STEPS, DEFAULT_TIMEOUT_S, REPO_ROOT, claim, prepare, refused_run
from backend.records import RunDir, tail
from engine.config import Config

#: torchrun's c10d store listens on RDZV_PORT_BASE + (job id mod 1000) on the head node
RDZV_PORT_BASE = 29500
COMMAND_TIMEOUT_S = 30.0

_FIELD = re.compile(r"(?:^|\s)(JobState|Reason|ExitCode|NodeList|TimeLimit|RunTime)=(\S*)")


#: what an ``#SBATCH`` value may hold, per option: Slurm's own names and time formats. A value is
#: written into a directive line of the script, so a newline in it would become a line of shell.
_DIRECTIVE_VALUES = {
    "--partition": (re.compile(r"[A-Za-z0-9_.+@-]+(,[A-Za-z0-9_.+@-]+)*"), "partition names (letters, digits, "
                    "_ . + @ -), comma-separated"),
    "--account": (re.compile(r"[A-Za-z0-9_.+@-]+"), "an account name (letters, digits, _ . + @ -)"),
    "--time": (re.compile(r"\d+(-\d+)?(:\d+){0,2}"), "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
}


def _directive(option: str, value: str) -> str:
    """``#SBATCH OPTION=VALUE`` after checking VALUE; ClusterError names the option and what it allows."""
    pattern, allowed = _DIRECTIVE_VALUES[option]
    if not pattern.fullmatch(value):
        raise ClusterError(f"{option} {value!r}: allowed: {allowed}")
    return f"#SBATCH {option}={value}"


def _path_directive(option: str, path: str) -> str:
    """``#SBATCH OPTION=PATH``, quoted for sbatch's directive parser where the path has blanks;
    a path with a newline, another control character or a double quote is refused."""
    if any(ord(ch) < 32 or ch in '"\x7f' for ch in path):
        raise ClusterError(f"{option} {path!r}: a path in an #SBATCH line cannot hold a control character "
                           "(newline, tab) or a double quote; choose another directory")
    return f'#SBATCH {option}="{path}"' if any(ch.isspace() for ch in path) else f"#SBATCH {option}={path}"


def sbatch_script(cfg: Config, run_dir: str | Path, steps: int = DEFAULT_STEPS, *, nodes: int, per_node: int,
                  partition: str | None = None, time_limit: str | None = None, account: str | None = None,
                  python: str | None = None, repo: str | Path = REPO_ROOT) -> str:
    """The batch script for ``cfg`` on ``nodes`` × ``per_node`` ranks (``run_dir`` absolute, shared).

    Raises ClusterError for a partition, time limit, account or path that an ``#SBATCH`` line cannot
    hold as it is."""
    q = shlex.quote
    run_dir = str(Path(run_dir).resolve())
    python = python or sys.executable
    repo = str(Path(repo).resolve())
    head = ["#!/bin/bash",
            _path_directive("--job-name", f"shardscope-{Path(run_dir).name}"),
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --no-requeue"]  # a measurement that silently restarts elsewhere would be a lie
    if cfg.cluster.gpu.name != "cpu":
        head.append(f"#SBATCH --gpus-per-node={per_node}")
    if partition is not None:
        head.append(_directive("--partition", partition))
    if time_limit is not None:
        head.append(_directive("--time", time_limit))
    if account is not None:
        head.append(_directive("--account", account))
    head += [_path_directive("--output", f"{run_dir}/logs/slurm-%j.log"),
             _path_directive("--chdir", repo),
             f"# ShardScope: {cfg.parallel.world_size} ranks = {nodes} node(s) x {per_node}, {steps} steps.",
             f"# Run directory (must be on a filesystem every node shares): {q(run_dir)}"]
    node_cmd = (
        f'exec {q(python)} -m torch.distributed.run --nnodes={nodes} --nproc-per-node={per_node} \\\n'
        f'  --rdzv-backend=c10d --rdzv-endpoint="$head_addr:$rdzv_port" --rdzv-id="$SLURM_JOB_ID" \\\n'
        f'  --rdzv-conf=is_host="$is_host" --local-addr="$addr" --max-restarts=0 --monitor-interval=0.5 \\\n'
        f'  -m backend.cluster.rank --run-dir {q(run_dir)} --steps {steps}')
    body = f"""
set -u
node_addr() {{ scontrol show node "$1" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | head -n 1; }}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export head_addr=$(node_addr "$head_node")
export rdzv_port=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 1000 ))
export PYTHONPATH={q(repo)}${{PYTHONPATH:+:$PYTHONPATH}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}} PYTHONUNBUFFERED=1
echo "shardscope: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous at $head_node ($head_addr:$rdzv_port)"

# one torchrun per node; on each: its own address, and the head node hosts the c10d store
read -r -d '' per_node <<'NODE' || true
addr=$(scontrol show node "$SLURMD_NODENAME" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
is_host=0; [ "$SLURM_NODEID" = 0 ] && is_host=1
echo "shardscope: node $SLURM_NODEID of job $SLURM_JOB_ID is $SLURMD_NODENAME ($addr), rendezvous host: $is_host"
export TORCHELASTIC_ERROR_FILE={q(run_dir)}/logs/error-$SLURMD_NODENAME.json
{node_cmd}
NODE
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --output={q(run_dir)}/logs/node-%n.log bash -c "$per_node"
"""
    return "\n".join(head) + "\n" + body


class SlurmJob(Job):
    """sbatch / scontrol / sacct / scancel for one job."""

    name = "Slurm"

    def __init__(self, run_dir: RunDir, env: dict[str, str] | None = None):
        self.dir = run_dir
        self.env = env
        self.job_id: str | None = None
        self._accounting: bool | None = None

    def _cmd(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              env=self.env, stdin=subprocess.DEVNULL)

    def submit(self, script: Path) -> tuple[str | None, str]:
        """(job id, "") or (None, sbatch's own error)."""
        if shutil.which("sbatch", path=(self.env or os.environ).get("PATH")) is None:
            return None, "sbatch not found: Slurm's client commands (sbatch, scontrol, scancel) must be on PATH"
        try:
            p = self._cmd("sbatch", "--parsable", str(script))
        except subprocess.TimeoutExpired:
            return None, f"sbatch did not answer within {COMMAND_TIMEOUT_S:g} s (is slurmctld up?)"
        if p.returncode != 0:
            return None, (p.stderr.strip() or p.stdout.strip() or f"sbatch exited with code {p.returncode}")
        self.job_id = p.stdout.strip().split(";")[0]
        return self.job_id, ""

    def poll(self) -> JobState | None:
        try:
            p = self._cmd("scontrol", "-o", "show", "job", self.job_id)
        except subprocess.TimeoutExpired:
            return None
        if p.returncode == 0 and "JobState=" in p.stdout:
            return parse_scontrol(p.stdout)
        return self._sacct()

    def _sacct(self) -> JobState | None:
        if self._accounting is False:
            return JobState("UNKNOWN", "scontrol no longer knows the job and accounting is off", source="none")
        try:
            p = self._cmd("sacct", "-j", self.job_id, "-X", "-n", "-P", "-o", "State,Reason,ExitCode,NodeList")
        except (OSError, subprocess.TimeoutExpired):
            p = None
        if p is None or p.returncode != 0 or not p.stdout.strip():
            self._accounting = False if p is None or "disabled" in p.stderr.lower() or p.returncode else None
            return JobState("UNKNOWN", "scontrol no longer knows the job and sacct has no record", source="none")
        self._accounting = True
        return parse_sacct(p.stdout)

    def cancel(self) -> None:
        if self.job_id is not None:
            try:
                self._cmd("scancel", self.job_id)
            except (OSError, subprocess.TimeoutExpired):
                pass

    def log_tail(self) -> str:
        text = tail(self.dir.logs / f"slurm-{self.job_id}.log", 20) if self.job_id else ""
        for node_log in sorted(self.dir.logs.glob("node-*.log")):
            t = tail(node_log, 10)
            if t:
                text += f"\n--- {node_log.name} ---\n{t}"
        return text.strip()

    def stepd_lines(self) -> list[str]:
        """slurmstepd's / srun's own error lines ("*** JOB 12 ON n1 CANCELLED AT ... DUE TO TIME LIMIT ***")."""
        out = []
        for p in [self.dir.logs / f"slurm-{self.job_id}.log", *sorted(self.dir.logs.glob("node-*.log"))]:
            try:
                text = p.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            out += [ln.strip() for ln in text.splitlines()
                    if "***" in ln or ln.startswith(("slurmstepd: error", "srun: error"))]
        seen = []
        for ln in out:
            if ln not in seen:
                seen.append(ln)
        return seen[:4]

    def failure(self, st: JobState, cancelled: bool) -> str:
        text = f"Slurm job {self.job_id} ended {st.state}"
        if st.reason and st.reason != "None":
            text += f" (Reason={st.reason})"
        if st.exit_code and st.exit_code != "0:0":
            text += f", ExitCode={st.exit_code}"
        if st.nodes and st.nodes != "(null)":
            text += f", nodes {st.nodes}"
        lines = self.stepd_lines()
        if lines:
            text += ": " + " | ".join(lines)
        return text


def parse_scontrol(text: str) -> JobState:
    """The fields we use from ``scontrol -o show job ID``."""
    f = dict(_FIELD.findall(text))
    return JobState(f.get("JobState", "UNKNOWN"), f.get("Reason"), f.get("ExitCode"), f.get("NodeList"),
                    source="scontrol")


def parse_sacct(text: str) -> JobState:
    """``sacct -X -n -P -o State,Reason,ExitCode,NodeList``: the allocation's line."""
    cols = text.strip().splitlines()[0].split("|") + ["", "", "", ""]
    state = cols[0].split()[0] if cols[0] else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    return JobState(state, cols[1] or None, cols[2] or None, cols[3] or None, source="sacct")


def submit(cfg: Config | str | Path, out_dir: str | Path | None = None, steps: int = DEFAULT_STEPS,
           timeout_s: float = DEFAULT_TIMEOUT_S, *, nodes: int | None = None, per_node: int | None = None,
           partition: str | None = None, time_limit: str | None = None, account: str | None = None,
           python: str | None = None, env: dict[str, str] | None = None, fresh: bool = False) -> ClusterRun:
    """Write the batch script into the run directory, sbatch it and follow the job; returns at once.

    Never raises for a bad job: an invalid config or a submission Slurm rejects gives a run
    that has already failed with the reason in its record. ``timeout_s`` counts from the
    moment the job is RUNNING (queueing is Slurm's business; its --time is the hard limit).
    Raises :class:`backend.cluster.ClusterError`, having written nothing, for node counts that do not
    fit the layout and Slurm options an ``#SBATCH`` line cannot hold.
    """
    source = cfg
    out, cfg, refused = prepare(cfg, out_dir)
    if refused is not None:
        return refused
    nodes, per_node = node_layout(cfg, nodes, per_node)
    cfg = config_for_layout(cfg, nodes, per_node)
    opts = dict(nodes=nodes, per_node=per_node, partition=partition, time_limit=time_limit, account=account,
                python=python)
    sbatch_script(cfg, out.resolve(), steps, **opts)  # a field the script cannot hold: refused before the claim
    run_dir, why = claim(out.resolve(), source, fresh)
    if run_dir is None:
        return refused_run(out, why, cfg, steps)
    cfg.save(run_dir.config)
    script = run_dir.path / "job.sbatch"
    script.write_text(sbatch_script(cfg, run_dir.path, steps, **opts), encoding="utf-8")
    run = ClusterRun(run_dir, cfg, steps, timeout_s, cfg.parallel.world_size)
    job = SlurmJob(run_dir, None if env is None else {**os.environ, **env})
    run.job = job
    run._emit("started", world=cfg.parallel.world_size, steps=steps, nodes=nodes, per_node=per_node,
              target="slurm", command=["sbatch", "--parsable", str(script)], run_dir=str(run_dir.path))
    job_id, error = job.submit(script)
    if job_id is None:
        run._emit("failed", reason=f"Slurm rejected the job: {error}", rank=None, log_tail=error)
        return run
    run._emit("submitted", job_id=job_id, script=str(script))
    run.follow(job)
    return run
