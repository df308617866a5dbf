"""The wrapping plan: one decision of wrapper and precision per config, read by engine and backend."""

import pytest

from engine import Config
from engine.wrapping import DATA_PARALLEL_WRAPPERS, MIXED_PRECISION_KINDS, wrapping_plan


def cfg(dp=1, tp=1, pp=1, zero=0, precision="bf16-mixed", replicate=1, dp_mode="ddp", grad="bf16", reshard="default",
        float8="none", f8ag=False):
    return Config.from_dict({
        "model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": dp * tp * pp},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "replicate": replicate, "dp_mode": dp_mode,
                     "microbatches": 4, "fsdp_reshard_after_forward": reshard},
        "training": {"precision": precision, "grad_dtype": "fp32" if precision == "fp32" else grad,
                     "float8": float8, "float8_all_gather": f8ag}})


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
    # "default" is torchtitan's: reshard after forward except under pipelining (blocks and root)
    z3pp = wrapping_plan(cfg(dp=2, pp=2, zero=3))
    assert (z3pp.reshard_after_forward, z3pp.root_reshard_after_forward) == (False, False)
    z2 = wrapping_plan(cfg(dp=4, zero=2, replicate=2))
    assert (z2.reshard_after_forward, z2.root_reshard_after_forward, z2.hsdp) == (False, False, True)
    assert wrapping_plan(cfg(dp=4)).reshard_after_forward is None


def test_optimizer_sharding_and_reduce_dtype():
    assert wrapping_plan(cfg(dp=4, zero=1)).zero_redundancy_optimizer
    assert not wrapping_plan(cfg(dp=1, zero=1)).zero_redundancy_optimizer
    assert wrapping_plan(cfg(dp=4, zero=3, grad="fp32")).reduce_dtype == "fp32"
    assert wrapping_plan(cfg(dp=4, zero=3)).reduce_dtype == "bf16"
    assert wrapping_plan(cfg(dp=4)).reduce_dtype == "fp32"  # autocast: fp32 parameter grads


@pytest.mark.parametrize(("kw", "flag"), [
    ({"dp": 4, "zero": 3}, True), ({"dp": 2, "pp": 2, "zero": 3}, False),
    ({"dp": 4, "zero": 3, "reshard": "never"}, False), ({"dp": 2, "pp": 2, "zero": 3, "reshard": "always"}, True),
    ({"dp": 4, "zero": 3, "reshard": "always"}, True), ({"dp": 2, "pp": 2, "zero": 3, "reshard": "never"}, False),
    ({"dp": 4, "zero": 2}, False), ({"dp": 2, "pp": 2, "zero": 2}, False),
])
def test_reshard_policy_from_config(kw, flag):
    plan = wrapping_plan(cfg(**kw))
    assert plan.reshard_after_forward is flag and plan.root_reshard_after_forward is flag
    assert plan.reshard_policy == kw.get("reshard", "default") and "policy" in plan.describe()


def test_pipelined_fsdp2_stays_unsharded_and_accumulates_in_reduce_dtype():
    pp_fp32 = wrapping_plan(cfg(dp=2, pp=2, zero=3, grad="fp32"))
    assert pp_fp32.unsharded_after_first_backward
    assert (pp_fp32.grad_accumulation_dtype, pp_fp32.grad_accumulation_bytes) == ("fp32", 4)
    pp_bf16 = wrapping_plan(cfg(dp=2, pp=2, zero=2))
    assert pp_bf16.unsharded_after_first_backward and pp_bf16.grad_accumulation_bytes == 2
    assert wrapping_plan(cfg(dp=2, tp=2, pp=2)).unsharded_after_first_backward  # replicate is FSDP2 too
    assert not wrapping_plan(cfg(dp=4, zero=3)).unsharded_after_first_backward
    assert not wrapping_plan(cfg(dp=2, pp=2)).unsharded_after_first_backward  # DDP
    assert wrapping_plan(cfg(dp=2, pp=2)).grad_accumulation_dtype is None


def test_float8_all_gather_dtype():
    plan = wrapping_plan(cfg(dp=4, zero=3, float8="tensorwise", f8ag=True))
    assert plan.float8_all_gather and plan.all_gather_dtype == "fp8" and plan.gathered_bytes == 2
    assert "float8 all-gather" in plan.describe()
    plain = wrapping_plan(cfg(dp=4, zero=3, float8="tensorwise"))
    assert not plain.float8_all_gather and plain.all_gather_dtype == "bf16" and plain.float8 == "tensorwise"


def test_forwards_before_first_backward():
    from engine.wrapping import forwards_before_first_backward

    assert [forwards_before_first_backward("1F1B", r, 4, 1, 8) for r in range(4)] == [(4,), (3,), (2,), (1,)]
    assert forwards_before_first_backward("1F1B", 0, 4, 1, 4) == (4,)  # m = p − r: every forward first
    assert forwards_before_first_backward("GPipe", 1, 2, 1, 4) == (4,)
    assert forwards_before_first_backward("Interleaved1F1B", 0, 2, 2, 4) == (4, 2)
