"""What a full backward holds inside its first block: the MLP's backward gradients, the down input it
frees, the blocks' output gradient and a later stage's kept input gradient (engine/memory/activations.py,
``block_backward_terms``), hand-worked from the per-op MemTracker trace of the tiny model."""

from pathlib import Path

import pytest

from engine import Config
from engine.memory import memory_per_rank
from engine.memory.lifetimes import END_FREED_KINDS, LIFETIMES

ROOT = Path(__file__).resolve().parents[3]

# the accuracy matrix's tiny model (benchmarks/accuracy.py): h 128, f 352, s 64
TINY = {"preset": "tiny", "layers": 8, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn_hidden": 352,
        "vocab": 512, "seq_len": 64}


def _cfg(parallel: dict, training: dict | None = None, model: dict | None = None) -> Config:
    gpus = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
    return Config.from_dict({
        "model": {**TINY, **(model or {})},
        "cluster": {"preset": "local-cpu", "gpus": gpus, "gpus_per_node": gpus},
        "parallel": parallel,
        "training": {"micro_batch_size": 2, "precision": "fp32", **(training or {})},
    })


def _terms(r, cat: str) -> dict[str, int]:
    """The rank's terms of ``cat`` by kind, but the optimizer step's (another moment than the backward's,
    tests/backend/test_memory_pytorch.py)."""
    out: dict[str, int] = {}
    for t in r.catalogue(cat):
        if t.kind != "optimizer_step":
            out[t.kind] = out.get(t.kind, 0) + t.bytes
    return out


def test_the_tiny_pipelines_backward_moment_as_measured_op_by_op():
    """dp2 × pp2 1F1B, 4 microbatches, full recompute, fp32 DDP (the accuracy row). Measured on the last
    stage at its peak (w2's backward in the last B's recomputed block): Temp = 491,520 B = the down
    input's gradient (4·64·2·352 = 180,224) + w2's fresh weight gradient (352·128·4 = 180,224, added to
    the one accumulated) + the blocks' output gradient (4·64·2·128 = 65,536) + the input gradient the
    previous backward sent (65,536); on the first stage 360,448 B (no output gradient: its receive
    buffer is comm_buffers; nothing sent). DDP's bucket is no temporary."""
    c = _cfg({"dp": 2, "pp": 2, "microbatches": 4, "schedule": "1F1B"}, {"recompute": "full"})
    ranks = memory_per_rank(c).per_rank
    last = next(r for r in ranks if r.pp_rank == 1)
    first = next(r for r in ranks if r.pp_rank == 0)
    assert _terms(last, "temporaries") == {"mlp_backward": 2 * 180_224, "blocks_output_gradient": 65_536,
                                           "held_input_gradient": 65_536, "loss": 2 * 4 * 64 * 2 * 512}
    assert last.temporaries == 491_520  # the peak: the loss's own moment is not the B's
    # (and the embeddings' output gradient at the end of each of its B's, 4·64·2·128: another moment than the peak)
    assert _terms(first, "temporaries") == {"mlp_backward": 360_448, "embedding_output_gradient": 65_536}
    assert first.temporaries == 360_448
    for r in ranks:
        assert "ddp_backward_temporary" not in _terms(r, "temporaries")
        assert "mlp_backward_freed" not in _terms(r, "activations")  # the two moments tie: the earlier holds


def test_swiglu_frees_the_down_input_where_its_product_backward_is_the_larger_moment():
    """Llama 3 8B shapes (s·b = 16,384 ≫ h = 4,096): the product's backward, 3·s·b·f of gradients with
    the down input (s·b·f) freed, beats w2's (s·b·f and w2's weight gradient f·h). bf16 under FSDP2
    (no fresh-gradient temporary: FSDP2's unit gradients are their own terms)."""
    cfg = Config.load(ROOT / "assets/examples/fake/llama3-8b-fsdp8-full.toml")
    r = memory_per_rank(cfg).per_rank[0]
    s, b, f = cfg.local_seq_len, cfg.training.micro_batch_size, cfg.model.ffn_hidden
    sbf = 2 * s * b * f
    assert _terms(r, "temporaries")["mlp_backward"] == 3 * sbf
    assert _terms(r, "activations")["mlp_backward_freed"] == -sbf


def test_a_gelu_mlp_holds_w2s_backward_moment():
    """Without a gate the activation's backward makes one s·b·f gradient as w2's input gradient dies:
    w2's moment (its input gradient and fresh weight gradient) is the larger; nothing is freed then."""
    c = _cfg({"dp": 2, "microbatches": 2}, model={"mlp": "gelu"})
    r = memory_per_rank(c).per_rank[0]
    assert _terms(r, "temporaries")["mlp_backward"] == 4 * 64 * 2 * 352 + 352 * 128 * 4
    assert "mlp_backward_freed" not in _terms(r, "activations")
    assert _terms(r, "temporaries")["blocks_output_gradient"] == 4 * 64 * 2 * 128


def test_the_terms_live_in_full_backwards_and_the_kept_input_gradient_from_the_first_on():
    assert LIFETIMES["mlp_backward"] == LIFETIMES["mlp_backward_freed"] == "full_backward"
    assert LIFETIMES["blocks_output_gradient"] == "full_backward"
    assert LIFETIMES["held_input_gradient"] == "after_first_backward"
    assert "held_input_gradient" in END_FREED_KINDS


def test_float8_eager_casts_of_w2s_input_are_the_backwards_moment():
    """The accuracy row float8 tensorwise, bf16 ZeRO-3 dp4 (float8 all-gather), traced op by op: the
    tracker peaks in w2's backward while torchao casts w2's saved bf16 input to float8 for the weight
    gradient (``tensor.to(torch.float32) * scale``, then float8): Temp 561,164 B = the down input's
    gradient (2·64·2·352 = 90,112) + the fp32 upcast and scaled copy and the float8 bytes
    ((4 + 4 + 1)·45,056 = 405,504) + the output gradient's two float8 casts (2·64·2·128 = 32,768) +
    the blocks' output gradient (2·64·2·128 = 32,768) + 12 B of scalars. Compiled, inductor fuses the
    casts: the plain moments then."""
    par = {"dp": 4, "zero": 3, "microbatches": 2}
    fl8 = {"precision": "bf16-mixed", "grad_dtype": "bf16", "float8": "tensorwise", "float8_all_gather": True}
    r = memory_per_rank(_cfg(par, fl8)).per_rank[0]
    assert _terms(r, "temporaries")["mlp_backward"] == 90_112 + 405_504 + 32_768
    assert "B of microbatch" in r.peak_moment and "loss" not in r.peak_moment
    assert r.temporaries == 561_152
    compiled = memory_per_rank(_cfg(par, {**fl8, "compile": True})).per_rank[0]
    # w2's moment: the down input's gradient and w2's fresh gradient (FSDP2 accumulates the two microbatches' in
    # bf16 on .grad: added in place), 2·90,112 B, ties SwiGLU's product backward (3·90,112 − the freed down input)
    assert _terms(compiled, "temporaries")["mlp_backward"] == 90_112 + 352 * 128 * 2


def test_float8_casts_w2s_weight_for_its_input_gradient_which_dominates_when_tokens_are_few():
    """torchao 0.18's Float8Linear backward casts its weight along the other axis for the input gradient
    (``hp_tensor_to_float8_dynamic(weight_hp_t, ...)``: the scaled and saturated fp32 copies and the float8 bytes,
    9 B an element) beside the output gradient's float8 cast, before the down input's gradient exists. A fake
    Llama 3 405B step at 2,048 tokens a rank held 9.25 GB of temporaries at its peak: one 16,384 × 53,248
    weight's. By hand, s·b = 16 tokens, h 128, f 2,048, rowwise (no float8 all-gather): 9·f·h + s·b·h."""
    par = {"dp": 4, "zero": 3, "microbatches": 2}
    fl8 = {"precision": "bf16-mixed", "grad_dtype": "bf16", "float8": "rowwise", "micro_batch_size": 1}
    small = {"seq_len": 16, "ffn_hidden": 2048}
    r = memory_per_rank(_cfg(par, fl8, small)).per_rank[0]
    assert _terms(r, "temporaries")["mlp_backward"] == 9 * 2048 * 128 + 16 * 128
    # many tokens: the tokens' casts are the moment again (the tiny model's 2 × 64 tokens: the test above)
    many = memory_per_rank(_cfg(par, fl8, {"seq_len": 1024, "ffn_hidden": 2048})).per_rank[0]
    sbf = 2 * 1024 * 2048
    assert _terms(many, "temporaries")["mlp_backward"] == sbf + (4 + 4 + 1) * 1024 * 2048 + 2 * 1024 * 128


def test_a_split_backward_keeps_each_weight_ops_output_gradient_from_i_to_w():
    """InterleavedZeroBubble pp4 v2, fp32, one block per stage (the accuracy row), traced op by op:
    on the last rank (stages 3 and 7) MemTracker's Temp rose by exactly 1,146,880 B per I of stage 7
    before any W ran: per token 4 B × (wq 128 + wk, wv 2·64 + wo 128 + w1, w3 2·352 + w2 128 + the two
    norms' 2·128) × s·b 128 = 753,664 B, the final norm's and the head's output gradients 4 × 128 ×
    (128 + 512) = 327,680 B, and the stage input's gradient 65,536 B. The first stage runs no I. On stage 5 (the
    same config through ``measure --fake``, real ops on fake tensors, rank 1) an I pending its W holds 753,664 B of
    Temp with the stage input's gradient among them: its last block's w2 output gradient is the received gradient
    (out = h + w2(·)), the receive buffer, no tensor of its own — 688,128 B kept for the W beside the 65,536."""
    c = _cfg({"pp": 4, "schedule": "InterleavedZeroBubble", "virtual_stages": 2, "microbatches": 4})
    ranks = memory_per_rank(c).per_rank
    per_mb, grads = {}, {}
    for r in ranks:
        for t in r.catalogue("temporaries"):
            if t.kind == "split_backward_grads":
                per_mb[t.stage] = t.bytes // t.in_flight
            if t.kind == "input_gradients_kept":  # kept past the W, to the step's end: one per I of the stage
                grads[t.stage] = (t.bytes // t.in_flight, t.in_flight)
    assert per_mb[7] == 753_664 + 327_680
    assert per_mb[5] == per_mb[3] == 753_664 - 65_536
    assert grads == {s: (65_536, 4) for s in range(1, 8)}
    assert 0 not in per_mb
    # in the peak at the count alive then: the last rank peaks at its first W, stage 7's four Is done
    last = ranks[3]
    assert last.peak_moment.startswith("stage 7 W of microbatch 0")
    kept = {(t.kind, t.stage): t.bytes for t in last.explain("temporaries")
            if t.kind in ("split_backward_grads", "input_gradients_kept")}
    # measured: 4 × 1,146,880 B of Temp after stage 7's fourth I (stage 3 has run no I yet)
    assert kept == {("split_backward_grads", 7): 4 * 1_081_344, ("input_gradients_kept", 7): 4 * 65_536}
    assert 4 * 1_081_344 + 4 * 65_536 == 4 * 1_146_880


def test_a_split_backwards_input_gradients_stay_to_the_steps_end():
    """torch's stage_backward_input sets each stage input's .grad (a receive buffer, one per microbatch, kept
    across steps) and nothing clears it before the next step's clear_runtime_states; stage_backward (a full B)
    reads it and sets it back to None (torch/distributed/pipelining/_backward.py). measure --fake of GPT-2 at
    8,192 × 4 tokens, ZBVZeroBubble pp4 m8, bf16 autocast: every I's 96 MiB fp32 input gradient alive at the
    rank's peak in its cooldown (14 of them on pp rank 2; the engine held one: −7.7 %)."""
    c = _cfg({"pp": 4, "schedule": "ZBVZeroBubble", "virtual_stages": 2, "microbatches": 8})
    r = memory_per_rank(c).per_rank[2]
    tl = r._body.timeline
    (t,) = [t for t in r.catalogue("temporaries") if t.kind == "input_gradients_kept" and t.stage == 2]
    idx = r.catalogue("temporaries").index(t)
    assert tl.lifetime("temporaries", idx) == "after_input" and t.in_flight == 8
    # at the end of the backward and the optimizer step every I's is there
    sig = tl.signature
    from engine.memory.lifetimes import END, STEP, sig_moments
    mo = sig_moments(sig)
    for ph in (END, STEP):
        (i,) = [i for i in range(len(mo.phase)) if mo.phase[i] == ph]
        assert mo.ig[i].tolist() == [8, 8]


def test_a_bs_mlp_backward_and_its_cp_attention_are_not_at_once():
    """Context parallelism (cp2) with full recompute: the B laid the MLP's backward gradients and the
    attention's context-parallel workspace together. The block's MLP runs its backward first and frees what
    it and norm2 saved; the attention (its recomputed forward, its backward) comes before or after, without
    them. The term taken off is min(workspace, MLP net + MLP and norm2 saved), by hand for the tiny model at
    s = 64 / 2 = 32, b 2, fp32: the saved rows (MLP input 4·s·b·h, gate, SiLU, up and down 4·s·b·f each,
    norm2's input 4·s·b·h and rstd 4·s·b) and the net MLP gradients 3·4·s·b·f − 4·s·b·f."""
    c = Config.from_dict({"model": TINY, "cluster": {"preset": "local-cpu", "gpus": 2, "gpus_per_node": 2},
                          "parallel": {"cp": 2},
                          "training": {"micro_batch_size": 2, "precision": "fp32", "recompute": "full"}})
    r = memory_per_rank(c).per_rank[0]
    s, b, h, f = 32, 2, 128, 352
    saved = 4 * s * b * h + 4 * 4 * s * b * f + 4 * s * b * h + 4 * s * b
    net = 3 * 4 * s * b * f - 4 * s * b * f
    cp = _terms(r, "temporaries")["cp_attention"]
    off = [t.bytes for t in r.catalogue("temporaries") if t.kind == "mlp_backward_freed"]
    assert off == [-min(cp, net + saved)]
    assert LIFETIMES["mlp_backward_freed"] == "full_backward"  # B moments only
    # without recompute the same order holds: the attention's backward after the MLP's, its saved tensors gone
    plain = memory_per_rank(c.replace(training={"recompute": "none"})).per_rank[0]
    cp = _terms(plain, "temporaries")["cp_attention"]
    assert [t.bytes for t in plain.catalogue("temporaries") if t.kind == "mlp_backward_freed"] == [-min(cp, net + saved)]


def test_under_sequence_parallel_w2s_backward_holds_its_gathered_output_gradient_and_both_float8_casts():
    """RowwiseParallel's output is reduce-scattered over the sequence, so w2's output gradient comes in sharded
    and is all-gathered into a whole s·b·h tensor that lives through w2's backward (a fake Llama 3 70B TP8 SP
    step: 0.5 GiB at 32,768 tokens a rank, beside the down input's gradient). Under float8 the output
    gradient's second cast (for w2's weight gradient) holds its scaled fp32 copy, the clamp's fp32 output and
    its own float8 result (``to_fp8_saturated``), with the first cast's float8 bytes: 10 B an element (the same
    fake: 1.0 + 1.0 + 0.25 + 0.25 GiB). By hand, tp 4 with SP, s·b = 128 tokens, h 128, f/t = 88, rowwise:
    the down input's gradient 4·128·88 = 45,056 B (fp32 here: CPU autocast, torchao's Linears take fp32
    inputs), the casts 10·128·128 = 163,840 B, the gathered gradient 2·128·128 = 32,768 B; without float8
    the down input's gradient (bf16: 22,528 B), the gathered gradient, and w2's bf16 weight gradient beside its
    fp32 cast (autocast on plain gradients: 88·128·2 = 22,528 B)."""
    par = {"tp": 4, "sequence_parallel": True}
    fl8 = {"precision": "bf16-mixed", "grad_dtype": "bf16", "float8": "rowwise"}
    r = memory_per_rank(_cfg(par, fl8)).per_rank[0]
    assert _terms(r, "temporaries")["mlp_backward"] == 45_056 + 163_840 + 32_768
    plain = memory_per_rank(_cfg(par, {"precision": "bf16-mixed", "grad_dtype": "bf16"})).per_rank[0]
    assert _terms(plain, "temporaries")["mlp_backward"] == 22_528 + 32_768 + 22_528
    no_sp = memory_per_rank(_cfg({"tp": 4}, fl8)).per_rank[0]
    assert _terms(no_sp, "temporaries")["mlp_backward"] == 45_056 + 163_840


def test_layer_selective_recompute_comes_after_the_plain_blocks_behind_it_freed_theirs():
    """torchtitan's layer-selective AC checkpoints block k (1-based over the rank's blocks) when k % N == 0. The
    backward recomputes a stage's last checkpointed block when it reaches it, after the plain blocks behind it
    ran their backward and freed their saved tensors (a whole plain block's, more than the recomputed block
    holds less its kept input), so that moment never tops the backward's start. 8 blocks, N = 3: blocks 3 and 6
    are checkpointed, 7 and 8 plain, no recomputed block at the peak; N = 2: block 8 is checkpointed and
    recomputed first, with every saved tensor alive (a CPU run of 3 blocks at N = 2, dp2 tp2 SP ZeRO-2, seed
    20261205 #29 of the sweep: tracked peak +6.0 % with the recompute laid beside the plain block, −2.5 %
    without)."""
    par = {"dp": 2}
    def recomputed(every: int) -> int:
        r = memory_per_rank(_cfg(par, {"recompute": "selective-layer", "recompute_every": every})).per_rank[0]
        return sum(t.bytes for t in r.catalogue("activations") if t.kind == "recomputed_block")
    assert recomputed(3) == 0
    assert recomputed(2) > 0


def test_per_op_selective_recompute_holds_the_replay_of_the_forward_at_its_last_op():
    """Under per-op selective recompute (no early stop) a block's backward replays its whole forward; at its last
    op w2's output (stashed or made anew) is alive beside what its redistribution makes of it. Llama 3 8B s16K
    b16 tp8 SP (measure --fake, pp stage 0 of 4, 1F1B: 2 + 2 GiB at w2 and the reduce-scatter's contiguous
    copy (funcol.reduce_scatter_single, scatter dim 1), 0.25 + 0.25 GiB the reduce-scatter's stashed output and
    the MLP's sequence-sharded input, beside the 2 GiB output gradient all-gathered): more than the MLP's
    backward (the down input's gradient, 0.875 GiB, beside the gathered gradient)."""
    base = {"preset": "llama3-8b", "layers": 8, "seq_len": 16_384}
    par = {"dp": 32, "tp": 8, "pp": 4, "zero": 3, "sequence_parallel": True, "schedule": "1F1B", "microbatches": 4}
    tr = {"micro_batch_size": 16, "precision": "bf16-mixed", "grad_dtype": "bf16", "recompute": "selective-op"}
    c = Config.from_dict({"model": base, "cluster": {"gpu": "h100-96g", "gpus": 1024, "gpus_per_node": 8},
                          "parallel": par, "training": tr})
    r = next(r for r in memory_per_rank(c).per_rank if r.pp_rank == 0)
    sbh = 16_384 * 16 * 4096 * 2
    # the replay's tensors are its forward's (activations, as MemTracker files a recomputation's), the gathered
    # gradient the backward's
    assert _terms(r, "activations")["mlp_backward"] == 2 * sbh + 2 * sbh // 8
    assert _terms(r, "temporaries")["mlp_backward"] == sbh
    # without SP the all-reduce's output stands beside w2's: 2 whole s·b·h tensors (no gathered gradient)
    nosp = c.replace(parallel={"sequence_parallel": False}, training={"micro_batch_size": 4})
    r = next(r for r in memory_per_rank(nosp).per_rank if r.pp_rank == 0)
    assert _terms(r, "activations")["mlp_backward"] == 2 * sbh // 4 and "mlp_backward" not in _terms(r, "temporaries")
    # without TP the MLP's backward (SwiGLU: 3·s·b·f of gradients, the down input freed) is the larger moment
    notp = c.replace(parallel={"tp": 1, "dp": 256, "sequence_parallel": False}, training={"micro_batch_size": 2})
    r = next(r for r in memory_per_rank(notp).per_rank if r.pp_rank == 0)
    assert _terms(r, "temporaries")["mlp_backward"] == 3 * 16_384 * 2 * 14_336 * 2
    # another policy holds no replay: full recompute stops at the last saved tensor (early stop)
    full = c.replace(training={"recompute": "full"})
    r = next(r for r in memory_per_rank(full).per_rank if r.pp_rank == 0)
    # (and w2's fresh gradient, added in place to the one FSDP2 accumulates in bf16 over the 4 microbatches)
    assert _terms(r, "temporaries")["mlp_backward"] == 16_384 * 16 * 14_336 // 8 * 2 + sbh + 14_336 // 8 * 4096 * 2


def _hsdp_405b_pp8_cp4() -> Config:
    """The fake's layout of the two tests below: Llama 3 405B (8 blocks) pp8 cp4 HSDP ZeRO-2 1F1B, bf16 gradients."""
    par = {"dp": 64, "replicate": 2, "pp": 8, "cp": 4, "zero": 2, "schedule": "1F1B", "microbatches": 16}
    tr = {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "bf16", "recompute": "full"}
    return Config.from_dict({"model": {"preset": "llama3-405b", "layers": 8, "seq_len": 4096},
                             "cluster": {"gpu": "h100-96g", "gpus": 2048, "gpus_per_node": 8},
                             "parallel": par, "training": tr})


def test_fsdp2_accumulating_in_the_parameters_dtype_adds_w2s_fresh_gradient_in_place():
    """FSDP2 accumulating across microbatches in the parameters' dtype keeps the sum on the unsharded parameter's
    .grad (FSDPParam.to_accumulated_grad_if_needed moves it only to convert it): autograd's AccumulateGrad adds
    w2's fresh gradient into it, a transient beside the down input's gradient, as for plain gradients. A fake
    Llama 3 405B pp8 cp4 HSDP ZeRO-2 1F1B step (bf16 gradients, stage 2, a later microbatch's B): w2's fresh
    16,384 × 53,248 bf16 gradient (1.625 GiB) beside the down input's. With fp32 gradients FSDP2 converts each
    fresh one at the post-backward instead (no in-place add: no such term)."""
    c = _hsdp_405b_pp8_cp4()
    r = next(r for r in memory_per_rank(c).per_rank if r.pp_rank == 2)
    fresh = [t.bytes for t in r.catalogue("temporaries") if t.kind == "mlp_backward" and "fresh" in t.label]
    assert fresh == [53_248 * 16_384 * 2]
    fp32 = c.replace(training={"grad_dtype": "fp32"})
    r = next(r for r in memory_per_rank(fp32).per_rank if r.pp_rank == 2)
    assert not [t for t in r.catalogue("temporaries") if t.kind == "mlp_backward" and "fresh" in t.label]


def test_the_heads_backward_after_the_loss_adds_its_fresh_gradient_to_the_accumulated_one():
    """A later microbatch's head backward, right after the loss's: the loss's temporaries and the log-probabilities
    freed, the logits' gradient beside the head weight's fresh gradient, added into the one FSDP2 accumulates in
    bf16. A fake Llama 3 405B pp8 cp4 HSDP ZeRO-2 1F1B step (last stage, 1,024 tokens × 2 a microbatch): 3.91 GiB
    fresh head gradient beside the 0.49 GiB bf16 logits' gradient — over the loss's 2 × 0.98 GiB fp32 tensors and
    the 0.98 GiB log-probabilities by 1.47 GiB. With fp32 gradients FSDP2 converts at the post-backward instead."""
    c = _hsdp_405b_pp8_cp4()
    r = next(r for r in memory_per_rank(c).per_rank if r.pp_rank == 7)
    sv, vh = 1024 * 2 * 128_256, 128_256 * 16_384
    assert _terms(r, "temporaries")["head_backward"] == 2 * sv + 2 * vh - 4 * sv - 2 * 4 * sv
    assert r.peak_moment.endswith("at its start: the loss (action 4 of 32)")
    fp32 = c.replace(training={"grad_dtype": "fp32"})
    r = next(r for r in memory_per_rank(fp32).per_rank if r.pp_rank == 7)
    assert "head_backward" not in _terms(r, "temporaries")
    # a split backward's I, which opens the last stage's backward after the loss, makes no weight gradient (its W does)
    zbv = c.replace(parallel={"schedule": "ZBVZeroBubble", "virtual_stages": 2, "pp": 4, "dp": 128})
    r = next(r for r in memory_per_rank(zbv).per_rank if r.pp_rank == 0)  # the V's last stage is on pp rank 0
    assert "head_backward" not in _terms(r, "temporaries")


def test_the_events_lay_what_an_i_keeps_for_its_w_tensor_by_tensor():
    """The allocation events lay what an I keeps for its W as torch keeps it, each weight op's output gradient a tensor
    of its own (laid as one piece it carved a large cached block at every I, and the next moment's transients grew
    a segment each: measure --fake of GPT-2 s32K pp4 cp2 ZBV fp32, 192 and 768 MiB tensors where the events laid
    1,920 MiB; thirteen cached seeds' reserve within 5 % 644 -> 664 of 1,109 ranks). The tiny InterleavedZeroBubble
    pp4 v2 fp32 on a GPU kind (CPU ranks replay nothing), stage 5's I of microbatch 0 (rank 1): the norms', Q, K, V,
    output, gate and up projections' output gradients, 4 B × 128 tokens × (128, 128, 64, 64, 128, 128, 352, 352) —
    not w2's, the received gradient."""
    c = Config.from_dict({"model": TINY, "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
                          "parallel": {"pp": 4, "schedule": "InterleavedZeroBubble", "virtual_stages": 2,
                                       "microbatches": 4},
                          "training": {"micro_batch_size": 2, "precision": "fp32"}})
    r = memory_per_rank(c).per_rank[1]
    ev = r._body.timeline.events()
    kept = [e[2] for e in ev if e[0] == "alloc" and e[1][:3] == ("iw", 5, 0)]
    assert kept == [4 * 128 * w for w in (128, 128, 64, 64, 128, 128, 352, 352)]
    assert sum(kept) == 753_664 - 65_536
    # each freed by the W of that microbatch
    at = {(e[0], e[1]): k for k, e in enumerate(ev)}
    assert all(("free", e[1]) in at for e in ev if e[0] == "alloc" and e[1][:3] == ("iw", 5, 0))


def test_a_two_block_walk_prefetches_nothing_in_its_second_block_and_has_no_later_layer():
    """Unpipelined ZeRO-3: the walk's second block is its last where the rank has two blocks (the root stays gathered),
    so its backward holds no prefetched all-gather output beside the last block's reduce-scatter input, and there is
    no layer 2 whose input a late moment keeps. A real CPU run (tiny sweep seed 20261220 #06: hidden 256, 8 heads over
    4, FFN 680, V 300, 64 tokens × 2, dp4 ZeRO-3 full recompute fp32, qk_norm) measured 13,302,052 B at its tracked
    peak, the one block's unit, the root, the last block's reduce-scatter input and the recomputed block; the engine
    laid a prefetched output there too and read +15.4 %. With three blocks the second block's backward prefetches
    the first's."""
    model = {"preset": "tiny", "layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 680, "vocab": 300,
             "seq_len": 64, "tied_embeddings": False, "mlp": "gelu", "qk_norm": True}
    c = Config.from_dict({"model": model, "cluster": {"preset": "local-cpu", "gpus": 4},
                          "parallel": {"dp": 4, "zero": 3},
                          "training": {"micro_batch_size": 2, "precision": "fp32", "recompute": "full"}})
    r = memory_per_rank(c).per_rank[0]
    tracked = sum(getattr(r, k) for k in ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries"))
    assert tracked == pytest.approx(13_302_052, rel=0.02)
    kinds = {t.kind for t in r.catalogue("comm_buffers") if t.bytes < 0}
    assert "fsdp_early_reduce" in kinds and not [t for t in r.catalogue("comm_buffers") if t.kind == "fsdp_late_reduce"]
    three = memory_per_rank(c.replace(model={"layers": 3})).per_rank[0]
    assert not [t for t in three.catalogue("comm_buffers") if t.kind == "fsdp_early_reduce" and t.bytes < 0]


def test_layer_selective_recompute_of_a_moe_block_comes_after_the_moe_blocks_behind_it():
    """The same order with MoE blocks (a stage's MoE blocks are its last: the model's dense blocks lead). 3 MoE
    blocks, N = 2: block 2 is checkpointed and recomputed after block 3's backward freed a MoE block's saved
    tensors, more than the recompute holds less its kept input — no recomputed block at the peak (a CPU run,
    ``benchmarks/accuracy.py --sweep 30 --seed 20261229`` #01, dp2 ZeRO-3: tracked peak +14.6 → +0.9 % without it;
    seed 20261224 #12, not looked at before: +6.4 → +1.4 %). N = 3: block 3 is recomputed first, beside every saved
    tensor: a MoE block's saved bytes less its kept input. Dense leading blocks: with one, N = 2 checkpoints it
    (block 2 of 3 is then MoE); the trailing block is MoE either way."""
    moe = {"layers": 3, "experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 40}

    def recomputed(every: int, **model) -> int:
        cfg = _cfg({"dp": 2, "zero": 3}, {"recompute": "selective-layer", "recompute_every": every}, {**moe, **model})
        r = memory_per_rank(cfg).per_rank[0]
        return sum(t.bytes for t in r.catalogue("activations") if t.kind == "recomputed_block")

    assert recomputed(2) == 0
    every_block = memory_per_rank(_cfg({"dp": 2, "zero": 3}, {"recompute": "none"}, moe)).per_rank[0]
    per_moe = sum(t.bytes for t in every_block.catalogue("activations") if t.kind == "moe_layers") // 3
    kept = memory_per_rank(_cfg({"dp": 2, "zero": 3}, {"recompute": "full"}, moe)).per_rank[0]
    kept_input = sum(t.bytes for t in kept.catalogue("activations") if t.kind in ("layers", "moe_layers")) // 3
    assert per_moe > kept_input > 0
    assert recomputed(3) == per_moe - kept_input
    assert recomputed(2, dense_layers=1) == 0
