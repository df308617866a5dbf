"""The config's sections, every field declared with ``knob`` (``engine.config.knobs``), and what is read off the
declarations: ``KNOBS`` (every field by dotted path) and ``FIELD_RANGES`` (every numeric field's range)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass

from engine import names
from engine.config.knobs import _BANDWIDTH, _LATENCY, Knob, Range, knob

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    Ranges: the largest published models are Llama 3 405B (126 layers, hidden 16384, 128 heads, FFN
    53248), PaLM 540B (118 layers, hidden 18432, FFN 73728), Megatron 1T (hidden 25600); DeepSeek-V3 has
    256 routed experts of top-8 in 58 MoE blocks, and latent attention of kv 512, q 1536, rope 64, nope
    128, v 128."""

    layers: int = knob(
        doc="transformer blocks",
        range=Range(1, 1024, "DeepNet trained 1000 layers (Wang et al. 2022); LLMs stay under 200"),
        group="shape",
    )
    hidden: int = knob(
        doc="the residual stream's width (d_model)",
        range=Range(1, 131072, "5× the widest published dense model (Megatron-LM 1T, 25600)"),
        group="shape",
    )
    heads: int = knob(
        doc="query heads per block",
        range=Range(1, 4096, "32× Llama 3 405B's 128 query heads"),
        group="shape",
    )
    kv_heads: int = knob(
        doc="key/value heads per block (grouped-query attention when fewer than heads)",
        range=Range(1, 4096, "as model.heads (kv_heads divides heads)"),
        group="shape",
    )
    ffn_hidden: int = knob(
        doc="the MLP's inner width",
        range=Range(1, 1048576, "14× PaLM 540B's FFN (73728)"),
        group="shape",
    )
    vocab: int = knob(
        doc="vocabulary size: the embedding's and the head's rows",
        range=Range(1, 4194304, "16× the largest vocabularies in use (Gemma 256k, mT5 250k)"),
        group="shape",
    )
    seq_len: int = knob(
        doc="tokens per sequence",
        range=Range(1, 16777216, "1.6× the longest context released (Llama 4 Scout, 10M tokens)"),
        group="shape",
    )
    tied_embeddings: bool = knob(False, doc="the head reuses the input embedding's weight", group="shape")
    mlp: str = knob(
        "swiglu",
        doc="the MLP: gelu (two Linears) or swiglu (three, gated)",
        choices=names.MLP_KINDS,
        group="shape",
    )
    norm: str = knob("rmsnorm", doc="the normalisation: layernorm or rmsnorm", choices=names.NORM_KINDS, group="shape")
    attention: str = knob(
        "flash",
        doc="eager keeps the s×s scores for backward; flash recomputes them blockwise; mla is DeepSeek's latent attention",
        choices=names.ATTENTION_KINDS,
        group="shape",
    )
    position: str = knob(
        "rope",
        doc="rope (rotary, no weights) or learned (a position embedding)",
        choices=names.POSITION_KINDS,
        group="shape",
    )
    bias: bool = knob(False, doc="every Linear has a bias", group="shape")
    dropout: float = knob(
        0.0,
        doc="dropout probability after attention and MLP (0 = none)",
        range=Range(0, 1, "a probability; 1 would drop everything", hi_open=True),
        group="shape",
    )
    preset: str | None = knob(
        None,
        doc="the model preset the fields came from (assets/presets/models.toml)",
        group="source",
    )
    head_size: int = knob(
        0,
        doc="per-head width of q, k, v; 0 = hidden / heads (Qwen3 and gpt-oss set it)",
        range=Range(0, 65536, "heads are 64–256 wide (Gemma 256, MLA 192); 256× that", note="0 = hidden / heads"),
        group="attention",
    )
    qkv_bias: bool = knob(
        False,
        doc="biases on q, k and v only (Qwen2); model.bias puts one on every Linear",
        group="attention",
    )
    qk_norm: bool = knob(
        False,
        doc="RMSNorm over each head of q and of k (Qwen3): head_dim weights each",
        group="attention",
    )
    attention_sinks: bool = knob(False, doc="one learned sink logit per query head (gpt-oss)", group="attention")
    sliding_window: int = knob(
        0,
        doc="tokens a sliding-window layer attends to; 0 = full attention everywhere",
        range=Range(0, 16777216, "as model.seq_len (Mistral 4096, gpt-oss 128)", note="0 = no sliding window"),
        group="attention",
    )
    full_attention_every: int = knob(
        0,
        doc="with sliding_window: every N-th block attends fully; 0 = all slide",
        range=Range(0, 1024, "as model.layers (gpt-oss 2, Gemma 3 6)", note="0 = every block slides"),
        group="attention",
    )
    experts: int = knob(
        0,
        doc="routed experts per MoE block",
        range=Range(0, 1048576, "PEER (He 2024) routes over ~1M single-neuron experts; LLMs use 8–384", note="0 = dense"),
        group="mixture of experts",
    )
    experts_per_token: int = knob(
        1,
        doc="top-k routed experts per token",
        range=Range(1, 4096, "top-k: 1 (Switch) to 8 (DeepSeek-V3, Qwen3); at most model.experts"),
        group="mixture of experts",
    )
    expert_ffn_hidden: int = knob(
        0,
        doc="each expert's FFN width; 0 = ffn_hidden",
        range=Range(0, 1048576, "as model.ffn_hidden", note="0 = model.ffn_hidden"),
        group="mixture of experts",
    )
    shared_experts: int = knob(
        0,
        doc="always-on experts per MoE block, each of expert_ffn_hidden",
        range=Range(0, 4096, "DeepSeek-V3 has 1, DeepSeekMoE 16B 2, Qwen2-MoE 4 (as widths)"),
        group="mixture of experts",
    )
    dense_layers: int = knob(
        0,
        doc="leading blocks with the dense MLP (ffn_hidden) instead of experts",
        range=Range(0, 1024, "as model.layers (DeepSeek-V3 leads with 3 dense blocks)"),
        group="mixture of experts",
    )
    router_score: str = knob(
        "softmax",
        doc="how router logits become scores",
        choices=names.ROUTER_SCORES,
        group="mixture of experts",
    )
    router_bias: bool = knob(False, doc="the router Linear has a bias (gpt-oss)", group="mixture of experts")
    router_balance_bias: bool = knob(
        False,
        doc="aux-loss-free balancing bias per expert, a buffer (DeepSeek-V3)",
        group="mixture of experts",
    )
    norm_topk_prob: bool = knob(True, doc="the top-k scores are renormalised to sum to 1", group="mixture of experts")
    routed_scaling_factor: float = knob(
        1.0,
        doc="the routed experts' output is scaled by this (DeepSeek-V3: 2.5)",
        range=Range(0, 1e6, "DeepSeek-V3 scales routed outputs by 2.5", lo_open=True),
        group="mixture of experts",
    )
    router_aux_loss: float = knob(
        0.0,
        doc="coefficient of the load-balancing loss (Switch); 0 = none",
        range=Range(0, 1e3, "load-balancing coefficients in use are 1e-4 (DeepSeek-V3) to 0.02"),
        group="mixture of experts",
    )
    router_groups: int = knob(
        1,
        doc="group-limited routing: experts in this many groups (DeepSeek-V3: 8); 1 = none",
        range=Range(1, 1048576, "as model.experts (DeepSeek-V3: 8 groups of 32)", note="1 = no groups"),
        group="mixture of experts",
    )
    router_topk_groups: int = knob(
        1,
        doc="a token's experts come from its best this many groups (DeepSeek-V3: 4)",
        range=Range(1, 1048576, "as model.router_groups (DeepSeek-V3: 4)"),
        group="mixture of experts",
    )
    kv_lora_rank: int = knob(
        0,
        doc="the compressed KV latent",
        range=Range(0, 131072, "as model.hidden (DeepSeek-V3: 512)"),
        group="latent attention",
    )
    q_lora_rank: int = knob(
        0,
        doc="the compressed query latent; 0 = queries projected directly",
        range=Range(0, 131072, "as model.hidden (DeepSeek-V3: 1536)", note="0 = no query compression"),
        group="latent attention",
    )
    qk_rope_head_dim: int = knob(
        0,
        doc="rotary part of each q/k head (the rotary key is shared by all heads)",
        range=Range(0, 65536, "as model.head_size (DeepSeek-V3: 64)"),
        group="latent attention",
    )
    qk_nope_head_dim: int = knob(
        0,
        doc="non-rotary part of each q/k head",
        range=Range(0, 65536, "as model.head_size (DeepSeek-V3: 128)"),
        group="latent attention",
    )
    v_head_dim: int = knob(
        0,
        doc="each value head",
        range=Range(0, 65536, "as model.head_size (DeepSeek-V3: 128)"),
        group="latent attention",
    )
    hf_config: str | None = knob(
        None,
        doc="the Hugging Face config.json the fields came from (resolved path)",
        group="source",
    )

    @property
    def head_dim(self) -> int:
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_size or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        """True for a mixture of experts (some blocks route tokens to experts)."""
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Blocks with experts (after the ``dense_layers`` leading dense blocks); 0 when dense."""
        return max(0, self.layers - self.dense_layers) if self.experts > 0 else 0

    @property
    def expert_hidden(self) -> int:
        """Each expert's FFN width (``expert_ffn_hidden``, or ``ffn_hidden`` when 0)."""
        return self.expert_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has experts."""
        return self.experts > 0 and index >= self.dense_layers

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator kind. Units are in the field names.

    Ranges: B200 2250 dense bf16 TFLOP/s and 8 TB/s HBM, B300 / MI355X 288 GB; the wafer-scale Cerebras
    WSE-3 125 PFLOP/s and 21 PB/s of on-chip SRAM bandwidth."""

    name: str = knob(doc="the GPU kind (assets/presets/gpus.toml), or cpu for local CPU ranks", group="gpu")
    memory_gib: float = knob(
        doc="device memory",
        range=Range(0, 65536, "64 TiB: past any accelerator (288 GB) and any host's RAM for CPU " "ranks", lo_open=True),
        group="gpu",
    )
    peak_bf16_tflops: float = knob(
        doc="dense bf16 / fp16 tensor-core peak",
        range=Range(0, 1e6, "1 EFLOP/s per device: 8× a Cerebras WSE-3", lo_open=True),
        group="gpu",
    )
    peak_fp32_tflops: float = knob(
        doc="fp32 peak (what fp32 precision computes at)",
        range=Range(0, 1e6, "as peak_bf16_tflops", lo_open=True),
        group="gpu",
    )
    hbm_bandwidth_gb_per_s: float = knob(
        doc="device memory bandwidth (the optimizer step and elementwise work)",
        range=Range(0, 1e8, "100 PB/s: 5× a WSE-3's on-chip SRAM", lo_open=True),
        group="gpu",
    )
    runtime_context_gib: float = knob(
        0.5,
        doc="the CUDA / ROCm context, outside PyTorch's allocator",
        range=Range(0, 1024, "CUDA / ROCm contexts take 0.3–1 GiB"),
        group="gpu",
    )
    intra_node_bandwidth_gb_per_s: float = knob(
        300.0,
        doc="this GPU's link to the others of its node, per direction",
        range=_BANDWIDTH,
        group="gpu",
    )
    inter_node_bandwidth_gb_per_s: float = knob(
        25.0,
        doc="this GPU's share of its node's network, per direction",
        range=_BANDWIDTH,
        group="gpu",
    )
    peak_fp8_tflops: float = knob(
        0.0,
        doc="dense float8 tensor-core TFLOP/s (torch._scaled_mm); 0 = no float8 tensor cores (training.float8 refused)",
        range=Range(0, 1e6, "as peak_bf16_tflops (B200: 4500 dense)", note="0 = no float8 tensor cores: training.float8 is refused"),
        group="gpu",
    )

    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_gib * 2**30))

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for the compute dtype of ``precision``."""
        tflops = self.peak_fp32_tflops if precision == "fp32" else self.peak_bf16_tflops
        return tflops * 1e12


@dataclass(frozen=True)
class ClusterSpec:
    """The machines: a GPU kind, how many, how they are linked. Ranges: the largest training clusters
    announced hold ~200k GPUs (xAI Colossus)."""

    gpu: GPUSpec = knob(doc="the GPU kind: a preset name or a table of GPUSpec fields", group="cluster")
    gpus: int = knob(
        doc="GPUs (ranks) in the job",
        range=Range(1, 1048576, "5× the largest announced cluster (~200k GPUs)"),
        group="cluster",
    )
    gpus_per_node: int = knob(
        doc="GPUs per node: one NVLink / xGMI domain",
        range=Range(1, 1024, "NVL72 racks hold 72 GPUs in one NVLink domain, NVL576 576"),
        group="cluster",
    )
    intra_node_bandwidth_gb_per_s: float = knob(
        doc="link bandwidth between GPUs of a node, per GPU and direction",
        range=_BANDWIDTH,
        group="cluster",
    )
    intra_node_latency_us: float = knob(
        doc="latency of a collective step inside a node",
        range=_LATENCY,
        group="cluster",
    )
    inter_node_bandwidth_gb_per_s: float = knob(
        doc="network bandwidth between nodes, per GPU and direction",
        range=_BANDWIDTH,
        group="cluster",
    )
    inter_node_latency_us: float = knob(
        doc="latency of a collective step across nodes",
        range=_LATENCY,
        group="cluster",
    )
    preset: str | None = knob(
        None,
        doc="the cluster preset the fields came from (assets/presets/clusters.toml)",
        group="cluster",
    )
    cpu_wake_latency_us: float = knob(
        0.0,
        doc="local CPU ranks (gpu cpu) only: what a collective costs more, once a call (times its group's ranks per "
            "core; at every send), when a rank calls it after its own compute, as training does (gloo's threads and a "
            "shared core wake first; shardscope calibrate --links times calls both ways); calls queued back to back "
            "(async_op) pay it once",
        range=_LATENCY,
        group="cluster",
    )
    cpu_cores: int = knob(
        0,
        doc="physical cores local CPU ranks (gpu cpu) share; 0 = one core per rank",
        range=Range(0, 65536, "the largest single hosts have under 1000 cores", note="0 = one core per rank"),
        group="cluster",
    )

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.gpus / self.gpus_per_node))

    @property
    def intra_node_bytes_per_s(self) -> float:
        return self.intra_node_bandwidth_gb_per_s * 1e9

    @property
    def inter_node_bytes_per_s(self) -> float:
        return self.inter_node_bandwidth_gb_per_s * 1e9


@dataclass(frozen=True)
class ParallelSpec:
    """Parallel layout. Rank order is torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp]: TP
    innermost, then CP, then DP, then PP outermost (engine.pipeline.layout).

    Ranges: degrees are bounded by the cluster (dp, replicate) or by the model (tp divides heads,
    pp·virtual_stages ≤ layers), so their bounds are those fields' bounds."""

    dp: int = knob(
        1,
        doc="data-parallel degree (default: gpus / (tp·pp·cp))",
        range=Range(1, 1048576, "as cluster.gpus"),
        group="layout",
    )
    tp: int = knob(
        1,
        doc="tensor-parallel degree: every matmul split over tp GPUs",
        range=Range(1, 4096, "as model.heads (tp divides heads)"),
        group="layout",
    )
    pp: int = knob(
        1,
        doc="pipeline-parallel degree: the blocks split into pp·virtual_stages stages",
        range=Range(1, 90, "pp ≤ model.layers and pp·model.layers ≤ 8192 (the engine lays every pipeline " "rank's warm-up): 90 stages of 90 layers; Megatron-LM's 1T model ran 64 stages"),
        group="layout",
    )
    cp: int = knob(
        1,
        doc="context parallelism: the sequence split over cp ranks (torch's context_parallel, ring attention with head-tail load balancing: each rank holds chunks i and 2·cp−1−i of 2·cp); cp joins the FSDP shard group and the gradient reduction (dp·cp ranks hold the same parameters)",
        range=Range(1, 1048576, "as cluster.gpus (dp·cp·tp·pp = gpus; model.seq_len is divisible by 2·cp)"),
        group="layout",
    )
    cp_rotate: str = knob("allgather", doc="how K and V reach the other cp ranks (torch's set_rotate_method)", choices=names.CP_ROTATE_METHODS, group="layout")
    zero: int = knob(
        0,
        doc="ZeRO stage: 0 DDP, 1 optimizer states sharded, 2 and gradients, 3 and parameters (FSDP)",
        range=Range(0, max(names.ZERO_STAGES), "the ZeRO stages", note="0 (DDP), 1, 2, 3 (FSDP full shard)"),
        group="layout",
    )
    replicate: int = knob(
        1,
        doc="HSDP: data-parallel replicas; ZeRO shards over dp // replicate",
        range=Range(1, 1048576, "as cluster.gpus (replicate divides dp)"),
        group="layout",
    )
    sequence_parallel: bool = knob(
        False,
        doc="with tp: norms and dropout shard the sequence over the tp ranks",
        group="layout",
    )
    schedule: str = knob(
        "1F1B",
        doc="the pipeline schedule (torch.distributed.pipelining)",
        choices=names.SCHEDULES,
        group="layout",
    )
    virtual_stages: int = knob(
        1,
        doc="pipeline stages per rank (interleaved and V schedules)",
        range=Range(1, 512, "pp ≥ 2 whenever virtual_stages > 1, and pp·virtual_stages ≤ " "model.layers ≤ 1024"),
        group="layout",
    )
    microbatches: int = knob(
        1,
        doc="microbatches per step (gradient accumulation)",
        range=Range(1, 16384, "gradient accumulation: DeepSeek-V3's 15360-sequence batch on one " "replica; pp·virtual_stages·microbatches ≤ 16384 too (the step is simulated)"),
        group="layout",
    )
    dp_mode: str = knob(
        "ddp",
        doc="ddp: one process per GPU; dataparallel: legacy torch.nn.DataParallel, one process driving one node's GPUs",
        choices=names.DP_MODES,
        group="layout",
    )
    async_tp: bool = knob(
        False,
        doc="micro-pipelined TP collectives (torch's async TP: all-gather / reduce-scatter overlapped with the sequence-parallel matmuls; needs SP and torch.compile, as in torchtitan)",
        group="layout",
    )
    fsdp_reshard_after_forward: str = knob(
        "default",
        doc="ZeRO-3: free the gathered parameters after forward: default (torchtitan's: not under pipelining), always, never",
        choices=names.RESHARD_POLICIES,
        group="layout",
    )
    pipeline_split: str = knob(
        "even",
        doc="how the blocks fall on the stages: even, or torchtitan's (the embedding and the norm + head weigh a "
            "block each)",
        choices=names.PIPELINE_SPLITS,
        group="layout",
    )
    ep: int = knob(
        1,
        doc="expert parallel (torchtitan's expert_parallel_degree): each MoE layer's experts split over ep ranks of the dense region dp_shard·cp·tp, which the sparse region lays out as efsdp·ep",
        range=Range(1, 1048576, "as model.experts (ep divides the experts of each MoE block)"),
        group="layout",
    )

    @property
    def expert_shard_degree(self) -> int:
        """efsdp: the FSDP degree of expert weights, dp_shard·cp·tp / ep (torchtitan's ParallelDims)."""
        return self.dp // self.replicate * self.cp * self.tp // self.ep  # shard_degree already holds cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: dp·cp (the CP
        ranks of a sequence see different tokens of it, so their gradients are summed too)."""
        return self.dp * self.cp

    @property
    def shard_degree(self) -> int:
        """The degree ZeRO/FSDP divides by: (dp/replicate)·cp — torchtitan's dp_shard_cp mesh
        (dp·cp for plain sharding; HSDP replicates over ``replicate``)."""
        return self.dp // self.replicate * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages


@dataclass(frozen=True)
class TrainingSpec:
    """How the job trains: micro-batch, precision, optimizer, recomputation, float8, compile, LoRA."""

    micro_batch_size: int = knob(
        1,
        doc="sequences per microbatch on one rank",
        range=Range(1, 65536, "the largest batches trained (LAMB's 64k sequences) on one rank"),
        group="training",
    )
    precision: str = knob(
        "bf16-mixed",
        doc="fp32, or mixed precision with bf16 / fp16 compute and fp32 master weights",
        choices=names.PRECISIONS,
        group="training",
    )
    grad_dtype: str = knob(
        "bf16",
        doc="the dtype gradients are reduced in (with fp32 precision fp32; defaults follow the precision)",
        choices=names.GRAD_DTYPES,
        group="training",
    )
    optimizer: str = knob(
        "adamw",
        doc="adamw (two states per parameter), sgd-momentum (one), sgd (none)",
        choices=names.OPTIMIZERS,
        group="training",
    )
    recompute: str = knob(
        "none",
        doc="activation recomputation: what the backward computes again instead of keeping",
        choices=names.RECOMPUTE_KINDS,
        group="training",
    )
    recompute_every: int = knob(
        2,
        doc='"selective-layer": every N-th block is checkpointed (torchtitan\'s "2")',
        range=Range(1, 1024, "as model.layers (checkpoint every N-th block)"),
        group="training",
    )
    float8: str = knob(
        "none",
        doc="torchao float8 training of the Linear layers (bf16-mixed, a GPU with float8 tensor cores)",
        choices=names.FLOAT8_KINDS,
        group="training",
    )
    float8_all_gather: bool = knob(
        False,
        doc="FSDP2 all-gathers float8 weights (tensorwise scaling only)",
        group="training",
    )
    compile: bool = knob(False, doc="torch.compile per block (inductor)", group="training")
    finetune: str = knob(
        "full",
        doc="full fine-tuning, or LoRA: the base weights frozen, adapters B·A trained on lora_targets",
        choices=names.FINETUNE_KINDS,
        group="training",
    )
    lora_rank: int = knob(
        16,
        doc="LoRA: the adapters' rank r",
        range=Range(1, 131072, "as model.hidden (a rank beyond the adapted dimension is refused too)"),
        group="training",
    )
    lora_alpha: float = knob(
        32.0,
        doc="LoRA: the adapter output is scaled by lora_alpha / lora_rank",
        range=Range(0, 1e6, "alphas in use are 8–512; rsLoRA-style scales stay far below", lo_open=True, note="the adapter scale is alpha / rank"),
        group="training",
    )
    lora_targets: str = knob(
        "all",
        doc="LoRA: which Linears get adapters",
        choices=names.LORA_TARGETS,
        group="training",
    )
    lora_base_dtype: str = knob(
        "fp32",
        doc="storage of the frozen base: fp32 | bf16 | nf4 (QLoRA); under mixed precision an fp32 base is cast anew by "
            "every forward and each frozen matmul saves its 16-bit cast for the backward (activations, per "
            "microbatch in flight)",
        choices=names.LORA_BASE_DTYPES,
        group="training",
    )

    @property
    def lora(self) -> bool:
        return self.finetune == "lora"

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameter copy used for compute."""
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        return names.DTYPE_BYTES[self.grad_dtype]

    @property
    def master_weights(self) -> bool:
        """Mixed precision keeps an fp32 master copy (counted in ``optimizer``)."""
        return self.precision != "fp32"


@dataclass(frozen=True)
class Conventions:
    """The conventions that tools in this field silently disagree on, made switchable."""

    runtime_context: bool = knob(True, doc="count the GPU kind's runtime context in `overhead`", group="conventions")
    collective_buffers: bool = knob(True, doc="count collective-library buffers per communicator", group="conventions")
    collective_buffer_mib: float = knob(
        64.0,
        doc="per communicator a rank belongs to (NCCL-like)",
        range=Range(0, 65536, "NCCL keeps NCCL_BUFFSIZE (4 MiB) per channel and peer: " "tens to hundreds of MiB per communicator"),
        group="conventions",
    )
    allocator_slack_fraction: float = knob(
        0.0,
        doc="a floor on the caching allocator's reserve, as a fraction of the tracked bytes at the peak (reserved = max(the replayed allocator's reserve, allocated × (1 + it)); never added to the replay)",
        range=Range(0, 1, "a fraction of live tensors", hi_open=True),
        group="conventions",
    )
    expandable_segments: bool = knob(
        False,
        doc="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch's default is off): the replayed caching allocator grows one segment per stream instead of caching fixed-size segments",
        group="conventions",
    )
    ddp_bucket_mb: float = knob(
        25.0,
        doc="DDP's bucket_cap_mb",
        range=Range(0, 4194304, "one bucket for every fp32 gradient of a 1T model is 4e6 MB", lo_open=True),
        group="conventions",
    )
    ddp_gradient_as_bucket_view: bool = knob(
        False,
        doc="DDP gradients alias the buckets (no separate bucket copy)",
        group="conventions",
    )
    pipeline_outputs: str = knob(
        "released",
        doc="what a pipeline's last stage keeps of each microbatch's output (its logits): 'released' at the end of "
            "the microbatch's backward (the training loop calls step(return_outputs=False): torchtitan ≥ 0.2.1), "
            "or 'kept' to the step's end and merged by step() (its default, return_outputs=True: torchtitan ≤ 0.2.0)",
        choices=names.PIPELINE_OUTPUTS,
        group="conventions",
    )
    fsdp_prefetch: bool = knob(
        True,
        doc="FSDP holds the next unit unsharded while computing this one (the zero-paper accounting; FSDP2 under "
            "pipelining). Unpipelined, FSDP2's prefetch is the next unit's all-gather output beside the current unit, "
            "which a unit's own gather holds as much of at its copy-out: the same bytes either way",
        group="conventions",
    )
    bubble: str = knob(
        "share-of-total",
        doc="how the pipeline bubble is stated: idle over makespan × ranks, or idle over busy (Narayanan 2021)",
        choices=names.BUBBLE_CONVENTIONS,
        group="conventions",
    )
    compute_efficiency: float = knob(
        0.5,
        doc="achieved / peak FLOP/s for analytic durations (clock = efficiency: one fudge for every FLOP)",
        range=Range(0, 1, "achieved / peak FLOP/s", lo_open=True),
        group="conventions",
    )
    clock: str = knob(
        "ops",
        doc="how compute is timed: each op of the blocks as a roofline on the GPU kind's device profile "
            "(assets/presets/devices.toml; the cpu's as shardscope calibrate --device measured it), or 'efficiency': "
            "every FLOP at compute_efficiency × the peak (one fudge for every kernel)",
        choices=names.CLOCKS,
        group="conventions",
    )
    rms_norm: str = knob(
        "fused",
        doc="the kernels an eager RMSNorm runs, for the clock from ops (compiled blocks fuse every norm into one kernel; "
            "memory does not read it)",
        choices=names.RMS_NORMS,
        group="conventions",
    )
    state_accounting: str = knob(
        "pytorch",
        doc="how model states split into params / grads / optimizer",
        choices={"pytorch": "what torch's autocast / FSDP2 / ZeroRedundancyOptimizer keep", "zero-paper": "the ZeRO paper's 2 + 2 + 12 bytes per parameter split"},
        group="conventions",
    )
    moe_imbalance: float = knob(
        1.0,
        doc="tokens routed to the busiest expert (and so its rank) over the mean tokens·top_k / experts; 1 = balanced",
        range=Range(1, 1048576, "the busiest expert's tokens over the mean; at most model.experts " "(every token to one expert)", note="1 = balanced"),
        group="conventions",
    )
    moe_capacity_factor: float = knob(
        0.0,
        doc="GShard / Switch capacity: each expert takes at most this × the mean and drops the rest; 0 = dropless",
        range=Range(0, 1048576, "GShard and Switch use 1.0–2.0", note="0 = dropless"),
        group="conventions",
    )
    moe_expert_load: tuple = knob(
        (),
        doc="A measured load: the fraction of the routed token copies each expert receives (one list for every MoE block, model.experts long, summing to 1; a run's records give it). Each EP rank then computes n·k·ep × the sum of its experts' fractions (experts laid out contiguously over the ep ranks). Empty = moe_imbalance (balanced by default). Or one such list per MoE block (in block order), or per microbatch one list per MoE block (microbatches in order): a run's routing differs block by block and microbatch by microbatch, and the activations alive at the peak follow the microbatches in flight then.",
        group="conventions",
    )

    def __post_init__(self) -> None:
        if isinstance(self.moe_expert_load, list):
            object.__setattr__(self, "moe_expert_load", _deep_tuple(self.moe_expert_load))


def _deep_tuple(x):
    """Lists (nested) as tuples, so a Conventions stays hashable and frozen."""
    return tuple(_deep_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


_SECTIONS = ("model", "cluster", "parallel", "training", "conventions")


def _declared(cls: type, prefix: str) -> dict[str, Knob]:
    """Every field of ``cls`` with its Knob, by dotted path (a nested section's fields after its own)."""
    own, nested = {}, {}
    for f in dataclasses.fields(cls):
        if f.name == "gpu" and cls is ClusterSpec:
            nested.update(_declared(GPUSpec, f"{prefix}.gpu"))
        own[f"{prefix}.{f.name}"] = f.metadata["knob"]
    return {**own, **nested}


#: Every field of a Config (dotted path as in the file) and its declaration, in section order.
KNOBS: dict[str, Knob] = {k: v for section, cls in (("model", ModelSpec), ("cluster", ClusterSpec),
                                                    ("parallel", ParallelSpec), ("training", TrainingSpec),
                                                    ("conventions", Conventions))
                          for k, v in _declared(cls, section).items()}


#: Every numeric field's allowed values, read off the declarations. ``check`` enforces them, the tests
#: read them; each is generous — several times the largest real model or cluster — and only there to
#: turn a typo (layers = 1000000000) into an error instead of a prediction that never returns.
#: ``schema_version`` is exact (SCHEMA_VERSION), not a range.
FIELD_RANGES: dict[str, Range] = {k: v.range for k, v in KNOBS.items() if v.range is not None}


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    """Each dataclass field's type (Optional unwrapped); cached: the classes never change, and
    ``typing.get_type_hints`` is slow enough to dominate a slider move when asked per field."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        h = hints[f.name]
        args = [a for a in typing.get_args(h) if a is not type(None)]
        out[f.name] = tuple if typing.get_origin(h) is tuple else (args[0] if args else h)
    return out
