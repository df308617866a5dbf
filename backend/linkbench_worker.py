"""One rank of the link micro-benchmark: ``python -m backend.linkbench_worker --out DIR``.

Started by :mod:`backend.linkbench` under torchrun (gloo on CPU, NCCL on GPUs). Every rank
times, with every other rank doing the same at the same moment (so oversubscribed cores and
shared links are measured as the training sees them):

* ``all_reduce``, ``all_gather``, ``reduce_scatter`` over groups of 2 consecutive ranks and
  over the whole world, for a sweep of buffer sizes S (S = the whole buffer, the gathered
  output for all-gather, the input for reduce-scatter: ``engine.time.comm``'s convention);
* ``p2p``: one send from each even rank to the next odd rank (all pairs at once);
* a matmul per rank, fp32 and bf16, at a small (model-like) and a large shape;
* on CPU ranks, the same collectives *as training pays them* (``"mode": "busy"``): each call follows
  ``--busy-work-ms`` of this rank's own CPU work, with no barrier, as a training step calls a
  collective after its compute; a sample is the wall time of ``work + call`` less that of ``work``
  alone, the two timed back to back over the same iterations. Idle ranks' gloo threads and a core
  shared with other ranks' compute are then woken, where the barrier's samples find them awake: on a
  2-core machine (2026-12-04) a ring step cost 0.7–2.1 ms busy at 2 ranks against 0.1–0.3 ms synced,
  and 2–12 ms at 4 and 8 ranks sharing the cores.

Each timed call is preceded by a barrier of its group; a sample is the slowest rank's time of
that call, and the result per (collective, group size, S) is the median of the samples. Rank 0
writes ``links_raw.json`` into DIR; the launcher fits α and β from it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def pair_exchange(buf, rank: int) -> None:
    """One point-to-point transfer within a pair of consecutive ranks: the even rank sends ``buf`` to the next one,
    which receives it (every pair at once)."""
    import torch.distributed as dist

    if rank % 2 == 0:
        dist.send(buf, rank + 1)
    else:
        dist.recv(buf, rank - 1)


def _bench(args) -> dict:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        backend = "gloo"
    rank, world = dist.get_rank(), dist.get_world_size()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # groups: pairs of consecutive ranks, and the world (every rank calls new_group for each)
    groups: dict[int, object] = {}
    if world >= 4 and world % 2 == 0:
        for start in range(0, world, 2):
            g = dist.new_group(list(range(start, start + 2)))
            if start <= rank < start + 2:
                groups[2] = g
    if world >= 2:
        groups[world] = dist.group.WORLD
    sizes = [int(s) for s in args.sizes]
    samples: list[dict] = []

    def timed(fn, group, reps: int) -> list[float]:
        out = []
        for i in range(reps + args.warmup):
            dist.barrier(group=group)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                out.append(dt)
        return out

    for n, group in sorted(groups.items()):
        for size in sizes:
            reps = args.reps if size <= 2**20 else max(3, args.reps // 2)
            elems = max(n, size // 4 // n * n)  # fp32, divisible by n
            full = torch.ones(elems, dtype=torch.float32, device=device)
            part = torch.empty(elems // n, dtype=torch.float32, device=device)
            cases = {
                "all_reduce": lambda full=full, group=group: dist.all_reduce(full, group=group),
                "all_gather": lambda full=full, part=part, group=group: dist.all_gather_into_tensor(full, part,
                                                                                                    group=group),
                "reduce_scatter": lambda full=full, part=part, group=group: dist.reduce_scatter_tensor(part, full,
                                                                                                       group=group),
            }
            for kind, fn in cases.items():
                samples.append({"kind": kind, "n": n, "bytes": elems * 4, "seconds": timed(fn, group, reps)})
    if world >= 2 and world % 2 == 0:
        pair = groups.get(2, dist.group.WORLD)
        for size in sizes:
            reps = args.reps if size <= 2**20 else max(3, args.reps // 2)
            buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)

            def one(buf=buf):
                pair_exchange(buf, rank)

            samples.append({"kind": "p2p", "n": 2, "bytes": buf.numel() * 4, "seconds": timed(one, pair, reps)})

    if device.type == "cpu" and args.busy_work_ms > 0:  # the same calls as training pays them
        samples += _busy_samples(args, groups, sizes, rank, world)
    # matmul FLOP/s per rank, every rank at once
    matmul = []
    shapes = [(128, 128, 352), (512, 512, 512)]
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            for _ in range(3):
                a @ b
            dist.barrier()
            sync()
            iters, t0 = 0, time.perf_counter()
            while True:
                for _ in range(8):
                    a @ b
                sync()
                iters += 8
                dt = time.perf_counter() - t0
                if dt >= args.matmul_seconds:
                    break
            matmul.append({"dtype": str(dtype).replace("torch.", ""), "shape": [m, k, n],
                           "flops_per_s": 2.0 * m * k * n * iters / dt})

    every = [None] * world
    dist.all_gather_object(every, {"samples": samples, "matmul": matmul})
    result = None
    if rank == 0:
        merged = []
        for j, s in enumerate(samples):
            per_rank = [e["samples"][j]["seconds"] for e in every]
            slowest = [max(t) for t in zip(*per_rank)]  # one sample = the slowest rank's time of that call
            merged.append({**s, "seconds": slowest})
        mm = []
        for j, x in enumerate(matmul):
            rates = [e["matmul"][j]["flops_per_s"] for e in every]
            mm.append({**x, "flops_per_s_per_rank": rates})
            mm[-1].pop("flops_per_s")
        result = {"backend": backend, "world": world, "device": device.type,
                  "torch": torch.__version__, "samples": merged, "matmul": mm,
                  "threads": torch.get_num_threads()}
    dist.barrier()
    dist.destroy_process_group()
    return result


def _busy_samples(args, groups: dict, sizes: list[int], rank: int, world: int) -> list[dict]:
    """The collectives as training pays them on CPU ranks (module docstring): per (collective, group, size),
    ``reps`` samples, each the wall seconds per iteration of ``--busy-iters`` iterations of work then the
    call, less the same iterations of work alone (run just before)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(128, 128)
    work_s = args.busy_work_ms / 1e3

    def work() -> None:
        end = time.thread_time() + work_s  # this rank's CPU time: the same work however the cores are shared
        while time.thread_time() < end:
            torch.mm(a, a)

    def per_iter(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(args.busy_iters):
            work()
            fn()
        return (time.perf_counter() - t0) / args.busy_iters

    out = []
    busy_sizes = [s for s in sizes if 2**13 <= s <= 2**21]
    cases: list[tuple[str, int, object, int]] = []  # (collective, bytes, call, group size)
    for n, group in sorted(groups.items()):
        for size in busy_sizes:
            elems = max(n, size // 4 // n * n)
            full, part = torch.ones(elems), torch.empty(elems // n)
            cases += [
                ("all_reduce", elems * 4, lambda full=full, group=group: dist.all_reduce(full, group=group), n),
                ("all_gather", elems * 4, lambda full=full, part=part, group=group:
                 dist.all_gather_into_tensor(full, part, group=group), n),
                ("reduce_scatter", elems * 4, lambda full=full, part=part, group=group:
                 dist.reduce_scatter_tensor(part, full, group=group), n),
            ]
    if world % 2 == 0:
        for size in busy_sizes:
            buf = torch.ones(max(1, size // 4))

            def one(buf=buf):
                pair_exchange(buf, rank)
            cases.append(("p2p", buf.numel() * 4, one, 2))
    for kind, nbytes, fn, n in cases:
        fn()  # warm
        dist.barrier()
        seconds = []
        for _ in range(args.busy_reps):
            alone = per_iter(lambda: None)
            seconds.append(max(per_iter(fn) - alone, 1e-6))  # the fit divides by it
        out.append({"kind": kind, "n": n, "bytes": nbytes, "seconds": seconds, "mode": "busy"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", nargs="+", default=[2**10, 2**13, 2**16, 2**19, 2**21, 2**23])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--matmul-seconds", type=float, default=0.3)
    ap.add_argument("--busy-work-ms", type=float, default=3.0, help="CPU work before each busy call (0: none)")
    ap.add_argument("--busy-iters", type=int, default=6)
    ap.add_argument("--busy-reps", type=int, default=3)
    args = ap.parse_args(argv)
    _die_with_parent()
    result = _bench(args)
    if result is not None:
        tmp = os.path.join(args.out, "links_raw.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(args.out, "links_raw.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
