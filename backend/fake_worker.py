"""One simulated rank: ``python -m backend.fake_worker --run-dir D --rank R``. Imports torch.

Runs the real backend code path for one rank of the configured job in this single process:
a fake process group (``FakeStore``, backend "fake": every collective is a no-op that
hallucinates its result) and ``FakeTensorMode`` (tensors carry shapes, dtypes and storage
sizes, never data), under the PyTorch MemTracker / FSDPMemTracker that the real runs use.

Order (what works with torch 2.13's fake tensors): the model is built on the meta device and TP /
recompute / ``fully_shard`` are applied outside the fake mode, exactly as backend.train
composes them; ``to_empty`` then materialises it inside ``FakeTensorMode(allow_non_fake_inputs=
True)``. DDP and ZeRO-1 wrap the materialised (fake) module, since they copy parameters into
flat buckets at construction. Then optimizer state is created (one step on zero gradients, as a
real run's training steps leave it) and one step runs under the tracker: backend.train.Trainer's own
``forward_backward`` / ``measure_memory``.

Pipeline parallelism: the stage modules this rank holds are cut by backend.parallel.apply_pp and
run the schedule's real compute order for this pp rank (``engine.pipeline.schedules``' action list, the
order torch executes): each F, B, I and W in turn, as torch's PipelineStage runs them —
``forward_one_chunk`` keeps (outputs, inputs) until the microbatch's backward, the last stage
keeps no output beyond its microbatch's backward (``conventions.pipeline_outputs = "released"``: the
trainer's ``step(return_outputs=False)``, as torchtitan ≥ 0.2.1) or, "kept", every microbatch's output to
the step's end, concatenated there (step()'s ``_merge_outputs``), B is ``stage_backward``, I ``stage_backward_input`` (its state kept until
W), W ``stage_backward_weight``; FSDP / DDP are driven as ``backward_maybe_with_nosync`` and
``perform_reduce_grad`` drive them. No send or receive runs (a fake process group cannot carry
the schedule's shape exchange): a received activation or gradient is the stage's receive buffer of that
microbatch, made before the measured step as torch's first step makes them (``make_recv_buffers``).
See ``NOT_COVERED_PP``.

Every allocation and free the tracker sees during the measured step (and the storages alive when
it starts) is replayed through ``engine.memory.allocator.CachingAllocator`` with the bytes a CUDA
tensor of that storage takes, giving the rank's modelled ``max_memory_reserved`` (record field
``allocator``). FSDP2's all-gather buffers and reduce-scatter inputs are allocated on their own
streams (the tracker tags them), everything else on the default stream.

Writes ``ranks/rank{R}.measurement.json`` in the run directory in the same shape as a real
rank (backend.train), plus ``simulated``, ``cross_check`` and ``not_covered``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NOT_COVERED_PP = [
    "pipeline: no send or receive runs; a received activation or gradient is the stage's receive buffer of that "
    "microbatch (one per microbatch and direction, made before the measured step, as torch's first step makes "
    "them), its contents never written",
]
NOT_COVERED = [
    "runtime context and collective-library buffers (no device, no NCCL)",
    "allocator: reserved bytes are the modelled caching allocator's replay of this one measured step from an "
    "empty cache (the storages alive at its start allocated first, in the tracker's order); a real run's "
    "earlier steps leave the cache warm",
    "kernels' workspaces (AdamW steps with torch's GPU default, foreach, on the fake tensors)",
]
NOT_COVERED_CPU_KERNELS = [
    "CPU kernels stand in for GPU ones where torch has no fake equivalent: autocast's CPU cast lists "
    "(mixed precision without an FSDP2 wrapper), CPU flash attention (saves what CUDA flash saves: Q, K, V, output, "
    "log-sum-exp; not CUDA's RNG state)",
]

NOT_COVERED_MOE = (
    "mixture of experts: routing cannot depend on data that fake tensors do not carry — every rank routes each "
    "microbatch's n·k token copies by a fixed load (conventions.moe_expert_load, its mean over blocks and "
    "microbatches where given per block or microbatch; else balanced), the same on every rank of the "
    "expert-parallel group; the router still runs (its tensors are real-sized), its choices are not used")

#: relative disagreement beyond which a tracker category is reported as wrong
TOLERANCE = 0.01


def fake_refusal(cfg) -> str | None:
    """What this simulation cannot run with fake tensors, in words (None: it can)."""
    if cfg.training.float8_all_gather:
        return ("training.float8_all_gather: torchao's float8-gathered weight (WeightWithDynamicFloat8CastTensor) "
                "computes its scale from the weight's values when FSDP2 flattens it for the all-gather, which "
                "fake tensors cannot (DataDependentOutputException: aten._local_scalar_dense); simulate with "
                "float8_all_gather = false, or run it for real")
    return None


def _stage_actions(cfg, pp_rank: int) -> tuple:
    """This pp rank's compute actions (kind, stage, microbatch) in the order torch executes them."""
    from engine.pipeline.schedules import pipeline_actions

    par = cfg.parallel
    return pipeline_actions(par.schedule, par.pp, par.microbatches, par.virtual_stages).per_rank[pp_rank]


def schedule_in_flight(actions, stages: list[int]) -> list[int]:
    """Per local stage, the most microbatches alive at once in ``actions``: from F until its B, or
    until its W where the backward is split (the autograd graph is kept from I until W)."""
    alive = dict.fromkeys(stages, 0)
    most = dict.fromkeys(stages, 0)
    split = {(a[1], a[2]) for a in actions if a[0] == "I"}
    for kind, s, mb in actions:
        if kind == "F":
            alive[s] += 1
            most[s] = max(most[s], alive[s])
        elif kind == "W" or (kind == "B" and (s, mb) not in split):
            alive[s] -= 1
    return [most[s] for s in stages]


def _build(cfg, rank: int, fake_tensors: bool = True):
    """A backend.train.Trainer for ``rank`` on the fake process group, with fake tensors
    (or, for checking them, real ones: the same path with ``FakeTensorMode`` left out)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from backend.train import Trainer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg.parallel.world_size)
    return type("FakeTrainer", (_FakeTrainer, Trainer), {})(cfg, fake_tensors)


class _FakeTrainer:
    """backend.train.Trainer's state, composed as Trainer.__init__ composes it, on meta then fake tensors;
    mixed in before Trainer by ``_build`` (this module imports no torch until a rank is built)."""

    counts_compiled_saved = False  # inductor compiles nothing for fake tensors here

    def __init__(self, cfg, fake_tensors: bool):  # noqa: D401 - deliberately not Trainer.__init__ (no real group)
        import torch
        import torch.distributed as dist
        from torch._subclasses.fake_tensor import FakeTensorMode

        from backend.model import Transformer
        from backend.parallel import ParallelDims, apply_pp
        from backend.train import SEED, check_supported
        from engine.wrapping import wrapping_plan

        par = cfg.parallel
        self.cfg, self.out = cfg, None
        self.device = torch.device("cpu")
        self.rank = dist.get_rank()
        self.dims = ParallelDims(par, self.device.type, cfg.cluster.gpus_per_node)
        self.dims.build_mesh()
        self.coords = self.dims.coords
        check_supported(cfg)
        self.cp = self.dims.context_parallel(cfg.model, self.device)
        why = fake_refusal(cfg) if fake_tensors else None
        if why:
            raise NotImplementedError(why)
        self.plan = wrapping_plan(cfg)
        self.pipelined = self.plan.pipelined
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        if cfg.cluster.gpu.name != "cpu":
            use_fused_rms_norm(model)  # the kernel the GPU kind runs, not CPU's composite
        parts = apply_pp(model, par, self.coords.pp) if self.pipelined else [(0, model)]
        self.output_chunks: list = []  # the last stage's outputs under pipeline_outputs = "kept", to the next step
        #: (direction, stage, microbatch) -> the pipeline's receive buffer, made before the measured step
        self.recv_buffers: dict = {}
        self.fake_mode = (FakeTensorMode(allow_non_fake_inputs=True) if fake_tensors
                          else contextlib.nullcontext())
        self._parallelize(parts)
        self._schedule_state()

    @contextlib.contextmanager
    def _materialize(self, m):
        """The meta module's tensors allocated (fake ones: storage sizes, no data); the wrappers that copy
        parameters at construction are built in the same mode."""
        with self.fake_mode, _ddp_without_init_checks(), _device_mesh_outside_fake_mode():
            m.to_empty(device=self.device)
            _retie_head(m, self.cfg.model)
            yield

    def _parallelize(self, parts) -> None:
        """Each stage module wrapped as backend.train wraps it, then the optimizer (as the GPU would step)."""
        from torch.nn.parallel import DistributedDataParallel

        from backend import measure
        from backend.model import moe_modules
        from backend.parallel import build_optimizer, parallelize
        from backend.parallel.expert_parallel import plan_dispatch
        from backend.parallel.parallelize import expert_grad_sync
        from backend.train import _optimizer_cls_and_kwargs
        from engine.memory.states import optimizer_foreach

        cfg, par = self.cfg, self.cfg.parallel
        self.modules = []
        before = 0  # the rank's earlier blocks: per-layer recompute counts on through its stages
        for s, m in parts:
            n = len(m.layers)
            m = parallelize(m, cfg, self.plan, self.dims, self.device, materialize=self._materialize,
                            blocks_before=before)
            before += n
            if isinstance(m, DistributedDataParallel):
                with self.fake_mode:
                    m.register_comm_hook(None, _bucket_as_reduced)
                    m.reducer = _NoRebuildReducer(m.reducer)
            self.modules.append((s, m))
        self.stages = [s for s, _ in self.modules]
        self.params = measure.unique_params(m for _, m in self.modules)
        self.moes = [moe for _, m in self.modules for moe in moe_modules(m)]
        if self.moes:  # fake tensors cannot be counted: route by a load given up front
            group = self.dims.expert_mesh("ep").get_group() if par.ep > 1 else None
            for _, m in self.modules:
                self.moe_load = plan_dispatch(m, cfg, group)
        self.sync_experts = expert_grad_sync([m for _, m in self.modules], cfg, self.plan, self.dims)
        cls, kw = _optimizer_cls_and_kwargs(cfg.training.optimizer, optimizer_foreach(cfg))
        with self.fake_mode:
            self.optimizer = build_optimizer(self.params, self.plan, self.dims, cls, **kw)

    def _schedule_state(self) -> None:
        """The step's data, timer and (pipelined) this pp rank's actions in the schedule's order."""
        from backend.parallel.pipeline import ActionTimer

        cfg, par = self.cfg, self.cfg.parallel
        self.timer = ActionTimer()
        self.schedule = None
        self.has_first = 0 in self.stages
        self.has_last = par.num_stages - 1 in self.stages
        self.data = _ZeroData(cfg.model.seq_len)
        self.local_batch = par.microbatches * cfg.training.micro_batch_size
        self.actions = _stage_actions(cfg, self.coords.pp) if self.pipelined else ()
        self.in_flight = schedule_in_flight(self.actions, self.stages) if self.pipelined else []

    def expert_tokens(self, k: int) -> dict:
        """The planned routing (Trainer.expert_tokens' shape): every rank of a stage routes each
        microbatch's n·k copies by the planned load (``backend.parallel.expert_parallel.planned_load``)."""
        cfg, par = self.cfg, self.cfg.parallel
        mbs, ep = par.microbatches, par.ep
        blocks = {}
        send = self.moes[0].dispatch.send if self.moes else []
        local = len(send) // ep if send else 0
        ep_rank = self.dims.expert_mesh("ep").get_local_rank() if ep > 1 else 0
        got = [ep * c for c in send[ep_rank * local:(ep_rank + 1) * local]] if ep > 1 else list(send)
        for moe in self.moes:
            blocks[str(moe.index)] = {"routed": [c * mbs for c in send], "received": [c * mbs for c in got],
                                      "first_expert": ep_rank * local if ep > 1 else 0,
                                      "routed_microbatches": [list(send)] * mbs,
                                      "received_microbatches": [list(got)] * mbs}
        routers = par.world_size // par.pp  # the ranks routing each block's tokens
        total = {str(b): [c * mbs * routers for c in send]
                 for b in range(cfg.model.dense_layers, cfg.model.layers)}
        return {"k": k, "planned_load": list(self.moe_load), "blocks": blocks, "total": total}

    def step_input(self, step: int):
        """What Trainer.forward_backward takes (the batch, or the step in older versions)."""
        return self.batch(step) if hasattr(self, "batch") else step

    def forward_backward(self, arg) -> tuple[float, int]:
        if not self.pipelined:
            return super().forward_backward(arg)
        return self._stage_forward_backward()

    def p2p_buffer_bytes(self) -> int:
        """The receive buffers ``make_recv_buffers`` made (Trainer.p2p_buffer_bytes reads torch's)."""
        return sum(nbytes for _, _, nbytes, _ in _recv_buffer_events(self))

    def make_recv_buffers(self) -> None:
        """What torch's PipelineStage allocates in its first step (``_prepare_forward_infra`` /
        ``_prepare_backward_infra``) and reuses: one activation receive buffer per microbatch for a stage
        that is not the first (``args_recv_info``, requires_grad: it is the stage's input) and one gradient
        receive buffer per microbatch for a stage that is not the last (``grad_recv_info``). Made before the
        measured step, as a real run's earlier steps leave them."""
        import torch

        st = self._step_shapes()
        shape = (st.mbs, st.sp_seq, st.hidden)
        for s in self.stages:
            for mb in range(self.cfg.parallel.microbatches):
                if s != st.first:
                    self.recv_buffers[("act", s, mb)] = torch.zeros(shape, dtype=st.act_dtype, requires_grad=True)
                if s != st.last:
                    self.recv_buffers[("grad", s, mb)] = torch.zeros(shape, dtype=st.act_dtype)

    def _step_shapes(self) -> _PipelineStep:
        import torch

        from backend.parallel.precision import compute_dtype
        from engine.memory.activations import frozen_16bit_stream

        cfg, par, tr = self.cfg, self.cfg.parallel, self.cfg.training
        seq = cfg.local_seq_len  # the rank's tokens (cp)
        return _PipelineStep(
            mbs=tr.micro_batch_size, seq=seq, hidden=cfg.model.hidden,
            sp_seq=seq // par.tp if par.sequence_parallel else seq,
            # an FSDP2 policy casts the parameters, so the residual stream is in the compute dtype; autocast
            # (and fp32) leave it in fp32, but for LoRA's base frozen in bf16 (its embedding's output is bf16:
            # engine.memory.activations.frozen_16bit_stream), as torch's shape inference finds it
            act_dtype=(compute_dtype(self.plan) if self.plan.mixed_precision == "fsdp2-policy"
                       else torch.bfloat16 if frozen_16bit_stream(cfg) else torch.float32),
            first=0, last=par.num_stages - 1)

    def _stage_forward_backward(self) -> tuple[float, int]:
        """This pp rank's actions in the schedule's order, as torch's PipelineStage runs them."""
        import torch

        st = self._step_shapes()
        # the backward that completes each stage-microbatch: its W where split, else its B
        split = {(a[1], a[2]) for a in self.actions if a[0] == "I"}
        st.finishing = {s: sum(1 for k, stage, mb in self.actions if stage == s
                               and (k == "W" or (k == "B" and (stage, mb) not in split))) for s in self.stages}
        self.output_chunks = []  # torch clears the last step's outputs when a step starts
        from engine.pipeline.schedules import sends_held

        st.sends_held = sends_held(self.cfg.parallel.schedule)  # what the schedule's Works keep of its sends
        mods = dict(self.modules)
        with self._loss_ctx():
            for kind, s, mb in self.actions:
                mod = mods[s]
                if kind == "F":  # forward_one_chunk
                    self._forward_chunk(st, mod, s, mb)
                    continue
                if kind in ("B", "I"):  # backward_one_chunk (full_backward = kind == "B")
                    self._backward_chunk(st, mod, kind, s, mb)
                else:  # "W": backward_weight_one_chunk
                    self._weight_chunk(st, mod, s, mb)
                if st.finishing[s] == 0:
                    _perform_reduce_grad(mod)
            st.sent.clear()  # the schedule waits its sends at the end of its actions and drops them
            if self.has_last and self.output_chunks:  # step()'s return value: the last stage's outputs merged
                merged = torch.cat(self.output_chunks)
                del merged
        return 0.0, 1

    def _sent(self, st: _PipelineStep, s: int, tensors, forward: bool) -> None:
        """What torch's schedule keeps of a send: a send to another rank (not the V-schedules' hand-over to the
        rank's own next or previous stage) is a ``dist.isend`` whose Work holds its tensor (gloo's SendWork
        ``tensor_``, NCCL's ``outputs_``) until the schedule drops the Work. The multi-stage runtime and GPipe
        keep every send's Work to the end of their actions (``send_ops`` / ``fwd_sends_to_wait``,
        ``bwd_sends_to_wait``); 1F1B keeps the last backward's input gradients (``bwd_sends`` / ``send_work``)
        until the next backward's send replaces them, and each forward's output only while its
        ``fwd_cache`` keeps it anyway (torch/distributed/pipelining/schedules.py)."""
        to = s + 1 if forward else s - 1
        if to < st.first or to > st.last or to in self.stages:
            return
        if st.sends_held == "all":
            st.sent.extend(t for t in tensors if t is not None)
        elif st.sends_held == "last_backward" and not forward:
            st.sent[:] = [t for t in tensors if t is not None]

    def _forward_chunk(self, st: _PipelineStep, mod, s: int, mb: int) -> None:
        """forward_one_chunk: the stage's input (token ids, or the received activation), kept with the
        output until the microbatch's backward, the last stage's output also in ``output_chunks`` to the step's
        end when the convention keeps them (``return_outputs``), and the last stage's loss."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from backend.train import loss_fn

        if s == st.first:
            x = torch.zeros(st.mbs, st.seq, dtype=torch.long)
        else:  # the received activation: the stage's receive buffer of this microbatch
            x = self.recv_buffers[("act", s, mb)]
        if isinstance(mod, DistributedDataParallel):
            with mod.no_sync():
                out = mod(x)
        else:
            out = mod(x)
        if s == st.last:
            if self.cfg.conventions.pipeline_outputs == "kept":
                self.output_chunks.append(out)
            st.losses[mb] = loss_fn(out, torch.zeros(st.mbs, st.seq, dtype=torch.long))
        st.fwd_cache[(s, mb)] = (out if isinstance(out, tuple) else (out,), [x])
        self._sent(st, s, st.fwd_cache[(s, mb)][0], forward=True)

    def _backward_chunk(self, st: _PipelineStep, mod, kind: str, s: int, mb: int) -> None:
        """backward_one_chunk: B (the whole backward) or I (the input's gradient, its state kept for W)."""
        import torch

        outputs, inputs = st.fwd_cache.pop((s, mb))
        if s == st.last:
            stage_output, output_grads = st.losses.pop(mb), None
        else:  # the received gradient: the stage's receive buffer of this microbatch
            received = self.recv_buffers[("grad", s, mb)]
            stage_output = outputs
            output_grads = (received,) + tuple(torch.ones_like(o) for o in outputs[1:])
        grads_input = ()
        if kind == "B":
            st.finishing[s] -= 1
            grads_input, _ = _backward_maybe_with_nosync(mod, "full", st.finishing[s] == 0,
                                                         stage_output=stage_output, output_grads=output_grads,
                                                         input_values=inputs)
        else:
            param_groups = None
            if s != st.first:
                if isinstance(stage_output, torch.Tensor):
                    stage_output = (stage_output,)
                grads_input, param_groups = _backward_maybe_with_nosync(
                    mod, "input", False, stage_output=stage_output, output_grads=output_grads, input_values=inputs)
            st.backward_state[(s, mb)] = (inputs, param_groups, stage_output, output_grads)
        if s != st.first:  # get_bwd_send_ops: the input gradients, sent to the previous stage
            self._sent(st, s, grads_input[:1], forward=False)
        if s == st.last and s != st.first:
            for t in outputs:
                if not t._is_view():
                    t.detach_()

    def _weight_chunk(self, st: _PipelineStep, mod, s: int, mb: int) -> None:
        """backward_weight_one_chunk: W from what the I kept (the first stage, which ran no I: its whole backward)."""
        inputs, param_groups, stage_output, output_grads = st.backward_state.pop((s, mb))
        st.finishing[s] -= 1
        if s != st.first:
            _backward_maybe_with_nosync(mod, "weight", st.finishing[s] == 0, stage_output=stage_output,
                                        param_groups=param_groups)
        else:
            _backward_maybe_with_nosync(mod, "full", st.finishing[s] == 0, stage_output=stage_output,
                                        output_grads=output_grads, input_values=inputs)


@dataclass
class _PipelineStep:
    """One pipelined step's shapes and what its actions leave for later ones (``_FakeTrainer``)."""

    mbs: int  # micro-batch size
    seq: int  # the rank's tokens of a sequence
    hidden: int
    sp_seq: int  # the tokens of a received activation (sequence-parallel shard)
    act_dtype: Any  # the residual stream's dtype
    first: int  # the first and last stage
    last: int
    finishing: dict[int, int] = field(default_factory=dict)  # stage -> backwards left before its REDUCE_GRAD
    fwd_cache: dict = field(default_factory=dict)  # (stage, mb) -> (output tuple, input tensors), F until B / I
    backward_state: dict = field(default_factory=dict)  # (stage, mb) -> what I leaves for W
    losses: dict = field(default_factory=dict)  # mb -> the last stage's loss
    sends_held: str = "none"  # what the schedule keeps of its sends (``sends_held``)
    sent: list = field(default_factory=list)  # the tensors of the sends it keeps by now


def _backward_maybe_with_nosync(mod, kind: str, last_backward: bool, **kw):
    """PipelineStage.backward_maybe_with_nosync: B ("full"), I ("input") or W ("weight") of one stage module,
    DDP's reduction and FSDP2's gradient sync held back but for the stage's last backward (DDP)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
    from torch.nn.parallel import DistributedDataParallel

    def run():
        if kind == "full":
            return stage_backward(kw["stage_output"], kw["output_grads"], kw["input_values"]), None
        if kind == "input":
            return stage_backward_input(kw["stage_output"], kw["output_grads"], kw["input_values"],
                                        mod.parameters())
        return stage_backward_weight(mod.parameters(), kw["param_groups"]), None

    if isinstance(mod, DistributedDataParallel):
        if last_backward:
            mod.reducer.prepare_for_backward(list(torch.nn.parallel.distributed._find_tensors(kw["stage_output"])))
            return run()
        with mod.no_sync():
            return run()
    if isinstance(mod, FSDPModule):
        mod.set_is_last_backward(False)
        mod.set_reshard_after_backward(False)
        mod.set_requires_gradient_sync(False)
    return run()


class _ZeroData:
    """Token ids of the right shape (fake tensors carry no values)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def batch(self, step: int, dp_index: int, batch_size: int):
        import torch

        z = torch.zeros(batch_size, self.seq_len, dtype=torch.long)
        return z, z


def _perform_reduce_grad(mod) -> None:
    """PipelineStage.perform_reduce_grad after a stage's last backward: FSDP's post-backward
    (reduce-scatter) run by hand. (Its grad scaling divides in place: no memory.)"""
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(mod, FSDPModule):
        return
    mod.set_is_last_backward(True)
    mod.set_reshard_after_backward(True)
    mod.set_requires_gradient_sync(True)
    state = replicate.state(mod) if isinstance(mod, ReplicateModule) else fully_shard.state(mod)
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


class _FusedRMSNorm:
    """Holder of the autograd Function (built lazily: this module imports torch only in functions)."""

    fn = None


def _fused_rms_norm_fn():
    """An autograd Function with the memory profile of CUDA's fused RMSNorm (``aten::_fused_rms_norm``).

    On a GPU, ``F.rms_norm`` runs the fused kernel: it returns the output in the input dtype and
    an fp32 ``rstd`` (one per row), and autograd saves the input, the weight and ``rstd``. The CPU
    build has no such kernel, so ``F.rms_norm`` there decomposes into torch's composite (upcast the
    input to fp32, pow, mean, rsqrt, mul, mul by weight, cast back), which saves two fp32 copies of
    the input (x and x·rstd): 4 bytes × 2 per element instead of 2 under bf16 — 96 MiB more per
    norm for Llama-2 7B at s = 4096, 6.1 GiB over its 65 norms. Fake tensors allocate exactly what
    the kernel allocates (outputs; backward: ``aten::_fused_rms_norm_backward``'s meta kernel);
    real tensors (the reference run) compute the same values with the same saved tensors.
    """
    if _FusedRMSNorm.fn is not None:
        return _FusedRMSNorm.fn
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    class FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            d = x.shape[-1]
            if isinstance(x, FakeTensor):
                out = torch.empty_like(x)
                rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
            else:
                xf = x.float()
                rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                out = (xf * rstd).to(x.dtype)
                if weight is not None:
                    out = out * weight
                del xf
            ctx.save_for_backward(x, weight, rstd)
            ctx.d = d
            return out

        @staticmethod
        def backward(ctx, grad):
            x, weight, rstd = ctx.saved_tensors
            if isinstance(x, FakeTensor):
                gx, gw = torch.ops.aten._fused_rms_norm_backward(
                    grad, x, [ctx.d], rstd, weight, [True, weight is not None])
                return gx, gw, None
            xhat = x.float() * rstd
            gy = grad.float() * (weight.float() if weight is not None else 1.0)
            gx = rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
            gw = (grad.float() * xhat).sum(tuple(range(grad.dim() - 1))).to(weight.dtype) if weight is not None else None
            return gx.to(x.dtype), gw, None

    _FusedRMSNorm.fn = FusedRMSNorm
    return FusedRMSNorm


def use_fused_rms_norm(model) -> None:
    """Every ``nn.RMSNorm`` in ``model`` runs :func:`_fused_rms_norm_fn` (DTensors: on local shards)."""
    import torch
    from torch.distributed.tensor import DTensor

    fn = _fused_rms_norm_fn()

    def forward(self, x):
        w = self.weight
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if isinstance(x, DTensor):
            wl = w.to_local() if isinstance(w, DTensor) else w
            out = fn.apply(x.to_local(), wl, eps)
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        if isinstance(w, DTensor):
            w = w.to_local()
        return fn.apply(x, w, eps)

    for mod in model.modules():
        if isinstance(mod, torch.nn.RMSNorm):
            mod.forward = forward.__get__(mod)


def _bucket_as_reduced(state, bucket):
    """DDP comm hook: the bucket as if all-reduced (the fake group's all-reduce future yields None,
    which DDP's reducer rejects). The Reducer's flat buckets are allocated just the same."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _NoRebuildReducer:
    """DDP's Reducer, minus the one-off bucket rebuild after the first step: it broadcasts the
    bucket order by reading tensor data. The buckets keep their construction order (same bytes)."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def _retie_head(module, spec) -> None:
    """A tied head shares the token embedding's weight (``backend.model.Transformer``). ``to_empty`` gives each
    module a new tensor of its own (torch 2.13: a meta model's tied weights come back as two), so a stage that
    holds both, wrapped without FSDP2 (whose ``to_empty`` keeps the one parameter it registered), gets its head
    tied again, as the real build (on real tensors) has it: ``measure --fake`` of GPT-2 under DDP counted a second
    V·h parameter, gradient and AdamW state."""
    if not spec.tied_embeddings:
        return
    from torch import nn
    from torch.distributed.tensor import DTensor

    for mod in module.modules():
        emb, out = getattr(mod, "tok_embeddings", None), getattr(mod, "output", None)
        if isinstance(emb, nn.Embedding) and isinstance(out, nn.Linear) and out.weight is not emb.weight \
                and not isinstance(emb.weight, DTensor) and out.weight.shape == emb.weight.shape:
            out._parameters["weight"] = emb._parameters["weight"]  # the same tensor, as the tie before to_empty


@contextlib.contextmanager
def _ddp_without_init_checks():
    """DDP's constructor compares parameter shapes across ranks by reading tensor data, which
    fake tensors do not have; on a fake process group the comparison is meaningless anyway."""
    import torch.nn.parallel.distributed as ddp_mod

    old = ddp_mod._verify_param_shape_across_processes
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None
    try:
        yield
    finally:
        ddp_mod._verify_param_shape_across_processes = old


def _create_optimizer_state(trainer) -> None:
    """What a real run's earlier steps leave behind: optimizer state exists before the measured
    step, and a pipeline's receive buffers (``make_recv_buffers``). One optimizer step on zero
    gradients creates the state without a forward and backward. Only the
    trainable parameters get one: the step's zero_grad clears the optimizer's parameters only, so a
    frozen base's gradients (LoRA) would otherwise live on through the measured step."""
    import torch

    for p in trainer.params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if trainer.pipelined:
        trainer.make_recv_buffers()
    trainer.optimizer_step()  # zero_grad(set_to_none=True) follows, as after a training step


@contextlib.contextmanager
def _fake_scalars_read_as_zero():
    """``float(fake tensor)`` is 0.0 (Trainer logs each microbatch's loss; fakes hold no value)."""
    from torch._subclasses.fake_tensor import FakeTensor

    had = "__float__" in FakeTensor.__dict__
    old = FakeTensor.__dict__.get("__float__")
    FakeTensor.__float__ = lambda self: 0.0
    try:
        yield
    finally:
        if had:
            FakeTensor.__float__ = old
        else:
            del FakeTensor.__float__


@contextlib.contextmanager
def _float8_inputs_cast_as_on_cuda(cfg):
    """torchao's ``Float8Linear.forward`` casts its input to the autocast dtype only under CUDA's autocast
    (``torch.is_autocast_enabled()`` and ``get_autocast_gpu_dtype()``); the fake steps of a GPU config run CPU autocast
    in its place, where the input would stay fp32 and be saved so for the weight gradient (fp32 norm outputs and
    float8 casts from fp32: 2× the saved Linear inputs of a GPU run). The cast the GPU run makes, made here too; a
    ``gpu = "cpu"`` config keeps the CPU's own behaviour."""
    if cfg.training.float8 == "none" or cfg.cluster.gpu.name == "cpu":
        yield
        return
    import torch
    from torchao.float8.float8_linear import Float8Linear

    forward = Float8Linear.forward

    def cast_first(self, input):
        if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled():
            input = input.to(torch.get_autocast_dtype("cpu"))
        return forward(self, input)

    Float8Linear.forward = cast_first
    try:
        yield
    finally:
        Float8Linear.forward = forward


@contextlib.contextmanager
def _device_mesh_outside_fake_mode():
    """DeviceMesh finds a rank in its mesh tensor with ``(mesh == rank).nonzero()``
    (``_get_mesh_tensor_from_full_mesh``). FSDP2's ``replicate`` (ZeRO-0 with TP) concatenates the dp
    and tp meshes inside the fake mode (``_init_sharding_spec_tp``), so the new mesh's index tensor
    was a fake one, whose ``nonzero`` has no static shape (DynamicOutputShapeException): every ZeRO-0
    dp × tp layout failed to simulate. A mesh is bookkeeping, not memory of the rank: built on real
    tensors, as without fake tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    old = DeviceMesh.__init__

    def init_outside(self, *args, **kwargs):
        with unset_fake_temporarily():
            old(self, *args, **kwargs)

    DeviceMesh.__init__ = init_outside
    try:
        yield
    finally:
        DeviceMesh.__init__ = old


@contextlib.contextmanager
def _dtensor_propagation_in_own_fake_mode():
    """DTensor's sharding propagation computes output metadata by running the op on fake tensors
    in ``detect_fake_mode() or FakeTensorMode()`` (torch.distributed.tensor._sharding_prop). With
    real tensors that is a fresh mode, which the MemTracker ignores (it counts only ops under the
    fake mode it was entered in). Under our FakeTensorMode it is *our* mode, so every propagation
    (a global-shape copy of the op: mm, empty_strided, ... on each cache miss) was counted as
    memory of the rank: transient Temp in backward / Activation in forward that a real run never
    allocates, enough to move the peak (the head and loss rank of the tiny 3-D config: +0.7 MB
    Temp). A fresh mode per propagation, as with real tensors, removes them."""
    import torch.distributed.tensor._sharding_prop as sp

    old = sp.detect_fake_mode
    sp.detect_fake_mode = lambda *a, **k: None
    try:
        yield
    finally:
        sp.detect_fake_mode = old


#: the replay's stream of each FSDP2 stream (``FSDPCommContext``); any other stream, the default one,
#: is 0. ``foreach_all_gather`` makes the all-gather output (its input a view into it) under its copy-in stream,
#: ``foreach_reduce`` the reduce-scatter output under its reduce-scatter stream (its input on the
#: current one) and HSDP's all-reduce under its all-reduce stream; the unsharded parameters are made
#: by the copy-out on the current stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
FSDP_STREAMS = (("all_gather_copy_in_stream", 1), ("all_gather_stream", 1), ("reduce_scatter_stream", 2),
                ("all_reduce_stream", 3))


def fsdp_stream_index(modules) -> Callable[[object], int]:
    """stream -> the replay's stream index, for FSDP2's streams of ``modules`` (read when asked: FSDP2
    makes them lazily, at the first forward)."""
    states = [m._get_fsdp_state() for mod in modules for m in mod.modules() if hasattr(m, "_get_fsdp_state")]

    def index(stream) -> int:
        seen = set()
        for st in states:
            ctx = getattr(st, "_comm_ctx", None)
            if ctx is None or id(ctx) in seen:
                continue
            seen.add(id(ctx))
            for attr, i in FSDP_STREAMS:
                if getattr(ctx, attr, None) is stream:
                    return i
        return 0

    return index


class AllocationRecorder:
    """While active, every storage allocation, resize and free a MemTracker (or FSDPMemTracker)
    records, as ``engine.memory.allocator.replay`` events: ``["alloc", key, nbytes, stream]`` /
    ``["free", key]``. ``nbytes`` is the storage's size in bytes, what a CUDA tensor of that shape
    and dtype asks the caching allocator for (the allocator rounds it). Storages alive when a
    tracker starts are allocations at its start, in the order it registers them. A resize
    (FSDP2 frees and re-allocates unsharded parameters by resizing their storage) is a free and
    an allocation. The stream of an allocation is the stream current when torch makes it, as the
    caching allocator pools it: ``stream_index`` maps ``torch.cpu.current_stream()`` (which FSDP2's
    ``device_handle.stream(...)`` sets on a CPU device) to the replay's stream (``fsdp_stream_index``);
    without one, every allocation is on stream 0."""

    def __init__(self, stream_index: Callable[[object], int] | None = None):
        self.events: list[list] = []
        self._live: dict[int, tuple[int, int]] = {}  # id(winfo) -> (key, index of its alloc event)
        self._next_key = 0
        self._orig = None
        self._stream_index = stream_index

    def __enter__(self) -> AllocationRecorder:
        from torch.distributed._tools.mem_tracker import MemTracker

        self._orig = orig = MemTracker._update_snap
        recorder = self

        def _update_snap(tracker, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            orig(tracker, u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
            recorder._record(u_type.name, winfo, old_mem_consumed)

        MemTracker._update_snap = _update_snap
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        MemTracker._update_snap = self._orig

    def _stream(self) -> int:
        if self._stream_index is None:
            return 0
        import torch

        current = torch.cpu.current_stream()
        return 0 if current is torch.cpu._default_cpu_stream else self._stream_index(current)

    def _alloc(self, winfo) -> None:
        nbytes = int(winfo.size) * int(winfo.element_size)
        if nbytes <= 0:
            return
        key = self._next_key
        self._next_key += 1
        self._live[id(winfo)] = (key, len(self.events))
        self.events.append(["alloc", key, nbytes, self._stream()])

    def _free(self, winfo) -> None:
        entry = self._live.pop(id(winfo), None)
        if entry is not None:
            self.events.append(["free", entry[0]])

    def _record(self, kind: str, winfo, old_mem_consumed) -> None:
        if kind == "ADD":
            self._alloc(winfo)
        elif kind == "DEL":
            self._free(winfo)
        elif kind == "SIZE":
            self._free(winfo)
            self._alloc(winfo)


def _ddp_bucket_events(trainer) -> list[list]:
    """DDP's flat gradient buckets as allocations at the replay's start: the Reducer allocates them at
    construction, before the measured step, and the tracker (which leaves out what predates it) never
    files them, so the recorded events lack them; the rank's comm_buffers count them (``measure``). One
    per bucket, its size from the Reducer itself (``_get_zeros_like_grad_buckets``: a GradBucket like
    each, its flat ``buffer()`` fake here)."""
    from torch.nn.parallel import DistributedDataParallel

    events: list[list] = []
    for _, m in trainer.modules:
        if isinstance(m, DistributedDataParallel):
            with trainer.fake_mode:
                buckets = m.reducer._get_zeros_like_grad_buckets()
            for b in buckets:
                flat = b.buffer()
                events.append(["alloc", ("ddp_bucket", len(events)), flat.numel() * flat.element_size(), 0])
    return events


def _recv_buffer_events(trainer) -> list[list]:
    """The pipeline's receive buffers (``make_recv_buffers``) as allocations at the replay's start: torch's
    first step makes them and every later one reuses them, and the tracker, which leaves out what predates
    it, never files them (the rank's comm_buffers count them, ``p2p_buffer_bytes``)."""
    from backend import measure

    return [["alloc", ("p2p_recv", i), measure._nbytes(t), 0] for i, t in enumerate(trainer.recv_buffers.values())]


def allocator_capacity(cfg) -> int | None:
    """The bytes the caching allocator may reserve: the accelerator's memory (None on a CPU kind)."""
    gpu = cfg.cluster.gpu
    return gpu.memory_bytes if gpu.name != "cpu" and gpu.memory_bytes > 0 else None


def replay_allocations(events, *, expandable_segments: bool = False, capacity: int | None = None) -> dict:
    """The recorded events through the modelled caching allocator: its stats, as the record's
    ``allocator`` field (``oom``: torch's out-of-memory message when a request does not fit in
    ``capacity``). A job that runs out of memory reports what it would need: the stats of the replay
    without a capacity, as the engine reports its reserve where it predicts an out-of-memory
    (``engine.memory.overhead._replayed_reserve``); ``at_oom`` keeps the capped replay's stats at the
    failing request (a torch run stops there, and its ``max_memory_allocated`` says those)."""
    from engine.memory.allocator import AllocatorOutOfMemory, replay

    oom = at_oom = None
    try:
        stats = replay(events, expandable_segments=expandable_segments, capacity=capacity)
    except AllocatorOutOfMemory as exc:
        oom = str(exc)
        at_oom = {"max_allocated": exc.stats.max_allocated, "max_reserved": exc.stats.max_reserved}
        stats = replay(events, expandable_segments=expandable_segments, capacity=None)
    return {"max_allocated": stats.max_allocated, "max_reserved": stats.max_reserved,
            "reserved_end": stats.reserved_end, "segments": stats.segments,
            "expandable_segments": bool(expandable_segments), "capacity": capacity, "oom": oom,
            "at_oom": at_oom, "events": len(events), "streams": sorted({e[3] for e in events if e[0] == "alloc"})}


def simulate_rank(cfg, rank: int, fake_tensors: bool = True, expandable_segments: bool = False) -> dict:
    """Simulate ``rank`` of ``cfg``; the rank record (backend.train's shape plus the fake extras).

    ``expandable_segments``: the caching allocator's convention the replay follows
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``)."""
    import torch.distributed as dist

    from backend import measure

    t0 = time.perf_counter()
    trainer = _build(cfg, rank, fake_tensors)
    t_build = time.perf_counter() - t0
    own = _dtensor_propagation_in_own_fake_mode() if fake_tensors else contextlib.nullcontext()
    with own, trainer.fake_mode, _fake_scalars_read_as_zero(), _float8_inputs_cast_as_on_cuda(cfg):
        _create_optimizer_state(trainer)
        t_warm = time.perf_counter() - t0
        with AllocationRecorder(fsdp_stream_index([m for _, m in trainer.modules])) as recorder:
            memory = trainer.measure_memory(2)
        trainer.output_chunks = []
    events = _ddp_bucket_events(trainer) + _recv_buffer_events(trainer) + recorder.events
    allocator = replay_allocations(events, expandable_segments=expandable_segments,
                                   capacity=allocator_capacity(cfg))
    seconds = time.perf_counter() - t0
    check = cross_check(memory["tracker_peak"], memory["exact"])
    not_covered = list(NOT_COVERED) + NOT_COVERED_CPU_KERNELS
    if trainer.moes:
        not_covered.append(NOT_COVERED_MOE)
    if trainer.pipelined:
        not_covered = NOT_COVERED_PP + not_covered
    coords = trainer.coords
    rec = {
        "rank": rank,
        "coords": {"pp": coords.pp, "dp": coords.dp, "tp": coords.tp, "cp": coords.cp},
        "stages": trainer.stages,
        "memory": memory,
        "step_seconds": [],
        "losses": [],
        "actions": [],
        "peak_rss_bytes": measure.peak_rss_bytes(),
        "simulated": True,
        "fake_tensors": fake_tensors,
        "in_flight": trainer.in_flight,
        "allocator": allocator,
        "cross_check": check,
        "not_covered": not_covered,
        "seconds": {"build": t_build, "optimizer_state": t_warm - t_build, "measured_step": seconds - t_warm,
                    "total": seconds},
    }
    dist.destroy_process_group()
    return rec


def cross_check(tracker_raw: dict[str, int], exact: dict[str, int]) -> dict:
    """The tracker's params / grads / optimizer at its peak beside the exact local bytes.

    Gradients may legitimately be lower at the peak (it can fall before the backward ends);
    more than exact is an over-count. The reported categories use the exact bytes, but the gradients where a
    tracker tags them (what it saw at its peak: backend.measure.categories_from); a
    disagreement means the tracker's peak snapshot is off for that category (seen with TP:
    short-lived optimizer-step buffers counted as state), so the other categories of that
    peak deserve doubt too.
    """
    from backend.measure import TRACKER_TO_CATEGORY

    tracked = dict.fromkeys(("params", "grads", "optimizer"), 0)
    for name, v in tracker_raw.items():
        cat = TRACKER_TO_CATEGORY.get(name)
        if cat in tracked:
            tracked[cat] += int(v)
    out: dict = {"categories": {}, "agree": True, "warnings": []}
    for cat, t in tracked.items():
        e = int(exact[cat])
        rel = abs(t - e) / e if e else (0.0 if t == 0 else float("inf"))
        ok = rel <= TOLERANCE
        if cat == "grads" and t <= e:
            ok = True  # the peak may come before the last gradient exists (e.g. mid-backward)
        out["categories"][cat] = {"tracker": t, "exact": e, "relative_difference": rel, "agree": ok}
        if not ok:
            out["agree"] = False
            out["warnings"].append(
                f"{cat}: the tracker's peak holds {t:,} B but the exact local bytes are {e:,} B "
                f"({rel * 100:.1f} % off); {cat} is reported from the exact bytes")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--real-tensors", action="store_true",
                    help="allocate real tensors (on the fake process group): the reference for the fake ones")
    ap.add_argument("--expandable-segments", action="store_true",
                    help="replay the allocations through the caching allocator with expandable_segments:True")
    args = ap.parse_args(argv)

    from backend.records import RankWriter, RunDir
    from engine.config import Config

    run = RunDir(args.run_dir)
    out = RankWriter(args.run_dir, args.rank)
    out.event("rank_started", pid=os.getpid())
    try:
        cfg = Config.load(run.config)
        rec = simulate_rank(cfg, args.rank, fake_tensors=not args.real_tensors,
                            expandable_segments=args.expandable_segments)
        out.measurement(rec)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the record
        traceback.print_exc()
        sys.stderr.flush()
        out.event("failed", reason=f"{type(exc).__name__}: {exc}"[:2000])
        return 1
    out.event("rank_done", seconds=rec["seconds"]["total"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
