"""The "pytorch" state accounting: what torch's autocast, FSDP2 and ZeroRedundancyOptimizer keep.

Hand-worked numbers per strategy (bytes per parameter), torch's ZeRO-1 partition on a small
tensor list, and the tiny preset against what PyTorch's MemTracker measured for it.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Config, ConfigError
from engine.memory import memory_per_rank
from engine.memory.lifetimes import PARTIAL_STATE_KINDS
from engine.memory.states import _adjacent_peak
from engine.model.params import (
    param_counts,
    params_per_rank,
    rank_tensor_groups,
    zero_redundancy_largest,
    zero_redundancy_partition,
)

NO_OVERHEAD = {"runtime_context": False, "collective_buffers": False}
EVEN = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 1024, "vocab": 1024,
        "seq_len": 128, "mlp": "gelu", "norm": "layernorm", "attention": "eager", "bias": False}
MIXED = {"precision": "bf16-mixed", "grad_dtype": "bf16", "optimizer": "adamw"}


def cfg(model=None, training=None, accounting="pytorch", gpu="h100-sxm", **parallel) -> Config:
    par = {"dp": 1, "tp": 1, "pp": 1, **parallel}
    return Config.from_dict({
        "model": model or {"preset": "tiny"},
        "cluster": {"gpu": gpu, "gpus": par["dp"] * par["tp"] * par["pp"]},
        "parallel": par, "training": training or {},
        "conventions": {**NO_OVERHEAD, "state_accounting": accounting},
    })


def test_default_is_pytorch_and_bad_value_names_the_field():
    assert Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "h100-sxm", "gpus": 1}}) \
        .conventions.state_accounting == "pytorch"
    with pytest.raises(ConfigError) as e:
        cfg(accounting="deepspeed")
    assert "conventions.state_accounting" in str(e.value) and "zero-paper" in str(e.value)


def test_ddp_autocast_adamw_is_4_4_8():
    c = cfg(EVEN, MIXED, dp=4)
    psi = param_counts(c.model).total
    r = memory_per_rank(c).per_rank[0]
    assert (r.params, r.grads, r.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    # DDP's buckets take the gradients' dtype: fp32 under autocast
    assert r.comm_buffers == 4 * psi
    # same 16 B/param total as the ZeRO paper's 2 + 2 + 12, different split
    z = memory_per_rank(cfg(EVEN, MIXED, accounting="zero-paper", dp=4)).per_rank[0]
    assert z.model_states == r.model_states and (z.params, z.grads, z.optimizer) == (2 * psi, 2 * psi, 12 * psi)


def test_fsdp2_zero3_keeps_the_fp32_shard_as_master():
    d = 4
    c = cfg(EVEN, MIXED, dp=d, zero=3)
    psi = param_counts(c.model).total
    assert psi % d == 0
    r = memory_per_rank(c).per_rank[0]
    # the sharded gradient is in the parameter dtype, fp32; FSDP2 makes a unit's only in its post-backward
    # (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: "new_sharded_grad =
    # torch.as_strided(reduce_output, ...)" ... "fsdp_param.sharded_param.grad = new_sharded_dtensor_grad"), and
    # zero_grad(set_to_none=True) drops it after the step. m = 1: the peak is the B's own moment after its last
    # block's post-backward (that block's sharded gradients and reduce-scatter input outweigh its saved tensors:
    # measured so on a fake step of the tiny preset), so that block's are alive
    rp = params_per_rank(c)[0][0]
    block = max(sum(a * b for a, b in u) for u in rp.units if u not in rp.root_units)
    assert (r.params, r.grads, r.optimizer) == (4 * psi // d, 4 * block // d, 8 * psi // d)
    # (late in the backward, past the peak here, those of every unit reduced by then: all but the root
    # unit and the first two blocks)
    root = sum(a * b for u in rp.root_units for a, b in u)
    assert root == 2 * 1024 * 256 + 2 * 256  # the embeddings, the final LayerNorm and the head: fully_shard(model)
    assert [(t.kind, t.bytes) for t in r.catalogue("grads")] == [
        ("fsdp_sharded_grads", 4 * psi // d), ("fsdp_early_reduce", 4 * block // d),
        ("fsdp_reduced_grads", 4 * psi // d * (psi - root - 2 * block) // psi)]
    # bf16: the root unit gathered, the current block's unit, the next one's all-gather output, the last block's
    # reduce-scatter input (m = 1), and the unsharded gradients autograd has made by then (FSDP2's, which its
    # post-backward reduces): the block's and the final norm's and head's, made first
    made = sum(t.bytes for t in r.catalogue("comm_buffers") if t.kind == "fsdp_unit_grads")
    assert r.comm_buffers == 2 * root + 2 * block + 2 * block + 2 * block + made + 2 * (2 * 256 + 1024 * 256)
    # with gradient accumulation FSDP2 keeps every unit's unsharded gradient until the synced microbatch
    r4 = memory_per_rank(cfg(EVEN, MIXED, dp=d, zero=3, microbatches=4)).per_rank[0]
    assert r4.comm_buffers == 2 * root + 2 * block + 2 * block + 2 * psi


def test_fsdp2_zero2_params_are_sharded_the_gathered_copy_is_a_buffer():
    d = 4
    c = cfg(EVEN, MIXED, dp=d, zero=2)
    psi = param_counts(c.model).total
    r = memory_per_rank(c).per_rank[0]
    # 4/d, 4/d, 8/d with d = 4; the sharded gradient is not alive at the peak (the first backward's own
    # moment, before any post-backward): FSDP2 makes a sharded gradient only in its post-backward (torch
    # 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: "new_sharded_grad =
    # torch.as_strided(reduce_output, ...)" ... "fsdp_param.sharded_param.grad = new_sharded_dtensor_grad"),
    # and zero_grad(set_to_none=True) drops it after the step
    assert (r.params, r.grads, r.optimizer) == (psi, 0, 2 * psi)
    assert [t.bytes for t in r.catalogue("grads")] == [psi]
    assert r.comm_buffers >= 2 * psi  # all units stay gathered (bf16) between forward and backward
    z = memory_per_rank(cfg(EVEN, MIXED, accounting="zero-paper", dp=d, zero=2)).per_rank[0]
    assert (z.params, z.grads, z.optimizer) == (2 * psi, 2 * psi // d, 12 * psi // d)


def _each(*numels: int) -> list[tuple[int, int]]:
    return [(n, 1) for n in numels]


def test_zero_redundancy_partition_is_torchs_greedy():
    assert zero_redundancy_partition(_each(10, 7, 5, 3, 1), 2) == [13, 13]
    # 6 → r0, 5 → r1, 4 → r2, 3 → r2 (4 is least), 2 → r1, 1 → r0
    assert zero_redundancy_partition(_each(1, 2, 3, 4, 5, 6), 3) == [7, 7, 7]
    assert zero_redundancy_partition(_each(4, 4, 4), 4) == [4, 4, 4, 0]  # whole tensors: a rank may get none
    assert zero_redundancy_partition(_each(9, 1, 1), 2) == [9, 2]
    # the same tensors given as (numel, count) groups
    assert zero_redundancy_partition([(4, 3)], 4) == [4, 4, 4, 0]
    assert zero_redundancy_partition([(1, 2), (9, 1)], 2) == [9, 2]


@given(st.lists(st.integers(1, 64), min_size=1, max_size=24), st.integers(1, 9))
def test_a_ranks_largest_zero_redundancy_tensors_are_those_torchs_greedy_hands_it_first(numels, degree):
    """``zero_redundancy_largest`` against ZeroRedundancyOptimizer's ``_partition_parameters`` written out:
    a stable sort by numel, largest first, each tensor to the least-loaded rank (the lowest on ties)."""
    loads, owned = [0] * degree, [[] for _ in range(degree)]
    for x in sorted(numels, reverse=True):
        r = loads.index(min(loads))
        owned[r].append(x)
        loads[r] += x
    assert zero_redundancy_partition(_each(*numels), degree) == loads
    for r in range(degree):
        assert zero_redundancy_largest(_each(*numels), degree, r) == owned[r][:2]


def test_zero1_optimizer_differs_per_rank_and_sums_exactly():
    c = cfg(None, None, dp=4, zero=1)  # tiny preset, fp32
    rep = memory_per_rank(c)
    rp = params_per_rank(c)[0][0]
    shares = zero_redundancy_partition(rank_tensor_groups(rp), 4)
    assert [r.optimizer for r in rep.per_rank] == [8 * x for x in shares]
    assert sum(r.optimizer for r in rep.per_rank) == 8 * rp.total
    assert len(set(shares)) > 1  # the tiny preset's tensors do not split evenly
    assert all(r.params == 4 * rp.total and r.grads == 4 * rp.total for r in rep.per_rank)


def test_tp_embedding_gradient_is_full_size():
    c = cfg(None, None, tp=4)
    m = c.model
    r = memory_per_rank(c).per_rank[1]
    local = params_per_rank(c)[0][1].total
    assert r.params == 4 * local
    # (whole: plain gradients exist from the first backward on, so a peak before it holds none)
    whole = sum(t.bytes for t in r.catalogue("grads") if t.kind not in PARTIAL_STATE_KINDS)  # (not a moment's share)
    assert whole == 4 * (local + m.vocab * m.hidden - m.vocab * m.hidden // 4)
    # under FSDP2's replicate (dp × tp) the gradient comes back sharded
    assert memory_per_rank(cfg(None, None, dp=2, tp=2)).per_rank[0].grads == \
        4 * params_per_rank(cfg(None, None, dp=2, tp=2))[0][0].total


def test_fsdp2_tp_embedding_gradient_is_full_size_until_its_post_backward():
    # tiny: V = 512, h = 128, so V·h = 65,536 elements; TP 2 holds 32,768 of them per rank.
    # The lookup's gradient comes back replicated (V × h on every TP rank); FSDP2 redistributes it
    # to the row shard only when its post-backward reduces it.
    fp32_reduce = {"precision": "bf16-mixed", "grad_dtype": "fp32", "optimizer": "adamw"}

    def term(r, words):
        return [t for t in r.catalogue("comm_buffers") if words in t.label]

    # one microbatch, no pipeline: a bf16 transient of 2 B × 65,536 on every rank (each holds the embedding),
    # alive at the end of the backward only: the embedding's backward is the root unit's, after every block's
    # backward has freed its saved tensors (Llama 3 8B dp16 × tp8 + SP, fp32, measure --fake: at the peak
    # "Activation" 32 KiB beside "Unsharded Grad" V·h·4 B + the head's shard; holding it at the B with the
    # activations was allocated +14.0 %, now -2.7 %)
    from engine.memory.lifetimes import LIFETIMES

    one = memory_per_rank(cfg(None, fp32_reduce, dp=2, tp=2, zero=3))
    for r in one.per_rank:
        (t,) = term(r, "token-embedding gradient at full V × h in bf16")
        assert (t.bytes, t.kind) == (131_072, "embedding_full_gradient")
        assert LIFETIMES[t.kind] == "post_backward"
    # pipelined: the fp32 accumulation holds the replicated gradient, 4 B × (65,536 − 32,768) beyond
    # the row shard, on stage 0 only (the embeddings' stage)
    piped = memory_per_rank(cfg(None, fp32_reduce, dp=2, tp=2, pp=2, zero=3, microbatches=4, schedule="1F1B"))
    for r in piped.per_rank:
        extra = term(r, "token-embedding gradient accumulated at full V × h, in fp32")
        assert [(t.bytes, t.kind) for t in extra] == ([(131_072, "fsdp_embedding_full_grad")] if r.pp_rank == 0 else [])
    # no TP: the gradient is the shard's own size, no extra term
    assert not any(term(r, "token-embedding gradient") for r in
                   memory_per_rank(cfg(None, fp32_reduce, dp=2, zero=3)).per_rank)


def test_an_unpipelined_later_microbatch_makes_the_embeddings_gradient_afresh():
    """Unpipelined FSDP2 over two microbatches in one dtype (fp32): the first backward's token-embedding gradient is
    the accumulation; a later one's backward ends making a fresh one (full V × h under TP) that AccumulateGrad adds in
    (a temporary at each later B's end), and the events lay the accumulation's replicated part as one tensor."""
    from engine.memory.lifetimes import LIFETIMES
    from engine.memory.per_rank import rank_body

    fp32 = {"precision": "fp32", "optimizer": "adamw"}
    c = cfg(None, fp32, dp=2, tp=2, zero=2, microbatches=2)
    for r in memory_per_rank(c).per_rank:
        (fresh,) = [t for t in r.catalogue("temporaries") if t.kind == "fsdp_embedding_added_grad"]
        assert fresh.bytes == 4 * 65_536 and LIFETIMES[fresh.kind] == "later_backward_end"
    rows = rank_body(c, params_per_rank(c)[0][0]).timeline._rows
    assert [n for life, n, _ in rows if life == "accumulated_whole"] == [4 * (65_536 - 32_768)]
    one = memory_per_rank(cfg(None, fp32, dp=2, tp=2, zero=2, microbatches=1))
    assert not any(t.kind == "fsdp_embedding_added_grad" for r in one.per_rank for t in r.catalogue("temporaries"))


@pytest.mark.parametrize("training, measured", [
    ({"precision": "fp32", "grad_dtype": "fp32"}, 13_675_016),  # MemTracker "Activation" at the peak, torch 2.13 CPU, one rank, one microbatch
    (MIXED, 11_971_080),  # the same under bf16 autocast
])
def test_tiny_activations_match_memtracker(training, measured):
    r = memory_per_rank(cfg(None, {**training, "micro_batch_size": 2}, gpu="cpu")).per_rank[0]
    assert abs(r.activations - measured) / measured < 0.001


def test_pipeline_stage_input_is_the_receive_buffer():
    c = cfg(None, None, pp=2, microbatches=4, schedule="1F1B")
    r1 = memory_per_rank(c).per_rank[1]
    labels = {t.label for t in r1.catalogue("activations")}  # every term (the peak may be the optimizer step)
    assert any("receive buffer" in x for x in labels)
    sbh = c.model.seq_len * c.training.micro_batch_size * c.model.hidden
    assert r1.comm_buffers == 4 * 4 * sbh  # m activation receive buffers, fp32


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)), min_size=1, max_size=6),
       st.integers(1, 40))
def test_zero_redundancy_partition_in_closed_form_and_with_numpy_is_the_greedy(groups, degree):
    """Both ways of computing torch's _partition_parameters (Python with a heap and the closed form;
    numpy, used from NUMPY_PARTITION_RANKS ranks on) equal handing the tensors out one by one."""
    from engine.model.params import _partition, tensor_groups

    tensors = sorted((n for n, c in groups for _ in range(c)), reverse=True)
    sizes = [0] * degree
    for n in tensors:
        r = min(range(degree), key=lambda j: (sizes[j], j))
        sizes[r] += n
    g = tensor_groups(groups)
    assert list(_partition(g, degree)) == sizes
    assert list(_partition(g, degree, numpy_from=1)) == sizes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 3, 7, 9, 12]), min_size=1, max_size=40), st.integers(1, 300))
def test_share_classes_are_numbered_in_order_of_appearance_either_way(pattern, repeat):
    """memory_per_rank's ZeRO-1 share classes (numpy, for 131,072 dp ranks) give each dp index the class a
    plain dict pass gives it, and each class the same indices."""
    from engine.memory.per_rank import _share_classes

    sizes = (pattern * repeat)[:5000]
    classes: dict[int, list[int]] = {}
    for d, n in enumerate(sizes):
        classes.setdefault(n, []).append(d)
    index = {n: i for i, n in enumerate(classes)}
    assert _share_classes(sizes) == (tuple(index[n] for n in sizes), [tuple(ds) for ds in classes.values()])


def _terms(cfg, category):
    return {t.label: t.bytes for t in memory_per_rank(cfg).per_rank[0].explain(category)}


def test_loss_parallel_holds_three_fp32_shards_and_the_head_its_gathered_input():
    """Issue 31's case, by hand from torch's source: loss_parallel's _nll_loss_and_log_softmax_backward
    returns (zeros_like(x) + exp(x)) * grad_output, three fp32 shards of s·b·⌈V/t⌉ alive at once
    (measure --fake: tracker Temp 25,220,481,028 B); the head's ColwiseParallel gathers the sequence
    shards and F.linear saves that gathered input, 2·s·b·h (the fake: 1.75 GiB more than /t)."""
    cfg = Config.from_dict({"model": {"preset": "llama3-70b"}, "cluster": {"gpu": "h100-sxm", "gpus": 256},
                            "parallel": {"dp": 32, "tp": 8, "zero": 3, "sequence_parallel": True},
                            "training": {"micro_batch_size": 16, "precision": "bf16-mixed", "recompute": "full"}})
    s, b, h, v_t = 8192, 16, 8192, -(-128256 // 8)
    assert v_t == 16032
    temps = _terms(cfg, "temporaries")
    loss = [x for k, x in temps.items() if k.startswith("loss (loss_parallel)")]
    assert loss == [3 * 4 * s * b * v_t] == [25_216_155_648]
    acts = _terms(cfg, "activations")
    assert acts["stage 0: head input, gathered from the sequence shards"] == 2 * s * b * h
    # without sequence parallel the loss sees the replicated logits: the aten path's two fp32 copies of V
    plain = cfg.replace(parallel={"sequence_parallel": False})
    assert [x for k, x in _terms(plain, "temporaries").items() if k.startswith("loss:")] == [2 * 4 * s * b * 128256]


def test_sdpa_keeps_k_and_v_repeated_to_every_query_head():
    """backend/model.py repeats K and V for GQA before the attention core, so SDPA saves them at h/t,
    not kv/t (measure --fake, Llama 3 8B TP4 + SP, b 2: the engine was 1.50 GiB under, exactly
    2·(h − kv)/t · 2 B · s·b · 32 layers)."""
    from engine.memory.activations import activation_terms_per_layer

    cfg = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "gpus": 32},
                            "parallel": {"dp": 8, "tp": 4, "zero": 2, "sequence_parallel": True},
                            "training": {"micro_batch_size": 2, "precision": "bf16-mixed"},
                            "conventions": {"state_accounting": "pytorch"}})
    terms, formula = activation_terms_per_layer(cfg)
    kv = {t.label: t.bytes for t in terms}["K, V"]
    assert kv == 2 * 2 * 8192 * 2 * 4096 // 4  # two tensors × 2 B × s·b·h/t
    # the paper's accounting keeps the kv heads (8 of 32: a quarter)
    paper = cfg.replace(conventions={"state_accounting": "zero-paper"})
    assert {t.label: t.bytes for t in activation_terms_per_layer(paper)[0]}["K, V"] == kv // 4


# --------------------------------------------------------------------------- the optimizer step


def _step_terms(r):
    return [t for t in r.catalogue("temporaries") if t.kind == "optimizer_step"]


def test_adamw_foreach_on_a_gpu_makes_the_square_root_of_every_second_moment_at_once():
    """torch/optim/adam.py ``_multi_tensor_adam`` (torch's default on CUDA:
    optimizer.py ``_default_to_fused_or_foreach``): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``,
    one fp32 tensor per stepped parameter, alive until ``_foreach_addcdiv_``: 4 B × the local elements.
    It lives at the optimizer-step moment only, with every gradient (zero_grad comes after the step)."""
    for par in ({"dp": 2}, {"dp": 2, "zero": 3}, {"dp": 4, "zero": 1}, {"tp": 2, "sequence_parallel": True}):
        rep = memory_per_rank(cfg(None, None, **par))
        for r in rep.per_rank:
            (t,) = _step_terms(r)
            opt = sum(x.bytes for x in r.catalogue("optimizer") if x.kind == "optimizer_states")
            assert t.bytes == opt // 2  # two fp32 moments per element: the step makes one more
            assert r._body.timeline.lifetime("temporaries", r.catalogue("temporaries").index(t)) == "optimizer_step"
    # TP without SP and without an FSDP2 wrapper leaves the norms plain beside DTensors, which a foreach op refuses:
    # the backend steps them one by one (its optimizer's foreach flag, measured on fake ranks), and the engine too
    (t,) = _step_terms(memory_per_rank(cfg(None, None, tp=2)).per_rank[0])
    assert "for-loop" in t.label
    # plain SGD (with or without momentum) steps in place
    for opt in ("sgd", "sgd-momentum"):
        assert not _step_terms(memory_per_rank(cfg(None, {"optimizer": opt}, dp=2)).per_rank[0])


def test_adamw_for_loop_on_cpu_holds_one_parameter_s_root_and_quotient_beside_the_previous_denominator():
    """``_single_tensor_adam`` (torch's default on CPU): ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``
    makes the root and the quotient of one parameter while the previous parameter's ``denom`` is still
    bound. Under ZeroRedundancyOptimizer the local optimizer steps its share largest first
    (``_partition_parameters``). Measured (CPU sweep seed 2026 #03, tiny h192 f744 V300 3 layers, dp2
    ZeRO-1, gelu MLP): MemTracker's optimizer state at its peak, inside the step, was 6,936,632 B against
    5,222,400 B of states: 1,714,232 B, of which 1,714,176 = 4 B × 3 × 142,848 (f × h: the two largest
    tensors of the share, both MLP weights)."""
    model = {"preset": "tiny", "layers": 3, "hidden": 192, "heads": 6, "kv_heads": 3, "ffn_hidden": 744,
             "vocab": 300, "seq_len": 32, "mlp": "gelu", "attention": "eager"}
    rep = memory_per_rank(cfg(model, {"recompute": "full", "micro_batch_size": 3, "precision": "fp32"}, gpu="cpu",
                              dp=2, zero=1))
    for r in rep.per_rank:
        (t,) = _step_terms(r)
        assert t.bytes == 4 * 3 * 744 * 192
        assert r.peak_moment.startswith("the optimizer step")
    # without ZeRO-1, the parameters in order: max over them of previous + 2 × this
    assert _adjacent_peak([((5, 1, 9), 1)]) == 1 + 18
    assert _adjacent_peak([((9, 1), 3)]) == max(18, 9 + 2, 1 + 18)
    assert _adjacent_peak([((2,), 1), ((7, 3), 2), ((4,), 1)]) == max(4, 2 + 14, 7 + 6, 3 + 14, 3 + 8)


def test_autocasts_cached_weight_casts_are_gone_at_the_optimizer_step():
    """The training loop runs each forward and backward inside ``torch.autocast``, whose exit clears the
    cache (torch/amp/autocast_mode.py: ``torch.clear_autocast_cache()`` when the nesting reaches 0); the
    optimizer steps outside it. Measured (CPU sweep seed 4711 #01, dp4 ZeRO-1 bf16-mixed m1): the
    tracker's peak is in the backward, with the casts; a step moment holding them too read 4.5 % high."""
    r = memory_per_rank(cfg(None, MIXED, dp=2)).per_rank[0]
    assert r.peak_moment.startswith("the optimizer step")
    assert "autocast_weight_casts" in {t.kind for t in r.catalogue("activations")}
    assert "autocast_weight_casts" not in {t.kind for t in r.explain("activations")}
    assert r.allocated == r.total  # no overhead terms here: the snapshot is the peak


def test_a_zero2_forward_gathers_each_block_beside_the_previous_ones_all_gather_result():
    """FSDP2's implicit forward prefetch keeps each unit's all-gather result until the next unit's
    ``wait_for_unshard`` (``comm_ctx.all_gather_state``), which runs after that unit's all-gather has landed;
    the root's post-forward frees the last. Under ZeRO-2 with 4 microbatches the units are resharded after
    each backward and gathered again in the next forward, with the unsharded gradients accumulated: the peak
    is the last block's unshard, every unit gathered and two blocks' all-gather outputs (a CPU run of this
    layout: MemTracker's All Gather 2,509,824 B = 2 × 1,254,912). Full recompute: the last block saves
    nothing after its input, so the second output counts whole. By hand, fp32 (h 192, 8 heads over 4 KV,
    f 352): one block's parameters 2·192² + 2·192·96 + 3·192·352 + 2·192 (its norms) = 313,728 elements,
    1,254,912 B gathered."""
    shape = {"preset": "tiny", "layers": 3, "hidden": 192, "heads": 8, "kv_heads": 4, "ffn_hidden": 352,
             "vocab": 512, "seq_len": 48}
    c = Config.from_dict({
        "model": shape, "cluster": {"preset": "local-cpu", "gpus": 4, "gpus_per_node": 4},
        "parallel": {"dp": 4, "zero": 2, "microbatches": 4},
        "training": {"micro_batch_size": 2, "precision": "fp32", "recompute": "full"}})
    r = memory_per_rank(c).per_rank[0]
    block = 4 * 313_728
    gathered = [t.bytes for t in r.catalogue("comm_buffers") if t.kind == "all_gather_output"]
    assert gathered == [block, block]
    assert r.peak_moment.startswith("stage 0 F of microbatch 1")
    # where the blocks save more after their input, the second output counts less that (per-op selective:
    # the block's tensors but its input are made after its unshard)
    sel = memory_per_rank(c.replace(training={"recompute": "selective-op"})).per_rank[0]
    second = [t.bytes for t in sel.catalogue("comm_buffers") if t.kind == "all_gather_output"][1:]
    assert not second or second[0] < block
