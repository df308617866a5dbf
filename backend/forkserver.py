"""One fork server per process for the Python processes the backend starts: torchrun agents
(backend.launch) and simulated ranks (backend.fake).

Each of them begins by importing torch and the backend: 3–5 s of CPU on this 2-core machine, paid
again by every launch of a process that starts many (the test suite, ``benchmarks/accuracy.py``,
the fake sweep). multiprocessing's "forkserver" is a fresh interpreter (never a fork of the caller,
whatever threads the caller runs) that imports a list of modules once and then forks a child per
request, so each child starts with those imports done.

A module that starts processes this way names what its children import with :func:`want` when it is
imported; the server, started at the first request, preloads everything named by then (a module
named later is imported by each child itself: slower, never wrong). A one-shot command that imports
only one of the two pays only for its own list.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.context
import os
import sys

_WANTED: list[str] = []


def want(modules) -> None:
    """Ask the server to preload ``modules`` (if it has not started yet)."""
    for name in modules:
        if name not in _WANTED:
            _WANTED.append(name)


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context; its server preloads what :func:`want` was given before it started."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_WANTED))  # read only when the server starts: the first request
    return ctx


def redirect_output(path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) appended to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def as_child_process(cwd, log_path: str, env: dict[str, str]) -> None:
    """In a process forked from the server: what ``subprocess.Popen(..., cwd=cwd, env=env, stdout=log,
    stderr=log, start_new_session=True)`` with PYTHONUNBUFFERED would have given it: its own session (so that
    it can be stopped as a group), its output appended to its log unbuffered (what it prints before it
    dies reaches the log), the environment it was given (torch's threads as ``OMP_NUM_THREADS`` says)."""
    os.setsid()
    os.chdir(cwd)
    redirect_output(log_path)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    os.environ.clear()
    os.environ.update(env)
    # the server's OpenMP read its thread count from the environment the server started with, not this one
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
