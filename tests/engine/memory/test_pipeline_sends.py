"""What a pipeline schedule keeps of its sends (torch 2.13, torch/distributed/pipelining/schedules.py).

``_batch_p2p`` sends an all-send batch as plain ``dist.isend`` calls, and the Work of each holds its tensor
until the Work goes (gloo's ``SendWork::tensor_``; NCCL's ``WorkNCCL::outputs_``, which ``wait()`` keeps).
The multi-stage runtime keeps every send's Work in ``send_ops`` to the end of its actions, GPipe in
``fwd_sends_to_wait`` / ``bwd_sends_to_wait``; 1F1B keeps the last backward's (``bwd_sends``, then
``send_work``) until the next backward's send. So under the runtime and GPipe each B's input gradient sent to
another rank stays to the end of the backward (``moments``' ``ig``, beside a split backward's I's, which
stay on the receive buffer's ``.grad`` through the optimizer step too), and each stage output sent to another
rank outlives the B (or W) that frees the rest of its microbatch (``moments``' ``ho``; the stage's ``fwd_cache``,
then an I's ``backward_state``, drop it, the send's Work keeps it); the V-schedules hand a stage's tensors to the
rank's own next or previous stage without a send."""


import numpy as np
import pytest

from engine import Config
from engine.memory import memory_per_rank
from engine.memory.lifetimes import B_END, END, STEP, moments
from engine.pipeline.schedules import sends_held

TINY = {"preset": "tiny", "layers": 8, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn_hidden": 352,
        "vocab": 512, "seq_len": 64}
SBH = 4 * 64 * 2 * 128  # one microbatch's fp32 input gradient: 4 B × s·b·h


def _cfg(schedule: str, v: int = 1, m: int = 4, recompute: str = "none", pp: int = 2) -> Config:
    return Config.from_dict({
        "model": TINY, "cluster": {"preset": "local-cpu", "gpus": pp, "gpus_per_node": pp},
        "parallel": {"pp": pp, "schedule": schedule, "virtual_stages": v, "microbatches": m},
        "training": {"micro_batch_size": 2, "precision": "fp32", "recompute": recompute}})


def test_which_schedules_keep_their_sends():
    assert sends_held("1F1B") == "last_backward"
    for s in ("GPipe", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert sends_held(s) == "all"
    with pytest.raises(ValueError, match="allowed"):
        sends_held("1F2B")


def _kept(schedule: str, pp_rank: int, v: int = 1, m: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Per local stage, the kept input gradients at the end of the backward and at the optimizer step."""
    mo = moments(schedule, pp_rank, 2, v, m)
    return mo.ig[np.flatnonzero(mo.phase == END)[-1]], mo.ig[np.flatnonzero(mo.phase == STEP)[-1]]


def test_a_sent_input_gradient_is_kept_to_the_end_of_the_backward():
    # GPipe pp2: stage 1 sends each of its 4 B's gradients to stage 0 (the first stage sends none)
    end, step = _kept("GPipe", 1)
    assert end.tolist() == [4] and step.tolist() == [0]
    assert _kept("GPipe", 0)[0].tolist() == [0]
    # 1F1B keeps only the last one: the held_input_gradient term, not a count per B
    assert _kept("1F1B", 1)[0].tolist() == [0]
    # DualPipeV pp2: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Stage 3 sends to stage 2 (rank 1) and
    # stage 1 to stage 0 (rank 0): kept, one per B or I; stage 2 hands its gradient to stage 1 on its own rank
    mo = moments("DualPipeV", 1, 2, 2, 8)
    end = mo.ig[np.flatnonzero(mo.phase == END)[-1]].tolist()
    n_i = [int(((mo.kind == 2) & (mo.stage == s) & (mo.phase == 0)).sum()) for s in (1, 2)]
    assert end == [8, n_i[1]] and n_i[1] < 8
    step = mo.ig[np.flatnonzero(mo.phase == STEP)[-1]].tolist()
    assert step == n_i  # the optimizer step: only the I's, on their receive buffers' .grad


def test_the_kept_gradients_are_one_term_per_stage_and_1f1b_keeps_one():
    ranks = memory_per_rank(_cfg("GPipe")).per_rank
    (t,) = [t for t in ranks[1].catalogue("temporaries") if t.kind == "input_gradients_kept"]
    assert (t.stage, t.in_flight, t.bytes) == (1, 4, 4 * SBH) and "one per B (4)" in t.label
    assert not [t for r in ranks for t in r.catalogue("temporaries") if t.kind == "held_input_gradient"]
    assert not [t for t in ranks[0].catalogue("temporaries") if t.kind == "input_gradients_kept"]
    ranks = memory_per_rank(_cfg("1F1B")).per_rank
    assert [t.bytes for t in ranks[1].catalogue("temporaries") if t.kind == "held_input_gradient"] == [SBH]
    assert not [t for t in ranks[1].catalogue("temporaries") if t.kind == "input_gradients_kept"]


def test_the_peak_holds_the_gradients_sent_by_then():
    """Interleaved1F1B pp2 v2 m4, full recompute: pp rank 1 (stages 1 and 3) peaks in stage 3's last B, its
    three earlier B's gradients sent to stage 2 on rank 0 kept, and the two of stage 1's B's run by then (sent to
    stage 0 on rank 0)."""
    r = memory_per_rank(_cfg("Interleaved1F1B", v=2, recompute="full")).per_rank[1]
    assert r.peak_moment.startswith("stage 3 B of microbatch 3")
    kept = {t.stage: t.bytes for t in r.explain("temporaries") if t.kind == "input_gradients_kept"}
    assert kept == {1: 2 * SBH, 3: 3 * SBH}


def test_a_sent_output_outlives_its_microbatch_to_the_end_of_the_backward():
    # GPipe pp2: stage 0 sends each output to stage 1; after each B the output stays, none at the optimizer step
    mo = moments("GPipe", 0, 2, 1, 4)
    end, step = np.flatnonzero(mo.phase == END)[-1], np.flatnonzero(mo.phase == STEP)[-1]
    assert mo.ho[end].tolist() == [4] and mo.ho[step].tolist() == [0]
    b = np.flatnonzero((mo.kind == 1) & (mo.phase == 0))
    assert mo.ho[b].ravel().tolist() == [0, 1, 2, 3]  # a B's own moment still holds it in the microbatch
    assert not moments("GPipe", 1, 2, 1, 4).ho.any()  # the last stage sends no output
    assert not moments("1F1B", 0, 2, 1, 4).ho.any()  # 1F1B's fwd_cache is all that keeps one
    # a split backward's I keeps the output in backward_state: it leaves the microbatch at the W
    mo = moments("ZBVZeroBubble", 1, 2, 2, 4)  # stages 1 and 2: stage 2 sends to stage 3 on rank 0
    w2 = np.flatnonzero((mo.kind == 3) & (mo.stage == 2) & (mo.phase == 0))
    i2 = np.flatnonzero((mo.kind == 2) & (mo.stage == 2) & (mo.phase == 0))
    assert mo.ho[w2, 1].tolist() == [0, 1, 2, 3] and mo.ho[i2[1], 1] == 1 and not mo.ho[:, 0].any()


def test_the_sent_outputs_are_one_activation_term_per_stage_on_the_peak():
    """GPipe pp2, rank 0: its peak is a B's, the outputs of the B's before it kept beside the microbatches still
    in flight; ZBVZeroBubble pp2 v2, rank 1: the W of microbatch 2 of stage 2, two outputs past their W."""
    ranks = memory_per_rank(_cfg("GPipe", m=8)).per_rank
    (t,) = [t for t in ranks[0].catalogue("activations") if t.kind == "stage_outputs_sent"]
    assert (t.stage, t.in_flight, t.bytes) == (0, 8, 8 * SBH)
    assert not [t for t in ranks[1].catalogue("activations") if t.kind == "stage_outputs_sent"]
    r = memory_per_rank(_cfg("ZBVZeroBubble", v=2)).per_rank[1]
    assert r.peak_moment.startswith("stage 2 W of microbatch 2")
    assert [(t.stage, t.bytes) for t in r.explain("activations") if t.kind == "stage_outputs_sent"] == [(2, 2 * SBH)]


@pytest.mark.integration
@pytest.mark.parametrize("schedule, v, rank, recompute", [("Interleaved1F1B", 2, 1, "full"),
                                                          ("ZBVZeroBubble", 2, 1, "none"),
                                                          ("InterleavedZeroBubble", 2, 0, "none")])
def test_the_fake_keeps_what_the_schedule_keeps_of_its_sends(schedule, v, rank, recompute):
    """``measure --fake`` runs no send, so backend.fake_worker keeps each sent tensor as the schedule's Works do
    (``_FakeTrainer._sent``), and the engine lays them: the fake's activations are the engine's (before, both
    were two stage outputs short of what torch keeps), and on Interleaved1F1B its temporaries too (before, the
    fake held three input gradients fewer)."""
    pytest.importorskip("torch")
    import backend.fake_worker as fw

    cfg = _cfg(schedule, v=v, recompute=recompute)
    e = memory_per_rank(cfg).per_rank[rank]
    f = fw.simulate_rank(cfg, rank)["memory"]["categories"]
    assert abs(f["activations"] - e.activations) <= 1024
    assert f["grads"] == e.grads and f["comm_buffers"] == e.comm_buffers
    if schedule == "Interleaved1F1B":
        assert abs(f["temporaries"] - e.temporaries) <= 1024


def test_the_first_stage_output_at_its_b_end_is_counted_once():
    """The residual-stream tensor measured alive at the end of the first stage's B (``embedding_output_kept``) is
    the stage output ``backward_one_chunk`` still holds: where the send's Work holds it too, the sent outputs count
    it (GPipe: no such term, the B's end holds its output in ``ho``); 1F1B keeps the term."""
    r = memory_per_rank(_cfg("GPipe")).per_rank[0]
    assert not [t for t in r.catalogue("activations") if t.kind == "embedding_output_kept"]
    mo = moments("GPipe", 0, 2, 1, 4, b_end=True)
    ends = np.flatnonzero(mo.phase == B_END)
    assert mo.ho[ends].ravel().tolist() == [1, 2, 3, 4]
    r = memory_per_rank(_cfg("1F1B")).per_rank[0]
    assert [t.bytes for t in r.catalogue("activations") if t.kind == "embedding_output_kept"] == [SBH]
