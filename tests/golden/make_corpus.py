"""Record the golden corpus of predictions: random valid configs and what the engine says of them.

    .venv/bin/python tests/golden/make_corpus.py            # writes tests/golden/corpus.json.gz
    .venv/bin/python tests/golden/make_corpus.py --rerecord # same configs, new observations; prints what moved
    .venv/bin/python tests/golden/make_corpus.py --add-sweep N SEED  # append N full-size layouts of the fake sweep

``--add-sweep`` draws with ``benchmarks/fake_sweep.draw_layouts(N, SEED, max_layers=8)``: the space the backend runs
(mixtures of experts and expert parallelism, context parallelism, ZeRO-3's reshard policy, float8, compile, LoRA),
which this file's own generator does not reach; the entries are configs like the others.

Each entry keeps the config (as its dict, so the corpus does not depend on this generator's
randomness), every rank's memory by category and total, and the step's seconds. The test
``tests/test_golden.py`` holds the engine to it byte for byte. Re-record only when a prediction
is meant to change, and name the rows that moved in the commit.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# the corpus holds what the shipped device profiles predict, as the tests read them (tests/conftest.py), not this
# machine's measured CPU profile (``shardscope calibrate --device``): the engine reads it from this cache folder
os.environ["SHARDSCOPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardscope-corpus-cache-")

from engine import Config, ConfigError, names  # noqa: E402
from engine.predict import predict  # noqa: E402

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.json.gz"
MODELS = ("tiny", "gpt2-124m", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b")
GPUS = ("cpu", "a100-40g", "a100-80g", "h100-sxm", "h200", "b200", "mi300x", "rtx4090")


def random_raw(rng: random.Random) -> dict:
    model = rng.choice(MODELS)
    dp, tp, pp = rng.choice([1, 2, 4, 8]), rng.choice([1, 1, 2, 4, 8]), rng.choice([1, 1, 2, 4, 8])
    schedule = rng.choice(names.SCHEDULES)
    v = 2 if schedule in names.V_SCHEDULES else (1 if schedule in names.SINGLE_STAGE_SCHEDULES
                                                 else rng.choice([1, 2, 3]))
    zero = rng.choice([0, 0, 1, 2, 3])
    precision = rng.choice(names.PRECISIONS)
    grads = {"fp32": ["fp32"], "bf16-mixed": ["bf16", "fp32"], "fp16-mixed": ["fp16", "fp32"]}[precision]
    gpus_per_node = rng.choice([1, 2, 4, 8])
    world = dp * tp * pp
    raw = {
        "model": {"preset": model},
        "cluster": {"gpu": rng.choice(GPUS), "gpus": world,
                    "gpus_per_node": gpus_per_node if world % gpus_per_node == 0 else world},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "schedule": schedule, "virtual_stages": v,
                     "microbatches": rng.choice([1, 2, 3, 4, 8, 16]),
                     "sequence_parallel": tp > 1 and rng.random() < 0.5,
                     "replicate": rng.choice([1, 2]) if zero in (2, 3) and dp % 2 == 0 else 1},
        "training": {"micro_batch_size": rng.choice([1, 2, 4]), "precision": precision,
                     "grad_dtype": rng.choice(grads), "optimizer": rng.choice(names.OPTIMIZERS),
                     "recompute": rng.choice(("none", "selective", "full"))},  # the kinds of the recording
        "conventions": {"state_accounting": rng.choice(names.STATE_ACCOUNTINGS),
                        "collective_buffers": rng.random() < 0.7, "runtime_context": rng.random() < 0.8,
                        "fsdp_prefetch": rng.random() < 0.8,
                        "allocator_slack_fraction": rng.choice([0.0, 0.0, 0.05]),
                        "bubble": rng.choice(names.BUBBLE_CONVENTIONS)},
    }
    if rng.random() < 0.25:
        raw["model"].update(attention=rng.choice(names.ATTENTION_KINDS), dropout=rng.choice([0.0, 0.1]))
    if model == "tiny" and rng.random() < 0.3:
        raw["model"]["seq_len"] = rng.choice([32, 64, 128])
    if rng.random() < 0.2:
        raw["training"].update(finetune="lora", lora_rank=rng.choice([4, 8, 16]),
                               lora_targets=rng.choice(names.LORA_TARGETS),
                               lora_base_dtype=rng.choice(names.LORA_BASE_DTYPES))
    if rng.random() < 0.08:
        raw["parallel"].update(dp_mode="dataparallel", tp=1, pp=1, zero=0, replicate=1, schedule="1F1B",
                               virtual_stages=1, sequence_parallel=False)
        raw["cluster"].update(gpus=dp, gpus_per_node=max(dp, 8))
    return raw


def observe(cfg: Config) -> dict:
    pred = predict(cfg)
    mem = [[getattr(r, c) for c in names.MEMORY_CATEGORIES] + [r.total] for r in pred.memory.per_rank]
    return {"memory": mem, "step_seconds": pred.step.seconds}


def generate(n: int, seed: int = 20261201) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []
    seen: set[str] = set()
    tries = 0
    need = {("model", m) for m in MODELS} | {("schedule", s) for s in names.SCHEDULES} | \
           {("precision", p) for p in names.PRECISIONS} | {("zero", z) for z in range(4)} | \
           {("finetune", "lora"), ("dp_mode", "dataparallel")}
    got: set = set()
    while len(out) < n or not need <= got:
        tries += 1
        raw = random_raw(rng)
        try:
            cfg = Config.from_dict(raw)
        except ConfigError:
            continue
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        p, t = cfg.parallel, cfg.training
        got |= {("model", cfg.model.preset), ("precision", t.precision), ("zero", p.zero),
                ("finetune", t.finetune), ("dp_mode", p.dp_mode)}
        if p.pp > 1:
            got.add(("schedule", p.schedule))
        out.append({"config": cfg.to_dict(), **observe(cfg)})
    return out


def rerecord() -> list[dict]:
    """The stored configs observed again; prints each entry whose prediction moved and by how much."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        old = json.load(f)["entries"]
    out, moved = [], 0
    for i, e in enumerate(old):
        cfg = Config.from_dict(e["config"])
        new = {"config": e["config"], **observe(cfg)}
        if new["memory"] != e["memory"] or new["step_seconds"] != e["step_seconds"]:
            moved += 1
            d_tot = max(abs(a[-1] - b[-1]) for a, b in zip(new["memory"], e["memory"]))
            cats = sorted({names.MEMORY_CATEGORIES[j] for a, b in zip(new["memory"], e["memory"])
                           for j in range(len(names.MEMORY_CATEGORIES)) if a[j] != b[j]})
            print(f"entry {i}: {cfg.model.preset} on {cfg.cluster.gpu.name}, dp{cfg.parallel.dp} tp{cfg.parallel.tp} "
                  f"pp{cfg.parallel.pp}: {', '.join(cats) or 'step only'} moved, largest total change "
                  f"{d_tot / 2**20:.1f} MiB, step {e['step_seconds']:.6g} -> {new['step_seconds']:.6g} s")
        out.append(new)
    print(f"{moved} of {len(old)} entries moved")
    return out


def add_sweep(n: int, seed: int) -> list[dict]:
    """The stored entries and ``n`` layouts of the fake sweep's draw (``seed``) that none of them holds, observed."""
    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    from fake_sweep import draw_layouts  # noqa: PLC0415 (a benchmark's drawer, only here)

    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        out = json.load(f)["entries"]
    seen = {json.dumps(e["config"], sort_keys=True) for e in out}
    added = 0
    for cfg in draw_layouts(n, seed, max_layers=8).values():
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append({"config": cfg.to_dict(), **observe(cfg)})
            added += 1
    print(f"added {added} layouts of the fake sweep's draw (seed {seed})")
    return out


def main() -> None:
    if sys.argv[1:] == ["--rerecord"]:
        corpus = rerecord()
    elif sys.argv[1:2] == ["--add-sweep"] and len(sys.argv) == 4:
        corpus = add_sweep(int(sys.argv[2]), int(sys.argv[3]))
    else:
        corpus = generate(int(sys.argv[1]) if len(sys.argv) > 1 else 480)
    with gzip.open(CORPUS, "wt", encoding="utf-8") as f:
        json.dump({"count": len(corpus), "categories": list(names.MEMORY_CATEGORIES) + ["total"],
                   "entries": corpus}, f, separators=(",", ":"))
    print(f"wrote {len(corpus)} entries to {CORPUS}")


if __name__ == "__main__":
    main()
