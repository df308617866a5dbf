"""Communication model: ring formulas, bus-bandwidth factors, group placement, volumes."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Config
from engine.time.comm import (
    GroupSpan,
    LinkFit,
    MeasuredLinks,
    bus_factor,
    collective_seconds,
    communication,
    group_span,
    ring_seconds,
)


def cfg(**parallel):
    gpus = parallel.pop("gpus", None)
    cluster = {"preset": parallel.pop("cluster", "h100-pod-64")}
    par = {"dp": 1, "tp": 1, "pp": 1, **parallel}
    cluster["gpus"] = gpus or par["dp"] * par["tp"] * par["pp"]
    return Config.from_dict({"model": {"preset": parallel.pop("model", "llama2-7b")}, "cluster": cluster,
                             "parallel": par})


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("p2p", 2) == 1.0
    with pytest.raises(ValueError, match="allowed"):
        bus_factor("broadcast", 2)


def test_ring_formulas_hand_worked():
    # 1 GB all-reduce over 8 GPUs at 100 GB/s, 5 us: 14·5us + 1.75 · 10 ms = 17.57 ms
    assert ring_seconds("all_reduce", 1e9, 8, 100e9, 5e-6) == pytest.approx(14 * 5e-6 + 1.75e-2)
    assert ring_seconds("all_gather", 1e9, 8, 100e9, 5e-6) == pytest.approx(7 * 5e-6 + 0.875e-2)
    assert ring_seconds("p2p", 1e6, 2, 1e9, 1e-5) == pytest.approx(1e-5 + 1e-3)
    assert ring_seconds("all_reduce", 1e9, 1, 100e9, 5e-6) == 0.0


def test_groups_follow_tp_innermost_placement():
    c = cfg(dp=8, tp=8)  # 64 GPUs, 8 per node
    assert group_span(c, "tp") == GroupSpan("tp", 8, 1, 8)  # a TP group fills one node
    assert group_span(c, "dp") == GroupSpan("dp", 8, 8, 1)  # a DP group has one rank per node
    c = cfg(dp=4, tp=16)
    span = group_span(c, "tp")
    assert span.crosses_nodes and span.link == "hierarchical" and span.local == 8


def test_hierarchical_all_reduce_hand_worked():
    c = cfg(dp=4, tp=16)
    cl = c.cluster
    S = 64e6
    span = GroupSpan("tp", 16, 2, 8)
    intra, inter = cl.intra_node_bytes_per_s, cl.inter_node_bytes_per_s
    a_in, a_out = cl.intra_node_latency_us * 1e-6, cl.inter_node_latency_us * 1e-6
    expect = (7 * a_in + 7 / 8 * S / intra) + (2 * a_out + 1.0 * (S / 8) / inter) + (7 * a_in + 7 / 8 * S / intra)
    assert collective_seconds(c, "all_reduce", S, span) == pytest.approx(expect)


def dp_bytes(c):
    return sum(rc.bytes_sent("dp") for rc in communication(c).per_pp_rank)


def test_zero3_moves_one_and_a_half_times_ddp():
    ddp = dp_bytes(cfg(dp=8, zero=0, gpus=8, cluster="dgx-h100"))
    z2 = dp_bytes(cfg(dp=8, zero=2, gpus=8, cluster="dgx-h100"))
    z3 = dp_bytes(cfg(dp=8, zero=3, gpus=8, cluster="dgx-h100"))
    assert z2 == pytest.approx(ddp, rel=1e-9)
    assert z3 == pytest.approx(1.5 * ddp, rel=1e-9)


def test_ddp_volume_hand_worked():
    c = cfg(dp=8, zero=0, gpus=8, cluster="dgx-h100")
    psi = 6_738_415_616
    expect = 2 * 7 / 8 * psi * 2  # bf16 grads
    assert dp_bytes(c) == pytest.approx(expect)
    item = communication(c).per_pp_rank[0].items[0]
    assert item.calls == math.ceil(psi * 2 / 25e6)


def test_pp_communication_is_far_smaller_than_tp():
    tp = communication(cfg(tp=4, gpus=4, cluster="dgx-h100", microbatches=8))
    pp = communication(cfg(pp=4, gpus=4, cluster="dgx-h100", microbatches=8))
    tp_bytes = sum(r.bytes_sent("tp") for r in tp.per_pp_rank)
    pp_bytes = sum(r.bytes_sent("pp") for r in pp.per_pp_rank)
    assert pp_bytes > 0 and tp_bytes > 20 * pp_bytes


def _tp_bytes(c, phase):
    return sum(i.bytes_sent for i in communication(c).per_pp_rank[0].items
               if i.dim == "tp" and i.phase == phase and "per block" in i.what)


def test_tp_with_sp_moves_the_same_forward_bytes_as_all_reduce():
    a = cfg(tp=8, gpus=8, cluster="dgx-h100")
    b = cfg(tp=8, gpus=8, cluster="dgx-h100", sequence_parallel=True)
    assert _tp_bytes(a, "forward") == pytest.approx(_tp_bytes(b, "forward"))
    # backward: torch's DTensor plan all-reduces the input gradient of every column-parallel
    # module (wq, wk, wv, w1, w3 = 5 per SwiGLU block), SP one reduce-scatter + gather per sub-layer
    assert _tp_bytes(a, "backward") == pytest.approx(_tp_bytes(b, "backward") * 5 / 2)


def test_tp_collectives_per_block_follow_torchs_plan():
    calls = {(i.collective, i.phase): i.calls // 32 for i in communication(cfg(tp=8, gpus=8)).per_pp_rank[0].items
             if i.dim == "tp" and "per block" in i.what}  # llama2-7b: 32 blocks, one microbatch
    assert calls == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 5}
    gelu = Config.from_dict({"model": {"preset": "gpt2-124m"}, "cluster": {"preset": "dgx-h100", "gpus": 2},
                             "parallel": {"tp": 2}})
    calls = {(i.collective, i.phase): i.calls // 12 for i in communication(gelu).per_pp_rank[0].items
             if i.dim == "tp" and "per block" in i.what}
    assert calls == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 4}


def test_fsdp_gathers_and_reduce_scatters_once_per_unit():
    c = cfg(dp=8, zero=3, gpus=8, microbatches=2)
    items = {i.collective: i for i in communication(c).per_pp_rank[0].items if i.dim == "dp"}
    units = 32 + 2  # embedding, 32 blocks, norm + head
    assert items["all_gather"].calls == 2 * 2 * units  # forward and backward, each microbatch
    assert items["reduce_scatter"].calls == units and not items["reduce_scatter"].overlappable
    z2 = {i.collective: i for i in communication(cfg(dp=8, zero=2, gpus=8, microbatches=2)).per_pp_rank[0].items}
    assert z2["all_gather"].calls == 2 * units  # FSDP2 reshards after each backward


def test_cpu_ranks_sharing_cores_slow_the_links_and_hide_nothing():
    def local(cores, **par):
        par = {"dp": 4, **par}
        return Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"preset": "local-cpu", "gpus": 4,
                                                                            "cpu_cores": cores}, "parallel": par})
    span = group_span(local(4), "dp")
    one = collective_seconds(local(4), "all_reduce", 1e6, span)
    assert collective_seconds(local(2), "all_reduce", 1e6, span) == pytest.approx(2 * one)
    assert collective_seconds(local(0), "all_reduce", 1e6, span) == pytest.approx(one)
    assert not any(i.overlappable for i in communication(local(2)).per_pp_rank[0].items)


def test_measured_links_replace_alpha_and_beta_per_collective_and_group_size():
    c = cfg(dp=4, gpus=4, cluster="dgx-h100")
    links = MeasuredLinks((LinkFit("all_reduce", 2, 1e-3, 1e9), LinkFit("all_reduce", 4, 2e-3, 5e8)))
    span = group_span(c, "dp")
    assert collective_seconds(c, "all_reduce", 1e6, span, links) == pytest.approx(
        ring_seconds("all_reduce", 1e6, 4, 5e8, 2e-3))
    assert links.lookup("all_reduce", 3) == (5e8, 2e-3)  # nearest group size, the larger on a tie
    assert links.lookup("all_gather", 4) is None
    # not measured: the cluster's link
    assert collective_seconds(c, "all_gather", 1e6, span, links) == pytest.approx(
        collective_seconds(c, "all_gather", 1e6, span))
    doubled = MeasuredLinks(links.fits, scale=2.0)
    assert doubled.lookup("all_reduce", 2) == (5e8, 2e-3)


def test_v_placement_has_no_send_between_the_two_middle_stages():
    c = cfg(pp=2, gpus=2, cluster="dgx-h100", schedule="ZBVZeroBubble", virtual_stages=2, microbatches=4)
    ranks = communication(c).per_pp_rank
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: rank 0 sends F from 0 and B from 3 → 2 boundaries
    sends = {rc.pp_rank: sum(i.calls for i in rc.items if i.dim == "pp") for rc in ranks}
    assert sends == {0: 2 * 4, 1: 2 * 4}


def test_to_json_names_groups_and_links():
    data = communication(cfg(dp=4, tp=16)).to_json()
    assert data["groups"]["tp"]["crosses_nodes"] is True
    assert data["per_rank"][0]["items"]


def test_tp_embedding_head_and_loss_collectives_follow_the_backend_plan():
    from engine.time.comm import tp_edge_collectives

    c = cfg(tp=8, gpus=8)  # llama2-7b, one stage holds embedding and head
    m, t = c.model, c.training
    act = t.micro_batch_size * m.seq_len * m.hidden * t.param_bytes
    logits = t.micro_batch_size * m.seq_len * m.vocab * t.param_bytes
    assert tp_edge_collectives(c, True, True) == [("all_reduce", "forward", 1, act), ("all_gather", "forward", 1, logits),
                                                   ("all_reduce", "backward", 1, act)]
    sp = cfg(tp=8, gpus=8, sequence_parallel=True)
    rows = t.micro_batch_size * m.seq_len
    assert tp_edge_collectives(sp, True, False) == [("reduce_scatter", "forward", 1, act)]
    assert tp_edge_collectives(sp, False, True)[-1] == ("all_reduce", "forward", 3, rows * 4.0)  # loss_parallel
    assert tp_edge_collectives(cfg(dp=8, gpus=8), True, True) == []
    edges = [i for i in communication(c).per_pp_rank[0].items if i.dim == "tp" and "embedding" in i.what]
    assert sum(i.calls for i in edges) == 3 * c.parallel.microbatches


def test_zero1_broadcasts_every_parameter_tensor_separately():
    from engine.time.comm import broadcast_seconds

    c = cfg(dp=4, zero=1, gpus=4)
    it = next(i for i in communication(c).per_pp_rank[0].items if i.what.startswith("ZeRO-1 parameter"))
    tensors = 1 + 32 * 9 + 2  # embedding, 32 blocks × (wq wk wv wo w1 w2 w3 + 2 norms), norm + head
    assert f"{tensors} per-tensor broadcasts" in it.what and not it.overlappable
    held = it.size_bytes  # listed as one all-gather of the whole local parameters (its volume)
    span = group_span(c, "dp")
    # binomial tree over 4 ranks: 2 rounds of one send, per tensor
    assert broadcast_seconds(c, 1e6, span) == pytest.approx(2 * collective_seconds(c, "p2p", 1e6, span))
    assert it.seconds == pytest.approx(tensors * broadcast_seconds(c, held / tensors, span))


def test_cpu_ranks_pay_the_wake_once_a_call_and_gloo_steps_at_the_shared_cores_alpha():
    """The embedded default's cluster (local-cpu: α 150 µs, wake 1,210 µs, 1.8 GB/s, 4 ranks on 2 cores): a
    collective called after compute pays the wake once, times its group's ranks per core (4 / 2), then gloo's ring
    steps at α · 2 (world / cores) and its bytes at B / 2; one queued behind another (ZeRO-1's async broadcasts) no
    wake; a broadcast's sends (p2p) pay the wake each, the receiver waking first. Worked by hand."""
    from engine import default_config
    from engine.time.comm import broadcast_seconds
    from engine.time.durations import p2p_seconds

    c = default_config().replace(parallel={"dp": 4, "pp": 1, "zero": 1, "microbatches": 1})
    assert (c.cluster.intra_node_latency_us, c.cluster.cpu_wake_latency_us, c.cluster.cpu_cores) == (150.0, 1210.0, 2)
    span = group_span(c, "dp")
    s = 1e6
    assert collective_seconds(c, "all_reduce", s, span) == pytest.approx(2 * 1210e-6 + 6 * 300e-6 + 1.5 * s / 0.9e9)
    assert collective_seconds(c, "all_reduce", s, span, queued=True) == pytest.approx(6 * 300e-6 + 1.5 * s / 0.9e9)
    assert collective_seconds(c, "all_gather", s, span) == pytest.approx(2 * 1210e-6 + 3 * 300e-6 + 0.75 * s / 0.9e9)
    first, queued = broadcast_seconds(c, s, span), broadcast_seconds(c, s, span, queued=True)
    assert (first, queued) == (pytest.approx(2 * (2720e-6 + s / 0.9e9)), pytest.approx(2 * (300e-6 + s / 0.9e9)))
    it = next(i for i in communication(c).per_pp_rank[0].items if i.what.startswith("ZeRO-1 parameter"))
    tensors = int(it.what.split("timed as ")[1].split()[0])
    one = it.size_bytes / tensors
    assert it.seconds == pytest.approx(broadcast_seconds(c, one, span) + (tensors - 1) * broadcast_seconds(
        c, one, span, queued=True))
    pp = default_config()  # dp2 × pp2: p2p between the stages, before the core sharing's doubling
    assert p2p_seconds(pp, 2)[0] == pytest.approx(1360e-6 + 2 * 64 * 128 * 4 / 1.8e9)
    gpu = cfg(dp=4, zero=1, gpus=4)  # GPUs have no wake
    assert gpu.cluster.cpu_wake_latency_us == 0.0
    assert collective_seconds(gpu, "all_reduce", s, group_span(gpu, "dp")) == collective_seconds(
        gpu, "all_reduce", s, group_span(gpu, "dp"), queued=True)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 6, 8, 16]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3, 4, 8]),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 4, 5, 7, 8, 12, 72]),
       st.sampled_from(["dp", "tp", "pp", "cp", "dp_cp"]))
def test_group_span_without_scanning_the_world_equals_the_scan(dp, tp, pp, cp, gpn, dim):
    """``_group_span`` reads each group's spread from its start's offset inside a node; scanning every
    group of the world (what it did before) gives the same worst span."""
    from engine.time.comm import GroupSpan, _group_span, _ranks_of_group

    size = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "dp_cp": dp * cp}[dim]
    worst = GroupSpan("dp" if dim == "dp_cp" else dim, size, 1, size)
    for r in range(dp * cp * tp * pp):
        per_node: dict[int, int] = {}
        for x in _ranks_of_group(dp, cp, tp, pp, dim, r):
            per_node[x // gpn] = per_node.get(x // gpn, 0) + 1
        span = GroupSpan(worst.dim, size, len(per_node), max(per_node.values()))
        if (span.nodes, -span.local) > (worst.nodes, -worst.local):
            worst = span
    assert _group_span.__wrapped__(dp, tp, pp, gpn, dim, cp) == worst


def test_the_wake_field_is_written_only_where_a_cluster_sets_it():
    """A GPU cluster's file reads as it did before cluster.cpu_wake_latency_us existed (the fake sweep's cache keys
    and saved configs stay); the local-cpu preset's names it and reads back equal."""
    from engine import default_config

    assert "cpu_wake_latency_us" not in cfg(dp=4, zero=1, gpus=4).dumps_toml()
    local = default_config()
    assert "cpu_wake_latency_us = 1210.0" in local.dumps_toml()
    assert Config.loads_toml(local.dumps_toml()) == local


def test_gloo_reduce_scatters_as_an_all_reduce_and_all_to_alls_in_one_round_on_cpu_ranks():
    """torch's ProcessGroupGloo on CPU tensors (benchmarks/clocks.md, session 38): ``reduce_scatter_tensor_coalesced``
    clones the input, all-reduces it and copies out the rank's chunk (an all-reduce's steps and bytes); ``alltoall``
    posts every send and receive at once (one round). A pair inside 4 ranks on 2 cores wakes once (2 / 2 ranks a
    core) and steps at α · 2. Worked by hand."""
    from engine import default_config
    from engine.time.comm import gloo_call_seconds

    c = default_config().replace(parallel={"dp": 4, "pp": 1, "microbatches": 1})
    s = 1e6
    ar = 2 * 1210e-6 + 6 * 300e-6 + 1.5 * s / 0.9e9
    assert gloo_call_seconds(c, "reduce_scatter", s, 4) == pytest.approx(ar)
    assert gloo_call_seconds(c, "all_to_all", s, 4) == pytest.approx(2 * 1210e-6 + 300e-6 + 0.75 * s / 0.9e9)
    assert gloo_call_seconds(c, "all_reduce", s, 2) == pytest.approx(1210e-6 + 2 * 300e-6 + s / 0.9e9)
    assert gloo_call_seconds(c, "all_gather", s, 2, queued=True) == pytest.approx(300e-6 + 0.5 * s / 0.9e9)
    # the GPU kinds keep the ring's α-β model
    gpu = cfg(dp=4, gpus=4)
    span = group_span(gpu, "dp")
    assert collective_seconds(gpu, "reduce_scatter", s, span) == pytest.approx(
        ring_seconds("reduce_scatter", s, 4, gpu.cluster.intra_node_bytes_per_s, gpu.cluster.intra_node_latency_us * 1e-6))
