"""How a mixture of experts routes its tokens: the measured per-expert load
(``conventions.moe_expert_load``) in its fullest form, each EP rank's share of it, the routed copies an EP
rank computes over the balanced mean (``routed_factor``) and the tokens entering one MoE block. Pure rules,
read by the memory model, the durations, the communication model and the planner alike."""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.config import Config


def expert_load_table(cfg: Config) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """``conventions.moe_expert_load`` in its fullest form: per microbatch, per MoE block (in block
    order), each expert's fraction — a single list repeated over blocks and microbatches, a per-block
    one over microbatches; () without a measured load."""
    load = cfg.conventions.moe_expert_load
    if not load:
        return ()
    if not isinstance(load[0], tuple):
        blocks = (load,) * (cfg.model.layers - cfg.model.dense_layers)
        return (blocks,) * cfg.parallel.microbatches
    if not isinstance(load[0][0], tuple):
        return (load,) * cfg.parallel.microbatches
    return load


def varying_expert_load(cfg: Config) -> bool:
    """Whether ``conventions.moe_expert_load`` differs by block or microbatch (given nested)."""
    load = cfg.conventions.moe_expert_load
    return bool(load) and isinstance(load[0], tuple)


def mean_expert_load(cfg: Config) -> tuple[float, ...]:
    """Each expert's fraction averaged over the MoE blocks and microbatches (the load itself when
    given as one list); () without a measured load."""
    load = cfg.conventions.moe_expert_load
    if not load or not isinstance(load[0], tuple):
        return load
    lists = [b for mb in expert_load_table(cfg) for b in mb]
    return tuple(math.fsum(x[e] for x in lists) / len(lists) for e in range(len(lists[0])))


def ep_rank_loads(cfg: Config) -> tuple[float, ...]:
    """Under ``conventions.moe_expert_load``: each EP rank's share of the routed copies, the sum of
    its experts' fractions (rank r owns experts r·E/ep … (r+1)·E/ep − 1, as the backend and
    torchtitan lay them out), of the load averaged over blocks and microbatches where it is given
    per block or microbatch; () without a measured load."""
    return load_shares(mean_expert_load(cfg), cfg.parallel.ep)


def load_shares(load: Sequence[float], ep: int) -> tuple[float, ...]:
    """Each of ``ep`` ranks' share of a per-expert load (contiguous experts per rank); () for no load."""
    if not load:
        return ()
    local = len(load) // ep
    return tuple(math.fsum(load[r * local:(r + 1) * local]) for r in range(ep))


def routed_factor(cfg: Config, ep_rank: int | None = None) -> float:
    """Routed token copies on an EP rank over the balanced mean n·k: the capacity factor when set
    (its buffers hold that many, dropping the rest); under a measured per-expert load, ep × the
    load of ``ep_rank``'s experts (None: the busiest rank's, which the all-to-all and the grouped
    GEMMs wait for); else the assumed imbalance under expert parallelism (1: balanced), else 1
    (every expert is local: n·k in all)."""
    conv, par = cfg.conventions, cfg.parallel
    if conv.moe_capacity_factor > 0:
        return conv.moe_capacity_factor
    if par.ep == 1:
        return 1.0
    loads = ep_rank_loads(cfg)
    if loads:
        return par.ep * (max(loads) if ep_rank is None else loads[ep_rank])
    return conv.moe_imbalance


def routed_factor_of(cfg: Config, ep_rank: int, microbatch: int, block: int) -> float:
    """As :func:`routed_factor` under a measured load, for one microbatch and MoE block (its index
    among the MoE blocks): ep × the fractions of ``ep_rank``'s experts there."""
    lst = expert_load_table(cfg)[microbatch][block]
    return cfg.parallel.ep * load_shares(lst, cfg.parallel.ep)[ep_rank] if cfg.parallel.ep > 1 else 1.0


def moe_tokens(cfg: Config, ep_rank: int | None = None, phi: float | None = None) -> tuple[int, int]:
    """(tokens entering one MoE block on this rank per microbatch, routed copies it computes).

    With expert parallelism and TP, each TP rank dispatches its 1/t slice of the sequence
    (torchtitan); otherwise the block sees the s·b tokens (s·b/t of the router input under SP).
    The routed copies are n·k times ``phi`` (default ``routed_factor``, of ``ep_rank`` under a
    measured load)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    n = m.seq_len * tr.micro_batch_size
    if par.ep > 1:
        n //= par.tp
    phi = routed_factor(cfg, ep_rank) if phi is None else phi
    return n, int(-(-n * m.experts_per_token * phi // 1))
