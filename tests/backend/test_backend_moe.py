"""Mixture of experts in the backend: the MoE block from the spec, and expert parallelism run as
real torchrun ranks on CPU/gloo (all-to-all dispatch and combine), alone and with FSDP, TP and PP.

Every run is checked against an in-process single-replica reference (the same model, seed and
data, trained without any parallelism): equal losses mean the dispatch, the combine and the
expert-gradient reduction are right. States (params, grads, optimizer) are exact against
``engine.predict`` on every rank; the routed-token counts add up to tokens · top-k.
"""

from __future__ import annotations

import json

import pytest

from engine import Config, ConfigError, default_config
from engine.config import ModelSpec
from engine.model.params import param_counts

torch = pytest.importorskip("torch")

from backend.model import Router, SyntheticData, Transformer, count_parameters, moe_modules  # noqa: E402
from backend.parallel.expert_parallel import refusal  # noqa: E402

#: 3 blocks (one leading dense), 4 experts of top-2 with one shared expert
MOE = dict(layers=3, hidden=32, heads=4, kv_heads=4, ffn_hidden=64, vocab=128, seq_len=16, experts=4,
           experts_per_token=2, expert_ffn_hidden=32, shared_experts=1, dense_layers=1)


def moe_config(parallel: dict, model: dict | None = None, **sections) -> Config:
    par = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "microbatches": 2, **parallel}
    gpus = par["dp"] * par["tp"] * par["pp"]
    return default_config().replace(model={**MOE, **(model or {})}, cluster={"gpus": gpus}, parallel=par, **sections)


# --------------------------------------------------------------------------- the block, in process


@pytest.mark.parametrize("over", [{}, {"mlp": "gelu", "bias": True, "router_bias": True, "shared_experts": 0},
                                  {"dense_layers": 0, "router_score": "sigmoid", "router_balance_bias": True}])
def test_moe_parameter_count_is_the_engines(over):
    spec = ModelSpec(**{**MOE, **over})
    model = Transformer(spec)
    assert count_parameters(model) == param_counts(spec).total
    assert [m.index for m in moe_modules(model)] == list(range(spec.dense_layers, spec.layers))
    experts = moe_modules(model)[0].experts
    assert experts.w1.shape == (spec.experts, spec.expert_hidden, spec.hidden)  # torchtitan's (E, f, h)
    assert experts.w2.shape == (spec.experts, spec.hidden, spec.expert_hidden)


def test_dense_model_builds_as_before():
    model = Transformer(default_config().model)
    assert moe_modules(model) == []
    assert count_parameters(model) == param_counts(default_config().model).total


def test_router_top_k_and_scores():
    spec = ModelSpec(**MOE)
    torch.manual_seed(0)
    router = Router(spec)
    x = torch.randn(50, spec.hidden)
    scores, ids, probs = router(x)
    assert ids.shape == (50, 2) and scores.shape == (50, 2)
    assert torch.allclose(scores.sum(-1), torch.ones(50))  # norm_topk_prob
    assert torch.equal(ids.sort(-1).values, probs.topk(2, -1).indices.sort(-1).values)
    scaled = Router(ModelSpec(**{**MOE, "norm_topk_prob": False, "routed_scaling_factor": 2.5}))
    scaled.load_state_dict(router.state_dict())
    s2, _, p2 = scaled(x)
    assert torch.allclose(s2, 2.5 * p2.gather(-1, ids))


def test_moe_block_matches_a_per_token_loop_and_counts_its_tokens():
    spec = ModelSpec(**MOE)
    torch.manual_seed(0)
    model = Transformer(spec)
    moe = moe_modules(model)[0]
    x = torch.randn(2, spec.seq_len, spec.hidden)
    y = moe(x)
    scores, ids, _ = moe.router(x.reshape(-1, spec.hidden))
    e = moe.experts
    ref = []
    for t, tok in enumerate(x.reshape(-1, spec.hidden)):
        out = moe.shared_experts(tok)
        for k in range(spec.experts_per_token):
            i = int(ids[t, k])
            h = torch.nn.functional.silu(e.w1[i] @ tok) * (e.w3[i] @ tok)
            out = out + scores[t, k] * (e.w2[i] @ h)
        ref.append(out)
    assert torch.allclose(y.reshape(-1, spec.hidden), torch.stack(ref), atol=1e-5)
    assert int(moe.routed_counts.sum()) == 2 * spec.seq_len * spec.experts_per_token
    assert torch.equal(moe.routed_counts, moe.received_counts)  # no expert parallelism: every expert is local


def test_moe_model_trains_under_bf16_autocast():
    """Under CPU autocast (fp32 parameters, bf16 matmuls) the experts' outputs are bf16 and the residual
    stream fp32: the combine adds them in the block input's dtype (torchtitan's ``.to(x.dtype)``), where
    it once raised "index_add_(): self (Float) and source (BFloat16) must have the same scalar type"
    (found by benchmarks/accuracy.py --sweep 30 --seed 2026)."""
    spec = ModelSpec(**MOE)
    torch.manual_seed(0)
    model = Transformer(spec)
    x = torch.randint(0, spec.vocab, (2, spec.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().mean().backward()
    assert all(p.grad is not None for p in moe_modules(model)[0].experts.parameters())


def test_ep_must_divide_the_experts_and_the_dense_region():
    with pytest.raises(ConfigError) as err:
        moe_config({"dp": 3, "ep": 3})
    assert "parallel.ep" in str(err.value) and "model.experts (4)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        moe_config({"dp": 2, "ep": 4})
    assert "parallel.ep" in str(err.value) and "dp_shard·cp·tp" in str(err.value)


def test_layouts_the_backend_does_not_run_are_refused_with_the_field():
    assert "parallel.ep = 1 and parallel.tp > 1" in refusal(moe_config({"tp": 2}))
    assert "parallel.sequence_parallel" in refusal(moe_config({"tp": 2, "ep": 2, "sequence_parallel": True}))
    assert refusal(moe_config({"dp": 2, "ep": 2})) is None
    assert refusal(default_config()) is None


def test_records_read_the_token_counts_and_the_imbalance():
    from backend.records import expert_imbalance, expert_token_totals

    rank = {"rank": 0, "expert_tokens": [{"k": 1, "blocks": {}, "total": {"1": [2, 2, 2, 2]}},
                                         {"k": 2, "blocks": {}, "total": {"1": [8, 0, 0, 0]}}],
            "memory": {"expert_tokens": {"k": 3, "blocks": {}, "total": {"1": [1, 1, 1, 1], "2": [6, 2, 0, 0]}}}}
    assert expert_token_totals({"ranks": [rank]}) == [{"1": [2, 2, 2, 2]}, {"1": [8, 0, 0, 0]}]
    assert expert_imbalance({"ranks": [rank]}) == 3.0  # block 2 of the measured step: 6 over a mean of 2
    assert expert_token_totals({"ranks": [{"rank": 0}]}) == [] and expert_imbalance({"ranks": []}) is None


# --------------------------------------------------------------------------- runs


def reference_losses(cfg: Config, steps: int) -> list[float]:
    """The losses of ``cfg``'s run computed in this process without parallelism: each step's
    gradient is the mean over the dp replicas' local batches, as every data-parallel layout's."""
    from backend.train import SEED, _optimizer_cls_and_kwargs, loss_fn

    par = cfg.parallel
    torch.manual_seed(SEED)
    model = Transformer(cfg.model)
    cls, kw = _optimizer_cls_and_kwargs(cfg.training.optimizer)
    opt = cls(model.parameters(), **kw)
    data = SyntheticData(cfg.model.vocab, cfg.model.seq_len)
    mbs, m = cfg.training.micro_batch_size, par.microbatches
    out = []
    for k in range(1, steps + 1):
        total = 0.0
        for d in range(par.dp):
            x, y = data.batch(k, d, m * mbs)
            for i in range(m):
                loss = loss_fn(model(x[i * mbs:(i + 1) * mbs]), y[i * mbs:(i + 1) * mbs]) / m
                (loss / par.dp).backward()
                total += float(loss.detach()) / par.dp
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    return out


LAYOUTS = {
    "ep2": {"dp": 2, "ep": 2},
    "ep4": {"dp": 4, "ep": 4},
    "ep2 + FSDP (efsdp 2)": {"dp": 4, "ep": 2, "zero": 3},
    "ep2 + TP2": {"tp": 2, "ep": 2},
    "ep2 + PP2": {"dp": 2, "pp": 2, "ep": 2, "microbatches": 4},
    # HSDP: experts replicated over dp_replicate and (efsdp = dp_shard·tp/ep = 1) not sharded
    "ep2 + HSDP (replicate 2 × shard 2)": {"dp": 4, "replicate": 2, "zero": 3, "ep": 2},
    # no expert parallelism: the routed experts are in their block's FSDP unit, their expert dimension
    # (2) sharded over 4 ranks with padding, as torchtitan wraps them (not a unit of their own on dim 1)
    "FSDP4, 2 experts, no EP": ({"dp": 4, "zero": 3}, {"experts": 2, "experts_per_token": 1}),
}
STEPS = 3


@pytest.mark.integration
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_run(tmp_path, name):
    from backend.launch import launch
    from engine.compare.measured import compare
    from engine.predict import predict

    layout = LAYOUTS[name]
    cfg = moe_config(*layout) if isinstance(layout, tuple) else moe_config(layout)
    run = launch(cfg, tmp_path / "run", steps=STEPS, timeout_s=150)
    res = run.wait()
    assert res["event"] == "finished", f"{res.get('reason')}\n{res.get('log_tail')}"
    meas = run.measurement()
    par, m = cfg.parallel, cfg.model

    # the same training as without parallelism, and it learns
    assert meas.step.losses == pytest.approx(reference_losses(cfg, STEPS), rel=2e-5)
    assert meas.step.losses[-1] < meas.step.losses[0] - 0.3

    # params, grads, optimizer exact on every rank against the engine
    raw = json.loads((tmp_path / "run" / "measurement.json").read_text())
    cmp = compare(predict(cfg), raw)
    for row in cmp.memory:
        for cat in ("params", "grads", "optimizer"):
            assert row.categories[cat].error == 0, (name, row.rank, cat, row.categories[cat])

    # the tokens each expert received add up to tokens · top-k, per rank and over the model
    local_tokens = par.microbatches * cfg.training.micro_batch_size * m.seq_len // par.tp
    moe_blocks = [str(b) for b in range(m.dense_layers, m.layers)]
    totals = {}
    for rank in meas.ranks:
        steps = rank["expert_tokens"]
        assert [s["k"] for s in steps] == list(range(1, STEPS + 1))
        for s in steps:
            assert set(s["total"]) == set(moe_blocks)
            for block, counts in s["blocks"].items():
                assert len(counts["routed"]) == m.experts and len(counts["received"]) == m.experts // par.ep
                assert sum(counts["routed"]) == local_tokens * m.experts_per_token
                # per microbatch, in order: each forward's own counts, summing to the step's
                per_mb = counts["routed_microbatches"]
                assert len(per_mb) == par.microbatches == len(counts["received_microbatches"])
                assert [sum(c) for c in per_mb] == [local_tokens // par.microbatches * m.experts_per_token] * len(per_mb)
                assert [sum(x) for x in zip(*per_mb)] == counts["routed"]
                assert [sum(x) for x in zip(*counts["received_microbatches"])] == counts["received"]
                first = counts["first_expert"]
                totals.setdefault((s["k"], block), {})[first] = counts["received"]
    world_tokens = par.dp * par.microbatches * cfg.training.micro_batch_size * m.seq_len
    for rank in meas.ranks:
        for s in rank["expert_tokens"]:
            for total in s["total"].values():
                assert sum(total) == world_tokens * m.experts_per_token
    # with efsdp = 1 (one expert-parallel group per stage) each owner received exactly the total
    if par.dp * par.tp == par.ep:
        for (k, block), owners in totals.items():
            got = [c for first in sorted(owners) for c in owners[first]]
            step = next(s for s in meas.ranks[0]["expert_tokens"] if s["k"] == k)
            assert got == step["total"][block]


# --------------------------------------------------------------------------- planned routing (fake tensors)


def test_planned_routing_splits_the_copies_by_the_load():
    from backend.parallel.expert_parallel import planned_load, split_copies

    assert split_copies(10, (0.25,) * 4) == [3, 3, 2, 2]  # the first of equal remainders first
    assert split_copies(256, (0.5, 0.25, 0.125, 0.125)) == [128, 64, 32, 32]
    assert sum(split_copies(7, (0.1, 0.2, 0.3, 0.4))) == 7
    assert planned_load(moe_config({"dp": 2, "ep": 2})) == (0.25,) * 4
    told = moe_config({"dp": 2, "ep": 2}, conventions={"moe_expert_load": [0.4, 0.3, 0.2, 0.1]})
    assert planned_load(told) == (0.4, 0.3, 0.2, 0.1)


@pytest.mark.integration
def test_fake_measure_runs_a_mixture_of_experts(tmp_path):
    """``shardscope measure --fake`` on an ep-2 layout: fake tensors route by the planned (balanced)
    load, say so, and land near the engine's balanced prediction."""
    from backend.fake import simulate
    from engine.compare.measured import compare
    from engine.predict import predict

    # the accuracy matrix's MoE model: the tiny preset with 8 experts of top-2, one shared, one dense block
    tiny_moe = {"experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 128, "shared_experts": 1, "dense_layers": 1}
    cfg = default_config().replace(model=tiny_moe, cluster={"gpus": 2},
                                   parallel={"dp": 2, "ep": 2, "tp": 1, "pp": 1, "zero": 0, "microbatches": 2})
    run = simulate(cfg, tmp_path / "fake", [0], 240, None, False, 1)
    rec = run.records[0]
    assert any("mixture of experts: routing" in x for x in rec["not_covered"])
    assert rec["memory"]["expert_tokens"]["planned_load"] == [0.125] * 8
    rc = next(r for r in compare(predict(cfg), json.loads((run.path / "measurement.json").read_text())).memory
              if r.rank == 0)
    for cat in ("params", "grads", "optimizer"):
        assert rc.categories[cat].error == 0
    # the tracked peak (its activations are the moment's: here the engine's B of the second microbatch and the
    # fake's loss moment before it, 0.2 % apart in the engine — the all-to-all buffers live only while a MoE layer
    # runs, so the loss moment no longer holds them)
    assert rc.allocated is not None and abs(rc.allocated.relative_tracked) < 0.03


@pytest.mark.integration
def test_bf16_replicate_with_tp_and_ep_runs_its_fp32_experts(tmp_path):
    """FSDP2's ``replicate`` (ZeRO-0 with TP) leaves the routed experts out of its mixed-precision policy, so they
    stay fp32 beside its bf16 tokens: each expert matmul casts its slices (it raised "expected m1 and m2 to have the
    same dtype" before; tiny sweep seed 20261207 #07), and the engine lays those casts as under autocast."""
    from backend.launch import launch
    from engine.compare.measured import compare
    from engine.predict import predict

    cfg = Config.from_dict({
        "model": {"preset": "tiny", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 864,
                  "vocab": 384, "seq_len": 48, "mlp": "gelu", "experts": 8, "experts_per_token": 1,
                  "expert_ffn_hidden": 64, "shared_experts": 1},
        "cluster": {"preset": "local-cpu", "gpus": 4},
        "parallel": {"dp": 2, "tp": 2, "ep": 2, "microbatches": 2},
        "training": {"precision": "bf16-mixed", "grad_dtype": "bf16", "micro_batch_size": 1}})
    run = launch(cfg, tmp_path / "run", steps=2, timeout_s=150)
    res = run.wait()
    assert res["event"] == "finished", f"{res.get('reason')}\n{res.get('log_tail')}"
    pred = predict(cfg)
    from engine.memory.activations import moe_layer_terms

    casts = [x for label, x, _ in moe_layer_terms(cfg)[0] if "weight casts" in label]
    assert casts == [2 * 4 * 2 * 64 * 256]  # 4 local experts × 2 matrices (GeLU) × f·h in bf16, each forward
    from engine.compare.measured import states_exact

    measured = json.loads((tmp_path / "run" / "measurement.json").read_text())
    assert states_exact(pred, measured)  # parameters, gradients and optimizer states at their exact sizes
    assert abs(compare(pred, measured).summary()["allocated"]) <= 0.05
