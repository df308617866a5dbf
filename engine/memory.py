"""Memory per rank, per pipeline stage, by category — with the terms behind every number.

``memory_per_rank(cfg)`` answers "does it fit, and on which GPU does it not?". Every rank of
the world is listed; ranks that hold the same thing (DP replicas, TP shards with equal vocab
chunks) share one computed body. Each category of each rank expands into named terms
(``RankMemory.explain(category)``), each with its bytes and the formula that produced it.

Conventions (each one is stated in ``MemoryReport.conventions`` too):

Model states (ZeRO paper accounting, Rajbhandari et al. 2020). ``w`` = compute-copy bytes
(2 under bf16/fp16-mixed, 4 under fp32); ``g`` = ``training.grad_dtype`` bytes; optimizer =
fp32 master copy (4, mixed precision only) + 4 per state (adamw 2, sgd-momentum 1, sgd 0).
ZeRO shards over ``parallel.shard_degree`` d (dp, or dp/replicate under HSDP) — never the world:
    ZeRO-0  w·Ψ + g·Ψ + o·Ψ           ZeRO-2  w·Ψ + g·⌈Ψ/d⌉ + o·⌈Ψ/d⌉
    ZeRO-1  w·Ψ + g·Ψ + o·⌈Ψ/d⌉       ZeRO-3  (w + g + o)·Ψ_d, Ψ_d = Σ ⌈dim0/d⌉·rest per tensor
(ZeRO-1/2 shard one flat buffer like DeepSpeed; ZeRO-3 pads every tensor's dim 0 like FSDP2.)
That is ``conventions.state_accounting = "zero-paper"``. The default, "pytorch", reports what
torch keeps, strategy by strategy, exactly as ``backend/`` runs it — the product promises
predicted-vs-measured agreement with PyTorch, so its default split is the one PyTorch has:
    DDP / ZeRO-0    autocast (mixed) or fp32: params 4Ψ (fp32; autocast casts on the fly, caching
                    the 16-bit weights for the step — counted in activations), grads 4Ψ (the
                    parameter dtype), optimizer 4kΨ (no separate master); DDP buckets 4Ψ.
    ZeRO-1          the same, optimizer 4k × this DP rank's share under ZeroRedundancyOptimizer's
                    greedy whole-tensor partition (``engine.params.zero_redundancy_partition``):
                    ranks differ, the sum is exact. (With TP torch has no ZeRO-1: flat split.)
    ZeRO-2 / -3     FSDP2 + MixedPrecisionPolicy: params 4Ψ_d (the fp32 shard is the master),
                    grads 4Ψ_d, optimizer 4kΨ_d; the 16-bit gathered copy is comm_buffers (every
                    unit under ZeRO-2, current + prefetched unit under ZeRO-3), plus one unit's
                    all-gather output and the unsharded gradients (every unit with m > 1, as
                    FSDP2 accumulates unsharded without sync; one unit with m = 1).
    DP × TP         FSDP2's replicate: whole fp32 params / grads, all units gathered (16-bit).
    TP alone        the vocab-parallel token embedding's gradient is full V × h on every rank.
Under "pytorch" the activation terms also follow torch's kernels: the residual stream and the
norms in fp32 under autocast, one 16-bit input cast per Linear, torch's composite RMSNorm on CPU
(x̂ = x·rstd saved too), rstd, rope tables, the causal mask, SP's gathered Linear inputs, a
pipeline stage's kept output, and its input that is the p2p receive buffer (comm_buffers).
Checked against PyTorch's MemTracker on CPU (benchmarks/accuracy.md).

Activations per layer per microbatch (Korthikanti et al. 2022), derived tensor by tensor from
what each op saves for backward (``_layer_activation_terms``): with f = 4h, eager attention,
dropout on and 16-bit activations the sum is exactly Table 2 in all five cases.

Pipeline: microbatches whose activations a stage holds at its peak follow torch's own order
(``_in_flight``): GPipe m; 1F1B min(m, p − r); LoopedBFS m per local stage; Interleaved1F1B and
InterleavedZeroBubble by replaying torch's per-rank op order (the ZB variant keeps a microbatch
alive until its W, because torch's ``stage_backward_input`` retains the whole autograd graph);
ZBVZeroBubble and DualPipeV by replaying torch's orders too (about 2p and 2p + 1
stage-microbatches per rank: the ZB-V paper's "1F1B peak on every rank", and DualPipe's
PP + 1). Each replay was checked against torch 2.13's ``pipeline_order``. DualPipe's doubled
parameters belong to the bidirectional DualPipe with two model copies; torch ships only
DualPipeV, whose 2p stages are distinct, so no parameter is doubled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from engine import lora
from engine.config import Config
from engine.names import MEMORY_CATEGORIES, OPTIMIZER_STATES
from engine.params import (
    RankParams,
    params_per_rank,
    rank_tensor_numels,
    sharded_numel,
    zero_redundancy_partition,
)

GIB = 2**30
MB = 10**6
MIB = 2**20


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Term:
    """One named contribution to a category: its bytes and the formula that gives them."""

    label: str
    bytes: int
    formula: str


class _Body:
    """The categories of one distinct rank (shared by identical ranks)."""

    __slots__ = ("terms", "values", "total", "stages", "pp_rank")

    def __init__(self, terms: dict[str, list[Term]], stages: tuple[int, ...], pp_rank: int):
        self.terms = terms
        self.values = {c: sum(t.bytes for t in terms[c]) for c in MEMORY_CATEGORIES}
        self.total = sum(self.values.values())
        self.stages = stages
        self.pp_rank = pp_rank


class RankMemory:
    """Memory of one rank: one attribute per category (bytes), ``total``, ``fits``, ``explain``."""

    __slots__ = ("rank", "tp_rank", "dp_rank", "_body", "_capacity")

    def __init__(self, rank: int, tp_rank: int, dp_rank: int, body: _Body, capacity: int):
        self.rank = rank
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self._body = body
        self._capacity = capacity

    # categories (params, grads, ...) are added as properties below the class
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    temporaries: int
    overhead: int

    @property
    def pp_rank(self) -> int:
        return self._body.pp_rank

    @property
    def stages(self) -> tuple[int, ...]:
        return self._body.stages

    @property
    def total(self) -> int:
        return self._body.total

    @property
    def fits(self) -> bool:
        return self._body.total <= self._capacity

    @property
    def model_states(self) -> int:
        """params + grads + optimizer."""
        v = self._body.values
        return v["params"] + v["grads"] + v["optimizer"]

    def explain(self, category: str) -> list[Term]:
        """The terms that make up ``category`` (their bytes sum to it)."""
        if category not in self._body.terms:
            raise KeyError(f"unknown memory category {category!r}; allowed: {', '.join(MEMORY_CATEGORIES)}")
        return list(self._body.terms[category])

    def to_dict(self) -> dict:
        v = self._body.values
        out = {"rank": self.rank, "stage": self._body.stages[0], "stages": list(self._body.stages)}
        out.update((c, v[c]) for c in MEMORY_CATEGORIES)
        out["total"] = self._body.total
        out["fits"] = self.fits
        return out

    def __repr__(self) -> str:
        return f"RankMemory(rank={self.rank}, stages={self.stages}, total={self.total / GIB:.2f} GiB)"


def _category_property(name: str) -> property:
    return property(lambda self: self._body.values[name], doc=f"bytes of {name!r} on this rank")


for _name in MEMORY_CATEGORIES:
    setattr(RankMemory, _name, _category_property(_name))


@dataclass(frozen=True)
class MemoryReport:
    per_rank: list[RankMemory]
    capacity_bytes: int
    conventions: dict[str, str]

    @property
    def peak(self) -> RankMemory:
        """The rank that needs the most memory (lowest rank on ties)."""
        return max(self.per_rank, key=lambda r: (r.total, -r.rank))

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.per_rank)

    def distinct(self) -> list[list[RankMemory]]:
        """Ranks grouped by identical content, in rank order of each group's first rank."""
        groups: dict[int, list[RankMemory]] = {}
        for r in self.per_rank:
            groups.setdefault(id(r._body), []).append(r)
        return list(groups.values())

    def to_json(self) -> dict:
        return {"per_rank": [r.to_dict() for r in self.per_rank], "capacity_bytes": self.capacity_bytes}


# --------------------------------------------------------------------------- activations


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


@dataclass(frozen=True)
class _Shape:
    """What the per-layer activation formula depends on."""

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
    selective: bool
    # "pytorch" accounting only (all False / equal to ``act`` under "zero-paper"):
    torch_ops: bool = False  # count what torch's kernels save beyond the paper's terms
    resid: int = 0  # bytes of the residual stream (fp32 under autocast, whose norms run in fp32)
    composite_norm: bool = False  # RMSNorm as torch's composite (CPU): also saves x̂ = x·rstd
    rope: bool = False  # rope's cos/sin tables saved by its multiplies
    head_dim: int = 0
    # LoRA (engine.lora): adapter rank (0 = full fine-tuning) and the adapted Linears' names. A frozen
    # Linear saves no input for a weight gradient; each adapter saves A's output for B's gradient.
    lora_r: int = 0
    lora_mods: tuple[str, ...] = ()


@lru_cache(maxsize=256)
def _layer_activation_terms(sh: _Shape) -> tuple[tuple[tuple[str, int], ...], str]:
    """Saved-for-backward bytes of one block for one microbatch: ((label, bytes), ...), formula.

    Derived from what each op keeps for its backward (Korthikanti et al. 2022, §4.1):
      attention  norm1 output (QKV input) 2sbh · Q and K 2sbh each · V 2sbh ·
                 eager: softmax output 2as²b, its dropout mask as²b and dropout output 2as²b ·
                 o-proj input 2sbh · residual dropout mask sbh                  → 11sbh + 5as²b
      MLP        norm2 output 2sbh · GeLU input 2sbf · fc2 input 2sbf · dropout mask sbh → 19sbh (f=4h)
      norms      the two norm inputs 2sbh each                                   → 4sbh
    Variants, from the same rule:
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
      * selective recompute: the attention core (softmax, its dropout; flash's lse) is recomputed.
      * LoRA (frozen base): a frozen Linear keeps no input for its weight gradient, so the QKV, o-proj,
        MLP and down inputs stay only where an adapter's A reads them (flash keeps its output anyway);
        each adapter adds A's output (s·b·r) for B's gradient; a frozen composite RMSNorm keeps no x̂.
    Element bytes: 2 for 16-bit activations (Table 2), 4 under fp32; masks are 1 byte.
    """
    s, b, h, a, t, act = sh.s, sh.b, sh.h, sh.a, sh.t, sh.act
    res = sh.resid or act  # norm inputs (the residual stream)
    rep = t if sh.sp else 1
    # coefficient per basis for the formula; basis symbols
    rep_sym = "h/t" if sh.sp else "h"
    out: list[tuple[str, int]] = []
    coef: dict[str, int] = {}

    def add(label: str, c: int, basis: str, numel: int) -> None:
        out.append((label, c * numel))
        coef[basis] = coef.get(basis, 0) + c

    sbh_rep, sbh_t = s * b * h // rep, s * b * h // t

    def norm(n: int) -> None:
        add(f"norm{n} input", res, rep_sym, sbh_rep)
        if sh.composite_norm and not sh.lora_r:  # x̂ is kept for the weight's gradient: none when frozen
            add(f"norm{n} x̂ = x·rstd (torch's composite RMSNorm)", res, rep_sym, sbh_rep)
        if sh.torch_ops:
            add(f"norm{n} rstd (fp32)", 4, "1/t" if sh.sp else "1", s * b // rep)

    # torch's SequenceParallel + PrepareModuleInput all-gather the norm output into a replicated
    # DTensor, and the column-parallel Linears save that full s·b·h input (Megatron re-gathers it)
    lin_in, lin_sym = (s * b * h, "h") if sh.torch_ops else (sbh_rep, rep_sym)
    lora_on = sh.lora_r > 0

    def keeps(*mods: str) -> bool:
        """A Linear's input is saved for its weight gradient: full fine-tuning, or an adapter's A."""
        return not lora_on or any(x in sh.lora_mods for x in mods)

    norm(1)
    if keeps("wq", "wk", "wv"):
        add("QKV input (norm1 output)", act, lin_sym, lin_in)
    add("Q", act, "h/t", sbh_t)
    if sh.rope and sh.torch_ops:
        add("rope cos and sin for Q and K (saved by their multiplies)", 4 * act, "d/2b", s * (sh.head_dim // 2))
    if sh.flash:
        add("K, V (kv heads)", 2 * act, "kv/t", s * b * sh.kv // t)
    else:
        add("K, V (repeated to all heads)", 2 * act, "h/t", sbh_t)
    if not sh.selective:
        if sh.flash:
            add("softmax log-sum-exp (fp32)", 4, "a/t", a * s * b // t)
        else:
            as2b = a * s * s * b // t
            if sh.torch_ops:
                add("causal mask (bool, saved by masked_fill)", 1, "s/b", s * s)
            add("softmax output", act, "as/t", as2b)
            if sh.dropout:
                add("attention-dropout mask", 1, "as/t", as2b)
                add("attention-dropout output", act, "as/t", as2b)
    if keeps("wo") or sh.flash:  # the flash kernel saves its output (the o-proj input) itself
        add("o-proj input (attention output)", act, "h/t", sbh_t)
    if sh.dropout:
        add("attention residual-dropout mask", 1, rep_sym, sbh_rep)
    norm(2)
    if keeps("w1", "w3"):
        add("MLP input (norm2 output)", act, lin_sym, lin_in)
    sbf_t = s * b * sh.f // t
    if sh.swiglu:
        add("gate output (SiLU input)", act, "f/t", sbf_t)
        add("SiLU output", act, "f/t", sbf_t)
        add("up output", act, "f/t", sbf_t)
        if keeps("w2"):
            add("down input", act, "f/t", sbf_t)
    else:
        add("GeLU input", act, "f/t", sbf_t)
        if keeps("w2"):
            add("fc2 input (GeLU output)", act, "f/t", sbf_t)
    if lora_on:
        n = len(sh.lora_mods)
        add(f"LoRA: A's output, saved by B for its gradient ({n} adapted Linears, rank r = {sh.lora_r})",
            n * act, "r", s * b * sh.lora_r)
    if sh.dropout:
        add("MLP residual-dropout mask", 1, rep_sym, sbh_rep)
    order = ("h", "h/t", "kv/t", "f/t", "as/t", "a/t", "1", "1/t", "d/2b", "s/b", "r")
    parts = [f"{coef[k]}{'' if k == '1' else k}" for k in order if coef.get(k)]
    formula = "s·b·(" + " + ".join(parts) + ")"
    return tuple(out), formula


def _uses_fsdp2(cfg: Config) -> bool:
    """The backend wraps in FSDP2: fully_shard for ZeRO-2/3, FSDP2's ``replicate`` for DP × TP."""
    par = cfg.parallel
    return par.zero in (2, 3) or (par.dp > 1 and par.tp > 1)


def _shape(cfg: Config) -> _Shape:
    model, par, tr = cfg.model, cfg.parallel, cfg.training
    act = 4 if tr.precision == "fp32" else 2
    base = dict(s=model.seq_len, b=tr.micro_batch_size, h=model.hidden, a=model.heads, kv=model.kv_dim,
                f=model.ffn_hidden, t=par.tp, sp=par.sequence_parallel, act=act, dropout=model.dropout > 0,
                flash=model.attention == "flash", swiglu=model.mlp == "swiglu",
                selective=tr.recompute == "selective")
    if tr.finetune == "lora":
        base.update(lora_r=tr.lora_rank, lora_mods=tuple(lora.target_modules(model, tr.lora_targets)))
    if cfg.conventions.state_accounting != "pytorch":
        return _Shape(**base)
    # autocast keeps the residual stream (embedding output, residual adds, the norms) in fp32;
    # FSDP2's MixedPrecisionPolicy casts the whole forward to the 16-bit param dtype.
    autocast = tr.precision != "fp32" and not _uses_fsdp2(cfg)
    # The per-layer terms stay at 16 bits here (so ``activation_bytes_per_layer`` does not depend on
    # the DP wrapper, and the planner's per-layer bound stays a bound); ``_body`` adds autocast's
    # fp32 residual stream as its own term.
    del autocast
    return _Shape(**base, torch_ops=True, resid=act,
                  composite_norm=model.norm == "rmsnorm" and cfg.cluster.gpu.name == "cpu",
                  rope=model.position == "rope", head_dim=model.head_dim)


def activation_terms_per_layer(cfg: Config) -> tuple[list[Term], str]:
    """What one block saves for backward for one microbatch on one rank, tensor by tensor.

    Ignores recompute = "full" (that keeps only the block input; see ``memory_per_rank``);
    honours "selective". Returns the terms and the symbolic formula of their sum.
    """
    terms, formula = _layer_activation_terms(_shape(cfg))
    return [Term(label, x, formula) for label, x in terms], formula


def activation_bytes_per_layer(cfg: Config) -> int:
    """Bytes one block saves for backward for one microbatch on one rank (no full recompute)."""
    return sum(x for _, x in _layer_activation_terms(_shape(cfg))[0])


# --------------------------------------------------------------------------- pipeline


@lru_cache(maxsize=512)
def _interleaved_states(rank: int, p: int, v: int, m: int, zero_bubble: bool) -> tuple[tuple[int, ...], ...]:
    """Per-local-stage live microbatches after each forward, replaying torch's op order.

    Port of ``_get_1f1b_rank_ops`` (torch.distributed.pipelining.schedules) for
    Interleaved1F1B (warm-up factor 2) and InterleavedZeroBubble (factor 1, W deferred by
    ``rank`` steps). A microbatch stays alive from its F to its full backward (B), or, under
    zero bubble, to its W.
    """
    mpr = m // max(1, m // p)
    warmup = min((v - 1) * mpr + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    fwd_bwd = m * v - warmup
    held = [0] * v
    states: set[tuple[int, ...]] = set()
    bwd_ops: list[int] = []
    w_count = 0

    def fstage(op: int) -> int:
        return (op // mpr) % v

    def bstage(op: int) -> int:
        return v - 1 - ((op - warmup) // mpr) % v

    def forward(op: int) -> None:
        held[fstage(op)] += 1
        states.add(tuple(held))

    def backward(op: int) -> None:
        nonlocal w_count
        bwd_ops.append(op)
        if not zero_bubble:
            held[bstage(op)] -= 1
        elif op - warmup >= rank:
            held[bstage(bwd_ops[w_count])] -= 1
            w_count += 1

    for op in range(warmup):
        forward(op)
    for op in range(warmup, warmup + fwd_bwd):
        forward(op)
        backward(op)
    for op in range(warmup + fwd_bwd, warmup + fwd_bwd + warmup):
        backward(op)
    return _frontier(states)


@lru_cache(maxsize=512)
def _zbv_states(rank: int, p: int, m: int) -> tuple[tuple[int, int], ...]:
    """(chunk-0, chunk-1) live microbatches after each forward: torch's ScheduleZBVZeroBubble order.

    Port of its ``_calculate_single_rank_operations``: the order is generated for
    max(2p − 1, m) microbatches and the actions of microbatches ≥ m are dropped. A microbatch
    is alive from its F until its W (the I step retains the autograd graph).
    """
    n_micro = max(2 * p - 1, m)
    held = [0, 0]
    nxt = {("F", 0): 0, ("F", 1): 0, ("W", 0): 0, ("W", 1): 0}
    states: set[tuple[int, int]] = set()

    def act(kind: str, chunk: int) -> None:
        mb = nxt[kind, chunk]
        nxt[kind, chunk] = mb + 1
        if mb >= m:
            return
        if kind == "F":
            held[chunk] += 1
            states.add((held[0], held[1]))
        else:
            held[chunk] -= 1

    for _ in range(2 * (p - rank) - 1):
        act("F", 0)
    for _ in range(rank):
        act("F", 1)
        act("F", 0)
    for _ in range(p - rank):
        act("F", 1)
        act("W", 1)
    while nxt["F", 1] < nxt["F", 0] or nxt["F", 0] < n_micro:
        if nxt["F", 0] < n_micro:
            act("F", 0)
        act("W", 0)
        act("F", 1)
        act("W", 1)
    return _frontier(states)  # the cool-down only frees


@lru_cache(maxsize=512)
def _dualpipev_states(rank: int, p: int, m: int) -> tuple[tuple[int, int], ...]:
    """(chunk-0, chunk-1) live microbatches after each forward: torch's ScheduleDualPipeV order.

    Port of its ``_calculate_single_rank_operations``. FULL_BACKWARD frees at once; a
    BACKWARD_INPUT frees at its queued W. Overlapped F+B actions run the F first.
    """
    held = [0, 0]
    w_queue: list[int] = []
    states: set[tuple[int, int]] = set()

    def f(chunk: int) -> None:
        held[chunk] += 1
        states.add((held[0], held[1]))

    def full_b(chunk: int) -> None:
        held[chunk] -= 1

    def input_b(chunk: int) -> None:
        w_queue.append(chunk)

    def w() -> None:
        if w_queue:
            held[w_queue.pop(0)] -= 1

    for _ in range((p - rank - 1) * 2):
        f(0)
    for _ in range(rank + 1):
        f(0)
        f(1)
    for _ in range(p - rank - 1):
        input_b(1)
        w()
        f(1)
    for _ in range(m - 2 * p + rank + 1):
        f(0)
        full_b(1)
        f(1)
        full_b(0)
    for _ in range(p - rank - 1):
        full_b(1)
        f(1)
        full_b(0)
    return _frontier(states)  # what follows only frees


def _frontier(states: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The states no other state dominates (only these can be a weighted peak), sorted."""
    kept: list[tuple[int, ...]] = []
    for a in sorted(states, key=sum, reverse=True):  # a dominator always has a larger sum
        if not any(all(x >= y for x, y in zip(b, a)) for b in kept):
            kept.append(a)
    return tuple(sorted(kept))


def _in_flight(schedule: str, pp_rank: int, p: int, v: int, m: int, unit_bytes: list[int]) -> tuple[int, ...]:
    """Microbatches each local stage holds at the rank's activation peak (local stage order)."""
    if p == 1:  # no pipeline: gradient accumulation runs F then B per microbatch, one alive at a time
        return (1,) * len(unit_bytes)
    if schedule in ("GPipe", "LoopedBFS"):
        return (m,) * len(unit_bytes)
    if schedule == "1F1B":
        return (min(m, p - pp_rank),)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        states = _interleaved_states(pp_rank, p, v, m, schedule == "InterleavedZeroBubble")
        return max(states, key=lambda st: sum(n * u for n, u in zip(st, unit_bytes)))
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        states = (_zbv_states if schedule == "ZBVZeroBubble" else _dualpipev_states)(pp_rank, p, m)
        return max(states, key=lambda st: sum(n * u for n, u in zip(st, unit_bytes)))
    raise ValueError(f"unknown schedule {schedule!r}")


_IN_FLIGHT_RULE = {
    "GPipe": "all m microbatches (every forward before any backward)",
    "LoopedBFS": "all m microbatches on every local stage (breadth-first)",
    "1F1B": "min(m, p − r) on pp-rank r",
    "Interleaved1F1B": "torch's interleaved order replayed: warm-up (v−1)·m_round + 2(p−1−r) forwards",
    "InterleavedZeroBubble": "torch's order replayed: warm-up (v−1)·m_round + (p−1−r), each microbatch held until its W",
    "ZBVZeroBubble": "torch's ZB-V order replayed (about 2p stage-microbatches per rank, held until W)",
    "DualPipeV": "torch's DualPipeV order replayed (about 2p + 1 stage-microbatches per rank)",
}


# --------------------------------------------------------------------------- per rank


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _torch_states(cfg: Config, rp: RankParams, dp_rank: int, T: dict[str, list[Term]], where: str) -> None:
    """params / grads / optimizer as torch keeps them ("pytorch" accounting; see the module docstring)."""
    par, tr, model = cfg.parallel, cfg.training, cfg.model
    z, d, k = par.zero, par.shard_degree, OPTIMIZER_STATES[tr.optimizer]
    psi = rp.total
    if z == 1 and par.tp > 1 and par.dp > 1:
        # torch has no ZeRO-1 for DTensor (TP) parameters (ZeroRedundancyOptimizer refuses them; the
        # backend raises): the states follow Megatron's distributed optimizer, an even flat split.
        T["params"].append(Term(f"parameters ({where}), fp32", 4 * psi, f"4 B × Ψ = 4 × {psi:,}"))
        T["grads"].append(Term("gradients, fp32", 4 * psi, f"4 B × Ψ = 4 × {psi:,}"))
        opt_numel = _ceil_div(psi, d)
        rule = f"⌈Ψ/d⌉ = ⌈{psi:,}/{d}⌉ (flat split: torch has no ZeRO-1 for TP parameters)"
    elif _uses_fsdp2(cfg):
        shard = d if par.zero in (2, 3) else 1  # FSDP2's replicate (DP × TP) keeps whole fp32 params
        psi_d = sharded_numel(tuple(x for u in rp.units for x in u), shard)
        how = (f"Ψ_d = {psi_d:,} (Ψ = {psi:,} over d = {shard}, dim 0 padded per tensor)" if shard > 1
               else f"Ψ = {psi:,} (FSDP2 replicate: not sharded)")
        T["params"].append(Term(f"parameters ({where}), FSDP2 fp32 sharded parameter (the master)",
                                4 * psi_d, f"4 B × {how}"))
        T["grads"].append(Term("gradients, FSDP2 sharded, in the parameter dtype (fp32)", 4 * psi_d, f"4 B × {how}"))
        opt_numel, rule = psi_d, how
    else:
        T["params"].append(Term(f"parameters ({where}), fp32 (autocast casts on the fly; no separate master)"
                                if tr.precision != "fp32" else f"parameters ({where})", 4 * psi, f"4 B × Ψ = 4 × {psi:,}"))
        grads = psi
        gterm = f"4 B × Ψ = 4 × {psi:,}"
        if par.tp > 1 and any(st.stage == 0 for st in rp.stages):
            # The vocab-parallel embedding's gradient comes back replicated: full V × h locally
            local_rows = rp.stages[[st.stage for st in rp.stages].index(0)].embedding
            extra = model.vocab * model.hidden - local_rows
            grads += extra
            gterm += f" + token-embedding gradient at full V × h on every TP rank (+{extra:,})"
        T["grads"].append(Term("gradients, fp32 (autocast gradients take the parameter dtype)"
                               if tr.precision != "fp32" else "gradients", 4 * grads, gterm))
        if z == 1 and par.dp > 1:
            sizes = zero_redundancy_partition(rank_tensor_numels(rp), par.dp)
            opt_numel = sizes[dp_rank]
            rule = (f"{opt_numel:,} elements: ZeroRedundancyOptimizer's greedy whole-tensor share of dp-rank "
                    f"{dp_rank} (ranks hold {', '.join(f'{x:,}' for x in sizes)})")
        else:
            opt_numel, rule = psi, f"Ψ = {psi:,}"
    if k:
        T["optimizer"].append(Term(f"{tr.optimizer} states ({k} × fp32; no master copy: the fp32 parameter is it)",
                                   4 * k * opt_numel, f"{4 * k} B × {rule}"))
    else:
        T["optimizer"].append(Term("no optimizer state (plain sgd)", 0, "0"))


def _lora_first_block_saving(sh: _Shape, layer_terms, res: int, sbh_rep: int, hs: str) -> tuple[str, int, str]:
    """What the first block of stage 0 does not save under LoRA: nothing before the first adapter
    requires grad (frozen embedding), so the ops there keep nothing for backward. With attention
    adapters that is norm1; with MLP adapters only, the whole attention half and norm2."""
    labels = [lbl for lbl, _ in layer_terms]
    if any(x in sh.lora_mods for x in ("wq", "wk", "wv")):
        skipped = [x for lbl, x in layer_terms if lbl.startswith("norm1")]
        n_norm, what = 1, "norm1"
    else:
        first_mlp = next(i for i, lbl in enumerate(labels) if lbl.startswith("MLP input") or lbl.startswith("gate")
                         or lbl.startswith("GeLU"))
        skipped = [x for lbl, x in layer_terms[:first_mlp] if not lbl.startswith("MLP input")]
        n_norm, what = 2, "the attention half and norm2"
    n_fp32 = n_norm  # the norm inputs (a frozen composite RMSNorm keeps no x̂)
    total = sum(skipped) + n_fp32 * (res - sh.act) * sbh_rep
    return (f"LoRA: the first block saves nothing for {what} (its input needs no gradient before the first "
            "adapter)", -total, f"−{total:,} B")


def _lora_units(cfg: Config, rp: RankParams) -> list[tuple[tuple[int, int], ...]]:
    """The adapter tensors of each FSDP unit of this rank (empty for embeddings and norm + head)."""
    tr = cfg.training
    block = lora.adapter_block_tensors(cfg.model, tr.lora_rank, tr.lora_targets, cfg.parallel.tp)
    return [block if u == rp.block_tensors else () for u in rp.units]


def _lora_states(cfg: Config, rp: RankParams, dp_rank: int, T: dict[str, list[Term]], where: str) -> int:
    """params / grads / optimizer under LoRA (engine.lora): frozen base, trainable fp32 adapters.

    The base has no gradient and no optimizer state; it is sharded like any parameter under
    ZeRO-3 / FSDP2 (fully_shard shards frozen parameters too). Returns the trainable elements this
    rank holds before any sharding (what DDP's buckets and the DP gradient traffic cover).
    """
    par, tr = cfg.parallel, cfg.training
    torch_acc = cfg.conventions.state_accounting == "pytorch"
    z, d, k = par.zero, par.shard_degree, OPTIMIZER_STATES[tr.optimizer]
    units = _lora_units(cfg, rp)
    ad = [x for u in units for x in u]
    psi_lora = sum(a * b for a, b in ad)
    psi_base = rp.total
    fsdp2 = _uses_fsdp2(cfg) if torch_acc else z == 3
    shard = d if (z in (2, 3) if torch_acc else z == 3) else 1
    # ---- frozen base
    if tr.lora_base_dtype == "nf4":
        weights = [a * b for a, b in rp.block_tensors if b > 1]  # the block Linears' weight matrices
        q_bytes = rp.layers * sum(lora.nf4_bytes(n) for n in weights)
        q_numel = rp.layers * sum(weights)
        u = lora.unquantised_bytes(tr)
        T["params"].append(Term(f"frozen base ({where}): block Linears in nf4 with double-quantised constants",
                                q_bytes, f"Σ ⌈n/2⌉ + ⌈n/64⌉ + 4·⌈⌈n/64⌉/256⌉ + 4 over {q_numel:,} weights "
                                         f"(≈ {lora.nf4_bytes_per_param():.4f} B each)"))
        T["params"].append(Term("frozen base: embeddings, norms, head (not quantised)", u * (psi_base - q_numel),
                                f"{u} B × {psi_base - q_numel:,}"))
    else:
        bb = lora.base_bytes_per_param(tr)
        base_d = sharded_numel(tuple(x for u in rp.units for x in u), shard)
        how = (f"Ψ_base,d = {base_d:,} (Ψ_base = {psi_base:,} over d = {shard}, dim 0 padded per tensor)"
               if shard > 1 else f"Ψ_base = {psi_base:,}")
        T["params"].append(Term(f"frozen base ({where}), {tr.lora_base_dtype}; no gradient, no optimizer state",
                                bb * base_d, f"{bb} B × {how}"))
    # ---- adapters
    lora_d = sharded_numel(tuple(ad), shard)
    how = (f"Ψ_lora,d = {lora_d:,} (Ψ_lora = {psi_lora:,} over d = {shard}, dim 0 padded per tensor)"
           if shard > 1 else f"Ψ_lora = {psi_lora:,}")
    per_layer = lora.adapter_params_per_layer(cfg.model, tr.lora_rank, tr.lora_targets)
    origin = (f"{rp.layers} blocks × Σ r·(d_in + d_out) = {rp.layers} × {per_layer:,} (r = {tr.lora_rank}, "
              f"targets {tr.lora_targets}{', local TP shard' if par.tp > 1 else ''})")
    if torch_acc:
        w_a = g_a = 4
        master = 0
    else:
        w_a, g_a = tr.param_bytes, tr.grad_bytes
        master = 4 if tr.master_weights else 0
    T["params"].append(Term(f"LoRA adapters A and B ({origin})", w_a * lora_d, f"{w_a} B × {how}"))
    g_numel, g_how = lora_d, how
    if not torch_acc and z == 2 and shard == 1:
        g_numel, g_how = _ceil_div(psi_lora, d), f"⌈Ψ_lora/d⌉ = ⌈{psi_lora:,}/{d}⌉"
    T["grads"].append(Term("adapter gradients" + (" (fp32, the adapters' dtype)" if torch_acc else ""),
                           g_a * g_numel, f"{g_a} B × {g_how}"))
    if z == 1 and par.dp > 1 and torch_acc and par.tp == 1:
        sizes = zero_redundancy_partition([a * b for a, b in ad], par.dp)
        opt_numel = sizes[dp_rank]
        rule = (f"{opt_numel:,} adapter elements: ZeroRedundancyOptimizer's greedy whole-tensor share of dp-rank "
                f"{dp_rank} (ranks hold {', '.join(f'{x:,}' for x in sizes)})")
    elif z >= 1 and par.dp > 1 and not (fsdp2 and shard > 1):
        opt_numel, rule = _ceil_div(psi_lora, d), f"⌈Ψ_lora/d⌉ = ⌈{psi_lora:,}/{d}⌉"
    else:
        opt_numel, rule = lora_d, how
    if master:
        T["optimizer"].append(Term("fp32 master weights of the adapters", 4 * opt_numel, f"4 B × {rule}"))
    if k:
        T["optimizer"].append(Term(f"{tr.optimizer} states of the adapters ({k} × fp32); none for the frozen base",
                                   4 * k * opt_numel, f"{4 * k} B × {rule}"))
    if not T["optimizer"]:
        T["optimizer"].append(Term("no optimizer state (plain sgd)", 0, "0"))
    return psi_lora


def _body(cfg: Config, rp: RankParams, dp_rank: int = 0) -> _Body:
    model, par, tr, conv = cfg.model, cfg.parallel, cfg.training, cfg.conventions
    t, p, v, m = par.tp, par.pp, par.virtual_stages, par.microbatches
    z, d = par.zero, par.shard_degree
    w, g = tr.param_bytes, tr.grad_bytes
    master = 4 if tr.master_weights else 0
    n_states = OPTIMIZER_STATES[tr.optimizer]
    psi = rp.total
    T: dict[str, list[Term]] = {c: [] for c in MEMORY_CATEGORIES}
    where = f"stage{'s' if len(rp.stages) > 1 else ''} {', '.join(map(str, rp.stage_indices))}"
    torch_acc = conv.state_accounting == "pytorch"
    fsdp2 = _uses_fsdp2(cfg)
    autocast = torch_acc and tr.precision != "fp32" and not fsdp2
    pd = w  # bytes of the compute copy FSDP2 all-gathers (MixedPrecisionPolicy.param_dtype)

    lora_on = tr.finetune == "lora"
    psi_train = psi  # elements that get a gradient (DDP buckets, unsharded gradients)
    train_units = [sum(a * c for a, c in u) for u in rp.units]
    # ---------------- model states
    if lora_on:
        psi_train = _lora_states(cfg, rp, dp_rank, T, where)
        lora_units = _lora_units(cfg, rp)
        train_units = [sum(a * c for a, c in u) for u in lora_units]
        psi = psi + psi_train  # every parameter the rank holds (FSDP2 gathers the frozen base too)
        rp = replace(rp, units=tuple(u + a for u, a in zip(rp.units, lora_units)))
    elif torch_acc:
        _torch_states(cfg, rp, dp_rank, T, where)
    elif z == 3:
        per_unit = [sharded_numel(u, d) for u in rp.units]
        psi_d = sum(per_unit)
        T["params"].append(Term(f"parameters ({where}), sharded ZeRO-3", w * psi_d,
                                f"{w} B × Ψ_d = {w} × {psi_d:,} (Ψ = {psi:,} over d = {d}, dim 0 padded per tensor)"))
        T["grads"].append(Term("gradients, sharded ZeRO-3", g * psi_d, f"{g} B × Ψ_d = {g} × {psi_d:,}"))
        opt_numel, opt_rule = psi_d, "Ψ_d"
    else:
        T["params"].append(Term(f"parameters ({where})", w * psi, f"{w} B × Ψ = {w} × {psi:,}"))
        if z == 2:
            gd = _ceil_div(psi, d)
            T["grads"].append(Term("gradients, sharded ZeRO-2", g * gd, f"{g} B × ⌈Ψ/d⌉ = {g} × ⌈{psi:,}/{d}⌉"))
        else:
            T["grads"].append(Term("gradients", g * psi, f"{g} B × Ψ = {g} × {psi:,}"))
        if z >= 1:
            opt_numel, opt_rule = _ceil_div(psi, d), f"⌈Ψ/d⌉ = ⌈{psi:,}/{d}⌉"
        else:
            opt_numel, opt_rule = psi, f"Ψ = {psi:,}"
    if master and not torch_acc and not lora_on:
        T["optimizer"].append(Term("fp32 master weights", 4 * opt_numel, f"4 B × {opt_rule}"))
    if n_states and not torch_acc and not lora_on:
        T["optimizer"].append(Term(f"{tr.optimizer} states ({n_states} × fp32)", 4 * n_states * opt_numel,
                                   f"{4 * n_states} B × {opt_rule}"))
    if not T["optimizer"]:
        T["optimizer"].append(Term("no optimizer state (plain sgd, fp32)", 0, "0"))

    # ---------------- activations
    s, b, h = model.seq_len, tr.micro_batch_size, model.hidden
    sh = _shape(cfg)
    act, sp = sh.act, sh.sp
    # residual stream: stage inputs/outputs, p2p buffers (autocast keeps it, and the norms, in fp32)
    res = 4 if autocast else act
    rep = t if sp else 1
    layer_terms, layer_formula = _layer_activation_terms(sh)
    per_layer = sum(x for _, x in layer_terms)
    sbh_rep = s * b * h // rep
    hs = "h/t" if sp else "h"
    if res > act:
        n_fp32 = 4 if sh.composite_norm and not lora_on else 2  # the two norm inputs (and x̂ of composite RMSNorm)
        per_layer += n_fp32 * (res - act) * sbh_rep
        # autocast casts a norm's fp32 output once per Linear that reads it (activations are not
        # cached, only weights): q, k, v each save their own copy; gate and up too under SwiGLU
        n_casts = 2 + (1 if model.mlp == "swiglu" else 0)
        if lora_on:  # only the Linears whose input is saved (adapted ones: their A) keep a cast
            n_casts = (max(0, sum(x in sh.lora_mods for x in ("wq", "wk", "wv")) - 1)
                       + max(0, sum(x in sh.lora_mods for x in ("w1", "w3")) - 1))
        per_layer += n_casts * act * s * b * h
        layer_formula += (f" + {n_fp32}·{res - act}·s·b·{hs} (autocast: norms in fp32)"
                          f" + {n_casts}·{act}·s·b·h (autocast: one input cast per Linear)")
    # torch's loss: loss_parallel (SP) keeps the vocabulary sharded; otherwise the head's output is
    # replicated (ColwiseParallel → Replicate), so the loss sees all V on every TP rank.
    v_loss = _ceil_div(model.vocab, t) if (sp or not torch_acc) else model.vocab
    v_sym = "⌈V/t⌉" if v_loss != model.vocab else "V"
    if tr.recompute == "full":
        stored, stored_formula = res * sbh_rep, f"{res}·s·b·{hs} (checkpointed block input)"
    else:
        stored, stored_formula = per_layer, layer_formula
    n_stages = par.num_stages
    extras: list[list[tuple[str, int, str]]] = []
    for st in rp.stages:
        ex: list[tuple[str, int, str]] = []
        if st.stage == 0:
            if not lora_on:  # a frozen embedding saves nothing
                ex.append(("token ids (int64, embedding backward)", 8 * s * b, "8·s·b"))
            elif tr.recompute != "full":
                ex.append(_lora_first_block_saving(sh, layer_terms, res, sbh_rep, hs))
            if model.dropout > 0 and not lora_on:
                ex.append(("embedding-dropout mask", sbh_rep, "s·b·" + hs))
        elif torch_acc:
            ex.append(("stage input is the p2p receive buffer (counted in comm_buffers)", -res * sbh_rep,
                       f"−{res}·s·b·{hs}"))
        if st.stage == n_stages - 1:
            if torch_acc:
                ex.append(("final-norm input", res * sbh_rep, f"{res}·s·b·{hs}"))
                if sh.composite_norm and not lora_on:
                    ex.append(("final-norm x̂ and rstd (composite RMSNorm)", res * sbh_rep + 4 * s * b // rep,
                               f"{res}·s·b·{hs} + 4·s·b"))
                else:
                    ex.append(("final-norm rstd", 4 * s * b // rep, "4·s·b"))
                if not lora_on:  # a frozen head saves no input for a weight gradient
                    ex.append(("head input", act * sbh_rep, f"{act}·s·b·{hs}"))
            elif lora_on:
                ex.append(("final-norm input (the frozen head saves none)", act * sbh_rep, f"{act}·s·b·{hs}"))
            else:
                ex.append(("final-norm input and head input", 2 * act * sbh_rep, f"{2 * act}·s·b·{hs}"))
            ex.append(("fp32 log-probabilities for the loss", 4 * s * b * v_loss, f"4·s·b·{v_sym}"))
        elif torch_acc:
            ex.append(("stage output kept by the pipeline stage for its backward", res * sbh_rep,
                       f"{res}·s·b·{hs}"))
        extras.append(ex)
    unit_bytes = [st.layers * stored + sum(x for _, x, _ in ex) for st, ex in zip(rp.stages, extras)]
    counts = _in_flight(par.schedule, rp.pp_rank, p, v, m, unit_bytes)
    dims = f"s={s}, b={b}, h={h}, a={model.heads}, f={model.ffn_hidden}, t={t}"
    for st, ex, n in zip(rp.stages, extras, counts):
        T["activations"].append(Term(
            f"stage {st.stage}: {n} microbatch{'es' if n != 1 else ''} in flight × {st.layers} layers",
            n * st.layers * stored,
            f"{n} × {st.layers} × {stored_formula} = {n} × {st.layers} × {stored:,} B ({dims})"))
        for label, x, fx in ex:
            T["activations"].append(Term(f"stage {st.stage}: {label}", n * x, f"{n} × {fx} = {n} × {x:,} B"))
    if torch_acc and p > 1 and any(st.stage == n_stages - 1 for st in rp.stages):
        # torch.distributed.pipelining keeps every microbatch's output (the logits) on the last stage
        # until step() merges them, whatever the schedule
        lo = act * s * b * v_loss
        T["activations"].append(Term("last stage: every microbatch's logits, kept by the schedule to merge the output",
                                     m * lo, f"m × {act}·s·b·{v_sym} = {m} × {lo:,} B"))
    if autocast and lora_on:
        # autocast caches casts of leaf tensors that require grad only: the adapters, not the base
        T["activations"].append(Term("autocast's 16-bit casts of the adapters (cached; the frozen base is cast "
                                     "on the fly and not cached)", act * psi_train,
                                     f"{act} B × {psi_train:,} adapter weights"))
    elif autocast:
        # autocast caches the 16-bit cast of every weight a matmul uses until its context exits
        # (the backend's context spans forward and backward); the matmuls save these casts.
        cast = sum(a * c for blk in [rp.block_tensors] for a, c in blk if c > 1) * rp.layers
        cast += sum(st.head for st in rp.stages)
        T["activations"].append(Term("autocast's 16-bit weight casts (cached for the whole step)", act * cast,
                                     f"{act} B × {cast:,} matmul weights (blocks and head)"))
    if tr.recompute == "full":
        T["temporaries"].append(Term("one block recomputed during backward (full recompute)", per_layer,
                                     f"{layer_formula} = {per_layer:,} B ({dims})"))
    if any(st.stage == n_stages - 1 for st in rp.stages):
        if torch_acc:
            lx = 2 * 4 * s * b * v_loss
            T["temporaries"].append(Term("loss: fp32 logits and the log-softmax gradient at the start of backward",
                                         lx, f"2 × 4·s·b·{v_sym} = {lx:,} B"))
        else:
            v_local = _ceil_div(model.vocab, t)
            lx = act * s * b * v_local + (4 * s * b * v_local if act != 4 else 0)
            T["temporaries"].append(Term("logits at the loss (compute dtype + fp32 copy)", lx,
                                         f"{act + (4 if act != 4 else 0)}·s·b·V/t = {lx:,} B"))

    # ---------------- communication buffers
    dp_grad_group = par.dp > 1
    if torch_acc and fsdp2 and dp_grad_group:
        sizes = sorted((sum(a * c for a, c in u) for u in rp.units), reverse=True)
        largest = sizes[0]
        if z == 3:
            n_units = 2 if conv.fsdp_prefetch and len(sizes) > 1 else 1
            T["comm_buffers"].append(Term(
                "FSDP2 unsharded parameters: current unit" + (" + prefetched unit" if n_units == 2 else ""),
                pd * sum(sizes[:n_units]), f"{pd} B × ({' + '.join(f'{x:,}' for x in sizes[:n_units])})"))
        else:
            T["comm_buffers"].append(Term(
                "FSDP2 unsharded parameters, all units (" + ("ZeRO-2: not resharded after forward"
                                                              if z == 2 else "replicate") + ")",
                pd * psi, f"{pd} B × Ψ = {pd} × {psi:,}"))
        if z in (2, 3):
            T["comm_buffers"].append(Term("all-gather output of one unit (largest)", pd * largest,
                                          f"{pd} B × {largest:,}"))
        if m > 1:
            T["comm_buffers"].append(Term(
                "FSDP2 unsharded gradients of every unit (accumulated unsharded over microbatches without sync)"
                + (" — adapters only under LoRA" if lora_on else ""),
                pd * psi_train, f"{pd} B × Ψ{'_lora' if lora_on else ''} = {pd} × {psi_train:,}"))
        else:
            big = max(train_units)
            T["comm_buffers"].append(Term("reduce-scatter input (one unit's unsharded gradients"
                                          + (", adapters only)" if lora_on else ")"), pd * big,
                                          f"{pd} B × largest FSDP unit's trainable elements ({big:,})"))
    elif z in (0, 1) and dp_grad_group:
        gb = 4 if torch_acc else g  # DDP's buckets take the gradients' dtype (fp32 under autocast)
        buckets = max(1, math.ceil(gb * psi_train / (conv.ddp_bucket_mb * MB)))
        if getattr(conv, "ddp_gradient_as_bucket_view", False):
            T["comm_buffers"].append(Term("DDP gradient buckets (gradients are views into them)", 0,
                                          "0 (gradient_as_bucket_view=True)"))
        else:
            T["comm_buffers"].append(Term(
                f"DDP gradient buckets ({buckets} × ≤{conv.ddp_bucket_mb:g} MB)", gb * psi_train,
                f"{gb} B × {'Ψ_lora (frozen parameters have no bucket)' if lora_on else 'Ψ'}: the Reducer's flat "
                "buckets cover every gradient; bucket_cap_mb sets their count"))
        # it is part of the peak where the rank's peak falls in a backward: no pipeline, the last stage
        # (one microbatch in flight), full recompute; stages holding several microbatches peak at the
        # end of their warm-up forwards, before it exists (measured)
        in_backward = p == 1 or tr.recompute == "full" or any(st.stage == n_stages - 1 for st in rp.stages)
        # not seen with LoRA's frozen base (measured: DDP + peft, torch 2.13)
        if torch_acc and in_backward and not lora_on:
            T["temporaries"].append(Term(
                "DDP: a gradient-sized temporary early in the synchronised backward (measured, torch 2.13)",
                gb * psi_train, f"{gb} B × Ψ{'_lora' if lora_on else ''} = {gb} × {psi_train:,}"))
    elif z in (2, 3) and d > 1:
        sizes = sorted((sum(a * c for a, c in u) for u in rp.units), reverse=True)
        largest = sizes[0]
        big = max(train_units)
        T["comm_buffers"].append(Term("reduce-scatter input (one unit's unsharded gradients)", g * big,
                                      f"{g} B × largest FSDP unit's trainable elements ({big:,})"))
        if z == 3:
            T["comm_buffers"].append(Term("all-gather input (one unit's shard)", w * _ceil_div(largest, d),
                                          f"{w} B × ⌈{largest:,}/{d}⌉"))
            n_units = 2 if conv.fsdp_prefetch and len(sizes) > 1 else 1
            unsharded = sum(sizes[:n_units])
            T["temporaries"].append(Term(
                "unsharded parameters: current unit" + (" + prefetched unit" if n_units == 2 else ""),
                w * unsharded, f"{w} B × ({' + '.join(f'{x:,}' for x in sizes[:n_units])}) — the all-gather output"))
    if p > 1:
        stage_io = res * sbh_rep
        for st in rp.stages:
            if st.stage > 0:
                T["comm_buffers"].append(Term(f"stage {st.stage}: activation receive buffers", m * stage_io,
                                              f"m × {res}·s·b·{hs} = {m} × {stage_io:,} (torch allocates one per microbatch)"))
            if st.stage < n_stages - 1:
                T["comm_buffers"].append(Term(f"stage {st.stage}: gradient receive buffers", m * stage_io,
                                              f"m × {res}·s·b·{hs} = {m} × {stage_io:,}"))
    if not T["comm_buffers"]:
        T["comm_buffers"].append(Term("no collective buffers (nothing to reduce)", 0, "0"))
    if not T["temporaries"]:
        T["temporaries"].append(Term("no large temporaries", 0, "0"))

    # ---------------- overhead
    gpu = cfg.cluster.gpu
    if conv.runtime_context:
        ctx = int(round(gpu.runtime_context_gib * GIB))
        T["overhead"].append(Term(f"runtime context ({gpu.name}; cluster.gpu.runtime_context_gib)", ctx,
                                  f"{gpu.runtime_context_gib:g} GiB (conventions.runtime_context)"))
    if conv.collective_buffers:
        comms = _communicators(cfg)
        if comms:
            per = int(round(conv.collective_buffer_mib * MIB))
            T["overhead"].append(Term(
                f"collective-library buffers ({', '.join(comms)})", len(comms) * per,
                f"{len(comms)} communicators × {conv.collective_buffer_mib:g} MiB (conventions.collective_buffer_mib)"))
    if conv.allocator_slack_fraction > 0:
        live = sum(x.bytes for c in MEMORY_CATEGORIES for x in T[c] if c != "overhead")
        slack = int(live * conv.allocator_slack_fraction)
        T["overhead"].append(Term("allocator slack (reserved, not allocated)", slack,
                                  f"{conv.allocator_slack_fraction:g} × live tensors {_gib(live)} "
                                  "(conventions.allocator_slack_fraction)"))
    if not T["overhead"]:
        T["overhead"].append(Term("no overhead counted (all overhead conventions off)", 0, "0"))
    return _Body(T, rp.stage_indices, rp.pp_rank)


def _communicators(cfg: Config) -> list[str]:
    """Communicators a rank belongs to (size > 1): the world, and each mesh dimension's group."""
    par = cfg.parallel
    out = []
    if par.world_size > 1:
        out.append("world")
    if par.replicate > 1:
        out.append("dp-replicate")
        if par.shard_degree > 1:
            out.append("dp-shard")
    elif par.dp > 1:
        out.append("dp")
    if par.tp > 1:
        out.append("tp")
    if par.pp > 1:
        out.append("pp")
    return out


def conventions_of(cfg: Config) -> dict[str, str]:
    """The conventions this report used, in words (shown next to the numbers)."""
    tr, par, conv = cfg.training, cfg.parallel, cfg.conventions
    k = OPTIMIZER_STATES[tr.optimizer]
    if conv.state_accounting == "pytorch":
        how = ("FSDP2 (fully_shard / replicate, MixedPrecisionPolicy): the fp32 sharded parameter is the master"
               if _uses_fsdp2(cfg) else
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
    return {
        "bytes_per_parameter": bpp,
        "sharding_degree": f"ZeRO-{par.zero} divides by parallel.shard_degree = {par.shard_degree} "
                           "(dp, or dp/replicate under HSDP), never by the world size",
        "zero_accounting": acc,
        "state_accounting": conv.state_accounting,
        "activations": "saved-for-backward tensors per op (Korthikanti et al. 2022 Table 2 when f=4h, "
                       f"eager, dropout on); attention = {cfg.model.attention}, dropout "
                       f"{'on' if cfg.model.dropout > 0 else 'off (no masks)'}, recompute = {tr.recompute}, "
                       f"{4 if tr.precision == 'fp32' else 2}-byte activations",
        "pipeline_in_flight": f"{par.schedule}: {_IN_FLIGHT_RULE[par.schedule]}" if par.pp > 1 else "no pipeline",
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
        "overhead.allocator_slack": f"{conv.allocator_slack_fraction:g} × live tensors",
        "capacity": f"cluster.gpu.memory_gib = {cfg.cluster.gpu.memory_gib:g} GiB",
    }


def memory_per_rank(cfg: Config) -> MemoryReport:
    """Memory of every rank 0..world−1, by category, with the terms behind each number."""
    par = cfg.parallel
    capacity = cfg.cluster.gpu.memory_bytes
    grid = params_per_rank(cfg)
    # torch's ZeroRedundancyOptimizer gives DP ranks different shares: one body per dp-rank then
    per_dp = cfg.conventions.state_accounting == "pytorch" and par.zero == 1 and par.dp > 1 and par.tp == 1
    bodies: dict[tuple[int, int, int], _Body] = {}
    for pp_rank, row in enumerate(grid):
        seen: dict[tuple[int, int], _Body] = {}
        for tp_rank, rp in enumerate(row):
            for dp_rank in range(par.dp if per_dp else 1):
                key = (rp.total, dp_rank)  # TP shards differ only by their vocabulary chunk
                body = seen.get(key)
                if body is None:
                    body = seen[key] = _body(cfg, rp, dp_rank)
                bodies[pp_rank, tp_rank, dp_rank] = body
    # rank order as engine.layout.rank_coords: TP innermost, then DP, then PP
    dp, tp = par.dp, par.tp
    per_rank = [RankMemory(rank, rank % tp, (rank // tp) % dp,
                           bodies[rank // (dp * tp), rank % tp, (rank // tp) % dp if per_dp else 0], capacity)
                for rank in range(par.world_size)]
    return MemoryReport(per_rank=per_rank, capacity_bytes=capacity, conventions=conventions_of(cfg))
