"""Context parallelism (parallel.cp, parallel.cp_rotate): the config, the rank order, the engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.layout import rank_coords, rank_of

LLAMA = {"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8}}


def cfg_of(parallel: dict, model: dict | None = None, gpus: int = 8, **extra) -> Config:
    raw = {"model": {"preset": "llama3-8b", **(model or {})}, "cluster": {"gpu": "h100-sxm", "gpus": gpus},
           "parallel": parallel, **extra}
    return Config.from_dict(raw)


def problems(raw_parallel: dict, model: dict | None = None, gpus: int = 8) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        cfg_of(raw_parallel, model, gpus)
    return {p.field: p.message for p in err.value.problems}


# --------------------------------------------------------------------------- config


def test_cp_defaults_to_one_and_allgather():
    cfg = Config.from_dict(LLAMA)
    assert cfg.parallel.cp == 1
    assert cfg.parallel.cp_rotate == "allgather"
    assert cfg.parallel.world_size == cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp == 8


def test_world_size_includes_cp_and_dp_fills_the_rest():
    cfg = cfg_of({"cp": 2, "tp": 2})  # dp is derived: 8 / (cp·tp·pp)
    assert cfg.parallel.dp == 2
    assert cfg.parallel.world_size == 8
    assert cfg.parallel.dp_cp == 4
    assert cfg.parallel.shard_degree == 4  # FSDP shards over dp_shard·cp (torchtitan's dp_shard_cp)


def test_gpus_follow_the_degrees_when_not_given():
    cfg = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm"},
                            "parallel": {"dp": 2, "cp": 4, "tp": 2}})
    assert cfg.cluster.gpus == 16


def test_degrees_must_multiply_to_the_gpus_naming_cp():
    found = problems({"dp": 2, "cp": 2, "tp": 1})
    assert "dp·cp·tp·pp = 2·2·1·1 = 4 must equal cluster.gpus (8)" in found["parallel.dp"]


def test_seq_len_must_divide_by_two_cp():
    found = problems({"cp": 8, "dp": 1}, model={"seq_len": 8200})
    msg = found["parallel.cp"]
    assert "divisible by 2·cp = 16" in msg and "allowed: 1, 2, 4" in msg


def test_cp_rotate_names_its_allowed_values():
    found = problems({"cp": 2, "cp_rotate": "ring"})
    assert found["parallel.cp_rotate"] == "allowed: allgather | alltoall"


def test_cp_refuses_zero_one_and_dataparallel():
    found = problems({"cp": 2, "zero": 1})
    assert "needs parallel.zero = 0, 2 or 3" in found["parallel.cp"]
    found = problems({"cp": 2, "dp": 4, "dp_mode": "dataparallel"})
    assert "parallel.cp = 1" in found["parallel.dp_mode"]


def test_sequence_parallel_needs_the_local_sequence_divisible_by_tp():
    found = problems({"cp": 2, "tp": 4, "dp": 1, "sequence_parallel": True}, model={"seq_len": 12})
    assert "multiple of cp·tp (2·4)" in found["parallel.sequence_parallel"]
    assert cfg_of({"cp": 4, "tp": 2, "dp": 1, "sequence_parallel": True}, model={"seq_len": 64}).parallel.cp == 4


def test_cp_round_trips_through_toml():
    cfg = cfg_of({"cp": 2, "tp": 2, "cp_rotate": "alltoall", "zero": 3})
    again = Config.loads_toml(cfg.dumps_toml())
    assert again == cfg
    assert again.parallel.cp == 2 and again.parallel.cp_rotate == "alltoall"


# --------------------------------------------------------------------------- rank order


def test_rank_order_is_torchtitans_tp_innermost_then_cp():
    # [pp, dp, cp, tp] = [2, 2, 2, 2]: rank 1 is the next tp rank, rank 2 the next cp rank
    assert rank_of(0, 0, 1, dp=2, tp=2, cp_index=0, cp=2) == 1
    assert rank_of(0, 0, 0, dp=2, tp=2, cp_index=1, cp=2) == 2
    assert rank_of(0, 1, 0, dp=2, tp=2, cp_index=0, cp=2) == 4
    assert rank_of(1, 0, 0, dp=2, tp=2, cp_index=0, cp=2) == 8
    c = rank_coords(11, dp=2, tp=2, pp=2, gpus_per_node=8, cp=2)
    assert (c.pp, c.dp, c.cp, c.tp, c.node) == (1, 0, 1, 1, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.data())
def test_rank_coords_and_rank_of_are_inverse(dp, cp, tp, pp, data):
    world = dp * cp * tp * pp
    rank = data.draw(st.integers(0, world - 1))
    c = rank_coords(rank, dp, tp, pp, 8, cp)
    assert rank_of(c.pp, c.dp, c.tp, dp, tp, c.cp, cp) == rank
    if cp == 1:  # the old TP-DP-PP order, unchanged
        assert rank == c.pp * dp * tp + c.dp * tp + c.tp


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]))
def test_world_size_is_the_product_of_the_degrees(dp, cp, tp, pp):
    cfg = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm"},
                            "parallel": {"dp": dp, "cp": cp, "tp": tp, "pp": pp, "microbatches": 2}})
    assert cfg.parallel.world_size == dp * cp * tp * pp == cfg.cluster.gpus


# --------------------------------------------------------------------------- backend


def test_backend_refuses_cp_until_it_runs_it():
    from backend.support import composition_problems

    cfg = cfg_of({"cp": 2, "zero": 3})
    assert any("parallel.cp = 2" in p and "not yet" in p for p in composition_problems(cfg))
    assert not any("parallel.cp" in p for p in composition_problems(cfg_of({"zero": 3})))
