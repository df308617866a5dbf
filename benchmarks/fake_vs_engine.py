"""The engine's allocated peak against ``shardscope measure --fake`` of the same config, at full size.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fake_vs_engine.py [CONFIG ...] [--out DIR] [--reuse]
        [--timeout S] [--expandable-segments]

CONFIG defaults to every ``assets/examples/fake/*.toml`` (the full-size rows; ``fake/probes/`` holds
smaller layouts for quick probes, run only when named). For each config the script runs
``python -m gui.cli measure CONFIG --fake --json --out DIR/<name>`` (one simulated rank per pipeline
stage: dp = 0, tp = 0) and ``engine.predict``, then prints per simulated rank and per category the
engine's bytes (the snapshot at its peak) beside the simulated ones (the tracker's snapshot at its
peak; params / grads / optimizer exact), and the two peaks that are compared:

- allocated: the engine's ``allocated`` (tracked bytes at its peak moment) vs the simulated rank's
  modelled caching allocator's ``max_allocated`` (every storage the tracker saw, replayed);
- reserved: the engine's ``reserved`` vs the simulated ``max_reserved`` (same allocator model).

The error is (engine − simulated) / simulated; a row beyond ±5 % is marked. ``--reuse`` reads an
existing ``DIR/<name>.json`` instead of simulating again (fake runs take minutes on few cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import Config  # noqa: E402
from engine.names import MEMORY_CATEGORIES  # noqa: E402
from engine.predict import predict  # noqa: E402

GIB = 2**30
TOLERANCE = 0.05


def simulate(config: Path, out: Path, timeout_s: float, reuse: bool, expandable: bool) -> dict:
    """The ``measure --fake --json`` document of ``config`` (cached at ``out``.json)."""
    cache = out.with_suffix(".json")
    if reuse and cache.exists():
        return json.loads(cache.read_text(encoding="utf-8"))
    cmd = [sys.executable, "-m", "gui.cli", "measure", str(config), "--fake", "--json", "--out", str(out),
           "--timeout", str(timeout_s)]
    if expandable:
        cmd.append("--expandable-segments")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{config}: measure --fake failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    doc = json.loads(proc.stdout)
    doc["wall_seconds"] = time.perf_counter() - t0
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(doc), encoding="utf-8")
    return doc


def error(engine: int, simulated: int) -> float:
    return (engine - simulated) / simulated if simulated else float("inf") if engine else 0.0


def compared_config(cfg: Config) -> Config:
    """The config whose prediction a fake run of ``cfg`` is compared with: ``cfg`` itself, but a compiled one
    as eager. The fake trainer runs compiled blocks eagerly and does not count what inductor's kernels save
    (backend.fake_worker: ``counts_compiled_saved = False``), so its activations and temporaries are the eager
    blocks'; against the engine's compiled prediction a row measures the difference between eager and
    compiled blocks, not the engine's error (async TP, which needs compile, goes with it)."""
    if not cfg.training.compile:
        return cfg
    return cfg.replace(training={"compile": False}, parallel={"async_tp": False})


def rows_of(cfg: Config, doc: dict) -> list[dict]:
    """Per simulated rank: its categories, allocated and reserved, the engine's (for ``compared_config(cfg)``)
    and the simulation's side by side."""
    pred = {r.rank: r for r in predict(compared_config(cfg)).memory.per_rank}
    sim_cats = {r["rank"]: r for r in doc["memory"]["per_rank"]}
    alloc = {r["rank"]: r for r in doc["reserved"]}
    out = []
    for rank in doc["simulated_ranks"]:
        p, s, a = pred[rank], sim_cats[rank], alloc[rank]
        out.append({
            "rank": rank, "stage": s.get("stage", 0), "peak_moment": p.peak_moment,
            "categories": {c: (int(getattr(p, c)), int(s.get(c, 0))) for c in MEMORY_CATEGORIES},
            "allocated": (int(p.allocated), int(a["max_allocated"])),
            "reserved": (int(p.reserved), int(a["max_reserved"])),
        })
    return out


def render(name: str, rows: list[dict], seconds: float | None) -> str:
    lines = [f"== {name}" + (f" (fake run {seconds:.0f} s)" if seconds else "")]
    for r in rows:
        lines.append(f"rank {r['rank']} (stage {r['stage']}; engine peak at {r['peak_moment'] or 'n/a'})")
        lines.append(f"  {'':<13}{'engine GiB':>11}{'fake GiB':>10}{'error':>9}")
        for c, (e, s) in r["categories"].items():
            lines.append(f"  {c:<13}{e / GIB:>11.3f}{s / GIB:>10.3f}{'':>9}")
        for k in ("allocated", "reserved"):
            e, s = r[k]
            err = error(e, s)
            mark = "" if abs(err) <= TOLERANCE else "  > 5 %"
            lines.append(f"  {k:<13}{e / GIB:>11.3f}{s / GIB:>10.3f}{err * 100:>+8.1f}%{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "fake_vs_engine")
    ap.add_argument("--reuse", action="store_true", help="read DIR/<name>.json from an earlier run when present")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per fake run")
    ap.add_argument("--expandable-segments", action="store_true")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    args = ap.parse_args(argv)
    configs = args.configs or sorted((ROOT / "assets" / "examples" / "fake").glob("*.toml"))
    worst = 0.0
    everything = {}
    for path in configs:
        cfg = Config.load(path)
        doc = simulate(path.resolve(), args.out / path.stem, args.timeout, args.reuse, args.expandable_segments)
        rows = rows_of(cfg, doc)
        everything[path.stem] = rows
        worst = max([worst] + [abs(error(*r["allocated"])) for r in rows])
        if not args.json:
            print(render(path.stem, rows, doc.get("wall_seconds")))
            print()
    if args.json:
        print(json.dumps(everything, indent=1))
    else:
        print(f"largest allocated-peak error: {worst * 100:.1f} % (target ≤ {TOLERANCE * 100:.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
