"""Time ``engine.memory.memory_per_rank`` for one config; prints the median per call.

Run: .venv/bin/python benchmarks/bench_memory.py
The GUI recomputes on every slider move, so one config must take well under a millisecond.
Each config is timed cold-ish: the layout caches are cleared before every call, so the median
includes recomputing the parameter placement, not only a cache hit.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Config, default_config, memory  # noqa: E402
from engine.model import params
from engine.pipeline import schedules

CONFIGS = {
    "default (tiny, dp2 × pp2, 1F1B)": default_config(),
    "llama3-8b FSDP over 8": Config.from_dict({
        "model": {"preset": "llama3-8b"}, "cluster": {"preset": "dgx-h100"},
        "parallel": {"dp": 8, "zero": 3}, "training": {"precision": "bf16-mixed"}}),
    "llama3-70b 3D tp8 pp4 dp2, interleaved v2, SP": Config.from_dict({
        "model": {"preset": "llama3-70b"}, "cluster": {"preset": "h100-pod-64"},
        "parallel": {"dp": 2, "tp": 8, "pp": 4, "zero": 1, "schedule": "Interleaved1F1B",
                     "virtual_stages": 2, "microbatches": 16, "sequence_parallel": True},
        "training": {"precision": "bf16-mixed", "recompute": "selective"}}),
    "llama3-405b tp8 pp8 ZBV m32 (64 ranks)": Config.from_dict({
        "model": {"preset": "llama3-405b"}, "cluster": {"preset": "h100-pod-64"},
        "parallel": {"dp": 1, "tp": 8, "pp": 8, "schedule": "ZBVZeroBubble", "virtual_stages": 2,
                     "microbatches": 32}, "training": {"precision": "bf16-mixed", "recompute": "full"}}),
}


def _clear() -> None:
    # the parameter placement, the activation table and the pipeline's in-flight states (with the
    # action lists they are derived from)
    for fn in _CACHES:
        fn.cache_clear()


def _caches() -> tuple:
    if hasattr(memory, "activations"):  # engine.memory as a package
        return (params._params_per_rank, params.layer_tensors, memory.activations.layer_activation_terms,
                schedules.in_flight_states, schedules._pipeline_actions)
    return (params._params_per_rank, params.layer_tensors, memory._layer_activation_terms,  # the single module
            memory._interleaved_states, memory._zbv_states, memory._dualpipev_states)


_CACHES = _caches()


def bench(cfg: Config, repeat: int = 300, cold: bool = False) -> float:
    times = []
    for _ in range(repeat):
        if cold:
            _clear()
        t0 = time.perf_counter()
        memory.memory_per_rank(cfg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    print(f"{'config':48} {'warm median':>12} {'cold median':>12}")
    for name, cfg in CONFIGS.items():
        warm, cold = bench(cfg), bench(cfg, repeat=100, cold=True)
        print(f"{name:48} {warm * 1e6:9.0f} µs {cold * 1e6:9.0f} µs")


if __name__ == "__main__":
    main()
