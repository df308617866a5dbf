"""Context parallelism: each sequence split over the ``cp`` mesh dimension, attention exchanging K, V.

The sequence is head-tail load balanced as torch's ``_HeadTailLoadBalancer`` does it: of 2·cp equal
chunks, cp-rank r holds chunks r and 2·cp−1−r, so every rank gets the same share of the causal
work. Everything outside attention runs on the rank's tokens only; gradients and the loss are
reduced over dp·cp (the data-parallel wrapper's group includes the cp ranks, torchtitan's
dp_shard_cp / dp_cp meshes in ``backend.parallel.dims``).

Three ways to run attention over the sharded sequence:

* ``torch``: torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) around each
  microbatch's forward and backward, with ``set_rotate_method(parallel.cp_rotate)``: it shards the
  batch in place and swaps SDPA for its ring attention. Its sharding strategies exist for the CUDA
  SDPA kernels (flash, efficient, cuDNN) only, so this path is chosen on CUDA with flash attention.
* ``ring``: flash attention elsewhere (CPU / gloo, where torch registers no strategy for
  ``aten._scaled_dot_product_flash_attention_for_cpu``): the same ring algorithm, torch's
  ``_templated_ring_attention`` and its backward, called with the CPU flash kernel as the block op
  (``RingFlashAttention``) — K, V all-gathered once or rotated (``parallel.cp_rotate``), blocks merged
  in fp32 by their log-sum-exp, dK, dV brought home by the all-to-all ring; it saves only the rank's
  own Q, K, V, output and log-sum-exp. Its tensors are the ones torch's path allocates, so a CPU or
  fake run measures what a GPU run holds (no (s × S) mask).
* ``allgather``: eager attention on any device. K and V are all-gathered with an autograd all-gather
  (backward: reduce-scatter) and saved gathered, as its matmuls must; each rank's queries attend to
  the gathered keys under the causal mask of its two chunks.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import checkpoint

#: the words of a run's record (``memory.notes``) for each way of running attention
NOTES = {
    "torch": "cp: torch's context_parallel (ring attention, rotate method {rotate}) on CUDA SDPA kernels",
    "ring": ("cp on {device}: torch's ring attention (its _templated_ring_attention, rotate method {rotate}) on the "
             "{device} flash kernel; head-tail load balanced"),
    "allgather": ("cp on {device}: all-gather K/V variant of torch's allgather rotate method (eager attention "
                  "saves its gathered K, V{eager}); head-tail load balanced, dK/dV reduce-scattered"),
}


def head_tail_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions (int64, ascending) of the tokens cp-rank ``cp_rank`` holds: chunks r and 2·cp−1−r of
    2·cp equal chunks (torch's ``_HeadTailLoadBalancer``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"model.seq_len = {seq_len} must be divisible by 2·cp = {2 * cp} (head-tail load balancing)")
    c = seq_len // (2 * cp)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([head, tail])


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(len(q), len(k)) bool, True where a query may attend to a key (the key is not after it)."""
    return k_positions[None, :] <= q_positions[:, None]


# --------------------------------------------------------------------------- collectives on the sequence dim


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """All-gather ``x`` over ``group`` and concatenate along ``dim`` in group-rank order."""
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.unflatten(0, (n, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's slice of ``dim`` (the inverse of gather_sequence)."""
    n = dist.get_world_size(group)
    parts = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = parts.new_empty(parts.shape[1:])
    dist.reduce_scatter_tensor(out, parts.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
    return out


class GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over the cp group; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_sequence(grad, ctx.group, ctx.dim), None, None


def _flash_block(q, k, v, *, is_causal: bool, scale: float, n_rep: int):
    """One block of torch's ring attention on the CPU flash kernel: the queries against a block of keys
    (kv heads, repeated to the query heads here: the kernel takes no GQA); (output, log-sum-exp)."""
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _flash_block_backward(*, grad_out, query, key, value, out, logsumexp, is_causal: bool, scale: float, n_rep: int):
    """The block's fused backward; the repeated heads' dK, dV summed onto their kv head."""
    k, v = key, value
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    # the output gradient as it comes (the attention output's transposed view): the CPU kernel reads it by its strides
    # as CUDA's flash backward does, so no copy of it is made here that a GPU run does not make
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, k, v, out, logsumexp, 0.0, is_causal, scale=scale)
    if n_rep > 1:
        dk = dk.unflatten(1, (-1, n_rep)).sum(2)
        dv = dv.unflatten(1, (-1, n_rep)).sum(2)
    return dq, dk, dv


@contextlib.contextmanager
def _ring_options(rotate: str):
    """torch's ring-attention options for one call (they are module globals): head-tail load balancing,
    fp32 merging, and the rotate method of ``parallel.cp_rotate``."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    opts = ring._cp_options
    saved = (opts.enable_load_balance, opts.convert_to_f32, opts.rotate_method)
    opts.enable_load_balance, opts.convert_to_f32 = True, True
    opts.rotate_method = ring._RotateMethod.ALL_GATHER if rotate == "allgather" else ring._RotateMethod.ALL_TO_ALL
    try:
        yield ring
    finally:
        opts.enable_load_balance, opts.convert_to_f32, opts.rotate_method = saved


class RingFlashAttention(torch.autograd.Function):
    """torch's own ring attention (``_templated_ring_attention`` and its backward, the algorithm its
    ``context_parallel`` runs on CUDA) with the CPU flash kernel as the block op.

    Forward: K, V of the other ranks arrive by the rotate method (all-gathered once, or rotated), each
    block runs causal (its own chunk), whole, or on the tail half of the queries (head-tail load
    balancing), and the blocks' outputs merge in fp32 by their log-sum-exp. Saves the local Q, K, V (kv
    heads), output and log-sum-exp only; the backward rotates K, V again and the fp32 dK, dV ring
    (all-to-all) brings each rank its own. q: (b, heads, s, d); k, v: (b, kv_heads, s, d), the rank's tokens.
    """

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, n_rep: int):
        scale = 1.0 / math.sqrt(q.shape[-1])
        with _ring_options(cp.rotate) as ring:
            out, lse = ring._templated_ring_attention(
                cp.group, 2, functools.partial(_flash_block, n_rep=n_rep), q, k, v, is_causal=True, scale=scale)
        ctx.cp, ctx.n_rep, ctx.scale = cp, n_rep, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with _ring_options(ctx.cp.rotate) as ring:
            dq, dk, dv = ring._templated_ring_attention_backward(
                ctx.cp.group, 2, functools.partial(_flash_block_backward, n_rep=ctx.n_rep), grad_out,
                "grad_out", q, k, v, out, lse, is_causal=True, scale=ctx.scale)
        return dq, dk, dv, None, None


# --------------------------------------------------------------------------- one rank's view


class ContextParallel:
    """One rank's context parallelism: its cp group, its token positions, and attention over them.

    ``method`` is "torch" (torch's context_parallel, CUDA flash), "ring" (torch's ring template on the
    CPU flash kernel) or "allgather" (eager attention: the all-gather K/V variant). Set on each
    ``Attention`` as ``context_parallel`` by ``apply_cp``; the trainer shards each microbatch with
    ``microbatch``.
    """

    def __init__(self, mesh, seq_len: int, device: torch.device, attention: str, rotate: str = "allgather",
                 dropout: float = 0.0):
        self.mesh = mesh
        self.group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
        self.cp = dist.get_world_size(self.group)
        self.cp_rank = dist.get_rank(self.group)
        self.seq_len, self.rotate, self.attention = seq_len, rotate, attention
        self.method = ("torch" if device.type == "cuda" else "ring") if attention == "flash" else "allgather"
        if self.method == "ring" and dropout > 0:
            raise NotImplementedError(
                f"model.dropout = {dropout} with parallel.cp > 1 and flash attention on {device.type}: the "
                "ring attention calls torch's fused CPU kernel without dropout; set model.dropout = 0 "
                "or model.attention = 'eager'")
        if self.method == "allgather" and rotate != "allgather":  # engine.backend_limits says it too
            raise NotImplementedError(
                f"parallel.cp_rotate = {rotate!r} with {attention} attention: the ring runs with flash attention "
                "only; allowed here: 'allgather'")
        self.positions = head_tail_positions(seq_len, self.cp, self.cp_rank).to(device)
        #: every key's position in the order the all-gather concatenates the ranks' tokens
        self.key_positions = torch.cat([head_tail_positions(seq_len, self.cp, r)
                                        for r in range(self.cp)]).to(device)

    # ---- attention

    def masked(self) -> torch.Tensor:
        """(s, S) bool, True where the score is masked out (eager attention's masked_fill)."""
        return self.key_positions[None, :] > self.positions[:, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, core: nn.Module) -> torch.Tensor:
        """Attention output (b, heads, s, d) of the local queries. q: (b, heads, s, d); k, v: (b, kv_heads,
        s, d), the rank's tokens (not yet repeated for GQA). ``core``: the layer's AttentionCore."""
        if self.method == "torch":  # inside torch's context_parallel: its ring replaces SDPA
            if n_rep > 1:
                k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            return core(q, k, v)
        if self.method == "ring":
            if isinstance(core, CheckpointWrapper):
                # "selective" checkpoints the attention core; on CUDA torch's context_parallel runs its ring inside
                # that core, so the ring runs inside the same checkpoint here (Q, K, V kept, the ring recomputed)
                return checkpoint(RingFlashAttention.apply, q, k, v, self, n_rep, use_reentrant=False,
                                  preserve_rng_state=False)
            return RingFlashAttention.apply(q, k, v, self, n_rep)
        k, v = GatherSequence.apply(k, self.group, 2), GatherSequence.apply(v, self.group, 2)
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return core(q, k, v, self.masked())

    # ---- data

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``t`` along its sequence dim ``dim``."""
        return t.index_select(dim, self.positions.to(t.device))

    @contextlib.contextmanager
    def microbatch(self, *tensors: torch.Tensor):
        """Around one microbatch's forward and backward: yields ``tensors`` (batch, seq, ...) as this rank's
        shards. On the torch path, torch's context_parallel shards them (in place, on copies) and swaps
        SDPA for its ring attention while the context is open."""
        if self.method != "torch":
            yield tuple(self.shard(t) for t in tensors)
            return
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.rotate)
        bufs = [t.clone() for t in tensors]
        with context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[1] * len(bufs),
                              no_restore_buffers=set(bufs)):
            yield tuple(bufs)

    def note(self, device_type: str) -> str:
        """What the run's record says about how attention ran."""
        if self.method in ("torch", "ring"):
            return NOTES[self.method].format(rotate=self.rotate, device=device_type.upper())
        eager = "; it materialises its scores, torch's ring runs a fused kernel"
        return NOTES["allgather"].format(device=device_type.upper(), eager=eager)


def apply_cp(model: nn.Module, cp: ContextParallel) -> None:
    """Every attention layer of ``model`` (a Transformer or a stage of it) attends over the sharded
    sequence with ``cp``; rotary / learned positions follow the rank's tokens."""
    model.positions = cp.positions
    for block in model.layers.values():
        block.attention.context_parallel = cp
