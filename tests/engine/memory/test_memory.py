"""Memory per rank: hand-worked numbers for model states, Table 2 activations, pipelines."""

import pytest

from engine import MEMORY_CATEGORIES, Config, ConfigError
from engine.memory import (
    activation_bytes_per_layer,
    activation_terms_per_layer,
    memory_per_rank,
)
from engine.model.family import largest_fitting_model
from engine.model.params import param_counts

# The hand-worked checks below are the published accountings (ZeRO paper, Korthikanti Table 2):
# pinned to "zero-paper". What torch keeps ("pytorch", the default) is tests/backend/test_memory_pytorch.py.
NO_OVERHEAD = {"runtime_context": False, "collective_buffers": False, "state_accounting": "zero-paper"}


def cfg(model=None, training=None, conventions=None, gpu="h100-sxm", **parallel) -> Config:
    par = {"dp": 1, "tp": 1, "pp": 1, **parallel}
    gpus = par["dp"] * par["tp"] * par["pp"]
    return Config.from_dict({
        "model": model or {"preset": "tiny"},
        "cluster": {"gpu": gpu, "gpus": gpus},
        "parallel": par,
        "training": training or {},
        "conventions": conventions if conventions is not None else NO_OVERHEAD,
    })


# A model whose every tensor dim divides 4, so ZeRO shards are exact.
EVEN = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 1024, "vocab": 1024,
        "seq_len": 128, "mlp": "gelu", "norm": "layernorm", "attention": "eager", "bias": False}
MIXED = {"precision": "bf16-mixed", "grad_dtype": "bf16", "optimizer": "adamw"}


# --------------------------------------------------------------------------- model states


@pytest.mark.parametrize("zero, per_param", [
    (0, lambda d: 16),
    (1, lambda d: 2 + 2 + 12 / d),
    (2, lambda d: 2 + 14 / d),
    (3, lambda d: 16 / d),
])
def test_mixed_adam_bytes_per_parameter(zero, per_param):
    d = 4
    c = cfg(EVEN, MIXED, dp=d, zero=zero)
    psi = param_counts(c.model).total
    assert psi % d == 0
    r = memory_per_rank(c).per_rank[0]
    assert r.params + r.grads + r.optimizer == per_param(d) * psi
    assert r.model_states == per_param(d) * psi


def test_zero_split_between_categories():
    c = cfg(EVEN, MIXED, dp=4, zero=1)
    psi = param_counts(c.model).total
    r = memory_per_rank(c).per_rank[0]
    assert (r.params, r.grads, r.optimizer) == (2 * psi, 2 * psi, 12 * psi // 4)
    terms = {t.label: t.bytes for t in r.explain("optimizer")}
    assert terms == {"fp32 master weights": psi, "adamw states (2 × fp32)": 2 * psi}


def test_seven_billion_ddp_and_zero3():
    ddp = memory_per_rank(cfg({"preset": "llama2-7b"}, MIXED, gpu="a100-80g")).per_rank[0]
    psi = 6_738_415_616
    assert ddp.model_states == 16 * psi  # 107.8 GB: "about 112 GB" is 16 × 7e9
    assert abs(ddp.model_states - 112e9) / 112e9 < 0.05
    z3 = memory_per_rank(cfg({"preset": "llama2-7b"}, MIXED, gpu="a100-80g", dp=4, zero=3)).per_rank[0]
    assert z3.model_states == 4 * psi  # 16Ψ/4, ≈ 28 GB
    assert abs(z3.model_states - 28e9) / 28e9 < 0.05


def test_fp32_grads_and_other_optimizers():
    psi = param_counts(cfg(EVEN).model).total
    r = memory_per_rank(cfg(EVEN, {**MIXED, "grad_dtype": "fp32"})).per_rank[0]
    assert r.model_states == 18 * psi
    r = memory_per_rank(cfg(EVEN, {"precision": "fp32", "optimizer": "adamw"})).per_rank[0]
    assert (r.params, r.grads, r.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    r = memory_per_rank(cfg(EVEN, {"precision": "fp32", "optimizer": "sgd"})).per_rank[0]
    assert r.optimizer == 0
    r = memory_per_rank(cfg(EVEN, {**MIXED, "optimizer": "sgd-momentum"})).per_rank[0]
    assert r.optimizer == 8 * psi
    r = memory_per_rank(cfg(EVEN, {"precision": "fp16-mixed", "optimizer": "adamw"})).per_rank[0]
    assert r.model_states == 16 * psi


def test_hsdp_divides_by_shard_degree_not_world():
    c = cfg(EVEN, MIXED, dp=4, zero=3, replicate=2)
    psi = param_counts(c.model).total
    assert memory_per_rank(c).per_rank[0].model_states == 16 * psi // 2


def test_zero_with_tp_and_pp_divides_the_local_share():
    c = cfg(EVEN, MIXED, dp=2, tp=2, pp=2, zero=1, microbatches=2)
    grid_total = sum(r.params for r in memory_per_rank(c).per_rank if r.dp_rank == 0) // 2
    replicated = 4 * (2 * 2 * 256) + 2 * 256  # LayerNorms of 4 blocks + final norm, on both TP ranks
    assert grid_total == param_counts(c.model).total + (2 - 1) * replicated
    # every rank's optimizer is its own local share / dp
    for r in memory_per_rank(c).per_rank:
        assert r.optimizer == 12 * (r.params // 2) // 2


# --------------------------------------------------------------------------- activations
# Korthikanti et al. 2022, Table 2, with s=512, b=2, h=1024, a=16, t=4, f=4h, eager, dropout on:
# sbh = 1,048,576; a·s²·b = 8,388,608.

TABLE2 = {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 16, "ffn_hidden": 4096, "vocab": 1024,
          "seq_len": 512, "mlp": "gelu", "norm": "layernorm", "attention": "eager", "dropout": 0.1}
SBH, AS2B = 512 * 2 * 1024, 16 * 512 * 512 * 2
B2 = {**MIXED, "micro_batch_size": 2}


def per_layer(model=TABLE2, recompute="none", **parallel):
    return activation_bytes_per_layer(cfg(model, {**B2, "recompute": recompute}, **parallel))


def test_table2_no_parallelism():
    assert SBH == 1_048_576 and AS2B == 8_388_608
    assert per_layer() == 34 * SBH + 5 * AS2B == 77_594_624  # sbh(34 + 5as/h)


def test_table2_tensor_parallel():
    assert per_layer(tp=4) == 10 * SBH + 24 * SBH // 4 + 5 * AS2B // 4 == 27_262_976


def test_table2_tensor_and_sequence_parallel():
    assert per_layer(tp=4, sequence_parallel=True) == (34 * SBH + 5 * AS2B) // 4 == 19_398_656


def test_table2_tensor_parallel_selective():
    assert per_layer(recompute="selective", tp=4) == 10 * SBH + 24 * SBH // 4 == 16_777_216


def test_table2_tp_sp_selective():
    assert per_layer(recompute="selective", tp=4, sequence_parallel=True) == 34 * SBH // 4 == 8_912_896


def test_without_dropout_the_masks_and_dropout_output_go():
    no_drop = {**TABLE2, "dropout": 0.0}
    # −1 sbh mask after attention, −1 sbh after MLP, −as²b mask, −2as²b dropout output
    assert per_layer(no_drop) == 32 * SBH + 2 * AS2B == 50_331_648
    labels = {t.label for t in activation_terms_per_layer(cfg(no_drop, B2))[0]}
    assert not any("mask" in lab or "dropout" in lab for lab in labels)


def test_flash_attention_drops_the_s_squared_terms():
    flash = {**TABLE2, "attention": "flash", "dropout": 0.0}
    lse = 4 * 16 * 512 * 2  # a·s·b fp32 log-sum-exp
    assert per_layer(flash) == 32 * SBH + lse == 33_619_968
    # with dropout on, flash regenerates its mask from the RNG: only the two residual masks return
    assert per_layer({**flash, "dropout": 0.1}) == 34 * SBH + lse


def test_full_recompute_keeps_block_inputs():
    c = cfg(TABLE2, {**B2, "recompute": "full"}, tp=4, sequence_parallel=True)
    r = memory_per_rank(c).per_rank[0]
    layer_terms = [t for t in r.explain("activations") if "layers" in t.label]
    assert layer_terms[0].bytes == 4 * 2 * SBH // 4  # 4 layers × 2sbh/t, one microbatch
    # the block its backward recomputes is activations, as PyTorch's MemTracker files it, less its
    # input: the checkpoint keeps that, and norm1's replay saves the same tensor (2sbh/t here)
    act = {t.label: t.bytes for t in r.explain("activations")}
    assert act["one block recomputed during backward (full recompute), less its kept input"] == \
        19_398_656 - 2 * SBH // 4 == 18_874_368
    assert not any(t.kind == "recomputed_block" for t in r.explain("temporaries"))


def test_fp32_activations_double_the_16bit_terms():
    fp32 = per_layer_fp32 = activation_bytes_per_layer(
        cfg(TABLE2, {"precision": "fp32", "micro_batch_size": 2}))
    # masks stay 1 byte: 4 masks-worth (2 sbh + as²b) are not doubled
    assert fp32 == per_layer_fp32 == 2 * 77_594_624 - (2 * SBH + AS2B)


def test_swiglu_saves_four_ffn_tensors():
    sw = {**TABLE2, "mlp": "swiglu", "dropout": 0.0, "ffn_hidden": 2048}
    gelu = {**TABLE2, "dropout": 0.0, "ffn_hidden": 2048}
    assert per_layer(sw) - per_layer(gelu) == 2 * (2 * 512 * 2 * 2048)


# --------------------------------------------------------------------------- pipelines


def in_flight(schedule, p=4, m=8, v=1, layers=8):
    model = {**EVEN, "layers": layers}
    c = cfg(model, MIXED, pp=p, schedule=schedule, virtual_stages=v, microbatches=m)
    rep = memory_per_rank(c)
    per = activation_bytes_per_layer(c)
    out = []
    for rank in rep.per_rank:
        terms = [t for t in rank.explain("activations") if t.kind == "layers"]
        assert [t.stage for t in terms] == list(rank.stages)
        for t in terms:  # the layer term is in_flight × (its stage's layers) × one layer's bytes
            assert t.bytes == 0 if t.in_flight == 0 else t.bytes % (t.in_flight * per) == 0 < t.bytes
        out.append(tuple(t.in_flight for t in terms))
    return out, rep


def test_gpipe_holds_every_microbatch():
    counts, _ = in_flight("GPipe")
    assert counts == [(8,)] * 4


def test_1f1b_holds_p_minus_rank():
    counts, rep = in_flight("1F1B")
    assert counts == [(4,), (3,), (2,), (1,)]
    t = rep.per_rank[0].explain("activations")[0]
    assert t.label == "stage 0: 4 microbatches in flight × 2 layers"
    assert t.formula.startswith("4 × 2 × s·b·(")


def test_interleaved_matches_narayanan_on_rank0():
    # torch: warm-up (v−1)·m_round + 2(p−1−r) forwards, then one more before the first backward
    counts, _ = in_flight("Interleaved1F1B", p=4, m=8, v=2)
    assert sum(counts[0]) == (2 + 1) * 4 - 1  # 11 = p·v·(1 + (p−1)/(p·v)) stage-microbatches
    assert counts[0][0] >= 7  # the first local stage takes the warm-up's first and third rounds
    assert sum(counts[3]) == 4 + 1


def test_interleaved_zero_bubble_holds_until_w():
    counts, _ = in_flight("InterleavedZeroBubble", p=4, m=8, v=2)
    zb1 = [sum(c) for c in counts]
    il = [sum(c) for c in in_flight("Interleaved1F1B", p=4, m=8, v=2)[0]]
    assert all(a >= 1 for a in zb1)
    assert zb1[3] >= il[3]  # the last rank defers W: it holds at least as many


def test_looped_bfs_and_v_schedules():
    assert in_flight("LoopedBFS", v=2)[0] == [(8, 8)] * 4
    # torch's ZB-V order: 2p stage-microbatches alive on every rank (the 1F1B peak), held until W
    zbv = in_flight("ZBVZeroBubble", v=2)[0]
    assert [sum(c) for c in zbv] == [8] * 4 and zbv[0] == (7, 1) and zbv[3] == (4, 4)
    # torch's DualPipeV order: 2p + 1 (DualPipe README: PP + 1 stage-pairs' worth)
    assert in_flight("DualPipeV", v=2)[0] == [(8, 1), (7, 2), (6, 3), (5, 4)]


def test_dualpipev_does_not_double_parameters():
    c = cfg(EVEN, MIXED, pp=2, schedule="DualPipeV", virtual_stages=2, microbatches=4)
    rep = memory_per_rank(c)
    assert sum(r.params for r in rep.per_rank) == 2 * param_counts(c.model).total


def test_every_pipeline_rank_reported_with_its_stages():
    c = cfg(EVEN, MIXED, dp=2, tp=2, pp=2, microbatches=4)
    rep = memory_per_rank(c)
    assert [r.rank for r in rep.per_rank] == list(range(8))
    assert [r.stages for r in rep.per_rank] == [(0,)] * 4 + [(1,)] * 4
    assert [r.pp_rank for r in rep.per_rank] == [0] * 4 + [1] * 4


def test_pipeline_receive_buffers_one_per_microbatch():
    c = cfg(EVEN, MIXED, pp=2, microbatches=4)
    rep = memory_per_rank(c)
    io = 2 * 128 * 1 * 256  # bf16 s·b·h
    assert {t.label: t.bytes for t in rep.per_rank[0].explain("comm_buffers")} == {
        "stage 0: gradient receive buffers": 4 * io}
    assert {t.label: t.bytes for t in rep.per_rank[1].explain("comm_buffers")} == {
        "stage 1: activation receive buffers": 4 * io}


# --------------------------------------------------------------------------- buffers, overhead


def test_ddp_buckets_cover_all_gradients():
    c = cfg(EVEN, MIXED, dp=2)
    r = memory_per_rank(c).per_rank[0]
    assert r.comm_buffers == r.grads


def test_fsdp_unsharded_units_and_buffers():
    c = cfg(EVEN, MIXED, dp=4, zero=3)
    r = memory_per_rank(c).per_rank[0]
    block = param_counts(c.model).per_layer  # 787,456 > embedding 262,144: the two largest are blocks
    largest = second = block
    temps = {t.label: t.bytes for t in r.explain("temporaries")}
    assert temps["unsharded parameters: current unit + prefetched unit"] == 2 * (largest + second)
    no_prefetch = cfg(EVEN, MIXED, conventions={**NO_OVERHEAD, "fsdp_prefetch": False}, dp=4, zero=3)
    r2 = memory_per_rank(no_prefetch).per_rank[0]
    assert r.temporaries - r2.temporaries == 2 * second
    comm = {t.label: t.bytes for t in r.explain("comm_buffers")}
    assert comm["reduce-scatter input (one unit's unsharded gradients)"] == 2 * largest


def test_overhead_lines_are_named_and_switchable():
    on = cfg(EVEN, MIXED, conventions={"allocator_slack_fraction": 0.1}, dp=2, tp=2)
    r = memory_per_rank(on).per_rank[0]
    lines = {t.label: t.bytes for t in r.explain("overhead")}
    assert lines["runtime context (h100-sxm; cluster.gpu.runtime_context_gib)"] == 2**29
    assert lines["collective-library buffers (world, dp, tp)"] == 3 * 64 * 2**20
    live = r.total - r.overhead
    assert lines["allocator slack (reserved, not allocated)"] == int(live * 0.1)
    off = memory_per_rank(cfg(EVEN, MIXED, dp=2, tp=2)).per_rank[0]
    assert off.overhead == 0


# --------------------------------------------------------------------------- report shape


def test_report_json_shape_and_totals():
    rep = memory_per_rank(cfg(EVEN, MIXED, dp=2, pp=2, microbatches=2))
    j = rep.to_json()
    assert set(j) == {"per_rank", "capacity_bytes"}
    assert j["capacity_bytes"] == round(79.6 * 2**30)
    row = j["per_rank"][2]
    assert list(row)[:2] == ["rank", "stage"] and row["rank"] == 2 and row["stage"] == 1
    assert set(MEMORY_CATEGORIES) <= set(row) and row["stages"] == [1] and row["fits"] is True
    for r in rep.per_rank:
        assert r.total == sum(getattr(r, c) for c in MEMORY_CATEGORIES)
        for c in MEMORY_CATEGORIES:
            assert sum(t.bytes for t in r.explain(c)) == getattr(r, c)
    assert "bytes_per_parameter" in rep.conventions


def test_fits_flag_and_unknown_category():
    big = memory_per_rank(cfg({"preset": "llama2-7b"}, MIXED, gpu="rtx4090"))
    assert not big.per_rank[0].fits and not big.fits
    with pytest.raises(KeyError, match="allowed"):
        big.per_rank[0].explain("weights")


def test_invalid_config_never_reaches_the_formulas():
    with pytest.raises(ConfigError) as err:
        cfg(EVEN, MIXED, tp=3)
    assert "parallel.tp" in err.value.fields()


def test_largest_fitting_model_is_on_the_boundary():
    c = cfg({"preset": "llama2-7b"}, MIXED, gpu="a100-80g", dp=8, zero=3)
    spec, n = largest_fitting_model(c)
    assert spec.head_dim == 128 and spec.heads == spec.kv_heads
    assert n == param_counts(spec).total
    assert memory_per_rank(c.replace(model={"hidden": spec.hidden, "heads": spec.heads,
                                            "kv_heads": spec.kv_heads, "ffn_hidden": spec.ffn_hidden,
                                            "layers": spec.layers})).fits
    tiny_gpu = cfg({"preset": "llama2-7b"}, MIXED, gpu="rtx4090", conventions={})
    assert largest_fitting_model(tiny_gpu) is None or largest_fitting_model(tiny_gpu)[1] < 7e9


def test_schedule_replays_match_torch_pipeline_order():
    """The in-flight replays equal what torch's own schedules plan (stand-in stages, no process group)."""
    import types

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from engine.pipeline.layout import stage_to_pp_rank
    from engine.pipeline.schedules import _frontier, in_flight_states

    def stand_ins(p, v, style):
        owner = stage_to_pp_rank(p * v, p, style)
        return [types.SimpleNamespace(stage_index=s, num_stages=p * v, group_size=p, group_rank=0, submod=None,
                                      stage_index_to_group_rank=dict(enumerate(owner)),
                                      is_first=s == 0, is_last=s == p * v - 1)
                for s in range(p * v) if owner[s] == 0]

    cases = [("ScheduleInterleaved1F1B", 4, 2, 8, "loop"), ("ScheduleInterleavedZeroBubble", 3, 2, 9, "loop"),
             ("ScheduleZBVZeroBubble", 4, 2, 5, "v"), ("ScheduleDualPipeV", 3, 2, 7, "v")]
    for name, p, v, m, style in cases:
        sch = getattr(schedules, name)(stand_ins(p, v, style), m)
        owner = stage_to_pp_rank(p * v, p, style)
        for r in range(p):
            local = [s for s in range(p * v) if owner[s] == r]
            held, states = [0] * v, set()
            for a in sch.pipeline_order[r]:
                for x in (getattr(a, "sub_actions", None) or (a,)) if a is not None else ():
                    kind = x.computation_type.name
                    if kind == "FORWARD":
                        held[local.index(x.stage_index)] += 1
                        states.add(tuple(held))
                    elif kind == "BACKWARD_WEIGHT" or (kind == "FULL_BACKWARD"):
                        held[local.index(x.stage_index)] -= 1
            mine = in_flight_states(name.removeprefix("Schedule"), r, p, v, m)
            assert mine == _frontier(states), (name, r)


# --------------------------------------------------------------------------- LoRA under autocast


def _lora_cfg(base="fp32", recompute="none", targets="mlp", **parallel):
    return cfg({"preset": "llama2-7b", "layers": 2, "seq_len": 2048},
               {"precision": "bf16-mixed", "recompute": recompute, "finetune": "lora", "lora_rank": 16,
                "lora_targets": targets, "lora_base_dtype": base},
               conventions={**NO_OVERHEAD, "state_accounting": "pytorch"}, **parallel)


_lora = _lora_cfg


def _acts(c: Config, rank: int = 0) -> int:
    return sum(t.bytes for t in memory_per_rank(c).per_rank[rank].catalogue("activations"))


def test_a_frozen_fp32_base_under_autocast_saves_its_weight_casts_per_microbatch(monkeypatch):
    """Autocast caches no cast of a frozen weight (aten cached_cast: requires_grad and leaf), so every forward casts
    the fp32 base anew and each frozen Linear's matmul saves the cast for its input's gradient. By hand for
    Llama 2 7B's two blocks (h 4096, kv 4096, f 11008, SwiGLU) with MLP adapters: the first block's wq, wk,
    wv, wo, w1, w3 see an input that needs no gradient (nothing before its first adapter does), so of it only
    w2 saves its cast; the second block saves all seven; the head its (V·h) once; 2 B each element.
    measure --fake of this layout: activations 1.508 GiB, the engine's now (0.803 before). (A bf16 base also makes
    the residual stream 16-bit, ``frozen_16bit_stream``: held off here so the two differ by the casts alone; the
    configs carry an alpha of their own so no cached prediction of the real rule is read.)"""
    import engine.memory.activations as activations

    monkeypatch.setattr(activations, "frozen_16bit_stream", lambda cfg: False)

    def _lora(*args, **kw):
        return _lora_cfg(*args, **kw).replace(training={"lora_alpha": 31.0})
    h, kv, f, v = 4096, 4096, 11008, 32000
    block = 2 * (h * h + 2 * h * kv + h * h + 3 * h * f)
    casts = 2 * h * f + block + 2 * v * h
    assert _acts(_lora("fp32")) - _acts(_lora("bf16")) == casts
    # a bf16 base needs no cast (the matmul saves the weight itself); the per-op policy keeps none in the
    # forward (its save list has no cast), and a block's recompute makes them again for its own backward
    assert _acts(_lora("fp32", "selective-op")) - _acts(_lora("bf16", "selective-op")) == block + 2 * v * h
    # with attention adapters the first block's wq, wk, wv alone see an input that needs no gradient
    first = 2 * (h * h + 3 * h * f)
    assert _acts(_lora("fp32", targets="all")) - _acts(_lora("bf16", targets="all")) == first + block + 2 * v * h
