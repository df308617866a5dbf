"""One rank's training: build the model, apply the strategies, train, measure. Imports torch.

Run by backend.worker inside each torchrun rank; talks to the launcher only through files in
the run directory (backend.records.RankWriter).

Legacy ``parallel.dp_mode = "dataparallel"``: the launcher starts ONE process (world size 1);
it builds the model on cuda:0, wraps it in ``nn.DataParallel`` over GPUs 0..dp-1, feeds each
microbatch as the concatenation of what the dp DDP ranks would get (so the losses follow DDP's),
and writes one measurement record per GPU (rows 0..dp-1) from each GPU's CUDA allocator
(backend.parallel.data_parallel.dataparallel_rows says how the categories are split).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from backend import measure
from backend.faults import maybe_fault
from backend.model import SyntheticData, Transformer, moe_modules
from backend.parallel import ParallelDims, apply_pp, autocast_context, build_optimizer, build_schedule, parallelize
from backend.parallel.compile import measured_eagerly
from backend.parallel.data_parallel import dataparallel_refusal, dataparallel_rows
from backend.parallel.expert_parallel import expert_params
from backend.parallel.expert_parallel import refusal as moe_refusal
from backend.parallel.float8 import precompute_scales
from backend.parallel.lora import lora_refusal
from backend.parallel.parallelize import expert_grad_sync
from backend.parallel.pipeline import ActionTimer
from backend.records import RankWriter
from engine.backend_limits import composition_problems
from engine.config import Config
from engine.memory.states import optimizer_foreach
from engine.wrapping import wrapping_plan

LEARNING_RATE = 5e-3
SEED = 0


def _optimizer_cls_and_kwargs(name: str, foreach: bool = False):
    """The optimizer class and its arguments; ``foreach``: AdamW's multi-tensor step, as torch picks it on
    GPUs (engine.memory.states.optimizer_foreach: a fake-tensor simulation of a GPU rank lives on the CPU,
    where torch would pick the for-loop)."""
    if name == "adamw":
        return torch.optim.AdamW, {"lr": LEARNING_RATE, "betas": (0.9, 0.95), "weight_decay": 0.0,
                                   "foreach": foreach}
    if name == "sgd-momentum":
        return torch.optim.SGD, {"lr": 0.3, "momentum": 0.9}
    return torch.optim.SGD, {"lr": 0.3}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def check_supported(cfg: Config) -> None:
    """Combinations torch's APIs cannot compose; raised before anything is built."""
    par = cfg.parallel
    for problem in composition_problems(cfg):
        raise NotImplementedError(problem)
    if par.dp_mode == "dataparallel":
        why = dataparallel_refusal(cfg, torch.cuda.device_count())
        if why:
            raise NotImplementedError(why)
    why = moe_refusal(cfg)
    if why:
        raise NotImplementedError(why)
    if cfg.training.finetune == "lora":
        why = lora_refusal(cfg.training, torch.cuda.is_available())
        if why:
            raise NotImplementedError(why)


class Trainer:
    """Everything one rank holds: stage modules, optimizer, schedule (PP), data."""

    legacy = False  # nn.DataParallel (set in __init__; class defaults keep subclasses such as the fake trainer)
    #: under training.compile, count what the compiled blocks save over one more compiled step
    #: (``compiled_saved_peak``); off where no kernel runs (the fake trainer's fake tensors)
    counts_compiled_saved = True
    gpus = 1  # GPUs this process drives
    cp = None  # backend.parallel.context_parallel.ContextParallel when parallel.cp > 1
    moes: tuple = ()  # the MoE blocks this rank holds (set in __init__)
    sync_experts = None  # what reduces the routed experts' gradients when no FSDP2 wrapper does

    @property
    def microbatch_rows(self) -> int:
        """Sequences per microbatch this process feeds (nn.DataParallel scatters them over its GPUs)."""
        return self.cfg.training.micro_batch_size * self.gpus

    def __init__(self, cfg: Config, out: RankWriter):
        self.cfg, self.out = cfg, out
        par, tr = cfg.parallel, cfg.training
        check_supported(cfg)  # first: a refused dataparallel job would not match the one-process world
        self.plan = wrapping_plan(cfg)  # which wrapper and precision: read, never re-decided, below
        self.legacy = self.plan.legacy  # nn.DataParallel: one process drives par.dp GPUs
        self.gpus = par.dp if self.legacy else 1  # GPUs this process drives
        self.device = self._init_process_group()
        self.rank = dist.get_rank()
        # the process group of a dataparallel job is this one process: its mesh is the dp = 1 layout
        spec = dataclasses.replace(par, dp=1, dp_mode="ddp") if self.legacy else par
        self.dims = ParallelDims(spec, self.device.type, cfg.cluster.gpus_per_node)
        self.dims.build_mesh()
        self.coords = self.dims.coords
        self.pipelined = self.plan.pipelined
        #: context parallelism (None when cp = 1): each microbatch's sequences are sharded by it
        self.cp = self.dims.context_parallel(cfg.model, self.device)

        torch.manual_seed(SEED)  # every rank builds the same full model, then keeps its part
        with torch.device(self.device):  # nn.DataParallel: cuda:0, its source device
            model = Transformer(cfg.model)
        parts = apply_pp(model, par, self.coords.pp) if self.pipelined else [(0, model)]
        before = [sum(len(p.layers) for _, p in parts[:i]) for i in range(len(parts))]  # the rank's earlier blocks
        self.modules = [(s, parallelize(m, cfg, self.plan, self.dims, self.device, blocks_before=b))
                        for (s, m), b in zip(parts, before)]
        self.stages = [s for s, _ in self.modules]
        self.params = measure.unique_params(m for _, m in self.modules)
        self.moes = [moe for _, m in self.modules for moe in moe_modules(m)]
        self.sync_experts = expert_grad_sync([m for _, m in self.modules], cfg, self.plan, self.dims)

        cls, kw = _optimizer_cls_and_kwargs(tr.optimizer, optimizer_foreach(cfg))
        self.optimizer = build_optimizer(self.params, self.plan, self.dims, cls, **kw)

        self.timer = ActionTimer()
        self.schedule = None
        if self.pipelined:
            self.schedule = build_schedule(self.modules, par, self.dims["pp"].get_group(), self.device,
                                           loss_fn, self.timer)
        self.has_first = 0 in self.stages
        self.has_last = par.num_stages - 1 in self.stages
        self.data = SyntheticData(cfg.model.vocab, cfg.model.seq_len)
        self.local_batch = par.microbatches * tr.micro_batch_size  # per DDP rank (per GPU under DataParallel)

    def _init_process_group(self) -> torch.device:
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        return device

    # ----------------------------------------------------------------- one step

    def _loss_ctx(self):
        ctx = contextlib.ExitStack()
        if self.cfg.parallel.sequence_parallel:
            ctx.enter_context(loss_parallel())
        ctx.enter_context(autocast_context(self.plan, self.device.type))
        return ctx

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.legacy:  # microbatch i = [dp-rank 0's microbatch i, ..., dp-rank N-1's]: chunk d goes to GPU d
            mbs, m = self.cfg.training.micro_batch_size, self.cfg.parallel.microbatches
            parts = [self.data.batch(step, d, self.local_batch) for d in range(self.gpus)]
            x = torch.cat([p[0][i * mbs:(i + 1) * mbs] for i in range(m) for p in parts])
            y = torch.cat([p[1][i * mbs:(i + 1) * mbs] for i in range(m) for p in parts])
            return x.to(self.device), y.to(self.device)
        x, y = self.data.batch(step, self.coords.dp, self.local_batch)
        return x.to(self.device), y.to(self.device)

    def synchronize(self) -> None:
        """Wait for every GPU this process drives (all of them under nn.DataParallel)."""
        if self.device.type != "cuda":
            return
        if not self.legacy:
            torch.cuda.synchronize(self.device)
            return
        for i in range(self.gpus):
            torch.cuda.synchronize(i)

    def _sequence_shards(self, x: torch.Tensor, y: torch.Tensor):
        """A context yielding (x, y) as this rank holds them: its sequence shard under context
        parallelism (the mean loss of equal shards, averaged over dp·cp, is the full sequence's)."""
        if self.cp is None:
            return contextlib.nullcontext((x, y))
        return self.cp.microbatch(x, y)

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, int]:
        """Forward and backward of one optimizer step's local batch: (loss sum, loss count)."""
        x, y = batch
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            with self._sequence_shards(x, y) as (x, y), self._loss_ctx():
                args = (x,) if self.has_first else ()
                # conventions.pipeline_outputs: "released" calls step(return_outputs=False), as torchtitan since
                # 0.2.1 (its PR 1922: the last stage keeps no output of every microbatch to merge at the step's
                # end); "kept", step()'s default; the losses come back either way
                keep = self.cfg.conventions.pipeline_outputs == "kept"
                if self.has_last:
                    self.schedule.step(*args, target=y, losses=losses, return_outputs=keep)
                else:
                    self.schedule.step(*args, return_outputs=keep)
            if not losses:
                return 0.0, 0
            return float(torch.stack([loss.detach().float() for loss in losses]).mean()), 1
        (_, model), = self.modules
        mbs = self.microbatch_rows
        m = self.cfg.parallel.microbatches
        total = 0.0
        for i in range(m):
            last = i == m - 1
            sync = contextlib.nullcontext()
            if isinstance(model, DistributedDataParallel) and not last:
                sync = model.no_sync()
            elif isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(last)
            with sync, self._sequence_shards(x[i * mbs:(i + 1) * mbs], y[i * mbs:(i + 1) * mbs]) as (xi, yi), \
                    self._loss_ctx():
                loss = loss_fn(model(xi), yi) / m
                loss.backward()
            total += float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
        return total, 1

    def optimizer_step(self) -> None:
        if self.sync_experts is not None:
            self.sync_experts()
        self.optimizer.step()
        self.after_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)

    def after_optimizer_step(self) -> None:
        """torchtitan's post-optimizer hook: FSDP2's float8-gathered weights get their next scales."""
        if self.cfg.training.float8_all_gather:
            precompute_scales([m for _, m in self.modules])

    # ----------------------------------------------------------------- the run

    def train(self, steps: int) -> None:
        n = steps
        step_seconds: list[float] = []
        losses: list[float] = []
        actions: list = []
        expert_tokens: list[dict] = []
        self.out.event("rank_ready", stages=self.stages, pid=os.getpid())
        for k in range(1, n + 1):
            maybe_fault(self.rank, k)
            batch = self.batch(k)  # data is made before the clock starts
            for moe in self.moes:
                moe.reset_counts()
            dist.barrier()
            self.timer.actions.clear()
            self.timer.on = k == n
            t0 = time.perf_counter_ns()
            loss_sum, count = self.forward_backward(batch)
            self.optimizer_step()
            self.synchronize()
            t1 = time.perf_counter_ns()
            self.timer.on = False
            seconds = (t1 - t0) / 1e9
            if k == n:
                actions = [[kind, s, mb, (a - t0) / 1e9, (b - t0) / 1e9]
                           for kind, s, mb, a, b in self.timer.actions]
            # outside the timed region: mean loss over the ranks that have one, slowest rank's time
            # on the rank's device: an NCCL-only process group reduces CUDA tensors only
            stats = torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=self.device)
            slow = torch.tensor([seconds], dtype=torch.float64, device=self.device)
            dist.all_reduce(stats)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            loss = float(stats[0] / max(stats[1], 1.0))
            step_seconds.append(seconds)
            losses.append(loss)
            if self.moes or self.cfg.model.experts:
                expert_tokens.append(self.expert_tokens(k))
            if self.rank == 0:
                self.out.event("step", k=k, n=n, loss=loss, seconds=float(slow[0]))
        if self.legacy:
            self._write_dataparallel_rows(n + 1, step_seconds, losses)
            return
        memory = self.measure_memory(n + 1)
        extra = {"expert_tokens": expert_tokens} if expert_tokens else {}
        self.out.measurement({
            "rank": self.rank,
            "coords": {"pp": self.coords.pp, "dp": self.coords.dp, "tp": self.coords.tp, "cp": self.coords.cp},
            "stages": self.stages,
            "memory": memory,
            "step_seconds": step_seconds,
            "losses": losses,
            "actions": actions,
            "peak_rss_bytes": measure.peak_rss_bytes(),
            **extra,
            **self._cuda_stats(),
        })

    def expert_tokens(self, k: int) -> dict:
        """Step ``k``'s routed-token counts (outside the timed region): per MoE block this rank holds,
        ``routed`` (tokens it sent to each of the E experts, microbatches summed), ``received`` (tokens
        each of its local experts got from the expert-parallel group), the same per microbatch in the
        order of the block's forwards (``routed_microbatches``, ``received_microbatches``: the
        activations alive at a moment follow the microbatches in flight then, not the step's sum) and
        the first local expert's index; and ``total``, per block of the whole model, the tokens each
        expert received from every rank (a sum over all ranks: every rank of a stage routes different
        tokens)."""
        m = self.cfg.model
        blocks = list(range(m.dense_layers, m.layers))
        total = torch.zeros(len(blocks), m.experts, dtype=torch.int64)
        local = {}
        for moe in self.moes:
            routed = moe.routed_counts if moe.routed_counts is not None else torch.zeros(m.experts, dtype=torch.int64)
            received = moe.received_counts if moe.received_counts is not None else torch.zeros(
                moe.experts.num_experts, dtype=torch.int64)
            total[blocks.index(moe.index)] += routed
            first = (m.experts // self.cfg.parallel.ep) * (self.dims.expert_mesh("ep").get_local_rank()
                                                            if self.cfg.parallel.ep > 1 else 0)
            local[str(moe.index)] = {"routed": routed.tolist(), "received": received.tolist(), "first_expert": first,
                                     "routed_microbatches": [c.tolist() for c in moe.routed_per_forward],
                                     "received_microbatches": [c.tolist() for c in moe.received_per_forward]}
        total = total.to(self.device)
        dist.all_reduce(total)
        return {"k": k, "blocks": local, "total": {str(b): row for b, row in zip(blocks, total.cpu().tolist())}}

    def p2p_buffer_bytes(self) -> int:
        """The pipeline's receive buffers (torch keeps one per microbatch, stage and direction)."""
        return measure.p2p_buffer_bytes(self.schedule)

    def measure_memory(self, step: int) -> dict:
        """One extra, untimed step under PyTorch's MemTracker, plus exact local byte counts."""
        mods = [m for _, m in self.modules]
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        batch = self.batch(step)
        for moe in self.moes:
            moe.reset_counts()
        tracker = measure.tracker_for(mods, self.optimizer, batch)
        compiled = self.cfg.training.compile and self.counts_compiled_saved
        eager_saved = measure.SavedTensorPeak(self.params, mods) if compiled else contextlib.nullcontext()
        with measured_eagerly(self.cfg.training.compile), tracker, eager_saved:
            self.forward_backward(batch)
            grads = measure.grad_bytes(self.params)
            experts = {id(p) for m in mods for p in expert_params(m)}
            ddp_grads = measure.grad_bytes([p for p in self.params if id(p) not in experts])
            if self.sync_experts is not None:
                self.sync_experts()
            self.optimizer.step()
            self.after_optimizer_step()
        exact = {
            "params": measure.param_bytes(self.params),
            "grads": grads,
            "optimizer": measure.optimizer_bytes(self.optimizer),
        }
        self.optimizer.zero_grad(set_to_none=True)
        raw = measure.tracker_peak(tracker, self.device)
        cats = measure.categories_from(raw, exact)
        if any(isinstance(m, DistributedDataParallel) for m in mods):
            # DDP's reducer buckets hold a flat copy of every gradient it reduces (not the routed
            # experts', which it leaves to sync_expert_grads)
            cats["comm_buffers"] += ddp_grads
        if self.pipelined:
            cats["comm_buffers"] += self.p2p_buffer_bytes()  # untracked p2p receive buffers
        out = {
            "categories": cats,
            "exact": exact,
            "params_local_count": measure.param_count_local(self.params),
            "tracker_peak": raw,
            # what the tracker saw that predates it (DDP's buckets, the p2p receive buffers): not in
            # tracker_peak; counted in comm_buffers at their exact sizes instead
            "pre_existing": dict(tracker.pre_existing),
            "notes": measure.memory_notes(self.cfg) + ([self.cp.note(self.device.type)] if self.cp else []),
        }
        if self.cfg.model.experts:  # the routing of the measured step, which its activations follow
            out["expert_tokens"] = self.expert_tokens(step)
        if compiled:
            out["saved_for_backward"] = {"eager": eager_saved.peak, "compiled": self.compiled_saved_peak(batch)}
        return out

    def compiled_saved_peak(self, batch) -> int:
        """The saved-for-backward bytes at their peak over one more untimed forward and backward of the
        same batch with the blocks compiled (``measure.SavedTensorPeak``: what MemTracker cannot see
        inside a compiled block); the gradients it makes are dropped, no optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        with measure.SavedTensorPeak(self.params, [m for _, m in self.modules]) as saved:
            self.forward_backward(batch)
        self.optimizer.zero_grad(set_to_none=True)
        return saved.peak

    def measure_dataparallel(self, step: int) -> list[dict[str, int]]:
        """One extra, untimed nn.DataParallel step measured by each GPU's CUDA allocator (no MemTracker:
        the replicas run in nn.DataParallel's threads, which a dispatch-mode tracker does not follow)."""
        gpus = range(self.gpus)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        batch = self.batch(step)
        self.synchronize()
        for i in gpus:
            torch.cuda.reset_peak_memory_stats(i)
        before = [torch.cuda.memory_allocated(i) for i in gpus]
        after_forward: list[int] = []
        x, y = batch
        (_, model), = self.modules
        mbs, m = self.microbatch_rows, self.cfg.parallel.microbatches
        for k in range(m):
            with self._loss_ctx():
                loss = loss_fn(model(x[k * mbs:(k + 1) * mbs]), y[k * mbs:(k + 1) * mbs]) / m
            if k == 0:
                self.synchronize()
                after_forward = [torch.cuda.memory_allocated(i) for i in gpus]
            loss.backward()
        grads = measure.grad_bytes(self.params)
        self.optimizer.step()
        self.synchronize()
        peak = [torch.cuda.max_memory_allocated(i) for i in gpus]
        exact = {"params": measure.param_bytes(self.params), "grads": grads,
                 "optimizer": measure.optimizer_bytes(self.optimizer)}
        self.optimizer.zero_grad(set_to_none=True)
        rows = dataparallel_rows(before, after_forward, peak, exact, replica_param_bytes=exact["params"])
        return [{"categories": row, "exact": exact if i == 0 else {}, "params_local_count":
                 measure.param_count_local(self.params), "cuda_allocated": {"before": before[i],
                 "after_forward": after_forward[i], "peak": peak[i]}} for i, row in enumerate(rows)]

    def _write_dataparallel_rows(self, step: int, step_seconds: list[float], losses: list[float]) -> None:
        """One measurement record per GPU (rows 0..dp-1), as if each GPU were a rank: the launcher
        assembles them like any run, so the comparison sees GPU 0's extra load per category."""
        rows = self.measure_dataparallel(step)
        for i, memory in enumerate(rows):
            RankWriter(self.out.dir.path, i).measurement({
                "rank": i,
                "coords": {"pp": 0, "dp": i, "tp": 0},
                "stages": [0],
                "memory": memory,
                "step_seconds": step_seconds,  # one process: the same clock for every GPU
                "losses": losses,
                "actions": [],
                "peak_rss_bytes": measure.peak_rss_bytes() if i == 0 else 0,
                "dp_mode": "dataparallel",
                "max_memory_allocated": memory["cuda_allocated"]["peak"],
                "max_memory_reserved": torch.cuda.max_memory_reserved(i),
            })

    def _cuda_stats(self) -> dict:
        if self.device.type != "cuda":
            return {}
        return {"max_memory_allocated": torch.cuda.max_memory_allocated(self.device),
                "max_memory_reserved": torch.cuda.max_memory_reserved(self.device)}

    def close(self) -> None:
        """Barrier, drop the model and optimizer, collect, then destroy the group: a plain
        ``destroy_process_group()`` lets gloo workers die with SIGABRT after training (4 in 10 runs here)."""
        dist.barrier()
        del self.schedule, self.modules, self.optimizer, self.params
        gc.collect()
        dist.destroy_process_group()


def run_rank(cfg: Config, out: RankWriter, steps: int) -> None:
    trainer = Trainer(cfg, out)
    trainer.train(steps)
    trainer.close()
