"""What FSDP2 holds unsharded, filed by the measurement as what it is (``backend.measure._filing_fsdp_buffers``): the
gradient a unit accumulates across microbatches in the reduce dtype is FSDPMemTracker's "Unsharded Grad"
(comm_buffers), not the temporary its ``.to(reduce_dtype)`` made it, so the fake's categories are the engine's."""

from __future__ import annotations

import pytest

from backend.fake import simulate
from engine.config import Config
from engine.predict import predict


def _rank0_and_the_fakes_categories(cfg: Config, tmp_path):
    """The engine's rank 0 and ``measure --fake``'s categories of it (seconds)."""
    r = next(x for x in predict(cfg).memory.per_rank if x.rank == 0)
    run = simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300)
    (cats,) = [m["memory"]["categories"] for m in run.records]
    return r, cats


@pytest.mark.integration
def test_the_accumulated_unsharded_gradients_are_comm_buffers(tmp_path):
    """Llama 3 405B (8 blocks) s4K b4 dp16 tp4 SP ZeRO-3, two microbatches, fp32 gradients (seed 20261227
    #3ab2c0fc, cut to 2 blocks): the fake filed the 33.5 GiB of fp32 accumulations as temporaries (39.4 GiB beside
    the engine's 5.9), comm_buffers 0 beside the engine's 33.5."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-405b", "layers": 2, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 64, "gpus_per_node": 8},
        "parallel": {"dp": 16, "tp": 4, "zero": 3, "sequence_parallel": True, "microbatches": 2},
        "training": {"micro_batch_size": 4, "precision": "bf16-mixed", "grad_dtype": "fp32", "recompute": "none"}})
    r, cats = _rank0_and_the_fakes_categories(cfg, tmp_path)
    assert r.comm_buffers > 2**30
    assert cats["comm_buffers"] == pytest.approx(r.comm_buffers, rel=0.05)
    assert cats["temporaries"] == pytest.approx(r.temporaries, rel=0.05)


@pytest.mark.integration
def test_the_attention_phases_gradients_come_off_their_own_category_where_the_mlp_phase_is_the_moment(tmp_path):
    """Llama 3 405B (2 blocks) s64K b4 dp2 tp8 SP cp4 ZeRO-2 fp32, full recompute (seed 20261263 #38, cut to 2 blocks):
    the B's moment is the MLP's backward, larger than the ring attention's phase even with the MLP's and output
    projection's gradients that phase would hold; those 960 MiB are not made yet, and were laid in comm_buffers but
    taken off the temporaries (comm +15 %, temporaries −15 % against the fake; now both to the byte)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-405b", "layers": 2, "seq_len": 65536},
        "cluster": {"gpu": "h100-96g", "gpus": 64, "gpus_per_node": 8},
        "parallel": {"dp": 2, "tp": 8, "cp": 4, "zero": 2, "sequence_parallel": True},
        "training": {"micro_batch_size": 4, "precision": "fp32", "grad_dtype": "fp32", "recompute": "full"}})
    r, cats = _rank0_and_the_fakes_categories(cfg, tmp_path)
    assert r.peak_moment.startswith("stage 0 B of microbatch 0 (")
    assert cats["comm_buffers"] == pytest.approx(r.comm_buffers, rel=0.01)
    assert cats["temporaries"] == pytest.approx(r.temporaries, rel=0.01)


@pytest.mark.integration
def test_the_mlps_saved_tensors_gone_in_the_attention_phase_are_activations(tmp_path):
    """GPT-2 (8 blocks) s2K b16 HSDP dp4 (replicate 2) pp4 cp2 ZeRO-3 per-op selective recompute (seed 20261262 #26):
    a B's moment is the ring attention's phase, where the MLP's and its norm's saved tensors are gone; they came off
    the temporaries, which read activations +12.1 % against the fake (now +1.1 %)."""
    cfg = Config.from_dict({
        "model": {"preset": "gpt2-124m", "layers": 8, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
        "parallel": {"dp": 4, "replicate": 2, "pp": 4, "cp": 2, "zero": 3, "schedule": "1F1B", "microbatches": 4,
                     "fsdp_reshard_after_forward": "always"},
        "training": {"micro_batch_size": 16, "precision": "bf16-mixed", "grad_dtype": "bf16",
                     "recompute": "selective-op"}})
    r, cats = _rank0_and_the_fakes_categories(cfg, tmp_path)
    assert any(t.kind == "cp_saved_refiled" for t in r.explain("activations"))
    assert cats["activations"] == pytest.approx(r.activations, rel=0.03)


@pytest.mark.integration
def test_replicates_reduce_scatter_input_is_a_temporary(tmp_path):
    """Llama 3 405B (8 blocks) s32K dp4 tp4 SP ZeRO-1 (FSDP2's replicate over the DTensor parameters), bf16 gradients,
    full recompute (seed 20261263 #09): the peak late in the B holds layer 1's 1,520 MiB reduce-scatter input, which
    FSDPMemTracker names "Reduce Scatter" only at a ``_reduce_scatter_base_`` that replicate's shard group of one never
    calls — a temporary (comm_buffers +8 %, temporaries −42 % with it filed as comm)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-405b", "layers": 8, "seq_len": 32768},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 4, "tp": 4, "zero": 1, "sequence_parallel": True},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "grad_dtype": "bf16", "recompute": "full"}})
    r, cats = _rank0_and_the_fakes_categories(cfg, tmp_path)
    assert r.peak_moment.startswith("late in stage 0 B")
    assert cats["temporaries"] == pytest.approx(r.temporaries, rel=0.02)
    assert cats["comm_buffers"] == pytest.approx(r.comm_buffers, rel=0.02)
