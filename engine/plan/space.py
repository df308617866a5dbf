"""The planner's candidate grid, as columns: the types its bounds pass around (one (tp, pp, v, schedule, cp)
structure, its candidate rows, the bytes every pp rank's memory bound reads) and the tie-break between
layouts of equal step time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from engine import names
from engine.config import Config

_SAFETY = 1.0 - 1e-9  # bounds are compared with this margin against float rounding
_RECOMPUTE = names.RECOMPUTE_KINDS
_SCHEDULE_INDEX = {s: i for i, s in enumerate(names.SCHEDULES)}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_COLS = ("tp", "pp", "cp", "v", "sched", "m", "b", "zero", "sp", "rc", "f8", "cmp", "struct")

_FLOAT8 = names.FLOAT8_KINDS


@dataclass
class _Grid:
    """The candidate layouts as columns, with their bounds."""

    cols: dict[str, np.ndarray]
    mem_lb: np.ndarray
    rest_lb: np.ndarray  # max over pp ranks of exposed DP + optimizer (exact), per candidate
    makespan_lb: np.ndarray
    rest_by_rank: list[np.ndarray]  # per candidate group: [candidates, pp] exposed DP + optimizer
    skipped_global_batch: int
    memory_prefiltered: int = 0  # valid layouts left out of the columns: the memory lower bound exceeds capacity


class _Consts(NamedTuple):
    """What the bounds of every (tp, pp, v, schedule, cp) read of the base config (``_Planner.grid``)."""

    fl: Any  # engine.time.durations.flops_per_token
    h: int  # hidden size
    act_b: int  # bytes of an activation element
    w_b: int  # bytes of a parameter, of its gradient, of its optimizer states (+ master copy)
    g_b: int
    o_b: int
    opt_per_param: float  # optimizer seconds per local parameter (ZeRO-0)
    opt_per_tensor: float  # and per parameter tensor it steps (its aten calls where torch steps one at a time)
    ctx: int  # runtime context bytes
    buf: int  # bytes of one communicator's buffers
    peak_rate: float  # achieved FLOP/s of one rank
    over: float  # engine.time.comm.cpu_oversubscription: CPU ranks sharing cores (the whole grid's world)
    fsdp_unit: tuple[float, float, float] = (0.0, 0.0, 0.0)  # an FSDP2 unit's F (gathering, replicate's) and I seconds
    opt_dtensor: float = 0.0  # what the optimizer step costs more per DTensor parameter it steps


@dataclass
class _Struct:
    """One (tp, pp, v, schedule, cp) of the grid: its mesh, the rows it spans and its shape."""

    tp: int
    pp: int
    v: int
    sc: str
    cp: int
    bs: list[int]  # micro-batch sizes with a valid microbatch count
    per_dp: int  # sequences per dp-rank
    zeros: list[int]
    sps: list[bool]
    rep: Config  # a valid config with this mesh (group spans)
    sh: dict[str, Any]  # ``_Planner._shape``
    s_len: int  # the tokens of a sequence one rank holds (seq_len / cp)
    n_stages: int
    dpc: int  # the gradient group and the ZeRO / FSDP shard group: dp · cp
    split: bool  # a split backward (I and W)
    vocab_t: int  # the vocabulary shard of a TP rank


class _Rows(NamedTuple):
    """Candidate rows of one struct: micro-batch size, ZeRO stage, SP, recompute (index), microbatches, the
    micro-batch size as a float, SP's divisor of the hidden state, compile."""

    b: np.ndarray
    zero: np.ndarray
    sp: np.ndarray
    rc: np.ndarray
    m: np.ndarray
    bf: np.ndarray
    rep_div: np.ndarray
    cmp: np.ndarray


class _RowBytes(NamedTuple):
    """Per row, what the memory bound of every pp rank of a struct reads (``_Planner._memory_bound``)."""

    full: np.ndarray  # full recompute
    sl: np.ndarray  # selective-layer recompute
    per_layer1: np.ndarray  # saved bytes of a block per sequence
    sbh1: np.ndarray  # one sequence's hidden state
    stored1: np.ndarray  # what a block keeps per sequence
    overhead: int  # runtime context and communicators
    torch_acc: bool  # the "pytorch" state accounting
    fsdp2_grads: np.ndarray
    gathered_at_b: bool
    fsdp2: dict[str, Any]  # ``_Planner._fsdp2_bytes``
    plain: np.ndarray  # plain gradients from the first backward on
    lora: bool
    k_opt: int  # optimizer-state bytes per element
    keeps_split: bool  # a split backward's I keeps output gradients until its W


def _key(g: _Grid, i: int) -> tuple:
    """Deterministic tie-break between layouts with equal step time."""
    c = g.cols
    return tuple(int(c[k][i]) for k in ("tp", "pp", "v", "sched", "m", "b", "zero", "sp", "rc", "cp", "f8", "cmp"))
