import os
import tempfile
import threading

import pytest

# Qt tests run without a display.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# torch and numpy in the test process (and the processes it starts) compute on one thread, as the
# ranks already do (backend.launch sets OMP_NUM_THREADS=1 for them): on a small shared machine a
# second OpenMP thread brings nothing to the tiny model's kernels and, when the cores are busy, its
# spin-waiting made in-process torch tests 2-4 times slower. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the engine reads a measured CPU device profile from this machine's cache (engine.time.ops.device_profile):
# the tests read the shipped one, whatever `shardscope calibrate --device` left here
# runs a test starts without --out go to a temporary folder, never the user's data folder
os.environ["SHARDSCOPE_RUNS_DIR"] = os.path.join(tempfile.gettempdir(), f"shardscope-tests-{os.getpid()}-runs")
os.environ["SHARDSCOPE_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"shardscope-tests-{os.getpid()}-cache")


def pytest_configure(config):
    """Byte-compile the project's packages once, before any test starts a process. Where the
    environment says PYTHONDONTWRITEBYTECODE (this machine's does), no process writes a .pyc, so every
    rank and CLI subprocess the suite starts (hundreds) would compile engine/ and backend/ from source
    again: a rank's ``import backend.train`` took 2.85 s of CPU so, 2.6 s with the .pyc files (median
    of 4). Reading a .pyc is not affected by that setting, and a stale one is never used (Python
    checks the source's mtime and size)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller did it
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for pkg in ("engine", "backend", "gui"):
        compileall.compile_dir(root / pkg, quiet=1)


@pytest.fixture
def window(qtbot, tmp_path):
    """The ShardScope window on the embedded default, offscreen at 1500 × 950, with its first prediction
    drawn; runs go to a temporary directory."""
    from PySide6.QtWidgets import QApplication

    from engine import default_config
    from gui.app import make_window
    from gui.state import State

    w = make_window(State(default_config(), runs_dir=tmp_path / "runs"))
    qtbot.addWidget(w)
    w.resize(1500, 950)
    w.show()
    qtbot.waitExposed(w)
    w.state.recompute_now()
    QApplication.processEvents()
    return w


#: a small 3-D layout (tiny preset, FSDP 2 × TP 2 × PP 2, 1F1B, 4 microbatches) that more than one
#: file simulates; ``small_3d_fake`` is its fake-tensor simulation
SMALL_3D = {"cluster": {"gpus": 8},
            "parallel": {"dp": 2, "tp": 2, "pp": 2, "zero": 3, "schedule": "1F1B", "microbatches": 4}}


class _Once:
    """A result computed on first request and kept (the request may come from a worker thread)."""

    def __init__(self, make):
        self._make, self._lock, self._result = make, threading.Lock(), None

    def __call__(self):
        with self._lock:
            if self._result is None:
                self._result = self._make()
            return self._result


@pytest.fixture(scope="session")
def small_3d_fake(tmp_path_factory):
    """``small_3d_fake()``: the fake-tensor simulation of ``SMALL_3D``'s ranks 0 and 4 (one per pipeline
    stage, two at a time), run once for the session: tests/backend/fake/test_fake.py holds it to real tensors per
    category (running it beside its real-tensor run), tests/backend/fake/test_fake_allocator.py to a real torchrun
    run's activations. Read it, never write to it."""
    pytest.importorskip("torch")
    from backend.fake import simulate
    from engine import default_config

    out = tmp_path_factory.mktemp("small-3d") / "fake"
    return _Once(lambda: simulate(default_config().replace(**SMALL_3D), out, ranks=[0, 4], jobs=2))


# --------------------------------------------------------------------------- running on two workers
# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2): the unit tests and the
# single-threaded phases of one launch (imports, the measured step) overlap another launch. Each
# test is its own unit of work, except these files, each run whole on one worker, in order: their
# tests share an expensive module- or session-scoped fixture (computed once per worker that runs
# one of them, and again after a test of another file ran in between), or, for the cluster tests,
# start a real Slurm and network namespaces on this machine, so run one after the other. (xdist's
# own xdist_group marks do nothing under pytest >= 9.2: xdist 3.8 renames Item._nodeid, which
# pytest no longer reads.)
_FILE_GROUPS = {
    "test_planner.py": "planner",  # small_case's brute force of every layout; all_fitting
    "test_backend_torchtitan_knobs.py": "knobs",  # runs: launches shared by its tests
    "test_fake.py": "small-3d-fake",  # the session's small_3d_fake, read by both files
    "test_fake_allocator.py": "small-3d-fake",
    "test_cluster_slurm.py": "cluster",
    "test_cluster_hosts.py": "cluster",
    "test_planner_cp.py": "planner-cp",  # brute_force
    "test_planner_float8.py": "planner-float8",  # brute
}
#: the groups, longest first, start before everything else (so no long group starts last)
_FIRST = ["planner", "knobs", "small-3d-fake", "cluster", "planner-cp", "planner-float8"]


def _group(nodeid: str) -> str | None:
    return _FILE_GROUPS.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist chooses its own
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid) or nodeid

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's order is the order work is handed out
        first = {g: i for i, g in enumerate(_FIRST)}
        items.sort(key=lambda it: first.get(_group(it.nodeid), len(first)))


def settle(state, timeout_ms: int = 10_000) -> None:
    """Wait until the window's prediction (made on its worker thread) is of the current config."""
    import time

    from PySide6.QtWidgets import QApplication

    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        QApplication.processEvents()
        p = state.prediction
        if not state.predicting and not state.session.stale and p is not None and p.config == state.config:
            return
        time.sleep(0.002)
    raise AssertionError("the window's prediction did not arrive")
