"""Timeline simulation and analytic stage durations (engine.pipeline.timeline, engine.time.durations)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine import Config
from engine.names import SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from engine.pipeline.schedules import Action, PipelinePlan, pipeline_actions, schedule_problems
from engine.pipeline.timeline import pipeline_prediction, simulate
from engine.time.durations import StageDurations, activation_bytes_per_microbatch, stage_durations


def _uniform(plan, f=1.0, i=1.0, w=1.0, p2p=0.0):
    return StageDurations.uniform(plan.num_stages, f, i, w, p2p)


def _cfg(**parallel) -> Config:
    par = {"dp": 1, "tp": 1, "pp": 2, "schedule": "1F1B", "virtual_stages": 1, "microbatches": 4, **parallel}
    gpus = par["dp"] * par["tp"] * par["pp"]
    return Config.from_dict({
        "model": {"preset": "tiny", "layers": 16},
        "cluster": {"preset": "local-cpu", "gpus": gpus, "gpus_per_node": min(gpus, 8)},
        "parallel": par,
    })


# --------------------------------------------------------------------------- bubble checks


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 7), (3, 4), (4, 4), (4, 8), (4, 13), (8, 32)])
def test_bubble_share_matches_closed_form(name, p, m):
    tl = simulate(pipeline_actions(name, p, m, 1), StageDurations.uniform(p, 1.0, 1.5, 0.5))
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert tl.bubble_relative_to_ideal == pytest.approx((p - 1) / m)
    assert tl.makespan_s == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1)(t_f + t_b)
    assert tl.bubble("share-of-total") == tl.bubble_fraction
    assert tl.bubble("relative-to-ideal") == tl.bubble_relative_to_ideal


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (3, 12, 2)])
def test_interleaved_bubble_relative_to_ideal(p, m, v):
    # a virtual stage holds 1/v of a rank's layers, so each action takes 1/v
    plan = pipeline_actions("Interleaved1F1B", p, m, v)
    tl = simulate(plan, StageDurations.uniform(p * v, 1 / v, 1 / v, 1 / v))
    assert tl.bubble_relative_to_ideal == pytest.approx((p - 1) / (v * m), rel=0.05)
    plain = simulate(pipeline_actions("1F1B", p, m, 1), StageDurations.uniform(p))
    assert tl.makespan_s < plain.makespan_s


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_h1_is_a_third_of_1f1b(p, m):
    # F = I = W: 1F1B idles (p-1)(F+B) = 3(p-1) per rank, ZB-H1 (p-1)(F+B-W) = (p-1)
    one_f_one_b = simulate(pipeline_actions("1F1B", p, m, 1), StageDurations.uniform(p))
    zb = simulate(pipeline_actions("InterleavedZeroBubble", p, m, 1), StageDurations.uniform(p))
    assert zb.idle_s.sum() / one_f_one_b.idle_s.sum() == pytest.approx(1 / 3, abs=0.05)
    zbv = simulate(pipeline_actions("ZBVZeroBubble", p, m, 2), StageDurations.uniform(2 * p, 0.5, 0.5, 0.5))
    assert zbv.idle_s.sum() <= zb.idle_s.sum() + 1e-9


# --------------------------------------------------------------------------- dependencies


def _all_combos():
    for name in SCHEDULES:
        for p in (2, 3, 4):
            vs = (1,) if name in SINGLE_STAGE_SCHEDULES else (2,) if name in V_SCHEDULES else (1, 2)
            for v in vs:
                for m in (1, 3, 4, 8):
                    if not schedule_problems(name, p, m, v):
                        yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(_all_combos()))
def test_timeline_respects_order_and_data(name, p, m, v):
    plan = pipeline_actions(name, p, m, v)
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    S = plan.num_stages
    dur = StageDurations.of(S, rng.uniform(0.5, 2, S), backward_input_s=rng.uniform(0.5, 2, S),
                            backward_weight_s=rng.uniform(0.2, 1, S), p2p_s=rng.uniform(0, 0.3, S - 1))
    tl = simulate(plan, dur)
    start, end = {}, {}
    for r in range(p):
        acts = tl.actions_of_rank(r)
        assert [Action(k, s, mb) for k, s, mb, _, _ in acts] == list(plan.per_rank[r])
        for (k, s, mb, t0, t1), nxt in zip(acts, acts[1:] + [None]):
            start[(k, s, mb)], end[(k, s, mb)] = t0, t1
            assert t1 >= t0
            if nxt is not None:
                assert nxt[3] >= t1 - 1e-12  # a rank runs one action at a time, in order
    owner = plan.stage_to_rank

    def comm(a, b):
        return dur.p2p_s[min(a, b)] if owner[a] != owner[b] else 0.0

    for (k, s, mb), t0 in start.items():
        if k == "F" and s > 0:
            assert t0 >= end[("F", s - 1, mb)] + comm(s - 1, s) - 1e-12
        if k in "BI":
            assert t0 >= end[("F", s, mb)] - 1e-12
            if s < S - 1:
                up = end.get(("B", s + 1, mb), end.get(("I", s + 1, mb)))
                assert t0 >= up + comm(s, s + 1) - 1e-12
        if k == "W":
            assert t0 >= end[("I", s, mb)] - 1e-12
    assert tl.makespan_s == pytest.approx(max(end.values()))
    assert np.allclose(tl.busy_s + tl.idle_s, tl.makespan_s)
    # every transfer leaves when its producer ends and takes the boundary's p2p time
    tr = tl.transfers
    assert np.all(tr["src_rank"] != tr["dst_rank"])
    assert np.allclose(tr["end_s"] - tr["start_s"], dur.p2p_s[np.where(tr["kind"] == "F", tr["stage"] - 1, tr["stage"])])


def _reference_times(plan, dur):
    """The textbook recurrence, one action at a time, in whichever order the data allows:
    start = max(end of the rank's previous action, end of the dependency + p2p)."""
    owner, S = plan.stage_to_rank, plan.num_stages
    table = {k: dur.table()[i] for i, k in enumerate("FBIW")}
    present = {a for acts in plan.per_rank for a in acts}
    end: dict = {}
    start: dict = {}
    ptr = [0] * plan.pp
    last = [0.0] * plan.pp
    while any(ptr[r] < len(plan.per_rank[r]) for r in range(plan.pp)):
        for r, acts in enumerate(plan.per_rank):
            while ptr[r] < len(acts):
                k, s, mb = a = acts[ptr[r]]
                src, link = None, None
                if k == "F" and s > 0:
                    src, link = ("F", s - 1, mb), s - 1
                elif k == "W":
                    src = ("I", s, mb)
                elif k in "BI" and s < S - 1:
                    src, link = ("I" if ("I", s + 1, mb) in present else "B", s + 1, mb), s
                elif k in "BI":
                    src = ("F", s, mb)
                if src is not None and src not in end:
                    break  # its data is not there yet: next rank
                t = last[r]
                if src is not None:
                    comm = dur.p2p_s[link] if link is not None and owner[src[1]] != r else 0.0
                    t = max(t, end[src] + comm)
                start[a], end[a] = t, t + table[k][s]
                last[r] = end[a]
                ptr[r] += 1
    return start, end


@pytest.mark.parametrize("name,p,m,v", [c for c in _all_combos() if c[2] in (3, 8)])
def test_times_equal_the_textbook_recurrence_exactly(name, p, m, v):
    plan = pipeline_actions(name, p, m, v)
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    S = plan.num_stages
    dur = StageDurations.of(S, rng.random(S), backward_input_s=rng.random(S), backward_weight_s=rng.random(S),
                            p2p_s=rng.random(S - 1) * 0.3)
    tl = simulate(plan, dur)
    start, end = _reference_times(plan, dur)
    for r in range(p):
        for k, s, mb, t0, t1 in tl.actions_of_rank(r):
            assert (t0, t1) == (start[(k, s, mb)], end[(k, s, mb)])  # bit for bit


def test_deadlocking_plan_is_reported():
    # rank 1 wants microbatch 1's forward before 0's, which rank 0 sends only after its backward
    bad = PipelinePlan("custom", 2, 2, 2, (0, 1), (
        (Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)),
        (Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)),
    ))
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad, StageDurations.uniform(2))


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4), (4, 9)])
def test_activation_peaks(p, m):
    gpipe = simulate(pipeline_actions("GPipe", p, m, 1), StageDurations.uniform(p, p2p_s=0.1))
    assert gpipe.peak_activations.tolist() == [m] * p
    one = simulate(pipeline_actions("1F1B", p, m, 1), StageDurations.uniform(p, p2p_s=0.1))
    assert one.peak_activations.tolist() == [min(m, p - r) for r in range(p)]
    times, live = one.activations_in_flight(0)
    assert live.max() == min(m, p) and live[-1] == 0 and np.all(np.diff(times) >= 0)


def test_split_backward_holds_activations_until_w():
    plan = pipeline_actions("InterleavedZeroBubble", 2, 4, 1)
    tl = simulate(plan, StageDurations.uniform(2, 1.0, 1.0, 1.0))
    t, live = tl.activations_in_flight(1)
    # last stage: F0 then I0 W0 later; with F=I=W the count reaches its peak and falls to 0
    assert live[-1] == 0 and tl.peak_activations[1] >= 1
    assert t[-1] == pytest.approx(tl.end_s[tl.rank_slice(1)].max())


# --------------------------------------------------------------------------- output


def test_to_json_shape():
    cfg = _cfg(dp=2, tp=2, pp=2, microbatches=4)
    tl = pipeline_prediction(cfg)
    js = tl.to_json(cfg.conventions.bubble)
    json.dumps(js)
    assert js["schedule"] == "1F1B" and js["bubble_convention"] == "share-of-total"
    assert js["bubble"] == js["bubble_fraction"]
    assert [r["pp_rank"] for r in js["per_rank"]] == [0, 1]
    assert [r["rank"] for r in js["per_rank"]] == [0, 4]  # pp_rank * dp * tp
    first = js["per_rank"][0]["actions"][0]
    assert first[:3] == ["F", 0, 0] and first[3] == 0.0 and first[4] > 0
    assert js["per_rank"][1]["busy_s"] + js["per_rank"][1]["idle_s"] == pytest.approx(js["makespan_s"])


def test_pp1_is_gradient_accumulation_without_bubble():
    cfg = _cfg(dp=1, pp=1, microbatches=3)
    tl = pipeline_prediction(cfg)
    assert tl.pp == 1 and tl.bubble_fraction == 0.0 and tl.idle_s[0] == pytest.approx(0.0)
    assert [a[0] for a in tl.actions_of_rank(0)] == ["F", "B"] * 3
    assert tl.peak_activations.tolist() == [1]


# --------------------------------------------------------------------------- durations


def test_uneven_split_shows_uneven_stages():
    cfg = Config.from_dict({
        "model": {"preset": "tiny", "layers": 10, "vocab": 8},
        "cluster": {"preset": "local-cpu", "gpus": 4},
        "parallel": {"dp": 1, "pp": 4, "schedule": "GPipe", "microbatches": 4},
    })
    d = stage_durations(cfg)
    # 10 layers over 4 stages: 3, 3, 2, 2 (tiny head with vocab 8)
    assert d.forward_s[0] == pytest.approx(d.forward_s[1])
    assert d.forward_s[0] == pytest.approx(1.5 * d.forward_s[2], rel=0.01)
    assert d.forward_s[3] > d.forward_s[2]  # the head lives on the last stage
    assert np.allclose(d.backward_s, d.backward_input_s + d.backward_weight_s)
    assert np.all(d.backward_s > 1.9 * d.forward_s) and np.all(d.backward_s < 2.1 * d.forward_s + 1e-12)


def test_durations_scale_with_hardware_and_recompute():
    base = _cfg(pp=2)
    d = stage_durations(base)
    fast = stage_durations(base.replace(conventions={"compute_efficiency": 1.0}))
    assert np.allclose(fast.forward_s * 2, d.forward_s)  # default efficiency 0.5
    full = stage_durations(base.replace(training={"recompute": "full"}))
    assert np.allclose(full.forward_s, d.forward_s)
    assert np.all(full.backward_s > d.backward_s)
    assert np.allclose(full.backward_weight_s, d.backward_weight_s)
    sel = stage_durations(base.replace(training={"recompute": "selective"}))
    assert np.all(d.backward_s < sel.backward_s) and np.all(sel.backward_s < full.backward_s)


def test_p2p_intra_vs_inter_node_and_sequence_parallel():
    cfg = Config.from_dict({
        "model": {"preset": "tiny"},
        "cluster": {"preset": "local-cpu", "gpus": 8, "gpus_per_node": 4},
        "parallel": {"dp": 1, "tp": 2, "pp": 4, "schedule": "1F1B", "microbatches": 4},
    })
    cl = cfg.cluster
    nbytes = activation_bytes_per_microbatch(cfg)
    dtype_bytes = 4 if cfg.training.precision == "fp32" else 2
    assert nbytes == cfg.training.micro_batch_size * cfg.model.seq_len * cfg.model.hidden * dtype_bytes
    p2p = stage_durations(cfg).p2p_s
    # inside a node the receiver also wakes (local CPU ranks: engine.time.durations.cpu_wake_s)
    intra = (cl.intra_node_latency_us + cl.cpu_wake_latency_us) * 1e-6 + nbytes / cl.intra_node_bytes_per_s
    inter = cl.inter_node_latency_us * 1e-6 + nbytes / cl.inter_node_bytes_per_s
    # pp ranks sit at global ranks 0, 2, 4, 6; nodes hold 4 GPUs: 0-2 intra, 2-4 inter, 4-6 intra
    assert p2p.tolist() == pytest.approx([intra, inter, intra])
    sp = cfg.replace(parallel={"sequence_parallel": True})
    assert activation_bytes_per_microbatch(sp) == nbytes // 2


def test_v_turn_has_no_transfer():
    cfg = _cfg(pp=2, schedule="ZBVZeroBubble", virtual_stages=2, microbatches=4)
    p2p = stage_durations(cfg).p2p_s
    assert p2p[1] == 0.0 and p2p[0] > 0 and p2p[2] > 0  # stages 1 and 2 both live on rank 1


def test_calibration_overrides():
    cfg = _cfg(pp=2)
    d = stage_durations(cfg, forward_s=[0.1, 0.2], backward_s=0.4, p2p_s=0.0)
    assert d.forward_s.tolist() == [0.1, 0.2] and d.backward_s.tolist() == [0.4, 0.4]
    assert np.allclose(d.backward_input_s + d.backward_weight_s, 0.4)
    assert d.source == "model+given"
    d2 = stage_durations(cfg, backward_input_s=0.3, backward_weight_s=0.1)
    assert np.allclose(d2.backward_s, 0.4)
    tl = pipeline_prediction(cfg, StageDurations.of(2, 1.0, 2.0))
    assert tl.makespan_s == pytest.approx((4 + 2 - 1) * 3.0)
    with pytest.raises(ValueError):
        StageDurations.of(2, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        StageDurations.of(2, -1.0)


def test_default_config_predicts():
    from engine import default_config

    tl = pipeline_prediction(default_config())
    assert tl.makespan_s > 0 and 0 < tl.bubble_fraction < 1
    assert math.isfinite(tl.bubble_relative_to_ideal)


def test_rank_peak_over_local_stages():
    p, m = 4, 8
    one = simulate(pipeline_actions("1F1B", p, m, 1), StageDurations.uniform(p))
    assert [one.peak_activations_of_rank(r)[0] for r in range(p)] == [(min(m, p - r),) for r in range(p)]
    bfs = simulate(pipeline_actions("LoopedBFS", p, m, 2), StageDurations.uniform(2 * p))
    assert bfs.peak_activations_of_rank(1) == ((m, m), 2.0 * m)  # breadth-first: everything alive
    zbv = simulate(pipeline_actions("ZBVZeroBubble", p, m, 2), StageDurations.uniform(2 * p))
    per_stage, total = zbv.peak_activations_of_rank(0, stage_bytes=[2.0] + [1.0] * (2 * p - 1))
    assert len(per_stage) == 2 and total == 2.0 * per_stage[0] + per_stage[1]


# --------------------------------------------------------------------------- the two simulation loops


@pytest.mark.parametrize("name", SCHEDULES)
def test_wave_by_wave_run_gives_the_action_by_action_bits(name):
    """``_run_waves`` (numpy, a wave of independent actions at a time) against ``_run`` (Python, an action
    at a time): the same end times to the bit, on random durations and p2p per stage, every schedule."""
    from engine.pipeline.timeline import _comm_seconds, _graph, _run, _run_waves

    rng = np.random.default_rng(sum(map(ord, name)))
    for p, v, m in ((1, 1, 6), (2, 1, 4), (4, 1, 12), (3, 2, 9), (4, 2, 16), (8, 2, 32)):
        if name in SINGLE_STAGE_SCHEDULES and v != 1 or name in V_SCHEDULES and v != 2:
            continue
        if p == 1 and name not in SINGLE_STAGE_SCHEDULES and name not in V_SCHEDULES:
            continue
        if schedule_problems(name, p, m, v):
            continue
        plan = pipeline_actions(name, p, m, v)
        s = plan.num_stages
        d = StageDurations(rng.uniform(0.1, 2, s), rng.uniform(0.1, 4, s), rng.uniform(0.1, 2, s),
                           rng.uniform(0.1, 2, s), rng.uniform(0, 0.5, s - 1))
        g = _graph(plan)
        dur = d.table()[g.kind, g.stage]
        comm = _comm_seconds(g, d)
        one = _run(g, dur.tolist(), comm.tolist())
        waves = _run_waves(g, dur, comm)
        assert np.array_equal(one, waves), (p, v, m)
        # and simulate() takes the wave path on a plan it sees again, with the same timeline
        first = simulate(plan, d)
        again = simulate(plan, d)
        assert np.array_equal(first.start_s, again.start_s) and np.array_equal(first.end_s, again.end_s)


def test_simulate_runs_wide_plans_wave_by_wave_when_seen_again(monkeypatch):
    from engine.pipeline import timeline

    original, calls = timeline._run_waves, []
    monkeypatch.setattr(timeline, "_run_waves", lambda *a: calls.append(1) or original(*a))
    wide = pipeline_actions("1F1B", 16, 128, 1)  # 4,096 actions in ~290 waves
    d = StageDurations.uniform(16, 1.0, 2.0, 1.0, 0.1)
    first = simulate(wide, d)
    assert calls == []  # a plan seen once: no waves computed for it
    again = simulate(wide, d)
    assert calls == [1] and np.array_equal(first.end_s, again.end_s)
    narrow = pipeline_actions("1F1B", 4, 8, 1)  # 64 actions: action by action always
    simulate(narrow, d.__class__.uniform(4, 1.0, 2.0, 1.0))
    simulate(narrow, d.__class__.uniform(4, 1.0, 2.0, 1.0))
    assert calls == [1]
