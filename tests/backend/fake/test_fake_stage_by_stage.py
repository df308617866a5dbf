"""A rank of several pipeline stages under FSDP2 holds each stage's gathered units and its B ends' gradients on that
stage's own time, not the rank's: ``measure --fake`` of one rank against the engine (seconds each)."""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine.config import Config
from engine.predict import predict


def _rank0_as_the_fake_holds_it(cfg: Config, tmp_path, rel: float = 0.01):
    """The engine's rank 0, its allocated peak checked against ``measure --fake`` of the same rank within ``rel``."""
    rank = predict(cfg).memory.per_rank[0]
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (row,) = reserved_rows(res)
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=rel)
    return rank


def _cfg(preset: str, schedule: str, zero: int, grad_dtype: str, seq: int, microbatches: int) -> Config:
    return Config.from_dict({
        "model": {"preset": preset, "layers": 8, "seq_len": seq},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 4, "pp": 4, "zero": zero, "schedule": schedule, "virtual_stages": 2,
                     "microbatches": microbatches},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": grad_dtype,
                     "recompute": "full"}})


@pytest.mark.integration
def test_a_looped_schedule_reshards_each_stage_at_its_own_reduce_grad(tmp_path):
    """LoopedBFS runs all of rank 0's later stage (4) before its first (0): stage 4's REDUCE_GRAD reshards its units
    (ZeRO-3 not resharded after forward: kept gathered from the stage's first forward) long before stage 0's backwards,
    where the rank peaks with only stage 0's units gathered (engine: ``stage_gathered``; with every unit gathered to
    the end of the backward it read +5.4 %). The token embeddings' fresh gradient at the ends of stage 0's B only."""
    cfg = _cfg("llama3-8b", "LoopedBFS", 3, "bf16", 2048, 8)
    rank = _rank0_as_the_fake_holds_it(cfg, tmp_path)
    assert rank.peak_moment.startswith("the end of stage 0 B")
    gathered = {t.stage: t.bytes for t in rank.explain("comm_buffers") if t.kind == "fsdp_unsharded_params"}
    assert set(gathered) == {0}
    assert {t.stage for t in rank.catalogue("comm_buffers") if t.kind == "fsdp_unsharded_params"} == {0, 4}


@pytest.mark.integration
def test_the_first_stages_w_ends_as_a_b_does(tmp_path):
    """Under a split backward the first stage's W is its whole backward (its I ran nothing), the token embedding's
    last: its end holds the embeddings' fresh gradient beside the fp32 accumulation FSDP2's post-backward makes from
    it, the rank's peak for GPT-2 (a large vocabulary for its blocks); without that moment the engine read −4.2 %."""
    cfg = _cfg("gpt2-124m", "InterleavedZeroBubble", 2, "fp32", 1024, 4)
    rank = _rank0_as_the_fake_holds_it(cfg, tmp_path)
    assert rank.peak_moment.startswith("the end of stage 0 B of microbatch 0")
    fresh = [t for t in rank.explain("comm_buffers") if t.kind == "fsdp_embedding_fresh_grad"]
    assert len(fresh) == 1 and fresh[0].stage == 0


@pytest.mark.integration
@pytest.mark.parametrize("preset, grad_dtype, buffers", [("qwen3-30b-a3b", "bf16", 3), ("mixtral-8x7b", "fp32", 0)])
def test_fsdp2_experts_backward_holds_their_input_buffers_beside_the_accumulation(tmp_path, preset, grad_dtype, buffers):
    """Each expert's weights are a slice of a 3-D parameter, so select_backward gives every expert a full-size
    gradient, summed in autograd's input buffers (w1, w3, w2) beside two fresh ones. Under FSDP2 with the parameters'
    dtype for the accumulation, a later microbatch's buffers are tensors of their own beside the accumulated .grad (a
    Qwen3 30B-A3B LoopedBFS ZeRO-3 ep2 rank peaks there: −3.5 % without them); accumulating in fp32, FSDP2's
    post-backward has moved the sum off .grad, so the buffers become the fresh .grad, which the unit's fresh-gradient
    term already counts (counted twice, seed 20261225's Mixtral ZeRO-3 ep2 read +11 %; left out, −2.6 % here)."""
    cfg = Config.from_dict({
        "model": {"preset": preset, "layers": 8, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 4, "pp": 4, "ep": 2, "zero": 3, "schedule": "LoopedBFS", "virtual_stages": 2,
                     "microbatches": 8},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": grad_dtype,
                     "recompute": "selective"}})
    rank = predict(cfg).memory.per_rank[0]
    (term,) = [t for t in rank.catalogue("temporaries") if t.kind == "moe_backward"]
    assert term.formula.startswith(f"({buffers} + 2) × E_loc")
    _rank0_as_the_fake_holds_it(cfg, tmp_path, rel=0.01)


@pytest.mark.integration
def test_experts_that_replicate_leaves_out_make_their_gradients_in_the_first_backward(tmp_path):
    """FSDP2's replicate (ZeRO-0 with TP) leaves the routed experts out: their .grad are autograd's plain fp32 ones,
    made by the first backward (the select_backward buffers AccumulateGrad takes), not alive all step: rank 0 of a
    Mixtral 1F1B ep4 tp4 layout peaks in its first B with none of them yet (+7.9 % when they were). Their buffers are
    fp32 (the slice is taken of the fp32 parameter, cast after), and by the time two fresh ones are alive beside
    them the first expert's chain has freed its own tensors. (+2.1 % before the router's saved input was its fp32
    copy, 4 B an element on these 16-bit parameters; +3.2 % since, until FSDP2's fresh gradient of its largest
    unit stopped being the experts' — replicate leaves them out, their gradients are plain: +1.8 %.) With the
    experts' moment freeing a whole expert and the second's down projection (its weight casts too), the combine's
    backward outweighs it, as in the fake (three 256 MiB fp32 n·k·h tensors at its peak): +0.6 %."""
    cfg = Config.from_dict({
        "model": {"preset": "mixtral-8x7b", "layers": 8, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 64, "gpus_per_node": 8},
        "parallel": {"dp": 4, "tp": 4, "pp": 4, "ep": 4, "zero": 0, "schedule": "1F1B", "microbatches": 4},
        "training": {"micro_batch_size": 16, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "selective-layer", "recompute_every": 4}})
    rank = predict(cfg).memory.per_rank[0]
    assert rank.peak_moment.startswith("stage 0 B of microbatch 0")
    assert not [t for t in rank.explain("grads") if t.kind == "gradients"]
    (term,) = [t for t in rank.catalogue("temporaries") if t.kind == "moe_backward"]
    assert term.formula.startswith("3 × 4·n·k·h")  # the combine's three fp32 routed-copy tensors
    _rank0_as_the_fake_holds_it(cfg, tmp_path, rel=0.02)


@pytest.mark.integration
def test_left_out_experts_gradients_are_made_stage_by_stage_one_weight_at_a_time(tmp_path):
    """A rank of two stages (LoopedBFS): the routed experts replicate leaves out get their plain .grad at each stage's
    own first backward, so stage 2's second B holds stage 2's and none of stage 0's (which it had all step: +15 %).
    With one local expert (ep8 of 8) nothing is summed in autograd's input buffers: each weight's select_backward
    output goes to AccumulateGrad before the next weight's, two full-size tensors at a time. Since the router keeps its
    fp32 input copy (16-bit parameters) the rank peaks in stage 2's first B, where no gradient of either stage exists
    yet (+3.5 → +3.9 %); since FSDP2's fresh gradient is its largest unit's, not the experts' (replicate leaves them
    out), in stage 2's second B, +2.1 %."""
    cfg = Config.from_dict({
        "model": {"preset": "mixtral-8x7b", "layers": 8, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 64, "gpus_per_node": 8},
        "parallel": {"dp": 4, "tp": 8, "pp": 2, "ep": 8, "zero": 0, "schedule": "LoopedBFS", "virtual_stages": 2,
                     "microbatches": 2},
        "training": {"micro_batch_size": 8, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "selective-layer", "recompute_every": 2}})
    rank = predict(cfg).memory.per_rank[0]
    assert rank.peak_moment.startswith("stage 2 B of microbatch")
    held = {t.stage for t in rank.explain("grads") if t.kind in ("gradients", "plain_grads_accumulating")}
    assert held <= {2}  # never stage 0's, whose first backward comes later
    (term,) = [t for t in rank.catalogue("temporaries") if t.kind == "moe_backward"]
    assert term.formula.startswith("(0 + 2) × E_loc")
    _rank0_as_the_fake_holds_it(cfg, tmp_path, rel=0.025)


@pytest.mark.integration
def test_experts_gradients_moment_under_per_op_recompute(tmp_path):
    """Per-op selective recompute replays a MoE block's forward for its backward, and the experts' backward then makes
    the same full-size select_backward buffers as under any other policy (autocast: fp32, beside the accumulated
    .grad): a middle rank of Qwen3 30B-A3B Interleaved1F1B ep2 DDP peaks there (−6.8 % when that moment was not laid
    under this policy; seed 20261228's Qwen3 235B rows −6.8 … −9.9 → −1.2 … +0.4 %)."""
    cfg = Config.from_dict({
        "model": {"preset": "qwen3-30b-a3b", "layers": 8, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 4, "pp": 4, "ep": 2, "zero": 0, "schedule": "Interleaved1F1B", "virtual_stages": 2,
                     "microbatches": 8},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "selective-op"}})
    rank = next(r for r in predict(cfg).memory.per_rank if r.rank == 4)
    assert [t for t in rank.explain("temporaries") if t.kind == "moe_backward"]
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[4], timeout_s=300)
    (row,) = reserved_rows(res)
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.02)


@pytest.mark.integration
def test_the_combines_backward_over_a_per_op_replay(tmp_path):
    """With few local experts (ep32: 4 of 128) the experts' gradients weigh less than the combine's backward, which
    runs first in a MoE block's backward: over the per-op replay (less the weighted outputs, which index_add_'s node
    drops as checkpoint's unpack hook lets go of them) the cast's and the multiply's three fp32 n·k·h temporaries.
    A middle rank of Qwen3 30B-A3B Interleaved1F1B tp2 ep32 (seed 20261276 #14, m16 there: −4.9 % when the moment
    was not laid under this policy, +1.6 % with the weighted outputs left alive) peaks there."""
    cfg = Config.from_dict({
        "model": {"preset": "qwen3-30b-a3b", "layers": 8, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 256, "gpus_per_node": 8},
        "parallel": {"dp": 32, "tp": 2, "pp": 4, "ep": 32, "zero": 0, "schedule": "Interleaved1F1B",
                     "virtual_stages": 2, "microbatches": 4},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "selective-op"}})
    rank = next(r for r in predict(cfg).memory.per_rank if r.rank == 128)
    combine = [t for t in rank.explain("temporaries") if t.kind == "moe_backward"]
    assert combine and "its combine" in combine[0].label and " B of " in rank.peak_moment
    res = simulate(cfg, out_dir=tmp_path / "run", ranks=[128], timeout_s=300)
    (row,) = reserved_rows(res)
    assert rank.allocated == pytest.approx(row["max_allocated"], rel=0.015)
