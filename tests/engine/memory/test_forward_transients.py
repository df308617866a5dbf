"""What a forward's own moment holds beyond its microbatch's saved tensors: the last block's down projection at its
tensor-parallel collective (torch 2.13 _functional_collectives.py: ``reduce_scatter_single`` copies a scatter_dim-1
input to dim-0 chunk order first, ``all_reduce`` returns a new tensor; DTensor's Partial -> Shard(1) under sequence
parallelism, Partial -> Replicate without it), filed with the activations as torch's MemTracker files every tensor a
forward makes."""

import pytest

from engine import Config
from engine.memory import memory_per_rank

TINY = {"preset": "tiny", "layers": 4, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn_hidden": 352,
        "vocab": 512, "seq_len": 64}
SBH = 64 * 2 * 128  # s·b·h of one microbatch (micro-batch 2)


def _term(tp: int, sp: bool, recompute: str = "none") -> int:
    c = Config.from_dict({
        "model": TINY, "cluster": {"preset": "local-cpu", "gpus": tp, "gpus_per_node": tp},
        "parallel": {"tp": tp, "sequence_parallel": sp},
        "training": {"micro_batch_size": 2, "precision": "fp32", "recompute": recompute}})
    r = memory_per_rank(c).per_rank[0]
    terms = [t for t in r.catalogue("activations") if t.kind == "forward_down_projection"]
    assert not [t for t in r.catalogue("temporaries") if t.kind == "forward_down_projection"]
    return sum(t.bytes for t in terms)


@pytest.mark.parametrize(("tp", "sp", "expected"), [
    (1, False, 4 * SBH),  # w2's output y beside the residual add's
    (2, False, 4 * SBH),  # y (a partial sum) and all_reduce's new tensor, less the add's output not yet made
    (2, True, 8 * SBH),  # y, its dim-0 copy and the s·b·h/t reduce-scatter output, less the add's s·b·h/t
])
def test_the_down_projection_at_its_collective(tp, sp, expected):
    assert _term(tp, sp) == expected


def test_the_per_op_policy_keeps_what_it_stashes_out_of_it():
    """Per-op selective recompute stashes mm and reduce-scatter outputs: they are the microbatch's saved tensors."""
    assert _term(2, True, "selective-op") < _term(2, True)


def test_a_1f1b_first_stage_can_peak_in_its_last_warm_up_forward():
    """measure --fake of Llama 3 405B, dp16 tp8 SP pp4 1F1B, 4 microbatches of 4 × 8K, no recompute (seed 20261260
    #22): stage 0 peaks in its fourth forward's last reduce-scatter, 2 × s·b·h (2 GiB) beyond the forward's saved
    tensors, above its first backward; the engine said the first B (allocated −1.0 %, activations −5.6 %, temporaries
    1.6 GiB where the fake has none) and now says that F (−0.2 %, activations −0.3 %)."""
    c = Config.from_dict({
        "model": {"preset": "llama3-405b", "layers": 8, "seq_len": 8192},
        "cluster": {"gpu": "h100-96g", "gpus": 512, "gpus_per_node": 8},
        "parallel": {"dp": 16, "tp": 8, "sequence_parallel": True, "pp": 4, "schedule": "1F1B", "microbatches": 4},
        "training": {"micro_batch_size": 4, "precision": "bf16-mixed", "grad_dtype": "bf16"}})
    r = memory_per_rank(c).per_rank[0]
    assert r.peak_moment.startswith("stage 0 F of microbatch 3")
    sbh = 8192 * 4 * 16384
    assert [t.bytes for t in r.explain("activations") if t.kind == "forward_down_projection"] == [2 * 2 * sbh]
