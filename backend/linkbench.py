"""Measure this machine's links and per-rank throughput (no torch imported here).

``measure_links(ranks, out_dir)`` runs ``backend.linkbench_worker`` under torchrun (gloo on
CPU, NCCL on GPUs; the same environment as a training run: loopback, one OpenMP thread per
rank), reads the raw timings it writes (``links_raw.json``), fits α and β per collective and
group size (``engine.compare.calibrate.links_from_benchmark``) and writes ``links.json`` beside it.
About 10–20 s on a small machine. ``shardscope calibrate --links`` is its command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend.launch import REPO_ROOT, _has_torch, local_torchrun
from engine.compare.calibrate import LINKS_FILE, LinkCalibration, links_from_benchmark

RAW_FILE = "links_raw.json"


class LinkBenchError(RuntimeError):
    """The benchmark could not run or did not finish."""


def measure_links(ranks: int, out_dir: str | Path, timeout_s: float = 180.0, python: str | None = None,
                  cores: int | None = None) -> LinkCalibration:
    """Run the micro-benchmark at ``ranks`` ranks; returns the fitted :class:`LinkCalibration`."""
    if ranks < 2:
        raise LinkBenchError(f"--ranks {ranks}: a collective needs at least 2 ranks")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    python = python or sys.executable
    if not _has_torch(python):
        raise LinkBenchError(f"torch is not installed for {python}: install it to measure links")
    for name in (RAW_FILE, LINKS_FILE):
        (out / name).unlink(missing_ok=True)
    cmd, env = local_torchrun(python, ranks, "backend.linkbench_worker", ["--out", str(out.resolve())],
                              {"PYTHONWARNINGS": "ignore"})
    log_path = out / "linkbench.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise LinkBenchError(f"the link benchmark did not finish in {timeout_s:g} s (log: {log_path})") from None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    raw_path = out / RAW_FILE
    if rc != 0 or not raw_path.exists():
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-1500:]
        raise LinkBenchError(f"the link benchmark failed (exit code {rc}); log {log_path}:\n{tail}")
    raw = json.loads(raw_path.read_text(encoding="utf-8"))
    cal = links_from_benchmark(raw, source=str(out), cores=cores)
    data = cal.to_json()
    data["seconds"] = time.monotonic() - t0
    data["command"] = f"shardscope calibrate --links --ranks {ranks} --out {out}"
    tmp = out / (LINKS_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(out / LINKS_FILE)
    return cal


def render_links(cal: LinkCalibration) -> str:
    """The fitted α and B per collective and group size, and the per-rank FLOP/s, as a table."""
    lines = [f"{cal.backend}, {cal.world} ranks" + (f" on {cal.cores} CPU core(s)" if cal.cores else ""),
             f"{'collective':<15} {'ranks':>5} {'alpha':>12} {'bandwidth':>14}"]
    for f in cal.fits:
        bw = "∞" if f.bytes_per_s == float("inf") else f"{f.bytes_per_s / 1e9:.3g} GB/s"
        lines.append(f"{f.kind:<15} {f.group_size:>5} {f.latency_s * 1e6:>9.1f} µs {bw:>14}")
    for dtype, rate in cal.flops_per_rank.items():
        lines.append(f"matmul {dtype}: {rate / 1e9:.1f} GFLOP/s per rank (every rank at once)")
    return "\n".join(lines)
