"""Fuzz the engine over the whole config space: every draw must be refused with the config error or
predicted with finite, non-negative numbers, within a second.

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz_configs.py --n 10000 --seed 7

Draws ``--n`` configs from ``tests/config_space.py`` (valid-biased, a share with junk fields), loads
each as the CLI does (``Config.from_dict``), predicts the valid ones, renders the CLI's table (which
asks every distinct rank's reserved bytes, the caching-allocator replay; the time includes it) and
checks every number a person or a program reads. Prints the counts (refused, predicted, crashed),
the slowest predictions (median and worst seconds, and the slowest configs' layouts), and each
crash with its config; exit 1 on a crash, a bad number or a prediction over ``--limit`` seconds.
Times are wall seconds on this machine: read them beside the machine's load.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from config_space import bad_numbers, random_config  # noqa: E402

from engine import Config, ConfigError  # noqa: E402
from engine.predict import predict  # noqa: E402
from gui.text import prediction_table  # noqa: E402


class _Abandoned(Exception):
    pass


def _abandon(signum, frame):
    raise _Abandoned


def check(raw: dict, give_up_s: float = 60.0) -> tuple[str, float, str]:
    """("refused" | "predicted" | "bad" | "crash" | "abandoned", predict seconds, detail); a prediction
    still running after ``give_up_s`` is abandoned (and counts as over the limit)."""
    try:
        cfg = Config.from_dict(raw)
    except ConfigError:
        return "refused", 0.0, ""
    except Exception:  # noqa: BLE001 - what the fuzz is for
        return "crash", 0.0, "Config.from_dict: " + traceback.format_exc(limit=6)
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _abandon)
    signal.setitimer(signal.ITIMER_REAL, give_up_s)
    try:
        pred = predict(cfg)
        prediction_table(pred)  # asks every distinct rank's reserved bytes: the allocator replay
        seconds = time.perf_counter() - t0
    except _Abandoned:
        return "abandoned", time.perf_counter() - t0, f"still predicting after {give_up_s:g} s"
    except Exception:  # noqa: BLE001
        return "crash", time.perf_counter() - t0, "predict: " + traceback.format_exc(limit=8)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    bad = bad_numbers(pred)
    return ("bad", seconds, "; ".join(bad[:5])) if bad else ("predicted", seconds, "")


def layout(raw: dict) -> str:
    par, m = raw.get("parallel", {}), raw.get("model", {})
    name = m.get("preset") if isinstance(m, dict) else None
    return (f"{name or 'custom'} gpus={raw.get('cluster', {}).get('gpus')} "
            + " ".join(f"{k}={par.get(k)}" for k in ("dp", "tp", "pp", "cp", "ep", "zero", "schedule",
                                                     "virtual_stages", "microbatches") if isinstance(par, dict)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--junk", type=float, default=0.3, help="share of draws given junk fields")
    ap.add_argument("--limit", type=float, default=1.0, help="seconds a prediction may take")
    ap.add_argument("--slowest", type=int, default=5)
    ap.add_argument("--give-up", type=float, default=60.0, help="seconds after which a prediction is abandoned")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    times: list[tuple[float, str]] = []
    failures = []
    t0 = time.perf_counter()
    for i in range(args.n):
        raw = random_config(rng, args.junk)
        kind, seconds, detail = check(raw, args.give_up)
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "predicted":
            times.append((seconds, layout(raw)))
        if kind in ("crash", "bad", "abandoned") or seconds > args.limit:
            failures.append((i, kind, seconds, detail, raw))
            print(f"#{i} {kind} {seconds:.1f} s: {layout(raw)}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    print(f"{args.n} configs (seed {args.seed}, junk {args.junk:g}) in {wall:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if times:
        s = sorted(t for t, _ in times)
        print(f"predict: median {statistics.median(s) * 1e3:.1f} ms, p99 {s[int(0.99 * (len(s) - 1))] * 1e3:.1f} ms, "
              f"worst {s[-1] * 1e3:.1f} ms (limit {args.limit * 1e3:.0f} ms)")
        for seconds, what in sorted(times, reverse=True)[:args.slowest]:
            print(f"  {seconds * 1e3:8.1f} ms  {what}")
    for i, kind, seconds, detail, raw in failures[:20]:
        print(f"\n#{i} {kind} ({seconds * 1e3:.0f} ms): {detail}\n  {json.dumps(raw, default=str)[:1500]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
