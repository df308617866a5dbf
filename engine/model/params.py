"""Exact parameter counts, and which pipeline stage and tensor-parallel shard holds what.

THE PARAMETER RULE (the backend builds exactly this model; ``sum(p.numel())`` must match):

A decoder-only transformer with ``L`` identical blocks, hidden ``h``, ``a`` heads of
``d = h / a``, ``a_kv`` KV heads, FFN size ``f``, vocabulary ``V``, sequence ``s``:

* token embedding          ``V·h``
* position embedding       ``s·h``, only when ``model.position == "learned"`` (rope: none)
* per block, in order
    - norm1                LayerNorm: weight + bias = ``2h``; RMSNorm: weight only = ``h``
    - attention            q: ``h → a·d``, k: ``h → a_kv·d``, v: ``h → a_kv·d``, o: ``h → h``
    - norm2                as norm1
    - MLP                  swiglu: gate ``h → f``, up ``h → f``, down ``f → h``;
                           gelu: up ``h → f``, down ``f → h``
    - biases               on every Linear above iff ``model.bias`` (q: ``a·d``, k and v:
                           ``a_kv·d`` each, o: ``h``, gate/up: ``f`` each, down: ``h``)
* final norm               as norm1
* head                     ``h → V`` without bias; absent when ``tied_embeddings``

GPT-2 small (gpt2-124m preset) gives 124,439,808; llama2-7b 6,738,415,616.

Beyond the plain block (each 0 / off by default):

* ``qkv_bias``: biases on q, k and v only (``a·d``, ``a_kv·d``, ``a_kv·d``; Qwen2).
* ``head_size``: q is ``h → a·d`` and o ``a·d → h`` with that ``d`` (need not be ``h / a``);
  ``qk_norm`` adds a norm of ``d`` over q and one over k; ``attention_sinks`` one logit per head.
* ``attention = "mla"``: ``attention_tensors`` below (DeepSeek-V2/V3's projections and latent norms).
* Mixture of experts (``experts = E > 0``): the first ``dense_layers`` blocks keep the dense MLP;
  every later block replaces it with a router ``h → E`` (bias ``E`` iff ``router_bias``), ``E``
  routed experts of FFN ``expert_ffn_hidden`` (an MLP as above each, biases iff ``model.bias``)
  and ``shared_experts`` always-on ones of the same width (one MLP of ``S·f_e``). Active
  parameters count ``experts_per_token`` of the ``E`` experts.

PLACEMENT RULE (pipeline and tensor parallel):

* Stage ``k`` holds the blocks ``engine.pipeline.layout.split_layers(L, pp·v, parallel.pipeline_split)[k]``
  ("even": uneven splits give the first stages one block more; "torchtitan": the embeddings and
  norm + head count as a block each). The embeddings sit on stage 0, the final norm and head on
  the last stage; the stage-to-rank map is ``engine.pipeline.layout`` (loop, or V for ZBV/DualPipeV, where
  pp-rank 0 holds both the first and the last stage).
* Tied embeddings with more than one stage: the last stage keeps its own copy of the embedding
  matrix as the head (Megatron's convention, and ``backend.model.cut_stage``: a stage is its own
  module, so even under V placement, where pp-rank 0 holds both ends, the head is a copy).
  With a single stage (pp = 1) there is one matrix.
* Tensor parallel (Megatron / torchtitan plan): q, k, v, gate, up are column-parallel (output
  dim and its bias split by ``t``); o and down are row-parallel (input dim split; bias
  replicated); norms are replicated; the token embedding and the head are split along the
  vocabulary like ``torch.chunk`` (``ceil(V/t)`` rows on the first ranks, the rest on the last);
  the learned position embedding is replicated.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from engine.config import Config, ModelSpec
from engine.pipeline.layout import placement_style, split_layers, stages_of_pp_rank

# --------------------------------------------------------------------------- whole model


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer block of one kind (dense, or with experts)."""

    attention: int  # q, k, v, o weights (MLA: its projections and latent norms); attention sinks
    mlp: int  # the dense MLP's weights; in a block with experts, the shared experts' weights
    norms: int  # norm1 + norm2, and the q/k norms
    biases: int  # the bias of every Linear above (0 unless model.bias)
    router: int = 0  # the router's weight and bias
    experts: int = 0  # every routed expert's weights and biases
    active_experts: int = 0  # of those, the ones a token passes through (top-k experts)

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.biases + self.router + self.experts

    @property
    def active(self) -> int:
        """Parameters one token uses: everything but the experts it is not routed to."""
        return self.total - self.experts + self.active_experts


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts of a ModelSpec, by part.

    ``layer`` is the repeating block: the block with experts for a mixture of experts, whose
    first ``dense_layers`` blocks are ``dense_layer`` instead.
    """

    embedding: int
    position: int
    layer: LayerParams
    layers: int
    final_norm: int
    head: int  # 0 when tied
    dense_layer: LayerParams | None = None
    dense_layers: int = 0

    @property
    def per_layer(self) -> int:
        return self.layer.total

    @property
    def blocks(self) -> int:
        dense = self.dense_layers * self.dense_layer.total if self.dense_layer else 0
        return (self.layers - self.dense_layers) * self.layer.total + dense

    @property
    def experts(self) -> int:
        """Routed expert parameters of the whole model."""
        return (self.layers - self.dense_layers) * self.layer.experts

    @property
    def total(self) -> int:
        return self.embedding + self.position + self.blocks + self.final_norm + self.head

    @property
    def active(self) -> int:
        """Parameters one token passes through: the total less the routed experts it skips
        (embedding and head included, as Mixtral's 12.9B and DeepSeek-V3's 37B count them)."""
        dense = self.dense_layers * self.dense_layer.total if self.dense_layer else 0
        return (self.embedding + self.position + self.final_norm + self.head + dense
                + (self.layers - self.dense_layers) * self.layer.active)

    @property
    def active_without_embedding(self) -> int:
        """``active`` less the input embedding (a row lookup, not a matmul; the head stays, and a
        tied head counts its matrix): the convention of gpt-oss's 3.6B / 5.1B and of DeepSeek-V3's
        36.6B ("37B") active parameters."""
        tied_head = self.embedding if self.head == 0 else 0
        return self.active - self.embedding - self.position + tied_head


def _norm_params(model: ModelSpec) -> int:
    return 2 * model.hidden if model.norm == "layernorm" else model.hidden


def norm_tensors(model: ModelSpec, width: int) -> tuple[tuple[int, int], ...]:
    return ((width, 1), (width, 1)) if model.norm == "layernorm" else ((width, 1),)


def attention_tensors(model: ModelSpec, tp: int = 1) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(weights, biases) of one block's attention on one TP rank, as (dim0, rest) shapes.

    Plain / grouped-query: q ``h → a·d``, k and v ``h → a_kv·d`` (column-parallel), o ``a·d → h``
    (row-parallel), biases on each iff ``model.bias``; attention sinks add one logit per head.
    MLA (DeepSeek-V2/V3): q ``h → r_q`` (q_a_proj), its norm ``r_q``, ``r_q → a·(d_nope + d_rope)``
    (q_b_proj; or q ``h → a·(d_nope + d_rope)`` without a query latent), kv ``h → r_kv + d_rope``
    (kv_a_proj_with_mqa), its norm ``r_kv``, ``r_kv → a·(d_nope + d_v)`` (kv_b_proj), o
    ``a·d_v → h``. The latent projections and norms are replicated over TP; the head-wise ones split.
    """
    h, a = model.hidden, model.heads
    if model.attention == "mla":
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        a_local = a // tp
        w: list[tuple[int, int]] = []
        if model.q_lora_rank:
            w += [(model.q_lora_rank, h)] + list(norm_tensors(model, model.q_lora_rank))
            w += [(a_local * qk, model.q_lora_rank)]
        else:
            w += [(a_local * qk, h)]
        w += [(model.kv_lora_rank + model.qk_rope_head_dim, h)] + list(norm_tensors(model, model.kv_lora_rank))
        w += [(a_local * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank)]
        w += [(h, a_local * model.v_head_dim)]
        b: list[tuple[int, int]] = []
        if model.bias:  # on every Linear, as plain attention's bias flag means
            if model.q_lora_rank:
                b += [(model.q_lora_rank, 1), (a_local * qk, 1)]
            else:
                b += [(a_local * qk, 1)]
            b += [(model.kv_lora_rank + model.qk_rope_head_dim, 1), (a_local * (model.qk_nope_head_dim + model.v_head_dim), 1),
                  (h, 1)]
    else:
        q_local, kv_local = a * model.head_dim // tp, model.kv_dim // tp
        w = [(q_local, h), (kv_local, h), (kv_local, h), (h, q_local)]  # q, k, v (col); o (row)
        b = ([(q_local, 1), (kv_local, 1), (kv_local, 1), (h, 1)] if model.bias
             else [(q_local, 1), (kv_local, 1), (kv_local, 1)] if model.qkv_bias else [])
    if model.attention_sinks:
        w += [(a // tp, 1)]
    return tuple(w), tuple(b)


def mlp_tensors(model: ModelSpec, width: int, tp: int = 1) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(weights, biases) of one MLP of FFN ``width`` on one TP rank: swiglu gate, up ``h → f``
    (column-parallel) and down ``f → h`` (row-parallel); gelu up and down."""
    h, f_local = model.hidden, width // tp
    ups = 2 if model.mlp == "swiglu" else 1
    w = [(f_local, h)] * ups + [(h, f_local)]
    b = [(f_local, 1)] * ups + [(h, 1)] if model.bias else []
    return tuple(w), tuple(b)


def router_tensors(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """The router of a block with experts: ``h → E`` (+ a bias of E with ``router_bias``), replicated over TP.
    DeepSeek-V3's balancing bias (``router_balance_bias``) is a buffer, not a parameter."""
    return ((model.experts, model.hidden),) + (((model.experts, 1),) if model.router_bias else ())


def expert_tensors(model: ModelSpec, experts: int, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """``experts`` routed experts as grouped weights (torchtitan's GroupedExperts: w1, w3 ``(E, f, h)``,
    w2 ``(E, h, f)``; gelu w1, w2; with ``model.bias`` a bias ``(E, f)`` per up projection and
    ``(E, h)`` for down), each as (dim0, rest) with the expert dimension first. ``tp`` splits f
    (experts sharded by TP when expert parallelism is off)."""
    h, f = model.hidden, model.expert_hidden // tp
    ups = 2 if model.mlp == "swiglu" else 1
    out = [(experts, f * h)] * ups + [(experts, h * f)]
    if model.bias:
        out += [(experts, f)] * ups + [(experts, h)]
    return tuple(out)


def _numel(tensors) -> int:
    return sum(a * b for a, b in tensors)


def expert_weight_numel(model: ModelSpec, experts: int, tp: int = 1) -> int:
    """Elements of the weight matrices of ``experts`` routed experts (w1, w2, and w3 under SwiGLU; ``tp``
    splits f), their biases left out: ``_weight_numel`` cannot tell a grouped weight of one expert, (1, f·h),
    from a norm, nor a grouped bias, (E, f), from a matrix."""
    return (3 if model.mlp == "swiglu" else 2) * experts * (model.expert_hidden // tp) * model.hidden


def _block_params(model: ModelSpec, with_experts: bool) -> LayerParams:
    att_w, att_b = attention_tensors(model)
    if with_experts:
        shared = model.shared_experts * model.expert_hidden
        mlp_w, mlp_b = mlp_tensors(model, shared) if shared else ((), ())
        router = _numel(router_tensors(model))
        per_expert = _numel(expert_tensors(model, 1))
        experts, active = model.experts * per_expert, model.experts_per_token * per_expert
    else:
        mlp_w, mlp_b = mlp_tensors(model, model.ffn_hidden)
        router = experts = active = 0
    qk_norms = 2 * model.head_dim if model.qk_norm else 0
    return LayerParams(attention=_numel(att_w), mlp=_numel(mlp_w), norms=2 * _norm_params(model) + qk_norms,
                       biases=_numel(att_b) + _numel(mlp_b), router=router, experts=experts,
                       active_experts=active)


def param_counts(model: ModelSpec) -> ParamCounts:
    """Exact parameter counts by part (see the rule at the top of this module)."""
    moe = model.experts > 0
    return ParamCounts(
        embedding=model.vocab * model.hidden,
        position=model.seq_len * model.hidden if model.position == "learned" else 0,
        layer=_block_params(model, with_experts=moe),
        layers=model.layers,
        final_norm=_norm_params(model),
        head=0 if model.tied_embeddings else model.vocab * model.hidden,
        dense_layer=_block_params(model, with_experts=False) if moe and model.dense_layers else None,
        dense_layers=model.dense_layers if moe else 0,
    )


# --------------------------------------------------------------------------- local tensors
#
# A tensor is described by its local shape on one TP rank as (dim0, rest) — the numbers
# ZeRO-3 / FSDP2 shard (FSDP2 pads dim 0 to a multiple of the shard degree).


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes ``torch.chunk`` (and DTensor ``Shard``) gives: ceil(n/parts) on the first parts."""
    size = -(-n // parts)
    return [max(0, min(size, n - i * size)) for i in range(parts)]


@lru_cache(maxsize=256)
def layer_tensors(model: ModelSpec, tp: int, with_experts: bool = False, ep: int = 1,
                  expert_degree: int = 1) -> tuple[tuple[int, int], ...]:
    """(dim0, rest) of every parameter of one block's FSDP unit on one TP rank.

    A dense block: norm1, q, k, v, o (+ biases), norm2, the MLP (+ biases). A block with experts:
    norm1, attention, norm2, the router, the shared experts (TP-split like the dense MLP) and —
    without expert parallelism — the routed experts, split by TP along f. With ``ep`` > 1 the
    routed experts are a unit of their own (``local_expert_tensors``), as torchtitan wraps them.
    """
    h = model.hidden
    norm = norm_tensors(model, h)
    att_w, att_b = attention_tensors(model, tp)
    out: list[tuple[int, int]] = list(norm) + list(att_w) + list(att_b)
    if model.qk_norm:
        out += [(model.head_dim, 1), (model.head_dim, 1)]
    out += list(norm)
    if not with_experts:
        mlp_w, mlp_b = mlp_tensors(model, model.ffn_hidden, tp)
        return tuple(out + list(mlp_w) + list(mlp_b))
    out += list(router_tensors(model))
    if model.shared_experts:
        mlp_w, mlp_b = mlp_tensors(model, model.shared_experts * model.expert_hidden, tp)
        out += list(mlp_w) + list(mlp_b)
    if ep == 1:
        out += list(expert_tensors(model, model.experts, tp))
    return tuple(out)


@lru_cache(maxsize=256)
def local_expert_tensors(model: ModelSpec, ep: int, expert_degree: int) -> tuple[tuple[int, int], ...]:
    """The routed experts one EP rank holds (E / ep of them, whole), as FSDP2 shards them over
    ``expert_degree`` (efsdp) ranks: torchtitan's shard placement splits the expert dimension
    (dim 0) when there are at least efsdp local experts, else dim 1 (f of w1 / w3, h of w2)."""
    e_local = model.experts // ep
    grouped = expert_tensors(model, e_local)
    if e_local >= expert_degree:
        return grouped
    h, f = model.hidden, model.expert_hidden
    ups = 2 if model.mlp == "swiglu" else 1
    out = [(f, e_local * h)] * ups + [(h, e_local * f)]
    if model.bias:
        out += [(f, e_local)] * ups + [(h, e_local)]
    return tuple(out)


def _weight_numel(tensors) -> int:
    """Elements of the matrices among ``tensors`` (the Linears' and experts' weights, not norms or biases)."""
    return sum(a * b for a, b in tensors if a > 1 and b > 1)


def sharded_numel(tensors: tuple[tuple[int, int], ...], degree: int) -> int:
    """Elements per rank when each tensor's dim 0 is split over ``degree`` ranks, padded (FSDP2)."""
    if degree == 1:
        return sum(a * b for a, b in tensors)
    return sum(-(-a // degree) * b for a, b in tensors)


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class StageParams:
    """What one pipeline stage holds on one TP rank (local element counts)."""

    stage: int
    layers: int  # blocks on this stage
    embedding: int  # local token-embedding rows × h (stage 0 only)
    position: int  # learned position embedding (stage 0 only)
    blocks: int  # layers × local params of one block (without the routed experts)
    final_norm: int  # last stage only
    head: int  # last stage only (a copy of the embedding when tied across ranks)
    experts: int = 0  # the routed experts' weights this rank holds for the stage's MoE blocks
    moe_layers: int = 0  # of the stage's blocks, those with experts

    @property
    def total(self) -> int:
        return self.embedding + self.position + self.blocks + self.final_norm + self.head + self.experts

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers


Tensors = tuple[tuple[int, int], ...]  # (dim0, rest) of each tensor of one FSDP unit


@dataclass(frozen=True)
class RankParams:
    """What one (pp-rank, tp-rank) holds; identical on every DP replica.

    Its FSDP units (embeddings, each block, final norm + head) are kept as ``unit_groups``: runs
    of identical units with their multiplicity, in stage order — O(stages) entries however many
    layers the model has. Everything the engine asks of the units (element counts, the largest
    units, how many there are, the tensors ZeRO-1 partitions) is computed from the groups.
    """

    pp_rank: int
    tp_rank: int
    stages: tuple[StageParams, ...]
    block_tensors: Tensors  # one (dense) block's local (dim0, rest) shapes
    unit_groups: tuple[tuple[Tensors, int], ...]  # (one unit's tensors, how many in a row), stage order
    # the routed experts' own FSDP units under expert parallelism (one per MoE block; also in
    # unit_groups), sharded over efsdp instead of dp_shard; empty without experts or with ep = 1
    expert_units: tuple[tuple[Tensors, int], ...] = ()
    matmul_weights: int = -1  # elements of the blocks' weight matrices (-1: block_tensors × layers)
    expert_matmul_weights: int = 0  # of them, the routed experts' (``expert_weight_numel``)
    # the context-parallel rank of the ranks it stands for: it holds the same parameters on every cp-rank, but the
    # ring attention's saved outputs differ by it (``engine.memory.activations.cp_ranks_differ``); 0 elsewhere
    cp_rank: int = 0

    @property
    def stage_indices(self) -> tuple[int, ...]:
        return tuple(s.stage for s in self.stages)

    @cached_property
    def total(self) -> int:
        return sum(s.total for s in self.stages)

    @property
    def layers(self) -> int:
        return sum(s.layers for s in self.stages)

    @property
    def units(self) -> tuple[Tensors, ...]:
        """Every FSDP unit, one entry per unit (O(layers): for tests and inspection, never the engine's hot path)."""
        return tuple(u for u, count in self.unit_groups for _ in range(count))

    @cached_property
    def unit_count(self) -> int:
        """How many FSDP units this rank holds (each ``fully_shard`` call)."""
        return sum(count for _, count in self.unit_groups)

    @cached_property
    def tensor_count(self) -> int:
        """How many parameter tensors this rank holds."""
        return sum(len(u) * count for u, count in self.unit_groups)

    def sharded_numel(self, degree: int, expert_degree: int | None = None) -> int:
        """Elements per rank when every tensor's dim 0 is split over ``degree`` ranks, padded (FSDP2);
        the expert units (expert parallelism) over ``expert_degree`` (efsdp) when given."""
        if expert_degree is None or not self.expert_units:
            return sum(sharded_numel(u, degree) * count for u, count in self.unit_groups)
        experts = {u for u, _ in self.expert_units}
        return sum(sharded_numel(u, expert_degree if u in experts else degree) * count
                   for u, count in self.unit_groups)

    @property
    def experts(self) -> int:
        """Routed-expert elements this rank holds (its part of each MoE block's experts)."""
        return sum(st.experts for st in self.stages)

    @property
    def block_weight_numel(self) -> int:
        """Elements of the weight matrices of this rank's blocks (what autocast casts and caches)."""
        if self.matmul_weights >= 0:
            return self.matmul_weights
        return sum(a * c for a, c in self.block_tensors if c > 1) * self.layers

    @cached_property
    def root_units(self) -> tuple[Tensors, ...]:
        """The units of FSDP2's root on this rank (``fully_shard(model)`` after the blocks): the embeddings
        where it holds the first stage, the final norm + head where it holds the last; none on a middle
        stage. They lead and end ``unit_groups`` (stage order)."""
        out = []
        if any(st.stage == 0 for st in self.stages):
            out.append(self.unit_groups[0][0])
        if any(st.final_norm or st.head for st in self.stages) and len(self.unit_groups) > len(out):
            out.append(self.unit_groups[-1][0])
        return tuple(out)

    def largest_unit_numels(self, n: int) -> list[int]:
        """The element counts of the ``n`` largest units, largest first (fewer when it holds fewer)."""
        return largest_numels(((unit_numel(u), count) for u, count in self.unit_groups), n)


def unit_numel(tensors: Tensors) -> int:
    """Elements of one unit (the sum of its tensors)."""
    return sum(a * b for a, b in tensors)


def largest_numels(groups, n: int) -> list[int]:
    """The ``n`` largest values of (value, count) groups with their multiplicity, largest first."""
    out: list[int] = []
    for value, count in sorted(groups, key=lambda g: g[0], reverse=True):
        out.extend([value] * min(count, n - len(out)))
        if len(out) >= n:
            break
    return out


def params_per_rank(cfg: Config) -> tuple[tuple[RankParams, ...], ...]:
    """What each pipeline rank and each TP shard holds: ``result[pp_rank][tp_rank]``.

    Under expert parallelism every rank of one (pp-rank, tp-rank) holds a different E / ep of
    the experts, but as many of them: the counts are the same on every EP rank."""
    par = cfg.parallel
    if cfg.model.experts > 0:
        return _moe_params_per_rank(cfg.model, par.tp, par.pp, par.virtual_stages, placement_style(par.schedule),
                                    par.pipeline_split, par.ep, par.expert_shard_degree)
    return _params_per_rank(cfg.model, par.tp, par.pp, par.virtual_stages,
                            placement_style(par.schedule), par.pipeline_split)


@lru_cache(maxsize=128)
def _moe_params_per_rank(model: ModelSpec, tp: int, pp: int, v: int, style: str, pipeline_split: str, ep: int,
                         expert_degree: int, tp_ranks: int = 0) -> tuple[tuple[RankParams, ...], ...]:
    """As ``_params_per_rank`` for a mixture of experts: stages hold dense and MoE blocks by layer
    index (the first ``dense_layers`` are dense), the routed experts counted apart. ``tp_ranks``
    > 0 lists only the first that many TP ranks (the planner's bounds need tp-rank 0 alone)."""
    n_stages = pp * v
    split = split_layers(model.layers, n_stages, pipeline_split)
    owners = stages_of_pp_rank(n_stages, pp, style)
    dense = layer_tensors(model, tp)
    moe = layer_tensors(model, tp, True, ep, expert_degree)
    experts_unit = local_expert_tensors(model, ep, expert_degree) if ep > 1 else ()
    routed_tp = expert_tensors(model, model.experts, tp) if ep == 1 else ()
    expert_numel = _numel(experts_unit) if ep > 1 else _numel(routed_tp)
    moe_rest = _numel(moe) - (expert_numel if ep == 1 else 0)
    h = model.hidden
    vocab_rows = chunk_sizes(model.vocab, tp)
    norm = norm_tensors(model, h)
    norm_numel = _norm_params(model)
    head_is_copy = model.tied_embeddings and n_stages > 1
    # the routed experts' matrices counted by ``expert_weight_numel`` (in ``moe`` without ep, in their own unit with it)
    w_experts = (expert_weight_numel(model, model.experts, tp) if ep == 1
                 else expert_weight_numel(model, model.experts // ep))
    w_dense = _weight_numel(dense)
    w_moe = _weight_numel(moe) - (_weight_numel(routed_tp) if ep == 1 else 0) + w_experts
    n_moe_of = [sum(1 for i in split[s] if model.is_moe_layer(i)) for s in range(n_stages)]
    out = []
    for pp_rank, stages in enumerate(owners):
        row = []
        built: dict[int, RankParams] = {}  # TP ranks with the same vocabulary chunk hold the same
        for tp_rank in range(tp_ranks or tp):
            rows = vocab_rows[tp_rank]
            if rows in built:
                row.append(replace(built[rows], tp_rank=tp_rank))
                continue
            per_stage: list[StageParams] = []
            groups: list[tuple[Tensors, int]] = []
            weights = expert_weights = 0
            for s in stages:
                first, last = s == 0, s == n_stages - 1
                layers = split[s]
                n_moe = n_moe_of[s]
                n_dense = len(layers) - n_moe
                emb = rows * h if first else 0
                pos = model.seq_len * h if first and model.position == "learned" else 0
                head = rows * h if last and (not model.tied_embeddings or head_is_copy) else 0
                per_stage.append(StageParams(stage=s, layers=len(layers), embedding=emb, position=pos,
                                             blocks=n_dense * _numel(dense) + n_moe * moe_rest,
                                             final_norm=norm_numel if last else 0, head=head,
                                             experts=n_moe * expert_numel, moe_layers=n_moe))
                weights += n_dense * w_dense + n_moe * w_moe
                expert_weights += n_moe * w_experts
                if first:
                    _append_units(groups, ((rows, h),) + (((model.seq_len, h),) if pos else ()), 1)
                _append_units(groups, dense, n_dense)  # the dense blocks lead
                _append_units(groups, moe, n_moe)
                if ep > 1:  # each MoE block's experts are a unit of their own, after it
                    _append_units(groups, experts_unit, n_moe)
                if last:
                    _append_units(groups, norm + (((rows, h),) if head else ()), 1)
            n_moe_rank = sum(st.moe_layers for st in per_stage)
            built[rows] = RankParams(pp_rank=pp_rank, tp_rank=tp_rank, stages=tuple(per_stage), block_tensors=dense,
                                     unit_groups=_merge_alternating(groups),
                                     expert_units=((experts_unit, n_moe_rank),) if ep > 1 and n_moe_rank else (),
                                     matmul_weights=weights, expert_matmul_weights=expert_weights)
            row.append(built[rows])
        out.append(tuple(row))
    return tuple(out)


def _merge_alternating(groups: list[tuple[Tensors, int]]) -> tuple[tuple[Tensors, int], ...]:
    """Groups as given: a MoE block and its expert unit alternate (one group each per block);
    what the engine asks of the groups (sums, largest units, counts) does not depend on order."""
    merged: dict[Tensors, int] = {}
    order: list[Tensors] = []
    for u, c in groups:
        if u not in merged:
            order.append(u)
            merged[u] = 0
        merged[u] += c
    return tuple((u, merged[u]) for u in order)


@lru_cache(maxsize=128)
def _params_per_rank(model: ModelSpec, tp: int, pp: int, v: int, style: str,
                     pipeline_split: str = "even") -> tuple[tuple[RankParams, ...], ...]:
    n_stages = pp * v
    split = split_layers(model.layers, n_stages, pipeline_split)
    owners = stages_of_pp_rank(n_stages, pp, style)
    block = layer_tensors(model, tp)
    block_numel = sum(a * b for a, b in block)
    h = model.hidden
    vocab_rows = chunk_sizes(model.vocab, tp)
    norm = ((h, 1), (h, 1)) if model.norm == "layernorm" else ((h, 1),)
    norm_numel = _norm_params(model)
    head_is_copy = model.tied_embeddings and n_stages > 1
    out = []
    for pp_rank, stages in enumerate(owners):
        row = []
        for tp_rank in range(tp):
            rows = vocab_rows[tp_rank]
            per_stage: list[StageParams] = []
            groups: list[tuple[Tensors, int]] = []
            for s in stages:
                first, last = s == 0, s == n_stages - 1
                emb = rows * h if first else 0
                pos = model.seq_len * h if first and model.position == "learned" else 0
                head = rows * h if last and (not model.tied_embeddings or head_is_copy) else 0
                per_stage.append(StageParams(stage=s, layers=len(split[s]), embedding=emb, position=pos,
                                             blocks=len(split[s]) * block_numel,
                                             final_norm=norm_numel if last else 0, head=head))
                if first:
                    _append_units(groups, ((rows, h),) + (((model.seq_len, h),) if pos else ()), 1)
                _append_units(groups, block, len(split[s]))
                if last:
                    _append_units(groups, norm + (((rows, h),) if head else ()), 1)
            row.append(RankParams(pp_rank=pp_rank, tp_rank=tp_rank, stages=tuple(per_stage),
                                  block_tensors=block, unit_groups=tuple(groups)))
        out.append(tuple(row))
    return tuple(out)


def _append_units(groups: list[tuple[Tensors, int]], unit: Tensors, count: int) -> None:
    """Add ``count`` copies of ``unit`` after the last group (merged with it when it is the same unit)."""
    if count <= 0:
        return
    if groups and groups[-1][0] == unit:
        groups[-1] = (unit, groups[-1][1] + count)
    else:
        groups.append((unit, count))


# --------------------------------------------------------------------------- ZeRO-1 in torch


def rank_tensor_groups(rp: RankParams) -> tuple[tuple[int, int], ...]:
    """(numel, count) of the parameter tensors a (pp-rank, tp-rank) holds: every tensor of its FSDP
    units, equal sizes merged, largest first."""
    return tensor_groups((a * b, count) for u, count in rp.unit_groups for a, b in u)


def tensor_groups(groups) -> tuple[tuple[int, int], ...]:
    """(numel, count) pairs with equal numels merged, largest first (zero counts dropped)."""
    merged: dict[int, int] = {}
    for numel, count in groups:
        if count:
            merged[numel] = merged.get(numel, 0) + count
    return tuple(sorted(merged.items(), reverse=True))


def zero_redundancy_partition(groups, degree: int) -> list[int]:
    """Elements each of ``degree`` ranks owns under torch's ZeroRedundancyOptimizer, given the
    tensors as (numel, count) groups.

    Its ``_partition_parameters``: whole tensors, largest first (a stable sort by numel), each to
    the rank with the fewest elements so far (the lowest such rank on ties). Unlike DeepSpeed's
    flat ZeRO-1 split, ranks differ; the sum is exact. Equal-size tensors are interchangeable, so
    their order cannot change the per-rank sums.

    Exact without a per-tensor loop: handing ``c`` tensors of ``n`` elements out greedily offers
    rank ``r`` the keys (size_r + j·n, r), j = 0, 1, … in increasing order, and each tensor goes
    to the smallest key on offer — a merge of ``degree`` sorted sequences, so the ``c`` tensors
    go to the ``c`` smallest keys of all ranks, which ``_hand_out_equal`` counts in closed form.
    """
    return list(zero_redundancy_shares(groups, degree))


def zero_redundancy_shares(groups, degree: int) -> tuple[int, ...]:
    """``zero_redundancy_partition`` as a tuple, the same object for the same tensors and degree (every
    distinct rank of a prediction asks for it; what is counted of it once is then found again)."""
    if degree < 1:
        raise ValueError(f"degree must be at least 1, got {degree}")
    return _partition(tensor_groups(groups), degree)


def zero_redundancy_largest(groups, degree: int, rank: int, n: int = 2) -> list[int]:
    """The ``n`` largest tensors (element counts, largest first) that dp-rank ``rank`` owns under the
    greedy partition of ``zero_redundancy_partition``: its first ``n``, since tensors go out largest
    first. A rank that owns nothing yet has the least elements (tensors are not empty), so the first
    ``degree`` tensors go to ranks 0, 1, … in order; then each to the least-loaded (lowest on ties).
    Costs at most one step per tensor of the rank."""
    out: list[int] = []
    fresh, heap = 0, []  # the lowest rank that owns nothing; (elements, rank) of those that own some
    for numel, count in tensor_groups(groups):
        if numel <= 0:
            continue
        for _ in range(count):
            if fresh < degree:
                r, load = fresh, numel
                fresh += 1
                heapq.heappush(heap, (load, r))
            else:
                load, r = heap[0]
                heapq.heapreplace(heap, (load + numel, r))
            if r == rank:
                out.append(numel)
                if len(out) == n:
                    return out
    return out


#: from this many ranks on, the partition is computed with numpy, every group in closed form
#: (``_hand_out_equal_np``): O(degree) array work per tensor group instead of Python loops
NUMPY_PARTITION_RANKS = 4096


@lru_cache(maxsize=256)
def _partition(groups: tuple[tuple[int, int], ...], degree: int,
               numpy_from: int = NUMPY_PARTITION_RANKS) -> tuple[int, ...]:
    if degree >= numpy_from:
        import numpy as np  # only for very many ranks: the CLI's light commands never get here

        arr = np.zeros(degree, dtype=np.int64)
        for n, c in groups:  # largest first
            if n == 0:
                continue
            _hand_out_equal_np(arr, n, c)
        return tuple(arr.tolist())
    sizes = [0] * degree
    for n, c in groups:  # largest first
        if n == 0 or degree == 1:
            sizes[0] += n * c
        elif c <= degree:  # a few tensors: one at a time, the least-loaded (size, rank) first
            heap = [(x, r) for r, x in enumerate(sizes)]
            heapq.heapify(heap)
            for _ in range(c):
                x, r = heap[0]
                heapq.heapreplace(heap, (x + n, r))
            for x, r in heap:
                sizes[r] = x
        else:
            _hand_out_equal(sizes, n, c)
    return tuple(sizes)


def _hand_out_equal_np(sizes, n: int, c: int) -> None:
    """``_hand_out_equal`` on an int64 array, in place: the same levels, found with a sort and a
    cumulative sum, the remaining keys at level K in (ρ_r, r) order with a lexsort."""
    import numpy as np

    q = sizes // n
    qs = np.sort(q)
    prefix = np.cumsum(qs)
    i = np.arange(1, len(qs) + 1, dtype=np.int64)
    reach = np.empty(len(qs), dtype=bool)
    reach[:-1] = i[:-1] * qs[1:] - prefix[:-1] >= c  # the c-th key lies below level q_(i+1)
    reach[-1] = True
    k = int(np.argmax(reach))
    level = -(-(c + int(prefix[k])) // (k + 1)) - 1  # the largest K with i·K − Σq < c
    below = np.maximum(0, level - q)
    left = c - int(below.sum())
    if left:
        at = np.flatnonzero(q <= level)
        order = at[np.lexsort((at, sizes[at] % n))]
        below[order[:left]] += 1
    sizes += below * n


def _hand_out_equal(sizes: list[int], n: int, c: int) -> None:
    """Give ``c`` tensors of ``n`` > 0 elements to the ``c`` smallest keys (size_r + j·n, r), j ≥ 0.

    With size_r = q_r·n + ρ_r (0 ≤ ρ_r < n), rank r's keys sit at levels k = q_r, q_r + 1, … (value
    k·n + ρ_r); keys order by level, then by (ρ_r, r) within a level. Below level K there are
    Σ max(0, K − q_r) keys: find the level K where the c-th key lies, give every rank its keys
    below K, and the remaining ones at level K to its ranks in (ρ_r, r) order.
    """
    q = sorted(x // n for x in sizes)
    prefix = 0
    for i, qi in enumerate(q, start=1):  # levels [q_(i), q_(i+1)): the i lowest ranks take part
        prefix += qi
        nxt = q[i] if i < len(q) else None
        if nxt is None or i * nxt - prefix >= c:  # the c-th key lies below level q_(i+1)
            level = -(-(c + prefix) // i) - 1  # the largest K with i·K − Σq < c
            break
    below = [max(0, level - x // n) for x in sizes]
    left = c - sum(below)
    at_level = sorted((x % n, r) for r, x in enumerate(sizes) if x // n <= level)
    for _, r in at_level[:left]:
        below[r] += 1
    for r, k in enumerate(below):
        sizes[r] += k * n
