"""Fault injection for the fault tests (no torch): ``SHARDSCOPE_FAULT=kind@rank:step``.

kind is ``raise`` (an exception), ``kill`` (SIGKILL to itself), ``hang`` (sleeps forever) or
``exit`` (exits with code 3). The variable is read by the worker; production runs never set it.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "SHARDSCOPE_FAULT"


def parse(spec: str) -> tuple[str, int, int]:
    kind, _, where = spec.partition("@")
    rank, _, step = where.partition(":")
    if kind not in ("raise", "kill", "hang", "exit"):
        raise ValueError(f"{ENV}={spec!r}: kind must be raise | kill | hang | exit")
    return kind, int(rank), int(step or 1)


def maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    kind, at_rank, at_step = parse(spec)
    if rank != at_rank or step != at_step:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "exit":
        os._exit(3)
    while True:  # hang
        time.sleep(3600)
