"""Step time: composition, breakdown, MFU, and hand-worked layout comparisons (TP across nodes, ZeRO-3 traffic, PP vs TP)."""

import pytest

from engine import Config
from engine.time.durations import StageDurations
from engine.time.step import BREAKDOWN_KEYS, step_time


def make(cluster="dgx-h100", model="llama2-7b", gpus=None, training=None, **par):
    par = {"dp": 1, "tp": 1, "pp": 1, **par}
    c = {"preset": cluster, "gpus": gpus or par["dp"] * par["tp"] * par["pp"]}
    return Config.from_dict({"model": {"preset": model}, "cluster": c, "parallel": par,
                             "training": training or {}})


@pytest.mark.parametrize("par", [
    {"dp": 8}, {"dp": 8, "zero": 3}, {"tp": 8, "sequence_parallel": True}, {"pp": 4, "dp": 2, "microbatches": 8},
    {"pp": 2, "tp": 2, "dp": 2, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 4},
    {"pp": 2, "dp": 4, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 4, "zero": 1},
])
def test_breakdown_sums_to_the_step(par):
    st = step_time(make(**par))
    assert set(st.breakdown) == set(BREAKDOWN_KEYS)
    assert sum(st.breakdown.values()) == pytest.approx(st.seconds, rel=1e-9)
    assert all(v >= -1e-12 for v in st.breakdown.values())
    assert 0 < st.mfu <= st.hfu < 1


def test_tp16_across_an_ordinary_network_is_slower_than_tp8_in_a_node():
    tp8 = step_time(make("h100-ethernet-16", tp=8, gpus=8))
    tp16 = step_time(make("h100-ethernet-16", tp=16, gpus=16))
    assert tp16.seconds > tp8.seconds
    assert tp16.breakdown["tp_comm"] > 5 * tp8.breakdown["tp_comm"]


def test_single_gpu_step_is_compute_plus_optimizer_hand_worked():
    cfg = make(model="gpt2-124m", cluster="dgx-h100", gpus=1).replace(conventions={"clock": "efficiency"})
    st = step_time(cfg)
    assert st.breakdown["pipeline_bubble"] == pytest.approx(0.0, abs=1e-12)
    assert st.breakdown["dp_comm_exposed"] == 0.0 and st.breakdown["tp_comm"] == 0.0
    # optimizer: AdamW, bf16-mixed, bf16 grads: read g(2)+master(4)+m,v(8); write master(4)+m,v(8)+bf16 copy(2) = 28 B
    assert st.optimizer_s == pytest.approx(124_439_808 * 28 / 3350e9)
    # compute: 3 × forward FLOPs per token × tokens / (peak × efficiency)
    tokens = 1024
    fl = 3 * (12 * (2 * 768 * (768 + 2 * 768) + 2 * 768 * 768 + 4 * 1024 * 768 + 2 * 768 * 3072 * 2)
              + 2 * 768 * 50257)
    assert st.breakdown["compute"] == pytest.approx(tokens * fl / (989e12 * 0.5))
    assert st.model_flops == pytest.approx(tokens * fl)


def test_recompute_costs_time_and_raises_hfu_not_mfu():
    plain = step_time(make(dp=8))
    full = step_time(make(dp=8, training={"recompute": "full"}))
    assert full.seconds > plain.seconds
    assert full.model_flops == plain.model_flops and full.hardware_flops > plain.hardware_flops


def test_measured_durations_replace_the_analytic_ones():
    cfg = make(pp=4, dp=2, microbatches=8, cluster="dgx-h100")
    d = StageDurations.uniform(4, 0.01, 0.01, 0.01, 0.0)
    st = step_time(cfg, durations=d)
    # GPipe/1F1B with F = 0.01, B = 0.02, no transfer: makespan (m + p - 1)(F + B)
    assert st.timeline.makespan_s == pytest.approx((8 + 3) * 0.03)


def test_exposed_dp_communication_grows_on_a_slow_network():
    fast = step_time(make("h100-pod-64", dp=64, gpus=64))
    slow = step_time(make("h100-ethernet-16", dp=16, gpus=16))
    assert slow.breakdown["dp_comm_exposed"] > fast.breakdown["dp_comm_exposed"]
