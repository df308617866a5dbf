"""Names that every package shares. A fact lives once: here.

Memory categories, schedule names, strategy names and the enumerations of the
Config file are defined in this module and used everywhere else by reference.
"""

from __future__ import annotations

#: Memory categories, in display order. Every number is per rank, in bytes.
MEMORY_CATEGORIES: tuple[str, ...] = (
    "params",
    "grads",
    "optimizer",  # includes fp32 master weights under mixed precision
    "activations",
    "comm_buffers",  # DDP buckets, all-gather / reduce-scatter buffers, p2p buffers
    "temporaries",
    "overhead",  # runtime context, collective-library buffers, allocator slack
)

#: Pipeline schedules, spelled as torch.distributed.pipelining names them (without "Schedule").
SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: Schedules that run exactly one stage per rank.
SINGLE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
#: Schedules that place two stages per rank in a V (stage i and 2p-1-i on rank i).
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV"})
#: Schedules that split the backward into input-gradient (I) and weight-gradient (W) parts.
SPLIT_BACKWARD_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})

#: ZeRO stage -> what it shards.
ZERO_STAGES: dict[int, str] = {
    0: "DDP: everything replicated, gradients all-reduced",
    1: "ZeRO-1: optimizer state sharded",
    2: "ZeRO-2: optimizer state and gradients sharded",
    3: "ZeRO-3 / FSDP full shard: parameters, gradients and optimizer state sharded",
}

#: FSDP sharding-strategy names (FSDP1's ShardingStrategy) mapped onto (zero stage, hybrid?).
FSDP_STRATEGIES: dict[str, tuple[int, bool]] = {
    "NO_SHARD": (0, False),
    "SHARD_GRAD_OP": (2, False),
    "FULL_SHARD": (3, False),
    "HYBRID_SHARD": (3, True),
    "_HYBRID_SHARD_ZERO2": (2, True),
}

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
#: Attention (model.attention): the eager kernel, a fused (flash) kernel, or DeepSeek's multi-head latent
#: attention (low-rank KV and query latents, a shared rotary key; run with the fused kernel).
ATTENTION_KINDS = ("eager", "flash", "mla")
#: How a MoE router turns logits into scores (model.router_score): softmax (Mixtral, Qwen3, gpt-oss) or
#: sigmoid (DeepSeek-V3).
ROUTER_SCORES = ("softmax", "sigmoid")
POSITION_KINDS = ("rope", "learned")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
GRAD_DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "sgd-momentum", "sgd")
#: Activation recomputation (training.recompute): none; "selective" = Korthikanti et al.'s attention
#: core; "full" = every block; "selective-op" = torchtitan's per-op selective checkpointing (its save
#: list: matmul outputs saved every other one, attention outputs and reduce-scatters kept, the rest
#: recomputed); "selective-layer" = full recompute of every training.recompute_every-th block.
RECOMPUTE_KINDS = ("none", "selective", "full", "selective-op", "selective-layer")
#: torchao float8 training of the Linear layers (training.float8): scaling granularity.
FLOAT8_KINDS = ("none", "tensorwise", "rowwise")
#: FSDP2 reshard_after_forward (parallel.fsdp_reshard_after_forward) for ZeRO-3: "default" as
#: torchtitan means it (reshard after forward, except under pipelining), "always", "never".
RESHARD_POLICIES = ("default", "always", "never")
#: How the blocks are cut into pipeline stages (parallel.pipeline_split): "even" = blocks split as
#: evenly as they go; "torchtitan" = its generate_llm_fqn_per_model_part with input and output
#: weights 1: the embeddings count as one block on the first stage, norm + head as one on the last.
PIPELINE_SPLITS = ("even", "torchtitan")
BUBBLE_CONVENTIONS = ("share-of-total", "relative-to-ideal")
#: what a pipeline's last stage keeps of its outputs (``conventions.pipeline_outputs``)
PIPELINE_OUTPUTS = ("released", "kept")
#: conventions.clock: how compute is timed (engine.time.step.analytic_durations)
CLOCKS = {"efficiency": "every FLOP at conventions.compute_efficiency × the peak",
          "ops": "each op a roofline on the device profile (engine.time.ops)"}
#: conventions.rms_norm: the kernels an eager RMSNorm runs (the clock from ops times them; under
#: torch.compile every norm is one fused kernel whatever this says)
RMS_NORMS = {"fused": "one kernel reading and writing its tensor: torch's F.rms_norm / nn.RMSNorm since its "
                      "fused kernel (pytorch#153666, 2025), what this backend runs on GPUs (on CPU ranks torch decomposes it, "
                      "and the clock counts the composite)",
             "fp32-composite": "torchtitan's own RMSNorm before March 2025 (torchtitan#985) (torchtitan/models/norms.py: x.float(), "
                               "pow, mean, + eps, rsqrt, mul, type_as, × weight: 8 kernels through fp32), "
                               "what its published H100 benchmarks of December 2024 ran"}
#: How context parallelism moves K and V between the cp ranks (parallel.cp_rotate), as torch's
#: ``torch.distributed.tensor.experimental._attention.set_rotate_method`` names them: "allgather" =
#: one all-gather of every rank's K, V per attention call (the full-sequence K, V alive while it
#: runs); "alltoall" = the ring: cp−1 rotations of one chunk, each overlapped with the blockwise
#: attention on the chunk in hand (two chunks in flight).
CP_ROTATE_METHODS = ("allgather", "alltoall")
#: How data-parallel replicas are driven (parallel.dp_mode): "ddp" = one process per GPU
#: (DistributedDataParallel, or ZeRO / FSDP by parallel.zero); "dataparallel" = the legacy
#: single-process torch.nn.DataParallel (GPU 0 scatters, gathers and steps: engine.legacy_dp).
DP_MODES = ("ddp", "dataparallel")
#: What training updates (training.finetune): every weight, or LoRA adapters on a frozen base.
FINETUNE_KINDS = ("full", "lora")
#: Which Linears get LoRA adapters (training.lora_targets), as the backend's module names:
#: attention = q, k, v, o projections; mlp = gate, up, down (gelu: up, down); all = both.
LORA_TARGETS = ("attention", "mlp", "all")
LORA_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "attention": ("wq", "wk", "wv", "wo"),
    "mlp": ("w1", "w3", "w2"),
    "all": ("wq", "wk", "wv", "wo", "w1", "w3", "w2"),
}
#: Storage of the frozen base weights under LoRA (training.lora_base_dtype): fp32, bf16, or
#: nf4 (QLoRA: 4-bit NormalFloat, blocks of 64 with an absmax constant each, double-quantised).
LORA_BASE_DTYPES = ("fp32", "bf16", "nf4")
#: How model states are split into params / grads / optimizer (engine.memory's docstring):
#: "pytorch" = what torch's AMP autocast, FSDP2 (fully_shard + MixedPrecisionPolicy) and
#: ZeroRedundancyOptimizer keep; "zero-paper" = Rajbhandari et al. 2020's split.
STATE_ACCOUNTINGS = ("pytorch", "zero-paper")

#: Bytes per element of each dtype name used above.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

#: Optimizer states per parameter (fp32 each), beside any master weights.
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}

#: Default gradient dtype for each precision when the file does not say.
DEFAULT_GRAD_DTYPE: dict[str, str] = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
