"""Model states (params, grads, optimizer): one function per accounting, and adapters under LoRA.

``conventions.state_accounting = "zero-paper"`` (``zero_paper_states``) is the ZeRO paper's split
(Rajbhandari et al. 2020). ``w`` = compute-copy bytes (2 under bf16/fp16-mixed, 4 under fp32);
``g`` = ``training.grad_dtype`` bytes; optimizer = fp32 master copy (4, mixed precision only) +
4 per state (adamw 2, sgd-momentum 1, sgd 0). ZeRO shards over ``parallel.shard_degree`` d (dp·cp,
or dp/replicate·cp under HSDP: context-parallel ranks join the shard group, torchtitan's
dp_shard_cp mesh) — never the world:
    ZeRO-0  w·Ψ + g·Ψ + o·Ψ           ZeRO-2  w·Ψ + g·⌈Ψ/d⌉ + o·⌈Ψ/d⌉
    ZeRO-1  w·Ψ + g·Ψ + o·⌈Ψ/d⌉       ZeRO-3  (w + g + o)·Ψ_d, Ψ_d = Σ ⌈dim0/d⌉·rest per tensor
(ZeRO-1/2 shard one flat buffer like DeepSpeed; ZeRO-3 pads every tensor's dim 0 like FSDP2.)

The default, "pytorch" (``pytorch_states``), reports what torch keeps, strategy by strategy,
exactly as ``backend/`` runs it — the product promises predicted-vs-measured agreement with
PyTorch, so its default split is the one PyTorch has. Which wrapper holds the model is
``engine.wrapping.wrapping_plan``'s decision:
    DDP / ZeRO-0    autocast (mixed) or fp32: params 4Ψ (fp32; autocast casts on the fly, caching
                    the 16-bit weights for the step — counted in activations), grads 4Ψ (the
                    parameter dtype), optimizer 4kΨ (no separate master); DDP buckets 4Ψ.
    ZeRO-1          the same, optimizer 4k × this DP rank's share under ZeroRedundancyOptimizer's
                    greedy whole-tensor partition (``engine.model.params.zero_redundancy_partition``):
                    ranks differ, the sum is exact. With TP (which ZeroRedundancyOptimizer refuses)
                    FSDP2's replicate and the backend's TensorParallelZeRO1: the same partition of
                    each TP shard's own tensors.
    ZeRO-2 / -3     FSDP2 + MixedPrecisionPolicy: params 4Ψ_d (the fp32 shard is the master),
                    grads 4Ψ_d, optimizer 4kΨ_d (the gathered 16-bit copies: ``buffers``).
    DP × TP         FSDP2's replicate: whole fp32 params / grads.
    TP alone        the vocab-parallel token embedding's gradient is full V × h on every rank.

Expert parallelism (``parallel.ep`` > 1): the routed experts' own FSDP units shard over
efsdp = dp_shard·cp·tp / ep instead of d (``expert_degree``), as torchtitan's sparse mesh does;
without EP they shard as every other parameter.

LoRA (``lora_states``, engine.model.lora): a frozen base with no gradient and no optimizer state,
sharded like any parameter under ZeRO-3 / FSDP2 (fully_shard shards frozen parameters too),
and trainable adapters (fp32 under "pytorch").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from engine.config import Config
from engine.memory.report import Terms, ceil_div
from engine.model import lora
from engine.model.params import (
    RankParams,
    Tensors,
    attention_tensors,
    expert_tensors,
    mlp_tensors,
    norm_tensors,
    rank_tensor_groups,
    sharded_numel,
    unit_numel,
    zero_redundancy_largest,
    zero_redundancy_shares,
)
from engine.names import OPTIMIZER_STATES, SPLIT_BACKWARD_SCHEDULES
from engine.wrapping import WrappingPlan, wrapping_plan


def per_stage_gradients(plan: WrappingPlan, rp: RankParams) -> bool:
    """Whether FSDP2's gradients are laid stage by stage: under a pipeline schedule on a rank of several
    stages, torch reduces each stage's right after that stage's last backward
    (``engine.memory.lifetimes.STAGE_LIFETIMES``), so the terms are per stage."""
    return plan.unsharded_after_first_backward and len(rp.stages) > 1


def stage_shares(nbytes: int, rp: RankParams) -> list[tuple[int, int]]:
    """(stage, bytes) of ``nbytes`` split over the rank's stages by their elements (the last takes the
    rounding; each stage's sharding padding is not told apart)."""
    total = rp.total or 1
    out, given = [], 0
    stages = sorted(rp.stages, key=lambda st: st.stage)
    for k, st in enumerate(stages):
        x = nbytes - given if k == len(stages) - 1 else nbytes * st.total // total
        out.append((st.stage, x))
        given += x
    return out


def stage_plain_gradients(cfg: Config, plan: WrappingPlan, rp: RankParams) -> bool:
    """Whether a rank's plain gradients (no FSDP2, torch's accounting, not DDP's ``gradient_as_bucket_view``) are laid
    per local stage: a pipeline rank of several stages, where autograd makes each stage's at that stage's first
    backward, a split backward's at its first W (``_plain_gradients_by_stage``; measure --fake of Llama 3 8B
    InterleavedZeroBubble pp2 v2 tp8: rank 0 peaks in stage 2's second W with none of stage 0's 2.2 GiB)."""
    return (cfg.parallel.pp > 1 and len(rp.stages) > 1 and not plan.fsdp2
            and cfg.conventions.state_accounting == "pytorch"
            and not getattr(cfg.conventions, "ddp_gradient_as_bucket_view", False))


def _plain_gradients_by_stage(T: Terms, rp: RankParams, label: str, nbytes: int, extra: int, how: str) -> None:
    """A pipeline rank's plain gradients, per local stage. Autograd's AccumulateGrad makes a parameter's ``.grad`` the
    first time a backward reaches it (a new tensor where it is undefined: ``zero_grad(set_to_none=True)`` dropped the
    last step's), and a rank of several stages runs each stage's first backward at its own time: before it, none of that
    stage's gradients exist (measure --fake of Qwen3 30B interleaved pp2 v3, DDP: 3.48 GiB of gradients at the last
    stage's second loss, that stage's own, not the rank's 8.12). Each stage's are laid from the end of its first B (or W,
    under a split backward) to the step's end, as two terms of the same bytes on the per-stage lifetimes
    (``stage_accumulated`` through its last backward, ``stage_reduced`` after it); the second,
    ``plain_grads_accumulating``, is a part of the gradients (``PARTIAL_STATE_KINDS``), not more of them. ``extra``: the
    TP token embedding's full-size gradient beyond its rows, the first stage's."""
    shares = []
    for stage, x in stage_shares(nbytes, rp):
        what = f"its share by elements of {how}" + (f" (+{extra:,} B: the embedding at full V × h)"
                                                    if stage == 0 and extra else "")
        shares.append((stage, x + (extra if stage == 0 else 0), what))
    _stage_gradient_terms(T, label, shares)


def _stage_gradient_terms(T: Terms, label: str, shares: list[tuple[int, int, str]]) -> None:
    """Plain gradients of several stages, each (stage, bytes, formula) as two terms of the same bytes on the per-stage
    lifetimes: ``stage_accumulated`` through its last backward (``plain_grads_accumulating``, a part of the gradients,
    ``PARTIAL_STATE_KINDS``) and ``stage_reduced`` after it."""
    for stage, x, what in shares:
        T.add("grads", f"{label}: stage {stage}'s, from its last backward on", x, what, kind="gradients",
              stage=stage)
        T.add("grads", f"{label}: stage {stage}'s, from its first backward through its last (the same tensors)", x, what,
              kind="plain_grads_accumulating", stage=stage)


def add_sharded_grads(T: Terms, plan: WrappingPlan, rp: RankParams, label: str, nbytes: int, how: str) -> None:
    """FSDP2's sharded gradients: one term, or one per stage (``per_stage_gradients``). Each unit's post-backward makes
    its own (``foreach_reduce``'s reduce-scatter output): the largest unit's share is the piece the allocation events
    lay them in (``Terms.grad_piece``)."""
    units = [(unit_numel(u), count) for u, count in rp.unit_groups if count]
    total = sum(n * c for n, c in units)
    if total:
        T.grad_piece = nbytes * max(n for n, _ in units) // total
    if not per_stage_gradients(plan, rp):
        T.add("grads", label, nbytes, how, kind="fsdp_sharded_grads")
        return
    for stage, x in stage_shares(nbytes, rp):
        T.add("grads", f"{label}: stage {stage}'s (made at its REDUCE_GRAD)", x,
              f"its share by elements of {how} = {nbytes:,} B", kind="fsdp_sharded_grads", stage=stage)


def zero1_shares(cfg: Config, rp: RankParams) -> tuple[int, ...]:
    """The optimizer elements each dp-rank owns under torch's ZeroRedundancyOptimizer (greedy, whole
    tensors: ``engine.model.params.zero_redundancy_partition``): of the rank's parameters, or of its LoRA
    adapters when only they train. The dp-ranks of one share hold the same memory."""
    if cfg.training.finetune == "lora":
        groups = [(a * b, count) for u, count in lora_unit_groups(cfg, rp) for a, b in u]
    else:
        groups = rank_tensor_groups(rp)
    return zero_redundancy_shares(groups, cfg.parallel.dp)


def fsdp2_optimizer_shares(cfg: Config, rp: RankParams) -> tuple[int, ...] | None:
    """Per dp-rank, the elements of its FSDP2 shards of ``rp``'s parameters without the padding: what
    AdamW's states take (``zeros_like`` of each sharded DTensor, whose local tensor is torch.chunk's
    piece: ⌈a/d⌉ rows on the first shard ranks, fewer or none on the last), where the parameters and
    their gradients hold the padded storage on every rank (``FSDPParam._init_sharded_param``,
    ``foreach_reduce``). The routed experts' own units under expert parallelism count padded. None
    where every dp-rank holds the same (each dim 0 divides the shard degree), and under context
    parallelism (the shard rank is then dp × cp: a rank's share is not its dp-rank's alone)."""
    par = cfg.parallel
    d = par.shard_degree
    if d == 1 or par.cp > 1:
        return None
    return _fsdp2_shares(rp.unit_groups, rp.expert_units, d, expert_degree(cfg), par.replicate)


@lru_cache(maxsize=64)
def _fsdp2_shares(unit_groups, expert_units, d: int, e_deg: int | None, replicate: int) -> tuple[int, ...] | None:
    """``fsdp2_optimizer_shares`` of a rank's units, once per distinct rank (one tuple of dp entries, which
    ``_share_summary`` then counts once)."""
    experts = {u for u, _ in expert_units} if e_deg not in (None, d) else set()
    rows: dict[int, int] = {}  # dim 0 of an uneven tensor -> its elements per row, summed
    even = 0
    for u, count in unit_groups:
        for a, b in u:
            if u in experts:
                even += ceil_div(a, e_deg) * b * count
            elif a % d:
                rows[a] = rows.get(a, 0) + b * count
            else:
                even += a // d * b * count
    if not rows:
        return None
    shard = np.arange(d, dtype=np.int64)
    per_shard = np.full(d, even, dtype=np.int64)
    for a, b in rows.items():  # torch.chunk's piece s (engine.model.params.chunk_sizes), in closed form
        c = -(-a // d)
        per_shard += np.clip(a - shard * c, 0, c) * b
    return tuple(per_shard.tolist()) * replicate  # HSDP: dp-rank r·d + s holds shard s


def _zero1_share(sizes: tuple[int, ...], dp_rank: int, what: str) -> tuple[int, str]:
    """(elements, the rule in words) of dp-rank ``dp_rank``'s ZeroRedundancyOptimizer share; the words
    are the same for every dp-rank of that share."""
    mine = sizes[dp_rank]
    alike, low, high = _share_summary(sizes)
    return mine, (f"{mine:,} {what}: ZeroRedundancyOptimizer's greedy whole-tensor share ({alike[mine]} of the "
                  f"{len(sizes)} dp-ranks hold this many; shares run from {low:,} to {high:,})")


def _fsdp2_share(sizes: tuple[int, ...], dp_rank: int) -> tuple[int, str]:
    """(elements, the rule in words) of dp-rank ``dp_rank``'s unpadded FSDP2 shards (``fsdp2_optimizer_shares``)."""
    mine = sizes[dp_rank]
    alike, low, high = _share_summary(sizes)
    return mine, (f"{mine:,} elements: its FSDP2 shards without the padding (a dim 0 the shard degree does not "
                  f"divide leaves the last shard ranks short or empty; {alike[mine]} of the {len(sizes)} dp-ranks "
                  f"hold this many, from {low:,} to {high:,})")


_last_summary: list = [(None, None)]  # [(the shares, their summary)]: every rank of a prediction asks of one tuple


def _share_summary(sizes: tuple[int, ...]) -> tuple[dict[int, int], int, int]:
    """(how many dp-ranks hold each share, the least, the most): counted once per tuple of shares, not
    once per rank (131,072 dp-ranks × every distinct rank). The pair is read and replaced whole, so a
    prediction on another thread never reads one tuple's summary for another."""
    last = _last_summary[0]
    if last[0] is sizes:
        return last[1]
    alike = dict(Counter(sizes))
    summary = (alike, min(alike), max(alike))
    _last_summary[0] = (sizes, summary)
    return summary


def optimizer_foreach(cfg: Config) -> bool:
    """Whether AdamW steps with torch's multi-tensor ("foreach") implementation: torch's default where
    every parameter is on a device with foreach kernels (torch/optim/optimizer.py,
    ``_default_to_fused_or_foreach``: CUDA and the other accelerators, not the CPU), which the backend
    passes explicitly so that a simulated GPU rank (fake tensors live on the CPU) steps as the GPU would —
    except where the rank's stepped parameters mix DTensors and plain tensors (:func:`mixes_dtensors`), which
    a foreach op refuses ("got mixed torch.Tensor and DTensor"): the backend steps those one by one
    (``backend.parallel.parallelize.build_optimizer``)."""
    return cfg.cluster.gpu.name != "cpu" and not mixes_dtensors(cfg)


def mixes_dtensors(cfg: Config) -> bool:
    """A rank's stepped parameters mix DTensors and plain tensors: tensor parallelism without an FSDP2 wrapper
    and without sequence parallelism (torch's TP plan leaves the norms plain), or routed experts under expert
    parallelism beside DTensors where no ``fully_shard`` takes them (``replicate`` ignores them; TP does not shard
    them). Measured on fake ranks of the backend (the optimizer's foreach flag and its parameters' types): tiny
    tp2 mixes, tp2 with SP and dp2 × tp2 under replicate do not. LoRA (only the adapters step) is left alone."""
    par = cfg.parallel
    if cfg.training.finetune == "lora":
        return False
    plan = wrapping_plan(cfg)
    if plan.data_parallel == "fully_shard":
        return False
    dtensors = par.tp > 1 or plan.data_parallel == "replicate"
    plain = (par.tp > 1 and plan.data_parallel != "replicate" and not par.sequence_parallel) or (
        cfg.model.experts > 0 and par.ep > 1)
    return dtensors and plain


def _adjacent_peak(groups) -> int:
    """max over the tensors in order of (the previous one + 2 × this one), for (numels of one unit,
    how many such units in a row) groups: O(groups), not O(tensors)."""
    best = prev = 0
    for numels, count in groups:
        if not numels or count <= 0:
            continue
        for x in numels:
            best = max(best, prev + 2 * x)
            prev = x
        if count > 1:  # each later unit's first tensor follows the unit's last; its other pairs repeat
            best = max(best, numels[-1] + 2 * numels[0])
    return best


def optimizer_step_term(cfg: Config, T: Terms, opt_numel: int, rule: str, groups: Callable[[], list],
                        zero1_rank: int | None) -> None:
    """What AdamW allocates while it steps (torch/optim/adam.py, ``decoupled_weight_decay``; plain SGD,
    with or without momentum, steps in place). Alive at the optimizer-step moment only
    (``engine.memory.lifetimes``), after the backward, with every gradient still there.

    foreach (``_multi_tensor_adam``): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` makes
    the square root of every second moment at once, then divides, adds eps and ``_foreach_addcdiv_``
    in place: one tensor per stepped parameter, 4 B (fp32) × the elements this rank steps.
    for-loop (``_single_tensor_adam``): per parameter ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``,
    the square root and the quotient both alive while the previous parameter's ``denom`` is still
    bound: 4 B × max over the parameters in the optimizer's order of (previous + 2 × this).
    ``groups()``: (local numels of one unit in parameter order, count), in parameter order, walked once: for
    a GPU rank's allocator replay (``Terms.optimizer_step``, the step's tensors one by one; a few groups of
    a unit's tensors, not every tensor) and for the for-loop step's peak;
    ``zero1_rank``: the dp-rank whose ZeroRedundancyOptimizer share steps (its tensors largest first,
    ``_partition_parameters``' order), None without ZeRO-1."""
    if cfg.training.optimizer != "adamw" or opt_numel <= 0:
        return
    loop = not optimizer_foreach(cfg)
    walked = groups() if loop or (cfg.cluster.gpu.name != "cpu" and zero1_rank is None) else []
    if cfg.cluster.gpu.name != "cpu" and zero1_rank is None:
        # the step's tensors one by one, for the allocator replay (gloo ranks replay nothing); not a
        # ZeroRedundancyOptimizer's share: a dp-th of the states, which would give every dp-rank a replay of its own
        T.optimizer_step = (loop, tuple((tuple(4 * a for a in numels), c) for numels, c in walked if numels and c > 0))
    if not loop:
        T.add("temporaries", "AdamW step (foreach, torch's default on GPUs): √ of every second moment at once",
              4 * opt_numel, f"4 B × {rule}", kind="optimizer_step")
        return
    if zero1_rank is not None:
        top = zero_redundancy_largest([(a, c) for numels, c in walked for a in numels], cfg.parallel.dp,
                                      zero1_rank)
        peak, order = _adjacent_peak([(tuple(top), 1)]), "its ZeroRedundancyOptimizer share, largest first"
    else:
        peak, order = _adjacent_peak(walked), "parameter order"
    why = ("torch's default on CPU" if cfg.cluster.gpu.name == "cpu"
           else "the rank's parameters mix DTensors and plain tensors, which foreach refuses")
    T.add("temporaries", f"AdamW step (for-loop, {why}): one parameter's √v and its quotient, "
          "the previous parameter's denominator", 4 * peak,
          f"4 B × max over the stepped tensors ({order}) of previous + 2 × this = 4 × {peak:,}", kind="optimizer_step")


def _dense_block_order(model, tp: int) -> Tensors:
    """One dense block's tensors in the order the backend's model registers its parameters
    (backend/model.py, ``named_parameters``): the attention norm, each of q, k, v, o with its bias right
    after it, q/k norms, the MLP norm, then w1, w2 (down), w3 each with its bias. ``layer_tensors`` lists
    the same tensors with the weights first (the order FSDP2 and ZeRO-1 never depend on)."""
    norm = norm_tensors(model, model.hidden)
    att_w, att_b = attention_tensors(model, tp)
    mlp_w, mlp_b = mlp_tensors(model, model.ffn_hidden, tp)
    out = list(norm)
    for i, w in enumerate(att_w):
        out += [w] + ([att_b[i]] if i < len(att_b) else [])
    if model.qk_norm:
        out += [(model.head_dim, 1), (model.head_dim, 1)]
    out += list(norm)
    order = [0, len(mlp_w) - 1] + list(range(1, len(mlp_w) - 1))  # w1 (up), w2 (down), w3 (up, SwiGLU)
    for i in order:
        out += [mlp_w[i]] + ([mlp_b[i]] if mlp_b else [])
    return tuple(out)


def _local_groups(rp: RankParams, shard: int, e_deg: int | None = None, units=None, model=None, tp: int = 1):
    """(local numels of one unit in parameter order, count) of the rank's units: dim 0 of every tensor
    split over ``shard`` (FSDP2: ``torch.chunk``, the first chunk's ⌈dim0/shard⌉ rows), the routed experts'
    own units over ``e_deg``; a dense block in the model's parameter order (``_dense_block_order``, where
    ``model`` is given)."""
    experts = {u for u, _ in rp.expert_units} if e_deg not in (None, shard) else set()
    block = _dense_block_order(model, tp) if model is not None and units is None else None
    out = []
    for u, count in (units if units is not None else rp.unit_groups):
        d = e_deg if u in experts else shard
        if block is not None and u == rp.block_tensors and sorted(block) == sorted(u):
            u = block
        out.append((tuple(ceil_div(a, d) * b for a, b in u), count))
    return out


def replicate_expert_grads(cfg: Config, plan: WrappingPlan) -> bool:
    """Whether the routed experts' gradients are autograd's plain ones, alive from the first backward on: FSDP2's
    replicate ignores the experts (backend.parallel.data_parallel.apply_replicate), so their .grad is made by the
    first backward and added to by every later one. With one microbatch it is made block by block during the only
    backward: the unpipelined walk's late moment holds every block's but layer 0's
    (``engine.memory.buffers._unit_by_unit_reduce``)."""
    return plan.data_parallel == "replicate"


def pytorch_states(cfg: Config, plan: WrappingPlan, rp: RankParams, dp_rank: int, T: Terms, where: str) -> None:
    """params / grads / optimizer as torch keeps them ("pytorch" accounting)."""
    par, tr, model = cfg.parallel, cfg.training, cfg.model
    z, d, k = par.zero, par.shard_degree, OPTIMIZER_STATES[tr.optimizer]
    psi = rp.total
    if plan.fsdp2:
        shard = d if par.zero in (2, 3) else 1  # FSDP2's replicate (DP × TP) keeps whole fp32 params
        e_deg = expert_degree(cfg)
        psi_d = rp.sharded_numel(shard, e_deg)
        how = (f"Ψ_d = {psi_d:,} (Ψ = {psi:,} over d = {shard}, dim 0 padded per tensor"
               + (f"; the experts over efsdp = {e_deg}" if e_deg is not None else "") + ")"
               if shard > 1 or e_deg not in (None, 1) else f"Ψ = {psi:,} (FSDP2 replicate: not sharded)")
        T.add("params", f"parameters ({where}), FSDP2 fp32 sharded parameter (the master)", 4 * psi_d,
              f"4 B × {how}", kind="parameters")
        split_expert_params(T, expert_elements(cfg, rp, shard, e_deg), 4)
        plain = rp.experts if replicate_expert_grads(cfg, plan) else 0
        add_sharded_grads(T, plan, rp, "gradients, FSDP2 sharded, in the parameter dtype (fp32)"
                          + (", without the routed experts" if plain else ""), 4 * (psi_d - plain),
                          f"4 B × {how}" + (f" − 4 B × {plain:,} expert elements" if plain else ""))
        label = ("routed experts' gradients, plain fp32 tensors (FSDP2's replicate ignores the experts: autograd "
                 "accumulates their .grad, the backend syncs them over the expert replicas)")
        if plain and par.pp > 1 and len(rp.stages) > 1:
            # made at each stage's own first backward, as a rank's plain gradients are (``_plain_gradients_by_stage``;
            # measure --fake Mixtral LoopedBFS pp2 v2 ep8: rank 0 peaks in stage 2's first B with no expert gradient),
            # under a split backward at its first W (seed 20261250 #27, Qwen3 235B ZBV ep4 ZeRO-0: stage 6's W's peak
            # before stage 1's first, +7.3 % with stage 1's laid from the rank's first I)
            _stage_gradient_terms(T, label, [(st.stage, 4 * st.experts, f"4 B × {st.experts:,}")
                                             for st in sorted(rp.stages, key=lambda st: st.stage) if st.experts])
        elif plain:
            T.add("grads", label, 4 * plain, f"4 B × {plain:,}", kind="gradients")
        opt_numel, rule = psi_d, how
        shares = fsdp2_optimizer_shares(cfg, rp) if shard > 1 else None
        if shares is not None and shares[dp_rank] != psi_d:
            opt_numel, rule = _fsdp2_share(shares, dp_rank)
        if z == 1 and par.dp > 1:
            # ZeRO-1 with TP: FSDP2's replicate keeps the parameters and reduces the gradients, and the
            # backend's TensorParallelZeRO1 partitions the optimizer over dp as ZeroRedundancyOptimizer
            # does, by the local (TP-sharded) tensors
            opt_numel, rule = _zero1_share(zero1_shares(cfg, rp), dp_rank, "elements")
    else:
        T.add("params", f"parameters ({where}), fp32 (autocast casts on the fly; no separate master)"
              if tr.precision != "fp32" else f"parameters ({where})", 4 * psi, f"4 B × Ψ = 4 × {psi:,}",
              kind="parameters")
        split_expert_params(T, rp.experts, 4)
        grads = psi
        gterm = f"4 B × Ψ = 4 × {psi:,}"
        if par.tp > 1 and any(st.stage == 0 for st in rp.stages):
            # The vocab-parallel embedding's gradient comes back replicated: full V × h locally
            local_rows = rp.stages[[st.stage for st in rp.stages].index(0)].embedding
            extra = model.vocab * model.hidden - local_rows
            grads += extra
            gterm += f" + token-embedding gradient at full V × h on every TP rank (+{extra:,})"
        label = "gradients, fp32 (autocast gradients take the parameter dtype)" if tr.precision != "fp32" else "gradients"
        if stage_plain_gradients(cfg, plan, rp):
            _plain_gradients_by_stage(T, rp, label, 4 * psi, 4 * (grads - psi), gterm)
        else:
            T.add("grads", label, 4 * grads, gterm, kind="gradients")
            if grads > psi:
                # the vocab-parallel embedding's backward is the graph's last node: its full-size gradient, one
                # tensor (DTensor's ``embedding_dense_backward`` output, Partial at V × h), is made after every
                # block's (measure --fake of Llama 3 8B dp1 tp4 SP, seed 20261255 #03: a 2,004 MiB request at the
                # backward's end, alone in a new segment)
                T.plain_grad_whole = 4 * model.vocab * model.hidden
        if z == 1 and par.dp > 1:
            opt_numel, rule = _zero1_share(zero1_shares(cfg, rp), dp_rank, "elements")
        else:
            opt_numel, rule = psi, f"Ψ = {psi:,}"
    if k:
        T.add("optimizer", f"{tr.optimizer} states ({k} × fp32; no master copy: the fp32 parameter is it)",
              4 * k * opt_numel, f"{4 * k} B × {rule}", kind="optimizer_states")
    else:
        T.add("optimizer", "no optimizer state (plain sgd)", 0, "0", kind="none")
    zero1 = z == 1 and par.dp > 1
    sharded = plan.fsdp2 and par.zero in (2, 3)
    optimizer_step_term(cfg, T, opt_numel, rule,
                        lambda: _local_groups(rp, d if sharded else 1, expert_degree(cfg) if plan.fsdp2 else None,
                                              model=model, tp=par.tp),
                        dp_rank if zero1 else None)


def zero_paper_states(cfg: Config, plan: WrappingPlan, rp: RankParams, dp_rank: int, T: Terms, where: str) -> None:
    """params / grads / optimizer as the ZeRO paper splits them ("zero-paper" accounting)."""
    par, tr = cfg.parallel, cfg.training
    z, d = par.zero, par.shard_degree
    w, g = tr.param_bytes, tr.grad_bytes
    k = OPTIMIZER_STATES[tr.optimizer]
    psi = rp.total
    e_deg = expert_degree(cfg)
    if z == 3:
        psi_d = rp.sharded_numel(d, e_deg)
        T.add("params", f"parameters ({where}), sharded ZeRO-3", w * psi_d,
              f"{w} B × Ψ_d = {w} × {psi_d:,} (Ψ = {psi:,} over d = {d}, dim 0 padded per tensor)", kind="parameters")
        split_expert_params(T, expert_elements(cfg, rp, d, e_deg), w)
        T.add("grads", "gradients, sharded ZeRO-3", g * psi_d, f"{g} B × Ψ_d = {g} × {psi_d:,}", kind="gradients")
        opt_numel, opt_rule = psi_d, "Ψ_d"
    else:
        T.add("params", f"parameters ({where})", w * psi, f"{w} B × Ψ = {w} × {psi:,}", kind="parameters")
        split_expert_params(T, rp.experts, w)
        flat, flat_rule = _flat_share(rp, d, e_deg)
        if z == 2:
            T.add("grads", "gradients, sharded ZeRO-2", g * flat, f"{g} B × {flat_rule}", kind="gradients")
        else:
            T.add("grads", "gradients", g * psi, f"{g} B × Ψ = {g} × {psi:,}", kind="gradients")
        if z >= 1:
            opt_numel, opt_rule = flat, flat_rule
        else:
            opt_numel, opt_rule = psi, f"Ψ = {psi:,}"
    if tr.master_weights:
        T.add("optimizer", "fp32 master weights", 4 * opt_numel, f"4 B × {opt_rule}", kind="master_weights")
    if k:
        T.add("optimizer", f"{tr.optimizer} states ({k} × fp32)", 4 * k * opt_numel, f"{4 * k} B × {opt_rule}",
              kind="optimizer_states")
    if not T["optimizer"]:
        T.add("optimizer", "no optimizer state (plain sgd, fp32)", 0, "0", kind="none")


def expert_elements(cfg: Config, rp: RankParams, shard: int, e_deg: int | None) -> int:
    """Elements of the routed experts this rank keeps when its parameters shard over ``shard`` ranks
    (``e_deg``: the experts' own degree under expert parallelism), padded as FSDP2 pads."""
    if not rp.experts:
        return 0
    if rp.expert_units:
        return sum(sharded_numel(u, e_deg or shard) * n for u, n in rp.expert_units)
    moe_layers = sum(st.moe_layers for st in rp.stages)  # without EP: inside the blocks, split by TP
    return moe_layers * sharded_numel(expert_tensors(cfg.model, cfg.model.experts, cfg.parallel.tp), shard)


def split_expert_params(T: Terms, numel: int, nbytes: int) -> None:
    """Show the routed experts as their own part of this rank's parameters: the last params term
    becomes the rest and the experts (same total)."""
    if numel <= 0:
        return
    last = T["params"].pop()
    e = nbytes * numel
    T.add("params", f"{last.label}, without the routed experts", last.bytes - e,
          f"{last.formula} − {nbytes} B × {numel:,} expert elements", tracked=last.tracked, kind=last.kind)
    T.add("params", "routed experts' parameters (their part of the above)", e, f"{nbytes} B × {numel:,}",
          tracked=last.tracked, kind="expert_parameters")


def expert_degree(cfg: Config) -> int | None:
    """The FSDP degree of the routed experts under expert parallelism (efsdp = dp_shard·cp·tp / ep,
    torchtitan's sparse region), when sharded strategies shard them; None without EP (the experts
    shard as every other parameter then)."""
    par = cfg.parallel
    if par.ep > 1 and par.zero in (2, 3):
        return par.expert_shard_degree
    return None


def _flat_share(rp: RankParams, d: int, e_deg: int | None) -> tuple[int, str]:
    """A flat ZeRO-1/2 split: ⌈Ψ/d⌉, or the dense part over d and the experts over efsdp."""
    psi = rp.total
    if e_deg is None or not rp.expert_units:
        return ceil_div(psi, d), f"⌈Ψ/d⌉ = ⌈{psi:,}/{d}⌉"
    e = rp.experts
    n = ceil_div(psi - e, d) + ceil_div(e, e_deg)
    return n, f"⌈(Ψ − Ψ_e)/d⌉ + ⌈Ψ_e/efsdp⌉ = ⌈{psi - e:,}/{d}⌉ + ⌈{e:,}/{e_deg}⌉"


#: state_accounting -> the function that writes the model states of full fine-tuning
ACCOUNTINGS = {"pytorch": pytorch_states, "zero-paper": zero_paper_states}


def lora_unit_groups(cfg: Config, rp: RankParams) -> tuple[tuple[Tensors, int], ...]:
    """The adapter tensors of each FSDP unit of this rank (empty for embeddings and norm + head),
    one entry per group of ``rp.unit_groups`` with its count."""
    tr = cfg.training
    block = lora.adapter_block_tensors(cfg.model, tr.lora_rank, tr.lora_targets, cfg.parallel.tp)
    return tuple((block if u == rp.block_tensors else (), count) for u, count in rp.unit_groups)


def lora_states(cfg: Config, plan: WrappingPlan, rp: RankParams, dp_rank: int, T: Terms, where: str) -> int:
    """params / grads / optimizer under LoRA (engine.model.lora): frozen base, trainable adapters.

    Returns the trainable elements this rank holds before any sharding (what DDP's buckets and
    the DP gradient traffic cover).
    """
    par, tr = cfg.parallel, cfg.training
    torch_acc = cfg.conventions.state_accounting == "pytorch"
    z, d, k = par.zero, par.shard_degree, OPTIMIZER_STATES[tr.optimizer]
    ad = lora_unit_groups(cfg, rp)
    psi_lora = sum(sum(a * b for a, b in u) * count for u, count in ad)
    psi_base = rp.total
    fsdp2 = plan.fsdp2 if torch_acc else z == 3
    shard = d if (z in (2, 3) if torch_acc else z == 3) else 1
    # ---- frozen base
    if tr.lora_base_dtype == "nf4":
        weights = [a * b for a, b in rp.block_tensors if b > 1]  # the block Linears' weight matrices
        q_bytes = rp.layers * sum(lora.nf4_bytes(n) for n in weights)
        q_numel = rp.layers * sum(weights)
        u = lora.unquantised_bytes(tr)
        T.add("params", f"frozen base ({where}): block Linears in nf4 with double-quantised constants", q_bytes,
              f"Σ ⌈n/2⌉ + ⌈n/64⌉ + 4·⌈⌈n/64⌉/256⌉ + 4 over {q_numel:,} weights "
              f"(≈ {lora.nf4_bytes_per_param():.4f} B each)", kind="frozen_base")
        T.add("params", "frozen base: embeddings, norms, head (not quantised)", u * (psi_base - q_numel),
              f"{u} B × {psi_base - q_numel:,}", kind="frozen_base")
    else:
        bb = lora.base_bytes_per_param(tr)
        base_d = rp.sharded_numel(shard)
        how = (f"Ψ_base,d = {base_d:,} (Ψ_base = {psi_base:,} over d = {shard}, dim 0 padded per tensor)"
               if shard > 1 else f"Ψ_base = {psi_base:,}")
        T.add("params", f"frozen base ({where}), {tr.lora_base_dtype}; no gradient, no optimizer state",
              bb * base_d, f"{bb} B × {how}", kind="frozen_base")
    # ---- adapters
    lora_d = sum(sharded_numel(u, shard) * count for u, count in ad)
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
    T.add("params", f"LoRA adapters A and B ({origin})", w_a * lora_d, f"{w_a} B × {how}", kind="adapters")
    g_numel, g_how = lora_d, how
    if not torch_acc and z == 2 and shard == 1:
        g_numel, g_how = ceil_div(psi_lora, d), f"⌈Ψ_lora/d⌉ = ⌈{psi_lora:,}/{d}⌉"
    # under FSDP2 ("pytorch" accounting) the adapters' sharded gradients are what each unit's post-backward
    # makes, as for full fine-tuning: alive at the end of the backward only (``lifetimes``)
    T.add("grads", "adapter gradients" + (" (fp32, the adapters' dtype)" if torch_acc else ""),
          g_a * g_numel, f"{g_a} B × {g_how}", kind="fsdp_sharded_grads" if torch_acc and plan.fsdp2 else "gradients")
    if z == 1 and par.dp > 1 and torch_acc and par.tp == 1:
        opt_numel, rule = _zero1_share(zero1_shares(cfg, rp), dp_rank, "adapter elements")
    elif z >= 1 and par.dp_cp > 1 and not (fsdp2 and shard > 1):
        opt_numel, rule = ceil_div(psi_lora, d), f"⌈Ψ_lora/d⌉ = ⌈{psi_lora:,}/{d}⌉"
    else:
        opt_numel, rule = lora_d, how
    if master:
        T.add("optimizer", "fp32 master weights of the adapters", 4 * opt_numel, f"4 B × {rule}",
              kind="master_weights")
    if k:
        T.add("optimizer", f"{tr.optimizer} states of the adapters ({k} × fp32); none for the frozen base",
              4 * k * opt_numel, f"{4 * k} B × {rule}", kind="optimizer_states")
    if torch_acc:
        zero1 = z == 1 and par.dp > 1 and par.tp == 1
        optimizer_step_term(cfg, T, opt_numel, rule, lambda: _local_groups(rp, shard if fsdp2 else 1, units=ad),
                            dp_rank if zero1 else None)
    if not T["optimizer"]:
        T.add("optimizer", "no optimizer state (plain sgd)", 0, "0", kind="none")
    return psi_lora


def plain_grads_late(cfg: Config, plan: WrappingPlan) -> bool:
    """Whether this rank's plain gradients (``kind="gradients"``: no FSDP2) live from its first
    backward on (``lifetimes.lifetime_overrides``): torch's accounting, and not DDP's
    ``gradient_as_bucket_view``, where ``.grad`` is a view of the Reducer's buckets, which live all
    step."""
    conv = cfg.conventions
    return (conv.state_accounting == "pytorch" and not plan.fsdp2
            and not getattr(conv, "ddp_gradient_as_bucket_view", False))


def plain_first_backward(cfg: Config, plan: WrappingPlan, rp: RankParams) -> bool:
    """Whether the rank's first B walks plain gradients into being (``plain_grads_late``) over one pipeline stage with a
    full backward (no split schedule's W, no legacy nn.DataParallel): its own moment holds the gradients made before it
    (``buffers._plain_early_backward``) and its late moment, at the stage's first block, every later block's
    (``buffers._plain_late_backward``, ``lifetimes._with_first_late_moment``)."""
    par = cfg.parallel
    return (plain_grads_late(cfg, plan) and par.dp_mode != "dataparallel" and len(rp.stages) == 1
            and not (par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES))
