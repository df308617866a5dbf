"""Memory per rank of a mixture of experts: experts per EP rank, their FSDP shards over efsdp, the
routed tokens' activations under the load convention, the all-to-all buffers. Hand-worked numbers
on a small MoE (the tiny preset with 4 experts of top-2)."""

from __future__ import annotations

import pytest

from engine import Config
from engine.memory import memory_per_rank
from engine.model.params import param_counts, params_per_rank, sharded_numel, unit_numel
from engine.wrapping import wrapping_plan

TINY_MOE = {"preset": "tiny", "experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 96, "dense_layers": 2}


def cfg(parallel=None, model=None, conventions=None, gpus=4, training=None) -> Config:
    raw = {"model": {**TINY_MOE, **(model or {})}, "cluster": {"gpu": "cpu", "gpus": gpus},
           "parallel": parallel or {}, "training": training or {}}
    if conventions:
        raw["conventions"] = conventions
    return Config.from_dict(raw)


def terms(c: Config, category: str, kind: str):
    """Rank 0's terms of ``kind`` (every term, not only those alive at the peak: on these tiny layouts the
    peak is AdamW's step, after every activation is freed)."""
    return [t for t in memory_per_rank(c).per_rank[0].catalogue(category) if t.kind == kind]


def test_experts_per_ep_rank_by_hand():
    c = cfg({"ep": 2, "dp": 4})
    (row,) = params_per_rank(c)
    rp = row[0]
    per_expert = 3 * 128 * 96
    assert rp.experts == 6 * 2 * per_expert  # 6 MoE blocks × E/ep = 2 experts
    assert rp.expert_units == ((((2, 96 * 128), (2, 96 * 128), (2, 128 * 96)), 6),)
    # every element of the model is on some rank: dense parts everywhere, experts split over ep
    assert rp.total - rp.experts + rp.experts * 2 == param_counts(c.model).total
    assert sum(sum(a * b for a, b in u) * n for u, n in rp.unit_groups) == rp.total


def test_without_ep_tp_splits_the_experts():
    c = cfg({"tp": 2, "dp": 2})
    row = params_per_rank(c)[0]
    assert [rp.experts for rp in row] == [6 * 4 * 3 * 128 * 48] * 2
    replicated = 8 * 2 * 128 + 6 * 4 * 128 + 128  # norms of 8 blocks, 6 routers, the final norm: on both TP ranks
    assert sum(rp.total for rp in row) - replicated == param_counts(c.model).total


def test_fsdp_shards_experts_over_efsdp_and_the_rest_over_dp_shard():
    c = cfg({"ep": 2, "dp": 4, "zero": 3})
    assert c.parallel.expert_shard_degree == 2
    rp = params_per_rank(c)[0][0]
    dense_units = [(u, n) for u, n in rp.unit_groups if u not in {e for e, _ in rp.expert_units}]
    expected = sum(sharded_numel(u, 4) * n for u, n in dense_units) + 6 * sharded_numel(rp.expert_units[0][0], 2)
    (param_term,) = terms(c, "params", "parameters")
    (expert_term,) = terms(c, "params", "expert_parameters")  # the experts as their own part
    assert param_term.bytes + expert_term.bytes == 4 * expected
    assert expert_term.bytes == 4 * 6 * sharded_numel(rp.expert_units[0][0], 2)
    assert "efsdp = 2" in param_term.formula


def test_routed_activations_scale_with_the_imbalance_convention():
    base = cfg({"ep": 2, "dp": 4})
    skewed = cfg({"ep": 2, "dp": 4}, conventions={"moe_imbalance": 1.5})
    n = 64  # s·b tokens, tp 1
    routed = n * 2  # n·k balanced
    act = 2  # bf16-mixed by default
    # dispatched token (w1's and, under autocast, w3's own casts) + SwiGLU internals + (EP) its permutation
    # index and expert output kept by index_copy
    per_copy = 2 * act * 128 + 4 * act * 96 + 8 + act * 128
    (a,) = terms(base, "activations", "moe_layers")
    (b,) = terms(skewed, "activations", "moe_layers")
    assert b.bytes - a.bytes == 6 * (int(routed * 1.5) - routed) * per_copy  # 6 MoE blocks, 1 microbatch
    capped = cfg({"ep": 2, "dp": 4}, conventions={"moe_imbalance": 1.5, "moe_capacity_factor": 1.25})
    (c,) = terms(capped, "activations", "moe_layers")
    assert c.bytes - a.bytes == 6 * (int(routed * 1.25) - routed) * per_copy


def test_moe_block_rows_by_hand():
    c = cfg({"ep": 2, "dp": 4})
    (dense,) = terms(c, "activations", "layers")
    (moe,) = terms(c, "activations", "moe_layers")
    assert "2 dense layers" in dense.label and "6 MoE layers" in moe.label
    act, n, h, e, k, f = 2, 64, 128, 4, 2, 96
    n_r = n * k  # balanced
    # bf16-mixed: autocast; the router runs in fp32 on an fp32 copy of its input, each expert Linear casts
    # its input itself (w1 and w3), and the local experts' weights (slices, not leaves) are cast per forward
    moe_rows = (4 * n * h + 4 * n * e + 12 * n * k + 4 * n  # router input, probabilities, top-k, weights' sum
                + 20 * n * k  # token index, sort order (int64), gathered gate weights (fp32)
                + 2 * act * n_r * h + 4 * act * n_r * f  # dispatched tokens (w1's and w3's casts), SwiGLU internals
                + act * (e // 2) * 3 * f * h  # the 2 local experts' w1, w2, w3 casts
                + (8 + act * h) * n_r  # EP: permutation index, expert outputs kept by index_copy
                + 4 * n * k * h + 4 * n * k * h)  # combine: fp32 outputs, weighted outputs in the (fp32) input's dtype
    # the dense FFN's MLP input (w1's cast of the norm output), w3's own cast of it and its SwiGLU internals: the experts'
    # rows hold their own (measure --fake of Mixtral tp8 ep2 pp8 under autocast: no third norm-output cast per block)
    mlp_rows_dense = act * n * h + act * n * h + 4 * act * n * 352
    per_dense = dense.bytes // 2
    assert moe.bytes // 6 == per_dense - mlp_rows_dense + moe_rows


def test_all_to_all_buffers_only_under_ep():
    with_ep = terms(cfg({"ep": 2, "dp": 4}), "comm_buffers", "moe_all_to_all")
    assert [t.bytes for t in with_ep] == [2 * 64 * 2 * 128, 2 * 128 * 128]
    assert not terms(cfg({"dp": 4}), "comm_buffers", "moe_all_to_all")


def test_mixtral_fsdp_params_are_an_eighth(tmp_path):
    c = Config.from_dict({"model": {"preset": "mixtral-8x7b"}, "cluster": {"gpu": "h100-sxm", "gpus": 8},
                          "parallel": {"ep": 8, "zero": 3}, "training": {"precision": "bf16-mixed"}})
    rank = memory_per_rank(c).per_rank[0]
    total = param_counts(c.model).total
    assert abs(rank.params - 4 * total / 8) / (4 * total / 8) < 1e-3


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "gpt-oss-20b",
                                  "gpt-oss-120b"])
def test_every_moe_preset_predicts(name):
    from engine.predict import predict

    c = Config.from_dict({"model": {"preset": name, "seq_len": 4096}, "cluster": {"gpu": "h100-sxm", "gpus": 64},
                          "parallel": {"ep": 8, "zero": 3, "pp": 2, "microbatches": 4},
                          "training": {"precision": "bf16-mixed"}})
    pred = predict(c)
    assert pred.step.seconds > 0 and all(r.total > 0 for r in pred.memory.per_rank)
    assert pred.to_json()["model"]["params"] == param_counts(c.model).total


def test_the_load_convention_is_stated_beside_the_numbers():
    from engine.memory import conventions_of

    conv = conventions_of(cfg({"ep": 2, "dp": 4}, conventions={"moe_imbalance": 1.5}))
    assert "imbalance 1.5" in conv["moe_load"] and "efsdp = 2" in conv["moe_experts"]
    assert "capacity factor 1.25" in conventions_of(cfg({"dp": 4}, conventions={"moe_capacity_factor": 1.25}))["moe_load"]
    dense = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 4}})
    assert "moe_load" not in conventions_of(dense)


def test_expert_parameters_are_their_own_part_with_and_without_ep():
    for par in ({"ep": 2, "dp": 4}, {"tp": 2, "dp": 2}, {"dp": 4, "zero": 3}):
        c = cfg(par)
        rank = memory_per_rank(c).per_rank[0]
        (e,) = [t for t in rank.explain("params") if t.kind == "expert_parameters"]
        assert 0 < e.bytes < rank.params
    dense = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 4}})
    assert not [t for t in memory_per_rank(dense).per_rank[0].explain("params") if t.kind == "expert_parameters"]


@pytest.mark.parametrize("zero", [0, 3])
def test_attention_core_recompute_lays_the_moe_backward_as_the_other_policies_do(zero):
    """Attention-core recompute ("selective") recomputes nothing of an MoE block's experts, router or combine, so
    its backward makes the temporaries it makes under the other policies (measure --fake, Qwen3 30B pp8 ZeRO-2,
    seed 20261208 #03: the combine's 6.0 GiB of fp32 n·k·h tensors at a middle stage's peak, where the engine
    laid none); the larger moment of the block's backward is chosen as under full recompute: the expert
    gradients' (the tiny block's experts' gradients outweigh its combine at 64 tokens, under FSDP2 as with plain
    gradients)."""
    par = {"dp": 4, "zero": zero}
    sel, full, none = (terms(cfg(par, training={"recompute": r}), "temporaries", "moe_backward")
                       for r in ("selective", "full", "none"))
    assert len(sel) == 1 and sel[0].bytes > 0
    assert [t.bytes for t in sel] == [t.bytes for t in full]
    assert "combine" not in sel[0].label
    if zero == 0:
        assert [t.bytes for t in sel] == [t.bytes for t in none]


def test_fsdp2_pads_each_dim_0_to_the_shard_degree_and_the_last_ranks_step_fewer_rows():
    """4 experts over 8 shard ranks without EP: FSDP2 pads every dim 0 to a multiple of the shard degree
    (``FSDPParam._init_sharded_param``), so a block gathers 8 expert rows (and 8 router rows): its
    all-gather output is 2 B × (128 + 128² + 2·64·128 + 128² + 128 + 8·128 + 3·8·12,288) = 690,688 B
    instead of 2 B × 198,016. The parameters' storage is padded on every rank; AdamW's states take the
    unpadded chunks, so dp-ranks 4–7 (no expert or router row) hold 8 B × 6 blocks × (3·12,288 + 128)
    fewer bytes than dp-ranks 0–3 (one row of each)."""
    c = cfg({"dp": 8, "zero": 3}, gpus=8)
    (ag,) = terms(c, "comm_buffers", "all_gather_output")
    assert ag.bytes == 2 * (128 + 128 * 128 + 2 * 64 * 128 + 128 * 128 + 128 + 8 * 128 + 3 * 8 * 12288) == 690688
    ranks = memory_per_rank(c).per_rank
    assert len({r.params for r in ranks}) == 1
    assert [r.optimizer for r in ranks[1:4]] == [ranks[0].optimizer] * 3
    assert [r.optimizer for r in ranks[4:]] == [ranks[0].optimizer - 8 * 6 * (3 * 12288 + 128)] * 4


def test_replicate_leaves_the_experts_gradients_to_autograd():
    """Under ZeRO-0 with TP the dense parameters take FSDP2's ``replicate`` and the routed experts are its
    ignored_params (backend.parallel.data_parallel.apply_replicate): their ``.grad`` is autograd's, made by the
    first backward and added to by every later one, in fp32; replicate neither gathers nor accumulates them."""
    many = cfg({"tp": 2, "ep": 2, "dp": 2, "microbatches": 2})
    rp = params_per_rank(many)[0][0]
    (plain,) = terms(many, "grads", "gradients")
    assert plain.bytes == 4 * rp.experts
    (sharded,) = terms(many, "grads", "fsdp_sharded_grads")
    assert sharded.bytes == 4 * (rp.total - rp.experts)
    acc = next(t for t in terms(many, "comm_buffers", "fsdp_unsharded_grads") if t.label.startswith("FSDP2"))
    assert acc.bytes == wrapping_plan(many).grad_accumulation_bytes * (rp.total - rp.experts)  # the dense part only
    # one microbatch: made block by block in the only backward, so its late moment (layer 0's backward) holds every
    # MoE block's but layer 0's: all six here (layers 0 and 1 dense), five of eight without dense layers
    one = cfg({"tp": 2, "ep": 2, "dp": 2, "microbatches": 1})
    (plain,) = terms(one, "grads", "gradients")
    assert plain.bytes == 4 * rp.experts
    (late,) = terms(one, "grads", "plain_late_grads")
    assert late.bytes == plain.bytes
    all_moe = cfg({"tp": 2, "ep": 2, "dp": 2, "microbatches": 1}, model={"dense_layers": 0})
    (plain,) = terms(all_moe, "grads", "gradients")
    (late,) = terms(all_moe, "grads", "plain_late_grads")
    assert late.bytes == plain.bytes * 7 // 8


def test_replicates_fresh_gradient_is_its_largest_units_not_the_left_out_experts():
    """Where FSDP2 accumulates in fp32 beside bf16 gradients, one unit's fresh bf16 gradient waits for its
    post-backward: under replicate the routed experts are no unit of it (their gradients are plain), so the largest
    of the others (measure --fake of Qwen3 30B pp8 tp4 ep4 replicate: +2.6 … +7.4 % with the experts' counted)."""
    c = cfg({"tp": 2, "ep": 2, "dp": 2, "microbatches": 2}, model={"expert_ffn_hidden": 1024},
            training={"precision": "bf16-mixed", "grad_dtype": "fp32"})  # the experts the largest unit
    rp = params_per_rank(c)[0][0]
    experts = {u for u, _ in rp.expert_units}
    (fresh,) = terms(c, "comm_buffers", "fsdp_fresh_grad")
    assert fresh.bytes == 2 * max(unit_numel(u) for u, _ in rp.unit_groups if u not in experts)
    assert fresh.bytes < 2 * max(unit_numel(u) for u in experts)


def test_the_combines_backward_holds_three_fp32_routed_gradients_not_the_16_bit_one():
    """The combine's backward (``(out.float() * scores).to(dtype)`` then ``index_add_``): index_add_'s backward
    gathers the output gradient per routed copy in 16 bits, the cast's backward makes it fp32 and frees the
    16-bit one (its only holder), the multiply's backward makes the expert outputs' gradient and the scores'
    product: three fp32 n·k·h tensors (fakes of Qwen3 30B-A3B pp8: three 2 GiB fp32 Temps at the peak, no
    1 GiB 16-bit one). By hand, bf16 ZeRO-3 dp4 at 512 tokens (where the combine's moment outweighs the experts'
    gradients), n = 512, k = 2, h 128: 3 × 4·512·2·128 + the block output gradient 512·128·2."""
    c = cfg({"dp": 4, "zero": 3}, model={"seq_len": 512}, training={"precision": "bf16-mixed"})
    (moe,) = terms(c, "temporaries", "moe_backward")
    assert "combine" in moe.label
    assert moe.bytes == 3 * 4 * 512 * 2 * 128 + 512 * 128 * 2
    # index_add_'s node runs first and frees the weighted outputs it saved (in the block input's dtype, bf16
    # under FSDP2's policy): at the combine's moment they are gone (the fakes' peaks hold the fp32 outputs only)
    (freed,) = terms(c, "activations", "moe_backward_freed")
    assert freed.bytes == -2 * 512 * 2 * 128


def test_an_input_pass_lays_the_combines_backward_not_the_experts_weight_gradients():
    """Under a split backward an I computes input gradients only (torch's ``stage_backward_input``): its MoE
    moment is the combine's backward; the experts' full-size weight gradients come with the W, and at a full B
    (ZBV's first stage) the larger of the two moments. Without a split both kinds stay one term of every B."""
    zbv = cfg({"pp": 2, "virtual_stages": 2, "schedule": "ZBVZeroBubble", "microbatches": 4, "dp": 2}, gpus=4)
    (i_temp,) = terms(zbv, "temporaries", "moe_input_backward")
    assert "combine" in i_temp.label
    (b_temp,) = terms(zbv, "temporaries", "moe_full_backward")
    assert "weight gradients" in b_temp.label  # fp32, 4 tiny experts: their gradients outweigh the combine
    assert not terms(zbv, "temporaries", "moe_backward")
    one_f_one_b = cfg({"pp": 2, "schedule": "1F1B", "microbatches": 4, "dp": 2}, gpus=4)
    assert terms(one_f_one_b, "temporaries", "moe_backward")
    assert not terms(one_f_one_b, "temporaries", "moe_input_backward")


def test_autocast_caches_the_dense_weights_of_a_rank_with_one_local_expert():
    """With one local expert (ep = E) its grouped weights are (1, f·h): the cached casts are the attention's, the
    router's and the head's, never fewer than none (they read −2.5 GiB on Mixtral tp8 ep8 before: the experts were
    subtracted from a count that had never held them)."""
    from engine.model.params import params_per_rank

    c = Config.from_dict({"model": {"preset": "mixtral-8x7b", "layers": 8, "seq_len": 4096},
                          "cluster": {"gpu": "h100-96g", "gpus": 8}, "parallel": {"tp": 8, "ep": 8},
                          "training": {"precision": "bf16-mixed"}})
    (cast,) = terms(c, "activations", "autocast_weight_casts")
    rp = params_per_rank(c)[0][0]
    m, t = c.model, 8
    attention = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim // t + m.heads * m.head_dim * m.hidden // t
    router = m.experts * m.hidden
    head = -(-m.vocab // t) * m.hidden
    assert cast.bytes == 2 * (8 * (attention + router) + head)
    assert rp.expert_matmul_weights == 8 * 3 * m.expert_hidden * m.hidden


def test_an_input_pass_frees_nothing_it_runs_through():
    """torch's ``stage_backward_input`` runs autograd with ``retain_graph=True`` (the W runs the rest of the graph), so
    at an I's combine moment index_add_'s node has not freed the weighted outputs it saved, and the later blocks'
    tensors stay: the I's term frees nothing, where a full B's frees them (measure --fake of seed 20261256 #00, Qwen3
    30B-A3B InterleavedZeroBubble ep2: the 512 MiB weighted outputs at three I's, allocated −3.2 … −3.5 → −2.0 …
    −2.3 %). By hand as the combine test above, bf16 ZeRO-3 at 512 tokens: the I's term is the combine's own."""
    zbv = cfg({"pp": 2, "virtual_stages": 2, "schedule": "ZBVZeroBubble", "microbatches": 4, "dp": 2, "zero": 3},
              gpus=4, model={"seq_len": 512}, training={"precision": "bf16-mixed"})
    (i_temp,) = terms(zbv, "temporaries", "moe_input_backward")
    assert "combine" in i_temp.label
    assert not [t for t in terms(zbv, "activations", "moe_input_backward_freed") if t.bytes]
    one_f_one_b = cfg({"pp": 2, "schedule": "1F1B", "microbatches": 4, "dp": 2, "zero": 3}, gpus=4,
                      model={"seq_len": 512}, training={"precision": "bf16-mixed"})
    (freed,) = terms(one_f_one_b, "activations", "moe_backward_freed")
    assert freed.bytes < 0


def test_a_moe_blocks_unit_has_made_no_fresh_gradient_by_its_combines_backward():
    """FSDP2 accumulating in fp32 beside bf16 parameters, pipelined, no expert parallelism (a MoE block's experts are in
    its unit): where the B's moment is the combine's backward, the block's backward has made no weight gradient yet
    (the combine has no weights; the experts' come after it), so the unit's whole fresh gradient is laid at the end
    of the backward, not at the B (measure --fake of seed 20261257 #05, Qwen3 30B-A3B pp8 1F1B ZeRO-3 full recompute:
    no 1.16 GiB bf16 gradient beside the combine's three fp32 tensors, allocated +4.3 … +5.4 → −0.1 … +0.5 %; a pool
    of ten such layouts from seeds 20261200–43, not looked at: Mixtral 8x7B pp4 +5.8 … +6.9 → +0.9 … +1.9 %). A
    dense block's unit was laid so already."""
    c = cfg({"pp": 2, "schedule": "1F1B", "microbatches": 4, "dp": 2, "zero": 3}, gpus=4, model={"seq_len": 512},
            training={"precision": "bf16-mixed", "grad_dtype": "fp32"})
    assert params_per_rank(c)[0][0].expert_units == ()  # ep = 1: the experts are in their block's unit
    assert any("combine" in t.label for t in terms(c, "temporaries", "moe_backward"))
    assert not terms(c, "comm_buffers", "fsdp_fresh_grad")
    assert terms(c, "comm_buffers", "fsdp_fresh_grad_end")


def test_a_plain_one_microbatch_backward_holds_the_gradients_made_before_its_moment():
    """DDP, one microbatch, no FSDP2: at the B's own moment autograd has made the head's and final norm's
    ``.grad`` (the loss's backward runs into them first) and, the moment being inside the last block with experts,
    that block's shared experts' (run after the routed ones in the forward): hand-worked element counts of the tiny
    MoE (h128, V512 untied, f_e 96, one shared expert, SwiGLU)."""
    c = cfg({"dp": 4, "zero": 1}, model={"shared_experts": 1}, training={"recompute": "none"})
    (plain,) = terms(c, "grads", "gradients")
    (early,) = terms(c, "grads", "plain_early_grads")
    rp = params_per_rank(c)[0][0]
    head_and_norm = 512 * 128 + 128
    shared = 3 * 128 * 96
    assert early.bytes == plain.bytes * (head_and_norm + shared) // rp.total
    # the experts' input buffers are partial sums beside it (no .grad exists yet): w1, w2, w3's and two fresh ones
    (moe,) = terms(c, "temporaries", "moe_backward")
    assert moe.label.startswith("MoE backward") and "(3 + 2) × 4·96·128·4" in moe.formula
    # FSDP2 makes no plain .grad: no such term
    assert not terms(cfg({"dp": 4, "zero": 3}, training={"recompute": "none"}), "grads", "plain_early_grads")
