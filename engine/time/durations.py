"""How long each pipeline stage takes: per-stage F, B (or I and W) seconds and p2p seconds.

Analytic durations come from the FLOPs of the layers a stage holds over the GPU's peak
FLOP/s for the precision times ``conventions.compute_efficiency``; the p2p time between two
consecutive stages from the activation bytes over the link between their ranks. Measured
durations (calibration) replace any of them: pass them to :func:`stage_durations` or build a
:class:`StageDurations` with :meth:`StageDurations.of`.

FLOP conventions (per token, per transformer block, forward, before dividing by tp):

* projections ``2·h·(h + 2·kv_dim) + 2·h·h`` (QKV and output), MLP ``2·h·ffn`` times 3
  (SwiGLU) or 2 (GELU), attention core ``4·s·h`` (QKᵀ and AV, full square: the Megatron /
  Narayanan MFU convention, also for causal masks); the head ``2·h·vocab`` on the last stage;
  embedding lookup, norms and biases are not counted.
* mixtures of experts, MLA, head_size, sliding windows (:func:`block_flops`): 2 × the weights a
  token multiplies (the router, its top-k experts, the shared experts; MLA's projections), the
  attention core ``2·s'·a·(d_qk + d_v)`` over the window; dense and MoE blocks counted per stage
  by layer. The stage durations charge the busiest EP rank's experts (× the routed factor of
  ``conventions.moe_imbalance`` / ``moe_capacity_factor``); MFU counts the balanced active FLOPs.
* backward for inputs (I) = forward of the matmuls + 2× the attention core; backward for
  weights (W) = forward of the matmuls; full backward B = I + W (≈ 2× forward).
* recompute: ``full`` adds the blocks' forward to B (and to I), ``selective`` adds the
  attention core's forward, ``selective-op`` (torchtitan's per-op policy) the forward of the
  matmuls its counter does not save (every second one: wk, wo, w3 of a SwiGLU block; the saved
  attention op and elementwise ops add no counted FLOPs), ``selective-layer`` the whole forward
  of the blocks it checkpoints (``engine.model.recompute.checkpointed_blocks``: every N-th block of each rank).

Context parallelism (``parallel.cp``): a rank computes its seq_len / cp tokens (``Config.local_seq_len``)
of every microbatch; the attention core per token stays ``4·s·h`` over the whole sequence s (each
query still meets every key; torch's head-tail load balancing gives every cp rank the same causal
share), so a rank's attention is 1/cp of the sequence's. The K, V exchange is engine.time.step's.

LoRA (``training.finetune = "lora"``, engine.model.lora): every adapted Linear adds its adapter's
matmuls, ``2·r·(d_in + d_out)`` FLOPs per token (x·Aᵀ, then ·Bᵀ) in the forward, as much again
for the adapter's input gradient (in I) and for its weight gradients (in W). The frozen base still
computes its input gradients (I unchanged: the gradient must reach the adapters below), but no
weight gradient: W is the adapters' weight gradients only — no base matmuls, no head. Under TP the
adapter FLOPs are each TP rank's local shard (column-parallel A is replicated, so every TP rank
computes it). Stated simplification: the first block skips the input gradients below its first
adapter (its input comes from the frozen embedding and needs none); I is not reduced for that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import Config
from engine.model.lora import adapter_block_tensors, target_modules
from engine.model.params import attention_tensors, mlp_tensors
from engine.model.recompute import block_linears_addmm, checkpointed_blocks, sac_saved_matmuls
from engine.model.routing import routed_factor
from engine.pipeline.layout import split_layers, stage_placement


@dataclass(frozen=True, eq=False)
class StageDurations:
    """Seconds per microbatch for each stage, and per stage boundary for p2p.

    ``forward_s[s]``, ``backward_s[s]`` (full backward), ``backward_input_s[s]`` and
    ``backward_weight_s[s]`` (the split used by zero-bubble schedules) are arrays of length
    ``num_stages``; ``p2p_s[s]`` is the transfer time from stage ``s`` to ``s + 1`` (activations
    forward, their gradients backward: same size), length ``num_stages - 1``. The simulator
    charges it only where the two stages sit on different ranks.
    """

    forward_s: np.ndarray
    backward_s: np.ndarray
    backward_input_s: np.ndarray
    backward_weight_s: np.ndarray
    p2p_s: np.ndarray
    source: str = "given"  # "model" (analytic) or "given" (calibrated / explicit)

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def of(
        cls,
        num_stages: int,
        forward_s: float | Sequence[float],
        backward_s: float | Sequence[float] | None = None,
        backward_input_s: float | Sequence[float] | None = None,
        backward_weight_s: float | Sequence[float] | None = None,
        p2p_s: float | Sequence[float] = 0.0,
        source: str = "given",
    ) -> StageDurations:
        """Explicit durations; scalars apply to every stage (or boundary).

        Give B, or I and W, or all three. With only B, I = W = B / 2; with only I and W,
        B = I + W. Without any backward, B = 2·F and I = W = F.
        """
        f = _vec(forward_s, num_stages, "forward_s")
        i = None if backward_input_s is None else _vec(backward_input_s, num_stages, "backward_input_s")
        w = None if backward_weight_s is None else _vec(backward_weight_s, num_stages, "backward_weight_s")
        if (i is None) != (w is None):
            raise ValueError("give both backward_input_s and backward_weight_s, or neither")
        if backward_s is not None:
            b = _vec(backward_s, num_stages, "backward_s")
            if i is None:
                i, w = b / 2, b / 2
        elif i is not None:
            b = i + w
        else:
            b, i, w = 2 * f, f.copy(), f.copy()
        p = _vec(p2p_s, max(num_stages - 1, 0), "p2p_s")
        for name, arr in (("forward_s", f), ("backward_s", b), ("backward_input_s", i),
                          ("backward_weight_s", w), ("p2p_s", p)):
            if np.any(arr < 0) or not np.all(np.isfinite(arr)):
                raise ValueError(f"{name} must be finite and ≥ 0")
        return cls(f, b, i, w, p, source)

    @classmethod
    def uniform(cls, num_stages: int, forward_s: float = 1.0, backward_input_s: float = 1.0,
                backward_weight_s: float = 1.0, p2p_s: float = 0.0) -> StageDurations:
        """Every stage alike (B = I + W): the textbook setting of the bubble formulas."""
        return cls.of(num_stages, forward_s, backward_input_s=backward_input_s,
                      backward_weight_s=backward_weight_s, p2p_s=p2p_s)

    def table(self) -> np.ndarray:
        """Rows F, B, I, W (the order of ``engine.pipeline.schedules.ACTION_KINDS``), one column per stage."""
        return np.stack([self.forward_s, self.backward_s, self.backward_input_s, self.backward_weight_s])

    def to_json(self) -> dict:
        return {"source": self.source, "forward_s": self.forward_s.tolist(), "backward_s": self.backward_s.tolist(),
                "backward_input_s": self.backward_input_s.tolist(),
                "backward_weight_s": self.backward_weight_s.tolist(), "p2p_s": self.p2p_s.tolist()}


def _vec(value, n: int, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{name} needs {n} values, got {arr.shape[0] if arr.ndim == 1 else arr.shape}")
    return arr.copy()


# --------------------------------------------------------------------------- from the model


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token of one transformer block (before tp), split as the backward needs."""

    projections: float
    attention_core: float
    mlp: float
    head: float

    @property
    def matmuls(self) -> float:
        return self.projections + self.mlp

    @property
    def block(self) -> float:
        return self.projections + self.attention_core + self.mlp


def flops_per_token(cfg: Config) -> FlopsPerToken:
    m = cfg.model
    h = m.hidden
    proj = 2.0 * h * (h + 2 * m.kv_dim) + 2.0 * h * h
    core = 4.0 * m.seq_len * h
    mlp = 2.0 * h * m.ffn_hidden * (3 if m.mlp == "swiglu" else 2)
    head = 2.0 * h * m.vocab
    return FlopsPerToken(proj, core, mlp, head)


def plain_blocks(cfg: Config) -> bool:
    """True for the plain decoder the per-token FLOPs above describe exactly (q width h, no experts,
    no MLA, no sliding window); the others use :func:`block_flops`."""
    m = cfg.model
    return m.experts == 0 and m.attention != "mla" and not m.head_size and not m.sliding_window



def block_flops(cfg: Config, with_experts: bool, routed: float = 1.0) -> FlopsPerToken:
    """Forward FLOPs per token of one block of any kind (before tp): 2 × every weight a token
    multiplies — the attention projections as engine.model.params lays them out (MLA's latents, head_size),
    the dense MLP, or the router, ``experts_per_token`` routed experts (× ``routed``: the busiest
    rank's share under imbalance) and the shared experts (grouped GEMMs: the active FLOPs, at the
    same efficiency) — and the attention core ``2·s'·a·(d_qk + d_v)``, where s' averages the full
    context and the sliding window over the blocks."""

    m = cfg.model
    h = m.hidden
    weights, _ = attention_tensors(m)
    proj = 2.0 * sum(a * b for a, b in weights if b > 1)  # norms and sinks (one column) are no matmul
    d_qk = m.head_dim
    d_v = m.v_head_dim if m.attention == "mla" else m.head_dim
    s = float(m.seq_len)
    if m.sliding_window:
        full = (m.layers // m.full_attention_every) if m.full_attention_every else 0
        s = (full * s + (m.layers - full) * min(s, m.sliding_window)) / m.layers
    core = 2.0 * s * m.heads * (d_qk + d_v)
    if with_experts:
        per_expert = 2.0 * (3 if m.mlp == "swiglu" else 2) * h * m.expert_hidden
        mlp = 2.0 * m.experts * h + routed * m.experts_per_token * per_expert
        if m.shared_experts:
            w, _ = mlp_tensors(m, m.shared_experts * m.expert_hidden)
            mlp += 2.0 * sum(a * b for a, b in w)
    else:
        w, _ = mlp_tensors(m, m.ffn_hidden)
        mlp = 2.0 * sum(a * b for a, b in w)
    return FlopsPerToken(proj, core, mlp, 2.0 * h * m.vocab)


def stage_block_counts(cfg: Config, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """(dense blocks, blocks with experts) of each stage (the first ``dense_layers`` are dense)."""
    m = cfg.model
    split = split_layers(m.layers, num_stages, cfg.parallel.pipeline_split)
    moe = np.array([sum(1 for i in r if m.is_moe_layer(i)) for r in split], dtype=np.float64)
    return np.array([len(r) for r in split], dtype=np.float64) - moe, moe


def adapter_elements_per_block(cfg: Config) -> int:
    """LoRA adapter elements one TP rank holds per block (0 under full fine-tuning)."""
    tr = cfg.training
    if tr.finetune != "lora":
        return 0
    return sum(a * b for a, b in adapter_block_tensors(cfg.model, tr.lora_rank, tr.lora_targets, cfg.parallel.tp))


def adapter_flops_per_token(cfg: Config) -> float:
    """One block's adapter forward FLOPs per token, before dividing by tp (the per-TP-rank matmuls
    ``2·local elements``, times tp): also the cost of the adapters' input gradient and of their
    weight gradients. 0 under full fine-tuning."""
    return 2.0 * adapter_elements_per_block(cfg) * cfg.parallel.tp


def model_flops_per_token(cfg: Config) -> float:
    """FLOPs per token of one training step without recompute, all layers and the head, before tp:
    F + I + W. Full fine-tuning: ``3·(layers·block + head)``. LoRA: the forward with the adapters,
    the input gradients of every layer and of the head, the adapters' weight gradients only."""
    fl = flops_per_token(cfg)
    n = cfg.model.layers
    if not plain_blocks(cfg) and cfg.training.finetune != "lora":  # MFU counts the active FLOPs: the top-k experts, balanced
        dense, moe = block_flops(cfg, False), block_flops(cfg, True)
        n_moe = cfg.model.moe_layers
        return 3 * ((n - n_moe) * dense.block + n_moe * moe.block + dense.head)
    if cfg.training.finetune != "lora":
        return 3 * (n * fl.block + fl.head)
    a = adapter_flops_per_token(cfg)
    return n * (fl.block + a) + fl.head + n * (fl.matmuls + 2 * fl.attention_core + a) + fl.head + n * a


def linear_flops_per_token(cfg: Config) -> dict[str, float]:
    """Forward FLOPs per token of each Linear of one block (before tp), by the backend's names."""
    m = cfg.model
    h, kv, f = m.hidden, m.kv_dim, m.ffn_hidden
    out = {"wq": 2.0 * h * h, "wk": 2.0 * h * kv, "wv": 2.0 * h * kv, "wo": 2.0 * h * h, "w1": 2.0 * h * f}
    if m.mlp == "swiglu":
        out["w3"] = 2.0 * h * f
    out["w2"] = 2.0 * f * h
    return out


#: each Linear's (input, output) widths as (hidden | kv | ffn) names, for its LoRA adapter's matmuls
_LINEAR_DIMS = {"wq": ("h", "h"), "wk": ("h", "kv"), "wv": ("h", "kv"), "wo": ("h", "h"), "w1": ("h", "f"),
                "w3": ("h", "f"), "w2": ("f", "h")}


def per_op_recompute_flops_per_token(cfg: Config) -> float:
    """Forward FLOPs per token per block that torchtitan's per-op selective checkpointing repeats:
    the matmuls its counter does not save (``engine.model.recompute.sac_saved_matmuls``; LoRA
    adapters' A and B matmuls included, 2·r·d each, before tp). SDPA / eager attention's bmms are
    saved, elementwise ops are not counted (the FLOP convention)."""
    m, tr = cfg.model, cfg.training
    mods = tuple(target_modules(m, tr.lora_targets)) if tr.finetune == "lora" else ()
    saved = sac_saved_matmuls(m.mlp == "swiglu", block_linears_addmm(m, tr), mods)
    width = {"h": m.hidden, "kv": m.kv_dim, "f": m.ffn_hidden}
    total = 0.0
    for name, fl in linear_flops_per_token(cfg).items():
        total += 0.0 if name in saved else fl
        if name in mods:
            d_in, d_out = _LINEAR_DIMS[name]
            total += 0.0 if f"{name}.A" in saved else 2.0 * tr.lora_rank * width[d_in]
            total += 0.0 if f"{name}.B" in saved else 2.0 * tr.lora_rank * width[d_out]
    return total



def block_recompute_flops_per_token(cfg: Config) -> tuple[float, float]:
    """(FLOPs per token repeated by each fully recomputed block, by every block besides) — the
    blocks' forward with adapters; the per-op policy's unsaved matmuls, or selective's attention core."""
    fl = flops_per_token(cfg)
    every = {"selective": fl.attention_core}.get(cfg.training.recompute, 0.0)
    if cfg.training.recompute == "selective-op":
        every = per_op_recompute_flops_per_token(cfg)
    return fl.block + adapter_flops_per_token(cfg), every


def recompute_flops_per_token(cfg: Config) -> float:
    """Forward FLOPs per token per block that recompute repeats in the backward (adapters included),
    averaged over the blocks (selective-layer recomputes some blocks only): times model.layers it is
    the step's recompute."""
    tr = cfg.training
    if tr.recompute == "none":
        return 0.0
    whole, every = block_recompute_flops_per_token(cfg)
    if tr.recompute == "full":
        return whole
    if tr.recompute == "selective-layer":
        return whole * sum(checkpointed_blocks(cfg)) / cfg.model.layers
    return every


def activation_bytes_per_microbatch(cfg: Config) -> int:
    """Bytes of the hidden state one stage sends the next (and its gradient back), per microbatch."""
    t = cfg.training
    act_bytes = 4 if t.precision == "fp32" else 2
    n = t.micro_batch_size * cfg.local_seq_len * cfg.model.hidden * act_bytes
    if cfg.parallel.sequence_parallel:
        n //= cfg.parallel.tp
    return n



def stage_durations(
    cfg: Config,
    *,
    forward_s: float | Sequence[float] | None = None,
    backward_s: float | Sequence[float] | None = None,
    backward_input_s: float | Sequence[float] | None = None,
    backward_weight_s: float | Sequence[float] | None = None,
    p2p_s: float | Sequence[float] | None = None,
) -> StageDurations:
    """Per-stage seconds of F, B, I, W and p2p for ``cfg``; any keyword replaces the analytic value.

    Calibration hook: pass measured seconds (per stage, or one number for all). A given B
    without I/W rescales the analytic I and W to sum to it; given I and W set B = I + W
    unless B is given too.
    """
    par, tr, cl = cfg.parallel, cfg.training, cfg.cluster
    num_stages = 1 if par.pp == 1 else par.num_stages
    fl = flops_per_token(cfg)
    tokens = tr.micro_batch_size * cfg.local_seq_len  # this rank's tokens (seq_len / cp)
    rate = cl.gpu.peak_flops(tr.precision) * cfg.conventions.compute_efficiency * par.tp
    layers = np.array([len(r) for r in split_layers(cfg.model.layers, num_stages, cfg.parallel.pipeline_split)], dtype=np.float64)
    head = np.zeros(num_stages)
    head[-1] = fl.head
    # per block (full: every block is recomputed whole) and the checkpointed blocks of selective-layer
    whole, every = block_recompute_flops_per_token(cfg)
    recompute = whole if tr.recompute == "full" else every
    ckpt = np.array(checkpointed_blocks(cfg), dtype=np.float64) * whole if tr.recompute == "selective-layer" \
        else np.zeros(num_stages)

    if not plain_blocks(cfg) and tr.finetune != "lora":  # blocks differ: dense and MoE blocks by layer, the busiest EP rank's experts
        dn, mn = stage_block_counts(cfg, num_stages)
        fd, fm = block_flops(cfg, False), block_flops(cfg, True, routed_factor(cfg))
        blk = dn * fd.block + mn * fm.block
        mm = dn * fd.matmuls + mn * fm.matmuls
        core = dn * fd.attention_core + mn * fm.attention_core
        if tr.recompute == "full":
            rec = blk
        elif tr.recompute == "selective":
            rec = core
        elif tr.recompute == "selective-layer":
            rec = np.array(checkpointed_blocks(cfg), dtype=np.float64) * blk / np.maximum(dn + mn, 1)
        else:
            rec = (dn + mn) * every
        head_mm = head
        f = tokens * (blk + head_mm) / rate
        i = tokens * (mm + 2 * core + rec + head_mm) / rate
        w = tokens * (mm + head_mm) / rate
    elif tr.finetune == "lora":  # frozen base: input gradients as before, weight gradients of the adapters only
        a = adapter_flops_per_token(cfg)
        f = tokens * (layers * (fl.block + a) + head) / rate
        i = tokens * (layers * (fl.matmuls + 2 * fl.attention_core + a + recompute) + ckpt + head) / rate
        w = tokens * (layers * a) / rate
    else:
        f = tokens * (layers * fl.block + head) / rate
        i = tokens * (layers * (fl.matmuls + 2 * fl.attention_core + recompute) + ckpt + head) / rate
        w = tokens * (layers * fl.matmuls + head) / rate
    b = i + w

    if backward_s is not None and backward_input_s is None and backward_weight_s is None:
        b_given = _vec(backward_s, num_stages, "backward_s")
        scale = np.divide(b_given, b, out=np.full(num_stages, 0.5), where=b > 0)
        i, w, b = i * scale, w * scale, b_given
    else:
        if backward_input_s is not None:
            i = _vec(backward_input_s, num_stages, "backward_input_s")
        if backward_weight_s is not None:
            w = _vec(backward_weight_s, num_stages, "backward_weight_s")
        b = i + w if backward_s is None else _vec(backward_s, num_stages, "backward_s")
    if forward_s is not None:
        f = _vec(forward_s, num_stages, "forward_s")
    p = p2p_seconds(cfg, num_stages) if p2p_s is None else p2p_s
    given = any(x is not None for x in (forward_s, backward_s, backward_input_s, backward_weight_s, p2p_s))
    return StageDurations.of(num_stages, f, b, i, w, p, source="model+given" if given else "model")


def cpu_wake_s(cfg: Config) -> float:
    """What a collective step or a send costs more on CPU ranks when called after the rank's compute
    (``cluster.cpu_wake_latency_us``; 0 on GPUs; engine.time.comm)."""
    cl = cfg.cluster
    return cl.cpu_wake_latency_us * 1e-6 if cl.gpu.name == "cpu" else 0.0


def p2p_seconds(cfg: Config, num_stages: int) -> np.ndarray:
    """Per stage boundary, the seconds one microbatch's activations (or their gradients) take between
    the two stages' ranks (0 where one rank holds both)."""
    par, cl = cfg.parallel, cfg.cluster
    owners = stage_placement(cfg)
    nbytes = activation_bytes_per_microbatch(cfg)
    out = np.zeros(max(num_stages - 1, 0))
    for s in range(num_stages - 1):
        a, b = owners[s], owners[s + 1]
        if a == b:
            continue  # same rank (the turn of a V): no transfer
        # the (dp=0, cp=0, tp=0) member of each pipeline rank; rank = pp_index * dp * cp * tp + ...
        node_a = a * par.dp * par.cp * par.tp // cl.gpus_per_node
        node_b = b * par.dp * par.cp * par.tp // cl.gpus_per_node
        if node_a == node_b:  # on CPU ranks the receiver wakes first
            out[s] = cl.intra_node_latency_us * 1e-6 + cpu_wake_s(cfg) + nbytes / cl.intra_node_bytes_per_s
        else:
            out[s] = cl.inter_node_latency_us * 1e-6 + nbytes / cl.inter_node_bytes_per_s
    return out


#: bytes one float8 cast moves per element: reads the 16-bit tensor for its amax and again to scale it,
#: writes 1 byte; torch.compile fuses the amax into the cast (one read)
FLOAT8_CAST_BYTES = {False: 5, True: 3}


def block_linears(cfg: Config) -> list[tuple[int, int]]:
    """(d_in, d_out) of each block Linear on one TP rank (q, k, v, o, gate, up, down)."""
    m, tp = cfg.model, cfg.parallel.tp
    q, kv, f, h = m.heads * m.head_dim // tp, m.kv_dim // tp, m.ffn_hidden // tp, m.hidden
    ups = [(h, f)] * (2 if m.mlp == "swiglu" else 1)
    return [(h, q), (h, kv), (h, kv), (q, h)] + ups + [(f, h)]


def float8_cast_bytes(cfg: Config, linears: list[tuple[int, int]] | None = None) -> tuple[float, float]:
    """Bytes the float8 casts of one block move for one microbatch on one rank: (forward, backward
    without recompute; a recomputed forward casts its forward's again, :func:`with_float8_and_compile`).
    ``linears``: the (d_in, d_out) of the block's float8 Linears on one TP rank (default: a dense
    block's, :func:`block_linears`)."""
    tr, par = cfg.training, cfg.parallel
    if tr.float8 == "none":
        return 0.0, 0.0
    tokens = tr.micro_batch_size * cfg.local_seq_len
    per = FLOAT8_CAST_BYTES[bool(tr.compile)]
    lin = block_linears(cfg) if linears is None else linears
    inputs = tokens * sum(i for i, _ in lin)
    grads_out = tokens * sum(o for _, o in lin)
    weights = sum(i * o for i, o in lin) / (par.shard_degree if tr.float8_all_gather else 1)
    again = 2 if tr.float8 == "rowwise" else 1  # rowwise: input and output gradient cast along the other axis too
    fwd = per * (inputs + weights)
    bwd = per * (again * grads_out + (again - 1) * inputs + weights)
    return fwd, bwd
