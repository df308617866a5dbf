"""Step time, tokens/s, MFU and HFU, with a breakdown that sums to the step.

The step is composed as::

    step = pipeline makespan (compute with TP communication on the critical path, p2p waits, bubble)
         + exposed data-parallel communication (what the backward / forward cannot hide)
         + optimizer step (memory-bound: bytes touched per local parameter / HBM bandwidth; on CPU ranks
           under the clock from ops torch's one-tensor step, its aten calls at the per-op cost too)

for the pipeline rank whose step ends last. TP collectives (and EP's all-to-alls, breakdown
``ep_comm`` when ep > 1) run inside each F/B (Megatron TP does not overlap them), so they lengthen
the stage durations the timeline simulates; so does what the context-parallel K, V exchange cannot
hide behind the blockwise attention (:func:`cp_seconds_per_layer`).
DP overlap: gradient all-reduces hide behind the backward of the last microbatch except the
last bucket; FSDP all-gathers hide behind the compute of the previous unit except the first;
FSDP reduce-scatters are counted exposed. On CPU ranks (GPU kind "cpu") nothing hides:
communication and compute share the cores. Recompute adds its forward to the backward (HFU
counts it, MFU does not).

LoRA (``training.finetune = "lora"``): engine.time.durations gives the backward the frozen base's input
gradients and the adapters' weight gradients only; engine.time.comm moves adapter gradients only (FSDP
still gathers the frozen base); the optimizer steps the adapters only (fp32 under PyTorch state
accounting). MFU counts the FLOPs the step needs (engine.time.durations.model_flops_per_token): the
forward, every input gradient, the adapters' weight gradients — not 6·Ψ.

Core sharing: CPU ranks beyond ``cluster.cpu_cores`` share the cores, so the analytic compute,
p2p and optimizer times are multiplied by ``engine.time.comm.cpu_oversubscription`` (and the
collectives' α and B scaled by it in engine.time.comm). Given durations are used as given.

The stages' compute (:func:`analytic_durations`): by default (``conventions.clock = "ops"``) each op of the
blocks, the head and the embedding a roofline on the GPU kind's device profile (engine.time.ops: float8's
GEMMs and casts and compile's fused chains are in its op lists); under ``clock = "efficiency"`` every FLOP
at ``conventions.compute_efficiency`` × the peak with the float8 and compile conventions below. MFU and HFU
divide by the peak, under float8 by :func:`peak_for_mfu`.

The efficiency clock's float8 (``training.float8``, torchao's Float8Linear on the blocks' Linears; the head
stays bf16): the Linear matmuls of F, I and W (and the recomputed forward's: ``recomputed_linear_blocks``) run at ``cluster.gpu.peak_fp8_tflops``
times the same ``conventions.compute_efficiency``; the casts are memory-bound time added to the
stage (``engine.time.durations.float8_cast_bytes``: each Linear casts its input and its weight in the
forward and its output gradient in the backward — rowwise casts input and output gradient once
more along the other axis for the weight gradient; each cast reads the 16-bit tensor twice, for
its amax and to scale it, and writes 1 byte: 5 B per element; under float8 all-gather the weight
is cast on its shard before the gather, 1/d of it).

The efficiency clock's torch.compile (``training.compile``), convention ``COMPILE_CONVENTION`` =
"fused-elementwise":
inductor fuses the elementwise chains between the matmuls, so each removes one write and one read
of its intermediate per element — SwiGLU's silu·mul (f), each residual add + RMSNorm pair (2 · h),
RoPE on q and k (q + kv dims) — in the forward and twice that in the backward, time at the HBM
bandwidth taken off F and B; and each float8 cast fuses its amax into the cast (3 B per element
instead of 5). Nothing else changes: the rest of compile's gain is inside compute_efficiency.

Async TP (``parallel.async_tp``, SP + compile): the blocks' all-gathers and reduce-scatters are
micro-pipelined with their matmuls, so per stage only ``max(0, collectives − matmuls)`` is exposed
(forward against the forward matmuls, backward against I + W's); the embedding's and head's
collectives stay exposed.

Calibration hook: pass measured ``durations`` (engine.time.durations.StageDurations), measured
``links`` (engine.time.comm.MeasuredLinks: α and B per collective) and/or a Config whose cluster
links and ``conventions.compute_efficiency`` come from a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import Config
from engine.model.params import params_per_rank
from engine.model.recompute import checkpointed_blocks
from engine.names import OPTIMIZER_STATES
from engine.pipeline.layout import split_layers
from engine.pipeline.timeline import Timeline, pipeline_prediction
from engine.time.comm import (
    CommReport,
    MeasuredLinks,
    activation_message_bytes,
    collective_seconds,
    communication,
    cp_layer_exchanges,
    cp_recomputed_blocks,
    cpu_oversubscription,
    ep_seconds_per_moe_layer,
    group_span,
    tp_block_collectives,
    tp_edge_collectives,
    tp_recomputed_blocks,
    tp_recomputed_collectives,
    trainable_local,
    zero1_broadcast_tensors,
)
from engine.time.durations import (
    StageDurations,
    block_flops,
    float8_cast_bytes,
    flops_per_token,
    model_flops_per_token,
    per_op_recompute_flops_per_token,
    plain_blocks,
    recompute_flops_per_token,
    stage_block_counts,
    stage_durations,
)
from engine.time.ops import Op, device_profile, op_durations, op_seconds
from engine.wrapping import wrapping_plan

BREAKDOWN_KEYS = ("compute", "tp_comm", "cp_comm", "pipeline_bubble", "dp_comm_exposed", "optimizer")


@dataclass(frozen=True)
class StepTime:
    seconds: float
    breakdown: dict[str, float]  # BREAKDOWN_KEYS, sums to seconds
    critical_pp_rank: int
    tokens_per_s: float
    model_flops: float  # per step, all GPUs
    hardware_flops: float  # model flops + recompute
    mfu: float
    hfu: float
    dp_comm_s: float  # total DP communication of the critical rank (hidden + exposed)
    optimizer_s: float
    timeline: Timeline
    comm: CommReport

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "breakdown": self.breakdown, "critical_pp_rank": self.critical_pp_rank,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "hfu": self.hfu,
                "model_flops": self.model_flops, "hardware_flops": self.hardware_flops,
                "dp_comm_s": self.dp_comm_s, "optimizer_s": self.optimizer_s}


def tp_seconds_per_layer(cfg: Config, links: MeasuredLinks | None = None) -> tuple[float, float]:
    """TP communication of one block for one microbatch: (forward, backward) seconds
    (the calls of engine.time.comm.tp_block_collectives)."""
    par, tr, m = cfg.parallel, cfg.training, cfg.model
    if par.tp == 1:
        return 0.0, 0.0
    span = group_span(cfg, "tp")
    act = tr.micro_batch_size * cfg.local_seq_len * m.hidden * tr.param_bytes
    out = {"forward": 0.0, "backward": 0.0}
    for coll, phase, calls in tp_block_collectives(cfg):
        out[phase] += calls * collective_seconds(cfg, coll, act, span, links)
    return out["forward"], out["backward"]


def tp_recomputed_seconds(cfg: Config, links: MeasuredLinks | None = None) -> float:
    """The TP collectives one recomputed block repeats in its backward for one microbatch, in seconds
    (engine.time.comm.tp_recomputed_collectives)."""
    if cfg.parallel.tp == 1:
        return 0.0
    span = group_span(cfg, "tp")
    act = activation_message_bytes(cfg)
    return sum(calls * collective_seconds(cfg, coll, act, span, links) for coll, calls in tp_recomputed_collectives(cfg))


def _stage_layers(cfg: Config, num_stages: int) -> np.ndarray:
    return np.array([len(r) for r in split_layers(cfg.model.layers, num_stages, cfg.parallel.pipeline_split)],
                    dtype=np.float64)


def recomputed_linear_blocks(cfg: Config, num_stages: int) -> np.ndarray:
    """Per stage, the blocks' worth of Linear matmuls the backward runs again for one microbatch: every
    block under full, the checkpointed ones under selective-layer (engine.model.recompute.checkpointed_blocks),
    under selective-op the share of a block's matmul FLOPs its policy does not save in every block
    (engine.time.durations.per_op_recompute_flops_per_token), none under selective and none."""
    tr = cfg.training
    layers = _stage_layers(cfg, num_stages)
    if tr.recompute == "full":
        return layers
    if tr.recompute == "selective-layer":
        return np.array(checkpointed_blocks(cfg), dtype=np.float64)
    if tr.recompute == "selective-op":
        return layers * (per_op_recompute_flops_per_token(cfg) / flops_per_token(cfg).matmuls)
    return np.zeros(num_stages)


def linear_matmul_seconds(cfg: Config, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of the blocks' Linear matmuls per stage for one microbatch, at the rate they run
    (float8 or the compute dtype): (forward, backward = I + W, with the recomputed forward's
    matmuls, :func:`recomputed_linear_blocks`)."""
    par, tr = cfg.parallel, cfg.training
    fl = flops_per_token(cfg)
    tokens = tr.micro_batch_size * cfg.local_seq_len
    gpu = cfg.cluster.gpu
    peak = gpu.peak_fp8_tflops * 1e12 if tr.float8 != "none" else gpu.peak_flops(tr.precision)
    rate = peak * cfg.conventions.compute_efficiency * par.tp
    one = tokens * fl.matmuls / rate
    fwd = _stage_layers(cfg, num_stages) * one
    return fwd, 2.0 * fwd + recomputed_linear_blocks(cfg, num_stages) * one


def tp_stage_seconds(cfg: Config, num_stages: int,
                     links: MeasuredLinks | None = None) -> tuple[np.ndarray, np.ndarray]:
    """TP communication per stage for one microbatch, as it lies on the critical path: (forward,
    backward) arrays — the blocks' collectives (:func:`tp_seconds_per_layer`; under async TP only
    what their matmuls cannot hide) plus the embedding's on the first stage and the head's and
    loss_parallel's on the last (engine.time.comm.tp_edge_collectives)."""
    fwd_l, bwd_l = tp_seconds_per_layer(cfg, links)
    layers = _stage_layers(cfg, num_stages)
    fwd, bwd = layers * fwd_l, layers * bwd_l
    if cfg.training.recompute == "selective-layer" and cfg.parallel.tp > 1:
        bwd = bwd + np.array(tp_recomputed_blocks(cfg), dtype=np.float64) * tp_recomputed_seconds(cfg, links)
    if cfg.parallel.async_tp:
        mm_f, mm_b = linear_matmul_seconds(cfg, num_stages)
        fwd, bwd = np.maximum(0.0, fwd - mm_f), np.maximum(0.0, bwd - mm_b)
    if cfg.parallel.tp > 1:
        span = group_span(cfg, "tp")
        for s in {0, num_stages - 1}:
            for coll, phase, calls, size in tp_edge_collectives(cfg, s == 0, s == num_stages - 1):
                t = calls * collective_seconds(cfg, coll, size, span, links)
                if phase == "forward":
                    fwd[s] += t
                else:
                    bwd[s] += t
    return fwd, bwd


def with_tp_communication(cfg: Config, d: StageDurations, links: MeasuredLinks | None = None) -> StageDurations:
    """Stage durations with the TP collectives (:func:`tp_stage_seconds`) added to F, B and I (not W)."""
    if cfg.parallel.tp == 1:
        return d
    fwd, bwd = tp_stage_seconds(cfg, d.num_stages, links)
    return StageDurations.of(d.num_stages, d.forward_s + fwd, d.backward_s + bwd,
                             d.backward_input_s + bwd, d.backward_weight_s, d.p2p_s,
                             source=d.source)


def attention_core_seconds(cfg: Config) -> tuple[float, float]:
    """One layer's attention core (QKᵀ and AV) on one rank for one microbatch: (forward, backward)
    seconds at the analytic rate — the compute torch's ring attention overlaps its K, V exchange
    with. Under context parallelism each rank computes its s = S/cp queries against all S keys
    (the FLOP convention's full square); the head-tail load balancing gives every rank the same
    causal work, so no rank straggles and each of the cp blockwise steps is 1/cp of it."""
    fl = flops_per_token(cfg)
    tr = cfg.training
    rate = cfg.cluster.gpu.peak_flops(tr.precision) * cfg.conventions.compute_efficiency * cfg.parallel.tp
    fwd = tr.micro_batch_size * cfg.local_seq_len * fl.attention_core / rate * cpu_oversubscription(cfg)
    return fwd, 2.0 * fwd


def cp_seconds_per_layer(cfg: Config, links: MeasuredLinks | None = None) -> tuple[float, float]:
    """The context-parallel K, V exchange of one layer for one microbatch as it lies on the critical
    path: (forward, backward) seconds, overlapped as torch overlaps it (a backward that recomputes
    the forward adds the forward's again: :func:`cp_stage_seconds`).

    Each exchange is issued before the blockwise attention step it feeds the next: "allgather"'s one
    gather hides behind the first step (the rank's own chunk, 1/cp of its attention), each of
    "alltoall"'s cp − 1 rotations behind one step; the dK, dV rotations of the backward hide behind
    the next step, and the last is waited for after the loop (exposed); eager attention's gradient
    reduce-scatter follows its backward (exposed). On CPU ranks nothing hides (shared cores)."""
    par = cfg.parallel
    if par.cp == 1:
        return 0.0, 0.0
    span = group_span(cfg, "cp")
    hides = cfg.cluster.gpu.name != "cpu"
    attn_f, attn_b = attention_core_seconds(cfg)
    out = {"forward": 0.0, "backward": 0.0}
    for coll, phase, calls, size, what in cp_layer_exchanges(cfg):
        one = collective_seconds(cfg, coll, size, span, links)
        if not hides or coll == "reduce_scatter":
            out[phase] += calls * one
        elif what.startswith("dK"):  # cp rotations, each behind the next step but the last
            out[phase] += (calls - 1) * max(0.0, one - attn_b / par.cp) + one
        else:
            window = (attn_f if phase == "forward" else attn_b) / par.cp
            out[phase] += calls * max(0.0, one - window)
    return out["forward"], out["backward"]


def cp_stage_seconds(cfg: Config, num_stages: int,
                     links: MeasuredLinks | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The exposed context-parallel exchange per stage for one microbatch: (forward, backward); the
    backward of a block that recomputes its forward (engine.time.comm.cp_recomputed_blocks) repeats the
    forward's, hidden behind the recomputed attention as in the forward."""
    fwd_l, bwd_l = cp_seconds_per_layer(cfg, links)
    layers = _stage_layers(cfg, num_stages)
    again = np.array(cp_recomputed_blocks(cfg), dtype=np.float64) if cfg.parallel.cp > 1 else 0.0
    return layers * fwd_l, layers * bwd_l + again * fwd_l


def with_mesh_communication(cfg: Config, d: StageDurations, links: MeasuredLinks | None = None) -> StageDurations:
    """Stage durations with what the mesh's collectives put on the critical path of each F and B:
    the TP collectives (:func:`with_tp_communication`) and the exposed context-parallel K, V
    exchange (:func:`cp_stage_seconds`), added to F, B and I (not W)."""
    d = with_tp_communication(cfg, d, links)
    if cfg.parallel.cp == 1:
        return d
    fwd, bwd = cp_stage_seconds(cfg, d.num_stages, links)
    return StageDurations.of(d.num_stages, d.forward_s + fwd, d.backward_s + bwd,
                             d.backward_input_s + bwd, d.backward_weight_s, d.p2p_s, source=d.source)


def ep_stage_seconds(cfg: Config, num_stages: int,
                     links: MeasuredLinks | None = None) -> tuple[np.ndarray, np.ndarray]:
    """EP all-to-alls per stage for one microbatch (forward, backward): each stage's MoE blocks ×
    engine.time.comm.ep_seconds_per_moe_layer; zeros without expert parallelism."""
    zeros = np.zeros(num_stages)
    if cfg.parallel.ep == 1:
        return zeros, zeros.copy()

    fwd_l, bwd_l = ep_seconds_per_moe_layer(cfg, links)
    _, moe = stage_block_counts(cfg, num_stages)
    return moe * fwd_l, moe * bwd_l


def with_ep_communication(cfg: Config, d: StageDurations, links: MeasuredLinks | None = None) -> StageDurations:
    """Stage durations with the EP all-to-alls added to F, B and I (they wait on the experts' tokens)."""
    if cfg.parallel.ep == 1:
        return d
    fwd, bwd = ep_stage_seconds(cfg, d.num_stages, links)
    return StageDurations.of(d.num_stages, d.forward_s + fwd, d.backward_s + bwd,
                             d.backward_input_s + bwd, d.backward_weight_s, d.p2p_s, source=d.source)


#: torch's optimizers as they step one parameter tensor at a time (torch/optim/adam.py ``_single_tensor_adam``,
#: sgd.py ``_single_tensor_sgd``, with the backend's arguments: no weight decay, no amsgrad): per tensor, the aten
#: calls, and per element the bytes they move for a parameter (and its gradient) of ``p`` bytes and fp32 states.
#: AdamW: ``step += 1``, ``exp_avg.lerp_(grad)`` (8 + p), ``exp_avg_sq.mul_`` (8) ``.addcmul_(grad, grad)`` (8 + p),
#: ``step.item()``, ``exp_avg_sq.sqrt()`` (8) ``/ bias_correction2_sqrt`` (8) ``.add_(eps)`` (8),
#: ``param.addcdiv_(exp_avg, denom)`` (8 + 2p); SGD with momentum: ``buf.mul_`` (8) ``.add_(grad)`` (4 + 4 + p),
#: ``param.add_(buf)`` (4 + 2p); SGD: ``param.add_(grad)`` (3p)
FOR_LOOP_OPTIMIZER: dict[str, tuple[int, int, int]] = {"adamw": (9, 56, 4), "sgd-momentum": (3, 20, 3), "sgd": (1, 0, 3)}


def optimizer_tensors(cfg: Config, rp) -> int:
    """Parameter tensors one rank's optimizer steps: every local one (FSDP2 steps each tensor's shard), under
    LoRA the blocks' adapters; ZeroRedundancyOptimizer gives each rank of the shard group whole tensors, its
    share of them."""
    n = zero1_broadcast_tensors(cfg, rp)
    if wrapping_plan(cfg).zero_redundancy_optimizer:
        n = -(-n // cfg.parallel.shard_degree)
    return n


def optimizer_seconds(cfg: Config, local_params: int, tensors: int = 0) -> float:
    """Optimizer step over the local shard: memory-bound, bytes read + written per parameter / HBM.

    ``local_params`` are the parameters the optimizer steps before DP sharding (under LoRA the
    adapters only: :func:`engine.time.comm.trainable_local`). LoRA's adapters are fp32 with fp32
    gradients and no master copy under PyTorch state accounting, as engine.memory counts them.

    Under the clock from ops on CPU ranks, where torch steps one tensor at a time (torch/optim/optimizer.py
    ``_default_to_fused_or_foreach``: no foreach kernels on the CPU; ``engine.memory.states.optimizer_foreach``),
    the step is its op list (:data:`FOR_LOOP_OPTIMIZER`), timed as the clock times a memory-bound op: its bytes at
    the profile's bandwidth and each of its aten calls (``tensors`` × the calls per tensor) at the profile's per-op
    cost, each call on a DTensor parameter (FSDP2's, TP's) the profile's ``dtensor_optimizer_op_us`` more. GPU ranks
    (the multi-tensor step; the one-tensor step of ranks that mix DTensors, not yet measured there)
    and the efficiency clock keep one pass over the bytes the step must touch.
    """
    par, tr = cfg.parallel, cfg.training
    shard = local_params / (par.shard_degree if wrapping_plan(cfg).optimizer_sharded else 1)
    states = OPTIMIZER_STATES[tr.optimizer]
    master = 4 if tr.master_weights else 0
    lora_fp32 = tr.finetune == "lora" and cfg.conventions.state_accounting == "pytorch"
    if cfg.conventions.clock == "ops" and cfg.cluster.gpu.name == "cpu":
        calls, fixed, per_p = FOR_LOOP_OPTIMIZER[tr.optimizer]
        p = 4 if lora_fp32 else (master or tr.param_bytes)
        op = Op("optimizer step", "F", "memory", 0.0, shard * (fixed + per_p * p), calls * tensors)
        prof = device_profile(cfg.cluster.gpu.name)
        plan = wrapping_plan(cfg)
        # DTensor parameters (FSDP2's, TP's): each aten call dispatches through DTensor first
        dtensor = calls * tensors * prof.dtensor_optimizer_op_us * 1e-6 if plan.fsdp2 or par.tp > 1 else 0.0
        return (op_seconds(op, cfg, prof) + dtensor) * cpu_oversubscription(cfg)
    if lora_fp32:
        per_param = 4 + 4 + 8 * states + 4  # read grad + param + states; write param + states
        return shard * per_param / (cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9) * cpu_oversubscription(cfg)
    # read grad + param (master or compute copy) + states; write param (+ compute copy) + states
    per_param = tr.grad_bytes + (master or tr.param_bytes) + 8 * states + (master or tr.param_bytes) \
        + (tr.param_bytes if master else 0)
    return shard * per_param / (cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9) * cpu_oversubscription(cfg)


#: the name of the torch.compile speed-up convention (module docstring)
COMPILE_CONVENTION = "fused-elementwise"
def compile_saved_bytes(cfg: Config) -> tuple[float, float]:
    """Bytes torch.compile's fused elementwise chains save per block for one microbatch on one
    rank under ``COMPILE_CONVENTION``: (forward, backward = twice the forward)."""
    tr, m, par = cfg.training, cfg.model, cfg.parallel
    if not tr.compile:
        return 0.0, 0.0
    tokens = tr.micro_batch_size * cfg.local_seq_len
    act = 4 if tr.precision == "fp32" else 2
    f = m.ffn_hidden / par.tp if m.mlp == "swiglu" else 0.0
    rope = (m.heads * m.head_dim + m.kv_dim) / par.tp if m.position == "rope" else 0.0
    residual_norm = 2 * m.hidden / (par.tp if par.sequence_parallel else 1)
    fwd = 2 * act * tokens * (f + residual_norm + rope)  # one write + one read of each intermediate
    return fwd, 2 * fwd


def with_float8_and_compile(cfg: Config, d: StageDurations) -> StageDurations:
    """Analytic durations with float8's matmul rate and cast time and compile's fused elementwise
    time (module docstring); unchanged when neither is on."""
    tr = cfg.training
    if tr.float8 == "none" and not tr.compile:
        return d
    n = d.num_stages
    layers = _stage_layers(cfg, n)
    hbm = cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9
    f, i, w = d.forward_s.copy(), d.backward_input_s.copy(), d.backward_weight_s.copy()
    if tr.float8 != "none":
        fl = flops_per_token(cfg)
        tokens = tr.micro_batch_size * cfg.local_seq_len
        eff, tp = cfg.conventions.compute_efficiency, cfg.parallel.tp
        per_block = tokens * fl.matmuls / (eff * tp) * (
            1 / cfg.cluster.gpu.peak_flops(tr.precision) - 1 / (cfg.cluster.gpu.peak_fp8_tflops * 1e12))
        redo = recomputed_linear_blocks(cfg, n)  # the recomputed forward's matmuls run in float8 too, casts and all
        cast_f, cast_b = float8_cast_bytes(cfg)
        f += layers * (cast_f / hbm - per_block)
        i += layers * cast_b / hbm + redo * (cast_f / hbm - per_block) - layers * per_block
        w -= layers * per_block
    save_f, save_b = compile_saved_bytes(cfg)
    f -= layers * save_f / hbm
    i -= layers * save_b / hbm
    f, i, w = (np.maximum(x, 0.0) for x in (f, i, w))
    return StageDurations.of(n, f, i + w, i, w, d.p2p_s, source=d.source)


def analytic_durations(cfg: Config) -> StageDurations:
    """The stages' analytic durations, slowed by core sharing on CPU ranks: under ``conventions.clock =
    "efficiency"`` engine.time.durations' FLOP-based ones with float8 and compile
    (:func:`with_float8_and_compile`); under ``"ops"`` the sum of the blocks' ops, each a roofline on the
    GPU kind's device profile (engine.time.ops.op_durations: float8 and compile are in its op lists)."""
    if cfg.conventions.clock == "ops":
        d = op_durations(cfg)
    else:
        d = with_float8_and_compile(cfg, stage_durations(cfg))
    over = cpu_oversubscription(cfg)
    if over == 1.0:
        return d
    return StageDurations.of(d.num_stages, d.forward_s * over, d.backward_s * over, d.backward_input_s * over,
                             d.backward_weight_s * over, d.p2p_s * over, source=d.source)


def peak_for_mfu(cfg: Config, model_flops: float) -> float:
    """One GPU's peak FLOP/s that MFU and HFU divide by: the precision's peak; under float8 the rate at which
    the step's model FLOPs would run if each ran at the peak of the tensor cores it uses — the blocks'
    Linears (3 × their forward FLOPs a token, every layer) at the fp8 peak, the attention, the head and the
    rest at the precision's — so MFU stays a share of what the card can do (at most 1), not a ratio to a
    peak the float8 GEMMs exceed."""
    gpu, tr = cfg.cluster.gpu, cfg.training
    peak = gpu.peak_flops(tr.precision)
    if tr.float8 == "none" or model_flops <= 0:
        return peak
    linears = flops_per_token(cfg).matmuls if plain_blocks(cfg) else block_flops(cfg, False).matmuls
    f8 = min(model_flops, cfg.tokens_per_step * 3 * cfg.model.layers * linears)
    return model_flops / ((model_flops - f8) / peak + f8 / (gpu.peak_fp8_tflops * 1e12))


def step_time(cfg: Config, durations: StageDurations | None = None,
              links: MeasuredLinks | None = None) -> StepTime:
    """Predicted step time for ``cfg`` (analytic durations unless measured ones are given;
    intra-node collectives from ``links`` where given)."""
    par, tr, model = cfg.parallel, cfg.training, cfg.model
    base = durations if durations is not None else analytic_durations(cfg)
    d = with_ep_communication(cfg, with_mesh_communication(cfg, base, links), links)
    timeline = pipeline_prediction(cfg, d)
    comm = communication(cfg, links)
    held = params_per_rank(cfg)
    tp_f, tp_b = tp_stage_seconds(cfg, d.num_stages, links)
    cp_f, cp_b = cp_stage_seconds(cfg, d.num_stages, links)
    ep_f, ep_b = ep_stage_seconds(cfg, d.num_stages, links)
    stages_of = [list(rp[0].stage_indices) for rp in held] if par.pp > 1 else [[0]]

    best = None
    for pp_rank in range(par.pp):
        rc = comm.per_pp_rank[pp_rank]
        stages = stages_of[pp_rank]
        back_one = float(sum(d.backward_s[s] for s in stages))  # backward of one microbatch
        fwd_one = float(sum(d.forward_s[s] for s in stages))
        exposed = 0.0
        dp_total = 0.0
        for item in rc.items:
            if item.dim != "dp":
                continue
            dp_total += item.seconds
            one_call = item.seconds / item.calls
            if not item.overlappable:
                exposed += item.seconds
            elif item.phase == "backward":
                exposed += max(one_call, item.seconds - back_one)
            else:  # FSDP gathers (one call per unit): the first is exposed, the rest hide behind compute
                window = (fwd_one + back_one) * par.microbatches
                exposed += max(one_call, item.seconds - window)
        opt = optimizer_seconds(cfg, trainable_local(cfg, held[pp_rank][0]),
                                optimizer_tensors(cfg, held[pp_rank][0]))
        busy = float(timeline.busy_s[pp_rank])
        tp_here = float(sum(tp_f[s] + tp_b[s] for s in stages)) * par.microbatches
        cp_here = float(sum(cp_f[s] + cp_b[s] for s in stages)) * par.microbatches
        ep_here = float(sum(ep_f[s] + ep_b[s] for s in stages)) * par.microbatches
        # the optimizer step's own TP collectives (sequence-parallel norms' partial gradients): after the backward
        tp_step = sum(i.seconds for i in rc.items if i.dim == "tp" and i.phase == "step")
        total = timeline.makespan_s + exposed + opt + tp_step
        entry = (total, pp_rank, busy, tp_here, cp_here, exposed, opt, dp_total, ep_here, tp_step)
        if best is None or total > best[0]:
            best = entry
    total, pp_rank, busy, tp_here, cp_here, exposed, opt, dp_total, ep_here, tp_step = best
    breakdown = {
        "compute": busy - tp_here - cp_here - ep_here,
        "tp_comm": tp_here + tp_step,
        "cp_comm": cp_here,
        "pipeline_bubble": timeline.makespan_s - busy,
        "dp_comm_exposed": exposed,
        "optimizer": opt,
    }
    if par.ep > 1:
        breakdown["ep_comm"] = ep_here
    tokens = cfg.tokens_per_step
    if tr.finetune == "lora" or not plain_blocks(cfg):
        model_flops = tokens * model_flops_per_token(cfg)
    else:
        fl = flops_per_token(cfg)
        model_flops = tokens * 3 * (model.layers * fl.block + fl.head)
    hardware_flops = model_flops + tokens * model.layers * recompute_flops_per_token(cfg)
    peak = peak_for_mfu(cfg, model_flops) * cfg.cluster.gpus
    return StepTime(
        seconds=total, breakdown=breakdown, critical_pp_rank=pp_rank, tokens_per_s=tokens / total,
        model_flops=model_flops, hardware_flops=hardware_flops, mfu=model_flops / (total * peak),
        hfu=hardware_flops / (total * peak), dp_comm_s=dp_total, optimizer_s=opt, timeline=timeline, comm=comm,
    )
