"""Integration: every strategy runs as real torchrun ranks on CPU/gloo, and is measured per rank.

Each run is the tiny preset, a few steps, seconds long. Byte checks use fp32 + AdamW, where a
parameter costs 4 bytes, its gradient 4 and its optimizer state 8 (exp_avg, exp_avg_sq).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import default_config
from engine.names import MEMORY_CATEGORIES
from engine.predict import predict

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")

from test_backend_model import expected_params  # noqa: E402

from backend.launch import launch  # noqa: E402

TINY = default_config().model
FULL = expected_params(TINY)
NORM_PARAMS = TINY.hidden * (2 * TINY.layers + 1)  # replicated across TP ranks (RMSNorm weights)
KEYS = {"rank", "stage", *MEMORY_CATEGORIES, "total"}


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command (state, ppid, pgrp, session, ...); None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as s:
            fields = s.read().rsplit(") ", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def processes_of(run) -> list[int]:
    """Live processes of a launched run: those whose command line names its directory (an agent or ranks
    started as fresh interpreters), the agent, the ranks it recorded, and every process in their sessions
    or descended from them (an agent forked from backend.launch's fork server, and the ranks it forks,
    carry the fork server's command line)."""
    needle = str(Path(run.path).resolve()).encode()
    roots = {p for p in (getattr(run.proc, "pid", None), *run._worker_pids.values()) if p}
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            stats[int(d)] = st
    pids = set()
    for pid, st in stats.items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                named = needle in f.read()
        except OSError:
            continue
        if named or pid in roots or int(st[3]) in roots:  # st[3]: the session id
            pids.add(pid)
    grown = True
    while grown:  # their descendants
        more = {pid for pid, st in stats.items() if int(st[1]) in pids} - pids
        pids |= more
        grown = bool(more)
    return sorted(p for p in pids if _stat(p) is not None)


def run_ok(tmp_path, steps=3, timeout_s=150, **sections):
    cfg = default_config().replace(**sections)
    run = launch(cfg, tmp_path / "run", steps=steps, timeout_s=timeout_s)
    events = list(run.events())
    res = run.wait()
    assert res["event"] == "finished", f"{res.get('reason')}\n{res.get('log_tail')}"
    assert processes_of(run) == []
    meas = run.measurement()
    assert len(meas.memory.per_rank) == cfg.parallel.world_size
    for row in meas.memory.per_rank:
        assert set(vars(row)) == KEYS
        assert row.total == sum(getattr(row, c) for c in MEMORY_CATEGORIES)
        assert row.activations > 0
    assert len(meas.step.losses) == steps
    return cfg, meas, events


def col(meas, key):
    return [getattr(r, key) for r in meas.memory.per_rank]


def exact(meas, key):
    """The exact local bytes of params / grads / optimizer each rank recorded (``memory.exact``): the
    measured grads category is what the tracker saw at its peak, which under FSDP2 may precede some or
    all of the sharded gradients (each unit's post-backward makes its own)."""
    return [r["memory"]["exact"][key] for r in meas.ranks]


def test_ddp_two_ranks_records_and_exact_bytes(tmp_path):
    cfg, meas, events = run_ok(tmp_path, steps=4, cluster={"gpus": 2},
                               parallel={"dp": 2, "pp": 1, "microbatches": 1})
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-2:] == ["measurement", "finished"]
    assert kinds.count("rank_ready") == 2
    steps = [e for e in events if e["event"] == "step"]
    assert [e["k"] for e in steps] == [1, 2, 3, 4] and all(e["seconds"] > 0 for e in steps)
    assert meas.step.losses[-1] < meas.step.losses[0] - 0.5  # the loss falls
    assert col(meas, "params") == [4 * FULL] * 2
    assert exact(meas, "grads") == [4 * FULL] * 2
    # at the peak (the loss, before the backward makes any): what the engine holds there
    assert col(meas, "grads") == [r.grads for r in predict(cfg).memory.per_rank]
    assert col(meas, "optimizer") == [8 * FULL] * 2
    assert col(meas, "comm_buffers") == [4 * FULL] * 2  # DDP buckets
    run = tmp_path / "run"
    for name in ("config.toml", "events.jsonl", "measurement.json", "logs/rank0.log", "logs/rank1.log"):
        assert (run / name).exists(), name
    on_disk = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert on_disk == kinds
    detail = meas.ranks[0]
    # PyTorch's own tracker agrees with the exact count of parameter bytes
    assert detail["memory"]["tracker_peak"]["Parameter"] == 4 * FULL
    assert detail["peak_rss_bytes"] > 0


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_shard_what_they_promise(tmp_path, zero):
    training = {"recompute": "full"} if zero == 3 else {}
    _, meas, _ = run_ok(tmp_path, cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1, "zero": zero},
                        training=training)
    opt = col(meas, "optimizer")
    assert sum(opt) == 8 * FULL and max(opt) < 8 * FULL  # optimizer state sharded in every stage
    if zero == 1:
        assert col(meas, "params") == [4 * FULL] * 2 and exact(meas, "grads") == [4 * FULL] * 2
    else:  # fully_shard: params and grads sharded evenly over dp = 2
        assert exact(meas, "grads") == [2 * FULL] * 2 and col(meas, "params") == [2 * FULL] * 2
        assert all(g <= 2 * FULL for g in col(meas, "grads"))  # at the peak: those made by then
        assert all(c > 0 for c in col(meas, "comm_buffers"))  # all-gathered parameters
    assert min(meas.step.losses[1:]) < meas.step.losses[0]


def reference_losses(steps: int, microbatches: int, micro_batch_size: int, model_spec=TINY) -> list[float]:
    """The same training on one process, no parallelism: what every layout must reproduce."""
    import torch.nn.functional as F

    from backend.model import SyntheticData, Transformer
    from backend.train import LEARNING_RATE, SEED

    torch.manual_seed(SEED)
    model = Transformer(model_spec)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)
    data = SyntheticData(model_spec.vocab, model_spec.seq_len)
    out = []
    for k in range(1, steps + 1):
        x, y = data.batch(k, 0, microbatches * micro_batch_size)
        total = 0.0
        for i in range(microbatches):
            sl = slice(i * micro_batch_size, (i + 1) * micro_batch_size)
            loss = F.cross_entropy(model(x[sl]).flatten(0, 1), y[sl].flatten()) / microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def test_tp_with_sequence_parallel_matches_single_rank_losses(tmp_path):
    cfg, meas, _ = run_ok(tmp_path, cluster={"gpus": 2},
                          parallel={"dp": 1, "tp": 2, "pp": 1, "microbatches": 2, "sequence_parallel": True},
                          training={"recompute": "selective"})
    assert sum(col(meas, "params")) == 4 * (FULL + NORM_PARAMS)  # norms replicated, the rest sharded
    assert col(meas, "optimizer") == [2 * p for p in col(meas, "params")]
    ref = reference_losses(3, 2, cfg.training.micro_batch_size)
    assert meas.step.losses == pytest.approx(ref, rel=1e-4)
    # loss_parallel's backward holds three fp32 vocabulary shards (torch's
    # _nll_loss_and_log_softmax_backward: zeros_like, exp, their sum) and the head saves its input
    # gathered from the sequence shards; with two, and the shard, the engine missed a third of these
    # temporaries (tiny, b 4: 512 KiB of 776 KiB measured)
    from engine.memory import memory_per_rank

    predicted = memory_per_rank(cfg).per_rank
    for r, measured in enumerate(meas.ranks):
        got = measured["memory"]["categories"]
        assert predicted[r].temporaries == pytest.approx(got["temporaries"], rel=0.03), r
        assert predicted[r].activations == pytest.approx(got["activations"], rel=0.01), r


def test_qwen3s_qk_norm_under_tp_matches_single_rank_losses(tmp_path):
    """Qwen3's q and k norms act on each TP rank's own heads: their weights replicate over TP and their
    partial gradients are summed over it (SequenceParallel over the heads dim, as torchtitan's Qwen3
    plan). TP 2 with sequence parallelism trains as one process does; each rank's activations are the
    engine's, within 1 %, and its parameters exactly the sharded ones plus the replicated norms."""
    cfg, meas, _ = run_ok(tmp_path, model={"qk_norm": True}, cluster={"gpus": 2},
                          parallel={"dp": 1, "tp": 2, "pp": 1, "microbatches": 2, "sequence_parallel": True})
    ref = reference_losses(3, 2, cfg.training.micro_batch_size, cfg.model)
    assert meas.step.losses == pytest.approx(ref, rel=1e-4)
    from engine.memory import memory_per_rank

    predicted = memory_per_rank(cfg).per_rank
    for r, measured in enumerate(meas.ranks):
        got = measured["memory"]["categories"]
        assert predicted[r].activations == pytest.approx(got["activations"], rel=0.01), r
        assert measured["memory"]["exact"]["params"] == predicted[r].params, r


def test_zero1_with_tp_partitions_the_states_and_trains_as_zero0(tmp_path):
    """ZeroRedundancyOptimizer refuses DTensor parameters; the backend's TensorParallelZeRO1 partitions
    each TP shard's tensors over dp as it would (whole tensors, largest first, to the least-loaded
    dp-rank) and broadcasts them after its step: the same losses as ZeRO-0, each rank's optimizer state
    its share (the engine's, exactly), the dp-ranks' shares summing to ZeRO-0's state."""
    par = {"dp": 2, "tp": 2, "pp": 1, "microbatches": 2}
    cfg, meas, _ = run_ok(tmp_path / "z1", cluster={"gpus": 4}, parallel={**par, "zero": 1})
    _, base, _ = run_ok(tmp_path / "z0", cluster={"gpus": 4}, parallel={**par, "zero": 0})
    assert meas.step.losses == pytest.approx(base.step.losses, rel=1e-5)
    from engine.memory import memory_per_rank

    predicted = memory_per_rank(cfg).per_rank
    opt, opt0 = exact(meas, "optimizer"), exact(base, "optimizer")
    assert opt == [r.optimizer for r in predicted]
    for tp_rank in range(2):  # ranks tp_rank and 2 + tp_rank hold the same TP shard: their shares add up
        assert opt[tp_rank] + opt[2 + tp_rank] == opt0[tp_rank]
    assert 0 < min(opt)


def test_fsdp_by_tp_two_dimensional(tmp_path):
    _, meas, _ = run_ok(tmp_path, cluster={"gpus": 4}, parallel={"dp": 2, "tp": 2, "pp": 1, "zero": 3,
                                                                  "microbatches": 1})
    assert sum(col(meas, "params")) == 4 * (FULL + NORM_PARAMS)
    assert exact(meas, "grads") == col(meas, "params")
