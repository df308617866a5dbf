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

Pipeline parallelism: the stage modules this rank holds are cut by backend.parallel.apply_pp,
but no schedule runs (a fake process group cannot carry the schedule's shape exchange). Each
local stage runs forward on the number of microbatches the engine says it holds at its peak
(``engine.memory``, replaying torch's schedule orders), keeps them alive, then runs their
backwards — FSDP is driven as torch's PipelineStage drives it. See ``NOT_COVERED_PP``.

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

NOT_COVERED_PP = [
    "pipeline: no schedule runs; each local stage holds the engine's in-flight microbatch count "
    "(forwards kept alive, then their backwards) instead of torch's interleaved order",
    "pipeline: p2p send/receive buffers (one per microbatch in torch) are not allocated",
]
NOT_COVERED = [
    "runtime context, allocator caching/fragmentation and collective-library buffers (no device, no NCCL)",
    "kernels' workspaces and the fused/foreach optimizer paths a GPU would take (CPU default: for-loop AdamW)",
]
NOT_COVERED_CPU_KERNELS = [
    "CPU kernels stand in for GPU ones where torch has no fake equivalent: autocast's CPU cast lists "
    "(mixed precision without an FSDP2 wrapper), CPU flash attention (saves what CUDA flash saves: Q, K, V, output, "
    "log-sum-exp; not CUDA's RNG state)",
]

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


def _in_flight_counts(cfg, rank: int, stages: list[int]) -> list[int]:
    """Microbatches each local stage holds at the rank's peak, from the engine's memory model
    (its activation terms carry their stage and microbatches in flight)."""
    from engine.memory import memory_per_rank

    row = memory_per_rank(cfg).per_rank[rank]
    found = {t.stage: t.in_flight for t in row.explain("activations") if t.kind == "layers"}
    return [found.get(s, cfg.parallel.microbatches) for s in stages]


def _build(cfg, rank: int, fake_tensors: bool = True):
    """A backend.train.Trainer for ``rank`` on the fake process group, with fake tensors
    (or, for checking them, real ones: the same path with ``FakeTensorMode`` left out)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from backend import measure
    from backend.model import Transformer
    from backend.parallel import ParallelDims, apply_pp, build_optimizer, parallelize
    from backend.parallel.pipeline import ActionTimer
    from backend.parallel.precision import compute_dtype
    from backend.train import SEED, Trainer, _optimizer_cls_and_kwargs, check_supported
    from engine.wrapping import wrapping_plan

    par, tr = cfg.parallel, cfg.training
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=par.world_size)

    class FakeTrainer(Trainer):
        """Trainer's state, composed as Trainer.__init__ does, on meta then fake tensors."""

        def __init__(self):  # noqa: D401 - deliberately not Trainer.__init__ (no real process group)
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
            self.fake_mode = (FakeTensorMode(allow_non_fake_inputs=True) if fake_tensors
                              else contextlib.nullcontext())

            @contextlib.contextmanager
            def materialize(m):
                """The meta module's tensors allocated (fake ones: storage sizes, no data); the
                wrappers that copy parameters at construction are built in the same mode."""
                with self.fake_mode, _ddp_without_init_checks():
                    m.to_empty(device=self.device)
                    yield

            self.modules = []
            for s, m in parts:
                m = parallelize(m, cfg, self.plan, self.dims, self.device, materialize=materialize)
                if isinstance(m, DistributedDataParallel):
                    with self.fake_mode:
                        m.register_comm_hook(None, _bucket_as_reduced)
                        m.reducer = _NoRebuildReducer(m.reducer)
                self.modules.append((s, m))
            self.stages = [s for s, _ in self.modules]
            self.params = measure.unique_params(m for _, m in self.modules)
            cls, kw = _optimizer_cls_and_kwargs(tr.optimizer)
            with self.fake_mode:
                self.optimizer = build_optimizer(self.params, self.plan, self.dims, cls, **kw)
            self.timer = ActionTimer()
            self.schedule = None
            self.has_first = 0 in self.stages
            self.has_last = par.num_stages - 1 in self.stages
            self.data = _ZeroData(cfg.model.seq_len)
            self.local_batch = par.microbatches * tr.micro_batch_size
            self.in_flight = _in_flight_counts(cfg, self.rank, self.stages) if self.pipelined else []

        def step_input(self, step: int):
            """What Trainer.forward_backward takes (the batch, or the step in older versions)."""
            return self.batch(step) if hasattr(Trainer, "batch") else step

        def forward_backward(self, arg) -> tuple[float, int]:
            if not self.pipelined:
                return super().forward_backward(arg)
            return self._stage_forward_backward()

        def _stage_forward_backward(self) -> tuple[float, int]:
            """Each local stage: ``n`` forwards kept alive, then their backwards (see module doc)."""
            from torch.distributed.fsdp import FSDPModule

            from backend.train import loss_fn

            mbs, seq, hidden = tr.micro_batch_size, cfg.local_seq_len, cfg.model.hidden  # the rank's tokens (cp)
            sp_seq = seq // par.tp if par.sequence_parallel else seq
            # an FSDP2 policy casts the parameters, so the residual stream is in the compute dtype;
            # autocast (and fp32) leave it in fp32
            act_dtype = compute_dtype(self.plan) if self.plan.mixed_precision == "fsdp2-policy" else torch.float32
            for (s, mod), n in zip(self.modules, self.in_flight):
                outputs = []
                with self._loss_ctx():
                    for _ in range(n):
                        if s == 0:
                            x = torch.zeros(mbs, seq, dtype=torch.long)
                        else:
                            x = torch.zeros(mbs, sp_seq, hidden, dtype=act_dtype, requires_grad=True)
                        out = mod(x)
                        if s == par.num_stages - 1:
                            out = loss_fn(out, torch.zeros(mbs, seq, dtype=torch.long)) / par.microbatches
                        outputs.append(out)
                    for i, out in enumerate(outputs):
                        if isinstance(mod, FSDPModule):  # as PipelineStage.backward_maybe_with_nosync
                            mod.set_is_last_backward(False)
                            mod.set_reshard_after_backward(False)
                            mod.set_requires_gradient_sync(False)
                        if out.dim() == 0:
                            out.backward()
                        else:
                            out.backward(torch.ones_like(out))
                        outputs[i] = None
                if isinstance(mod, FSDPModule):  # as PipelineStage.perform_reduce_grad
                    from torch.distributed.fsdp import fully_shard

                    mod.set_is_last_backward(True)
                    mod.set_reshard_after_backward(True)
                    mod.set_requires_gradient_sync(True)
                    state = fully_shard.state(mod)
                    for st in state._state_ctx.all_states:
                        for group in st._fsdp_param_groups:
                            group.post_backward()
                    state._root_post_backward_final_callback()
            return 0.0, 1

    class _ZeroData:
        """Token ids of the right shape (fake tensors carry no values)."""

        def __init__(self, seq_len: int):
            self.seq_len = seq_len

        def batch(self, step: int, dp_index: int, batch_size: int):
            z = torch.zeros(batch_size, self.seq_len, dtype=torch.long)
            return z, z

    return FakeTrainer()


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
    step. One optimizer step on zero gradients creates it without a forward and backward."""
    import torch

    for p in trainer.params:
        p.grad = torch.zeros_like(p)
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


def simulate_rank(cfg, rank: int, fake_tensors: bool = True) -> dict:
    """Simulate ``rank`` of ``cfg``; the rank record (backend.train's shape plus the fake extras)."""
    import torch.distributed as dist

    from backend import measure

    t0 = time.perf_counter()
    trainer = _build(cfg, rank, fake_tensors)
    t_build = time.perf_counter() - t0
    own = _dtensor_propagation_in_own_fake_mode() if fake_tensors else contextlib.nullcontext()
    with own, trainer.fake_mode, _fake_scalars_read_as_zero():
        _create_optimizer_state(trainer)
        t_warm = time.perf_counter() - t0
        memory = trainer.measure_memory(2)
    seconds = time.perf_counter() - t0
    check = cross_check(memory["tracker_peak"], memory["exact"])
    not_covered = list(NOT_COVERED) + NOT_COVERED_CPU_KERNELS
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
    more than exact is an over-count. The reported categories use the exact bytes (backend.measure.categories_from); a
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
    args = ap.parse_args(argv)

    from backend.records import RankWriter, RunDir
    from engine.config import Config

    run = RunDir(args.run_dir)
    out = RankWriter(args.run_dir, args.rank)
    out.event("rank_started", pid=os.getpid())
    try:
        cfg = Config.load(run.config)
        rec = simulate_rank(cfg, args.rank, fake_tensors=not args.real_tensors)
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
