"""torchtitan's activation-memory knobs: per-op selective AC, layer-selective AC, torch.compile, float8.

Hand-worked numbers from the policies' rules (torchtitan's SelectiveAC counter, its layer counter),
a property that they lie between full and no recompute, and the recompute FLOPs HFU counts.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Config
from engine.memory import activation_bytes_per_layer, memory_per_rank
from engine.memory.conventions import conventions_of
from engine.memory.lifetimes import LIFETIMES
from engine.model.recompute import (
    BLOCK_MATMUL_ORDER,
    checkpointed_blocks,
    checkpointed_per_stage,
    sac_saved_matmuls,
    sac_saved_moe,
)
from engine.names import SPLIT_BACKWARD_SCHEDULES
from engine.time.durations import (
    per_op_recompute_flops_per_token,
    recompute_flops_per_token,
    stage_durations,
)
from engine.time.step import step_time
from tests.engine.memory.test_memory_properties import build, raw_configs, with_

# s·b = 64 tokens; h = 64, 4 heads of 16, kv_heads 2 (kv = 32), f = 176
TINY = {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 128, "seq_len": 32,
        "mlp": "swiglu", "norm": "rmsnorm", "attention": "flash", "position": "rope", "dropout": 0.0, "bias": False}
PAPER = {"runtime_context": False, "collective_buffers": False, "state_accounting": "zero-paper"}
S, B, H, A, KV, F = 32, 2, 64, 4, 32, 176


def cfg(model=None, training=None, conventions=PAPER, gpu="h100-sxm", **parallel) -> Config:
    par = {"dp": 1, "tp": 1, "pp": 1, **parallel}
    return Config.from_dict({
        "model": {**TINY, **(model or {})},
        "cluster": {"gpu": gpu, "gpus": par["dp"] * par["tp"] * par["pp"]},
        "parallel": par,
        "training": {"micro_batch_size": B, "precision": "bf16-mixed", **(training or {})},
        "conventions": conventions,
    })


# --------------------------------------------------------------------------- the per-op policy's counter


def test_counter_saves_the_odd_matmuls_of_the_backend_order():
    # backend/model.py: q, k, v, o, then w2(silu(w1 x) * w3 x): w1, w3, w2
    assert BLOCK_MATMUL_ORDER[True] == ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
    assert sac_saved_matmuls(True, False) == {"wq", "wv", "w1", "w2"}  # 1st, 3rd, 5th, 7th mm
    assert sac_saved_matmuls(False, False) == {"wq", "wv", "w1"}  # GeLU: w2 is the 6th
    # a bias makes every Linear an aten.addmm: in the save list, not counted by the mm counter
    assert sac_saved_matmuls(True, True) == set(BLOCK_MATMUL_ORDER[True])
    # peft's LoRA Linear: base, lora_A, lora_B, each an mm of the counter
    # wq 1, wq.A 2, wq.B 3, wk 4, wv 5, wv.A 6, wv.B 7, wo 8, w1 9, w3 10, w2 11
    assert sac_saved_matmuls(True, False, ("wq", "wv")) == {"wq", "wq.B", "wv", "wv.B", "w1", "w2"}


def test_counter_runs_on_through_a_moe_blocks_router_and_experts():
    # q, k, v, o are mms 1–4; the router 5 (saved); expert 0: w1 6, w3 7 (saved), w2 8; expert 1: w1 9
    # (saved), w3 10, w2 11 (saved); expert 2 as expert 0 ...; the shared experts after the last
    router, experts, shared = sac_saved_moe(True, False, False, 3, True)
    assert router and experts == ({"w3"}, {"w1", "w2"}, {"w3"})
    assert shared == {"w1", "w2"}  # mms 15, 16, 17
    # GeLU: two mms an expert, the router 5th: every expert's w1 even (recomputed), w2 odd (saved)
    assert sac_saved_moe(False, False, False, 4, False) == (True, ({"w2"},) * 4, frozenset())
    # the router's bias makes it an addmm: saved, not counted; expert 0's w1 is then the 5th mm
    assert sac_saved_moe(True, False, True, 2, False) == (True, ({"w1", "w2"}, {"w3"}), frozenset())
    # LoRA on q and v: two mms more an adapted Linear, eight before the router (the 9th: saved), and
    # expert 0's w1 the 10th
    assert sac_saved_moe(True, False, False, 1, False, ("wq", "wv")) == (True, ({"w3"},), frozenset())


def test_selective_op_one_block_saved_bytes_by_the_policy():
    """Kept: the block input, wq out, wv out, SDPA out and lse, w1 out, w2 out (16-bit but lse fp32)."""
    got = activation_bytes_per_layer(cfg(training={"recompute": "selective-op"}))
    assert got == S * B * (2 * H + 2 * H + 2 * KV + 2 * H + 4 * A + 2 * F + 2 * H) == 60_416
    # no recompute keeps 12h + 4kv + 4a + 8f per token; selective recomputes only lse
    assert activation_bytes_per_layer(cfg()) == S * B * (12 * H + 4 * KV + 4 * A + 8 * F)


def test_selective_op_under_sequence_parallel_keeps_both_reduce_scatters():
    got = activation_bytes_per_layer(cfg(training={"recompute": "selective-op"}, tp=2, sequence_parallel=True))
    t = 2
    kept = (2 * H / t  # block input, sequence-sharded
            + 2 * H / t + 2 * KV / t  # wq, wv outputs (column-parallel)
            + 2 * H / t + 4 * A / t  # SDPA output, lse
            + 2 * H / t  # o-proj reduce-scatter output (its mm, the 4th, is recomputed)
            + 2 * F / t  # w1 output
            + 2 * H  # w2's local output: the full partial sum before its reduce-scatter
            + 2 * H / t)  # MLP reduce-scatter output
    assert got == S * B * kept


def test_selective_op_eager_attention_keeps_both_bmms():
    got = activation_bytes_per_layer(cfg({"attention": "eager"}, {"recompute": "selective-op"}))
    assert got == S * B * (2 * H + 2 * H + 2 * KV + 2 * A * S + 2 * H + 2 * F + 2 * H)


def test_selective_op_recomputed_block_is_activations():
    c = cfg(training={"recompute": "selective-op"})
    r = memory_per_rank(c).per_rank[0]
    assert not any(t.kind == "recomputed_block" for t in r.catalogue("temporaries"))
    redo = [t for t in r.catalogue("activations") if t.kind == "recomputed_block"]
    # during its backward the block holds what "none" keeps instead of its stash (the replay hands each
    # stashed output to its op once; the ones a backward node saves are the same tensors, not copies)
    none = S * B * (12 * H + 4 * KV + 4 * A + 8 * F)
    stash = S * B * (2 * H + 2 * H + 2 * KV + 2 * H + 4 * A + 2 * F + 2 * H)  # input, wq, wv, SDPA out + lse, w1, w2
    assert [t.bytes for t in redo] == [none - stash] == [none - activation_bytes_per_layer(c)]
    assert "selective-op" in conventions_of(c)["recompute"]


def test_selective_op_recompute_flops_are_the_unsaved_matmuls():
    c = cfg(training={"recompute": "selective-op"})
    assert per_op_recompute_flops_per_token(c) == 2 * H * KV + 2 * H * H + 2 * H * F  # wk, wo, w3
    assert recompute_flops_per_token(c) == per_op_recompute_flops_per_token(c)
    none, sel = step_time(cfg()), step_time(c)
    tokens = c.tokens_per_step
    assert sel.model_flops == none.model_flops  # MFU does not count recompute
    assert sel.hardware_flops - sel.model_flops == tokens * 1 * (2 * H * KV + 2 * H * H + 2 * H * F)
    d_none, d_sel = stage_durations(cfg()), stage_durations(c)
    assert d_sel.forward_s[0] == d_none.forward_s[0] and d_sel.backward_weight_s[0] == d_none.backward_weight_s[0]
    assert d_sel.backward_input_s[0] > d_none.backward_input_s[0]


# --------------------------------------------------------------------------- layer-selective


def test_layer_counter_is_per_rank_and_one_based():
    # torchtitan's _layer_sac_count: incremented per block, checkpoint when count % N == 0
    assert checkpointed_per_stage([8], 2) == [4]
    assert checkpointed_per_stage([5, 4], 2) == [2, 2]  # counted across the rank's stages: 2,4 | 6,8
    assert checkpointed_per_stage([2, 2], 3) == [0, 1]
    assert checkpointed_per_stage([1], 2) == [0]


def test_selective_layer_on_8_layers_every_2nd_over_2_stages():
    c = cfg({"layers": 8}, {"recompute": "selective-layer", "recompute_every": 2}, pp=2, schedule="1F1B",
            microbatches=2)
    assert checkpointed_blocks(c) == [2, 2]  # each rank counts its own 4 blocks: its 2nd and 4th
    plain = activation_bytes_per_layer(cfg())
    kept = 2 * S * B * H  # a checkpointed block keeps its 16-bit input
    rep = memory_per_rank(c)
    for pp_rank, in_flight in ((0, 2), (1, 1)):  # 1F1B: min(m, pp − r)
        r = next(x for x in rep.per_rank if x.pp_rank == pp_rank)
        layers = sum(t.bytes for t in r.explain("activations") if t.kind == "layers")
        assert layers == in_flight * (2 * kept + 2 * plain)
        # the checkpointed block its backward recomputes, less its input: kept by the checkpoint, and the
        # same tensor norm1's replay saves
        assert [t.bytes for t in r.explain("activations") if t.kind == "recomputed_block"] == [plain - kept]
    # HFU: 4 of 8 blocks recompute their forward
    fl_block = stage_durations(c)  # durations: each stage adds 2 blocks' forward to I
    full, none = stage_durations(cfg({"layers": 8}, {"recompute": "full"}, pp=2, schedule="1F1B", microbatches=2)), \
        stage_durations(cfg({"layers": 8}, pp=2, schedule="1F1B", microbatches=2))
    extra, extra_full = fl_block.backward_input_s - none.backward_input_s, full.backward_input_s - none.backward_input_s
    assert abs(extra[0] - extra_full[0] / 2) < 1e-15 and abs(extra[1] - extra_full[1] / 2) < 1e-15
    st = step_time(c)
    assert abs((st.hardware_flops - st.model_flops) / (step_time(cfg({"layers": 8}, {"recompute": "full"}, pp=2,
               schedule="1F1B", microbatches=2)).hardware_flops - st.model_flops) - 0.5) < 1e-12


def test_selective_layer_uneven_and_virtual_stages():
    # 9 layers over 2 stages: 5 | 4 — rank 0 checkpoints its 2nd and 4th, rank 1 its 2nd and 4th
    c = cfg({"layers": 9}, {"recompute": "selective-layer"}, pp=2, schedule="1F1B", microbatches=2)
    assert checkpointed_blocks(c) == [2, 2]
    # Interleaved, 8 layers, pp 2 × v 2: rank 0 holds stages 0 and 2 (2 blocks each): its 2nd and 4th block
    c = cfg({"layers": 8}, {"recompute": "selective-layer", "recompute_every": 3}, pp=2,
            schedule="Interleaved1F1B", virtual_stages=2, microbatches=4)
    assert checkpointed_blocks(c) == [0, 0, 1, 1]


# --------------------------------------------------------------------------- between full and none


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw_configs(), st.sampled_from(["selective-op", "selective-layer"]), st.integers(1, 4))
def test_new_kinds_lie_between_full_and_none(raw, kind, every):
    # without sequence parallel: under SP the per-op policy keeps the row-parallel mm's full partial sum
    # (s·b·h) beside its reduce-scatter, which can exceed what no recompute keeps at tiny f
    raw = with_(raw, "parallel", sequence_parallel=False)
    # and not under a split backward: its weight pass can make a recomputing rank peak at a W and one that
    # keeps everything at its optimizer step, so their snapshots are not at comparable moments
    if raw["parallel"].get("schedule") in SPLIT_BACKWARD_SCHEDULES and raw["parallel"].get("pp", 1) > 1:
        return
    # what the blocks keep between their forward and backward: the activations at the peak without what a
    # recomputing backward rebuilds (transient: one block in a B or I; a split backward's weight pass, once per
    # parameter group, which can exceed what no recompute keeps)
    rebuilt = {"recomputed_block", "weight_pass",
               # (and the per-op replay's own tensors at its last op, activations since 203b988: MemTracker files
               # what a recompute makes as ACT; the only activations of kind "mlp_backward")
               "mlp_backward",
               # and the saved tensors an unpipelined ZeRO-2/3 B has freed by its early-backward moment (its first
               # block reduced): a B moment's, which selective-layer at every = 1 (all blocks checkpointed) peaks
               # at where full peaks at its forward
               "fsdp_early_reduce"}
    # nor a forward's own transients (its last down projection at its collective, float8's casts, the ring attention's
    # forward workspace): a rank that peaks at an F holds them, not kept (hypothesis, 2026-12-07: a 1-block fp32 ZeRO-2
    # step under full recompute peaks at its F with the down projection's 1,024 B beside 1,088 kept)
    rebuilt |= {k for k, life in LIFETIMES.items() if life == "forwards"}
    acts, after = {}, {}
    for rc in ("none", "full", kind):
        rep = memory_per_rank(build(with_(raw, "training", recompute=rc, recompute_every=every)))
        acts[rc] = [r.activations - sum(t.bytes for t in r.explain("activations") if t.kind in rebuilt)
                    for r in rep.per_rank]
        # a rank can peak after its backward (its states and buckets), where its snapshot holds no activation at
        # all: nothing to compare there (tiny fp32 dp2 tp2, m 1, found by this test; and a kind whose in-backward
        # moments stay below its end while full recompute's recomputed block lifts one above it: 5 tiny blocks,
        # ffn 4, selective-layer every 2, found by this test, 2026-12-07)
        after[rc] = [r.peak_moment.startswith(("the end of the backward", "the optimizer step")) for r in rep.per_rank]
    for lo, mid, hi, done, kind_done in zip(acts["full"], acts[kind], acts["none"], after["none"], after[kind]):
        assert kind_done or lo <= mid
        assert done or mid <= hi


# --------------------------------------------------------------------------- torch.compile


def test_compile_matches_inductor_on_one_block():
    """Measured on CPU (torch 2.x inductor, backend TransformerBlock, fp32, b=3, s=24, h=64, 4 heads,
    f=176, SwiGLU, RMSNorm, rope, SDPA; saved tensors by saved_tensors_hooks, unique storages, no
    parameters): eager 391,872 B, compiled 301,248 B — the difference is the two composite-RMSNorm
    x̂ (2 × 18,432), rope's four cos/sin tables (4 × 768) and the SiLU output (50,688) = 90,624 B.
    A GeLU / LayerNorm / learned-position block saved 251,136 B both ways (no change)."""
    def one(compile_, **model):
        return activation_bytes_per_layer(Config.from_dict({
            "model": {**TINY, "kv_heads": 4, "seq_len": 24, **model}, "cluster": {"gpu": "cpu", "gpus": 1},
            "training": {"micro_batch_size": 3, "precision": "fp32", "compile": compile_}}))
    assert one(False) - one(True) == 90_624
    assert one(False, mlp="gelu", norm="layernorm", position="learned") == \
        one(True, mlp="gelu", norm="layernorm", position="learned")
    c = cfg(training={"compile": True})
    assert "min-cut" in conventions_of(c)["compile"]


# --------------------------------------------------------------------------- float8


def test_float8_keeps_high_precision_activations_and_no_block_weight_casts():
    base = {"model": {**TINY, "layers": 2}, "cluster": {"gpu": "h100-sxm", "gpus": 2}, "parallel": {"dp": 2},
            "training": {"micro_batch_size": B, "precision": "bf16-mixed"}}
    bf16 = Config.from_dict(base)
    fp8 = Config.from_dict({**base, "training": {**base["training"], "float8": "tensorwise"}})
    assert activation_bytes_per_layer(fp8) == activation_bytes_per_layer(bf16)

    def casts(c):
        return [t.bytes for t in memory_per_rank(c).per_rank[0].catalogue("activations")
                if t.kind == "autocast_weight_casts"]
    head = 2 * TINY["vocab"] * TINY["hidden"]
    assert casts(fp8) == [head]  # the head's cast only: Float8Linear passes its fp32 weight uncast
    assert casts(bf16)[0] > head
    assert "high-precision" in conventions_of(fp8)["float8"]


# --------------------------------------------------------------------------- plain blocks beside the checkpointed


def test_the_plain_blocks_around_a_stages_checkpointed_ones():
    """torchtitan's counter over the rank's stages in order (block k checkpointed where k % every == 0): the plain
    blocks before a stage's first and last checkpointed block, and after its last (worked by hand)."""
    from types import SimpleNamespace as NS

    from engine.memory.activations import _plain_after_checkpoint_of_stages, _plain_before_checkpoints_of_stages

    def stages(*layers):
        return NS(stages=[NS(stage=i, layers=n) for i, n in layers])

    every2 = NS(training=NS(recompute="selective-layer", recompute_every=2))
    rp = stages((0, 2), (3, 2))  # a ZBV rank 0: blocks 1, 2 | 3, 4 -> 2 and 4 checkpointed
    assert _plain_before_checkpoints_of_stages(every2, rp, {0: 1, 3: 1}) == {0: (1, 1), 3: (1, 1)}
    assert _plain_after_checkpoint_of_stages(every2, rp, {0: 1, 3: 1}) == {0: 0, 3: 0}
    every4 = NS(training=NS(recompute="selective-layer", recompute_every=4))
    rp = stages((1, 3), (2, 2))  # blocks 1-3 | 4, 5 -> 4 checkpointed, 5 plain after it
    assert _plain_before_checkpoints_of_stages(every4, rp, {1: 0, 2: 1}) == {2: (0, 0)}
    assert _plain_after_checkpoint_of_stages(every4, rp, {1: 0, 2: 1}) == {2: 1}
    rp = stages((0, 5), (3, 6))  # blocks 1-5 | 6-11 -> 4 | 8 checkpointed
    assert _plain_before_checkpoints_of_stages(every4, rp, {0: 1, 3: 1}) == {0: (3, 3), 3: (2, 2)}
    assert _plain_after_checkpoint_of_stages(every4, rp, {0: 1, 3: 1}) == {0: 1, 3: 3}
    full = NS(training=NS(recompute="full", recompute_every=1))
    assert _plain_before_checkpoints_of_stages(full, rp, {0: 5, 3: 6}) == {0: (0, 0), 3: (0, 0)}


def test_a_weight_pass_drops_the_plain_blocks_run_before_it():
    """The groups of the plain blocks before the checkpointed one come first in the parameter order: by the pass's
    peak their kept gradients are dropped (``freed``) and what their weights' nodes saved is gone."""
    from engine.memory.activations import shape_of, split_backward_group_grads, weight_pass_block, weight_pass_bytes

    cfg = build({"model": {"preset": "llama3-8b", "layers": 4, "seq_len": 1024},
                 "cluster": {"gpu": "h100-sxm", "gpus": 2},
                 "parallel": {"pp": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 2},
                 "training": {"precision": "fp32", "recompute": "selective-layer", "recompute_every": 2}})
    sh = shape_of(cfg)
    keeps = split_backward_group_grads(cfg, sh.act, sh.act, sh.s * sh.b * sh.h)
    saved = sum(n for _, n in weight_pass_block(sh, sh.act)[1])
    alone, _, freed0 = weight_pass_bytes(sh, sh.act, 1, None, keeps)
    after, _, freed1 = weight_pass_bytes(sh, sh.act, 1, None, keeps, plain_before=(1, 1), plain_saved=saved)
    assert freed1 - freed0 == sum(keeps.values())
    assert after - alone == -saved  # (the pass's peak is the same group's, its gradients' drop inside its bytes)
