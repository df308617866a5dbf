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
  fp32, :func:`rms_norm_op`), each residual add 1 (3·T'·h·a), RoPE on q and k 14 kernels each
  (backend/model.py's ``rope``: its angles' cos and sin, four products, a difference, a sum and a cat:
  9·a bytes an element),
  SwiGLU's silu and product 2 (5·T·f·a), float8's casts (``engine.time.durations.float8_cast_bytes``;
  2 kernels a cast: amax, then scale). Under torch.compile the chains fuse: each residual add with the
  norm after it 1 kernel (4·T'·h·a), RoPE 1 kernel (2a), silu·mul 1 (3·T·f·a), a cast 1 (amax fused).
* backward for inputs (I): each Linear's input-gradient GEMM, the attention's backward (2.5 × its
  forward FLOPs), each memory-bound op's backward at twice its forward's bytes and kernels, the
  float8 casts of the output gradients; and the recomputed forward (``training.recompute``): the
  whole forward (full; the checkpointed blocks under selective-layer), the attention (selective),
  the matmuls torchtitan's per-op policy does not save and every elementwise op (selective-op).
* backward for weights (W): each Linear's weight-gradient GEMM.
* the last stage adds the final norm, the head's GEMMs (bf16: float8 leaves the head alone) and the
  loss (the logits cast to fp32, log-softmax; the backward's softmax gradient and cast back); the
  first stage the embedding's gather.

What this slice leaves out (the efficiency clock's terms stand there): MoE, MLA, sliding-window and
LoRA blocks (validation refuses ``clock = "ops"`` for them); the async-TP and context-parallel
overlap windows (``engine.time.step`` reads them off the efficiency clock); the optimizer step
(memory-bound already, ``engine.time.step.optimizer_seconds``); gradient accumulation adds.
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
from engine.model.recompute import checkpointed_blocks
from engine.pipeline.layout import split_layers
from engine.time.durations import (
    StageDurations,
    float8_cast_bytes,
    flops_per_token,
    p2p_seconds,
    per_op_recompute_flops_per_token,
)

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

    def gemm_fraction(self, dtype: str) -> float:
        return getattr(self, f"gemm_fraction_{dtype}")


#: profile fields a table may leave out (their defaults: a GPU's)
OPTIONAL_FIELDS = ("softmax_fraction",)


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
    kind: str  # "gemm", "attention" or "memory"
    flops: float
    bytes: float
    kernels: int = 1
    dtype: str = "bf16"  # a GEMM's: one of GEMM_DTYPES
    exp_bound: bool = False  # a memory-bound kernel of exponentials (softmax, log-softmax): ``softmax_fraction``


def op_seconds(op: Op, cfg: Config, prof: DeviceProfile) -> float:
    """The roofline time of one op on ``cfg``'s GPU kind (module docstring)."""
    gpu = cfg.cluster.gpu
    seconds = op.bytes / (gpu.hbm_bandwidth_gb_per_s * 1e9 * prof.hbm_fraction
                          * (prof.softmax_fraction if op.exp_bound else 1.0))
    if op.kind == "gemm" and op.flops > 0:
        peak = {"bf16": gpu.peak_bf16_tflops, "fp32": gpu.peak_fp32_tflops}.get(op.dtype, gpu.peak_fp8_tflops)
        one = op.flops / op.kernels
        rate = peak * 1e12 * prof.gemm_fraction(op.dtype) * prof.power_factor * one / (one + prof.gemm_half_gflop * 1e9)
        seconds = max(seconds, op.flops / rate)
    elif op.kind == "attention" and op.flops > 0:
        frac = prof.attention_fraction_forward if op.phase == "F" else prof.attention_fraction_backward
        rate = gpu.peak_flops(cfg.training.precision) * frac * prof.power_factor
        seconds = max(seconds, op.flops / rate)
    launch = prof.launch_us if op.phase == "F" else prof.launch_backward_us
    return seconds + op.kernels * launch * 1e-6


def _linears(cfg: Config) -> list[tuple[str, int, int]]:
    """(name, d_in, d_out) of each block Linear on one TP rank."""
    m, tp = cfg.model, cfg.parallel.tp
    q, kv, f, h = m.heads * m.head_dim // tp, m.kv_dim // tp, m.ffn_hidden // tp, m.hidden
    ups = [("w1", h, f), ("w3", h, f)] if m.mlp == "swiglu" else [("w1", h, f)]
    return [("wq", h, q), ("wk", h, kv), ("wv", h, kv), ("wo", q, h)] + ups + [("w2", f, h)]


def _gemm(name: str, phase: str, tokens: int, d_in: int, d_out: int, dtype: str, act: int) -> Op:
    """One Linear's GEMM in ``phase``: 2·T·d_in·d_out FLOPs; its operands' bytes (float8: 1-byte
    inputs, the output in the activation dtype)."""
    operand = 1 if dtype.startswith("fp8") else act
    if phase == "F":  # x (T × d_in) · Wᵀ -> y (T × d_out)
        nbytes = operand * (tokens * d_in + d_in * d_out) + act * tokens * d_out
    elif phase == "I":  # dy (T × d_out) · W -> dx (T × d_in)
        nbytes = operand * (tokens * d_out + d_in * d_out) + act * tokens * d_in
    else:  # dyᵀ · x -> dW (d_out × d_in)
        nbytes = operand * tokens * (d_in + d_out) + act * d_in * d_out
    return Op(f"{name}.{phase}", phase, "gemm", 2.0 * tokens * d_in * d_out, nbytes, 1, dtype)


def rms_norm_op(name: str, elems: int, act: int, cfg: Config) -> Op:
    """One eager RMSNorm's forward over ``elems`` elements of an ``act``-byte activation
    (``conventions.rms_norm``). Fused: one kernel reading and writing its tensor, 2·act bytes an element.
    fp32-composite (torchtitan/models/norms.py's RMSNorm before March 2025, torchtitan#985: ``self._norm(x.float()).type_as(x)
    * self.weight``, ``_norm`` = ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``): x.float()
    (act + 4 bytes an element; no kernel in fp32), pow (8), mean (4), + eps and rsqrt (one value a row), the
    product (8), type_as (4 + act; none in fp32), × weight (2·act): 36 bytes an element and 8 kernels in bf16,
    28 and 6 in fp32. A LayerNorm (``model.norm``) is one kernel either way."""
    if cfg.conventions.rms_norm == "fused" or cfg.model.norm != "rmsnorm":
        return Op(name, "F", "memory", 0.0, 2 * elems * act, 1)
    casts = 2 * (act + 4) if act < 4 else 0
    return Op(name, "F", "memory", 0.0, elems * (20 + 2 * act + casts), 8 if act < 4 else 6)


def _forward_memory_ops(cfg: Config) -> list[Op]:
    """The memory-bound ops of one block's forward (module docstring), eager or compiled."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    T = tr.micro_batch_size * cfg.local_seq_len
    Ts = T // par.tp if par.sequence_parallel else T
    a = 4 if tr.precision == "fp32" else 2
    h, q, kv, f = m.hidden, m.heads * m.head_dim // par.tp, m.kv_dim // par.tp, m.ffn_hidden // par.tp
    c = bool(tr.compile)
    ops = []
    if c:
        ops.append(Op("residual add + norm ×2", "F", "memory", 0.0, 2 * 4 * Ts * h * a, 2))
    else:
        norm = rms_norm_op("RMSNorm", Ts * h, a, cfg)
        ops.append(Op("RMSNorm ×2", "F", "memory", 0.0, 2 * norm.bytes, 2 * norm.kernels))
        ops.append(Op("residual add ×2", "F", "memory", 0.0, 2 * 3 * Ts * h * a, 2))
    if m.position == "rope":  # backend/model.py's rope: 4 products, a difference, a sum, a cat (and its cos, sin)
        ops.append(Op("RoPE (q, k)", "F", "memory", 0.0, (2 if c else 9) * a * T * (q + kv), 1 if c else 2 * 14))
    if m.qk_norm:
        ops.append(Op("qk_norm", "F", "memory", 0.0, (2 if c else 6) * T * (q + kv) * a, 1 if c else 3))
    if m.mlp == "swiglu":
        ops.append(Op("silu · mul", "F", "memory", 0.0, (3 if c else 5) * T * f * a, 1 if c else 2))
    else:
        ops.append(Op("gelu", "F", "memory", 0.0, 2 * T * f * a, 1))
    if tr.float8 != "none":
        casts = 2 * len(_linears(cfg))  # each Linear's input and weight
        ops.append(Op("float8 casts", "F", "memory", 0.0, float8_cast_bytes(cfg)[0], casts * (1 if c else 2)))
    return ops


def _attention_ops(cfg: Config) -> tuple[list[Op], list[Op]]:
    """The attention core's ops of one block (forward, backward for inputs). ``flash``: one SDPA kernel at
    its executed causal FLOPs (half the full square), its backward 2.5 × that. ``eager`` (backend/model.py's
    AttentionCore): K and V repeated for GQA, the scores' batched GEMM (the full square: the mask is
    applied after), the scale, the mask, the softmax, the weighted sum's batched GEMM, the heads'
    reshape copy; the backward's GEMMs twice the forward's and its elementwise ops twice their bytes and
    kernels."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    T = tr.micro_batch_size * cfg.local_seq_len
    a = 4 if tr.precision == "fp32" else 2
    q, kv = m.heads * m.head_dim // par.tp, m.kv_dim // par.tp
    full = T * flops_per_token(cfg).attention_core / par.tp  # QKᵀ and AV over the whole sequence
    if m.attention != "eager":
        nbytes = T * (2 * q + 2 * kv) * a
        return ([Op("attention", "F", "attention", full / 2, nbytes, 1)],
                [Op("attention backward", "I", "attention", 2.5 * full / 2, 2 * nbytes, 1)])
    dtype = "fp32" if tr.precision == "fp32" else "bf16"
    heads = m.heads // par.tp
    scores = T * m.seq_len * heads * a  # every local query against every key
    fwd = []
    if m.heads != m.kv_heads:
        fwd.append(Op("repeat K, V (GQA)", "F", "memory", 0.0, 2 * T * (kv + q) * a, 2))
    fwd += [Op("scores Q·Kᵀ", "F", "gemm", full / 2, T * 2 * q * a + scores, 1, dtype),
            Op("scale, mask", "F", "memory", 0.0, 2 * 2 * scores, 3),
            Op("softmax", "F", "memory", 0.0, 2 * scores, 2, exp_bound=True),
            Op("probs · V", "F", "gemm", full / 2, scores + 2 * T * q * a, 1, dtype),
            Op("heads reshape", "F", "memory", 0.0, 2 * T * q * a, 1)]
    back = [Op(o.name + " backward", "I", o.kind, 2 * o.flops, 2 * o.bytes, 2 * o.kernels, o.dtype, o.exp_bound)
            for o in fwd]
    return fwd, back


def block_ops(cfg: Config) -> dict[str, list[Op]]:
    """The ops of one dense block for one microbatch on one rank: ``{"F": ..., "I": ..., "W": ...,
    "R": ...}`` — R the forward ops a recomputing backward runs again in every block (full:
    the whole forward; selective: the attention; selective-op: the unsaved matmuls' share of the
    GEMMs and every memory-bound op; none and selective-layer: nothing in every block — the
    checkpointed blocks of selective-layer rerun the whole forward, :func:`op_durations`)."""
    tr = cfg.training
    T = tr.micro_batch_size * cfg.local_seq_len
    a = 4 if tr.precision == "fp32" else 2
    dtype = f"fp8_{tr.float8}" if tr.float8 != "none" else ("fp32" if tr.precision == "fp32" else "bf16")
    lin = _linears(cfg)
    fwd = [_gemm(n, "F", T, i, o, dtype, a) for n, i, o in lin]
    mem = _forward_memory_ops(cfg)
    attention, attention_back = _attention_ops(cfg)
    fwd += attention + mem
    bwd_in = [_gemm(n, "I", T, i, o, dtype, a) for n, i, o in lin] + attention_back
    for op in mem:
        if op.name == "float8 casts":
            c = bool(tr.compile)
            bwd = float8_cast_bytes(cfg)[1]
            again = 2 if tr.float8 == "rowwise" else 1
            casts = len(lin) * (2 * again)  # output gradients (and, rowwise, inputs along the other axis) and weights
            bwd_in.append(Op("float8 casts backward", "I", "memory", 0.0, bwd, casts * (1 if c else 2)))
        else:
            bwd_in.append(Op(op.name + " backward", "I", "memory", 0.0, 2 * op.bytes, 2 * op.kernels))
    bwd_w = [_gemm(n, "W", T, i, o, dtype, a) for n, i, o in lin]
    if tr.recompute == "full":
        redo = list(fwd)
    elif tr.recompute == "selective":
        redo = list(attention)
    elif tr.recompute == "selective-op":
        share = per_op_recompute_flops_per_token(cfg) / flops_per_token(cfg).matmuls
        redo = [Op(g.name + " (recomputed share)", "F", "gemm", g.flops * share, g.bytes * share, 1, g.dtype)
                for g in fwd if g.kind == "gemm"] + mem
    else:
        redo = []
    return {"F": fwd, "I": bwd_in, "W": bwd_w, "R": redo}


def head_ops(cfg: Config) -> dict[str, list[Op]]:
    """The last stage's final norm, head GEMMs (bf16, or fp32 under fp32) and loss for one microbatch."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    T = tr.micro_batch_size * cfg.local_seq_len
    Ts = T // par.tp if par.sequence_parallel else T
    a = 4 if tr.precision == "fp32" else 2
    v = m.vocab // par.tp  # loss_parallel / the head's column shard
    dtype = "fp32" if tr.precision == "fp32" else "bf16"
    norm = rms_norm_op("final RMSNorm", Ts * m.hidden, a, cfg)  # outside the compiled blocks: eager
    loss = Op("loss (fp32 logits, log-softmax)", "F", "memory", 0.0, (a + 4 + 8) * T * v, 3, exp_bound=True)
    return {"F": [norm, _gemm("output", "F", T, m.hidden, v, dtype, a), loss],
            "I": [Op("loss backward", "I", "memory", 0.0, (8 + 4 + a) * T * v, 3, exp_bound=True),
                  _gemm("output", "I", T, m.hidden, v, dtype, a),
                  Op("final RMSNorm backward", "I", "memory", 0.0, 2 * norm.bytes, 2 * norm.kernels)],
            "W": [_gemm("output", "W", T, m.hidden, v, dtype, a)]}


def embedding_ops(cfg: Config) -> dict[str, list[Op]]:
    """The first stage's embedding gather for one microbatch (its backward's scatter-add, in W)."""
    tr, m = cfg.training, cfg.model
    T = tr.micro_batch_size * cfg.local_seq_len
    a = 4 if tr.precision == "fp32" else 2
    return {"F": [Op("embedding gather", "F", "memory", 0.0, 2 * T * m.hidden * a, 1)], "I": [],
            "W": [Op("embedding backward (scatter-add)", "W", "memory", 0.0, T * m.hidden * (a + 4), 2)]}


def _seconds(ops: list[Op], cfg: Config, prof: DeviceProfile) -> float:
    return float(sum(op_seconds(op, cfg, prof) for op in ops))


def op_durations(cfg: Config) -> StageDurations:
    """Per-stage F, I, W (B = I + W) seconds for one microbatch from the ops (module docstring); p2p
    as engine.time.durations times it."""
    par = cfg.parallel
    n = 1 if par.pp == 1 else par.num_stages
    prof = device_profile(cfg.cluster.gpu.name)
    blk = block_ops(cfg)
    f1, i1, w1, r1 = (_seconds(blk[k], cfg, prof) for k in ("F", "I", "W", "R"))
    layers = np.array([len(r) for r in split_layers(cfg.model.layers, n, par.pipeline_split)], dtype=np.float64)
    f = layers * f1
    i = layers * (i1 + r1)
    w = layers * w1
    if cfg.training.recompute == "selective-layer":
        i = i + np.array(checkpointed_blocks(cfg), dtype=np.float64) * f1
    head, emb = head_ops(cfg), embedding_ops(cfg)
    for k, arr in (("F", f), ("I", i), ("W", w)):
        arr[-1] += _seconds(head[k], cfg, prof)
        arr[0] += _seconds(emb[k], cfg, prof)
    return StageDurations.of(n, f, i + w, i, w, p2p_seconds(cfg, n), source="model")


def op_table(cfg: Config) -> list[tuple[str, str, str, float, float, int, float]]:
    """Every op of one block (then the head's and the embedding's) for one microbatch: (where, phase,
    name, GFLOP, MB, kernels, µs) — what ``clock = "ops"`` adds up, for a reader."""
    prof = device_profile(cfg.cluster.gpu.name)
    rows = []
    for where, table in (("block", block_ops(cfg)), ("head", head_ops(cfg)), ("embedding", embedding_ops(cfg))):
        for phase, ops in table.items():
            for op in ops:
                rows.append((where, phase, op.name, op.flops / 1e9, op.bytes / 1e6, op.kernels,
                             op_seconds(op, cfg, prof) * 1e6))
    return rows
