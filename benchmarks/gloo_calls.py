"""gloo's collectives as training calls them on this machine's CPU ranks: each rank does ``c`` ms of its own CPU work,
then the call, every rank at once, no barrier (``benchmarks/clocks.md``, session 38). Prints, per work length, group
size and collective, the seconds a call adds to the work alone (medians of ``R`` repeats of ``K`` iterations), for
engine.time.comm's rules to be checked against.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/gloo_calls.py          (2, 4 or 8 ranks; ~1 min at 4)

Groups: the world, and (4 ranks or more) pairs of consecutive ranks. Environment: ``C`` the work lengths in ms
(default "0.3 1 3"), ``K`` iterations (30), ``R`` repeats (3), ``BYTES`` the buffer (65536: the tiny preset's
activation)."""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backend.linkbench_worker import pair_exchange  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's notes on the *_tensor names
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    groups = {world: dist.group.WORLD}
    if world >= 4:
        for s in range(0, world, 2):
            g = dist.new_group([s, s + 1])
            if s <= rank < s + 2:
                groups[2] = g
    a = torch.randn(128, 128)

    def work(ms: float) -> None:
        end = time.thread_time() + ms / 1e3  # this rank's CPU time: the same work however the cores are shared
        while time.thread_time() < end:
            torch.mm(a, a)

    k, repeats = int(os.environ.get("K", 30)), int(os.environ.get("R", 3))
    elems = int(os.environ.get("BYTES", 65536)) // 4
    rows = []
    for c in (float(x) for x in os.environ.get("C", "0.3 1 3").split()):
        for n, g in sorted(groups.items()):
            full, part = torch.ones(elems // n * n), torch.empty(elems // n)
            a2a_out = torch.empty_like(full)
            calls = {"none": lambda: None,
                     "all_reduce": lambda full=full, g=g: dist.all_reduce(full, group=g),
                     "all_gather": lambda full=full, part=part, g=g: dist.all_gather_into_tensor(full, part, group=g),
                     "reduce_scatter": lambda full=full, part=part, g=g: dist.reduce_scatter_tensor(part, full, group=g),
                     "all_to_all": lambda full=full, out=a2a_out, g=g: dist.all_to_all_single(out, full, group=g)}
            if n == 2:
                calls["p2p"] = lambda part=part: pair_exchange(part, rank)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(repeats):
                for name, fn in calls.items():
                    fn()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(k):
                        work(c)
                        fn()
                    dist.barrier()
                    times[name].append((time.perf_counter() - t0) / k)
            for name in calls:
                if name != "none":
                    extra = statistics.median(x - y for x, y in zip(times[name], times["none"]))
                    rows.append((c, n, name, extra))
    if rank == 0:
        print(f"{world} ranks on {os.cpu_count()} cores, {elems * 4} B buffers")
        print("work_ms  group  collective       ms_a_call")
        for c, n, name, extra in rows:
            print(f"{c:7g}  {n:5d}  {name:15s}  {extra * 1e3:9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
