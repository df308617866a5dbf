"""Pipeline parallelism with torch.distributed.pipelining.

Stages are cut from the full model by engine.pipeline.layout (loop or V placement, the layer split ``parallel.pipeline_split``),
so the backend runs exactly the stages the engine predicts. ``ActionTimer`` wraps each stage's
forward_one_chunk / backward_one_chunk / backward_weight_one_chunk, which every schedule calls,
to time each F / B / I / W action.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from backend.model import Transformer, cut_stage, moe_modules
from engine.config import ParallelSpec
from engine.pipeline.layout import placement_style, stages_of_pp_rank

if TYPE_CHECKING:  # imported where a schedule is built: torch's pipelining pulls in dynamo (≈ 0.6 s)
    from torch.distributed.pipelining import PipelineStage


def stage_ids_of(par: ParallelSpec, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds (engine.pipeline.layout's placement)."""
    return stages_of_pp_rank(par.num_stages, par.pp, placement_style(par.schedule))[pp_rank]


def apply_pp(model: Transformer, par: ParallelSpec, pp_rank: int) -> list[tuple[int, Transformer]]:
    """(stage index, stage module) for every stage this pipeline rank holds."""
    ids = stage_ids_of(par, pp_rank)
    out = []
    for i, s in enumerate(ids):
        part = model if i == len(ids) - 1 else copy.deepcopy(model)
        out.append((s, cut_stage(part, s, par.num_stages, par.pipeline_split)))
    return out


class ActionTimer:
    """Records (kind, stage, microbatch, start_ns, end_ns) of every compute action while on."""

    def __init__(self) -> None:
        self.on = False
        self.actions: list[tuple[str, int, int, int, int]] = []

    def wrap(self, stage: PipelineStage) -> None:
        timer, s = self, stage.stage_index
        fwd, bwd, bw = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            t0 = time.perf_counter_ns()
            out = fwd(fwd_chunk_id, *args, **kwargs)
            timer._add("F", s, fwd_chunk_id, t0)
            return out

        def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            t0 = time.perf_counter_ns()
            out = bwd(bwd_chunk_id, *args, **kwargs)
            timer._add("B" if full else "I", s, bwd_chunk_id, t0)
            return out

        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
            t0 = time.perf_counter_ns()
            out = bw(bwd_chunk_id, *args, **kwargs)
            timer._add("W", s, bwd_chunk_id, t0)
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _add(self, kind: str, stage: int, mb: int, t0: int) -> None:
        if self.on:
            self.actions.append((kind, stage, int(mb), t0, time.perf_counter_ns()))


def count_tokens_in_microbatches(stage: PipelineStage) -> None:
    """MoE blocks of ``stage`` count routed tokens only inside its microbatch forwards, not in the
    forward the stage runs once on placeholder inputs to infer its output shapes."""
    moes = moe_modules(stage.submod)
    if not moes:
        return
    fwd = stage.forward_one_chunk

    def forward_one_chunk(*args, **kwargs):
        for moe in moes:
            moe.count_tokens = True
        try:
            return fwd(*args, **kwargs)
        finally:
            for moe in moes:
                moe.count_tokens = False

    for moe in moes:
        moe.count_tokens = False
    stage.forward_one_chunk = forward_one_chunk


def infer_shapes_without_ddp_sync(stage: PipelineStage) -> None:
    """Run a DDP-wrapped stage's shape-inference forward under ``no_sync()``, as its microbatch forwards run.

    Before its first step the stage runs one forward with grad enabled to infer its shapes
    (``_prepare_forward_infra``), on ``self.submod`` directly; outside ``no_sync`` DDP's forward arms the
    reducer (``_post_forward`` → ``prepare_for_backward``). The first backward then reduces the
    gradients although it runs under ``no_sync`` and records every parameter for the bucket rebuild,
    and the last backward (armed again by the stage) records them a second time: where the stage runs
    two backwards with no forward between them (GPipe, 1F1B with microbatches = pp), the next forward
    fails torch's assertion "rebuilt parameter indices size is not same as original model parameters
    size". Under ``no_sync`` the inference forward leaves the reducer to the last backward, as the
    stage intends (``backward_maybe_with_nosync``).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(stage.submod, DistributedDataParallel):
        return
    infer, ddp = stage._prepare_forward_infra, stage.submod

    def _prepare_forward_infra(*args, **kwargs):
        with ddp.no_sync():
            return infer(*args, **kwargs)

    stage._prepare_forward_infra = _prepare_forward_infra


def build_schedule(stage_modules: list[tuple[int, nn.Module]], par: ParallelSpec, pp_group,
                   device: torch.device, loss_fn: Callable, timer: ActionTimer):
    """PipelineStage per held stage and the schedule named by ``par.schedule``."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    stages = []
    for s, mod in stage_modules:
        stage = PipelineStage(mod, s, par.num_stages, device, group=pp_group)
        timer.wrap(stage)
        count_tokens_in_microbatches(stage)
        infer_shapes_without_ddp_sync(stage)
        stages.append(stage)
    cls = get_schedule_class(par.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        assert len(stages) == 1
        return cls(stages[0], n_microbatches=par.microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=par.microbatches, loss_fn=loss_fn, scale_grads=True)
