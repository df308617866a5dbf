"""The clock from ops (``conventions.clock = "ops"``): each stage's F, I and W per microbatch as the
sum of the ops its blocks run, each op timed as a roofline on the GPU kind's device profile.

An op is a GEMM, the attention kernel or a memory-bound kernel (norms, RoPE, the MLP's activation,
residual adds, float8 casts, the loss), with its FLOPs, the bytes it reads and writes and its kernel
count. Its time is::

    max(FLOPs / achieved rate, bytes / (HBM bandwidth · hbm_fraction)) + kernels · launch

(``launch_us`` for a forward op, ``launch_backward_us`` for a backward one: the autograd engine's cost
per node is its own)

where a GEMM's achieved rate is ``peak(dtype) · gemm_fraction(dtype) · power_factor · F / (F +
F_half)`` (F: one kernel's FLOPs: small GEMMs run below the large-GEMM rate) and the attention
kernel's is ``peak · attention_fraction · power_factor`` over the FLOPs it executes (causal: half
the full square the MFU convention counts). The figures are data: ``assets/presets/devices.toml``,
each with its source; a GPU kind without a profile there uses its ``[generic]`` one.

The ops of one dense block for one microbatch on one rank (T tokens: micro-batch × seq_len / cp; T'
= T / tp where sequence parallelism shards the norms and residuals; a: the activation dtype's bytes):

* forward: the Linears' GEMMs (q, k, v, o, the MLP's; float8's GEMMs in its recipe's dtype, 1-byte
  inputs), the attention (``_attention_ops``: one flash kernel, or eager attention's GEMMs and
  elementwise ops), and the memory-bound ops. Eager: each RMSNorm 1 kernel reading and writing
  its tensor (2·T'·h·a bytes: ``torch.rms_norm`` runs its fused kernel when input and weight share a
  dtype, as under FSDP2's bf16 parameters; its warning "Mismatch dtype between input and weight ...
  Cannot dispatch to fused implementation" from aten/src/ATen/native/layer_norm.cpp says when it does
  not; ``conventions.rms_norm = "fp32-composite"``: torchtitan's own norm of 2024, 8 kernels through
  fp32, :func:`rms_norm_op`; on CPU ranks torch's own composite, whatever the convention), each residual add 1 (3·T'·h·a), RoPE on q and k 14 kernels each
  (backend/model.py's ``rope``: its angles' cos and sin, four products, a difference, a sum and a cat:
  9·a bytes an element),
  SwiGLU's silu and product 2 (5·T·f·a), float8's casts (``engine.time.durations.float8_cast_bytes``;
  2 kernels a cast: amax, then scale), and under ``torch.autocast`` (DDP, ZeRO-1/2 in bf16-mixed) each weight's
  and each stream-reading input's cast to bf16 (:func:`autocast_casts`). Under torch.compile the chains fuse: each residual add with the
  norm after it 1 kernel (4·T'·h·a), RoPE 1 kernel (2a), silu·mul 1 (3·T·f·a), a cast 1 (amax fused).
* backward for inputs (I): each Linear's input-gradient GEMM, the attention's backward (2.5 × its
  forward FLOPs), each memory-bound op's backward at twice its forward's bytes and kernels, the
  float8 casts of the output gradients; and the recomputed forward (``training.recompute``): the
  whole forward (full; the checkpointed blocks under selective-layer), the attention (selective),
  the matmuls torchtitan's per-op policy does not save and every elementwise op (selective-op).
* backward for weights (W): each Linear's weight-gradient GEMM. Float8's rowwise recipe runs its gradient GEMMs (I's and
  W's) without fast accumulation, and torchao then calls the tensorwise kernel with unit scales and scales the output
  itself (:func:`_rowwise_post_scale`): those GEMMs run at the tensorwise rate, plus 2 kernels over each output.
* the last stage adds the final norm, the head's GEMMs (bf16: float8 leaves the head alone) and the
  loss (the logits cast to fp32, log-softmax; the backward's softmax gradient and cast back); the
  first stage the embedding's gather.

Other block kinds (:func:`block_ops` with ``experts``; a stage adds its dense blocks and its blocks with
experts, ``engine.time.durations.stage_block_counts``):

* experts: the router's GEMM over the tokens the block routes (``h × E``, replicated), the local experts'
  grouped GEMMs (E / ep of them; f split by TP only without expert parallelism) over the routed copies
  (n·k × ``routed_factor``: the busiest EP rank's, which the all-to-all waits for), one kernel each at the
  rate of one expert's share of its FLOPs; the shared experts as a dense MLP; the router's scores and
  top-k (3 kernels over n × E) and the tokens' dispatch and weighted combine (gather 2, weight 2 and
  scatter-add 1 passes over the copies, 2 over the n tokens: 4 kernels). Float8 leaves the grouped
  experts alone (validation refuses float8 with experts). The all-to-all is communication
  (``engine.time.comm``).
* MLA: its latent and head-wise projections (``engine.model.params.attention_tensors``' layout), the
  latents' norms, RoPE on the rope dimensions only (each head's query and the one shared key), the flash
  kernel over QKᵀ at d_qk = d_nope + d_rope and AV at d_v.
* head_size: the projections and the attention at a·d wide, not h.
* sliding windows: the flash kernel executes min(i + 1, w) keys for query i, (w − w²/2s) / s of the
  square, averaged over the blocks with the full ones (``_executed_share``).
* LoRA: each adapted Linear's A and B GEMMs (engine.model.lora's TP layout) in F and I, their scale and
  add; the frozen base keeps its input-gradient GEMMs but W holds the adapters' only (no base, head or
  embedding weight gradient).

Host work the kernels do not show (a profile's optional figures; ``shardscope calibrate --device`` measures them on
this machine, GPU profiles leave them at 0, their launch queue hiding it): DTensor's dispatch, sharding propagation and
redistributes per TP-sharded Linear (``tp_linear_us``, ``sp_linear_us`` and their backward figures: an op of kind
"dtensor" in F and I, in a full recompute's R too), FSDP2's hooks and copies per unit and microbatch
(:func:`fsdp_unit_seconds`: each stage's blocks and its root) and the optimizer's aten calls on DTensor parameters
(``engine.time.step.optimizer_seconds``).

Ops in a chain of blocks (a profile's optional ``context_*`` figures; 1 on GPU profiles): a CPU core runs an op
interleaved with a block's other ops slower than the micro-benchmarks' hot loops, which repeat it alone (in the tiny
preset's forward a 128 × 128 × 352 GEMM takes 125 µs against 76 alone, the scores' batched GEMM 167 against 25 on the
same tensors). ``calibrate --device`` times its own probe model (backend/devicebench.py's ``_context_probe``: 4 blocks
of hidden 192 and its loss, in fp32 and under bf16 autocast) and divides by its op lists' sums at the other figures;
every op of a stage's F (and a recompute's forward) and of its I and W is timed at that multiple
(:meth:`DeviceProfile.context`), the optimizer's and float8's GEMMs not (the probe runs neither).

What it leaves out (the efficiency clock's terms stand there): the async-TP and context-parallel
overlap windows (``engine.time.step`` reads them off the efficiency clock); the optimizer step
(``engine.time.step.optimizer_seconds``: memory-bound; on CPU ranks torch's one-tensor step as an op list of its own,
its aten calls at the per-op cost); gradient accumulation adds.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from assets import PRESETS_DIR
from engine.config import Config
from engine.model.lora import adapted_linears
from engine.model.recompute import checkpointed_blocks
from engine.model.routing import routed_factor
from engine.time.durations import (
    StageDurations,
    float8_cast_bytes,
    flops_per_token,
    p2p_seconds,
    per_op_recompute_flops_per_token,
    stage_block_counts,
)
from engine.wrapping import wrapping_plan

#: the dtypes a GEMM runs in, by the profile field naming its achieved fraction
GEMM_DTYPES = ("bf16", "fp32", "fp8_tensorwise", "fp8_rowwise")


@dataclass(frozen=True)
class DeviceProfile:
    """Achieved fractions of a GPU kind's peaks (``assets/presets/devices.toml`` explains each)."""

    name: str
    gemm_fraction_bf16: float
    gemm_fraction_fp32: float
    gemm_fraction_fp8_tensorwise: float
    gemm_fraction_fp8_rowwise: float
    gemm_half_gflop: float
    attention_fraction_forward: float
    attention_fraction_backward: float
    hbm_fraction: float
    launch_us: float
    launch_backward_us: float
    power_factor: float
    # the bandwidth a kernel of exponentials (softmax, log-softmax) achieves, as a fraction of ``hbm_fraction``'s
    # (optional in devices.toml: 1, a GPU's memory-bound kernels all stream; a CPU core computes each exp)
    softmax_fraction: float = 1.0
    # the half-rate size of the 16-bit GEMMs where it differs from ``gemm_half_gflop``'s (optional: 0, the same; a CPU's
    # bf16 GEMMs run oneDNN's AMX kernel, whose set-up costs ~19 µs a call where fp32's costs ~1)
    gemm_half_gflop_bf16: float = 0.0
    # the half-rate sizes of the float8 GEMMs, per kernel (``torch._scaled_mm`` with one scale a tensor, which torchao's
    # tensorwise recipe and a rowwise recipe's gradient GEMMs call, and with a scale a row, a rowwise forward's); optional:
    # 0, the 16-bit GEMMs' (a CPU's float8 kernels are others than its bf16 one, backend/devicebench.py)
    gemm_half_gflop_fp8_tensorwise: float = 0.0
    gemm_half_gflop_fp8_rowwise: float = 0.0
    # a block's kernels as training pays them under each recompute kind's wrapper (``training.recompute``: torch's
    # checkpoint, its saved-tensor hooks, per-op selective checkpointing's dispatch mode), forward and recomputed
    # ops (``launch_us_*``) and backward ones (``launch_backward_us_*``); optional: 0, the plain figures
    launch_us_full: float = 0.0
    launch_backward_us_full: float = 0.0
    launch_us_selective: float = 0.0
    launch_backward_us_selective: float = 0.0
    launch_us_selective_op: float = 0.0
    launch_backward_us_selective_op: float = 0.0
    # what a block Linear that tensor parallelism shards costs more, as DTensor runs it (its dispatch, sharding
    # propagation, the input's and output's redistributes in Python; the collectives themselves are engine.time.comm's),
    # forward and backward, without and with sequence parallelism (``parallel.sequence_parallel``: the norms, the
    # residual stream's shards); optional: 0, a GPU's launch queue hides it
    tp_linear_us: float = 0.0
    tp_linear_backward_us: float = 0.0
    sp_linear_us: float = 0.0
    sp_linear_backward_us: float = 0.0
    # what FSDP2 costs a unit (``fully_shard``'s pre- and post-forward hooks with its all-gather's copies, or
    # ``replicate``'s without a gather; the backward's hooks and reduce-scatter copies) beyond the collectives, and what
    # an aten call of the optimizer's one-tensor step costs more on a DTensor parameter; optional: 0
    fsdp_unit_us: float = 0.0
    fsdp_unit_kept_us: float = 0.0
    fsdp_unit_backward_us: float = 0.0
    dtensor_optimizer_op_us: float = 0.0
    # a stage's compute as a chain of blocks runs it, over the sum of its ops at the figures above (hot micro-benchmarks,
    # each op repeated alone): forward (and recomputed) ops, backward ones; fp32, and under bf16 autocast (the ``_bf16``
    # figures; 0: the fp32 ones). A CPU core runs an op interleaved with others slower than alone (its caches, its
    # predictors), which no micro-benchmark sees: backend/devicebench.py's _context_probe measures it on a probe model
    # of its own. Optional: 1, a GPU's kernels (its launch queue overlaps the host, its caches hold no weights)
    context_forward: float = 1.0
    context_backward: float = 1.0
    context_forward_bf16: float = 0.0
    context_backward_bf16: float = 0.0

    def context(self, phase: str, precision: str) -> float:
        """What a stage's op in ``phase`` (F: forward and recomputed; I, W: backward) costs in a chain of blocks over
        its time alone, under ``training.precision``."""
        forward = phase == "F"
        own = (self.context_forward_bf16 if forward else self.context_backward_bf16) if precision != "fp32" else 0.0
        return own if own > 0 else (self.context_forward if forward else self.context_backward)

    def launch(self, phase: str, recompute: str = "none") -> float:
        """µs one kernel of a block costs beyond its roofline under ``recompute``'s wrapper: a forward or recomputed
        one (``phase`` "F") or a backward one; the plain figure where the profile has none for the kind (none and
        selective-layer use the plain ones)."""
        forward = phase == "F"
        plain = self.launch_us if forward else self.launch_backward_us
        kind = RECOMPUTE_LAUNCH.get(recompute)
        if kind is None:
            return plain
        got = getattr(self, f"launch_us_{kind}" if forward else f"launch_backward_us_{kind}")
        return got if got > 0 else plain

    def gemm_fraction(self, dtype: str) -> float:
        return getattr(self, f"gemm_fraction_{dtype}")

    def tp_linear(self, phase: str, sequence_parallel: bool) -> float:
        """µs a TP-sharded Linear costs beyond its kernels in a forward (``phase`` "F") or a backward."""
        kind = "sp" if sequence_parallel else "tp"
        return getattr(self, f"{kind}_linear_us" if phase == "F" else f"{kind}_linear_backward_us")

    def gemm_half(self, dtype: str) -> float:
        """GFLOP at which a ``dtype`` GEMM runs at half its large-GEMM rate."""
        own = getattr(self, f"gemm_half_gflop_{dtype}", 0.0) if dtype.startswith("fp8") else 0.0
        if own > 0:
            return own
        return self.gemm_half_gflop_bf16 if dtype != "fp32" and self.gemm_half_gflop_bf16 > 0 else self.gemm_half_gflop


#: the recompute kinds whose wrappers a profile may time on their own (:meth:`DeviceProfile.launch`), by field suffix
RECOMPUTE_LAUNCH = {"full": "full", "selective": "selective", "selective-op": "selective_op"}

#: profile fields a table may leave out (their defaults: a GPU's)
OPTIONAL_FIELDS = ("softmax_fraction", "gemm_half_gflop_bf16", "gemm_half_gflop_fp8_tensorwise",
                   "gemm_half_gflop_fp8_rowwise",
                   *(f"{p}_{k}" for k in RECOMPUTE_LAUNCH.values() for p in ("launch_us", "launch_backward_us")),
                   *(f"{k}_linear{p}_us" for k in ("tp", "sp") for p in ("", "_backward")),
                   "fsdp_unit_us", "fsdp_unit_kept_us", "fsdp_unit_backward_us", "dtensor_optimizer_op_us",
                   "context_forward", "context_backward", "context_forward_bf16", "context_backward_bf16")


@functools.cache
def _profiles() -> dict[str, DeviceProfile]:
    with open(PRESETS_DIR / "devices.toml", "rb") as fh:
        raw = tomllib.load(fh)
    names = {f.name for f in fields(DeviceProfile)} - {"name"}
    required = names - set(OPTIONAL_FIELDS)
    out = {}
    for kind, table in raw.items():
        if not required <= set(table) <= names:
            raise ValueError(f"assets/presets/devices.toml [{kind}]: expected the fields {sorted(required)} "
                             f"(optional: {sorted(OPTIONAL_FIELDS)}), got {sorted(table)}")
        out[kind] = DeviceProfile(name=kind, **{k: float(v) for k, v in table.items()})
    return out


#: where ``shardscope calibrate --device`` keeps this machine's measured CPU profile (``SHARDSCOPE_CACHE_DIR``,
#: else ``$XDG_CACHE_HOME/shardscope``, else ``~/.cache/shardscope``)
MEASURED_PROFILE = "device-cpu.json"


def measured_profile_path() -> Path:
    root = os.environ.get("SHARDSCOPE_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardscope")
    return Path(root) / MEASURED_PROFILE


@functools.lru_cache(maxsize=8)
def _measured(path: str, mtime_ns: int) -> DeviceProfile | None:
    """The profile a ``calibrate --device`` of this machine wrote (None: another machine's, or unreadable)."""
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("host") != socket.gethostname():
            return None
        return DeviceProfile(name=f"cpu (measured {doc.get('measured', '?')})",
                             **{f.name: float(doc["profile"][f.name]) for f in fields(DeviceProfile)
                                if f.name != "name" and (f.name in doc["profile"] or f.name not in OPTIONAL_FIELDS)})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def device_profile(gpu_name: str) -> DeviceProfile:
    """The profile of a GPU kind: for ``cpu`` this machine's as ``shardscope calibrate --device`` measured it
    (``measured_profile_path``) where it has, else ``devices.toml``'s own where it has one, else ``generic``."""
    if gpu_name == "cpu":
        path = measured_profile_path()
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = None
        if mtime is not None:
            got = _measured(str(path), mtime)
            if got is not None:
                return got
    profiles = _profiles()
    return profiles.get(gpu_name, profiles["generic"])


def bound_efficiency(cfg: Config) -> float:
    """A fraction of the peaks no op of ``cfg``'s clock runs above, as the efficiency clock counts FLOPs:
    ``compute_efficiency`` under ``clock = "efficiency"``; under ``"ops"`` the profile's largest GEMM
    fraction, twice its attention forward fraction and 1.6 × its backward one (the efficiency clock counts
    the full square and a 2× backward where the ops execute half of it and 2.5× that), times the power
    factor. The planner's time bound reads its rates off it, so it stays a lower bound of either clock
    (the ops' memory-bound time and small-GEMM slowdown only add to it)."""
    if cfg.conventions.clock != "ops":
        return cfg.conventions.compute_efficiency
    prof = device_profile(cfg.cluster.gpu.name)
    return prof.power_factor * max(*(prof.gemm_fraction(d) for d in GEMM_DTYPES), 2 * prof.attention_fraction_forward,
                                   1.6 * prof.attention_fraction_backward)


def clock_description(cfg: Config) -> str:
    """What timed a prediction of ``cfg``, in words: the efficiency and its value, or the device profile."""
    if cfg.conventions.clock != "ops":
        return (f"efficiency clock: every FLOP at {cfg.conventions.compute_efficiency:g} × the "
                f"{cfg.cluster.gpu.name} peak (conventions.compute_efficiency)")
    prof = device_profile(cfg.cluster.gpu.name)
    where = (f"this machine's measured profile, {measured_profile_path()}" if prof.name.startswith("cpu (measured")
             else "assets/presets/devices.toml")
    return f"clock from ops: each op a roofline on the {prof.name} device profile ({where})"


def profile_record(cfg: Config) -> dict:
    """What timed ``cfg`` on this machine, for a run to keep beside its measurement (``device-profile.json``):
    the clock, the device profile's name, where it came from and its figures (under the efficiency clock the
    efficiency)."""
    if cfg.conventions.clock != "ops":
        return {"clock": cfg.conventions.clock, "compute_efficiency": cfg.conventions.compute_efficiency,
                "description": clock_description(cfg)}
    prof = device_profile(cfg.cluster.gpu.name)
    return {"clock": "ops", "gpu": cfg.cluster.gpu.name, "profile": prof.name, "description": clock_description(cfg),
            "figures": {f.name: getattr(prof, f.name) for f in fields(DeviceProfile) if f.name != "name"}}


def clock_short(cfg: Config) -> str:
    """:func:`clock_description` in a few words, for a table cell: "efficiency 0.5" or "ops (h100-96g)"."""
    if cfg.conventions.clock != "ops":
        return f"efficiency {cfg.conventions.compute_efficiency:g}"
    name = device_profile(cfg.cluster.gpu.name).name
    return "ops (measured cpu)" if name.startswith("cpu (measured") else f"ops ({name})"


@dataclass(frozen=True)
class Op:
    """One op of a block (or of the head / embedding) for one microbatch on one rank."""

    name: str
    phase: str  # "F", "I" or "W"
    kind: str  # "gemm", "attention", "memory" or "dtensor" (``kernels`` TP-sharded Linears' DTensor costs)
    flops: float
    bytes: float
    kernels: int = 1
    dtype: str = "bf16"  # a GEMM's: one of GEMM_DTYPES
    exp_bound: bool = False  # a memory-bound kernel of exponentials (softmax, log-softmax): ``softmax_fraction``
    groups: int = 1  # a grouped GEMM's experts: its rate is one group's size's


def op_seconds(op: Op, cfg: Config, prof: DeviceProfile, recompute: str = "none") -> float:
    """The roofline time of one op on ``cfg``'s GPU kind (module docstring); ``recompute``: the kind whose wrapper
    the op runs in (a block's ops: ``training.recompute``; the head's, the embedding's and the optimizer's none)."""
    gpu = cfg.cluster.gpu
    if op.kind == "dtensor":
        return op.kernels * prof.tp_linear(op.phase, cfg.parallel.sequence_parallel) * 1e-6
    seconds = op.bytes / (gpu.hbm_bandwidth_gb_per_s * 1e9 * prof.hbm_fraction
                          * (prof.softmax_fraction if op.exp_bound else 1.0))
    if op.kind == "gemm" and op.flops > 0:
        peak = {"bf16": gpu.peak_bf16_tflops, "fp32": gpu.peak_fp32_tflops}.get(op.dtype, gpu.peak_fp8_tflops)
        one = op.flops / (op.kernels * op.groups)
        rate = peak * 1e12 * prof.gemm_fraction(op.dtype) * prof.power_factor * one / (one + prof.gemm_half(op.dtype) * 1e9)
        seconds = max(seconds, op.flops / rate)
    elif op.kind == "attention" and op.flops > 0:
        frac = prof.attention_fraction_forward if op.phase == "F" else prof.attention_fraction_backward
        rate = gpu.peak_flops(cfg.training.precision) * frac * prof.power_factor
        seconds = max(seconds, op.flops / rate)
    return seconds + op.kernels * prof.launch(op.phase, recompute) * 1e-6


@dataclass(frozen=True)
class _Linear:
    """One matmul of a block on one TP rank: ``tokens`` rows times a ``d_in × d_out`` weight. ``groups``
    > 1: a grouped GEMM over that many local experts (one kernel; its rate is one group's size's).
    ``float8``: ``training.float8`` converts it (the blocks' nn.Linears, backend/parallel/float8.py; not
    the experts' grouped weights, not the router)."""

    name: str
    d_in: int
    d_out: int
    tokens: int
    groups: int = 1
    float8: bool = True


def _tokens(cfg: Config) -> int:
    return cfg.training.micro_batch_size * cfg.local_seq_len


def _attention_linears(cfg: Config) -> list[_Linear]:
    """The attention's projections on one TP rank (engine.model.params.attention_tensors' layout): q, k,
    v (column-parallel) and o (row-parallel); MLA's query and key-value latents (replicated) and their
    head-wise up-projections (split), its o."""
    m, tp = cfg.model, cfg.parallel.tp
    T, h = _tokens(cfg), m.hidden
    if m.attention != "mla":
        q, kv = m.heads * m.head_dim // tp, m.kv_dim // tp
        return [_Linear("wq", h, q, T), _Linear("wk", h, kv, T), _Linear("wv", h, kv, T), _Linear("wo", q, h, T)]
    a, qk = m.heads // tp, m.qk_nope_head_dim + m.qk_rope_head_dim
    lin = ([_Linear("wq_a", h, m.q_lora_rank, T), _Linear("wq_b", m.q_lora_rank, a * qk, T)] if m.q_lora_rank
           else [_Linear("wq", h, a * qk, T)])
    return lin + [_Linear("wkv_a", h, m.kv_lora_rank + m.qk_rope_head_dim, T),
                  _Linear("wkv_b", m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim), T),
                  _Linear("wo", a * m.v_head_dim, h, T)]


def _moe_tokens(cfg: Config) -> tuple[int, int]:
    """(tokens one MoE block routes on this rank per microbatch, routed copies its experts compute): under
    expert parallelism each TP rank dispatches its 1/t of the tokens (engine.model.routing.moe_tokens),
    the copies n·k × ``routed_factor`` (the busiest EP rank's, which the grouped GEMMs wait for)."""
    m, par = cfg.model, cfg.parallel
    n = _tokens(cfg) // (par.tp if par.ep > 1 else 1)
    return n, int(-(-n * m.experts_per_token * routed_factor(cfg) // 1))


def _mlp_linears(cfg: Config, experts: bool) -> list[_Linear]:
    """The MLP's matmuls on one TP rank: the dense MLP (gate, up column-parallel; down row-parallel); or
    the router (replicated), the local experts' grouped GEMMs (E / ep experts; f split by TP only
    without expert parallelism) over the routed copies, and the shared experts as a dense MLP."""
    m, par = cfg.model, cfg.parallel
    T, h = _tokens(cfg), m.hidden

    def mlp(prefix: str, width: int, tokens: int, groups: int = 1, float8: bool = True) -> list[_Linear]:
        names = ("w1", "w3", "w2") if m.mlp == "swiglu" else ("w1", "w2")
        return ([_Linear(prefix + n, h, width, tokens, groups, float8) for n in names[:-1]]
                + [_Linear(prefix + names[-1], width, h, tokens, groups, float8)])

    if not experts:
        return mlp("", m.ffn_hidden // par.tp, T)
    n, routed = _moe_tokens(cfg)
    lin = [_Linear("router", h, m.experts, n, float8=False)]
    lin += mlp("experts.", m.expert_hidden // (1 if par.ep > 1 else par.tp), routed, m.experts // par.ep, False)
    if m.shared_experts:
        lin += mlp("shared.", m.shared_experts * m.expert_hidden // par.tp, T)
    return lin


def _adapters(cfg: Config) -> list[_Linear]:
    """LoRA's matmuls on one TP rank (engine.model.lora: A ``d_in → r``, B ``r → d_out``; on a
    column-parallel Linear A is replicated and B split, on a row-parallel one A split and B replicated)."""
    tr = cfg.training
    if tr.finetune != "lora":
        return []
    T, tp, r = _tokens(cfg), cfg.parallel.tp, tr.lora_rank
    out = []
    for lin in adapted_linears(cfg.model, tr.lora_targets):
        d_in, d_out = (lin.d_in, lin.d_out // tp) if lin.column_parallel else (lin.d_in // tp, lin.d_out)
        out += [_Linear(lin.name + ".lora_A", d_in, r, T, float8=False),
                _Linear(lin.name + ".lora_B", r, d_out, T, float8=False)]
    return out


def _gemm(lin: _Linear, phase: str, dtype: str, act: int) -> Op:
    """One matmul in ``phase``: 2·T·d_in·d_out FLOPs; its operands' bytes (float8: 1-byte inputs, the
    output in the activation dtype; a grouped GEMM reads each expert's weight)."""
    operand = 1 if dtype.startswith("fp8") else act
    tokens, d_in, d_out, weight = lin.tokens, lin.d_in, lin.d_out, lin.groups * lin.d_in * lin.d_out
    if phase == "F":  # x (T × d_in) · Wᵀ -> y (T × d_out)
        nbytes = operand * (tokens * d_in + weight) + act * tokens * d_out
    elif phase == "I":  # dy (T × d_out) · W -> dx (T × d_in)
        nbytes = operand * (tokens * d_out + weight) + act * tokens * d_in
    else:  # dyᵀ · x -> dW (d_out × d_in)
        nbytes = operand * tokens * (d_in + d_out) + act * weight
    return Op(f"{lin.name}.{phase}", phase, "gemm", 2.0 * tokens * d_in * d_out, nbytes, 1, dtype, groups=lin.groups)


def _rowwise_post_scale(lin: list[_Linear], phase: str, act: int, compiled: bool) -> Op:
    """The rowwise recipe's scaling of its gradient GEMMs' outputs (``phase`` "I": dx, T × d_in; "W": dW, d_out × d_in),
    as torchao's ``addmm_float8_unwrapped`` runs it where ``use_fast_accum`` is off (the rowwise recipe's grad_input
    and grad_weight GEMMs, ``Float8LinearConfig.from_recipe_name("rowwise")``): "the rowwise CUTLASS-based kernel is so
    slow without fast-accum that we'd rather use the tensorwise cuBLAS-based kernel and do the scaling manually
    afterwards" — ``post_inverse_scale = a_inverse_scale * b_inverse_scale`` (an fp32 M × N outer product: 4 B an
    element written) and ``output *= post_inverse_scale`` (the output read and written, the scale read): 2 kernels a
    GEMM, (8 + 2·act) B an output element; under torch.compile one fused kernel reading and writing the output (2·act
    B)."""
    elems = sum((x.tokens * x.d_in) if phase == "I" else (x.groups * x.d_out * x.d_in) for x in lin)
    per, kernels = (2 * act, 1) if compiled else (8 + 2 * act, 2)
    return Op(f"float8 rowwise post-scale ({phase})", phase, "memory", 0.0, per * elems, kernels * len(lin))


def rms_norm_op(name: str, elems: int, act: int, cfg: Config) -> Op:
    """One eager RMSNorm's forward over ``elems`` elements of an ``act``-byte activation
    (``conventions.rms_norm``). Fused: one kernel reading and writing its tensor, 2·act bytes an element.
    fp32-composite (torchtitan/models/norms.py's RMSNorm before March 2025, torchtitan#985: ``self._norm(x.float()).type_as(x)
    * self.weight``, ``_norm`` = ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``): x.float()
    (act + 4 bytes an element; no kernel in fp32), pow (8), mean (4), + eps and rsqrt (one value a row), the
    product (8), type_as (4 + act; none in fp32), × weight (2·act): 36 bytes an element and 8 kernels in bf16,
    28 and 6 in fp32. On CPU ranks torch has no fused kernel: ``nn.RMSNorm`` runs ``pow, mean, add_, rsqrt, mul,
    mul`` (and a cast either side in bf16: a TorchDispatchMode trace of torch 2.13 on CPU), the composite count
    whatever the convention. A LayerNorm (``model.norm``) is one kernel either way."""
    composite = cfg.conventions.rms_norm != "fused" or cfg.cluster.gpu.name == "cpu"
    if not composite or cfg.model.norm != "rmsnorm":
        return Op(name, "F", "memory", 0.0, 2 * elems * act, 1)
    casts = 2 * (act + 4) if act < 4 else 0
    return Op(name, "F", "memory", 0.0, elems * (20 + 2 * act + casts), 8 if act < 4 else 6)


def _forward_memory_ops(cfg: Config, experts: bool, lin: list[_Linear]) -> list[Op]:
    """The memory-bound ops of one block's forward (module docstring), eager or compiled; ``lin``: the
    block's matmuls (its MLPs' activations, LoRA's adds and float8's casts follow them)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    T = _tokens(cfg)
    Ts = T // par.tp if par.sequence_parallel else T
    a = 4 if tr.precision == "fp32" else 2
    h, q, kv = m.hidden, m.heads * m.head_dim // par.tp, m.kv_dim // par.tp
    c = bool(tr.compile)
    ops = []
    if c:
        ops.append(Op("residual add + norm ×2", "F", "memory", 0.0, 2 * 4 * Ts * h * a, 2))
    else:
        norm = rms_norm_op("RMSNorm", Ts * h, a, cfg)
        ops.append(Op("RMSNorm ×2", "F", "memory", 0.0, 2 * norm.bytes, 2 * norm.kernels))
        ops.append(Op("residual add ×2", "F", "memory", 0.0, 2 * 3 * Ts * h * a, 2))
    if m.attention == "mla":  # the query and key-value latents' norms
        latents = 2 if m.q_lora_rank else 1
        elems = T * (m.kv_lora_rank + m.q_lora_rank)
        norm = rms_norm_op("latent RMSNorm", elems, a, cfg)
        ops.append(Op("latent RMSNorm", "F", "memory", 0.0, 2 * elems * a if c else norm.bytes,
                      latents * (1 if c else norm.kernels)))
    if m.position == "rope":  # backend/model.py's rope: 4 products, a difference, a sum, a cat (and its cos, sin)
        rotated = T * ((m.heads // par.tp + 1) * m.qk_rope_head_dim if m.attention == "mla" else q + kv)
        ops.append(Op("RoPE (q, k)", "F", "memory", 0.0, (2 if c else 9) * a * rotated, 1 if c else 2 * 14))
    if m.qk_norm:
        ops.append(Op("qk_norm", "F", "memory", 0.0, (2 if c else 6) * T * (q + kv) * a, 1 if c else 3))
    for up in (x for x in lin if x.name.endswith("w1")):  # each MLP's activation over its up projection's output
        prefix, n = up.name[:-2], up.tokens * up.d_out
        if m.mlp == "swiglu":
            ops.append(Op(prefix + "silu · mul", "F", "memory", 0.0, (3 if c else 5) * n * a, 1 if c else 2))
        else:
            ops.append(Op(prefix + "gelu", "F", "memory", 0.0, 2 * n * a, 1))
    if experts:
        n, routed = _moe_tokens(cfg)
        ops.append(Op("router scores, top-k", "F", "memory", 0.0, n * m.experts * (a + 8), 3, exp_bound=True))
        ops.append(Op("dispatch, combine", "F", "memory", 0.0, (5 * routed + 2 * n) * h * a, 4))
    lora = [x for x in lin if x.name.endswith(".lora_B")]
    if lora:  # the base output plus scale · B A x
        ops.append(Op("LoRA scale, add", "F", "memory", 0.0, sum(5 * x.tokens * x.d_out * a for x in lora), 2 * len(lora)))
    if tr.float8 != "none":
        f8 = [(x.d_in, x.d_out) for x in lin if x.float8]
        ops.append(Op("float8 casts", "F", "memory", 0.0, float8_cast_bytes(cfg, f8)[0], 2 * len(f8) * (1 if c else 2)))
    ops += autocast_casts(cfg, lin)["F"]
    return ops


#: the Linears that read the fp32 residual stream's norm output (autocast casts it for each of them)
_STREAM_READERS = ("wq", "wk", "wv", "wq_a", "wkv_a", "w1", "w3")


def autocast_casts(cfg: Config, lin: list[_Linear]) -> dict[str, list[Op]]:
    """Under ``torch.autocast`` (bf16-mixed without FSDP2's policy: DDP, ZeRO-1/2; engine.wrapping) a block's
    Linears keep fp32 weights and read the fp32 residual stream, so each forward casts every weight to bf16 (once:
    autocast caches a leaf's cast for the forward) and the norm output once for each Linear that reads it; the
    backward casts each of those inputs' gradients back to fp32, the stream's gradient to bf16 where it enters
    the o and down projections, and each weight's gradient to fp32 (W). A cast reads 4 and writes 2 bytes an
    element, or the reverse. Counted from a TorchDispatchMode trace of backend/model.py's block on torch 2.13:
    16 ``_to_copy`` forward (7 weights, 5 inputs, RoPE's 4 small cos/sin casts, left out), 14 backward."""
    if not wrapping_plan(cfg).autocast:
        return {"F": [], "I": [], "W": []}
    dense = [x for x in lin if x.name != "router"]  # the router computes in fp32 with autocast off
    readers = [x for x in dense if x.name.split(".")[-1] in _STREAM_READERS]
    weights = sum(x.groups * x.d_in * x.d_out for x in dense)
    inputs = sum(x.tokens * x.d_in for x in readers)
    stream = 2 * _tokens(cfg) * cfg.model.hidden  # into wo's and w2's bf16 backward
    return {"F": [Op("autocast casts", "F", "memory", 0.0, 6 * (weights + inputs), len(dense) + len(readers))],
            "I": [Op("autocast casts backward", "I", "memory", 0.0, 6 * (inputs + stream), len(readers) + 2)],
            "W": [Op("autocast weight-gradient casts", "W", "memory", 0.0, 6 * weights, len(dense))]}


def _executed_share(cfg: Config) -> float:
    """The share of the full square a causal flash kernel executes, averaged over the blocks: 1/2 under
    full attention; a sliding window of w < s keys (query i meets min(i + 1, w) of them): (w − w²/2s) / s."""
    m = cfg.model
    s, w = m.seq_len, m.sliding_window
    if not w or w >= s:
        return 0.5
    full = m.layers // m.full_attention_every if m.full_attention_every else 0
    return (full * 0.5 + (m.layers - full) * (w - w * w / (2 * s)) / s) / m.layers


def _attention_ops(cfg: Config) -> tuple[list[Op], list[Op]]:
    """The attention core's ops of one block (forward, backward for inputs). ``flash`` (and MLA): one SDPA
    kernel over the FLOPs it executes (QKᵀ at the query-key width, AV at the value width; causal: half the
    full square; a sliding window its window, :func:`_executed_share`), its backward 2.5 × that.
    ``eager`` (backend/model.py's AttentionCore): K and V repeated for GQA, the scores' batched GEMM (the
    full square: the mask is applied after), the scale, the mask, the softmax, the weighted sum's batched
    GEMM, the heads' reshape copy; the backward's GEMMs twice the forward's and its elementwise ops twice
    their bytes and kernels."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    T = _tokens(cfg)
    a = 4 if tr.precision == "fp32" else 2
    heads = m.heads // par.tp
    mla = m.attention == "mla"
    d_qk, d_v = m.head_dim, (m.v_head_dim if mla else m.head_dim)
    q, kv = heads * d_qk, (heads * d_qk if mla else m.kv_dim // par.tp)
    o = heads * d_v
    qk_full = 2.0 * T * m.seq_len * heads * d_qk  # every local query against every key
    av_full = 2.0 * T * m.seq_len * heads * d_v
    if m.attention != "eager":
        nbytes = T * (q + kv + kv * d_v // d_qk + o) * a
        executed = _executed_share(cfg) * (qk_full + av_full)
        return ([Op("attention", "F", "attention", executed, nbytes, 1)],
                [Op("attention backward", "I", "attention", 2.5 * executed, 2 * nbytes, 1)])
    dtype = "fp32" if tr.precision == "fp32" else "bf16"
    scores = T * m.seq_len * heads * a
    fwd = []
    if m.heads != m.kv_heads:
        fwd.append(Op("repeat K, V (GQA)", "F", "memory", 0.0, 2 * T * (kv + q) * a, 2))
    fwd += [Op("scores Q·Kᵀ", "F", "gemm", qk_full, T * 2 * q * a + scores, 1, dtype),
            Op("scale, mask", "F", "memory", 0.0, 2 * 2 * scores, 3),
            Op("softmax", "F", "memory", 0.0, 2 * scores, 2, exp_bound=True),
            Op("probs · V", "F", "gemm", av_full, scores + 2 * T * o * a, 1, dtype),
            Op("heads reshape", "F", "memory", 0.0, 2 * T * o * a, 1)]
    back = [Op(o.name + " backward", "I", o.kind, 2 * o.flops, 2 * o.bytes, 2 * o.kernels, o.dtype, o.exp_bound)
            for o in fwd]
    return fwd, back


def _block_parts(cfg: Config, experts: bool, casts: bool = True) -> tuple[list[Op], list[Op], list[Op], list[Op], list[Op]]:
    """:func:`block_ops`' F, I and W, and the forward's attention and memory-bound ops (what recompute repeats);
    ``casts=False``: without autocast's casts (the planner's bound, which does not tell the ZeRO stages apart)."""
    tr = cfg.training
    a = 4 if tr.precision == "fp32" else 2
    base = "fp32" if tr.precision == "fp32" else "bf16"
    fp8 = f"fp8_{tr.float8}" if tr.float8 != "none" else base
    lin = _attention_linears(cfg) + _mlp_linears(cfg, experts) + _adapters(cfg)
    fwd = [_gemm(x, "F", fp8 if x.float8 else base, a) for x in lin]
    mem = _forward_memory_ops(cfg, experts, lin)
    if not casts:
        mem = [op for op in mem if op.name != "autocast casts"]
    attention, attention_back = _attention_ops(cfg)
    fwd += attention + mem
    # torchao runs a rowwise recipe's gradient GEMMs (use_fast_accum off) on the tensorwise kernel with unit scales, then
    # multiplies the output by the outer product of the two scale vectors (:func:`_rowwise_post_scale`)
    grad8 = "fp8_tensorwise" if tr.float8 == "rowwise" else fp8
    bwd_in = [_gemm(x, "I", grad8 if x.float8 else base, a) for x in lin] + attention_back
    if tr.float8 == "rowwise":
        bwd_in.append(_rowwise_post_scale([x for x in lin if x.float8], "I", a, tr.compile))
    for op in mem:
        if op.name == "autocast casts":
            continue  # its backward is its own (autocast_casts)
        if op.name == "float8 casts":
            f8 = [(x.d_in, x.d_out) for x in lin if x.float8]
            again = 2 if tr.float8 == "rowwise" else 1
            n_casts = len(f8) * (2 * again)  # output gradients (and, rowwise, inputs along the other axis) and weights
            bwd_in.append(Op("float8 casts backward", "I", "memory", 0.0, float8_cast_bytes(cfg, f8)[1],
                             n_casts * (1 if tr.compile else 2)))
        else:
            bwd_in.append(Op(op.name + " backward", "I", "memory", 0.0, 2 * op.bytes, 2 * op.kernels, exp_bound=op.exp_bound))
    trained = [x for x in lin if ".lora_" in x.name] if tr.finetune == "lora" else lin
    bwd_w = [_gemm(x, "W", grad8 if x.float8 else base, a) for x in trained]
    if tr.float8 == "rowwise" and any(x.float8 for x in trained):
        bwd_w.append(_rowwise_post_scale([x for x in trained if x.float8], "W", a, tr.compile))
    sharded = tp_sharded_linears(cfg, lin)
    if sharded:  # DTensor's costs per sharded Linear (DeviceProfile.tp_linear): a recompute's forward runs them again
        fwd.append(Op("TP DTensor dispatch", "F", "dtensor", 0.0, 0.0, sharded))
        bwd_in.append(Op("TP DTensor dispatch backward", "I", "dtensor", 0.0, 0.0, sharded))
    if casts and wrapping_plan(cfg).autocast:
        bwd_in += autocast_casts(cfg, lin)["I"]
        bwd_w += autocast_casts(cfg, trained)["W"]  # LoRA: the adapters' weight gradients only
    return fwd, bwd_in, bwd_w, attention, mem


def tp_sharded_linears(cfg: Config, lin: list[_Linear] | None = None) -> int:
    """How many of a block's Linears tensor parallelism shards as DTensors (backend.parallel.tensor_parallel: the
    attention's and the dense or shared MLP's; not the router, the routed experts or LoRA's adapters); 0 without TP."""
    if cfg.parallel.tp == 1:
        return 0
    lin = _attention_linears(cfg) + _mlp_linears(cfg, False) if lin is None else lin
    return sum(1 for x in lin if x.name != "router" and not x.name.startswith("experts.") and ".lora_" not in x.name)


def _redo(cfg: Config, fwd: list[Op], attention: list[Op], mem: list[Op], recompute: str) -> list[Op]:
    """The forward ops ``recompute`` runs again in every block (:func:`block_ops`)."""
    if recompute == "full":
        return list(fwd)
    if recompute == "selective":
        return list(attention)
    if recompute == "selective-op":
        share = per_op_recompute_flops_per_token(cfg) / flops_per_token(cfg).matmuls
        return [Op(g.name + " (recomputed share)", "F", "gemm", g.flops * share, g.bytes * share, 1, g.dtype,
                   groups=g.groups) for g in fwd if g.kind == "gemm"] + mem
    return []


def block_ops(cfg: Config, experts: bool = False) -> dict[str, list[Op]]:
    """The ops of one block (``experts``: a block with experts) for one microbatch on one rank: ``{"F": ...,
    "I": ..., "W": ..., "R": ...}`` — R the forward ops a recomputing backward runs again in every block
    (full: the whole forward; selective: the attention; selective-op: the unsaved matmuls' share of the
    GEMMs and every memory-bound op; none and selective-layer: nothing in every block — the
    checkpointed blocks of selective-layer rerun the whole forward, :func:`op_durations`). Under LoRA the
    frozen base computes its input gradients but no weight gradient: W is the adapters'."""
    fwd, bwd_in, bwd_w, attention, mem = _block_parts(cfg, experts)
    return {"F": fwd, "I": bwd_in, "W": bwd_w, "R": _redo(cfg, fwd, attention, mem, cfg.training.recompute)}


def head_ops(cfg: Config) -> dict[str, list[Op]]:
    """The last stage's final norm, head GEMMs (bf16, or fp32 under fp32) and loss for one microbatch."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    T = _tokens(cfg)
    Ts = T // par.tp if par.sequence_parallel else T
    a = 4 if tr.precision == "fp32" else 2
    v = m.vocab // par.tp  # loss_parallel / the head's column shard
    dtype = "fp32" if tr.precision == "fp32" else "bf16"
    norm = rms_norm_op("final RMSNorm", Ts * m.hidden, a, cfg)  # outside the compiled blocks: eager
    loss = Op("loss (fp32 logits, log-softmax)", "F", "memory", 0.0, (a + 4 + 8) * T * v, 3, exp_bound=True)
    out = _Linear("output", m.hidden, v, T)
    return {"F": [norm, _gemm(out, "F", dtype, a), loss],
            "I": [Op("loss backward", "I", "memory", 0.0, (8 + 4 + a) * T * v, 3, exp_bound=True),
                  _gemm(out, "I", dtype, a),
                  Op("final RMSNorm backward", "I", "memory", 0.0, 2 * norm.bytes, 2 * norm.kernels)],
            "W": [] if tr.finetune == "lora" else [_gemm(out, "W", dtype, a)]}  # LoRA: the head is frozen


def embedding_ops(cfg: Config) -> dict[str, list[Op]]:
    """The first stage's embedding gather for one microbatch (its backward's scatter-add, in W)."""
    tr, m = cfg.training, cfg.model
    T = _tokens(cfg)
    a = 4 if tr.precision == "fp32" else 2
    return {"F": [Op("embedding gather", "F", "memory", 0.0, 2 * T * m.hidden * a, 1)], "I": [],
            "W": [] if tr.finetune == "lora" else  # LoRA: the embedding is frozen
            [Op("embedding backward (scatter-add)", "W", "memory", 0.0, T * m.hidden * (a + 4), 2)]}


def _seconds(ops: list[Op], cfg: Config, prof: DeviceProfile, recompute: str = "none") -> float:
    """A stage's ``ops`` (a block's, the head's, the embedding's) as a chain of blocks runs them: each op's time
    (:func:`op_seconds`) times the profile's in-context figure for its phase (:meth:`DeviceProfile.context`)."""
    p = cfg.training.precision
    return float(sum(op_seconds(op, cfg, prof, recompute) * _context(op, prof, p) for op in ops))


def _context(op: Op, prof: DeviceProfile, precision: str) -> float:
    """The in-context multiple of ``op`` (:meth:`DeviceProfile.context`); 1 for a float8 GEMM, which the probe does not
    run (on a CPU torch's float8 kernels take milliseconds to seconds a call, where what interleaving costs an op is
    microseconds: the tensorwise kernel of a float8 row ran as measured alone, 71.5 s predicted a step against 67.9)."""
    return 1.0 if op.kind == "gemm" and op.dtype.startswith("fp8") else prof.context(op.phase, precision)


def unit_seconds(cfg: Config, experts: bool = False, recomputes: tuple[str, ...] | None = None,
                 profile: DeviceProfile | None = None, casts: bool = True) -> dict[str, tuple[float, ...]]:
    """For each recompute kind of ``recomputes`` (default: the config's own), from one op list, the seconds of
    one microbatch's: a block's F, its I with the recompute every block runs (R), its W; the head's F, I and
    W; the embedding's F and W — the terms :func:`op_durations` adds per stage (the planner's time bound
    reads every kind at once)."""
    prof = profile or device_profile(cfg.cluster.gpu.name)
    fwd, bwd_in, bwd_w, attention, mem = _block_parts(cfg, experts, casts)
    head, emb = head_ops(cfg), embedding_ops(cfg)
    edges = (*(_seconds(head[k], cfg, prof) for k in ("F", "I", "W")), _seconds(emb["F"], cfg, prof),
             _seconds(emb["W"], cfg, prof))
    out, timed = {}, {}
    for kind in (recomputes or (cfg.training.recompute,)):
        # the block's ops at the kernel costs of the kind's wrapper: one timing per distinct pair of costs
        costs = (prof.launch("F", kind), prof.launch("I", kind))
        if costs not in timed:
            timed[costs] = tuple(_seconds(x, cfg, prof, kind) for x in (fwd, bwd_in, bwd_w))
        f1, i1, w1 = timed[costs]
        out[kind] = (f1, i1 + _seconds(_redo(cfg, fwd, attention, mem, kind), cfg, prof, kind), w1, *edges)
    return out


def op_durations(cfg: Config) -> StageDurations:
    """Per-stage F, I, W (B = I + W) seconds for one microbatch from the ops (module docstring): each stage's
    dense blocks and blocks with experts, its head or embedding; p2p as engine.time.durations times it.
    Kept per config and device profile (a drag back and forth over a slider finds its positions here; a new
    ``calibrate --device`` is a new profile); its arrays are read-only."""
    return _op_durations(cfg, device_profile(cfg.cluster.gpu.name))


@functools.lru_cache(maxsize=256)
def _op_durations(cfg: Config, profile: DeviceProfile) -> StageDurations:
    par = cfg.parallel
    n = 1 if par.pp == 1 else par.num_stages
    f, i, w = np.zeros(n), np.zeros(n), np.zeros(n)
    extra = np.zeros((3, n))  # selective-layer: a checkpointed block's F, I (its forward again) and W beyond a plain one's
    counts = stage_block_counts(cfg, n)  # (dense blocks, blocks with experts) of each stage
    kinds = ("selective-layer", "full") if cfg.training.recompute == "selective-layer" else (cfg.training.recompute,)
    for count, experts in zip(counts, (False, True)):
        if not count.any():
            continue
        units = unit_seconds(cfg, experts, recomputes=kinds, profile=profile)
        f1, ir1, w1, hf, hi, hw, ef, ew = units[kinds[0]]
        f += count * f1
        i += count * ir1
        w += count * w1
        if len(kinds) > 1:  # checkpoint_wrapper's blocks: the whole forward again, every kernel at full's costs
            extra += count * (np.array(units["full"][:3]) - (f1, ir1, w1))[:, None]
    if len(kinds) > 1:  # the checkpointed blocks, at the stage's mean block
        share = np.array(checkpointed_blocks(cfg), dtype=np.float64) / np.maximum(sum(counts), 1)
        f, i, w = f + share * extra[0], i + share * extra[1], w + share * extra[2]
    f[-1], i[-1], w[-1] = f[-1] + hf, i[-1] + hi, w[-1] + hw
    f[0], w[0] = f[0] + ef, w[0] + ew
    unit_f, unit_b = fsdp_unit_seconds(cfg, profile)
    if unit_f or unit_b:  # each stage's blocks, its root, and under EP each MoE block's experts
        units = sum(counts) + 1 + (counts[1] if par.ep > 1 else 0)
        f, i = f + units * unit_f, i + units * unit_b
    out = StageDurations.of(n, f, i + w, i, w, p2p_seconds(cfg, n), source="model")
    for arr in (out.forward_s, out.backward_s, out.backward_input_s, out.backward_weight_s, out.p2p_s):
        arr.setflags(write=False)
    return out


def fsdp_unit_seconds(cfg: Config, profile: DeviceProfile) -> tuple[float, float]:
    """(forward, backward) seconds an FSDP2 unit costs a microbatch beyond its collectives (the profile's
    ``fsdp_unit_us``: ``fully_shard``'s forward, which gathers; ``fsdp_unit_kept_us``: ``replicate``'s, which does not;
    ``fsdp_unit_backward_us``); 0 without an FSDP2 wrapper."""
    plan = wrapping_plan(cfg)
    if not plan.fsdp2:
        return 0.0, 0.0
    forward = profile.fsdp_unit_kept_us if plan.data_parallel == "replicate" else profile.fsdp_unit_us
    return forward * 1e-6, profile.fsdp_unit_backward_us * 1e-6


def op_table(cfg: Config) -> list[tuple[str, str, str, float, float, int, float]]:
    """Every op of one block of each kind the model has (then the head's and the embedding's) for one
    microbatch: (where, phase, name, GFLOP, MB, kernels, µs) — what ``clock = "ops"`` adds up, for a reader."""
    prof = device_profile(cfg.cluster.gpu.name)
    m = cfg.model
    tables = ([("block", block_ops(cfg))] if m.moe_layers < m.layers else []) \
        + ([("MoE block", block_ops(cfg, experts=True))] if m.moe_layers else []) \
        + [("head", head_ops(cfg)), ("embedding", embedding_ops(cfg))]
    rows = []
    for where, table in tables:
        wrapper = cfg.training.recompute if "block" in where else "none"
        for phase, ops in table.items():
            for op in ops:
                rows.append((where, phase, op.name, op.flops / 1e9, op.bytes / 1e6, op.kernels,
                             op_seconds(op, cfg, prof, wrapper) * _context(op, prof, cfg.training.precision) * 1e6))
    return rows
