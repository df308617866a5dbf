"""Measure this machine's CPU as one training rank sees it: the device profile of ``gpu = "cpu"`` for the
clock from ops (``conventions.clock = "ops"``, engine/time/ops.py).

``python -m backend.devicebench --out FILE`` (``shardscope calibrate --device`` runs it as a child
process with ``OMP_NUM_THREADS=1``, the thread count a local rank runs with, backend/launch.py) times,
in about 10–20 s:

* GEMMs (``torch.mm``) of n × n by n × n for n = 16 … 512 in fp32 and bf16, and fits ``time = F / R +
  c`` (F = 2n³, n ≥ 32: ``FIT_FROM``) per dtype: R is the large-GEMM rate, ``c`` a GEMM's fixed cost, which
  the op clock splits into the per-op launch below and ``gemm_half_gflop = (c − launch) · R`` (its rate curve
  ``R · F / (F + F_half)`` costs exactly ``F / R + F_half / R``; bf16's ``gemm_half_gflop_bf16``: oneDNN's
  AMX GEMM costs ~19 µs a call however small, fp32's ~1);
* the float8 GEMMs as torchao calls ``torch._scaled_mm`` (:func:`_float8_gemms`), fitted the same way per kernel: with
  one scale a tensor (torch 2.13's CPU kernel then runs ~0.05 GFLOP/s, four orders below bf16: the tensorwise recipe's
  GEMMs and a rowwise recipe's gradient GEMMs) and with a scale a row (~20 GFLOP/s: a rowwise recipe's forward);
* the bandwidth of an elementwise kernel: ``torch.add`` of two 32 MiB fp32 tensors into a third; and of a kernel of
  exponentials, ``torch.softmax`` over 4 Mi fp32 elements in rows of 64 (each read and written once: 8 B an
  element), as a fraction of the first (``softmax_fraction``: the op clock's softmax and the loss's log-softmax);
* an op's cost as training pays it (``launch_us``): the backend's own transformer block
  (backend/model.py) at a size where its kernels take no time (hidden 16, 8 tokens): its forward over
  the forward kernels the op clock counts for that block (``engine.time.ops.block_ops``), its backward
  over the backward's (``launch_backward_us``): the dispatcher, autograd and the modules' Python per kernel (a bare multiplication's is kept beside it,
  ``tiny_op_s``, for comparison); and the same block wrapped as each recompute kind wraps the blocks
  (``launch_us_full`` … ``launch_backward_us_selective_op``: torch's checkpoint and its saved-tensor hooks, per-op
  selective checkpointing's dispatch mode in Python on every op — 35 µs a forward kernel here against 6 unwrapped).

It writes the profile as fractions of the ``cpu`` GPU preset's figures (``assets/presets/gpus.toml``:
its fp32 / bf16 peaks and memory bandwidth, themselves a dev machine's measurements), as
``assets/presets/devices.toml`` states profiles, with the machine's name and the date: the engine reads
it for ``gpu = "cpu"`` on this machine (``engine.time.ops.device_profile``).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from backend.model import Transformer, TransformerBlock
from backend.parallel.recompute import apply_recompute
from engine.config import Config, default_config
from engine.time.ops import RECOMPUTE_LAUNCH, block_ops

SIZES = (16, 32, 64, 128, 256, 512)
#: the smallest GEMM the rate line is fitted on: a 16³ GEMM takes another kernel path (bf16: 3 µs, against
#: 19 µs at 32³ where oneDNN's AMX kernel starts), and a transformer block's GEMMs are wider
FIT_FROM = 32


def _seconds(fn, budget_s: float = 0.25, least: int = 5) -> float:
    """The median seconds of ``fn()`` over repeats filling about ``budget_s`` (after one warm-up)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(least, min(20000, int(budget_s / one)))
    times = []
    batch = max(1, reps // 9)
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    times.sort()
    return times[len(times) // 2]


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a·x + b, weighted by 1/y² (relative errors: small and large GEMMs alike)."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    a = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return a, (sy - a * sx) / sw


def measure() -> dict:
    """The raw measurements (module docstring)."""
    torch.manual_seed(0)
    out: dict = {"threads": torch.get_num_threads(), "gemm": {}}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rows = []
        for n in SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            rows.append((2.0 * n**3, _seconds(lambda a=a, b=b: torch.mm(a, b))))
        fitted = [(f, t) for f, t in rows if f >= 2.0 * FIT_FROM**3]
        slope, fixed = _fit_line([f for f, _ in fitted], [t for _, t in fitted])
        out["gemm"][name] = {"sizes": list(SIZES), "seconds": [t for _, t in rows],
                             "rate_flops": 1.0 / slope, "fixed_s": max(fixed, 0.0)}
    out["gemm"].update(_float8_gemms())
    x, y = torch.randn(2**23), torch.randn(2**23)
    z = torch.empty_like(x)
    t = _seconds(lambda: torch.add(x, y, out=z))
    out["bandwidth_bytes_per_s"] = 3 * x.numel() * 4 / t
    rows = torch.randn(2**16, 64)
    out["softmax_bytes_per_s"] = 8 * rows.numel() / _seconds(lambda: torch.softmax(rows, dim=-1))
    leaf = torch.randn(64, requires_grad=True)

    def chain(k: int = 100) -> None:
        v = leaf
        for _ in range(k):
            v = v * 1.0001
    out["tiny_op_s"] = _seconds(chain) / 100
    # the per-op cost training pays: the backend's own transformer block (backend/model.py) at a size where
    # its kernels take no time, forward and backward, over the kernels the op clock counts for that block
    cfg = probe_config()
    block = TransformerBlock(cfg.model)
    x = torch.randn(cfg.training.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)

    def forward() -> None:
        block(x).sum()

    def step() -> None:
        block(x).sum().backward()
    ops = block_ops(cfg)
    f_kernels = sum(o.kernels for o in ops["F"])
    b_kernels = sum(o.kernels for phase in ("I", "W") for o in ops[phase])
    out["probe_forward_s"] = _seconds(forward)
    out["probe_block_s"] = _seconds(step)
    out["probe_kernels"] = {"forward": f_kernels, "backward": b_kernels}
    out["launch_s"] = out["probe_forward_s"] / f_kernels
    out["launch_backward_s"] = max(out["probe_block_s"] - out["probe_forward_s"], 0.0) / b_kernels
    out["recompute"] = {kind: _recompute_probe(kind) for kind in RECOMPUTE_LAUNCH}
    out["context"] = _context_probe()
    out.update(_distributed_probes())
    return out


#: the float8 GEMMs' sizes (n × n by n × n) per kernel: torch 2.13's CPU ``_scaled_mm`` with one scale a tensor runs
#: ~0.05 GFLOP/s here (a 128³ GEMM 90 ms), with a scale a row ~20
FLOAT8_SIZES = {"fp8_tensorwise": (16, 32, 48, 64), "fp8_rowwise": (32, 64, 128, 256)}


def _float8_gemms() -> dict:
    """``torch._scaled_mm`` as torchao's Float8Linear calls it (torchao.float8.float8_ops.addmm_float8_unwrapped:
    float8 e4m3 operands, the second column-major, a bf16 output), fitted as the GEMMs are (``time = F / R + c``):
    "fp8_tensorwise" with one fp32 scale a tensor (the tensorwise recipe's three GEMMs, and a rowwise recipe's gradient
    GEMMs, which run without fast accumulation: torchao then calls this kernel with unit scales and scales the output
    itself), "fp8_rowwise" with a scale a row of the first operand and a column of the second and fast accumulation (a
    rowwise recipe's forward GEMM)."""
    out = {}
    for name, sizes in FLOAT8_SIZES.items():
        rows = []
        for n in sizes:
            a = torch.randn(n, n).to(torch.float8_e4m3fn)
            b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
            if name == "fp8_tensorwise":
                sa = sb = torch.tensor(1.0)
                fast = False
            else:
                sa, sb, fast = torch.ones(n, 1), torch.ones(1, n), True
            rows.append((2.0 * n**3, _seconds(lambda a=a, b=b, sa=sa, sb=sb, fast=fast: torch._scaled_mm(
                a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast), budget_s=0.1, least=3)))
        slope, fixed = _fit_line([f for f, _ in rows], [t for _, t in rows])
        out[name] = {"sizes": list(sizes), "seconds": [t for _, t in rows], "rate_flops": 1.0 / slope,
                     "fixed_s": max(fixed, 0.0)}
    return out


def _distributed_probes() -> dict:
    """:func:`_tp_probe` and :func:`_fsdp_probe` on one fake process group of 2 ranks (torch's ``FakeStore``: every
    collective a no-op, so only what DTensor and FSDP2 run in Python and the dispatcher is left)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=PROBE_RANKS)
    try:
        mesh = init_device_mesh("cpu", (PROBE_RANKS,))
        return {"tensor_parallel": _tp_probe(mesh), "fsdp": _fsdp_probe(mesh)}
    finally:
        dist.destroy_process_group()


#: the fake process group's ranks the TP and FSDP2 probes shard over
PROBE_RANKS = 2


def _fsdp_probe(mesh) -> dict:
    """What FSDP2 adds: the probe model (2 blocks) unwrapped, then as the backend wraps it (backend.parallel.
    data_parallel.apply_fsdp: each block, then the root) resharding after forward (ZeRO-3) and not (ZeRO-2): forward,
    backward and the one-tensor AdamW step as the backend builds it; the difference over the units (forward,
    backward) and over the optimizer's aten calls (on DTensor parameters)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from backend.parallel.data_parallel import apply_fsdp
    from engine.time.step import FOR_LOOP_OPTIMIZER

    cfg = probe_config().replace(model={"layers": 2})
    out: dict = {"units": cfg.model.layers + 1, "optimizer_calls": FOR_LOOP_OPTIMIZER["adamw"][0]}
    for mode, reshard in (("plain", None), ("zero3", True), ("zero2", False)):
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        if reshard is not None:
            apply_fsdp(model, mesh, MixedPrecisionPolicy(), reshard, reshard)
        tokens = torch.randint(0, cfg.model.vocab, (cfg.training.micro_batch_size, cfg.model.seq_len))
        forward_s = _seconds(lambda model=model, tokens=tokens: model(tokens).sum())
        step_s = _seconds(lambda model=model, tokens=tokens: model(tokens).sum().backward())
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)  # the backend's one-tensor step on CPU ranks
        out[mode] = {"forward_s": forward_s, "backward_s": max(step_s - forward_s, 0.0),
                     "optimizer_s": _seconds(opt.step), "tensors": len(params)}
    return out


def _tp_probe(mesh) -> dict:
    """What DTensor adds to a TP-sharded block Linear: the probe block (4 heads over 2 KV heads, so that 2 ranks
    split it) unsharded, then sharded by the backend's own plan (backend.parallel.tensor_parallel) over 2 ranks of a
    fake process group (torch's ``FakeStore``: every collective a no-op, so only DTensor's dispatch, sharding
    propagation and redistributes in Python are left), without and with sequence parallelism; the difference over
    the block's sharded Linears (``engine.time.ops.tp_sharded_linears``), forward and backward."""
    from backend.parallel.tensor_parallel import apply_tp
    from engine.time.ops import tp_sharded_linears

    cfg = probe_config().replace(model={"heads": 4, "kv_heads": 2})
    tp = PROBE_RANKS
    out: dict = {"linears": tp_sharded_linears(cfg.replace(cluster={"gpus": tp}, parallel={"tp": tp}))}
    for mode in ("plain", "tp", "sp"):
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        if mode != "plain":
            apply_tp(model, mesh, sequence_parallel=mode == "sp")
        block = next(iter(model.layers.values()))
        seq = cfg.model.seq_len // (tp if mode == "sp" else 1)  # under SP a block takes its sequence shard
        x = torch.randn(cfg.training.micro_batch_size, seq, cfg.model.hidden, requires_grad=True)
        forward_s = _seconds(lambda block=block, x=x: block(x).sum())
        step_s = _seconds(lambda block=block, x=x: block(x).sum().backward())
        out[mode] = {"forward_s": forward_s, "backward_s": max(step_s - forward_s, 0.0)}
    return out


def _recompute_probe(kind: str) -> dict:
    """The probe block wrapped as ``training.recompute = kind`` wraps the blocks (backend.parallel.recompute):
    its forward over the forward kernels the op clock counts (``launch_s``: each forward and recomputed kernel),
    its backward less the recomputed forward's kernels at that cost over the backward's (``launch_backward_s``)."""
    cfg = probe_config().replace(training={"recompute": kind})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    apply_recompute(model, kind)
    block = next(iter(model.layers.values()))
    x = torch.randn(cfg.training.micro_batch_size, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    ops = block_ops(cfg)
    f_k = sum(o.kernels for o in ops["F"])
    r_k = sum(o.kernels for o in ops["R"])
    b_k = sum(o.kernels for phase in ("I", "W") for o in ops[phase])
    forward_s = _seconds(lambda: block(x).sum())
    step_s = _seconds(lambda: block(x).sum().backward())
    launch = forward_s / f_k
    return {"forward_s": forward_s, "block_s": step_s, "kernels": {"forward": f_k, "recomputed": r_k, "backward": b_k},
            "launch_s": launch, "launch_backward_s": max(step_s - forward_s - r_k * launch, 0.0) / b_k}


#: the in-context probe's model (:func:`_context_probe`): the tiny preset's kind of block at a shape of its own (no
#: shipped preset, no accuracy-matrix layout has it), a few blocks, one microbatch
CONTEXT_PROBE = {"preset": None, "layers": 4, "hidden": 192, "heads": 6, "kv_heads": 2, "ffn_hidden": 512, "vocab": 384,
                 "seq_len": 96}


def context_config(precision: str) -> Config:
    """The in-context probe as one rank's layout (one microbatch, no parallelism), timed by the clock from ops."""
    return default_config().replace(
        model=CONTEXT_PROBE, cluster={"gpus": 1},
        parallel={"dp": 1, "tp": 1, "pp": 1, "zero": 0, "microbatches": 1, "schedule": "1F1B"},
        training={"micro_batch_size": 1, "precision": precision, "recompute": "none"}, conventions={"clock": "ops"})


def _context_probe() -> dict:
    """A stage's compute as training runs it: the backend's Transformer (:data:`CONTEXT_PROBE`) with its loss
    (backend.train.loss_fn), forward and forward + backward, in fp32 and under bf16 autocast (a DDP rank's
    bf16-mixed). :func:`profile` divides them by the op lists' sums at the hot figures (``context_*``)."""
    from backend.train import loss_fn

    out = {}
    for name, precision in (("fp32", "fp32"), ("bf16", "bf16-mixed")):
        cfg = context_config(precision)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        tokens = torch.randint(0, cfg.model.vocab, (cfg.training.micro_batch_size, cfg.model.seq_len))
        labels = torch.randint(0, cfg.model.vocab, tokens.shape)
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")

        def forward(model=model, tokens=tokens, labels=labels, cast=cast):
            with cast:
                return loss_fn(model(tokens), labels)

        def step(model=model, forward=forward):
            model.zero_grad(set_to_none=True)
            forward().backward()
        out[name] = {"precision": precision, "forward_s": _seconds(forward), "step_s": _seconds(step)}
    return out


def probe_config() -> Config:
    """A block of the tiny preset's kind at a size where only the per-op cost is left."""
    return default_config().replace(
        model={"preset": None, "layers": 1, "hidden": 16, "heads": 2, "kv_heads": 1, "ffn_hidden": 32, "vocab": 32,
               "seq_len": 8},
        cluster={"gpus": 1}, parallel={"dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "schedule": "1F1B"},
        training={"micro_batch_size": 1}, conventions={"clock": "ops"})


def profile(raw: dict) -> dict:
    """The device profile (``engine.time.ops.DeviceProfile``'s fields) of the raw measurements, as fractions
    of the ``cpu`` preset's figures."""
    gpu = default_config().cluster.gpu  # the embedded default's GPU kind: cpu
    launch = raw["launch_s"]
    g32, g16 = raw["gemm"]["fp32"], raw["gemm"]["bf16"]
    f32 = g32["rate_flops"] / (gpu.peak_fp32_tflops * 1e12)
    f16 = g16["rate_flops"] / (gpu.peak_bf16_tflops * 1e12)
    half = max(0.0, g32["fixed_s"] - launch) * g32["rate_flops"] / 1e9
    half16 = max(0.0, g16["fixed_s"] - launch) * g16["rate_flops"] / 1e9
    # the float8 GEMMs (:func:`_float8_gemms`; a raw record of before them: bf16's rate, as the cpu preset's fp8 peak is)
    fp8 = {}
    for kind in ("fp8_tensorwise", "fp8_rowwise"):
        g = raw["gemm"].get(kind)
        if g is None:
            fp8[f"gemm_fraction_{kind}"] = f16 * gpu.peak_bf16_tflops / gpu.peak_fp8_tflops
            continue
        fp8[f"gemm_fraction_{kind}"] = g["rate_flops"] / (gpu.peak_fp8_tflops * 1e12)
        fp8[f"gemm_half_gflop_{kind}"] = max(max(0.0, g["fixed_s"] - launch) * g["rate_flops"] / 1e9, 1e-6)
    fields = {
        "gemm_fraction_bf16": f16, "gemm_fraction_fp32": f32, **fp8,
        "gemm_half_gflop": max(half, 1e-6), "gemm_half_gflop_bf16": max(half16, 1e-6),
        # attention on CPU ranks is GEMMs (eager) or SDPA's CPU kernel: the GEMM fraction stands for it
        "attention_fraction_forward": f32, "attention_fraction_backward": f32,
        "hbm_fraction": raw["bandwidth_bytes_per_s"] / (gpu.hbm_bandwidth_gb_per_s * 1e9),
        "launch_us": launch * 1e6,
        "launch_backward_us": raw["launch_backward_s"] * 1e6,
        "power_factor": 1.0,
        "softmax_fraction": raw["softmax_bytes_per_s"] / raw["bandwidth_bytes_per_s"],
        **{f"{field}_{suffix}": raw["recompute"][kind][key] * 1e6 for kind, suffix in RECOMPUTE_LAUNCH.items()
           for field, key in (("launch_us", "launch_s"), ("launch_backward_us", "launch_backward_s"))
           if kind in raw.get("recompute", {})},
        **_tp_fields(raw.get("tensor_parallel")),
        **_fsdp_fields(raw.get("fsdp")),
    }
    fields.update(_context_fields(raw.get("context"), fields))
    return fields


def _context_fields(context: dict | None, fields: dict) -> dict:
    """The profile's ``context_*`` from :func:`_context_probe`'s times: each measured forward (and backward: the step
    less the forward) over the probe's op-list sum at the profile's other figures (``fields``)."""
    from engine.time.ops import DeviceProfile, _op_durations

    if not context:
        return {}
    prof = DeviceProfile(name="cpu (hot figures)", **fields)
    out = {}
    for name, t in context.items():
        d = _op_durations(context_config(t["precision"]), prof)
        suffix = "" if name == "fp32" else "_" + name
        out["context_forward" + suffix] = t["forward_s"] / float(d.forward_s[0])
        out["context_backward" + suffix] = max(t["step_s"] - t["forward_s"], 0.0) / float(d.backward_s[0])
    return out


def _fsdp_fields(fsdp: dict | None) -> dict:
    """The profile's ``fsdp_unit_us`` … ``dtensor_optimizer_op_us`` from :func:`_fsdp_probe`'s times."""
    if not fsdp:
        return {}
    plain, z3, z2, units = fsdp["plain"], fsdp["zero3"], fsdp["zero2"], fsdp["units"]
    ops = plain["tensors"] * fsdp["optimizer_calls"]
    return {"fsdp_unit_us": max(z3["forward_s"] - plain["forward_s"], 0.0) / units * 1e6,
            "fsdp_unit_kept_us": max(z2["forward_s"] - plain["forward_s"], 0.0) / units * 1e6,
            "fsdp_unit_backward_us": max(z3["backward_s"] - plain["backward_s"], 0.0) / units * 1e6,
            "dtensor_optimizer_op_us": max(z3["optimizer_s"] - plain["optimizer_s"], 0.0) / ops * 1e6}


def _tp_fields(tp: dict | None) -> dict:
    """The profile's ``tp_linear_us`` … ``sp_linear_backward_us`` from :func:`_tp_probe`'s times (none: not measured)."""
    if not tp:
        return {}
    plain, n = tp["plain"], tp["linears"]
    return {f"{mode}_linear{suffix}_us": max(tp[mode][key] - plain[key], 0.0) / n * 1e6
            for mode in ("tp", "sp") for suffix, key in (("", "forward_s"), ("_backward", "backward_s"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the profile JSON goes")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    raw = measure()
    doc = {"gpu": "cpu", "host": socket.gethostname(), "processor": platform.processor() or platform.machine(),
           "measured": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
           "seconds": round(time.perf_counter() - t0, 1), "profile": profile(raw), "raw": raw}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(out)
    print(json.dumps(doc["profile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
