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

import multiprocessing
import multiprocessing.context

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
