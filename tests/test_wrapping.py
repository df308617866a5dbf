"""The wrapping plan: one decision of wrapper and precision per config, read by engine and backend."""

import pytest

from engine import Config
from engine.wrapping import DATA_PARALLEL_WRAPPERS, MIXED_PRECISION_KINDS, wrapping_plan


def cfg(dp=1, tp=1, pp=1, zero=0, precision="bf16-mixed", replicate=1, dp_mode="ddp", grad="bf16"):
    return Config.from_dict({
        "model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": dp * tp * pp},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "replicate": replicate, "dp_mode": dp_mode,
                     "microbatches": 4},
        "training": {"precision": precision, "grad_dtype": "fp32" if precision == "fp32" else grad}})


@pytest.mark.parametrize(("kw", "wrapper", "mixed"), [
    ({}, "none", "autocast"),
    ({"dp": 4}, "ddp", "autocast"),
    ({"dp": 4, "zero": 1}, "ddp", "autocast"),
    ({"dp": 4, "zero": 2}, "fully_shard", "fsdp2-policy"),
    ({"dp": 4, "zero": 3}, "fully_shard", "fsdp2-policy"),
    ({"dp": 1, "zero": 3}, "fully_shard", "fsdp2-policy"),
    # dp × tp: FSDP2's replicate holds DTensors, and its policy casts — never autocast on top
    ({"dp": 2, "tp": 2}, "replicate", "fsdp2-policy"),
    ({"tp": 2}, "none", "autocast"),
    ({"dp": 2, "dp_mode": "dataparallel"}, "dataparallel", "autocast"),
    ({"dp": 2, "tp": 2, "precision": "fp32"}, "replicate", "none"),
    ({"dp": 4, "precision": "fp32"}, "ddp", "none"),
])
def test_wrapper_and_precision(kw, wrapper, mixed):
    plan = wrapping_plan(cfg(**kw))
    assert plan.data_parallel == wrapper and plan.mixed_precision == mixed
    assert plan.data_parallel in DATA_PARALLEL_WRAPPERS and plan.mixed_precision in MIXED_PRECISION_KINDS
    assert not (plan.autocast and plan.fsdp2)
    assert plan.describe()


def test_reshard_policy_and_hsdp():
    z3 = wrapping_plan(cfg(dp=4, zero=3))
    assert (z3.reshard_after_forward, z3.root_reshard_after_forward, z3.hsdp) == (True, True, False)
    z3pp = wrapping_plan(cfg(dp=2, pp=2, zero=3))
    assert (z3pp.reshard_after_forward, z3pp.root_reshard_after_forward) == (True, False)
    z2 = wrapping_plan(cfg(dp=4, zero=2, replicate=2))
    assert (z2.reshard_after_forward, z2.root_reshard_after_forward, z2.hsdp) == (False, False, True)
    assert wrapping_plan(cfg(dp=4)).reshard_after_forward is None


def test_optimizer_sharding_and_reduce_dtype():
    assert wrapping_plan(cfg(dp=4, zero=1)).zero_redundancy_optimizer
    assert not wrapping_plan(cfg(dp=1, zero=1)).zero_redundancy_optimizer
    assert wrapping_plan(cfg(dp=4, zero=3, grad="fp32")).reduce_dtype == "fp32"
    assert wrapping_plan(cfg(dp=4, zero=3)).reduce_dtype == "bf16"
    assert wrapping_plan(cfg(dp=4)).reduce_dtype == "fp32"  # autocast: fp32 parameter grads
