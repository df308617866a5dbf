"""ShardScope against torchtitan's published H100 benchmarks (Tables 1 to 5 of
pytorch/torchtitan's benchmarks/llama3_h100_202412_torchtitan.md; issue 26's bar is Tables 1, 3 and 5,
``BAR_TABLES``: Tables 2 (context parallel) and 4 (FSDP × TP, async TP) are further predictions).

Run:  .venv/bin/python benchmarks/published.py [--markdown benchmarks/published.md]

Every row of those tables is a config in assets/examples/published/*.toml; each file carries, in
``# published.<key> = <value>`` comments (Config.load ignores comments and refuses unknown
sections), the source, table, row, the published TPS per GPU and memory, and states the
assumptions the table does not (sequence, optimizer, reduce dtype, float8 recipe, microbatches).
The engine predicts each as it is, nothing tuned per row, and this prints beside the published
figures:

* memory: the predicted *reserved* bytes of the worst rank (``max`` over ranks of
  ``RankMemory.reserved``: each rank's step replayed through the caching-allocator model,
  ``engine.memory.allocator``) — what torchtitan logs (``torch.cuda.max_memory_reserved()``: the
  allocator's segments, cached free blocks and fragmentation included; no CUDA context, no NCCL
  buffers). The allocated bytes at the peak are printed beside it;
* TPS/GPU: tokens per step / predicted step seconds / GPUs.

The step is timed by the default clock, the clock from ops (engine/time/ops.py: each op a roofline on
the ``h100-96g`` device profile of assets/presets/devices.toml); no config holds a timing knob. One
figure of that profile is fitted — ``power_factor``, the 500 W card's share of the tensor-core rates —
on Table 1's first row only; every other row is a prediction. One convention says what code the rows
ran: ``conventions.rms_norm = "fp32-composite"`` (torchtitan's RMSNorm of that commit).

For comparison the script also times every row with the efficiency clock (every FLOP at one
efficiency × the peak), applying ``EFFICIENCY`` = 0.39 itself — a fudge chosen once before any row was
predicted: torchtitan's note on these tables says 1-D Llama 3.1 8B FSDP reaches 33 % to 39 % MFU against
the SXM peak that the h100-96g preset also uses, and the efficiency is the achieved fraction of peak for
every FLOP counted (recompute included, which MFU leaves out), so the upper end stands for the card.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import Config  # noqa: E402
from engine.interop.torchtitan import import_torchtitan  # noqa: E402
from engine.predict import predict  # noqa: E402
from engine.time.ops import device_profile  # noqa: E402

CONFIGS = ROOT / "assets" / "examples" / "published"
_NOTE = re.compile(r"^#\s*published\.(\w+)\s*=\s*(.*?)\s*$")
GIB = 2**30


def published_notes(path: Path) -> dict[str, str]:
    """The ``# published.<key> = value`` comment lines of one config file."""
    notes = {}
    for line in path.read_text().splitlines():
        m = _NOTE.match(line)
        if m:
            notes[m.group(1)] = m.group(2)
    for key in ("source", "table", "row", "tps_per_gpu", "memory_gib", "command"):
        if key not in notes:
            raise ValueError(f"{path}: missing '# published.{key} = ...' line")
    return notes


#: the benchmarks' card: "8 NVIDIA H100 GPUs ... 96GB HBM2e" on Grand Teton (assets/presets/gpus.toml [h100-96g]);
#: torchtitan's configs do not name a card, so the import is told it
CARD = "h100-96g"
#: torchtitan's train_configs at the benchmarks' commit (9dec370), which the commands' --job.config_file name
TORCHTITAN_ROOT = CONFIGS / "torchtitan-9dec370"


def published_config(path: Path, notes: dict[str, str] | None = None) -> Config:
    """The row's config as torchtitan's benchmark command (``# published.command``) imports
    (``engine.interop.torchtitan``); the file's own body must be that same config (it is the runnable example)."""
    notes = notes or published_notes(path)
    got = _imported(notes)
    declared = {n.strip() for n in notes.get("not_expressed", "").split(",") if n.strip()}
    unsaid = [n for n in got.not_expressed if n.split(" = ")[0] not in declared]
    if unsaid:
        raise ValueError(f"{path}: the command's {', '.join(unsaid)} did not carry over (and the file's "
                         "'# published.not_expressed' does not say so)")
    if got.config != Config.load(path):
        raise ValueError(f"{path}: the file's config is not its command imported "
                         "(benchmarks/published.py --regenerate writes it)")
    return got.config


def _imported(notes: dict[str, str]):
    """The row's command imported: torchtitan's files from ``published.torchtitan`` (a folder beside the configs;
    default the 2024 benchmarks' commit), the card from ``published.gpu`` (default h100-96g)."""
    root = CONFIGS / notes["torchtitan"] if "torchtitan" in notes else TORCHTITAN_ROOT
    return import_torchtitan(notes["command"], base_dir=root, cluster={"gpu": notes.get("gpu", CARD)})


def _order(path: Path) -> tuple[int, int]:
    notes = published_notes(path)
    return int(notes["table"]), int(notes.get("position", 0))


#: the tables whose rows the clock is held to within 10 % (issue 26); the others are shown as predictions too
BAR_TABLES = (1, 3, 5)

#: the efficiency clock's one number for this card (the module docstring says how it was chosen); the configs
#: hold none: the default clock (from ops) needs none
EFFICIENCY = 0.39


def rows(clock: str = "ops", efficiency: float = EFFICIENCY) -> list[dict]:
    """Every published row predicted with its config as written (``clock = "ops"``, the default), or under
    the efficiency clock at ``efficiency``."""
    out = []
    for path in sorted(CONFIGS.glob("*.toml"), key=_order):
        notes = published_notes(path)
        timing = {"clock", "compute_efficiency"} & set(tomllib.loads(path.read_text()).get("conventions", {}))
        if timing:
            raise ValueError(f"{path}: a published config holds no timing knob, found conventions.{sorted(timing)}")
        cfg = published_config(path, notes)
        if clock == "efficiency":
            cfg = cfg.replace(conventions={"clock": "efficiency", "compute_efficiency": efficiency})
        pred = predict(cfg)
        worst = max(pred.memory.per_rank, key=lambda r: (r.reserved, -r.rank))
        tps = cfg.tokens_per_step / pred.step.seconds / cfg.cluster.gpus
        pub_tps, pub_mem = float(notes["tps_per_gpu"]), float(notes["memory_gib"])
        out.append({"config": path.name, "table": int(notes["table"]), "row": notes["row"],
                    "published_tps": pub_tps, "tps": tps, "tps_error": (tps - pub_tps) / pub_tps,
                    "published_gib": pub_mem, "gib": worst.reserved / GIB, "rank": worst.rank,
                    "allocated_gib": worst.allocated / GIB,
                    "gib_error": (worst.reserved / GIB - pub_mem) / pub_mem,
                    "clock": cfg.conventions.clock})
    return out


def table(data: list[dict]) -> list[str]:
    head = ["table", "row", "config", "TPS/GPU published", "TPS/GPU predicted", "error",
            "memory published (GiB, reserved)", "memory predicted (GiB, reserved, worst rank)", "error",
            "allocated at its peak (GiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 7) + "|"]
    for r in data:
        lines.append(f"| {r['table']} | {r['row']} | {r['config']} | {r['published_tps']:,.0f} | {r['tps']:,.0f} | "
                     f"{r['tps_error']:+.1%} | {r['published_gib']:.1f} | {r['gib']:.1f} (rank {r['rank']}) | "
                     f"{r['gib_error']:+.1%} | {r['allocated_gib']:.1f} |")
    return lines


#: the lines ``--regenerate`` writes above the config (each starts "# ~ ", so the next run finds and replaces them)
_LEGACY = ("# The config below is the command imported", "# `benchmarks/published.py --regenerate` writes it again",
           "# conventions.rms_norm = fp32-composite (model.norm_type", "# torchtitan#985) and, under pipelining",
           "# microbatch's output until torchtitan 0.2.1")


def _generated(notes: dict[str, str], flavour: str) -> str:
    lines = [f"The config below is the command imported (engine/interop/torchtitan.py, as `shardscope import "
             f"torchtitan --gpu {notes.get('gpu', CARD)}`);", "`benchmarks/published.py --regenerate` writes it again."]
    if flavour == "2024":
        lines += ["From the command's torchtitan (2024) the import sets conventions.rms_norm = fp32-composite",
                  "(model.norm_type = \"rmsnorm\": its own RMSNorm, x.float() ... type_as, before torchtitan#985) and,",
                  "under pipelining, conventions.pipeline_outputs = kept (pp_schedule.step() returned every",
                  "microbatch's output until torchtitan 0.2.1)."]
    return "".join(f"# ~ {ln}\n" for ln in lines)


def regenerate(path: Path) -> bool:
    """Write the file's config as its ``# published.command`` imports, below its comment lines (kept); True if the
    text changed."""
    import tomli_w

    from engine.interop import compact_dict

    notes = published_notes(path)
    got = _imported(notes)
    text = path.read_text()
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    head = [ln for ln in head if not ln.startswith("# ~ ") and not ln.startswith(_LEGACY)]
    new = "\n".join(head) + "\n" + _generated(notes, got.flavour) + tomli_w.dumps(compact_dict(got.config))
    if new != text:
        path.write_text(new)
    return new != text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", type=Path, help="also write the table as markdown here")
    ap.add_argument("--regenerate", action="store_true",
                    help="write each config file's body as its `# published.command` imports, then predict")
    args = ap.parse_args()
    if args.regenerate:
        for path in sorted(CONFIGS.glob("*.toml")):
            print(f"{path.name}: {'rewritten' if regenerate(path) else 'unchanged'}")
    ops = rows()
    lines = table(ops)
    worst = max((r for r in ops[1:] if r["table"] in BAR_TABLES), key=lambda r: abs(r["tps_error"]))
    others = [r for r in ops if r["table"] not in BAR_TABLES]
    print("The default clock (from ops); predicted memory is the caching allocator's reserve (its allocated bytes "
          "beside it):\n" + "\n".join(lines))
    print(f"fitted: h100-96g's power_factor on {ops[0]['config']} only; worst predicted row of Tables "
          f"{', '.join(map(str, BAR_TABLES))}: {worst['config']} {worst['tps_error']:+.1%}; Tables 2, 4 and 7: "
          + ", ".join(f"{r['tps_error']:+.1%}" for r in others))
    eff = rows("efficiency")
    eff_lines = table(eff)
    knob_default = Config.load(CONFIGS / ops[0]["config"]).conventions.compute_efficiency  # no config sets it
    at_default = [r["tps_error"] for r in rows("efficiency", knob_default) if r["table"] in BAR_TABLES]
    print(f"\nThe efficiency clock (every FLOP at {EFFICIENCY:g} × the peak, applied by this script):\n"
          + "\n".join(eff_lines))
    if args.markdown:
        doc = [
            "# ShardScope vs torchtitan's published H100 benchmarks",
            "",
            "Source: pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md`, Tables 1 to 5 "
            "(H100 96 GB HBM2e at 500 W: preset `h100-96g`). Configs: `assets/examples/published/*.toml` "
            "(each states its assumptions; none holds a timing knob). Regenerate: `.venv/bin/python "
            "benchmarks/published.py --markdown benchmarks/published.md`.",
            "",
            *lines,
            "",
            "Timed by the default clock, the clock from ops (`engine/time/ops.py`): every op of the blocks, the head "
            "and the loss a roofline on the `h100-96g` device profile (`assets/presets/devices.toml`: achieved GEMM, "
            "attention and HBM fractions with their sources). One figure is fitted: the profile's `power_factor` "
            "(the 500 W card's share of the tensor-core rates, "
            f"{device_profile('h100-96g').power_factor:g}), on the first row only; every other row is a prediction. "
            "One convention says what code the rows ran: `conventions.rms_norm = \"fp32-composite\"` in every "
            "config — the benchmark's torchtitan (commit 9dec370, 2024/12/26) built its own RMSNorm, "
            "`self._norm(x.float()).type_as(x) * self.weight` (torchtitan/models/norms.py; torch's fused "
            "`nn.RMSNorm` replaced it in torchtitan#985, 2025/03): in eager blocks 8 kernels and 36 bytes an "
            "element through fp32 where a fused norm reads and writes 4; compiled blocks fuse it either way. "
            "Without it the eager rows took the norm as one kernel and the fit on row 1 left the compile rows "
            "at −8 % and the float8 rows at −11 … −12 %. "
            f"Worst predicted row of Tables 1, 3 and 5 (issue 26's bar): {worst['config']} {worst['tps_error']:+.1%} "
            f"({'within' if abs(worst['tps_error']) <= 0.10 else 'outside'} 10 %). Tables 2 and 4 (and 7, the H200 rows of another torchtitan benchmark file, in session 30) were added after "
            "the clock was made, as predictions it was never looked at against: "
            + ", ".join(f"{r['config']} {r['tps_error']:+.1%}" for r in others)
            + ". Context parallelism at 128K and 256K runs slower than predicted (+18, +22 %): the op lists time "
            "each rank's share of the causal square at the flash kernel's rate and the K, V all-gather, not the "
            "blockwise attention's per-chunk kernels and their merges; async TP's memory is not modelled "
            "(torchtitan measured 4.3 GiB less with it: both 2-D rows are predicted alike, −7.5 % and −1.7 %; "
            "before session 47 laid a recomputed block as the tensors it is outside the backward's walk, +3.4 % and "
            "+10.0 %; `measure --fake` of the 2-D row in eager mode without float8 all-gather reserves 71.5 GiB, "
            "predicted 79.8, 92.7 before). What the op lists leave out is in "
            "`engine/time/ops.py`'s docstring.",
            "",
            "## The efficiency clock, for comparison",
            "",
            f"Every FLOP at one `compute_efficiency` = {EFFICIENCY:g} × the peak (`conventions.clock = "
            "\"efficiency\"`, applied by the script to every row: a fudge chosen once from torchtitan's stated "
            "33–39 % MFU for 1-D 8B FSDP; see the script's docstring). At the knob's default "
            f"({knob_default:g}) its tokens/s miss Tables 1, 3 and 5 by "
            f"{min(at_default):+.0%} … {max(at_default):+.0%}.",
            "",
            *eff_lines,
            "",
            "What is modelled and what is not: Tables 1 and 3 use torchtitan's per-op selective activation "
            "checkpointing (`recompute = \"selective-op\"`: its save list replayed over the block's matmuls, "
            "`engine/memory/activations.py`); torch.compile's saved tensors follow the partitioner convention of "
            "`engine/memory/activations.py` and its speed the fused elementwise chains of `engine/time/ops.py` "
            "(under the efficiency clock only the `fused-elementwise` convention of `engine/time/step.py`); Table 5 runs torchtitan's default of that commit, microbatches = the PP degree (8 of 4 "
            "samples: see the configs). Its 1F1B row is the lower of the two rows "
            "(torchtitan measured 1F1B ~10 GiB above interleaved): the block-by-block replay raised both by "
            "about 5 GiB of fragmentation and does not explain the difference; 1F1B's stage 0 holds all 8 "
            "microbatches as interleaved's does. Found at the last stage against `measure --fake` and not "
            "modelled: each microbatch's kept logits take a fresh segment, and the schedule's merge of the "
            "outputs at the step's end (one tensor of m × the logits) is not a term (not the worst rank here). "
            "Since 2026-12-05 its rank 0 is 1.7 GiB lower (−6.2 → −8.4 %): FSDP2's fresh gradient of the token "
            "embedding's unit is made at the end of each B, its blocks' tensors freed, not beside the first block's "
            "backward — so the backend's code has it: `measure --fake` of this config in eager mode without async TP "
            "and float8 all-gather (which the fake does not run) allocates 76.20 GiB on rank 0, predicted 76.84 "
            "(80.01 before); what torchtitan's run of 2024 held beyond that is not found. Since session 47 (2026-12-06) "
            "the token embedding's replicated fp32 gradient is laid as the one tensor torch allocates, after the first "
            "backward's blocks, not a piece a block: its replayed reserve is 1.1 GiB lower (−8.0 → −9.3 %); the eager "
            "variant above reserves 89.96 GiB predicted against the fake's 89.18 (88.44 before).",
            "",
            "Published memory is the max over GPUs of the *reserved* memory the training loop logs; the prediction "
            "is the worst rank's `reserved`: its step (every term laid on the schedule's actions, "
            "`engine/memory/lifetimes.py`) replayed through the caching-allocator model "
            "(`engine/memory/allocator.py`), with the allocated bytes at the peak beside it. The replay lays the "
            "step as the training loop allocates it, block by block (`lifetimes.allocation_events` with a "
            "`Grain`): each forward saves one block at a time beside the two largest tensors it makes and frees; "
            "the last stage makes the logits, their fp32 copy and the log-probabilities; the loss moment its two "
            "fp32 gradients and the logits' gradient; each backward walks its blocks last to first (recomputed "
            "block, the unit's gradient and reduce-scatter input, the block's saved tensors freed); FSDP2's "
            "sharded gradients on the reduce-scatter stream. Tensors no term holds (the forward's, the logits' "
            "casts) are laid only where the live bytes stay within the peak, so `allocated` is the moments'. "
            "Against the same configs replayed tensor by tensor it reserves within 2.5 %; the caching "
            "allocator's fragmentation inside one block's own tensors is what it leaves out.",
            "",
        ]
        args.markdown.write_text("\n".join(doc))


if __name__ == "__main__":
    main()
