"""The one description of a training job that engine, backend and GUI share.

A :class:`Config` is frozen and always valid: constructing one with values that break
a rule raises :class:`ConfigError`, which lists *every* problem at once, each naming
the field, the value and what is allowed. Files (TOML or JSON) are read with the
standard library's ``tomllib`` / ``json``; loading never executes anything.

File format (the product's public contract; keys may be added, never renamed)::

    schema_version = 1
    [model]      preset, hf_config, layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq_len,
                 tied_embeddings, mlp, norm, attention ("eager" | "flash" | "mla"), position,
                 bias, dropout, head_size (0 = hidden / heads), qkv_bias, qk_norm, attention_sinks,
                 sliding_window (0 = none), full_attention_every (0 = every layer slides)
                 mixture of experts (experts = 0: a dense model): experts, experts_per_token,
                 expert_ffn_hidden (0 = ffn_hidden), shared_experts, dense_layers,
                 router_score ("softmax" | "sigmoid"), router_bias, router_balance_bias,
                 norm_topk_prob, routed_scaling_factor, router_aux_loss, router_groups,
                 router_topk_groups
                 multi-head latent attention (attention = "mla"): kv_lora_rank,
                 q_lora_rank (0 = no query compression), qk_rope_head_dim, qk_nope_head_dim,
                 v_head_dim
    [cluster]    preset, gpu (a preset name or a table), gpus, gpus_per_node,
                 intra_node_bandwidth_gb_per_s, intra_node_latency_us,
                 inter_node_bandwidth_gb_per_s, inter_node_latency_us, cpu_cores
    [parallel]   dp, tp, pp, cp, cp_rotate ("allgather" | "alltoall"), zero (or fsdp =
                 "FULL_SHARD" | ...), replicate,
                 sequence_parallel, schedule, virtual_stages, microbatches,
                 dp_mode ("ddp" | "dataparallel": legacy single-process nn.DataParallel),
                 async_tp, fsdp_reshard_after_forward ("default" | "always" | "never"),
                 pipeline_split ("even" | "torchtitan"),
                 ep (expert parallel: the experts of each MoE layer split over ep ranks)
    [training]   micro_batch_size, precision, grad_dtype, optimizer, recompute ("none" |
                 "selective" | "full" | "selective-op" | "selective-layer"), recompute_every,
                 float8 ("none" | "tensorwise" | "rowwise"), float8_all_gather, compile,
                 finetune ("full" | "lora"), lora_rank, lora_alpha,
                 lora_targets ("attention" | "mlp" | "all"), lora_base_dtype ("fp32" | "bf16" | "nf4")
    [conventions] the switchable conventions (overhead lines, bucket size, bubble,
                 moe_imbalance, moe_capacity_factor, moe_expert_load (a list of floats), ...)

``model.hf_config`` names a Hugging Face ``config.json`` (relative to the config file, or
absolute; engine.model.hf_config reads it): its architecture fills the model fields, and any field
given beside it in [model] overrides it.

Every numeric field has a documented range (``FIELD_RANGES``: the bound and where it comes
from); a value outside it is a problem that names the field and the range.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from assets import PRESETS_DIR
from engine import names
from engine.model.hf_config import HFConfigError, read_hf_config
from engine.model.presets import cluster_presets, gpu_presets, model_presets
from engine.pipeline.layout import split_layers

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the field (dotted path), its value, and why."""

    field: str
    value: Any
    message: str

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 80:  # a 400-digit number or a pasted file: its ends say enough
            shown = f"{shown[:40]}…{shown[-12:]} ({len(shown)} characters)"
        return f"{self.field} = {shown}: {self.message}"


class ConfigError(ValueError):
    """A config that breaks one or more rules. ``problems`` lists every one of them."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")

    def fields(self) -> set[str]:
        return {p.field for p in self.problems}


# --------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric field: ``lo … hi``, either end open or closed.

    ``source`` says where the bound comes from; ``note`` is added to the error message.
    """

    lo: float
    hi: float
    source: str
    lo_open: bool = False  # the value must be greater than lo (lo itself is not allowed)
    hi_open: bool = False  # the value must be less than hi
    note: str = ""

    def contains(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below  # False for NaN

    def describe(self) -> str:
        lo = f"greater than {_num(self.lo)}" if self.lo_open else _num(self.lo)
        hi = f"less than {_num(self.hi)}" if self.hi_open else _num(self.hi)
        return f"{lo} … {hi}"

    def message(self, value: float) -> str:
        """``allowed: lo … hi`` and which end the value breaks (nothing more for NaN)."""
        if self.lo_open and not value > self.lo:
            hint = f"must be greater than {_num(self.lo)}"
        elif not self.lo_open and value < self.lo:
            hint = f"must be at least {_num(self.lo)}"
        elif self.hi_open and not value < self.hi:
            hint = f"must be less than {_num(self.hi)}"
        elif not self.hi_open and value > self.hi:
            hint = f"must be at most {_num(self.hi)}"
        else:
            hint = "must be a finite number"
        note = f" ({self.note})" if self.note else ""
        return f"allowed: {self.describe()}; {hint}{note}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


_ONE_SECOND_US = 1e6
_BANDWIDTH = Range(0, 1e5, "NVLink 5 moves 900 GB/s per GPU and direction, an 8×800 Gb/s node 100 GB/s per GPU: "
                   "100 TB/s is 100× the fastest link", lo_open=True)
_LATENCY = Range(0, _ONE_SECOND_US, "a round trip across continents is ~100 ms (1e5 µs): one second is 10× that")


# --------------------------------------------------------------------------- knobs: each field declared once


_NO_DEFAULT = dataclasses.MISSING


@dataclass(frozen=True)
class Knob:
    """What a config field is, declared with it (``knob``): its one-line doc, its allowed values (a
    numeric ``range`` with the reason for its bounds, or string ``choices``, a tuple or a mapping of
    each value to what it means) and its ``group`` within its section. Validation, its messages, the
    README's field reference and the window read these."""

    doc: str
    range: Range | None = None
    choices: tuple[str, ...] | dict[str, str] | None = None
    group: str = ""

    def allowed(self) -> str:
        """The choices as the error messages and the reference write them: ``a | b`` (``a (what a means)``)."""
        if isinstance(self.choices, dict):
            return " | ".join(f"{k} ({v})" for k, v in self.choices.items())
        return " | ".join(sorted(self.choices) if isinstance(self.choices, frozenset) else self.choices or ())


def knob(default: Any = _NO_DEFAULT, *, doc: str, range: Range | None = None,
         choices: tuple[str, ...] | dict[str, str] | None = None, group: str = "") -> Any:
    """A dataclass field with its :class:`Knob` (``field(default=..., metadata={"knob": ...})``)."""
    meta = {"knob": Knob(doc, range, choices, group)}
    return field(metadata=meta) if default is _NO_DEFAULT else field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections


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
        doc="storage of the frozen base: fp32 | bf16 | nf4 (QLoRA)",
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
    fsdp_prefetch: bool = knob(
        True,
        doc="FSDP holds the next unit unsharded while computing this one",
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
        doc="achieved / peak FLOP/s for analytic durations",
        range=Range(0, 1, "achieved / peak FLOP/s", lo_open=True),
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


@dataclass(frozen=True)
class Config:
    """A whole training job. Always valid: construction checks every rule."""

    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    conventions: Conventions = field(default_factory=Conventions)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        problems = check(self.model, self.cluster, self.parallel, self.training, self.conventions)
        if self.schema_version != SCHEMA_VERSION:
            problems.append(
                Problem("schema_version", self.schema_version, f"allowed: {SCHEMA_VERSION}")
            )
        if problems:
            raise ConfigError(problems)

    # ----------------------------------------------------------------- derived

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.parallel.dp * self.parallel.microbatches * self.training.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.seq_len

    @property
    def local_seq_len(self) -> int:
        """Tokens of one sequence on one rank: model.seq_len / parallel.cp (context parallelism splits
        the sequence; every op outside attention sees only these)."""
        return self.model.seq_len // self.parallel.cp

    # ----------------------------------------------------------------- changing

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A new, validated Config with some fields changed: ``cfg.replace(parallel={"tp": 2})``.

        Raises ConfigError (naming every field at fault) if the result is invalid.
        """
        unknown = set(sections) - set(_SECTIONS)
        if unknown:
            raise ConfigError(
                [Problem(k, None, f"unknown section; allowed: {', '.join(_SECTIONS)}") for k in sorted(unknown)]
            )
        changed = {}
        problems: list[Problem] = []
        for name, updates in sections.items():
            current = getattr(self, name)
            allowed = {f.name for f in dataclasses.fields(current)}
            for key in updates:
                if key not in allowed:
                    problems.append(
                        Problem(f"{name}.{key}", updates[key], f"unknown key; allowed: {', '.join(sorted(allowed))}")
                    )
            if not problems:
                changed[name] = dataclasses.replace(current, **updates)
        if problems:
            raise ConfigError(problems)
        return dataclasses.replace(self, **changed)

    # ----------------------------------------------------------------- files

    @classmethod
    def from_dict(cls, raw: dict[str, Any], base_dir: str | Path | None = None) -> Config:
        """Parse and validate ``raw``; relative paths in it (model.hf_config) are taken from
        ``base_dir`` (the working directory when None)."""
        return _parse(raw, Path(base_dir) if base_dir is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return _unparse(self)

    @classmethod
    def load(cls, path: str | Path) -> Config:
        """Read a ``.toml`` or ``.json`` file. Errors name the file and every problem."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([Problem("file", str(path), f"cannot be read: {exc.strerror or exc}")]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError([Problem("file", str(path), f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                                       f"offset {exc.start}): save it as UTF-8")]) from None
        except ValueError as exc:  # a path with a NUL character
            raise ConfigError([Problem("file", str(path), f"cannot be read: {exc}")]) from None
        if path.suffix.lower() == ".json":
            return cls.loads_json(text, base_dir=path.parent)
        return cls.loads_toml(text, base_dir=path.parent)

    @classmethod
    def loads_toml(cls, text: str, base_dir: str | Path | None = None) -> Config:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([Problem("file", None, f"is not valid TOML: {exc}")]) from None
        except RecursionError:
            raise ConfigError([Problem("file", None, "is nested too deeply to be a config")]) from None
        return cls.from_dict(raw, base_dir)

    @classmethod
    def loads_json(cls, text: str, base_dir: str | Path | None = None) -> Config:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError([Problem("file", None, f"is not valid JSON: {exc}")]) from None
        except RecursionError:
            raise ConfigError([Problem("file", None, "is nested too deeply to be a config")]) from None
        if not isinstance(raw, dict):
            raise ConfigError([Problem("file", None, "must hold a JSON object at the top level")])
        return cls.from_dict(raw, base_dir)

    def dumps_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    def dumps_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write as TOML or JSON by the file's suffix, atomically (write, then rename)."""
        path = Path(path)
        text = self.dumps_json() if path.suffix.lower() == ".json" else self.dumps_toml()
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        except BaseException:  # a full or read-only disk leaves nothing behind
            tmp.unlink(missing_ok=True)
            raise
        return path


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


@functools.lru_cache(maxsize=1)
def _range_paths() -> tuple[tuple[str, str, tuple[str, ...], str, Range], ...]:
    """FIELD_RANGES split once: (path, section, attributes down to the field's owner, field, range)."""
    out = []
    for path, rng in FIELD_RANGES.items():
        section, *middle, key = path.split(".")
        out.append((path, section, tuple(middle), key, rng))
    return tuple(out)


def _check_ranges(p: list[Problem], sections: dict[str, Any]) -> set[str]:
    """Every field of FIELD_RANGES inside its range (and of its type); returns the fields at fault."""
    bad: set[str] = set()
    for path, section, middle, key, rng in _range_paths():
        obj = sections[section]
        for name in middle:
            obj = getattr(obj, name)
        value = getattr(obj, key)
        integer = _field_types(type(obj))[key] is int
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            p.append(Problem(path, value, f"must be {'an integer' if integer else 'a number'}; allowed: {rng.describe()}"))
            bad.add(path)
        elif not rng.contains(value):
            p.append(Problem(path, value, rng.message(value)))
            bad.add(path)
    return bad


# --------------------------------------------------------------------------- rules


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choice(problems: list[Problem], path: str, value: Any) -> None:
    """``value`` among the choices ``path`` declares (``KNOBS``), or a problem that lists them."""
    k = KNOBS[path]
    if value not in k.choices:
        problems.append(Problem(path, value, f"allowed: {k.allowed()}"))


def check(
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    training: TrainingSpec,
    conventions: Conventions,
) -> list[Problem]:
    """Every rule a Config must satisfy. Returns all problems found (empty when valid).

    Every numeric field first meets its range in ``FIELD_RANGES``; the rules between fields
    (divisibility, degrees multiplying to the GPU count, ...) run on the fields that did.
    """
    p: list[Problem] = []
    out_of_range = _check_ranges(p, {"model": model, "cluster": cluster, "parallel": parallel, "training": training,
                                     "conventions": conventions})
    ok_model = not any(f"model.{k}" in out_of_range for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden",
                                                              "vocab", "seq_len"))
    _check_model(p, model, parallel, training, conventions, out_of_range, ok_model)
    ok_cluster = "cluster.gpus" not in out_of_range and "cluster.gpus_per_node" not in out_of_range
    if ok_cluster and cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        p.append(
            Problem(
                "cluster.gpus",
                cluster.gpus,
                f"must be a multiple of cluster.gpus_per_node ({cluster.gpus_per_node}) when it spans nodes",
            )
        )
    ok_par = not any(f"parallel.{k}" in out_of_range for k in ("dp", "tp", "pp", "cp", "virtual_stages",
                                                               "microbatches", "replicate", "zero"))
    _check_parallel(p, model, cluster, parallel, ok_model=ok_model, ok_cluster=ok_cluster, ok_par=ok_par)
    _check_dp_mode(p, cluster, parallel, ok_cluster)
    _check_training(p, model, cluster, parallel, training)
    c = conventions
    _choice(p, "conventions.bubble", c.bubble)
    _choice(p, "conventions.state_accounting", c.state_accounting)
    return p


def _check_model(p: list[Problem], model: ModelSpec, parallel: ParallelSpec, training: TrainingSpec,
                 conventions: Conventions, out_of_range: set, ok_model: bool) -> None:
    """The model's own rules: head widths, the kinds it names, its experts and latent attention."""
    if ok_model:
        if model.hidden % model.heads and not model.head_size and model.attention != "mla":
            p.append(Problem("model.hidden", model.hidden, f"must be a multiple of model.heads ({model.heads}) "
                             "unless model.head_size gives the head width"))
        if model.heads % model.kv_heads:
            p.append(
                Problem(
                    "model.kv_heads",
                    model.kv_heads,
                    f"must divide model.heads ({model.heads}); allowed: {', '.join(map(str, _divisors(model.heads)))}",
                )
            )
    _choice(p, "model.mlp", model.mlp)
    _choice(p, "model.norm", model.norm)
    _choice(p, "model.attention", model.attention)
    _choice(p, "model.position", model.position)
    _check_moe(p, model, parallel, conventions, out_of_range)
    _check_mla(p, model, out_of_range)
    _check_moe_combinations(p, model, parallel, training)


def _check_parallel(p: list[Problem], model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *, ok_model: bool,
                    ok_cluster: bool, ok_par: bool) -> None:
    """The layout's rules: its degrees multiply to the GPU count and divide what they shard."""
    _choice(p, "parallel.schedule", par.schedule)
    _choice(p, "parallel.cp_rotate", par.cp_rotate)
    if ok_par and ok_cluster and par.world_size != cluster.gpus:
        if par.cp == 1:
            what = f"dp·tp·pp = {par.dp}·{par.tp}·{par.pp}"
        else:
            what = f"dp·cp·tp·pp = {par.dp}·{par.cp}·{par.tp}·{par.pp}"
        p.append(Problem("parallel.dp", par.dp, f"{what} = {par.world_size} must equal cluster.gpus ({cluster.gpus})"))
    if not (ok_par and ok_model):
        return
    _check_context_parallel(p, model, par)
    bad = [f"model.{k} ({getattr(model, k)})" for k in ("heads", "kv_heads", "ffn_hidden")
           if getattr(model, k) % par.tp]
    if bad:
        allowed = [t for t in _divisors(math.gcd(model.heads, model.kv_heads, model.ffn_hidden))]
        p.append(
            Problem("parallel.tp", par.tp,
                    f"must divide {', '.join(bad)}; allowed: {', '.join(map(str, allowed))}")
        )
    if par.sequence_parallel and par.tp == 1:
        p.append(Problem("parallel.sequence_parallel", True, "needs parallel.tp > 1"))
    elif par.sequence_parallel and par.cp == 1 and model.seq_len % par.tp:
        p.append(
            Problem("parallel.sequence_parallel", True,
                    f"needs model.seq_len ({model.seq_len}) to be a multiple of parallel.tp ({par.tp})")
        )
    elif par.sequence_parallel and par.cp > 1 and model.seq_len % (par.cp * par.tp):
        p.append(
            Problem("parallel.sequence_parallel", True,
                    f"shards each context-parallel rank's {model.seq_len}/{par.cp} tokens over tp: needs "
                    f"model.seq_len ({model.seq_len}) to be a multiple of cp·tp ({par.cp}·{par.tp})")
        )
    if par.dp % par.replicate:
        p.append(Problem("parallel.replicate", par.replicate,
                         f"must divide parallel.dp ({par.dp}); allowed: {', '.join(map(str, _divisors(par.dp)))}"))
    elif par.replicate > 1 and par.zero not in (2, 3):
        p.append(Problem("parallel.replicate", par.replicate,
                         "HSDP replication needs parallel.zero = 2 or 3 (a sharded strategy)"))
    _check_pipeline(p, model, par)
    if par.pipeline_split == "torchtitan" and par.pp > 1 and not any(q.field.startswith("parallel.") for q in p):

        try:
            split_layers(model.layers, par.num_stages, "torchtitan")
        except ValueError as exc:
            p.append(Problem("parallel.pipeline_split", par.pipeline_split,
                             f"{exc}: needs model.layers ≥ 2·(pp·virtual_stages) − 2 or so; allowed: even"))


def _check_dp_mode(p: list[Problem], cluster: ClusterSpec, par: ParallelSpec, ok_cluster: bool) -> None:
    """Legacy nn.DataParallel: one process, one node, data parallelism alone."""
    _choice(p, "parallel.dp_mode", par.dp_mode)
    if par.dp_mode != "dataparallel":
        return
    bad = [f"{k} = {getattr(par, k)}" for k, ok in (("tp", 1), ("pp", 1), ("cp", 1), ("zero", 0),
                                                     ("replicate", 1))
           if getattr(par, k) != ok]
    if bad:
        p.append(Problem("parallel.dp_mode", par.dp_mode,
                         "legacy nn.DataParallel replicates one process's model over the GPUs of one node; it "
                         "needs parallel.tp = 1, parallel.pp = 1, parallel.cp = 1, parallel.zero = 0, "
                         "parallel.replicate = 1 "
                         f"(got {', '.join('parallel.' + b for b in bad)}); use dp_mode = \"ddp\" for these layouts"))
    if ok_cluster and cluster.gpus > cluster.gpus_per_node:
        p.append(Problem("parallel.dp_mode", par.dp_mode,
                         f"nn.DataParallel runs in one process on one node: cluster.gpus ({cluster.gpus}) must "
                         f"not exceed cluster.gpus_per_node ({cluster.gpus_per_node})"))


def _check_training(p: list[Problem], model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec,
                    t: TrainingSpec) -> None:
    """The training's rules: the kinds it names, torchtitan's knobs, float8 on a GPU that has it, the
    gradients' dtype under its precision, LoRA."""
    _choice(p, "training.precision", t.precision)
    _choice(p, "training.optimizer", t.optimizer)
    _choice(p, "training.recompute", t.recompute)
    _check_torchtitan_knobs(p, par, t)
    fp8 = cluster.gpu.peak_fp8_tflops
    if t.float8 in ("tensorwise", "rowwise") and isinstance(fp8, (int, float)) and not fp8 > 0:
        p.append(Problem("training.float8", t.float8,
                         f"cluster.gpu {cluster.gpu.name!r} has no float8 tensor cores (peak_fp8_tflops = "
                         f"{cluster.gpu.peak_fp8_tflops:g}): float8 training needs one that has (H100, H200, B200, "
                         "MI300X, RTX 4090); allowed on this GPU: none"))
    allowed_grads = {"fp32": ("fp32",), "bf16-mixed": ("bf16", "fp32"), "fp16-mixed": ("fp16", "fp32")}
    if t.precision in allowed_grads and t.grad_dtype not in allowed_grads[t.precision]:
        p.append(Problem("training.grad_dtype", t.grad_dtype,
                         f"with precision {t.precision!r} allowed: {' | '.join(allowed_grads[t.precision])}"))
    _check_lora(p, model, par, t)


def _check_context_parallel(p: list[Problem], model: ModelSpec, par: ParallelSpec) -> None:
    """Context parallelism: torch's head-tail load balancing cuts the sequence into 2·cp chunks."""
    if par.cp == 1:
        return
    if model.seq_len % (2 * par.cp):
        ok = [c for c in _divisors(model.seq_len // 2) if c > 1] if model.seq_len % 2 == 0 else []
        p.append(Problem("parallel.cp", par.cp,
                         f"needs model.seq_len ({model.seq_len}) divisible by 2·cp = {2 * par.cp} (torch's head-tail "
                         "load balancing gives each rank chunks i and 2·cp−1−i of 2·cp); allowed: 1"
                         + (f", {', '.join(map(str, ok[:12]))}" if ok else "")))
    if model.attention == "eager" and par.cp_rotate == "alltoall":
        p.append(Problem("parallel.cp_rotate", par.cp_rotate,
                         "the ring (alltoall) runs inside torch's fused SDPA kernels, blockwise; eager attention "
                         "materialises its scores against every key: needs model.attention = 'flash'; allowed with "
                         "eager attention: allgather"))
    if par.zero == 1:
        p.append(Problem("parallel.cp", par.cp,
                         "context parallelism reduces gradients over dp·cp as torchtitan does, with FSDP's "
                         "dp_shard_cp mesh or DDP; ZeRO-1 (ZeroRedundancyOptimizer) is not composed with it: "
                         "needs parallel.zero = 0, 2 or 3; allowed with zero = 1: 1"))


def _check_moe(p: list[Problem], model: ModelSpec, par: ParallelSpec, conv: Conventions, bad: set[str]) -> None:
    """Mixture of experts and expert parallelism (torchtitan's ParallelDims: ep divides dp_shard·cp·tp)."""
    _choice(p, "model.router_score", model.router_score)
    for key in ("qkv_bias", "qk_norm", "attention_sinks", "router_bias", "router_balance_bias", "norm_topk_prob"):
        if not isinstance(getattr(model, key), bool):
            p.append(Problem(f"model.{key}", getattr(model, key), "allowed: true | false"))
    fields = ("experts", "experts_per_token", "expert_ffn_hidden", "shared_experts", "dense_layers", "layers",
              "ffn_hidden")
    if any(f"model.{k}" in bad for k in fields) or "parallel.ep" in bad or "parallel.tp" in bad:
        return
    e, k = model.experts, model.experts_per_token
    if e == 0:
        if par.ep > 1:
            p.append(Problem("parallel.ep", par.ep, "expert parallelism needs experts: model.experts > 0; "
                             "allowed with a dense model: 1"))
        _check_expert_load(p, conv, e, model.layers - model.dense_layers if e else 0, par.microbatches)
        return
    if k > e:
        p.append(Problem("model.experts_per_token", k, f"top-k must not exceed model.experts ({e}); "
                         f"allowed: 1 … {e}"))
    if model.dense_layers >= model.layers:
        p.append(Problem("model.dense_layers", model.dense_layers,
                         f"leaves no block with experts: must be less than model.layers ({model.layers}); "
                         f"allowed: 0 … {model.layers - 1}"))
    g = model.router_groups
    if g > 1 and "model.router_groups" not in bad and "model.router_topk_groups" not in bad:
        if e % g:
            p.append(Problem("model.router_groups", g, f"must divide model.experts ({e}); allowed: "
                             f"{', '.join(map(str, _divisors(e)[:24]))}"))
        elif model.router_topk_groups > g:
            p.append(Problem("model.router_topk_groups", model.router_topk_groups,
                             f"must not exceed model.router_groups; allowed: 1 … {g}"))
        elif k > model.router_topk_groups * (e // g):
            p.append(Problem("model.experts_per_token", k,
                             f"the best router_topk_groups ({model.router_topk_groups}) groups of {e // g} experts "
                             f"hold only {model.router_topk_groups * (e // g)}: allowed: 1 … "
                             f"{model.router_topk_groups * (e // g)}"))
    if e % par.ep:
        p.append(Problem("parallel.ep", par.ep, f"must divide model.experts ({e}); allowed: "
                         f"{', '.join(map(str, _divisors(e)[:24]))}"))
    if "parallel.dp" not in bad and "parallel.replicate" not in bad and par.replicate >= 1 \
            and par.dp % par.replicate == 0:
        dp_shard = par.dp // par.replicate
        dense = par.shard_degree * par.tp  # shard_degree = dp_shard·cp already
        if dense % par.ep:
            p.append(Problem("parallel.ep", par.ep,
                             f"must divide the dense region dp_shard·cp·tp = {dp_shard}·{par.cp}·{par.tp} = {dense} "
                             f"(the ranks its efsdp·ep sparse region covers); allowed: "
                             f"{', '.join(str(d) for d in _divisors(math.gcd(dense, e)))}"))
    if par.ep > 1 and par.tp > 1 and "model.seq_len" not in bad and model.seq_len % par.tp:
        p.append(Problem("parallel.ep", par.ep, f"with parallel.tp > 1 each TP rank dispatches its slice of the "
                         f"sequence: needs model.seq_len ({model.seq_len}) to be a multiple of parallel.tp ({par.tp})"))
    if par.ep == 1 and par.tp > 1 and model.expert_hidden % par.tp:
        p.append(Problem("parallel.tp", par.tp, f"without expert parallelism the experts are split by TP: must "
                         f"divide model.expert_ffn_hidden ({model.expert_hidden}); allowed: "
                         f"{', '.join(map(str, _divisors(math.gcd(model.expert_hidden, model.heads))))}"))
    if "conventions.moe_imbalance" not in bad and conv.moe_imbalance > e:
        p.append(Problem("conventions.moe_imbalance", conv.moe_imbalance,
                         f"the busiest expert gets at most every token: allowed: 1 … model.experts ({e})"))
    _check_expert_load(p, conv, e, model.layers - model.dense_layers if e else 0, par.microbatches)


def _check_expert_load(p: list[Problem], conv: Conventions, experts: int, moe_blocks: int = 0,
                       microbatches: int = 1) -> None:
    """``conventions.moe_expert_load``: empty, or one non-negative fraction per expert summing to 1
    (every block and microbatch), or one such list per MoE block, or per microbatch one per MoE block;
    and not beside another load convention."""
    load, key = conv.moe_expert_load, "conventions.moe_expert_load"
    if not load:
        return
    forms = (f"allowed: a list of model.experts ({experts}) fractions, a list of one such list per MoE block "
             f"({moe_blocks}), a list of one such list of lists per microbatch ({microbatches}), or [] (balanced)")

    def depth(x) -> int:
        return 1 + depth(x[0]) if isinstance(x, tuple) and x else (1 if isinstance(x, tuple) else 0)

    d = depth(load)
    if not isinstance(load, tuple) or d not in (1, 2, 3):
        p.append(Problem(key, load, "must be a list of numbers (the fraction of routed tokens each expert gets); "
                         + forms))
        return
    if experts == 0:
        p.append(Problem(key, _deep_list(load), "a dense model (model.experts = 0) has no expert load; allowed: []"))
        return
    if d == 3 and len(load) != microbatches:
        p.append(Problem(key, _deep_list(load), f"per microbatch: needs one entry per microbatch "
                         f"(parallel.microbatches = {microbatches}), got {len(load)}; " + forms))
        return
    blocks = [b for mb in load for b in mb] if d == 3 else list(load) if d == 2 else [load]
    if d >= 2 and any(not isinstance(b, tuple) or len(b) == 0 or isinstance(b[0], tuple) for b in blocks):
        p.append(Problem(key, _deep_list(load), "must be nested evenly; " + forms))
        return
    if d >= 2 and len(blocks) != moe_blocks * (microbatches if d == 3 else 1):
        p.append(Problem(key, _deep_list(load), f"needs one list per MoE block (model.layers − model.dense_layers "
                         f"= {moe_blocks}){' in every microbatch' if d == 3 else ''}; " + forms))
        return
    for lst in blocks:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lst):
            p.append(Problem(key, _deep_list(load), "must be a list of numbers (the fraction of routed tokens each "
                             "expert gets)"))
            return
        if len(lst) != experts:
            p.append(Problem(key, _deep_list(load), f"needs one fraction per expert: allowed: a list of model.experts "
                             f"({experts}) numbers, or [] (balanced)"))
            return
        if any(not math.isfinite(x) or x < 0 for x in lst):
            p.append(Problem(key, _deep_list(load), "fractions must be finite and ≥ 0"))
            return
        if abs(sum(lst) - 1.0) > 1e-6:
            p.append(Problem(key, _deep_list(load), f"fractions must sum to 1 (within 1e-6); they sum to "
                             f"{sum(lst):.9g}"))
            return
    if conv.moe_imbalance != 1.0:
        p.append(Problem(key, _deep_list(load), "gives the load itself: with it allowed: conventions.moe_imbalance = 1"))
    if conv.moe_capacity_factor > 0:
        p.append(Problem(key, _deep_list(load), "a measured dropless load: with it allowed: "
                         "conventions.moe_capacity_factor = 0"))


def _deep_list(x):
    return [_deep_list(v) for v in x] if isinstance(x, tuple) else x


def _check_moe_combinations(p: list[Problem], model: ModelSpec, par: ParallelSpec, t: TrainingSpec) -> None:
    """What experts and MLA do not compose with here (each a clear refusal, not a silent guess)."""
    if model.experts > 0 or model.attention == "mla":
        what = "model.experts > 0" if model.experts > 0 else "attention = 'mla'"
        if t.finetune == "lora":
            p.append(Problem("training.finetune", t.finetune, f"LoRA adapters are placed on the plain attention "
                             f"and MLP Linears; with {what} allowed: full"))
        if par.dp_mode == "dataparallel":
            p.append(Problem("parallel.dp_mode", par.dp_mode, f"legacy nn.DataParallel is modelled for dense "
                             f"decoders; with {what} allowed: ddp"))
    if model.experts > 0 and t.float8 not in ("none",) and isinstance(t.float8, str) and t.float8 in names.FLOAT8_KINDS:
        p.append(Problem("training.float8", t.float8, "float8 training of grouped expert GEMMs is not modelled; with "
                         "model.experts > 0 allowed: none"))
    if isinstance(par.ep, int) and par.ep > 1 and par.zero == 1:
        p.append(Problem("parallel.zero", par.zero, "ZeroRedundancyOptimizer partitions one data-parallel group, "
                         "but expert weights differ between EP ranks: with parallel.ep > 1 allowed: 0 (experts "
                         "all-reduced over efsdp), 2, 3 (experts FSDP-sharded over efsdp, as torchtitan)"))


def _check_mla(p: list[Problem], model: ModelSpec, bad: set[str]) -> None:
    """Multi-head latent attention: its ranks and head widths, and none of the plain-attention ones."""
    if model.attention != "mla":
        return
    for key in ("kv_lora_rank", "v_head_dim"):
        if f"model.{key}" not in bad and getattr(model, key) < 1:
            p.append(Problem(f"model.{key}", getattr(model, key), "attention = 'mla' needs it: allowed: at least 1"))
    if "model.qk_rope_head_dim" not in bad and "model.qk_nope_head_dim" not in bad:
        if model.qk_rope_head_dim + model.qk_nope_head_dim < 1:
            p.append(Problem("model.qk_nope_head_dim", model.qk_nope_head_dim,
                             "attention = 'mla' needs query/key heads: qk_nope_head_dim + qk_rope_head_dim ≥ 1"))
        if model.qk_rope_head_dim % 2:
            p.append(Problem("model.qk_rope_head_dim", model.qk_rope_head_dim, "rotary halves pair up: must be even"))
    if model.head_size:
        p.append(Problem("model.head_size", model.head_size, "attention = 'mla' sets its head widths with "
                         "qk_nope_head_dim, qk_rope_head_dim and v_head_dim; allowed: 0"))
    if "model.kv_heads" not in bad and "model.heads" not in bad and model.kv_heads != model.heads:
        p.append(Problem("model.kv_heads", model.kv_heads, f"attention = 'mla' expands the latent to every head: "
                         f"allowed: model.heads ({model.heads})"))


def _check_torchtitan_knobs(p: list[Problem], par: ParallelSpec, t: TrainingSpec) -> None:
    """float8, compile, async TP, the FSDP reshard policy and the pipeline split (torchtitan's knobs)."""
    _choice(p, "training.float8", t.float8)
    _choice(p, "parallel.fsdp_reshard_after_forward", par.fsdp_reshard_after_forward)
    _choice(p, "parallel.pipeline_split", par.pipeline_split)
    for path, value in (("training.float8_all_gather", t.float8_all_gather), ("training.compile", t.compile),
                        ("parallel.async_tp", par.async_tp)):
        if not isinstance(value, bool):
            p.append(Problem(path, value, "allowed: true | false"))
    if t.float8 in ("tensorwise", "rowwise") and t.precision != "bf16-mixed":
        p.append(Problem("training.float8", t.float8, f"float8 training runs under bf16 autocast or an FSDP2 bf16 "
                         f"policy: needs training.precision = 'bf16-mixed' (got {t.precision!r})"))
    if t.float8_all_gather is True and (t.float8 != "tensorwise" or par.zero not in (2, 3)):
        p.append(Problem("training.float8_all_gather", True,
                         "FSDP2 gathers float8 weights with tensorwise scaling only: needs training.float8 = "
                         f"'tensorwise' and parallel.zero = 2 or 3 (got float8 = {t.float8!r}, zero = {par.zero})"))
    if par.async_tp is True and not (isinstance(par.tp, int) and par.tp > 1 and par.sequence_parallel is True
                                     and t.compile is True):
        p.append(Problem("parallel.async_tp", True,
                         "async TP micro-pipelines the sequence-parallel collectives through torch.compile: needs "
                         "parallel.tp > 1, parallel.sequence_parallel = true and training.compile = true"))
    if par.fsdp_reshard_after_forward in ("always", "never") and par.zero != 3:
        p.append(Problem("parallel.fsdp_reshard_after_forward", par.fsdp_reshard_after_forward,
                         "sets ZeRO-3's reshard policy: needs parallel.zero = 3 (ZeRO-2 never reshards after "
                         "forward; that is what makes it ZeRO-2); allowed otherwise: default"))
    if par.pipeline_split == "torchtitan" and par.pp == 1:
        p.append(Problem("parallel.pipeline_split", par.pipeline_split, "needs parallel.pp > 1 (a pipeline to split)"))


def _check_lora(p: list[Problem], model: ModelSpec, par: ParallelSpec, t: TrainingSpec) -> None:
    """LoRA's fields: always type- and range-checked; the cross-rules only when finetune = "lora"."""
    _choice(p, "training.finetune", t.finetune)
    _choice(p, "training.lora_targets", t.lora_targets)
    _choice(p, "training.lora_base_dtype", t.lora_base_dtype)
    if t.finetune != "lora":
        return
    if isinstance(t.lora_rank, int) and t.lora_rank > min(model.hidden, model.ffn_hidden):
        p.append(Problem("training.lora_rank", t.lora_rank,
                         f"must not exceed the smallest adapted dimension, min(model.hidden, model.ffn_hidden) = "
                         f"{min(model.hidden, model.ffn_hidden)}: a low-rank adapter that is not low rank"))
    if t.lora_base_dtype == "bf16" and t.precision == "fp32":
        p.append(Problem("training.lora_base_dtype", t.lora_base_dtype,
                         "a bf16 base needs training.precision = bf16-mixed or fp16-mixed (fp32 compute cannot use "
                         "bf16 weights as stored); allowed with precision fp32: fp32 | nf4"))
    if t.lora_base_dtype == "nf4" and (par.zero in (2, 3) or par.tp > 1):
        p.append(Problem("training.lora_base_dtype", t.lora_base_dtype,
                         "a 4-bit (nf4) base composes here with DDP / ZeRO-1 and pipelining only: needs parallel.zero "
                         f"≤ 1 and parallel.tp = 1 (got zero = {par.zero}, tp = {par.tp})"))


def _check_pipeline(p: list[Problem], model: ModelSpec, par: ParallelSpec) -> None:
    """The pipeline rules, including those torch.distributed.pipelining enforces itself."""
    v, m, s = par.virtual_stages, par.microbatches, par.schedule
    if par.pp == 1:
        if v != 1:
            p.append(Problem("parallel.virtual_stages", v, "needs parallel.pp > 1; allowed with pp = 1: 1"))
        return
    if s not in names.SCHEDULES:
        return
    if s in names.SINGLE_STAGE_SCHEDULES and v != 1:
        p.append(Problem("parallel.virtual_stages", v, f"schedule {s} runs one stage per rank; allowed: 1"))
    if s in names.V_SCHEDULES and v != 2:
        p.append(Problem("parallel.virtual_stages", v, f"schedule {s} places exactly two stages per rank (a V); allowed: 2"))
    if par.num_stages > model.layers:
        p.append(Problem("parallel.pp", par.pp,
                         f"pp·virtual_stages = {par.num_stages} exceeds model.layers ({model.layers}): a stage needs a layer"))
    if s == "1F1B" and m < par.pp:
        p.append(Problem("parallel.microbatches", m, f"schedule 1F1B needs microbatches ≥ pp ({par.pp})"))
    if s in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // par.pp)
        if m % rounds:
            ok = [k for k in range(1, 4 * par.pp + 1) if k % max(1, k // par.pp) == 0]
            p.append(Problem("parallel.microbatches", m,
                             f"schedule {s} needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}; "
                             f"allowed e.g.: {', '.join(map(str, ok[:12]))}"))
    if s == "DualPipeV" and m < par.num_stages:
        p.append(Problem("parallel.microbatches", m,
                         f"schedule DualPipeV needs microbatches ≥ number of stages (2·pp = {par.num_stages})"))
    values = {"parallel.pp": par.pp, "parallel.microbatches": m}
    p.extend(Problem(field, values[field], why) for field, why in step_size_problems(s, par.pp, v, m, model.layers))


def step_size_problems(schedule: str, pp: int, virtual_stages: int, microbatches: int,
                       layers: int | None = None) -> list[tuple[str, str]]:
    """Why a step is too long for the engine to simulate in about a second, as (field, why) (empty: it
    is not). Read by validation and by the planner (``engine.pipeline.schedules.schedule_problems``)."""
    out = []
    stages = pp * virtual_stages
    if layers is not None and pp * layers > MAX_PP_LAYERS:
        out.append(("parallel.pp", f"parallel.pp × model.layers = {pp}·{layers} = {pp * layers:,} exceeds {MAX_PP_LAYERS:,}: the "
                   "engine lays each block of every pipeline rank's warm-up and cool-down, which no steady state "
                   f"repeats; allowed with {layers} layers: pp ≤ {max(1, MAX_PP_LAYERS // layers)}"))
    breadth_first = schedule in ("GPipe", "LoopedBFS")
    if layers is not None and breadth_first and microbatches * layers > MAX_BREADTH_FIRST_BLOCKS:
        out.append(("parallel.microbatches", f"schedule {schedule} runs every forward before any backward, so nothing of a step "
                   f"repeats and the engine lays each block of each microbatch: microbatches × model.layers = "
                   f"{microbatches}·{layers} = {microbatches * layers:,} exceeds {MAX_BREADTH_FIRST_BLOCKS:,}; allowed with "
                   f"{layers} layers: microbatches 1 … {max(1, MAX_BREADTH_FIRST_BLOCKS // layers)}, or a schedule with a "
                   "steady state (1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"))
    elif layers is not None and pp > 1 and microbatches * layers > MAX_PIPELINE_BLOCKS:
        out.append(("parallel.microbatches", f"a pipeline's last stage keeps every microbatch's outputs until the step "
                   "ends, so its ranks' allocator states need not repeat and the engine replays each block of each "
                   f"microbatch on every pipeline rank: microbatches × model.layers = {microbatches}·{layers} = "
                   f"{microbatches * layers:,} exceeds {MAX_PIPELINE_BLOCKS:,}; allowed with {layers} layers: "
                   f"microbatches 1 … {max(1, MAX_PIPELINE_BLOCKS // layers)}, or pp = 1"))
    if stages * microbatches > MAX_STAGE_MICROBATCHES:
        out.append(("parallel.microbatches", f"pp·virtual_stages·microbatches = {stages}·{microbatches} = {stages * microbatches:,} exceeds "
                   f"{MAX_STAGE_MICROBATCHES:,}: the engine simulates every forward and backward of the step, and "
                   f"answers within a second up to that; allowed with {stages} stage(s): 1 … "
                   f"{MAX_STAGE_MICROBATCHES // stages}"))
    return out


#: the most forward passes (stages × microbatches) a step may hold: the timeline simulates each F, B
#: (and W) action and the allocator replay lays what no steady state repeats, so the step predicts in
#: about a second at most up to here (Llama 3 405B on 16,384 GPUs runs 16 stages × 16 microbatches;
#: DeepSeek-V3's 2,048 GPUs 16 × 120; its 15,360-sequence batch on one replica, 1 × 15,360)
MAX_STAGE_MICROBATCHES = 16384
#: the most block-microbatches (microbatches × layers) a breadth-first schedule (GPipe, LoopedBFS) may
#: lay: its step holds no steady state for the allocator replay to skip, each costs ~30 µs with two
#: stages a rank (Llama 3 405B's 126 layers: 130 microbatches; GPipe runs are published with 8–64)
MAX_BREADTH_FIRST_BLOCKS = 16384
#: the most block-microbatches (microbatches × layers, summed over the pipeline ranks) any other
#: pipeline may lay: its allocator need not loop (the last stage's kept outputs grow each microbatch),
#: ~15 µs a block-microbatch and distinct rank; the fuzz's 1,000-layer pipelines of 128–256
#: microbatches (128,000–256,000) took 1.2–6.3 s. Llama 3 70B on 64 stages × 256 microbatches: 20,480;
#: Llama 3 405B: 260 microbatches; published pipelines run 8–64
MAX_PIPELINE_BLOCKS = 32768
#: the most pipeline-rank blocks (pp × layers): each pipeline rank's warm-up and cool-down are laid block
#: by block, ~0.1 ms per pp·layer for two stages a rank (Megatron-LM's 1T model: 64 stages of 128
#: layers, 8,192; Llama 3 405B: 16 × 126)
MAX_PP_LAYERS = 8192


# --------------------------------------------------------------------------- parsing

_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               tuple: "a list of numbers"}


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


def _nested_numbers(value: Any, depth: int) -> bool:
    """Lists of numbers nested at most ``depth`` deep, every leaf a number at the same depth."""
    if not isinstance(value, (list, tuple)) or depth == 0:
        return False
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return True
    return all(_nested_numbers(x, depth - 1) for x in value)


def _deep_float(value: Any) -> Any:
    return tuple(_deep_float(x) for x in value) if isinstance(value, (list, tuple)) else float(value)


def _coerce(p: list[Problem], path: str, value: Any, kind: type) -> tuple[bool, Any]:
    try:
        return _coerce_number(p, path, value, kind)
    except OverflowError:  # an integer of hundreds of digits given where a float goes
        p.append(Problem(path, value, f"is too large for a number (at most about {_MAX_FLOAT:.3g})"))
        return False, None


_MAX_FLOAT = 1.7976931348623157e308


def _coerce_number(p: list[Problem], path: str, value: Any, kind: type) -> tuple[bool, Any]:
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return True, value
    if kind in (bool, str) and isinstance(value, kind):
        return True, value
    if kind is tuple and isinstance(value, (list, tuple)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return True, tuple(float(x) for x in value)
    if kind is tuple and path.endswith("moe_expert_load") and _nested_numbers(value, 3):
        return True, _deep_float(value)  # per block, or per microbatch and block
    p.append(Problem(path, value, f"must be {_KIND_NAMES.get(kind, kind.__name__)}"))
    return False, None


def _table(p: list[Problem], raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        p.append(Problem(key, value, "must be a table"))
        return {}
    return value


def _read_fields(p: list[Problem], section: str, table: dict, cls: type, skip: set[str]) -> dict[str, Any]:
    """Type-check a table against a dataclass; unknown keys are problems that name the key."""
    types = _field_types(cls)
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in skip:
            continue
        if key not in types:
            allowed = sorted(set(types) | skip)
            p.append(Problem(f"{section}.{key}", value, f"unknown key; allowed: {', '.join(allowed)}"))
            continue
        ok, v = _coerce(p, f"{section}.{key}", value, types[key])
        if ok:
            out[key] = v
    return out


def _parse(raw: dict[str, Any], base_dir: Path | None = None) -> Config:
    p: list[Problem] = []
    if not isinstance(raw, dict):
        raise ConfigError([Problem("file", None, "must hold a table at the top level")])
    for key in raw:
        if key not in _SECTIONS and key != "schema_version":
            p.append(Problem(key, raw[key], f"unknown key; allowed: schema_version, {', '.join(_SECTIONS)}"))
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION or isinstance(version, bool):
        p.append(Problem("schema_version", version, f"allowed: {SCHEMA_VERSION}"))

    model = _parse_model(p, _table(p, raw, "model"), base_dir)
    cluster_raw = _table(p, raw, "cluster")
    parallel_raw = _table(p, raw, "parallel")
    par = _parse_parallel(p, parallel_raw)
    cluster = _parse_cluster(p, cluster_raw, par)
    inner = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)
    if cluster is not None and "dp" not in par and inner > 0 and cluster.gpus % inner == 0:
        par["dp"] = max(1, cluster.gpus // inner)
    parallel = ParallelSpec(**par)
    tr = _read_fields(p, "training", _table(p, raw, "training"), TrainingSpec, set())
    if "grad_dtype" not in tr:
        tr["grad_dtype"] = names.DEFAULT_GRAD_DTYPE.get(tr.get("precision", TrainingSpec.precision), "fp32")
    training = TrainingSpec(**tr)
    conventions = Conventions(**_read_fields(p, "conventions", _table(p, raw, "conventions"), Conventions, set()))

    if model is not None and cluster is not None:
        p.extend(check(model, cluster, parallel, training, conventions))
    if p:
        # keep order, drop exact duplicates
        seen, unique = set(), []
        for prob in p:
            k = (prob.field, repr(prob.value), prob.message)
            if k not in seen:
                seen.add(k)
                unique.append(prob)
        raise ConfigError(unique)
    return Config(model=model, cluster=cluster, parallel=parallel, training=training, conventions=conventions)


def _parse_model(p: list[Problem], table: dict, base_dir: Path | None = None) -> ModelSpec | None:
    presets = model_presets()
    base: dict[str, Any] = {}
    preset = table.get("preset")
    if preset is not None:
        if not isinstance(preset, str) or preset not in presets:
            p.append(Problem("model.preset", preset, f"unknown preset; allowed: {', '.join(presets)}"))
        else:
            base = dict(presets[preset])
    hf_path = table.get("hf_config")
    if hf_path is not None:
        if preset is not None:
            p.append(Problem("model.hf_config", hf_path, "names the architecture as model.preset does: give one "
                             "of them, not both"))
        hf = _read_hf(p, hf_path, base_dir)
        if hf is None:
            return None
        base, hf_path = hf
    fields = _read_fields(p, "model", table, ModelSpec, {"preset", "hf_config"})
    merged = {**base, **fields}
    if hf_path is not None:
        merged["hf_config"] = hf_path
    if base and preset is not None and hf_path is None:
        merged["preset"] = preset
    required = [f.name for f in dataclasses.fields(ModelSpec) if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in merged]
    if missing:
        p.append(Problem("model", None, f"missing {', '.join(missing)} (give them, or name a preset: {', '.join(presets)})"))
        return None
    return ModelSpec(**merged)


def _read_hf(p: list[Problem], value: Any, base_dir: Path | None) -> tuple[dict[str, Any], str] | None:
    """The fields of the Hugging Face config.json ``value`` names (relative to ``base_dir``, the
    config file's folder, else the working directory) and its resolved path."""

    if not isinstance(value, str) or not value:
        p.append(Problem("model.hf_config", value, "must be the path of a Hugging Face config.json (a string)"))
        return None
    if "\x00" in value:
        p.append(Problem("model.hf_config", value, "a file path cannot hold a NUL character"))
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    try:
        fields = read_hf_config(path)
    except HFConfigError as err:
        for message in err.messages:
            p.append(Problem("model.hf_config", value, message))
        return None
    return fields, str(path.resolve())


def _parse_parallel(p: list[Problem], table: dict) -> dict[str, Any]:
    table = dict(table)
    fsdp = table.pop("fsdp", None)
    par = _read_fields(p, "parallel", table, ParallelSpec, set())
    if fsdp is not None:
        if not isinstance(fsdp, str) or fsdp not in names.FSDP_STRATEGIES:
            p.append(Problem("parallel.fsdp", fsdp, f"allowed: {' | '.join(names.FSDP_STRATEGIES)}"))
        else:
            zero, hybrid = names.FSDP_STRATEGIES[fsdp]
            if "zero" in par and par["zero"] != zero:
                p.append(Problem("parallel.zero", par["zero"], f"disagrees with parallel.fsdp = {fsdp!r} (ZeRO-{zero})"))
            par["zero"] = zero
            if hybrid and par.get("replicate", 1) == 1:
                p.append(Problem("parallel.replicate", par.get("replicate", 1),
                                 f"fsdp = {fsdp!r} needs parallel.replicate > 1 (HSDP replica count)"))
    return par


def _parse_gpu(p: list[Problem], value: Any) -> GPUSpec | None:
    presets = gpu_presets()
    if isinstance(value, str):
        if value not in presets:
            p.append(Problem("cluster.gpu", value, f"unknown GPU; allowed: {', '.join(presets)}"))
            return None
        return GPUSpec(name=value, **presets[value])
    if isinstance(value, dict):
        value = dict(value)
        base_name = value.pop("preset", None)
        base: dict[str, Any] = {}
        if base_name is not None:
            if not isinstance(base_name, str) or base_name not in presets:
                p.append(Problem("cluster.gpu.preset", base_name, f"unknown GPU; allowed: {', '.join(presets)}"))
            else:
                base = {"name": base_name, **presets[base_name]}
        fields = _read_fields(p, "cluster.gpu", value, GPUSpec, set())
        merged = {**base, **fields}
        merged.setdefault("name", "custom")
        missing = [f.name for f in dataclasses.fields(GPUSpec) if f.default is dataclasses.MISSING and f.name not in merged]
        if missing:
            p.append(Problem("cluster.gpu", None, f"missing {', '.join(missing)}"))
            return None
        return GPUSpec(**merged)
    p.append(Problem("cluster.gpu", value, f"must be a GPU preset name ({', '.join(presets)}) or a table"))
    return None


def _parse_cluster(p: list[Problem], table: dict, par: dict[str, Any]) -> ClusterSpec | None:
    presets = cluster_presets()
    table = dict(table)
    preset = table.pop("preset", None)
    base: dict[str, Any] = {}
    if preset is not None:
        if not isinstance(preset, str) or preset not in presets:
            p.append(Problem("cluster.preset", preset, f"unknown preset; allowed: {', '.join(presets)}"))
            preset = None
        else:
            base = dict(presets[preset])
    gpu_value = table.pop("gpu", base.pop("gpu", "cpu"))
    gpu = _parse_gpu(p, gpu_value)
    fields = _read_fields(p, "cluster", table, ClusterSpec, {"preset", "gpu"})
    if gpu is None:
        return None
    merged = {**base, **fields}
    if "gpus" not in fields:
        inner = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)
        if "dp" in par:
            merged["gpus"] = par["dp"] * inner
        elif "gpus" not in merged:
            merged["gpus"] = inner
    merged.setdefault("gpus_per_node", min(merged["gpus"], 8) if merged["gpus"] > 0 else 1)
    merged.setdefault("intra_node_bandwidth_gb_per_s", gpu.intra_node_bandwidth_gb_per_s)
    merged.setdefault("inter_node_bandwidth_gb_per_s", gpu.inter_node_bandwidth_gb_per_s)
    merged.setdefault("intra_node_latency_us", 20.0 if gpu.name == "cpu" else 2.0)
    merged.setdefault("inter_node_latency_us", 50.0 if gpu.name == "cpu" else 5.0)
    return ClusterSpec(gpu=gpu, preset=preset, **merged)


def _asdict_without_none(obj: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if getattr(obj, f.name) is not None and f.name not in drop}


#: Fields a file names only when they differ from their defaults (the mixture-of-experts, MLA and
#: recent attention fields): a dense model's file reads as it did before they existed.
_WRITTEN_WHEN_SET: dict[type, tuple[str, ...]] = {
    ModelSpec: ("head_size", "qkv_bias", "qk_norm", "attention_sinks", "sliding_window", "full_attention_every", "experts",
                "experts_per_token", "expert_ffn_hidden", "shared_experts", "dense_layers", "router_score",
                "router_bias", "router_balance_bias", "norm_topk_prob", "routed_scaling_factor",
                "router_aux_loss", "router_groups", "router_topk_groups", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim"),
    ParallelSpec: ("ep",),
    Conventions: ("moe_imbalance", "moe_capacity_factor", "moe_expert_load"),
}


def _drop_defaults(obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    for key in _WRITTEN_WHEN_SET.get(type(obj), ()):
        if key in out and out[key] == defaults[key]:
            del out[key]
    return out


def _unparse(cfg: Config) -> dict[str, Any]:
    # hf_config is provenance only: every field it gave is written out, so the file stands alone
    model = _drop_defaults(cfg.model, _asdict_without_none(cfg.model, drop=("preset", "hf_config")))
    if cfg.model.preset is not None:
        model = {"preset": cfg.model.preset, **model}
    cl = cfg.cluster
    gpu = cl.gpu
    presets = gpu_presets()
    if gpu.name in presets and GPUSpec(name=gpu.name, **presets[gpu.name]) == gpu:
        gpu_value: Any = gpu.name
    else:
        gpu_value = _asdict_without_none(gpu)
    cluster: dict[str, Any] = {}
    if cl.preset is not None:
        cluster["preset"] = cl.preset
    cluster["gpu"] = gpu_value
    cluster.update(_asdict_without_none(cl, drop=("gpu", "preset")))
    return {
        "schema_version": cfg.schema_version,
        "model": model,
        "cluster": cluster,
        "parallel": _drop_defaults(cfg.parallel, _asdict_without_none(cfg.parallel)),
        "training": _asdict_without_none(cfg.training),
        "conventions": _drop_defaults(cfg.conventions, _asdict_without_none(cfg.conventions)),
    }


def default_config() -> Config:
    """The embedded default: the tiny model on local CPU ranks (assets/presets/default.toml)."""

    return Config.load(PRESETS_DIR / "default.toml")
