"""Legacy nn.DataParallel in the backend: the launcher starts ONE process for it, the process refuses
where fewer than two CUDA GPUs exist (this machine), and — on a machine with two — trains and writes
one measurement row per GPU. The CUDA run itself is skipped here (no GPU); the rest is checked."""

from __future__ import annotations

import pytest

from engine import default_config

torch = pytest.importorskip("torch")

PSI = 1_607_808  # tiny preset parameters


def legacy(n=2, **parallel):
    return default_config().replace(cluster={"gpus": n},
                                    parallel={"dp": n, "pp": 1, "microbatches": 1, "dp_mode": "dataparallel",
                                              **parallel})


def test_launcher_starts_one_process_for_dataparallel_and_one_per_rank_otherwise():
    from backend.launch import processes_for

    assert processes_for(legacy(2)) == 1
    assert processes_for(legacy(4)) == 1
    assert processes_for(legacy(2).replace(parallel={"dp_mode": "ddp"})) == 2
    assert processes_for(default_config()) == default_config().parallel.world_size


def test_refusal_needs_two_cuda_gpus_and_dp_of_them():
    from backend.parallel.data_parallel import dataparallel_refusal

    for have in (0, 1):
        why = dataparallel_refusal(legacy(2), have)
        assert "nn.DataParallel" in why and f"has {have} CUDA GPU(s)" in why and "dp_mode = 'ddp'" in why
    assert "at least 4" in dataparallel_refusal(legacy(4), 2)
    assert dataparallel_refusal(legacy(2), 2) is None
    assert dataparallel_refusal(legacy(4), 8) is None


def test_check_supported_lets_dataparallel_through_where_two_gpus_exist(monkeypatch):
    from backend import train

    with pytest.raises(NotImplementedError, match="nn.DataParallel"):
        monkeypatch.setattr(train.torch.cuda, "device_count", lambda: 1)
        train.check_supported(legacy(2))
    monkeypatch.setattr(train.torch.cuda, "device_count", lambda: 2)
    train.check_supported(legacy(2))  # no refusal


def test_rows_split_each_gpu_peak_into_categories_hand_worked():
    from backend.parallel.data_parallel import dataparallel_rows

    exact = {"params": 400, "grads": 400, "optimizer": 800}
    # GPU 0: before = params + optimizer + 16 B of buffers; forward adds 1,000; the peak 2,000 above that
    # GPU 1: before 0; forward adds the 400 B replica copy + 700 B of activations; the peak 900 above that
    rows = dataparallel_rows(before=[1_216, 0], after_forward=[2_216, 1_100], peak=[4_216, 2_000], exact=exact,
                             replica_param_bytes=400)
    g0, g1 = rows
    assert g0 == {"params": 400, "grads": 400, "optimizer": 800, "activations": 1_000, "comm_buffers": 0,
                  "temporaries": 2_000 - 400, "overhead": 16}
    assert g1 == {"params": 400, "grads": 0, "optimizer": 0, "activations": 700, "comm_buffers": 0,
                  "temporaries": 900, "overhead": 0}
    assert sum(g0.values()) == 4_216 and sum(g1.values()) == 2_000  # each row sums to that GPU's peak


def test_dataparallel_batch_is_the_ddp_ranks_microbatches_side_by_side():
    """Microbatch i fed to nn.DataParallel = [dp-rank 0's microbatch i, dp-rank 1's ...]: its scatter
    hands GPU d exactly what DDP rank d would train on, so the losses follow DDP's."""
    from backend.model import SyntheticData
    from backend.train import Trainer

    cfg = legacy(2, microbatches=2)
    t = Trainer.__new__(Trainer)
    t.cfg, t.legacy, t.gpus, t.device = cfg, True, 2, torch.device("cpu")
    t.data = SyntheticData(cfg.model.vocab, cfg.model.seq_len)
    mbs = cfg.training.micro_batch_size
    t.local_batch = 2 * mbs
    x, y = t.batch(3)
    assert t.microbatch_rows == 2 * mbs and x.shape == (2 * 2 * mbs, cfg.model.seq_len)
    r0, r1 = (t.data.batch(3, d, 2 * mbs) for d in (0, 1))
    expect = torch.cat([r0[0][:mbs], r1[0][:mbs], r0[0][mbs:], r1[0][mbs:]])
    assert torch.equal(x, expect)
    assert torch.equal(y, torch.cat([r0[1][:mbs], r1[1][:mbs], r0[1][mbs:], r1[1][mbs:]]))


@pytest.mark.integration
def test_dataparallel_launches_one_process_and_is_refused_without_two_gpus(tmp_path):
    from backend.events import describe
    from backend.launch import launch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two CUDA GPUs: the run is not refused")
    run = launch(legacy(2), tmp_path / "run", steps=1, timeout_s=120)
    events = list(run.events())
    started = events[0]
    assert started["event"] == "started" and started["world"] == 2 and started["processes"] == 1
    assert "--nproc-per-node=1" in started["command"]
    assert "1 process driving 2 GPUs" in describe(started)
    res = run.wait()
    assert res["event"] == "failed" and res["rank"] == 0
    assert "nn.DataParallel" in res["reason"] and "dp_mode = 'ddp'" in res["reason"], res["reason"]
    assert not (run.path / "ranks" / "rank1.events.jsonl").exists()  # one process, one event stream


@pytest.mark.integration
def test_dataparallel_trains_on_two_cuda_gpus_with_gpu0_heavier(tmp_path):  # pragma: no cover - needs 2 GPUs
    from backend.launch import launch

    if torch.cuda.device_count() < 2:
        pytest.skip("nn.DataParallel needs two CUDA GPUs; this machine has fewer")
    run = launch(legacy(2), tmp_path / "run", steps=4, timeout_s=300)
    res = run.wait()
    assert res["event"] == "finished", f"{res.get('reason')}\n{res.get('log_tail')}"
    meas = run.measurement()
    g0, g1 = meas.memory.per_rank
    assert (g0.params, g0.grads, g0.optimizer) == (4 * PSI, 4 * PSI, 8 * PSI)  # fp32 AdamW, all on GPU 0
    assert (g1.grads, g1.optimizer) == (0, 0) and g1.params == 4 * PSI  # the broadcast replica
    assert g0.total > g1.total
    assert meas.step.losses[-1] < meas.step.losses[0]
