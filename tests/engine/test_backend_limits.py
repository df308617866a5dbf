"""Layouts the engine predicts but ShardScope's backend cannot run: named before anything runs, and
marked "predict only" wherever the engine shows them (predict, the planner, the window)."""

import dataclasses

import pytest

from engine import Config
from engine.backend_limits import composition_problems, predict_only
from engine.plan.search import plan
from engine.predict import predict
from gui.planning import LAYOUT_COLUMN, PlanOutcome
from gui.runnable import runnable_version
from gui.text import prediction_table


def cfg(tied: bool = False, **parallel):
    par = {"dp": 1, "tp": 2, "pp": 1, **parallel}
    return Config.from_dict({"model": {"preset": "tiny", "tied_embeddings": tied},
                             "cluster": {"gpu": "cpu", "gpus": par["dp"] * par["tp"]},
                             "parallel": par, "training": {"precision": "fp32"}})


def test_tied_embeddings_with_tp_are_named_with_what_runs_instead():
    problems = composition_problems(cfg(tied=True, dp=2))
    assert len(problems) == 1 and "tied embeddings" in problems[0] and "tied_embeddings = false" in problems[0]
    assert composition_problems(cfg(dp=2, zero=1)) == []  # ZeRO-1 with TP runs (TensorParallelZeRO1)


def test_the_window_does_not_offer_to_run_it():
    r = runnable_version(cfg(tied=True, dp=2))
    assert r.config is None and not r.is_original
    assert "cannot run with PyTorch's APIs" in r.describe() and "tied embeddings" in r.describe()
    ok = runnable_version(cfg(dp=2, zero=1))
    assert ok.is_original and ok.config is not None and ok.describe() == ""


def test_a_runnable_version_that_would_hit_it_is_refused_too():
    big = Config.from_dict({"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "gpus": 4},
                            "parallel": {"dp": 2, "tp": 2}, "training": {"finetune": "lora"}})
    r = runnable_version(big)  # the tiny model on CPU ranks keeps the layout: LoRA with tp 2
    assert r.config is None and "LoRA with tp > 1" in r.describe()


#: every shipped model preset, planned on a cluster it fits (the planner's top 10 of each are checked)
PRESET_CLUSTERS = {"tiny": ("cpu", 4, 4), "gpt2-124m": ("a100-40g", 8, 8), "llama2-7b": ("a100-80g", 16, 8),
                   "llama3-8b": ("h100-sxm", 16, 8), "llama3-70b": ("h100-sxm", 64, 8),
                   "llama3-405b": ("h100-sxm", 512, 8), "mixtral-8x7b": ("h100-sxm", 64, 8),
                   "qwen3-30b-a3b": ("h100-sxm", 16, 8), "qwen3-235b-a22b": ("h100-sxm", 256, 8),
                   "gpt-oss-20b": ("h100-sxm", 16, 8), "gpt-oss-120b": ("h100-sxm", 64, 8),
                   "deepseek-v3": ("h100-sxm", 1024, 8)}


def _backend_refusal(cfg: Config) -> str | None:
    """What the backend says before it builds anything for ``cfg`` (its own checks, no launch): its
    refusal in words, or None."""
    from backend.model import refuse_unsupported
    from backend.train import check_supported

    try:
        refuse_unsupported(cfg.model)
        check_supported(cfg)
    except NotImplementedError as exc:
        return str(exc)
    return None


def test_every_shipped_preset_has_a_cluster_here():
    from engine.model.presets import model_presets

    assert set(PRESET_CLUSTERS) == set(model_presets())


@pytest.mark.parametrize("preset", sorted(PRESET_CLUSTERS))
def test_the_planners_top_10_are_each_run_by_the_backend_or_marked_predict_only(preset):
    """Without launching: each of the planner's top 10 for each shipped preset is either accepted by the
    backend's own checks or marked predict only with the backend's own words, never both or neither;
    with runnable_only the backend accepts every one."""
    gpu, gpus, per_node = PRESET_CLUSTERS[preset]
    result = plan(preset, gpus, gpu, per_node, top=10)
    assert result.entries, preset
    for e in result.entries:
        refusal = _backend_refusal(e.config)
        assert (refusal is None) == (not e.predict_only), (preset, e.label(), refusal, e.predict_only)
        if refusal is not None:
            assert refusal in e.predict_only
    runnable = plan(preset, gpus, gpu, per_node, top=10, runnable_only=True)
    assert all(_backend_refusal(e.config) is None and not e.predict_only for e in runnable.entries)
    if any(e.predict_only for e in result.entries):  # they were left out, and said so
        assert runnable.counts.predict_only_skipped > 0


def test_predict_and_the_planner_say_predict_only_in_words():
    oss = Config.from_dict({"model": {"preset": "gpt-oss-20b"}, "cluster": {"gpu": "h100-sxm", "gpus": 16},
                            "parallel": {"dp": 8, "tp": 2, "ep": 2, "zero": 2}})
    pred = predict(oss)
    assert pred.predict_only == predict_only(oss) and any("attention_sinks" in w for w in pred.predict_only)
    assert "predict only: ShardScope's backend cannot run this layout" in prediction_table(pred)
    assert pred.to_json()["predict_only"] == pred.predict_only
    plain = predict(cfg(dp=2, zero=2))
    assert plain.predict_only == [] and "predict only" not in prediction_table(plain)
    result = plan("llama3-8b", 16, "h100-sxm", 8, top=10).to_json()
    result["entries"] += plan("gpt-oss-20b", 16, "h100-sxm", 8, top=3).to_json()["entries"]
    outcome = PlanOutcome(result)
    marked = [i for i, e in enumerate(result["entries"]) if e["predict_only"]]
    assert marked == list(range(10, 13))  # gpt-oss's attention sinks and sliding windows are not built
    for i, row in enumerate(outcome.rows()):
        assert row[LAYOUT_COLUMN].endswith(" · predict only") == (i in marked)
        assert any(w.startswith("predict only") for w in outcome.why(i)) == (i in marked)


def test_the_window_does_not_offer_to_run_a_model_the_backend_does_not_build():
    small = {"layers": 2, "experts": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "expert_ffn_hidden": 32,
             "ffn_hidden": 128, "vocab": 256, "seq_len": 32, "experts_per_token": 2}
    oss = Config.from_dict({"model": {"preset": "qwen3-30b-a3b", **small, "attention_sinks": True},
                            "cluster": {"gpu": "cpu", "gpus": 2}, "parallel": {"dp": 2}})
    r = runnable_version(oss)
    assert r.config is None and "attention_sinks" in r.describe()
    qwen = runnable_version(oss.replace(model={"attention_sinks": False}))  # qk_norm: built
    assert qwen.is_original and qwen.config is not None


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_per_op_recompute_with_a_split_backward_is_predict_only(schedule):
    bad = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 2},
                            "parallel": {"pp": 2, "schedule": schedule, "virtual_stages": 2,
                                         "microbatches": 8 if schedule == "DualPipeV" else 4},
                            "training": {"recompute": "selective-op"}})
    (problem,) = composition_problems(bad)
    assert problem.startswith("training.recompute = 'selective-op'") and "backward an extra time" in problem
    for ok in ("selective-layer", "full", "none"):
        assert composition_problems(bad.replace(training={"recompute": ok})) == []
    assert composition_problems(bad.replace(parallel={"schedule": "Interleaved1F1B"})) == []


def test_torchs_selective_checkpoint_cannot_be_backwarded_as_a_zero_bubble_stage_does():
    """The rule's reason, measured: a block under the backend's per-op selective checkpoint, backwarded
    for its input's gradient and then for its weights' (what torch.distributed.pipelining's I and W
    actions do), raises on the second (found by benchmarks/accuracy.py --sweep 30 --seed 2026, DualPipeV)."""
    torch = pytest.importorskip("torch")
    from backend.model import Transformer
    from backend.parallel.recompute import apply_recompute
    from engine import default_config

    spec = dataclasses.replace(default_config().model, layers=1)
    model = Transformer(spec)
    apply_recompute(model, "selective-op", 2)
    block = model.layers["0"]
    h = torch.randn(2, spec.seq_len, spec.hidden, requires_grad=True)
    y = block(h).sum()
    torch.autograd.grad(y, h, retain_graph=True)  # I: the input's gradient
    with pytest.raises(RuntimeError, match="backward an extra time"):
        torch.autograd.grad(y, [p for p in block.parameters()])  # W: the weights'


def test_a_launch_of_a_predict_only_layout_is_refused_before_anything_starts(tmp_path):
    pytest.importorskip("torch")
    from backend.launch import launch

    bad = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 2},
                            "parallel": {"pp": 2, "schedule": "ZBVZeroBubble", "virtual_stages": 2,
                                         "microbatches": 4}, "training": {"recompute": "selective-op"}})
    run = launch(bad, tmp_path / "run", steps=1)
    assert run.refused and "predict only" in run.wait()["reason"]
    assert not (tmp_path / "run").exists()  # nothing written


#: a small mixture of experts: 4 blocks, 8 routed experts of top-2
SMALL_MOE = dict(preset="tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=300, seq_len=64,
                 experts=8, experts_per_token=2, expert_ffn_hidden=32)


def _moe_pp(**parallel):
    par = {"dp": 2, "pp": 2, "zero": 3, "schedule": "GPipe", "microbatches": 4, **parallel}
    return Config.from_dict({"model": SMALL_MOE, "cluster": {"gpu": "cpu", "gpus": par["dp"] * par["pp"]},
                             "parallel": par, "training": {"recompute": "selective-op", "precision": "bf16-mixed"}})


def test_per_op_recompute_of_gathered_fsdp_experts_under_a_pipeline_is_predict_only():
    """Found by benchmarks/fake_sweep.py --seed 2612 (#34, Qwen3 30B LoopedBFS ep4 ZeRO-3) and run again on
    four CPU ranks of this model (GPipe, ZeRO-3 'default', ep 1): every rank failed in its recompute with
    torch's "profiler._record_function_enter_new.default invocation index 3 encountered during backward but
    not found in storage" (torchtitan issue 3427, FSDP + EP under per-op SAC); with reshard 'always', recompute
    'full', or no pipeline it ran."""
    (why,) = predict_only(_moe_pp())
    assert why.startswith("model.experts with training.recompute = 'selective-op'") and "invocation index" in why
    assert predict_only(_moe_pp(zero=2)) == [why]  # ZeRO-2 keeps every unit gathered after forward
    assert predict_only(_moe_pp(fsdp_reshard_after_forward="never")) == [why]
    assert predict_only(_moe_pp(fsdp_reshard_after_forward="always")) == []
    assert predict_only(_moe_pp().replace(training={"recompute": "full"})) == []
    assert predict_only(_moe_pp(pp=1, microbatches=1).replace(cluster={"gpus": 2})) == []
    dense = _moe_pp().replace(model={"experts": 0})
    assert predict_only(dense) == []  # a dense block is one FSDP unit outside its checkpoint


def test_per_op_recompute_of_expert_parallel_fsdp_experts_under_a_one_f_one_b_schedule_is_predict_only():
    """Found by benchmarks/fake_sweep.py --seed 20261253 (#08, Qwen3 30B-A3B 1F1B pp4 ep2 HSDP ZeRO-3 resharding
    'always') and run again on eight CPU ranks of this model (dp 4, ep 2, pp 2, ZeRO-3 'always'): 1F1B failed in its
    recompute with torch's "invocation index ... not found in storage", GPipe ran (the fake: Interleaved1F1B failed,
    LoopedBFS ran, ep 1 ran under 1F1B)."""
    (why,) = predict_only(_moe_pp(ep=2, dp=4, schedule="1F1B", fsdp_reshard_after_forward="always"))
    assert why.startswith("model.experts with training.recompute = 'selective-op', parallel.ep > 1")
    assert "invocation index" in why and "'GPipe'" in why
    assert predict_only(_moe_pp(ep=2, dp=4, fsdp_reshard_after_forward="always")) == []  # GPipe
    assert predict_only(_moe_pp(schedule="1F1B", fsdp_reshard_after_forward="always")) == []  # ep 1
    assert predict_only(_moe_pp(ep=2, dp=4, schedule="Interleaved1F1B", virtual_stages=2,
                                fsdp_reshard_after_forward="always")) == [why.replace("'1F1B'", "'Interleaved1F1B'")]


def _moe_ep(**parallel):
    par = {"dp": 4, "ep": 4, "zero": 3, "microbatches": 2, **parallel}
    return Config.from_dict({"model": SMALL_MOE, "cluster": {"gpu": "cpu", "gpus": par["dp"]},
                             "parallel": par, "training": {"recompute": "selective-op", "precision": "bf16-mixed"}})


def test_per_op_recompute_of_fsdp_experts_on_a_one_rank_mesh_is_predict_only():
    """Found by benchmarks/fake_sweep.py (seed 20261208 #25, seed 20261207 #03 and #10, seed 20261206 #31: every
    one had efsdp = 1) and run again on CPU ranks of a small MoE (no pipeline): dp 4 with ep 4 (ZeRO-3, ZeRO-2,
    ZeRO-3 resharding 'always', one microbatch), dp 2 with ep 2 and dp 1 failed in their recompute with torch's
    "invocation index ... not found in storage"; dp 4 with ep 2, ZeRO-0 and full recompute ran."""
    (why,) = predict_only(_moe_ep())
    assert why.startswith("model.experts with training.recompute = 'selective-op' and FSDP experts on one rank")
    assert "efsdp" in why and "invocation index" in why
    assert predict_only(_moe_ep(zero=2)) == [why.replace("parallel.zero = 3", "parallel.zero = 2")]
    assert predict_only(_moe_ep(fsdp_reshard_after_forward="always")) == [why]
    assert predict_only(_moe_ep(dp=2, ep=2).replace(cluster={"gpus": 2})) == [why]
    assert predict_only(_moe_ep(ep=2)) == []  # efsdp = 2
    assert predict_only(_moe_ep(zero=0)) == []
    assert predict_only(_moe_ep().replace(training={"recompute": "full"})) == []
    assert predict_only(_moe_ep(dp=8, replicate=2, ep=4).replace(cluster={"gpus": 8})) != []  # HSDP: efsdp = 4/4


@pytest.mark.integration
def test_what_the_message_offers_instead_runs(tmp_path):
    """The same layout with the experts resharded after every forward ('always') simulates on the fake
    backend: each microbatch's forward and its recompute all-gather alike."""
    pytest.importorskip("torch")
    from backend.fake import simulate

    res = simulate(_moe_pp(fsdp_reshard_after_forward="always"), tmp_path / "always", ranks=[2], jobs=1)
    (last,) = res.measurement.memory.per_rank  # the last stage: its blocks' recompute, then the loss's
    assert last.rank == 2 and last.activations > 0
    # and each expert on two data-parallel ranks (efsdp = 2) where one failed
    res = simulate(_moe_ep(ep=2), tmp_path / "efsdp2", ranks=[0], jobs=1)
    (rank0,) = res.measurement.memory.per_rank
    assert rank0.rank == 0 and rank0.activations > 0
