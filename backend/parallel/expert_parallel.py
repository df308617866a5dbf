"""Expert parallelism: each MoE block's experts split over the ``ep`` ranks, tokens exchanged with
``all_to_all_single`` (gloo runs it on CPU), torchtitan 0.3.0's AllToAllTokenDispatcher.

Mesh (torchtitan's ParallelDims): the dense region dp_shard·tp of each pipeline stage is the same
set of ranks as the sparse region efsdp·ep, ep innermost (``ParallelDims.build_mesh``). Expert
parallel rank ``r`` holds the experts ``r·E/ep .. (r+1)·E/ep - 1``; the ``efsdp`` ranks holding
the same experts are their data-parallel replicas (FSDP2 shards them over efsdp).

Order of operations of one MoE block on one rank (torchtitan's dispatch / combine):

1. route the local tokens; ``counts[e]`` = (token, choice) pairs for expert e; sort the pairs by
   expert (so the send buffer is grouped by destination rank, then local expert);
2. exchange the counts (an all-to-all of the (ep, E/ep) count matrix): ``received[r, j]`` = pairs
   rank r sends for my local expert j; input splits = my counts summed per destination rank,
   output splits = ``received`` summed per source rank;
3. all-to-all the tokens with those splits; the result is rank-major ((r0, e0), (r0, e1), ...,
   (r1, e0), ...); permute to expert-major so each local expert's tokens are contiguous;
4. run the local experts;
5. un-permute, all-to-all back with the splits swapped, weight by the gate scores, scatter-add
   onto the tokens.

The all-to-all is an autograd function: its backward is the all-to-all with the splits swapped.

With TP (expert tensor parallel degree 1, torchtitan's etp = 1): the experts are not split by TP;
the block's replicated tokens are split along the sequence over the TP ranks (``SequenceShard``),
each TP rank routes and dispatches its slice over the ep group, and the outputs are all-gathered.
The router then sees each TP rank's slice only, so its gradients are summed over TP. Shared
experts are the dense part: TP-sharded like any MLP (``apply_tp``).

Gradients of expert weights: a rank's experts get the gradients of every token sent to them, so
the mean over data-parallel replicas divides by the dense data-parallel degree ``dp`` (not by
efsdp): FSDP2's ``set_gradient_divide_factor(dp)`` on the experts, or, without FSDP2 on them, a sum
over efsdp and a division by dp before the optimizer step (``sync_expert_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from backend.model import MoE, moe_modules, scatter_combine
from engine.backend_limits import moe_problem


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with split sizes; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatch:
    """Dispatch and combine over the expert-parallel group (see the module's order of operations)."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor):
        ep = self.ep
        order = torch.argsort(ids_TK.reshape(-1), stable=True)
        token = order // ids_TK.shape[1]
        send = x_TD[token]
        with torch.no_grad():
            received = torch.empty_like(counts_E)
            dist.all_to_all_single(received, counts_E.contiguous(), group=self.group)
        in_splits = counts_E.view(ep, -1).sum(dim=1).tolist()
        out_splits = received.view(ep, -1).sum(dim=1).tolist()
        recv = all_to_all(send, out_splits, in_splits, self.group)
        # rank-major -> expert-major (torchtitan's _permute)
        t_mat = received.view(ep, -1)  # [source rank, local expert]
        starts = (received.cumsum(0) - received).view(ep, -1)
        seg_lens = t_mat.t().reshape(-1)
        seg_starts = starts.t().reshape(-1)
        seg = torch.repeat_interleave(torch.arange(seg_lens.numel(), device=recv.device), seg_lens)
        out_starts = seg_lens.cumsum(0) - seg_lens
        permuted = seg_starts[seg] + torch.arange(seg.numel(), device=recv.device) - out_starts[seg]
        meta = (order, token, permuted, recv.shape, in_splits, out_splits)
        return recv[permuted], t_mat.sum(dim=0), meta

    def combine(self, out_RD: torch.Tensor, meta, scores_TK: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        order, token, permuted, shape, in_splits, out_splits = meta
        unpermuted = out_RD.new_zeros(shape).index_copy(0, permuted, out_RD)
        back = all_to_all(unpermuted, in_splits, out_splits, self.group)
        return scatter_combine(back, order, token, scores_TK, x_TD)


def planned_load(cfg) -> tuple[float, ...]:
    """The per-expert load a planned dispatch routes by: ``conventions.moe_expert_load`` (its mean
    over blocks and microbatches where given per block or microbatch), else balanced."""
    from engine.model.routing import mean_expert_load

    return tuple(mean_expert_load(cfg)) or (1.0 / cfg.model.experts,) * cfg.model.experts


def split_copies(copies: int, load: tuple[float, ...]) -> list[int]:
    """``copies`` routed copies over the experts in proportion to ``load`` (largest remainders, so
    they sum to ``copies``)."""
    raw = [copies * x for x in load]
    out = [int(x) for x in raw]
    for e in sorted(range(len(raw)), key=lambda e: out[e] - raw[e])[:copies - sum(out)]:
        out[e] += 1
    return out


class PlannedDispatch:
    """Dispatch by a routing plan fixed up front instead of the router's choices: fake tensors
    (``backend.fake_worker``) carry shapes and no values, so what the real dispatch reads from the
    data — the tokens per expert, which size each expert's slice and the all-to-all splits — is
    taken from a load given in advance (:func:`planned_load`: the configured
    ``conventions.moe_expert_load``, else balanced), the same on every rank of the expert-parallel
    group. Every tensor the real dispatch and combine make is made with the same shape and dtype
    (the sort, the gathers, the all-to-alls, the permutation index, the un-permute and the
    weighted scatter-add), so the memory they hold is the real path's at that load."""

    planned = True

    def __init__(self, send: list[int], ep: int = 1, group=None):
        """``send``: the tokens each rank sends to each expert per microbatch; ``group``: the expert-
        parallel group of ``ep`` ranks the tokens are exchanged over (None: every expert local)."""
        self.send, self.ep, self.group = list(send), ep, group
        self.local = len(send) // ep  # every rank of the group sends the same counts

    def counts(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.send, dtype=torch.int64, device=ids.device)

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor):
        order = torch.argsort(ids_TK.reshape(-1), stable=True)
        token = order // ids_TK.shape[1]
        if self.group is None:
            return x_TD[token], list(self.send), (order, token)
        rank = dist.get_rank(self.group)
        mine = self.send[rank * self.local:(rank + 1) * self.local]
        in_splits = [sum(self.send[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        out_splits = [sum(mine)] * self.ep
        recv = all_to_all(x_TD[token], out_splits, in_splits, self.group)
        permuted = torch.arange(recv.shape[0], device=recv.device)  # a permutation of the real one's size
        meta = (order, token, permuted, recv.shape, in_splits, out_splits)
        return recv[permuted], [self.ep * c for c in mine], meta

    def combine(self, out_RD: torch.Tensor, meta, scores_TK: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            order, token = meta
            return scatter_combine(out_RD, order, token, scores_TK, x_TD)
        return AllToAllDispatch.combine(self, out_RD, meta, scores_TK, x_TD)


def plan_dispatch(model: nn.Module, cfg, ep_group=None) -> tuple[float, ...]:
    """Give every MoE block of ``model`` a :class:`PlannedDispatch` at :func:`planned_load` (each
    rank routes its n·k copies of a microbatch by it); returns the load."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    n = m.seq_len * tr.micro_batch_size // (par.tp if par.ep > 1 else 1)
    load = planned_load(cfg)
    send = split_copies(n * m.experts_per_token, load)
    for moe in moe_modules(model):
        moe.dispatch = PlannedDispatch(send, par.ep, ep_group)
    return load


class _SplitSequence(torch.autograd.Function):
    """Forward: this TP rank's slice of the sequence (dim 1) of a replicated tensor.
    Backward: all-gather the slices' gradients (each rank computed only its own)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.size = group, size
        return x.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None, None, None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the TP ranks' sequence slices into the replicated tensor.
    Backward: this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, y, group, rank, size):
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(y) for _ in range(size)]
        dist.all_gather(parts, y.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group`` (a weight used on slices)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SequenceShard:
    """The TP ranks' split of an MoE block's tokens along the sequence (etp = 1)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return _SplitSequence.apply(x, self.group, self.rank, self.size)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(y, self.group, self.rank, self.size)

    def reduce_grad(self, w: torch.Tensor) -> torch.Tensor:
        return _SumGradOver.apply(w, self.group)


def apply_expert_parallel(model: nn.Module, ep: int, ep_rank: int, ep_group, tp_group=None) -> None:
    """Keep this rank's experts in every MoE block of ``model`` and install the all-to-all dispatch
    (``ep`` > 1); with ``tp_group`` (tp > 1) split each block's tokens over the TP ranks."""
    for moe in moe_modules(model):
        if ep > 1:
            local = moe.num_experts // ep
            moe.experts.keep(ep_rank * local, local)
            moe.dispatch = AllToAllDispatch(ep_group, ep)
        if tp_group is not None:
            moe.sequence = SequenceShard(tp_group)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (sharded by ep, replicated over efsdp)."""
    return [p for moe in moe_modules(model) for p in moe.experts.parameters()]


def expert_param_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the routed experts' parameters (what DDP must leave alone)."""
    ids = {id(p) for p in expert_params(model)}
    return [name for name, p in model.named_parameters() if id(p) in ids]


@torch.no_grad()
def sync_expert_grads(params: list[nn.Parameter], efsdp_group, efsdp: int, dp: int) -> None:
    """Without FSDP2 on the experts: sum their gradients over the efsdp replicas, divide by ``dp``."""
    for p in params:
        if p.grad is None:
            continue
        if efsdp > 1:
            dist.all_reduce(p.grad, group=efsdp_group)
        p.grad.div_(dp)


def refusal(cfg) -> str | None:
    """Why the backend cannot run this mixture-of-experts layout (None when it can):
    ``engine.backend_limits.moe_problem``."""
    return moe_problem(cfg)


__all__ = ["AllToAllDispatch", "MoE", "PlannedDispatch", "SequenceShard", "all_to_all", "apply_expert_parallel",
           "expert_params", "plan_dispatch", "planned_load", "refusal", "split_copies", "sync_expert_grads"]
