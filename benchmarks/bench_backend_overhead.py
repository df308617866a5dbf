"""Overhead of a backend run vs a plain hand-written torchrun DDP script on the same model.

    .venv/bin/python benchmarks/bench_backend_overhead.py [--steps 20] [--ranks 2] [--repeats 1]

Both train the tiny preset with DDP, AdamW, fp32, the same synthetic data and batch; both
time each step the same way (after a barrier, perf_counter around forward+backward+step).
Reports the median step time of each (steps after the first), the ratio backend / plain, and
the whole wall time of each launch (torchrun start to exit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PLAIN = r'''
import json, os, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from engine import default_config
from backend.model import Transformer, SyntheticData
steps, mbs = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
spec = default_config().model
torch.manual_seed(0)
model = DDP(Transformer(spec), broadcast_buffers=False)
opt = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95), weight_decay=0.0)
data = SyntheticData(spec.vocab, spec.seq_len)
times = []
for k in range(1, steps + 1):
    x, y = data.batch(k, rank, mbs)
    dist.barrier()
    t0 = time.perf_counter_ns()
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append((time.perf_counter_ns() - t0) / 1e9)
if rank == 0:
    print("PLAIN_TIMES " + json.dumps(times))
dist.barrier(); del model, opt; dist.destroy_process_group()
'''


def run_plain(steps: int, ranks: int, mbs: int) -> tuple[list[float], float]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PLAIN)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={ranks}", f.name, str(steps), str(mbs)],
                         capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    wall = time.monotonic() - t0
    os.unlink(f.name)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PLAIN_TIMES ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"plain script failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1]), wall


def run_backend(steps: int, ranks: int, mbs: int) -> tuple[list[float], float]:
    from backend.launch import launch
    from engine import default_config

    cfg = default_config().replace(cluster={"gpus": ranks},
                                   parallel={"dp": ranks, "pp": 1, "microbatches": 1},
                                   training={"micro_batch_size": mbs})
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        run = launch(cfg, Path(d) / "run", steps=steps, timeout_s=600)
        res = run.wait()
        wall = time.monotonic() - t0
        if res["event"] != "finished":
            raise SystemExit(f"backend run failed: {res['reason']}\n{res.get('log_tail')}")
        meas = run.measurement()
        rank0 = next(r for r in meas.ranks if r["rank"] == 0)
        return rank0["step_seconds"], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    plain_med, back_med, plain_wall, back_wall = [], [], [], []
    for _ in range(args.repeats):
        t, w = run_plain(args.steps, args.ranks, args.micro_batch_size)
        plain_med.append(statistics.median(t[1:]))
        plain_wall.append(w)
        t, w = run_backend(args.steps, args.ranks, args.micro_batch_size)
        back_med.append(statistics.median(t[1:]))
        back_wall.append(w)
    p, b = statistics.median(plain_med), statistics.median(back_med)
    pw, bw = statistics.median(plain_wall), statistics.median(back_wall)
    print(json.dumps({
        "ranks": args.ranks, "steps": args.steps, "repeats": args.repeats,
        "plain_step_s": round(p, 5), "backend_step_s": round(b, 5), "step_ratio": round(b / p, 3),
        "plain_wall_s": round(pw, 2), "backend_wall_s": round(bw, 2), "wall_ratio": round(bw / pw, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
