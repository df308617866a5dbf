"""Context parallelism (parallel.cp, parallel.cp_rotate): the config, the rank order, the engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.pipeline.layout import rank_coords, rank_of

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


def test_the_ring_needs_flash_attention():
    found = problems({"cp": 2, "cp_rotate": "alltoall"}, model={"attention": "eager"})
    assert "allowed with eager attention: allgather" in found["parallel.cp_rotate"]
    assert cfg_of({"cp": 2, "cp_rotate": "allgather"}, model={"attention": "eager"}).parallel.cp == 2


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


def test_backend_runs_cp_with_torchs_apis():
    from engine.backend_limits import composition_problems

    # the backend runs cp (tests/backend/test_backend_cp.py): nothing about it is refused whatever the machine
    cfg = cfg_of({"cp": 2, "zero": 3})
    assert not any("parallel.cp" in p for p in composition_problems(cfg))
    assert not any("parallel.cp" in p for p in composition_problems(cfg_of({"zero": 3})))


# --------------------------------------------------------------------------- engine: memory

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256, "seq_len": 32,
         "mlp": "swiglu", "attention": "flash"}


def small(cp: int, dp: int = 1, model: dict | None = None, **parallel) -> Config:
    return Config.from_dict({"model": {**SMALL, **(model or {})}, "cluster": {"gpu": "h100-sxm"},
                             "parallel": {"dp": dp, "cp": cp, **parallel},
                             "conventions": {"state_accounting": "zero-paper"}})


def test_a_layers_activations_halve_at_cp_two_by_hand():
    from engine.memory.activations import activation_bytes_per_layer

    # flash, SwiGLU, no dropout, 16-bit: norm1 input, QKV input, Q, o-proj input, norm2 input, MLP input
    # 2·s·b·h each; K and V 2·s·b·kv each; lse 4·a·s·b; gate, SiLU, up, down input 2·s·b·f each
    def by_hand(s):
        b, h, kv, a, f = 1, 64, 32, 4, 128
        return 6 * 2 * s * b * h + 2 * 2 * s * b * kv + 4 * a * s * b + 4 * 2 * s * b * f

    assert activation_bytes_per_layer(small(1)) == by_hand(32) == 61952
    assert activation_bytes_per_layer(small(2)) == by_hand(16) == 30976


def test_eager_scores_span_every_key_under_cp():
    from engine.memory.activations import activation_terms_per_layer

    terms, formula = activation_terms_per_layer(small(2, model={"attention": "eager"}))
    scores = {t.label: t.bytes for t in terms}["softmax output"]
    assert scores == 2 * 4 * 16 * 32  # 2 B × a · (S/cp) queries · S keys · b
    kv = {t.label: t.bytes for t in terms}["K, V (repeated to all heads)"]
    assert kv == 2 * 2 * 32 * 64  # gathered to the whole sequence: 2 × 2 B × S · b · h
    assert "aS/t" in formula


def test_cp_workspace_is_the_gathered_kv_or_the_ring_chunks():
    from engine.memory.activations import context_parallel_workspace, shape_of

    sh = shape_of(small(2))
    s, S, kv, h, a = 16, 32, 32, 64, 4
    chunk = 2 * s * kv * 2
    merger = s * h * 6 + 8 * a * s
    grads = s * (h + 2 * kv)
    ring_dkv = 2 * 4 * 2 * s * kv
    # backward: fp32 dQ, dK, dV accumulators, two blocks' gradients (torch's loop rebinds the last block's only once
    # the next op has made its own), the fp32 dK, dV ring
    bwd = 4 * grads + 2 * 2 * grads + ring_dkv
    gathered, _ = context_parallel_workspace(sh, 2, "allgather")
    assert gathered == max(2 * S * kv * 2 + chunk + merger, 2 * S * kv * 2 + chunk + bwd)
    ring, _ = context_parallel_workspace(sh, 2, "alltoall")
    assert ring == max(3 * chunk + merger, 3 * chunk + bwd)
    # a longer context with more cp ranks: the gathered K, V (whole sequence) outgrow the three chunks
    big = shape_of(small(8, model={"seq_len": 4096}))
    assert context_parallel_workspace(big, 8, "allgather")[0] > context_parallel_workspace(big, 8, "alltoall")[0]


def test_cp_backward_workspace_as_the_fake_measured_it():
    """measure --fake of Llama 2 7B s2K b8 cp2 fp32 (allgather; the fake runs the backend's CPU ring): 2,560.5 MiB of
    the ring attention's backward at its peak — K, V gathered (512 MiB) and the sent copy (256), fp32 dQ, dK, dV
    accumulators (384), two blocks' gradients (384 + 384), the dK, dV ring (2 × 256), and the output gradient made
    contiguous (128), which that ring no longer copies: CUDA's flash backward, and the CPU kernel, read it as it
    comes (``tests/backend/test_backend_cp.py``: the ring makes no copy of it)."""
    from engine.memory.activations import context_parallel_workspace, shape_of

    cfg = Config.from_dict({"model": {"preset": "llama2-7b", "layers": 8, "seq_len": 2048},
                            "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
                            "parallel": {"dp": 2, "cp": 2, "zero": 3},
                            "training": {"micro_batch_size": 8, "precision": "fp32", "recompute": "selective-op"}})
    ws, _ = context_parallel_workspace(shape_of(cfg), 2, "allgather")
    assert ws == (512 + 256 + 384 + 2 * 384 + 2 * 256) * 2**20


def test_the_workspace_is_a_temporary_of_every_cp_rank_and_absent_without_cp():
    from engine.memory import memory_per_rank

    kinds = {t.kind for t in memory_per_rank(small(2)).per_rank[1].catalogue("temporaries")}
    assert "cp_attention" in kinds
    kinds = {t.kind for t in memory_per_rank(small(1)).per_rank[0].catalogue("temporaries")}
    assert "cp_attention" not in kinds


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from(["flash", "eager"]),
       st.sampled_from(["none", "selective", "full"]), st.sampled_from([256, 1024]))
def test_activations_do_not_grow_with_cp(kv_heads_div, tp, attention, recompute, seq_len):
    """The sharded part (the saved-tensor table and the rank's activation terms, each at its largest)
    is non-increasing in cp. (At the peak moment it need not be: the attention workspace, alive only
    while a block runs, can move the peak from the end of the backward into a block's backward.)"""
    from engine.memory import memory_per_rank
    from engine.memory.activations import activation_bytes_per_layer

    model = {**SMALL, "heads": 8, "kv_heads": 8 // kv_heads_div, "hidden": 128, "ffn_hidden": 256,
             "seq_len": seq_len, "attention": attention}
    last_layer = last_rank = None
    for cp in (1, 2, 4, 8):
        cfg = Config.from_dict({"model": model, "cluster": {"gpu": "h100-sxm"},
                                "parallel": {"dp": 1, "cp": cp, "tp": tp, "zero": 3},
                                "training": {"recompute": recompute}})
        layer = activation_bytes_per_layer(cfg)
        rank = sum(t.bytes for t in memory_per_rank(cfg).per_rank[0].catalogue("activations"))
        if last_layer is not None:
            assert layer <= last_layer and rank <= last_rank
        last_layer, last_rank = layer, rank


def test_cp_joins_the_fsdp_shard_group():
    from engine.memory import memory_per_rank

    with_cp = memory_per_rank(small(2, dp=2, zero=3)).per_rank[0]
    dp_only = memory_per_rank(small(1, dp=4, zero=3)).per_rank[0]
    for cat in ("params", "grads", "optimizer"):
        assert getattr(with_cp, cat) == getattr(dp_only, cat)
    # cp alone shards too (torchtitan's dp_shard_cp with dp_shard = 1)
    assert memory_per_rank(small(2, zero=3)).per_rank[0].params < memory_per_rank(small(1, zero=3)).per_rank[0].params


# --------------------------------------------------------------------------- engine: communication, step


def test_kv_all_gather_bytes_by_hand():
    from engine.time.comm import cp_layer_exchanges

    cfg = cfg_of({"cp": 8, "tp": 8, "dp": 1, "zero": 3, "sequence_parallel": True}, model={"seq_len": 131072},
                 gpus=64)
    ex = {(c, ph, w): (n, size) for c, ph, n, size, w in cp_layer_exchanges(cfg)}
    # K and V of 16384 local tokens, kv_dim 8·128 = 1024 over tp 8, 2 bytes: 8 MiB per rank, 64 MiB gathered
    chunk = 2 * 16384 * 1 * (1024 // 8) * 2
    assert chunk == 8_388_608
    assert ex["all_gather", "forward", "K, V all-gather"] == (1, 8 * chunk)
    assert ex["all_gather", "backward", "K, V all-gather"] == (1, 8 * chunk)
    assert ex["p2p", "backward", "dK, dV ring rotation (fp32)"] == (8, 2 * chunk)  # fp32: twice the bytes
    ring = cfg.replace(parallel={"cp_rotate": "alltoall"})
    ex = {(c, ph): (n, size) for c, ph, n, size, w in cp_layer_exchanges(ring) if not w.startswith("dK")}
    assert ex["p2p", "forward"] == (7, chunk) and ex["p2p", "backward"] == (7, chunk)


def test_cp_group_is_tp_strided_and_gradients_reduce_over_dp_cp():
    from engine.time.comm import communication, group_ranks, group_span

    cfg = small(2, dp=2, tp=2)
    assert group_ranks(cfg, "cp", 0) == [0, 2]
    assert group_ranks(cfg, "dp", 0) == [0, 4]
    assert group_ranks(cfg, "dp_cp", 0) == [0, 2, 4, 6]
    assert group_span(cfg, "dp_cp").size == 4
    items = communication(cfg).per_pp_rank[0].items
    ar = [i for i in items if i.dim == "dp" and i.collective == "all_reduce"]
    assert ar and all(i.group_size == 4 for i in ar)
    assert any(i.dim == "cp" for i in items)


def test_cp_exchange_is_all_exposed_on_cpu_and_partly_hidden_on_gpus():
    from engine.time.comm import collective_seconds, cp_layer_exchanges, group_span
    from engine.time.step import cp_seconds_per_layer

    raw = {"model": {**SMALL, "seq_len": 256}, "parallel": {"dp": 1, "cp": 4}}
    cpu = Config.from_dict({**raw, "cluster": {"gpu": "cpu"}})
    span = group_span(cpu, "cp")
    every = {"forward": 0.0, "backward": 0.0}
    for coll, phase, calls, size, _ in cp_layer_exchanges(cpu):
        every[phase] += calls * collective_seconds(cpu, coll, size, span)
    assert cp_seconds_per_layer(cpu) == pytest.approx((every["forward"], every["backward"]))
    gpu = Config.from_dict({**raw, "cluster": {"gpu": "h100-sxm"}})
    f, b = cp_seconds_per_layer(gpu)
    span = group_span(gpu, "cp")
    total = sum(calls * collective_seconds(gpu, c, size, span) for c, _, calls, size, _ in cp_layer_exchanges(gpu))
    assert 0 < f + b <= total


@pytest.mark.parametrize("parallel", [
    {"cp": 2, "dp": 1},
    {"cp": 2, "dp": 2, "zero": 3},
    {"cp": 2, "tp": 2, "dp": 1, "sequence_parallel": True},
    {"cp": 2, "pp": 2, "dp": 1, "microbatches": 4},
    {"cp": 2, "tp": 2, "pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "cp_rotate": "alltoall"},
    {"cp": 2, "dp": 4, "replicate": 2, "zero": 3},
])
def test_cp_composes_with_fsdp_tp_and_pp(parallel):
    from engine.predict import predict
    from engine.time.step import BREAKDOWN_KEYS

    cfg = Config.from_dict({"model": {"preset": "llama3-8b", "seq_len": 8192}, "cluster": {"gpu": "h100-sxm"},
                            "parallel": parallel})
    pred = predict(cfg)
    assert len(pred.memory.per_rank) == cfg.parallel.world_size
    st_ = pred.step
    assert set(st_.breakdown) == set(BREAKDOWN_KEYS)
    assert sum(st_.breakdown.values()) == pytest.approx(st_.seconds)
    assert st_.breakdown["cp_comm"] >= 0
    # the CP ranks of a sequence hold the same thing: their memory is equal
    cp_peer = 1 * cfg.parallel.tp  # rank of (pp 0, dp 0, cp 1, tp 0)
    assert pred.memory.per_rank[cp_peer].total == pred.memory.per_rank[0].total


def test_cp_shortens_the_step_of_a_long_sequence_at_a_fixed_batch():
    from engine.predict import predict

    def step(cp):
        cfg = Config.from_dict({"model": {"preset": "llama3-8b", "seq_len": 65536}, "cluster": {"gpu": "h100-sxm"},
                                "parallel": {"dp": 1, "cp": cp, "tp": 8, "zero": 3, "sequence_parallel": True},
                                "training": {"recompute": "full"}})
        return predict(cfg).step

    one, four = step(1), step(4)
    assert one.tokens_per_s == pytest.approx(65536 / one.seconds)  # one sequence per step
    assert four.seconds < one.seconds / 3  # 4× the GPUs on the same sequence: nearly 4× faster
    assert four.breakdown["cp_comm"] > 0 and one.breakdown["cp_comm"] == 0


@pytest.mark.parametrize(("recompute", "blocks"), [("none", 0), ("selective-op", 0), ("selective", 2), ("full", 2),
                                                   ("selective-layer", 1)])
def test_a_recomputed_forward_exchanges_kv_again(recompute, blocks):
    from engine.time.comm import communication
    from engine.time.step import cp_seconds_per_layer, cp_stage_seconds

    cfg = Config.from_dict({"model": {**SMALL, "seq_len": 256}, "cluster": {"gpu": "cpu"},
                            "parallel": {"dp": 1, "cp": 2, "microbatches": 3},
                            "training": {"recompute": recompute, "recompute_every": 2}})
    items = [i for i in communication(cfg).per_pp_rank[0].items if i.dim == "cp"]
    again = [i for i in items if "recomputed forward" in i.what]
    assert sum(i.calls for i in again) == blocks * 3  # one all-gather per recomputed block and microbatch
    f, b = cp_seconds_per_layer(cfg)
    fs, bs = cp_stage_seconds(cfg, 1)
    assert fs[0] == pytest.approx(2 * f) and bs[0] == pytest.approx(2 * b + blocks * f)
