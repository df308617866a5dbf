"""torchrun on one machine with nothing listening beyond loopback: ``python -m backend.torchrun_loopback
[torchrun's own arguments]``.

``torchrun --standalone`` hosts its c10d rendezvous store, and the store it shares with the
workers, in TCPStore servers that bind every interface whatever host they are given (torch 2.13's
TCPStore server listens on ``::``/``0.0.0.0``; ``--local-addr`` only names the address it
advertises). Neither store authenticates, so anyone on the network could write into a run's
rendezvous while it lasts. TCPStore can instead serve on a socket the caller bound itself
(``master_listen_fd``); this module registers a rendezvous backend, ``shardscope-loopback``,
through torchrun's own handler registry, that is torch's c10d backend and dynamic rendezvous
with both stores served on sockets bound to 127.0.0.1, then runs torchrun's ``main``. The ranks
reach the shared store as clients (TORCHELASTIC_USE_AGENT_STORE), and gloo's own sockets follow
GLOO_SOCKET_IFNAME=lo (backend.launch sets it), so every listening socket of a local run is on
loopback (tests/backend/test_backend_faults.py checks it during a run).

Where the ranks run on the CPU (no CUDA device: gloo), a ``-m module`` entry point is run by
forking this agent after it has imported the module and what the module lists in ``PRELOAD``
(torch, torch.distributed's FSDP / pipelining / DTensor, the engine): torchrun's own
``MultiprocessContext`` with ``start_method="fork"``, as ``torchrun --run-path`` runs a script.
Each rank then starts with those imports done (3–5 s of CPU per rank on this 2-core machine,
where four ranks importing at once took 11 s before their first step) and exits without
tearing the interpreter down. With CUDA, torchrun starts a fresh interpreter per rank as usual:
a process must not fork after the CUDA driver was initialised in it.
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from backend import worker  # (no torch at import: the rank's entry point sets itself up first)
from backend.forkserver import as_child_process

BACKEND = "shardscope-loopback"
LOOPBACK = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
#: what the agent imports before it starts the ranks: torchrun, this module, and what it preloads for the CPU
#: ranks it forks (backend.worker.PRELOAD); backend.launch has its fork server import them once
AGENT_PRELOAD = ("torch.distributed.run", "backend.torchrun_loopback", "backend.worker", *worker.PRELOAD)


def loopback_store(timeout_s: float = 60.0):
    """A TCPStore server on an ephemeral port of 127.0.0.1 (and nowhere else)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # the store serves on this socket and owns it from here on (detach: Python will not close it)
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach(),
                         timeout=timedelta(seconds=timeout_s))


def create_handler(params):
    """torchrun's c10d rendezvous (``--rdzv-backend=c10d``) for one node, its stores on loopback."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler

    host = params.endpoint.rsplit(":", 1)[0] if params.endpoint else LOOPBACK
    if host not in (LOOPBACK, "localhost"):
        raise ValueError(f"--rdzv-backend={BACKEND} serves on {LOOPBACK} only, not on {host!r}")
    if params.max_nodes != 1:
        raise ValueError(f"--rdzv-backend={BACKEND} is for one node (--nnodes=1), not {params.max_nodes}")
    class LoopbackBackend(C10dRendezvousBackend):  # torch's c10d backend under this registry name
        @property
        def name(self) -> str:
            return BACKEND

    store = loopback_store(float(params.get_as_int("read_timeout", 60)))
    handler = dynamic_handler(store, LoopbackBackend(store, params.run_id), params)
    # the store the agent shares with its workers (dynamic_rendezvous' own method binds every interface)
    handler._create_tcp_store_server = lambda addr, port: loopback_store()
    return handler


def _method_name(depth: int = 2) -> str:
    """dynamic_rendezvous.get_method_name without reading source: torch's takes
    ``inspect.stack()[depth].function`` (twice), and ``inspect.stack`` reads every frame's source
    lines for their context, which only names a log record's method: 0.7 s of the agent's CPU per
    launch, before the ranks start. The same frame's name, from the frame itself."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def run_module(module: str, *args: str) -> int:
    """A rank's entry point in a forked agent: ``python -m module args`` in this interpreter, as
    ``module.main(args)`` (what ``torchrun --run-path`` does for a script). It returns 0, so that
    torchrun's worker wrapper hands the agent a return value; any other status ends the rank with it."""
    sys.argv = [module, *args]
    code = importlib.import_module(module).main(list(args))
    if code:
        raise SystemExit(code)
    return 0


def forks_ranks(args) -> bool:
    """Whether the ranks of this launch are forked from the agent: a ``-m`` module with a ``main(argv)``
    on a machine without CUDA (``torch.cuda.is_available`` is False without a driver, and then
    initialises nothing)."""
    import torch

    if not args.module or args.no_python or args.run_path or torch.cuda.is_available():
        return False
    return callable(getattr(importlib.import_module(args.training_script), "main", None))


def _report_every_failure(poll):
    """torchrun's ``MultiprocessContext._poll`` with the bookkeeping of its ``SubprocessContext._poll``:
    the forked context reports the first failed rank its join happens to see (a rank that died after a
    peer was killed, as often as the killed one), the subprocess context every rank that had exited
    non-zero by then — which is what the failure summary, and backend.blame reading it, rely on."""

    def _poll(self):
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        result = poll(self)
        if result is None or not result.failures:
            return result
        for i, proc in enumerate(self._pc.processes if self._pc is not None else ()):
            if i not in result.failures and proc.exitcode not in (None, 0):
                result.failures[i] = ProcessFailure(local_rank=i, pid=proc.pid, exitcode=proc.exitcode,
                                                    error_file=self.error_files[i])
        return result

    return _poll


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, rendezvous_handler_registry
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args
    from torch.distributed.run import run as torchrun_run

    dynamic_rendezvous.get_method_name = _method_name
    rendezvous_handler_registry.register(BACKEND, create_handler)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not forks_ranks(args):
        record(torchrun_run)(args)
        return
    for name in getattr(sys.modules[args.training_script], "PRELOAD", ()):
        importlib.import_module(name)
    # what the imports made lives as long as the ranks: the collector's permanent generation (gc.freeze, meant
    # for a process that forks without exec), so that a rank's gc.collect (before its measured step and its
    # census) walks what the rank made, not torch's modules (0.19 s a collection here)
    gc.freeze()
    MultiprocessContext._poll = _report_every_failure(MultiprocessContext._poll)
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    record(elastic_launch(config=config, entrypoint=run_module))(args.training_script, *args.training_script_args)


def _exit_status(exc: SystemExit) -> int:
    """The exit status the interpreter gives ``raise SystemExit(code)`` (a message: printed, then 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def forked_main(args: list[str], log_path: str, env: dict[str, str]) -> None:
    """``python -m backend.torchrun_loopback ARGS`` in a process forked from backend.launch's fork server
    (which has imported ``AGENT_PRELOAD``): what a fresh interpreter started by ``subprocess.Popen(...,
    cwd=REPO_ROOT, env=env, stdout=log, stderr=log, start_new_session=True)`` with PYTHONUNBUFFERED
    would have been, ending with the same exit status, without its 3-4 s of imports and its teardown."""
    as_child_process(REPO_ROOT, log_path, env)
    sys.argv = [__file__, *args]  # what `python -m` sets
    code = 1
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
