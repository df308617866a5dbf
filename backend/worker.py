"""The entry point of each rank under torchrun: ``python -m backend.worker --run-dir D --steps N``.

Sets itself up before importing torch (its log file, and a parent-death signal so it cannot
outlive the torchrun agent), then runs backend.train. Any exception is written as a ``failed``
rank event with the traceback in the rank's log, and the process exits non-zero.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import traceback

#: what backend.torchrun_loopback imports in the agent before it forks CPU ranks (the ranks' own imports).
#: torch._dynamo: DistributedDataParallel's constructor imports it, and so does the first call of any
#: function torch wraps with ``torch._disable_dynamo`` (FSDP2's hooks, the pipelining schedules): 0.6 s of
#: CPU a rank (1.4 s profiled) that every rank paid at its start
PRELOAD = ("backend.train", "engine.config", "torch._dynamo")


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel sends SIGKILL to this rank if the agent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    _die_with_parent()
    rank = int(os.environ.get("RANK", "0"))

    from backend.forkserver import redirect_output
    from backend.records import RankWriter, RunDir

    run = RunDir(args.run_dir)
    redirect_output(str(run.rank_log(rank)))
    out = RankWriter(args.run_dir, rank)
    out.event("rank_started", pid=os.getpid())
    try:
        from backend.train import run_rank
        from engine.config import Config

        cfg = Config.load(run.config)
        run_rank(cfg, out, args.steps)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the record
        traceback.print_exc()
        sys.stderr.flush()
        out.event("failed", reason=f"{type(exc).__name__}: {exc}"[:2000])
        os._exit(1)
    out.event("rank_done")
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
