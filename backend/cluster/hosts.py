"""Plain multi-node torchrun without a scheduler: the command for each host, then follow the run.

``start(cfg, hosts=["a", "b"])`` writes the run directory, emits one ``node_command`` event
per host (the exact shell line to start there: torchrun with c10d rendezvous at the first
host, the run directory's name as rendezvous id, ``--local-addr`` set to that host) and
follows the run directory until every rank has finished or one has failed. The user starts
the commands (ssh, a terminal per host, a container); this checkout, its Python and the run
directory must be at the same paths on every host (a shared filesystem).
Cancelling stops following; the processes on the hosts are the user's to stop.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from backend.cluster.follow import ClusterError, ClusterRun, Job, config_for_layout, node_layout
from backend.launch import DEFAULT_STEPS, DEFAULT_TIMEOUT_S, REPO_ROOT, claim, prepare, refused_run
from engine.config import Config

RDZV_PORT = 29500


def parse_hosts(text: str | list[str]) -> tuple[list[str], int]:
    """``"a,b"`` or ``"a:29400,b"`` -> (hosts, rendezvous port on the first)."""
    items = [h.strip() for h in (text.split(",") if isinstance(text, str) else text) if h.strip()]
    if len(items) < 1:
        raise ClusterError("--hosts needs at least one host, e.g. --hosts node1,node2")
    port = RDZV_PORT
    hosts = []
    for i, h in enumerate(items):
        name, sep, p = h.rpartition(":") if h.count(":") == 1 else (h, "", "")
        if sep:
            if not p.isdigit():
                raise ClusterError(f"--hosts: {h!r} has a port that is not a number")
            if i == 0:
                port = int(p)
            h = name
        hosts.append(h)
    if len(set(hosts)) != len(hosts):
        raise ClusterError(f"--hosts names a host twice: {','.join(hosts)}")
    return hosts, port


def node_argv(run_dir: Path, steps: int, *, hosts: list[str], node: int, per_node: int, port: int,
              rdzv_id: str, python: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=is_host={1 if node == 0 else 0}", f"--local-addr={hosts[node]}", "--max-restarts=0",
            "--monitor-interval=0.5", "-m", "backend.cluster.rank", "--run-dir", str(run_dir), "--steps", str(steps)]


def node_commands(cfg: Config, run_dir: str | Path, steps: int, hosts: list[str], per_node: int,
                  port: int = RDZV_PORT, python: str | None = None, repo: str | Path = REPO_ROOT) -> list[dict]:
    """For each host: {node, host, argv, cwd, env, shell} — ``shell`` is the line to paste there."""
    run_dir = Path(run_dir).resolve()
    repo = str(Path(repo).resolve())
    python = python or sys.executable
    env = {"PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = []
    for i, host in enumerate(hosts):
        argv = node_argv(run_dir, steps, hosts=hosts, node=i, per_node=per_node, port=port,
                         rdzv_id=run_dir.name, python=python)
        shell = (f"cd {shlex.quote(repo)} && " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " "
                 + shlex.join(argv))
        out.append({"node": i, "host": host, "argv": argv, "cwd": repo, "env": env, "shell": shell})
    return out


def start(cfg: Config | str | Path, hosts: str | list[str], out_dir: str | Path | None = None,
          steps: int = DEFAULT_STEPS, timeout_s: float = DEFAULT_TIMEOUT_S, *, per_node: int | None = None,
          python: str | None = None, fresh: bool = False) -> ClusterRun:
    """Prepare the run directory, emit each host's command, follow the ranks; returns at once.

    ``timeout_s`` counts from now: the time the user has to start every command and the run
    to finish. Raises :class:`ClusterError` for hosts that do not fit the layout.
    """
    source = cfg
    out, cfg, refused = prepare(cfg, out_dir)
    if refused is not None:
        return refused
    host_list, port = parse_hosts(hosts)
    nodes, per_node = node_layout(cfg, len(host_list), per_node)
    cfg = config_for_layout(cfg, nodes, per_node)
    run_dir, why = claim(out.resolve(), source, fresh)
    if run_dir is None:
        return refused_run(out, why, cfg, steps)
    cfg.save(run_dir.config)
    cmds = node_commands(cfg, run_dir.path, steps, host_list, per_node, port, python)
    run = ClusterRun(run_dir, cfg, steps, timeout_s, cfg.parallel.world_size)
    run._emit("started", world=cfg.parallel.world_size, steps=steps, nodes=nodes, per_node=per_node,
              target="hosts", command=[c["argv"] for c in cmds], run_dir=str(run_dir.path))
    for c in cmds:
        run._emit("node_command", **c)
    run._emit("waiting", message=f"start the command above on each host; following {run_dir.path} "
                                 f"(for up to {timeout_s:g} s; Ctrl-C stops following)")
    run.follow(Job())
    return run
