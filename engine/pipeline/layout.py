"""Where things live: rank coordinates, stage placement and the layer split.

Shared by the memory model, the pipeline model and the backend so that they all cut
the model and place the stages the same way.

Rank order (torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp]): TP innermost, then CP
(context parallel), then DP (replicas outermost within it), then PP outermost::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

With cp = 1 this is Megatron's TP-DP-PP order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.names import V_SCHEDULES

if TYPE_CHECKING:
    from engine.config import Config


@dataclass(frozen=True)
class RankCoords:
    rank: int
    pp: int
    dp: int
    tp: int
    node: int
    cp: int = 0


def rank_coords(rank: int, dp: int, tp: int, pp: int, gpus_per_node: int, cp: int = 1) -> RankCoords:
    """Coordinates of a global rank on the (pp, dp, cp, tp) mesh, and the node that hosts it."""
    world = dp * cp * tp * pp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    rest, tp_i = divmod(rank, tp)
    rest, cp_i = divmod(rest, cp)
    pp_i, dp_i = divmod(rest, dp)
    return RankCoords(rank=rank, pp=pp_i, dp=dp_i, tp=tp_i, node=rank // gpus_per_node, cp=cp_i)


def rank_of(pp_index: int, dp_index: int, tp_index: int, dp: int, tp: int, cp_index: int = 0, cp: int = 1) -> int:
    """The global rank at these mesh coordinates (the inverse of ``rank_coords``)."""
    return ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index


def placement_style(schedule: str) -> str:
    """"v" for the V-shaped schedules (ZBVZeroBubble, DualPipeV), else "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


def stage_to_pp_rank(num_stages: int, pp: int, style: str) -> list[int]:
    """Pipeline rank (index in the pp group) of each stage.

    Same rule as ``torch.distributed.pipelining.schedules.generate_stage_to_rank_mapping``:
    "loop" puts stage s on rank s mod pp; "v" walks down then back up, so rank 0 holds the
    first and the last stage.
    """
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    if style == "v":
        if num_stages % pp:
            raise ValueError(f"V placement needs num_stages ({num_stages}) to be a multiple of pp ({pp})")
        out = []
        for s in range(num_stages):
            block, offset = divmod(s, pp)
            out.append(offset if block % 2 == 0 else pp - 1 - offset)
        return out
    raise ValueError(f"unknown placement style {style!r}; allowed: loop | v")


def stages_of_pp_rank(num_stages: int, pp: int, style: str) -> list[list[int]]:
    """The stages each pipeline rank holds, in increasing stage order."""
    owners = stage_to_pp_rank(num_stages, pp, style)
    out: list[list[int]] = [[] for _ in range(pp)]
    for s, r in enumerate(owners):
        out[r].append(s)
    return out


def split_layers(layers: int, num_stages: int, split: str = "even") -> list[range]:
    """Transformer blocks of each stage (``parallel.pipeline_split``, names.PIPELINE_SPLITS).

    "even": as even as possible, the first stages take the remainder; e.g. 10 layers over 4
    stages -> [0,1,2] [3,4,5] [6,7] [8,9]. "torchtitan": its ``generate_llm_fqn_per_model_part``
    with input and output weights 1 — the embedding counts as one block on the first stage and
    norm + head as one on the last, the ``layers + 2`` effective blocks are split evenly (first
    stages take the remainder), so the first and last stages hold one block fewer; e.g. 8 layers
    over 4 stages -> [0,1] [2,3,4] [5,6] [7]. The embedding sits on stage 0 and
    the final norm and head on the last stage, beside these blocks.
    """
    if num_stages < 1 or layers < num_stages:
        raise ValueError(f"cannot split {layers} layers over {num_stages} stages")
    if split == "torchtitan" and num_stages > 1:
        base, extra = divmod(layers + 2, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        sizes[0] -= 1
        sizes[-1] -= 1
        if min(sizes) < 1:
            raise ValueError(f"the torchtitan split of {layers} layers over {num_stages} stages leaves a stage "
                             "without a block")
    elif split in ("even", "torchtitan"):
        base, extra = divmod(layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        raise ValueError(f"unknown pipeline split {split!r}; allowed: even | torchtitan")
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def stage_placement(cfg: Config) -> list[int]:
    """Pipeline rank of each stage for the config's schedule (one stage on rank 0 when pp = 1)."""
    par = cfg.parallel
    if par.pp == 1:
        return [0]
    return stage_to_pp_rank(par.num_stages, par.pp, placement_style(par.schedule))
