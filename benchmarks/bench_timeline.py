"""Timeline simulation speed: the GUI redraws the pipeline while a slider moves.

Goals: 8 stages × 32 microbatches in about 1 ms; 64 × 512 well under 100 ms.
Prints medians; asserts nothing (timing is machine-dependent).

    .venv/bin/python benchmarks/bench_timeline.py [--repeat N]

Columns: ``plan`` = generating the per-rank order (uncached; integer arrays, the per-rank
``Action`` tuples are built only on demand), ``graph`` = the dependency graph of a plan (once
per plan, cached), ``simulate`` = a simulation of a cached plan with new durations (what a
duration/efficiency slider costs), ``cold`` = all three (what a pp / microbatch / schedule
slider costs).

History (medians of 3 runs, 2 shared cores, ms, the 64-stage × 512-microbatch rows): before
the closed-form generators and the fused simulation loop, cold was 88-239 (plan 39-105,
graph 25-40, simulate 16-28); after, cold 25-45 (plan 2-5, graph 3.5-5.7, simulate 20-33:
the fused loop finds the order as it goes, ~2 ms slower than replaying a cached order, but
there is no 25-40 ms sort per new plan). 8 × 32 cold: 0.4-0.65 (was 0.6-0.9).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.pipeline.schedules import _pipeline_actions, pipeline_actions  # noqa: E402
from engine.pipeline.timeline import _build_graph, simulate  # noqa: E402
from engine.time.durations import StageDurations  # noqa: E402

CASES = [
    # (schedule, pp, microbatches, virtual stages): stages = pp * v
    ("1F1B", 8, 32, 1),
    ("Interleaved1F1B", 4, 32, 2),
    ("ZBVZeroBubble", 4, 32, 2),
    ("DualPipeV", 4, 32, 2),
    ("1F1B", 64, 512, 1),
    ("Interleaved1F1B", 32, 512, 2),
    ("InterleavedZeroBubble", 64, 512, 1),
    ("ZBVZeroBubble", 32, 512, 2),
    ("DualPipeV", 32, 512, 2),
]


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_case(name: str, pp: int, m: int, v: int, repeat: int) -> dict[str, float]:
    """Median milliseconds of each phase for one (schedule, pp, microbatches, v)."""
    plan = pipeline_actions(name, pp, m, v)
    dur = StageDurations.uniform(plan.num_stages, 1.0, 1.0, 1.0, p2p_s=0.01)
    simulate(plan, dur)  # warm the graph cache

    def cold() -> None:
        simulate(_pipeline_actions.__wrapped__(name, pp, m, v), dur)

    return {
        "actions": plan.num_actions,
        "plan": _median_ms(lambda: _pipeline_actions.__wrapped__(name, pp, m, v), repeat),
        "graph": _median_ms(lambda: _build_graph(plan), repeat),
        "simulate": _median_ms(lambda: simulate(plan, dur), repeat),
        "cold": _median_ms(cold, repeat),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=0, help="runs per case (default: 200 small, 15 large)")
    args = ap.parse_args()
    print(f"{'schedule':<22} {'pp':>3} {'m':>4} {'v':>2} {'stages':>6} {'actions':>7} "
          f"{'plan ms':>8} {'graph ms':>8} {'simulate ms':>11} {'cold ms':>8}")
    for name, pp, m, v in CASES:
        r = bench_case(name, pp, m, v, args.repeat or (200 if pp * m <= 512 else 15))
        print(f"{name:<22} {pp:>3} {m:>4} {v:>2} {pp * v:>6} {r['actions']:>7} "
              f"{r['plan']:>8.3f} {r['graph']:>8.3f} {r['simulate']:>11.3f} {r['cold']:>8.3f}")


if __name__ == "__main__":
    main()
