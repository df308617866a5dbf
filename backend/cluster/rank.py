"""Per-rank entry point on a cluster node: ``python -m backend.cluster.rank --run-dir D --steps N``.

Writes one ``rank_node`` event (which node, host and network namespace this rank runs in)
to the rank's own events file, then runs :func:`backend.worker.main` unchanged. Imports no
torch itself.
"""

from __future__ import annotations

import os
import socket
import sys


def node_facts() -> dict:
    """Where this process runs: Slurm's node name if any, the host name, the torchrun node rank."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = None
    host = socket.gethostname()
    return {
        "node": os.environ.get("SLURMD_NODENAME") or host,
        "hostname": host,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "netns": netns,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from backend.records import RankWriter

    run_dir = argv[argv.index("--run-dir") + 1]
    RankWriter(run_dir, int(os.environ.get("RANK", "0"))).event("rank_node", **node_facts())
    from backend import worker

    return worker.main(argv)


if __name__ == "__main__":
    sys.exit(main())
