"""engine.memory.lifetimes: each rank's peak is one moment of its step, its categories the terms alive
then; the step's allocation events replayed through the caching allocator give ``reserved``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Config, ConfigError, default_config
from engine.compare.measured import compare
from engine.memory import memory_per_rank
from engine.memory.allocator import AllocatorOutOfMemory, replay, round_size
from engine.memory.lifetimes import (
    ACTION,
    ACTION_KINDS,
    END_FREED_KINDS,
    HEAD_KINDS,
    LIFETIMES,
    STEP_FREED_KINDS,
    TRANSIENT,
    allocation_events,
    canonical_event_signature,
    fsdp_params_lifetime,
    moments,
    peak_of,
    replay_events,
    sig_moments,
)
from engine.names import MEMORY_CATEGORIES
from engine.pipeline.schedules import microbatches_in_flight, schedule_problems
from engine.predict import predict

ROOT = Path(__file__).resolve().parents[3]


def _cfg(parallel: dict, gpus: int | None = None, training: dict | None = None, conventions: dict | None = None,
         preset: str = "tiny", cluster: str = "dgx-h100") -> Config:
    d = {"model": {"preset": preset}, "cluster": {"preset": cluster}, "parallel": parallel,
         "training": training or {}, "conventions": conventions or {}}
    if gpus:
        d["cluster"]["gpus"] = gpus
    return Config.from_dict(d)


LAYOUTS = [
    {"dp": 2, "pp": 2, "microbatches": 4},
    {"dp": 2, "zero": 3},
    {"dp": 4, "zero": 2, "microbatches": 4},
    {"dp": 2, "tp": 2, "pp": 2, "zero": 2, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 4},
    {"dp": 2, "pp": 2, "zero": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 4},
    {"dp": 2, "pp": 4, "zero": 3, "schedule": "InterleavedZeroBubble", "virtual_stages": 2, "microbatches": 8},
    {"pp": 4, "schedule": "DualPipeV", "virtual_stages": 2, "microbatches": 8},
    {"pp": 2, "schedule": "GPipe", "microbatches": 4},
]


def _world(par: dict) -> int:
    return par.get("dp", 1) * par.get("tp", 1) * par.get("pp", 1)


@pytest.mark.parametrize("par", LAYOUTS)
def test_categories_are_the_snapshot_at_the_peak_and_sum_to_the_total(par):
    rep = memory_per_rank(_cfg(par, gpus=_world(par), training={"precision": "bf16-mixed"}))
    for r in rep.per_rank:
        body = r._body
        tl = body.timeline
        snap_tracked = sum(t.bytes for c in MEMORY_CATEGORIES for t in r.explain(c) if t.tracked)
        assert r.allocated == tl.peak.bytes == snap_tracked
        assert r.total == sum(getattr(r, c) for c in MEMORY_CATEGORIES)
        for c in MEMORY_CATEGORIES:
            assert getattr(r, c) == sum(t.bytes for t in r.explain(c))
        # every term at its largest at once is an upper bound of one moment
        assert r.total <= sum(t.bytes for c in MEMORY_CATEGORIES for t in r.catalogue(c))
        # the model states are alive all step, whole, but FSDP2's sharded gradients: each unit's
        # post-backward makes its own only with gradient sync on (torch 2.13,
        # torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, FSDPParamGroup.post_backward:
        # "if not self.reduce_grads: ... return" before foreach_reduce), which the training loop turns on
        # for the last microbatch only (backend/train.py: "model.set_requires_gradient_sync(last)") and
        # pipelining only at REDUCE_GRAD: they are whole at the end of the backward, absent before. A rank
        # with several stages reduces each right after that stage's last backward (torch's
        # _add_reduce_grad), so there each stage's are laid from its own REDUCE_GRAD on, a term per stage.
        # Plain gradients (no FSDP2, no bucket view) from the first backward on (a split backward's first W):
        # zero_grad(set_to_none) dropped the last step's, and AccumulateGrad makes each as the first backward
        # reaches it
        alive = dict(zip(TRANSIENT, tl.peak.alive))
        several = len(body.stages) > 1
        pk, local = tl.peak, sorted(body.stages)
        for c in ("params", "grads", "optimizer"):
            want = []
            for i, t in enumerate(r.catalogue(c)):
                life = tl.lifetime(c, i)
                if t.kind == "fsdp_sharded_grads":
                    assert life == ("stage_reduced" if several else "end_of_backward")
                    assert (t.stage is not None) == several
                elif t.kind == "fsdp_reduced_grads":  # those reduced by the late-backward moment (m = 1)
                    assert life == "late_backward"
                elif t.kind == "fsdp_early_reduce":  # the last block's, reduced by the second block's backward
                    assert life == "early_backward"
                elif t.kind == "gradients":  # made by a B, or under a split backward by the W; per stage on several
                    split = par.get("schedule") in ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")
                    assert life == ("stage_reduced" if several else "after_first_weight" if split
                                    else "after_first_backward")
                    assert (t.stage is not None) == several
                elif t.kind == "plain_grads_accumulating":  # the same tensors, from that stage's first B or W
                    assert several and life == "stage_accumulated"
                elif t.kind == "plain_early_grads":  # what of them the rank's first B has made by its own moment
                    assert not several and life == "first_backward"
                elif t.kind == "plain_late_grads":  # and by its walk's first block (its late moment)
                    assert not several and life == "late_backward"
                else:
                    assert life == "step"
                if life == "step" or (pk.red[local.index(t.stage)] if life == "stage_reduced"
                                      else pk.acc[local.index(t.stage)] if life == "stage_accumulated" else alive[life]):
                    want.append(t)
            got = [t for t in r.explain(c) if t.bytes or t.kind != "none"]
            assert got == want
        assert r.peak_moment.startswith(("stage ", "the end of the backward, after stage ", "the optimizer step, after stage "))


def test_without_a_pipeline_the_peak_is_the_largest_of_the_moments_of_each_microbatch_and_the_end():
    """pp = 1: one microbatch at a time, F, then B opened by its loss moment, then the end of the
    backward. F: the unit transients and its activations but the loss side (the blocks' forward comes
    before the final norm and the head make it); the loss moment: the loss and its
    activations; B: every transient but the loss (the first block's MLP backward too), and its
    activations but the loss side (what the final norm, the head and the loss saved: their backward
    ran first, so the blocks' backward, the action's own moment, comes after they were freed); the end:
    no activation, the unit and gradient transients. From the end of the first backward on, the terms
    of ``after_first_backward`` are alive (FSDP2's accumulated gradients); FSDP2's sharded gradients
    (``end_of_backward``) only at the end, as gradient sync is on only for the last microbatch, and by
    then the accumulated unsharded ones are gone (each unit's reducing post-backward drops them)."""
    for par in ({"dp": 2}, {"dp": 2, "zero": 3, "microbatches": 2}, {"tp": 2}, {"dp": 2, "zero": 3}):
        m = par.get("microbatches", 1)
        rep = memory_per_rank(_cfg(par, gpus=_world(par)))
        for r in rep.per_rank:
            tl = r._body.timeline
            b: dict[str, int] = {}
            for c in MEMORY_CATEGORIES:
                for i, t in enumerate(r.catalogue(c)):
                    if t.tracked:
                        b[tl.lifetime(c, i)] = b.get(tl.lifetime(c, i), 0) + t.bytes
            g = b.get
            base, act, late = g("step", 0), g("microbatch", 0), g("after_first_backward", 0)
            base_actions = base + g("until_end_of_backward", 0)  # (replicate's units: gathered to their post-backward)
            # unpipelined ZeRO-3: the root unit at every action and at the end, the current block's unit and the
            # next one's all-gather output at the actions only
            unit, bwd = g("every_action", 0) + g("during_actions", 0), g("backward", 0) + g("backward_input", 0)
            assert g("loss", 0) > 0
            head = sum(t.bytes for c in MEMORY_CATEGORIES for t in r.catalogue(c) if t.kind in HEAD_KINDS)
            assert head > 0
            moments_bytes = []
            for k in range(m):
                before = late if k else 0
                moments_bytes += [base_actions + unit + act - head + before, base_actions + g("loss", 0) + act + before,
                                  base_actions + unit + bwd + g("full_backward", 0) + act - head + before]
            # one microbatch under ZeRO-3: late in the B (its second block), the B's transients, no saved tensor
            # but what the late-backward lifetime holds (the first block's), the sharded gradients reduced by then
            if g("late_backward", 0):
                assert m == 1
                moments_bytes.append(base_actions + unit + bwd + g("full_backward", 0) + g("late_backward", 0))
            # by the end, the reducing post-backward has dropped FSDP2's accumulated unsharded gradients; the
            # root's post-backward (post_backward) beside the root unit, still gathered
            acc = sum(t.bytes for c in MEMORY_CATEGORIES for i, t in enumerate(r.catalogue(c))
                      if t.kind in END_FREED_KINDS and tl.lifetime(c, i) == "after_first_backward")
            moments_bytes.append(base + g("every_action", 0) + g("backward", 0) + late - acc + g("end_of_backward", 0)
                                 + g("post_backward", 0))
            # the optimizer step: what the end holds but the last unit's transients and autocast's cached
            # casts (its context has exited), with AdamW's temporaries
            assert g("optimizer_step", 0) > 0
            casts = sum(t.bytes for c in MEMORY_CATEGORIES for t in r.catalogue(c) if t.kind in STEP_FREED_KINDS)
            moments_bytes.append(base - casts + late - acc + g("end_of_backward", 0) + g("optimizer_step", 0))
            assert r.allocated == max(moments_bytes)
            i = moments_bytes.index(max(moments_bytes))
            extra = len(moments_bytes) - 3 * m - 2  # the late-backward moment
            what = ("late in stage 0 B" if extra and i == 3 * m else
                    "the end of the backward" if i == 3 * m + extra else "the optimizer step" if i == 3 * m + 1 + extra
                    else ("F", "B", "B")[i % 3] + f" of microbatch {i // 3}")
            assert what in r.peak_moment
            assert ("at its start: the loss" in r.peak_moment) == (i < 3 * m and i % 3 == 1)
    # a large vocabulary's loss beats them (Llama 3 8B FSDP 8, mbs 2, s 8192, full recompute): at
    # the loss no sharded gradient exists yet
    r = memory_per_rank(Config.load(ROOT / "assets/examples/fake/llama3-8b-fsdp8-full.toml")).per_rank[0]
    assert "at its start: the loss" in r.peak_moment
    assert "fsdp_sharded_grads" not in {t.kind for t in r.explain("grads")}
    # without a large loss, the optimizer step: gradients complete, no activation, AdamW's foreach
    # temporaries, 4 B a local element, above the end of the backward's root unit and its gradient
    # (Llama 3 70B FSDP 8 × TP 8, s 8192)
    r = memory_per_rank(Config.load(ROOT / "assets/examples/fake/llama3-70b-fsdp8-tp8.toml")).per_rank[0]
    assert "the optimizer step" in r.peak_moment
    assert r.activations == 0 and "fsdp_sharded_grads" in {t.kind for t in r.explain("grads")}
    step = [t for t in r.explain("temporaries") if t.kind == "optimizer_step"]
    assert len(step) == 1 and step[0].bytes == sum(t.bytes for t in r.explain("params") if t.kind == "parameters")


#: term kind -> the transient lifetime it has
_TRANSIENT_KIND = {"fsdp_unsharded_grads": "after_first_backward", "mlp_backward": "full_backward",
                   "loss": "loss", "recomputed_block": "backward_input", "held_input_gradient": "after_first_backward",
                   "fsdp_sharded_grads": "end_of_backward"}


@pytest.mark.parametrize("par,some_below", [
    ({"dp": 2, "pp": 4, "schedule": "InterleavedZeroBubble", "virtual_stages": 2, "microbatches": 4}, True),
    ({"dp": 2, "pp": 4, "schedule": "GPipe", "microbatches": 4}, True),
    ({"dp": 2, "pp": 4, "zero": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 8}, True),
    # with two stages per rank each stage's gradients are its own: unsharded from its first backward to
    # its REDUCE_GRAD, sharded after it (made inside the backward for the stage that finishes first)
    ({"dp": 2, "pp": 4, "zero": 3, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 8}, True),
    # one stage per rank: the steady state's forwards hold the warm-up's microbatches again, now with the
    # unsharded gradients: every rank's peak holds every term but those alive only apart from the steady
    # state (None): the loss (its own moments) and FSDP2's all-gather output (units never resharded: the
    # first forwards only), the sharded gradients (the end of the backward), AdamW's step temporaries, the
    # token embedding's fresh gradient (the ends of the first stage's Bs), a forward's own transients (its Fs) and
    # the gradients a first B has made by its moment (that B's only)
    ({"dp": 2, "pp": 4, "zero": 3, "schedule": "1F1B", "microbatches": 8}, None),
])
def test_a_transient_term_is_in_the_peak_exactly_when_its_lifetime_covers_the_peak_moment(par, some_below):
    """The first block's MLP backward (full backwards), FSDP2's unsharded gradients (from the first backward),
    the loss (the last stage's backward): each is in the snapshot iff alive at the peak; where one is
    not, the peak is below the sum of every term at its largest (what the model used to report)."""
    c = _cfg(par, gpus=8, preset="llama3-8b", training={"precision": "bf16-mixed"})
    below = 0
    for r in memory_per_rank(c).per_rank:
        pk = r._body.timeline.peak
        alive = dict(zip(TRANSIENT, pk.alive))
        local = sorted(r.stages)
        for cat in MEMORY_CATEGORIES:
            shown = {(t.kind, t.stage) for t in r.explain(cat)}
            for i, t in enumerate(r.catalogue(cat)):
                if t.kind in _TRANSIENT_KIND and t.bytes:
                    life = _TRANSIENT_KIND[t.kind]
                    per_stage = t.kind in ("fsdp_sharded_grads", "fsdp_unsharded_grads") and len(r.stages) > 1
                    if per_stage:  # each stage's own: unsharded to its REDUCE_GRAD, sharded after it
                        life = "stage_reduced" if t.kind == "fsdp_sharded_grads" else "stage_accumulated"
                        on = bool((pk.red if life == "stage_reduced" else pk.acc)[local.index(t.stage)])
                    else:
                        on = alive[life]
                    assert r._body.timeline.lifetime(cat, i) == life
                    assert ((t.kind, t.stage) in shown) == on, (r.rank, t.kind, t.stage)
        is_below = r.total < sum(t.bytes for cat in MEMORY_CATEGORIES for t in r.catalogue(cat))
        if some_below is None:
            tl = r._body.timeline
            apart = sum(t.bytes for cat in MEMORY_CATEGORIES for i, t in enumerate(r.catalogue(cat))
                        if tl.lifetime(cat, i) in ("loss", "end_of_backward", "first_forwards", "stage_reduced",
                                                   "optimizer_step", "backward_end", "later_backward_end",
                                                   "reduce_grad", "forwards", "first_backward")
                        or (tl.lifetime(cat, i) == "stage_accumulated" and not pk.acc[local.index(t.stage)]))
            every = sum(t.bytes for cat in MEMORY_CATEGORIES for t in r.catalogue(cat))
            assert every - apart <= r.total < every, r.rank  # the loss moment can be above the rest
        below += is_below
    assert bool(below) == (some_below is not False)


def test_per_microbatch_terms_are_rescaled_to_the_microbatches_alive_at_the_peak():
    c = _cfg({"pp": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 4}, gpus=2)
    for r in memory_per_rank(c).per_rank:
        pk = r._body.timeline.peak
        col = {s: j for j, s in enumerate(sorted(r.stages))}
        full = {(t.label, t.stage): t for t in r.catalogue("activations")}
        for t in r.explain("activations"):
            if t.kind == "layers":
                assert t.in_flight == pk.counts[col[t.stage]]
                if "alive at the peak" in t.label:
                    orig = next(o for o in full.values() if o.stage == t.stage and o.kind == t.kind
                                and o.bytes // o.in_flight * t.in_flight == t.bytes)
                    assert orig.in_flight > t.in_flight


@pytest.mark.parametrize("sc", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_a_split_backwards_plain_gradients_exist_per_stage_from_its_first_w(sc):
    """Plain ``.grad`` is made by AccumulateGrad the first time a backward reaches a parameter, and under a split
    backward that is the stage's W (its I computes input gradients only; stage 0's I runs nothing): on a rank of
    several stages each stage's gradients are alive from the end of its own first W, not the rank's (``measure
    --fake`` of Llama 3 8B InterleavedZeroBubble pp2 v2 tp8: rank 0 peaks in stage 2's second W with none of
    stage 0's 2.2 GiB). At every rank's peak the gradients are those of the stages whose first W (or full B) has ended."""
    par = {"pp": 2, "schedule": sc, "virtual_stages": 2, "microbatches": 4}
    c = _cfg(par, gpus=2, training={"precision": "bf16-mixed"})
    for r in memory_per_rank(c).per_rank:
        tl = r._body.timeline
        mo = sig_moments(tl.signature)
        pk = tl.peak
        local = sorted(r.stages)
        done = {int(mo.stage[i]) for i in range(pk.moment) if ACTION_KINDS[int(mo.kind[i])] in ("B", "W")}
        assert done <= set(local)
        grads = {t.stage for t in r.explain("grads") if t.kind in ("gradients", "plain_grads_accumulating")}
        assert grads == done, (r.rank, pk, grads, done)
        assert {t.stage for t in r.catalogue("grads") if t.kind == "gradients"} == set(local)


def test_a_stage_the_weighted_in_flight_state_leaves_empty_still_weighs_its_microbatches():
    """GPT-2 interleaved zero-bubble pp2 v2 m4: rank 0's heaviest in-flight state holds 4 microbatches of stage 0 and
    none of stage 2, whose terms then carried 0 bytes — every moment that does hold stage 2's microbatches laid
    them as nothing (``measure --fake`` of this layout at s = 8K: −6.7 % at its peak, its F(2, 0) 0.48 GiB up where
    the engine stayed flat). Every local stage with blocks weighs its microbatches, and each F adds its own."""
    c = _cfg({"dp": 8, "pp": 2, "schedule": "InterleavedZeroBubble", "virtual_stages": 2, "microbatches": 4}, gpus=16,
             training={"micro_batch_size": 1, "precision": "bf16-mixed"}, preset="gpt2-124m").replace(
        model={"layers": 8, "seq_len": 8192})
    assert microbatches_in_flight("InterleavedZeroBubble", 0, 2, 2, 4, (10, 9)) == (4, 0)
    r = memory_per_rank(c).per_rank[0]
    sig = r._body.timeline.signature
    assert all(u > 0 for u in sig.unit_bytes)
    layers = {t.stage: t for t in r.catalogue("activations") if t.kind == "layers"}
    assert layers[2].bytes > 0 and layers[2].in_flight == 2  # the most it holds


@pytest.mark.parametrize("sc,v", [("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
                                  ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("GPipe", 1), ("LoopedBFS", 2)])
def test_the_moments_reach_the_in_flight_peak_of_the_schedule(sc, v):
    """The most stage-microbatches alive at any moment (weighted) is the in-flight rule's peak."""
    p, m = 4, 8
    if schedule_problems(sc, p, m, v):
        pytest.skip("combination torch refuses")
    for rank in range(p):
        mo = moments(sc, rank, p, v, m)
        for weights in ((1,) * v, tuple(range(1, v + 1)), tuple(range(v, 0, -1))):
            best = microbatches_in_flight(sc, rank, p, v, m, weights)
            got = max(sum(n * w for n, w in zip(row, weights)) for row in mo.counts.tolist())
            assert got == sum(n * w for n, w in zip(best, weights))
        assert mo.counts.min() >= 0 and mo.counts[-1].sum() <= v  # the last backward frees its own


def test_every_tracked_term_kind_has_a_lifetime():
    kinds = set()
    for par in LAYOUTS + [{"dp": 2, "zero": 1}, {"dp": 2}]:
        for training in ({}, {"precision": "bf16-mixed", "recompute": "full"}, {"finetune": "lora"},
                         {"recompute": "selective-op"}):
            try:
                c = _cfg(par, gpus=_world(par), training=training)
            except ConfigError:
                continue
            for r in memory_per_rank(c).per_rank:
                for cat in MEMORY_CATEGORIES:
                    for t in r.catalogue(cat):
                        per_mb = cat == "activations" and t.stage is not None and t.in_flight is not None
                        if t.tracked and not per_mb:
                            kinds.add(t.kind)
    unknown = kinds - set(LIFETIMES) - {"fsdp_unsharded_params"}
    assert not unknown, f"kinds without a lifetime rule: {unknown}"


# --------------------------------------------------------------------------- reserved


def test_the_events_replay_to_the_peak_allocated():
    """The allocator's most allocated bytes are the timeline's peak, rounded up block by block (the
    peak of the moments up to the end of the backward: the optimizer step's temporaries are not laid)."""
    for par in LAYOUTS:
        rep = memory_per_rank(_cfg(par, gpus=_world(par)))
        for group in rep.distinct():
            r = group[0]
            ev = r._body.timeline.events()
            laid = peak_of(r._body.timeline._event_signature()[0]).bytes
            assert laid <= r.allocated
            stats = replay(ev)
            live, most, top = {}, 0, 0
            for e in ev:
                if e[0] == "alloc":
                    live[e[1]] = e[2]
                else:
                    del live[e[1]]
                exact = sum(live.values())
                if exact > top:
                    top, most = exact, sum(round_size(x) for x in live.values())
            assert top == laid
            # the allocator counts whole blocks: a large-pool block is not split for a remainder ≤ 1 MiB
            assert laid <= stats.max_allocated <= most + (2**20 + 512) * len(ev)
            assert r.reserved >= stats.max_allocated
            assert r.reserved == stats.max_reserved or r.reserved == r.allocated + sum(
                t.bytes for t in r.explain("overhead") if t.kind == "allocator_slack")


def test_all_gathers_are_on_their_own_stream():
    r = memory_per_rank(_cfg({"dp": 2, "zero": 3}, gpus=2)).per_rank[0]
    streams = {e[3] for e in r._body.timeline.events() if e[0] == "alloc" and len(e) > 3}
    # FSDP2's sharded gradients are views of the reduce-scatter output, which torch 2.13 allocates on the
    # reduce-scatter stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce:
    # "with device_handle.stream(reduce_scatter_stream): reduce_output = reduce_scatter_comm.allocate(...)",
    # then "new_sharded_grad = torch.as_strided(reduce_output, ...)"): stream 2, every byte of them
    assert streams == {1, 2}
    on_rs = sum(e[2] for e in r._body.timeline.events() if e[0] == "alloc" and len(e) > 3 and e[3] == 2)
    # (and the late-backward moment's: those reduced by then, the same tensors)
    assert on_rs == sum(t.bytes for t in r.catalogue("grads")
                        if t.kind in ("fsdp_sharded_grads", "fsdp_reduced_grads")) > 0


def test_cpu_ranks_reserve_what_they_allocate():
    c = default_config()
    assert c.cluster.gpu.name == "cpu"
    for r in memory_per_rank(c).per_rank:
        assert r.reserved == r.allocated == r.total  # no overhead counted on CPU ranks
        assert r.device_bytes == r.reserved


def test_fits_compares_reserved_and_untracked_overhead_with_the_card():
    c = _cfg({"dp": 8, "zero": 3}, preset="llama3-8b", training={"precision": "bf16-mixed"})
    r = memory_per_rank(c).per_rank[0]
    untracked = sum(t.bytes for t in r.explain("overhead") if not t.tracked)
    assert untracked > 0 and r.reserved >= r.allocated
    assert r.device_bytes == r.reserved + untracked
    assert r.fits == (r.device_bytes <= c.cluster.gpu.memory_bytes)


def test_allocator_slack_is_a_floor_on_the_reserve_not_added_to_it():
    base = _cfg({"dp": 2, "pp": 2, "microbatches": 4}, gpus=4)
    slack = _cfg({"dp": 2, "pp": 2, "microbatches": 4}, gpus=4, conventions={"allocator_slack_fraction": 0.5})
    for a, b in zip(memory_per_rank(base).per_rank, memory_per_rank(slack).per_rank):
        assert a.allocated == b.allocated
        term = next(t for t in b.explain("overhead") if t.kind == "allocator_slack")
        assert term.bytes == int(b.allocated * 0.5) and not term.tracked
        assert b.reserved == max(a.reserved, b.allocated + term.bytes)
        assert b.device_bytes == b.reserved + (a.device_bytes - a.reserved)  # the slack is not counted twice


def test_expandable_segments_is_a_convention_and_is_validated():
    c = _cfg({"dp": 2, "pp": 2, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 4}, gpus=4,
             preset="llama3-8b", training={"precision": "bf16-mixed"})
    assert c.conventions.expandable_segments is False
    on = c.replace(conventions={"expandable_segments": True})
    for a, b in zip(memory_per_rank(c).per_rank, memory_per_rank(on).per_rank):
        assert a.allocated == b.allocated and b.reserved >= b.allocated
    assert any(a.reserved != b.reserved for a, b in zip(memory_per_rank(c).per_rank, memory_per_rank(on).per_rank))
    with pytest.raises(ConfigError, match="conventions.expandable_segments"):
        Config.from_dict({**c.to_dict(), "conventions": {"expandable_segments": "yes"}})
    assert "expandable_segments" in predict(on).conventions["overhead.reserved"]


def test_predict_json_has_allocated_and_reserved_on_every_rank(tmp_path):
    c = _cfg({"dp": 2, "pp": 2, "microbatches": 4}, gpus=4)
    path = tmp_path / "job.toml"
    c.save(path)
    out = subprocess.run([sys.executable, "-m", "gui.cli", "predict", str(path), "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)["memory"]["per_rank"]
    assert len(rows) == 4
    pred = predict(c)
    for row, r in zip(rows, pred.memory.per_rank):
        assert row["reserved"] == r.reserved >= row["allocated"] == r.allocated
    text = subprocess.run([sys.executable, "-m", "gui.cli", "predict", str(path)], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    assert "allocated" in text and "reserved" in text


def test_compare_names_allocated_and_reserved():
    c = _cfg({"dp": 2}, gpus=2)
    pred = predict(c)
    rows = [r.to_dict() for r in pred.memory.per_rank]
    meas = {"memory": {"per_rank": rows}, "step": {"seconds": 1.0}, "pipeline": {"per_rank": []},
            "ranks": [{"rank": r["rank"], "max_memory_allocated": r["allocated"],
                       "max_memory_reserved": r["reserved"] + 2**20} for r in rows]}
    cmp = compare(pred, meas)
    for rc, r in zip(cmp.memory, pred.memory.per_rank):
        assert rc.allocated.predicted == rc.allocated.measured == r.allocated
        assert rc.reserved["predicted"] == rc.reserved_cell.predicted == r.reserved
        assert rc.reserved["error"] == rc.reserved_cell.error == -2**20
    assert cmp.summary()["reserved"] == pytest.approx(max(2**20 / (r.reserved + 2**20) for r in pred.memory.per_rank))
    assert "reserved" in cmp.to_json()["memory"]["per_rank"][0]


def test_repeated_events_are_cached():
    c = _cfg({"tp": 8, "pp": 8, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 32},
             preset="llama3-405b", cluster="h100-pod-64", training={"precision": "bf16-mixed", "recompute": "full"})
    a = memory_per_rank(c)
    sig = a.per_rank[0]._body.timeline._event_signature()
    assert allocation_events(sig) is allocation_events(sig)
    assert [r.reserved for r in memory_per_rank(c).per_rank] == [r.reserved for r in a.per_rank]


@pytest.mark.parametrize("training", [{"recompute": "none"}, {"recompute": "full"}, {"recompute": "selective-op"},
                                      {"recompute": "selective-layer", "compile": True}])
def test_repeating_microbatches_replay_once_and_reserve_the_same(training):
    """On a one-stage rank the microbatches after the first backward lay the same events up to their
    keys: they are one cycle, and the replay reserves what the events written out reserve (with and
    without expandable segments, and against a capacity that makes the allocator release its cache)."""
    for par in ({"dp": 8, "zero": 3, "microbatches": 16}, {"dp": 4, "tp": 2, "zero": 2, "microbatches": 8},
                {"dp": 8, "microbatches": 6}):
        for es in (False, True):
            c = _cfg(par, gpus=8, preset="llama3-8b", training={"precision": "bf16-mixed", **training},
                     conventions={"expandable_segments": es})
            r = memory_per_rank(c).per_rank[0]
            sig = r._body.timeline._event_signature()
            flat, packed = allocation_events(sig), replay_events(sig)
            cycles = [e for e in packed if e[0] == "cycle"]
            # every microbatch but the first (its backward lays what lives from then on), and at most the last
            assert len(cycles) == 1 and cycles[0][2] >= par["microbatches"] - 2 and cycles[0][3] == 1
            assert len(packed) < len(flat)
            for cap in (None, r.allocated + 2**30, r.reserved):
                assert _replayed(packed, es, cap) == _replayed(flat, es, cap)


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
                                         ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("GPipe", 1), ("LoopedBFS", 2)])
def test_a_pipeline_ranks_steady_state_is_one_cycle_and_reserves_the_same(schedule, v):
    """Under pipelining a rank's steady state repeats its periods with every microbatch shifted (the
    last stage adding its kept outputs): one cycle, which the replay stops running once the allocator
    loops; every rank reserves what its events written out reserve, with and without expandable
    segments, and against capacities that make the allocator release its cache or run out."""
    looped = 0
    for m, recompute in ((24, "none"), (40, "full")):
        c = _cfg({"tp": 2, "pp": 4, "zero": 2, "schedule": schedule, "virtual_stages": v, "microbatches": m},
                 gpus=8, preset="llama3-8b", training={"precision": "bf16-mixed", "recompute": recompute})
        for es in (False, True):
            c = c.replace(conventions={"expandable_segments": es})
            for g in memory_per_rank(c).distinct_groups():
                r = g.first
                sig = r._body.timeline._event_signature()
                flat, packed = allocation_events(sig), replay_events(sig)
                looped += any(e[0] == "cycle" for e in packed)
                for cap in (None, r.allocated + 2**30, r.reserved, r.allocated):
                    assert _replayed(packed, es, cap) == _replayed(flat, es, cap), (m, es, r.rank, cap)
    assert looped >= (4 if schedule not in ("GPipe", "LoopedBFS") else 0)


def test_a_thousand_microbatches_replay_in_a_few_periods():
    """The steady state of 1,024 microbatches costs the replay the periods until the allocator loops
    (about the microbatches in flight), not 1,024: a rank's reserve is found in milliseconds and equals
    the reserve of the same events with the cycle's periods written out."""
    import engine.memory.allocator as allocator

    c = _cfg({"tp": 8, "pp": 8, "zero": 2, "schedule": "DualPipeV", "virtual_stages": 2, "microbatches": 1024},
             preset="llama3-8b", cluster="h100-pod-64", training={"precision": "bf16-mixed", "recompute": "full"})
    r = memory_per_rank(c).per_rank[-1]  # the last stage: every microbatch's kept outputs grow its reserve
    sig = r._body.timeline._event_signature()
    packed = replay_events(sig)
    (cycle,) = [e for e in packed if e[0] == "cycle"]
    assert cycle[2] > 1000
    ran = []
    real = allocator._replay_into
    try:
        allocator._replay_into = lambda a, ev, live, at: (ran.append(at), real(a, ev, live, at))
        fast = allocator.replay(packed)
    finally:
        allocator._replay_into = real
    assert ran.count(packed.index(cycle)) < 300  # of 1,015 periods
    written = []
    for e in packed:
        if e[0] == "cycle":
            for k in range(e[2]):
                written.extend((x[0], e[4].shift(x[1], k * e[3])) + x[2:] for x in e[1])
        else:
            written.append(e)
    assert fast == allocator.replay(written)


def _replayed(events, expandable_segments, capacity):
    try:
        return replay(events, expandable_segments=expandable_segments, capacity=capacity)
    except AllocatorOutOfMemory as exc:
        return "out of memory", exc.requested, exc.allocated, exc.reserved


def test_under_pipelining_fsdp2_makes_sharded_gradients_at_reduce_grad_and_gathers_each_unit_once():
    """perform_reduce_grad runs each unit's post-backward after the last backward (its reduce-scatter
    makes the sharded gradients); with units never resharded the all-gather output exists only in each
    stage's first forward (Llama 3.1 405B, FSDP 8 × TP 8 × PP 8, 1F1B, m 32)."""
    c = Config.load(ROOT / "assets/examples/fake/llama3-405b-3d-1f1b.toml")
    for r in memory_per_rank(c).per_rank[:1]:
        tl = r._body.timeline
        lives = {t.kind: tl.lifetime(cat, i) for cat in MEMORY_CATEGORIES for i, t in enumerate(r.catalogue(cat))}
        assert lives["fsdp_sharded_grads"] == "end_of_backward"
        assert lives["all_gather_output"] == "first_forwards"
        assert " B of microbatch " in r.peak_moment and "end of the backward" not in r.peak_moment
        assert not {"fsdp_sharded_grads", "all_gather_output"} & {t.kind for cat in MEMORY_CATEGORIES
                                                                  for t in r.explain(cat)}
    for sc, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):
        for rank in range(4):
            mo = moments(sc, rank, 4, v, 8)
            first = mo.masks[:, TRANSIENT.index("first_forwards")].astype(bool)
            assert sorted(mo.stage[first].tolist()) == sorted(set(mo.stage.tolist()))
            assert (mo.kind[first] == 0).all()  # F
            end = mo.masks[:, TRANSIENT.index("end_of_backward")].astype(bool)  # the end, then the optimizer step
            assert end.tolist() == [False] * (len(end) - 2) + [True, True] and mo.counts[-1].sum() == 0


def test_the_events_lay_each_block_as_the_training_loop_allocates_it():
    """On a GPU rank the events go block by block: each forward allocates one block's saved tensors at
    a time (with the transients its forward makes, freed as it goes), and the backward frees them last
    block first; FSDP2's sharded gradients appear during the first backward, on the reduce-scatter stream."""
    c = _cfg({"dp": 2, "zero": 3}, gpus=2, training={"precision": "bf16-mixed"})
    r = memory_per_rank(c).per_rank[0]
    ev = r._body.timeline.events()
    blocks = c.model.layers
    saved = [e for e in ev if e[1][0] == "mb" and isinstance(e[1][3], int)]
    allocs = [e[1][3] for e in saved if e[0] == "alloc"]
    frees = [e[1][3] for e in saved if e[0] == "free"]
    assert allocs == list(range(blocks)) and frees == list(reversed(range(blocks)))
    assert any(e[0] == "alloc" and e[1][0] == "fwd" for e in ev)  # the forward's own transients
    first_free = next(k for k, e in enumerate(ev) if e[0] == "free" and e[1][0] == "mb")
    grads = [k for k, e in enumerate(ev) if e[0] == "alloc" and len(e) > 3 and e[3] == 2]
    assert grads and min(grads) > first_free  # made during the backward, once freed blocks cover them
    # the replay still peaks at the allocated bytes of the moments it lays (up to the end of the backward),
    # and the reserve is at least the peak's
    assert replay(ev).max_allocated >= peak_of(r._body.timeline._event_signature()[0]).bytes
    assert r.reserved >= r.allocated


def test_the_loss_side_lives_from_after_the_blocks_forward_to_before_the_blocks_backward():
    """What the final norm, the head and the loss save (``HEAD_KINDS``) is made after an F's blocks
    (the F's own moment has the blocks' units gathered, not the loss side yet) and freed by the head's
    backward, before a B's blocks: the loss moment holds it, the B's own moment does not. A split
    backward's I retains the graph for its W (torch.distributed.pipelining's stage_backward_input), so
    there it lives until the W, as the stage-microbatch does."""
    for sc, v in (("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2),
                  ("InterleavedZeroBubble", 2), ("DualPipeV", 2)):
        for rank in range(4):
            mo = moments(sc, rank, 4, v, 8)
            kinds = mo.kind.tolist()
            for i, (k, ph) in enumerate(zip(kinds, mo.phase.tolist())):
                head, counts = mo.head[i], mo.counts[i]
                assert (head <= counts).all() and (head >= 0).all()
                diff = counts - head
                if ph == 1:  # the loss moment: every microbatch alive holds its loss side
                    assert diff.sum() == 0
                elif ph == 0 and k in (0, 1):  # an F or a B: its own microbatch's loss side is not alive
                    assert diff.sum() == 1
                else:  # an I, a W, the end: as the stage-microbatches
                    assert diff.sum() == 0, (sc, rank, i)
    # the last stage's B of a 1F1B rank: no log-probabilities, no head input in its snapshot
    c = _cfg({"pp": 2, "microbatches": 4}, gpus=2)
    r = memory_per_rank(c).per_rank[1]
    tl = r._body.timeline
    assert tl.peak.kind == "B"
    kinds = {t.kind: t for t in r.explain("activations")}
    if " at its start: the loss" in r.peak_moment:
        assert "log_probabilities" in kinds
    else:
        assert not set(kinds) & HEAD_KINDS and "log_probabilities" in {t.kind for t in r.catalogue("activations")}


@pytest.mark.parametrize("sp", [True, False])
def test_the_loss_is_laid_as_the_tensors_torch_makes(sp):
    """At the loss the events lay the fp32 tensors of the vocabulary shard one by one (4·s·b·V/t each under
    loss_parallel, three of them; 4·s·b·V each otherwise, two), not the term in two halves, and the
    logits and their gradient in the compute dtype (act·s·b·v): the caching allocator then reuses the
    forward's fp32 blocks for them as it does for torch's (measure --fake, Llama 2 7B s64K dp32 × TP2 +SP
    ZeRO-3: events of 5.86 GiB each where torch makes 3.91 GiB ones reserved 73.2 GiB against 62.9)."""
    c = _cfg({"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": sp}, gpus=4, training={"precision": "bf16-mixed"},
             preset="llama3-8b")
    r = memory_per_rank(c).per_rank[0]
    s, b, vocab, t = c.local_seq_len, c.training.micro_batch_size, c.model.vocab, 2
    v = -(-vocab // t) if sp else vocab
    ev = r._body.timeline.events()
    loss = [e for e in ev if e[0] == "alloc" and e[1][0] == "loss"]
    assert [e[2] for e in loss] == [4 * s * b * v] * (3 if sp else 2)
    term = next(x for x in r.catalogue("temporaries") if x.kind == "loss")
    assert term.bytes == sum(e[2] for e in loss)
    grads = [e[2] for e in ev if e[0] == "alloc" and e[1][0] in ("logits", "logits_grad")]
    assert grads and set(grads) == {2 * s * b * v}
    # all alive at once, then all but the last freed before the logits' gradient
    keys = [e[1] for e in loss]
    at = {(e[0], e[1]): k for k, e in enumerate(ev)}
    last_alloc = max(at[("alloc", key)] for key in keys)
    assert all(at[("free", key)] > last_alloc for key in keys)
    g = next(k for k, e in enumerate(ev) if e[0] == "alloc" and e[1][0] == "logits_grad")
    assert all(at[("free", key)] < g for key in keys[:-1]) and at[("free", keys[-1])] > g


@pytest.mark.parametrize("seed", range(4))
def test_random_pipelines_reserve_what_their_events_written_out_reserve(seed):
    """Random pipelined layouts (presets, schedules, pp, virtual stages, microbatches, TP, ZeRO,
    precision, recompute, sequence length, expandable segments): every distinct rank's replay of its
    compressed events (steady state as one cycle) equals the replay of its events written out, at no
    capacity and at capacities that make the allocator release its cache or run out."""
    import random

    rng = random.Random(seed)
    checked = 0
    while checked < 12:
        model = rng.choice(["tiny", "llama3-8b", "deepseek-v3", "gpt-oss-20b", "llama3-70b"])
        pp = rng.choice([2, 3, 4, 8])
        schedule = rng.choice(["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
        v = 2 if schedule in ("ZBVZeroBubble", "DualPipeV") else (1 if schedule == "1F1B" else rng.choice([1, 2, 3]))
        tp = rng.choice([1, 2])
        raw = {"model": {"preset": model} | ({} if model == "tiny" else {"seq_len": rng.choice([256, 1024, 4096])}),
               "cluster": {"gpu": rng.choice(["h100-sxm", "a100-80g", "mi300x"]), "gpus": pp * tp * rng.choice([1, 2])},
               "parallel": {"tp": tp, "pp": pp, "virtual_stages": v, "schedule": schedule,
                            "microbatches": rng.choice([pp * v, 2 * pp * v, 24, 40, 64]), "zero": rng.choice([0, 1, 2, 3])},
               "training": {"precision": rng.choice(["bf16-mixed", "fp32"]), "micro_batch_size": rng.choice([1, 2, 4]),
                            "recompute": rng.choice(["none", "full", "selective", "selective-op"])},
               "conventions": {"expandable_segments": rng.random() < 0.3}}
        try:
            c = Config.from_dict(raw)
        except ConfigError:
            continue
        es = c.conventions.expandable_segments
        for g in memory_per_rank(c).distinct_groups():
            r = g.first
            sig = r._body.timeline._event_signature()
            for cap in (None, r.allocated + 2**30, r.reserved, r.allocated):
                assert _replayed(replay_events(sig), es, cap) == _replayed(allocation_events(sig), es, cap), (raw, r.rank)
        checked += 1


@pytest.mark.parametrize("pp, microbatches", [(4, 32), (8, 64)])
def test_a_steady_window_starting_where_a_stage_first_lays_its_gradients_is_cut_there(pp, microbatches):
    """DualPipeV under ZeRO-2 (Llama 3 8B, dp 2): a rank's gradients of its first chunk are laid at its
    first backward of that chunk, which is the first moment of the steady window the schedule offers.
    The window's state is taken before that moment, so no period there can repeat the first: the
    window is cut after the period holding it, and every rank's steady state is one cycle (before, only
    the last rank's was and the others laid every microbatch: Llama 3.1 405B over 16 stages and 256
    microbatches, 21,100 events a rank, 1,300-2,600 now); the cycle replays as the events written out."""
    c = Config.from_dict({"model": {"preset": "llama3-8b", "seq_len": 1024},
                          "cluster": {"gpu": "h100-sxm", "gpus": 2 * pp},
                          "parallel": {"dp": 2, "zero": 2, "pp": pp, "schedule": "DualPipeV", "virtual_stages": 2,
                                       "microbatches": microbatches},
                          "training": {"precision": "bf16-mixed", "optimizer": "sgd"}})
    groups = memory_per_rank(c).distinct_groups()
    assert len({g.first.pp_rank for g in groups}) == pp
    for g in groups:
        sig = g.first._body.timeline._event_signature()
        compressed = replay_events(sig)
        assert sum(e[0] == "cycle" for e in compressed) == 1, g.first.rank
        written = allocation_events(sig)
        assert len(compressed) < len(written) / 2
        for cap in (None, g.first.reserved, g.first.allocated):
            assert _replayed(compressed, False, cap) == _replayed(written, False, cap), (g.first.rank, cap)


@pytest.mark.parametrize("dp, extra", [(8, {}), (64, {"conventions": {"allocator_slack_fraction": 0.0}}),
                                       (16, {"training": {"precision": "bf16-mixed", "optimizer": "sgd-momentum"}})])
def test_step_tensors_in_segments_of_their_own_replay_as_nothing_and_reserve_the_same(dp, extra):
    """ZeroRedundancyOptimizer gives each dp-rank its own share: the ranks differ only in that step
    tensor, which fills a segment of its own, so replayed_reserve replays them once and adds each
    one's segment back; that equals replaying each rank's own events (at no capacity, at capacities
    that make the allocator release its cache, and below what the step tensors alone need)."""
    from engine.memory.overhead import _replayed_reserve, replayed_reserve

    c = _cfg({"dp": dp, "zero": 1, "pp": 2, "schedule": "1F1B", "microbatches": 4}, gpus=2 * dp, preset="llama3-8b",
             training={"precision": "fp32"} | extra.get("training", {}), conventions=extra.get("conventions", {}))
    rep = memory_per_rank(c)
    assert len(rep.groups) > 2  # dp-ranks of different shares
    for g in rep.groups:
        sig = g.first._body.timeline._event_signature()
        for cap in (None, g.first.allocated + 2**30, g.first.reserved, g.first.allocated, 2**30):
            assert replayed_reserve(sig, False, cap) == _replayed_reserve.__wrapped__(sig, False, cap)


def test_dp_ranks_whose_shares_are_inert_or_missing_replay_once_per_stage():
    """Llama 3 8B over 512 dp-ranks: the ZeroRedundancyOptimizer shares run from none (more dp-ranks than
    tensors) through 32 KiB (a small-pool block, which later requests share) to whole 2-MiB multiples
    (inert). Every rank whose share is inert or missing replays the same events, so a stage replays once
    for them and once per share that takes part; each rank's reserve is still its own replay's."""
    from engine.memory.allocator import get_allocation_size, kMinLargeAlloc, kSmallSize, round_size
    from engine.memory.overhead import _replayed_reserve, replayed_reserve

    c = _cfg({"dp": 512, "zero": 1, "pp": 2, "schedule": "1F1B", "microbatches": 4}, gpus=1024,
             preset="llama3-8b", training={"precision": "bf16-mixed"})
    sigs = [g.first._body.timeline._event_signature() for g in memory_per_rank(c).groups]

    def takes_part(nbytes: int) -> bool:
        size = round_size(nbytes)
        return nbytes > 0 and not (size >= kMinLargeAlloc and get_allocation_size(size) - size <= kSmallSize)

    steps = [tuple(r for r in rows if r[0] == "step") for _, rows, *_ in sigs]
    assert any(len(s) < max(map(len, steps)) for s in steps)  # some dp-ranks hold no share
    assert any(not takes_part(n) for s in steps for _, n, _ in s if n)  # some shares are inert
    expected = {(sig.stages, tuple(r for r in s if takes_part(r[1]))) for (sig, *_), s in zip(sigs, steps)}
    assert len(expected) < len(sigs)
    _replayed_reserve.cache_clear()
    reserves = [replayed_reserve(sig, False, None) for sig in sigs]
    assert _replayed_reserve.cache_info().misses == len(expected)  # one replay per signature left
    for sig, reserve in zip(sigs, reserves):  # each rank's own events replayed as they are
        assert reserve == _replayed_reserve.__wrapped__(sig, False, None)


def test_shares_whose_rounding_no_request_uses_replay_once_and_each_reserve_is_its_own_replay():
    """Llama 3 8B over 16 dp-ranks (ZeRO-1, two stages): the ZeroRedundancyOptimizer shares round to
    segments that leave 1.5-1.9 MiB, split off as cached blocks, and every later request of the large
    pool is at least 32 MiB, so no request ever uses them: the dp-ranks of a stage replay once (five
    replays for seven distinct ranks before), and each rank's reserve is still its own events'
    replay, with and without a capacity."""
    from engine.memory.overhead import _replayed_reserve, replayed_reserve

    c = Config.from_dict({"model": {"preset": "llama3-8b", "seq_len": 2048},
                          "cluster": {"gpu": "h100-sxm", "gpus": 32, "gpus_per_node": 8},
                          "parallel": {"dp": 16, "zero": 1, "pp": 2, "schedule": "GPipe", "microbatches": 8},
                          "training": {"precision": "bf16-mixed", "optimizer": "adamw"}})
    groups = memory_per_rank(c).groups
    sigs = [g.first._body.timeline._event_signature() for g in groups]
    assert len(sigs) == 7
    _replayed_reserve.cache_clear()
    for sig in sigs:
        replayed_reserve(sig, False, None)
    assert _replayed_reserve.cache_info().misses == 2  # one per stage
    for g, sig in zip(groups, sigs):
        for cap in (None, g.first.allocated + 2**30, g.first.allocated):
            assert replayed_reserve(sig, False, cap) == _replayed_reserve.__wrapped__(sig, False, cap)


def test_a_step_tensor_that_fits_an_earlier_ones_cached_rest_is_replayed():
    """A 3-MiB step tensor takes a 20-MiB segment and caches the 17 MiB it leaves; a 12-MiB step tensor
    after it is served from that block, not from a segment of its own: it takes part, and the reserve
    is the whole replay's (12 MiB less than counting it a fresh segment, as this shortcut once did)."""
    from engine.memory.overhead import _replayed_reserve, replayed_reserve

    mib = 2**20
    c = Config.from_dict({"model": {"preset": "llama3-8b", "seq_len": 4096},
                          "cluster": {"gpu": "h100-sxm", "gpus": 2, "gpus_per_node": 8},
                          "parallel": {"pp": 2, "schedule": "GPipe", "microbatches": 4},
                          "training": {"precision": "bf16-mixed", "optimizer": "adamw"}})
    sig = memory_per_rank(c).groups[0].first._body.timeline._event_signature()
    extra = (("step", 3 * mib, 0), ("step", 12 * mib, 0))
    crafted = (sig[0]._replace(step_bytes=sig[0].step_bytes + 15 * mib), extra + sig[1]) + tuple(sig[2:])
    exact = _replayed_reserve.__wrapped__(crafted, False, None)
    assert replayed_reserve(crafted, False, None) == exact
    assert exact + 12 * mib == _replayed_reserve.__wrapped__(
        (crafted[0], (extra[1], extra[0]) + sig[1]) + tuple(sig[2:]), False, None)  # the 12 MiB first: fresh


def test_a_steady_state_that_never_loops_spends_at_most_a_quarter_of_its_replay_reading_states():
    """Llama 3 8B, DualPipeV over 4 ranks, 128 microbatches, fp32: pp rank 3's allocator state after each period
    never equals an earlier one (each period keeps its sent input gradients and stage outputs to the end of the
    backward, cut from the cached blocks), so every state read is wasted. They may cost at most a quarter of
    replaying every period (a block read about as dear as an event replayed): 1,391 block reads for 7,076 events
    of periods, the same reserve. (bf16 was this case until a forward's down projection was laid, DualPipeV over
    8 ranks at 128 microbatches, fp32, until the sends were kept: its states now grow too fast to be worth reading; Qwen3 30B-A3B on DualPipeV until a MoE
    block's forward was laid in pieces of its largest tensor, ``per_rank._moe_block_pieces``.)"""
    import engine.memory.allocator as allocator

    c = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "gpus": 4},
                          "parallel": {"dp": 1, "pp": 4, "schedule": "DualPipeV", "virtual_stages": 2,
                                       "microbatches": 128},
                          "training": {"precision": "fp32", "optimizer": "sgd"}})
    cycles = []  # [what its periods cost, what its state reads cost]
    real_cycle, real_state = allocator._replay_cycle, allocator.CachingAllocator.relative_state

    def cycle(alloc, chunk, count, *rest):
        cycles.append([len(chunk) * count, 0])
        return real_cycle(alloc, chunk, count, *rest)

    def state(self, live, *rest):
        cycles[-1][1] += len(live) + len(self._free) + len(self._live)
        return real_state(self, live, *rest)

    allocator._replay_cycle, allocator.CachingAllocator.relative_state = cycle, state
    try:
        sig = memory_per_rank(c).groups[3].first._body.timeline._event_signature()
        fast = allocator.replay(replay_events(sig))
    finally:
        allocator._replay_cycle, allocator.CachingAllocator.relative_state = real_cycle, real_state
    assert cycles and all(read <= periods / 4 for periods, read in cycles)
    assert any(read > periods / 8 for periods, read in cycles)  # the reads were cut, not merely few
    assert fast == allocator.replay(allocation_events(sig))


def test_ranks_that_differ_only_in_step_tensors_lay_the_rest_of_their_events_once():
    """Sixteen dp-ranks of small ZeroRedundancyOptimizer shares (none inert): their events differ only in
    the step tensors, which come first and are never freed, so the rest is laid once per stage and each
    rank's step tensors put before it; each replays as its own events laid whole."""
    import engine.memory.lifetimes as lifetimes

    c = _cfg({"dp": 16, "zero": 1, "pp": 2, "schedule": "GPipe", "microbatches": 16}, gpus=32,
             training={"optimizer": "adamw"})
    sigs = [g.first._body.timeline._event_signature() for g in memory_per_rank(c).groups]
    assert len({s[0].stages for s in sigs}) < len(sigs)
    laid = []
    real = lifetimes._fine_events
    lifetimes._fine_events = lambda *a, **k: laid.append(a[0].stages) or real(*a, **k)
    lifetimes.replay_events.cache_clear()
    try:
        events = [lifetimes.replay_events(s) for s in sigs]
    finally:
        lifetimes._fine_events = real
    assert sorted(laid) == sorted({s[0].stages for s in sigs})
    for sig, ev in zip(sigs, events):
        assert replay(ev) == replay(lifetimes._fine_events(sig[0], sig[1], sig[3], sig[2], compress=True))


POOLED = LAYOUTS + [
    {"dp": 16, "zero": 1, "pp": 2, "schedule": "GPipe", "microbatches": 16},
    {"dp": 8, "zero": 1, "pp": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 32},
    {"dp": 8, "zero": 1, "pp": 4, "schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 16},
]


@pytest.mark.parametrize("par", POOLED)
@pytest.mark.parametrize("preset, expandable", [("tiny", False), ("llama3-8b", False), ("llama3-8b", True)])
def test_the_reserve_replayed_pool_by_pool_is_the_whole_replays(par, preset, expandable):
    """Without a capacity every pool's reserve only grows and no pool serves another's requests, so the
    step's most reserved is the sum of its pools' replayed alone, exactly; the most allocated they give
    is at most the whole replay's. Ranks whose step tensors differ only in one pool replay the others once."""
    from engine.memory import overhead

    c = _cfg(par, gpus=_world(par), training={"precision": "bf16-mixed", "optimizer": "adamw"}, preset=preset)
    sigs = [g.first._body.timeline._event_signature() for g in memory_per_rank(c).groups]
    overhead._pool_reserve.cache_clear()
    for sig in sigs:
        least_most, reserved = overhead._unbounded_reserve(sig, expandable)
        most, whole = overhead._unbounded_replay.__wrapped__(sig, expandable)
        assert reserved == whole and least_most <= most, (par, sig[0].stages)
    if par.get("zero") == 1 and preset == "tiny":  # small shares: the large pool's replay is shared
        assert overhead._pool_reserve.cache_info().misses < 2 * len(sigs)


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b"])
def test_expandable_step_tensors_replay_as_their_bytes_past_whole_pages(preset):
    """With expandable segments a pool's step tensors lie end to end from its segment's base, so the
    rest of the step replays as after one step tensor of their bytes past whole pages, the pages
    added back: equal to replaying them all, for step tensors of any sizes in either pool (the
    ZBV rank holds kept outputs that never repeat a state: no loop is skipped, every period runs)."""
    import random

    from engine.memory import overhead
    from engine.memory.allocator import kLargeBuffer, kSmallBuffer, kSmallSize
    from engine.memory.lifetimes import without_step_rows

    par = {"dp": 8, "zero": 1, "pp": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 8}
    c = _cfg(par, gpus=_world(par), training={"precision": "bf16-mixed", "optimizer": "adamw"}, preset=preset)
    sig = memory_per_rank(c).groups[0].first._body.timeline._event_signature()
    rest = without_step_rows(sig)
    rng = random.Random(2026)
    for pool in overhead._events_by_pool(rest):
        small = pool[1]
        page = kSmallBuffer if small else kLargeBuffer
        for _ in range(12):
            lo, hi = (1, kSmallSize) if small else (kSmallSize + 1, 5 * page)
            steps = tuple(rng.randint(lo, hi) for _ in range(rng.randint(1, 5)))
            if rng.random() < 0.3:  # sums on a page boundary, and just past one
                steps += (max(lo, -sum(map(round_size, steps)) % page + rng.choice((0, 512))),)
            if not lo <= steps[-1] <= hi:
                steps = steps[:-1]
            whole = overhead._pool_reserve.__wrapped__(rest, pool, steps, True)
            assert overhead._pool_reserve_of(rest, pool, steps, True) == whole, (pool, steps)


def test_the_cyclic_collector_is_paused_while_a_rank_replays_and_left_as_the_caller_had_it():
    import gc

    from engine.memory import overhead

    sig = memory_per_rank(_cfg({"pp": 2, "schedule": "GPipe", "microbatches": 4}, gpus=2)).groups[0] \
        .first._body.timeline._event_signature()
    seen = []
    real = overhead.replay
    overhead.replay = lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k)
    try:
        for enabled in (True, False):
            overhead._replayed_reserve.cache_clear()
            overhead._pool_reserve.cache_clear()
            overhead._unbounded_replay.cache_clear()
            (gc.enable if enabled else gc.disable)()
            overhead.replayed_reserve(sig, False, None)
            assert gc.isenabled() is enabled
    finally:
        overhead.replay = real
        gc.enable()
    assert seen and not any(seen)


def test_zero2_without_a_pipeline_gathers_each_unit_in_its_forward_and_reshards_it_in_its_post_backward():
    """FSDP2 with reshard_after_forward=False (ZeRO-2) keeps each unit gathered from its forward to its
    backward and reshards it in its post-backward (reshard_after_backward, True unless a pipeline
    schedule sets it False: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): every unit's
    unsharded parameters are alive at the action and loss moments, not at the end of the backward.
    Found by the sweep (seed 31, #02: dp2 ZeRO-2 m1, tracked peak +12.5 % → +4.5 %, states exact)."""
    assert fsdp_params_lifetime(True, False, False, pipelined=False) == "until_end_of_backward"
    # pipelined: kept gathered to the stage's REDUCE_GRAD, whose post-backward reshards them (perform_reduce_grad sets
    # set_reshard_after_backward(True) first): gone at the end of the backward too (measure --fake of Llama 3 70B dp8
    # tp2 pp2 cp4 replicate 1F1B: none at the optimizer step, where the engine held 4.17 GiB of them, +8.1 %)
    assert fsdp_params_lifetime(True, False, False, pipelined=True) == "until_end_of_backward"
    # replicate (ZeRO-0 / -1 × TP) is the same machinery with a shard degree of 1: resharded in its post-backward
    # too (measure --fake of Llama 3 405B dp4 tp8 ZeRO-0 m1: no unsharded parameter at its optimizer-step peak,
    # where the engine held 6.92 GiB of them, +10.0 %)
    assert fsdp_params_lifetime(False, None, False, pipelined=False) == "until_end_of_backward"
    assert fsdp_params_lifetime(False, None, False, pipelined=True) == "until_end_of_backward"
    for sc, pp, v in (("1F1B", 1, 1), ("1F1B", 4, 1), ("ZBVZeroBubble", 4, 2)):
        for rank in range(pp):
            mo = moments(sc, rank, pp, v, 8)
            until = mo.masks[:, TRANSIENT.index("until_end_of_backward")].astype(bool)
            during = mo.masks[:, TRANSIENT.index("during_actions")].astype(bool)
            assert until.tolist() == (mo.phase < 2).tolist()  # every moment but the end and the optimizer step
            assert during.tolist() == (mo.phase == 0).tolist()  # the actions' own moments only
            fwd = mo.masks[:, TRANSIENT.index("forwards")].astype(bool)
            assert fwd.tolist() == ((mo.phase == 0) & (mo.kind == 0)).tolist()  # each F's own moment
    c = _cfg({"dp": 2, "zero": 2}, gpus=2, training={"precision": "fp32"}, cluster="dgx-h100")
    r = memory_per_rank(c).per_rank[0]
    tl = r._body.timeline
    lives = {t.kind: tl.lifetime(cat, i) for cat in MEMORY_CATEGORIES for i, t in enumerate(r.catalogue(cat))}
    assert lives["fsdp_unsharded_params"] == "until_end_of_backward"
    # and the backward gathers nothing: FSDP2's all-gather output exists in the forwards only (seed 31 #29,
    # dp4 ZeRO-2 m1: tracked peak +17.2 % -> +1.2 %)
    assert lives["all_gather_output"] == "forwards"
    assert "all_gather_output" not in {t.kind for t in r.explain("comm_buffers")} or " F of " in r.peak_moment
    if "end of the backward" in r.peak_moment:
        assert "fsdp_unsharded_params" not in {t.kind for t in r.explain("comm_buffers")}


def test_the_context_parallel_attention_workspace_lives_only_while_a_block_runs():
    """The ring attention's workspace exists while one layer's attention runs, forward or backward: not
    at the loss moment (the head's backward) nor at the end of the backward. Found by the fake sweep
    (benchmarks/fake_sweep.py, seed 7: Llama 2 7B s8K cp4 ZeRO-2, 0.42 GiB of temporaries at the loss
    moment that the real code does not hold; allocated +3.8 % → +1.1 %)."""
    assert (LIFETIMES["cp_attention"], LIFETIMES["cp_attention_forward"]) == ("backward_input", "forwards")
    c = _cfg({"dp": 1, "cp": 2}, gpus=2, training={"precision": "bf16-mixed"})
    r = memory_per_rank(c).per_rank[0]
    tl = r._body.timeline
    lives = {t.kind: tl.lifetime(cat, i) for cat in MEMORY_CATEGORIES for i, t in enumerate(r.catalogue(cat))}
    assert (lives["cp_attention"], lives["cp_attention_forward"]) == ("backward_input", "forwards")
    at_peak = {t.kind for cat in ("temporaries", "activations") for t in r.explain(cat)}
    assert bool({"cp_attention", "cp_attention_forward"} & at_peak) == (
        ": the loss" not in r.peak_moment and "end of the backward" not in r.peak_moment
        and "optimizer step" not in r.peak_moment)


def test_a_split_backwards_w_runs_no_context_parallel_attention():
    """A split backward's W asks autograd for the weights' gradients only (torch's stage_backward_weight): the I made
    the attention's, so a W's moment holds no ring workspace, a forward's and a B's or an I's do (measure --fake of
    GPT-2 DualPipeV pp2 cp4, seed 20261232 #64c157d1: +13.2 → +4.4 %)."""
    c = _cfg({"dp": 1, "cp": 2, "pp": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 4},
             gpus=4, training={"precision": "bf16-mixed"})
    r = memory_per_rank(c).per_rank[0]
    tl = r._body.timeline
    mo = sig_moments(tl.signature)
    cp = [(cat, i) for cat in ("temporaries", "activations") for i, t in enumerate(tl.terms[cat])
          if t.kind.startswith("cp_attention")]  # (the forward's: made in a forward, activations)
    lives = [TRANSIENT.index(tl.lifetime(cat, i)) for cat, i in cp]
    kinds = [ACTION_KINDS[int(k)] for k in mo.kind]
    assert cp and "W" in kinds
    for k, masks, ph, st in zip(kinds, mo.masks, mo.phase, mo.stage.tolist()):
        if ph == 0:  # an action's own moment: the workspace laid by one of the two terms, but at a later stage's W —
            # stage 0's W is the full backward and its I none (torch's backward_one_chunk, backward_weight_one_chunk)
            assert any(masks[life] for life in lives) == (k in "FB" or (k == "I") == (st != 0)), (k, st)


def _renamed(a: tuple, b: tuple) -> bool:
    """Whether event lists ``a`` and ``b`` are the same up to a one-to-one renaming of their keys."""
    fwd: dict = {}
    bwd: dict = {}
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x[0] != y[0] or x[2:] != y[2:] or fwd.setdefault(x[1], y[1]) != y[1] or bwd.setdefault(y[1], x[1]) != x[1]:
            return False
    return True


@pytest.mark.parametrize("schedule, v", [("GPipe", 1), ("LoopedBFS", 2), ("1F1B", 1), ("Interleaved1F1B", 2),
                                         ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("InterleavedZeroBubble", 2)])
def test_ranks_whose_steps_differ_only_in_their_stage_numbers_replay_once(schedule, v):
    """A rank's replay is cached on its canonical signature: the least pp rank whose moments are its
    own with its stages renamed in order. Its events are then the rank's own with every key renamed
    one-to-one (so the allocator does the same), and its reserve the same, at every capacity; GPipe's
    and LoopedBFS's middle stages (the same actions) share one, the other schedules' ranks (warm-ups of
    their own lengths) keep their own."""
    from engine.memory.overhead import _replayed_reserve, replayed_reserve

    c = _cfg({"dp": 1, "pp": 8, "schedule": schedule, "virtual_stages": v, "microbatches": 16}, gpus=8,
             preset="llama3-8b", training={"precision": "bf16-mixed", "optimizer": "sgd"})
    rep = memory_per_rank(c)
    canon = set()
    for g in rep.distinct_groups():
        sig = g.first._body.timeline._event_signature()
        same = canonical_event_signature(sig)
        canon.add(same)
        assert same[0].pp_rank <= sig[0].pp_rank and same[1:] == sig[1:]
        assert _renamed(allocation_events(sig), allocation_events(same)), g.first.rank
        for cap in (None, g.first.reserved, g.first.allocated):
            assert replayed_reserve(same, False, cap) == _replayed_reserve.__wrapped__(sig, False, cap)
    ranks = len(rep.distinct_groups())
    if schedule in ("GPipe", "LoopedBFS"):
        assert len(canon) < ranks  # the middle stages share one
    else:
        assert len(canon) == ranks


def test_a_loop_as_long_as_the_keys_lives_or_a_period_more_is_found_and_skipped():
    """Llama 3 8B, 1F1B over 8 ranks, 256 microbatches, fp32: rank 0's allocator loops (a block freed in a period
    handed out again in the next) and the states are read at the first two periods of every 7, so the loop is
    seen and the runs after it skipped (32 of 248 periods run); the stats are those of every period written out.
    (DualPipeV over 8 ranks was this case until the sends were kept: the input gradients and stage outputs each
    period keeps to the end of the backward are cut from the cached blocks, and its allocator never loops;
    Qwen3 30B-A3B until a MoE block's forward was laid in pieces of its largest tensor,
    ``per_rank._moe_block_pieces``.)"""
    import engine.memory.allocator as allocator

    c = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8},
                          "parallel": {"dp": 1, "pp": 8, "schedule": "1F1B", "microbatches": 256},
                          "training": {"precision": "fp32", "optimizer": "sgd"}})
    sig = memory_per_rank(c).groups[0].first._body.timeline._event_signature()
    events = replay_events(sig)
    (count,) = [e[2] for e in events if e[0] == "cycle"]
    ran = []
    real = allocator._replay_into
    allocator._replay_into = lambda a, e, live, at: (at is not None and ran.append(at), real(a, e, live, at))[1]
    try:
        fast = allocator.replay(events)
    finally:
        allocator._replay_into = real
    assert len(ran) < count / 2
    assert fast == allocator.replay(allocation_events(sig))


@pytest.mark.parametrize("schedule, v, zero", [("1F1B", 1, 1), ("Interleaved1F1B", 2, 3), ("ZBVZeroBubble", 2, 0),
                                               ("DualPipeV", 2, 2), ("GPipe", 1, 0)])
def test_the_laid_events_most_live_counts_every_period_of_a_cycle(schedule, v, zero):
    """``laid_most_live``: the most bytes the replayed events hold live at once, read from the laying (a
    steady window laid once as a cycle counts its later periods, each holding the first's bytes plus the
    kept outputs of the periods before it), equals the most of the events written out in full; with the
    step tensors and without. The reserve's shortcut (``overhead._replayed_reserve``: a most live past the
    capacity is a most allocated past it) rests on it."""
    from engine.memory.lifetimes import laid_most_live, most_live, without_step_rows
    from engine.memory.overhead import _replayed_reserve, _unbounded_replay, _unbounded_reserve

    c = _cfg({"dp": 2, "pp": 4, "zero": zero, "schedule": schedule, "virtual_stages": v, "microbatches": 32}, gpus=8,
             preset="llama3-8b", training={"precision": "bf16-mixed"})
    cycles = 0
    for g in memory_per_rank(c).distinct_groups():
        sig = g.first._body.timeline._event_signature()
        for s in (sig, without_step_rows(sig)):
            assert laid_most_live(s) == most_live(allocation_events(s)), g.first.rank  # written out in full
        cycles += sum(ev[0] == "cycle" for ev in replay_events(sig))
        most = laid_most_live(sig)
        most_allocated, unbounded = _unbounded_replay(sig, False)
        assert most <= most_allocated  # a block is at least its request
        assert _unbounded_reserve(sig, False)[1] == unbounded
        for cap in (most - 1, most, most_allocated):  # around the events' most: the reserve the replays say
            if unbounded <= cap:
                expected = unbounded
            elif most_allocated > cap:
                expected = unbounded
            else:
                try:
                    expected = replay(replay_events(sig), capacity=cap).max_reserved
                except AllocatorOutOfMemory:
                    expected = unbounded
            assert _replayed_reserve.__wrapped__(sig, False, cap) == expected, (g.first.rank, cap)
    assert cycles > 0 or schedule == "GPipe"  # the steady state was laid as a cycle (GPipe has none)


@pytest.mark.parametrize("seed", range(3))
def test_each_category_peaks_over_the_step_at_least_where_the_rank_peaks(seed):
    """``category_peaks``: each category laid alone over the step's moments. Never below the snapshot at the
    rank's peak (one of those moments), and their sum never below the rank's total; a category the snapshot
    shows at 0 can be held elsewhere in the step."""
    import random

    rng = random.Random(seed)
    checked = 0
    while checked < 8:
        raw = {"model": {"preset": rng.choice(["tiny", "llama3-8b", "mixtral-8x7b"])},
               "cluster": {"gpu": "h100-sxm", "gpus": 8},
               "parallel": {"dp": rng.choice([1, 2, 4]), "pp": rng.choice([1, 2]), "zero": rng.choice([0, 1, 2, 3]),
                            "microbatches": rng.choice([1, 2, 4]), "schedule": rng.choice(["1F1B", "GPipe"])},
               "training": {"recompute": rng.choice(["none", "full", "selective"]),
                            "precision": rng.choice(["bf16-mixed", "fp32"])}}
        raw["cluster"]["gpus"] = raw["parallel"]["dp"] * raw["parallel"]["pp"]
        try:
            c = Config.from_dict(raw)
        except ConfigError:
            continue
        for r in memory_per_rank(c).per_rank:
            peaks = r.category_peaks()
            assert set(peaks) == set(MEMORY_CATEGORIES)
            for cat in MEMORY_CATEGORIES:
                assert peaks[cat] >= getattr(r, cat), (raw, r.rank, cat)
            assert sum(peaks.values()) >= r.total
        checked += 1


def test_zero3_gradients_are_zero_at_the_peak_but_not_over_the_step():
    """ZeRO-3 on 4 ranks (the tiny preset) with two microbatches: the rank peaks in the last backward, before any
    unit's post-backward has reduced (FSDP2 accumulates unsharded until the synced microbatch's); over the step the
    gradients peak at the sharded gradients' full size (the end of the backward, the optimizer step). (With one
    microbatch the B's own moment is after its last block's post-backward, which made that block's.)"""
    c = _cfg({"dp": 4, "zero": 3, "microbatches": 2}, gpus=4)
    r = memory_per_rank(c).per_rank[0]
    assert r.grads == 0
    sharded = sum(t.bytes for t in r.catalogue("grads") if t.kind == "fsdp_sharded_grads")
    assert sharded > 0 and r.category_peaks()["grads"] == sharded


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "Interleaved1F1B"])
def test_the_last_stage_frees_its_logits_at_the_i_of_a_split_backward(schedule):
    """torch.distributed.pipelining's last stage keeps its output (the logits) from the forward to the end of the
    microbatch's ``backward_one_chunk``; a split backward's I keeps only the loss for the W (stage.py: the popped
    ``stage_output`` is a local of the I, dropped when it returns, after ``stage_backward_input`` made the gradients it
    retains). So under a zero-bubble schedule the logits are freed at the I's end, after the I's retained gradients,
    while the stage-microbatch's saved tensors wait for the W; under a full backward they go with the B."""
    par = {"pp": 2, "schedule": schedule, "virtual_stages": 2, "microbatches": 4}
    rep = memory_per_rank(_cfg(par, gpus=2, training={"precision": "bf16-mixed"}))
    last = 2 * 2 - 1
    (r,) = [r for r in rep.per_rank if last in r.stages]
    tl = r._body.timeline
    (logits,) = [t for t in r.catalogue("activations") if t.kind == "stage_logits"]
    split = schedule != "Interleaved1F1B"
    col = sorted(r.stages).index(last)
    each = logits.bytes // logits.in_flight
    assert tl.signature.so_bytes == (tuple(each if j == col else 0 for j in range(2)) if split else ())
    assert tl.signature.unit_bytes[col] > logits.bytes // logits.in_flight  # the logits are part of the unit
    freed_at, kept_at = {}, {}
    for i, e in enumerate(tl.events()):
        key = e[1]
        if e[0] == "free" and key[:2] == ("mb", last) and key[3:4] == ("so",):
            freed_at[key[2]] = i
            assert kept_at.get(key[2], 10**9) < i  # the logits went after the I's retained gradients
        if e[0] == "alloc" and key[:2] == ("iw", last):
            kept_at.setdefault(key[2], i)
        if e[0] == "free" and key[:2] == ("mb", last) and key[3:4] not in (("so",), ("logprob",)) and split:
            assert key[2] in freed_at  # the saved tensors wait for the W
    assert len(freed_at) == (4 if split else 0)


def test_fsdp2_gradients_of_a_split_backward_follow_torchs_post_backward():
    """FSDP2's unsharded gradients of one stage (``_stage_columns``): a split backward's I makes no weight
    gradient, its W writes them into ``.grad`` in the parameter dtype, and only the next post-backward that finds
    them (an I's; the stage's REDUCE_GRAD at its m-th W at the latest) adds them into an accumulation of another
    dtype (torch's FSDPParam.to_accumulated_grad_if_needed). The pipeline's first stage runs its W as a full
    backward, which adds them in itself, as a B does."""
    import numpy as np

    from engine.memory.lifetimes import _stage_columns
    from engine.pipeline.schedules import ACTION_KINDS

    def columns(actions, first=False, m=2):
        kind = np.array([ACTION_KINDS.index(a) for a in actions])
        stage = np.full(len(kind), 0 if first else 1)  # (the pipeline's first stage, or a later one)
        acc, red, wr, cv, fr, _, fs, *_ = _stage_columns(kind, stage, np.zeros(len(kind), dtype=np.int64), 1, m)
        fresh_start.append(fs[:, 0].tolist())
        return [x[:, 0].tolist() for x in (acc, red, cv, fr)]

    fresh_start = []  # each W that makes the .grad afresh (none pending from an earlier W)

    # every I before the W's (a zero-bubble warm-up): no accumulation ever, the gradients stay in .grad
    acc, red, cv, fr = columns("FFIIWW")
    assert acc == [0, 0, 0, 0, 0, 1] and red == [0] * 6
    assert cv == [0] * 6 and fr == [0, 0, 0, 0, 1, 1]
    assert fresh_start[-1] == [0, 0, 0, 0, 1, 0]  # the second W adds into the first's .grad
    # an I after a W adds them in (at that I's moment they still exist), the next W makes them again
    acc, red, cv, fr = columns("FIWFIW")
    assert acc == [0, 0, 0, 1, 1, 1] and cv == [0, 0, 0, 0, 0, 1] and fr == [0, 0, 1, 1, 1, 1]
    assert fresh_start[-1] == [0, 0, 1, 0, 0, 1]
    # the first stage: its W adds them in itself
    acc, red, cv, fr = columns("FIWFIW", first=True)
    assert cv == [0, 0, 0, 1, 1, 1] and fr == [0] * 6
    # a full backward: made and added in by the B, as before
    acc, red, cv, fr = columns("FBFB")
    assert acc == cv == [0, 0, 1, 1] and fr == [0] * 4


def _head_events(cfg: Config) -> list[tuple]:
    """The loss side of rank 0's first forward: the events between the head's saved tensors and the saved
    log-probabilities, (kind, key name, bytes) in order."""
    events = memory_per_rank(cfg).per_rank[0]._body.timeline.events()
    size, out, on = {}, [], False
    for e in events:
        key = e[1]
        if e[0] == "alloc":
            size[key] = e[2]
        if key[:1] == ("mb",) and key[-1] == "head":
            on = True
            continue
        if on and key[:1] == ("mb",) and key[-1] == "logprob":
            return out
        if on:
            out.append((e[0], key[0], size[key]))
    raise AssertionError("no loss side in the events")


def test_the_heads_output_gathered_for_the_loss_lays_the_shard_the_buffer_and_its_copy():
    """Tensor parallelism without loss_parallel: the head's vocabulary-sharded output is redistributed
    Shard(-1) → Replicate for the loss; ``funcol.all_gather_single`` gathers along dim 0 and, the sequence lying
    between dim 0 and the vocabulary, copies it into place (``torch._utils._maybe_view_chunk_cat``: a view only
    where every dim before the gather dim is 1). The local shard, the gathered buffer and the copy are alive at
    once; the buffer and the shard are freed before the loss casts the copy to fp32 (``measure --fake``: Llama 3
    70B tp8, 16,384 tokens a rank — 0.49, 3.91 and 3.91 GB, then 7.83 GB twice). Llama 3 70B, 2 blocks, tp 8
    (no SP), cp 2, 8 × 4,096 tokens: 16,384 tokens on a rank, 16,032 vocabulary columns a TP rank, bf16."""
    base = {"model": {"preset": "llama3-70b", "seq_len": 4096, "layers": 2},
            "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
            "training": {"micro_batch_size": 8, "precision": "bf16-mixed", "recompute": "full"}}
    shard = 2 * 16_384 * 16_032
    cfg = Config.from_dict({**base, "parallel": {"dp": 2, "tp": 8, "cp": 2, "zero": 3}})
    assert _head_events(cfg) == [("alloc", "head_shard", shard), ("alloc", "head_gather", 8 * shard),
                                 ("alloc", "logits", 8 * shard), ("free", "head_gather", 8 * shard),
                                 ("free", "head_shard", shard), ("alloc", "logits_fp32", 16 * shard)]
    # under sequence parallelism the loss runs on the shard (loss_parallel): no gather, its fp32 copy of the shard
    sp = Config.from_dict({**base, "parallel": {"dp": 2, "tp": 8, "cp": 2, "zero": 3, "sequence_parallel": True}})
    assert _head_events(sp) == [("alloc", "logits", shard), ("alloc", "logits_fp32", 2 * shard)]
    # fp32: the gathered copy is the logits the loss reads, no cast
    fp32 = Config.from_dict({**base, "parallel": {"dp": 2, "tp": 8, "cp": 2, "zero": 3},
                             "training": {**base["training"], "precision": "fp32"}})
    assert _head_events(fp32) == [("alloc", "head_shard", 2 * shard), ("alloc", "head_gather", 16 * shard),
                                  ("alloc", "logits", 16 * shard), ("free", "head_gather", 16 * shard),
                                  ("free", "head_shard", 2 * shard)]


def test_a_later_bs_end_is_a_moment_where_autocast_casts_leave_their_gradients_waiting():
    """The end of each full B is a moment where the rank has a term of it (``backward_end``: FSDP2's fresh gradient
    of the token embeddings' unit, made by the first stage's last op); ``later_backward_end`` there but after a
    stage's first B (pipelined autocast on plain gradients: the casts cached from the step's first forward run their
    backward last). Its microbatch is freed; none of the B's own transients; what lives from the first backward on."""
    from engine.memory.lifetimes import B_END, moments

    mo = moments("1F1B", 0, 2, 1, 4, b_end=True)
    plain = moments("1F1B", 0, 2, 1, 4)
    ends = [i for i, ph in enumerate(mo.phase.tolist()) if ph == B_END]
    assert len(ends) == 4 and len(mo.kind) == len(plain.kind) + 4  # after each of stage 0's four Bs
    for n, i in enumerate(ends):
        assert mo.kind[i - 1] == mo.kind[i] and mo.microbatch[i - 1] == mo.microbatch[i] and mo.phase[i - 1] == 0
        assert mo.counts[i][0] == mo.counts[i - 1][0] - 1 and mo.acc[i][0] == 1
        alive = {life for life, on in zip(TRANSIENT, mo.masks[i]) if on}
        # (and FSDP2's units kept gathered: under pipelining to the stage's REDUCE_GRAD, past the B's end)
        # (and the units a B leaves gathered: ``after_a_backward``, the current ones with them: ``every_action``)
        assert alive == {"backward_end", "after_first_backward", "after_first_weight", "until_end_of_backward",
                         "after_a_backward", "every_action"} | (
            {"later_backward_end"} if n else set())
    wide = {"preset": "tiny", "layers": 4, "hidden": 512, "ffn_hidden": 2048, "vocab": 4096, "seq_len": 16}

    def waiting(par, training=None):
        cfg = Config.from_dict({"model": wide, "cluster": {"preset": "local-cpu", "gpus": 2}, "parallel": par,
                                "training": {"precision": "bf16-mixed", **(training or {})}})
        return [t.bytes for r in memory_per_rank(cfg).per_rank for t in r.catalogue("temporaries")
                if t.kind == "autocast_cast_gradients"]
    assert waiting({"dp": 1, "pp": 2, "microbatches": 4})  # pipelined autocast, plain gradients
    assert not waiting({"dp": 2, "microbatches": 4})  # unpipelined: one autocast context a microbatch
    assert not waiting({"dp": 2, "pp": 1, "zero": 3, "microbatches": 4})  # FSDP2: no autocast
    assert not waiting({"dp": 1, "pp": 2, "microbatches": 4}, {"precision": "fp32"})
    # float8: autocast casts no block weight (Float8Linear casts its own); the first stage's token embedding's fp32
    # V·h gradient beside its .grad is left, the last stage's head's 16-bit gradient waiting and its fp32 one
    first, last = waiting({"dp": 1, "pp": 2, "microbatches": 4}, {"float8": "tensorwise"})
    assert first == 4 * 4096 * 512 and last == 2 * 4096 * 512 + 4 * 4096 * 512


def test_fsdp2s_embedding_gradient_is_made_at_the_end_of_the_first_stages_b():
    """Under pipelining the token embedding's backward is the first stage's last op: its unit's fresh bf16 gradient
    (before FSDP2's post-backward adds it into the fp32 accumulation) lies at the end of each B, and the B's own
    moment holds the largest block unit's. By hand: V 8192 × h 512 = 4,194,304 elements, 2 B each."""
    cfg = Config.from_dict({
        "model": {"preset": "tiny", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn_hidden": 1024,
                  "vocab": 8192, "seq_len": 16},
        "cluster": {"preset": "local-cpu", "gpus": 4}, "parallel": {"dp": 2, "pp": 2, "zero": 3, "microbatches": 4},
        "training": {"precision": "bf16-mixed", "grad_dtype": "fp32", "micro_batch_size": 1}})
    first, last = (memory_per_rank(cfg).per_rank[r] for r in (0, 2))
    emb = [t.bytes for t in first.catalogue("comm_buffers") if t.kind == "fsdp_embedding_fresh_grad"]
    assert emb == [2 * 8192 * 512] and LIFETIMES["fsdp_embedding_fresh_grad"] == "backward_end"
    block = 2 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1024 + 2 * 512)  # wq, wo; wk, wv; w1-3; two norms
    assert [t.bytes for t in first.catalogue("comm_buffers") if t.kind == "fsdp_fresh_grad_end"] == [block]
    assert not [t for t in last.catalogue("comm_buffers") if t.kind == "fsdp_embedding_fresh_grad"]
    # (its REDUCE_GRAD, the embeddings' reduce-scatter beside every accumulated gradient, is its peak; without it,
    # the end of a B)
    sig = first._body.timeline.signature
    tb = list(sig.transient_bytes)
    tb[TRANSIENT.index("reduce_grad")] = 0
    assert "REDUCE_GRAD" in first.peak_moment
    assert first._body.timeline.peak_moment(peak_of(sig._replace(transient_bytes=tuple(tb)))).startswith(
        "the end of stage 0 B")


def test_in_the_same_dtype_the_embeddings_first_gradient_is_the_accumulation():
    """Reduced in bf16 (no conversion) FSDP2's first gradient of the token embedding is its accumulation: only a later
    B's fresh one is a second tensor, at that B's end (``later_backward_end``)."""
    cfg = Config.from_dict({
        "model": {"preset": "tiny", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn_hidden": 1024,
                  "vocab": 8192, "seq_len": 16},
        "cluster": {"preset": "local-cpu", "gpus": 4}, "parallel": {"dp": 2, "pp": 2, "zero": 3, "microbatches": 4},
        "training": {"precision": "bf16-mixed", "grad_dtype": "bf16", "micro_batch_size": 1}})
    first = memory_per_rank(cfg).per_rank[0]
    kinds = {t.kind: t.bytes for t in first.catalogue("comm_buffers")}
    # autograd adds it into the .grad: a temporary of the backward, not the unsharded gradient FSDP2 names
    added = [t.bytes for t in first.catalogue("temporaries") if t.kind == "fsdp_embedding_added_grad"]
    assert added == [2 * 8192 * 512] and "fsdp_embedding_fresh_grad" not in kinds
    assert "fsdp_fresh_grad" not in kinds  # the blocks add theirs in as made
    assert LIFETIMES["fsdp_embedding_added_grad"] == "later_backward_end"


def _wide_gpipe(cluster: dict) -> dict:
    """The tiny model widened (h 512, f 1,024), dp2 × pp2 GPipe ZeRO-3 m4, bf16 parameters with fp32 accumulation."""
    return {"model": {"preset": "tiny", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn_hidden": 1024,
                      "vocab": 1024, "seq_len": 64},
            "cluster": cluster,
            "parallel": {"dp": 2, "pp": 2, "zero": 3, "microbatches": 4, "schedule": "GPipe"},
            "training": {"precision": "bf16-mixed", "grad_dtype": "fp32", "micro_batch_size": 1}}


def test_a_bs_mlp_backward_holds_only_the_down_projections_fresh_gradient():
    """Converting gradients (bf16 parameters, fp32 accumulation), FSDP2's fresh gradient of the largest unit (a dense
    block) is, at a B's own moment (its first block's MLP backward), the down projection's alone: autograd runs w2's
    matmul first and the block's other weight gradients come later; the whole unit's waits for the post-backward at
    the end of the backward. (A fake Llama 3 70B pp8 GPipe step: w2's 112 MiB at its peak, not the block's 408.)"""
    raw = _wide_gpipe({"preset": "local-cpu", "gpus": 4})
    last = memory_per_rank(Config.from_dict(raw)).per_rank[2]
    kinds = {t.kind: t.bytes for t in last.catalogue("comm_buffers")}
    block = 2 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1024 + 2 * 512)
    assert kinds["fsdp_fresh_grad_made"] == 2 * 512 * 1024 and kinds["fsdp_fresh_grad_end"] == block
    assert "fsdp_fresh_grad" not in kinds
    assert LIFETIMES["fsdp_fresh_grad_made"] == "full_backward" and LIFETIMES["fsdp_fresh_grad_end"] == "post_backward"
    # under float8 the MLP's moment is the second up projection's weight cast: w2's and the first up projection's
    f8 = memory_per_rank(Config.from_dict({**raw, "training": {**raw["training"], "float8": "tensorwise"}})).per_rank[2]
    assert [t.bytes for t in f8.catalogue("comm_buffers") if t.kind == "fsdp_fresh_grad_made"] == [2 * 2 * 512 * 1024]
    # the last stage's final norm and head: their fresh gradient through the B
    assert kinds["fsdp_head_fresh_grad"] == 2 * (1024 * 512 + 512) and LIFETIMES["fsdp_head_fresh_grad"] == "backward"
    # a split backward: the whole unit's as before (not checked against the fake there)
    zbv = {"parallel": {**raw["parallel"], "schedule": "ZBVZeroBubble", "virtual_stages": 2}}
    other = memory_per_rank(Config.from_dict({**raw, **zbv})).per_rank[0]
    assert [t.bytes for t in other.catalogue("comm_buffers") if t.kind == "fsdp_fresh_grad"] == [block]


def test_a_first_b_holds_the_gradients_made_by_then_where_fsdp2_accumulates_in_the_parameters_dtype():
    """Bf16 gradients under bf16 parameters (no conversion): the unsharded gradients are the ``.grad`` autograd writes,
    held from the first backward on (``fsdp_unsharded_grads``, after it). The rank's first B holds those its backward has
    made by its moment: the head's and final norm's on the last stage (the head's backward runs first), and the first
    block's down projection's; the middle stages' only the latter. Only at the first B (a later one holds them all)."""
    raw = _wide_gpipe({"preset": "local-cpu", "gpus": 4})
    raw = {**raw, "training": {**raw["training"], "grad_dtype": "bf16"}}
    ranks = memory_per_rank(Config.from_dict(raw)).per_rank
    last, first = ranks[2], ranks[0]
    made = sorted(t.bytes for t in last.catalogue("comm_buffers") if t.kind == "fsdp_first_grads_made")
    assert made == sorted([2 * 512 * 1024, 2 * (1024 * 512 + 512)])
    assert [t.bytes for t in first.catalogue("comm_buffers") if t.kind == "fsdp_first_grads_made"] == [2 * 512 * 1024]
    assert LIFETIMES["fsdp_first_grads_made"] == "first_backward"
    # converting, the fresh gradients' own terms stand for them (above)
    conv = memory_per_rank(Config.from_dict(_wide_gpipe({"preset": "local-cpu", "gpus": 4}))).per_rank[2]
    assert not [t for t in conv.catalogue("comm_buffers") if t.kind == "fsdp_first_grads_made"]


def test_the_events_make_each_blocks_fresh_gradient_in_a_bs_walk():
    """A B's own moment holds what its first block's backward made of the unit's fresh gradient (``fsdp_fresh_grad_made``)
    and the end of the backward the whole unit's (``fsdp_fresh_grad_end``); the allocator, though, sees every block of
    every B make them: the part by its MLP backward, the whole before its post-backward adds it in. The events lay both
    in each block of the walk (the whole one where it stays within the peak), so the replay fragments as the steps do
    (on the cached fakes of eleven seeds, reserved within 5 % 443 -> 447 of 883 ranks)."""
    from engine.memory.lifetimes import allocation_events

    rank = memory_per_rank(Config.from_dict(_wide_gpipe({"gpu": "h100-sxm", "gpus": 4}))).per_rank[0]
    tl = rank._body.timeline
    sig = tl._event_signature()
    assert sig[2] is not None  # a Grain: the B walks its blocks
    made, whole = 2 * 512 * 1024, 2 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1024 + 2 * 512)
    events = allocation_events(sig)
    per_block = [e for e in events if e[0] == "alloc" and e[1][0] == "bw" and e[2] == made]
    fresh = [e for e in events if e[0] == "alloc" and e[1][0] == "uf"]
    blocks, bs = 2, 4  # stage 0's two blocks, its four B
    assert len(per_block) == blocks * bs
    assert fresh and all(e[2] == whole for e in fresh) and len(fresh) <= blocks * bs


def test_unpipelined_the_embeddings_fresh_gradient_comes_at_the_end_and_the_heads_lives_through_the_b():
    """Unpipelined FSDP2 accumulating fp32 over microbatches from bf16 parameters, TP: the largest fresh gradient is the
    vocab-parallel embedding's at full V·h, but its backward is the step's last op, at the end of the backward; at a B's
    own moment the block's made part and the head's (made first, added by the root's post-backward at the backward's
    end). measure --fake of Llama 3 70B dp2 tp8 cp4 ZeRO-3 m2 float8: the head's 0.245 GiB bf16 gradient alive at the
    peak (a B), no full-size embedding gradient (the engine laid its 1.96 GiB there: +14.4 %, now +0.4 %)."""
    raw = {"model": {"preset": "tiny", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn_hidden": 1024,
                     "vocab": 8192, "seq_len": 64},
           "cluster": {"preset": "local-cpu", "gpus": 4},
           "parallel": {"dp": 2, "tp": 2, "zero": 3, "microbatches": 2},
           "training": {"precision": "bf16-mixed", "grad_dtype": "fp32", "micro_batch_size": 1}}
    r = memory_per_rank(Config.from_dict(raw)).per_rank[0]
    kinds = {t.kind: t.bytes for t in r.catalogue("comm_buffers")}
    assert kinds["fsdp_fresh_grad_made"] == 2 * 512 * 512  # w2 (1024 / tp × 512)
    assert kinds["fsdp_fresh_grad_end"] == 2 * 8192 * 512  # the token embedding's, whole V·h (TP: replicated)
    assert kinds["fsdp_head_fresh_grad"] == 2 * (4096 * 512 + 512)  # the head's vocab shard and the final norm
    assert "fsdp_fresh_grad" not in kinds
    at_b = {t.kind for t in r.explain("comm_buffers")} if r.peak_moment.startswith("stage 0 B") else None
    assert at_b is None or "fsdp_fresh_grad_end" not in at_b


def test_a_pipeline_ranks_plain_gradients_appear_stage_by_stage():
    """Plain gradients (DDP, no FSDP2) are made by AccumulateGrad at a stage's first backward: on a rank of several
    stages, before the others' first backward only the last stage's exist (measure --fake of Qwen3 30B interleaved
    pp2 v3: 3.48 GiB at the last stage's second loss, its own, not the rank's 8.12). Laid per stage, as two terms of the
    same bytes (``stage_accumulated`` then ``stage_reduced``); the catalogue counts the gradients once."""
    from engine.memory.lifetimes import PARTIAL_STATE_KINDS

    raw = {"model": {"preset": "tiny", "layers": 6, "vocab": 65536, "seq_len": 256},
           "cluster": {"preset": "local-cpu", "gpus": 4},
           "parallel": {"dp": 2, "pp": 2, "schedule": "Interleaved1F1B", "virtual_stages": 3, "microbatches": 2},
           "training": {"precision": "bf16-mixed", "micro_batch_size": 2}}
    rank = memory_per_rank(Config.from_dict(raw)).per_rank[2]  # pp rank 1: stages 1, 3, 5, the last with the head
    grads = [t for t in rank.catalogue("grads") if t.kind == "gradients"]
    early = [t for t in rank.catalogue("grads") if t.kind == "plain_grads_accumulating"]
    assert sorted(t.stage for t in grads) == [1, 3, 5] and [t.bytes for t in grads] == [t.bytes for t in early]
    assert "plain_grads_accumulating" in PARTIAL_STATE_KINDS
    assert "stage 5 B of microbatch 1, at its start: the loss" in rank.peak_moment
    at_peak = [t for t in rank.explain("grads")]
    assert [(t.kind, t.stage) for t in at_peak] == [("plain_grads_accumulating", 5)]
    # one stage per rank, or a split backward: the rank's gradients from its first backward on, as before
    one = memory_per_rank(Config.from_dict({**raw, "parallel": {**raw["parallel"], "schedule": "1F1B",
                                                                 "virtual_stages": 1}})).per_rank[2]
    assert [t.stage for t in one.catalogue("grads") if t.kind == "gradients"] == [None]


def test_a_lora_blocks_recompute_holds_peft_casts_again_at_the_b():
    """A block recomputed whole in its backward runs its forward again, peft's casts and all (``lora_recompute_casts``,
    at B and I moments beside the recomputed block): measure --fake of Llama 2 7B LoRA (bf16 base, full recompute,
    pp2 v4) held 0.35 GiB more at its B than the recomputed block's saved tensors. Not without a whole-block recompute."""
    raw = {"model": {"preset": "tiny", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn_hidden": 1024,
                     "vocab": 1024, "seq_len": 256},
           "cluster": {"preset": "local-cpu", "gpus": 2}, "parallel": {"pp": 2, "microbatches": 4},
           "training": {"precision": "bf16-mixed", "finetune": "lora", "lora_targets": "mlp",
                        "lora_base_dtype": "bf16", "recompute": "full", "micro_batch_size": 2}}
    rank = memory_per_rank(Config.from_dict(raw)).per_rank[1]
    made = {t.kind: t.bytes for t in rank.catalogue("activations")}
    assert made["lora_recompute_casts"] == made["lora_forward_casts"] == 2 * 256 * (6 * 1024 + 8 * 512)
    assert LIFETIMES["lora_recompute_casts"] == "backward_input" and " B of microbatch" in rank.peak_moment
    assert "lora_recompute_casts" in {t.kind for t in rank.explain("activations")}
    none = memory_per_rank(Config.from_dict({**raw, "training": {**raw["training"], "recompute": "none"}})).per_rank[1]
    assert "lora_recompute_casts" not in {t.kind for t in none.catalogue("activations")}


def test_a_pipelines_last_stage_lays_its_kept_logits_once():
    """torch.distributed.pipelining's last stage keeps its output, the logits, to the microbatch's backward
    (``stage_logits``): that output is the tensor the loss casts to fp32, one tensor, laid with the stage's
    microbatch; the events laid the logits a second time before the cast (measure --fake of GPT-2 s128K pp8 cp2,
    last stage: one 6,284 MiB logits tensor before the loss's fp32 ones). Unpipelined, the logits are laid as the
    head makes them and freed once cast. GPT-2 (2 blocks) pp2 1F1B, bf16 autocast, rank 1 (the last stage)."""
    def events(pp):
        cfg = Config.from_dict({"model": {"preset": "gpt2-124m", "layers": 2, "seq_len": 1024},
                                "cluster": {"gpu": "h100-96g", "gpus": pp, "gpus_per_node": pp},
                                "parallel": {"pp": pp, "microbatches": 2},
                                "training": {"micro_batch_size": 2, "precision": "bf16-mixed"}})
        r = memory_per_rank(cfg).per_rank[-1]
        kept = sum(t.bytes for t in r.catalogue("activations") if t.kind == "stage_logits")
        return kept, [e for e in r._body.timeline.events() if e[0] == "alloc"]
    kept, ev = events(2)
    logits = 2 * 2 * 1024 * 50_257  # bf16 · s · b · V
    assert kept == logits  # one microbatch in flight on the last stage
    assert not [e for e in ev if e[1][0] == "logits"]
    assert [e[2] for e in ev if e[1][0] == "logits_fp32"] == [2 * logits, 2 * logits]
    _, ev1 = events(1)
    assert [e[2] for e in ev1 if e[1][0] == "logits"] == [logits, logits]


@pytest.mark.parametrize("schedule, v", [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2), ("DualPipeV", 2)])
def test_a_stages_later_ws_are_those_after_its_first(schedule, v):
    """``Moments.lw``: a W of a stage after that stage's first B or W (its weights hold a gradient by then, so
    ``stage_backward_weight`` holds fresh ones beside it: ``weight_pass_fresh``), on no other moment."""
    made = {ACTION_KINDS.index("B"), ACTION_KINDS.index("W")}
    for pp_rank in range(4):
        mo = moments(schedule, pp_rank, 4, v, 8)
        local = sorted(set(mo.stage.tolist()))
        seen = [False] * len(local)
        for i in range(len(mo.kind)):
            for j in range(len(local)):
                assert bool(mo.lw[i, j]) == (bool(mo.wr[i, j]) and seen[j]), (pp_rank, i, j)
            if mo.kind[i] in made and mo.phase[i] == 0:
                seen[local.index(int(mo.stage[i]))] = True
        assert 0 < mo.lw.sum() <= mo.wr.sum()


def test_a_zero3_zero_bubble_stages_later_w_holds_its_fresh_weight_gradients():
    """End to end, the term ``weight_pass_fresh``: on a later W only, and the rank's peak grows by it where that W
    peaks (measure --fake of Llama 3 405B ZBV pp4 ZeRO-3 bf16, four ranks: −4.1 … −5.0 % → +0.2 %)."""
    cfg = default_config().replace(
        model={"preset": "llama3-8b", "layers": 8, "seq_len": 2048},
        parallel={"dp": 2, "pp": 4, "tp": 1, "zero": 3, "schedule": "ZBVZeroBubble", "virtual_stages": 2,
                  "microbatches": 4},
        cluster={"gpus": 8},
        training={"recompute": "full", "micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "bf16"})
    sig = next(r._body.timeline.signature for r in predict(cfg).memory.per_rank
               if r._body.timeline.signature.pp_rank == 1)
    assert sig.lw_bytes and all(x > 0 for x in sig.lw_bytes)
    pk = peak_of(sig)
    assert pk.kind == "W" and any(pk.lw)
    assert peak_of(sig._replace(lw_bytes=())).bytes < pk.bytes


def test_a_one_stage_pipelined_rank_reduces_its_units_at_a_moment_before_the_end():
    """``_with_reduce_moment``: where the rank has something of ``reduce_grad`` (a pipelined FSDP2 rank of one stage),
    the schedule's REDUCE_GRAD is a moment of its own right before the end of the backward: every microbatch freed,
    the accumulated gradients and gathered units still there (what lives from the first backward on, and
    ``until_end_of_backward``), no sharded gradient yet (``end_of_backward``), none of the last B's transients."""
    import numpy as np

    from engine.memory.lifetimes import END, REDUCE

    plain, mo = moments("1F1B", 0, 2, 1, 4), moments("1F1B", 0, 2, 1, 4, reduce=True)
    assert len(mo.kind) == len(plain.kind) + 1
    at = int(np.flatnonzero(mo.phase == REDUCE)[0])
    assert mo.phase[at + 1] == END and mo.counts[at].sum() == 0
    alive = {life for life, on in zip(TRANSIENT, mo.masks[at]) if on}
    assert {"reduce_grad", "until_end_of_backward", "after_first_backward"} <= alive
    assert not alive & {"end_of_backward", "post_backward", "backward", "full_backward", "loss"}
    # not on a rank of several stages (each reduces right after its own last backward), nor unpipelined
    assert REDUCE not in moments("Interleaved1F1B", 0, 2, 2, 4, reduce=True).phase
    assert REDUCE not in moments("1F1B", 0, 1, 1, 4, reduce=True).phase


def test_a_recomputed_block_laid_outside_the_walk_is_its_tensors():
    """Unpipelined ZeRO-3 resharding after forward, full recompute: the late-backward moment holds the recomputed
    block (lifetime backward_input) outside a B's block-by-block walk; the events lay it in the pieces of a block's
    tensors (the grain's ``work``), as the walk does, never as one request (measure --fake, Llama 2 7B s64K b2: no
    tensor above 2,752 MiB; laid whole, an 18,225 MiB request took a segment of its own)."""
    from engine.memory.lifetimes import allocation_events, canonical_event_signature
    from engine.memory.per_rank import rank_body
    from engine.model.params import params_per_rank

    cfg = Config.from_dict({"model": {"preset": "llama2-7b", "layers": 4, "seq_len": 4096},
                            "cluster": {"gpu": "h100-96g", "gpus": 2},
                            "parallel": {"dp": 2, "zero": 3, "fsdp_reshard_after_forward": "always"},
                            "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "bf16",
                                         "recompute": "full"}})
    body = rank_body(cfg, params_per_rank(cfg)[0][0])
    tl = body.timeline
    recomputed = max(n for life, n, _ in tl._rows if life == "backward_input")
    largest = max(tl._grain.work)
    assert recomputed > largest
    sizes = [e[2] for e in allocation_events(canonical_event_signature(tl._event_signature())) if e[0] == "alloc"]
    assert recomputed not in sizes


def test_a_moe_blocks_forward_transients_are_its_experts_tensors():
    """The two largest tensors a block with experts makes in its forward (the allocation events' transients) are the
    experts': the fp32 outputs the combine weights (n·k·h·4) and the outputs in expert order (n·k·h·2, with the
    un-permute's int64 index), not the dense table's MLP rows (Qwen3 235B-A22B s4K b2 ep32: measure --fake's forward
    allocates 1 GiB and 512 MiB tensors in each block; the dense rows said 256 and 192 MiB)."""
    from engine.memory.activations import shape_of
    from engine.memory.per_rank import _moe_block_work

    cfg = Config.from_dict({
        "model": {"preset": "qwen3-235b-a22b", "layers": 2, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
        "parallel": {"dp": 32, "ep": 32, "zero": 2},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "full"}})
    n_k = 4096 * 2 * 8  # tokens × experts per token
    assert _moe_block_work(cfg, shape_of(cfg, 0)) == (n_k * 4096 * 4, n_k * 4096 * 2 + n_k * 8)


def test_the_roots_reduce_scatter_input_after_accumulation_is_one_tensor_of_the_events():
    """Unpipelined FSDP2 over two microbatches: the root's post-backward (torch's ``foreach_reduce``, in the backward's
    final callback) copies its accumulated gradients into one reduce-scatter input on the compute stream — Llama 3 8B
    dp4 ZeRO-3 with fp32 gradients: (2 × 128,256 × 4,096 + 4,096) elements (every dim 0 a multiple of 4: no padding)
    × 4 B = 4,008 MiB, the request measure --fake makes there (seed 20261254 #05: a new segment, reserved −13.2 →
    −3.9 % with it in the events)."""
    from engine.memory.lifetimes import canonical_event_signature
    from engine.memory.per_rank import rank_body
    from engine.model.params import params_per_rank

    cfg = Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
        "parallel": {"dp": 4, "zero": 3, "microbatches": 2},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "fp32"}})
    body = rank_body(cfg, params_per_rank(cfg)[0][0])
    events = replay_events(canonical_event_signature(body.timeline._event_signature()))
    root_input = (2 * 128_256 * 4_096 + 4_096) * 4
    assert root_input == 4008 * 2**20 + 16 * 2**10  # the final norm's 16 KiB past 4,008 MiB
    made = [e for e in events if e[0] == "alloc" and e[2] == root_input]
    assert len(made) == 1 and (len(made[0]) < 4 or made[0][3] == 0)  # once, on the compute stream


def test_tp_alones_embedding_gradient_is_one_tensor_made_after_the_blocks():
    """TP without a data-parallel wrapper: the token embedding's backward is the graph's last node, and DTensor's
    ``embedding_dense_backward`` makes its weight gradient Partial at the full V × h — one fp32 tensor of 128,256 ×
    4,096 × 4 B = 2,004 MiB for Llama 3 8B, made after every block's gradient when the freed activations are scattered
    over the forward's segments (measure --fake of seed 20261255 #03, dp1 tp4 SP: that request at the backward's end,
    a new segment; reserved −10.4 → −1.0 % with it in the events). The events lay it once, after the blocks'
    gradients, and the rest of the gradients in pieces; the bytes are the gradients' (4 B × (Ψ + V·h − rows))."""
    from engine.memory.lifetimes import canonical_event_signature
    from engine.memory.per_rank import rank_body
    from engine.model.params import params_per_rank

    cfg = Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
        "parallel": {"tp": 4, "sequence_parallel": True},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "fp32"}})
    body = rank_body(cfg, params_per_rank(cfg)[0][0])
    whole = 128_256 * 4_096 * 4
    assert whole == 2004 * 2**20
    grads = [t for t in body.catalogue["grads"] if t.kind == "gradients"]
    assert len(grads) == 1 and grads[0].bytes > whole
    events = replay_events(canonical_event_signature(body.timeline._event_signature()))
    made = [i for i, e in enumerate(events) if e[0] == "alloc" and e[2] == whole]
    assert len(made) == 1
    late = [i for i, e in enumerate(events) if e[0] == "alloc" and e[1][0] == "late"]
    assert late[-1] == made[0] and len(late) > 1  # the blocks' pieces first, then it
    assert sum(events[i][2] for i in late) == grads[0].bytes


def test_the_roots_all_gather_output_is_kept_to_the_first_blocks_copy_out():
    """Unpipelined ZeRO-3 resharding after forward: the forward gathers the root first and FSDP2's implicit prefetch
    keeps its all-gather output (on the all-gather stream) to the first block's copy-out, beside the first block's
    output (torch 2.13 _fsdp_param_group.py ``wait_for_unshard``: ``prev_all_gather_state``). Llama 3 8B dp8: the root
    (embeddings, final norm, head) is (2 × 128,256 × 4,096 + 4,096) bf16 elements = 2,004 MiB + 8 KiB, laid once in
    the first forward on that stream, freed once the moment's gathered units are laid; measure --fake of seed 20261255
    #23 makes it so (reserved −7.8 → −0.5 % with it in the events)."""
    from engine.memory.lifetimes import ALL_GATHER_STREAM, canonical_event_signature
    from engine.memory.per_rank import rank_body
    from engine.model.params import params_per_rank

    cfg = Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 8, "gpus_per_node": 8},
        "parallel": {"dp": 8, "zero": 3},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "fp32"}})
    body = rank_body(cfg, params_per_rank(cfg)[0][0])
    root = (2 * 128_256 * 4_096 + 4_096) * 2
    assert [t.bytes for t in body.catalogue["comm_buffers"] if t.kind == "fsdp_root_params"] == [root]
    events = replay_events(canonical_event_signature(body.timeline._event_signature()))
    made = [i for i, e in enumerate(events) if e[0] == "alloc" and e[1][0] == "rag"]
    assert len(made) == 1 and events[made[0]][2:] == (root, ALL_GATHER_STREAM)
    freed = next(i for i, e in enumerate(events) if e == ("free", events[made[0]][1]))
    between = [e for e in events[made[0]:freed] if e[0] == "alloc"]
    assert {e[1][0] for e in between} == {"rag", "t"} and len(between) >= 3  # the root's and the blocks' units
    # ZeRO-2 keeps every unit gathered: no such tensor laid
    z2 = Config.from_dict({**cfg.to_dict(), "parallel": {"dp": 8, "zero": 2}})
    body = rank_body(z2, params_per_rank(z2)[0][0])
    assert not [e for e in replay_events(canonical_event_signature(body.timeline._event_signature()))
                if e[0] == "alloc" and e[1][0] == "rag"]


def test_a_last_stages_first_backward_holds_the_heads_plain_gradient_and_no_later_moment_adds_it():
    """Plain gradients (DDP): a rank's first B makes each ``.grad`` as its walk reaches the parameter, the head's and
    final norm's first (the loss's backward runs into them), so its own moment holds those (``plain_early_grads``,
    lifetime ``first_backward``), and from its end every gradient (``after_first_backward``); the first stage holds
    no head. measure --fake of Llama 2 7B GPipe pp8 m8 DDP fp32 full recompute (the golden corpus's entry 16), last
    stage: its first B peaks with all eight microbatches' block inputs beside 3.1 GB of gradients."""
    c = _cfg({"dp": 2, "pp": 2, "schedule": "GPipe", "microbatches": 4}, gpus=4, training={"precision": "fp32"})
    first, last = (next(r for r in memory_per_rank(c).per_rank if r.stages == (s,)) for s in (0, 1))
    assert not [t for t in first.catalogue("grads") if t.kind == "plain_early_grads"]
    (early,) = [t for t in last.catalogue("grads") if t.kind == "plain_early_grads"]
    (plain,) = [t for t in last.catalogue("grads") if t.kind == "gradients"]
    m = c.model
    assert early.bytes == plain.bytes * (m.vocab * m.hidden + m.hidden) // (plain.bytes // 4)
    assert LIFETIMES["plain_early_grads"] == "first_backward"
    tl = last._body.timeline
    mo = sig_moments(tl.signature)
    col = TRANSIENT.index("first_backward")
    bs = [i for i in range(len(mo.kind)) if ACTION_KINDS[int(mo.kind[i])] == "B" and mo.phase[i] == 0]
    assert [int(mo.masks[i, col]) for i in bs] == [1] + [0] * (len(bs) - 1)
    assert int(mo.masks[:, col].sum()) == 1  # not at the loss moments, the B ends or the end


def test_a_rank_of_several_stages_keeps_each_stages_units_from_its_backward_to_its_next_forward():
    """ZeRO-3 resharding after forward, Interleaved1F1B pp2 v2 m4, rank 0 (stages 0 and 2), worked by hand from the
    schedule: a stage's units stay gathered after each of its backwards (``set_reshard_after_backward(False)``)
    until its next forward reshards them or its REDUCE_GRAD (after its fourth B); its own F and its B after a forward
    gather its current units (``cu``), and those not right after one of its backwards all-gather (``sg`` in a
    backward, ``sf`` in a forward)."""
    mo = moments("Interleaved1F1B", 0, 2, 2, 4)
    rows = mo.phase == 0
    got = [(ACTION_KINDS[k], s, mb) for k, s, mb in zip(mo.kind[rows], mo.stage[rows], mo.microbatch[rows])]
    assert got == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0), ("F", 0, 3),
                   ("B", 2, 1), ("F", 2, 2), ("B", 0, 0), ("F", 2, 3), ("B", 0, 1), ("B", 2, 2), ("B", 2, 3),
                   ("B", 0, 2), ("B", 0, 3)]
    assert mo.gk[rows].tolist() == [[0, 0]] * 6 + [[0, 1], [0, 1], [0, 0], [0, 0]] + [[1, 0]] * 3 + [[1, 1]] + [[1, 0]] * 2
    assert mo.cu[rows].tolist() == [[1, 0], [1, 0], [0, 1], [0, 1], [1, 0], [0, 1], [1, 0], [0, 0], [0, 1], [1, 0],
                                    [0, 1], [0, 0], [0, 1], [0, 0], [0, 0], [0, 0]]
    assert mo.sg[rows].tolist() == [[0, 0]] * 5 + [[0, 1]] + [[0, 0]] * 3 + [[1, 0]] + [[0, 0]] * 2 + [[0, 1]] + [[0, 0]] * 3
    assert mo.sf[rows].tolist() == [[1, 0], [1, 0], [0, 1], [0, 1], [1, 0], [0, 0], [1, 0], [0, 0], [0, 0], [0, 0],
                                    [0, 1]] + [[0, 0]] * 5
    # the end of the backward and the optimizer step: every stage reduced and resharded
    assert not mo.gk[~rows].any() and not mo.cu[~rows].any()


@pytest.mark.parametrize("sc,v", [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2), ("DualPipeV", 2)])
def test_the_first_stages_w_is_the_full_backward_and_its_i_none(sc, v):
    """torch's ``backward_weight_one_chunk`` runs ``stage_backward`` (a full backward) for stage 0's W — its input needs
    no gradient, so its I found no parameter groups (torch/distributed/pipelining/stage.py) — so that W holds what a
    B holds at its own moment: the ``early_backward`` lifetime (the experts' full-size weight gradients,
    ``moe_full_backward``; measure --fake of seed 20261273 #21, Qwen3 30B-A3B ZBV pp4, rank 0: every stage-0 W
    −3.52 GiB without it, +0.03 with it). A later stage's W and every I run no full backward."""
    early = TRANSIENT.index("early_backward")
    for rank in range(4):
        mo = moments(sc, rank, 4, v, 8)
        on = mo.masks[:, early].astype(bool)
        kinds = [ACTION_KINDS[int(k)] for k in mo.kind]
        for i, k in enumerate(kinds):
            if mo.phase[i] != ACTION or k not in ("B", "I", "W"):
                continue
            assert on[i] == (k == "B" or (k == "W" and int(mo.stage[i]) == 0)), (rank, i, k, int(mo.stage[i]))
        assert on.any() == (rank == 0 or "B" in kinds)
        # and stage 0's I runs no backward at all (backward_one_chunk computes no input gradient for the first stage):
        # none of a backward's transients at its moment (measure --fake of #36, Llama 3 405B cp2 ZBV: +2.36 GiB without)
        for life in ("backward", "backward_input", "input_backward", "backward_after_forward"):
            col = mo.masks[:, TRANSIENT.index(life)].astype(bool)
            for i, k in enumerate(kinds):
                if k == "I" and mo.phase[i] == ACTION:
                    assert col[i] == (int(mo.stage[i]) != 0) or life == "backward_after_forward", (life, rank, i)
                    assert not (col[i] and int(mo.stage[i]) == 0), (life, rank, i)
