"""The conventions a memory report used, in words, shown next to the numbers (``conventions_of``).

Tools in this field silently disagree (16 vs 18 bytes per parameter, fp32 vs bf16 gradients,
with or without the attention-score term under fused attention); every choice the memory
model makes is stated here, and the switchable ones name their ``conventions.*`` field. The
rules themselves are documented where they are computed: ``states`` (bytes per parameter,
sharding degree, accounting), ``activations``, ``in_flight`` (pipeline), ``buffers``,
``overhead``.
"""

from __future__ import annotations

from engine.config import Config
from engine.memory.in_flight import IN_FLIGHT_RULE
from engine.model.routing import ep_rank_loads, varying_expert_load
from engine.names import OPTIMIZER_STATES
from engine.wrapping import wrapping_plan

#: what each training.recompute keeps of a block, in words ({n}: training.recompute_every)
_RECOMPUTE_RULE = {
    "none": "none: every block keeps what its ops save for backward",
    "selective": "selective (Korthikanti et al.): the attention core (softmax, its dropout; flash's lse) is "
                 "recomputed",
    "full": "full: each block keeps its input only and is recomputed whole in the backward (one block's saved "
            "tensors as activations while its backward runs, as PyTorch's MemTracker counts them)",
    "selective-op": "selective-op (torchtitan's SelectiveAC): each block keeps its input and the outputs of the "
                    "ops in the policy's save list — every other aten.mm by its counter (odd ones saved: wq, wv, "
                    "w1, w2 of a SwiGLU block; a Linear with a bias is an addmm, always saved), the attention "
                    "op's outputs (SDPA output and log-sum-exp; eager: both bmms), sequence parallel's "
                    "reduce-scatter outputs; the rest is recomputed (one block's recomputed tensors counted once, as activations)",
    "selective-layer": "selective-layer (torchtitan's selective_ac_option = N = {n}): every N-th block of each rank "
                       "(its process-wide 1-based counter, k % N == 0) is fully checkpointed, the others keep "
                       "everything",
}


def conventions_of(cfg: Config) -> dict[str, str]:
    """The conventions this report used, in words (shown next to the numbers)."""
    tr, par, conv = cfg.training, cfg.parallel, cfg.conventions
    k = OPTIMIZER_STATES[tr.optimizer]
    if conv.state_accounting == "pytorch":
        how = ("FSDP2 (fully_shard / replicate, MixedPrecisionPolicy): the fp32 sharded parameter is the master"
               if wrapping_plan(cfg).fsdp2 else
               "autocast: fp32 parameters, 16-bit casts made on the fly" if tr.precision != "fp32" else "fp32")
        bpp = (f"{4 + 4 + 4 * k} unsharded = params 4 + grads 4 (the parameter dtype) + optimizer {4 * k} "
               f"({k} fp32 state(s) of {tr.optimizer}, no separate master) — {how}")
        acc = ("pytorch (default): what torch's autocast / FSDP2 / ZeroRedundancyOptimizer keep, strategy by "
               "strategy — the split the backend measures, so predicted and measured compare category by "
               "category; ZeRO-1 gives each DP rank whole tensors (greedy, largest first); the TP token "
               "embedding's gradient is full size without an FSDP2 wrapper. conventions.state_accounting = "
               "'zero-paper' gives the ZeRO paper's split")
    else:
        w, g = tr.param_bytes, tr.grad_bytes
        o = (4 if tr.master_weights else 0) + 4 * k
        bpp = (f"{w + g + o} unsharded = params {w} + grads {g} ({tr.grad_dtype}) + optimizer {o} "
               f"({'fp32 master 4 + ' if tr.master_weights else ''}{k} fp32 state(s) of {tr.optimizer})")
        acc = ("zero-paper: ZeRO paper split (16-bit working copy in params, fp32 master in optimizer, grads in "
               "grad_dtype, ZeRO-1/2 as an even flat split); torch (FSDP2, autocast) keeps the fp32 "
               "parameter as master — same total in most cases, a different split")
    out = {
        "bytes_per_parameter": bpp,
        "sharding_degree": f"ZeRO-{par.zero} divides by parallel.shard_degree = {par.shard_degree} "
                           "(dp, or dp/replicate under HSDP), never by the world size",
        "zero_accounting": acc,
        "state_accounting": conv.state_accounting,
        "activations": "saved-for-backward tensors per op (Korthikanti et al. 2022 Table 2 when f=4h, "
                       f"eager, dropout on); attention = {cfg.model.attention}, dropout "
                       f"{'on' if cfg.model.dropout > 0 else 'off (no masks)'}, recompute = {tr.recompute}, "
                       f"{4 if tr.precision == 'fp32' else 2}-byte activations",
        "recompute": _RECOMPUTE_RULE[tr.recompute].format(n=tr.recompute_every),
        "compile": ("torch.compile per block: inductor's min-cut partitioner recomputes fused elementwise chains "
                    "from their inputs (SwiGLU keeps gate, up and their product, not the SiLU output; a composite "
                    "RMSNorm keeps its input and rstd, not x̂; rope's cos/sin tables are recomputed; autocast's "
                    "repeated input casts are merged by CSE), everything else as eager — the partitioner's usual "
                    "choice, measured on one block on CPU" if tr.compile else "eager (no torch.compile)"),
        "float8": (f"torchao float8 training ({tr.float8} scaling): matmul_with_hp_or_float8_args saves the "
                   "high-precision input and weight, so the saved activations are as bf16 (on a CPU rank the QKV and "
                   "MLP inputs stay fp32 under autocast: Float8Linear casts its input only under CUDA's autocast); "
                   "the float8 casts are transient; Float8Linear's weight is not cast by autocast (no cached 16-bit copy of the blocks' "
                   "weights); the amax scalars it saves are not counted" if tr.float8 != "none" else "none"),
        "pipeline_in_flight": f"{par.schedule}: {IN_FLIGHT_RULE[par.schedule]}" if par.pp > 1 else "no pipeline",
        "dualpipe_parameters": "not doubled: torch's DualPipeV holds 2p distinct stages in a V",
        "tied_embeddings": "one matrix with a single stage; with more stages the last stage keeps its own copy",
        "ddp_buckets": "the DDP Reducer's buckets cover all gradients (bucket_cap_mb = "
                       f"{conv.ddp_bucket_mb:g} sets their count) unless gradient_as_bucket_view",
        "fsdp_units": "one unit per block, one for the embeddings, one for final norm + head; "
                      f"prefetch {'on' if conv.fsdp_prefetch else 'off'} (conventions.fsdp_prefetch)",
        "pipeline_buffers": "torch allocates one receive buffer per microbatch for activations and for gradients",
        "loss": "last stage holds fp32 log-probabilities per microbatch in flight; logits counted as temporaries",
        "overhead.runtime_context": f"{'on' if conv.runtime_context else 'off'}: cluster.gpu.runtime_context_gib "
                                    f"= {cfg.cluster.gpu.runtime_context_gib:g} GiB",
        "overhead.collective_buffers": f"{'on' if conv.collective_buffers else 'off'}: "
                                       f"{conv.collective_buffer_mib:g} MiB per communicator",
        "overhead.allocator_slack": f"{conv.allocator_slack_fraction:g} × the tracked bytes at the peak: a floor "
                                    "on the reserve (reserved = max(replayed, allocated + slack)), never added to "
                                    "the replay's",
        "peak": "the moment of the rank's step with the most live tracked bytes (every term laid on the schedule's "
                "actions: states all step, a stage-microbatch's activations from its F to its B or W, FSDP2's "
                "unsharded gradients from the first backward, the loss in the last stage's backward); the "
                "categories are the terms alive then, the untracked overhead on top",
        "overhead.reserved": ("CPU ranks: no caching allocator, reserved = allocated" if cfg.cluster.gpu.name == "cpu"
                              else "the step's allocations (one block per term, per stage-microbatch for "
                                   "activations; FSDP2's gathers on their own stream) replayed through torch's "
                                   "caching allocator (engine.memory.allocator), expandable_segments = "
                                   f"{conv.expandable_segments} (conventions.expandable_segments); no runtime context "
                                   "or collective-library buffers (outside the allocator); fits: reserved + those "
                                   "≤ capacity"),
        "capacity": f"cluster.gpu.memory_gib = {cfg.cluster.gpu.memory_gib:g} GiB",
    }
    if cfg.model.experts > 0:
        m = cfg.model
        load = (f"capacity factor {conv.moe_capacity_factor:g}: each expert's buffers hold that × the mean, the "
                "rest dropped" if conv.moe_capacity_factor > 0 else
                f"imbalance {conv.moe_imbalance:g}: the busiest EP rank routes that × the balanced n·k"
                + (" (1 = balanced, the default)" if conv.moe_imbalance == 1 else "")
                if par.ep > 1 else "every expert local (ep = 1): n·k routed copies in all")
        if conv.moe_expert_load and par.ep > 1:

            shares = ", ".join(f"{x:.3f}" for x in ep_rank_loads(cfg))
            load = (f"measured per-expert load: EP rank r routes n·k·ep × the fractions of its experts "
                    f"(experts contiguous over the ep ranks; shares {shares}); the all-to-all and grouped GEMMs "
                    f"are timed at the busiest rank's"
                    + ("; given per MoE block: each stage's MoE blocks follow their own loads (averaged over the "
                       "stage's blocks; the shares above are the mean over blocks and microbatches)"
                       if varying_expert_load(cfg) else "")
                    + ("; given per microbatch: the microbatches in flight at the rank's peak moment (found at "
                       "the mean load)" if varying_expert_load(cfg) and isinstance(conv.moe_expert_load[0][0], tuple)
                       else ""))
        elif conv.moe_expert_load:
            load = "measured per-expert load, every expert local (ep = 1): n·k routed copies in all"
        out["moe_load"] = (f"{load} (conventions.moe_imbalance, conventions.moe_capacity_factor, "
                           f"conventions.moe_expert_load)")
        out["moe_experts"] = (f"E / ep = {m.experts // par.ep} whole experts per rank per MoE block, FSDP-sharded over "
                              f"efsdp = {par.expert_shard_degree} (torchtitan's sparse mesh)" if par.ep > 1 else
                              f"all {m.experts} experts on every rank, split by TP along f")
    return out


