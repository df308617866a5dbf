"""Time ``engine.predict`` against the layer count; prints the medians and largest/smallest.

Run: .venv/bin/python benchmarks/bench_layers.py [--repeat N]
Blocks are identical, so a prediction should cost the same for 32 or millions of them: the
parameter placement keeps runs of identical FSDP units with a count, and ZeRO-1's partition
hands out equal tensors in closed form. Two configs: llama3-8b dense 1F1B over pp8, and
llama3-8b ZeRO-1 over dp8 (torch's ZeroRedundancyOptimizer: one partition per dp-rank). The
layer counts: 32, 1,000, 100,000 (those the config accepts) and the largest the config's
validation accepts (searched up to 4,096 × 1,024). Each call is timed cold: the layout caches are cleared first (a slider that
moves the layer count misses them), so the median includes placing the parameters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Config, ConfigError, memory  # noqa: E402
from engine.model import params
from engine.pipeline import schedules
from engine.predict import predict  # noqa: E402

SEARCH_CAP = 4096 * 1024  # the largest layer count looked for when the config sets no bound

BASES = {
    "llama3-8b dense 1F1B pp8 (m16)": {
        "model": {"preset": "llama3-8b"}, "cluster": {"preset": "dgx-h100"},
        "parallel": {"dp": 1, "pp": 8, "schedule": "1F1B", "microbatches": 16},
        "training": {"precision": "bf16-mixed"}},
    "llama3-8b ZeRO-1 dp8": {
        "model": {"preset": "llama3-8b"}, "cluster": {"preset": "dgx-h100"},
        "parallel": {"dp": 8, "zero": 1}, "training": {"precision": "bf16-mixed"}},
}

_CACHES = (params._params_per_rank, params.layer_tensors, params._partition, memory.activations.layer_activation_terms,
           schedules.in_flight_states, schedules._pipeline_actions)


def with_layers(base: dict, layers: int) -> Config:
    d = {k: dict(v) for k, v in base.items()}
    d["model"]["layers"] = layers
    return Config.from_dict(d)


def _valid(base: dict, layers: int) -> bool:
    try:
        with_layers(base, layers)
    except ConfigError:
        return False
    return True


def largest_layers(base: dict, cap: int = SEARCH_CAP) -> int:
    """The largest layer count up to ``cap`` that validation accepts (it accepts 1 .. a bound)."""
    if _valid(base, cap):
        return cap
    lo, hi = 32, cap
    if not _valid(base, lo):
        raise SystemExit(f"model.layers = {lo} is not accepted by the config's validation")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _valid(base, mid) else (lo, mid)
    return lo


def bench(cfg: Config, repeat: int) -> float:
    predict(cfg)  # one untimed call: imports and first-call costs stay out of the first series
    times = []
    for _ in range(repeat):
        for fn in _CACHES:
            fn.cache_clear()
        t0 = time.perf_counter()
        predict(cfg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=100, help="timed calls per (config, layers); default 100")
    args = ap.parse_args()
    for name, base in BASES.items():
        bound = largest_layers(base)
        counts = sorted({n for n in (32, 1_000, 100_000) if n <= bound} | {bound})
        medians = [bench(with_layers(base, n), args.repeat) for n in counts]
        print(name)
        for n, t in zip(counts, medians):
            print(f"  layers = {n:>9,}  predict() median {t * 1e3:8.3f} ms")
        for n in (1_000, 100_000):
            if n > bound:
                print(f"  layers = {n:>9,}  not accepted by the config (model.layers ≤ {bound:,})")
        print(f"  largest / smallest median: {max(medians) / min(medians):.2f}")

if __name__ == "__main__":
    main()
