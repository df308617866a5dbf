"""Legacy single-process data parallelism (``torch.nn.DataParallel``, ``parallel.dp_mode =
"dataparallel"``): what each GPU holds, what flows through GPU 0, and why it stops scaling.

One Python process drives N GPUs of one node. Every forward, ``nn.DataParallel``:

1. scatters the batch (token ids) from GPU 0 to the others, ``micro_batch_size`` sequences each;
2. *replicates* the module: broadcasts every parameter (frozen ones too) from GPU 0
   (``comm.broadcast_coalesced``; NCCL's ring broadcast: each GPU receives P bytes, GPU 0 sends
   them once, pipelined: ``(N−1)·α + P/B``); replica 0 is the module itself;
3. runs the N replicas in N Python threads (``parallel_apply``), serialised on the GIL;
4. gathers every replica's output (the logits, ``s·b·V`` each) onto GPU 0, where the loss of the
   whole batch is computed; backward scatters the logits' gradient back the same way;
5. in backward, each replica's weight gradients are reduce-added onto GPU 0's parameters
   (``ReduceAddCoalesced``, the backward of the broadcast): it fires after the replicas' backward,
   so nothing overlaps it;
6. the optimizer steps once, on GPU 0, which alone holds the optimizer state.

Memory per GPU, built from the single-GPU body of the same job (``dp = 1``, ``engine.memory``):

* GPU 0: the module's parameters, ``.grad`` and the optimizer state; its replica's activations;
  the loss of the whole batch — N × the log-probabilities (activations) and N × the loss
  temporaries (the gathered logits and their gradient); its own replica's gradients before the
  reduce-add (temporaries, the size of the gradients).
* GPU i > 0: the broadcast parameter copies (params, rebuilt every forward), the replica's
  gradients until the reduce-add (grads, transient but at the backward peak), no optimizer
  state; its replica's activations without any loss; its output logits until gathered
  (temporaries).
* every GPU: the runtime context; one NCCL communicator over the N GPUs (when
  ``conventions.collective_buffers``).

Step time (no overlap anywhere — that is the point)::

    step = m × ( scatter inputs + broadcast params + forward (max with the GIL-serialised
                 Python of N replicas) + gather logits + loss of the other N−1 replicas' b
                 sequences on GPU 0 (its own is not counted, as for DDP)
                 + scatter logit gradients + backward + reduce-add gradients onto GPU 0 )
         + optimizer step on GPU 0

The GIL term is a stated estimate, ``PYTHON_S_PER_BLOCK`` seconds of Python per transformer
block per replica per forward (op dispatch and the per-forward module copies of ``replicate``),
serialised over the N threads; it shows only where it exceeds the GPU's forward time. As N grows,
the gather / scatter through GPU 0 grow as N − 1, the loss on GPU 0 as N and the Python as N,
while DDP's step stays flat: tokens/s stops growing (``scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as dc_replace

from engine.config import Config
from engine.memory import GIB, MemoryReport, RankMemory, Term, _Body, memory_per_rank
from engine.memory.lifetimes import LOSS, PARTIAL_STATE_KINDS
from engine.memory.overhead import collective_buffer_bytes
from engine.model.lora import adapter_params
from engine.model.params import param_counts
from engine.names import MEMORY_CATEGORIES
from engine.time.comm import CommItem, CommReport, GroupSpan, MeasuredLinks, RankComm
from engine.time.durations import (
    StageDurations,
    flops_per_token,
    model_flops_per_token,
    recompute_flops_per_token,
    stage_durations,
)
from engine.time.step import StepTime, optimizer_seconds, step_time
from engine.wrapping import wrapping_plan

#: Python seconds per transformer block per replica per forward (dispatch of ~30 ops and the
#: replicate() module copies, ~10 µs each): a stated estimate, not a measurement.
PYTHON_S_PER_BLOCK = 400e-6
#: Bytes read and written per logit by the loss on GPU 0 (fp32 log-softmax forward and backward).
LOSS_BYTES_PER_LOGIT = 16

BREAKDOWN_KEYS = ("compute", "python_gil_exposed", "loss_on_gpu0", "dp_comm_exposed", "optimizer",
                  "tp_comm", "pipeline_bubble")


def is_legacy(cfg: Config) -> bool:
    return wrapping_plan(cfg).legacy


def single_gpu_config(cfg: Config) -> Config:
    """The same job on one GPU (one replica): the body every GPU's memory starts from."""
    return cfg.replace(cluster={"gpus": 1, "gpus_per_node": 1},
                       parallel={"dp": 1, "dp_mode": "ddp", "zero": 0, "replicate": 1})


# --------------------------------------------------------------------------- memory


def _loss_terms(terms: dict[str, list]) -> tuple[int, int]:
    """(bytes of the log-probabilities kept for backward, bytes of the loss temporaries) of one replica,
    from its terms at one moment."""
    logp = sum(t.bytes for t in terms["activations"] if t.kind == "log_probabilities")
    tmp = sum(t.bytes for t in terms["temporaries"] if t.kind == "loss")
    return logp, tmp


def memory(cfg: Config) -> MemoryReport:
    """Memory of each of the N GPUs of a ``dp_mode = "dataparallel"`` job (GPU 0 is the heavy one)."""
    n = cfg.parallel.dp
    one = memory_per_rank(single_gpu_config(cfg))
    base: _Body = one.per_rank[0]._body
    model, tr = cfg.model, cfg.training
    s, b = model.seq_len, tr.micro_batch_size
    act = 4 if tr.precision == "fp32" else 2
    # the gradients whole, alive at the single GPU's peak or not (there they come with its first backward):
    # this model sums GPU 0's terms as one moment, with .grad (plain lifetimes are not followed here)
    # (a moment's share of them, ``PARTIAL_STATE_KINDS``, is the same tensors: left out)
    grads_whole = [t for t in base.catalogue["grads"] if t.kind not in PARTIAL_STATE_KINDS]
    # its terms at the single GPU's forward and backward peak: the optimizer step's temporaries (AdamW's,
    # engine.memory.states.optimizer_step_term) are another moment, which this one-moment sum leaves out
    snap = base.timeline.snapshot(base.timeline.peak_before_step) if base.timeline is not None else base.terms
    snap = {c: [t for t in snap[c] if t.kind != "optimizer_step"] for c in MEMORY_CATEGORIES}
    # GPU 0 at the single GPU's loss moment too, where the whole batch's loss adds to it: the larger of the two
    at_loss = base.timeline.peak_in_phase(LOSS) if base.timeline is not None else None
    loss_snap = {c: [t for t in base.timeline.snapshot(at_loss)[c] if t.kind != "optimizer_step"]
                 for c in MEMORY_CATEGORIES} if at_loss is not None else snap
    params_b, grads_b = base.values["params"], sum(t.bytes for t in grads_whole)
    logits = act * s * b * model.vocab
    conv = cfg.conventions
    comm_term = None
    per = collective_buffer_bytes(cfg)
    if n > 1 and per:
        comm_term = Term("collective-library buffers (one NCCL communicator over the N GPUs: broadcast, reduce)",
                         per, f"1 × {conv.collective_buffer_mib:g} MiB (conventions.collective_buffer_mib)",
                         "overhead", tracked=False, kind="collective_buffers")

    def gpu0(moment: dict[str, list[Term]]) -> dict[str, list[Term]]:
        """GPU 0 at one of the single GPU's moments: the module, its state, and the whole batch's loss."""
        t0 = {c: list(moment[c]) if c != "grads" else list(grads_whole) for c in MEMORY_CATEGORIES}
        logp, loss_tmp = _loss_terms(moment)
        if n > 1:
            t0["activations"].append(Term(f"GPU 0: the other {n - 1} replicas' log-probabilities (the loss of the "
                                          "whole batch is computed here)", (n - 1) * logp, f"(N − 1) × {logp:,} B",
                                          "activations", kind="log_probabilities"))
            t0["temporaries"].append(Term(f"GPU 0: gathered outputs of the other {n - 1} replicas and their loss "
                                          "gradient", (n - 1) * loss_tmp, f"(N − 1) × {loss_tmp:,} B",
                                          "temporaries", kind="loss"))
            t0["temporaries"].append(Term("GPU 0: its replica's gradients before ReduceAddCoalesced sums every "
                                          "replica's into .grad", grads_b, f"{grads_b:,} B (the gradients' size)",
                                          "temporaries", kind="gradients_before_reduce"))
        if comm_term:
            t0["overhead"].append(comm_term)
        return t0

    t0 = max((gpu0(snap), gpu0(loss_snap)), key=lambda t: sum(x.bytes for c in MEMORY_CATEGORIES for x in t[c]
                                                              if x.tracked))
    bodies = [_Body(t0, (0,), 0)]
    if n > 1:
        ti = {c: [] for c in MEMORY_CATEGORIES}
        ti["params"].append(Term("replica: parameters broadcast from GPU 0 (rebuilt every forward, frozen ones too)",
                                 params_b, f"{params_b:,} B (as GPU 0's parameters)", "params",
                                 kind="replica_parameters"))
        ti["grads"].append(Term("replica gradients, alive until reduce-added onto GPU 0 at the end of backward",
                                grads_b, f"{grads_b:,} B", "grads", kind="gradients"))
        ti["optimizer"].append(Term("none: only GPU 0 steps the optimizer", 0, "0", "optimizer", kind="none"))
        ti["activations"] = [t for t in snap["activations"] if t.kind != "log_probabilities"]
        ti["temporaries"] = [t for t in snap["temporaries"] if t.kind != "loss"]
        ti["temporaries"].append(Term("replica's output logits until gathered onto GPU 0 (then their gradient)",
                                      logits, f"{act}·s·b·V = {logits:,} B", "temporaries", kind="replica_logits"))
        ti["comm_buffers"] = list(snap["comm_buffers"])
        ti["overhead"] = list(snap["overhead"]) + ([comm_term] if comm_term else [])
        bodies.append(_Body(ti, (0,), 0))
    capacity = cfg.cluster.gpu.memory_bytes
    per_rank = [RankMemory(r, 0, r, bodies[min(r, 1)], capacity) for r in range(n)]
    conventions = dict(one.conventions)
    conventions["legacy_dataparallel"] = (
        "nn.DataParallel: GPU 0 holds the module, .grad, the optimizer state and the loss of the whole batch; "
        "GPUs 1..N−1 hold broadcast parameter copies and their replica's gradients until the reduce-add")
    return MemoryReport(per_rank=per_rank, capacity_bytes=capacity, conventions=conventions)


# --------------------------------------------------------------------------- traffic and time


@dataclass(frozen=True)
class Transfer:
    """One movement through GPU 0 per microbatch: bytes that enter or leave GPU 0, and its seconds."""

    what: str
    bytes_through_gpu0: float
    seconds: float
    phase: str


def _trainable(cfg: Config) -> int:
    if cfg.training.finetune == "lora":
        return adapter_params(cfg.model, cfg.training.lora_rank, cfg.training.lora_targets)
    return param_counts(cfg.model).total


def transfers(cfg: Config, links: MeasuredLinks | None = None) -> list[Transfer]:
    """What moves through GPU 0 for one microbatch (the step repeats it ``microbatches`` times).

    Each is a point-to-point movement between GPU 0 and the others (NCCL's broadcast and reduce
    are pipelined rings of sends): timed with the cluster's intra-node α and B, or with the
    measured point-to-point ones where ``links`` has them."""
    n = cfg.parallel.dp
    if n == 1:
        return []
    cl = cfg.cluster
    bw, lat = cl.intra_node_bytes_per_s, cl.intra_node_latency_us * 1e-6
    if links is not None:
        bw, lat = links.lookup("p2p", 2) or (bw, lat)
    body = memory_per_rank(single_gpu_config(cfg)).per_rank[0]
    params_b = body.params
    grads_b = sum(t.bytes for t in body.catalogue("grads") if t.kind not in PARTIAL_STATE_KINDS)  # whole, peak or not
    model, tr = cfg.model, cfg.training
    act = 4 if tr.precision == "fp32" else 2
    ids = 8 * model.seq_len * tr.micro_batch_size
    logits = act * model.seq_len * tr.micro_batch_size * model.vocab
    return [
        Transfer("scatter the batch (token ids) from GPU 0", (n - 1) * ids, (n - 1) * (lat + ids / bw), "forward"),
        Transfer("broadcast every parameter from GPU 0 (replicate; NCCL ring, pipelined)", params_b,
                 (n - 1) * lat + params_b / bw, "forward"),
        Transfer("gather every replica's logits onto GPU 0", (n - 1) * logits, (n - 1) * (lat + logits / bw),
                 "forward"),
        Transfer("scatter the logits' gradients from GPU 0", (n - 1) * logits, (n - 1) * (lat + logits / bw),
                 "backward"),
        Transfer("reduce-add every replica's gradients onto GPU 0 (NCCL ring reduce, after the backward)",
                 grads_b, (n - 1) * lat + grads_b / bw, "backward"),
    ]


def step(cfg: Config, durations: StageDurations | None = None, links: MeasuredLinks | None = None) -> StepTime:
    """Step time of a ``dp_mode = "dataparallel"`` job, with the legacy breakdown (sums to the step).

    ``durations``: measured (calibrated) seconds of one replica's forward and backward of a
    microbatch — the same per-GPU work as the single-GPU body's, so they replace its analytic
    ones; ``links``: measured point-to-point α and B for the traffic through GPU 0 (:func:`transfers`).
    """
    par, tr, model = cfg.parallel, cfg.training, cfg.model
    n, m = par.dp, par.microbatches
    one_cfg = single_gpu_config(cfg)
    base = step_time(one_cfg, durations, links)
    d = durations if durations is not None else stage_durations(one_cfg)
    fwd, bwd = float(d.forward_s[0]), float(d.backward_s[0])
    python = n * model.layers * PYTHON_S_PER_BLOCK if n > 1 else 0.0
    gil = max(0.0, python - fwd)
    loss_bytes = LOSS_BYTES_PER_LOGIT * (n - 1) * tr.micro_batch_size * model.seq_len * model.vocab
    loss = loss_bytes / (cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9)
    moved = transfers(cfg, links)
    comm = sum(t.seconds for t in moved)
    opt = optimizer_seconds(one_cfg, _trainable(cfg))
    breakdown = {
        "compute": m * (fwd + bwd),
        "python_gil_exposed": m * gil,
        "loss_on_gpu0": m * loss,
        "dp_comm_exposed": m * comm,
        "optimizer": opt,
        "tp_comm": 0.0,
        "pipeline_bubble": 0.0,
    }
    total = sum(breakdown.values())
    tokens = cfg.tokens_per_step
    if tr.finetune == "lora":  # the step's own FLOPs (engine.time.durations): no base weight gradients
        model_flops = tokens * model_flops_per_token(cfg)
    else:
        fl = flops_per_token(cfg)
        model_flops = tokens * 3 * (model.layers * fl.block + fl.head)
    hardware_flops = model_flops + tokens * model.layers * recompute_flops_per_token(cfg)
    peak = cfg.cluster.gpu.peak_flops(tr.precision) * n
    items = tuple(CommItem(dim="dp", what=t.what, collective="p2p", calls=m, size_bytes=t.bytes_through_gpu0,
                           group_size=n, link="intra-node", seconds=m * t.seconds, overlappable=False, phase=t.phase)
                  for t in moved)
    report = CommReport(per_pp_rank=(RankComm(pp_rank=0, rank=0, items=items),),
                        spans={"dp": GroupSpan("dp", n, 1, n)})
    return dc_replace(base, seconds=total, breakdown=breakdown, tokens_per_s=tokens / total,
                      model_flops=model_flops, hardware_flops=hardware_flops, mfu=model_flops / (total * peak),
                      hfu=hardware_flops / (total * peak), dp_comm_s=m * comm, optimizer_s=opt, comm=report)


def scaling(cfg: Config, gpus: tuple[int, ...] | None = None) -> list[dict]:
    """tokens/s of the same job under nn.DataParallel and under DDP for N = 1, 2, 4, ... GPUs of one node.

    Each row: {"gpus", "dataparallel_tokens_per_s", "ddp_tokens_per_s", "gpu0_bytes", "other_gpu_bytes"}.
    """
    if gpus is None:
        top = cfg.cluster.gpus_per_node
        gpus = tuple(sorted({1, *(2**k for k in range(1, 8) if 2**k <= top), top}))
    rows = []
    for n in gpus:
        c = cfg.replace(cluster={"gpus": n, "gpus_per_node": max(n, 1)}, parallel={"dp": n, "dp_mode": "dataparallel"})
        ddp = c.replace(parallel={"dp_mode": "ddp"})
        mem = memory(c)
        rows.append({"gpus": n, "dataparallel_tokens_per_s": step(c).tokens_per_s,
                     "ddp_tokens_per_s": step_time(ddp).tokens_per_s, "gpu0_bytes": mem.per_rank[0].total,
                     "other_gpu_bytes": mem.per_rank[-1].total})
    return rows


def summary(cfg: Config) -> str:
    """One line for reports: GPU 0 against the others."""
    mem = memory(cfg)
    g0, gi = mem.per_rank[0].total, mem.per_rank[-1].total
    return (f"nn.DataParallel over {cfg.parallel.dp} GPUs: GPU 0 {g0 / GIB:.2f} GiB, "
            f"GPU 1..{cfg.parallel.dp - 1} {gi / GIB:.2f} GiB each")
