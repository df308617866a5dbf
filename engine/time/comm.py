"""Communication per step: bytes and seconds, per rank and per parallel dimension.

Collective times follow the ring alpha-beta model with the nccl-tests bus-bandwidth
factors (NVIDIA nccl-tests, doc/PERFORMANCE.md in that repository)::

    all-reduce                               2(n-1)·α + 2(n-1)/n · S/B
    reduce-scatter / all-gather / all-to-all  (n-1)·α +  (n-1)/n · S/B
    point-to-point                                 α +          S/B

S is the size of the whole buffer (for all-gather: the gathered output), B the per-GPU
bus bandwidth of the link the group spans, α its latency. A group whose ranks sit on
several nodes with more than one rank per node runs hierarchically: an intra-node
reduce-scatter, the inter-node collective on S/n_local, an intra-node all-gather. A group
with one rank per node runs a flat ring over the network.

Rank placement: TP innermost, then CP, then DP, then PP (engine.pipeline.layout), so TP groups are the
consecutive ranks and the most likely to fit in a node, CP groups next; PP groups are strided furthest.

Local CPU ranks (GPU kind "cpu") run gloo's collectives (:func:`gloo_call_seconds`): its ring steps
as gloo takes them (a reduce-scatter is an all-reduce on CPU tensors, an all-to-all one round), each
at α and the bytes at B, both shared by the ranks that outnumber ``cluster.cpu_cores``: every hop
waits for a descheduled peer and every copy runs on a shared core, so α is multiplied and B divided
by the oversubscription ``world / cores`` (the ``local-cpu`` preset's α and B are per core, measured
with ``shardscope calibrate --links``). A collective a rank calls after its compute, as training
does, pays ``cluster.cpu_wake_latency_us`` once more, times its group's ranks per core (gloo's
threads and a shared core wake first, which a collective timed after a barrier never waits for;
``benchmarks/gloo_calls.py``, ``benchmarks/clocks.md``); ZeRO-1's broadcasts, issued back to back
with async_op, pay it once. Sends (p2p, the broadcasts' rounds) pay the wake at each, times the
world's ranks per core.

Under sequence parallelism without FSDP2 (dp·cp = 1, ZeRO below 2) the norms' weight gradients reach the
optimizer as Partial DTensors, and torch's one-tensor step all-reduces each at every op that reads it
(:func:`sp_partial_gradients`): TP items of phase "step", after the backward.

Expert parallelism (``parallel.ep`` > 1): each MoE block all-to-alls its tokens to the experts'
ranks and back, forward and backward (:func:`ep_layer_collectives`), over ep consecutive ranks
(``ep_span``); a group across nodes sends each peer's share over its own link
(:func:`all_to_all_seconds`). They are items of dimension "ep", on the critical path like TP's.
The experts' own gradients and FSDP gathers run over efsdp = dp_shard·cp·tp / ep
(:func:`_expert_dp_items`), the rest of the model's over dp.

Measured links (:class:`MeasuredLinks`, from ``shardscope calibrate --links``) replace the
cluster's intra-node α and B per collective and group size when given.

LoRA (``training.finetune = "lora"``): only the adapters have gradients, so DDP's all-reduce,
ZeRO-1's all-reduce and parameter broadcast, FSDP's reduce-scatter and HSDP's replica all-reduce
move adapter bytes only (:func:`trainable_local`); FSDP still all-gathers the frozen base with the
adapters (fully_shard shards frozen parameters too), and reduce-scatters only the units that hold
adapters (the blocks). Wire dtypes follow the backend: FSDP2 reduces in its MixedPrecisionPolicy's
``reduce_dtype`` (``training.grad_dtype``); DDP and ZeroRedundancyOptimizer move the fp32 adapters'
own gradients and parameters under PyTorch state accounting (``training.grad_dtype`` /
``param_bytes`` under the paper convention, as engine.memory counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from engine.config import Config
from engine.memory.buffers import gathered_unit_bytes
from engine.model.lora import adapter_block_tensors
from engine.model.params import params_per_rank
from engine.model.recompute import checkpointed_blocks
from engine.model.routing import moe_tokens, routed_factor
from engine.pipeline.layout import placement_style, rank_coords, rank_of, split_layers, stage_to_pp_rank
from engine.time.durations import adapter_elements_per_block, cpu_wake_s
from engine.wrapping import forwards_before_first_backward, wrapping_plan

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
DIMENSIONS = ("dp", "cp", "tp", "pp")
#: process groups a span is asked for: the dimensions, and "dp_cp" (dp and cp flattened: the
#: gradient reduction and the ZeRO / FSDP shard group, torchtitan's dp_shard_cp)
GROUPS = (*DIMENSIONS, "dp_cp")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each rank moves per byte of the buffer."""
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if kind == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {kind!r}; allowed: {', '.join(COLLECTIVES)}")


def ring_seconds(kind: str, size_bytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Flat-ring time of one collective of a ``size_bytes`` buffer over ``n`` ranks."""
    if kind == "p2p":
        return latency_s + size_bytes / bandwidth_bytes_per_s
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * latency_s + bus_factor(kind, n) * size_bytes / bandwidth_bytes_per_s


def cpu_oversubscription(cfg: Config) -> float:
    """How many ranks share each core: ``world / cluster.cpu_cores`` for CPU ranks, at least 1."""
    cl = cfg.cluster
    if cl.gpu.name != "cpu" or cl.cpu_cores <= 0:
        return 1.0
    return max(1.0, cfg.parallel.world_size / cl.cpu_cores)


@dataclass(frozen=True)
class LinkFit:
    """α and B of one collective over groups of ``group_size`` ranks, fitted to measured times."""

    kind: str  # one of COLLECTIVES
    group_size: int
    latency_s: float  # α, per ring step
    bytes_per_s: float  # B, bus bandwidth


@dataclass(frozen=True)
class MeasuredLinks:
    """Per-collective α and B measured inside a node; ``scale`` multiplies α and divides B
    (core sharing of the target layout relative to the benchmark's)."""

    fits: tuple[LinkFit, ...]
    scale: float = 1.0

    def lookup(self, kind: str, n: int) -> tuple[float, float] | None:
        """(bytes/s, α) for ``kind`` over ``n`` ranks: the fit of the nearest measured group size
        (the larger one on a tie); all-to-all uses the all-gather fit. None: not measured."""
        kind = "all_gather" if kind == "all_to_all" else kind
        fits = [f for f in self.fits if f.kind == kind]
        if not fits:
            return None
        f = min(fits, key=lambda x: (abs(x.group_size - n), -x.group_size))
        return f.bytes_per_s / self.scale, f.latency_s * self.scale


@dataclass(frozen=True)
class GroupSpan:
    """How one process group of a dimension lies on the nodes."""

    dim: str
    size: int
    nodes: int  # nodes the group touches
    local: int  # ranks of the group per node (the largest count on any node)

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def link(self) -> str:
        if not self.crosses_nodes:
            return "intra-node"
        return "hierarchical" if self.local > 1 else "inter-node"


def group_ranks(cfg: Config, dim: str, rank: int = 0) -> list[int]:
    """The global ranks of the ``dim`` group that contains ``rank`` ("dp_cp": the flattened
    dp·cp group that reduces gradients and, under ZeRO / FSDP, shards the model states)."""
    if dim not in GROUPS:
        raise ValueError(f"unknown dimension {dim!r}; allowed: {', '.join(GROUPS)}")
    par = cfg.parallel
    return list(_ranks_of_group(par.dp, par.cp, par.tp, par.pp, dim, rank))


def _ranks_of_group(dp: int, cp: int, tp: int, pp: int, dim: str, rank: int) -> tuple[int, ...]:
    c = rank_coords(rank, dp, tp, pp, 1, cp)
    if dim == "tp":
        return tuple(rank_of(c.pp, c.dp, t, dp, tp, c.cp, cp) for t in range(tp))
    if dim == "cp":
        return tuple(rank_of(c.pp, c.dp, c.tp, dp, tp, k, cp) for k in range(cp))
    if dim == "dp":
        return tuple(rank_of(c.pp, d, c.tp, dp, tp, c.cp, cp) for d in range(dp))
    if dim == "dp_cp":
        return tuple(rank_of(c.pp, d, c.tp, dp, tp, k, cp) for d in range(dp) for k in range(cp))
    return tuple(rank_of(p, c.dp, c.tp, dp, tp, c.cp, cp) for p in range(pp))


def group_span(cfg: Config, dim: str) -> GroupSpan:
    """The widest-spread group of ``dim`` (all groups of a dimension have the same shape
    when gpus_per_node divides the group stride; otherwise the worst one is reported)."""
    par = cfg.parallel
    if dim not in GROUPS:
        raise ValueError(f"unknown dimension {dim!r}; allowed: {', '.join(GROUPS)}")
    return _group_span(par.dp, par.tp, par.pp, cfg.cluster.gpus_per_node, dim, par.cp)


#: each dimension's groups as arithmetic progressions of ranks on the (pp, dp, cp, tp) mesh
#: (engine.pipeline.layout's rank order): member stride and block length (a block holds ``stride`` groups
#: side by side), as functions of (dp, cp, tp, pp)
_PROGRESSIONS = {
    "tp": lambda dp, cp, tp, pp: (1, tp),
    "cp": lambda dp, cp, tp, pp: (tp, tp * cp),
    "dp": lambda dp, cp, tp, pp: (tp * cp, tp * cp * dp),
    "dp_cp": lambda dp, cp, tp, pp: (tp, tp * cp * dp),
    "pp": lambda dp, cp, tp, pp: (tp * cp * dp, tp * cp * dp * pp),
}


def _progression_span(first: int, stride: int, n: int, gpn: int) -> tuple[int, int]:
    """(nodes touched, most members on one node) of the ranks ``first + j·stride``, j < n, on nodes of
    ``gpn`` consecutive ranks (``first`` < gpn: only its offset inside a node matters)."""
    if stride >= gpn:  # consecutive members a node or more apart: one member per node
        return n, 1
    last_node = (first + (n - 1) * stride) // gpn
    # members one stride apart skip no node, so every node from 0 to last_node is touched; their
    # counts repeat every stride / gcd(stride, gpn) nodes: the first period (and the ends) hold the most
    scan = min(last_node, stride // math.gcd(stride, gpn) + 1)
    most = 0
    for k in range(scan + 1):
        j_lo = max(0, -(-(k * gpn - first) // stride))
        j_hi = min(n - 1, ((k + 1) * gpn - first - 1) // stride)
        most = max(most, j_hi - j_lo + 1)
    return last_node + 1, most


@lru_cache(maxsize=4096)
def _group_span(dp: int, tp: int, pp: int, gpn: int, dim: str, cp: int = 1) -> GroupSpan:
    """The worst-spread group of ``dim`` (most nodes, then fewest ranks per node), in time independent
    of the world size: a group is the progression ``start + j·stride`` and its spread depends only on
    ``start mod gpn``; the starts are ``k·block + o`` (k < world / block, o < stride)."""
    size = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "dp_cp": dp * cp}[dim]
    stride, block = _PROGRESSIONS[dim](dp, cp, tp, pp)
    world = dp * cp * tp * pp
    if stride >= gpn:
        offsets: set[int] = {0}  # the spread does not depend on the start
    else:
        block_offsets = {(k * block) % gpn for k in range(min(world // block, gpn))}
        offsets = {(b + o) % gpn for b in block_offsets for o in range(min(stride, gpn))}
    worst = GroupSpan("dp" if dim == "dp_cp" else dim, size, 1, size)
    for first in sorted(offsets):
        nodes, local = _progression_span(first, stride, size, gpn)
        if (nodes, -local) > (worst.nodes, -worst.local):
            worst = GroupSpan(worst.dim, size, nodes, local)
    return worst


def collective_seconds(cfg: Config, kind: str, size_bytes: float, span: GroupSpan,
                       links: MeasuredLinks | None = None, queued: bool = False) -> float:
    """Time of one collective over a group laid out as ``span`` on this cluster (intra-node
    α and B from ``links`` where it measured the collective). On CPU ranks each intra-node step
    also pays the wake (:func:`cpu_wake_s`) unless ``queued``: issued back to back after another
    call (async_op), it finds gloo's threads awake."""
    cl = cfg.cluster
    over = cpu_oversubscription(cfg)
    wake = 0.0 if queued else cpu_wake_s(cfg)
    intra = (cl.intra_node_bytes_per_s / over, (cl.intra_node_latency_us * 1e-6 + wake) * over)
    inter = (cl.inter_node_bytes_per_s / over, cl.inter_node_latency_us * 1e-6 * over)
    n = span.size
    if kind == "p2p":
        if links is not None and not span.crosses_nodes:
            intra = links.lookup("p2p", 2) or intra
        return ring_seconds("p2p", size_bytes, 2, *(inter if span.crosses_nodes else intra))
    if n <= 1:
        return 0.0
    if not span.crosses_nodes:
        fit = links.lookup(kind, n) if links is not None else None
        if fit is None and cl.gpu.name == "cpu":
            return gloo_call_seconds(cfg, kind, size_bytes, n, queued)
        return ring_seconds(kind, size_bytes, n, *(fit or intra))
    if span.local == 1:
        return ring_seconds(kind, size_bytes, n, *inter)
    # hierarchical: intra reduce-scatter / all-gather around an inter-node collective on S/local
    local, nodes = span.local, span.nodes
    if kind == "all_reduce":
        return (ring_seconds("reduce_scatter", size_bytes, local, *intra)
                + ring_seconds("all_reduce", size_bytes / local, nodes, *inter)
                + ring_seconds("all_gather", size_bytes, local, *intra))
    return (ring_seconds(kind, size_bytes, local, *intra)
            + ring_seconds(kind, size_bytes / local, nodes, *inter))


#: ring steps of one gloo collective over n ranks (torch's ProcessGroupGloo on CPU tensors): its all-reduce is a
#: ring of 2(n − 1) steps; ``reduce_scatter_tensor_coalesced`` clones the input, all-reduces it and copies out the
#: rank's chunk (an all-reduce's steps and bytes); the all-gather a ring of n − 1; ``alltoall`` posts every send and
#: receive at once and waits (one round)
GLOO_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: 2 * (n - 1),
              "all_gather": lambda n: n - 1, "all_to_all": lambda n: 1}


def gloo_call_seconds(cfg: Config, kind: str, size_bytes: float, n: int, queued: bool = False) -> float:
    """One collective over ``n`` local CPU ranks on gloo as training calls it (``benchmarks/clocks.md``, session 38):
    the wake once a call (``cluster.cpu_wake_latency_us``: gloo's threads and a core shared with the rank's own
    compute wake first; none when ``queued`` behind another call), times the group's ranks per core — each must be
    scheduled — then gloo's steps (:data:`GLOO_STEPS`) at α and the bytes at B, both shared by the world's ranks per
    core (:func:`cpu_oversubscription`)."""
    cl = cfg.cluster
    over = cpu_oversubscription(cfg)
    per_core = max(1.0, n / cl.cpu_cores) if cl.cpu_cores > 0 else 1.0
    wake = 0.0 if queued else cpu_wake_s(cfg) * per_core
    moved = bus_factor("all_reduce" if kind == "reduce_scatter" else kind, n) * size_bytes
    return wake + GLOO_STEPS[kind](n) * cl.intra_node_latency_us * 1e-6 * over + moved * over / cl.intra_node_bytes_per_s


# --------------------------------------------------------------------------- per step


@dataclass(frozen=True)
class CommItem:
    """One kind of communication a rank does in a step."""

    dim: str  # "dp" | "tp" | "pp"
    what: str  # e.g. "DDP gradient all-reduce"
    collective: str  # one of COLLECTIVES
    calls: int  # per step
    size_bytes: float  # buffer size of one call (S)
    group_size: int
    link: str  # intra-node | inter-node | hierarchical
    seconds: float  # all calls of the step together
    overlappable: bool  # may hide behind compute (DP with backward, FSDP prefetch); TP is on the critical path
    phase: str  # "forward" | "backward" | "step" | "forward+backward"

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank puts on the wire in the step (bus bytes)."""
        n = 2 if self.collective == "p2p" else self.group_size
        return self.calls * self.size_bytes * bus_factor(self.collective, n)


@dataclass(frozen=True)
class RankComm:
    pp_rank: int
    rank: int  # global rank of (pp_rank, dp 0, cp 0, tp 0)
    items: tuple[CommItem, ...] = field(default=())

    def seconds(self, dim: str | None = None) -> float:
        return sum(i.seconds for i in self.items if dim is None or i.dim == dim)

    def bytes_sent(self, dim: str | None = None) -> float:
        return sum(i.bytes_sent for i in self.items if dim is None or i.dim == dim)


@dataclass(frozen=True)
class CommReport:
    per_pp_rank: tuple[RankComm, ...]
    spans: dict[str, GroupSpan]

    def to_json(self) -> dict:
        return {
            "groups": {d: {"size": s.size, "nodes": s.nodes, "ranks_per_node": s.local, "link": s.link,
                           "crosses_nodes": s.crosses_nodes} for d, s in self.spans.items()},
            "per_rank": [
                {"pp_rank": rc.pp_rank, "rank": rc.rank, "seconds": rc.seconds(), "bytes_sent": rc.bytes_sent(),
                 "items": [{"dim": i.dim, "what": i.what, "collective": i.collective, "calls": i.calls,
                            "size_bytes": i.size_bytes, "group_size": i.group_size, "link": i.link,
                            "seconds": i.seconds, "bytes_sent": i.bytes_sent, "overlappable": i.overlappable,
                            "phase": i.phase} for i in rc.items]}
                for rc in self.per_pp_rank
            ],
        }


def activation_message_bytes(cfg: Config) -> int:
    """One microbatch's hidden states b·s·h on one rank in the compute dtype (what TP collectives and PP
    sends move); s is the rank's tokens, seq_len / cp under context parallelism."""
    m, t = cfg.model, cfg.training
    return t.micro_batch_size * cfg.local_seq_len * m.hidden * t.param_bytes


def communication(cfg: Config, links: MeasuredLinks | None = None) -> CommReport:
    """Bytes and seconds of every collective and send a rank does in one step, per pp-rank
    (intra-node α and B from ``links`` where given)."""
    par = cfg.parallel
    spans = {d: group_span(cfg, d) for d in DIMENSIONS}
    if par.ep > 1:
        spans["ep"] = ep_span(cfg)
    held = params_per_rank(cfg)
    n_stages = par.num_stages
    owners = stage_to_pp_rank(n_stages, par.pp, placement_style(par.schedule))
    m = par.microbatches
    act = activation_message_bytes(cfg)
    out = []
    for pp_rank in range(par.pp):
        rp = held[pp_rank][0]  # tp-rank 0 holds the largest vocabulary chunk
        items: list[CommItem] = []
        if par.ep > 1 and rp.expert_units:  # the experts reduce over efsdp, the rest over dp
            items += _dp_items(cfg, without_experts(rp), spans, links)
            items += _expert_dp_items(cfg, rp, links)
        else:
            items += _dp_items(cfg, rp, spans, links)
        items += _tp_items(cfg, rp, act, spans["tp"], links)
        items += _cp_items(cfg, rp, spans["cp"], links)
        if par.ep > 1:
            items += _ep_items(cfg, rp, links)
        # pipeline sends: one activation forward and one gradient backward per microbatch per boundary
        pp_msg = act / par.tp if par.sequence_parallel else act
        fwd = sum(1 for s in rp.stage_indices if s < n_stages - 1 and owners[s + 1] != pp_rank)
        bwd = sum(1 for s in rp.stage_indices if s > 0 and owners[s - 1] != pp_rank)
        pspan = spans["pp"]
        if par.pp > 1:
            for phase, boundaries in (("forward", fwd), ("backward", bwd)):
                if boundaries:
                    one = collective_seconds(cfg, "p2p", pp_msg, pspan, links)
                    items.append(CommItem("pp", f"pipeline {'activation' if phase == 'forward' else 'gradient'} send",
                                          "p2p", boundaries * m, pp_msg, 2, pspan.link, boundaries * m * one, False, phase))
        out.append(RankComm(pp_rank=pp_rank, rank=rank_of(pp_rank, 0, 0, par.dp, par.tp, 0, par.cp), items=tuple(items)))
    return CommReport(per_pp_rank=tuple(out), spans=spans)


def recomputed_blocks(cfg: Config, every_block: tuple[str, ...]) -> list[int]:
    """Blocks per stage whose backward re-runs their forward, or the part of it a collective sits in
    (one entry per stage; one stage when pp = 1): every block when ``training.recompute`` is one of
    ``every_block``, torchtitan's every N-th block of each rank under selective-layer
    (``engine.model.recompute.checkpointed_blocks``), none otherwise."""

    tr, par = cfg.training, cfg.parallel
    if tr.recompute in every_block:
        return [len(r) for r in split_layers(cfg.model.layers, 1 if par.pp == 1 else par.num_stages,
                                             par.pipeline_split)]
    return checkpointed_blocks(cfg)


def cp_recomputed_blocks(cfg: Config) -> list[int]:
    """Blocks per stage whose backward re-runs the attention forward, and so its K, V exchange
    (one entry per stage; one stage when pp = 1): every block under full and selective (attention
    core) recompute, torchtitan's every N-th block under selective-layer, none otherwise
    (torchtitan's per-op policy saves the attention outputs)."""
    return recomputed_blocks(cfg, ("full", "selective"))


def tp_recomputed_blocks(cfg: Config) -> list[int]:
    """Blocks per stage whose backward repeats TP collectives of their forward
    (:func:`tp_recomputed_collectives`): every block under full and selective-op, the checkpointed
    blocks under selective-layer, none otherwise (selective recomputes only the attention core,
    which lies between the collectives)."""
    return recomputed_blocks(cfg, ("full", "selective-op"))


def cp_layer_exchanges(cfg: Config) -> list[tuple[str, str, int, float, str]]:
    """The context-parallel K, V exchange of one layer for one microbatch on one rank, as torch's
    ring attention (``torch.distributed.tensor.experimental._context_parallel._attention``) issues
    it: (collective, phase, calls, bytes of one call, what).

    "allgather" (``_AllGatherRotater``): one all-gather of every rank's K, V (the gathered buffer
    2·S·b·kv/t, S the whole sequence) in the forward, and again in the backward. "alltoall"
    (``_AllToAllRotater``): cp − 1 rotations of the rank's chunk 2·s·b·kv/t (s = S/cp) to the next
    rank, forward and backward. Either way the backward's dK, dV travel the ring (its rotater is
    always all-to-all) in fp32 (``convert_to_f32``): cp rotations. Eager attention (all-gather
    only) runs the gather through autograd: its backward reduce-scatters the K, V gradients
    instead. A block whose backward recomputes its forward (``cp_recomputed_blocks``) repeats the
    forward's exchange in its backward.
    """
    par, tr, m = cfg.parallel, cfg.training, cfg.model
    if par.cp == 1:
        return []
    act = 4 if tr.precision == "fp32" else 2
    s, b, kv = cfg.local_seq_len, tr.micro_batch_size, m.kv_dim // par.tp
    chunk = 2.0 * s * b * kv * act
    out: list[tuple[str, str, int, float, str]] = []
    if par.cp_rotate == "allgather":
        gathered = chunk * par.cp
        out.append(("all_gather", "forward", 1, gathered, "K, V all-gather"))
        out.append(("all_gather", "backward", 1, gathered, "K, V all-gather"))
    else:
        out.append(("p2p", "forward", par.cp - 1, chunk, "K, V ring rotation"))
        out.append(("p2p", "backward", par.cp - 1, chunk, "K, V ring rotation"))
    if m.attention == "flash":
        out.append(("p2p", "backward", par.cp, 2.0 * s * b * kv * 4, "dK, dV ring rotation (fp32)"))
    else:
        out.append(("reduce_scatter", "backward", 1, chunk * par.cp, "K, V gradient reduce-scatter"))
    return out


def _cp_items(cfg: Config, rp, span: GroupSpan, links: MeasuredLinks | None) -> list[CommItem]:
    """The K, V exchange of every layer of the rank's stages and every microbatch, and the
    recomputed forwards' (engine.time.step hides each behind the blockwise attention it overlaps)."""
    par = cfg.parallel
    items = []
    hides = cfg.cluster.gpu.name != "cpu"
    again = cp_recomputed_blocks(cfg)
    redo = sum(again[st.stage] for st in rp.stages)
    for coll, phase, calls, size, what in cp_layer_exchanges(cfg):
        one = collective_seconds(cfg, coll, size, span, links)
        n = calls * rp.layers * par.microbatches
        items.append(CommItem("cp", f"CP {what} ({phase}; {calls} per layer, {par.cp_rotate})", coll, n, size,
                              par.cp, span.link, n * one, hides, phase))
        if phase == "forward" and redo:
            n = calls * redo * par.microbatches
            items.append(CommItem("cp", f"CP {what} of the recomputed forward (backward; {calls} per recomputed "
                                        f"block, {redo} block(s), {par.cp_rotate})", coll, n, size, par.cp,
                                  span.link, n * one, hides, "backward"))
    return items


def ep_span(cfg: Config) -> GroupSpan:
    """How one EP group lies on the nodes: ep consecutive ranks of a stage's dp_shard·tp block
    (torchtitan's sparse mesh puts ep innermost, over TP's ranks first)."""
    par, gpn = cfg.parallel, cfg.cluster.gpus_per_node
    n = par.ep
    local = min(n, gpn)
    return GroupSpan("ep", n, math.ceil(n / local), local)


def all_to_all_seconds(cfg: Config, size_bytes: float, span: GroupSpan, links: MeasuredLinks | None = None) -> float:
    """One all-to-all in which each rank sends ``size_bytes`` split evenly over the group: the
    share for peers on its node at the intra-node bus bandwidth, the share for other nodes at the
    inter-node one, concurrently, plus (n − 1)·α of the slower link."""
    n = span.size
    if n <= 1:
        return 0.0
    if not span.crosses_nodes:
        return collective_seconds(cfg, "all_to_all", size_bytes, span, links)
    cl = cfg.cluster
    over = cpu_oversubscription(cfg)
    intra = size_bytes * (span.local - 1) / n / (cl.intra_node_bytes_per_s / over)
    inter = size_bytes * (n - span.local) / n / (cl.inter_node_bytes_per_s / over)
    return max(intra, inter) + (n - 1) * cl.inter_node_latency_us * 1e-6 * over


def ep_layer_collectives(cfg: Config) -> list[tuple[str, str, int, float]]:
    """Expert parallelism's all-to-alls of one MoE block for one microbatch: (what, phase, calls,
    bytes one rank sends per call). Forward: dispatch the n·k token copies to their experts'
    ranks, combine the outputs back; backward: the same two for the gradients (and the forward's
    again under full recompute). The busiest rank receives the routed factor's share more; the
    time is paced by it (the sizes here are the balanced sends × that factor)."""

    par, tr, m = cfg.parallel, cfg.training, cfg.model
    if par.ep == 1 or m.experts == 0:
        return []
    n, _ = moe_tokens(cfg)
    size = n * m.experts_per_token * m.hidden * tr.param_bytes * routed_factor(cfg)
    again = 2 if tr.recompute == "full" else 0
    return [("dispatch and combine", "forward", 2, size), ("dispatch and combine gradients", "backward", 2 + again, size)]


def ep_seconds_per_moe_layer(cfg: Config, links: MeasuredLinks | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's all-to-alls for one microbatch."""
    span = ep_span(cfg)
    out = {"forward": 0.0, "backward": 0.0}
    for _, phase, calls, size in ep_layer_collectives(cfg):
        out[phase] += calls * all_to_all_seconds(cfg, size, span, links)
    return out["forward"], out["backward"]


def _ep_items(cfg: Config, rp, links: MeasuredLinks | None) -> list[CommItem]:
    span = ep_span(cfg)
    moe_layers = sum(st.moe_layers for st in rp.stages)
    items = []
    for what, phase, calls, size in ep_layer_collectives(cfg):
        n_calls = calls * moe_layers * cfg.parallel.microbatches
        if n_calls:
            one = all_to_all_seconds(cfg, size, span, links)
            items.append(CommItem("ep", f"EP all-to-all: {what} per MoE block ({phase}; {calls} per block)",
                                  "all_to_all", n_calls, size, span.size, span.link, n_calls * one, False, phase))
    return items


def without_experts(rp):
    """A (pp-rank, tp-rank)'s parameters less its routed experts' own units (expert parallelism)."""
    from dataclasses import replace

    experts = {u for u, _ in rp.expert_units}
    return replace(rp, unit_groups=tuple(g for g in rp.unit_groups if g[0] not in experts),
                   stages=tuple(replace(st, experts=0) for st in rp.stages), expert_units=())


def efsdp_span(cfg: Config) -> GroupSpan:
    """How one group of the experts' data parallelism lies on the nodes: efsdp ranks (times the HSDP
    replicas for DDP's all-reduce) strided by ep, the sparse mesh (dp_replicate, efsdp, ep) having
    ep innermost."""
    par, gpn = cfg.parallel, cfg.cluster.gpus_per_node
    n = par.expert_shard_degree
    local = max(1, min(n, gpn // par.ep))
    return GroupSpan("dp", n, math.ceil(n / local), local)


def _expert_dp_items(cfg: Config, rp, links: MeasuredLinks | None) -> list[CommItem]:
    """The routed experts' data-parallel traffic under expert parallelism, over efsdp (torchtitan's
    sparse mesh): FSDP (ZeRO-2/3) gathers each expert unit as the dense units are gathered and
    reduce-scatters its gradients once per step (exposed); DDP all-reduces them (overlapped with the
    backward), over efsdp × the HSDP replicas."""
    par, tr = cfg.parallel, cfg.training
    units = sum(c for _, c in rp.expert_units)
    elements = rp.experts
    span = efsdp_span(cfg)
    plan = wrapping_plan(cfg)
    hides = cfg.cluster.gpu.name != "cpu"
    m = par.microbatches
    items = []

    def add(what, coll, calls, size, sp, overlappable, phase):
        if sp.size > 1 and calls:
            one = collective_seconds(cfg, coll, size, sp, links)
            items.append(CommItem("dp", what, coll, calls, size, sp.size, sp.link, calls * one, overlappable and hides,
                                  phase))

    if par.zero in (2, 3) and plan.sharded:
        if plan.reshard_after_forward and par.pp == 1:
            calls = 2 * m * units
        elif par.pp == 1:
            calls = m * units
        else:
            calls = units * (2 if plan.reshard_after_forward else 1)
        add(f"FSDP all-gather of the experts over efsdp ({units} unit(s))", "all_gather", calls,
            elements * tr.param_bytes / units, span, True, "forward")
        add(f"FSDP gradient reduce-scatter of the experts over efsdp ({units} unit(s))", "reduce_scatter", units,
            elements * tr.grad_bytes / units, span, False, "backward")
    else:
        group = par.expert_shard_degree * par.replicate
        whole = GroupSpan("dp", group, max(1, math.ceil(group / span.local)), min(group, span.local))
        add("DDP all-reduce of the experts' gradients over efsdp", "all_reduce", 1, elements * tr.grad_bytes, whole,
            True, "backward")
    return items


def trainable_local(cfg: Config, rp) -> int:
    """Elements with a gradient that one (pp-rank, tp-rank) holds before any DP sharding: every
    local parameter under full fine-tuning, the blocks' adapters under LoRA."""
    if cfg.training.finetune != "lora":
        return rp.total
    return rp.layers * adapter_elements_per_block(cfg)


def lora_wire_bytes(cfg: Config, fsdp: bool) -> tuple[int, int]:
    """(bytes per adapter parameter, bytes per adapter gradient) that DP collectives move under LoRA."""
    tr = cfg.training
    if fsdp:  # FSDP2's MixedPrecisionPolicy: gathered in param_dtype, reduced in reduce_dtype
        return tr.param_bytes, tr.grad_bytes
    if cfg.conventions.state_accounting == "pytorch":  # fp32 adapters, fp32 gradients (peft upcasts)
        return 4, 4
    return tr.param_bytes, tr.grad_bytes


def _dp_items(cfg: Config, rp, spans: dict[str, GroupSpan], links: MeasuredLinks | None) -> list[CommItem]:
    """DP communication of one step.

    FSDP (ZeRO-2/3, torch's fully_shard per block + the root) gathers and reduce-scatters each
    unit separately: one call per unit, each paying the ring's latency. ZeRO-3 gathers every
    unit in the forward and again in the backward of every microbatch; ZeRO-2 keeps the
    forward's gather for the backward but FSDP2 reshards after each backward, so it gathers
    once per microbatch (once per step under pipelining, whose stages skip the reshard until
    the last backward). Under pipelining a ZeRO-3 unit that reshards after forward
    (``fsdp_reshard_after_forward = "always"``) is gathered in each forward before its stage's
    first backward and in that backward, then stays unsharded (engine.wrapping). float8
    all-gather moves the blocks' Linear weights in 1 byte (engine.memory.buffers.gathered_unit_bytes). The reduce-scatters run once per step (gradient sync only on the last
    microbatch) and are counted exposed. On CPU ranks nothing overlaps: communication and
    compute share the same cores.

    LoRA: gradients (and ZeRO-1's broadcast) cover the adapters only; FSDP gathers base + adapters.
    """
    par, tr, conv = cfg.parallel, cfg.training, cfg.conventions
    if par.dp_cp == 1:
        return []
    local_params = rp.total
    grads = local_params * tr.grad_bytes
    weights = local_params * tr.param_bytes
    lora_on = tr.finetune == "lora"
    grad_units = max(1, rp.unit_count)
    plan = wrapping_plan(cfg)
    if lora_on:
        adapters = trainable_local(cfg, rp)
        w_a, g_a = lora_wire_bytes(cfg, fsdp=plan.sharded)
        grads = adapters * g_a
        if plan.sharded:
            weights = (local_params + adapters) * tr.param_bytes  # the frozen base is gathered too
        else:
            weights = adapters * w_a  # ZeRO-1 broadcasts the updated adapter shards
        grad_units = max(1, rp.layers)  # only the blocks hold adapters (and reduce-scatter)
    shard = par.shard_degree
    # gradients are reduced over dp·cp (context-parallel ranks hold the same parameters)
    span = spans["dp"] if par.cp == 1 else group_span(cfg, "dp_cp")
    # the shard group is the first (dp/replicate)·cp ranks of the dp·cp group (replicas outermost)
    shard_span = _sub_span(span, shard)
    hides = cfg.cluster.gpu.name != "cpu"
    items = []

    def add(what, coll, calls, size, sp, overlappable, phase):
        if sp.size > 1:
            one = collective_seconds(cfg, coll, size, sp, links)
            items.append(CommItem("dp", what, coll, calls, size, sp.size, sp.link, calls * one,
                                  overlappable and hides, phase))

    if not plan.sharded and not plan.zero_redundancy_optimizer:  # DDP (or FSDP2's replicate)
        buckets = max(1, math.ceil(grads / (conv.ddp_bucket_mb * 1e6)))
        add(f"DDP gradient all-reduce ({buckets} bucket(s) of ≤ {conv.ddp_bucket_mb:g} MB"
            f"{'; adapters only' if lora_on else ''})", "all_reduce",
            buckets, grads / buckets, span, True, "backward")
    elif plan.zero_redundancy_optimizer:
        # torch's ZeroRedundancyOptimizer: DDP all-reduces the gradients, then every rank
        # broadcasts its updated shard — an all-gather of the parameters in volume.
        add("ZeRO-1 gradient all-reduce (DDP)", "all_reduce", 1, grads, span, True, "backward")
        # ...then every rank broadcasts its updated shard, one ``dist.broadcast`` per parameter
        # tensor (parameters_as_bucket_view=False, torch's default): every rank takes part in every
        # tensor's broadcast, each paying the broadcast's latency. Listed as one all-gather of the
        # parameters (its volume: calls and size_bytes), timed as the per-tensor broadcasts.
        tensors = zero1_broadcast_tensors(cfg, rp)
        if span.size > 1:  # issued with async_op=True and waited for at the end (torch's _sync_params): on CPU
            # ranks the first wakes gloo's threads, the rest find them awake
            one = weights / tensors
            secs = (broadcast_seconds(cfg, one, span, links)
                    + (tensors - 1) * broadcast_seconds(cfg, one, span, links, queued=True))
            items.append(CommItem("dp", f"ZeRO-1 parameter all-gather (timed as {tensors} per-tensor broadcasts "
                                        "after the step)", "all_gather", 1, weights, span.size, span.link,
                                  secs, False, "step"))
    else:
        units = max(1, rp.unit_count)
        m = par.microbatches
        if not lora_on:

            weights = sum(gathered_unit_bytes(plan, rp, u) * count for u, count in rp.unit_groups)
        if plan.reshard_after_forward and par.pp == 1:
            calls, when = 2 * m * units, "forward and backward, every microbatch"
        elif plan.reshard_after_forward:
            # every forward before a stage's first backward, and that backward; then unsharded for good
            before = forwards_before_first_backward(par.schedule, rp.pp_rank, par.pp, par.virtual_stages, m)
            calls = sum((st.layers + (st.stage == 0) + (st.stage == par.num_stages - 1)) * (f + 1)
                        for st, f in zip(rp.stages, before))
            calls, when = max(1, calls), "each forward until the stage's first backward, and that backward"
        elif par.pp == 1:
            calls, when = m * units, "once per microbatch (resharded after each backward)"
        else:
            calls, when = units, "once per step (pipelining keeps it until the last backward)"
        add(f"FSDP parameter all-gather ({units} unit(s), {when}"
            f"{'; float8 Linear weights' if plan.float8_all_gather else ''})", "all_gather", calls,
            weights / units, shard_span, True, "forward+backward" if plan.reshard_after_forward else "forward")
        add(f"FSDP gradient reduce-scatter ({grad_units if lora_on else units} unit(s)"
            f"{' with adapters' if lora_on else ''})", "reduce_scatter", grad_units if lora_on else units,
            grads / (grad_units if lora_on else units), shard_span, False, "backward")
        if par.replicate > 1:
            rep = GroupSpan("dp", par.replicate, min(span.nodes, par.replicate),
                            max(1, par.replicate // max(1, min(span.nodes, par.replicate))))
            add("HSDP gradient all-reduce across replicas", "all_reduce", 1, grads / shard, rep, True, "backward")
    return items


def zero1_broadcast_tensors(cfg: Config, rp) -> int:
    """Parameter tensors ZeroRedundancyOptimizer broadcasts after each step (one call each): every
    local parameter tensor, or under LoRA the blocks' adapter tensors."""
    if cfg.training.finetune == "lora":

        m = cfg.model
        return max(1, rp.layers * len(adapter_block_tensors(m, 0, cfg.training.lora_targets, cfg.parallel.tp)))
    return max(1, rp.tensor_count)


def broadcast_seconds(cfg: Config, size_bytes: float, span: GroupSpan, links: MeasuredLinks | None = None,
                      queued: bool = False) -> float:
    """One broadcast of ``size_bytes`` over a group laid out as ``span``: a binomial tree
    (gloo's and MPI's short-message algorithm), ⌈log₂ n⌉ rounds of one point-to-point send
    (α + S/B of the p2p link, measured where ``links`` has it; ``queued``: :func:`collective_seconds`)."""
    if span.size <= 1:
        return 0.0
    rounds = math.ceil(math.log2(span.size))
    return rounds * collective_seconds(cfg, "p2p", size_bytes, span, links, queued)


def _sub_span(span: GroupSpan, size: int) -> GroupSpan:
    """The span of the first ``size`` ranks of a group laid out like ``span``."""
    if size == span.size:
        return span
    local = min(size, span.local)
    nodes = math.ceil(size / local)
    return GroupSpan(span.dim, size, nodes, local)


def tp_recomputed_collectives(cfg: Config) -> list[tuple[str, int]]:
    """TP collectives the backward of one recomputed block (:func:`tp_recomputed_blocks`) repeats
    for one microbatch: (collective, calls).

    full and selective-layer re-run the block's whole forward: its forward's collectives. The per-op
    policy (selective-op) re-runs every op whose output it does not save: under sequence
    parallelism the reduce-scatters of the o-proj and down-proj outputs are in its save list
    (``_c10d_functional.reduce_scatter_tensor``; engine.memory.activations keeps their outputs) and
    are not repeated, while the two all-gathers that give attention and MLP their inputs (norm
    outputs the policy recomputes) are; without sequence parallelism neither all-reduce is saved,
    so both are repeated. selective and none repeat none.
    """
    par, tr = cfg.parallel, cfg.training
    if par.tp == 1 or tr.recompute not in ("full", "selective-layer", "selective-op"):
        return []
    if par.sequence_parallel:
        if tr.recompute == "selective-op":
            return [("all_gather", 2)]
        return [("all_gather", 2), ("reduce_scatter", 2)]
    return [("all_reduce", 2)]


def tp_block_collectives(cfg: Config) -> list[tuple[str, str, int]]:
    """TP collectives of one block for one microbatch: (collective, phase, calls), as torch's
    DTensor plan (backend.parallel.tensor_parallel) issues them.

    Without sequence parallelism the row-parallel outputs (wo, w2) all-reduce in the forward;
    in the backward every column-parallel module (wq, wk, wv, w1 and w3 for SwiGLU) turns its
    own replicated input back from a partial gradient: one all-reduce each, not Megatron's one
    per sub-layer. With sequence parallelism each sub-layer gathers its input once
    (PrepareModuleInput) and reduce-scatters its output, forward and backward. Where every block
    recomputes (full, selective-op) its backward also repeats :func:`tp_recomputed_collectives`;
    selective-layer's repeats are per stage (:func:`tp_recomputed_blocks`) and not in this list.
    """
    par, tr, m = cfg.parallel, cfg.training, cfg.model
    if par.tp == 1:
        return []
    again = dict(tp_recomputed_collectives(cfg)) if tr.recompute in ("full", "selective-op") else {}
    if par.sequence_parallel:
        return [("all_gather", "forward", 2), ("reduce_scatter", "forward", 2),
                ("all_gather", "backward", 2 + again.get("all_gather", 0)),
                ("reduce_scatter", "backward", 2 + again.get("reduce_scatter", 0))]
    column_modules = 3 + (2 if m.mlp == "swiglu" else 1)
    return [("all_reduce", "forward", 2), ("all_reduce", "backward", column_modules + again.get("all_reduce", 0))]


def tp_edge_collectives(cfg: Config, first: bool, last: bool) -> list[tuple[str, str, int, float]]:
    """TP collectives outside the blocks for one microbatch, as backend.parallel.tensor_parallel
    plans them: (collective, phase, calls, bytes of one call).

    The vocabulary-parallel embedding (RowwiseParallel, first stage) sums its partial output:
    an all-reduce of b·s·h (a reduce-scatter under SP) in the forward; its input is token ids, so
    nothing flows back. The head (ColwiseParallel, last stage): without SP its output is
    replicated — an all-gather of the b·s·V logits in the forward — and its replicated input's
    partial gradient is all-reduced in the backward; with SP it gathers its sequence-sharded input
    (all-gather of b·s·h) and reduce-scatters that gradient, and loss_parallel reduces the row max,
    the sum of exponentials and the target logit: three all-reduces of b·s fp32 values.
    """
    par, tr, m = cfg.parallel, cfg.training, cfg.model
    if par.tp == 1:
        return []
    act = float(activation_message_bytes(cfg))
    rows = tr.micro_batch_size * cfg.local_seq_len
    out: list[tuple[str, str, int, float]] = []
    if first:
        out.append(("reduce_scatter" if par.sequence_parallel else "all_reduce", "forward", 1, act))
    if last:
        if par.sequence_parallel:
            out += [("all_gather", "forward", 1, act), ("reduce_scatter", "backward", 1, act),
                    ("all_reduce", "forward", 3, rows * 4.0)]
        else:
            out += [("all_gather", "forward", 1, float(rows * m.vocab * tr.param_bytes)),
                    ("all_reduce", "backward", 1, act)]
    return out


def _tp_items(cfg: Config, rp, act: int, span: GroupSpan, links: MeasuredLinks | None) -> list[CommItem]:
    par, tr = cfg.parallel, cfg.training
    m, layers = par.microbatches, rp.layers
    again = {"full": " + recomputed forward", "selective-op": " + the per-op policy's recomputed ops"}.get(
        tr.recompute, "")
    items = []
    for coll, phase, per_block in tp_block_collectives(cfg):
        calls = per_block * layers * m
        one = collective_seconds(cfg, coll, act, span, links)
        label = "TP+SP " + coll.replace("_", "-") if par.sequence_parallel else "TP " + coll.replace("_", "-")
        # async TP micro-pipelines them with the matmuls (engine.time.step exposes only what those cannot hide)
        items.append(CommItem("tp", f"{label} per block ({phase}{again if phase == 'backward' else ''}; "
                                    f"{per_block} per block{'; async TP' if par.async_tp else ''})", coll, calls,
                              act, par.tp, span.link, calls * one, bool(par.async_tp), phase))
    if tr.recompute == "selective-layer":  # the checkpointed blocks repeat their forward's in the backward
        per_stage = tp_recomputed_blocks(cfg)
        redo = sum(per_stage[st.stage] for st in rp.stages)
        for coll, per_block in tp_recomputed_collectives(cfg) if redo else ():
            calls = per_block * redo * m
            one = collective_seconds(cfg, coll, act, span, links)
            label = "TP+SP " + coll.replace("_", "-") if par.sequence_parallel else "TP " + coll.replace("_", "-")
            items.append(CommItem("tp", f"{label} of the recomputed forward (backward; {per_block} per checkpointed "
                                        f"block, {redo} block(s){'; async TP' if par.async_tp else ''})", coll,
                                  calls, act, par.tp, span.link, calls * one, bool(par.async_tp), "backward"))
    stages = rp.stage_indices
    n_stages = par.num_stages
    for coll, phase, calls, size in tp_edge_collectives(cfg, 0 in stages, n_stages - 1 in stages):
        one = collective_seconds(cfg, coll, size, span, links)
        items.append(CommItem("tp", f"TP {coll.replace('_', '-')} of the embedding / head / loss ({phase})", coll,
                              calls * m, size, par.tp, span.link, calls * m * one, False, phase))
    tensors, size = sp_partial_gradients(cfg, layers, n_stages - 1 in stages)
    calls = tensors * PARTIAL_GRADIENT_REDUCES[tr.optimizer]
    if calls:
        one = collective_seconds(cfg, "all_reduce", size, span, links)
        items.append(CommItem("tp", f"TP all-reduce of the sequence-parallel norms' partial gradients in the optimizer "
                                    f"step ({tensors} tensor(s))", "all_reduce", calls, size, par.tp, span.link,
                              calls * one, False, "step"))
    return items


#: all-reduces the one-tensor optimizer step runs on a parameter whose gradient is a Partial DTensor: each op that
#: reads the gradient redistributes it to Replicate on its own (torch/optim/adam.py ``_single_tensor_adam``:
#: ``exp_avg.lerp_(grad)``, ``exp_avg_sq.addcmul_(grad, grad)`` — one, then two; torch/optim/sgd.py: the parameter's
#: ``add_`` of the gradient or of the momentum buffer, which stays Partial; traced: 51 all-reduces for 17 norms)
PARTIAL_GRADIENT_REDUCES = {"adamw": 3, "sgd-momentum": 1, "sgd": 1}


def sp_partial_gradients(cfg: Config, blocks: int, last_stage: bool) -> tuple[int, float]:
    """(tensors, bytes of one) of a rank's parameters whose gradients stay Partial DTensors into the optimizer
    step: under sequence parallelism the norms run SequenceParallel on sequence shards (backend.parallel.
    tensor_parallel), so each rank's weight gradient is its shard's partial sum; without an FSDP2 wrapper (dp·cp = 1
    and ZeRO below 2: engine.wrapping) nothing reduces it before the step (FSDP2's post-backward redistributes it,
    once, traced). Two norms a block and the final one on the last stage; a LayerNorm's bias too."""
    par = cfg.parallel
    if par.tp == 1 or not par.sequence_parallel or wrapping_plan(cfg).fsdp2 or cfg.training.finetune == "lora":
        return 0, 0.0  # LoRA: the norms are frozen
    return norm_tensors(cfg, blocks, last_stage), float(cfg.model.hidden * 4)  # fp32: no FSDP2 policy casts them


def norm_tensors(cfg: Config, blocks: int, last_stage: bool) -> int:
    """The norms' parameter tensors of ``blocks`` blocks (two norms each) and, on the last stage, the final norm; a
    LayerNorm has a bias beside its weight (the parameters stay fp32 without FSDP2's policy)."""
    return (2 if cfg.model.norm == "layernorm" else 1) * (2 * blocks + (1 if last_stage else 0))
