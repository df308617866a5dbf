"""Simulated measurement of Llama-2 7B on 64 H100s: FSDP 64, and FSDP 8 × TP 8 (backend.fake).

    .venv/bin/python benchmarks/bench_fake.py [--out DIR]

For each layout: wall time of ``simulate`` (child process start, torch import, build, the
measured step), the worker's peak RSS, and simulated vs predicted bytes per category for rank 0.
The target is under a minute per layout on this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.fake import comparison, simulate  # noqa: E402
from engine.config import Config  # noqa: E402

BASE = """schema_version = 1
[model]
preset = "llama2-7b"
[cluster]
preset = "h100-pod-64"
[parallel]
{parallel}
zero = 3
microbatches = 1
[training]
micro_batch_size = 1
precision = "bf16-mixed"
optimizer = "adamw"
recompute = "none"
"""
LAYOUTS = {"7B FSDP64": "dp = 64", "7B FSDP8 x TP8": "dp = 8\ntp = 8"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="keep the run directories here (default: a temporary folder)")
    args = ap.parse_args()
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-fake-"))
    for name, par in LAYOUTS.items():
        path = base / (name.replace(" ", "_") + ".toml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(BASE.format(parallel=par))
        cfg = Config.load(path)
        t0 = time.perf_counter()
        res = simulate(cfg, base / name.replace(" ", "_"), ranks=[0])
        wall = time.perf_counter() - t0
        rec = res.records[0]
        print(f"{name}: wall {wall:.1f} s (worker {rec['seconds']['total']:.1f} s: build "
              f"{rec['seconds']['build']:.1f}, optimizer state {rec['seconds']['optimizer_state']:.1f}, "
              f"measured step {rec['seconds']['measured_step']:.1f}), peak RSS "
              f"{rec['peak_rss_bytes'] / 2**20:.0f} MiB, {'OK' if wall < 60 else 'OVER'} (< 60 s)")
        print(f"  {'category':<13}{'predicted GiB':>14}{'simulated GiB':>15}{'sim - pred':>12}")
        for row in comparison(cfg, res.measurement):
            print(f"  {row['category']:<13}{row['predicted'] / 2**30:>14.3f}{row['measured'] / 2**30:>15.3f}"
                  f"{row['difference'] / 2**30:>+12.3f}")
        for w in res.warnings:
            print(f"  cross-check: {w}")
        print("  tracker peak (GiB): " + ", ".join(
            f"{k} {v / 2**30:.3f}" for k, v in rec["memory"]["tracker_peak"].items() if v and k != "Total"))
        alloc = rec["allocator"]
        print(f"  caching allocator (modelled, {alloc['events']:,} events): max allocated "
              f"{alloc['max_allocated'] / 2**30:.3f} GiB, max reserved {alloc['max_reserved'] / 2**30:.3f} GiB"
              + (f"; {alloc['oom']}" if alloc["oom"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
