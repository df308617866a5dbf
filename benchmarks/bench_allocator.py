"""Caching-allocator replay speed: the GUI replays a rank's allocation timeline on every slider move.

Goal: 100,000 events (50,000 mallocs and their frees) well under 0.5 s.
Prints medians; asserts nothing (timing is machine-dependent).

    .venv/bin/python benchmarks/bench_allocator.py [--repeat N]

Workloads (seeded, 100,000 events each):
  training  a step's shape: per layer a few long-lived large tensors (saved activations, freed
            in reverse in the backward) among many short-lived small and medium temporaries
  random    sizes log-uniform from 1 B to 256 MiB, each freed after a random number of mallocs
            (up to ~2,000 live at once), on 2 streams
Each runs with the default segments and with expandable segments.

History (medians of 5, 2 shared cores, first version): training 0.11-0.13 s default, 0.11 s
expandable; random 0.11-0.12 s default, 0.15-0.16 s expandable. With the cores oversubscribed
(load 8) wall time reached 0.34-1.04 s while CPU time stayed 0.12-0.18 s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.memory.allocator import replay  # noqa: E402

MIB = 1 << 20


def training_events(n_events: int = 100_000, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    events: list[tuple] = []
    saved: list[int] = []
    key = 0
    for _ in range(n_events // 34):  # forwards (19 events a layer): saved tensors stay, temporaries go
        for _ in range(3):
            events.append(("alloc", key, rng.choice((1, 2, 3, 4)) * MIB + rng.choice((0, 512, 4096))))
            saved.append(key)
            key += 1
        for _ in range(8):
            events.append(("alloc", key, rng.randint(1, 24 * MIB)))
            events.append(("free", key))
            key += 1
    while saved:  # backwards (5 events a saved tensor): each freed in reverse, with gradient temporaries
        k = saved.pop()
        events.append(("alloc", key, rng.choice((1, 2, 3, 4)) * MIB))
        events.append(("alloc", key + 1, rng.randint(1, 2 * MIB)))
        events.append(("free", key + 1))
        events.append(("free", k))
        events.append(("free", key))
        key += 2
    return events


def random_events(n_events: int = 100_000, seed: int = 1) -> list[tuple]:
    rng = random.Random(seed)
    events: list[tuple] = []
    pending: dict[int, list[int]] = {}
    step = 0
    key = 0
    while len(events) < n_events:
        for k in pending.pop(step, ()):
            events.append(("free", k))
        nbytes = int(2 ** rng.uniform(0, 28))
        events.append(("alloc", key, nbytes, rng.randrange(2)))
        pending.setdefault(step + rng.randint(1, 4000), []).append(key)
        key += 1
        step += 1
    return events[:n_events]


def _median_s(fn, repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds (CPU time is what to read on a loaded shared machine)."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    for name, events in (("training", training_events()), ("random", random_events())):
        for expandable in (False, True):
            s, cpu = _median_s(lambda ev=events, ex=expandable: replay(ev, expandable_segments=ex), args.repeat)
            st = replay(events, expandable_segments=expandable)
            mode = "expandable" if expandable else "default"
            print(f"{name:9s} {mode:10s} {len(events):7,d} events  {s:.3f} s (CPU {cpu:.3f} s)  "
                  f"max_allocated {st.max_allocated / MIB:9.1f} MiB  max_reserved {st.max_reserved / MIB:9.1f} MiB  "
                  f"segments {st.segments}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
