"""Context parallelism in the backend: the sharded attention's numerics, then real gloo ranks.

Numerics: eager attention (one process) — each cp-rank's head-tail shard of the queries, against K, V
gathered in the order the all-gather concatenates them, under the mask of its chunks, gives exactly the
rows of full causal attention at its positions, forward and gradients; flash attention (real gloo ranks)
— torch's ring-attention template on the CPU flash kernel gives each rank those rows too.

Integration (torchrun, gloo, ≤ 4 ranks, a 2-layer tiny model, one step each): cp ∈ {2, 4} alone (eager;
flash, which runs torch's ring-attention template on the CPU flash kernel, with either rotate method),
cp 2 with FSDP (dp 2), cp 2 with TP 2. The loss of step 1 equals the cp = 1 training's loss (same seed,
same data), and params, grads and optimizer bytes are exactly the engine's on every rank.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from backend.model import AttentionCore, rope  # noqa: E402
from backend.parallel.context_parallel import causal_mask, head_tail_positions  # noqa: E402
from engine import default_config  # noqa: E402
from engine.memory.lifetimes import PARTIAL_STATE_KINDS  # noqa: E402


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_head_tail_positions_are_torchs_load_balancer(cp):
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    seq = 48
    torch_order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0].long()
    ours = torch.cat([head_tail_positions(seq, cp, r) for r in range(cp)])
    assert torch.equal(ours, torch_order)
    for r in range(cp):  # chunks r and 2·cp−1−r of 2·cp
        c = seq // (2 * cp)
        p = head_tail_positions(seq, cp, r)
        assert p.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]


def test_head_tail_refuses_a_sequence_it_cannot_split():
    with pytest.raises(ValueError, match="divisible by 2·cp = 6"):
        head_tail_positions(64, 3, 0)


def _full_and_sharded(cp: int, seed: int = 0):
    """Full causal attention's output and input gradients, and the same from every cp-rank's shard
    (K, V gathered by concatenating the ranks' shards, the gradients of K, V summed over the ranks
    as the reduce-scatter sums them)."""
    g = torch.Generator().manual_seed(seed)
    b, heads, seq, d = 2, 4, 32, 8
    q, k, v = (torch.randn(b, seq, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
    core = AttentionCore("eager", 0.0)

    def full():
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        qr, kr = rope(qf).transpose(1, 2), rope(kf).transpose(1, 2)
        out = core(qr, kr, vf.transpose(1, 2))
        out.backward(dout)
        return out.detach(), qf.grad, kf.grad, vf.grad

    ref_out, ref_dq, ref_dk, ref_dv = full()
    order = torch.cat([head_tail_positions(seq, cp, r) for r in range(cp)])
    leaves = [tuple(t[:, head_tail_positions(seq, cp, r)].clone().requires_grad_() for t in (q, k, v))
              for r in range(cp)]
    # the all-gather: every rank's rotary K and V, concatenated in rank order
    ks = [rope(lk, positions=head_tail_positions(seq, cp, r)).transpose(1, 2) for r, (_, lk, _) in enumerate(leaves)]
    vs = [lv.transpose(1, 2) for _, _, lv in leaves]
    k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    outs = []
    for r, (lq, _, _) in enumerate(leaves):
        pos = head_tail_positions(seq, cp, r)
        qr = rope(lq, positions=pos).transpose(1, 2)
        out = core(qr, k_all, v_all, ~causal_mask(pos, order))
        outs.append(out)
    torch.autograd.backward(outs, [dout[:, :, head_tail_positions(seq, cp, r)] for r in range(cp)])
    out = torch.empty_like(ref_out)
    dq, dk, dv = (torch.empty_like(ref_dq) for _ in range(3))
    for r, (lq, lk, lv) in enumerate(leaves):
        pos = head_tail_positions(seq, cp, r)
        out[:, :, pos] = outs[r].detach()
        dq[:, pos], dk[:, pos], dv[:, pos] = lq.grad, lk.grad, lv.grad
    return (ref_out, ref_dq, ref_dk, ref_dv), (out, dq, dk, dv)


@pytest.mark.parametrize("cp", [2, 4])
def test_sharded_eager_attention_equals_full_attention(cp):
    ref, got = _full_and_sharded(cp)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def _ring_rank(rank: int, cp: int, rotate: str, init: str, n_rep: int) -> None:
    """One cp-rank: its head-tail shard of Q, K, V through RingFlashAttention on a gloo group, checked
    against full causal attention's rows at its positions (output, and the gradients of its Q, K, V)."""
    import torch.distributed as dist

    from backend.parallel.context_parallel import ContextParallel, RingFlashAttention

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cp)
    try:
        g = torch.Generator().manual_seed(7)
        b, heads, seq, d = 2, 4, 32, 8
        q = torch.randn(b, heads, seq, d, generator=g)
        k, v = (torch.randn(b, heads // n_rep, seq, d, generator=g) for _ in range(2))
        dout = torch.randn(b, heads, seq, d, generator=g)
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(n_rep, 1), vf.repeat_interleave(n_rep, 1),
                                             is_causal=True)
        ref.backward(dout)
        cpx = ContextParallel(dist.group.WORLD, seq, torch.device("cpu"), "flash", rotate)
        pos = cpx.positions
        lq, lk, lv = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        out = RingFlashAttention.apply(lq, lk, lv, cpx, n_rep)
        # the output gradient arrives as the model's attention makes it: the transposed view of a (b, s, heads, d)
        # tensor; the ring reads it as it comes, as CUDA's flash backward does (no contiguous copy of it)
        copies = []

        class Copies(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                res = func(*args, **(kwargs or {}))
                if func in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default) and res.shape == out.shape:
                    copies.append(func)
                return res

        with Copies():
            out.transpose(1, 2).backward(dout[:, :, pos].transpose(1, 2).contiguous())
        assert copies == []
        torch.testing.assert_close(out.detach(), ref.detach()[:, :, pos], rtol=1e-4, atol=1e-5)
        for name, got, want in (("dq", lq.grad, qf.grad), ("dk", lk.grad, kf.grad), ("dv", lv.grad, vf.grad)):
            torch.testing.assert_close(got, want[:, :, pos], rtol=1e-4, atol=1e-5, msg=name)
        # no rank tears its group down while a peer's last ring exchange is in flight: gloo aborts the process
        # ("terminate called without an active exception", SIGABRT; about one run in four without it)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp,rotate,n_rep", [(2, "allgather", 1), (4, "allgather", 2), (2, "alltoall", 2),
                                             (4, "alltoall", 1)])
def test_ring_flash_attention_equals_full_attention(tmp_path, cp, rotate, n_rep):
    """torch's ring-attention template on the CPU flash kernel, as the backend runs it (real gloo ranks):
    each rank's shard of the output and of the Q, K, V gradients equals full causal attention's."""
    import torch.multiprocessing as mp

    mp.spawn(_ring_rank, args=(cp, rotate, f"file://{tmp_path / 'init'}", n_rep), nprocs=cp, join=True)


# --------------------------------------------------------------------------- real ranks

SMALL = {"layers": 2}  # the tiny preset with two blocks: seconds per run


def _reference_first_loss(cfg) -> float:
    """Step 1's loss of the same training with cp = 1 on one process: the mean over the dp ranks'
    batches (what the ranks' mean reports), same seed and initial weights."""
    from backend.model import SyntheticData, Transformer
    from backend.train import SEED, loss_fn

    torch.manual_seed(SEED)
    model = Transformer(cfg.model)
    data = SyntheticData(cfg.model.vocab, cfg.model.seq_len)
    par, mbs = cfg.parallel, cfg.training.micro_batch_size
    losses = []
    with torch.no_grad():
        for d in range(par.dp):
            x, y = data.batch(1, d, par.microbatches * mbs)
            losses.append(sum(float(loss_fn(model(x[i * mbs:(i + 1) * mbs]), y[i * mbs:(i + 1) * mbs]))
                              for i in range(par.microbatches)) / par.microbatches)
    return sum(losses) / len(losses)


CASES = {
    "cp2": ({"cp": 2}, {}),
    "cp4 flash": ({"cp": 4}, {"attention": "flash"}),
    "cp2 flash ring": ({"cp": 2, "cp_rotate": "alltoall"}, {"attention": "flash"}),
    "cp2 + FSDP dp2": ({"cp": 2, "dp": 2, "zero": 3}, {}),
    "cp2 + TP2": ({"cp": 2, "tp": 2}, {}),
    # the attention core's checkpoint ("selective") around the ring, as torch's context_parallel runs it on CUDA
    "cp2 flash selective": ({"cp": 2}, {"attention": "flash"}, {"recompute": "selective"}),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_run_matches_cp1_loss_and_engine_states(tmp_path, case):
    from backend.launch import launch
    from engine.predict import predict

    par, model, *training = CASES[case]
    p = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "microbatches": 1, **par}
    gpus = p["dp"] * p["cp"] * p["tp"]
    cfg = default_config().replace(cluster={"gpus": gpus}, parallel=p, model={**SMALL, **model},
                                   **({"training": training[0]} if training else {}))
    run = launch(cfg, tmp_path / "run", steps=1, timeout_s=150)
    list(run.events())
    res = run.wait()
    assert res["event"] == "finished", f"{res.get('reason')}\n{res.get('log_tail')}"
    meas = run.measurement()
    assert meas.step.losses[0] == pytest.approx(_reference_first_loss(cfg), abs=1e-5)
    pred = {r.rank: r for r in predict(cfg).memory.per_rank}
    assert len(meas.memory.per_rank) == gpus
    exact = {r["rank"]: r["memory"]["exact"] for r in meas.ranks}
    for row in meas.memory.per_rank:
        # the states at their exact sizes, whole (plain .grad comes with the first backward, FSDP2's sharded
        # gradients with the reducing post-backward: which a peak holds is not the states' business)
        for c in ("params", "grads", "optimizer"):
            assert exact[row.rank][c] == sum(t.bytes for t in pred[row.rank].catalogue(c)
                                             if t.kind not in PARTIAL_STATE_KINDS), (row.rank, c)
        assert row.activations > 0
    detail = meas.ranks[0]
    assert detail["coords"]["cp"] == 0 and {r["coords"]["cp"] for r in meas.ranks} == set(range(p["cp"]))
    want = (f"torch's ring attention (its _templated_ring_attention, rotate method {cfg.parallel.cp_rotate})"
            if cfg.model.attention == "flash" else "all-gather K/V variant")
    assert any(want in n for n in detail["memory"]["notes"]), detail["memory"]["notes"]
