"""What the planner panel shows, without Qt: the command it runs, the lines it reads, the table
rows and scatter points it draws, and the Config a clicked layout becomes.

The planner runs as a child process, ``python -m gui.cli plan --config JOB.toml --global-batch G
--top K --json --all-fitting --progress``: JSON lines on stdout, ``{"event": "progress", ...}`` as it
goes, then ``{"event": "result", "result": {...}}`` (``engine.plan.results.PlanResult.to_json``) or
``{"event": "error", ...}``. The window's process never runs the search itself (it holds the GIL
for seconds), so a plan never stutters a slider.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import Config
from engine.plan.results import layout_config
from engine.plan.search import FITTING_LIMIT, FITTING_SECONDS
from gui.child_process import Lines
from gui.comparison import fmt_bytes, fmt_seconds

GIB = 2**30
DEFAULT_TOP = 10
#: the numbers first, so they stay in sight however long a layout's label (the table scrolls to the rest)
TABLE_HEADERS = ["#", "tokens/s", "step", "MFU", "peak", "layout", "vs #1 (select a row: why)"]
LAYOUT_COLUMN = TABLE_HEADERS.index("layout")






def default_batch(cfg: Config) -> int:
    """The Planner tab's global batch for this config: its own (so its layout is among those planned)."""
    return cfg.global_batch_size


def job_text(cfg: Config) -> str:
    """'tiny on 8 × h100-sxm (8 per node)' — what a plan of this config is for."""
    c = cfg.cluster
    return f"{cfg.model.preset or 'custom model'} on {c.gpus} × {c.gpu.name} ({c.gpus_per_node} per node)"


def job_key(cfg: Config) -> tuple:
    """What a plan depends on (everything but the layout the planner searches)."""
    d = cfg.to_dict()
    train = {k: v for k, v in d["training"].items() if k not in ("micro_batch_size", "recompute", "float8", "compile")}
    return (json.dumps(d["model"], sort_keys=True), json.dumps(d["cluster"], sort_keys=True),
            json.dumps(train, sort_keys=True), json.dumps(d["conventions"], sort_keys=True))


@dataclass(frozen=True)
class PlanRequest:
    """One plan of a Config's job: the global batch every layout trains, the top K, the sweep's limits."""

    config: Config
    global_batch: int
    top: int = DEFAULT_TOP
    fitting_seconds: float = FITTING_SECONDS
    fitting_limit: int = FITTING_LIMIT
    # search torchao float8 and torch.compile too (the planner's default); False keeps the config's own
    search_float8_compile: bool = True

    def command(self, config_path: str | Path) -> list[str]:
        knobs = [] if self.search_float8_compile else [
            "--float8", self.config.training.float8, "--compile", "on" if self.config.training.compile else "off"]
        return [sys.executable, "-m", "gui.cli", "plan", "--config", str(config_path),
                "--global-batch", str(self.global_batch), "--top", str(self.top), "--json", "--all-fitting",
                "--fitting-seconds", f"{self.fitting_seconds:g}", "--fitting-limit", str(self.fitting_limit),
                *knobs, "--progress"]


class LineReader:
    """Bytes from a child's stdout in, JSON objects (one a line) out; other lines are kept as text."""

    def __init__(self) -> None:
        self._lines = Lines()
        self.text: list[str] = []

    def feed(self, data: bytes, final: bool = False) -> list[dict]:
        out = []
        for line in self._lines.feed(data, final):
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                self.text.append(line)
                continue
            if isinstance(event, dict):
                out.append(event)
        return out


def progress_text(event: dict) -> tuple[int, int, str]:
    """(value, maximum, words) for a progress event; maximum 0 = busy (no count yet)."""
    if event.get("phase") == "fitting":
        k, n = int(event.get("evaluated", 0)), int(event.get("total", 0))
        return k, n, f"evaluating every layout that may fit: {k:,} of {n:,}"
    return 0, 0, "searching the fastest layouts (branch and bound)…"


class PlanOutcome:
    """A finished plan as the panel draws it: table rows (the top K), scatter points (every fitting
    layout the sweep evaluated), and the Config each one is."""

    def __init__(self, result: dict[str, Any]):
        self.result = result
        self.entries: list[dict] = list(result.get("entries") or [])
        fitting = result.get("fitting") or {}
        self.points: list[dict] = list(fitting.get("points") or [])
        self.candidates = int(fitting.get("candidates", 0))
        self.evaluated = int(fitting.get("evaluated", 0))
        self.stopped = str(fitting.get("stopped", ""))
        base = result.get("base_config")
        self.base: Config | None = Config.from_dict(base) if base is not None else None

    # ------------------------------------------------------------------ table

    def rows(self) -> list[list[str]]:
        out = []
        for e in self.entries:
            label = e["label"] + (" · predict only" if e.get("predict_only") else "")
            out.append([str(e["position"]), f"{e['tokens_per_s']:,.0f}", fmt_seconds(e["seconds"]),
                        f"{100 * e['mfu']:.1f}%", fmt_bytes(e["peak_bytes"]), label, self.versus_first(len(out))])
        return out

    def versus_first(self, row: int) -> str:
        """The short verdict of a row: 'fastest', or how much slower than #1 and what differs from it."""
        e, first = self.entries[row], self.entries[0]
        if row == 0:
            return "fastest"
        slower = 100 * (e["seconds"] / first["seconds"] - 1)
        names = {"zero": "ZeRO", "sequence_parallel": "SP", "virtual_stages": "v", "microbatches": "m",
                 "micro_batch_size": "b"}
        diff = [f"{names.get(k, k)} {_short(first['layout'][k])}→{_short(e['layout'][k])}"
                for k in first["layout"] if first["layout"][k] != e["layout"][k]]
        return f"+{slower:.1f}%" + (f": {', '.join(diff)}" if diff else "")

    def why(self, row: int) -> list[str]:
        """Why the row ranks where it does, and why no run can check it where the backend cannot run it."""
        e = self.entries[row]
        return list(e.get("why") or []) + [f"predict only (the backend cannot run it): {w}"
                                           for w in e.get("predict_only") or []]

    def entry_config(self, row: int) -> Config:
        return Config.from_dict(self.entries[row]["config"])

    # ------------------------------------------------------------------ scatter

    def memory_scale(self) -> tuple[str, int]:
        """The unit the scatter's memory axis reads in: GiB, or MiB where no point reaches 1 GiB (the CPU
        default's 0.02 GiB read "(x0.001)" under pyqtgraph's own prefix)."""
        peaks = [p["peak_bytes"] for p in self.points] + [e["peak_bytes"] for e in self.entries]
        return ("GiB", GIB) if not peaks or max(peaks) >= GIB else ("MiB", 2**20)

    def xy(self) -> tuple[list[float], list[float]]:
        """Peak memory per GPU (in ``memory_scale``'s unit) and tokens/s of every point."""
        scale = self.memory_scale()[1]
        return [p["peak_bytes"] / scale for p in self.points], [p["tokens_per_s"] for p in self.points]

    def front(self) -> list[int]:
        """The Pareto front's points, by peak memory (a line through them rises left to right)."""
        idx = [j for j, p in enumerate(self.points) if p.get("pareto")]
        return sorted(idx, key=lambda j: (self.points[j]["peak_bytes"], self.points[j]["tokens_per_s"]))

    def point_config(self, j: int) -> Config:
        if self.base is None:
            raise ValueError("the plan has no base_config: run it with --all-fitting")
        return layout_config(self.base, self.points[j]["layout"])

    def point_tip(self, j: int) -> str:
        p = self.points[j]
        extra = []
        if p.get("position"):
            extra.append(f"#{p['position']} of the top {len(self.entries)}")
        if p.get("pareto"):
            extra.append("on the Pareto front")
        return (f"{p['label']}\n{p['tokens_per_s']:,.0f} tokens/s · step {fmt_seconds(p['seconds'])} · "
                f"MFU {100 * p['mfu']:.1f}%\npeak {fmt_bytes(p['peak_bytes'])} per GPU (rank {p['peak_rank']})"
                + (f"\n{', '.join(extra)}" if extra else "") + "\nclick: make it the window's config")

    def point_of(self, cfg: Config) -> int | None:
        """The point whose layout is ``cfg``'s (the layout the window shows), if any."""
        for j, p in enumerate(self.points):
            if _same_layout(p["layout"], cfg):
                return j
        return None

    def row_of(self, cfg: Config) -> int | None:
        for i, e in enumerate(self.entries):
            if _same_layout(e["layout"], cfg):
                return i
        return None

    # ------------------------------------------------------------------ words

    def summary(self) -> str:
        r = self.result
        head = (f"{r['model']} on {r['gpus']} × {r['gpu']}, global batch {r['global_batch']} "
                f"({r['tokens_per_step']:,} tokens per step), {r['elapsed_s']:.1f} s: ")
        if not self.entries:
            return head + "no layout fits — try more GPUs, a GPU with more memory or a smaller global batch."
        c = r["counts"]
        text = (head + f"top {len(self.entries)} of {c['enumerated']:,} valid layouts; scatter: {len(self.points):,} "
                f"fitting layouts ({self.evaluated:,} of the {self.candidates:,} that pass the memory bound fully "
                "evaluated")
        if self.stopped:
            text += f", best bound first — {self.stopped}; the top {len(self.entries)} are exact"
        return text + "). Click a row or a point to make it the window's config."


def _short(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _same_layout(layout: dict, cfg: Config) -> bool:
    par, tr = cfg.parallel, cfg.training
    return (layout["dp"], layout["tp"], layout["pp"], layout.get("cp", 1), layout.get("ep", 1), layout["zero"],
            layout["sequence_parallel"], layout["schedule"] or "1F1B", layout["virtual_stages"],
            layout["microbatches"], layout["micro_batch_size"], layout["recompute"], layout.get("float8", "none"),
            layout.get("compile", False)) == (
        par.dp, par.tp, par.pp, par.cp, par.ep, par.zero, par.sequence_parallel,
        par.schedule if par.pp > 1 else "1F1B", par.virtual_stages, par.microbatches, tr.micro_batch_size,
        tr.recompute, tr.float8, tr.compile)
