"""Invariants of the memory model over random valid configs (hypothesis)."""

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from engine import MEMORY_CATEGORIES, Config, ConfigError
from engine.memory import memory_per_rank
from engine.memory.lifetimes import PARTIAL_STATE_KINDS
from engine.names import SCHEDULES

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def raw_configs(draw):
    head_dim = draw(st.sampled_from([8, 16]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if kv_heads % t == 0]))
    pp = draw(st.sampled_from([1, 2, 4]))
    schedule = draw(st.sampled_from(SCHEDULES)) if pp > 1 else "1F1B"
    v = 2 if schedule in ("ZBVZeroBubble", "DualPipeV") else (
        1 if schedule in ("GPipe", "1F1B") else draw(st.sampled_from([1, 2])))
    if pp == 1:
        v = 1
    m = draw(st.integers(min_value=max(1, pp * v), max_value=2 * pp * v + 2)) if pp > 1 else 1
    dp = draw(st.sampled_from([1, 2, 4]))
    zero = draw(st.sampled_from([0, 1, 2, 3]))
    replicate = draw(st.sampled_from([r for r in (1, 2) if dp % r == 0 and (r == 1 or zero >= 2)]))
    return {
        "model": {
            "layers": draw(st.integers(min_value=pp * v, max_value=pp * v + 4)),
            "hidden": heads * head_dim, "heads": heads, "kv_heads": kv_heads,
            "ffn_hidden": tp * draw(st.integers(min_value=4, max_value=24)),
            "vocab": draw(st.integers(min_value=16, max_value=300)),
            "seq_len": 4 * draw(st.integers(min_value=2, max_value=16)),
            "tied_embeddings": draw(st.booleans()),
            "mlp": draw(st.sampled_from(["gelu", "swiglu"])),
            "norm": draw(st.sampled_from(["layernorm", "rmsnorm"])),
            "attention": draw(st.sampled_from(["eager", "flash"])),
            "position": draw(st.sampled_from(["rope", "learned"])),
            "bias": draw(st.booleans()),
            "dropout": draw(st.sampled_from([0.0, 0.1])),
        },
        "cluster": {"gpu": "h100-sxm", "gpus": dp * tp * pp},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "replicate": replicate,
                     "sequence_parallel": tp > 1 and draw(st.booleans()), "schedule": schedule,
                     "virtual_stages": v, "microbatches": m},
        "training": {"micro_batch_size": draw(st.integers(min_value=1, max_value=3)),
                     "precision": draw(st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed"])),
                     "optimizer": draw(st.sampled_from(["adamw", "sgd-momentum", "sgd"])),
                     "recompute": draw(st.sampled_from(["none", "selective", "full"]))},
        "conventions": {"allocator_slack_fraction": draw(st.sampled_from([0.0, 0.05])),
                        "state_accounting": draw(st.sampled_from(["pytorch", "zero-paper"]))},
    }


def build(raw) -> Config:
    try:
        return Config.from_dict(raw)
    except ConfigError:
        assume(False)


def with_(raw, section, **changes):
    return {**raw, section: {**raw[section], **changes}}


@SETTINGS
@given(raw_configs())
def test_totals_are_sums_and_every_rank_reported(raw):
    cfg = build(raw)
    rep = memory_per_rank(cfg)
    par = cfg.parallel
    assert [r.rank for r in rep.per_rank] == list(range(par.world_size))
    assert {r.pp_rank for r in rep.per_rank} == set(range(par.pp))
    assert sorted(s for r in rep.per_rank if r.dp_rank == 0 and r.tp_rank == 0 for s in r.stages) == \
        list(range(par.num_stages))
    for r in rep.per_rank:
        values = [getattr(r, c) for c in MEMORY_CATEGORIES]
        assert all(isinstance(x, int) and x >= 0 for x in values)
        assert r.total == sum(values)
        for c in MEMORY_CATEGORIES:
            assert sum(t.bytes for t in r.explain(c)) == getattr(r, c)
        assert r.fits == (r.total <= rep.capacity_bytes)
    j = rep.to_json()
    assert len(j["per_rank"]) == par.world_size



def test_the_early_reduce_frees_the_last_blocks_tensors_once():
    """Found by the property above: an unpipelined FSDP2 backward's early moment (the last block's tensors freed, its
    sharded gradients made) sits beside the B's MLP moment, whose freed down input is one of those tensors — taken
    off twice, a one-block fp32 model's activations read −64 B."""
    raw = {"model": {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 4, "vocab": 16, "seq_len": 8,
                     "mlp": "swiglu", "norm": "layernorm", "attention": "eager", "position": "rope"},
           "cluster": {"gpu": "h100-sxm", "gpus": 2},
           "parallel": {"dp": 2, "zero": 3, "replicate": 2, "microbatches": 1},
           "training": {"micro_batch_size": 1, "precision": "fp32", "recompute": "none"},
           "conventions": {"allocator_slack_fraction": 0.0, "state_accounting": "pytorch"}}
    for r in memory_per_rank(Config.from_dict(raw)).per_rank:
        assert min(getattr(r, c) for c in MEMORY_CATEGORIES) >= 0
        early = [t for t in r.explain("activations") if t.kind == "fsdp_early_reduce"]
        assert early and "less the" in early[0].formula

def held_states(r) -> int:
    """params + grads + optimizer a rank holds, each term at its largest (the catalogue). The peak's
    snapshot may lack FSDP2's sharded gradients: FSDP2 makes them only in each unit's post-backward
    (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce:
    "fsdp_param.sharded_param.grad = new_sharded_dtensor_grad") and zero_grad(set_to_none=True) drops
    them after the step, so a peak before the first post-backward holds none. (Those some units have made by an
    earlier moment of an unpipelined backward — ``fsdp_early_reduce``, ``fsdp_reduced_grads`` — are part of them,
    not more.)"""
    return sum(t.bytes for c in ("params", "grads", "optimizer") for t in r.catalogue(c)
               if t.kind not in PARTIAL_STATE_KINDS)


@SETTINGS
@given(raw_configs())
def test_more_sharding_never_raises_model_states(raw):
    cfg = build(raw)
    base = [held_states(r) for r in memory_per_rank(cfg).per_rank]
    # a higher ZeRO stage on the same layout (HSDP needs 2 or 3)
    for z in range(cfg.parallel.zero + 1, 4):
        try:
            higher = Config.from_dict(with_(raw, "parallel", zero=z))
        except ConfigError:
            continue
        states = [held_states(r) for r in memory_per_rank(higher).per_rank]
        assert all(a <= b for a, b in zip(states, base)), z
    # twice the data-parallel ranks at the same ZeRO stage
    wider = with_(with_(raw, "parallel", dp=2 * cfg.parallel.dp), "cluster", gpus=2 * cfg.parallel.world_size)
    wide = memory_per_rank(build(wider))
    if cfg.conventions.state_accounting == "pytorch" and cfg.parallel.zero == 1:
        # ZeroRedundancyOptimizer's greedy whole-tensor shares are not monotone per rank (a rank
        # can draw a larger tensor with more ranks); their mean over the DP group is
        def mean(rep):
            acc: dict = {}
            for r in rep.per_rank:
                acc.setdefault((r.pp_rank, r.tp_rank), []).append(held_states(r))
            return {k: sum(v) / len(v) for k, v in acc.items()}
        narrow_mean = mean(memory_per_rank(cfg))
        for k, x in mean(wide).items():
            assert x <= narrow_mean[k]
        return
    per_local = {(r.pp_rank, r.tp_rank): held_states(r) for r in memory_per_rank(cfg).per_rank}
    for r in wide.per_rank:
        assert held_states(r) <= per_local[r.pp_rank, r.tp_rank]


#: a ZeRO-1 pair whose peak moves from the optimizer step to the loss as the sequence grows (found by hypothesis)
_PEAK_MOVES = {
    "model": {"layers": 1, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn_hidden": 4, "vocab": 16, "seq_len": 44,
              "tied_embeddings": False, "mlp": "gelu", "norm": "layernorm", "attention": "eager", "position": "rope",
              "bias": False, "dropout": 0.0},
    "cluster": {"gpu": "h100-sxm", "gpus": 2},
    "parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "replicate": 1, "sequence_parallel": False,
                 "schedule": "1F1B", "virtual_stages": 1, "microbatches": 1},
    "training": {"micro_batch_size": 1, "precision": "fp32", "optimizer": "adamw", "recompute": "none"},
    "conventions": {"allocator_slack_fraction": 0.0, "state_accounting": "pytorch"},
}

#: a ZeRO-3 pair whose peak moves from the end of the backward to a B's own moment, before FSDP2 makes the
#: first gradient, as a layer is added (found by hypothesis)
_GRADS_LEAVE_THE_PEAK = {
    "model": {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 4, "vocab": 263, "seq_len": 12,
              "tied_embeddings": False, "mlp": "gelu", "norm": "layernorm", "attention": "eager", "position": "rope",
              "bias": False, "dropout": 0.0},
    "cluster": {"gpu": "h100-sxm", "gpus": 2},
    "parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 3, "replicate": 1, "sequence_parallel": False,
                 "schedule": "1F1B", "virtual_stages": 1, "microbatches": 1},
    "training": {"micro_batch_size": 3, "precision": "fp32", "optimizer": "adamw", "recompute": "none"},
    "conventions": {"allocator_slack_fraction": 0.0, "state_accounting": "pytorch"},
}

#: the same under ZeRO-1 shares and a pipeline: rank 0's peak moves to microbatch 0's B (found by hypothesis)
_ZERO1_GRADS_LEAVE_THE_PEAK = {
    "model": {"layers": 2, "hidden": 16, "heads": 2, "kv_heads": 1, "ffn_hidden": 4, "vocab": 22, "seq_len": 8,
              "tied_embeddings": False, "mlp": "gelu", "norm": "rmsnorm", "attention": "eager", "position": "learned",
              "bias": False, "dropout": 0.0},
    "cluster": {"gpu": "h100-sxm", "gpus": 4},
    "parallel": {"dp": 2, "tp": 1, "pp": 2, "zero": 1, "replicate": 1, "sequence_parallel": False,
                 "schedule": "GPipe", "virtual_stages": 1, "microbatches": 2},
    "training": {"micro_batch_size": 1, "precision": "fp32", "optimizer": "sgd-momentum", "recompute": "none"},
    "conventions": {"allocator_slack_fraction": 0.0, "state_accounting": "pytorch"},
}


@SETTINGS
@given(raw_configs(), st.sampled_from(["layers", "ffn_hidden", "vocab", "seq_len", "micro_batch_size"]))
@example(_PEAK_MOVES, "seq_len")
@example(_GRADS_LEAVE_THE_PEAK, "layers")
@example(_ZERO1_GRADS_LEAVE_THE_PEAK, "layers")
def test_bigger_models_never_need_less(raw, knob):
    cfg = build(raw)
    if knob == "micro_batch_size":
        bigger = with_(raw, "training", micro_batch_size=cfg.training.micro_batch_size + 1)
    else:
        step = {"layers": 1, "ffn_hidden": cfg.parallel.tp, "vocab": 7, "seq_len": 4}[knob]
        bigger = with_(raw, "model", **{knob: getattr(cfg.model, knob) + step})
    small, big = memory_per_rank(cfg), memory_per_rank(build(bigger))
    # torch's ZeroRedundancyOptimizer hands whole tensors out greedily: a bigger tensor can move another
    # to a different rank, so one dp-rank's share may shrink (Linears 7 → 8 wide: a rank 6,144 → 5,952 B)
    # while the group's sum grows
    # and FSDP2 shards each tensor by rows, ceil(rows / dp) to a rank, the last ones short or empty
    # (torch.chunk's split): a tensor 4 → 5 rows wide over dp 4 gives rank 3 none of it where it had one
    shares_move = cfg.parallel.zero >= 1 and cfg.conventions.state_accounting == "pytorch" and cfg.parallel.dp > 1
    for a, b in zip(small.per_rank, big.per_rank):
        if not shares_move:
            assert b.total >= a.total, (knob, a.rank)
        if knob in ("layers", "ffn_hidden", "vocab") and not shares_move:
            # parameters and optimizer states grow with the knob at any moment; the gradients can vanish
            # from the peak: more activations move it from the end of the backward (gradients alive) to a
            # moment before FSDP2's post-backward makes the first (ZeRO-3, 1 → 2 layers of a 1-block model
            # with 263 tokens of vocabulary: the peak moves to the B's own moment, states 375,808 → 360,192 B)
            cats = {c: [sum(t.bytes for t in r.explain(c)) for r in (a, b)] for c in ("params", "grads", "optimizer")}
            assert cats["params"][1] >= cats["params"][0] and cats["optimizer"][1] >= cats["optimizer"][0]
            assert b.model_states >= a.model_states or (cats["grads"][1] < cats["grads"][0]
                                                        and b.peak_moment != a.peak_moment), (knob, a.rank)
    if shares_move:
        assert sum(r.total for r in big.per_rank) >= sum(r.total for r in small.per_rank)
        # the states at the peak, where the knob adds parameters: seq_len and micro_batch_size add only
        # activations, which can move the peak from the optimizer step (gradients alive) to the loss, before
        # the first gradient exists ("pytorch" accounting; seq_len 44 -> 48 of a 1-layer ZeRO-1 model)
        if knob in ("layers", "ffn_hidden", "vocab"):
            # as above, the gradients may leave a rank's peak with it (pp 2, 2 → 3 layers: rank 0's peak moves
            # from microbatch 1's B, gradients alive, to microbatch 0's: the group's states 43,712 → 43,584 B)
            sums = {c: [sum(sum(t.bytes for t in r.explain(c)) for r in m.per_rank) for m in (small, big)]
                    for c in ("params", "grads", "optimizer")}
            assert sums["params"][1] >= sums["params"][0] and sums["optimizer"][1] >= sums["optimizer"][0]
            moved = any(a.peak_moment != b.peak_moment for a, b in zip(small.per_rank, big.per_rank))
            assert (sum(r.model_states for r in big.per_rank) >= sum(r.model_states for r in small.per_rank)
                    or (sums["grads"][1] < sums["grads"][0] and moved))


@st.composite
def ep_or_zero1_configs(draw):
    """raw_configs, some with ZeRO-1 over several dp-ranks (each dp-rank's own optimizer share) or a
    measured expert load (each ep-rank its own activations), and with cp: the layouts whose ranks
    differ in more than their pipeline stage and TP shard."""
    raw = draw(raw_configs())
    par = raw["parallel"]
    if draw(st.booleans()):
        par.update(zero=1, replicate=1, tp=1, sequence_parallel=False)
        raw["conventions"]["state_accounting"] = "pytorch"
    if draw(st.booleans()):
        par["cp"] = 2
        raw["model"]["seq_len"] = 4 * raw["model"]["seq_len"]
    if draw(st.booleans()):
        experts = draw(st.sampled_from([4, 8]))
        raw["model"].update(experts=experts, experts_per_token=2, mlp="swiglu")
        dense = par["dp"] // par.get("replicate", 1) * par.get("cp", 1) * par["tp"]
        par["ep"] = draw(st.sampled_from([e for e in (1, 2, 4) if experts % e == 0 and dense % e == 0]))
        if par["ep"] > 1 and draw(st.booleans()):
            w = [draw(st.integers(min_value=1, max_value=9)) for _ in range(experts)]
            raw["conventions"]["moe_expert_load"] = [x / sum(w) for x in w]
    raw["cluster"]["gpus"] = par["dp"] * par["tp"] * par["pp"] * par.get("cp", 1)
    return raw


@SETTINGS
@given(ep_or_zero1_configs())
def test_the_groups_hold_every_rank_once_and_each_rank_reads_its_groups_body(raw):
    """``memory_per_rank`` computes one body per group and makes ranks when asked: the groups' rank
    sets (sizes, first and last ranks given without listing them) cover the world exactly once, and
    each rank made from the lazy view holds its group's body."""
    cfg = build(raw)
    rep = memory_per_rank(cfg)
    world = cfg.parallel.world_size
    seen = {}
    for g in rep.groups:
        ranks = list(g.ranks)
        assert ranks == sorted(ranks) and len(ranks) == len(g.ranks) and ranks[0] == g.first.rank
        assert ranks[-1] == (g.ranks.last if hasattr(g.ranks, "last") else g.ranks[-1])
        for r in ranks:
            assert r not in seen
            seen[r] = g
    assert sorted(seen) == list(range(world)) and len(rep.per_rank) == world
    for r in rep.per_rank:
        g = seen[r.rank]
        assert r._body is g.first._body
        assert (r.rank % cfg.parallel.tp, r.rank // (cfg.parallel.cp * cfg.parallel.tp) % cfg.parallel.dp) == \
            (r.tp_rank, r.dp_rank)
    assert rep.peak.total == max(r.total for r in rep.per_rank)
    assert rep.fits == all(r.fits for r in rep.per_rank)
