"""Time the planner on a mixture of experts: ``shardscope plan --model deepseek-v3 --gpus 2048``.

Run: .venv/bin/python benchmarks/bench_plan_moe.py [--repeat N] [--gpus N] [--model NAME]

Prints the cold first call (it fills the engine's layout caches) apart, then the median of
``--repeat`` calls (target: at most 2 s), the search's own counts, and the fastest layouts —
which use expert parallelism. The same call as the CLI: ``plan(model, gpus)`` with the
default GPU (h100-sxm, 8 per node), global batch and training table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.plan.search import plan  # noqa: E402

TARGET_S = 2.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--gpus", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    t = time.perf_counter()
    result = plan(args.model, args.gpus)
    cold = time.perf_counter() - t
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        result = plan(args.model, args.gpus)
        times.append(time.perf_counter() - t)
    median = statistics.median(times)
    c = result.counts
    print(f"plan({args.model!r}, {args.gpus}) on {result.gpu}: cold {cold:.2f} s, median of {args.repeat} "
          f"{median:.2f} s (min {min(times):.2f}, max {max(times):.2f}); target ≤ {TARGET_S:g} s: "
          f"{'met' if median <= TARGET_S else 'NOT met'}")
    print(f"  {c.enumerated:,} layouts: {c.memory_bound_rejected:,} cannot fit (memory bound), "
          f"{c.pruned_by_time_bound:,} pruned by the time bound, {c.fully_evaluated:,} fully evaluated "
          f"({c.did_not_fit:,} did not fit)")
    for e in result.entries[:5]:
        print(f"  #{e.position} {e.label():<60} {e.tokens_per_s:>12,.0f} tokens/s  MFU {100 * e.mfu:.1f}%  "
              f"peak {e.peak_bytes / 2**30:.1f} GiB")
    uses_ep = sum(1 for e in result.entries if e.config.parallel.ep > 1)
    print(f"  {uses_ep} of the top {len(result.entries)} layouts use expert parallelism")
    return 0 if median <= TARGET_S and uses_ep else 1


if __name__ == "__main__":
    raise SystemExit(main())
