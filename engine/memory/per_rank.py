"""``memory_per_rank(cfg)``: every rank of the world, its categories and the terms behind them.

It answers "does it fit, and on which GPU does it not?". One rank's body is assembled from the
modules of this package in order: model states (``states``, by accounting), activations
(``activations``) at the microbatches in flight of its stages (``in_flight``), communication
buffers (``buffers``); then the terms are laid on the rank's step (``lifetimes``): its peak is the
moment with the most live tracked bytes and its categories the snapshot of the terms alive then;
then the device overhead (``overhead``: its allocator slack is a fraction of the peak's bytes) and
the caching allocator's reserve (``overhead.reserved_bytes``: the step's allocation events replayed). Ranks that hold the same thing (DP replicas, TP shards with equal vocab
chunks) share one computed body; under torch's ZeroRedundancyOptimizer DP ranks hold different
optimizer shares, so each dp-rank gets its own; under a measured expert load
(``conventions.moe_expert_load``) EP ranks route different token counts, so each ep-rank does. Rank order is ``engine.pipeline.layout.rank_coords``':
TP innermost, then CP, then DP, then PP.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import numpy as np

from engine.config import Config
from engine.memory.activations import (
    TABLE_RECOMPUTE,
    cp_ranks_differ,
    layer_activation_terms,
    loss_vocab,
    moe_layer_terms,
    shape_of,
    stage_activation_terms,
)
from engine.memory.buffers import comm_buffers
from engine.memory.conventions import conventions_of
from engine.memory.in_flight import microbatches_in_flight
from engine.memory.lifetimes import (
    ACTION,
    Grain,
    RankTimeline,
    _pieces,
    fsdp_params_lifetime,
    lifetime_overrides,
    sig_moments,
)
from engine.memory.overhead import overhead, reserved_bytes
from engine.memory.report import LazyRanks, MemoryReport, RankGroup, RankMemory, RankSet, Terms, _Body, ceil_div
from engine.memory.states import (
    ACCOUNTINGS,
    fsdp2_optimizer_shares,
    lora_states,
    lora_unit_groups,
    per_stage_gradients,
    plain_first_backward,
    plain_grads_late,
    replicate_expert_grads,
    zero1_shares,
)
from engine.model.params import RankParams, params_per_rank, unit_numel
from engine.names import SPLIT_BACKWARD_SCHEDULES
from engine.pipeline.layout import split_layers
from engine.pipeline.schedules import ACTION_KINDS
from engine.wrapping import WrappingPlan, forward_after_first_backward, wrapping_plan


def rank_body(cfg: Config, rp: RankParams, dp_rank: int = 0, plan: WrappingPlan | None = None,
              ep_rank: int | None = None) -> _Body:
    """The categories and terms of one rank holding ``rp`` (its dp-rank matters under ZeRO-1 only,
    its ep-rank under a measured expert load only); ``plan`` is ``wrapping_plan(cfg)``, computed
    when not given."""
    par, tr = cfg.parallel, cfg.training
    plan = plan or wrapping_plan(cfg)
    torch_acc = cfg.conventions.state_accounting == "pytorch"
    T = Terms()
    rp0 = rp
    where = f"stage{'s' if len(rp.stages) > 1 else ''} {', '.join(map(str, rp.stage_indices))}"
    psi = psi_train = rp.total  # psi_train: elements that get a gradient (DDP buckets, unsharded gradients)
    train_units = tuple((unit_numel(u), count) for u, count in rp.unit_groups)  # (elements, units)
    if tr.finetune == "lora":
        psi_train = lora_states(cfg, plan, rp, dp_rank, T, where)
        adapters = lora_unit_groups(cfg, rp)
        train_units = tuple((unit_numel(a), count) for a, count in adapters)
        psi = psi + psi_train  # every parameter the rank holds (FSDP2 gathers the frozen base too)
        rp = replace(rp, unit_groups=tuple((u + a, count) for (u, count), (a, _) in zip(rp.unit_groups, adapters)))
    else:
        ACCOUNTINGS[cfg.conventions.state_accounting](cfg, plan, rp, dp_rank, T, where)

    def in_flight(unit_bytes: list[int]) -> tuple[int, ...]:
        return microbatches_in_flight(par.schedule, rp.pp_rank, par.pp, par.virtual_stages, par.microbatches,
                                      unit_bytes)

    stream = stage_activation_terms(cfg, rp, T, torch_acc=torch_acc, autocast=torch_acc and plan.autocast,
                                    psi_train=psi_train, in_flight=in_flight, ep_rank=ep_rank, plain_grads=not plan.fsdp2)
    comm_buffers(cfg, plan, rp, T, psi=psi, psi_train=psi_train, train_units=train_units, ep_rank=ep_rank,
                 **stream)
    after_backward = plan.unsharded_after_first_backward and forward_after_first_backward(cfg, rp.pp_rank)
    timeline = dict(schedule=par.schedule, pp_rank=rp.pp_rank, pp=par.pp, virtual_stages=par.virtual_stages,
                    microbatches=par.microbatches, stages=rp.stage_indices,
                    fsdp_params=fsdp_params_lifetime(plan.sharded, plan.reshard_after_forward, after_backward,
                                                       plan.pipelined, per_stage_gradients(plan, rp)),
                    overrides=lifetime_overrides(plan.unsharded_after_first_backward, plan.sharded,
                                                 plan.reshard_after_forward, len(rp.stages), plan.pipelined,
                                                 plain_grads_late(cfg, plan)
                                                 or (replicate_expert_grads(cfg, plan) and rp.experts > 0),
                                                 par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES,
                                                 plan.converts_gradients, all(st.layers <= 1 for st in rp.stages),
                                                 _moe_late_dense(cfg, plan, rp)))
    if ep_rank is not None and _load_per_microbatch(cfg):
        # a measured load per microbatch: the MoE blocks of each stage follow the microbatches in
        # flight at the peak (the moment found at the load averaged over microbatches; the allocation
        # grain does not move a peak, so that first timeline goes without it), laid again
        alive = microbatches_alive_at(RankTimeline(T, **timeline))
        T = Terms()
        if tr.finetune == "lora":
            lora_states(cfg, plan, rp0, dp_rank, T, where)
        else:
            ACCOUNTINGS[cfg.conventions.state_accounting](cfg, plan, rp0, dp_rank, T, where)
        stream = stage_activation_terms(cfg, rp, T, torch_acc=torch_acc, autocast=torch_acc and plan.autocast,
                                        psi_train=psi_train, in_flight=in_flight, ep_rank=ep_rank, plain_grads=not plan.fsdp2,
                                        moe_microbatches=alive)
        comm_buffers(cfg, plan, rp, T, psi=psi, psi_train=psi_train, train_units=train_units, ep_rank=ep_rank,
                     **stream)
    tl = RankTimeline(T, **timeline, grain=allocation_grain(cfg, rp, T))
    # laid before the overhead (not tensors: the peak does not depend on it); its slack is a fraction
    # of the peak's tracked bytes
    allocated = tl.peak.bytes
    overhead(cfg, T, allocated)
    snapshot = tl.snapshot()
    return _Body(snapshot, rp.stage_indices, rp.pp_rank, catalogue=T, allocated=allocated,
                 reserved=lambda: reserved_bytes(cfg, tl, allocated, snapshot), timeline=tl)


def _moe_late_dense(cfg: Config, plan: WrappingPlan, rp: RankParams) -> bool:
    """Whether the late-backward moment of a first backward with plain gradients on a rank of one stage (its first
    block's backward, ``buffers._plain_late_backward``) is in a block without experts, on a model with them."""
    par, m = cfg.parallel, cfg.model
    if not (m.experts and plain_first_backward(cfg, plan, rp)):
        return False
    layers = split_layers(m.layers, par.num_stages, par.pipeline_split)[rp.stages[0].stage]
    return bool(layers) and not m.is_moe_layer(min(layers))


def _load_per_microbatch(cfg: Config) -> bool:
    """Whether ``conventions.moe_expert_load`` is given per microbatch (lists of lists of lists)."""
    load = cfg.conventions.moe_expert_load
    return cfg.parallel.ep > 1 and bool(load) and isinstance(load[0], tuple) and isinstance(load[0][0], tuple)


def microbatches_alive_at(tl: RankTimeline) -> dict[int, tuple[int, ...]]:
    """Per global stage of the rank, the microbatches whose activations are alive at its peak moment
    (forward done, full backward or W not yet done; the peak action's own microbatch counts). Only the
    actions' own moments free: a loss moment opens its B (nothing freed yet), and at the end-of-backward
    moment nothing is alive (the MoE blocks then follow every microbatch)."""
    sig, pk = tl.signature, tl.peak
    mo = sig_moments(sig)
    stages = sig.stages if sig.pp > 1 else (sig.stages[0],)
    out: dict[int, tuple[int, ...]] = {}
    for st in stages:
        local = st if sig.pp > 1 else 0
        alive = set()
        for i in range(pk.moment + 1):
            if int(mo.stage[i]) != local or (i < pk.moment and mo.phase[i] != ACTION):
                continue
            kind, mb = ACTION_KINDS[int(mo.kind[i])], int(mo.microbatch[i])
            if kind == "F":
                alive.add(mb)
            elif kind in ("B", "W") and i < pk.moment:
                alive.discard(mb)
        out[st] = tuple(sorted(alive))
    return out


def allocation_grain(cfg: Config, rp: RankParams, T: Terms) -> Grain | None:
    """What the rank's allocation events lay block by block (``lifetimes.Grain``): one block's saved
    bytes and the two largest tensors its forward makes (``activations``' table under the configured
    policy and under recompute = "none"; full recompute keeps the block input), the blocks of each
    local stage, and the last stage's logits in the compute dtype before the loss's fp32 copy. One
    piece per block rather than one per tensor: on the published and fake configs the replay reserves
    within 2.5 % of what a tensor-by-tensor grain gives, at a fraction of its events (a first
    prediction of a 64-rank 405B layout: 0.17 s instead of 1.1 s). None on CPU ranks (gloo: no
    caching allocator replays their events)."""
    if cfg.cluster.gpu.name == "cpu":
        return None
    sh = shape_of(cfg, rp.cp_rank)
    kept, work = _block_tensors(sh, cfg.training.recompute)
    recomputed = ()
    if cfg.model.experts:
        moe = _moe_block_pieces(cfg, sh)
        if cfg.training.recompute in TABLE_RECOMPUTE:
            kept = moe
        # a recomputed block with experts is its tensors, the largest an expert's internals, not the dense block's
        recomputed = (max(moe),)
        work = _moe_block_work(cfg, sh)
    blocks = tuple(st.layers for st in sorted(rp.stages, key=lambda st: st.stage))
    logits = piece = shard = gather = 0
    if cfg.conventions.state_accounting == "pytorch":
        tokens = cfg.local_seq_len * cfg.training.micro_batch_size
        piece = 4 * tokens * loss_vocab(cfg, sp=sh.sp, torch_acc=True)
        logits = 0 if sh.act == 4 else piece // 4 * sh.act
        t = cfg.parallel.tp
        if t > 1 and not sh.sp:  # the head's output gathered for the loss (Grain: Shard(-1) → Replicate)
            shard = sh.act * tokens * ceil_div(cfg.model.vocab, t)
            gather = t * shard
    return Grain(kept, work, blocks if cfg.parallel.pp > 1 else (sum(blocks),), logits, piece, shard, gather,
                 T.optimizer_step, T.root_end,
                 tuple(T.split_backward_pieces.get(st.stage, ()) for st in sorted(rp.stages, key=lambda st: st.stage)),
                 T.reduce_gross,
                 tuple(T.freed_at_input_pieces.get(st.stage, ()) for st in sorted(rp.stages, key=lambda st: st.stage)),
                 recomputed, T.root_gather,
                 tuple(T.weight_pass_piece.get(st.stage, 0) for st in sorted(rp.stages, key=lambda st: st.stage)),
                 T.input_backward_piece, T.float8_piece)


#: how many of the tensors a block's forward makes the events lay as its transients (the largest)
TRANSIENTS = 2


@lru_cache(maxsize=256)
def _block_tensors(sh, recompute: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(saved, made) of one block's forward, one microbatch (``allocation_grain``): its saved bytes as
    one piece, and the two largest tensors its forward makes (the activation table at recompute =
    "none"), which it frees as it goes."""
    work = [x for _, x, _ in layer_activation_terms(replace(sh, recompute="none"))[0]]
    if recompute in TABLE_RECOMPUTE:
        kept = sum(x for _, x, _ in layer_activation_terms(sh)[0])
    elif recompute == "full":
        kept = work[0]  # the block input
    else:  # selective-layer: the plain blocks keep everything, the checkpointed ones their input
        kept = sum(work)
    return (kept,), tuple(sorted(work, reverse=True)[:TRANSIENTS])


def _moe_tensor_sizes(cfg: Config, sh, rows: list) -> list[int]:
    """The size of one tensor of each of a MoE block's experts' ``rows`` (``moe_layer_terms``): a row of one tensor per
    local expert (and matrix, or internal) holds that many."""
    e_loc = max(1, cfg.model.experts // max(cfg.parallel.ep, 1))
    mats = 3 if sh.swiglu else 2
    out = []
    for label, x, _ in rows:
        n = (2 * mats - 2) * e_loc if label.startswith("MoE: experts' ") else (
            mats * e_loc if label.startswith("MoE: the local experts' 16-bit weight casts") else 1)
        out.append(x // n)
    return out


def _moe_block_work(cfg: Config, sh) -> tuple[int, ...]:
    """The two largest tensors a block with experts makes in its forward (``allocation_grain``'s transients): of its
    attention half's (the dense table at recompute = "none") and its experts' (``moe_layer_terms`` at "none": the
    dispatched tokens, the fp32 expert outputs the combine keeps), not the dense table's MLP rows, which such a block
    does not make. (measure --fake of Qwen3 235B-A22B ep32 full recompute: each block's forward allocates 512 MiB
    dispatched tokens and 1 GiB fp32 outputs, where the dense rows gave 256 and 192 MiB)"""
    attention = [x for _, x, part in layer_activation_terms(replace(sh, recompute="none"))[0]
                 if part in ("norm1", "attention", "norm2")]
    experts = _moe_tensor_sizes(cfg, sh, moe_layer_terms(cfg, recompute="none")[0])
    return tuple(sorted(attention + experts, reverse=True)[:TRANSIENTS])


def _moe_block_pieces(cfg: Config, sh) -> tuple[int, ...]:
    """What one MoE block's forward saves, one microbatch, for the allocation events (``allocation_grain``): equal
    pieces the size of its largest tensor, not one piece as a dense block's. Its tensors are many (the experts'
    internals and weight casts one per local expert, ``activations.moe_layer_terms``), and the backward's gradients
    and the optimizer step's temporaries then ask for more than any of them: freed, they serve none of those
    requests, which a cache of one piece a block would (``measure --fake`` of Mixtral 8x7B dp16 ep4 DDP: its forward's
    64–256 MiB segments, the experts' 448 MiB gradients and AdamW's temporaries each a new segment; reserved −15.8 %
    with one piece a block). Pieces of the largest tensor rather than each tensor: what a later request can reuse is
    decided by the largest freed blocks, and a pipelined rank's replay stays as cheap as its steady state allows."""
    attention = [x for _, x, part in layer_activation_terms(sh)[0] if part in ("norm1", "attention", "norm2")]
    experts = moe_layer_terms(cfg)[0]
    largest = max(attention + _moe_tensor_sizes(cfg, sh, experts), default=0)
    total = sum(attention) + sum(x for _, x, _ in experts)
    return tuple(_pieces(total, (1,) * -(-total // largest))) if largest else (total,)


def _share_classes(sizes) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Each dp index's share class (classes numbered in order of first appearance) and each class's dp
    indices, in numpy (131,072 dp ranks in milliseconds)."""

    arr = np.asarray(sizes, dtype=np.int64)
    _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(len(first))
    share = rank_of[inverse]
    order = np.argsort(share, kind="stable")
    bounds = np.cumsum(np.bincount(share, minlength=len(first)))[:-1]
    return tuple(share.tolist()), [tuple(x.tolist()) for x in np.split(order, bounds)]


def memory_per_rank(cfg: Config) -> MemoryReport:
    """Memory of every rank 0..world−1, by category, with the terms behind each number.

    Only the distinct bodies are computed, and ``per_rank`` makes each rank's RankMemory when asked
    (``report.LazyRanks``): the cost does not grow with the world. A pipeline rank's ranks differ
    by their TP shard (its vocabulary chunk), under torch's ZeroRedundancyOptimizer by their dp-rank's
    optimizer share, under a measured expert load by their ep-rank (``rank mod ep``), and under the per-op
    policy over the ring attention by their cp-rank."""
    par = cfg.parallel
    capacity = cfg.cluster.gpu.memory_bytes
    grid = params_per_rank(cfg)
    plan = wrapping_plan(cfg)
    # torch's ZeroRedundancyOptimizer gives DP ranks different shares: one body per share then
    per_dp = cfg.conventions.state_accounting == "pytorch" and par.zero == 1 and par.dp > 1
    # FSDP2 leaves the last shard ranks short where a dim 0 does not divide the shard degree: their
    # optimizer states are smaller (states.fsdp2_optimizer_shares); one body per share then
    fsdp_dp = (cfg.conventions.state_accounting == "pytorch" and plan.fsdp2 and par.zero in (2, 3)
               and cfg.training.finetune != "lora")
    # a measured expert load: EP ranks route different token counts, so each ep-rank gets its own body
    # (the sparse mesh puts ep innermost over the dense region: ep-rank = rank mod ep)
    by_ep = bool(cfg.conventions.moe_expert_load) and par.ep > 1
    # the per-op policy over the ring attention: each cp-rank its own body (``activations.cp_ranks_differ``)
    by_cp = cp_ranks_differ(cfg)
    row = par.cp * par.tp  # the ranks of one dp index inside a pipeline rank's block
    block = par.dp * row
    # offsets x ≡ j (mod period) share a body (x = dp index · row + cp index · tp + tp index)
    period = math.lcm(row if by_cp else par.tp, par.ep if by_ep else 1)
    bodies: dict[tuple[int, int, int], _Body] = {}  # (pp rank, offset residue j, share class) -> body
    # per pp rank, per offset residue j: each dp index's share class (ZeroRedundancyOptimizer partitions
    # each TP shard's own tensors)
    share_class: list[dict[int, tuple[int, ...]]] = []
    groups = []
    for pp_rank, rps in enumerate(grid):
        share_class.append({})
        # TP shards differ only by their vocabulary chunk; EP ranks by their rank mod ep
        residues: dict[tuple[int, int, int], list[int]] = {}
        for j in range(period):
            residues.setdefault((grid[pp_rank][j % par.tp].total, j % par.ep if by_ep else -1,
                                 j // par.tp % par.cp if by_cp else 0), []).append(j)
        for (_, ep_rank, cp_rank), js in residues.items():
            rp = rps[js[0] % par.tp]
            if by_cp:  # (a new RankParams only then: its cached sums start afresh)
                rp = replace(rp, cp_rank=cp_rank)
            shares = zero1_shares(cfg, rp) if per_dp else fsdp2_optimizer_shares(cfg, rp) if fsdp_dp else None
            if shares is not None:
                share, dp_sets = _share_classes(shares)
                share_class[pp_rank].update((j, share) for j in js)
            else:
                dp_sets = [None]
            for cls, dps in enumerate(dp_sets):
                ranks = RankSet(block, row, (pp_rank,), period, tuple(js), dps)
                first = next(iter(ranks), None)
                if first is None:  # a share class none of these residues' dp indices is in (EP ranks apart)
                    continue
                body = rank_body(cfg, rp, dps[0] if dps else 0, plan, ep_rank if by_ep else None)
                for j in js:
                    bodies[pp_rank, j, cls] = body
                groups.append(RankGroup(RankMemory(first, first % par.tp, first % block // row, body, capacity),
                                        ranks))

    def locate(rank: int) -> tuple[int, int, _Body]:
        pp_rank, x = divmod(rank, block)
        d = x // row
        j = x % period
        share = share_class[pp_rank].get(j)
        return x % par.tp, d, bodies[pp_rank, j, share[d] if share is not None else 0]

    return MemoryReport(per_rank=LazyRanks(par.world_size, locate, capacity), capacity_bytes=capacity,
                        conventions=conventions_of(cfg), groups=tuple(groups))
