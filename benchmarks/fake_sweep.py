"""Random full-size layouts: the engine against ``shardscope measure --fake``, worst rows first.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fake_sweep.py [--n 40] [--seed 0] [--max-layers L]
        [--out DIR] [--refresh] [--retry-failed] [--timeout S] [--expandable-segments] [--json | --markdown]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/fake_sweep.py --n 40 --seed 0 --list   # the draws only

Draws ``--n`` layouts from ``--seed`` (``draw_layouts``) over what the backend runs, at full size on
h100-96g: dense presets (Llama 3 8B / 70B / 405B, Llama 2 7B, GPT-2) and mixtures of experts (Mixtral
8x7B, Qwen3 30B-A3B and 235B-A22B), seq 2K–128K, local batch 1–16 (at most 256K tokens a microbatch),
dp / tp / pp / cp / ep, ZeRO 0–3 and HSDP, every schedule and virtual stage count, every recompute
kind, float8 tensorwise / rowwise, compile, LoRA, bf16-mixed (fp32 or bf16 gradients) or fp32. A draw
is kept only when the config is valid, the backend can run it (``engine.backend_limits.predict_only``,
torch's ring on CPU, what fake tensors cannot run) and the engine says it fits the GPU (a replay that
runs out of memory stops at that moment, so it compares nothing). ``--max-layers L`` cuts each model to
at most L layers (a multiple of pp·virtual stages; full width kept): fake runs cost about 60 s for
Llama 3 8B and 300 s for 70B on two shared cores, 4–63 s at 4–8 layers.

Each layout runs ``python -m gui.cli measure CONFIG --fake --json`` (``fake_vs_engine.simulate``: one
simulated rank per pipeline rank, dp = tp = cp = 0: the engine's distinct rank groups differ by stage; and
each one's last cp-rank where the per-op policy over the ring attention makes cp-ranks differ,
``backend.fake.default_ranks``; other ranks of one stage that it tells apart, such as ZeRO-1's uneven
optimizer shares, are not run) and
is compared with ``engine.predict`` (``fake_vs_engine.rows_of``) per simulated rank: allocated (the
engine's tracked bytes at its peak vs the modelled caching allocator's max_allocated), reserved (vs
max_reserved) and each category but ``overhead`` (runtime context and NCCL buffers: no fake run has
them). Error = (engine − fake) / fake. Bounds: allocated within 3 %, reserved within 5 %, every
category above 1 GiB (on either side) within 5 %; a row outside any is marked.

Fake runs are cached in ``--out`` (default runs/fake_sweep, git-ignored) by a hash of the config's
canonical TOML (``Config.dumps_toml``) and the allocator flag, never by name: after an engine change a
rerun only predicts again (seconds); ``--refresh`` simulates again (after a backend change). A failed
run is kept as ``<hash>.failed.json`` and reported as a row; ``--retry-failed`` runs those again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fake_vs_engine import error, rows_of, simulate  # noqa: E402
from engine.config import Config, ConfigError  # noqa: E402
from engine.model.presets import model_presets  # noqa: E402
from engine.names import RECOMPUTE_KINDS, SCHEDULES, V_SCHEDULES  # noqa: E402

GIB = 2**30
ALLOCATED_BOUND = 0.03
RESERVED_BOUND = 0.05
CATEGORY_BOUND = 0.05
CATEGORY_FLOOR = GIB  # a category is held to its bound above this (either side)
UNSIMULATED = ("overhead",)  # runtime context, collective-library buffers: not in a fake run

DENSE = ("llama3-8b", "llama3-70b", "llama3-405b", "llama2-7b", "gpt2-124m")
MOE = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b")
SEQS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
BATCHES = (1, 2, 4, 8, 16)
MAX_MICROBATCH_TOKENS = 262144
INTERLEAVED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
TRIES_PER_PRESET = 400


# --------------------------------------------------------------------------- drawing


def _draw_parallel(rng: random.Random, moe: bool) -> dict:
    """dp / tp / pp / cp, ZeRO (and HSDP), schedule, virtual stages, microbatches, split."""
    dp, tp, pp = rng.choice((1, 2, 4, 8, 16, 32)), rng.choice((1, 1, 2, 4, 8)), rng.choice((1, 1, 2, 4, 8))
    cp = 1 if moe else rng.choice((1, 1, 1, 2, 4))
    schedule = rng.choice(SCHEDULES) if pp > 1 else "1F1B"
    v = 2 if schedule in V_SCHEDULES else rng.choice((2, 3, 4)) if schedule in INTERLEAVED else 1
    if pp > 1:
        m = pp * rng.choice((1, 2, 4)) * (2 if schedule == "DualPipeV" else 1)
    else:
        m = rng.choice((1, 1, 2))
    par = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": rng.choice((0, 1, 2, 3, 3)) if dp * cp > 1 else 0,
           "schedule": schedule, "virtual_stages": v, "microbatches": m,
           "sequence_parallel": tp > 1 and not moe and rng.random() < 0.6}
    if par["zero"] in (2, 3) and dp >= 4 and rng.random() < 0.3:
        par["replicate"] = rng.choice([r for r in (2, 4) if r < dp])
    if par["zero"] == 3 and rng.random() < 0.2:
        par["fsdp_reshard_after_forward"] = rng.choice(("always", "never"))
    if pp > 1 and rng.random() < 0.3:
        par["pipeline_split"] = "torchtitan"
    return par


def _draw_training(rng: random.Random, dense: bool, tp: int) -> dict:
    """Batch, precision, recompute, and the knobs: float8, compile, LoRA (dense models only)."""
    bf16 = rng.random() < 0.9
    tr = {"precision": "bf16-mixed" if bf16 else "fp32", "grad_dtype": rng.choice(("fp32", "bf16")) if bf16 else "fp32",
          "optimizer": "adamw", "recompute": rng.choice(RECOMPUTE_KINDS)}
    if tr["recompute"] == "selective-layer":
        tr["recompute_every"] = rng.choice((2, 4))
    if dense and bf16 and rng.random() < 0.3:
        tr["float8"] = rng.choice(("tensorwise", "rowwise"))
    if dense and rng.random() < 0.2:
        tr["compile"] = True
    if dense and tp == 1 and "float8" not in tr and rng.random() < 0.2:
        tr.update(finetune="lora", lora_rank=rng.choice((8, 16, 64)),
                  lora_targets=rng.choice(("attention", "mlp", "all")),
                  lora_base_dtype=rng.choice(("fp32", "bf16")) if bf16 else "fp32")
    return tr


def _layers(preset_layers: int, stages: int, max_layers: int | None) -> int | None:
    """The layer count under ``max_layers`` (a multiple of the stages), None to keep the preset's, 0
    when no such count exists (the draw is refused)."""
    if max_layers is None or preset_layers <= max_layers:
        return None
    layers = max_layers - max_layers % stages
    return layers if layers >= stages else 0


def _draw_raw(rng: random.Random, preset: str, max_layers: int | None) -> dict | None:
    """One drawn layout of ``preset`` as a config dict (None: refused before validation)."""
    spec = model_presets()[preset]
    moe = bool(spec.get("experts"))
    par = _draw_parallel(rng, moe)
    seq = rng.choice(SEQS)
    model = {"preset": preset, "seq_len": seq}
    layers = _layers(spec["layers"], par["pp"] * par["virtual_stages"], max_layers)
    if layers == 0:
        return None
    if layers:
        model["layers"] = layers
    if moe:
        shard = par["dp"] // par.get("replicate", 1) * par["cp"] * par["tp"]
        par["ep"] = rng.choice([e for e in (1, 2, 4, 8, 16, 32) if shard % e == 0 and spec["experts"] % e == 0])
    tr = _draw_training(rng, not moe, par["tp"])
    tr["micro_batch_size"] = rng.choice([b for b in BATCHES if b * seq <= MAX_MICROBATCH_TOKENS])
    world = par["dp"] * par["tp"] * par["pp"] * par["cp"]
    return {"schema_version": 1, "model": model, "cluster": {"gpu": "h100-96g", "gpus": world, "gpus_per_node": 8},
            "parallel": par, "training": tr}


def refusal(cfg: Config) -> str | None:
    """Why a drawn ``cfg`` is not kept (None: kept): what the backend cannot run, what a fake run cannot,
    and a layout the engine says does not fit."""
    from backend.fake_worker import fake_refusal  # no torch at import
    from engine.backend_limits import predict_only
    from engine.memory import memory_per_rank

    why = predict_only(cfg) or [fake_refusal(cfg)]
    why = [w for w in why if w]
    if why:
        return why[0]
    return None if memory_per_rank(cfg).fits else "the engine says it does not fit"


def layout_name(index: int, cfg: Config) -> str:
    """``#NN preset Llayers s<seq>K b<batch> | layout | training``: the draw's index makes it unique."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    parts = [f"#{index:02d} {m.preset} L{m.layers} s{m.seq_len // 1024}K b{tr.micro_batch_size} |",
             f"dp{par.dp}" + (f"r{par.replicate}" if par.replicate > 1 else ""),
             f"tp{par.tp}" + ("sp" if par.sequence_parallel else ""), f"pp{par.pp}", f"cp{par.cp}"]
    parts += [f"ep{par.ep}"] if par.ep > 1 else []
    parts += [f"z{par.zero}" + ({"always": "+rs", "never": "-rs"}.get(par.fsdp_reshard_after_forward, ""))]
    if par.pp > 1:
        parts += [par.schedule, f"v{par.virtual_stages}"] + (["tt"] if par.pipeline_split == "torchtitan" else [])
    parts += [f"m{par.microbatches} |", tr.recompute + (str(tr.recompute_every) if tr.recompute == "selective-layer"
                                                         else "")]
    parts += ["fp32" if tr.precision == "fp32" else f"bf16/g{tr.grad_dtype}"]
    parts += [f"fp8-{tr.float8}"] if tr.float8 != "none" else []
    parts += ["compile"] if tr.compile else []
    parts += [f"lora{tr.lora_rank}-{tr.lora_targets}-{tr.lora_base_dtype}"] if tr.lora else []
    return " ".join(parts)


def config_hash(cfg: Config, expandable: bool = False) -> str:
    """The cache key of a fake run: its config's canonical TOML and the allocator flag."""
    text = cfg.dumps_toml() + ("\n# expandable_segments\n" if expandable else "")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _draw_one(rng: random.Random, preset: str, max_layers: int | None, seen: set[str]) -> Config | None:
    """A kept layout of ``preset`` (valid, runnable, fitting, not drawn before) within ``TRIES_PER_PRESET``
    draws, else None: a big model fits in few layouts, so its layouts are drawn until one does."""
    for _ in range(TRIES_PER_PRESET):
        raw = _draw_raw(rng, preset, max_layers)
        if raw is None:
            continue
        try:
            cfg = Config.from_dict(raw)
        except ConfigError:
            continue
        if config_hash(cfg) not in seen and not refusal(cfg):
            return cfg
    return None


def draw_layouts(n: int, seed: int, max_layers: int | None = None) -> dict[str, Config]:
    """``n`` distinct layouts drawn from ``seed`` (the same for the same arguments), each valid, runnable
    by the backend and fitting by the engine (:func:`refusal`): a preset (dense two times in three), then
    its layouts until one is kept (:func:`_draw_one`); at most 4·n presets are tried."""
    rng = random.Random(seed)
    out: dict[str, Config] = {}
    seen: set[str] = set()
    for _ in range(4 * max(n, 1)):
        if len(out) == n:
            return out
        preset = rng.choice(DENSE) if rng.random() < 0.65 else rng.choice(MOE)
        cfg = _draw_one(rng, preset, max_layers, seen)
        if cfg is not None:
            seen.add(config_hash(cfg))
            out[layout_name(len(out), cfg)] = cfg
    if len(out) < n:
        raise RuntimeError(f"kept {len(out)} of {n} layouts after {4 * max(n, 1)} presets (seed {seed})")
    return out


# --------------------------------------------------------------------------- running


def run_layout(cfg: Config, out: Path, timeout_s: float, refresh: bool, retry_failed: bool,
               expandable: bool) -> tuple[dict | None, str | None, bool]:
    """(the fake run's document, or None and why it failed, whether it came from the cache)."""
    key = config_hash(cfg, expandable)
    doc_path, failed = out / f"{key}.json", out / f"{key}.failed.json"
    if not refresh and doc_path.exists():
        return json.loads(doc_path.read_text(encoding="utf-8")), None, True
    if not (refresh or retry_failed) and failed.exists():
        return None, json.loads(failed.read_text(encoding="utf-8"))["reason"], True
    out.mkdir(parents=True, exist_ok=True)
    for stale in (doc_path, failed):
        stale.unlink(missing_ok=True)
    shutil.rmtree(out / key, ignore_errors=True)  # an earlier run's directory: measure refuses a taken one
    config = cfg.save(out / f"{key}.toml")
    try:
        return simulate(config, out / key, timeout_s, reuse=False, expandable=expandable), None, False
    except SystemExit as exc:  # fake_vs_engine.simulate: the exit status and the tail of stderr
        lines = [x.strip() for x in str(exc.code).splitlines() if x.strip()]
        reason = "failed: " + (lines[-1] if lines else "no output")
        failed.write_text(json.dumps({"reason": reason, "timeout_s": timeout_s, "message": str(exc.code)}),
                          encoding="utf-8")
        return None, reason, False


def _category_worst(categories: dict) -> tuple[str | None, float | None]:
    """The category above the floor (either side; simulated ones only) with the largest |error|."""
    big = [(c, error(e, f)) for c, (e, f) in categories.items()
           if c not in UNSIMULATED and max(e, f) > CATEGORY_FLOOR]
    if not big:
        return None, None
    return max(big, key=lambda x: abs(x[1]))


def flat_rows(name: str, key: str, rows: list[dict], doc: dict, notes: list[str] | None = None) -> list[dict]:
    """``fake_vs_engine.rows_of`` rows as one flat row per simulated rank, with errors, bounds and
    ``notes`` (what the row's comparison leaves out)."""
    oom = {r["rank"]: r.get("oom") for r in doc.get("reserved", [])}
    out = []
    for r in rows:
        a, res = error(*r["allocated"]), error(*r["reserved"])
        cat, cat_err = _category_worst(r["categories"])
        out.append({
            "layout": name, "hash": key, "rank": r["rank"], "stage": r["stage"], "peak_moment": r["peak_moment"],
            "allocated": list(r["allocated"]), "allocated_error": a,
            "reserved": list(r["reserved"]), "reserved_error": res,
            "categories": {c: list(v) for c, v in r["categories"].items()},
            "worst_category": cat, "worst_category_error": cat_err, "oom": oom.get(r["rank"]), "notes": notes or [],
            "within": {"allocated": abs(a) <= ALLOCATED_BOUND, "reserved": abs(res) <= RESERVED_BOUND,
                       "categories": cat_err is None or abs(cat_err) <= CATEGORY_BOUND},
        })
    return out


def badness(row: dict) -> float:
    """The sort key: a failed row first, then the largest |error| of allocated and reserved."""
    if "failed" in row:
        return float("inf")
    return max(abs(row["allocated_error"]), abs(row["reserved_error"]))


def rank_rows(rows: list[dict]) -> list[dict]:
    """Worst rows first (stable for ties: layout order, then rank)."""
    return sorted(rows, key=lambda r: -badness(r))


def summary(rows: list[dict]) -> dict:
    """Counts against the bounds over the simulated ranks (failed layouts counted apart)."""
    ok = [r for r in rows if "failed" not in r]
    failed = sorted({r["layout"] for r in rows if "failed" in r})
    return {"layouts": len({r["layout"] for r in rows}), "ranks": len(ok), "failed_layouts": len(failed),
            "allocated_within": sum(r["within"]["allocated"] for r in ok),
            "reserved_within": sum(r["within"]["reserved"] for r in ok),
            "categories_within": sum(r["within"]["categories"] for r in ok),
            "bounds": {"allocated": ALLOCATED_BOUND, "reserved": RESERVED_BOUND, "category": CATEGORY_BOUND,
                       "category_floor_bytes": CATEGORY_FLOOR}}


def summary_line(s: dict) -> str:
    r = s["ranks"]
    return (f"{s['layouts']} layouts, {r} simulated ranks: allocated within {ALLOCATED_BOUND * 100:.0f} % on "
            f"{s['allocated_within']}/{r}, reserved within {RESERVED_BOUND * 100:.0f} % on {s['reserved_within']}/{r}, "
            f"categories >1 GiB within {CATEGORY_BOUND * 100:.0f} % on {s['categories_within']}/{r}"
            + (f"; {s['failed_layouts']} layouts failed to simulate" if s["failed_layouts"] else ""))


# --------------------------------------------------------------------------- output


HEAD = ("layout", "rank", "stage", "alloc engine", "alloc fake", "err", "resv engine", "resv fake", "err",
        "worst category >1 GiB", "err", "out of bounds")


def _pct(x: float | None) -> str:
    return "—" if x is None else "∞" if math.isinf(x) else f"{x * 100:+.1f}%"


def _cells(r: dict) -> tuple[str, ...]:
    if "failed" in r:
        return (r["layout"], "—", "—") + ("—",) * (len(HEAD) - 4) + (r["failed"],)
    (ae, af), (re_, rf) = r["allocated"], r["reserved"]
    marks = [k for k in ("allocated", "reserved", "categories") if not r["within"][k]]
    marks += ["fake OOM"] if r.get("oom") else []
    marks += [f"({n})" for n in r.get("notes", [])]
    cat = r["worst_category"]
    return (r["layout"], str(r["rank"]), str(r["stage"]), f"{ae / GIB:.2f}", f"{af / GIB:.2f}",
            _pct(r["allocated_error"]), f"{re_ / GIB:.2f}", f"{rf / GIB:.2f}", _pct(r["reserved_error"]),
            f"{cat} {r['categories'][cat][0] / GIB:.2f}/{r['categories'][cat][1] / GIB:.2f}" if cat else "—",
            _pct(r["worst_category_error"]), " ".join(marks))


def render(rows: list[dict]) -> str:
    """A plain-text table (GiB; engine, fake, error), the rows as given."""
    body = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEAD)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEAD, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(lines)


def render_markdown(rows: list[dict]) -> str:
    numbers = {3, 4, 5, 6, 7, 8, 10}
    out = ["| " + " | ".join(HEAD) + " |", "|" + "|".join("---:" if i in numbers else "---" for i in range(len(HEAD))) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(out)


def sweep(layouts: dict[str, Config], args: argparse.Namespace) -> list[dict]:
    """Every layout simulated (or read from the cache) and compared; progress on stderr."""
    rows: list[dict] = []
    for i, (name, cfg) in enumerate(layouts.items()):
        t0 = time.perf_counter()
        doc, why, cached = run_layout(cfg, args.out, args.timeout, args.refresh, args.retry_failed,
                                      args.expandable_segments)
        key = config_hash(cfg, args.expandable_segments)
        state = "cached" if cached else f"simulated in {time.perf_counter() - t0:.0f} s"
        print(f"[{i + 1}/{len(layouts)}] {name}: {why + ' (' + state + ')' if why else state}",
              file=sys.stderr, flush=True)
        if why:
            rows.append({"layout": name, "hash": key, "failed": why})
        else:
            rows += flat_rows(name, key, rows_of(cfg, doc), doc, notes_of(cfg))
    return rank_rows(rows)


def notes_of(cfg: Config) -> list[str]:
    """What a fake run of ``cfg`` measures differently from what the engine predicts."""
    # the fake trainer runs compiled blocks eagerly (fake_vs_engine.compared_config): the row compares the
    # engine's eager prediction of the layout
    return ["compile: fake and engine eager"] if cfg.training.compile else []


def _finite(x):
    """JSON without Infinity: an error whose fake side is 0 (and the engine's not) becomes null."""
    if isinstance(x, float) and math.isinf(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=40, help="layouts to draw (default 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-layers", type=int, help="cut each model to at most this many layers (full width)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "fake_sweep", help="the cache of fake runs")
    ap.add_argument("--refresh", action="store_true", help="simulate again, ignoring the cache")
    ap.add_argument("--retry-failed", action="store_true", help="simulate again the layouts that failed before")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per fake run (default 3600)")
    ap.add_argument("--expandable-segments", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the drawn layouts and their cache keys only")
    out_kind = ap.add_mutually_exclusive_group()
    out_kind.add_argument("--json", action="store_true", help="the rows and the summary as JSON")
    out_kind.add_argument("--markdown", action="store_true", help="the table as markdown")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    layouts = draw_layouts(args.n, args.seed, args.max_layers)
    if args.list:
        for name, cfg in layouts.items():
            print(f"{config_hash(cfg, args.expandable_segments)}  {name}")
        return 0
    t0 = time.perf_counter()
    rows = sweep(layouts, args)
    s = summary(rows)
    if args.json:
        print(json.dumps(_finite({"seed": args.seed, "n": args.n, "max_layers": args.max_layers, "summary": s,
                                  "rows": rows}), indent=1))
        return 0
    print(render_markdown(rows) if args.markdown else render(rows))
    print()
    print(summary_line(s))
    print(f"{time.perf_counter() - t0:.0f} s; fake runs cached in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
