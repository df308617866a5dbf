"""Activations: what each op saves for backward, as a table of saved tensors, one row per tensor.

Per layer per microbatch (Korthikanti et al. 2022, §4.1), derived tensor by tensor from what
each op keeps for its backward (``SAVED_TENSORS``, evaluated by ``layer_activation_terms``):
  attention  norm1 output (QKV input) 2sbh · Q and K 2sbh each · V 2sbh ·
             eager: softmax output 2as²b, its dropout mask as²b and dropout output 2as²b ·
             o-proj input 2sbh · residual dropout mask sbh                  → 11sbh + 5as²b
  MLP        norm2 output 2sbh · GeLU input 2sbf · fc2 input 2sbf · dropout mask sbh → 19sbh (f=4h)
  norms      the two norm inputs 2sbh each                                   → 4sbh
With f = 4h, eager attention, dropout on and 16-bit activations the sum is exactly Table 2 in
all five cases. Variants, each a condition on a row (``only``), never a branch:
  * dropout off: no masks (1-byte each), and no separate dropout output — the softmax output
    is what the AV matmul saves, so eager attention keeps 2as²b instead of 5as²b.
  * flash attention: no s² tensor at all; the kernel saves Q, K, V, its output (which is the
    o-proj input) and the softmax log-sum-exp (a·s·b fp32); dropout is regenerated from the
    RNG state, so no mask. K and V are saved at kv_heads·d (flash takes GQA natively), while
    eager attention saves the K, V it multiplies — repeated to all heads (2sbh each).
  * SwiGLU: silu saves its input (gate output), the product saves both factors (silu output,
    up output), down saves its input: 4 tensors of 2sbf instead of GeLU's 2.
  * TP: the parts inside the column/row pair are /t; the rest (norms, their outputs, the
    residual masks) are replicated unless sequence parallel, which makes them /t too.
  * context parallelism (cp): s is the rank's seq_len / cp tokens in every row; eager attention's
    scores (a·s·S) and the K, V it multiplies (gathered: S·b·h) span the whole sequence S. What
    the ring attention holds beyond the table while one layer runs is ``context_parallel_workspace``
    (a temporary: gathered K, V or ring chunks, fp32 merger and gradient accumulators).
  * recompute: a row names the policies that recompute it instead of keeping it
    (``recomputed_by``); selective recomputes the attention core (softmax, its dropout; flash's
    lse). Full recompute keeps only each block's input (``memory_per_rank``); the table itself
    ignores it. The block being recomputed in its backward is counted as activations too (one
    block's tensors, alive during that backward), as PyTorch's MemTracker counts it, less norm1's
    input: the replay saves the checkpoint's kept input itself (``checkpoint_shared_bytes``).
  * LoRA (frozen base): a frozen Linear keeps no input for its weight gradient, so the QKV, o-proj,
    MLP and down inputs stay only where an adapter's A reads them (``for_weight_grad_of``; flash
    keeps its output anyway, ``kernel_keeps``); each adapter adds A's output (s·b·r) for B's
    gradient; a frozen composite RMSNorm keeps no x̂.
Element bytes: 2 for 16-bit activations (Table 2), 4 under fp32; masks are 1 byte.

Mixture of experts (``moe_layer_terms``): a block with experts keeps the attention half's rows and
replaces the MLP's by the router's input and scores, the top-k choice, the dispatched tokens and
each expert's internals for them (n·k routed copies × ``engine.model.routing.routed_factor``), the
expert outputs the combine keeps and the shared experts as one dense MLP; under per-op selective
recompute they are all kept (an upper estimate). Stated simplifications: MLA is evaluated as flash
attention with K and V at heads × (d_nope + d_rope) (its latents not counted apart), and Q and the
o-proj input at h where head_size makes the query width differ from h.

Under ``conventions.state_accounting = "pytorch"`` the rows marked ``torch_ops`` follow torch's
kernels too: rstd of each norm, rope's cos/sin tables, the causal mask, SP's gathered Linear
inputs (torch's SequenceParallel + PrepareModuleInput all-gather the norm output into a
replicated DTensor, and the column-parallel Linears save that full s·b·h input), torch's
composite RMSNorm on CPU (x̂ = x·rstd saved too; of a 16-bit input, under FSDP2's MixedPrecisionPolicy
without autocast, its fp32 upcast and an fp32 x̂ instead). Beyond the block (``stage_activation_terms``):
the residual stream and the norms in fp32 under autocast, one 16-bit input cast per Linear,
autocast's cached weight casts, a pipeline stage's kept output, and its input that is the p2p
receive buffer (counted in comm_buffers). Checked against PyTorch's MemTracker on CPU
(benchmarks/accuracy.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from engine.config import Config
from engine.memory.lifetimes import LIFETIMES, moments
from engine.memory.report import Term, Terms, ceil_div
from engine.memory.states import plain_grads_late, replicate_expert_grads
from engine.model import lora
from engine.model.params import attention_tensors, mlp_tensors
from engine.model.recompute import block_linears_addmm, checkpointed_per_stage, sac_saved_matmuls, sac_saved_moe
from engine.model.routing import (
    load_shares,
    mean_expert_load,
    moe_tokens,
    routed_factor,
    routed_factor_of,
    varying_expert_load,
)
from engine.names import RECOMPUTE_KINDS, SPLIT_BACKWARD_SCHEDULES
from engine.pipeline.layout import split_layers
from engine.pipeline.schedules import sends_held
from engine.wrapping import wrapping_plan


@dataclass(frozen=True)
class _Shape:
    """What the per-layer activation table depends on."""

    s: int
    b: int
    h: int
    a: int
    kv: int  # kv_heads · head_dim
    f: int
    t: int
    sp: bool
    act: int  # bytes per activation element (2 for 16-bit, 4 for fp32)
    dropout: bool
    flash: bool
    swiglu: bool
    recompute: str = "none"
    mla: bool = False  # multi-head latent attention (no repeat of K and V: each head has its own)  # the policy the table is evaluated under ("full", "selective-layer": per block)
    bias: bool = False  # Linears run as one aten.addmm (a bias, no float8): saved by the per-op policy, not counted as an mm
    compile: bool = False  # torch.compile per block: what inductor's min-cut partitioner saves
    # torchao's Float8Linear saves its input as it arrives (matmul_with_hp_or_float8_args saves input_hp):
    # it casts it to the autocast dtype only under CUDA's autocast (torch.is_autocast_enabled() and
    # get_autocast_gpu_dtype() in Float8Linear.forward), so under CPU autocast the norm output stays at
    # the residual stream's dtype, one tensor shared by the Linears that read it
    float8_uncast: bool = False
    # "pytorch" accounting only (all False / equal to ``act`` under "zero-paper"):
    torch_ops: bool = False  # count what torch's kernels save beyond the paper's terms
    resid: int = 0  # bytes of the residual stream (the norm inputs)
    composite_norm: bool = False  # RMSNorm as torch's composite (CPU): also saves x̂ = x·rstd
    # the composite RMSNorm's input arrives in 16 bits (FSDP2's MixedPrecisionPolicy, no autocast): it
    # upcasts it and saves the fp32 upcast and the fp32 x̂ instead (set by ``stage_activation_terms``
    # only, so ``activation_bytes_per_layer`` does not depend on the DP wrapper)
    norm_upcast: bool = False
    rope: bool = False  # rope's cos/sin tables saved by its multiplies
    head_dim: int = 0
    # Qwen3's qk_norm: an RMSNorm over each query and key head (always RMSNorm, whatever model.norm);
    # torch's composite on CPU ranks (``qk_composite``), the fused kernel elsewhere
    qk_norm: bool = False
    qk_composite: bool = False
    # LoRA (engine.model.lora): adapter rank (0 = full fine-tuning) and the adapted Linears' names
    lora_r: int = 0
    lora_mods: tuple[str, ...] = ()
    # the frozen base is stored in fp32 (training.lora_base_dtype): autocast casts it anew in every forward
    lora_fp32_base: bool = False
    # autocast over LoRA's fp32 adapters: peft casts an adapted Linear's input to the adapters' dtype and autocast
    # casts that back for the matmul (set by ``stage_activation_terms`` only, as ``norm_upcast``)
    adapter_cast: bool = False
    # context parallelism: ``s`` is the rank's tokens (seq_len / cp); eager attention's scores and the
    # K, V it multiplies span every key of the sequence (``kv_len`` = seq_len; 0: s, no cp)
    kv_len: int = 0
    # the query width heads · head_dim where it is not the hidden size (Qwen3: 64 × 128 over h = 4096; the
    # backend's wq is h → heads·head_dim, wo back, backend/model.py's Attention); 0: h
    q: int = 0
    # context parallelism's ring attention (flash): the query halves its cp steps' outputs span on this
    # cp-rank r, cp + 1 + r (0: no ring). torch's ``_templated_ring_attention`` calls the flash op once a
    # step: step 0 and the r steps whose keys come before the rank's own take every query, the cp − 1 − r
    # others the tail half (head-tail load balancing); the per-op policy saves every call's output and
    # log-sum-exp (the op is in its save list), so cp-ranks differ
    ring_halves: int = 0

    @property
    def qd(self) -> int:
        """The query (and attention output) width: heads · head_dim."""
        return self.q or self.h

    @property
    def keys(self) -> int:
        """Keys each query attends over: the whole sequence (s without context parallelism)."""
        return self.kv_len or self.s

    @property
    def cp(self) -> bool:
        return self.kv_len > self.s

    @property
    def lora(self) -> bool:
        return self.lora_r > 0

    @property
    def ring(self) -> bool:
        return self.ring_halves > 0

    @property
    def lora_input_copy(self) -> bool:
        """An adapted wo's lora_A gets its input apart from the attention output the flash kernel keeps: the ring's
        heads' reshape is a copy, and under autocast peft casts the input to the fp32 adapters' dtype and autocast
        casts that back, a new 16-bit tensor (``adapter_cast``). Otherwise (FSDP2's 16-bit unsharded adapters, or fp32
        training) no cast applies and the reshape of the transposed output is a view: lora_A saves the kernel's own
        output (measure --fake of GPT-2 s32K pp2 ZeRO-3 bf16, LoRA on attention: seven s·b·h tensors a block, the
        kernel's output one of them)."""
        return self.ring or self.adapter_cast

    @property
    def rep(self) -> int:
        """Divisor of the replicated parts: t under sequence parallel, else 1."""
        return self.t if self.sp else 1

    @property
    def res(self) -> int:
        return self.resid or self.act

    @property
    def qk_upcast(self) -> bool:
        """The q and k norms' input is 16-bit (the wq / wk outputs in the compute dtype): torch's composite
        RMSNorm upcasts it and saves fp32 tensors (as ``norm_upcast`` for the block norms). Not compiled:
        inductor's fused norm keeps the 16-bit input and rstd (measured, tiny bf16: 55,296 B a layer)."""
        return self.qk_composite and self.act == 2 and not self.compile

    @property
    def selective(self) -> bool:
        return self.recompute == "selective"

    @property
    def sac(self) -> frozenset[str]:
        """The matmul outputs (Linear names; "wq.A", "wq.B" for LoRA adapters) the per-op policy saves."""
        return sac_saved_matmuls(self.swiglu, self.bias, self.lora_mods if self.lora else ())


# numel rule name -> (elements for one microbatch, the basis symbol in the formula s·b·(...))
_NUMEL = {
    "sbh_rep": (lambda sh: sh.s * sh.b * sh.h // sh.rep, lambda sh: "h/t" if sh.sp else "h"),
    "sb_rep": (lambda sh: sh.s * sh.b // sh.rep, lambda sh: "1/t" if sh.sp else "1"),
    # the column-parallel Linears' input: gathered to full s·b·h by torch's SP, else like the norm output
    "linear_input": (lambda sh: sh.s * sh.b * sh.h if sh.torch_ops else sh.s * sh.b * sh.h // sh.rep,
                     lambda sh: "h" if sh.torch_ops else ("h/t" if sh.sp else "h")),
    # the queries and the attention output: heads · head_dim wide (h unless model.head_size says otherwise)
    "sbq_t": (lambda sh: sh.s * sh.b * sh.qd // sh.t, lambda sh: "q/t" if sh.q else "h/t"),
    # a row-parallel Linear's local output: the full s·b·h partial sum before its all-reduce / reduce-scatter
    "sbh": (lambda sh: sh.s * sh.b * sh.h, lambda sh: "h"),
    "sbkv_t": (lambda sh: sh.s * sh.b * sh.kv // sh.t, lambda sh: "kv/t"),
    # what SDPA (flash) saves of K and V: torch's, the model's K and V repeated to every query head (at h/t);
    # the paper's accounting, latent attention (a K and V per head) and context parallelism (its own
    # exchange, engine.memory.activations.context_parallel_workspace): the kv heads
    "flash_kv_t": (lambda sh: sh.s * sh.b * (sh.qd if _repeats_kv(sh) else sh.kv) // sh.t,
                   lambda sh: ("q/t" if sh.q else "h/t") if _repeats_kv(sh) else "kv/t"),
    "sbf_t": (lambda sh: sh.s * sh.b * sh.f // sh.t, lambda sh: "f/t"),
    "as2b_t": (lambda sh: sh.a * sh.s * sh.keys * sh.b // sh.t, lambda sh: "aS/t" if sh.cp else "as/t"),
    # eager attention's K, V repeated to all heads: under context parallelism gathered to every key
    "keys_bh_t": (lambda sh: sh.keys * sh.b * sh.qd // sh.t,
                  lambda sh: ("(S/s)" if sh.cp else "") + ("q/t" if sh.q else "h/t")),
    "asb_t": (lambda sh: sh.a * sh.s * sh.b // sh.t, lambda sh: "a/t"),
    # the ring's cp steps together: ρ = ring_halves / 2 times the rank's queries (``_Shape.ring_halves``)
    "sbq_ring_t": (lambda sh: sh.s // 2 * sh.ring_halves * sh.b * sh.qd // sh.t,
                   lambda sh: "ρq/t" if sh.q else "ρh/t"),
    "asb_ring_t": (lambda sh: sh.a * (sh.s // 2 * sh.ring_halves) * sh.b // sh.t, lambda sh: "ρa/t"),
    # one row per query head and per key head (the qk norms' rstd): a + g heads, g = kv / head_dim
    "qk_rows_t": (lambda sh: (sh.a + sh.kv // max(sh.head_dim, 1)) * sh.s * sh.b // sh.t, lambda sh: "(a+g)/t"),
    "ss": (lambda sh: sh.s * sh.keys, lambda sh: "S/b" if sh.cp else "s/b"),
    "s_half_d": (lambda sh: sh.s * (sh.head_dim // 2), lambda sh: "d/2b"),
    "sbr": (lambda sh: sh.s * sh.b * sh.lora_r, lambda sh: "r"),
}
def _repeats_kv(sh) -> bool:
    return sh.torch_ops and not sh.mla and not sh.cp


#: order of the bases in the formula string
_BASIS_ORDER = ("h", "h/t", "q/t", "(S/s)h/t", "(S/s)q/t", "ρh/t", "ρq/t", "kv/t", "f/t", "as/t", "aS/t", "a/t", "ρa/t",
                "(a+g)/t", "1", "1/t", "d/2b", "s/b",
                "S/b", "r")
#: element-bytes rule name -> bytes
_ELEM = {"act": lambda sh: sh.act, "res": lambda sh: sh.res, "fp32": lambda sh: 4, "bool": lambda sh: 1}
#: shape flags a row's ``only`` may name ("!flag" negates)
_FLAGS = ("flash", "dropout", "swiglu", "torch_ops", "rope", "composite_norm", "lora", "sp", "compile",
          "float8_uncast", "norm_upcast", "qk_norm", "qk_composite", "qk_upcast", "ring", "lora_input_copy")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor an op of the block saves for backward, declared once.

    ``elem`` (an ``_ELEM`` rule) × ``count`` bytes per element of ``numel`` (a ``_NUMEL`` rule).
    ``part``: the part of the block it is saved in (norm1, attention, norm2, mlp, lora).
    ``only``: the shape flags it needs ("!flag": needs the flag off). ``recomputed_by``: the
    recompute policies that recompute it instead of keeping it. ``for_weight_grad_of``: Linears
    whose weight gradient is the only reason it is kept (under LoRA it stays only if one of them
    has an adapter), unless ``kernel_keeps`` names a flag under which the kernel saves it anyway.
    ``count`` = "adapters" multiplies by the number of adapted Linears. ``only_under``: the
    recompute policies it exists under alone (the outputs torchtitan's per-op policy stashes);
    ``sac_mm``: the matmul whose output it is, kept only if the policy's counter saves that matmul
    (``sac_saved_matmuls``). ``block_input``: the tensor is the block's input itself, which a checkpointed
    block keeps anyway (``checkpoint_shared_bytes``).
    """

    label: str
    elem: str
    numel: str
    part: str
    count: int | str = 1
    only: tuple[str, ...] = ()
    recomputed_by: frozenset[str] = frozenset()
    for_weight_grad_of: tuple[str, ...] = ()
    kernel_keeps: str = ""
    only_under: frozenset[str] = frozenset()
    sac_mm: str = ""
    block_input: bool = False
    # saved by the node where a weight's gradient path meets the block input's (its Linear's matmul, its
    # norm's weight multiply, or a fused norm's one node): a split backward's weight pass runs that node
    # (and frees what it saved) in the parameter group of this weight (``weight_pass_terms``); "mlp_in":
    # the MLP input's. ``fused_only``: so only where the norm is one fused node (not torch's CPU composite,
    # whose input and rstd other nodes of the input's path save too)
    weight_node: str = ""
    fused_only: bool = False

    def applies(self, sh: _Shape) -> bool:
        for flag in self.only:
            if flag.startswith("!") == bool(getattr(sh, flag.lstrip("!"))):
                return False
        if sh.recompute in self.recomputed_by:
            return False
        if self.only_under and sh.recompute not in self.only_under:
            return False
        if self.sac_mm:
            return self.sac_mm in sh.sac
        if self.for_weight_grad_of and sh.lora and not (self.kernel_keeps and getattr(sh, self.kernel_keeps)):
            return any(x in sh.lora_mods for x in self.for_weight_grad_of)
        return True

    def coefficient(self, sh: _Shape) -> int:
        n = len(sh.lora_mods) if self.count == "adapters" else self.count
        return n * _ELEM[self.elem](sh)

    def label_for(self, sh: _Shape) -> str:
        return self.label.format(n=len(sh.lora_mods), r=sh.lora_r)


#: torchtitan's per-op selective checkpointing: every tensor autograd saves inside the block is
#: recomputed in the backward from the block's checkpointed input and the policy's stash
_SAC = "selective-op"
_PER_OP = frozenset({_SAC})
_ATTENTION_CORE = frozenset({"selective", _SAC})

#: each Linear's output numel rule: column-parallel ones /t, row-parallel ones the full partial sum
_MM_OUTPUT = {"wq": "sbq_t", "wk": "sbkv_t", "wv": "sbkv_t", "wo": "sbh", "w1": "sbf_t", "w3": "sbf_t", "w2": "sbh"}
_MM_PART = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention", "w1": "mlp", "w3": "mlp",
            "w2": "mlp"}


def _stashed_matmul(name: str) -> tuple[SavedTensor, ...]:
    """What the per-op policy keeps of one Linear (and of its LoRA adapter): the mm outputs it saves."""
    part, under = _MM_PART[name], _PER_OP
    return (
        SavedTensor(f"{name} output (mm saved by the per-op policy)", "act", _MM_OUTPUT[name], part,
                    only_under=under, sac_mm=name),
        SavedTensor(f"LoRA: {name}'s A output (mm saved by the per-op policy)", "act", "sbr", "lora",
                    only=("lora",), only_under=under, sac_mm=f"{name}.A"),
        SavedTensor(f"LoRA: {name}'s B output (mm saved by the per-op policy)", "act", _MM_OUTPUT[name], "lora",
                    only=("lora",), only_under=under, sac_mm=f"{name}.B"),
    )


def _norm(n: int) -> tuple[SavedTensor, ...]:
    part = f"norm{n}"
    kept_input = frozenset() if n == 1 else _PER_OP
    return (
        # norm1's input is the block input: the checkpoint keeps it under the per-op policy, and under a
        # full checkpoint the replay of norm1 saves that same tensor (``block_input``)
        SavedTensor(f"norm{n} input", "res", "sbh_rep", part, only=("!norm_upcast",), recomputed_by=kept_input,
                    block_input=n == 1, weight_node=part, fused_only=True),
        # torch's composite RMSNorm computes in fp32 from an upcast of a 16-bit input (as its decomposition,
        # ``_fused_rms_norm`` in torch/_decomp/decompositions.py: "upcast is needed for fp16 and bf16",
        # ``upcasted_input = input.to(computation_dtype)``): pow and the mul by rsqrt save that fp32
        # upcast, not the 16-bit input (a new tensor: not what a checkpoint keeps; measured in
        # tests/backend/test_saved_tensors.py)
        SavedTensor(f"norm{n} input upcast to fp32 (torch's composite RMSNorm of a 16-bit input)", "fp32", "sbh_rep",
                    part, only=("norm_upcast",), recomputed_by=kept_input),
        # x̂ is kept for the weight's gradient: none when the norm is frozen (LoRA), none under
        # torch.compile (the fused norm keeps its input and rstd); of a 16-bit input it is the fp32
        # ``upcasted_result`` the weight multiplies (cast back to 16 bits only after)
        SavedTensor(f"norm{n} x̂ = x·rstd (torch's composite RMSNorm)", "res", "sbh_rep", part,
                    only=("composite_norm", "!lora", "!compile", "!norm_upcast"), recomputed_by=_PER_OP,
                    weight_node=part),
        SavedTensor(f"norm{n} x̂ = x·rstd in fp32 (torch's composite RMSNorm of a 16-bit input)", "fp32", "sbh_rep",
                    part, only=("norm_upcast", "!lora"), recomputed_by=_PER_OP, weight_node=part),
        SavedTensor(f"norm{n} rstd (fp32)", "fp32", "sb_rep", part, only=("torch_ops",), recomputed_by=_PER_OP,
                    weight_node=part, fused_only=True),
    )


def _qk_norms() -> tuple[SavedTensor, ...]:
    """Qwen3's q and k norms (``model.qk_norm``: an RMSNorm of head_dim weights over each head, between
    the wq / wk outputs and RoPE; backend/model.py's Attention), under "pytorch" accounting. As the
    block norms: torch's RMSNorm saves its input and the fp32 rstd (one per row: each query and key
    head of each token), and its composite (CPU) also x̂ for the weight's gradient; of a 16-bit input
    (the compute-dtype Linear outputs) the composite saves the fp32 upcast and an fp32 x̂ instead
    (measured in tests/backend/test_saved_tensors.py: 202,752 B per tiny layer, fp32 and bf16 alike)."""
    out: list[SavedTensor] = []
    for x, numel in (("q", "sbq_t"), ("k", "sbkv_t")):
        out += [
            SavedTensor(f"{x}_norm input (the w{x} output; qk_norm)", "act", numel, "attention",
                        only=("qk_norm", "torch_ops", "!qk_upcast"), recomputed_by=_PER_OP, weight_node=f"{x}_norm",
                        fused_only=True),
            SavedTensor(f"{x}_norm input upcast to fp32 (torch's composite RMSNorm of a 16-bit input; qk_norm)",
                        "fp32", numel, "attention", only=("qk_norm", "qk_upcast"), recomputed_by=_PER_OP),
            SavedTensor(f"{x}_norm x̂ = x·rstd (torch's composite RMSNorm; qk_norm)", "act", numel, "attention",
                        only=("qk_norm", "qk_composite", "!qk_upcast", "!lora", "!compile"), recomputed_by=_PER_OP,
                        weight_node=f"{x}_norm"),
            SavedTensor(f"{x}_norm x̂ = x·rstd in fp32 (torch's composite RMSNorm of a 16-bit input; qk_norm)",
                        "fp32", numel, "attention", only=("qk_norm", "qk_upcast", "!lora"), recomputed_by=_PER_OP,
                        weight_node=f"{x}_norm"),
        ]
    out.append(SavedTensor("q_norm and k_norm rstd (fp32; qk_norm)", "fp32", "qk_rows_t", "attention",
                           only=("qk_norm", "torch_ops"), recomputed_by=_PER_OP, weight_node="k_norm", fused_only=True))
    return tuple(out)


#: The saved tensors of one transformer block, in the order its ops run.
SAVED_TENSORS: tuple[SavedTensor, ...] = (
    *_norm(1),
    SavedTensor("QKV input (norm1 output)", "act", "linear_input", "attention", for_weight_grad_of=("wq", "wk", "wv"),
                only=("!float8_uncast",), recomputed_by=_PER_OP, weight_node="qkv_in"),
    SavedTensor("QKV input (norm1 output, uncast: torchao's Float8Linear saves it as it arrives)", "res",
                "linear_input", "attention", for_weight_grad_of=("wq", "wk", "wv"), only=("float8_uncast",),
                recomputed_by=_PER_OP, weight_node="qkv_in"),
    *_stashed_matmul("wq"), *_stashed_matmul("wk"), *_stashed_matmul("wv"),
    *_qk_norms(),
    SavedTensor("Q", "act", "sbq_t", "attention", recomputed_by=_PER_OP),
    # inductor recomputes the tables (arange, cos, sin) in the backward instead of saving them
    SavedTensor("rope cos and sin for Q and K (saved by their multiplies)", "act", "s_half_d", "attention", count=4,
                only=("rope", "torch_ops", "!compile"), recomputed_by=_PER_OP),
    # the model repeats K and V to every query head before the attention core (backend/model.py, as
    # torchtitan's repeat_kv): SDPA, flash or not, saves the repeated ones, and so does the attention-core
    # checkpoint of "selective" (its inputs). measure --fake, Llama 3 8B TP4 + SP, b 2: activations 1.50 GiB
    # over K, V at kv heads, = 2·(h − kv)/t · 2 B · s·b · 32 layers, under recompute none and selective alike
    SavedTensor("K, V", "act", "flash_kv_t", "attention", count=2, only=("flash",), recomputed_by=_PER_OP),
    SavedTensor("K, V (repeated to all heads)", "act", "keys_bh_t", "attention", count=2, only=("!flash",),
                recomputed_by=_PER_OP),
    SavedTensor("softmax log-sum-exp (fp32)", "fp32", "asb_t", "attention", only=("flash",),
                recomputed_by=_ATTENTION_CORE),
    SavedTensor("causal mask (bool, saved by masked_fill)", "bool", "ss", "attention", only=("!flash", "torch_ops"),
                recomputed_by=_ATTENTION_CORE),
    SavedTensor("softmax output", "act", "as2b_t", "attention", only=("!flash",), recomputed_by=_ATTENTION_CORE),
    SavedTensor("attention-dropout mask", "bool", "as2b_t", "attention", only=("!flash", "dropout"),
                recomputed_by=_ATTENTION_CORE),
    SavedTensor("attention-dropout output", "act", "as2b_t", "attention", only=("!flash", "dropout"),
                recomputed_by=_ATTENTION_CORE),
    # the per-op policy saves the attention op's outputs: SDPA's output and log-sum-exp, eager's two bmms
    SavedTensor("SDPA output (saved by the per-op policy)", "act", "sbq_t", "attention", only=("flash", "!ring"),
                only_under=_PER_OP),
    SavedTensor("SDPA log-sum-exp (fp32, saved by the per-op policy)", "fp32", "asb_t", "attention",
                only=("flash", "!ring"), only_under=_PER_OP),
    # context parallelism's ring: one flash call a cp step, each call's output and log-sum-exp saved (measure
    # --fake, Llama 3 70B s64K b2 cp4 pp8: cp-rank 0 keeps 512 + 3 × 256 MiB of outputs a microbatch, cp-rank 3
    # 4 × 512)
    SavedTensor("SDPA outputs of the ring's cp steps (the per-op policy saves each flash call's; ρ = (cp + 1 + "
                "cp-rank)/2 of the rank's queries)", "act", "sbq_ring_t", "attention", only=("flash", "ring"),
                only_under=_PER_OP),
    SavedTensor("SDPA log-sum-exps of the ring's cp steps (fp32, saved by the per-op policy)", "fp32", "asb_ring_t",
                "attention", only=("flash", "ring"), only_under=_PER_OP),
    SavedTensor("QKᵀ scores (bmm saved by the per-op policy)", "act", "as2b_t", "attention", only=("!flash",),
                only_under=_PER_OP),
    SavedTensor("attention output (the AV bmm, saved by the per-op policy)", "act", "sbq_t", "attention",
                only=("!flash",), only_under=_PER_OP),
    # the flash kernel saves its output (the o-proj input) itself
    SavedTensor("o-proj input (attention output)", "act", "sbq_t", "attention", for_weight_grad_of=("wo",),
                kernel_keeps="flash", recomputed_by=_PER_OP, weight_node="wo"),
    # context parallelism's ring attention keeps its merged output for its backward in the heads' layout (b, a, s, d),
    # so the heads' reshape of its transpose for wo is a copy, saved by wo apart (measure --fake of GPT-2 s8K cp2 pp4,
    # a block: _templated_ring_attention's results and the reshape's copy, 24 MiB each; the flash kernel's output
    # without the ring comes transposed already, the reshape a view). Both sizes are the row above's: this one counts
    # the second tensor, wo's (a W's recompute frees it with wo's group); under the selective policies the attention
    # core's own output is recomputed (the per-op one keeps its cp steps' outputs instead), and an adapted wo's row
    # below is that copy.
    SavedTensor("o-proj input: the heads' reshape of the context-parallel attention's output, a copy (which it keeps)",
                "act", "sbq_t", "attention", only=("flash", "ring", "!lora"), recomputed_by=_ATTENTION_CORE,
                weight_node="wo"),
    # an adapted wo's lora_A saves its own input apart from what the flash kernel keeps: the heads' reshape of the
    # transposed output is a copy (and under autocast peft's fp32 cast and autocast's cast back another); the frozen
    # base saves none (measured: LoRA on wo with SDPA, one s·b·q tensor a block more than the kernel's output)
    SavedTensor("o-proj input: an adapted wo's lora_A copy (the flash kernel keeps its output apart)", "act", "sbq_t",
                "attention", only=("flash", "lora", "lora_input_copy"), for_weight_grad_of=("wo",),
                recomputed_by=_ATTENTION_CORE),
    *_stashed_matmul("wo"),
    SavedTensor("o-proj reduce-scatter output (sequence parallel; saved by the per-op policy)", "act", "sbh_rep",
                "attention", only=("sp",), only_under=_PER_OP),
    SavedTensor("attention residual-dropout mask", "bool", "sbh_rep", "attention", only=("dropout",),
                recomputed_by=_PER_OP),
    *_norm(2),
    SavedTensor("MLP input (norm2 output)", "act", "linear_input", "mlp", for_weight_grad_of=("w1", "w3"),
                only=("!float8_uncast",), recomputed_by=_PER_OP, weight_node="mlp_in"),
    SavedTensor("MLP input (norm2 output, uncast: torchao's Float8Linear saves it as it arrives)", "res",
                "linear_input", "mlp", for_weight_grad_of=("w1", "w3"), only=("float8_uncast",),
                recomputed_by=_PER_OP, weight_node="mlp_in"),
    *_stashed_matmul("w1"), *_stashed_matmul("w3"),
    SavedTensor("gate output (SiLU input)", "act", "sbf_t", "mlp", only=("swiglu",), recomputed_by=_PER_OP),
    # inductor fuses silu into the product and recomputes it from the gate output (measured)
    SavedTensor("SiLU output", "act", "sbf_t", "mlp", only=("swiglu", "!compile"), recomputed_by=_PER_OP),
    SavedTensor("up output", "act", "sbf_t", "mlp", only=("swiglu",), recomputed_by=_PER_OP),
    SavedTensor("down input", "act", "sbf_t", "mlp", only=("swiglu",), for_weight_grad_of=("w2",),
                recomputed_by=_PER_OP, weight_node="w2"),
    SavedTensor("GeLU input", "act", "sbf_t", "mlp", only=("!swiglu",), recomputed_by=_PER_OP),
    SavedTensor("fc2 input (GeLU output)", "act", "sbf_t", "mlp", only=("!swiglu",), for_weight_grad_of=("w2",),
                recomputed_by=_PER_OP, weight_node="w2"),
    *_stashed_matmul("w2"),
    SavedTensor("MLP reduce-scatter output (sequence parallel; saved by the per-op policy)", "act", "sbh_rep",
                "mlp", only=("sp",), only_under=_PER_OP),
    SavedTensor("LoRA: A's output, saved by B for its gradient ({n} adapted Linears, rank r = {r})", "act", "sbr",
                "lora", count="adapters", only=("lora",), recomputed_by=_PER_OP),
    SavedTensor("MLP residual-dropout mask", "bool", "sbh_rep", "mlp", only=("dropout",), recomputed_by=_PER_OP),
)

#: the recompute kinds the per-layer table is evaluated under; "full" and "selective-layer" act per block
TABLE_RECOMPUTE = ("none", "selective", "selective-op")

for _row in SAVED_TENSORS:
    assert _row.elem in _ELEM and _row.numel in _NUMEL and _row.recomputed_by <= set(RECOMPUTE_KINDS), _row
    assert _row.only_under <= set(RECOMPUTE_KINDS), _row
    assert all(f.lstrip("!") in _FLAGS for f in _row.only), _row


def checkpoint_shared_bytes(sh: _Shape, res: int) -> int:
    """Bytes of a fully checkpointed block's recomputed tensors that are its kept input, counted once.

    torch's non-reentrant checkpoint (torch/utils/checkpoint.py, which ``checkpoint_wrapper`` uses)
    keeps the block's input: ``new_frame.save_inputs(*args)`` holds each tensor argument as a saved
    tensor (``_make_saved_tensor(arg, is_output=False)``). The backward's replay runs on those same
    tensors (``args = frame.get_inputs()``, then ``frame.recompute_fn(*args)``), and its
    ``_recomputation_hook`` stores what each op saves as ``x.detach()`` — a view of the same storage.
    So norm1's recomputed saved input is the kept block input, not a second copy. ``res``: bytes per
    element of the residual stream (fp32 under autocast)."""
    return sum(row.count * res * _NUMEL[row.numel][0](sh) for row in SAVED_TENSORS
               if row.block_input and row.applies(sh))


@lru_cache(maxsize=256)
def layer_activation_terms(sh: _Shape) -> tuple[tuple[tuple[str, int, str], ...], str]:
    """Saved-for-backward bytes of one block for one microbatch: ((label, bytes, part), ...), formula.

    The rows of ``SAVED_TENSORS`` that apply to ``sh``, evaluated; the formula's coefficient
    per basis is the sum of the rows' element bytes on it.
    """
    out: list[tuple[str, int, str]] = []
    coef: dict[str, int] = {}
    for row in SAVED_TENSORS:
        if not row.applies(sh):
            continue
        numel, basis = _NUMEL[row.numel]
        c = row.coefficient(sh)
        out.append((row.label_for(sh), c * numel(sh), row.part))
        key = basis(sh)
        coef[key] = coef.get(key, 0) + c
    parts = [f"{coef[k]}{'' if k == '1' else k}" for k in _BASIS_ORDER if coef.get(k)]
    return tuple(out), "s·b·(" + " + ".join(parts) + ")"


def _query_width(model) -> int:
    """heads · head_dim where it differs from the hidden size (``_Shape.q``), else 0; multi-head latent
    attention keeps its own accounting (h)."""
    q = model.heads * model.head_dim
    return q if q != model.hidden and model.attention != "mla" else 0


def shape_of(cfg: Config, cp_rank: int = 0) -> _Shape:
    """The activation table's shape of ``cfg`` on a rank of context-parallel rank ``cp_rank`` (it matters to
    the ring attention's saved outputs under the per-op policy only; cp-rank 0 saves the least)."""
    model, par, tr = cfg.model, cfg.parallel, cfg.training
    act = 4 if tr.precision == "fp32" else 2
    base = dict(s=cfg.local_seq_len, kv_len=model.seq_len if par.cp > 1 else 0, b=tr.micro_batch_size, h=model.hidden, a=model.heads, kv=model.kv_dim,
                f=model.ffn_hidden, t=par.tp, sp=par.sequence_parallel, act=act, dropout=model.dropout > 0,
                flash=model.attention in ("flash", "mla"), mla=model.attention == "mla", swiglu=model.mlp == "swiglu",
                recompute=tr.recompute if tr.recompute in TABLE_RECOMPUTE else "none",
                bias=block_linears_addmm(model, tr),
                compile=tr.compile, q=_query_width(model))
    if tr.finetune == "lora":
        base.update(lora_r=tr.lora_rank, lora_mods=tuple(lora.target_modules(model, tr.lora_targets)),
                    lora_fp32_base=tr.lora_base_dtype == "fp32" and tr.float8 == "none")
    if cfg.conventions.state_accounting != "pytorch":
        return _Shape(**base)
    # The per-layer terms stay at 16 bits here even under autocast (so ``activation_bytes_per_layer``
    # does not depend on the DP wrapper, and the planner's per-layer bound stays a bound);
    # ``stage_activation_terms`` adds autocast's fp32 residual stream as its own term.
    cpu = cfg.cluster.gpu.name == "cpu"
    return _Shape(**base, torch_ops=True, resid=act, float8_uncast=tr.float8 != "none" and cpu,
                  composite_norm=model.norm == "rmsnorm" and cpu,
                  rope=model.position == "rope", head_dim=model.head_dim, qk_norm=model.qk_norm, qk_composite=cpu,
                  ring_halves=par.cp + 1 + cp_rank if ring_attention(cfg) else 0)


def ring_attention(cfg: Config) -> bool:
    """Context parallelism runs torch's ring attention, a flash call per cp step (the backend's "torch" and
    "ring" methods, ``backend.parallel.context_parallel``; eager attention all-gathers K, V instead)."""
    return cfg.parallel.cp > 1 and cfg.model.attention == "flash"


def cp_ranks_differ(cfg: Config) -> bool:
    """Whether ranks of one pipeline rank differ by their cp-rank: the per-op policy saves every cp step's
    flash output, and the steps' query spans depend on the cp-rank (``_Shape.ring_halves``)."""
    return (ring_attention(cfg) and cfg.training.recompute == "selective-op"
            and cfg.conventions.state_accounting == "pytorch")


def activation_terms_per_layer(cfg: Config) -> tuple[list[Term], str]:
    """What one block saves for backward for one microbatch on one rank, tensor by tensor.

    Ignores recompute = "full" (that keeps only the block input; see ``memory_per_rank``);
    honours "selective". Returns the terms and the symbolic formula of their sum.
    """
    terms, formula = layer_activation_terms(shape_of(cfg))
    return [Term(label, x, formula, "activations", kind=f"saved:{part}") for label, x, part in terms], formula


def activation_bytes_per_layer(cfg: Config) -> int:
    """Bytes one block saves for backward for one microbatch on one rank (no full recompute)."""
    return sum(x for _, x, _ in layer_activation_terms(shape_of(cfg))[0])


# --------------------------------------------------------------------------- context parallel


def context_parallel_workspace(sh: _Shape, cp: int, rotate: str) -> tuple[int, str]:
    """The attention tensors of one layer that context parallelism does not shard, at their peak:
    (bytes, formula). Torch's ring attention (``_templated_ring_attention`` and its backward) saves
    only the rank's own Q, K, V, output and log-sum-exp (the table's rows at s = S/cp); while a
    layer's attention runs it also holds:

    * forward, "allgather": the all-gathered K, V of every rank (2·S·b·kv/t, the whole sequence)
      beside the copy of its own chunk it sends; "alltoall" (the ring): three chunks — the one in
      hand, its copy being sent and the one arriving (3 · 2·s·b·kv/t);
    * the merger of the blockwise results in fp32 (``convert_to_f32``): the running output and
      log-sum-exp, and one block's output and log-sum-exp;
    * backward: the K, V again (re-gathered, or rotated), fp32 accumulators of dQ, dK, dV, two
      blocks' gradients (``grad_query_, grad_key_, grad_value_, *rest = op(...)`` rebinds the last
      block's only once the next block's op has made its own), and the dK, dV ring (always all-to-all,
      fp32: the one sent and the one arriving). The output gradient is read as it comes (the attention
      output's transposed view) by CUDA's flash backward and by the backend's ring on the CPU flash kernel
      (``backend.parallel.context_parallel.RingFlashAttention``), which had made it contiguous (a copy no GPU
      run makes). Measured with ``measure --fake`` (the CPU ring, still copying it) of Llama 2 7B s2K b8 cp2
      fp32: 2,560.5 MiB at the attention's backward, the formula's 2,432 MiB and the 128 MiB copy.
    The layer's peak is the larger of its forward and backward. The head-tail layout (chunks i and
    2·cp−1−i of 2·cp on rank i) balances the causal work and changes no size. Eager attention (all-
    gather only) keeps the gathered K, V as its saved rows; here only their gathered form before
    the repeat to all heads (forward) and its gradient before the reduce-scatter (backward).
    """
    s, S, b, h, kv, t, a, e = sh.s, sh.keys, sh.b, sh.qd, sh.kv, sh.t, sh.a, sh.act  # h: the query width
    gathered = 2 * S * b * kv // t * e
    if not sh.flash:
        fwd, bwd = gathered, 2 * S * b * h // t * e
        return max(fwd, bwd), (f"max(forward 2·S·b·kv/t·{e} = {fwd:,} B (gathered K, V), backward 2·S·b·h/t·{e} = "
                               f"{bwd:,} B (their gradient at all heads)) with S = {S}, s = S/{cp}")
    kv_t, kv_f = _ring_kv(sh, rotate)
    kv_bytes = sum(kv_t)
    fwd = kv_bytes + _ring_merger(sh)
    grads = s * b * (h + 2 * kv) // t
    bwd = kv_bytes + 4 * grads + 2 * e * grads + 2 * 4 * 2 * s * b * kv // t
    formula = (f"max(forward {kv_f} + s·b·h/t·{4 + e} + 8·s·b·a/t (fp32 merger) = {fwd:,} B, backward the same K, V "
               f"+ (4 + 2·{e})·s·b·(h + 2kv)/t (fp32 dQ, dK, dV and two blocks') + 2 × 4·2·s·b·kv/t (dK, dV ring) = "
               f"{bwd:,} B) with S = {S}, s = S/{cp} = {s}, b = {b}, h = {h}, kv = {kv}, a = {a}, t = {t}")
    return max(fwd, bwd), formula


def attention_phase_of_fresh_gradients(cfg: Config) -> bool:
    """Without context parallelism, whether a B's moment is the larger of its first block's MLP phase and its
    attention's (the workspace ``attention_backward``, :func:`_cp_attention_after_mlp`): where FSDP2 accumulates the
    unsharded gradients over microbatches in another dtype than the parameters' (``buffers._fresh_gradients``), a dense
    block's backward writes each weight gradient fresh into .grad in the parameter dtype and the block's post-backward
    adds them in only at the block's end (``FSDPParam.accumulate_unsharded_grad_if_needed``), so by its attention's
    backward the MLP's and the output projection's are alive beside the attention's workspace, the MLP's and its norm's
    saved tensors gone. measure --fake of seed 20261252 #17 (Llama 3 70B pp8 1F1B HSDP ZeRO-2, bf16 parameters, fp32
    gradients, one block a stage): each later B peaks in ``_scaled_dot_product_flash_attention_for_cpu_backward`` with
    w1's, w2's, w3's and wo's bf16 gradients (3 × 448 + 128 MiB) and five 32 MiB s·b·h tensors, 448 MiB above the MLP's
    phase. Not under LoRA (adapters only), experts, MLA, a split backward (no B; its I's and W's are their own), or
    eager attention."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    if (par.cp > 1 or m.experts or m.attention != "flash" or tr.finetune != "full"
            or par.schedule in SPLIT_BACKWARD_SCHEDULES):
        return False
    plan = wrapping_plan(cfg)
    return plan.fsdp2 and plan.converts_gradients and (plan.unsharded_after_first_backward or par.microbatches > 1)


def attention_backward_workspace(sh: _Shape) -> tuple[int, int, str]:
    """A block's flash attention backward without context parallelism, at its op (bytes, the MLP's and its norm's saved
    bytes it no longer holds, formula; where it outweighs the MLP's phase): the residual stream's
    gradient (the attention's branch not yet added in: under SP sequence-sharded), the attention output's gradient
    (wo's backward), and the op's dQ, dK, dV — at every query head where the backend repeated K and V for grouped
    queries (``backend/model.py``: ``repeat_interleave`` before the SDPA call). measure --fake of Llama 3 70B pp8 (h =
    8,192, 2,048 tokens, 8 KV heads): five 32 MiB tensors at the op."""
    s, b, t, e = sh.s, sh.b, sh.t, sh.act
    res = sh.resid or e
    rows = s * b // t if sh.sp else s * b
    kv = sh.qd // t if sh.kv != sh.qd and not sh.mla else sh.kv // t
    ws = res * rows * sh.h + e * s * b * (2 * (sh.qd // t) + 2 * kv)
    kv_name = "q" if kv == sh.qd // t else "kv"
    formula = (f"{res}·s·b·h{'/t' if sh.sp else ''} (residual gradient) + {e}·s·b·(2·q/t + 2·{kv_name}/t) (attention "
               f"output's gradient, dQ, dK, dV) = {ws:,} B")
    return ws, _mlp_and_norm2_saved(sh), formula


def _ring_kv(sh: _Shape, rotate: str) -> tuple[tuple[int, ...], str]:
    """The K, V tensors one layer's flash ring holds while it runs (bytes each, formula): "allgather" the gathered
    K, V and the sent copy of its own chunk, "alltoall" three chunks (in hand, sent, arriving)."""
    chunk = 2 * sh.s * sh.b * sh.kv // sh.t * sh.act
    if rotate == "allgather":
        return ((2 * sh.keys * sh.b * sh.kv // sh.t * sh.act, chunk),
                f"2·S·b·kv/t·{sh.act} + 2·s·b·kv/t·{sh.act} (gathered K, V + the sent copy)")
    return (chunk,) * 3, f"3 × 2·s·b·kv/t·{sh.act} (ring: chunk in hand, sent, arriving)"


def _ring_merger(sh: _Shape) -> int:
    """The fp32 merger of the ring's blockwise outputs and log-sum-exps (bytes)."""
    return sh.s * sh.b * sh.qd // sh.t * (4 + sh.act) + 8 * (sh.a // sh.t) * sh.s * sh.b


def context_parallel_backward_tensors(sh: _Shape, rotate: str) -> tuple[int, ...]:
    """The tensors of :func:`context_parallel_workspace`'s backward one by one (bytes), for the allocation events: the
    K, V (``_ring_kv``), the fp32 dQ, dK, dV accumulators, two blocks' dQ, dK, dV, the dK, dV ring's two fp32 buffers
    (torch's ``_templated_ring_attention_backward``); () without the flash ring."""
    if not sh.flash:
        return ()
    s, b, kv, t = sh.s, sh.b, sh.kv, sh.t
    grads = (s * b * sh.qd // t, s * b * kv // t, s * b * kv // t)
    return (_ring_kv(sh, rotate)[0] + tuple(4 * g for g in grads) + tuple(sh.act * g for g in grads) * 2
            + (4 * 2 * s * b * kv // t,) * 2)


def context_parallel_forward_workspace(sh: _Shape, cp: int, rotate: str) -> tuple[int, str]:
    """The forward's part of :func:`context_parallel_workspace` (bytes, formula): what one layer's ring attention
    holds beyond its saved rows while its forward runs — the K, V it gathers or rotates and the fp32 merger of the
    blockwise results; the backward's accumulators and dK, dV ring are not there yet."""
    if not sh.flash:
        fwd = 2 * sh.keys * sh.b * sh.kv // sh.t * sh.act
        return fwd, f"2·S·b·kv/t·{sh.act} = {fwd:,} B (gathered K, V) with S = {sh.keys}, s = S/{cp}"
    kv_t, kv_f = _ring_kv(sh, rotate)
    fwd = sum(kv_t) + _ring_merger(sh)
    return fwd, f"{kv_f} + s·b·h/t·{4 + sh.act} + 8·s·b·a/t (fp32 merger) = {fwd:,} B"


# --------------------------------------------------------------------------- mixture of experts



def moe_layer_terms(cfg: Config, ep_rank: int | None = None, phi: float | None = None,
                    recompute: str | None = None, autocast: bool | None = None) -> tuple[list[tuple[str, int, str]], str]:
    """What one block's experts save for backward per microbatch on one rank, in place of the dense
    MLP's rows — every tensor autograd keeps of ``backend.model.MoE`` (a saved-tensor census of one
    block, ``tests/backend/test_moe_saved_tensors.py``, holds these rows to it byte for byte):

    * router: its input (the norm output; under TP with ep its 1/t sequence slice, the shared
      experts then keep the whole norm output), the fp32 probabilities (softmax / sigmoid output),
      the top-k indices (int64, saved by the gather), with ``norm_topk_prob`` (k > 1) the
      unnormalised top-k weights and their sum (the division's inputs);
    * sort and dispatch: the token index of each sorted (token, choice) pair (int64, saved by the
      gather ``x[token]`` and by the combine's ``index_add_``) and the sort order (int64, saved by
      the gather of the gate weights), the gathered weights (fp32);
    * experts: the dispatched tokens (the grouped GEMMs' input, after the all-to-all) and each
      expert's SwiGLU / GeLU internals for its n_r routed copies;
    * expert parallelism only: the permutation index (int64, n_r) and the expert outputs in expert
      order, which the un-permute's ``index_copy`` keeps (its source, saved whole for its shape);
    * combine: the expert outputs in fp32 (the weighting multiply's input; ``.float()`` of 16-bit
      outputs is a copy) and the weighted outputs (``index_add_`` keeps its source);
    * the shared experts as a dense MLP of S·f_e.

    Under ``conventions.moe_expert_load`` the routed copies are those of ``ep_rank``'s experts (None:
    the busiest rank's); ``phi`` gives their factor over n·k instead (one block and microbatch's).
    Under per-op selective recompute (``training.recompute``, or ``recompute`` when given) the block
    keeps only what that policy saves (``_moe_sac_terms``)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    act = 4 if tr.precision == "fp32" else 2
    h, k, e = m.hidden, m.experts_per_token, m.experts
    phi = routed_factor(cfg, ep_rank) if phi is None else phi
    n, n_r = moe_tokens(cfg, ep_rank, phi)
    rep = par.tp if par.sequence_parallel and par.ep == 1 else 1
    f_loc = m.expert_hidden // (par.tp if par.ep == 1 else 1)
    if (tr.recompute if recompute is None else recompute) == "selective-op":
        return _moe_sac_terms(cfg, ep_rank, n, n_r, rep, f_loc, act)
    inner = 4 if m.mlp == "swiglu" else 2
    # norm_topk_prob's division keeps the unnormalised top-k weights and their sum
    topk_norm = 4 * n * k + 4 * n if m.norm_topk_prob and k > 1 else 0
    # routed experts FSDP2's replicate leaves out (their replicas are the efsdp ranks) keep fp32 weights beside the
    # policy's 16-bit tokens: each matmul casts its expert's slices, as autocast does (backend.model.GroupedExperts)
    slices_cast = autocast is None and _replicate_leaves_experts_fp32(cfg)
    autocast = _moe_autocast(cfg) if autocast is None else autocast  # the planner's bound: False (a lower bound)
    # the router saves ``x_TD.float()``: a 16-bit norm output's fp32 copy (and ``w.float()``, its gate's on 16-bit
    # parameters), an fp32 one itself (autocast's residual stream). Under TP with ep each TP rank routes its 1/t
    # slice of the sequence (``SequenceShard.split``: dim 1's chunk, ``.contiguous()``); with one sample a
    # microbatch that chunk is contiguous already, so an fp32 norm output's slice is a view whose storage is the
    # whole (``measure --fake`` of Qwen3 30B tp4 ep4 under autocast, b = 1: 128 MiB a recompute, not 32)
    whole = par.ep > 1 and par.tp > 1 and tr.micro_batch_size == 1 and (autocast or act == 4)
    out = [
        ("MoE: router input (norm2 output, fp32" + (": the router runs outside autocast" if autocast else "")
         + ("; its 1/t slice is a view of the whole: one sample a microbatch" if whole else "") + ")",
         4 * (m.seq_len * tr.micro_batch_size if whole else n) * h // rep
         + (4 * h * e if act == 2 and not autocast else 0), "mlp"),  # 16-bit parameters: the gate's fp32 copy too
        (f"MoE: router scores ({m.router_score}, fp32)", 4 * n * e // rep, "mlp"),
        ("MoE: top-k expert indices (int64)" + (", the unnormalised weights and their sum (fp32)" if topk_norm else ""),
         (8 * n * k + topk_norm) // rep, "mlp"),
        ("MoE: token index and sort order of the (token, choice) pairs (int64), the gathered gate weights (fp32)",
         20 * n * k // rep, "experts"),
        (f"MoE: dispatched tokens, the grouped GEMMs' input (n·k·{phi:g} = {n_r:,} routed copies)", act * n_r * h,
         "experts"),
        (f"MoE: experts' {'gate, SiLU, up outputs and down input' if inner == 4 else 'GeLU input and output'} "
         f"for their tokens", inner * act * n_r * f_loc, "experts"),
    ]
    if autocast or slices_cast:
        # each expert's weights are slices of the grouped parameters, not leaves: autocast caches no cast of
        # them, so every forward casts each local expert's matrices anew and its matmuls save them; and
        # each Linear casts its input itself (w3's beside w1's)
        mats = 3 if inner == 4 else 2
        e_loc = e // par.ep
        out.append((f"MoE: the local experts' 16-bit weight casts ({e_loc} × {mats} matrices; slices, which "
                    "autocast does not cache)", act * e_loc * mats * f_loc * h, "experts"))
        if inner == 4 and autocast:
            out.append(("MoE: w3's own 16-bit cast of the dispatched tokens", act * n_r * h, "experts"))
    if par.ep > 1:
        out.append(("MoE: permutation index (int64) and the expert outputs in expert order (the un-permute's "
                    "index_copy source)", (8 + act * h) * n_r, "experts"))
    out += [
        ("MoE: expert outputs in fp32, kept by the combine's weighting multiply", 4 * n * k * h, "experts"),
        # in the block input's dtype (``.to(x.dtype)``): the fp32 residual stream under autocast (measure --fake of
        # Qwen3 30B-A3B under autocast: the combine keeps two fp32 n·k·h tensors)
        ("MoE: weighted expert outputs, kept by the combine's index_add_ (its source)",
         (4 if autocast else act) * n * k * h, "experts"),
    ]
    shared_in = 0
    if m.shared_experts:
        f_s = m.shared_experts * m.expert_hidden // par.tp
        n_s = m.seq_len * tr.micro_batch_size
        out.append((f"MoE: shared experts ({m.shared_experts} × f_e as one MLP) internals", inner * act * n_s * f_s,
                    "mlp"))
        split = par.ep > 1 and par.tp > 1
        if autocast:  # the router saw the rank's slice; the shared experts read it whole
            shared_in = act * (n_s - n) * h if split and not whole else 0
        else:  # they save the norm output itself: the router's own storage only where that is an fp32 view of it
            shared_in = 0 if whole or (act == 4 and not split) else act * n_s * h
        if shared_in:
            out.append(("MoE: shared experts' input, the whole norm output"
                        + (" (beyond the router's 1/t slice)" if autocast else " (the router keeps its own copy)"),
                        shared_in, "mlp"))
        if autocast:  # each of its input Linears casts the (fp32) norm output itself
            out.append(("MoE: shared experts' 16-bit casts of their input (one per input Linear)",
                        (2 if inner == 4 else 1) * act * n_s * h, "mlp"))
    if m.dropout > 0:
        out.append(("MLP residual-dropout mask", n * h // rep, "mlp"))
    tp_note = "/t" if par.ep > 1 and par.tp > 1 else ""
    formula = (f"MoE rows: n = s·b{tp_note} = {n:,} tokens, n_r = {n_r:,} routed copies: "
               f"{'4·s·b·h' if whole else '4·n·h'} + 4·n·E + 8·n·k"
               + (" + 4·n·k + 4·n" if topk_norm else "") + " + 20·n·k"
               + f" + {act}·n_r·h + {inner * act}·n_r·f_e{'/t' if par.ep == 1 and par.tp > 1 else ''}"
               + (f" + (8 + {act}·h)·n_r" if par.ep > 1 else "") + f" + (4 + {4 if autocast else act})·n·k·h"
               + (f" + {inner * act}·s·b·S·f_e/t" if m.shared_experts else "")
               + (f" + {act}·({'s·b − n' if autocast else 's·b'})·h" if shared_in else ""))
    return out, formula


def _replicate_leaves_experts_fp32(cfg: Config) -> bool:
    """FSDP2's ``replicate`` (DDP semantics for DTensor parameters) leaves the routed experts out of its mixed-precision
    policy (``backend.parallel.data_parallel.apply_replicate``: their replicas are the efsdp ranks), so they stay fp32
    beside the policy's 16-bit tokens."""
    plan = wrapping_plan(cfg)
    return (bool(cfg.model.experts) and plan.data_parallel == "replicate" and plan.compute_dtype != "fp32"
            and cfg.conventions.state_accounting == "pytorch")


def _moe_autocast(cfg: Config) -> bool:
    """Whether the backend runs the blocks under ``torch.autocast`` (torch's accounting): the routed
    experts' weight slices are then cast on every forward (``moe_layer_terms``)."""
    return cfg.conventions.state_accounting == "pytorch" and wrapping_plan(cfg).autocast


def _even_expert_share(cfg: Config, ep_rank: int | None, local: int) -> float:
    """The share of a rank's routed copies that its even-numbered local experts (0, 2, ...) compute:
    under ``conventions.moe_expert_load`` their loads over the rank's (``ep_rank``'s experts; the
    busiest rank's when None), else balanced."""
    load = mean_expert_load(cfg)
    if load:
        ep = cfg.parallel.ep
        if ep_rank is None:
            shares = load_shares(load, ep)
            ep_rank = max(range(ep), key=shares.__getitem__)
        mine = load[ep_rank * local:(ep_rank + 1) * local]
        if sum(mine) > 0:
            return sum(mine[0::2]) / sum(mine)
    return ((local + 1) // 2) / local


def _moe_sac_terms(cfg: Config, ep_rank: int | None, n: int, n_r: int, rep: int, f_loc: int,
                   act: int) -> tuple[list[tuple[str, int, str]], str]:
    """A MoE block's experts under per-op selective recompute: only what the policy's save list
    outputs is kept (``backend.parallel.recompute.save_ops``; the block input is the checkpoint's, in
    the attention half): the router's fp32 logits where its matmul's count is odd, top-k's values
    (fp32) and indices (int64), and the outputs of the experts' saved matmuls (``sac_saved_moe``: with
    SwiGLU, w3's of the even local experts and w1's and w2's of the odd ones), the shared experts'
    likewise. Everything else (the norm output, the dispatch and its all-to-all, the SiLU, the
    combine) is recomputed in the block's backward. Measured: a saved-storage census of one block
    under the backend's policy, ``tests/backend/test_moe_saved_tensors.py``."""
    m, par = cfg.model, cfg.parallel
    h, k, e = m.hidden, m.experts_per_token, m.experts
    swiglu = m.mlp == "swiglu"
    local = e // par.ep if par.ep > 1 else e
    lora_mods = tuple(lora.target_modules(m, cfg.training.lora_targets)) if cfg.training.finetune == "lora" else ()
    router, experts, shared_saved = sac_saved_moe(swiglu, m.bias, m.router_bias, local, m.shared_experts > 0,
                                                  lora_mods)
    even = _even_expert_share(cfg, ep_rank, local)
    width = {"w1": f_loc, "w3": f_loc, "w2": h}
    per_copy_even = sum(width[w] for w in experts[0])
    per_copy_odd = sum(width[w] for w in experts[1]) if local > 1 else 0
    n_even = round(n_r * even)
    routed = act * (n_even * per_copy_even + (n_r - n_even) * per_copy_odd)
    out = [
        ("MoE: router logits (fp32, its matmul saved by the per-op policy)", 4 * n * e // rep if router else 0,
         "mlp"),
        ("MoE: top-k values (fp32) and indices (int64), saved by the per-op policy", 12 * n * k // rep, "mlp"),
        (f"MoE: the experts' saved matmul outputs ({'+'.join(sorted(experts[0]))} of even local experts, "
         f"{'+'.join(sorted(experts[1])) if local > 1 else '-'} of odd ones) for their {n_r:,} routed copies",
         routed, "experts"),
    ]
    formula = (f"MoE rows under the per-op policy: n = {n:,} tokens, n_r = {n_r:,} routed copies"
               f" ({n_even:,} to even local experts): " + ("4·n·E + " if router else "") + "12·n·k"
               + f" + {act}·(n_even·({per_copy_even}) + n_odd·({per_copy_odd}))")
    if m.shared_experts:
        f_s = m.shared_experts * m.expert_hidden // par.tp
        n_s = m.seq_len * cfg.training.micro_batch_size
        widths = {"w1": f_s, "w3": f_s, "w2": h}
        kept = act * n_s * sum(widths[w] for w in shared_saved)
        out.append((f"MoE: shared experts' saved matmul outputs ({'+'.join(sorted(shared_saved)) or 'none'})", kept,
                    "mlp"))
        formula += f" + {act}·s·b·({' + '.join(str(widths[w]) for w in sorted(shared_saved)) or 0})"
    return out, formula


# --------------------------------------------------------------------------- per stage


def _checkpointed_of_stages(cfg: Config, rp) -> dict[int, int]:
    """Blocks recomputed whole in each of the rank's stages: all under "full"; under
    "selective-layer" torchtitan's every ``recompute_every``-th block, counted over the rank's stages
    in stage order (``engine.model.recompute.checkpointed_per_stage``); none otherwise."""
    tr = cfg.training
    stages = sorted(rp.stages, key=lambda st: st.stage)
    if tr.recompute == "full":
        return {st.stage: st.layers for st in stages}
    if tr.recompute != "selective-layer":
        return {st.stage: 0 for st in stages}
    counts = checkpointed_per_stage([st.layers for st in stages], tr.recompute_every)
    return {st.stage: c for st, c in zip(stages, counts)}



def _lora_first_block_saving(sh: _Shape, layer_terms, res: int, sbh_rep: int) -> tuple[str, int, str, str]:
    """What the first block of stage 0 does not save under LoRA: nothing before the first adapter
    requires grad (frozen embedding), so the ops there keep nothing for backward. With attention
    adapters that is norm1; with MLP adapters only, the whole attention half and norm2."""
    if any(x in sh.lora_mods for x in ("wq", "wk", "wv")):
        parts, n_norm, what = {"norm1"}, 1, "norm1"
        no_grad_in = ("wq", "wk", "wv")  # their input is norm1's output
    else:
        parts, n_norm, what = {"norm1", "attention", "norm2"}, 2, "the attention half and norm2"
        no_grad_in = ("wq", "wk", "wv", "wo", "w1") + (("w3",) if sh.swiglu else ())
    skipped = [x for _, x, part in layer_terms if part in parts]
    # the norm inputs (a frozen composite RMSNorm keeps no x̂) at the residual stream's dtype, and the casts
    # of the frozen Linears whose input needs no gradient (their matmuls save nothing)
    total = sum(skipped) + n_norm * (res - sh.act) * sbh_rep + (frozen_casts_saved(sh, no_grad_in) if res > sh.act else 0)
    return (f"LoRA: the first block saves nothing for {what} (its input needs no gradient before the first "
            "adapter)", -total, f"−{total:,} B", "lora_first_block")


def moe_stage_block_bytes(cfg: Config, rp, per_moe_of, ep_rank: int,
                          microbatches: dict[int, tuple[int, ...]] | None = None) -> dict[int, tuple[int, str]]:
    """Under a measured expert load given per block or microbatch: per stage of ``rp``, one MoE
    block's bytes averaged over the stage's MoE blocks and over ``microbatches[stage]`` (those in
    flight at the rank's peak; all of them when not given), and the words saying so.
    ``per_moe_of(phi)`` is one MoE block's bytes at routed factor ``phi``."""
    m, par = cfg.model, cfg.parallel
    split = split_layers(m.layers, par.num_stages, par.pipeline_split)
    out = {}
    for st in rp.stages:
        blocks = [i - m.dense_layers for i in split[st.stage] if m.is_moe_layer(i)]
        if not blocks:
            continue
        mbs = (microbatches or {}).get(st.stage) or tuple(range(par.microbatches))
        cache: dict[float, int] = {}
        total = 0
        for mb in mbs:
            for b in blocks:
                phi = routed_factor_of(cfg, ep_rank, mb, b)
                if phi not in cache:
                    cache[phi] = per_moe_of(phi)
                total += cache[phi]
        which = (f"microbatch{'es' if len(mbs) > 1 else ''} {', '.join(map(str, mbs))}"
                 if microbatches and st.stage in microbatches else "every microbatch")
        out[st.stage] = (-(-total // (len(mbs) * len(blocks))),
                         f"the measured load of each of its {len(blocks)} MoE blocks at {which}, averaged")
    return out


def frozen_16bit_stream(cfg: Config) -> bool:
    """Whether the residual stream is 16-bit under autocast because LoRA's frozen base is (``training.lora_base_dtype
    = "bf16"``): backend.parallel.lora casts every frozen parameter, the token embedding and the norms included, so
    the embedding's output is bf16 and autocast leaves the residual adds and the norms in it. A CPU run of the tiny
    preset (pp2, LoRA bf16 base) receives bf16 activations: its receive buffers are half the fp32 ones. Not under
    fp16 autocast: its fp16 block outputs added to the bf16 stream promote the sum to fp32 (torch's type promotion)."""
    tr = cfg.training
    return tr.finetune == "lora" and tr.lora_base_dtype == "bf16" and tr.precision == "bf16-mixed"


def stage_activation_terms(cfg: Config, rp, T: Terms, *, torch_acc: bool, autocast: bool, psi_train: int,
                           in_flight, ep_rank: int | None = None,
                           moe_microbatches: dict[int, tuple[int, ...]] | None = None,
                           plain_grads: bool = False) -> dict:
    """Activations of every local stage (each multiplied by its microbatches in flight), the block a
    recomputing backward rebuilds (activations) and the loss temporaries. ``in_flight(unit_bytes)``
    gives the per-local-stage counts; ``ep_rank`` picks the routed copies under a measured expert load;
    where that load is given per block or microbatch, a stage's MoE blocks follow their own loads at
    ``moe_microbatches[stage]`` (the microbatches in flight at the peak; every microbatch when not given).
    ``plain_grads``: the gradients are plain tensors a fresh one is added to (not FSDP2's).

    Returns what the buffers need: the residual stream's element bytes and numel.
    """
    model, par, tr = cfg.model, cfg.parallel, cfg.training
    t = par.tp
    s, b, h = cfg.local_seq_len, tr.micro_batch_size, model.hidden  # the rank's tokens (seq_len / cp)
    lora_on = tr.finetune == "lora"
    sh = shape_of(cfg, rp.cp_rank)
    stream16 = autocast and frozen_16bit_stream(cfg)  # autocast over LoRA's bf16 base: a 16-bit residual stream
    if sh.composite_norm and not sh.compile and (not autocast or stream16) and sh.act == 2:
        # 16-bit compute without autocast is FSDP2's MixedPrecisionPolicy (engine.wrapping): the blocks
        # run on 16-bit parameters, so the residual stream, and every norm's input, is 16-bit; so it is under
        # autocast over LoRA's base frozen in bf16
        sh = dataclasses.replace(sh, norm_upcast=True)
    if lora_on and autocast:
        sh = dataclasses.replace(sh, adapter_cast=True)
    act, sp = sh.act, sh.sp
    # residual stream: stage inputs/outputs, p2p buffers (autocast keeps it, and the norms, in fp32; a LoRA base
    # frozen in bf16 makes it 16-bit: ``frozen_16bit_stream``)
    res = 4 if autocast and not stream16 else act
    sbh_rep = s * b * h // sh.rep
    hs = "h/t" if sp else "h"
    v_loss = loss_vocab(cfg, sp=sp, torch_acc=torch_acc)
    # blocks recomputed whole (full: all; selective-layer: torchtitan's every N-th block of the rank)
    ckpt_of = _checkpointed_of_stages(cfg, rp)
    n_stages = par.num_stages
    holds_last = any(st.stage == n_stages - 1 for st in rp.stages)
    blocks = _block_sizes(cfg, rp, sh, res, ep_rank, moe_microbatches, lora_copies=stream16)
    extras = [_stage_extras(cfg, st, sh, blocks.layer_terms, ckpt_of, torch_acc=torch_acc, res=res, v_loss=v_loss)
              for st in rp.stages]
    unit_bytes = []
    for st, ex in zip(rp.stages, extras):
        c = ckpt_of[st.stage]
        d_plain, m_plain = blocks.plain_split(st, c)
        moe_bytes = blocks.per_moe_of_stage.get(st.stage, (blocks.per_moe, ""))[0] if blocks.moe else 0
        unit_bytes.append(c * blocks.kept + d_plain * blocks.per_layer + m_plain * moe_bytes
                          + sum(x for _, x, _, _ in ex))
    counts = _stage_counts(in_flight, unit_bytes)
    dims = f"s={s}, b={b}, h={h}, a={model.heads}, f={model.ffn_hidden}, t={t}"
    if par.cp > 1:
        dims += f", S={model.seq_len}: s = S/cp, cp={par.cp}"
        if sh.ring and sh.recompute == _SAC:
            dims += f", ρ = (cp + 1 + {rp.cp_rank})/2 = {sh.ring_halves / 2:g}"
    for st, ex, n, top in zip(rp.stages, extras, counts, _moe_top_of_stages(cfg, rp, T, sh, res, ckpt_of, ep_rank)):
        _add_stage_terms(T, st, ex, n, ckpt_of[st.stage], blocks, dims, tr.recompute_every, top)
    if torch_acc and par.pp > 1 and holds_last and cfg.conventions.pipeline_outputs == "kept":
        pipeline_output_terms(T, act * s * b * v_loss, par.microbatches, n_stages - 1,
                              f"{act}·s·b·{_v_symbol(model, v_loss)}")
    if autocast:
        _autocast_cast_terms(cfg, rp, T, act, psi_train)
    _recomputed_block_terms(cfg, rp, T, sh, blocks, ckpt_of, res, dims, ep_rank)
    _attention_workspace_terms(cfg, T, sh, torch_acc)
    if holds_last:
        _loss_terms(cfg, T, act, torch_acc=torch_acc, sp=sp, v_loss=v_loss)
    moe_combine = False
    if blocks.moe and torch_acc:
        # under full recompute the block's backward runs on its recomputed tensors and makes the same expert
        # gradients, the later blocks having kept only their inputs (measured with plain parameters: CPU runs
        # s31#03, s2026#13 MoE GPipe full 14.2 -> 0.6 %, 12.5 -> 1.2 %; measure --fake Qwen3 30B GPipe ZeRO-1 full
        # -12.3 -> +5.9 %). Under FSDP2 accumulating in another dtype the input buffers are the unit's fresh .grad,
        # which its own term counts (``fresh_buffers``: counted twice, s31#22 ZeRO-3 full read 1.6 -> 13.9 % and
        # seed 20261206 #29 −3 → +8 %, so only the combine's backward was laid under FSDP2; that left the experts'
        # moment out where it is the peak: measure --fake seed 20261227 #00 Qwen3 235B LoopedBFS ZeRO-3 ep2 bf16
        # gradients −14.0 → +0.7 %, seed 20261225 Mixtral LoopedBFS ZeRO-3 ep2 fp32 gradients −6.9 → +0.2 %).
        # Attention-core recompute ("selective") recomputes nothing
        # of the MoE half, whose backward runs on its saved tensors as under "none": the combine's backward is
        # laid the same (measure --fake, seed 20261208 #03, Qwen3 30B pp8 ZeRO-2: the fake's 6.0 GiB of fp32
        # n·k·h temporaries; allocated −15 … −23 → −5 … +3 % on its 8 ranks).
        # Per-layer recompute ("selective-layer") runs each block's backward as "none" or "full" does, on its saved
        # or recomputed tensors: the same moment (seed 20261209 #15 Qwen3 30B tp4 pp4 ep4: −20 … −22 → −9 … −17 %,
        # seed 20261211 #17 ep8 ZeRO-2: −11 … −14 → −2 … −5 %; no row of five seeds leaves its bounds)
        fresh_buffers, unit_grads = _expert_buffers_held(cfg, plain_grads)
        moe_combine = moe_backward_terms(cfg, rp, T, ep_rank, autocast,
                                         blocks.kept if tr.recompute == "full" else blocks.per_layer, moe_microbatches,
                                         fresh_buffers=fresh_buffers, unit_grads=unit_grads)
    if autocast and plain_grads and par.pp > 1 and par.microbatches > 1 and torch_acc and not lora_on:
        # (LoRA casts its adapters only: not laid; float8 casts no block weight: the head's cast and the fp32 token
        # embedding's gradient are left)
        _autocast_waiting_gradients(cfg, rp, T, act)
    if torch_acc and any(st.layers for st in rp.stages):
        _forward_transient_terms(cfg, rp, T, sh, res, moe=blocks.moe, lora_casts=lora_on and autocast,
                                 autocast=autocast, recomputed=any(ckpt_of[st.stage] for st in rp.stages))
    if torch_acc and par.pp > 1 and par.schedule not in SPLIT_BACKWARD_SCHEDULES \
            and any(st.stage == 0 for st in rp.stages):
        _embedding_backward_terms(T, res=res, sbh=s * b * h, sbh_rep=sbh_rep, hs=hs,
                                  sent=sends_held(par.schedule) == "all")
    mlp_phase, before_weight_gradients = 0, False
    if torch_acc:
        before_weight_gradients = block_backward_terms(
            cfg, rp, T, act=act, res=res, sbh_rep=sbh_rep, hs=hs, holds_last=holds_last, plain_grads=plain_grads,
            fp32_linear_inputs=autocast and sh.float8_uncast, autocast=autocast, lora_mods=sh.lora_mods if lora_on else None,
            early_stop=_first_block_replays(cfg, rp, ckpt_of))
        if par.cp > 1:
            mlp_phase = _cp_attention_after_mlp(T, sh)
        _autocast_waiting_phases(cfg, rp, T, sh, act, plain_grads=plain_grads, autocast=autocast)
        _recompute_forward_before_mlp(T)  # (LoRA)
        if par.schedule in SPLIT_BACKWARD_SCHEDULES and par.pp > 1 and model.attention != "mla" and not lora_on:
            split_backward_terms(cfg, rp, T, act=act, res=res, sbh_rep=sbh_rep, hs=hs, ep_rank=ep_rank)
    if torch_acc and par.pp > 1:
        kept_send_terms(cfg, rp, T, res=res, sbh_rep=sbh_rep, hs=hs)
    if torch_acc and par.schedule in SPLIT_BACKWARD_SCHEDULES and par.pp > 1 and model.attention != "mla" \
            and not sh.compile:
        keeps = None if lora_on else (split_backward_group_grads(cfg, act, res, sbh_rep),
                                      moe_split_backward_group_grads(cfg, act, res, sbh_rep, ep_rank) if blocks.moe
                                      else None)
        weight_pass_terms(cfg, rp, T, sh, blocks, ckpt_of, res, autocast, keeps, ep_rank)
    return {"res": res, "sbh_rep": sbh_rep, "hs": hs, "mlp_phase": mlp_phase,
            "before_weight_gradients": before_weight_gradients or moe_combine}


def _attention_workspace_terms(cfg: Config, T: Terms, sh: _Shape, torch_acc: bool) -> None:
    """What a block's attention holds beyond its saved tensors while it runs: the context-parallel ring's workspace
    (forward and backward), or without it the flash backward's where a B's attention phase may hold FSDP2's fresh
    gradients (``Terms.attention_phase``, laid by ``engine.memory.buffers._fresh_gradients``)."""
    par = cfg.parallel
    if par.cp == 1 and torch_acc and attention_phase_of_fresh_gradients(cfg):
        T.attention_phase = attention_backward_workspace(sh)
    if par.cp > 1:
        ws, formula = context_parallel_workspace(sh, par.cp, par.cp_rotate)
        T.add("temporaries", f"context-parallel attention of one layer ({par.cp_rotate}): what is not sharded, "
              "at the peak of its forward and backward", ws, formula, kind="cp_attention")
        pieces = context_parallel_backward_tensors(sh, par.cp_rotate)
        T.cp_pieces = pieces if sum(pieces) == ws else ()
        # the same at a forward's moment; a split backward's W runs no attention backward (stage_backward_weight asks
        # for the weights' gradients, the I made the attention's), and its recompute's forward workspace is gone by
        # the end of a group's recompute, where the W peaks (measure --fake of GPT-2 DualPipeV pp2 cp4: none there)
        ws_f, formula_f = context_parallel_forward_workspace(sh, par.cp, par.cp_rotate)
        # (made in a forward: the activations, as torch's MemTracker files every tensor a forward makes)
        T.add("activations", f"context-parallel attention of one layer ({par.cp_rotate}) in a forward", ws_f, formula_f,
              kind="cp_attention_forward")


def _v_symbol(model, v_loss: int) -> str:
    """How a formula names the loss's vocabulary: all of it, or a TP rank's shard."""
    return "⌈V/t⌉" if v_loss != model.vocab else "V"


#: the numel of each of a dense block's Linears (``_LINEARS``) on a TP rank
_LINEAR_NUMEL = {"wq": lambda sh: sh.h * sh.qd // sh.t, "wk": lambda sh: sh.h * sh.kv // sh.t,
                 "wv": lambda sh: sh.h * sh.kv // sh.t, "wo": lambda sh: sh.qd * sh.h // sh.t,
                 "w1": lambda sh: sh.h * sh.f // sh.t, "w2": lambda sh: sh.h * sh.f // sh.t,
                 "w3": lambda sh: sh.h * sh.f // sh.t}


def frozen_casts_saved(shape: _Shape, linears: tuple[str, ...] | None = None) -> int:
    """Bytes of the 16-bit casts of a frozen fp32 base that the matmuls of one block (or of ``linears``)
    save, for one microbatch. Autocast caches only the casts of leaves that require grad
    (aten/src/ATen/autocast_mode.cpp, ``cached_cast``: ``arg.requires_grad() && arg.is_leaf()``), so each
    frozen Linear's weight is cast anew by every forward, and its matmul saves that cast for its input's
    gradient (mm saves mat2 where self requires grad). Measured: ``measure --fake`` of Llama 2 7B, LoRA on
    the MLP, fp32 base, bf16-mixed: the w1, w3, w2 casts (86 MiB each) beside the block's tensors, and the
    head's (250 MiB) once per microbatch. None where the table's per-op policy, torch.compile or MLA apply
    (the casts recomputed or fused; MLA's projections are not these)."""
    if not (shape.lora and shape.lora_fp32_base) or shape.recompute == "selective-op" or shape.compile or shape.mla:
        return 0
    names = linears if linears is not None else tuple(n for n in _LINEARS if shape.swiglu or n != "w3")
    return shape.act * sum(_LINEAR_NUMEL[n](shape) for n in names)


def _expert_buffers_held(cfg: Config, plain_grads: bool) -> tuple[bool, bool]:
    """Where the experts' input buffers (the sums of their select_backward outputs) are counted, for
    ``moe_backward_terms``: (``fresh_buffers``: FSDP2 accumulating in another dtype over microbatches or pipelined, its
    fresh-gradient term holds them; ``unit_grads``: FSDP2 walking its units once, one microbatch unpipelined, where no
    fresh-gradient term is laid and the buffers are the unsharded parameters' .grad, which no gradient term counts
    either). measure --fake of Qwen3 30B dp32 ZeRO-3 per-op recompute m1 (seed 20261234 #20): its peak holds w1's,
    w2's, w3's 384 MiB bf16 buffers beside two fresh ones, −9.1 % without them. Plain gradients (DDP, ZeRO-1) in a
    step's one backward alike: no ``.grad`` exists while the experts' loop runs (torch's accounting: each is made as
    the walk reaches its parameter, ``states.plain_grads_late``), so the buffers are partial sums beside it, tracked
    as temporaries, until AccumulateGrad takes each finished one (measure --fake of a tiny MoE DDP dp4 ZeRO-1 step,
    accuracy sweep seed 20261233 #23: w2's old sum, its new select_backward output and their sum beside w1's sum and
    its last select_backward output at the peak). Not replicate's left-out experts (their gradients are plain ones)."""
    plan = wrapping_plan(cfg)
    unit = not plain_grads and not replicate_expert_grads(cfg, plan)
    fresh_term = plan.unsharded_after_first_backward or cfg.parallel.microbatches > 1
    plain_first = plain_grads and plain_grads_late(cfg, plan)
    return unit and plan.converts_gradients and fresh_term, (unit and not fresh_term) or plain_first


def _norm_output_casts(shape: _Shape, lora_on: bool) -> tuple[int, int]:
    """The 16-bit casts of a norm's fp32 output that a block's Linears save under autocast beyond the table's one
    row per norm output, (the attention's, the MLP's): autocast casts an activation once per Linear that reads it
    (it caches only weights), so q, k, v each save their own copy, gate and up too under SwiGLU. Under LoRA only
    the adapted Linears save their input (their A); none under the per-op policy (aten._to_copy is not in its save
    list), torch.compile (AOTAutograd's CSE merges the identical casts of one norm output) or torchao's
    Float8Linear under CPU autocast (it casts nothing: its fp32 input row)."""
    if shape.recompute == "selective-op" or shape.compile or shape.float8_uncast:
        return 0, 0
    if lora_on:
        return (max(0, sum(x in shape.lora_mods for x in ("wq", "wk", "wv")) - 1),
                max(0, sum(x in shape.lora_mods for x in ("w1", "w3")) - 1))
    return 2, 1 if shape.swiglu else 0


def _block_bytes(shape: _Shape, terms, formula: str, res: int, lora_on: bool,
                 lora_copies: bool = False) -> tuple[int, str]:
    """One block's saved bytes for one microbatch under ``shape`` (``terms``: its activation table, summed
    in ``formula``), with autocast's fp32 norms and casts where the residual stream (``res`` bytes an
    element) is wider than the compute dtype. ``lora_copies``: autocast over a 16-bit stream (LoRA's base frozen
    in bf16, ``frozen_16bit_stream``): no fp32 norm, but each adapted Linear's lora_A still saves its own 16-bit copy
    of the input (peft casts it to the fp32 adapters' dtype, autocast back: the frozen base's matmul saves none)."""
    act, s, b, h = shape.act, shape.s, shape.b, shape.h
    total = sum(x for _, x, _ in terms)
    if res <= act and not lora_copies:
        return total, formula
    hs = "h/t" if shape.sp else "h"
    # the kept tensors of the residual stream's dtype: the norm inputs (and x̂ of composite RMSNorm)
    fp32_rows = [row for row in SAVED_TENSORS if row.elem == "res" and row.applies(shape)] if res > act else []
    n_fp32 = sum(row.count for row in fp32_rows)
    total += sum(row.count * (res - act) * _NUMEL[row.numel][0](shape) for row in fp32_rows)
    n_casts = sum(_norm_output_casts(shape, lora_on))
    total += n_casts * act * s * b * h
    formula += ((f" + {n_fp32}·{res - act}·s·b·{hs} (autocast: norms in fp32)" if res > act else "")
                + f" + {n_casts}·{act}·s·b·h (autocast: one input cast per " + ("adapted " if res <= act else "")
                + "Linear)")
    casts = frozen_casts_saved(shape) if lora_on else 0
    if casts:
        total += casts
        formula += f" + {casts:,} B (autocast: the frozen fp32 base's 16-bit weight casts its matmuls save)"
    return total, formula


@dataclass(frozen=True)
class _Blocks:
    """What one block of the rank saves for one microbatch: a dense block (``per_layer``, its table
    ``layer_terms``), a MoE block (``per_moe``; ``per_moe_of_stage``: stage -> its own bytes and how,
    under a measured per-block or per-microbatch expert load), and a checkpointed block (``kept``, its
    input); each with its formula."""

    layer_terms: list
    per_layer: int
    layer_formula: str
    kept: int
    kept_formula: str
    moe: bool = False
    per_moe: int = 0
    moe_formula: str = ""
    per_moe_of_stage: dict = dataclasses.field(default_factory=dict)
    lora_on: bool = False
    lora_copies: bool = False  # autocast over a LoRA base frozen in bf16 (``_block_bytes``)

    def plain_split(self, st, c: int) -> tuple[int, int]:
        """(dense, MoE) blocks among a stage's blocks not checkpointed whole (the checkpointed
        ones counted among the MoE blocks first: an upper estimate under selective-layer)."""
        if not self.moe:
            return st.layers - c, 0
        moe_plain = max(0, st.moe_layers - c)
        return st.layers - c - moe_plain, moe_plain


def _block_sizes(cfg: Config, rp, sh: _Shape, res: int, ep_rank: int | None,
                 moe_microbatches: dict[int, tuple[int, ...]] | None, lora_copies: bool = False) -> _Blocks:
    """The rank's :class:`_Blocks`: the activation table under ``sh``, autocast's additions where the
    residual stream is ``res`` bytes wide, the experts' rows for a MoE block."""
    lora_on = cfg.training.finetune == "lora"
    layer_terms, layer_formula = layer_activation_terms(sh)
    per_layer, layer_formula = _block_bytes(sh, layer_terms, layer_formula, res, lora_on, lora_copies)
    hs = "h/t" if sh.sp else "h"
    kept = res * (sh.s * sh.b * sh.h // sh.rep)
    common = dict(layer_terms=layer_terms, per_layer=per_layer, layer_formula=layer_formula, kept=kept,
                  kept_formula=f"{res}·s·b·{hs} (checkpointed block input)", lora_on=lora_on,
                  lora_copies=lora_copies)
    if cfg.model.experts == 0:
        return _Blocks(**common)
    # a block with experts: the dense MLP's rows give way to the experts'
    moe_rows, moe_formula = moe_layer_terms(cfg, ep_rank)
    # (and the dense MLP's autocast cast of its input, which the experts' rows hold as their own)
    mlp_casts = _norm_output_casts(sh, lora_on)[1] if res > sh.act or lora_copies else 0
    attn_half = per_layer - sum(x for _, x, part in layer_terms if part == "mlp") - mlp_casts * sh.act * sh.s * sh.b * sh.h
    per_moe_of_stage: dict[int, tuple[int, str]] = {}
    if ep_rank is not None and cfg.parallel.ep > 1 and varying_expert_load(cfg):
        per_moe_of_stage = moe_stage_block_bytes(
            cfg, rp, lambda phi: attn_half + sum(x for _, x, _ in moe_layer_terms(cfg, ep_rank, phi)[0]),
            ep_rank, moe_microbatches)
    return _Blocks(**common, moe=True, per_moe=attn_half + sum(x for _, x, _ in moe_rows),
                   moe_formula=f"{layer_formula} with the MLP's rows replaced by the {moe_formula}",
                   per_moe_of_stage=per_moe_of_stage)


def pipeline_output_terms(T: Terms, logits: int, m: int, last: int, each: str) -> None:
    """``conventions.pipeline_outputs = "kept"``: the training loop calls ``step()`` with its default
    ``return_outputs=True`` (torchtitan ≤ 0.2.0), so the last stage appends every microbatch's output (the
    logits, ``logits`` bytes each) to ``output_chunks`` in its forward (torch/distributed/pipelining/stage.py:
    ``if self.is_last and save_forward_output``) and keeps them to the step's end, when ``step()`` returns
    ``_merge_outputs(output_chunks)``: one ``torch.cat`` of them all, made after the last backward and
    dropped by a loop that discards it (measured in ``measure --fake``: GPT-2 at 64K tokens, 4 microbatches,
    a 12.3 GiB request at the step's end that no cached block holds)."""
    T.add("activations", "last stage: every microbatch's logits, kept by the schedule to merge the output "
          "(step(return_outputs=True))", m * logits, f"m × {each} = {m} × {logits:,} B", stage=last, in_flight=m,
          kind="pipeline_outputs")
    T.add("temporaries", "last stage: step()'s merged output, torch.cat of every microbatch's logits after the last "
          "backward", m * logits, f"m × logits = {m} × {logits:,} B", kind="pipeline_output_merge")


def _stage_extras(cfg: Config, st, sh: _Shape, layer_terms, ckpt_of: dict[int, int], *, torch_acc: bool, res: int,
                  v_loss: int) -> list[tuple[str, int, str, str]]:
    """What a local stage saves for one microbatch beyond its blocks, as (label, bytes, formula, kind):
    the first stage's token ids (and dropout mask), a later stage's input (the p2p buffer, taken off),
    the last stage's final norm, head input and log-probabilities, another stage's kept output."""
    model = cfg.model
    lora_on = cfg.training.finetune == "lora"
    act, s, b, h = sh.act, sh.s, sh.b, sh.h
    sbh_rep = s * b * h // sh.rep
    hs = "h/t" if sh.sp else "h"
    n_stages = cfg.parallel.num_stages
    ex: list[tuple[str, int, str, str]] = []
    if st.stage == 0:
        if not lora_on:  # a frozen embedding saves nothing
            ex.append(("token ids (int64, embedding backward)", 8 * s * b, "8·s·b", "token_ids"))
        elif ckpt_of[st.stage] == 0 and sh.recompute != "selective-op":
            # (the per-op policy's stash and the checkpointed input are kept whatever needs grad)
            ex.append(_lora_first_block_saving(sh, layer_terms, res, sbh_rep))
        if model.dropout > 0 and not lora_on:
            ex.append(("embedding-dropout mask", sbh_rep, "s·b·" + hs, "embedding_dropout_mask"))
    elif torch_acc:
        ex.append(("stage input is the p2p receive buffer (counted in comm_buffers)", -res * sbh_rep,
                   f"−{res}·s·b·{hs}", "stage_input_in_p2p_buffer"))
    if st.stage != n_stages - 1:
        if torch_acc:
            ex.append(("stage output kept by the pipeline stage for its backward", res * sbh_rep,
                       f"{res}·s·b·{hs}", "stage_output"))
        return ex
    # the head's saved input: under sequence parallel its ColwiseParallel gathers the sequence shards
    # (input_layouts Shard(1) → Replicate, backend/parallel/tensor_parallel.py as torchtitan), and F.linear
    # saves that gathered input for the weight gradient, as the blocks' linears do ("linear_input"). measure
    # --fake, Llama 3 70B FSDP32 × TP8 + SP: activations 1.75 GiB over s·b·h/t, = 2·s·b·h·(1 − 1/t)
    head_input = (("head input, gathered from the sequence shards", act * s * b * h, f"{act}·s·b·h", "head_input")
                  if sh.sp and sh.torch_ops else ("head input", act * sbh_rep, f"{act}·s·b·{hs}", "head_input"))
    if torch_acc and sh.norm_upcast:
        # the composite RMSNorm of a 16-bit input saves its fp32 upcast and fp32 x̂ (``_norm``)
        ex.append(("final-norm input upcast to fp32 (composite RMSNorm of a 16-bit input)", 4 * sbh_rep,
                   f"4·s·b·{hs}", "final_norm"))
        xhat = 0 if lora_on else 4 * sbh_rep
        ex.append(("final-norm rstd" + ("" if lora_on else " and x̂ in fp32 (composite RMSNorm)"),
                   xhat + 4 * s * b // sh.rep, ("" if lora_on else f"4·s·b·{hs} + ") + "4·s·b", "final_norm"))
        if not lora_on:
            ex.append(head_input)
    elif torch_acc:
        ex.append(("final-norm input", res * sbh_rep, f"{res}·s·b·{hs}", "final_norm"))
        if sh.composite_norm and not lora_on:
            ex.append(("final-norm x̂ and rstd (composite RMSNorm)", res * sbh_rep + 4 * s * b // sh.rep,
                       f"{res}·s·b·{hs} + 4·s·b", "final_norm"))
        else:
            ex.append(("final-norm rstd", 4 * s * b // sh.rep, "4·s·b", "final_norm"))
        if not lora_on:  # a frozen head saves no input for a weight gradient
            ex.append(head_input)
    elif lora_on:
        ex.append(("final-norm input (the frozen head saves none)", act * sbh_rep, f"{act}·s·b·{hs}",
                   "final_norm"))
    else:
        ex.append(("final-norm input and head input", 2 * act * sbh_rep, f"{2 * act}·s·b·{hs}",
                   "final_norm"))
    if lora_on and torch_acc and res > act and sh.lora_fp32_base:  # the frozen head: its cast, as a block's Linears'
        head = act * ceil_div(model.vocab, sh.t) * h
        ex.append(("the frozen fp32 head's 16-bit weight cast, saved by its matmul (autocast caches no frozen weight)",
                   head, f"{act}·⌈V/t⌉·h", "frozen_head_cast"))
    ex.append(("fp32 log-probabilities for the loss", 4 * s * b * v_loss, f"4·s·b·{_v_symbol(model, v_loss)}",
               "log_probabilities"))
    if torch_acc and cfg.parallel.pp > 1 and cfg.conventions.pipeline_outputs == "released":
        # torch.distributed.pipelining's stage keeps its output (here the logits) in ``fwd_cache`` from the
        # forward to the end of the microbatch's backward (stage.py: ``backward_one_chunk`` pops it and holds it
        # to its end); with ``step(return_outputs=False)`` nothing else does (``pipeline_output_terms``)
        ex.append(("last stage output (the logits) kept by the pipeline stage for its backward", act * s * b * v_loss,
                   f"{act}·s·b·{_v_symbol(model, v_loss)}", "stage_logits"))
    return ex


def _moe_top_of_stages(cfg: Config, rp, T: Terms, sh: _Shape, res: int, ckpt_of: dict[int, int],
                       ep_rank: int | None) -> list[int]:
    """Per local stage: where a split schedule runs its backward as an I and a W, what its last block — one with experts
    whose saved tensors are the microbatch's (not checkpointed) — saved above every weight's node (0 elsewhere): the
    router's scores and gate weights, the un-permute's expert outputs, the combine's fp32 and weighted outputs
    (``moe_weight_pass_block``'s ``above``). ``stage_backward_input`` detaches the stage's output at the I's end, and the graph above the nodes it
    keeps for the W goes with what those nodes saved: they are freed at the I, not at the W. Only where the block's
    output is the stage's (no final norm or head after it: not the last stage; and not the first, whose I is its W).
    measure --fake of Qwen3 30B-A3B ZBV pp4 ep4 ZeRO-3, seed 20261246 #24, stages 3 and 4 of one MoE block: each I
    freed 2,048 MiB of its own forward (a 1,024 MiB fp32 and two 512 MiB n·k·h tensors); with them held to the W the
    cooldown's I's peaked at +6.0 %. Not analysed under torch.compile, per-op selective recompute, MLA or LoRA. Its
    tensors' sizes go to ``T.freed_at_input_pieces`` (the allocation events lay them so)."""
    par, tr = cfg.parallel, cfg.training
    if (not cfg.model.experts or cfg.conventions.state_accounting != "pytorch" or par.schedule not in
            SPLIT_BACKWARD_SCHEDULES or par.pp < 2 or cfg.model.attention == "mla" or sh.compile
            or tr.finetune == "lora" or tr.recompute not in ("none", "selective", "selective-layer")):
        return [0] * len(rp.stages)
    trailing = _plain_after_checkpoint_of_stages(cfg, rp, ckpt_of)
    out, above = {}, None
    for st in rp.stages:
        if st.stage in (0, par.num_stages - 1) or not st.moe_layers or (ckpt_of[st.stage] and not trailing[st.stage]):
            continue  # (dense blocks lead: a stage with experts ends with a block of them)
        if above is None:
            above = moe_weight_pass_block(cfg, sh, res, ep_rank)[3]
            # its tensors, for the allocation events: the combine's and the un-permute's, the rest (scores) as one
            big = [x for label, x, _ in moe_layer_terms(cfg, ep_rank)[0]
                   if label.startswith(("MoE: expert outputs in fp32", "MoE: weighted expert outputs",
                                        "MoE: permutation index"))]
            pieces = tuple(x for x in big + [above - sum(big)] if x > 0) if 0 < sum(big) <= above else (above,)
        out[st.stage] = above
        T.freed_at_input_pieces[st.stage] = pieces
    return [out.get(st.stage, 0) for st in rp.stages]


def _add_stage_terms(T: Terms, st, ex: list, n: int, c: int, blocks: _Blocks, dims: str, recompute_every: int,
                     top: int = 0) -> None:
    """A local stage's activations with ``n`` microbatches in flight: its blocks (``c`` of them
    checkpointed whole, keeping their input) and its extras ``ex``; ``top``: of its last block with experts, what
    an I frees (``_moe_top_of_stages``), a term of its own."""
    mb = f"{n} microbatch{'es' if n != 1 else ''} in flight"
    kept, kept_formula = blocks.kept, blocks.kept_formula
    per_layer, layer_formula = blocks.per_layer, blocks.layer_formula
    if blocks.moe:
        d_plain, m_plain = blocks.plain_split(st, c)
        if c:
            T.add("activations", f"stage {st.stage}: {mb} × {c} checkpointed layers", n * c * kept,
                  f"{n} × {c} × {kept_formula} = {n} × {c} × {kept:,} B ({dims})",
                  stage=st.stage, in_flight=n, kind="layers")
        if d_plain:
            T.add("activations", f"stage {st.stage}: {mb} × {d_plain} dense layers", n * d_plain * per_layer,
                  f"{n} × {d_plain} × {layer_formula} = {n} × {d_plain} × {per_layer:,} B ({dims})",
                  stage=st.stage, in_flight=n, kind="layers")
        if m_plain:
            one, how = blocks.per_moe_of_stage.get(st.stage, (blocks.per_moe, ""))
            how = f"; n_r from {how}" if how else ""
            T.add("activations", f"stage {st.stage}: {mb} × {m_plain} MoE layers", n * (m_plain * one - top),
                  f"{n} × ({m_plain} × ({blocks.moe_formula}{how}){f' − {top:,} B' if top else ''}) = "
                  f"{n} × ({m_plain} × {one:,} B{f' − {top:,} B' if top else ''}) ({dims})",
                  stage=st.stage, in_flight=n, kind="moe_layers")
            if top:
                T.add("activations", f"stage {st.stage}: {mb} × its last MoE layer's tensors above its weights' nodes "
                      "(router scores, un-permuted and combined expert outputs), freed at an I", n * top,
                      f"{n} × {top:,} B", stage=st.stage, in_flight=n, kind="moe_top_saved")
    elif c and c == st.layers:
        T.add("activations", f"stage {st.stage}: {mb} × {st.layers} layers", n * st.layers * kept,
              f"{n} × {st.layers} × {kept_formula} = {n} × {st.layers} × {kept:,} B ({dims})",
              stage=st.stage, in_flight=n, kind="layers")
    elif c == 0:
        T.add("activations", f"stage {st.stage}: {mb} × {st.layers} layers", n * st.layers * per_layer,
              f"{n} × {st.layers} × {layer_formula} = {n} × {st.layers} × {per_layer:,} B ({dims})",
              stage=st.stage, in_flight=n, kind="layers")
    else:  # selective-layer: c checkpointed blocks keep their input, the others everything
        T.add("activations", f"stage {st.stage}: {mb} × {c} checkpointed layers (every "
              f"{recompute_every}th block of the rank)", n * c * kept,
              f"{n} × {c} × {kept_formula} = {n} × {c} × {kept:,} B ({dims})",
              stage=st.stage, in_flight=n, kind="layers")
        T.add("activations", f"stage {st.stage}: {mb} × {st.layers - c} plain layers",
              n * (st.layers - c) * per_layer,
              f"{n} × {st.layers - c} × {layer_formula} = {n} × {st.layers - c} × {per_layer:,} B ({dims})",
              stage=st.stage, in_flight=n, kind="layers")
    for label, x, fx, kind in ex:
        T.add("activations", f"stage {st.stage}: {label}", n * x, f"{n} × {fx} = {n} × {x:,} B",
              stage=st.stage, in_flight=n, kind=kind)


def _autocast_cast_terms(cfg: Config, rp, T: Terms, act: int, psi_train: int) -> None:
    """The 16-bit weight casts autocast caches for the whole step."""
    tr = cfg.training
    if tr.finetune == "lora":
        # autocast caches casts of leaf tensors that require grad only: the adapters, not the base
        T.add("activations", "autocast's 16-bit casts of the adapters (cached; the frozen base is cast "
              "on the fly and not cached)", act * psi_train, f"{act} B × {psi_train:,} adapter weights",
              kind="autocast_weight_casts")
        return
    # autocast caches the 16-bit cast of every weight a matmul uses until its context exits
    # (the backend's context spans forward and backward); the matmuls save these casts.
    # torchao's Float8Linear passes its weight uncast (it casts to float8 itself and saves the
    # high-precision weight by reference): only the head's weight is cast and cached then
    float8 = tr.float8 != "none"
    # the routed experts' weights are sliced per expert, and slices are cast on every forward instead
    # (``moe_layer_terms``)
    cast = 0 if float8 else rp.block_weight_numel - (rp.expert_matmul_weights if _moe_autocast(cfg) else 0)
    cast += sum(st.head for st in rp.stages)
    T.add("activations", "autocast's 16-bit weight casts (cached for the whole step)", act * cast,
          f"{act} B × {cast:,} matmul weights ({'the head; float8 blocks cast none' if float8 else 'blocks and head'})",
          kind="autocast_weight_casts")


def _autocast_waiting_gradients(cfg: Config, rp, T: Terms, act: int) -> None:
    """Under pipelining the backend runs the whole schedule step in one autocast context, so the weight casts
    autocast caches are made in a stage's first forward and their backward nodes (``ToCopyBackward0``) are older
    than every node of a later microbatch's graph; autograd's ready queue runs the highest sequence number first
    (torch/csrc/autograd/engine.cpp, ``CompareNodeTaskTime``; ``AccumulateGrad`` at the highest of all), so each
    later B ends with every cast weight's 16-bit gradient waiting for its cast, then the casts one by one: the
    first makes its fp32 gradient beside all of them (the head's on the last stage, the first to run), and on
    the first stage the token embedding's backward, a node of the microbatch's own graph, makes its fp32 V·h
    gradient before them (``backward_end``: the B's microbatch freed by then). Measured on a real CPU run
    (hidden 512, f 2048, V 4096, pp2 m4 bf16-mixed, no wrapper): 23.03 and 27.06 MiB of temporaries at the peak,
    15 + 8 and 19 + 8 MiB here; measure --fake Llama 3 70B pp4 ZeRO-1: 7.23 GiB of temporaries on the first
    stage (3.19 GiB of bf16 block weight gradients, 3.91 of the embedding's fp32 one). Under float8 no block weight
    is cast by autocast (Float8Linear casts its own): the head's cast and the token embedding's fp32 gradient beside
    its ``.grad`` are left (measure --fake of Llama 3 8B tp4 SP pp8 GPipe m32 float8, fake seed 20261272 #16, stage
    0: two 1.96 GiB fp32 V·h tensors at each later B's end, −8.6 % at its peak without them)."""
    float8 = cfg.training.float8 != "none"
    per_block = [] if float8 else [a * c for a, c in rp.block_tensors if c > 1]
    best, what = 0, ""
    for st in rp.stages:
        weights = (0 if float8 else rp.block_weight_numel * st.layers // max(rp.layers, 1)) + st.head
        if _moe_autocast(cfg) and rp.layers and not float8:
            weights -= rp.expert_matmul_weights * st.layers // rp.layers  # sliced per expert, cast anew each forward
        # the token embedding's gradient under TP comes back replicated, V·h on every TP rank, where its weight is
        # a row shard (``engine.memory.buffers.replicated_embedding_gradient``: measure --fake of Llama 3 70B tp4 SP
        # pp4, seed 20261237 #15, first stage: embedding_dense_backward's 4,008 MiB fp32 output at a later B's end,
        # the row shard 1,002: allocated -15.1 %)
        emb = cfg.model.vocab * cfg.model.hidden if st.embedding and cfg.parallel.tp > 1 \
            and not cfg.model.tied_embeddings else st.embedding
        fp32 = max([4 * st.head, 4 * emb] + ([4 * max(per_block)] if st.layers and per_block else []))
        nbytes = act * weights + fp32
        if nbytes > best:
            best, what = nbytes, f"{act} B × {weights:,} cast weights of stage {st.stage} + {fp32:,} B (its largest fp32 gradient)"
    if best:
        T.add("temporaries", "at the end of each later B: every autocast-cast weight's 16-bit gradient waiting for "
              "its cast's backward (run last: the casts are cached from the stage's first forward), with the "
              "largest fp32 gradient made beside them (the first stage's token embedding's, the last's head's)",
              best, what, kind="autocast_cast_gradients")


def mlp_and_out_proj_elements(m, tp: int) -> int:
    """A dense block's MLP and output projection's parameter elements on a TP rank (weights and biases): the gradients
    its backward has made by its attention's backward."""
    weights, biases = mlp_tensors(m, m.ffn_hidden, tp)
    out_proj = [w for w in attention_tensors(m, tp)[0] if w[0] == m.hidden][-1]
    return sum(a * b for a, b in (*weights, *biases, out_proj)) + (m.hidden if m.bias else 0)


def _autocast_waiting_phases(cfg: Config, rp, T: Terms, sh: _Shape, act: int, *, plain_grads: bool,
                             autocast: bool) -> None:
    """A later B's attention phase under pipelining with autocast and plain gradients: each cast weight's 16-bit
    gradient waits for its cast's backward, run last (``_autocast_waiting_gradients``), so by its first block's
    attention backward the MLP's and the output projection's are all alive beside the attention's workspace (the
    ring's under context parallelism, the flash backward's without), the MLP's and its norm's saved tensors gone; a
    stage's first B casts each at once (its casts' nodes are the microbatch's own). measure --fake of seed 20261252
    #03 (Llama 2 7B pp8 cp4 DDP, fp32 parameters, bf16-mixed), a middle stage's second B: w1's, w2's, w3's and wo's
    bf16 gradients (3 × 86 + 32 MiB) inside the ring attention's backward, −3.2 … −4.1 % without them. Laid
    (``later_full_backward``) where that phase outweighs what the B's moment holds (the larger of the MLP's and the
    attention's without them)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    if not (autocast and plain_grads and par.pp > 1 and par.microbatches > 1 and tr.float8 == "none"
            and tr.finetune == "full" and not m.experts and m.attention == "flash"
            and par.schedule not in SPLIT_BACKWARD_SCHEDULES and any(st.layers for st in rp.stages)):
        return
    parts = mlp_phase_parts(T)
    mlp = sum(parts.values())
    if par.cp > 1:
        ws = sum(t.bytes for t in T["temporaries"] if t.kind == "cp_attention")
        saved = _mlp_and_norm2_saved(sh)
        out_grad = 0  # (the ring's workspace formula counts no residual gradient)
        laid = max(mlp, ws - saved)
    else:
        ws, saved, _ = attention_backward_workspace(sh)
        out_grad = sum(t.bytes for t in T["temporaries"] if t.kind == "blocks_output_gradient")
        laid = mlp
    waiting = act * mlp_and_out_proj_elements(m, par.tp)
    extra = ws + waiting - saved - out_grad - laid
    if extra > 0:
        T.add("temporaries", "a later B's attention backward under autocast: the MLP's and the output projection's "
              "16-bit weight gradients waiting for their casts' backward beside the workspace, the MLP's saved "
              "tensors gone (more than the B's moment as laid)", extra,
              f"{ws:,} B workspace + {waiting:,} B gradients − {saved:,} B saved"
              + (f" − {out_grad:,} B output gradient" if out_grad else "") + f" − {laid:,} B laid",
              kind="autocast_waiting_attention")


def _recomputed_block_terms(cfg: Config, rp, T: Terms, sh: _Shape, blocks: _Blocks, ckpt_of: dict[int, int],
                            res: int, dims: str, ep_rank: int | None) -> None:
    """The tensors a recomputing block's backward rebuilds (full, selective-layer, per-op selective)."""
    # The tensors a checkpointed block's backward recomputes are activations, as PyTorch's MemTracker
    # files them ("tensors produced during the forward pass and recomputation in activation
    # checkpointing", _MemRefType.ACT): one block's at a time, alive during that block's backward
    # (``engine.memory.lifetimes``: kind "recomputed_block", no stage or microbatches in flight)
    # less the block input, which the checkpoint keeps and the replay of norm1 saves as that same
    # tensor (``checkpoint_shared_bytes``; counted once, in the checkpointed block's kept input)
    per_layer, per_moe = blocks.per_layer, blocks.per_moe
    moe_here = blocks.moe and any(st.moe_layers for st in rp.stages)
    if any(ckpt_of[st.stage] for st in rp.stages):
        big = max(per_layer, per_moe) if moe_here else per_layer
        shared = checkpoint_shared_bytes(sh, res)
        redo = big - shared
        formula = (f"{blocks.moe_formula if blocks.moe and big != per_layer else blocks.layer_formula}"
                   f" − the kept block input = {big:,} − {shared:,}")
        if moe_here:
            redo, formula = _recomputed_moe_block(cfg, rp, ckpt_of, blocks, shared, formula)
        trailing = _plain_blocks_after_last_checkpoint(cfg, rp, ckpt_of) if not moe_here else 0
        if trailing:
            # torchtitan's layer-selective AC: the stage's last checkpointed block is recomputed when the backward
            # reaches it, after the plain blocks behind it have run theirs and freed their saved tensors
            freed = trailing * per_layer
            formula += f" − the {trailing} plain block{'s' if trailing > 1 else ''} after it, freed by then {freed:,}"
            redo = max(redo - freed, 0)
        T.add("activations", f"one block recomputed during backward ({cfg.training.recompute} recompute), less "
              "its kept input", redo, f"{formula} = {redo:,} B ({dims})", kind="recomputed_block")
        for st in rp.stages:
            if not ckpt_of[st.stage] and redo:
                # a stage none of whose blocks torchtitan's counter checkpoints recomputes nothing in its B or I
                # (measure --fake, seed 20261248 #33, Llama 2 7B LoopedBFS pp2 v3 selective-layer every 2, stages 0,
                # 2 and 4 of one block, the second checkpointed: stage 4's B held no recomputed block)
                T.add("activations", f"stage {st.stage}: none of its blocks checkpointed, its backward recomputes "
                      "nothing", -redo, f"−{redo:,} B", stage=st.stage, kind="recomputed_block_plain")
    elif sh.recompute == "selective-op":
        # During one block's backward the replay of its forward re-saves what recompute = "none" keeps,
        # and the block's stash goes into it: torch's selective checkpoint hands each cached MUST_SAVE
        # output to its op once during the replay (torch.utils.checkpoint's _CachedTorchDispatchMode
        # replaces it by _CONSUMED in its storage), so a stashed output that no backward node saves (the scores
        # the softmax reads, wq's output rope reads) is freed, and one that is saved (the gate output,
        # a V that is a view of wv's output) is the same tensor, not a copy. The block then holds the
        # "none" set instead of its stash: the term is their difference (measured with MemTracker on
        # the tiny model: a block's backward peak adds the "none" set less its stash, less the down
        # input its first backward op frees)
        plain = dataclasses.replace(sh, recompute="none")
        plain_terms, _ = layer_activation_terms(plain)
        plain_bytes, _ = _block_bytes(plain, plain_terms, "", res, blocks.lora_on, blocks.lora_copies)
        redo, stash, what = max(0, plain_bytes - per_layer), per_layer, "one block"
        if moe_here:
            # a MoE block replays its experts too: its "none" set (the dense attention half and the
            # experts' rows) less its stash
            plain_moe = plain_bytes - sum(x for _, x, part in plain_terms if part == "mlp") + sum(
                x for _, x, _ in moe_layer_terms(cfg, ep_rank, recompute="none")[0])
            if plain_moe - per_moe > redo:
                redo, stash, plain_bytes, what = plain_moe - per_moe, per_moe, plain_moe, "one MoE block"
        T.add("activations", f"{what}'s recomputed tensors during its backward (per-op selective recompute)",
              redo, f"what {what} keeps under recompute = 'none' − its per-op stash = {plain_bytes:,} − "
              f"{stash:,} = {redo:,} B ({dims})", kind="recomputed_block")


def _first_block_replays(cfg: Config, rp, ckpt_of: dict[int, int]) -> bool:
    """A B's first block (each stage's last) is a checkpointed one whose replay stops early: full recompute, or
    selective-layer where no plain block follows a stage's last checkpointed one."""
    if cfg.training.recompute not in ("full", "selective-layer") or not any(st.layers for st in rp.stages):
        return False
    trailing = _plain_after_checkpoint_of_stages(cfg, rp, ckpt_of)
    return all(trailing.get(st.stage, 1) == 0 for st in rp.stages if st.layers)


def _recomputed_moe_block(cfg: Config, rp, ckpt_of: dict[int, int], blocks: _Blocks, shared: int,
                          formula: str) -> tuple[int, str]:
    """A rank with MoE blocks: the most its stages' recomputed block adds at its backward, and the formula. Under
    "selective-layer" a stage's last checkpointed block is recomputed after the plain blocks behind it freed their
    saved tensors (torchtitan's counter, ``_plain_after_checkpoint_of_stages``); a stage's MoE blocks are its last
    ones (the model's ``dense_layers`` lead), so those plain blocks and the recomputed one are MoE blocks where they
    fall among them. A CPU run of 3 MoE blocks at N = 2 (``benchmarks/accuracy.py --sweep 30 --seed 20261229``, #01:
    the middle block recomputed after the last one's backward) peaked without the last block's saved tensors beside
    the recompute. Under the other policies the larger of a dense and a MoE block's, as before."""
    big_any = max(blocks.per_layer, blocks.per_moe)
    if cfg.training.recompute != "selective-layer":
        return big_any - shared, formula
    trailing = _plain_after_checkpoint_of_stages(cfg, rp, ckpt_of)
    worst, how = 0, ""
    for st in rp.stages:
        if st.stage not in trailing:
            continue
        t, moe = trailing[st.stage], st.moe_layers
        big = blocks.per_moe if t + 1 <= moe else blocks.per_layer
        freed = min(t, moe) * blocks.per_moe + (t - min(t, moe)) * blocks.per_layer
        redo = max(big - shared - freed, 0)
        if redo >= worst:
            worst = redo
            how = (f" (stage {st.stage}: its last checkpointed block {'MoE' if big == blocks.per_moe else 'dense'}"
                   + (f", the {t} plain block{'s' if t > 1 else ''} after it freed by then {freed:,}" if t else "")
                   + ")")
    return worst, formula + how


def _plain_blocks_after_last_checkpoint(cfg: Config, rp, ckpt_of: dict[int, int]) -> int:
    """Under "selective-layer": the fewest plain blocks that follow the last checkpointed block of a stage of the
    rank that has one (torchtitan's counter: block k of the rank, 1-based over its stages in order, is
    checkpointed when k % recompute_every == 0, ``checkpointed_per_stage``); 0 under the other policies."""
    return min(_plain_after_checkpoint_of_stages(cfg, rp, ckpt_of).values(), default=0)


def _plain_before_checkpoints_of_stages(cfg: Config, rp, ckpt_of: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Each of the rank's stages with a checkpointed block: the plain blocks before its first and before its last
    checkpointed block (torchtitan's counter, ``_checkpointed_of_stages``; (0, 0) under "full")."""
    if cfg.training.recompute != "selective-layer":
        return {st.stage: (0, 0) for st in rp.stages if ckpt_of[st.stage]}
    every, pos, out = cfg.training.recompute_every, 0, {}
    for st in sorted(rp.stages, key=lambda st: st.stage):
        c = ckpt_of[st.stage]
        if c:
            first = (every - pos % every) % every or every  # the stage's first checkpointed block, 1-based
            trailing = (pos + st.layers) % every
            out[st.stage] = (first - 1, st.layers - trailing - c)
        pos += st.layers
    return out


def _plain_after_checkpoint_of_stages(cfg: Config, rp, ckpt_of: dict[int, int]) -> dict[int, int]:
    """Each of the rank's stages with a checkpointed block: the plain blocks after its last one (torchtitan's
    counter, ``_checkpointed_of_stages``; 0 under "full")."""
    if cfg.training.recompute != "selective-layer":
        return {st.stage: 0 for st in rp.stages if ckpt_of[st.stage]}
    every, pos, out = cfg.training.recompute_every, 0, {}
    for st in sorted(rp.stages, key=lambda st: st.stage):
        end = pos + st.layers
        if ckpt_of[st.stage]:
            out[st.stage] = end % every
        pos = end
    return out


def loss_vocab(cfg: Config, *, sp: bool, torch_acc: bool) -> int:
    """The vocabulary columns the loss sees on a rank: torch's loss_parallel (SP) keeps the vocabulary
    sharded; otherwise the head's output is replicated (ColwiseParallel → Replicate), so the loss sees all
    V on every TP rank (the simple accounting counts V/t)."""
    t = cfg.parallel.tp
    return ceil_div(cfg.model.vocab, t) if (sp or not torch_acc) else cfg.model.vocab


def loss_tensors(*, sp: bool) -> int:
    """How many fp32 tensors of the loss's vocabulary shard (4·s·b·v each) its backward holds at once
    under torch's accounting. loss_parallel (the backend's loss under sequence parallel): torch's
    _nll_loss_and_log_softmax_backward (torch/distributed/tensor/parallel/loss.py) runs both backwards at
    once on the vocabulary shard, returning (grad_input + torch.exp(x)) * grad_output with grad_input =
    zeros_like(x): the zeros, exp(x) and their sum (then the sum and the product) are three fp32 shards
    alive at once (measure --fake, Llama 3 70B FSDP32 × TP8: tracker Temp 25,220,481,028 B, three times
    16·8192·16,032·4 B plus 4 MB). Otherwise two: the fp32 logits and the log-softmax gradient."""
    return 3 if sp else 2


def _loss_terms(cfg: Config, T: Terms, act: int, *, torch_acc: bool, sp: bool, v_loss: int) -> None:
    """The last stage's loss temporaries."""
    s, b = cfg.local_seq_len, cfg.training.micro_batch_size
    v_sym = _v_symbol(cfg.model, v_loss)
    if torch_acc:
        n = loss_tensors(sp=sp)
        lx = n * 4 * s * b * v_loss
        what = ("loss (loss_parallel): the one-hot gradient, exp of the log-probabilities and their sum, fp32 on "
                "the vocabulary shard") if sp else "loss: fp32 logits and the log-softmax gradient at the start of backward"
        T.add("temporaries", what, lx, f"{n} × 4·s·b·{v_sym} = {lx:,} B", kind="loss")
    else:
        v_local = ceil_div(cfg.model.vocab, cfg.parallel.tp)
        lx = act * s * b * v_local + (4 * s * b * v_local if act != 4 else 0)
        T.add("temporaries", "logits at the loss (compute dtype + fp32 copy)", lx,
              f"{act + (4 if act != 4 else 0)}·s·b·V/t = {lx:,} B", kind="loss")


def weight_op_outputs(model, t: int) -> int:
    """Elements per token of a dense block's Linear outputs on a rank of tp ``t`` — wq, wk + wv, wo, w1 (+ w3
    under SwiGLU), w2 (the matmuls see every token): the gradients a split backward keeps of them."""
    h, q = model.hidden, _query_width(model) or model.hidden
    kv = 2 * model.kv_heads * (q // model.heads) // t
    mlp = (2 if model.mlp == "swiglu" else 1) * model.ffn_hidden // t
    return q // t + kv + h + mlp + h


def split_backward_group_grads(cfg: Config, act: int, res: int, sbh_rep: int) -> dict[str, int]:
    """What a split backward's I keeps of one dense block for its W, by parameter group (``weight_groups``):
    each Linear's output gradient on the TP rank (wq q/t — heads · head_dim, h unless ``model.head_size``
    says otherwise —, wk and wv kv/t, wo h, w1 and w3 f/t, w2 h, the matmuls seeing every token) and each norm's weight-multiply output gradient; they sum to
    ``split_backward_terms``' block. (A Qwen-style q/k norm's group keeps none here.)"""
    m, t = cfg.model, cfg.parallel.tp
    sb = cfg.local_seq_len * cfg.training.micro_batch_size
    h, q = m.hidden, _query_width(m) or m.hidden
    kv = 2 * m.kv_heads * (q // m.heads) // t
    f = m.ffn_hidden // t
    grads = {"norm1": res * sbh_rep, "wq": act * sb * (q // t), "wk": act * sb * (kv // 2),
             "wv": act * sb * (kv - kv // 2), "wo": act * sb * h, "norm2": res * sbh_rep, "w1": act * sb * f,
             "w2": act * sb * h}
    if m.mlp == "swiglu":
        grads["w3"] = act * sb * f
    return grads


def moe_split_backward_group_grads(cfg: Config, act: int, res: int, sbh_rep: int,
                                   ep_rank: int | None = None) -> dict[str, int]:
    """``split_backward_group_grads`` of a block with experts: its attention half's and norms' as a dense
    block's, the router's output gradient (fp32, n·E), each expert matmul's output gradient for its routed
    copies (w1 and w3 n_r·f, w2 n_r·h: ``moe_tokens``), the shared experts' as a dense MLP's. Measured on the
    backend's tiny MoE block (fp32 and autocast): what the I keeps is exactly these and the input's gradient."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    grads = {g: n for g, n in split_backward_group_grads(cfg, act, res, sbh_rep).items() if g not in ("w1", "w2", "w3")}
    n, n_r = moe_tokens(cfg, ep_rank, routed_factor(cfg, ep_rank))
    rep = par.tp if par.sequence_parallel and par.ep == 1 else 1
    f_loc = m.expert_hidden // (par.tp if par.ep == 1 else 1)
    swiglu = m.mlp == "swiglu"
    grads |= {"router": 4 * n * m.experts // rep, "w1": act * n_r * f_loc, "w2": act * n_r * m.hidden}
    if swiglu:
        grads["w3"] = act * n_r * f_loc
    if m.shared_experts:
        f_s = m.shared_experts * m.expert_hidden // par.tp
        n_s = m.seq_len * tr.micro_batch_size
        grads |= {"shared.w1": act * n_s * f_s, "shared.w2": act * n_s * m.hidden}
        if swiglu:
            grads["shared.w3"] = act * n_s * f_s
    return grads


def kept_send_terms(cfg: Config, rp, T: Terms, *, res: int, sbh_rep: int, hs: str) -> None:
    """A pipelined stage's input gradients kept to the step's end (lifetime ``after_input``, per stage, one per
    action that keeps one: ``moments``' ``ig``), and its outputs its sends hold (``after_output``: ``ho``).

    A split backward's I sets each input gradient on the stage's receive buffer's ``.grad``, which nothing clears
    before the next step's ``clear_runtime_states`` (``stage_backward``, a full B, sets it back to None once read;
    measure --fake of GPT-2 ZBVZeroBubble pp4 m8: every I's input gradient alive at the cooldown's peak, 14 on pp
    rank 2). And where the schedule keeps its sends' Works to the end of its actions
    (``engine.pipeline.schedules.sends_held``: the multi-stage runtime, GPipe) a ``dist.isend`` Work holds its
    tensor (gloo's ``SendWork::tensor_``, NCCL's ``WorkNCCL::outputs_``) until the schedule drops it after the
    step's last action, before the optimizer step: each B's input gradient sent to another rank, and each
    microbatch's stage output sent to another rank past the B (or I) that frees the rest of the microbatch
    (``fwd_cache`` pops it, the Work keeps it). The V-schedules hand a stage's tensors to the rank's own next or
    previous stage without a send."""
    par = cfg.parallel
    mo = moments(par.schedule, rp.pp_rank, par.pp, par.virtual_stages, par.microbatches)
    local = sorted(st.stage for st in rp.stages)
    acts = mo.phase == 0  # the actions' own moments (not the loss's, the ends', the step's)
    end = -2 if mo.phase[-1] == 4 else -1  # the end of the backward: all made by then
    for st in rp.stages:
        col = local.index(st.stage)
        n_o = int(mo.ho[end, col])
        if n_o:
            T.add("activations", f"stage {st.stage}: its outputs sent to stage {st.stage + 1}'s rank, each held by its "
                  f"send's Work from the microbatch's backward to the end of the schedule's actions ({n_o})",
                  n_o * res * sbh_rep, f"{n_o} × {res}·s·b·{hs} = {n_o} × {res * sbh_rep:,} B", stage=st.stage,
                  in_flight=n_o, kind="stage_outputs_sent")
        n = int(mo.ig[end, col])
        if not n or st.stage == 0:
            continue
        n_i = int(((mo.kind == 2) & (mo.stage == st.stage) & acts).sum())
        n_b = n - n_i
        why = []
        if n_i:
            why.append(f"one per I ({n_i}) on its receive buffer's .grad (stage_backward_input sets it; the next "
                       "step's clear_runtime_states drops it)")
        if n_b:
            why.append(f"one per B ({n_b}) sent to the previous stage's rank, whose send's Work holds it to the end "
                       "of the schedule's actions")
        T.add("temporaries", f"stage {st.stage}: its input gradients kept to the step's end: " + "; ".join(why),
              n * res * sbh_rep, f"{n} × {res}·s·b·{hs} = {n} × {res * sbh_rep:,} B", stage=st.stage, in_flight=n,
              kind="input_gradients_kept")


def split_backward_terms(cfg: Config, rp, T: Terms, *, act: int, res: int, sbh_rep: int, hs: str,
                         ep_rank: int | None = None) -> None:
    """What a split backward keeps of each stage-microbatch from its I to its W (lifetime
    ``input_to_weight``): torch.distributed.pipelining's ``stage_backward_input`` hooks every node where
    a weight's path meets the stage input's (a Linear's matmul, a norm's weight multiply) and keeps the
    gradient flowing into it (``param_group["grads"]``) for ``stage_backward_weight``: each weight op's
    output gradient, in its output's dtype. And it sets the stage input's ``.grad`` (the gradient it
    sends) on the stage's receive buffer of that microbatch, which nothing clears before the next step's
    ``clear_runtime_states`` (``stage_backward``, a full B, sets it back to None once read): those are kept
    from each I to the step's end (``input_gradients_kept``, lifetime ``after_input``; measure --fake of GPT-2
    ZBVZeroBubble pp4 m8: every I's input gradient alive at the cooldown's peak, 14 on pp rank 2). The first
    stage runs no I (its W runs the whole backward): nothing. A block with experts keeps
    ``moe_split_backward_group_grads``. Measured op by op on the tiny model's
    InterleavedZeroBubble pp4 (fp32): one block keeps 753,664 B (4 B × s·b × (h + 2·kv + h + 2·f + h
    + 2·h)), the last stage 327,680 B more (the final norm's and the head's output gradients).

    Under context parallelism an I's moment also holds its own microbatch's of them made by its first block's
    attention, where the ring's backward workspace is (``split_backward_grads_made``, I moments only): measure
    --fake of Llama 2 7B ZBV pp2 cp2 s8K b8 selective, the last stage's I peaks there with 8 GiB of them."""

    m, par, tr = cfg.model, cfg.parallel, cfg.training
    t = par.tp
    s, b = cfg.local_seq_len, tr.micro_batch_size
    n_stages = par.num_stages
    # each weight op's output gradient of one dense block, by parameter group (the matmuls' and the norms' weight
    # multiplies): the I keeps each as a tensor of its own (the allocation events lay them so: Grain.iw_pieces)
    block = list(split_backward_group_grads(cfg, act, res, sbh_rep).values())
    mo = moments(par.schedule, rp.pp_rank, par.pp, par.virtual_stages, par.microbatches)
    local = sorted(st.stage for st in rp.stages)
    I_made = 0
    for st in rp.stages:
        if st.stage == 0:
            continue
        dense = st.layers - st.moe_layers
        pieces = block * dense  # the blocks (the stage input's gradient: ``input_gradients_kept``)
        formula = (f"{dense} × ({act}·s·b·(h/t + 2·kv/t + h + {'2·' if m.mlp == 'swiglu' else ''}f/t + h) + "
                   f"2·{res}·s·b·{hs})")
        if st.moe_layers:
            moe_pieces = list(moe_split_backward_group_grads(cfg, act, res, sbh_rep, ep_rank).values())
            moe = sum(moe_pieces)
            pieces += moe_pieces * st.moe_layers
            formula += f" + {st.moe_layers} × {moe:,} B (blocks with experts: router, expert and attention matmuls)"
        if st.stage == n_stages - 1:
            pieces += [res * sbh_rep, act * s * b * ceil_div(m.vocab, t)]
            formula += f" + {res}·s·b·{hs} + {act}·s·b·⌈V/t⌉ (final norm, head)"
        elif dense and not st.moe_layers and t == 1 and res == act:
            # the stage's last block's down projection: its output is the stage output (out = h + mlp(h)), so its
            # output gradient is the gradient the stage received, the receive buffer itself (comm_buffers), no tensor
            # of its own; not where autocast casts it to the matmul's dtype (res ≠ act) or TP redistributes it
            # (measure --fake of GPT-2 s32K pp4 cp2 ZBV fp32: a pending I keeps 7 h-wide and one f-wide tensors, its
            # input gradient among them — 192 MiB less each than the formula's, seed 20261236)
            pieces.pop(len(pieces) - 1 - pieces[::-1].index(res * sbh_rep))  # its w2 group's (the last h-wide one)
            formula += f" − {res}·s·b·h (the last block's down projection's: the received gradient)"
        one = sum(pieces)
        n = int(mo.iw[:, local.index(st.stage)].max())
        if par.cp > 1 and one:
            # the ring attention's backward workspace comes at each block's attention: at the first block's, the I
            # has made every weight op's output gradient but that block's Q, K, V projections' and its norm's
            made = one - act * s * b * (m.heads * m.head_dim + 2 * m.kv_dim) // t - res * sbh_rep
            I_made = max(I_made, made)
        if n and one:
            T.split_backward_pieces[st.stage] = tuple(x for x in pieces if x > 0)
            T.add("temporaries", f"stage {st.stage}: what its split backward keeps from each I to its W (the weight "
                  f"ops' output gradients) — {n} microbatch{'es' if n != 1 else ''} at most", n * one,
                  f"{n} × ({formula}) = {n} × {one:,} B", stage=st.stage, in_flight=n, kind="split_backward_grads")
    if I_made:
        T.add("temporaries", "an I's own weight-op output gradients, made by its first block's context-parallel "
              "attention (every one but that block's Q, K, V projections' and norm's), beside the ring's workspace",
              I_made, f"{I_made:,} B (the largest stage's)", kind="split_backward_grads_made")
    _float8_input_pass(cfg, rp, T, act=act, res=res, sbh_rep=sbh_rep, at_cp=I_made)


def _float8_input_pass(cfg: Config, rp, T: Terms, *, act: int, res: int, sbh_rep: int, at_cp: int) -> None:
    """An I of a later stage of dense blocks under eager float8, nothing recomputed: torchao's Float8Linear backward
    (``matmul_with_hp_or_float8_args.backward``) makes grad_weight as well as grad_input, whichever the caller asked
    for (``stage_backward_input`` asks for the stage input's), so each Linear's backward in the I casts its saved
    high-precision input to float8 along the tokens (the scaled fp32 copy, its saturated clamp and the float8 result:
    ``float8_cast_element_bytes``) beside its output gradient's two float8 casts and the weight's. The most comes at the
    first-run block's last input projection (wq: autograd runs the projections last made first), where the I has made
    every weight op's output gradient it keeps for the W but that block's norm's (its head's too on the last stage), and
    the norm output's gradient is the sum of wv's and wk's grad_inputs beside wq's own (the rows all-gathered under
    sequence parallelism). Laid at I moments beyond what the I's moment holds already (under context parallelism its
    ring attention's phase, ``split_backward_grads_made``). measure --fake of seed 20261273 #36 (Llama 3 405B tp8 SP
    pp4 cp2 ZBV tensorwise), the last stage's I: 5.50 GiB above its start at wq's input cast (2.25 GiB of it the cast)
    where the engine laid 2.36 (allocated −7.5 %)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    if tr.float8 == "none" or tr.compile or tr.recompute != "none" or tr.finetune != "full" or m.experts:
        return
    sh = shape_of(cfg, rp.cp_rank)
    grads = split_backward_group_grads(cfg, act, res, sbh_rep)
    lins = {lin.name: lin for lin in lora.adapted_linears(m, "all")}
    wq = lins["wq"]
    # under context parallelism the I's moment is its ring attention's: the gradients made by then and the workspace
    # (``cp_attention``), gone by the projections' backward
    at_cp += sum(t.bytes for t in T["temporaries"] if t.kind == "cp_attention") if at_cp else 0
    if wq.d_in % 16 or wq.d_out % 16:  # (backend.parallel.float8.converts: not converted)
        return
    x = sh.s * sh.b * sh.h  # the projections' input: every token (gathered under SP), h wide
    go = sh.s * sh.b * wq.d_out // sh.t
    w8 = wq.d_in * wq.d_out // sh.t if not wrapping_plan(cfg).float8_all_gather else 0
    casts = 2 * go + w8 + 2 * act * x + float8_cast_element_bytes(sh.float8_uncast) * x
    head = res * sbh_rep + act * sh.s * sh.b * ceil_div(m.vocab, sh.t)
    best = 0
    for st in rp.stages:
        if st.stage == 0 or not st.layers:
            continue
        made = sum(grads.values()) - grads["norm1"] + (head if st.stage == par.num_stages - 1 else 0)
        best = max(best, made + casts - at_cp)
    if best > 0:
        T.add("temporaries", "an I's float8 casts at its first block's Q projection (its input cast along the tokens for "
              "the weight gradient torchao makes in the I too, the output gradient's and weight's casts), the norm "
              "output's gradient from the three projections and every weight-op output gradient the I has made by "
              "then, less what the I's moment holds already", best,
              f"made + 2·q8 + w8 + 2·{act}·s·b·h + {float8_cast_element_bytes(sh.float8_uncast)}·s·b·h − {at_cp:,} B "
              f"= {best:,} B", kind="float8_input_backward")
        T.input_backward_piece = 4 * x  # the cast's scaled fp32 copy (its clamp's the same)


def weight_groups(sh: _Shape) -> tuple[str, ...]:
    """A dense block's parameter groups in the order torch.distributed.pipelining's ``stage_backward_weight``
    takes them: ``get_param_groups`` keys each group on the node where its weight's path meets the stage
    input's, in the order of ``module.parameters()`` (backend/model.py: attention_norm, wq, wk, wv, wo,
    q_norm, k_norm, ffn_norm, w1, w2, w3), one per weight (a Linear's bias joins its weight's matmul). Under
    LoRA only the adapters train: each adapted Linear's A then B (peft's lora_A, lora_B), "wq.A", "wq.B", ..."""
    if sh.lora:
        return tuple(f"{n}.{ab}" for n in _LINEARS if n in sh.lora_mods for ab in "AB")
    return (("norm1", "wq", "wk", "wv", "wo") + (("q_norm", "k_norm") if sh.qk_norm else ())
            + ("norm2", "w1", "w2") + (("w3",) if sh.swiglu else ()))


#: a block's Linears in module order, and which read the same input
_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
_READERS = {"qkv_in": ("wq", "wk", "wv"), "mlp_in": ("w1", "w3"), "wo": ("wo",), "w2": ("w2",)}


def weight_pass_block(sh: _Shape, res: int, mlp: bool = True) -> tuple[int, list[tuple[str, int]]]:
    """One checkpointed block under a split backward's weight pass: (what every recompute of it keeps to the
    pass's end, [(group, bytes its node frees), ...]).

    torch's ``stage_backward_weight`` runs one ``torch.autograd.grad`` per parameter group, each its own graph
    task, and a non-reentrant checkpoint recomputes its block once per graph task that unpacks one of its
    saved tensors (torch/utils/checkpoint.py: ``frame.recomputed[gid]``, ``gid`` the graph task id;
    pipelining does not group them under ``GraphExecGroup``): a recompute per group. Each stores a tensor for
    every saved tensor whose node has not run yet (``_recomputation_hook`` skips a holder already freed),
    unpacking frees only what its own node reads, and the nodes of the input's path never run in the weight
    pass: what they saved stays in every recompute until the graph goes at the pass's end. What a weight's
    own node saved goes, in every recompute, when its group runs it (the node's saved variables are
    released, and with them the holder and each recompute's copy). Under autocast each Linear also saved
    its own cast of its input, freed the same way; its weight's cast is autocast's cached one (the
    backend's autocast spans the step, so a recompute's cast of a weight hits the cache: no copy per
    recompute; but see ``weight_pass_casts``). Under LoRA the groups are the adapters' (each A, then B;
    the frozen weights' nodes never run in the pass). Measured on the backend's blocks
    (tests/backend/test_weight_pass.py): exact per group with every weight training, fp32 LoRA on every
    Linear too; LoRA on the attention only keeps less than this (the MLP's tensors go: 0.45 of it), bf16
    LoRA more (1.3 of it) — not analysed. ``mlp`` False: without the dense MLP's rows (a block with
    experts: ``moe_weight_pass_block``)."""
    autocast = res > sh.act
    kept, frees = 0, []

    for row in SAVED_TENSORS:
        if row.block_input or not row.applies(sh) or (not mlp and row.part == "mlp"):
            continue
        count = len(sh.lora_mods) if row.count == "adapters" else row.count
        nbytes = count * (res if row.elem == "res" else _ELEM[row.elem](sh)) * _NUMEL[row.numel][0](sh)
        if row.part == "lora":  # each adapter's A output, saved by its B: freed by the B's group
            adapters = [n for n in _LINEARS if n in sh.lora_mods]
            frees += [(f"{n}.B", nbytes // len(adapters)) for n in adapters]
            continue
        node = row.weight_node
        fused = not (sh.qk_composite if node in ("q_norm", "k_norm") else sh.composite_norm)
        if not node or (row.fused_only and not fused) or (row.kernel_keeps and getattr(sh, row.kernel_keeps)):
            kept += nbytes  # a node of the input's path saved it too
            continue
        readers = [n for n in _READERS.get(node, (node,)) if (sh.swiglu or n != "w3") and (not sh.lora or n in sh.lora_mods)]
        if node in ("norm1", "norm2", "q_norm", "k_norm") and sh.lora or not readers:
            kept += nbytes  # a frozen weight's node never runs in the weight pass
            continue
        # one tensor its readers share is freed by the last of them; under autocast each reads its own cast
        node = readers[0] if autocast else readers[-1]
        frees.append((f"{node}.A" if sh.lora else node, nbytes))
    if autocast and not (sh.recompute == "selective-op" or sh.compile or sh.float8_uncast):
        # each further reader's cast of its norm's output (``_block_bytes``: the first is the row above)
        cast = sh.act * sh.s * sh.b * sh.h
        for linears in (("wq", "wk", "wv"), ("w1", "w3") if sh.swiglu and mlp else ()):
            readers = [n for n in linears if not sh.lora or n in sh.lora_mods]
            frees += [(f"{n}.A" if sh.lora else n, cast) for n in readers[1:]]
    return kept, frees


def moe_weight_pass_block(cfg: Config, sh: _Shape, res: int,
                          ep_rank: int | None = None) -> tuple[int, list[tuple[str, int]], tuple[str, ...], int]:
    """A block with experts under a split backward's weight pass, by ``weight_pass_block``'s rule: (kept,
    frees, groups, above). Its attention half and norms are a dense block's. Of its MoE rows
    (``moe_layer_terms``) the I leaves only what some weight's node still reaches: ``stage_backward_input``
    detaches the stage's output, and the graph above every node it keeps for the W (each weight's matmul)
    goes, and with it what those nodes saved: the router's scores, top-k and gate weights, the combine's
    expert outputs and weighted outputs, the un-permute's (``above``, per recompute). That holds for the
    stage's last block only where its output is the stage's: a later block's checkpoint keeps its input
    with its graph (torch/utils/checkpoint.py ``_CheckpointFrame.save_inputs``: ``_make_saved_tensor(arg,
    is_output=False)`` holds the input's ``grad_fn``), and so does the last stage's final norm, so there
    every recompute keeps ``above`` too — its nodes never run in the pass (``weight_pass_bytes``'
    ``above``; exact on two tiny blocks, tests/backend/test_weight_pass.py; ``measure --fake`` of Qwen3
    235B ZBV tp4 ep32 ZeRO-3 full recompute, 3 blocks a stage: 24 recomputes of the earlier blocks each
    holding their 1.0 GiB of combine tensors, allocated −52 → −3 % with the query width). What stays: the router input (the router's matmul frees it, in its group after
    norm2's), the dispatched tokens (the experts' last reader frees them: w3 under SwiGLU, w1 otherwise;
    under autocast each reader's own cast, freed by it), the token index the dispatch gathered with, the
    experts' internals below w2 (w2 frees the down input; the gate, SiLU and up outputs are kept), the
    shared experts' as a dense MLP's; under autocast each recompute's casts of the local experts' weights. Groups in ``backend.model.MoE``'s parameter order: the router, the grouped experts'
    w1, w2 (, w3), the shared experts'. Measured on the backend's tiny MoE block (4 experts, top-2): the live
    bytes after each group exactly these (tests/backend/test_weight_pass.py)."""
    kept, frees = weight_pass_block(sh, res, mlp=False)
    m = cfg.model
    autocast = res > sh.act
    readers = ("w1", "w3") if sh.swiglu else ("w1",)
    inner = 4 if sh.swiglu else 2  # the experts' internals row: gate, SiLU, up outputs and down input
    rows = moe_layer_terms(cfg, ep_rank)[0]
    base = kept + sum(n for _, n in frees)
    for label, nbytes, _ in rows:
        if label.startswith("MoE: router input"):
            frees.append(("router", nbytes))
        elif label.startswith("MoE: dispatched tokens"):  # under autocast w1's own cast (w3's: its row)
            frees.append((readers[0] if autocast else readers[-1], nbytes))
        elif label.startswith("MoE: w3's own"):
            frees.append(("w3", nbytes))
        elif label.startswith("MoE: the local experts' 16-bit weight casts"):  # cast anew by every recompute
            frees += [(w, nbytes // (len(readers) + 1)) for w in ("w1", "w2") + readers[1:]]
        elif label.startswith("MoE: token index"):  # of token index (8), sort order (8), gate weights (4)
            kept += nbytes * 8 // 20
        elif label.startswith("MoE: experts' "):
            frees.append(("w2", nbytes // inner))
            kept += nbytes - nbytes // inner
        elif label.startswith("MoE: shared experts' 16-bit casts"):  # w1's and w3's own
            frees += [(w, nbytes // len(readers)) for w in ("shared.w1", "shared.w3")[:len(readers)]]
        elif label.startswith("MoE: shared experts' input"):
            frees.append(("shared.w1" if autocast or not sh.swiglu else "shared.w3", nbytes))
        elif label.startswith("MoE: shared experts"):  # its internals, as the experts'
            frees.append(("shared.w2", nbytes // inner))
            kept += nbytes - nbytes // inner
    dense = weight_groups(sh)
    groups = dense[:dense.index("norm2") + 1] + ("router",) + readers[:1] + ("w2",) + readers[1:] + (
        ("shared.w1", "shared.w2") + (("shared.w3",) if sh.swiglu else ()) if m.shared_experts else ())
    # the rows above the weights' nodes: every MoE row's bytes the loop laid neither as kept nor as freed
    above = sum(n for _, n, _ in rows) - (kept + sum(n for _, n in frees) - base)
    return kept, frees, groups, above


def _stage_counts(in_flight, unit_bytes: list[int]) -> tuple[int, ...]:
    """The microbatches each local stage's terms are laid at: the rank's heaviest in-flight state. The terms carry a
    stage's bytes per microbatch (the timeline splits them by this count and lays the stage at every moment by the
    microbatches alive then), so a stage that state leaves empty counts the most it ever holds, or its microbatches
    would weigh nothing at the moments that do hold them."""
    counts = in_flight(unit_bytes)
    if 0 in counts:
        counts = tuple(n or max(in_flight([int(k == j) for k in range(len(counts))])[j], 1)
                       for j, n in enumerate(counts))
    return counts


def _forward_transient_terms(cfg: Config, rp, T: Terms, sh: _Shape, res: int, *, moe: bool, lora_casts: bool,
                             autocast: bool, recomputed: bool) -> None:
    """What an F's own moment holds beyond its microbatch's saved tensors (``forwards``): float8's weight cast and its
    up projection's input cast, LoRA's casts under autocast, and the last block's down projection at its
    tensor-parallel collective, each at its own op of the forward: each laid only beyond the ones before."""
    _float8_forward_cast_term(cfg, rp, T, sh)
    if not moe:
        _float8_forward_input_cast_term(cfg, T, sh, res, autocast)
    if lora_casts:
        lora_forward_casts(cfg, T, res, recomputed=cfg.training.recompute in ("full", "selective-layer") and recomputed)
    if not moe:
        _down_projection_term(T, sh, res)


def _down_projection_term(T: Terms, sh: _Shape, res: int) -> None:
    """A forward's last block ends in its down projection w2 (row-parallel under TP) and the residual add, whose
    output the moment counts (the stage's output or the next block's input). Live beyond the moment, at the
    projection's collective: its s·b·h output y (a partial sum under TP; none where the per-op policy stashes it) and
    the collective's own tensors less the add's output not yet made: under sequence parallelism DTensor's Partial ->
    Shard(1) runs ``funcol.reduce_scatter_single`` with scatter_dim 1, which first copies y to dim-0 chunk order
    (``_chunk_or_narrow_cat``: one more s·b·h) and returns s·b·h/t (saved by the per-op policy); without it
    ``funcol.all_reduce`` returns a new s·b·h (torch 2.13 _functional_collectives.py; its meta kernel ``empty_like``).
    Then, at the add, the collective's output. measure --fake of Llama 3 405B tp8 SP pp4 1F1B (seed 20261260 #22,
    stage 0): its peak is the fourth F's last reduce-scatter, 2 × s·b·h (2 GiB) beyond the F's moment."""
    sbh, t, act = sh.s * sh.b * sh.h, sh.t, sh.act
    per_op = sh.recompute == _SAC
    y = 0 if per_op and "w2" in sh.sac else act * sbh
    if t > 1 and sh.sp:
        out = 0 if per_op else act * sbh // t
        beyond, how = max(y + act * sbh + out - res * sbh // t, out), "y + the dim-0 copy + y/t − the add's output"
    elif t > 1:
        beyond, how = max(y + act * sbh - res * sbh, act * sbh), "y + the all-reduce's output − the add's output"
    else:
        beyond, how = y, "y"
    fwd = forward_transient_bytes(T)
    if beyond > fwd:
        T.add("activations", "a forward's last down projection at its collective: its output and the collective's "
              "beyond the F's saved tensors (and beyond the forward's other transients)", beyond - fwd,
              f"{how} − {fwd:,} B ({sh.act} B × s·b·h = {act * sbh:,} B)", kind="forward_down_projection")


def forward_transient_bytes(T: Terms) -> int:
    """What the terms laid so far hold at a forward's own moment beyond its saved tensors (lifetime ``forwards``)."""
    return sum(t.bytes for c in ("activations", "temporaries") for t in T[c] if LIFETIMES.get(t.kind) == "forwards")


def _float8_forward_cast_term(cfg: Config, rp, T: Terms, sh: _Shape) -> None:
    """A forward's moment holds its microbatch's saved tensors; its last block cast its largest float8 weight
    (``float8_weight_cast_bytes``) before its MLP saved its own (none under full recompute): the cast beyond them."""
    f8_cast = float8_weight_cast_bytes(cfg) if any(st.layers for st in rp.stages) else 0
    if not f8_cast:
        return
    mlp = 0 if cfg.training.recompute == "full" else sum(x for _, x, part in layer_activation_terms(sh)[0]
                                                         if part == "mlp")
    if f8_cast > mlp:
        T.add("activations", "float8: a forward's cast of its largest Linear weight (fp32 upcast, scaled copy, "
              "float8), beyond the last block's MLP tensors not yet saved", f8_cast - mlp,
              f"9 B × the largest block weight's elements / t − {mlp:,} B", kind="float8_forward_cast")


def _float8_forward_input_cast_term(cfg: Config, T: Terms, sh: _Shape, res: int, autocast: bool) -> None:
    """A forward's last block, at its MLP's last up projection (w3 of a SwiGLU, w1 otherwise), casting that
    Linear's input to float8 (torchao 0.18's Float8Linear.forward: ``input.to(autocast_dtype)`` under autocast, then
    ``matmul_with_hp_or_float8_args`` saves that copy as ``input_hp`` and ``hp_tensor_to_float8_dynamic`` makes
    ``.to(float32)``, ``* scale``, the clamp and the float8 result: ``float8_input_cast_bytes``). Alive there beyond
    the F's moment: the cast; the Linear's input as it arrives (the norm's output; under sequence parallelism its
    all-gathered copy, and the norm's output shard beside it) and autocast's copy of it, each where the block does not
    save it (a checkpointed block saves neither; Float8Linear saves the copy, not its source); a SwiGLU's SiLU output
    where the block does not save it (the product reads it after w3), and the attention's residual sum where the block
    does not save it (the MLP's residual add reads it) — less what the block saves that is not made yet
    (the MLP's tensors after the cast, and the block's output) and the forward's other transients. measure --fake of
    Llama 3 70B tp4 SP pp4 1F1B selective-op float8 tensorwise (fake seed 20261270 #17, rank 8): each F peaks at the
    second block's w3 input cast, 15 B × s·b·h beyond the block's tensors made (the fp32 all-gathered input, its
    bf16 copy, the fp32 scaled copy and its clamp, the float8 result)."""
    cast = float8_input_cast_bytes(cfg, sh)[1]
    if not cast:
        return
    sbh = sh.s * sh.b * sh.h
    terms = () if cfg.training.recompute == "full" else layer_activation_terms(sh)[0]
    mlp = [(name, x) for name, x, part in terms if part == "mlp"]
    before = ("MLP input", "gate output", "SiLU output", "w1 output")  # made by the cast (a SwiGLU's w3)
    made = sum(x for name, x in mlp if name.startswith(before if sh.swiglu else before[:1]))
    input_saved = any(name.startswith("MLP input") for name, _ in mlp)
    copy = autocast and not sh.float8_uncast
    alive = cast + (res * sbh if copy or not input_saved else 0) + (sh.act * sbh if copy and not input_saved else 0)
    if sh.sp and sh.t > 1:
        alive += res * sbh // sh.t
    silu = sh.swiglu and not any(name.startswith("SiLU output") for name, _ in mlp)
    alive += sh.act * sh.s * sh.b * sh.f // sh.t if silu else 0
    stream = res * sbh // (sh.t if sh.sp else 1)  # the residual stream: the block's output, and its mid-block sum
    alive += 0 if any(name.startswith("norm2 input") for name, _, _ in terms) else stream
    unmade = sum(x for _, x in mlp) - made + stream
    beyond = alive - unmade - forward_transient_bytes(T)
    if beyond > 0:
        T.add("activations", "float8: a forward's last up projection casting its input (its input as it arrives, "
              "autocast's copy, the fp32 scaled copy, its clamp, the float8 result), beyond what the block saves "
              "after it", beyond, f"{alive:,} alive at the cast − {unmade:,} B not made yet − the forward's other "
              f"transients", kind="float8_forward_input_cast")
        T.float8_piece = max(T.float8_piece, 4 * sbh)  # the cast's scaled fp32 copy (its clamp's the same)


def float8_weight_cast_bytes(cfg: Config) -> int:
    """The transient of a float8 Linear's forward casting its weight (torchao's ``hp_tensor_and_scale_to_float8``:
    ``tensor.to(torch.float32) * scale``, then ``to_fp8_saturated``'s clamp and the float8 result: 4 + 4 + 1 B an
    element at once, of the block's largest Linear weight, its TP shard), in every forward and every recompute of
    one; none where FSDP2 gathers the weights in float8 already or where inductor fuses the casts (compile), and
    none without float8 (``measure --fake`` of Llama 3 405B ZBV pp2 cp4 rowwise: 3.25 + 3.25 + 0.8 GiB of w1's cast
    at the peak of a W's recompute)."""
    tr, m = cfg.training, cfg.model
    if tr.float8 == "none" or tr.compile or wrapping_plan(cfg).float8_all_gather:
        return 0
    # (a block with experts: its attention's; the grouped experts are no Float8Linear)
    dense = not m.experts or getattr(m, "dense_layers", 0)
    return 9 * max(lin.d_in * lin.d_out for lin in lora.adapted_linears(m, "all")
                   if dense or lin.name in ("wq", "wk", "wv", "wo")) // cfg.parallel.tp


def float8_input_cast_bytes(cfg: Config, sh: _Shape) -> tuple[int, int]:
    """The transients of a dense block's float8 Linears casting their inputs in a forward (torchao's
    ``hp_tensor_and_scale_to_float8`` of ``input_hp``: its fp32 upcast — none where it is fp32 already, CPU autocast's
    ``float8_uncast`` —, the scaled fp32 copy and the float8 result): (the down projection's, over the tokens × f/t,
    at the end of the forward with every tensor the block saves but its own made; the up projections', over the
    tokens × h, at the MLP's start, before the MLP saves anything). Measured in-process on the backend's GELU block
    under a split backward's weight pass, 2,048 tokens, f = 512: every group's recompute peaks 9 B × 2,048 × 512 above
    its bf16 twin; end to end tests/backend/fake/test_fake_float8_weight_pass.py. None without float8 or under
    torch.compile (inductor fuses the casts); a block with experts (no Float8Linear in its MLP) is not analysed."""
    tr = cfg.training
    if tr.float8 == "none" or tr.compile:
        return 0, 0
    per_element = float8_cast_element_bytes(sh.float8_uncast)
    return per_element * sh.s * sh.b * sh.f // sh.t, per_element * sh.s * sh.b * sh.h


def float8_cast_element_bytes(fp32_input: bool) -> int:
    """Bytes an element of a float8 input cast holds at its peak (torchao's ``hp_tensor_to_float8_dynamic``): the fp32
    upcast (none where the input is fp32 already), the scaled fp32 copy and the float8 result."""
    return (0 if fp32_input else 4) + 4 + 1


def weight_pass_casts(cfg: Config, sh: _Shape, autocast: bool) -> dict[str, int]:
    """Under autocast, the 16-bit weight cast each Linear's own group makes anew in a split backward's weight
    pass (its TP shard), kept by autocast's cache to the step's end beside the forward's: measured on the
    backend's blocks, each Linear's group re-casts its own weight once, the others hit the cache. None under
    float8 (Float8Linear saves its weight uncast)."""
    if not autocast or cfg.training.float8 != "none" or sh.lora:  # LoRA: only the small adapters train
        return {}
    return {lin.name: sh.act * lin.d_in * lin.d_out // sh.t for lin in lora.adapted_linears(cfg.model, "all")}


def weight_pass_fresh(cfg: Config, sh: _Shape, wb: int) -> dict[str, int]:
    """Per parameter group of a dense block (``weight_groups``), the fresh weight gradient ``stage_backward_weight``
    holds where the weight has a gradient already (a stage's W after its first: ``weight.grad += dw``, so ``dw`` is a
    tensor of its own, not the ``.grad``), in the parameter's dtype (``wb`` bytes). Its TP shard; the norms' weights
    whole. None under LoRA (the adapters' gradients are small)."""
    if sh.lora:
        return {}
    lins = {lin.name: lin for lin in lora.adapted_linears(cfg.model, "all")}
    out = {}
    for g in weight_groups(sh):
        numel = (sh.h if g in ("norm1", "norm2") else sh.head_dim if g in ("q_norm", "k_norm")
                 else lins[g].d_in * lins[g].d_out // sh.t)
        out[g] = numel * wb
    return out


def weight_pass_bytes(sh: _Shape, res: int, checkpointed: int, casts: dict[str, int] | None = None,
                      grads: dict[str, int] | None = None,
                      block: tuple[int, list[tuple[str, int]], tuple[str, ...], int] | None = None,
                      last_graph_kept: bool = False, f8_cast: int = 0,
                      f8_in: tuple[int, int] = (0, 0),
                      fresh: dict[str, int] | None = None,
                      node: dict[str, int] | None = None,
                      plain_before: tuple[int, int] = (0, 0), plain_saved: int = 0) -> tuple[int, str, int]:
    """What a W holds of its stage's ``checkpointed`` blocks (``weight_pass_block``): the groups run block
    after block, so the earlier blocks' recomputes (one per group) keep their input path's tensors, and the
    last block's k-th group holds, at the end of its recompute, the k − 1 earlier recomputes with every tensor
    not freed by an earlier group beside the whole block's saved tensors (the recompute's own graph holds them
    until torch's early stop unwinds it: ``_recomputation_hook`` stops only once it has packed as many tensors as
    the forward saved), then in its backward k such recomputes and the weight casts the groups so far made
    (``weight_pass_casts``); SwiGLU's w3, last, holds less (``_up_projection_tail``). Returns (bytes, formula,
    freed).

    ``grads``: what the I kept of each block for this W, by group (``split_backward_group_grads``; every
    block of the stage checkpointed). torch's ``stage_backward_weight`` drops a group's kept gradients once
    its ``autograd.grad`` has run (``del param_group["grads"]``), so the pass's peak is where its recomputes
    less the gradients already dropped are most: the first group (nothing dropped yet) or a group of the last
    block (the earlier blocks' gradients all dropped); ``freed`` is what is dropped by then. ``block``: the
    block's (kept, frees, groups, above) where it is not a dense one (``moe_weight_pass_block``): each
    earlier block's recomputes keep ``above`` too (the next block's checkpoint holds their graph), and the
    last block's where ``last_graph_kept`` (the last stage's final norm, or a plain block after it, holds it).
    ``plain_before``: the stage's plain blocks (selective-layer) before its first and before its last checkpointed
    block: their groups come first in the parameter order and run no recompute, so their kept gradients are dropped by
    the pass's peak (measure --fake, seed 20261244 #22, Llama 3 405B ZBV selective-layer every 2: stage 3's W dropped
    the plain block's 3 GiB before the checkpointed block's first recompute), and with them what their weights' nodes
    saved (``plain_saved`` a block: the groups' frees of ``weight_pass_block``; 2.7 of its 4.3 GiB there)."""
    kept, frees, groups, above = block if block is not None else (*weight_pass_block(sh, res), weight_groups(sh), 0)
    casts = casts or {}
    order = {g: i for i, g in enumerate(groups)}
    per_block = len(groups) * (kept + above) + sum(casts.values())  # what each earlier block's recomputes keep
    last_kept = kept + (above if last_graph_kept else 0)
    block_grads = sum(grads.values()) if grads else 0
    last = _weight_pass_peak_block(per_block, grads, checkpointed)
    n_plain = plain_before[1 if last == checkpointed - 1 else 0]
    plain_freed = n_plain * block_grads
    # the k-th group's recompute, at its end, holds every tensor the block saved (its graph's nodes hold what the
    # pack hook returns until the early stop unwinds it), beside the k − 1 earlier recomputes' stored tensors; then
    # its backward, k recomputes' stored tensors and the weight casts made so far
    full = kept + above + sum(n for _, n in frees)
    mlp = sum(n for g, n in frees if g.rsplit(".", 1)[-1] in ("w1", "w2", "w3"))
    # SwiGLU's up projection w3 comes last in the parameter order though its node lies above w2's: its group (under
    # LoRA its adapter's two) finds the other recomputes' copies gone and holds far less (measured on the backend's
    # blocks: tests/backend/test_weight_pass.py), so the last block's pass peaks before it
    tail = _up_projection_tail(groups) if last == checkpointed - 1 else 0
    fresh = fresh or {}
    best, at, alive, made, freed = None, 0, 0, 0, 0
    for k in range(1, max(len(groups) - tail, 1) + 1):
        alive_k = last_kept + sum(n for g, n in frees if order[g] >= k - 1)
        made_k = sum(n for g, n in casts.items() if order[g] <= k - 1)
        freed_k = last * block_grads + plain_freed + (sum(grads.get(g, 0) for g in groups[:k - 1]) if grads else 0)
        # (float8: a recompute casts each MLP weight in its forward, its MLP's saved tensors not yet made)
        # (and its Linears' casts of their inputs: ``float8_input_cast_bytes``, the down projection's at its end, the up
        # projections' before the MLP's saved tensors)
        f8 = max(f8_cast - mlp, f8_in[0], f8_in[1] - mlp, 0)
        # weights that hold a gradient already (``fresh``): the previous group's fresh gradients stay through this
        # group's autograd.grad (``dweights`` is rebound only when it returns), and this group's are made at its node,
        # beside what else that node makes (``node``)
        prev = fresh.get(groups[k - 2] if k > 1 else groups[-1] if last else "", 0)
        at_node = fresh.get(groups[k - 1], 0) + (node or {}).get(groups[k - 1], 0)
        held = max((k - 1) * alive_k + full + f8 + prev, k * alive_k + made_k + prev + at_node) - freed_k
        if best is None or held > best:
            best, at, alive, made, freed = held, k, alive_k, made_k, freed_k
    earlier = last * per_block
    where = "last" if last == checkpointed - 1 else "first"
    formula = (f"{last} earlier block(s) × ({len(groups)} groups × {kept + above:,} B (their input path"
               f"{f' and the {above:,} B above their weights' if above else ''})"
               f"{f' + {sum(casts.values()):,} B (weight casts)' if casts else ''}) + {at - 1} × {alive:,} B (the "
               f"{where} block's recomputes before its group {groups[at - 1] if groups else '-'}: what is not freed yet)"
               f" + {full:,} B (that group's recompute at its end: everything the block saves"
               + (f"; under float8 its forward's weight cast, {f8_cast:,} B, beyond the MLP's {mlp:,} B" if f8_cast else "")
               + (f", or its input casts: {f8_in[0]:,} B at its end, {f8_in[1]:,} B at its MLP's start" if f8_in[0] else "")
               + ")"
               f"{f' + {made:,} B (weight casts)' if casts else ''}")
    gone = min(n_plain * plain_saved, earlier + (best or 0) + freed)
    if gone:
        formula += f" − {n_plain} plain block(s) before it × {plain_saved:,} B (what their weights' nodes saved)"
    return earlier + (best or 0) + freed - gone, formula, freed


def _weight_pass_peak_block(per_block: int, grads: dict[str, int] | None, checkpointed: int) -> int:
    """Which checkpointed block a weight pass peaks in (``weight_pass_bytes``): each block adds ``per_block`` (its
    recomputes) and drops the gradients the I kept for it, so the first block (0) or the last."""
    return checkpointed - 1 if per_block >= (sum(grads.values()) if grads else 0) else 0


def _up_projection_tail(groups: tuple[str, ...]) -> int:
    """How many of the last parameter groups are SwiGLU's up projection's (w3; under LoRA its adapter's A and B; a
    block with experts: the routed or the shared experts' w3), leaving at least one group before them."""
    n = 0
    for g in reversed(groups[1:]):
        if (g[:-2] if g.endswith((".A", ".B")) else g).rsplit(".", 1)[-1] != "w3":
            break
        n += 1
    return n


def weight_pass_terms(cfg: Config, rp, T: Terms, sh: _Shape, blocks: _Blocks, ckpt_of: dict[int, int],
                      res: int, autocast: bool,
                      keeps: tuple[dict[str, int], dict[str, int] | None] | None = None,
                      ep_rank: int | None = None) -> None:
    """What each W of a local stage holds of its checkpointed blocks (lifetime ``stage_weight``: that stage's
    W moments). A later stage's W is ``stage_backward_weight``: a recompute per parameter group
    (``weight_pass_bytes``). The first stage's W is a full backward (torch's ``backward_weight_one_chunk``
    runs ``stage_backward`` there: its input needs no gradient, so its I found no parameter groups), which
    recomputes one block at a time, as a B: the B's own terms lie there (``lifetimes``: ``backward_input`` and
    ``full_backward`` at stage 0's W, ``recomputed_block`` among them), none here. Plain parameters and FSDP2's alike (FSDP2 under pipelining keeps
    a stage's units unsharded from its first backward, so its weight pass runs on the same graph: measured
    in-process 1.07 × the rule; end to end a ZeRO-3 interleaved zero-bubble run on CPU ranks −3.3 / −5.2 %,
    ``measure --fake`` of Llama 3 8B ZBV ZeRO-3 +9.3 / +4.6 %).
    A stage of blocks with experts only, each checkpointed, recomputes them the same way, per
    ``moe_weight_pass_block`` (``measure --fake`` Qwen3 235B DualPipeV tp2 ep2 full recompute: the W held
    29 GiB of the experts' recomputes where nothing was laid); a stage that mixes both is left as it was. Where only some
    of its blocks are checkpointed (selective-layer), the pass recomputes those (``weight_pass_bytes`` of their count,
    as for dense blocks; the others' saved tensors are the microbatch's): measure --fake of Qwen3 30B-A3B Interleaved
    tp4 ep32 ZeRO-2 selective-layer, stage 0, −11.3 % with nothing laid, +0.7 % so.

    ``keeps``: what the I kept of each block for the W, by group (``split_backward_group_grads``, and
    ``moe_split_backward_group_grads`` for a block with experts; None where ``split_backward_terms`` lays
    nothing). Where every block of the stage is checkpointed, the pass drops
    each group's kept gradients as it goes, and its peak comes after most are dropped: what is dropped by
    then comes off the I's keep at the W's moments (``fake`` Llama 3 70B DualPipeV tp8 SP ZeRO-3 full
    recompute: the middle stages' W peak held 1.7 of the 10.0 GiB the I kept)."""
    casts = weight_pass_casts(cfg, sh, autocast)
    plan = wrapping_plan(cfg)
    # the W's fresh weight gradients where the weights hold one already; not analysed under autocast over plain
    # parameters (its casts' backward) nor where FSDP2 converts (an I's post-backward moves .grad away first)
    fresh = (weight_pass_fresh(cfg, sh, plan.gathered_bytes if plan.fsdp2 else sh.act)
             if not autocast and not plan.converts_gradients else {})
    f8_cast = float8_weight_cast_bytes(cfg)
    of_count: dict[tuple, tuple[int, str, int] | int] = {}  # (checkpointed, kind) -> the pass; + ("peak",): its peak block
    moe_block = None
    trailing = _plain_after_checkpoint_of_stages(cfg, rp, ckpt_of)
    before = _plain_before_checkpoints_of_stages(cfg, rp, ckpt_of)
    for st in rp.stages:
        c = ckpt_of[st.stage]
        moe = bool(st.moe_layers)
        if not c and st.stage and not plan.fsdp2 and st.moe_layers and st.moe_layers == st.layers:
            _plain_experts_weight_pass(cfg, T, st, sh, res, autocast, keeps[1] if keeps else None, ep_rank)
        elif not c and fresh and st.stage:
            _plain_weight_pass_fresh(cfg, T, st, fresh, autocast)
        if not c and st.stage and keeps is not None and not st.moe_layers:
            _float8_plain_weight_pass(cfg, T, st, sh, res, keeps[0])
        if not c or (moe and (st.moe_layers != st.layers or st.stage == 0)):
            continue
        if moe:
            # the last checkpointed block's graph is held past the pass where the stage's final norm, or a plain block
            # after it (selective-layer), saved its output: that norm's node keeps the tensor with its grad_fn (torch's
            # SavedVariable keeps an input's graph) — measure --fake, seed 20261244 #00 (Qwen3 235B ZBV selective-layer
            # every 4, stage 2 = a checkpointed block and a plain one): each of the W's 12 recomputes held its
            # 1.29 GiB input path and above (allocated −10.9 % with the last block's rule)
            key = (c, "moe", bool(st.final_norm or st.head or trailing.get(st.stage)), before[st.stage])
            if key not in of_count:
                moe_block = moe_block or moe_weight_pass_block(cfg, sh, res, ep_rank)
                of_count[key] = weight_pass_bytes(sh, res, c, casts, keeps[1] if keeps else None, moe_block,
                                                  last_graph_kept=key[2], f8_cast=f8_cast, plain_before=key[3])
                node = _experts_weight_grads(cfg, autocast)
                with_grads = weight_pass_bytes(sh, res, c, casts, keeps[1] if keeps else None, moe_block,
                                               last_graph_kept=key[2], f8_cast=f8_cast, node=node,
                                               plain_before=key[3])
                of_count[key + ("grads",)] = (with_grads[0] - with_grads[2]) - (of_count[key][0] - of_count[key][2])
            nbytes, formula, freed = of_count[key]
            if key + ("peak",) not in of_count:
                of_count[key + ("peak",)] = _blocks_before_weight_peak(sh, res, c, casts, keeps[1] if keeps else None,
                                                                       moe_block, key[3])
            T.weight_peak_blocks[st.stage] = (of_count[key + ("peak",)], st.layers)
            extra = of_count[key + ("grads",)]
            if extra > 0:
                T.add("temporaries", f"stage {st.stage}: its W's experts' weight gradients at their group's node "
                      "(select_backward of each expert's slice, a full-size gradient each, summed in the input "
                      "buffer: two beside the sum)", extra, f"the pass's peak with them less without = {extra:,} B",
                      stage=st.stage, kind="weight_pass_grads")
            T.add("activations", f"stage {st.stage}: its W's recomputes of its {c} checkpointed block"
                  f"{'s' if c != 1 else ''} with experts, one per parameter group (torch's stage_backward_weight: "
                  "a graph task per group, the checkpoint recomputes per graph task)", nbytes, formula,
                  stage=st.stage, kind="weight_pass")
            _dropped(T, st.stage, freed)
            continue
        if st.stage == 0:  # its W is a full backward (its input needs no gradient): ``recomputed_block`` there
            continue
        key = (c, keeps is not None, before[st.stage])
        if key not in of_count:
            f8_in = float8_input_cast_bytes(cfg, sh)
            plain_saved = sum(n for _, n in weight_pass_block(sh, res)[1])
            of_count[key] = weight_pass_bytes(sh, res, c, casts, keeps[0] if key[1] else None, f8_cast=f8_cast,
                                              f8_in=f8_in, plain_before=key[2], plain_saved=plain_saved)
            if fresh:
                with_fresh = weight_pass_bytes(sh, res, c, casts, keeps[0] if key[1] else None, f8_cast=f8_cast,
                                               f8_in=f8_in, fresh=fresh, plain_before=key[2], plain_saved=plain_saved)
                of_count[key + ("fresh",)] = (with_fresh[0] - with_fresh[2]) - (of_count[key][0] - of_count[key][2])
        nbytes, formula, freed = of_count[key]
        if key + ("peak",) not in of_count:
            of_count[key + ("peak",)] = _blocks_before_weight_peak(sh, res, c, casts, keeps[0] if key[1] else None, None,
                                                                   key[2])
        T.weight_peak_blocks[st.stage] = (of_count[key + ("peak",)], st.layers)
        T.add("activations", f"stage {st.stage}: its W's recomputes of its {c} checkpointed block"
              f"{'s' if c != 1 else ''}, one per parameter group (torch's stage_backward_weight: a graph task "
              "per group, the checkpoint recomputes per graph task)", nbytes, formula, stage=st.stage,
              kind="weight_pass")
        _dropped(T, st.stage, freed)
        extra = of_count.get(key + ("fresh",), 0)
        if extra > 0:
            T.add("temporaries", f"stage {st.stage}: at each W but its first, the fresh weight gradients "
                  "stage_backward_weight holds beside its recomputes (its weights hold a gradient already: "
                  "weight.grad += dw; the previous group's dw stays until the next autograd.grad returns)", extra,
                  f"the pass's peak with them less without = {extra:,} B", stage=st.stage, kind="weight_pass_fresh")


def _plain_weight_pass_fresh(cfg: Config, T: Terms, st, fresh: dict[str, int], autocast: bool) -> None:
    """A W of a stage that recomputes nothing, after the stage's first (its weights hold a gradient already): each
    group's ``autograd.grad`` makes its weights' gradients fresh, added into ``.grad`` and dropped before the next
    group, so the W holds the largest group's: a dense weight's (``weight_pass_fresh``) or the grouped experts', whose
    select_backward makes a full-size gradient per expert summed in the input buffer — two beside the sum
    (``_experts_weight_grads``). measure --fake of Qwen3 235B-A22B InterleavedZeroBubble tp2 ep4 ZeRO-3 bf16 gradients,
    no recompute (seed 20261215 #37, rank 16, one block a stage): each W 1.12 GiB over what it started with, three
    384 MiB expert gradients."""
    largest = max(fresh.values(), default=0)
    if st.moe_layers:
        largest = max(largest, max(_experts_weight_grads(cfg, autocast).values()))
    if largest:
        T.add("temporaries", f"stage {st.stage}: at each W but its first, the fresh gradients of its largest parameter "
              "group (its weights hold a gradient already: weight.grad += dw)", largest, f"{largest:,} B", stage=st.stage,
              kind="weight_pass_fresh")


def _plain_experts_weight_pass(cfg: Config, T: Terms, st, sh: _Shape, res: int, autocast: bool,
                               kept: dict[str, int] | None, ep_rank: int | None) -> None:
    """``experts_weight_pass_peak`` laid at every W of a later stage of blocks with experts that recomputes nothing,
    its parameters plain (no FSDP2): in the stage's first W ``weight.grad = dw`` makes the previous group's gradient the
    ``.grad`` itself, which no gradient term counts before that W ends, so the first W holds the same. measure --fake
    of seed 20261273 #21 (Qwen3 30B-A3B ZBV pp4 v2 DDP autocast, one block a stage, 128 local experts): every later
    stage's W 2.38 GiB above its start at w2's first sum — w1's 768 MiB fp32 gradient, the sum, two select_backward
    outputs — less 0.62 GiB dropped; nothing was laid (allocated −5.4 %; laid, +0.007 GiB at every later W)."""
    best, at = experts_weight_pass_peak(cfg, sh, res, autocast, kept, ep_rank)
    _, wb, h, _, e_loc, f_loc, _ = _moe_backward_dims(cfg, autocast)
    if best:
        T.add("temporaries", f"stage {st.stage}: its W's weight gradients at group {at} (the experts' full-size "
              "gradients summed in the input buffer, two beside the sum, and the previous group's gradient; "
              "stage_backward_weight's dweights held until the next group's returns), less what the groups before "
              "it dropped", best, f"{best:,} B", stage=st.stage, kind="weight_pass_experts")
        # a few full-size gradients, each sum's buffer reused by the next: the allocator sees tensors of that size
        T.weight_pass_piece[st.stage] = e_loc * f_loc * h * wb


def experts_weight_pass_peak(cfg: Config, sh: _Shape, res: int, autocast: bool, kept: dict[str, int] | None,
                             ep_rank: int | None = None) -> tuple[int, str]:
    """What a W over a block with experts that recomputes nothing holds above its start at its peak, and the parameter
    group it peaks in, its weights holding gradients already. torch's ``stage_backward_weight`` runs the parameter
    groups in parameter order (``moe_weight_pass_block``'s groups: the attention half, the router, the grouped experts'
    w1, w2, w3), one ``autograd.grad`` each; its ``dweights`` tuple is rebound only when the next call returns, so each
    group runs beside the previous group's fresh gradient (``weight.grad += dw``). The grouped experts' node makes a
    full-size gradient per expert, summed out of place in the input buffer (``_experts_weight_grads``: two beside the
    sum). By a group's call the groups before it have dropped what their nodes saved (``moe_weight_pass_block``'s
    frees: under autocast w1's own casts of the dispatched tokens and of its weight slices) and the output gradients
    the I kept for them (``kept``), and the group's own node has run its last two experts (each sum's first operands),
    freeing what their matmuls saved. So the pass peaks at the group where that is largest, in the stage's first
    block: w2, beside w1's full-size gradient. Measured on the backend's block (16 local experts, fp32 and autocast)
    within one routed row (``tests/backend/test_weight_pass.py``)."""
    _, wb, h, _, e_loc, f_loc, _ = _moe_backward_dims(cfg, autocast)
    _, frees, groups, _ = moe_weight_pass_block(cfg, sh, res, ep_rank)
    node = _experts_weight_grads(cfg, autocast)
    dense = weight_pass_fresh(cfg, sh, wb)
    one = e_loc * f_loc * h * wb
    best, at, prev, dropped = 0, "", 0, 0
    for g in groups:
        own = node.get(g, dense.get(g, 0))
        if g in node:  # the first sum comes after the last two experts' matmuls ran and freed what they saved
            own -= sum(nb for gg, nb in frees if gg == g) * min(2, e_loc) // e_loc
        if prev + own - dropped > best:
            best, at = prev + own - dropped, g
        prev = one if g in node else dense.get(g, 0)
        dropped += (kept or {}).get(g, 0) + sum(nb for gg, nb in frees if gg == g)
    return best, at


def _float8_plain_weight_pass(cfg: Config, T: Terms, st, sh: _Shape, res: int, kept: dict[str, int]) -> None:
    """A split backward's W over a stage that recomputes nothing, under eager float8: torchao's Float8Linear backward
    (``matmul_with_hp_or_float8_args.backward``) makes grad_input as well as grad_weight, whichever the caller asked
    for (``stage_backward_weight`` asks for the weights'): the output gradient cast along its last axis (its float8
    bytes kept), the weight's cast, grad_input (the compute dtype), then the output gradient's and the input's casts
    along the tokens, each at its peak 9 B an element (the fp32 upcast and scaled copy, then the saturated clamp and
    the float8 bytes), the function's locals alive until it returns. The pass runs the groups in parameter order
    (``weight_groups``), each dropping its kept output gradient and what its weights' nodes saved
    (``weight_pass_block``'s frees) once its ``autograd.grad`` returns, so it holds the most at the group whose casts,
    less what the groups before it dropped, are the most. measure --fake of seed 20261252 #29 (GPT-2 ZBV pp4 rowwise,
    attention-core recompute): each later stage's W 168 MiB above its start at w1's group (its output gradient's cast
    along the tokens, 2 × 192 + 48 MiB, beside the first cast's 48 and grad_input's 24), −3.1 … −3.4 % with nothing
    laid. None without float8, compiled (inductor fuses the casts) or where FSDP2 gathers the weights in float8."""
    tr = cfg.training
    if tr.float8 == "none" or tr.compile:
        return
    n, t = sh.s * sh.b, sh.t
    weight_cast = not wrapping_plan(cfg).float8_all_gather
    frees = weight_pass_block(sh, res)[1]
    lins = {lin.name: lin for lin in lora.adapted_linears(cfg.model, "all")}
    best, at, dropped = 0, "", 0
    for g in weight_groups(sh):
        lin = lins.get(g)
        if lin is not None and lin.d_in % 16 == 0 and lin.d_out % 16 == 0:  # (backend.parallel.float8.converts)
            d_in = lin.d_in if lin.column_parallel else lin.d_in // t
            d_out = lin.d_out // t if lin.column_parallel else lin.d_out
            go, x, w = n * d_out, n * d_in, d_in * d_out if weight_cast else 0
            peak = max(go + 9 * w, go + w + sh.act * x + 9 * go, 2 * go + w + sh.act * x + 9 * x)
            if peak - dropped > best:
                best, at = peak - dropped, g
        dropped += kept.get(g, 0) + sum(nb for gg, nb in frees if gg == g)
    if best:
        # the pass peaks in the stage's first block (the groups run in parameter order, dropping as they go): FSDP2's
        # fresh gradients of the stage are not made by then (``buffers._stage_fresh_gradients``)
        T.weight_peak_blocks[st.stage] = (0, st.layers)
        T.add("temporaries", f"stage {st.stage}: its W's float8 casts at group {at} (torchao's backward makes grad_input "
              "too; the casts along the tokens), less what the groups before it dropped", best, f"{best:,} B",
              stage=st.stage, kind="weight_pass_float8")


def _blocks_before_weight_peak(sh: _Shape, res: int, c: int, casts: dict[str, int], grads: dict[str, int] | None,
                               block, plain_before: tuple[int, int]) -> int:
    """The blocks whose parameter groups have all run by a stage's weight-pass peak: the plain blocks before the
    checkpointed block it peaks in, and the checkpointed ones before it (``weight_pass_bytes``)."""
    kept, _, groups, above = block if block is not None else (*weight_pass_block(sh, res), weight_groups(sh), 0)
    last = _weight_pass_peak_block(len(groups) * (kept + above) + sum((casts or {}).values()), grads, c)
    return last + plain_before[1 if last == c - 1 else 0]


def _experts_weight_grads(cfg: Config, autocast: bool) -> dict[str, int]:
    """Per parameter group of the grouped experts (``moe_weight_pass_block``: w1, w2, w3), what its node holds beside its
    recomputes in a weight pass: each expert's weights are a slice of a 3-D parameter, so autograd's select_backward
    makes a full-size (E_loc, f, h) gradient per expert, summed in the parameter's input buffer — two beside the sum,
    as in a B (``moe_backward_terms``; one local expert: two, nothing to sum). measure --fake of Qwen3 30B-A3B pp4
    DualPipeV DDP full recompute, autocast (seed 20261229): its peak in a W's experts, one 768 MiB fp32 sum and two
    select_backward outputs."""
    _, wb, h, _, e_loc, f_loc, n_w = _moe_backward_dims(cfg, autocast)
    one = e_loc * f_loc * h * wb
    return {w: (3 if e_loc > 1 else 2) * one for w in ("w1", "w2", "w3")[:n_w]}


def first_weight_end_terms(cfg: Config, rp, T: Terms, grads_of: dict[int, int], autocast: bool) -> None:
    """A stage's first W under a split backward, where FSDP2's unsharded gradients of the stage are made by it
    (``stage_accumulated``: alive from that W's end) and the stage recomputes nothing: torch's
    ``stage_backward_weight`` runs its parameter groups in turn, each freeing what its weights' nodes saved and the
    output gradients the I kept for it, and making its weights' gradients, so the W peaks at its end — the stage's
    gradients made (``grads_of``), the microbatch's activations and kept gradients gone, beside the last group's
    transients (the grouped experts' w3: select_backward's two full-size gradients beside the sum,
    ``_experts_weight_grads``). What that end holds beyond the W's moment (its start) is laid at the stage's first W
    only (``stage_weight`` less ``stage_later_weight``). measure --fake of Qwen3 235B ZBV tp4 ep8 ZeRO-3 selective,
    seed 20261247 #21, stage 1 (three blocks with experts): its first W peaked at its end with the 9 experts'
    gradients of 192 MiB made and two more beside the last sum (−14 % at that W without it)."""
    par = cfg.parallel
    if par.schedule not in SPLIT_BACKWARD_SCHEDULES or par.pp < 2:
        return
    ckpt_of = _checkpointed_of_stages(cfg, rp)
    for st in rp.stages:
        g = grads_of.get(st.stage, 0)
        if st.stage == 0 or ckpt_of[st.stage] or not g:
            continue  # (stage 0's W is a full backward; a checkpointed stage's W peaks in its recomputes)
        acts = sum(t.bytes // t.in_flight for t in T["activations"]
                   if t.stage == st.stage and t.in_flight and t.kind not in ("moe_top_saved", "stage_logits"))
        kept = sum(t.bytes // t.in_flight for t in T["temporaries"]
                   if t.stage == st.stage and t.in_flight and t.kind == "split_backward_grads")
        last = 0
        if st.moe_layers and not cfg.model.shared_experts:
            last = _experts_weight_grads(cfg, autocast)["w3" if cfg.model.mlp == "swiglu" else "w2"] * 2 // 3
        extra = g + last - acts - kept
        if extra <= 0:
            continue
        how = (f"{g:,} B (its gradients) + {last:,} B (the last group's transients) − {acts:,} B (a microbatch's "
               f"activations) − {kept:,} B (what the I kept)")
        T.add("temporaries", f"stage {st.stage}: its first W's end (its gradients made, the microbatch's tensors freed)",
              extra, how, stage=st.stage, kind="first_weight_end")
        T.add("temporaries", f"stage {st.stage}: (not at its later W's: their gradients were made before)", -extra,
              f"−{extra:,} B", stage=st.stage, kind="first_weight_end_later")


def _dropped(T: Terms, stage: int, freed: int) -> None:
    """What a stage's W has dropped of the I's kept gradients by its peak (``weight_pass_bytes``' freed)."""
    if freed:
        T.add("temporaries", f"stage {stage}: the output gradients its W has dropped by its peak (each "
              "group's, once its autograd.grad has run), of what the I kept for it", -freed,
              f"−{freed:,} B (weight_pass_bytes)", stage=stage, kind="split_backward_grads_freed")


def _cp_attention_after_mlp(T: Terms, sh: _Shape) -> int:
    """A full backward runs a block's MLP before its attention: autograd frees what the MLP and its norm
    saved as their nodes run, so the context-parallel attention's workspace (its backward, and under full
    recompute the recomputed forward, which rebuilds the attention before the MLP) never meets the MLP's
    backward gradients nor the block's MLP tensors. The B moment laid both (``mlp_backward`` and
    ``cp_attention``); it holds the larger of the MLP's phase (its gradients, net of what it frees) and the
    attention's (the workspace, less the MLP's and norm's saved tensors): ``min(workspace, MLP net + saved)``
    comes off, at B moments only. Under full recompute, where the block's tensors at a B are its recomputed
    ones, the table at recompute = "none" (on the cached fakes of four seeds, 15 full-recompute CP ranks
    moved: Llama 2 7B s64K cp2 float8 +33 → +1 %, s16K cp4 rowwise +12.4 → 0.0 %; one layout overshoots,
    Llama 2 7B s32K fp32 GPipe +19 / +10 → −10 / −6 %). Under the other policies the same order holds (the
    MLP's saved tensors are the "none" table's too): laid there it left ranks 2–7 % low until the workspace's
    backward held what it holds (two blocks' gradients, the contiguous output gradient:
    ``context_parallel_workspace``); with both, thirteen cached seeds' mean |allocated error| 1.48 → 1.41 %
    (GPT-2 s128K pp8 cp2 per-op selective +13.5 → +5.5 %, Llama 2 7B s32K cp +4.0 → +1.4 %; lower: Llama 2 7B
    selective-layer pp cp −2.1 → −4.0 %, a split-backward selective row −2.9 → −5.8 %).

    Returns what the MLP's phase holds that the attention's does not (MLP net + saved; 0 where nothing was laid): FSDP2's
    fresh weight gradients made by the attention's phase but not by the MLP's take their place in the attention's side
    (``engine.memory.buffers._fresh_gradients``)."""
    cp = sum(t.bytes for t in T["temporaries"] if t.kind == "cp_attention")
    parts = mlp_phase_parts(T)
    mlp = sum(parts.values())
    again = _lora_forward_again(T)
    if not cp or not (mlp or again):
        return 0
    saved = _mlp_and_norm2_saved(sh)
    off = min(cp, max(mlp, again) + saved)
    T.add("temporaries", "a B's MLP backward and its context-parallel attention are not at once: the attention's "
          "workspace comes after the MLP's gradients and with the MLP's saved tensors gone", -off,
          f"−min(workspace {cp:,} B, MLP gradients net {mlp:,} B"
          + (f" (or, LoRA, the recompute's forward again {again:,} B, the larger)" if again else "")
          + f" + MLP and norm2 saved {saved:,} B)",
          kind="mlp_backward_freed")
    x = saved + parts["activations"]  # (the MLP backward's own activations terms: its freed down input)
    if not again and off == mlp + saved and x > 0:
        # the attention's phase is the moment: of what came off, the MLP's and its norm's saved tensors (less what the
        # MLP's backward had freed of them) are activations, not temporaries (measure --fake of Llama 2 7B s128K tp2 pp4
        # cp4 ZeRO-3 per-op, seed 20261263 #05: activations +14 %, temporaries −59 % with them off the temporaries).
        # A moment-only pair, so the totals, the events and the sums over these kinds stay as they were
        why = "a B's context-parallel attention phase: the MLP's and its norm's saved tensors gone are activations"
        T.add("temporaries", why + " (taken off the temporaries above)", x, f"{x:,} B", kind="cp_saved_refiled")
        T.add("activations", why, -x, f"−{x:,} B", kind="cp_saved_refiled")
    return mlp + saved


def _mlp_and_norm2_saved(sh: _Shape) -> int:
    """What a block's MLP and its norm saved for one microbatch, gone by its attention's backward: the table at
    recompute = "none" (under full recompute the block's tensors at a B are its recomputed ones, the same), with, LoRA
    over a frozen fp32 base, the 16-bit casts of the MLP's weights its matmuls saved."""
    plain = dataclasses.replace(sh, recompute="none")
    table = layer_activation_terms(plain)[0]
    return sum(x for _, x, group in table if group in ("mlp", "norm2")) + frozen_casts_saved(
        plain, tuple(n for n in ("w1", "w3", "w2") if sh.swiglu or n != "w3"))


def mlp_phase_parts(T: Terms) -> dict[str, int]:
    """A B's MLP backward as laid (``mlp_backward`` and what it frees), by category: its gradients net."""
    return {c: sum(t.bytes for t in T[c] if t.kind in ("mlp_backward", "mlp_backward_freed"))
            for c in ("temporaries", "activations")}


def _lora_forward_again(T: Terms) -> int:
    """LoRA: the adapted Linear's forward again in a block's recompute (``lora_recompute_casts``)."""
    return sum(t.bytes for t in T["activations"] if t.kind == "lora_recompute_casts")


def _recompute_forward_before_mlp(T: Terms) -> None:
    """LoRA under a recompute: the block's forward again (``lora_recompute_casts``) has returned before its MLP's
    backward makes its gradients (``mlp_backward``), so the B moment holds the larger of the two, not both
    (autograd runs the checkpoint's recompute on the first unpack, to its end, before the node that asked)."""
    again = _lora_forward_again(T)
    parts = mlp_phase_parts(T)
    mlp = sum(parts.values())
    if again <= 0 or mlp <= 0:
        return
    what = "LoRA: a recompute's forward again and its MLP's backward are not at once"
    if again >= mlp:  # the forward's moment, the earlier (MemTracker keeps its first peak where they tie)
        for c, x in parts.items():
            if x:
                T.add(c, f"{what}: the forward's moment, without the MLP's gradients", -x,
                      f"−{x:,} B (the MLP's backward terms in this category; forward again {again:,} B ≥ {mlp:,} B)",
                      kind="mlp_backward_freed")
    else:
        T.add("activations", f"{what}: the MLP's moment, without the forward again", -again,
              f"−{again:,} B (forward again; the MLP's gradients net {mlp:,} B are more)", kind="mlp_backward_freed")


def lora_forward_casts(cfg: Config, T: Terms, res: int, recomputed: bool = False) -> None:
    """What an adapted Linear's forward holds beyond what the microbatch saves, under autocast with fp32 adapters
    (peft's ``autocast_adapter_dtype``): peft's LoRA ``Linear.forward`` casts its input to the adapters' dtype
    (``_cast_input_dtype``: an fp32 copy where the input is 16-bit; autocast casts that back for lora_A, the copy the
    microbatch saves), the 16-bit input itself where only lora_A's copy is saved (the frozen base's matmul saves none),
    the base's output, lora_B's output and its scaled copy before the add, and the norm output the block part (attention
    or MLP) reads, freed when the part returns (``res`` bytes: the residual stream's). The widest adapted Linear's
    (the down projection's f/t-wide input where the MLP is adapted), at an F's own moment (``forwards``). measure
    --fake of GPT-2 pp2 1F1B (LoRA r8 on every Linear, bf16 base, bf16-mixed), stage 0 in the third F's down
    projection: 6 B × s·b·f + 8 B × s·b·h beyond the saved tensors (0.188 GiB at 8,192 tokens)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    t, tokens = par.tp, cfg.local_seq_len * tr.micro_batch_size
    act = 2  # autocast's 16-bit dtype

    def held(lin) -> int:
        d_in = lin.d_in if lin.column_parallel else lin.d_in // t
        d_out = lin.d_out // t if lin.column_parallel else lin.d_out
        # a norm output's readers (q, k, v; gate, up) take the stream's dtype: cast to fp32 only from 16 bits
        reads_norm = lin.name in ("wq", "wk", "wv", "w1", "w3")
        cast = (4 if res == act else 0) if reads_norm else 4 + act
        return tokens * (cast * d_in + 3 * act * d_out + res * m.hidden)
    lins = lora.adapted_linears(m, tr.lora_targets)
    if not lins:
        return
    widest = max(lins, key=held)
    # an MLP Linear's casts come after the block's attention part has returned: the forward's transients laid before
    # (the context-parallel attention's workspace, ``cp_attention_forward``) are gone by then, so the moment holds the
    # larger, as the forward's other transients are laid (``_forward_transient_terms``: each beyond the ones before).
    # measure --fake of seed 20261278 #21 (GPT-2 LoRA on the MLP, cp2 pp8): every action of rank 0 +0.16 GiB with both
    before = forward_transient_bytes(T) if widest.name in ("w1", "w2", "w3") else 0
    if held(widest) > before:
        T.add("activations", f"LoRA under autocast: {widest.name}'s forward, peft's fp32 cast of its input, the 16-bit "
              "input its frozen base does not save, the base's and lora_B's outputs and its scaled copy, the part's norm "
              "output (freed when it returns)" + (", beyond the attention's transients before it" if before else ""),
              held(widest) - before, f"s·b·(cast·d_in + 6·d_out + {res}·h) = {tokens:,} × "
              f"(cast × {widest.d_in} + 6 × {widest.d_out} + {res} × {m.hidden})"
              + (" (local TP widths)" if t > 1 else "") + (f" − {before:,} B" if before else ""),
              kind="lora_forward_casts")
    if recomputed:
        # a block recomputed whole in its backward runs its forward again, peft's casts and all, beside the recomputed
        # block's tensors (``backward_input``; measure --fake of Llama 2 7B LoRA bf16 base, full recompute, pp2 v4:
        # 0.35 GiB more at the B than the recomputed block's saved tensors, this term's 0.38)
        T.add("activations", f"LoRA under autocast: {widest.name}'s forward again in a block's recompute (as above)",
              held(widest), "as the forward's", kind="lora_recompute_casts")


def block_backward_terms(cfg: Config, rp, T: Terms, *, act: int, res: int, sbh_rep: int, hs: str,
                         holds_last: bool, plain_grads: bool, fp32_linear_inputs: bool, autocast: bool = False,
                         lora_mods: tuple[str, ...] | None = None, early_stop: bool = False) -> bool:
    """What a full backward B holds inside the first block it runs (the stage's last), over the saved
    tensors: the gradients its MLP's backward makes, the tensor it frees, the gradient coming in; and
    the input gradient a later stage keeps for its send (measured op by op with MemTracker on the
    tiny model, the pipeline's receive buffers and DDP's buckets left out:
    ``backend.measure._without_pre_existing``).

    The MLP's backward starts with w2's (the down projection): it makes the down input's gradient
    (s·b·f) and w2's weight gradient, then autograd frees the down input w2 saved. Where the weight
    already has a gradient (a later microbatch of plain, not FSDP2, gradients) the fresh one is a
    temporary until ``AccumulateGrad`` adds it. Under SwiGLU the product's backward then makes the
    gate activation's and the up projection's gradients (2·s·b·f) while the down input's is alive:
    3·s·b·f of gradients with the down input freed, against s·b·f plus the weight gradient before.
    The larger is the moment (the earlier one where they tie, as MemTracker keeps its first peak);
    later ops of the block free more than they make. On the last stage the blocks' output gradient
    (the final norm's input gradient) is alive too; on the others it is the receive buffer
    (comm_buffers). A stage after the first keeps the input gradient its backward sent until the next
    backward makes the next one. Only where the stage's last block is dense (a MoE block's backward
    is ``moe_backward_terms``'). ``fp32_linear_inputs``: torchao's float8 Linears receive fp32 inputs
    (CPU autocast: torchao casts to the autocast dtype under CUDA's only), so the down input is fp32.

    ``lora_mods``: the adapted Linears where LoRA freezes the base: w2 makes no weight gradient (its adapter's
    r-wide one is left out), and its input is saved, to be freed by its backward, only where w2 is adapted (its
    lora_A keeps it; the frozen matmul saves none). measure --fake of Llama 3 8B s128K cp4 LoRA on every Linear,
    full recompute (pool of seeds 20261200–43, #38): the peak in the first block's MLP backward, three s·b·f
    gradients beside the recomputed block.

    Returns whether the moment laid is one before any weight gradient of the block exists: float8's casts of the
    tokens for w2's weight gradient (``engine.memory.buffers._made_by_the_b_moment``)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    t = par.tp
    s, b = cfg.local_seq_len, tr.micro_batch_size
    before_weight_gradients = False
    # MoE blocks follow the dense ones: a stage's last block is dense where it holds no MoE block
    if any(st.layers and not st.moe_layers for st in rp.stages):
        f_loc = m.ffn_hidden // t
        sbf_e = s * b * f_loc
        x_b = 4 if fp32_linear_inputs else act  # the down input's (and its gradient's) element bytes
        sbf = x_b * sbf_e
        # the weight gradient's dtype is the parameter's: fp32 where the residual stream is (fp32, or
        # autocast, whose bf16 gradient is cast back to the fp32 weight), 16-bit under FSDP2's bf16
        wb = res
        w_extra, w16 = _w2_fresh_gradient(cfg, f_loc, act=act, wb=wb, plain_grads=plain_grads, autocast=autocast) \
            if lora_mods is None else (0, 0)
        down_saved = lora_mods is None or "w2" in lora_mods
        swiglu = m.mlp == "swiglu"
        dims = f"s={s}, b={b}, f={m.ffn_hidden}, t={t}"
        # under sequence parallelism w2's output gradient comes in sequence-sharded and is all-gathered
        # (RowwiseParallel's Shard(1) output: the backward of its reduce-scatter) into a whole s·b·h tensor in
        # the compute dtype, alive through w2's backward (measure --fake, Llama 3 70B TP8 SP: 0.5 GiB at
        # 32,768 tokens a rank); without it that gradient is the residual stream's, counted where it arrives
        gathered = act * s * b * m.hidden if t > 1 and par.sequence_parallel else 0
        cast, token_casts = _float8_w2_casts(cfg, sbf_e=sbf_e, sbf=sbf, x_b=x_b, f_loc=f_loc, gathered=gathered)
        x8 = float8_cast_element_bytes(x_b == 4) * sbf_e if cast else 0  # w2's input cast in the replay
        replay_parts = _replay_end_parts(cfg, act=act, res=res, sbh_rep=sbh_rep, gathered=gathered,
                                         unsaved_input=early_stop and autocast and lora_mods is None and not cast,
                                         x8=x8)
        replay = sum(x for _, x, _, _ in replay_parts)
        # the activation's backward: SwiGLU's makes the gate activation's and the up projection's gradients, GeLU's its
        # input's, beside the down input's gradient, the down input freed by then where w2 saved it. With it saved a
        # GeLU's phase is never the larger; without (LoRA leaves w2 frozen) it is the down input's gradient and the
        # GeLU input's (measure --fake of GPT-2 s32K pp2 LoRA on attention: two s·b·f Temps at gelu_backward)
        act_grads = 2 if swiglu else 1
        act_phase = (1 + act_grads) * sbf - (sbf if down_saved else 0)
        chosen = sbf + cast if cast and cast > w_extra and (not swiglu or sbf + cast >= 2 * sbf) else (
            act_phase if act_phase > sbf + w_extra + gathered else sbf + w_extra + gathered)
        if replay > chosen:  # each tensor its own term: the allocation events lay them apart
            if tr.recompute == "selective-op":
                _add_replay_parts(T, replay_parts, dims)
            else:
                _add_replay_parts(T, replay_parts, dims, f"{tr.recompute} recompute", "as w2 saves its input")
        elif cast and cast > w_extra and (not swiglu or sbf + cast >= 2 * sbf):
            # the tokens' casts for w2's weight gradient come before it: no weight gradient of the block is made by then
            before_weight_gradients = cast == token_casts
            T.add("temporaries", "the first block's MLP backward under float8: the down input's gradient, and "
                  "the down input cast to float8 for w2's weight gradient (fp32 upcast, scaled copy, float8) "
                  "with the output gradient's two float8 casts"
                  + (" and the output gradient all-gathered (SP)" if gathered else ""), sbf + cast,
                  f"{sbf:,} B + {cast:,} B ({dims}; torchao's eager casts"
                  + (f"; the gathered output gradient {gathered:,} B" if gathered else "") + ")", kind="mlp_backward")
            # its largest tensor: a cast's fp32 copy, of the tokens along either width or of w2's weight
            T.float8_piece = max(T.float8_piece, 4 * max(sbf_e, s * b * m.hidden, f_loc * m.hidden))
        elif act_phase > sbf + w_extra + gathered:
            T.add("temporaries", "the first block's MLP backward: the down input's" + (
                ", the gate activation's and the up projection's gradients" if swiglu else " and the GeLU input's gradients"),
                (1 + act_grads) * sbf, f"{1 + act_grads} × {x_b}·s·b·f/t = {1 + act_grads} × {sbf:,} B ({dims})",
                kind="mlp_backward")
            if down_saved:
                T.add("activations", "the first block's MLP backward: its down input, freed by w2's backward", -sbf,
                      f"−{x_b}·s·b·f/t = −{sbf:,} B ({dims})", kind="mlp_backward_freed")
        else:
            # FSDP2's fresh gradient its own term (the allocation events lay it apart from the down input's)
            fresh = w_extra if not plain_grads else 0
            w_extra -= fresh
            T.add("temporaries", "the first block's MLP backward: the down input's gradient"
                  + (" and w2's fresh weight gradient (added to the one accumulated)" if w_extra > w16 else "")
                  + (f" and w2's {act * 8}-bit weight gradient beside its fp32 cast (autocast)" if w16 else "")
                  + (" beside the output gradient all-gathered (SP)" if gathered else ""),
                  sbf + w_extra + gathered, f"{x_b}·s·b·f/t" + (f" + f/t·h·{wb}" if w_extra > w16 else "")
                  + (f" + f/t·h·{act}" if w16 else "")
                  + (f" + {act}·s·b·h" if gathered else "") + f" = {sbf + w_extra + gathered:,} B ({dims})",
                  kind="mlp_backward")
            if fresh:
                T.add("temporaries", "the first block's MLP backward: w2's fresh weight gradient, added in place to the "
                      "one FSDP2 accumulates on the unsharded parameter", fresh, f"f/t·h·{wb} = {fresh:,} B ({dims})",
                      kind="mlp_backward")
    if holds_last:
        T.add("temporaries", "the blocks' output gradient (the final norm's input gradient)", res * sbh_rep,
              f"{res}·s·b·{hs} = {res * sbh_rep:,} B", kind="blocks_output_gradient")
    if par.pp > 1 and sends_held(par.schedule) == "last_backward" and any(st.stage > 0 for st in rp.stages):
        # 1F1B: its ``bwd_sends`` list (then ``send_work``) holds the last backward's until the next one's send
        T.add("temporaries", "the input gradient of the last backward, kept for its send to the previous stage",
              res * sbh_rep, f"{res}·s·b·{hs} = {res * sbh_rep:,} B", kind="held_input_gradient")
    return before_weight_gradients


def _float8_w2_casts(cfg: Config, *, sbf_e: int, sbf: int, x_b: int, f_loc: int, gathered: int) -> tuple[int, int]:
    """(the float8 casts beside w2's backward, those of the tokens): ``block_backward_terms``' float8 moment (0, 0
    compiled or without float8)."""
    m, tr = cfg.model, cfg.training
    s, b = cfg.local_seq_len, tr.micro_batch_size
    cast = token_casts = 0
    if tr.float8 != "none" and not tr.compile:
        # torchao's eager cast of w2's saved input for its weight gradient
        # (hp_tensor_and_scale_to_float8: ``tensor.to(torch.float32) * scale``, then to float8):
        # the fp32 upcast (none where the input is fp32 already: CPU autocast), the scaled fp32
        # copy and the float8 bytes, beside the down input's gradient and the output gradient's
        # two float8 casts (one per gradient matmul); compiled, inductor fuses them
        cast = ((4 if x_b != 4 else 0) + 4 + 1) * sbf_e + 2 * s * b * m.hidden
        # or, where larger, the output gradient's second cast (for w2's weight gradient, along the other
        # axis): its scaled fp32 copy and its saturated fp32 copy (float8_utils.to_fp8_saturated) beside the
        # first cast's float8 bytes (a local of Float8Linear's backward until it returns), measured on a fake
        # Llama 3 70B TP8 step (two fp32 tokens × h tensors at its peak): under TP the output gradient is the
        # whole h wide, the down input f/t
        # (to_fp8_saturated: the clamp's fp32 output and its float8 result, with the scaled fp32 input
        # still held: 4 + 4 + 1 bytes an element, and the first cast's float8 byte)
        cast = max(cast, (4 + 4 + 1 + 1) * s * b * m.hidden) + gathered
        token_casts = cast
        if not wrapping_plan(cfg).float8_all_gather:
            # or, before the down input's gradient exists, w2's weight cast along its other axis for that
            # gradient (the backward's ``hp_tensor_to_float8_dynamic(weight_hp_t, ...)``, torchao 0.18
            # float8_linear.py): the same scaled and saturated fp32 copies and float8 bytes, over f/t·h
            # elements, beside the output gradient's float8 cast; it outweighs the tokens' casts where a
            # rank's tokens are few against the widths (a fake Llama 3 405B step at 2,048 tokens a rank:
            # 9.25 GB of temporaries at its peak, one 16,384 × 53,248 weight's). Float8 all-gather
            # brings the weight in float8 already
            # (the weight casts peak in the backward of w1 or w3, the same size, by when w2's gathered
            # output gradient is freed: measure --fake of Llama 3 405B TP2 SP tensorwise, line 131 of
            # float8_linear.py beside an f/t-wide output gradient's float8 cast)
            cast = max(cast, (4 + 4 + 1) * f_loc * m.hidden + s * b * m.hidden - sbf)
    return cast, token_casts


def _w2_fresh_gradient(cfg: Config, f_loc: int, *, act: int, wb: int, plain_grads: bool, autocast: bool) -> tuple[int, int]:
    """(bytes beside the down input's gradient in w2's backward, of them the 16-bit cast under autocast): w2's fresh
    weight gradient where autograd adds it to one accumulated over earlier microbatches. FSDP2 accumulating in the
    parameters' dtype keeps the sum on the unsharded parameter's .grad (FSDPParam.to_accumulated_grad_if_needed
    moves it only to convert it), so AccumulateGrad adds the fresh one in place as for a plain gradient (measure
    --fake, Llama 3 405B pp8 cp4 HSDP ZeRO-2, bf16 gradients, a later microbatch's B: w2's fresh 1.625 GiB gradient
    beside the down input's, −8.0 → 0.0 %). Under autocast w2's weight gradient comes out of its matmul in the
    compute dtype and the weight cast's backward (ToCopyBackward0) makes the fp32 one from it: both alive at the
    cast, the 16-bit one freed after (measure --fake, Llama 3 70B pp4 ZeRO-1 full recompute, stage 1: a 0.44 GiB
    bf16 w2 gradient alive as its 0.88 GiB fp32 cast is made)."""
    par, h = cfg.parallel, cfg.model.hidden
    plan = wrapping_plan(cfg)
    added = plain_grads or (plan.fsdp2 and not plan.converts_gradients)
    w_extra = f_loc * h * wb if added and par.microbatches > 1 else 0
    w16 = f_loc * h * act if autocast and plain_grads and cfg.training.float8 == "none" else 0
    return w_extra + w16, w16


def _add_replay_parts(T: Terms, parts: list[tuple[str, int, str, bool]], dims: str,
                      policy: str = "per-op selective recompute", where: str = "at its last op") -> None:
    """The replay's tensors at its last op (``_replay_end_parts``), each its own term: what the forward's replay makes
    are activations (MemTracker: "ACT: tensors produced during the forward pass and recomputation in activation
    checkpointing"), the output gradient the backward's (a temporary)."""
    for what, nbytes, formula, made_by_forward in parts:
        T.add("activations" if made_by_forward else "temporaries", "the first block's replay of its forward "
              f"({policy}) {where}: {what}", nbytes, f"{formula} = {nbytes:,} B ({dims})",
              kind="mlp_backward")


def _replay_end_parts(cfg: Config, *, act: int, res: int, sbh_rep: int, gathered: int,
                      unsaved_input: bool = False, x8: int = 0) -> list[tuple[str, int, str, bool]]:
    """Where a B's first block replays with early stop (``_early_stop_replay_parts``, where ``unsaved_input``) and
    under per-op selective recompute (``early_stop=False``, backend.parallel.recompute): what the first block's
    backward holds beyond the tensors recompute = "none" keeps when the replay of its forward reaches its last op,
    as (what, bytes, formula, made by the forward's replay) per tensor; none under the other policies. The whole
    forward runs again (torch.utils.checkpoint without early stop), and
    the down projection's output, handed back from the stash or made anew, is alive beside what is made of it:
    under SP DTensor's Partial → Shard(1) reduce-scatter (``funcol.reduce_scatter_single`` with a scatter dim
    ≠ 0) cats the chunks into a contiguous s·b·h copy, with the reduce-scatter's stashed s·b·h/t output and the
    MLP's sequence-sharded input (the caller's argument through the call) beside them; under TP without SP
    the all-reduce's output; without TP the residual add's. The output gradient SP all-gathered before the
    down projection's backward asked for the replay is alive through it. Measured with ``measure --fake`` of
    Llama 3 8B s16K b16 tp8 SP pp4 1F1B (stage 2): 2 + 2 GiB at w2 and its copy, 0.25 + 0.25 GiB, beside the
    2 GiB gathered gradient, at the step's allocated peak. Under autocast the MLP's input in the residual stream's
    dtype (under SP all-gathered) is alive too (its forward's argument; autocast's Linears save their 16-bit casts). Under
    float8 (``x8``: w2's input cast, 9 B × s·b·f/t) the replay peaks instead at w2 casting its input, where that is
    larger: measure --fake of Llama 3 70B tp4 SP pp4 1F1B selective-op float8 tensorwise under DDP's autocast (fake
    seed 20261270 #17, rank 8): each B peaks there, the fp32 scaled copy and its clamp (0.875 GiB each) and the
    float8 result beside the 1 GiB fp32 gathered input, 0.9 GiB beyond the engine's B."""
    par, tr = cfg.parallel, cfg.training
    if unsaved_input and tr.recompute != "selective-op":
        return _early_stop_replay_parts(cfg, res=res, act=act, gathered=gathered)
    if tr.recompute != "selective-op":
        return []
    sbh = cfg.local_seq_len * tr.micro_batch_size * cfg.model.hidden
    sp = par.tp > 1 and par.sequence_parallel
    copy = ("the contiguous copy its reduce-scatter makes (scatter dim 1)" if sp else
            "the all-reduce's output" if par.tp > 1 else "the residual add's output")
    parts = [("w2's output (handed back from the stash or made anew)", act * sbh, f"{act}·s·b·h", True),
             (copy, act * sbh, f"{act}·s·b·h", True)]
    if sp:
        parts += [("the reduce-scatter's stashed output", act * sbh_rep, f"{act}·s·b·h/t", True)]
    common = []
    if sp:
        common.append(("the MLP's sequence-sharded input (the caller's argument)", res * sbh_rep, f"{res}·s·b·h/t",
                       True))
    if res > act:
        # autocast: the MLP's input in the residual stream's dtype (under SP its all-gathered copy), which the
        # Linears cast and do not save, alive in the MLP's forward frame until it returns (``_early_stop_replay_parts``;
        # backend/model.py FeedForward.forward reads x in w1 and w3 and returns w2's output)
        common.append(("the MLP's input in the residual stream's dtype" + (", all-gathered (SP)" if sp else "")
                       + ", which autocast's Linears cast and do not save, alive in its forward's frame", res * sbh,
                       f"{res}·s·b·h", True))
    if gathered:
        common.append(("the output gradient all-gathered (SP) before w2's backward asked for the replay", gathered,
                       f"{act}·s·b·h", False))
    if x8 > act * 2 * sbh + (act * sbh_rep if sp else 0):
        # float8: the replay peaks earlier, at w2 casting its input (torchao's hp_tensor_to_float8_dynamic: the
        # scaled fp32 copy, its clamp and the float8 result), before w2's output exists
        # the stash's outputs after it, not handed back yet: w2's (where the policy saves it) and the reduce-scatter's
        m = cfg.model
        stashed = act * sbh if "w2" in sac_saved_matmuls(m.mlp == "swiglu", block_linears_addmm(m, tr)) else 0
        stashed += act * sbh_rep if sp else 0
        return [("w2's input cast to float8 (fp32 scaled copy, its clamp, the float8 result)", x8, "9·s·b·f/t", True),
                ("the stash's w2 output and reduce-scatter output, not handed back yet", stashed,
                 f"{stashed:,} B", True)][:2 if stashed else 1] + common
    return parts + common


def _embedding_backward_terms(T: Terms, *, res: int, sbh: int, sbh_rep: int, hs: str, sent: bool = False) -> None:
    """The first pipeline stage's B ends with the token embeddings' backward (embedding_dense_backward reads the
    gradient of their output), which makes their weight's fresh gradient: the output's gradient is alive there,
    whole (under SP the embeddings' Shard(1) output gradient all-gathered; without SP replicated), in the residual
    stream's dtype, and so, measured, is one residual-stream tensor of the microbatch the B has otherwise freed, at
    its own layout (sequence-sharded under SP). measure --fake, the end of stage 0's B at its peak: Llama 3 8B pp4
    GPipe DDP-less autocast (seed 20261244 #15) one 64 MiB fp32 s·b·h Temp and one Activation beyond the engine's;
    Llama 3 405B tp8 SP pp8 ZeRO-2 (seed 20261248 #35) a 512 MiB s·b·h Temp and a 64 MiB s·b·h/t Activation; Llama 3
    405B tp8 pp2 cp2 ZeRO-3 (#16) 256 MiB each; on 25 such ranks of ten seeds the engine was under by about these.
    Not under a split backward, whose first stage's W runs that backward: the fakes' and a CPU run's (seed 20261226 #00,
    IZB pp2 ZeRO-1: activations +2.9 → +16.6 % with them) ends hold no such pair. The residual-stream tensor is the
    stage's output, which ``backward_one_chunk`` holds to its end (its ``stage_output``, popped from ``fwd_cache``):
    where the schedule keeps its sends (``sent``) the send's Work holds it past the B anyway, and the sent outputs
    count it there (``kept_send_terms``; seed 20261260 #09, Llama 2 7B GPipe pp2: +1.8 % with both)."""
    T.add("temporaries", "the first stage's B at its end: the token embeddings' output gradient, whole, which their "
          "backward reads", res * sbh, f"{res}·s·b·h = {res * sbh:,} B", kind="embedding_output_gradient", stage=0)
    if sent:
        return
    T.add("activations", "the first stage's B at its end: one residual-stream tensor of the microbatch still alive "
          "(measured)", res * sbh_rep, f"{res}·s·b·{hs} = {res * sbh_rep:,} B", kind="embedding_output_kept", stage=0)


def _early_stop_replay_parts(cfg: Config, *, res: int, act: int, gathered: int) -> list[tuple[str, int, str, bool]]:
    """Under full recompute (or selective-layer, its stages' last blocks checkpointed) with autocast: the first
    block's replay of its forward (torch.utils.checkpoint with
    early stop, backend.parallel.recompute) ends as w2 saves its input — the pack hook raises before the matmul
    makes its output (VariableType records an input's SavedVariable before the redispatch) — so the whole block's
    recomputed tensors are alive beside the MLP's input: the norm's output in the residual stream's dtype, under SP
    the all-gathered s·b·h copy (torchtitan's PrepareModuleInput), an argument of the MLP's forward alive in its frame
    until the early stop unwinds it. Autocast's Linears save their 16-bit casts of it, not it (counted in the block),
    so it is beyond the block's saved tensors; without autocast it is what w1 and w3 save. The output gradient SP
    all-gathered before w2's backward asked for the replay is alive through it. ``measure --fake`` of Llama 3 70B
    s8K b4 tp8 SP pp4 1F1B full recompute, bf16-mixed under torch.autocast (seed 20261251 #27, stage 1): the peak
    at the replay's SwiGLU product, a 1 GiB fp32 s·b·h activation and the 0.5 GiB gathered gradient beside the
    recomputed block."""
    sbh = cfg.local_seq_len * cfg.training.micro_batch_size * cfg.model.hidden
    parts = [("the MLP's input in the residual stream's dtype" + (", all-gathered (SP)" if gathered else "")
              + ", which autocast's Linears cast and do not save, alive in its forward's frame until the early stop",
              res * sbh, f"{res}·s·b·h", True)]
    if gathered:
        parts.append(("the output gradient all-gathered (SP) before w2's backward asked for the replay", gathered,
                      f"{act}·s·b·h", False))
    return parts


def moe_backward_terms(cfg: Config, rp, T: Terms, ep_rank: int | None, autocast: bool, per_layer: int,
                       microbatches: dict[int, tuple[int, ...]] | None = None, fresh_buffers: bool = False,
                       unit_grads: bool = False) -> bool:
    """The moment inside a backward where a stage with experts peaks, the larger of two in its last MoE block:
    the combine's backward, or the routed experts' backward (measured with MemTracker on
    CPU: ``benchmarks/accuracy.md``'s MoE note).

    The combine (backend/model.py ``scatter_combine``: ``(out.float() * scores).to(dtype)`` then
    ``index_add_``) runs first in the block's backward: ``index_add_``'s backward gathers the output
    gradient per routed copy (n·k·h in the activation dtype), the cast's backward makes it fp32, and the
    multiply's backward makes the fp32 gradient of the expert outputs and, for the scores' gradient, the fp32
    product with the saved outputs before its row sum: three fp32 n·k·h tensors beside the fp32 outputs saved
    (measured in ``measure --fake`` of Qwen3 30B-A3B, pp8 ZeRO-3 full recompute: four 1 GiB fp32 n·k·h tensors
    at a middle stage's peak: the saved fp32 outputs and the three); of the block only the weighted outputs are
    freed by then (``index_add_``'s node, the first to run, releases the source it saved; the fake's peak holds
    the fp32 outputs and not them), and the later blocks. The gathered 16-bit
    gradient is gone by then: the cast's backward node was its only holder (two more fakes of Qwen3 30B-A3B,
    pp8 ZeRO-2 full recompute b8 and pp8 ZeRO-3 b2 at 16K: three 2 GiB fp32 Temps at the peak and no 1 GiB
    16-bit one; in fp32 training the casts are no-ops and the gathered gradient is the first fp32 one).

    Each expert's weights are a slice ``w[i]`` of a 3-D parameter, so autograd's select_backward
    gives every expert a full-size (E_loc, f, h) gradient, summed in the parameter's input buffer:
    at the peak the n_w buffers (w1, w3, w2; with one microbatch they become the ``.grad`` themselves,
    AccumulateGrad stealing them, and count as gradients) and two fresh full-size gradients are alive, with the
    block's output and input gradients (2·s·b·h) and, without ep, the routed outputs' gradient
    (n_r·h; under ep it is the all-to-all receive buffer, in comm_buffers). By then the backward
    has freed the last stage's final-norm, head-input and log-probability tensors (before any
    block's backward: ``engine.memory.lifetimes.HEAD_KINDS``, not this term's), the blocks after the
    stage's last MoE block, and of that block the shared experts' tensors and the combine's (fp32 and weighted outputs, gathered weights, sort order, the
    un-permute's index_copy source). Where the gradients outweigh what is freed, this moment is the
    backward's peak — measured so on every MoE row of the accuracy matrix, the last stage's included
    (the tiny preset's ep4 rows, where the freed tensors outweigh the gradients, peak elsewhere): the
    terms are laid as transients of every backward (B, I) of the rank. The loss's logits and gradient
    are not among them: the loss moment that opens a B holds those (``engine.memory.lifetimes``). Under a measured load given per block or
    microbatch, the block's routed copies are its own, averaged over ``microbatches[stage]`` (those in
    flight at the peak; every microbatch when not given).

    Returns whether the moment laid (of a full backward) is the combine's, before any weight gradient of the block
    exists (``engine.memory.buffers._made_by_the_b_moment``)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    act, wb, h, k, e_loc, f_loc, n_w = _moe_backward_dims(cfg, autocast)
    n, n_r = moe_tokens(cfg, ep_rank)
    n_s = m.seq_len * tr.micro_batch_size
    inner = 4 if m.mlp == "swiglu" else 2
    casts = autocast or _replicate_leaves_experts_fp32(cfg)  # each expert's weight slices cast anew, saved
    split = split_layers(m.layers, par.num_stages, par.pipeline_split)
    best = best_c = None  # the larger moment of either kind; the combine's alone
    for st in rp.stages:
        layers = split[st.stage]
        moe_idx = [i for i in layers if m.is_moe_layer(i)]
        if not moe_idx:
            continue
        if ep_rank is not None and par.ep > 1 and varying_expert_load(cfg):
            mbs = (microbatches or {}).get(st.stage) or tuple(range(par.microbatches))
            phi = sum(routed_factor_of(cfg, ep_rank, mb, moe_idx[-1] - m.dense_layers) for mb in mbs) / len(mbs)
            n_r = moe_tokens(cfg, ep_rank, phi)[1]
        # the n_w buffers are separate tensors only beside an existing .grad (a later microbatch): in a step's
        # only backward AccumulateGrad takes each buffer as the .grad itself (no copy), counted in grads; and
        # where FSDP2 accumulates in another dtype (``fresh_buffers``) its post-backward has moved the sum off .grad
        # (FSDPParam.to_accumulated_grad_if_needed), so every microbatch's buffers become the unit's fresh .grad,
        # the engine's fresh-gradient term (``engine.memory.buffers``)
        # (one local expert: its weights' input buffers take a single gradient each, nothing to sum, and AccumulateGrad
        # takes or adds each before the next weight's: the select_backward output beside its source, one weight's at
        # a time — measure --fake Mixtral ep8, 224 MiB fp32 tensors two at a time)
        # (``unit_grads``: FSDP2's units walked once, one microbatch: the buffers become the unsharded parameters' .grad,
        # counted by no term of the gradients, so they count here as with a later microbatch)
        w_grads = ((n_w if (par.microbatches > 1 or unit_grads) and not fresh_buffers and e_loc > 1 else 0) + 2
                   ) * e_loc * f_loc * h * wb
        after = sum(1 for i in layers if i > moe_idx[-1]) * per_layer
        received = _output_gradient_received(cfg, st, after) and len(moe_idx) == 1
        one_grad = n_s * h * act // (par.tp if par.sequence_parallel and par.ep == 1 else 1)
        grads = (1 if received else 2) * one_grad
        routed_grad = act * n_r * h if par.ep == 1 else 0
        temp = w_grads + grads + routed_grad
        shared = 0
        if m.shared_experts:
            f_s = m.shared_experts * m.expert_hidden // par.tp
            shared = (4 if m.mlp == "swiglu" else 2) * act * n_s * f_s
            if par.ep > 1 and par.tp > 1:
                shared += act * (n_s - n) * h
        combine = (4 * n * k * h + 12 * n * k + (4 if autocast else act) * n * k * h
                   + (act * n_r * h if par.ep > 1 else 0))
        # the experts run one after another, the last one first in the backward: by the time the buffers and two fresh
        # gradients are alive at once (the second expert's w1 or w3), the first's chain has run and freed its own saved
        # tensors (its gate, SiLU, up outputs; each of its weight slices' casts, one expert's n_w matrices) and the
        # second's down projection has run and freed what it saved (its input; its w2 slice's cast) — measure --fake
        # Mixtral ep4, 2 local experts: half of the block's expert rows gone at that moment; Mixtral tp8 ep2 pp8 under
        # autocast, 4 local experts: the first's three 112 MiB casts and the second's w2 cast gone
        first = (inner * act * n_r * f_loc // e_loc + act * (n_r // e_loc) * f_loc
                 + (act * (n_w + 1) * f_loc * h if casts else 0)) if e_loc > 1 else 0
        freed = after + shared + combine + first
        # against the combine's moment the experts' holds the unit's fresh .grad too where the buffers become it
        # (``fresh_buffers``: the fresh-gradient term's bytes, laid at this moment and not at the combine's, before any
        # weight gradient — measure --fake of Qwen3 235B pp4 ep8 ZeRO-2 full, stage 1: five 192 MiB bf16 expert
        # gradients at its peak, the two summed and w1, w2, w3's)
        gain = temp - freed + (n_w * e_loc * f_loc * h * wb if fresh_buffers else 0)
        if gain > 0 and (best is None or gain > best[0]):
            best = (gain, st.stage, temp, w_grads, grads, routed_grad, freed, after, shared, combine, first)
        c_temp = 3 * 4 * n * k * h + (0 if received else one_grad)
        # index_add_'s node runs first and frees the weighted outputs it saved; under per-op recompute they are the
        # replay's (``recomputed_block`` counts them): checkpoint's unpack hook drops its handle to a recomputed tensor
        # once its node has it (torch/utils/checkpoint.py: ``holder.handles[gid] = None``), so it goes the same way.
        # measure --fake of seed 20261276 #14, Qwen3 30B-A3B Interleaved1F1B tp2 ep32 selective-op: every B peaks
        # at the combine's backward with the replayed block (less its weighted outputs) and the three fp32 n·k·h
        # temporaries; three ranks −3.4 … −4.9 → −0.1 % (laid without the weighted outputs freed: +1.1 … +1.6 %)
        weighted = (4 if autocast else act) * n * k * h
        c = (c_temp - after - weighted, st.stage, c_temp, None, 0 if received else one_grad, 0, after + weighted, after, 0, 0, 0)
        if c[0] > 0 and (best is None or c[0] > best[0]):
            best = c
        # an I frees nothing it runs through: stage_backward_input calls autograd with retain_graph=True (the W runs the
        # rest of the graph), so the weighted outputs index_add_ saved and the later blocks' tensors stay (measure
        # --fake of seed 20261256 #00, Qwen3 30B-A3B InterleavedZeroBubble ep2: 512 MiB more at three I's, −3.2 … −3.5 %)
        c_i = (c_temp, st.stage, c_temp, None, 0 if received else one_grad, 0, 0, 0, 0, 0, 0)
        if best_c is None or c_i[0] > best_c[0]:
            best_c = c_i
    return _lay_moe_moments(cfg, T, best, best_c, autocast, n, n_r)


def _lay_moe_moments(cfg: Config, T: Terms, best: tuple | None, best_c: tuple | None, autocast: bool, n: int,
                     n_r: int) -> bool:
    """``moe_backward_terms``' moments laid: under a split backward the I's (``best_c``, the combine's) and the full
    B's (``best``), else one for every backward; returns whether the full backward's is the combine's."""
    par = cfg.parallel
    if par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES:  # as split_backward_terms' condition
        # an I computes input gradients only (stage_backward_input): its moment is the combine's backward; the
        # experts' weight gradients come in the W, and where they outweigh it, at a full B (ZBV's and DualPipeV's
        # first stage, DualPipeV's overlapped B) (measure --fake: Mixtral ZBV tp4 ep2, Qwen3 30B-A3B ZBV ep2)
        if best_c is not None:
            _lay_moe_backward(cfg, T, best_c, "moe_input_backward", autocast, n, n_r)
        if best is not None:
            _lay_moe_backward(cfg, T, best, "moe_full_backward", autocast, n, n_r)
        return False
    if best is not None:
        _lay_moe_backward(cfg, T, best, "moe_backward", autocast, n, n_r)
    return best is not None and best[3] is None


def _output_gradient_received(cfg: Config, st, after: int) -> bool:
    """Whether a stage's last MoE block's output gradient is the gradient the stage received, the receive buffer
    itself (comm_buffers), no tensor of its own: the block is the stage's last (nothing ``after`` it) and its output
    the stage's (an earlier stage; sequence parallel redistributes it). measure --fake of Mixtral 8x7B s64K 1F1B pp8 tp2
    ep8 full recompute, seed 20261247 #10, one block a stage: three 1 GiB fp32 temporaries at the combine's backward,
    no 512 MiB output gradient beside them (allocated +3.7 % on six ranks with one). Only where the block is the stage's
    one MoE block: with more, an earlier one's combine, whose output gradient is a tensor of its own, holds as much less
    what the later block kept (its input under full recompute; seed 20261250 #04, Mixtral pp2 four blocks a stage:
    −5.0 % with the last block's moment alone)."""
    par = cfg.parallel
    return par.pp > 1 and st.stage != par.num_stages - 1 and not par.sequence_parallel and not after


def _moe_backward_dims(cfg: Config, autocast: bool) -> tuple[int, int, int, int, int, int, int]:
    """(activation bytes, the experts' compute-weight bytes — FSDP2: param_dtype —, h, k, local experts, their
    f on this rank, weight matrices per expert) of ``moe_backward_terms``' moments. The weight gradients' buffers are
    in the dtype of the tensor each expert's slice is taken from: the fp32 parameter under autocast, and under FSDP2's
    replicate, which leaves the routed experts out of its mixed-precision policy (backend/model.py's ``sl``: the slice
    first, its cast after; measure --fake Mixtral ep4 tp4 replicate: 448 MiB fp32 buffers, 2 experts × 14336 × 4096)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    left_out = _replicate_leaves_experts_fp32(cfg)
    return (4 if tr.precision == "fp32" else 2, 4 if tr.precision == "fp32" or autocast or left_out else 2, m.hidden,
            m.experts_per_token, m.experts // par.ep if par.ep > 1 else m.experts,
            m.expert_hidden // (par.tp if par.ep == 1 else 1), 3 if m.mlp == "swiglu" else 2)


def _lay_moe_backward(cfg: Config, T: Terms, best: tuple, kind: str, autocast: bool, n: int, n_r: int) -> None:
    """``moe_backward_terms``' chosen moment as terms of ``kind`` (its freed tensors ``kind``_freed)."""
    par = cfg.parallel
    act, wb, h, k, e_loc, f_loc, n_w = _moe_backward_dims(cfg, autocast)
    _, stage, temp, w_grads, grads, routed_grad, freed, after, shared, combine, first = best
    if w_grads is None:
        T.add("temporaries", f"MoE backward of stage {stage}'s last MoE block, its combine: the routed copies' output "
              "gradient cast to fp32, the expert outputs' gradient and the scores' product",
              temp, f"3 × 4·n·k·h + s·b·h·{act} = 3 × 4·{n}·{k}·{h} + {grads:,} B (block output gradient"
              + ("; fp32: no casts)" if act == 4 else ")"), kind=kind)
        if freed:
            T.add("activations", f"MoE backward of stage {stage}'s last MoE block, its combine: freed by then (later "
                  "blocks; the weighted outputs index_add_ saved, its node the first to run)", -freed,
                  f"−({after:,} B later blocks + {freed - after:,} B weighted outputs)", kind=f"{kind}_freed")
        if par.ep > 1:
            # the all-to-all buffers (engine.memory.buffers.moe_dispatch_buffers, counted all step) are one
            # layer's at a time, and the combine's backward runs before its all-to-all's: none is alive then
            a2a = act * n * k * h + act * n_r * h
            T.add("comm_buffers", f"MoE backward of stage {stage}'s last MoE block, its combine: no all-to-all buffer "
                  "alive yet (the combine's all-to-all backward comes after)", -a2a,
                  f"−({act}·n·k·h + {act}·n_r·h) = −{a2a:,} B", kind=f"{kind}_freed")
        return
    bufs = w_grads // (e_loc * f_loc * h * wb) - 2  # the input buffers counted here (none where they are .grad)
    T.add("temporaries", f"MoE backward of stage {stage}'s last MoE block: the experts' full-size weight gradients "
          "(select_backward of each expert's slice, summed in autograd's input buffers"
          + ("" if bufs else ": the .grad itself, counted with the gradients") + ") and the activation gradients",
          temp, f"({bufs} + 2) × E_loc·f·h·{wb} = ({bufs} + 2) × {e_loc}·{f_loc}·{h}·{wb} = {w_grads:,} B + 2·s·b·h·{act} "
          f"= {grads:,} B (block output, input)" + (f" + n_r·h·{act} = {routed_grad:,} B (routed outputs)"
                                                   if routed_grad else ""), kind=kind)
    T.add("activations", f"MoE backward of stage {stage}'s last MoE block: freed by then (later blocks, the "
          "block's shared experts and combine, the first expert's own tensors)", -freed,
          f"−({after:,} B later blocks + {shared:,} B shared experts + {combine:,} B combine: "
          f"(4 + {4 if autocast else act})·n·k·h + 12·n·k" + (f" + {act}·n_r·h" if par.ep > 1 else "")
          + f" + {first:,} B one of {e_loc} experts' rows and weight casts)", kind=f"{kind}_freed")
