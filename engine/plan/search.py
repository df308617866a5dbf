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
   costly replay of torch's order, kept across plans (``_in_flight_sums``) — and parameters,
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
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from engine import names
from engine.backend_limits import predict_only
from engine.config import Config, ConfigError, ModelSpec, ParallelSpec
from engine.memory import activation_bytes_per_layer, memory_per_rank
from engine.memory.activations import TABLE_RECOMPUTE, weight_op_outputs
from engine.memory.overhead import collective_buffer_bytes, runtime_context_bytes
from engine.model.params import params_per_rank
from engine.model.presets import gpu_presets, model_presets
from engine.model.recompute import checkpointed_per_stage
from engine.pipeline.layout import placement_style, split_layers, stage_to_pp_rank
from engine.pipeline.schedules import (
    in_flight_states_after_first_backward,
    microbatches_in_flight,
    pipeline_actions,
    schedule_problems,
    single_rank_plan,
    split_backward_in_flight,
)
from engine.pipeline.timeline import simulate
from engine.plan.moe import plan_moe
from engine.plan.results import (  # noqa: F401  (the results: callers import them from here too)
    LAYOUT_KEYS,
    FitPoint,
    PlanCancelled,
    PlanCounts,
    PlanEntry,
    PlanError,
    PlanResult,
    _layout_of,
    explain,
    layout_config,
    layout_label,
    pareto_front,
)
from engine.time.comm import collective_seconds, cpu_oversubscription, group_span
from engine.time.durations import flops_per_token, per_op_recompute_flops_per_token
from engine.time.step import (
    FLOAT8_CAST_BYTES,
    analytic_durations,
    block_linears,
    cp_seconds_per_layer,
    optimizer_seconds,
    step_time,
    with_mesh_communication,
)
from engine.wrapping import _COMPUTE_DTYPE, PLAN_DTYPE_BYTES, reshard_after_forward

DEFAULT_TOKENS_PER_STEP = 4 * 2**20
#: sequences from this many tokens are long: the planner searches context parallelism for them
#: (``default_cp_degrees``); shorter ones keep cp = 1 unless ``plan(cp=...)`` asks
LONG_SEQUENCE_TOKENS = 16384
MAX_SEQUENCES_PER_GPU = 8
_SAFETY = 1.0 - 1e-9  # bounds are compared with this margin against float rounding
_RECOMPUTE = names.RECOMPUTE_KINDS
#: the recompute kinds searched unless told otherwise
SEARCHED_RECOMPUTE = ("none", "selective", "full", "selective-op", "selective-layer")
#: the torch.compile settings searched unless told otherwise (float8: ``default_float8_kinds``)
SEARCHED_COMPILE = (False, True)
_SCHEDULE_INDEX = {s: i for i, s in enumerate(names.SCHEDULES)}
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------- the grid


_COLS = ("tp", "pp", "cp", "v", "sched", "m", "b", "zero", "sp", "rc", "f8", "cmp", "struct")
_FLOAT8 = names.FLOAT8_KINDS


@dataclass
class _Grid:
    """The candidate layouts as columns, with their bounds."""

    cols: dict[str, np.ndarray]
    mem_lb: np.ndarray
    rest_lb: np.ndarray  # max over pp ranks of exposed DP + optimizer (exact), per candidate
    makespan_lb: np.ndarray
    rest_by_rank: list[np.ndarray]  # per candidate group: [candidates, pp] exposed DP + optimizer
    skipped_global_batch: int
    memory_prefiltered: int = 0  # valid layouts left out of the columns: the memory lower bound exceeds capacity


class _Consts(NamedTuple):
    """What the bounds of every (tp, pp, v, schedule, cp) read of the base config (``_Planner.grid``)."""

    fl: Any  # engine.time.durations.flops_per_token
    h: int  # hidden size
    act_b: int  # bytes of an activation element
    w_b: int  # bytes of a parameter, of its gradient, of its optimizer states (+ master copy)
    g_b: int
    o_b: int
    opt_per_param: float  # optimizer seconds per local parameter (ZeRO-0)
    ctx: int  # runtime context bytes
    buf: int  # bytes of one communicator's buffers
    peak_rate: float  # achieved FLOP/s of one rank
    over: float  # engine.time.comm.cpu_oversubscription: CPU ranks sharing cores (the whole grid's world)


@dataclass
class _Struct:
    """One (tp, pp, v, schedule, cp) of the grid: its mesh, the rows it spans and its shape."""

    tp: int
    pp: int
    v: int
    sc: str
    cp: int
    bs: list[int]  # micro-batch sizes with a valid microbatch count
    per_dp: int  # sequences per dp-rank
    zeros: list[int]
    sps: list[bool]
    rep: Config  # a valid config with this mesh (group spans)
    sh: dict[str, Any]  # ``_Planner._shape``
    s_len: int  # the tokens of a sequence one rank holds (seq_len / cp)
    n_stages: int
    dpc: int  # the gradient group and the ZeRO / FSDP shard group: dp · cp
    split: bool  # a split backward (I and W)
    vocab_t: int  # the vocabulary shard of a TP rank


class _Rows(NamedTuple):
    """Candidate rows of one struct: micro-batch size, ZeRO stage, SP, recompute (index), microbatches, the
    micro-batch size as a float, SP's divisor of the hidden state, compile."""

    b: np.ndarray
    zero: np.ndarray
    sp: np.ndarray
    rc: np.ndarray
    m: np.ndarray
    bf: np.ndarray
    rep_div: np.ndarray
    cmp: np.ndarray


class _RowBytes(NamedTuple):
    """Per row, what the memory bound of every pp rank of a struct reads (``_Planner._memory_bound``)."""

    full: np.ndarray  # full recompute
    sl: np.ndarray  # selective-layer recompute
    per_layer1: np.ndarray  # saved bytes of a block per sequence
    sbh1: np.ndarray  # one sequence's hidden state
    stored1: np.ndarray  # what a block keeps per sequence
    overhead: int  # runtime context and communicators
    torch_acc: bool  # the "pytorch" state accounting
    fsdp2_grads: np.ndarray
    gathered_at_b: bool
    fsdp2: dict[str, Any]  # ``_Planner._fsdp2_bytes``
    plain: np.ndarray  # plain gradients from the first backward on
    lora: bool
    k_opt: int  # optimizer-state bytes per element
    keeps_split: bool  # a split backward's I keeps output gradients until its W


class _Planner:
    def __init__(self, base: Config, global_batch: int, zero: tuple[int, ...], schedules: tuple[str, ...],
                 recompute: tuple[str, ...], max_virtual_stages: int, micro_batch_sizes: tuple[int, ...] | None,
                 cp: tuple[int, ...] = (1,), float8: tuple[str, ...] = ("none",),
                 compile: tuple[bool, ...] = (False,)):
        self.base = base
        self.float8 = float8
        self.compile = compile
        self.prefilter = False  # True: leave layouts whose memory bound exceeds capacity out of the grid
        self.cps = cp
        self.G = global_batch
        self.zero = zero
        self.schedules = schedules
        self.recompute = recompute
        self.max_v = max_virtual_stages
        self.mbs = micro_batch_sizes
        self.structs: list[tuple[int, int, int, str, int]] = []  # (tp, pp, v, schedule, cp)
        self._coll: dict[tuple, float] = {}
        self._act1: dict[tuple, int] = {}
        self._linear_sums: dict[int, tuple[int, int, int]] = {}  # tp -> (inputs, outputs, weights) of a block's linears
        self._plans: dict[tuple, Any] = {}
        self._makespans: dict[tuple, float] = {}
        self._shapes: dict[tuple, dict[str, Any]] = {}
        self._cp_layer: dict[tuple, tuple[float, float]] = {}
        self._k: _Consts | None = None  # grid(): what every struct's bounds read of the base config

    # ----------------------------------------------------------------- helpers

    def _rep(self, tp: int, pp: int, cp: int = 1) -> Config:
        """A valid config with this mesh (GPipe has no microbatch rule) for group spans."""
        return self.base.replace(parallel={"dp": self.base.cluster.gpus // (tp * pp * cp), "tp": tp, "pp": pp,
                                           "cp": cp, "schedule": "GPipe", "microbatches": 1})

    def _cp_per_layer(self, rep: Config, b: int) -> tuple[float, float]:
        """engine.time.step's exposed context-parallel exchange of one layer (forward, backward) for micro-batch
        size ``b``: exact, as the stage durations of the engine add it."""
        par = rep.parallel
        key = (par.dp, par.tp, par.pp, par.cp, b)
        out = self._cp_layer.get(key)
        if out is None:
            out = self._cp_layer[key] = cp_seconds_per_layer(rep.replace(training={"micro_batch_size": b}))
        return out

    def _collective(self, rep: Config, dim: str, kind: str, size: float) -> float:
        par = rep.parallel
        key = (par.dp, par.tp, par.pp, par.cp, dim, kind, size)
        out = self._coll.get(key)
        if out is None:
            out = self._coll[key] = collective_seconds(self.base, kind, size, group_span(rep, dim))
        return out

    def _act_per_layer_b1(self, tp: int, sp: bool, rc: str, cp: int = 1, compiled: bool = False) -> int:
        """Saved bytes of one block per sequence — b times this is ≤ the engine's b-value. The table's
        terms are linear in b, a few independent of it (rope's cos / sin: s·d/2 per layer), so this is the
        increment from b = 1 to b = 2, not the b = 1 value (which b times would count those b times)."""
        table = rc if rc in TABLE_RECOMPUTE else "none"  # full, selective-layer: the plain blocks' table
        key = (tp, sp, table, cp, compiled)
        out = self._act1.get(key)
        if out is None:
            def at(b: int) -> int:
                cfg = self.base.replace(parallel={"dp": self.base.cluster.gpus // (tp * cp), "tp": tp, "cp": cp,
                                                  "sequence_parallel": sp},
                                        training={"micro_batch_size": b, "recompute": table, "compile": compiled})
                return activation_bytes_per_layer(cfg)
            one = at(1)
            out = self._act1[key] = min(one, at(2) - one)
        return out

    # ----------------------------------------------------------------- enumeration + bounds

    def grid(self) -> _Grid:
        base = self.base
        model, cl, tr, conv = base.model, base.cluster, base.training, base.conventions
        gpus = cl.gpus
        fl = flops_per_token(base)
        s_len, h = model.seq_len, model.hidden
        act_b = 4 if tr.precision == "fp32" else 2
        w_b, g_b = tr.param_bytes, tr.grad_bytes
        o_b = (4 if tr.master_weights else 0) + 4 * names.OPTIMIZER_STATES[tr.optimizer]
        opt_per_param = optimizer_seconds(base, 1.0)  # base has zero 0: seconds per local parameter
        ctx, buf = runtime_context_bytes(base), collective_buffer_bytes(base)
        peak_rate = cl.gpu.peak_flops(tr.precision) * conv.compute_efficiency
        self._k = _Consts(fl, h, act_b, w_b, g_b, o_b, opt_per_param, ctx, buf, peak_rate,
                          cpu_oversubscription(base))
        tps = [t for t in _divisors(gpus) if model.heads % t == 0 and model.kv_heads % t == 0
               and model.ffn_hidden % t == 0]
        cols: dict[str, list[np.ndarray]] = {c: [] for c in _COLS}
        mem_parts, rest_parts, mk_parts, rest_rank = [], [], [], []
        skipped = prefiltered = 0
        meshes = [(tp, pp, cp) for tp in tps for pp in _divisors(gpus // tp) for cp in self.cps
                  if cp == 1 or ((gpus // (tp * pp)) % cp == 0 and s_len % (2 * cp) == 0)]
        for tp, pp, cp in meshes:
            if pp > model.layers:
                continue
            dp = gpus // (tp * pp * cp)
            if self.G % dp:
                skipped += 1
                continue
            per_dp = self.G // dp
            rep = self._rep(tp, pp, cp)
            bs = [b for b in _divisors(per_dp) if self.mbs is None or b in self.mbs]
            if pp == 1:
                shapes = [(1, "1F1B")]
            else:
                shapes = []
                for sc in self.schedules:
                    if sc in names.SINGLE_STAGE_SCHEDULES:
                        shapes.append((1, sc))
                    elif sc in names.V_SCHEDULES:
                        if 2 * pp <= model.layers:
                            shapes.append((2, sc))
                    else:
                        shapes += [(v, sc) for v in range(2, self.max_v + 1) if pp * v <= model.layers]
            # ZeRO stages differ only with a gradient group (dp·cp > 1); cp refuses ZeRO-1
            zeros = [z for z in self.zero if (dp * cp > 1 or z == 0) and not (cp > 1 and z == 1)] or [0]
            sps = [False] + ([True] if tp > 1 and (s_len // cp) % tp == 0 else [])
            for v, sc in shapes:
                ok_b = [b for b in bs if pp == 1 or not schedule_problems(sc, pp, per_dp // b, v, model.layers)]
                if not ok_b or not zeros:
                    continue
                si = len(self.structs)
                self.structs.append((tp, pp, v, sc, cp))
                part = self._struct_bounds(_Struct(
                    tp=tp, pp=pp, v=v, sc=sc, cp=cp, bs=ok_b, per_dp=per_dp, zeros=zeros, sps=sps, rep=rep,
                    sh=self._shape(tp, pp, v, sc, per_dp // ok_b[0], dp, rep, fl, cp), s_len=s_len // cp,
                    n_stages=pp * v, dpc=dp * cp, split=sc in names.SPLIT_BACKWARD_SCHEDULES,
                    vocab_t=-(-model.vocab // tp)))
                n = len(part["b"])
                prefiltered += part["rejected"]
                for c in ("m", "b", "zero", "sp", "rc", "f8", "cmp"):
                    cols[c].append(part[c])
                for c, val in (("tp", tp), ("pp", pp), ("cp", cp), ("v", v), ("sched", _SCHEDULE_INDEX[sc]),
                               ("struct", si)):
                    cols[c].append(np.full(n, val, dtype=np.int64))
                mem_parts.append(part["mem"])
                rest_parts.append(part["rest"])
                mk_parts.append(part["mk"])
                rest_rank.append(part["rest_rank"])
        if not mem_parts:
            empty = np.zeros(0)
            return _Grid({c: np.zeros(0, dtype=np.int64) for c in _COLS}, empty, empty, empty, [], skipped,
                         prefiltered)
        out = {c: np.concatenate(v) for c, v in cols.items()}
        return _Grid(out, np.concatenate(mem_parts), np.concatenate(rest_parts), np.concatenate(mk_parts),
                     rest_rank, skipped, prefiltered)

    def _struct_bounds(self, st: _Struct) -> dict[str, np.ndarray]:
        """Bounds for every (b, zero, sp, recompute, float8, compile) of one (tp, pp, v, schedule, cp)."""
        # grid axes: b (with m), zero, sp, recompute, float8, compile
        B = np.array(st.bs, dtype=np.int64)
        Z = np.array(st.zeros, dtype=np.int64)
        SP = np.array(st.sps, dtype=bool)
        RC = np.array([_RECOMPUTE.index(r) for r in self.recompute], dtype=np.int64)
        F8 = np.array([_FLOAT8.index(k) for k in self.float8], dtype=np.int64)
        CMP = np.array(self.compile, dtype=bool)
        gb, gz, gs, gr = (a.ravel() for a in np.meshgrid(B, Z, SP, RC, indexing="ij"))
        axes = (gb, gz, gs, gr, st.per_dp // gb, gb.astype(np.float64), np.where(gs, st.tp, 1))
        # every compile setting at once (the rows tiled, compile the slowest axis): [compile, base rows]
        n0, k8, kc = len(gb), len(F8), len(CMP)
        mem_by_compile = self._memory_bound(st, _Rows(*(np.tile(a, kc) for a in axes),
                                                      np.repeat(CMP, n0))).reshape(kc, n0)
        # expand to (b, zero, sp, recompute) × float8 × compile; outside an exhaustive search only the rows
        # that may fit go on (the rest are counted as rejected by the memory bound)
        base_i = np.repeat(np.arange(n0), k8 * kc)
        gf = np.tile(np.repeat(F8, kc), n0)
        ci = np.tile(np.arange(kc), n0 * k8)
        mem = mem_by_compile[ci, base_i]
        rejected = 0
        if self.prefilter:
            keep = mem * _SAFETY <= self.base.cluster.gpu.memory_bytes
            rejected = int(len(keep) - keep.sum())
            base_i, gf, ci, mem = base_i[keep], gf[keep], ci[keep], mem[keep]
        rows = _Rows(*(a[base_i] for a in axes), CMP[ci])
        out = {"b": rows.b, "m": rows.m, "zero": rows.zero, "sp": rows.sp.astype(np.int64), "rc": rows.rc, "f8": gf,
               "cmp": rows.cmp.astype(np.int64), "mem": mem, "rejected": rejected}
        if len(rows.b) == 0:  # the memory bound left none: no durations to bound
            none = np.zeros(0)
            return {**out, "mk": none, "rest": none, "rest_rank": np.zeros((0, st.pp))}
        f, i_, w_ = self._stage_seconds(st, rows, gf)
        mk, rest = self._time_bounds(st, rows, f, i_, w_)
        return {**out, "mk": mk, "rest": rest.max(axis=1), "rest_rank": rest}

    def _memory_bound(self, st: _Struct, r: _Rows) -> np.ndarray:
        """The memory lower bound on pp ranks 0 and pp-1 (any rank bounds the peak) on the (compile, b, zero,
        sp, recompute) rows, compile the slowest axis: float8 moves none of its terms."""
        k, conv, tp, cp = self._k, self.base.conventions, st.tp, st.cp
        full = r.rc == _RECOMPUTE.index("full")
        per_layer1 = self._per_layer_vec(tp, r.sp, r.rc, cp, r.cmp)
        sbh1 = np.floor(st.s_len * k.h / r.rep_div)  # one sequence's hidden state, /t under SP (≤ the engine's floor)
        n_comms = (1 if self.base.cluster.gpus > 1 else 0) + (st.dpc > 1) + (cp > 1) + (tp > 1) + (st.pp > 1)
        # FSDP2 (fully_shard, or replicate for DP × TP) makes its sharded gradients in each unit's
        # post-backward (under pipelining only at REDUCE_GRAD): the first backward's own moment and the
        # loss moment before it have none, so the bound holds none (the "pytorch" accounting, where the
        # bound's states per element, w_b + g_b + o_b, are the engine's 4 + 4 + optimizer bytes;
        # "zero-paper" counts the gradients all step)
        torch_acc = getattr(conv, "state_accounting", "pytorch") == "pytorch"
        fsdp2 = self._fsdp2_bytes(tp, st.pp, st.v, st.sc, st.dpc, r.zero, r.m, torch_acc, k.g_b)
        # plain gradients (no FSDP2, no DDP bucket view: ``per_rank.plain_grads_late``) exist from the
        # first backward on: before it the engine holds the fp32 parameters and the optimizer states
        # (ZeRO-1: its share) and no gradient, so those rows bound the states by that (none under LoRA,
        # whose states the bound does not follow), and the end of the backward by it plus 4 B an element
        plain = (np.zeros(len(r.zero), dtype=bool) if not torch_acc or getattr(conv, "ddp_gradient_as_bucket_view", False)
                 else ~fsdp2["on"] & (r.zero <= 1))
        c = _RowBytes(
            full=full, sl=r.rc == _RECOMPUTE.index("selective-layer"), per_layer1=per_layer1, sbh1=sbh1,
            stored1=np.where(full, k.act_b * sbh1, per_layer1), overhead=k.ctx + n_comms * k.buf,
            torch_acc=torch_acc,
            fsdp2_grads=(np.where(r.zero >= 2, 1.0, 1.0 if (tp > 1 and st.dpc > 1) else 0.0) if torch_acc
                         else np.zeros(len(r.zero))),
            # ZeRO-3's gathered units are alive at a backward's own moment when they are the current
            # (+ prefetched) unit (not pipelined) or every unit all step (pipelined, not resharded after
            # forward); resharded after forward under pipelining they are kept only from the first backward on
            gathered_at_b=st.pp == 1 or not reshard_after_forward(3, self.base.parallel.fsdp_reshard_after_forward,
                                                                  True),
            fsdp2=fsdp2, plain=plain, lora=self.base.training.finetune == "lora",
            k_opt=4 * names.OPTIMIZER_STATES[self.base.training.optimizer],
            # a split backward's I keeps each microbatch's weight-op output gradients until its W
            # (engine.memory.activations.split_backward_terms' condition)
            keeps_split=(st.split and torch_acc and self.base.training.finetune != "lora" and st.pp > 1
                         and self.base.model.attention != "mla"))
        capacity = self.base.cluster.gpu.memory_bytes
        mem = np.zeros(len(r.b))
        # the last pp rank first: its logits kept to the step's end (below) reject most pipelined rows
        # before the in-flight replays are read
        for ri, stages, sizes, last_psi in reversed(st.sh["ends"]):
            mem, held = self._rank_held_bytes(st, r, c, ri, stages, sizes, last_psi, mem)
            if self.prefilter and (mem * _SAFETY > capacity).all():
                return mem  # every row is rejected already: the later moments only raise it
            mem = self._in_flight_bound(st, r, c, ri, stages, held, mem)
        return mem

    def _rank_held_bytes(self, st: _Struct, r: _Rows, c: _RowBytes, ri: int, stages: tuple[int, ...],
                         sizes: tuple, last_psi: float, mem: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """pp rank ``ri``'s bytes that do not depend on the microbatches in flight: ``mem`` raised by the end
        of the backward (plain gradients, a split backward's kept gradients, the last stage's kept logits),
        and what the in-flight moments add to (``_in_flight_bound``)."""
        k, conv, model = self._k, self.base.conventions, self.base.model
        w_b, g_b, o_b, act_b, dpc, n_stages = k.w_b, k.g_b, k.o_b, k.act_b, st.dpc, st.n_stages
        gz, gs, bf = r.zero, r.sp, r.bf
        p_ = st.sh["psi"][ri]
        states_by_zero = np.array([(w_b + g_b + o_b) * p_, (w_b + g_b) * p_ + o_b * p_ / dpc,
                                   w_b * p_ + (g_b + o_b) * p_ / dpc, (w_b + g_b + o_b) * p_ / dpc])
        # FSDP2's sharded gradient is in the parameter dtype, fp32 (``states.pytorch_states``)
        sharded_grads = np.array([4 * p_, 4 * p_, 4 * p_ / dpc, 4 * p_ / dpc])
        states = np.maximum(states_by_zero[gz] - c.fsdp2_grads * sharded_grads[gz], 0.0)
        if c.plain.any():
            before = 0.0 if c.lora else 4 * p_ + c.k_opt * p_ / np.where(gz == 1, dpc, 1)
            states = np.where(c.plain, before, states)
        fixed = states + c.overhead
        units = tuple(len(st.sh["layers_of"][s]) for s in stages)
        ckpt_units = tuple(checkpointed_per_stage(units, self.base.training.recompute_every))
        # a peak holds either the loss (the moment that opens a last-stage backward) or a backward's
        # own transients (the recomputed block — activations, alive in its backward —, a unit's
        # gradient, the gathered unit), never both
        backward = np.where(c.full | (c.sl & (sum(ckpt_units) > 0)), bf * c.per_layer1, 0.0)
        loss = np.zeros(len(r.b))
        if n_stages - 1 in stages:  # fp32 logits and their gradient at the loss
            loss = loss + bf * st.s_len * st.vocab_t * (act_b + (4 if act_b != 4 else 0))
            if c.torch_acc:  # loss_parallel's backward: three fp32 vocabulary shards at once
                loss = np.where(gs, np.maximum(loss, bf * 12.0 * st.s_len * st.vocab_t), loss)
        ag_units = np.zeros(len(r.b))
        all_units = c.fsdp2["all_units"]
        if dpc > 1:
            if not getattr(conv, "ddp_gradient_as_bucket_view", False):
                fixed = fixed + np.where((gz <= 1) & ~c.fsdp2["on"], g_b * p_, 0.0)  # DDP's buckets
            backward = backward + np.where(gz >= 2, c.fsdp2["unit_grad"] * sizes[0], 0.0)
            if c.gathered_at_b:
                gathered = sum(sizes[:2] if conv.fsdp_prefetch and len(sizes) > 1 else sizes[:1])
                ag_units = np.where(gz == 3, w_b * gathered, 0.0)
                backward = backward + ag_units
        # FSDP2's unsharded parameters of every unit, all step, where no unit reshards between its
        # forward and backward (ZeRO-2, replicate, ZeRO-3 not resharded after forward: lifetime
        # "step", engine.memory.buffers.fsdp2_buffers), in place of the current (+ prefetched) unit
        fixed = fixed + all_units * p_
        backward = backward - np.where(all_units > 0, ag_units, 0.0)
        if st.pp > 1:
            ends = sum((s > 0) + (s < n_stages - 1) for s in stages)
            fixed = fixed + ends * r.m * bf * act_b * c.sbh1
        steady = fixed
        if c.plain.any() and not c.lora:  # the end of the backward: every plain gradient made
            mem = np.maximum(mem, np.where(c.plain, steady + 4 * p_, 0.0))
        if c.keeps_split:
            mem = np.maximum(mem, steady + self._split_keep(st.sc, st.tp, ri, st.pp, st.v, stages,
                                                             st.sh["layers_of"], n_stages, r.m, bf, c.sbh1,
                                                             st.s_len, act_b, st.vocab_t))
        fixed = steady + np.maximum(backward, loss)
        head_up = np.zeros(len(r.b))
        if n_stages - 1 in stages:
            # an F's own moment comes before the final norm and the head make the loss side of its
            # microbatch, a B's after their backward freed it, and the in-flight activations below
            # count it: less one microbatch's loss side, at most fp32 norm input, x̂, rstd, head
            # input and log-probabilities over the loss's vocabulary (its shard under SP's
            # loss_parallel, the whole of it otherwise)
            v_up = np.where(gs, st.vocab_t, model.vocab)
            s_len, h = st.s_len, k.h
            # (the head input gathered from the sequence shards under SP: at most 4 B an element)
            head_up = bf * (8 * np.ceil(s_len * h / r.rep_div) + 4 * np.where(gs, s_len * h, np.ceil(s_len * h / r.rep_div))
                            + 4 * s_len + 4 * s_len * v_up)
        # the end of the backward: torch.distributed.pipelining has kept every microbatch's logits on the last
        # stage (lifetime "to_step_end"), beside the step terms
        if c.torch_acc and st.pp > 1 and n_stages - 1 in stages:
            kept = act_b * st.s_len * np.where(gs, st.vocab_t, model.vocab)
            mem = np.maximum(mem, steady + r.m * bf * kept)
        # (a rank of several stages holds each stage's unsharded gradients only from that stage's
        # first backward to its REDUCE_GRAD after its m-th, lifetimes.STAGE_LIFETIMES: then, with m > 1,
        # those of the stage whose backward came first, the rank's last: nearest the loss)
        grads_unsharded, gacc = c.fsdp2["grads_unsharded"], c.fsdp2["gacc"]
        late = steady + np.where(grads_unsharded, gacc * p_, 0.0) if len(stages) == 1 else \
            steady + np.where(grads_unsharded & (r.m > 1), gacc * last_psi, 0.0)
        # plain gradients: every one of the rank's from its first backward on, whatever its stages
        plain_late = c.plain & (not c.lora)
        late = late + np.where(plain_late, 4 * p_, 0.0)
        return mem, {"fixed": fixed, "late": late, "after_on": grads_unsharded | plain_late, "head_up": head_up,
                     "units": units, "ckpt_units": ckpt_units}

    def _in_flight_bound(self, st: _Struct, r: _Rows, c: _RowBytes, ri: int, stages: tuple[int, ...],
                         held: dict[str, Any], mem: np.ndarray) -> np.ndarray:
        """``mem`` raised by pp rank ``ri``'s in-flight moments, each of which the engine's peak is at least:
        the layer-weighted activation peak of torch's order, with a backward's transients or the loss, and
        a forward after the rank's first backward (with none, any later action before the backward ends),
        where FSDP2 holds every unit's unsharded gradient (lifetime "after_first_backward": pipelined, or
        m > 1) beside the step terms and what is in flight then (ranks of one stage); both less the loss
        side an F's own moment lacks."""
        k, act_b, s_len, gs, bf = self._k, self._k.act_b, st.s_len, r.sp, r.bf
        capacity = self.base.cluster.gpu.memory_bytes
        kc = len(self.compile)
        torch_acc = c.torch_acc
        for rows_held, after_backward in ((held["fixed"], False), (held["late"], True)):
            if after_backward and not held["after_on"].any():
                break
            # replay torch's order only where it matters: the m values whose held part fits; per m the
            # (layer-weighted, first-stage, last-stage, checkpointed-layer-weighted) in-flight counts
            lut = np.zeros((4, st.per_dp + 1))
            # (b: the slowest axis after compile)
            fit_b = (rows_held * _SAFETY <= capacity).reshape(kc, len(st.bs), -1).any(axis=(0, 2)).tolist()
            for m_val in sorted({st.per_dp // b for b, ok in zip(st.bs, fit_b) if ok}):
                lut[:, m_val] = _in_flight_sums(st.sc, ri, st.pp, st.v, m_val, stages, held["units"], st.n_stages,
                                                held["ckpt_units"], after_backward)
            lsum, first, last, lck = lut[:, r.m]
            layers_act = np.where(c.sl, (lsum - lck) * c.per_layer1 + lck * (act_b * c.sbh1), lsum * c.stored1)
            # the last stage's loss side: final-norm input, head input (gathered under SP), fp32 log-probs
            head_in = act_b * np.where(gs, s_len * k.h, c.sbh1) if torch_acc else act_b * c.sbh1
            act = bf * (layers_act + first * 8 * s_len + last * (act_b * c.sbh1 + head_in + 4 * s_len * st.vocab_t))
            if after_backward:
                mem = np.maximum(mem, np.where(held["after_on"], rows_held + np.where(lsum > 0, act - held["head_up"],
                                                                                      0.0), 0.0))
            else:
                mem = np.maximum(mem, rows_held + act - held["head_up"])
        return mem

    def _stage_seconds(self, st: _Struct, r: _Rows, gf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate [rows] and stage [columns], one microbatch's F, I and W seconds: exactly
        engine.time.durations (CPU ranks sharing cores, float8, compile) + engine.time.step's TP and CP terms."""
        k, fl, tp, cp, sh = self._k, self._k.fl, st.tp, st.cp, st.sh
        L, head = sh["L"], sh["head"]
        gb, gs, gr, gc = r.b, r.sp, r.rc, r.cmp
        n = len(gb)
        tokens = r.bf * st.s_len
        rate = k.peak_rate * tp
        rc_flops = np.zeros(len(_RECOMPUTE))  # recomputed forward flops per token and layer, by recompute kind
        rc_flops[_RECOMPUTE.index("full")], rc_flops[_RECOMPUTE.index("selective")] = fl.block, fl.attention_core
        rc_flops[_RECOMPUTE.index("selective-op")] = per_op_recompute_flops_per_token(self.base)
        rc_extra = rc_flops[gr]
        # selective-layer: the checkpointed blocks of each stage recompute their whole forward
        sl = gr == _RECOMPUTE.index("selective-layer")
        ck_extra = np.where(sl, 1.0, 0.0)[:, None] * (sh["ckpt"][None, :] * fl.block)
        f = tokens[:, None] * (L[None, :] * fl.block + head[None, :]) / rate
        i_ = tokens[:, None] * (L[None, :] * (fl.matmuls + 2 * fl.attention_core + rc_extra[:, None])
                                + ck_extra + head[None, :]) / rate
        w_ = tokens[:, None] * (L[None, :] * fl.matmuls + head[None, :]) / rate
        if len(self.float8) > 1 or len(self.compile) > 1 or _FLOAT8.index(self.float8[0]) or self.compile[0]:
            f, i_, w_ = self._float8_and_compile(f, i_, w_, tp, L, sh["ckpt"], tokens, gs, gr, gf, gc, fl, k.act_b,
                                                 rate)
        if k.over != 1.0:  # CPU ranks sharing cores run each action that much longer (engine.time.step)
            f, i_, w_ = f * k.over, i_ * k.over, w_ * k.over
        one_tp = np.zeros(n)
        if tp > 1:
            for b in st.bs:
                size = b * st.s_len * k.h * k.w_b
                ar = self._collective(st.rep, "tp", "all_reduce", size)
                agrs = (self._collective(st.rep, "tp", "all_gather", size)
                        + self._collective(st.rep, "tp", "reduce_scatter", size))
                one_tp[(gb == b) & ~gs] = ar
                one_tp[(gb == b) & gs] = agrs
        fwd_tp = 2 * one_tp
        bwd_tp = 2 * one_tp * np.where(gr == _RECOMPUTE.index("full"), 2.0, 1.0)
        f = f + L[None, :] * fwd_tp[:, None]
        i_ = i_ + L[None, :] * bwd_tp[:, None]
        if cp > 1:  # the exposed K, V exchange, exactly as engine.time.step adds it
            cp_f, cp_b = np.zeros(n), np.zeros(n)
            for b in st.bs:
                cp_f[gb == b], cp_b[gb == b] = self._cp_per_layer(st.rep, b)
            # the blocks that recompute their forward repeat its exchange in the backward
            redo = np.where(np.isin(gr, [_RECOMPUTE.index("full"), _RECOMPUTE.index("selective")])[:, None],
                            L[None, :], 0.0) + np.where(sl, 1.0, 0.0)[:, None] * sh["ckpt"][None, :]
            f = f + L[None, :] * cp_f[:, None]
            i_ = i_ + L[None, :] * cp_b[:, None] + redo * cp_f[:, None]
        return f, i_, w_

    def _time_bounds(self, st: _Struct, r: _Rows, f: np.ndarray, i_: np.ndarray,
                     w_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate, a lower bound of the simulated makespan from its stage seconds (each rank busy with
        its stages' F and B of every microbatch after its first forward's wait; one microbatch down the whole
        chain), and per candidate and pp rank the exposed DP communication + optimizer (as engine.time.step)."""
        sh, gm, gz, dpc = st.sh, r.m, r.zero, st.dpc
        member, fwd_prefix_mask = sh["member"], sh["fwd_prefix_mask"]
        b_ = i_ + w_
        chain_back = i_ if st.split else b_
        busy = gm[:, None] * ((f + b_) @ member.T)  # [n, pp]
        head_wait = f @ fwd_prefix_mask.T  # [n, pp]
        mk = np.maximum((busy + head_wait).max(axis=1), f.sum(axis=1) + chain_back.sum(axis=1))
        zc = gz[:, None]
        opt = self._k.opt_per_param * sh["psi"][None, :] / np.where(zc >= 1, dpc, 1)
        if dpc > 1:
            nb, one_bucket, ar, ag, rs, n_units = (sh[k] for k in ("nb", "one_bucket", "ar", "ag", "rs", "n_units"))
            if self.base.cluster.gpu.name == "cpu":  # CPU ranks: nothing overlaps (engine.time.comm._dp_items); FSDP
                # gathers at least once a microbatch without pipelining, once a step with it
                rounds = gm[:, None] if st.pp == 1 else 1
                exposed = np.where(zc == 0, nb * one_bucket, np.where(zc == 1, ar + ag, rounds * ag + rs))
            else:  # the gradients' collectives hide behind the backward, FSDP's gathers behind F and B
                back_one = b_ @ member.T  # [n, pp]
                window = (f @ member.T + back_one) * gm[:, None]
                calls = np.where(zc == 3, 2 * gm[:, None], 1)
                exposed = np.where(zc == 0, np.maximum(one_bucket, nb * one_bucket - back_one),
                                   np.where(zc == 1, ar + ag, np.maximum(ag / n_units, calls * ag - window) + rs))
        else:
            exposed = 0.0
        return mk, exposed + opt

    def _shape(self, tp: int, pp: int, v: int, sc: str, m: int, dp: int, rep: Config, fl,
               cp: int = 1) -> dict[str, Any]:
        """What the bounds need from one (tp, pp, v, placement style, cp), shared by the schedules with it:
        parameters per pp rank, the stage placement and the DP collectives of each rank's gradients."""
        style = placement_style(sc)
        key = (tp, pp, v, style, cp)
        out = self._shapes.get(key)
        if out is not None:
            return out
        model, conv = self.base.model, self.base.conventions
        n_stages = pp * v
        held = params_per_rank(self.base.replace(parallel={"dp": dp, "tp": tp, "pp": pp, "cp": cp, "schedule": sc,
                                                          "virtual_stages": v, "microbatches": m}))
        rows = [row[0] for row in held]  # tp-rank 0 of each pp rank: the largest vocabulary chunk
        psi = np.array([r.total for r in rows], dtype=np.float64)  # [pp]
        layers_of = split_layers(model.layers, n_stages, self.base.parallel.pipeline_split)
        head = np.zeros(n_stages)
        head[-1] = fl.head
        owners = stage_to_pp_rank(n_stages, pp, style) if pp > 1 else [0]
        member = np.zeros((pp, n_stages))
        member[owners, np.arange(n_stages)] = 1.0
        first_stage = np.array([min(r.stage_indices) for r in rows])
        # selective-layer's checkpointed blocks per stage: every N-th of each rank's blocks (engine.time.durations)
        ckpt = np.zeros(n_stages)
        for r in rows:
            mine = sorted(r.stage_indices)
            for s_, c_ in zip(mine, checkpointed_per_stage([len(layers_of[x]) for x in mine],
                                                           self.base.training.recompute_every)):
                ckpt[s_] = c_
        out = {"psi": psi, "layers_of": layers_of, "L": np.array([len(x) for x in layers_of], dtype=np.float64),
               "head": head, "member": member, "ckpt": ckpt,
               "fwd_prefix_mask": (np.arange(n_stages)[None, :] < first_stage[:, None]).astype(np.float64),
               "ends": [(ri, rows[ri].stage_indices,
                         rows[ri].largest_unit_numels(2),
                         max(rows[ri].stages, key=lambda st: st.stage).total)  # its last stage's elements
                        for ri in sorted({0, pp - 1})]}
        if dp * cp > 1:
            g_bytes, w_b = self.base.training.grad_bytes, self.base.training.param_bytes
            grad_group = "dp" if cp == 1 else "dp_cp"  # gradients reduce over dp·cp (engine.time.comm)

            def per_rank(fn) -> np.ndarray:
                return np.array([fn(int(t)) for t in psi])

            out["nb"] = per_rank(lambda t: max(1, math.ceil(t * g_bytes / (conv.ddp_bucket_mb * 1e6))))
            out["one_bucket"] = per_rank(lambda t: self._collective(
                rep, grad_group, "all_reduce",
                t * g_bytes / max(1, math.ceil(t * g_bytes / (conv.ddp_bucket_mb * 1e6)))))
            out["ar"] = per_rank(lambda t: self._collective(rep, grad_group, "all_reduce", t * g_bytes))
            out["ag"] = per_rank(lambda t: self._collective(rep, grad_group, "all_gather", t * w_b))
            out["rs"] = per_rank(lambda t: self._collective(rep, grad_group, "reduce_scatter", t * g_bytes))
            out["n_units"] = np.array([max(1, r.unit_count) for r in rows], dtype=np.float64)
        self._shapes[key] = out
        return out

    def _split_keep(self, sc, tp, ri, pp, v, stages, layers_of, n_stages, gm, bf, sbh1, s_len, act_b,
                    vocab_t) -> np.ndarray:
        """Per row, the most a split backward keeps at once on pp rank ``ri`` from its I's to their W's on one
        stage: that stage's microbatches between I and W at most (``schedules.split_backward_in_flight``)
        times what one keeps (``engine.memory.activations.split_backward_terms`` with the residual stream at
        the activation dtype, ≤ its own): every Linear's and norm weight's output gradient of its blocks and
        the stage input's gradient, and on the last stage the final norm's and the head's."""
        linear_out = weight_op_outputs(self.base.model, tp)
        counts = np.zeros((len(stages), int(gm.max(initial=0)) + 1))  # [local stage, m]
        for m_val in set(gm.tolist()):
            counts[:, m_val] = split_backward_in_flight(sc, pp, v, m_val)[ri]
        out = np.zeros(len(gm))
        for j, st in enumerate(sorted(stages)):
            if st == 0:  # the first stage runs no I: its W is the whole backward
                continue
            one = len(layers_of[st]) * (act_b * s_len * linear_out + 2 * act_b * sbh1) + act_b * sbh1
            if st == n_stages - 1:
                one = one + act_b * sbh1 + act_b * s_len * vocab_t
            out = np.maximum(out, counts[j, gm] * bf * one)
        return out

    def _fsdp2_bytes(self, tp: int, pp: int, v: int, sc: str, dpc: int, gz: np.ndarray, gm: np.ndarray,
                     torch_acc: bool, g_b: int) -> dict[str, Any]:
        """What FSDP2 holds, per candidate of one (tp, pp, v, schedule, cp) on the (b, zero, sp, recompute) axes,
        for the memory bound (``engine.memory.buffers.fsdp2_buffers``, ``engine.wrapping.wrapping_plan``):
        ``on`` (fully_shard for ZeRO-2/3, replicate for ZeRO-0/1 with TP), ``all_units`` (bytes per parameter
        of every unit unsharded all step), ``unit_grad`` (bytes per element of a backward's one-unit gradient),
        ``grads_unsharded`` (every unit's gradient accumulated unsharded at some moment) and ``gacc`` (its
        bytes per element)."""
        base = self.base
        on = (torch_acc and dpc > 1 and base.parallel.dp_mode != "dataparallel") & ((gz >= 2) | (tp > 1))
        z3_reshards = reshard_after_forward(3, base.parallel.fsdp_reshard_after_forward, pp > 1)
        compute = _COMPUTE_DTYPE[base.training.precision]
        pd = PLAN_DTYPE_BYTES[compute]  # MixedPrecisionPolicy's param dtype: what FSDP2 gathers
        gacc = PLAN_DTYPE_BYTES["fp32" if compute == "fp32" else base.training.grad_dtype]
        if base.training.finetune == "lora":  # only the adapters' gradients: none counted
            gacc = 0
        # every unit unsharded all step (lifetime "step"): replicate, and ZeRO-3 not resharded after forward;
        # ZeRO-2's are the states' w_b·Ψ already (the paper's accounting of the states)
        all_units = np.where(on & ((gz <= 1) | ((gz == 3) & ~z3_reshards)), float(pd), 0.0)
        # a backward's gradient of one unit: the reduce-scatter input (in the reduce dtype) where each backward
        # syncs (FSDP2: one microbatch, no pipeline; the paper's accounting: always), else FSDP2's fresh
        # gradient in the parameter dtype where it accumulates in another (until post-backward adds it in)
        synced = ~on | ((pp == 1) & (gm == 1))
        unit_grad = np.where(synced, float(g_b), float(pd) if gacc != pd else 0.0)
        # some moment after the rank's first backward (B or I) and before the end of the backward: a later
        # microbatch, a second local stage, or a split backward's W
        grads_unsharded = on & ((gm > 1) | (pp > 1 and (v > 1 or sc in names.SPLIT_BACKWARD_SCHEDULES)))
        return {"on": on, "all_units": all_units, "unit_grad": unit_grad, "grads_unsharded": grads_unsharded,
                "gacc": gacc}

    def _per_layer_vec(self, tp, gs, gr, cp=1, gc=None) -> np.ndarray:
        gc = np.zeros(len(gs), dtype=bool) if gc is None else gc
        lut = np.zeros((2, len(_RECOMPUTE), 2))
        for s in set(gs.tolist()):  # (sets of a few values: np.unique costs more on these short axes)
            for r in set(gr.tolist()):
                for c in set(gc.tolist()):
                    lut[int(s), r, int(c)] = self._act_per_layer_b1(tp, s, _RECOMPUTE[r], cp, bool(c))
        return lut[gs.astype(np.int64), gr, gc.astype(np.int64)]

    def _float8_and_compile(self, f, i_, w_, tp, L, ckpt, tokens, gs, gr, gf, gc, fl, act_b, rate):
        """engine.time.step.with_float8_and_compile over the grid: float8's matmul rate and casts, compile's fused
        elementwise chains, on the per-stage compute durations (before the mesh's collectives), clamped at 0."""
        base = self.base
        m, gpu = base.model, base.cluster.gpu
        hbm = gpu.hbm_bandwidth_gb_per_s * 1e9
        on8 = gf > 0
        if on8.any():
            sums = self._linear_sums.get(tp)
            if sums is None:  # per tp: a validated replace each structure cost a sixth of the grid
                lin = block_linears(base.replace(parallel={"dp": base.cluster.gpus // tp, "tp": tp}))
                sums = self._linear_sums[tp] = (sum(a for a, _ in lin), sum(o for _, o in lin),
                                                sum(a * o for a, o in lin))
            s_in, s_out, wts = sums
            per = np.where(gc, FLOAT8_CAST_BYTES[True], FLOAT8_CAST_BYTES[False])
            again = np.where(gf == _FLOAT8.index("rowwise"), 2, 1)
            cast_f = per * (tokens * s_in + wts)
            cast_b = per * (again * tokens * s_out + (again - 1) * tokens * s_in + wts)
            cast_f, cast_b = np.where(on8, cast_f, 0.0)[:, None], np.where(on8, cast_b, 0.0)[:, None]
            peak8 = gpu.peak_fp8_tflops * 1e12 * base.conventions.compute_efficiency * tp
            per_block = (np.where(on8, 1.0, 0.0) * tokens * fl.matmuls * (1 / rate - 1 / peak8))[:, None]
            # engine.time.step.recomputed_linear_blocks: the blocks' worth of matmuls the backward runs again
            redo = np.zeros((len(gr), len(L)))
            redo[gr == _RECOMPUTE.index("full")] = L
            redo[gr == _RECOMPUTE.index("selective-layer")] = ckpt
            redo[gr == _RECOMPUTE.index("selective-op")] = L * (per_op_recompute_flops_per_token(base) / fl.matmuls)
            f = f + L[None, :] * (cast_f / hbm - per_block)
            i_ = i_ + L[None, :] * cast_b / hbm + redo * (cast_f / hbm - per_block) - L[None, :] * per_block
            w_ = w_ - L[None, :] * per_block
        if gc.any():
            ffn = m.ffn_hidden / tp if m.mlp == "swiglu" else 0.0
            rope = (m.heads * m.head_dim + m.kv_dim) / tp if m.position == "rope" else 0.0
            residual_norm = 2 * m.hidden / np.where(gs, tp, 1)
            save_f = np.where(gc, 2 * act_b * tokens * (ffn + residual_norm + rope), 0.0)[:, None]
            f = f - L[None, :] * save_f / hbm
            i_ = i_ - L[None, :] * (2 * save_f) / hbm
        return np.maximum(f, 0.0), np.maximum(i_, 0.0), np.maximum(w_, 0.0)

    # ----------------------------------------------------------------- exact pieces

    def config(self, g: _Grid, i: int) -> Config:
        c = g.cols
        tp, pp, v, sc, cp = self.structs[int(c["struct"][i])]
        return self.base.replace(
            parallel={"dp": self.base.cluster.gpus // (tp * pp * cp), "tp": tp, "pp": pp, "cp": cp,
                      "zero": int(c["zero"][i]),
                      "sequence_parallel": bool(c["sp"][i]), "schedule": sc, "virtual_stages": v,
                      "microbatches": int(c["m"][i])},
            training={"micro_batch_size": int(c["b"][i]), "recompute": _RECOMPUTE[int(c["rc"][i])],
                      "float8": _FLOAT8[int(c["f8"][i])], "compile": bool(c["cmp"][i])})

    def makespan_key(self, g: _Grid, i: int) -> tuple:
        """``makespan``'s cache key of candidate ``i``, from the grid's columns (no Config built)."""
        c = g.cols
        tp, pp, v, sc, cp = self.structs[int(c["struct"][i])]
        return (tp, pp, v, sc, int(c["m"][i]), int(c["b"][i]), bool(c["sp"][i]), _RECOMPUTE[int(c["rc"][i])], cp,
                _FLOAT8[int(c["f8"][i])], bool(c["cmp"][i]))

    def makespan(self, cfg: Config) -> float:
        """The simulated pipeline makespan (as engine.time.step computes it), cached per pipeline shape."""
        par, tr = cfg.parallel, cfg.training
        key = (par.tp, par.pp, par.virtual_stages, par.schedule, par.microbatches, tr.micro_batch_size,
               par.sequence_parallel, tr.recompute, par.cp, tr.float8, tr.compile)
        out = self._makespans.get(key)
        if out is None:
            pkey = (par.schedule, par.pp, par.microbatches, par.virtual_stages)
            plan = self._plans.get(pkey)
            if plan is None:
                plan = self._plans[pkey] = (single_rank_plan(par.schedule, par.microbatches) if par.pp == 1 else
                                            pipeline_actions(par.schedule, par.pp, par.microbatches, par.virtual_stages))
            d = with_mesh_communication(cfg, analytic_durations(cfg))
            out = self._makespans[key] = simulate(plan, d).makespan_s
        return out


@lru_cache(maxsize=8192)
def _in_flight_sums(schedule: str, pp_rank: int, pp: int, v: int, m: int, stages: tuple[int, ...],
                    units: tuple[int, ...], n_stages: int, ckpt: tuple[int, ...] = (),
                    late: bool = False) -> tuple[int, int, int, int]:
    """At the rank's activation peak (``engine.pipeline.schedules.microbatches_in_flight``; ``late``: the layer-weighted
    most of the states after a forward that runs after the rank's first backward, all 0 where none does):
    in-flight microbatches weighted by each local stage's layer count, those on the first and on the last stage,
    and the microbatches weighted by each local stage's checkpointed blocks ``ckpt`` (selective-layer; 0 without).

    Pure in its arguments, so shared by every layout group (tp, b, ZeRO, SP, recompute) with this
    pipeline shape, within one plan and across plans: replaying torch's order is the costly part.
    """
    if late:
        states = in_flight_states_after_first_backward(schedule, pp_rank, pp, v, m)
        if not states:
            return 0, 0, 0, 0
        counts = max(states, key=lambda st: sum(n * u for n, u in zip(st, units)))
    else:
        counts = microbatches_in_flight(schedule, pp_rank, pp, v, m, units)
    lsum = sum(c * u for c, u in zip(counts, units))
    first = sum(c for c, s in zip(counts, stages) if s == 0)
    last = sum(c for c, s in zip(counts, stages) if s == n_stages - 1)
    return lsum, first, last, sum(c * k for c, k in zip(counts, ckpt))


def _key(g: _Grid, i: int) -> tuple:
    """Deterministic tie-break between layouts with equal step time."""
    c = g.cols
    return tuple(int(c[k][i]) for k in ("tp", "pp", "v", "sched", "m", "b", "zero", "sp", "rc", "cp", "f8", "cmp"))


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
    Config's own are ignored (and float8 all-gather and async TP are off). ``options``: ``plan``'s keyword arguments (``top``, ``global_batch``, ``all_fitting``,
    ``seq_len``, ``cp``, …)."""
    t0 = time.perf_counter()
    allowed = {"top", "global_batch", "zero", "schedules", "recompute", "max_virtual_stages", "micro_batch_sizes",
               "exhaustive", "all_fitting", "fitting_limit", "fitting_seconds", "progress", "cancelled", "seq_len",
               "cp", "float8", "compile", "runnable_only"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise PlanError(unknown[0], f"unknown option; allowed: {', '.join(sorted(allowed))}")
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
