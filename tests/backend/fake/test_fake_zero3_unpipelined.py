"""Unpipelined ZeRO-3 with one microbatch at full width: the engine against ``measure --fake`` of the same
config (fake tensors through the backend's own path), where FSDP2's gathers and reductions, not the saved
tensors, decide the peak.

torch's order (torch/distributed/fsdp/_fully_shard): the root unit (``fully_shard(model)``: embeddings, final
norm, head) is gathered through the forward and again from the head's backward to the backward's final
callback; a block's unit is gathered in its pre-backward beside the next one's prefetched all-gather output;
each post-backward reshards, drops the previous reduce-scatter input and reduces its own. Full recompute saves
next to nothing, so Llama 3 70B peaks late in the backward, with most blocks' sharded gradients made; without
recompute, Llama 2 7B peaks early, after its last block's post-backward.
"""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine import Config
from engine.predict import predict

LAYOUTS = {
    # a 70B-wide model cut to 4 blocks: dp 8, full recompute, bf16 with fp32 gradients
    "late": {"model": {"preset": "llama3-70b", "seq_len": 8192, "layers": 4},
             "cluster": {"gpu": "h100-96g", "gpus": 8, "gpus_per_node": 8},
             "parallel": {"dp": 8, "zero": 3, "microbatches": 1},
             "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "fp32",
                          "recompute": "full"}},
    # Llama 2 7B cut to 4 blocks: dp 4, nothing recomputed, bf16 gradients
    "early": {"model": {"preset": "llama2-7b", "seq_len": 2048, "layers": 4},
              "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
              "parallel": {"dp": 4, "zero": 3, "microbatches": 1},
              "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "bf16",
                           "recompute": "none"}},
}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_unpipelined_zero3_peaks_where_the_backend_does(tmp_path, name):
    cfg = Config.from_dict(LAYOUTS[name])
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (row,) = reserved_rows(res)
    rank = predict(cfg).memory.per_rank[0]
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.03)
    if name == "late":
        assert rank.peak_moment.startswith("late in stage 0 B")
        # at the fake's peak: the root unit and one block gathered, in bf16 — the engine's two terms exactly
        (rec,) = res.records
        gathered = sum(t.bytes for t in rank.catalogue("comm_buffers")
                       if t.kind in ("fsdp_root_params", "fsdp_unsharded_params"))
        assert rec["memory"]["tracker_peak"]["Unsharded Param"] == gathered
    else:
        assert rank.peak_moment.startswith("stage 0 B of microbatch 0 (")


@pytest.mark.integration
def test_the_heads_gathered_output_is_in_the_reserve(tmp_path):
    """Tensor parallelism without sequence parallel: the head's output reaches the loss through DTensor's
    Shard(-1) → Replicate, whose all-gather buffer and copy are both whole-vocabulary logits (the engine's
    ``lifetimes.Grain``). Neither is at the allocated peak (the loss's fp32 tensors are), but their segments
    stay cached: Llama 3 70B cut to 4 blocks, dp32 tp8 cp2 ZeRO-3, 8 × 4,096 tokens, full recompute —
    the engine's reserve read −15.1 % of the fake's replay without them, −2.9 % with them."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-70b", "seq_len": 4096, "layers": 4},
        "cluster": {"gpu": "h100-96g", "gpus": 512, "gpus_per_node": 8},
        "parallel": {"dp": 32, "tp": 8, "cp": 2, "zero": 3, "microbatches": 1},
        "training": {"micro_batch_size": 8, "precision": "bf16-mixed", "grad_dtype": "fp32", "recompute": "full"}})
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (row,) = reserved_rows(res)
    rank = predict(cfg).memory.per_rank[0]
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.01)
    assert rank.reserved == pytest.approx(row["max_reserved"], rel=0.05)


REPLICATE = {
    # the walk's last block: Llama 3 405B cut to 6 blocks, 16 × 2,048 tokens (the recomputed block outweighs the end)
    "late": ("llama3-405b", 6, 16),
    # the root's post-backward: Llama 3 70B cut to 4 blocks, 2 × 2,048 tokens
    "end": ("llama3-70b", 4, 2),
}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(REPLICATE))
def test_replicate_walks_its_units_as_zero2_with_whole_gradients(tmp_path, name):
    """ZeRO-1 × TP runs FSDP2's ``replicate`` (a shard degree of 1): each unit is gathered in its forward and
    resharded in its post-backward, which makes its whole fp32 gradient — twice the bf16 copy it frees. So the
    walk's most is at its last block (layer 0): every later block's gradient made, only the root and layer 0
    still gathered (``measure --fake`` of Llama 3 405B dp16 tp4 ZeRO-1, full recompute: the engine read −4.1 %
    with every unit gathered to the end of the backward and no gradient made before it). At the end the root's
    post-backward (torch's ``foreach_reduce``) peaks before its reduce, where DTensor has redistributed the
    embeddings' full-size gradient to its row shard beside it (the engine read +10.5 %, the root's reduce input
    beside its whole sharded gradients, which are made only after the copy-in)."""
    preset, layers, batch = REPLICATE[name]
    cfg = Config.from_dict({
        "model": {"preset": preset, "seq_len": 2048, "layers": layers},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 4, "tp": 4, "sequence_parallel": True, "zero": 1, "microbatches": 1},
        "training": {"micro_batch_size": batch, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "full"}})
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (row,) = reserved_rows(res)
    rank = predict(cfg).memory.per_rank[0]
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.005)
    (rec,) = res.records
    if name == "late":
        assert rank.peak_moment.startswith("late in stage 0 B")
        gathered = sum(t.bytes for t in rank.explain("comm_buffers") if t.kind == "fsdp_unsharded_params"
                       or t.kind == "fsdp_late_reduce" and t.bytes < 0)
        assert rec["memory"]["tracker_peak"]["Unsharded Param"] == gathered
    else:
        assert rank.peak_moment.startswith("the end of the backward")


@pytest.mark.integration
def test_the_roots_pre_backward_gathers_it_again_after_the_losss_backward(tmp_path):
    """fp32, few tokens a rank against a large vocabulary: the root's pre-backward hook on the logits gathers
    it again once the loss's backward has freed its temporaries and log-probabilities; the all-gather output
    and the root's parameters (FSDP2's copy-out) beside the logits' gradient are the step's peak (engine:
    the loss moment's ``fsdp_root_regather`` term over the loss's own)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
        "parallel": {"dp": 8, "tp": 4, "zero": 3, "sequence_parallel": True, "microbatches": 2},
        "training": {"micro_batch_size": 1, "precision": "fp32", "recompute": "none"}})
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (row,) = reserved_rows(res)
    rank = predict(cfg).memory.per_rank[0]
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.005)
    v, h, t = cfg.model.vocab, cfg.model.hidden, 4
    root = sum(x.bytes for x in rank.catalogue("comm_buffers") if x.kind == "fsdp_root_params")
    assert root >= 2 * 4 * v * h // t  # the embedding's and the head's shards, fp32
    parts = {c: [x.bytes for x in rank.catalogue(c) if x.kind == "fsdp_root_regather"]
             for c in ("comm_buffers", "temporaries", "activations")}
    sbv = 4096 * v // t * 4  # one fp32 tensor of the loss's vocabulary shard
    # the root's all-gather output and copy-out; the logits' gradient less the loss's three; the log-probabilities
    assert parts == {"comm_buffers": [2 * root], "temporaries": [sbv - 3 * sbv], "activations": [-sbv]}


@pytest.mark.integration
def test_plain_gradients_are_made_block_by_block_and_peak_late(tmp_path):
    """ZeRO-1 (DDP + ZeroRedundancyOptimizer), full recompute, one microbatch: autograd makes each block's plain
    ``.grad`` in its backward, so by layer 0's backward every other block's gradient is there beside layer 0's
    recompute — the step's peak (its optimizer states sharded 16 ways, the optimizer step holds less). The
    engine's late-backward moment: −5.7 % → within 1 % of the fake."""
    cfg = Config.from_dict({
        "model": {"preset": "llama2-7b", "layers": 8, "seq_len": 16384},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 16, "zero": 1, "microbatches": 1},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "recompute": "full"}})
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (row,) = reserved_rows(res)
    rank = predict(cfg).memory.per_rank[0]
    assert rank.peak_moment.startswith("late in stage 0 B")
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.01)
    grads = sum(t.bytes for t in rank.catalogue("grads") if t.kind == "gradients")
    (late,) = [t.bytes for t in rank.catalogue("grads") if t.kind == "plain_late_grads"]
    assert 0.75 * grads < late < 0.9 * grads  # all but layer 0's (1/8 of the blocks) and the embeddings'
