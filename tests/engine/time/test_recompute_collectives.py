"""What the backward of a recomputed block repeats: TP (and SP) collectives per recompute kind, hand-worked
from torch's DTensor plan and the policies' save lists."""

import pytest

from engine import Config
from engine.time.comm import (
    communication,
    cp_recomputed_blocks,
    recomputed_blocks,
    tp_block_collectives,
    tp_recomputed_blocks,
    tp_recomputed_collectives,
)
from engine.time.step import tp_stage_seconds

# SwiGLU, 4 layers: per block 2 forward collectives; without SP 5 backward all-reduces (wq wk wv w1 w3)
TINY = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 128, "seq_len": 32,
        "mlp": "swiglu", "norm": "rmsnorm", "attention": "flash", "position": "rope", "dropout": 0.0, "bias": False}


def cfg(recompute="none", sp=False, tp=2, pp=1, every=2, layers=4, dp=1, zero=0, **par) -> Config:
    parallel = {"dp": dp, "tp": tp, "pp": pp, "sequence_parallel": sp, "zero": zero, **par}
    if pp > 1:
        parallel.setdefault("schedule", "1F1B")
        parallel.setdefault("microbatches", 2)
    return Config.from_dict({
        "model": {**TINY, "layers": layers},
        "cluster": {"gpu": "h100-sxm", "gpus": dp * tp * pp, "gpus_per_node": dp * tp * pp},
        "parallel": parallel,
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": recompute,
                     "recompute_every": every},
    })


def tp_calls(c: Config, pp_rank: int = 0) -> dict[tuple[str, str], int]:
    """Per-block TP collective calls of one pp rank for the whole step (edges and the optimizer step's left out), by
    (collective, phase)."""
    out: dict[tuple[str, str], int] = {}
    for it in communication(c).per_pp_rank[pp_rank].items:
        if it.dim == "tp" and "embedding" not in it.what and it.phase != "step":
            out[(it.collective, it.phase)] = out.get((it.collective, it.phase), 0) + it.calls
    return out


# --------------------------------------------------------------------------- per block, per kind


def test_none_and_selective_repeat_no_collective():
    for kind in ("none", "selective"):
        assert tp_recomputed_collectives(cfg(kind)) == []
        assert tp_block_collectives(cfg(kind)) == [("all_reduce", "forward", 2), ("all_reduce", "backward", 5)]
        assert tp_block_collectives(cfg(kind, sp=True)) == [
            ("all_gather", "forward", 2), ("reduce_scatter", "forward", 2),
            ("all_gather", "backward", 2), ("reduce_scatter", "backward", 2)]


def test_full_repeats_the_whole_forward():
    assert tp_recomputed_collectives(cfg("full")) == [("all_reduce", 2)]
    assert tp_block_collectives(cfg("full")) == [("all_reduce", "forward", 2), ("all_reduce", "backward", 5 + 2)]
    assert tp_recomputed_collectives(cfg("full", sp=True)) == [("all_gather", 2), ("reduce_scatter", 2)]
    assert tp_block_collectives(cfg("full", sp=True))[2:] == [("all_gather", "backward", 4),
                                                               ("reduce_scatter", "backward", 4)]


def test_selective_op_repeats_what_its_policy_does_not_save():
    # SP: the o-proj and down-proj reduce-scatter outputs are saved (reduce_scatter_tensor is in the save
    # list); the two all-gathers giving attention and MLP their (recomputed) norm outputs run again
    c = cfg("selective-op", sp=True)
    assert tp_recomputed_collectives(c) == [("all_gather", 2)]
    assert tp_block_collectives(c) == [("all_gather", "forward", 2), ("reduce_scatter", "forward", 2),
                                       ("all_gather", "backward", 2 + 2), ("reduce_scatter", "backward", 2)]
    # no SP: neither all-reduce is saved; the recomputed norm2 input needs the o-proj's, w2's reruns with it
    c = cfg("selective-op")
    assert tp_recomputed_collectives(c) == [("all_reduce", 2)]
    assert tp_block_collectives(c) == [("all_reduce", "forward", 2), ("all_reduce", "backward", 5 + 2)]
    assert tp_recomputed_blocks(c) == [4]


def test_selective_layer_repeats_the_checkpointed_blocks_only():
    # 4 blocks, every 2nd checkpointed: blocks 2 and 4 re-run their forward's 2 all-reduces each
    c = cfg("selective-layer", every=2)
    assert tp_block_collectives(c) == [("all_reduce", "forward", 2), ("all_reduce", "backward", 5)]
    assert tp_recomputed_blocks(c) == [2] and tp_recomputed_collectives(c) == [("all_reduce", 2)]
    m = c.parallel.microbatches  # 1
    assert tp_calls(c) == {("all_reduce", "forward"): 4 * 2 * m, ("all_reduce", "backward"): 4 * 5 * m + 2 * 2 * m}
    # with SP the checkpointed blocks repeat both the gathers and the reduce-scatters
    c = cfg("selective-layer", sp=True, every=2)
    assert tp_calls(c) == {("all_gather", "forward"): 8, ("reduce_scatter", "forward"): 8,
                           ("all_gather", "backward"): 8 + 4, ("reduce_scatter", "backward"): 8 + 4}


def test_selective_layer_over_two_stages_counts_each_ranks_own_blocks():
    # 6 layers over pp 2: 3 | 3; each rank's counter: its 2nd block → 1 checkpointed block per stage
    c = cfg("selective-layer", pp=2, every=2, layers=6)
    assert tp_recomputed_blocks(c) == [1, 1] == cp_recomputed_blocks(c)
    m = c.parallel.microbatches  # 2
    for r in (0, 1):
        assert tp_calls(c, r)[("all_reduce", "backward")] == 3 * 5 * m + 1 * 2 * m


def test_the_shared_helper_behind_tp_and_cp():
    c = cfg("selective-op")
    assert recomputed_blocks(c, ("full", "selective-op")) == [4] and cp_recomputed_blocks(c) == [0]
    c = cfg("selective")
    assert tp_recomputed_blocks(c) == [0] and cp_recomputed_blocks(c) == [4]


# --------------------------------------------------------------------------- seconds on the critical path


@pytest.mark.parametrize("sp", [False, True])
def test_stage_seconds_add_one_recomputed_forward_per_checkpointed_block(sp):
    none, full, layer = (cfg(k, sp=sp, every=2) for k in ("none", "full", "selective-layer"))
    f0, b0 = tp_stage_seconds(none, 1)
    ff, bf = tp_stage_seconds(full, 1)
    fl, bl = tp_stage_seconds(layer, 1)
    assert f0[0] == ff[0] == fl[0]
    # full repeats the forward's collectives in all 4 blocks, selective-layer in 2 of them
    assert bl[0] - b0[0] == pytest.approx((bf[0] - b0[0]) / 2, rel=1e-12)
    assert bf[0] > b0[0]
    op = cfg("selective-op", sp=sp)
    fo, bo = tp_stage_seconds(op, 1)
    if sp:  # the gathers only: less than full's gathers + reduce-scatters
        assert b0[0] < bo[0] < bf[0]
    else:  # both all-reduces, as full
        assert bo[0] == pytest.approx(bf[0], rel=1e-12)


# --------------------------------------------------------------------------- float8 on the recomputed forward


def test_selective_layer_every_block_times_as_full_under_float8_and_tp():
    """Checkpointing every block is full recompute: the recomputed forward's matmuls at float8's rate with
    their casts, and its TP collectives, match full's stage by stage."""
    from engine.time.step import analytic_durations, linear_matmul_seconds, recomputed_linear_blocks

    def both(**kw):
        full = cfg("full", **kw).replace(training={"float8": "rowwise", "compile": True})
        layer = cfg("selective-layer", every=1, **kw).replace(training={"float8": "rowwise", "compile": True})
        return full, layer

    for kw in (dict(sp=True), dict(sp=False, pp=2, layers=6)):
        full, layer = both(**kw)
        n = full.parallel.num_stages
        assert list(recomputed_linear_blocks(layer, n)) == list(recomputed_linear_blocks(full, n))
        a, b = analytic_durations(full), analytic_durations(layer)
        for x, y in ((a.forward_s, b.forward_s), (a.backward_input_s, b.backward_input_s),
                     (a.backward_weight_s, b.backward_weight_s)):
            assert list(x) == pytest.approx(list(y), rel=1e-12)
        for x, y in zip(tp_stage_seconds(full, n), tp_stage_seconds(layer, n)):
            assert list(x) == pytest.approx(list(y), rel=1e-12)
        assert linear_matmul_seconds(full, n)[1] == pytest.approx(linear_matmul_seconds(layer, n)[1], rel=1e-12)
    # every 2nd block: half of full's recomputed matmuls; selective-op: the policy's unsaved share per block
    half = cfg("selective-layer", every=2).replace(training={"float8": "tensorwise"})
    assert list(recomputed_linear_blocks(half, 1)) == [2.0]
    op = cfg("selective-op").replace(training={"float8": "tensorwise"})
    # SwiGLU without bias: wk, wo, w3 unsaved, of q k v o w1 w3 w2 (FLOPs ∝ h·q, h·kv, h·kv, q·h, h·f, h·f, f·h)
    h, kv, f = 64, 32, 176
    share = (h * kv + h * h + h * f) / (h * h + 2 * h * kv + h * h + 3 * h * f)
    assert recomputed_linear_blocks(op, 1)[0] == pytest.approx(4 * share, rel=1e-12)
