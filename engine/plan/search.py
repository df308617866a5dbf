"""The planner: every valid layout of a model on N GPUs, ranked by predicted throughput.

``plan(model, gpus, gpu, gpus_per_node, top=K)`` enumerates dp × tp × pp, ZeRO stage,
sequence parallel, pipeline schedule, virtual stages, micro-batch size (and with it the
microbatch count), recompute, float8 and torch.compile, keeps the layouts that validation accepts and that fit on
every rank, and returns the K with the highest predicted tokens/s — each with the engine's
full numbers (``memory_per_rank`` + ``step_time``) and why it wins or loses.

Fair comparison: every layout trains the same **global batch** (sequences per optimizer
step), so dp · microbatches · micro_batch_size = global_batch and tokens per step are equal;
ranking by tokens/s is ranking by step time. Default global batch: ``default_global_batch``
(about 4 Mi tokens, a multiple of the GPU count, at most 8 sequences per GPU).

A mixture of experts (``model.experts`` > 0) is planned by ``engine.plan.moe``, which adds
expert parallelism (ep) to the layouts and bounds MoE blocks by their own rows.

What is enumerated (duplicates that the engine cannot tell apart are left out, and said so):
    tp   divides gpus, heads, kv_heads and ffn_hidden     pp   divides gpus / tp, pp ≤ layers
    cp   context parallelism for long sequences (``default_cp_degrees``: from LONG_SEQUENCE_TOKENS
         tokens every power of two dividing gpus / (tp · pp) with seq_len divisible by 2·cp; 1 below)
    dp   = gpus / (tp · pp · cp), must divide the global batch
    schedule  pp = 1: none (gradient accumulation; the schedule name does not matter);
              pp > 1: GPipe, 1F1B (v = 1), ZBVZeroBubble, DualPipeV (v = 2),
              Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (v = 2 … max_virtual_stages,
              pp · v ≤ layers; v = 1 is the plain GPipe / 1F1B already listed)
    micro_batch_size  every divisor b of global_batch / dp; microbatches = global_batch / (dp · b)
    zero  0–3 when dp · cp > 1 (with dp · cp = 1 all stages are the same layout: only 0); not 1 with cp > 1
    sequence_parallel  off, and on when tp > 1 and tp divides seq_len / cp
    recompute  none, selective, full, selective-op, selective-layer (every training.recompute_every-th block
               of the base config)
    float8  none, tensorwise, rowwise where the GPU has float8 tensor cores (peak_fp8_tflops > 0) and
            precision is bf16-mixed (``default_float8_kinds``); none otherwise; float8 all-gather stays off
    compile  off and on (``SEARCHED_COMPILE``); async TP stays off
Schedule rules (1F1B needs m ≥ pp, …) come from ``engine.pipeline.schedules.schedule_problems``, and
every layout that is fully evaluated is built as a ``Config`` (which validates it).

Speed (branch and bound; the answer is the same as fully evaluating every layout):
1. For the whole candidate grid, vectorised with numpy: a closed-form **lower bound on peak
   memory** (model states, activations in flight from torch's schedule order, p2p and bucket
   buffers, FSDP2's unsharded parameters and gradients, logits, overhead — the terms of
   ``engine.memory`` minus a few small ones and rounding, at three moments: the activation peak, a
   forward after the rank's first backward, where FSDP2 holds every unit's accumulated gradient, and
   the end of the backward, with the last stage's kept logits)
   drops layouts that cannot fit; and a **lower bound on step time**: the exact
   per-stage F/B durations (compute at float8's rate with its casts and compile's fused elementwise time, as
   ``engine.time.step.with_float8_and_compile``, + TP collectives + the exposed CP exchange, as ``engine.time.step``), each pipeline
   rank's busy time plus the forward chain before its first stage, the one-microbatch critical
   path, the exact exposed DP communication and optimizer step. What does not depend on the
   layout group is computed once: in-flight counts per (schedule, pp rank, pp, v, m) — the
   costly replay of torch's order, kept across plans (``engine.plan.memory_bound._in_flight_sums``) — and parameters,
   placement and DP collectives per (tp, pp, v, placement style). The memory bound is computed on the
   (b, ZeRO, SP, recompute) axes once per compile setting (float8 moves none of its terms) before the
   float8 × compile expansion, and outside an exhaustive search the layouts it rejects leave the grid there.
2. Best first by that bound: a candidate whose bound is below the K-th best step found so
   far gets its pipeline simulated (the exact makespan, cached per pipeline shape and shared
   by the ZeRO stages) — a tighter bound; if it is still below, the full engine runs
   (``memory_per_rank``; if it fits, ``step_time``). The search stops when the smallest bound
   left exceeds the K-th best step. The final ranking uses only full engine numbers.

Every fitting layout (``all_fitting=True``, for a throughput-against-memory scatter): after the
top K, every layout that passes the memory lower bound is fully evaluated (``memory_per_rank``,
then ``step_time`` if it fits), best bound first, and those that fit are returned as
``PlanResult.fitting`` (``FitPoint``: the layout, tokens/s, peak memory per GPU, whether it is
on the Pareto front of tokens/s against peak memory). That costs a millisecond or two per
layout, so the sweep stops after ``fitting_limit`` layouts or ``fitting_seconds`` seconds,
whichever comes first, and says so (``fitting_stopped``); the top K are always among the points.
``progress(evaluated, total)`` is called as it goes and ``cancelled()`` is polled (both in the
search and in the sweep): when it returns True, ``PlanCancelled`` is raised.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine import names
from engine.backend_limits import predict_only
from engine.config import Config, ConfigError, ModelSpec, ParallelSpec
from engine.memory import memory_per_rank
from engine.model.presets import gpu_presets, model_presets
from engine.plan.grid import _Planner
from engine.plan.moe import plan_moe
from engine.plan.results import (
    FitPoint,
    PlanCancelled,
    PlanCounts,
    PlanError,
    PlanResult,
    explain,
    pareto_front,
)
from engine.plan.space import _SAFETY, _Grid, _key
from engine.time.step import step_time

DEFAULT_TOKENS_PER_STEP = 4 * 2**20
#: sequences from this many tokens are long: the planner searches context parallelism for them
#: (``default_cp_degrees``); shorter ones keep cp = 1 unless ``plan(cp=...)`` asks
LONG_SEQUENCE_TOKENS = 16384
MAX_SEQUENCES_PER_GPU = 8
#: the recompute kinds searched unless told otherwise
SEARCHED_RECOMPUTE = ("none", "selective", "full", "selective-op", "selective-layer")
#: the torch.compile settings searched unless told otherwise (float8: ``default_float8_kinds``)
SEARCHED_COMPILE = (False, True)
FITTING_LIMIT = 10_000  # layouts the all-fitting sweep evaluates at most
FITTING_SECONDS = 30.0  # ... and seconds it spends at most


# --------------------------------------------------------------------------- inputs


def _no_float8_reason(base: Config) -> str:
    """Why float8 cannot be searched on ``base`` ('' when it can)."""
    if not base.cluster.gpu.peak_fp8_tflops > 0:
        return f"{base.cluster.gpu.name} has no float8 tensor cores (peak_fp8_tflops = 0)"
    if base.training.precision != "bf16-mixed":
        return f"float8 training needs precision bf16-mixed (got {base.training.precision})"
    return ""


def default_float8_kinds(base: Config) -> tuple[str, ...]:
    """The float8 kinds searched by default: every one of ``names.FLOAT8_KINDS`` where the GPU has float8
    tensor cores and the precision is bf16-mixed (what validation accepts), else only "none"."""
    return names.FLOAT8_KINDS if not _no_float8_reason(base) else ("none",)


def _float8_kinds(base: Config, float8: tuple[str, ...] | None) -> tuple[str, ...]:
    if float8 is None:
        return default_float8_kinds(base)
    kinds = tuple(dict.fromkeys(float8)) if isinstance(float8, (tuple, list)) else ()
    bad = [k for k in kinds if k not in names.FLOAT8_KINDS]
    if bad or not kinds:
        raise PlanError("float8", f"allowed: {' | '.join(names.FLOAT8_KINDS)}; got {float8!r}")
    reason = _no_float8_reason(base)
    if reason and any(k != "none" for k in kinds):
        raise PlanError("float8", f"cannot search {', '.join(k for k in kinds if k != 'none')}: {reason}; allowed: none")
    return kinds


def default_cp_degrees(gpus: int, seq_len: int) -> tuple[int, ...]:
    """The context-parallel degrees searched by default: 1 below ``LONG_SEQUENCE_TOKENS``; from there
    every power of two up to ``gpus`` whose head-tail split works (seq_len divisible by 2·cp)."""
    if seq_len < LONG_SEQUENCE_TOKENS:
        return (1,)
    out, cp = [], 1
    while cp <= gpus:
        if cp == 1 or seq_len % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return tuple(out)


def default_global_batch(gpus: int, seq_len: int) -> int:
    """About 4 Mi tokens per step, as a multiple of ``gpus``, 1 … 8 sequences per GPU."""
    per_gpu = round(DEFAULT_TOKENS_PER_STEP / seq_len / gpus)
    return gpus * min(MAX_SEQUENCES_PER_GPU, max(1, per_gpu))


def _base_config(model: ModelSpec | str, gpus: int, gpu: str, gpus_per_node: int,
                 training: dict | None, conventions: dict | None, seq_len: int | None = None) -> Config:
    """The validated starting point (dp = gpus; the model's sequence length ``seq_len`` when given);
    errors name the planner argument at fault."""

    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise PlanError("seq_len", f"must be a whole number of tokens ≥ 1, got {seq_len!r}")
    if isinstance(model, str) and model not in model_presets():
        raise PlanError("model", f"unknown preset {model!r}; allowed: {', '.join(model_presets())}")
    if isinstance(gpu, str) and gpu not in gpu_presets():
        raise PlanError("gpu", f"unknown GPU {gpu!r}; allowed: {', '.join(gpu_presets())}")
    for arg, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(arg, f"must be a whole number ≥ 1, got {value!r}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise PlanError("gpus", f"{gpus} must be a multiple of gpus_per_node ({gpus_per_node}) "
                                "when it spans nodes")
    if (training or {}).get("finetune", "full") != "full":
        raise PlanError("training", "the planner searches full fine-tuning layouts only; its pruning bounds "
                                    "do not hold for LoRA (predict a LoRA config with shardscope predict)")
    raw = {"model": ({"preset": model} if isinstance(model, str) else {"preset": "tiny"})
           | ({"seq_len": seq_len} if seq_len is not None and isinstance(model, str) else {}),
           "cluster": {"gpu": gpu, "gpus": gpus, "gpus_per_node": gpus_per_node},
           "parallel": {"dp": gpus}, "training": dict(training or {}), "conventions": dict(conventions or {})}
    try:
        base = Config.from_dict(raw)
        if isinstance(model, ModelSpec):
            base = dataclasses.replace(base, model=model if seq_len is None else dataclasses.replace(model, seq_len=seq_len))
    except ConfigError as exc:
        field_to_arg = {"model.seq_len": "seq_len", "model": "model", "cluster.gpu": "gpu", "cluster.gpus": "gpus",
                        "cluster.gpus_per_node": "gpus_per_node", "training": "training",
                        "conventions": "conventions"}
        prob = exc.problems[0]
        arg = next((a for f, a in field_to_arg.items() if prob.field.startswith(f)), prob.field)
        raise PlanError(arg, "; ".join(str(p) for p in exc.problems)) from None
    return base


def _config_base(cfg: Config) -> Config:
    """The starting point for planning a Config's job: its model, cluster (links included), training
    and conventions; the parallel layout back to its defaults with dp = gpus."""
    if not isinstance(cfg, Config):
        raise PlanError("config", f"must be an engine Config, got {type(cfg).__name__}")
    if cfg.training.finetune != "full":
        raise PlanError("training", "the planner searches full fine-tuning layouts only; its pruning bounds "
                                    "do not hold for LoRA (predict a LoRA config with shardscope predict)")
    parallel = dataclasses.asdict(ParallelSpec())
    parallel["dp"] = cfg.cluster.gpus
    try:
        return cfg.replace(parallel=parallel, training={"micro_batch_size": 1, "recompute": "none", "float8": "none",
                                                        "float8_all_gather": False, "compile": False})
    except ConfigError as exc:
        raise PlanError("config", "; ".join(str(p) for p in exc.problems)) from None


# --------------------------------------------------------------------------- public entry


def plan(model: ModelSpec | str, gpus: int, gpu: str = "h100-sxm", gpus_per_node: int = 8, *,
         top: int = 10, global_batch: int | None = None, zero: tuple[int, ...] = (0, 1, 2, 3),
         schedules: tuple[str, ...] = names.SCHEDULES, recompute: tuple[str, ...] = SEARCHED_RECOMPUTE,
         max_virtual_stages: int = 8, micro_batch_sizes: tuple[int, ...] | None = None,
         training: dict | None = None, conventions: dict | None = None, exhaustive: bool = False,
         all_fitting: bool = False, fitting_limit: int = FITTING_LIMIT, fitting_seconds: float = FITTING_SECONDS,
         progress: Callable[[int, int], None] | None = None,
         cancelled: Callable[[], bool] | None = None, seq_len: int | None = None,
         cp: tuple[int, ...] | None = None, float8: tuple[str, ...] | None = None,
         compile: tuple[bool, ...] = SEARCHED_COMPILE, runnable_only: bool = False) -> PlanResult:
    """The ``top`` fastest layouts of ``model`` on ``gpus`` GPUs that are valid and fit.

    ``model`` is a preset name or a ModelSpec; ``gpu`` a GPU preset; ``global_batch`` the
    sequences per step every layout trains (default: ``default_global_batch``). ``training``
    and ``conventions`` are Config tables applied to every layout (precision, optimizer, …).
    ``exhaustive=True`` fully evaluates every layout (no pruning; for checking and benchmarks).
    ``all_fitting=True`` also fully evaluates every layout that passes the memory lower bound
    (at most ``fitting_limit`` layouts / ``fitting_seconds`` s, best bound first) and returns
    the fitting ones as ``PlanResult.fitting``, with ``progress(evaluated, total)`` as it goes;
    ``cancelled()`` returning True stops the search with ``PlanCancelled``. ``seq_len`` trains the
    model at that sequence length; ``cp`` the context-parallel degrees searched (default
    ``default_cp_degrees``: from ``LONG_SEQUENCE_TOKENS`` tokens every power of two that splits).
    ``float8`` the torchao float8 kinds searched (default ``default_float8_kinds``: all of them where the
    GPU has float8 tensor cores and precision is bf16-mixed, else "none"), ``compile`` the torch.compile
    settings searched (default both). ``runnable_only=True`` leaves out the layouts ShardScope's backend
    cannot run (``PlanEntry.predict_only``: engine.backend_limits). Raises PlanError naming the argument at fault.
    """
    t0 = time.perf_counter()
    base = _base_config(model, gpus, gpu, gpus_per_node, training, conventions, seq_len)
    return _plan(t0, base, top=top, global_batch=global_batch, zero=zero, schedules=schedules, recompute=recompute,
                 max_virtual_stages=max_virtual_stages, micro_batch_sizes=micro_batch_sizes, exhaustive=exhaustive,
                 all_fitting=all_fitting, fitting_limit=fitting_limit, fitting_seconds=fitting_seconds,
                 progress=progress, cancelled=cancelled, cp=cp, float8=float8, compile=compile,
                 runnable_only=runnable_only)


def plan_config(cfg: Config, **options: Any) -> PlanResult:
    """``plan`` for the job of a Config: its model (preset or custom), its cluster as it is (GPU kind,
    count, GPUs per node and links), its training table (precision, optimizer, …) and conventions.
    The parallel layout, micro-batch size, recompute, float8 and compile are what is searched, so the
    Config's own are ignored (and float8 all-gather and async TP are off); the global batch is the Config's
    unless ``global_batch`` is given. ``options``: ``plan``'s keyword arguments (``top``, ``global_batch``,
    ``all_fitting``, ``seq_len``, ``cp``, …)."""
    t0 = time.perf_counter()
    allowed = {"top", "global_batch", "zero", "schedules", "recompute", "max_virtual_stages", "micro_batch_sizes",
               "exhaustive", "all_fitting", "fitting_limit", "fitting_seconds", "progress", "cancelled", "seq_len",
               "cp", "float8", "compile", "runnable_only"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise PlanError(unknown[0], f"unknown option; allowed: {', '.join(sorted(allowed))}")
    # the job's own global batch by default: the config's layout is then one of those searched, in the
    # scatter beside the rest (the planner's default for a bare model and GPU count, default_global_batch,
    # made 32 sequences of the embedded default's 16)
    options.setdefault("global_batch", cfg.global_batch_size)
    base = _config_base(cfg)
    seq_len = options.pop("seq_len", None)
    if seq_len is not None:
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise PlanError("seq_len", f"must be a whole number of tokens ≥ 1, got {seq_len!r}")
        try:
            base = base.replace(model={"seq_len": seq_len})
        except ConfigError as exc:
            raise PlanError("seq_len", "; ".join(str(p) for p in exc.problems)) from None
    return _plan(t0, base, **options)


def _plan(t0: float, base: Config, *, top: int = 10, global_batch: int | None = None,
          zero: tuple[int, ...] = (0, 1, 2, 3), schedules: tuple[str, ...] = names.SCHEDULES,
          recompute: tuple[str, ...] = SEARCHED_RECOMPUTE, max_virtual_stages: int = 8,
          micro_batch_sizes: tuple[int, ...] | None = None, exhaustive: bool = False, all_fitting: bool = False,
          fitting_limit: int = FITTING_LIMIT, fitting_seconds: float = FITTING_SECONDS,
          progress: Callable[[int, int], None] | None = None,
          cancelled: Callable[[], bool] | None = None, cp: tuple[int, ...] | None = None,
          float8: tuple[str, ...] | None = None, compile: tuple[bool, ...] = SEARCHED_COMPILE,
          runnable_only: bool = False) -> PlanResult:
    gpus, gpus_per_node = base.cluster.gpus, base.cluster.gpus_per_node
    float8s, compiles, cps, G = _checked_options(base, top, global_batch, zero, schedules, recompute,
                                                 max_virtual_stages, all_fitting, fitting_limit, fitting_seconds,
                                                 cp, float8, compile)
    base = base.replace(training={"float8": "none", "float8_all_gather": False, "compile": False})
    if base.model.experts > 0:  # expert parallelism: its own grid and bounds (engine.plan.moe)
        if all_fitting:
            raise PlanError("all_fitting", "the every-fitting-layout sweep covers dense models; for a mixture of "
                            "experts leave it off")
        return plan_moe(t0, base, top=top, G=G, zero=tuple(zero), recompute=tuple(recompute),
                        micro_batch_sizes=None if micro_batch_sizes is None else tuple(micro_batch_sizes),
                        exhaustive=exhaustive, cancelled=cancelled, runnable_only=runnable_only)
    pl = _Planner(base, G, tuple(zero), tuple(schedules), tuple(recompute), max_virtual_stages,
                  None if micro_batch_sizes is None else tuple(micro_batch_sizes), tuple(sorted(set(cps))),
                  float8s, compiles)
    pl.prefilter = not exhaustive
    g = pl.grid()
    n = len(g.mem_lb)
    capacity = base.cluster.gpu.memory_bytes
    counts = {"enumerated": n + g.memory_prefiltered, "skipped_global_batch": g.skipped_global_batch}
    may_fit = np.ones(n, dtype=bool) if exhaustive else g.mem_lb * _SAFETY <= capacity
    counts["memory_bound_rejected"] = int(n - may_fit.sum()) + g.memory_prefiltered
    bound0 = (g.makespan_lb + g.rest_lb) * _SAFETY
    idx = np.flatnonzero(may_fit)
    idx = idx[np.argsort(bound0[idx], kind="stable")]
    best, seen, searched = _search(pl, g, bound0, idx, top, exhaustive, all_fitting, runnable_only, cancelled)
    counts.update(searched)
    entries = explain(best, capacity)
    sweep: dict[str, Any] = {}
    if all_fitting:
        sweep = _sweep_fitting(pl, g, idx, best, seen, fitting_limit, float(fitting_seconds), progress, cancelled,
                               runnable_only)
    notes = _notes(base, G, cps, float8s, float8, compiles)
    if all_fitting:
        notes += (sweep.pop("note"),)
    return PlanResult(model=base.model.preset or "custom", gpus=gpus, gpu=base.cluster.gpu.name,
                      gpus_per_node=gpus_per_node, global_batch=G, tokens_per_step=G * base.model.seq_len,
                      capacity_bytes=capacity, entries=entries, counts=PlanCounts(**counts),
                      elapsed_s=time.perf_counter() - t0, exhaustive=exhaustive, notes=notes,
                      all_fitting=all_fitting, base=base, **sweep)


def _checked_options(base: Config, top, global_batch, zero, schedules, recompute, max_virtual_stages, all_fitting,
                     fitting_limit, fitting_seconds, cp, float8,
                     compile) -> tuple[tuple[str, ...], tuple[bool, ...], tuple[int, ...], int]:
    """``plan``'s options checked (``PlanError`` naming the first that is not allowed): the float8 kinds
    and compile settings searched, the cp degrees (1 always among them) and the global batch."""
    float8s = _float8_kinds(base, float8)
    compiles = tuple(dict.fromkeys(compile)) if isinstance(compile, (tuple, list)) else compile
    if not isinstance(compiles, tuple) or not compiles or any(not isinstance(c, bool) for c in compiles):
        raise PlanError("compile", f"allowed: a non-empty list of true | false; got {compile!r}")
    cps = default_cp_degrees(base.cluster.gpus, base.model.seq_len) if cp is None else tuple(cp)
    if not cps or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in cps):
        raise PlanError("cp", f"context-parallel degrees must be whole numbers ≥ 1, got {list(cp or ())}")
    if 1 not in cps:
        cps = (1, *cps)  # cp = 1 is always a candidate: the baseline every cp is ranked against
    if not isinstance(top, int) or top < 1:
        raise PlanError("top", f"must be a whole number ≥ 1, got {top!r}")
    G = default_global_batch(base.cluster.gpus, base.model.seq_len) if global_batch is None else global_batch
    if not isinstance(G, int) or isinstance(G, bool) or G < 1:
        raise PlanError("global_batch", f"must be a whole number ≥ 1, got {global_batch!r}")
    bad_z = [z for z in zero if z not in names.ZERO_STAGES]
    if bad_z or not zero:
        raise PlanError("zero", f"allowed: {', '.join(map(str, names.ZERO_STAGES))}; got {list(zero)}")
    bad_s = [s for s in schedules if s not in names.SCHEDULES]
    if bad_s or not schedules:
        raise PlanError("schedules", f"allowed: {' | '.join(names.SCHEDULES)}; got {list(schedules)}")
    bad_r = [r for r in recompute if r not in names.RECOMPUTE_KINDS]
    if bad_r or not recompute:
        raise PlanError("recompute", f"allowed: {' | '.join(names.RECOMPUTE_KINDS)}; got {list(recompute)}")
    if max_virtual_stages < 1:
        raise PlanError("max_virtual_stages", f"must be ≥ 1, got {max_virtual_stages}")
    if all_fitting:
        if not isinstance(fitting_limit, int) or isinstance(fitting_limit, bool) or fitting_limit < 1:
            raise PlanError("fitting_limit", f"must be a whole number ≥ 1, got {fitting_limit!r}")
        if not isinstance(fitting_seconds, int | float) or not fitting_seconds > 0:
            raise PlanError("fitting_seconds", f"must be a number of seconds > 0, got {fitting_seconds!r}")
    return float8s, compiles, cps, G


def _search(pl: _Planner, g: _Grid, bound0: np.ndarray, idx: np.ndarray, top: int, exhaustive: bool,
            all_fitting: bool, runnable_only: bool,
            cancelled: Callable[[], bool] | None) -> tuple[list, dict[int, tuple] | None, dict[str, int]]:
    """The top K: the candidates ``idx`` (by their first time bound ``bound0``) tightened by their
    simulated makespan, then fully evaluated while a bound is below the K-th best step (every one where
    ``exhaustive``). Returns the best (seconds, key, i, cfg, step, memory), sorted; with ``all_fitting``
    every layout evaluated (i -> (cfg, memory, step or None)); and the search's counts."""
    best: list[tuple[float, tuple, int, Config, Any, Any]] = []  # (seconds, key, i, cfg, step, memory), sorted
    simulated = evaluated = no_fit = invalid = timed = 0
    not_runnable: set[int] = set()  # runnable_only: the layouts left out
    heap: list[tuple[float, int, Config]] = []  # (tighter bound, i, cfg)
    ptr = 0
    seen: dict[int, tuple] | None = {} if all_fitting else None  # i -> (cfg, memory, step or None)
    no_fit_memory: dict[tuple, Any] = {}  # layout with float8 as on / off -> its memory report that does not fit

    def mem_key(i: int) -> tuple:
        return _key(g, i)[:-2] + (int(g.cols["f8"][i]) > 0, int(g.cols["cmp"][i]))

    def kth() -> float:
        return best[top - 1][0] if len(best) >= top else math.inf

    while True:
        if cancelled is not None and cancelled():
            raise PlanCancelled("cancelled while searching the top layouts")
        next0 = bound0[idx[ptr]] if ptr < len(idx) else math.inf
        next1 = heap[0][0] if heap else math.inf
        if not exhaustive and min(next0, next1) > kth():
            break
        if next0 == math.inf and next1 == math.inf:
            break
        if next0 <= next1:
            i = int(idx[ptr])
            ptr += 1
            known = None if exhaustive else no_fit_memory.get(mem_key(i))
            if known is not None:  # the same layout with the other float8 scaling did not fit: neither does this
                evaluated += 1
                no_fit += 1
                if seen is not None:
                    seen[i] = (None, known, None)
                continue
            # a pipeline shape already simulated (another ZeRO stage) needs no Config until evaluated
            mk = None if exhaustive else pl._makespans.get(pl.makespan_key(g, i))
            cfg = None
            if mk is None:
                try:
                    cfg = pl.config(g, i)
                except ConfigError:
                    invalid += 1
                    continue
            if exhaustive:
                heapq.heappush(heap, (float(bound0[i]), i, cfg))
                continue
            if mk is None:
                before = len(pl._makespans)
                mk = pl.makespan(cfg)
                simulated += len(pl._makespans) - before
            bound1 = (mk + g.rest_lb[i]) * _SAFETY
            heapq.heappush(heap, (max(bound1, float(bound0[i])), i, cfg))
            continue
        _, i, cfg = heapq.heappop(heap)
        if cfg is None:
            try:
                cfg = pl.config(g, i)
            except ConfigError:
                invalid += 1
                continue
        if runnable_only and predict_only(cfg):
            not_runnable.add(i)
            continue
        evaluated += 1
        # engine.memory reads float8 only as on / off: a layout that does not fit with one scaling does not
        # fit with the other (the same bytes), so its report is not computed twice
        mem = no_fit_memory.get(mem_key(i)) or memory_per_rank(cfg)
        if not mem.fits:
            no_fit_memory[mem_key(i)] = mem
            no_fit += 1
            if seen is not None:
                seen[i] = (cfg, mem, None)
            continue
        timed += 1
        st = step_time(cfg)
        if seen is not None:
            seen[i] = (cfg, mem, st)
        entry = (st.seconds, _key(g, i), i, cfg, st, mem)
        if len(best) < top or (entry[0], entry[1]) < (best[-1][0], best[-1][1]):
            best.append(entry)
            best.sort(key=lambda e: (e[0], e[1]))
            del best[top:]
    pruned = len(idx) - evaluated - invalid - len(not_runnable)
    return best, seen, dict(pruned_by_time_bound=pruned, pipelines_simulated=simulated, fully_evaluated=evaluated,
                            did_not_fit=no_fit, rejected_by_validation=invalid, fitting_timed=timed,
                            predict_only_skipped=len(not_runnable))


def _notes(base: Config, G: int, cps: tuple[int, ...], float8s: tuple[str, ...], float8, compiles) -> tuple[str, ...]:
    """What every plan's table says under it: the batch, the grid's conventions, what was searched."""
    return (
        f"every layout trains the same global batch: {G} sequences × {base.model.seq_len} tokens "
        f"= {G * base.model.seq_len:,} tokens per step (--global-batch changes it)",
        "pp = 1 has no schedule (gradient accumulation); with dp·cp = 1 ZeRO stages are identical, only ZeRO-0 is "
        "listed; "
        "interleaved schedules start at v = 2 (v = 1 is plain GPipe / 1F1B)",
        "time = engine.time.step (makespan with TP collectives and the exposed CP K, V exchange inside F/B + exposed DP "
        "communication + optimizer); fit = engine.memory on every rank against cluster.gpu.memory_gib",
        (f"context parallelism searched: cp ∈ {{{', '.join(map(str, sorted(set(cps))))}}} "
         f"({base.parallel.cp_rotate}; cp joins the FSDP shard group, ZeRO-1 is not combined with it)"
         if len(set(cps)) > 1 else
         f"context parallelism not searched (cp = 1): sequences of {base.model.seq_len} tokens are below "
         f"{LONG_SEQUENCE_TOKENS} (--seq-len; plan(cp=...) searches it anyway)"),
        (f"float8 searched: {', '.join(float8s)}" if len(float8s) > 1 or float8s[0] != "none" else
         f"float8 not searched: {_no_float8_reason(base)}" if float8 is None else "float8 not searched (--float8 none)")
        + "; torch.compile searched: " + ", ".join("on" if c else "off" for c in compiles)
        + " (float8 all-gather and async TP are not searched: off)",
    )


def _sweep_fitting(pl: _Planner, g: _Grid, idx: np.ndarray, best: list, seen: dict[int, tuple],
                   limit: int, seconds: float, progress: Callable[[int, int], None] | None,
                   cancelled: Callable[[], bool] | None, runnable_only: bool = False) -> dict[str, Any]:
    """Fully evaluate the layouts that pass the memory bound, best bound first, within the limits;
    reuse what the search already evaluated; the top K are always among the fitting points."""
    t0 = time.perf_counter()
    total = min(len(idx), limit)
    found: dict[int, tuple] = {}  # i -> (seconds, key, cfg, step, memory)
    evaluated = 0
    stopped = ""
    if progress is not None:
        progress(0, total)
    for k, i in enumerate(idx.tolist()):
        if cancelled is not None and cancelled():
            raise PlanCancelled("cancelled while evaluating every fitting layout")
        if k >= limit:
            stopped = f"stopped after {limit:,} layouts (the limit)"
            break
        if time.perf_counter() - t0 > seconds:
            stopped = f"stopped after {seconds:g} s (the time limit)"
            break
        hit = seen.get(i)
        if hit is None:
            try:
                cfg = pl.config(g, i)
            except ConfigError:
                continue
            if runnable_only and predict_only(cfg):
                continue
            mem = memory_per_rank(cfg)
            st = step_time(cfg) if mem.fits else None
        else:
            cfg, mem, st = hit
        evaluated += 1
        if st is not None:
            found[i] = (st.seconds, _key(g, i), cfg, st, mem)
        if progress is not None:
            progress(evaluated, total)
    for seconds_, key, i, cfg, st, mem in best:  # the top K, even where the sweep stopped before them
        found.setdefault(i, (seconds_, key, cfg, st, mem))
    position = {e[2]: pos for pos, e in enumerate(best, start=1)}
    rows = sorted(found.items(), key=lambda kv: (kv[1][0], kv[1][1]))
    front = pareto_front([(r[3].tokens_per_s, r[4].peak.total) for _, r in rows])
    points = tuple(FitPoint(config=cfg, seconds=sec, tokens_per_s=st.tokens_per_s, mfu=st.mfu,
                            peak_bytes=mem.peak.total, peak_rank=mem.peak.rank, position=position.get(i, 0),
                            pareto=on)
                   for (i, (sec, _key_, cfg, st, mem)), on in zip(rows, front))
    note = (f"every fitting layout: {evaluated:,} of {len(idx):,} layouts that pass the memory bound fully "
            f"evaluated, best bound first; {len(points):,} fit (the top {len(best)} always among them)"
            + (f"; {stopped}" if stopped else "") + f" ({time.perf_counter() - t0:.1f} s)")
    return {"fitting": points, "fitting_candidates": len(idx), "fitting_evaluated": evaluated,
            "fitting_stopped": stopped, "note": note}
