"""Communication buffers: DDP's gradient buckets, FSDP2's unsharded units, all-gather and
reduce-scatter buffers, and the pipeline's p2p receive buffers.

Conventions:
* DDP: the Reducer's flat buckets cover every gradient (``conventions.ddp_bucket_mb`` sets
  their count), none under ``gradient_as_bucket_view``; they take the gradients' dtype (fp32
  under autocast). They are all the memory DDP adds: the Reducer writes each gradient into its
  bucket (what looked like a gradient-sized temporary of the synchronised backward was the
  bucket, first seen there by MemTracker).
* FSDP2 (``engine.wrapping``: fully_shard, or replicate for DP × TP): one unit per block, one
  for the embeddings, one for final norm + head. The 16-bit gathered copy is comm_buffers
  (every unit under ZeRO-2, replicate, ZeRO-3 not resharded after forward, and under pipelining
  once the rank runs forwards after its first backward; current + prefetched unit under ZeRO-3
  resharding after forward, with ``conventions.fsdp_prefetch``), plus one unit's all-gather
  output and the unsharded gradients (every unit under pipelining or with m > 1, as FSDP2
  accumulates unsharded without sync, in the reduce dtype when it differs from the parameter
  dtype; one unit's reduce-scatter input otherwise). float8 all-gather: the blocks' Linear
  weights are gathered and held in 1 byte, plus an fp32 scale per weight.
* "zero-paper": one unit's reduce-scatter input; under ZeRO-3 one unit's all-gather input and
  the unsharded parameters of the current (+ prefetched) unit as temporaries.
* Pipeline: torch allocates one receive buffer per microbatch for activations and for gradients.
* Expert parallelism: one MoE layer's all-to-all send and receive buffers (``moe_dispatch_buffers``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from engine.config import Config
from engine.memory.activations import (
    TABLE_RECOMPUTE,
    attention_phase_of_fresh_gradients,
    first_weight_end_terms,
    forward_transient_bytes,
    layer_activation_terms,
    mlp_and_out_proj_elements,
    mlp_phase_parts,
    shape_of,
)
from engine.memory.lifetimes import BLOCK_KINDS, HEAD_KINDS, STAGE_OUTPUT_KINDS
from engine.memory.report import MB, Terms, ceil_div
from engine.memory.states import per_stage_gradients, plain_first_backward, stage_shares
from engine.model.params import (
    RankParams,
    Tensors,
    largest_numels,
    layer_tensors,
    mlp_tensors,
    sharded_numel,
    unit_numel,
)
from engine.model.routing import moe_tokens
from engine.names import SPLIT_BACKWARD_SCHEDULES
from engine.pipeline.layout import split_layers
from engine.wrapping import PLAN_DTYPE_BYTES, WrappingPlan, forward_after_first_backward


def _unit_sizes(rp: RankParams) -> list[int]:
    """The two largest units, largest first: what FSDP2 holds gathered (current + prefetched)."""
    return rp.largest_unit_numels(2)


def float8_weight_numel(unit: Tensors, block: Tensors) -> tuple[int, int]:
    """(elements, tensors) of the float8 Linear weights in one FSDP unit: the block's weight matrices
    (q, k, v, o, gate, up, down) when the unit is a block (LoRA adapters appended after them stay in
    the compute dtype); none in the embeddings or the norm + head unit (torchtitan keeps "output" in
    high precision)."""
    if unit[:len(block)] != block:
        return 0, 0
    weights = [a * b for a, b in block if b > 1]
    return sum(weights), len(weights)


def padded_numel(tensors: Tensors, degree: int) -> int:
    """Elements of ``tensors`` with each dim 0 padded to a multiple of ``degree``: what FSDP2 gathers into
    and reduces from (``FSDPParam``'s padded sharded size × the shard degree: its all-gather output, the
    unsharded parameter's storage, the reduce-scatter input): ``degree`` × each rank's padded shard."""
    return degree * sharded_numel(tensors, degree)


def gathered_unit_bytes(plan: WrappingPlan, rp: RankParams, unit: Tensors, degree: int = 1) -> int:
    """Bytes FSDP2 gathers (and holds unsharded) for one unit sharded over ``degree`` ranks (each dim 0
    padded to a multiple of it): the compute dtype, or under float8 all-gather 1 B per Linear weight
    element plus one fp32 scale per weight (tensorwise)."""
    pd = plan.gathered_bytes
    numel = padded_numel(unit, degree)
    if not plan.float8_all_gather:
        return pd * numel
    f8, n_weights = float8_weight_numel(unit, rp.block_tensors)
    if f8:
        f8 = padded_numel(tuple(t for t in rp.block_tensors if t[1] > 1), degree)
    return pd * (numel - f8) + f8 + 4 * n_weights


def gather_degree(cfg: Config, plan: WrappingPlan, rp: RankParams, unit: Tensors) -> int:
    """The ranks FSDP2 shards ``unit`` over: the routed experts' own units under expert parallelism over
    efsdp, the others over the shard degree (dp_shard · cp); 1 where nothing is sharded (replicate)."""
    if not plan.sharded:
        return 1
    if cfg.parallel.ep > 1 and any(u == unit for u, _ in rp.expert_units):
        return cfg.parallel.expert_shard_degree
    return cfg.parallel.shard_degree


def _explain_units(sizes: list[int]) -> str:
    return " + ".join(f"{x:,} B" for x in sizes)


def _stage_walk(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms) -> tuple[int, int, int, int] | None:
    """(the stage's root units' gathered bytes, a block's, the stage's blocks, a block's saved bytes for one
    microbatch) for ``_current_units``' walk: a pipelined rank of one stage of two dense blocks or more; else None."""
    if not plan.pipelined or len(rp.stages) != 1 or rp.expert_units or any(st.moe_layers for st in rp.stages):
        return None
    st = rp.stages[0]
    if st.layers < 2:
        return None
    root = sum(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u in rp.root_units)
    block = max(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u))
                for u, _ in rp.unit_groups if u not in rp.root_units)
    saved = sum(t.bytes // max(t.in_flight or 1, 1) for t in T["activations"] if t.kind == "layers") // st.layers
    return root, block, st.layers, saved


#: the transients a B's moment (its first block's MLP backward) holds that its start does not
_B_MOMENT_KINDS = ("recomputed_block", "mlp_backward", "mlp_backward_freed", "fsdp_fresh_grad_made",
                   "blocks_output_gradient")


def _backward_walk_units(T: Terms, walk: tuple[int, int, int, int], f8: str) -> None:
    """What a B after a forward holds of a one-stage pipelined rank's units beyond its moment's (``_current_units``: the
    stage's root, the current block and the next one's all-gather output), at its most: at its start, the root's
    all-gather output kept to the first block's copy-out (FSDP2's implicit prefetch, as in a forward: the root's and
    the block's outputs beside both units), before any transient of the block's backward (measure --fake of Llama 3 8B
    pp2 1F1B ZeRO-3 reshard "always", selective recompute, stage 0's B of microbatch 1: 2 × 1,418 MiB); or at its
    i-th block, i more blocks kept gathered (set_reshard_after_backward(False)) and i blocks' saved tensors freed, and
    no output at the stage's last (full recompute: a unit outweighs a block's saved tensors, the 3rd block of 4 holds
    the most). Lifetime ``backward_after_forward``."""
    root, block, blocks, saved = walk
    moment = sum(t.bytes for c in ("activations", "temporaries", "comm_buffers") for t in T[c] if t.kind in _B_MOMENT_KINDS)
    start = root - max(moment, 0) if root else 0
    later = max(i * (block - saved) - (block if i == blocks - 1 else 0) for i in range(1, blocks))
    extra = max(start, later)
    if extra > 0:
        T.add("comm_buffers", "FSDP2 unsharded parameters in a B after a forward: " + (
              "at its start, the root's all-gather output kept to the first block's copy-out, before the block's "
              "transients" if start >= later else "the blocks it has run, kept gathered, beyond their saved tensors "
              "it freed (a later block of the B holds the most)") + f8, extra,
              f"max(the root's {root:,} B − the B moment's transients {moment:,} B, over its i-th block "
              f"i × ({block:,} B − {saved:,} B) less the last block's output)", kind="fsdp_units_kept_in_a_backward")


def _stage_units(rp: RankParams, st) -> int:
    """FSDP2 units one pipeline stage of this rank holds: its blocks (a MoE block's experts a unit of their own under
    expert parallelism), its embeddings' and its final norm's and head's (the stage module's own fully_shard). FSDP2
    prefetches within one root's units and each stage module is a root of its own, so a rank whose every stage holds
    one unit prefetches none (measure --fake of Llama 3 8B tp8 pp4 LoopedBFS v2 ZeRO-3 "always", one block a stage,
    seed 20261260's 50741bdb: one unit gathered at its B, where the current and prefetched units read +3.7 %)."""
    experts = st.moe_layers if rp.expert_units else 0
    return st.layers + experts + int(bool(st.embedding or st.position or st.final_norm or st.head))


def _current_units(T: Terms, two: list[int], all_bytes: int, kept: bool, prefetch: bool, f8: str,
                   walk: tuple[int, int, int, int] | None = None) -> None:
    """ZeRO-3 resharding after forward (``fsdp2_buffers``): the current (+ prefetched) unit at every action; where
    ``kept`` (a pipelined rank of one stage, or one that runs forwards after its first backward), the rest at a
    backward right after a backward (GPipe's later Bs, any cool-down), where the all-gather output is none (its
    lifetime ``gathering``). A backward leaves every unit it gathered so (set_reshard_after_backward(False)) and the
    stage's next forward reshards each in its post-forward (reshard_after_forward): every unit is gathered at a
    backward right after a backward, and nothing is left to all-gather there; at one after a forward the current
    unit and the next one's all-gather output (measure --fake of Llama 3 8B pp4 1F1B ZeRO-3 reshard "always", a
    3-block stage's B of its second microbatch: one block's parameters and one block's all-gather output, +4.6 % with
    all three blocks; pp2, stage 0's last B: every unit, no all-gather output)."""
    if walk:
        # a pipeline stage's root (the stage module's own fully_shard) is gathered through each forward and backward,
        # a block's unit from its pre-forward (pre-backward) on, the next block's all-gather output beside it (the
        # caller lays that output at a block's size; a B's later blocks: ``_backward_walk_units``)
        root, block, _, _ = walk
        current = root + block
        T.add("comm_buffers", "FSDP2 unsharded parameters: the stage's root (gathered through each forward and backward) "
              "and the current block's unit" + f8, current, f"{root:,} B + {block:,} B", kind="fsdp_unsharded_params")
        rest = all_bytes - current
    else:
        n_units = 2 if prefetch and len(two) > 1 else 1
        T.add("comm_buffers", "FSDP2 unsharded parameters: current unit" + (" + prefetched unit" if n_units == 2 else "")
              + f8, sum(two[:n_units]), _explain_units(two[:n_units]), kind="fsdp_unsharded_params")
        rest = all_bytes - sum(two[:n_units])
    # (measure --fake of Qwen3 235B pp4 GPipe ZeRO-3 ep4, two blocks a stage, four units: their 2.52 GiB and no
    # output at the second B, where the current, prefetched and output units made 3.38 GiB)
    if (kept or walk) and rest:
        T.add("comm_buffers", "FSDP2 unsharded parameters, the stage's other units: gathered since a backward with "
              "no forward since (its post-forward reshards them)" + f8, rest,
              f"{all_bytes:,} B (all units) less the current ones", kind="fsdp_units_kept_after_backward")


def _stage_fresh_gradients(plan: WrappingPlan, rp: RankParams, T: Terms, psi_train: int) -> None:
    """A split backward's W writes the stage's weight gradients into .grad in the parameter dtype; FSDP2 adds them into
    its accumulation only at the next post-backward that finds them (an I's or a B's:
    FSDPParam.to_accumulated_grad_if_needed), so until then they are the parameters' dtype, whole. A W that recomputes
    peaks in its recomputes, before its later groups have made theirs: at a W that makes them afresh (none pending
    from an earlier W: ``stage_fresh_start``) its moment holds those of the blocks whose groups have run by then
    (``Terms.weight_peak_blocks``; measure --fake of Qwen3 235B ZBV tp4 ep4 ZeRO-2 selective-layer every 2, seed
    20261247 #17, one block a stage: its W's peak short of the stage's 1,187 MiB, +5.1 % on two ranks with them)."""
    pgrad = PLAN_DTYPE_BYTES[plan.compute_dtype]
    for stage, x in stage_shares(pgrad * psi_train, rp):
        T.add("comm_buffers", f"stage {stage}'s weight gradients in {plan.compute_dtype}, from each W to the "
              "next I that adds them into the accumulation (or its REDUCE_GRAD)", x,
              f"its share by elements of {pgrad} B × Ψ = {pgrad} × {psi_train:,}",
              kind="fsdp_stage_fresh_grads", stage=stage)
        made, blocks = T.weight_peak_blocks.get(stage, (0, 0))
        if blocks:
            unmade = x - x * made // blocks
            T.add("comm_buffers", f"stage {stage}: of them, not yet made at its W's peak (in its recomputes, {made} of "
                  f"its {blocks} blocks' groups run)", -unmade, f"−{unmade:,} B", kind="fsdp_stage_fresh_unmade",
                  stage=stage)


def _gathered_units(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, groups: list[tuple[int, int]],
                    all_bytes: int, psi: int, ignored: set, left_out: bool, root_split: bool,
                    f8: str) -> tuple | None:
    """``fsdp2_buffers``' unsharded parameters and all-gather outputs: the root and current unit unpipelined under
    ZeRO-3 resharding after forward, stage by stage on a rank of several stages, the current (+ prefetched) units
    on a rank of one, else every unit. Returns the one-stage rank's walk (``_stage_walk``) for its backward."""
    conv, z = cfg.conventions, cfg.parallel.zero
    two = largest_numels(groups, 2)
    after_backward = plan.unsharded_after_first_backward and forward_after_first_backward(cfg, rp.pp_rank)
    # (``root_split``, unpipelined: not yet under expert parallelism, where a block's experts are a unit nested in it,
    # gathered and reduced in an order of their own, and the current + prefetched units stand for both)
    every_unit = False
    stage_by_stage = plan.sharded and plan.reshard_after_forward and per_stage_gradients(plan, rp)
    walk = None
    if root_split:
        two = [_root_and_current_unit(cfg, plan, rp, T, f8)]
    elif stage_by_stage:  # ZeRO-3 resharding after forward on a rank of several stages: its all-gather outputs too
        _stage_by_stage_units(cfg, plan, rp, T, all_bytes, f8)
    elif plan.sharded and plan.reshard_after_forward:
        walk = _stage_walk(cfg, plan, rp, T) if conv.fsdp_prefetch else None
        # a rank of one stage keeps every unit its backward gathered until a forward reshards it (torch's
        # backward_maybe_with_nosync)
        kept = after_backward or (plan.unsharded_after_first_backward and len(rp.stages) == 1)
        # (FSDP2 prefetches within one stage's units: ``_stage_units``)
        prefetch = conv.fsdp_prefetch and (not plan.pipelined or any(_stage_units(rp, st) > 1 for st in rp.stages))
        _current_units(T, two, all_bytes, kept, prefetch, f8, walk)
        if walk:
            two = [walk[1]]  # the all-gather output: the next block's
    else:
        _every_unit_gathered(plan, rp, T, all_bytes, psi, z, left_out, f8)
        every_unit = True
    if z in (2, 3) and not stage_by_stage:
        unpipelined_blocks = every_unit and not plan.pipelined and not ignored and len(rp.root_units) == 2
        _all_gather_outputs(cfg, plan, rp, T, groups if unpipelined_blocks else [], two[0], root_split, f8)
        if every_unit and plan.pipelined and conv.fsdp_prefetch and not ignored:
            _pipelined_kept_all_gather(cfg, plan, rp, T, two[0], f8)
    return walk


def fsdp2_buffers(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, psi: int, psi_train: int,
                  train_units: tuple[tuple[int, int], ...], mlp_phase: int = 0,
                  before_weight_gradients: bool = False) -> None:
    """What FSDP2 (fully_shard / replicate + MixedPrecisionPolicy) gathers and reduces on this rank,
    held at the rank's peak as ``plan`` says (engine.wrapping):

    * unsharded parameters: every unit when nothing reshards after forward (ZeRO-2, replicate,
      ZeRO-3 with reshard_after_forward False: all units of the stage gathered between its forward
      and its backward) and under pipelining where the rank runs a forward after its first backward
      (from then on every unit stays unsharded: ``set_reshard_after_backward(False)``); otherwise
      the current + prefetched unit;
    * one unit's all-gather output (the flat buffer the gather lands in, copied out into the params);
    * unsharded gradients: every unit where they accumulate without sync (pipelining: every
      microbatch until the schedule's REDUCE_GRAD; m > 1 without pipelining), in the accumulation
      dtype (the reduce dtype when it differs from the parameter dtype); else one unit's
      reduce-scatter input, in the reduce dtype; where the two dtypes differ, one unit's fresh
      gradient in the parameter dtype beside the accumulation (until post-backward adds it in).
    """
    m = cfg.parallel.microbatches
    lora_on = cfg.training.finetune == "lora"
    pd = plan.gathered_bytes  # MixedPrecisionPolicy.param_dtype: the copy FSDP2 all-gathers
    f8 = " (float8 Linear weights: 1 B + an fp32 scale each)" if plan.float8_all_gather else ""
    # FSDP2's replicate leaves the routed experts out (their replicas are the efsdp ranks:
    # backend.parallel.data_parallel.apply_replicate's ignored_params): it neither gathers, casts nor
    # accumulates them; their gradients are plain (engine.memory.states.pytorch_states)
    left_out = rp.experts if plan.data_parallel == "replicate" else 0
    ignored = {u for u, _ in rp.expert_units} if left_out else set()
    groups = [(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)), count)
              for u, count in rp.unit_groups if u not in ignored]
    all_bytes = sum(b * count for b, count in groups) - (pd * left_out if left_out and not ignored else 0)
    # unpipelined, FSDP2's root (embeddings, final norm, head: one fully_shard on the model) is a unit of
    # its own that stays gathered through each forward and backward (``_root_and_current_unit``)
    root_split = plan.sharded and plan.reshard_after_forward and not plan.pipelined and bool(rp.root_units)
    walk = _gathered_units(cfg, plan, rp, T, groups, all_bytes, psi, ignored, bool(left_out), root_split, f8)
    gacc = plan.grad_accumulation_bytes
    emb_full, emb_extra = replicated_embedding_gradient(cfg, rp)
    if plan.unsharded_after_first_backward or m > 1:
        why = ("every microbatch's backward until the schedule's REDUCE_GRAD (set_requires_gradient_sync(False))"
               if plan.unsharded_after_first_backward else "accumulated unsharded over microbatches without sync")
        label = (f"FSDP2 unsharded gradients of every unit ({why}), in {plan.grad_accumulation_dtype}"
                 + (" — adapters only under LoRA" if lora_on else ""))
        how = f"{gacc} B × Ψ{'_lora' if lora_on else ''} = {gacc} × {psi_train:,}"
        if left_out and not lora_on:
            psi_train -= left_out
            how = f"{gacc} B × Ψ without the routed experts (replicate ignores them) = {gacc} × {psi_train:,}"
        by_stage = per_stage_gradients(plan, rp) and not lora_on  # (the adapters' split by stage: not kept)
        if by_stage:
            split_converts = cfg.parallel.schedule in SPLIT_BACKWARD_SCHEDULES and plan.converts_gradients
            when = ("from its first I after a W to its REDUCE_GRAD" if split_converts
                    else "from its first backward to its REDUCE_GRAD")
            shares = dict(stage_shares(gacc * psi_train, rp))
            for stage, x in shares.items():
                T.add("comm_buffers", f"{label}: stage {stage}'s ({when})", x,
                      f"its share by elements of {how}", kind="fsdp_unsharded_grads", stage=stage)
            if not split_converts and cfg.conventions.state_accounting == "pytorch":
                first_weight_end_terms(cfg, rp, T, shares, plan.autocast)
            if split_converts:
                _stage_fresh_gradients(plan, rp, T, psi_train)
        else:
            T.add("comm_buffers", label, gacc * psi_train, how, kind="fsdp_unsharded_grads")
        if emb_extra:
            first = min(st.stage for st in rp.stages if st.embedding) if by_stage else None
            T.add("comm_buffers", f"token-embedding gradient accumulated at full V × h, in {plan.grad_accumulation_dtype} "
                  "(TP: the vocab-parallel embedding's gradient comes back replicated; FSDP2 keeps it so until "
                  "the reduce-scatter redistributes it to the row shard)", gacc * emb_extra,
                  f"{gacc} B × (V·h − local rows × h) = {gacc} × {emb_extra:,}", kind="fsdp_embedding_full_grad",
                  stage=first)
        if ignored and not lora_on:  # replicate: the routed experts' gradients are plain ones, no unit's
            train_units = tuple((unit_numel(u), count) for u, count in rp.unit_groups if u not in ignored)
        _fresh_gradients(plan, rp, T, train_units, emb_full, lora_on,
                         _made_by_the_b_moment(cfg, rp, lora_on, before_weight_gradients), mlp_phase,
                         microbatches=m)
        if not plan.pipelined and not lora_on and rp.root_units:
            _root_post_backward_after_accumulation(cfg, plan, rp, T, psi_train, emb_full, emb_extra)
        if plan.unsharded_after_first_backward and len(rp.stages) == 1 and not lora_on:
            _reduce_grad(cfg, plan, rp, T, ignored)
    else:
        # replicate walks its units as ZeRO-2 does (FSDP2's machinery with a shard degree of 1), its sharded
        # gradients the whole parameters' (the routed experts' are plain ones: replicate leaves them out)
        replicated = plan.data_parallel == "replicate"
        if (plan.sharded or replicated) and not plan.pipelined and not lora_on:
            _unit_by_unit_reduce(cfg, plan, rp, T, psi_train - left_out, root_split, emb_full,
                                 all_bytes if replicated else 0,
                                 (_made_by_the_b_moment(cfg, rp, lora_on, before_weight_gradients), mlp_phase))
        else:
            _reduce_scatter_input(cfg, plan, rp, T, train_units, lora_on)
        if emb_full:
            pgrad = PLAN_DTYPE_BYTES[plan.compute_dtype]
            T.add("comm_buffers", f"token-embedding gradient at full V × h in {plan.compute_dtype}, until the "
                  "embeddings' post-backward redistributes it to the row shard (TP: it comes back replicated)",
                  pgrad * emb_full, f"{pgrad} B × V·h = {pgrad} × {emb_full:,}", kind="embedding_full_gradient")
    if walk:
        _backward_walk_units(T, walk, f8)


def _attention_phase_gradients(T: Terms, nbytes: int, dtype: str, mlp_phase: int, category: str = "comm_buffers",
                               kind: str = "fsdp_fresh_grad_made", freed_kind: str = "mlp_backward_freed") -> None:
    """Under context parallelism the rest of the largest unit's fresh gradients a B's moment holds in its attention's
    phase (the MLP's and the output projection's, :func:`_made_by_the_b_moment`): beside the ring attention's workspace,
    not beside the MLP's backward. They join the workspace in ``_cp_attention_after_mlp``'s choice of the larger phase:
    what comes off grows from min(workspace, MLP phase) to min(workspace + these, MLP phase)."""
    ws = sum(t.bytes for t in T["temporaries"] if t.kind == "cp_attention")
    T.add(category, f"the largest unit's fresh gradients in {dtype} made by the ring attention's backward: the "
          "MLP's others and the output projection's", nbytes, f"{nbytes:,} B", kind=kind)
    if ws and mlp_phase:
        off = min(ws + nbytes, mlp_phase) - min(ws, mlp_phase)
        # where the MLP's phase is the larger even with them the moment is the MLP's: these gradients are not made yet,
        # so they come off their own category (measure --fake of Llama 3 405B tp8 SP cp4 ZeRO-2 fp32, seed 20261263 #38:
        # 960 MiB of them filed as comm_buffers and taken off the temporaries read comm +6 %, temporaries −15 %); where
        # the attention's phase is the larger the moment is its workspace and these, the MLP's backward gone
        whole = mlp_phase >= ws + nbytes
        if off:
            T.add(category if whole else "temporaries", "the attention phase's fresh gradients are not beside the MLP's "
                  "backward (the larger phase's)", -off,
                  f"−(min({ws:,} + {nbytes:,}, {mlp_phase:,}) − min({ws:,}, {mlp_phase:,})) B",
                  kind=freed_kind)


def _attention_phase_without_cp(T: Terms, more: int, dtype: str) -> None:
    """Without context parallelism, where a B's first block's attention backward outweighs its MLP's
    (``activations.attention_phase_of_fresh_gradients``, ``Terms.attention_phase``): the moment is the attention's —
    the flash backward's workspace, the MLP's and the output projection's fresh gradients (``more`` bytes beyond those
    the MLP's phase holds, which both phases hold), the MLP's and its norm's saved tensors and the MLP's backward gone, and on the last
    stage the blocks' output gradient (the residual add's backward has summed it into the residual stream's gradient,
    the workspace's). Laid only where it is the larger, so the categories stay the MLP phase's elsewhere."""
    ws, saved, formula = T.attention_phase
    parts = mlp_phase_parts(T)
    out_grad = sum(t.bytes for t in T["temporaries"] if t.kind == "blocks_output_gradient")
    gain = ws + more - saved - out_grad - sum(parts.values())
    if gain <= 0:
        return
    T.add("comm_buffers", f"the largest unit's fresh gradients in {dtype} made by its attention's backward: the MLP's "
          "others and the output projection's", more, f"{more:,} B", kind="fsdp_fresh_grad_made")
    T.add("temporaries", "a B's first block's attention backward (flash; the larger phase): the residual stream's "
          "gradient, the attention output's, dQ, dK, dV, in place of the MLP's backward" + (
              " and the blocks' output gradient" if out_grad else ""),
          ws - parts["temporaries"] - out_grad, f"{formula} − the MLP phase's {parts['temporaries']:,} B"
          + (f" − {out_grad:,} B" if out_grad else ""), kind="attention_backward")
    T.add("activations", "a B's attention backward: the first block's MLP and norm saved tensors freed by then",
          -saved - parts["activations"], f"−{saved:,} B (MLP and norm2 rows) − the MLP phase's {parts['activations']:,} B",
          kind="mlp_backward_freed")


def _first_backward_grads_made(plan: WrappingPlan, rp: RankParams, T: Terms, made_by: tuple[int, int] | None,
                               mlp_phase: int, lora_on: bool, train_units: tuple[tuple[int, int], ...]) -> None:
    """Under pipelining, FSDP2 accumulating in the parameters' dtype on a rank of one stage: its first B's moment holds
    the gradients the first block's backward has made by then (:func:`_made_by_the_b_moment`), the unsharded
    gradients themselves (autograd writes each ``.grad`` in the parameter dtype and the schedule's
    ``set_reshard_after_backward(False)`` keeps them; ``fsdp_unsharded_grads`` holds them from the first backward's
    end on, so a later B holds them already): the down projection's at the MLP's phase, and under context parallelism
    the MLP's others and the output projection's at the ring attention's (``_attention_phase_gradients``); on the last
    stage the final norm's and head's too, made first (as ``fsdp_head_fresh_grad`` where FSDP2 converts). measure
    --fake of Llama 2 7B pp2 cp4 ZeRO-2 bf16 gradients float8 (fake seed 20261270 #35, stage 0): its first B peaks in
    the first block's attention backward with w1, w2, w3 and wo's bf16 gradients (0.28 GiB) beside the workspace; of
    Llama 3 405B pp4 cp4 ZeRO-2 (fake seed 20261271 #16, stage 3): its first B with the head's 3.9 GiB gradient."""
    if (made_by is None or lora_on or not plan.unsharded_after_first_backward or len(rp.stages) != 1
            or not unit_numel(rp.block_tensors)):
        return
    pgrad = PLAN_DTYPE_BYTES[plan.compute_dtype]
    made_mlp, made_attention = made_by
    if rp.root_units and train_units and any(st.final_norm or st.head for st in rp.stages):
        head = train_units[-1][0]
        T.add("comm_buffers", f"the first B: the final norm's and head's gradient in {plan.compute_dtype}, made at the "
              "head's backward, before the blocks'", pgrad * head, f"{pgrad} B × {head:,}", kind="fsdp_first_grads_made")
    if made_mlp:
        T.add("comm_buffers", f"the first B's first block: the gradients in {plan.compute_dtype} its backward has made "
              "by the B's moment (the down projection's; float8: and an up projection's)", pgrad * made_mlp,
              f"{pgrad} B × {made_mlp:,} elements", kind="fsdp_first_grads_made")
    if made_attention and any(t.kind == "cp_attention" for t in T["temporaries"]):
        _attention_phase_gradients(T, pgrad * made_attention, plan.compute_dtype, mlp_phase,
                                   kind="fsdp_first_grads_made", freed_kind="first_grads_phase_freed")


def _made_by_the_b_moment(cfg: Config, rp: RankParams, lora_on: bool, before: bool = False) -> tuple[int, int] | None:
    """Elements of the gradients a dense block's backward has made by the moment a B's own moment stands for, where
    that holds fewer than the whole unit's (autograd runs the block's backward from its last op): (made by the MLP's
    backward, made more by the context-parallel attention's). The first block's MLP backward
    (``engine.memory.activations.block_backward_terms``) has made the down projection's weight (and bias) gradient,
    by the backward's first matmul; under float8 the MLP's moment is the weight casts of the second up projection's
    backward (torchao's Float8Linear), by when the first one's weight gradient is made too (measure --fake of Llama 3
    405B tp2 SP tensorwise: two 0.81 GiB bf16 gradients alive at its peak, in that cast); where the tokens' casts for
    w2's weight gradient outweigh that cast (``before``), the MLP's moment comes before w2's weight gradient: none is
    made (measure --fake of Llama 3 8B pp8 cp4 ZeRO-3 full tensorwise: at its peak in those casts, 448, 448 and 112 MiB
    beside the down input's 224 MiB gradient, no weight gradient of the block); where the stage's last block has
    experts and its B's moment is the combine's backward (``before``: ``moe_backward_terms``), the block's backward has
    made none either (the combine has no weights; the experts' gradients come after it, the attention's later: measure
    --fake of Mixtral pp8 ep2 ZeRO-3 full at 64K tokens, stage 1: no fresh gradient beside the combine's backward, whose
    unit, the experts', 1.31 GiB in bf16). Under context parallelism
    the B's moment holds the larger of two phases (``_cp_attention_after_mlp``): the MLP's, with those, and the ring
    attention's backward (its workspace, ``cp_attention``), which runs after the MLP's backward and the output
    projection's, with their weight gradients too (measure --fake of Llama 3 405B tp2 cp2, full recompute: w1, w2,
    w3 and wo's bf16 gradients alive at its peak inside the attention backward). None where it is not modelled so:
    LoRA (adapters only), a block with experts whose moment is the experts' backward (their moment holds the unit's
    fresh gradient) and split backwards (the first stage's W, run whole, was not checked against the fake)."""
    tr, m, par = cfg.training, cfg.model, cfg.parallel
    if lora_on or par.schedule in SPLIT_BACKWARD_SCHEDULES:
        return None
    if m.experts:  # a stage whose last block has experts: its B's moment is the combine's backward, before any
        return (0, 0) if before else None  # weight gradient (``moe_backward_terms``), or the experts' (not modelled so)
    weights, biases = mlp_tensors(m, m.ffn_hidden, par.tp)
    made = weights[-1:] + (weights[:1] if tr.float8 != "none" and m.mlp == "swiglu" else ())
    mlp = 0 if before else sum(a * b for a, b in made) + (biases[-1][0] if biases else 0)
    if par.cp == 1 and not attention_phase_of_fresh_gradients(cfg):
        return mlp, 0
    return mlp, mlp_and_out_proj_elements(m, par.tp) - mlp


def _fresh_gradients(plan: WrappingPlan, rp: RankParams, T: Terms, train_units: tuple[tuple[int, int], ...],
                     emb_full: int, lora_on: bool, made_by: tuple[int, int] | None = None, mlp_phase: int = 0,
                     microbatches: int = 1) -> None:
    """A unit's fresh gradient beside FSDP2's accumulation of the unsharded gradients: where it accumulates in another
    dtype than the parameters', the largest unit's; under pipelining, the token embeddings' at the end of each B
    (in any dtype: its backward makes the whole V·h gradient before it is added in).

    ``made_by`` (:func:`_made_by_the_b_moment`): where the largest unit is a dense block, a B's own moment holds only the
    gradients its backward has made by then (the down projection's, at the first block's MLP backward); the whole
    unit's are alive only when its backward ends, before its post-backward adds them in — at the end-of-backward
    moment here (``post_backward``). A fake Llama 3 70B pp8 GPipe step (dp4 tp4 SP, bf16 parameters, fp32 gradient
    accumulation) peaks in the second B's MLP backward with w2's bf16 gradient (112 MiB) and none of the block's others
    (296 MiB more). The final norm's and head's, made first, live through the B to the root's post-backward
    (``fsdp_head_fresh_grad``); unpipelined, the token embeddings' (under TP at full V·h), made by the backward's last
    op, only at its end, where it is the largest then (a fake Llama 3 70B tp8 cp4 ZeRO-3 m2 holds the head's at its B,
    not the embedding's 1.96 GiB)."""
    made = made_by is not None  # the B's moment laid with what the block's backward has made by then
    made_mlp, made_attention = made_by or (0, 0)
    # autograd writes each unit's gradient in the parameter dtype; FSDP2's post-backward then
    # converts it to (first backward) or adds it into (later ones) the reduce-dtype accumulation
    # (the embeddings' unit: its token embedding at full V × h under TP)
    pgrad = PLAN_DTYPE_BYTES[plan.compute_dtype]
    # under pipelining the token embedding's backward is the first stage's last op: its unit's fresh gradient
    # comes after the blocks' backward freed their tensors, at the end of each B (``backward_end``; measure
    # --fake Llama 3 8B tp4 pp4 ZeRO-3: the peak there, not at the first block's backward)
    # unpipelined, over microbatches in the same dtype, the same at the end of each later B: the backward's last op makes
    # it and AccumulateGrad adds it into the .grad (measure --fake, seed 20261244 #26, Llama 3 8B tp4 SP ZeRO-2 fp32,
    # m = 2: the second microbatch's 2,004 MiB full V × h gradient at its backward's end, a new segment for it)
    emb_unit = (unit_numel(rp.root_units[0]) if (plan.pipelined or (microbatches > 1 and not plan.converts_gradients))
                and not lora_on and rp.root_units and any(st.embedding for st in rp.stages) else 0)
    if not plan.converts_gradients:
        _first_backward_grads_made(plan, rp, T, made_by, mlp_phase, lora_on, train_units)
    if not plan.converts_gradients and not emb_unit:
        return
    # under pipelining the last stage's root unit (final norm + head) makes its gradient first, at the head's
    # backward, and keeps it to the root's post-backward at the B's end: beside every block's (``fsdp_head_fresh_grad``)
    # (unpipelined too: the root unit's post-backward runs in the backward's final callback, and the token
    # embeddings' gradient, the root's other part, is the backward's last op, made at its end)
    head_unit = len(train_units) - 1 if (made and plan.converts_gradients and rp.root_units
                                         and any(st.final_norm or st.head for st in rp.stages)) else -1
    emb_last = bool(made and not plan.pipelined and rp.root_units and any(st.embedding for st in rp.stages))
    units = [n for i, (n, _) in enumerate(train_units) if not ((emb_unit or emb_last) and i == 0) and i != head_unit]
    big = max(units or [0])
    what = f"largest FSDP unit's trainable elements ({big:,})"
    # (the largest unit a block's: a dense one, or a MoE block's whole unit where its experts are no unit of their own;
    # also where a TP rank's full-size token-embedding gradient outweighs a block: its B holds only the part made, as
    # the fakes do — seed 20261263 #21, Llama 3 70B tp4 pp2 Interleaved1F1B ZeRO-3, w2's 112 MiB, not the block's
    # 408 MiB: +1.3 -> 0.0 %. Until session 56 the whole block's was laid there: the part moved the published Table 5
    # 1F1B row's replayed reserve out of its bar then, -8.4 -> -10.7 %; since session 55 it stays -8.2 % either way)
    block = made and (big == unit_numel(rp.block_tensors) or bool(rp.expert_units)
                      or any(unit_numel(u) == big for u, _ in rp.unit_groups if u not in rp.root_units))
    emb_end = max(emb_full, train_units[0][0]) if emb_last else 0
    if emb_end > big:  # the embeddings' gradient, made at the end of the backward: the largest then
        big, what = emb_end, (f"the token embedding's gradient at full V·h ({emb_full:,}, TP: replicated)"
                              if emb_full >= train_units[0][0] else f"the token embeddings' unit's ({emb_end:,})")
    elif emb_full > big and not emb_unit:
        big, what = emb_full, f"the token embedding's gradient at full V·h ({emb_full:,}, TP: replicated)"
    if plan.converts_gradients and block:
        if made_mlp:
            T.add("comm_buffers", f"the largest unit's fresh gradient in {plan.compute_dtype} made by a B's own moment: "
                  "the down projection's (float8: and an up projection's), the unit's others later", pgrad * made_mlp,
                  f"{pgrad} B × {made_mlp:,} elements", kind="fsdp_fresh_grad_made")
        if made_attention and T.attention_phase:
            _attention_phase_without_cp(T, pgrad * made_attention, plan.compute_dtype)
        elif made_attention and any(t.kind == "cp_attention" for t in T["temporaries"]):
            _attention_phase_gradients(T, pgrad * made_attention, plan.compute_dtype, mlp_phase)
        T.add("comm_buffers", f"one unit's fresh gradient in {plan.compute_dtype} at the end of the backward, before "
              f"FSDP2's post-backward adds it into the {plan.grad_accumulation_dtype} accumulation (largest unit)",
              pgrad * big, f"{pgrad} B × {what}", kind="fsdp_fresh_grad_end")
    elif plan.converts_gradients:
        T.add("comm_buffers", f"one unit's fresh gradient in {plan.compute_dtype}, before FSDP2's post-backward "
              f"adds it into the {plan.grad_accumulation_dtype} accumulation (largest unit)", pgrad * big,
              f"{pgrad} B × {what}", kind="fsdp_fresh_grad")
    if head_unit >= 0:
        head = train_units[head_unit][0]
        T.add("comm_buffers", f"the final norm's and head's fresh gradient in {plan.compute_dtype}, made at the head's "
              "backward and added into the accumulation by the root unit's post-backward at the B's end", pgrad * head,
              f"{pgrad} B × {head:,}", kind="fsdp_head_fresh_grad")
    if emb_unit:
        emb = max(emb_unit, emb_full)
        # converting, the first B's post-backward makes the accumulation from it (both alive); in the same dtype its
        # first gradient is the accumulation, and only a later B's fresh one is a second tensor (measure --fake
        # Llama 3 405B tp8 pp2 ZeRO-3 bf16 gradients, m = 2: the peak at the second B's end, none at the first's)
        # converting, it is the parameter's .grad (FSDP2 names it an unsharded gradient); in the same dtype autograd
        # adds it into the .grad there (AccumulateGrad): a temporary of the backward
        T.add("comm_buffers" if plan.converts_gradients else "temporaries",
              f"the token embeddings' unit's fresh gradient in {plan.compute_dtype} at the end of "
              f"each {'' if plan.converts_gradients else 'later '}B (its backward is the first stage's last op), before "
              f"FSDP2's post-backward adds it into the {plan.grad_accumulation_dtype} accumulation", pgrad * emb,
              f"{pgrad} B × {emb:,}" + (" (TP: the full V·h, replicated)" if emb_full > emb_unit else ""),
              kind="fsdp_embedding_fresh_grad" if plan.converts_gradients else "fsdp_embedding_added_grad",
              # on a rank of several stages only the first stage's B ends hold it (``stage_backward_end``)
              stage=min(st.stage for st in rp.stages if st.embedding) if per_stage_gradients(plan, rp) else None)


def _stage_by_stage_units(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, all_bytes: int, f8: str) -> None:
    """ZeRO-3 resharding after forward on a rank of several pipeline stages, stage by stage
    (``lifetimes._kept_since_backward``): each stage's units kept gathered from its backward (the schedule's
    ``set_reshard_after_backward(False)``) to its next forward, whose post-forwards reshard them, or to its
    REDUCE_GRAD (``stage_kept``), which another stage's actions in between find still gathered; and at the stage's
    own F (or B after a forward) its root unit (the stage module's own fully_shard: embeddings, final norm + head),
    gathered through it, and its current block's unit with that block's experts' (``stage_current``). FSDP2
    prefetches within one stage module's units only, so a rank's two largest units may never be gathered together.
    measure --fake of Mixtral 8x7B Interleaved1F1B pp2 v3 (fake seed 20261268 #03, rank 4, one MoE block a stage):
    stage 5's last B holds stage 1's units and its own, 2.83 GiB, where every stage's made 4.18 GiB; a stage's F its
    block's and experts' units, 1.35 GiB, not two experts' units; Llama 3 8B Interleaved1F1B pp2 v2, two blocks a
    stage: a stage's later B right after its B holds its two blocks and no all-gather output, a stage's F its root,
    its last block and one block's all-gather output (at 14 of rank 0's 16 actions within 0.01 GiB of the fake's peak
    inside it, ``benchmarks/fake_actions.py``; its first B of stage 0 holds the root's all-gather output too, −0.54
    GiB)."""
    gathered = {id(u): gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u, _ in rp.unit_groups}
    roots, experts = rp.root_units, {id(u) for u, _ in rp.expert_units}
    block = max((gathered[id(u)] for u, _ in rp.unit_groups if u not in roots and id(u) not in experts), default=0)
    expert = max((gathered[id(u)] for u, _ in rp.expert_units), default=0)
    first = any(st.stage == 0 for st in rp.stages)
    emb = gathered[id(roots[0])] if roots and first else 0
    head = gathered[id(roots[-1])] if roots and (len(roots) > 1 or not first) else 0
    for st, (stage, x) in zip(sorted(rp.stages, key=lambda st: st.stage), stage_shares(all_bytes, rp)):
        T.add("comm_buffers", f"FSDP2 unsharded parameters, stage {stage}'s units kept gathered since its last backward "
              f"(set_reshard_after_backward(False)) to its next forward or its REDUCE_GRAD{f8}", x,
              f"its share by elements of {all_bytes:,} B (all units)", kind="fsdp_stage_kept_params", stage=stage)
        root = (emb if st.stage == 0 else 0) + (head if st.final_norm or st.head else 0)
        current = (block + (expert if st.moe_layers else 0)) if st.layers else 0
        T.add("comm_buffers", f"FSDP2 unsharded parameters, stage {stage}'s root and current block's units at its "
              f"forward (and a backward after one){f8}", min(root + current, x), f"{root:,} B + {current:,} B",
              kind="fsdp_stage_current_params", stage=stage)
        # beside them the all-gather output of the stage's next unit (prefetched), where it has another: in a forward
        # any (a MoE block's experts after the block), in a backward after a forward the next block's (a one-block
        # stage's backward peaks in its experts' backward, its units all copied out); a backward after a backward
        # finds every unit gathered and gathers none (as on a rank of one stage, ``_current_units``)
        unit = max(block, expert if st.moe_layers else 0)
        for kind, x, when in (("fsdp_stage_forward_all_gather_output", unit if _stage_units(rp, st) > 1 else 0,
                               "forward"),
                              ("fsdp_stage_all_gather_output", unit if st.layers > 1 else 0, "backward after a forward")):
            if x:
                T.add("comm_buffers", f"stage {stage}: all-gather output of its next unit in a {when} (prefetched; "
                      f"the largest){f8}", x, f"{x:,} B", kind=kind, stage=stage)


def _every_unit_gathered(plan: WrappingPlan, rp: RankParams, T: Terms, all_bytes: int, psi: int, zero: int,
                         left_out: bool, f8: str) -> None:
    """FSDP2's unsharded parameters where every unit stays gathered (``fsdp2_buffers``): replicate, ZeRO-2,
    ZeRO-3 not resharded after forward (resharding after forward: ``_current_units``, ``_stage_by_stage_units``)."""
    pd = plan.gathered_bytes
    if not plan.sharded:
        why = "replicate"
    elif zero == 2:
        why = "ZeRO-2: not resharded after forward"
    else:
        why = (f"ZeRO-3 not resharded after forward (policy {plan.reshard_policy}"
               + (": the default under pipelining" if plan.pipelined and plan.reshard_policy == "default" else "")
               + "): every unit gathered between forward and backward")
    how = (f"{pd} B × Ψ = {pd} × {psi:,}" if not plan.float8_all_gather and not left_out and all_bytes == pd * psi
           else f"{pd} B × Ψ with each dim 0 padded to a multiple of the shard degree = {all_bytes:,} B"
           if not plan.float8_all_gather and not left_out
           else f"{pd} B × Ψ without the routed experts (replicate ignores them) = {all_bytes:,} B" if left_out
           else f"Σ over {rp.unit_count} units of their gathered bytes (Ψ = {psi:,})")
    if per_stage_gradients(plan, rp):
        # not resharded after forward, a stage's units are gathered from its first forward on, whatever comes after its
        # first backward, and resharded at its REDUCE_GRAD
        # (``engine.memory.lifetimes.fsdp_params_lifetime``: ``stage_gathered``)
        for stage, x in stage_shares(all_bytes, rp):
            T.add("comm_buffers", f"FSDP2 unsharded parameters, stage {stage}'s units ({why}; from its first forward "
                  f"to its REDUCE_GRAD){f8}", x, f"its share by elements of {how}", kind="fsdp_unsharded_params",
                  stage=stage)
        return
    T.add("comm_buffers", f"FSDP2 unsharded parameters, all units ({why}){f8}", all_bytes, how,
          kind="fsdp_unsharded_params")


def _all_gather_outputs(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, groups: list, largest: int,
                        root_split: bool, f8: str) -> None:
    """FSDP2's all-gather outputs at the rank's moments (ZeRO-2/3). ``groups``: the unit groups (embeddings,
    blocks, head) where the rank runs unpipelined with units that stay gathered, else empty: a forward's
    outputs are then the blocks' (FSDP2 keeps each unit's until the next one's copy-out, and the root's
    post-forward frees the last block's), the root's only before the first block's. Otherwise one unit's
    (``largest``)."""
    blocks = groups[1:-1]
    if not blocks:
        what = "the next block's (prefetched), or the current one's before its copy-out; the largest" \
            if root_split else "largest"
        T.add("comm_buffers", f"all-gather output of one unit ({what})" + f8, largest, f"{largest:,} B",
              kind="all_gather_output")
        return
    last = max(b for b, _ in blocks)
    T.add("comm_buffers", "all-gather output of the last block a forward gathers (kept until the root's "
          "post-forward; the largest block)" + f8, last, f"{last:,} B", kind="all_gather_output")
    _head_forward_at_loss(cfg, plan, T, last)
    if cfg.conventions.fsdp_prefetch:
        prev = last if sum(count for _, count in blocks) > 1 else groups[0][0] + groups[-1][0]
        _kept_all_gather_result(cfg, rp, T, prev, f8)


def _pipelined_kept_all_gather(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, laid: int, f8: str) -> None:
    """A pipelined stage's first forward gathers its blocks one by one, and FSDP2's implicit forward prefetch keeps
    the previous block's all-gather result to the next one's copy-out, as unpipelined (:func:`_kept_all_gather_result`;
    measure --fake of Llama 3 70B pp4 cp4 ZeRO-3 LoRA, seed 20261237, stage 2: both blocks' all-gather outputs beside
    both blocks' parameters at the second one's copy-out, the first forward's peak: allocated −17.5 %). Two blocks'
    outputs there, where the one laid (``laid``) is the largest unit's (a first stage's root, embeddings: larger); on
    the last stage before its head and loss, whose saved tensors the forward's moment holds (Llama 3 405B pp4 cp2
    LoRA, seed 20261233 #6c7555c1, last stage: +5.0 % with them)."""
    blocks = [(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)), count)
              for u, count in rp.unit_groups if u not in rp.root_units]
    # the prefetch chains a stage's own blocks: each stage module is an FSDP2 root of its own, whose post-forward frees
    # its last block's result (measure --fake, seed 20261249 #27, Llama 3 405B ZBV pp4 ZeRO-3 LoRA, stages 3 and 4 of
    # one block each: one all-gather output at the first forward's peak, +26.6 % with a second one laid)
    n = min(sum(count for _, count in blocks), max((st.layers for st in rp.stages), default=0))
    # the stage's root (fully_shard of the stage's module: its embeddings or its final norm and head) is gathered
    # first, in its pre-forward, and its result kept to the first block's copy-out: there the root's and the first
    # block's outputs beside those two units alone (measure --fake of Llama 3 70B pp4 cp4 ZeRO-3 LoRA, seed 20261237,
    # the last stage of one block: the head's 2,004 MiB output and the block's 1,634 MiB beside both, −13.5 %)
    # (a rank of the first and the last stage, a V schedule's, gathers each root at its own stage's first forward: the
    # larger one's moment)
    root = max((gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u in rp.root_units), default=0)
    if n > 1 or (n and root):
        block = max(b for b, _ in blocks)
        head = sum(t.bytes // max(t.in_flight or 1, 1) for t in T["activations"]
                   if t.kind in HEAD_KINDS or t.kind in STAGE_OUTPUT_KINDS)
        # (the forward's moment holds its own transients and the stage output it keeps, which the copy-out precedes)
        fwd = forward_transient_bytes(T)
        kept_out = sum(t.bytes // max(t.in_flight or 1, 1) for t in T["activations"] if t.kind in STAGE_OUTPUT_KINDS)
        first = (root + block - laid - (n - 1) * block - kept_out - fwd, n) if root else (0, 0)
        _kept_all_gather_result(cfg, rp, T, 2 * block - laid if n > 1 else 0, f8, head=head,
                                at_end=block - laid if n > 1 else 0, first=first)


def _kept_all_gather_result(cfg: Config, rp: RankParams, T: Terms, second: int, f8: str, head: int = 0,
                            at_end: int = 0, first: tuple[int, int] = (0, 0)) -> None:
    """Where a forward gathers units that stay gathered (unpipelined ZeRO-2, ZeRO-3 not resharded after
    forward): FSDP2's implicit forward prefetch keeps each unit's all-gather result
    (``comm_ctx.all_gather_state``) until the next unit's ``wait_for_unshard``, which starts after that
    unit's all-gather has landed, so two all-gather outputs are alive at each unshard; the root's
    post-forward frees the last (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, _fsdp_state.py).
    The most such a moment holds is at the last block's unshard: every unit gathered, and of the forward's
    saved tensors all but those the last block saves besides its input (which exists: it is the argument).
    The forward's own moment counts one output and every block's tensors, so the second output counts less
    those (a CPU run of ZeRO-2 dp4 m4 full recompute: MemTracker's All Gather at the peak, in a later
    microbatch's forward, is two blocks' outputs, beside every block's input and nothing of the head).
    Dense blocks only (a MoE block's experts are a unit of their own). ``head``: the loss side the forward's moment
    holds, made after the last block (a pipeline's last stage: not yet there at its unshard); ``at_end``: what the
    forward's end holds beyond the output laid, the last block's result still kept (the stage's root post-forward
    frees it) — the larger of the two moments counts. ``first``: (what the first block's copy-out holds beyond the
    forward's moment in units, the blocks whose saved tensors that moment does not hold yet) where the root is
    gathered first (a pipeline stage's root: ``_pipelined_kept_all_gather``)."""
    if any(st.moe_layers for st in rp.stages) or not any(st.layers for st in rp.stages):
        return
    sh = shape_of(cfg, rp.cp_rank)
    policy = cfg.training.recompute
    plain = [x for _, x, _ in layer_activation_terms(replace(sh, recompute="none"))[0]]
    if policy in TABLE_RECOMPUTE:
        saved = sum(x for _, x, _ in layer_activation_terms(sh)[0])
    elif policy == "full":
        saved = plain[0]  # the block input alone
    else:  # selective-layer: the larger, a plain block's
        saved = sum(plain)
    after = max(saved - plain[0], 0)
    extra = max(second - after - head, at_end, first[0] - first[1] * saved if first[1] else 0)
    if extra > 0:
        T.add("comm_buffers", "the previous unit's all-gather output at the last block's unshard (FSDP2's implicit "
              "forward prefetch frees it after that unit's copy-out), less what the last block saves after it" + f8,
              extra, f"{second:,} B − {after:,} B (the last block's saved tensors but its input)",
              kind="all_gather_output")


def _root_and_current_unit(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, f8: str) -> int:
    """Unpipelined ZeRO-3 resharding after forward: FSDP2's root unit and the current block's unit, gathered;
    returns the largest other unit's gathered bytes (the all-gather output the caller lays).

    The root (``fully_shard(model)``, given its flag explicitly: torch's ``_lazy_init`` keeps a root gathered
    after forward only when the flag was left to it) is gathered in its pre-forward and resharded in its
    post-forward, so it is gathered through every block's forward; its pre-backward hook, on the logits, gathers
    it again before the head's backward, and its post-backward runs in the backward's final callback (its
    inputs, the token ids, take no gradient), so it stays gathered through every block's backward too. A
    block's unit is gathered from its own pre-forward (pre-backward) to its post-forward (post-backward); the
    next unit's all-gather lands beside it (the backward's prefetch, issued in the pre-backward) and is copied
    out into its parameters only in that unit's own pre-backward (``wait_for_unshard``), after the current unit
    resharded: measured on a fake Llama 3 405B step (dp8 cp2): the root, one block's parameters and one
    block's all-gather output at once."""
    root = rp.root_units
    root_b = sum(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u in root)
    experts = {u for u, _ in rp.expert_units}
    others = [(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)), count - (u in root), u in experts)
              for u, count in rp.unit_groups]
    # under expert parallelism a block's experts are a unit nested in it: gathered beside it in their backward, when
    # the prefetched all-gather is the previous block's own unit (FSDP2's post-forward order: experts, block); their
    # post-backward may hold more (``_unit_by_unit_reduce``)
    cur = (largest_numels([(b, c) for b, c, e in others if not e], 1) or [0])[0]
    moe = (largest_numels([(b, c) for b, c, e in others if e], 1) or [0])[0]
    has_emb = any(st.stage == 0 for st in rp.stages)
    what = " + ".join(name for name, on in (("embeddings", has_emb), ("final norm + head", len(root) > has_emb)) if on)
    T.add("comm_buffers", f"FSDP2 unsharded parameters: the root unit (fully_shard(model): {what}), gathered "
          "through the forward and through the backward", root_b, f"{plan.gathered_bytes} B × its elements, "
          f"each dim 0 padded to a multiple of the shard degree = {root_b:,} B", kind="fsdp_root_params")
    T.add("comm_buffers", "FSDP2 unsharded parameters: the current block's unit" + (" and its experts' unit" if moe else "")
          + f8, cur + moe, f"{cur:,} B" + (f" + {moe:,} B" if moe else "") + " (the largest)", kind="fsdp_unsharded_params")
    _root_regather_at_loss(cfg, plan, T, root_b)
    # the forward gathers the root first: its parameters are copied out of its all-gather output (``wait_for_unshard``:
    # ``foreach_all_gather_copy_out``), and that output, on the all-gather stream, is kept to the first block's
    # copy-out (implicit prefetch: ``prev_all_gather_state``; measure --fake of seed 20261255 #23, Llama 3 8B dp8
    # ZeRO-3: the root's 2,004 MiB output beside the first block's 416 MiB on the all-gather stream, a segment of its
    # own): an event-only tensor of the allocation events (``Grain.root_gather``). (Not laid where the units stay
    # gathered or the rank is pipelined: there the seeds' ranks moved both ways, the events laying every gathered
    # unit on the all-gather stream where torch's copy-out makes them on the compute stream)
    T.root_gather = root_b
    if not moe:
        _kept_all_gather_at_copy_out(T, root_b, cur, sum(st.layers for st in rp.stages), f8)
    return cur


def _kept_all_gather_at_copy_out(T: Terms, root_b: int, block_b: int, blocks: int, f8: str) -> None:
    """Unpipelined ZeRO-3 resharding after forward: in a forward FSDP2 keeps a unit's all-gather result to the next
    unit's ``wait_for_unshard`` (implicit prefetch: ``comm_ctx.all_gather_state``), which drops it before its copy-out
    but holds it in a local (``prev_all_gather_state``) to its return — so at the first block's copy-out the root's
    all-gather output, the root's parameters, the block's output and its parameters are alive at once, and at a later
    block's the previous block's output with the current one's (torch 2.13 _fsdp_param_group.py wait_for_unshard;
    measure --fake of a LoRA Llama 3 405B dp8 cp2 step, its peak there: the root's 8,016 MiB and a block's 6,090 MiB
    outputs beside both units' parameters). The forward's moment counts one output, the units, the blocks' saved
    tensors and the forward's transients; a copy-out holds none of the first, and the last block's saved tensors not
    yet: beyond it the larger of the root's output less every block's saved tensors and a block's output less one
    block's (dense blocks: a MoE block's experts are a unit of their own)."""
    saved = sum(t.bytes // max(t.in_flight or 1, 1) for t in T["activations"] if t.kind == "layers")
    fwd = forward_transient_bytes(T)
    extra = max(root_b - saved, block_b - saved // max(blocks, 1)) - fwd
    if extra > 0:
        T.add("comm_buffers", "the previous unit's all-gather output kept to the next one's copy-out (FSDP2's implicit "
              "forward prefetch), the root's at the first block's: beyond the forward's moment" + f8, extra,
              f"max(the root's {root_b:,} B − the {blocks} blocks' saved {saved:,} B, a block's {block_b:,} B − one "
              f"block's saved) − the forward's transients {fwd:,} B", kind="fsdp_kept_all_gather")


def _head_forward_at_loss(cfg: Config, plan: WrappingPlan, T: Terms, kept: int) -> None:
    """The head's forward, the forward's last op before the loss: its output (the logits, in the compute dtype) beside
    the last block's all-gather output, which FSDP2 keeps to the root's post-forward (``comm_ctx.all_gather_state``,
    freed in ``FSDPState._post_forward`` of the root, after the head: torch 2.13 _fsdp_state.py). Where that is more
    than the loss's moment holds (its temporaries, the log-probabilities) the loss moment holds it (a term over the
    loss's own, each part in its category): measure --fake of a tiny dp2 ZeRO-2 step (accuracy sweep seed 20261233
    #19, V512, three blocks of 347,904 B gathered), its peak at the head's matmul, 85,760 B over the loss's. One
    microbatch only: with more, the head's backward after the loss (``_head_backward_at_loss``) is the loss moment's
    other alternative, and the moment holds one of them, not their sum (not laid)."""
    if cfg.conventions.state_accounting != "pytorch" or cfg.parallel.microbatches > 1:
        return
    loss, logp, logits = _after_the_loss(cfg, plan, T)
    if not loss or kept + logits <= logp + loss:
        return
    T.add("comm_buffers", "the head's forward, before the loss: the last block's all-gather output, kept to the root's "
          "post-forward", kept, f"{kept:,} B", kind="head_forward")
    T.add("activations", "the head's forward, before the loss: its output (the logits, the compute dtype) where the "
          "loss's log-probabilities are", logits - logp, f"{logits:,} B − {logp:,} B", kind="head_forward")
    T.add("temporaries", "the head's forward, before the loss: no loss temporaries yet", -loss, f"−{loss:,} B",
          kind="head_forward")


def _after_the_loss(cfg: Config, plan: WrappingPlan, T: Terms) -> tuple[int, int, int]:
    """What the loss moment holds of the loss (its temporaries, one microbatch's log-probabilities), both freed once
    the loss's backward has run, and the logits' gradient that backward hands on (the compute dtype; the loss's
    vocabulary: sharded under loss_parallel, else whole): (loss, log-probabilities, logits' gradient) bytes."""
    loss = sum(t.bytes for t in T["temporaries"] if t.kind == "loss")
    logp = sum(t.bytes // max(t.in_flight or 1, 1) for t in T["activations"] if t.kind == "log_probabilities")
    sp = cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel
    v = ceil_div(cfg.model.vocab, cfg.parallel.tp) if sp else cfg.model.vocab
    return loss, logp, PLAN_DTYPE_BYTES[plan.compute_dtype] * cfg.local_seq_len * cfg.training.micro_batch_size * v


def _root_regather_at_loss(cfg: Config, plan: WrappingPlan, T: Terms, root_b: int) -> None:
    """The root's pre-backward, right after the loss's backward: its hook on the logits fires with their gradient
    (the compute dtype, the loss's vocabulary), the loss's temporaries and the log-probabilities it saved freed,
    and gathers the root again: FSDP2's all-gather output and the copy-out into the root's parameters alive at
    once (``foreach_all_gather_copy_out``, then the output freed). The loss moment holds the larger of the two
    (a term over the loss's own): measured on a fake Llama 3 8B dp8 tp4 SP ZeRO-3 fp32 step (s4K b1, two
    microbatches), 0.979 GiB all-gather output and root parameters each beside the 0.489 GiB logits gradient,
    0.489 GiB over the loss's backward (1.468 GiB of temporaries, 0.489 GiB of log-probabilities)."""
    if cfg.conventions.state_accounting != "pytorch":
        return
    loss, logp, grad = _after_the_loss(cfg, plan, T)
    if not loss:
        return
    extra = 2 * root_b + grad - logp - loss
    if extra > 0:  # each part in its category: the gathered root a comm buffer, the freed log-probabilities activations
        T.add("comm_buffers", "FSDP2's root gathered again in its pre-backward, after the loss's backward: its "
              "all-gather output beside the copy-out", 2 * root_b, f"2 × {root_b:,} B", kind="fsdp_root_regather")
        T.add("temporaries", "the loss's backward done: the logits' gradient, the loss's temporaries freed",
              grad - loss, f"{grad:,} B − {loss:,} B", kind="fsdp_root_regather")
        T.add("activations", "the loss's backward done: the log-probabilities it saved freed", -logp, f"−{logp:,} B",
              kind="fsdp_root_regather")


def _root_post_backward_after_accumulation(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, psi_train: int,
                                           emb_full: int, emb_extra: int) -> None:
    """Unpipelined FSDP2 over several microbatches: the last one's backward reduces unit by unit as the walk reaches
    each, and the root unit (embeddings, final norm, head) last, in the backward's final callback. The end of the
    backward, before that post-backward, holds every other unit's sharded gradients (and, with an all-reduce group in a
    16-bit reduce dtype, their all-reduce outputs: ``held_all_reduce_bytes``), the last block's reduce-scatter input,
    the root still gathered with its accumulated unsharded gradients (under TP the token embedding's at full V·h) and,
    under TP, the token embedding's fresh full V·h gradient from the last backward (a new tensor: the accumulated one
    has another placement; where the accumulation converts dtypes ``fsdp_fresh_grad_end`` is it) — not yet the root's
    sharded gradients. measure --fake, Llama 3 405B dp4 tp4 SP replicate m2, bf16 reduce (8 blocks): at the token
    embedding's fresh gradient 8 × 3,040 MiB fp32 gradients and 8 × 1,520 MiB all-reduce outputs, the last block's
    1,520 MiB input, the root's 2 × 1,002 MiB gathered and its 4,008 + 1,002 MiB accumulated, the 4,008 MiB fresh one;
    the end laid the whole sharded gradients alone (−11.3 %). The moment only: the allocation events do not lay it
    (laid as one piece at the step's end it split the replay's segments: reserved +10 … +38 % on nine layouts whose
    peak is elsewhere); they make the root's reduce-scatter input that follows, one tensor on the compute stream where
    the live bytes stay within the peak (measure --fake of Llama 3 8B dp4 ZeRO-3 m2, fp32 gradients: a 4,008 MiB
    request, a new segment; seed 20261254 #05 reserved −13.2 → −3.9 %)."""
    gacc, pgrad = plan.grad_accumulation_bytes, PLAN_DTYPE_BYTES[plan.compute_dtype]
    root = rp.root_units
    experts = {u for u, _ in rp.expert_units} if plan.data_parallel == "replicate" else set()
    rest = [u for u, count in rp.unit_groups if u not in experts and count - (u in root) > 0]
    rs = max((padded_numel(u, gather_degree(cfg, plan, rp, u)) for u in rest), default=0)
    root_b, shard, s_root = _root_at_the_end(cfg, plan, rp, T)
    accumulated = gacc * (sum(unit_numel(u) for u in root) + emb_extra)
    fresh = pgrad * emb_full if emb_full and not plan.converts_gradients else 0
    held = (shard - s_root) * held_all_reduce_bytes(plan) // 4
    # (ZeRO-3 resharding after forward lays the gathered root as a term of its own, ``fsdp_root_params``)
    laid = root_b if plan.sharded and plan.reshard_after_forward else 0
    end = root_b + accumulated + fresh + gacc * rs + held - s_root - laid
    T.add("comm_buffers", "the end of the last microbatch's backward, before the root's post-backward: the root gathered "
          "with its accumulated gradients" + (" and the token embedding's fresh full V·h one" if fresh else "")
          + ", the last block's reduce-scatter input" + (", every other unit's all-reduce output" if held else "")
          + "; the root's sharded gradients not yet made", end,
          f"{root_b:,} + {accumulated:,} + {fresh:,} + {gacc} × {rs:,} + {held:,} − {s_root:,} − {laid:,} B",
          kind="fsdp_root_reduce_accumulated")
    # the root's post-backward then copies its gradients into its reduce-scatter input (``foreach_reduce``): a tensor
    # of its own in the allocation events (``Grain.root_end``), where the live bytes stay within the peak
    T.root_end = (gacc * sum(padded_numel(u, gather_degree(cfg, plan, rp, u)) for u in root), 0, False)


def _root_at_the_end(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms) -> tuple[int, int, int]:
    """(the root's gathered bytes, every sharded gradient's bytes, the root's share of them) for the end of an
    unpipelined backward, before the root's post-backward: the share by sharded elements (under expert parallelism the
    routed experts' units shard over another degree than the root's; replicate leaves them out, their gradients
    plain ones)."""
    ignored = {u for u, _ in rp.expert_units} if plan.data_parallel == "replicate" else set()
    root_b = sum(gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u in rp.root_units)
    shard = sum(t.bytes for t in T["grads"] if t.kind == "fsdp_sharded_grads")
    sh_el = sum(sharded_numel(u, gather_degree(cfg, plan, rp, u)) * count for u, count in rp.unit_groups
                if u not in ignored)
    s_root = (shard * sum(sharded_numel(u, gather_degree(cfg, plan, rp, u)) for u in rp.root_units) // sh_el
              if sh_el else 0)
    return root_b, shard, s_root


def _head_backward_at_loss(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, res: int) -> None:
    """The head's backward, right after the loss's: the loss's temporaries and the log-probabilities freed, the
    logits' gradient (the compute dtype) beside the head weight's fresh gradient, which autograd adds into the one
    accumulated over the earlier microbatches (plain gradients, or FSDP2 accumulating in the parameters' dtype:
    ``block_backward_terms``' rule for w2). Where that is more than the loss's backward (a large vocabulary, few
    tokens a rank) the loss moment holds it (a term over the loss's own, or over the root's gathering where
    that is larger): measured with ``measure --fake`` of Llama 3 405B pp8 cp4 HSDP ZeRO-2 bf16 gradients, last
    stage, a later microbatch: the head's 3.91 GiB fresh gradient beside the 0.49 GiB logits' gradient, −5.5 %."""
    added = not plan.fsdp2 or not plan.converts_gradients
    head = sum(st.head for st in rp.stages)
    loss, logp, grad = _after_the_loss(cfg, plan, T)
    if not (added and head and loss):
        return
    fresh = res * head
    root = sum(t.bytes for c in ("comm_buffers", "temporaries", "activations") for t in T[c] if t.kind == "fsdp_root_regather")
    extra = grad + fresh - logp - loss - root
    if extra > 0:
        T.add("temporaries", "the head's backward after the loss's: the logits' gradient and the head weight's fresh "
              "gradient, added into the one accumulated (over the loss's backward, the log-probabilities freed"
              + (", and over the root's gathering" if root else "") + ")", extra,
              f"{grad:,} B + {res} B × {head:,} − {logp:,} B − {loss:,} B" + (f" − {root:,} B" if root else "")
              + f" = {extra:,} B", kind="head_backward")


def _unit_by_unit_reduce(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, psi_train: int,
                         root_split: bool, emb_full: int, replicated: int = 0,
                         phases: tuple[tuple[int, int] | None, int] = (None, 0)) -> None:
    """Unpipelined FSDP2 (ZeRO-2 / -3, replicate) with one microbatch: each unit's post-backward takes autograd's
    gradients, reshards, drops the previous unit's reduce-scatter input (``reduce_scatter_max_input_buffers``
    = 1) and copies them into its own (``foreach_reduce``), in the reduce dtype. Through a block's backward:
    its gradients as autograd makes them (the parameter dtype), the previous unit's reduce-scatter input,
    and the root's first gradients — the head's and final norm's, made before any block's and reduced only
    with the embeddings' at the backward's end. At the end: the root's gradients (the embeddings' too) and
    its reduce-scatter input, or, just before it, the root still gathered beside the last block's input.
    The block's gradients made at a backward moment (``_block_grads_made``) and the walk's early and late
    moments (``_early_and_late_backward``; under ZeRO-2, where every block stays gathered until its post-backward,
    early frees the last block's unit and late is never the most). ``psi_train``: the elements FSDP2 reduces (under
    replicate not the routed experts, whose plain gradients autograd makes as the walk reaches each block: the late
    moment holds those of every block but layer 0, ``plain_late_grads``; measure --fake of Mixtral 8x7B s16K dp16 tp2
    ep8 replicate full recompute peaks in layer 0's recompute beside 5.25 GiB of them: −8.3 → +0.4 %)."""
    gacc, pgrad = plan.grad_accumulation_bytes, PLAN_DTYPE_BYTES[plan.compute_dtype]
    root = rp.root_units
    experts = {u for u, _ in rp.expert_units}
    rest = [(u, count - (u in root)) for u, count in rp.unit_groups if u not in experts]
    # the reduce-scatter input kept across a block's backward is the last reduced unit's: a block's own (under
    # expert parallelism its experts reduce first, in their post-backward, before the rest of the block's)
    rs = max((padded_numel(u, gather_degree(cfg, plan, rp, u)) for u, c in rest if c > 0), default=0)
    grads = max((unit_numel(u) for u, c in rest if c > 0), default=0)
    moe = max((unit_numel(u) for u in experts), default=0)  # a block's experts' gradients, made in their backward
    made, how = _block_grads_made(cfg, T, moe or grads, pgrad)
    by_b, mlp_phase = phases
    ring = bool(by_b and by_b[1] and not moe)  # context parallelism: the B's moment is the larger of two phases
    if ring:
        made, how = pgrad * by_b[0], f"{pgrad} B × {by_b[0]:,} (the down projection's, by the MLP's backward)"
    T.add("comm_buffers", f"a block's gradients made by autograd in {plan.compute_dtype} (its post-backward copies "
          "them into its reduce-scatter input)", made, how, kind="fsdp_unit_grads")
    if ring:  # the MLP's others and the output projection's, beside the ring attention's backward (measure --fake of
        # Llama 2 7B tp4 SP cp4 ZeRO-2 fp32: w1's, w2's and w3's 43 MiB fp32 gradients inside the attention's backward)
        _attention_phase_gradients(T, pgrad * by_b[1], plan.compute_dtype, mlp_phase, "comm_buffers", "fsdp_unit_grads")
    if root_split and moe:
        # the experts' post-backward: their gradients beside their own reduce-scatter input, the experts
        # resharded and their backward's transients gone; more than their backward where that input outweighs
        # them and the block's kept input
        # (their backward holds the experts gathered, the block's kept input, its transients and the gradients made
        # by then; their post-backward every expert gradient and the experts' own input)
        big = max(experts, key=unit_numel)
        x = gacc * padded_numel(big, gather_degree(cfg, plan, rp, big)) + pgrad * moe
        held = gathered_unit_bytes(plan, rp, big, gather_degree(cfg, plan, rp, big)) + gacc * rs + made + sum(
            t.bytes for c in ("activations", "temporaries", "comm_buffers") for t in T[c]
            if t.kind in ("moe_backward", "moe_backward_freed", "moe_full_backward", "moe_full_backward_freed"))
        if x > held:
            T.add("comm_buffers", f"the experts' post-backward: their reduce-scatter input (in {plan.reduce_dtype}) "
                  "beside all their gradients, beyond what their backward holds (the experts gathered, the block's kept "
                  "input, the backward's transients, the gradients made by then)", x - held, f"{x:,} − {held:,} B",
                  kind="fsdp_expert_reduce")
    has_head = any(st.final_norm or st.head for st in rp.stages)
    has_emb = any(st.stage == 0 for st in rp.stages)
    if has_head:
        head = unit_numel(root[-1])
        T.add("comm_buffers", f"the final norm's and head's gradients in {plan.compute_dtype}, made first and reduced "
              "with the root unit at the backward's end", pgrad * head, f"{pgrad} B × {head:,}", kind="fsdp_head_grad")
    if has_emb and not emb_full:  # (under TP its full-size gradient is a term of its own: embedding_full_gradient)
        emb = unit_numel(root[0])
        T.add("comm_buffers", f"the embeddings' gradients in {plan.compute_dtype}, made last", pgrad * emb,
              f"{pgrad} B × {emb:,}", kind="fsdp_root_reduce")
    # the end: the root's post-backward, in the backward's final callback (torch's FSDPParamGroup.post_backward and
    # foreach_reduce). Before it the root is still gathered, the last block's reduce-scatter input kept, the root's
    # sharded gradients not yet made and (TP) the embeddings' full-size gradient beside the row shard its
    # redistribution makes; at its copy-in it has resharded and the root's reduce-scatter input takes the root's
    # gradients (the row shard for the full one); once they are copied the list holding them is cleared and the
    # sharded gradients are made (ZeRO-3: a 1 / dp share; replicate: whole), one of those gradients still held
    # then. The end-of-backward moment holds every sharded gradient, the head's and the embeddings' gradients and
    # (ZeRO-3: ``fsdp_root_params``) the gathered root: this term makes it the largest of the three
    root_rs = gacc * sum(padded_numel(u, gather_degree(cfg, plan, rp, u)) for u in root)
    root_b, shard, s_root = _root_at_the_end(cfg, plan, rp, T)
    laid = root_b if root_split else 0
    u_head = pgrad * unit_numel(root[-1]) if has_head else 0
    row = pgrad * unit_numel(root[0]) if has_emb else 0  # the embeddings' gradient, its row shard
    u_emb = pgrad * emb_full if has_emb and emb_full else row  # what the moment holds of it
    before = root_b + gacc * rs - s_root + (row if emb_full else 0)
    copy_in = root_rs - s_root + row - u_emb
    # (after it: also the root's own all-reduce output in a 16-bit reduce dtype, at its cast: held_all_reduce_bytes)
    after = root_rs + max(u_head, row) - u_head - u_emb + s_root * held_all_reduce_bytes(plan) // 4
    end = max(before, copy_in, after) - laid
    if end:
        T.add("comm_buffers", "the root's post-backward at the end of the backward: the largest of before it (the root "
              "gathered, the last block's reduce-scatter input, the root's sharded gradients not yet made"
              + (", the embeddings' gradient's row shard beside the full one" if emb_full else "") + "), at its "
              "copy-in (its own reduce-scatter input beside its gradients) and after it (beside the sharded gradients, "
              "one of its gradients still held), beyond what the moment holds", end,
              f"max({before:,}, {copy_in:,}, {after:,}) − {laid:,} B",
              kind="fsdp_root_end")
        # the allocation events lay the sides in torch's order (``Grain.root_end``)
        T.root_end = (root_rs, laid, copy_in >= max(before, after))
    elif root_rs:  # the moment holds more than every side: the events still make the input, a tensor of its own
        T.root_end = (root_rs, laid, False)
    held = held_all_reduce_bytes(plan)
    if held and shard > s_root:  # every other unit's all-reduce input, held to finalize_backward after the root's
        T.add("comm_buffers", f"the all-reduce inputs (in {plan.reduce_dtype}) of every unit but the root, each kept by "
              "its group to the end of the backward", (shard - s_root) * held // 4,
              f"{held} / 4 of {shard - s_root:,} B", kind="fsdp_root_reduce")
    # ZeRO-2 (every unit gathered to its post-backward): the last block's post-backward also frees its unit
    # (replicate ignores the routed experts: none gathered, their gradients plain ones, ``states.replicate_expert_grads``)
    plain = [t for t in T["grads"] if t.kind == "gradients"] if plan.data_parallel == "replicate" and moe else []
    one_unit = 0
    if not root_split:
        one_unit = max((gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u, c in rest if c > 0),
                       default=0)
        if not plain:
            one_unit += max((gathered_unit_bytes(plan, rp, u, gather_degree(cfg, plan, rp, u)) for u in experts),
                            default=0)
    for t in plain:  # the experts' gradients: every MoE block's but layer 0's by its backward
        all_experts = sum(unit_numel(u) * c for u, c in rp.expert_units)
        done = all_experts - (moe if cfg.model.dense_layers == 0 else 0)  # (the first blocks dense: layer 0 has none)
        T.add("grads", f"{t.label}: every block's but layer 0's, made by layer 0's backward",
              t.bytes * done // all_experts, f"{done:,} / {all_experts:,} of {t.bytes:,} B", kind="plain_late_grads")
    _early_and_late_backward(plan, rp, T, psi_train, unit_numel(root[0]) * has_emb
                             + (unit_numel(root[-1]) if has_head else 0), grads + (0 if plain else moe), gacc * rs, rs,
                             one_unit,
                             late=root_split,
                             resharded=replicated - root_b - one_unit if replicated else 0,
                             mlp_saved=cfg.training.recompute in ("none", "selective"))


def _block_grads_made(cfg: Config, T: Terms, grads: int, pgrad: int) -> tuple[int, str]:
    """(bytes, formula) of a block's weight gradients alive at a backward moment beside the block's transients
    (what its backward recomputes and its MLP's backward holds: ``recomputed_block``, ``mlp_backward``). Autograd
    runs the block's MLP first, its down projection's weight first: in the MLP's backward the block holds that
    gradient; in its attention's backward, the MLP's transients freed, every MLP weight's. The larger of the two
    beside the transients of the first. (A block with experts: none here, the MoE backward's term holding them.)"""
    m, par = cfg.model, cfg.parallel
    if m.experts:
        # the MoE backward's own term (engine.memory.activations' moe_backward) holds the experts' weight gradients
        return 0, "0 B: the MoE backward's term holds the experts' weight gradients"
    weights, _ = mlp_tensors(m, m.ffn_hidden, par.tp)
    down, mlp = pgrad * weights[-1][0] * weights[-1][1], pgrad * sum(a * b for a, b in weights)
    kinds = ("recomputed_block", "mlp_backward", "mlp_backward_freed")
    transients = sum(t.bytes for c in ("activations", "temporaries") for t in T[c] if t.kind in kinds)
    made = min(pgrad * grads, max(down, mlp - transients))
    return made, f"max(down projection's {down:,} B, the MLP weights' {mlp:,} B − the MLP backward's transients {transients:,} B)"


def reduce_scatter_input_category(plan: WrappingPlan) -> str:
    """The category a unit's reduce-scatter input is measured in: FSDPMemTracker names it "Reduce Scatter" (comm_buffers)
    at the ``_reduce_scatter_base_`` that takes it (torch 2.13 fsdp2_mem_tracker.py, in POST_BW), which ``replicate``'s
    shard group of one never calls (foreach_reduce copies the input into its output instead): there it stays the
    temporary it was made as (measure --fake of Llama 3 405B dp4 tp4 SP ZeRO-1 (replicate), seed 20261263 #09: its
    1,520 MiB input among the temporaries, comm_buffers +8 % and temporaries −42 % with it filed as comm)."""
    return "temporaries" if plan.data_parallel == "replicate" else "comm_buffers"


def held_all_reduce_bytes(plan: WrappingPlan) -> int:
    """Bytes per element of a unit's gradient that FSDP2 keeps after its post-backward beside the fp32 sharded
    gradient, 0 if none: with an all-reduce group (HSDP's replicate dimension, or ``replicate``) torch's
    ``foreach_reduce`` all-reduces the reduce-dtype output and hands it back as ``all_reduce_input``, which the
    unit's ``FSDPParamGroup._all_reduce_state`` holds (torch 2.13: "keeps the buffer off the caching allocator's free
    list", PR #140044) until the unit's next unshard or ``finalize_backward``; where that dtype is the parameters'
    it is the sharded gradient's own storage, else a buffer of its own (``measure --fake`` of Llama 3 405B dp8 tp8
    replicate, bf16 gradients: seven 760 MiB bf16 buffers beside the 1,520 MiB fp32 gradients late in the B). The
    root's own is alive at its cast to the sharded gradients' dtype (``_to_dtype_if_needed`` after ``dist.all_reduce``)
    in its post-backward (measure --fake of Llama 3 70B dp32 tp2 SP ZeRO-1 (replicate) bf16 gradients, seed 20261263
    #04: the root's 2,004 MiB bf16 output beside its 4,008 MiB fp32 cast and its 2,004 MiB reduce-scatter input, −4.0 %
    without it)."""
    if not (plan.hsdp or plan.data_parallel == "replicate"):
        return 0
    rb = PLAN_DTYPE_BYTES.get(plan.reduce_dtype, 4)
    return rb if rb < 4 else 0


def _early_and_late_backward(plan: WrappingPlan, rp: RankParams, T: Terms, psi_train: int, root: int, block: int,
                             rs_bytes: int, rs: int, one_unit: int = 0, late: bool = True, resharded: int = 0,
                             mlp_saved: bool = True) -> None:
    """The one B of an unpipelined ZeRO-3 step walks its blocks last to first. Each block's post-backward adds
    its sharded gradients and keeps its reduce-scatter input until the next one's, while the block's backward
    has freed its saved tensors; the current block's gathered unit, the next one's all-gather output and the
    gradients autograd is making (``fsdp_unit_grads``) are there at every block. So the most is at one end of
    the walk: at its start (the B's own moment), early (the second block's backward), or late (the
    second-to-last's).

    Early (``early_backward``, at the B's own moment, only where it is more than the start): the last block's
    sharded gradients and reduce-scatter input, less its saved tensors. Late (``late_backward``): the sharded
    gradients of every unit reduced by layer 1's backward (all but the root and layers 0 and 1: their share by
    elements), layer 2's reduce-scatter input, and layer 0's saved tensors (layer 1's are the B's own transients,
    as at its own moment: its recomputed tensors, its MLP's backward). Measured on fake steps: Llama 3 70B
    full-recompute peaks late, Llama 2 7B and the tiny model without recompute early. Under ZeRO-2 (``one_unit``:
    every unit is gathered until its post-backward, which reshards it) early also frees the last block's unit,
    and late is never the most (``late`` False).

    Under replicate (``resharded``: the gathered bytes of every unit but the root and layer 0) the sharded
    gradients are whole (fp32 where the gathered copy is 16-bit), so each block's post-backward adds more than it
    frees and the walk's most is at its last block: late is layer 0's backward, every later unit's gradients reduced
    and its gathered copy resharded, layer 1's reduce input kept (measure --fake of Llama 3 405B dp16 tp4 ZeRO-1
    full recompute, m = 1: 7 of 8 blocks' fp32 gradients, the root and layer 0 gathered)."""
    sharded = [t for t in T["grads"] if t.kind == "fsdp_sharded_grads"]
    at = 0 if resharded else 1  # the late moment's layer
    experts = {u for u, _ in rp.expert_units}
    blocks = sum(count - (u in rp.root_units) for u, count in rp.unit_groups if u not in experts)
    done = max(0, psi_train - root - (at + 1) * block)
    one = min(block, max(0, psi_train - root))
    layers = rp.layers
    saved = sum(t.bytes // t.in_flight // layers for t in T["activations"]
                if t.kind in BLOCK_KINDS and t.in_flight and layers)
    rs_how = f"{plan.grad_accumulation_bytes} B × the largest block unit's elements, padded ({rs:,})"
    early = [(t, t.bytes * one // psi_train if psi_train else 0) for t in sharded]
    if sum(x for _, x in early) + rs_bytes > saved + one_unit:
        for t, x in early:
            T.add("grads", f"{t.label}: the last block's, reduced before the second block's backward", x,
                  f"{one:,} / {psi_train:,} of {t.bytes:,} B", kind="fsdp_early_reduce")
        T.add(reduce_scatter_input_category(plan), f"reduce-scatter input of the last block (in {plan.reduce_dtype}), "
              "kept through the second block's backward", rs_bytes, rs_how, kind="fsdp_early_reduce")
        # (less what the B's moment already takes off of them: its MLP backward's freed down input, laid there too,
        # where the block saved it — ``mlp_saved``: no recompute, or the attention core's only; a recomputing block's
        # down input is one of its recomputed tensors, not of these)
        gone = -sum(t.bytes for t in T["activations"] if t.kind == "mlp_backward_freed") if mlp_saved else 0
        T.add("activations", "the last block's saved tensors, freed by its backward", -max(0, saved - gone),
              f"−1 / {layers} of one microbatch's blocks" + (f", less the {gone:,} B its MLP backward freed" if gone
                                                             else ""), kind="fsdp_early_reduce")
        if one_unit:
            T.add("comm_buffers", "the last block's gathered unit, resharded in its post-backward", -one_unit,
                  f"−{one_unit:,} B", kind="fsdp_early_reduce")
        prefetched = sum(t.bytes for t in T["comm_buffers"] if t.kind == "all_gather_output")
        if blocks <= 2 and prefetched and not one_unit:
            # the second block is the walk's last (the root stays gathered): its pre-backward has no unit left to
            # prefetch, so no all-gather output is alive there (a real CPU run of a 2-block model, dp4 ZeRO-3 full
            # recompute, tiny sweep seed 20261220 #06: tracked peak +15.4 % with one, the reduce-scatter input and
            # the recomputed block alone in the measured peak)
            T.add("comm_buffers", "no all-gather output in the second block's backward: the last block of the walk, "
                  "nothing left to prefetch", -prefetched, f"−{prefetched:,} B", kind="fsdp_early_reduce")
    if not (late or resharded) or blocks <= at + 1:  # (no layer at + 1: the late moment is the walk's start)
        return
    layers_done = "layers 0-1" if at else "layer 0"
    reduced = 0
    for t in sharded:
        x = t.bytes * done // psi_train if psi_train else 0
        reduced += x
        T.add("grads", f"{t.label}: those of every unit but the root and {layers_done}, reduced before layer {at}'s "
              "backward", x, f"{done:,} / {psi_train:,} of {t.bytes:,} B", kind="fsdp_reduced_grads")
    held = held_all_reduce_bytes(plan)
    if held and reduced:
        T.add("comm_buffers", f"the all-reduce inputs (in {plan.reduce_dtype}) of those units, each kept by its group to "
              "the end of the backward", reduced * held // 4, f"{held} / 4 of {reduced:,} B", kind="fsdp_late_reduce")
    T.add(reduce_scatter_input_category(plan), f"reduce-scatter input of layer {at + 1} (in {plan.reduce_dtype}), kept "
          f"through layer {at}'s backward", rs_bytes, rs_how, kind="fsdp_late_reduce")
    if resharded:
        T.add("comm_buffers", "every unit but the root and layer 0, resharded in its post-backward by layer 0's "
              "backward", -resharded, f"−{resharded:,} B", kind="fsdp_late_reduce")
    if saved:
        T.add("activations", f"the first block's saved tensors, still alive {'late in' if at else 'at the end of'} "
              "the backward", saved, f"1 / {layers} of one microbatch's blocks", kind="late_block_activations")


def _plain_early_backward(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, psi_train: int) -> None:
    """Plain gradients (DDP, ZeRO-1, one rank) on a rank of one stage, at its first B's own moment
    (``first_backward``): autograd has made the ``.grad`` of every parameter its walk has passed — the final norm's
    and the head's (the loss's backward runs into them first) and, where that moment is inside the stage's last
    block with experts (``moe_backward_terms``), the stage's blocks after it and its shared experts' (computed after
    the routed experts in the forward, ``backend/model.py`` ``MoE.forward``: their backward runs first); a later B
    holds every gradient (``after_first_backward``). measure --fake of a tiny MoE DDP dp4 ZeRO-1 step (accuracy
    sweep seed 20261233 #23, h48, V384, 4 experts): its peak in the routed experts' loop holds the head's, final
    norm's and shared experts' gradients, 123,072 B (−4.6 % tracked without them)."""
    if cfg.training.finetune == "lora" or not rp.layers or not psi_train:
        return
    grads = sum(t.bytes for t in T["grads"] if t.kind == "gradients")
    if not grads:
        return
    m, par = cfg.model, cfg.parallel
    done = sum(st.head + st.final_norm for st in rp.stages)
    where = "the final norm's and head's"
    layers = split_layers(m.layers, par.num_stages, par.pipeline_split)[rp.stages[0].stage]
    moe_idx = [i for i in layers if m.is_moe_layer(i)]
    if moe_idx and any(t.kind == "moe_backward" and t.bytes for t in T["temporaries"]):
        after = sum(1 for i in layers if i > moe_idx[-1])  # dense blocks after it
        done += after * sum(a * b for a, b in layer_tensors(m, par.tp))
        if m.shared_experts:
            w, bias = mlp_tensors(m, m.shared_experts * m.expert_hidden, par.tp)
            done += sum(a * b for a, b in w + bias)
        where += ", the later blocks' and the last block with experts' shared experts'"
    if done:
        T.add("grads", f"gradients made by the B's own moment: {where}", grads * done // psi_train,
              f"{done:,} / {psi_train:,} of {grads:,} B", kind="plain_early_grads")


def _plain_late_backward(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, psi_train: int) -> None:
    """Plain gradients (DDP, ZeRO-1, one rank) in a rank's first B over its one stage (``states.plain_first_backward``):
    autograd makes each parameter's ``.grad`` as the backward reaches it (the head's and final norm's first, each
    block's in its backward, the embeddings' last), so the walk holds more gradients at each block and fewer saved
    tensors. Its late moment is the stage's first block's backward (``late_backward``): every gradient but that
    block's and the embeddings', and the B's transients as at its own moment; unpipelined with one microbatch the
    moment is the end's (``lifetimes._with_late_moment``) and that block's saved tensors come back, else the B's own
    (``lifetimes._with_first_late_moment``) and the walked blocks' go. Measured with ``measure --fake`` of Mixtral
    8x7B s32K ep8 DDP full recompute (8 blocks): 6.18 GiB of fp32 gradients at the step's peak, layer 0's recompute
    and MoE backward beside them; of Llama 2 7B GPipe pp2 m8 DDP full recompute, its last stage's first B late in its
    walk (−1.9 → −0.8 %)."""
    if cfg.training.finetune == "lora" or not rp.layers or not psi_train:
        return
    grads = sum(t.bytes for t in T["grads"] if t.kind == "gradients")
    if not grads:
        return
    emb = sum(st.embedding + st.position for st in rp.stages)
    block = sum(st.blocks + st.experts for st in rp.stages) // rp.layers
    done = max(0, psi_train - emb - block)
    T.add("grads", "gradients made by layer 0's backward: every parameter's but layer 0's and the embeddings'",
          grads * done // psi_train, f"{done:,} / {psi_train:,} of {grads:,} B", kind="plain_late_grads")
    saved = sum(t.bytes // t.in_flight // rp.layers for t in T["activations"]
                if t.kind in BLOCK_KINDS and t.in_flight)
    if cfg.parallel.pp == 1 and cfg.parallel.microbatches == 1:
        if saved:  # (the moment is the end's, its microbatch freed: ``lifetimes._with_late_moment``)
            T.add("activations", "the first block's saved tensors, still alive in its backward", saved,
                  f"1 / {rp.layers} of one microbatch's blocks", kind="plain_late_activations")
    elif saved and rp.layers > 1:  # the moment is the first B's, its microbatch alive (its stage output kept by the
        # stage to the B's end: ``lifetimes._with_first_late_moment``): the blocks it has walked freed
        T.add("activations", "the first B's later blocks' saved tensors, freed by its first block's backward",
              -saved * (rp.layers - 1), f"−{rp.layers - 1} / {rp.layers} of one microbatch's blocks",
              kind="plain_late_activations")


def _reduce_grad(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, ignored: set) -> None:
    """A pipelined rank of one stage, at the schedule's REDUCE_GRAD (torch's ``_add_reduce_grad``, after its last
    backward: ``perform_reduce_grad`` runs each FSDP2 unit's post-backward, the root's first, then the blocks' in
    module order): each reshards its unit, allocates its reduce-scatter input (every rank's padded shard, in the reduce
    dtype), copies its accumulated gradient in and drops it (``unsharded_grads.clear()``; a stage root's outlives the
    output, as the fake holds it), allocates the output (its own shard) and converts it to the sharded parameter's fp32
    where the reduce dtype is another; its input goes before the next unit's. Beside every other
    unit's accumulated gradients and gathered parameters, the first units hold the most: measure --fake of Llama 3 8B
    pp2 1F1B ZeRO-3 fp32 reduce, stage 0 at 2,048 tokens (its peak): the root's 2,004 MiB input and 250.5 MiB output
    beside 5,332 MiB of accumulated gradients and four gathered blocks. What the REDUCE_GRAD moment holds beyond every
    accumulated gradient and gathered unit (lifetime ``reduce_grad``): the most over the units, in turn."""
    gacc, rb = plan.grad_accumulation_bytes, PLAN_DTYPE_BYTES[plan.reduce_dtype]
    root = rp.root_units
    groups = [(root, 1)] if root else []  # the root's units are one FSDP2 group (``fully_shard(model)``)
    groups += [((u,), count - (u in root)) for u, count in rp.unit_groups if u not in ignored and count - (u in root) > 0]
    best = held = gross = 0
    for units, count in groups:  # (a run of identical units holds the most at its first: each drops more than it keeps)
        deg = [gather_degree(cfg, plan, rp, u) for u in units]
        shard = sum(sharded_numel(u, d) for u, d in zip(units, deg))
        out, conv = rb * shard, (4 * shard if rb != 4 else 0)
        gathered = sum(gathered_unit_bytes(plan, rp, u, d) for u, d in zip(units, deg))  # resharded first
        acc = gacc * sum(unit_numel(u) for u in units)
        rs_in = rb * sum(padded_numel(u, d) for u, d in zip(units, deg))
        # foreach_reduce drops the accumulation once copied in (``unsharded_grads.clear()``) before it allocates the
        # output; the root's outlives it (measured: the token embeddings' 2,004 MiB beside the output)
        here = held - gathered + rs_in + max(0, out + conv - (0 if units is root else acc))
        if here > best:  # the allocation events lay that unit's input whole where it fits (``Terms.reduce_gross``)
            best, gross = here, rs_in
        # each keeps its sharded gradient and drops its parameters and its accumulation
        held += count * ((conv or out) - gathered - acc)
    if best:
        T.reduce_gross = gross
        T.add("comm_buffers", "the schedule's REDUCE_GRAD: the first units' reduce-scatter input and output (and the "
              "output in fp32) beside the other units' accumulated gradients and gathered parameters, less what they "
              "dropped", best, f"the most over the units in turn = {best:,} B", kind="fsdp_reduce_grad")


def _reduce_scatter_input(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms,
                          train_units: tuple[tuple[int, int], ...], lora_on: bool) -> None:
    """One unit's reduce-scatter input, in the reduce dtype (``fsdp2_buffers`` where gradients do not
    accumulate unsharded): the largest unit's, each dim 0 padded to a multiple of its shard degree as
    ``foreach_reduce`` allocates it (the adapters' under LoRA)."""
    gacc = plan.grad_accumulation_bytes
    big = max(n for n, _ in train_units)
    what = f"largest FSDP unit's trainable elements ({big:,})"
    if not lora_on:
        padded = max(padded_numel(u, gather_degree(cfg, plan, rp, u)) for u, _ in rp.unit_groups)
        if padded != big:
            big, what = padded, f"largest FSDP unit's elements, each dim 0 padded to a multiple of the shard degree ({padded:,})"
    T.add("comm_buffers", f"reduce-scatter input (one unit's unsharded gradients, in {plan.reduce_dtype}"
          + (", adapters only)" if lora_on else ")"), gacc * big, f"{gacc} B × {what}", kind="reduce_scatter_input")


def replicated_embedding_gradient(cfg: Config, rp: RankParams) -> tuple[int, int]:
    """(elements of the full token-embedding gradient, elements beyond the local row shard) on a rank
    whose stage holds the untied token embedding under TP with FSDP2; (0, 0) elsewhere.

    Under TP the embedding's weight is a row-sharded DTensor, but the gradient of its lookup comes
    back replicated (every TP rank holds V × h). FSDP2 reads it through
    ``FSDPParam._get_grad_inner_tensor``, which redistributes it to the parameter's placement only
    when the post-backward reduces it, and ``to_accumulated_grad_if_needed`` casts the replicated
    gradient as it is: the accumulation holds V × h in the reduce dtype until then.
    """
    model = cfg.model
    if cfg.parallel.tp == 1 or model.tied_embeddings or cfg.training.finetune == "lora":
        return 0, 0
    local = sum(st.embedding for st in rp.stages)
    if not local:
        return 0, 0
    full = model.vocab * model.hidden
    return full, full - local


def ddp_buffers(cfg: Config, rp: RankParams, T: Terms, psi_train: int, torch_acc: bool) -> None:
    """DDP's gradient buckets."""
    tr, conv = cfg.training, cfg.conventions
    lora_on = tr.finetune == "lora"
    gb = 4 if torch_acc else tr.grad_bytes  # DDP's buckets take the gradients' dtype (fp32 under autocast)
    buckets = max(1, math.ceil(gb * psi_train / (conv.ddp_bucket_mb * MB)))
    if getattr(conv, "ddp_gradient_as_bucket_view", False):
        T.add("comm_buffers", "DDP gradient buckets (gradients are views into them)", 0,
              "0 (gradient_as_bucket_view=True)", kind="ddp_buckets")
    else:
        T.add("comm_buffers", f"DDP gradient buckets ({buckets} × ≤{conv.ddp_bucket_mb:g} MB)", gb * psi_train,
              f"{gb} B × {'Ψ_lora (frozen parameters have no bucket)' if lora_on else 'Ψ'}: the Reducer's flat "
              "buckets cover every gradient; bucket_cap_mb sets their count", kind="ddp_buckets")
    # (no gradient-sized temporary: the Reducer writes each gradient into its bucket, ``mul_out`` into
    # the bucket's view. MemTracker files the bucket the first time it sees it, in the synchronised
    # backward, as Temp, which looked like one: ``backend.measure._without_pre_existing``)


def zero_paper_buffers(cfg: Config, rp: RankParams, T: Terms, train_units: tuple[tuple[int, int], ...]) -> None:
    """ZeRO-2/3 under the paper's accounting: one unit's reduce-scatter input, ZeRO-3's gathers."""
    par, tr, conv = cfg.parallel, cfg.training, cfg.conventions
    w, g, d = tr.param_bytes, tr.grad_bytes, par.shard_degree
    sizes = _unit_sizes(rp)
    largest = sizes[0]
    big = max(n for n, _ in train_units)
    T.add("comm_buffers", "reduce-scatter input (one unit's unsharded gradients)", g * big,
          f"{g} B × largest FSDP unit's trainable elements ({big:,})", kind="reduce_scatter_input")
    if par.zero == 3:
        T.add("comm_buffers", "all-gather input (one unit's shard)", w * ceil_div(largest, d),
              f"{w} B × ⌈{largest:,}/{d}⌉", kind="all_gather_input")
        n_units = 2 if conv.fsdp_prefetch and len(sizes) > 1 else 1
        unsharded = sum(sizes[:n_units])
        T.add("temporaries", "unsharded parameters: current unit" + (" + prefetched unit" if n_units == 2 else ""),
              w * unsharded, f"{w} B × ({' + '.join(f'{x:,}' for x in sizes[:n_units])}) — the all-gather output",
              kind="unsharded_params")


def pipeline_buffers(cfg: Config, rp: RankParams, T: Terms, res: int, sbh_rep: int, hs: str) -> None:
    """The p2p receive buffers of each local stage: one per microbatch, for activations and gradients."""
    m, n_stages = cfg.parallel.microbatches, cfg.parallel.num_stages
    stage_io = res * sbh_rep
    for st in rp.stages:
        if st.stage > 0:
            T.add("comm_buffers", f"stage {st.stage}: activation receive buffers", m * stage_io,
                  f"m × {res}·s·b·{hs} = {m} × {stage_io:,} (torch allocates one per microbatch)",
                  stage=st.stage, kind="p2p_activation_receive")
        if st.stage < n_stages - 1:
            T.add("comm_buffers", f"stage {st.stage}: gradient receive buffers", m * stage_io,
                  f"m × {res}·s·b·{hs} = {m} × {stage_io:,}", stage=st.stage, kind="p2p_gradient_receive")


def moe_dispatch_buffers(cfg: Config, T: Terms, ep_rank: int | None = None) -> None:
    """Expert parallelism's all-to-all buffers of the MoE layer in flight: the send buffer (this
    rank's n·k token copies, permuted by expert) and the receive buffer (the routed copies it
    computes, n_r = n·k × the routed factor), for dispatch and, in the backward, for combine's
    gradients; one layer's at a time (the dispatched tokens the experts keep are activations).
    Under a measured expert load the receive buffer holds ``ep_rank``'s routed copies."""

    m, tr = cfg.model, cfg.training
    act = 4 if tr.precision == "fp32" else 2
    n, n_r = moe_tokens(cfg, ep_rank)
    send = act * n * m.experts_per_token * m.hidden
    recv = act * n_r * m.hidden
    T.add("comm_buffers", "MoE all-to-all: one layer's dispatch send and combine receive buffers (n·k token copies)",
          send, f"{act} B × n·k·h = {act} × {n:,}·{m.experts_per_token}·{m.hidden}", kind="moe_all_to_all")
    T.add("comm_buffers", "MoE all-to-all: one layer's dispatch receive and combine send buffers (routed copies)",
          recv, f"{act} B × n_r·h = {act} × {n_r:,}·{m.hidden}", kind="moe_all_to_all")


def comm_buffers(cfg: Config, plan: WrappingPlan, rp: RankParams, T: Terms, *, psi: int, psi_train: int,
                 train_units: tuple[tuple[int, int], ...], res: int, sbh_rep: int, hs: str,
                 ep_rank: int | None = None, mlp_phase: int = 0, before_weight_gradients: bool = False) -> None:
    """Every communication buffer of this rank (and the temporaries that go with them); ``ep_rank``
    sizes the MoE receive buffers under a measured expert load; ``mlp_phase``: what a B's MLP phase holds that its
    context-parallel attention's does not (``engine.memory.activations._cp_attention_after_mlp``);
    ``before_weight_gradients``: a B's MLP moment comes before the block's first weight gradient (float8's casts of
    the tokens, ``engine.memory.activations.block_backward_terms``)."""
    par = cfg.parallel
    torch_acc = cfg.conventions.state_accounting == "pytorch"
    z = par.zero
    if torch_acc and plan.fsdp2 and par.dp_cp > 1:
        fsdp2_buffers(cfg, plan, rp, T, psi, psi_train, train_units, mlp_phase, before_weight_gradients)
    elif z in (0, 1) and par.dp_cp > 1:
        # DDP leaves the routed experts out (their replicas are the efsdp ranks; sync_expert_grads)
        ddp_buffers(cfg, rp, T, psi_train - (rp.experts if cfg.model.experts else 0), torch_acc)
    elif z in (2, 3) and par.shard_degree > 1:
        zero_paper_buffers(cfg, rp, T, train_units)
    if par.pp > 1:
        pipeline_buffers(cfg, rp, T, res, sbh_rep, hs)
    if plain_first_backward(cfg, plan, rp):  # (legacy nn.DataParallel's GPU 0 sums its terms whole: engine.legacy_dp)
        _plain_early_backward(cfg, plan, rp, T, psi_train)
        _plain_late_backward(cfg, plan, rp, T, psi_train)
    if torch_acc and par.microbatches > 1 and cfg.training.finetune != "lora" and not (
            par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES):  # a split backward's I makes no weight gradient
        _head_backward_at_loss(cfg, plan, rp, T, res)
    if par.ep > 1 and any(st.moe_layers for st in rp.stages):
        moe_dispatch_buffers(cfg, T, ep_rank)
    if not T["comm_buffers"]:
        T.add("comm_buffers", "no collective buffers (nothing to reduce)", 0, "0", kind="none")
    if not T["temporaries"]:
        T.add("temporaries", "no large temporaries", 0, "0", kind="none")
