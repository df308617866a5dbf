"""torchtitan's knobs in the backend: per-op / per-layer selective AC, torchao float8, per-block
torch.compile, the torchtitan pipeline split; async TP refused with its reason.

Unit tests build the tiny model in this process; the integration tests launch real gloo ranks
(tiny model, 2 steps). Tolerances:
- recompute kinds: the recompute reruns the same CPU kernels on the same inputs in the same order,
  so losses equal "none" exactly (no nondeterministic kernel runs on CPU here).
- float8 vs the same bf16 run: e4m3 keeps 3 mantissa bits, a cast's relative error is up to 2^-4;
  the first loss (no update yet) is the forward's error only (within 1e-3 relative: the errors of
  ~10^4 products average out), the second within 2 % (one AdamW step on float8 gradients).
- compile vs eager: inductor fuses and reorders fp32 reductions: 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest

from engine import default_config
from engine.backend_limits import composition_problems
from engine.pipeline.layout import split_layers

torch = pytest.importorskip("torch")

TINY = default_config().model


def _tiny_cfg(zero=0, **training):
    return default_config().replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1, "microbatches": 1, "zero": zero},
                                    training={"micro_batch_size": 8, **training})


# --------------------------------------------------------------------------- refusals (torch-free)


def test_async_tp_is_refused_naming_the_field_and_the_missing_kernel():
    cfg = default_config().replace(cluster={"gpus": 2},
                                   parallel={"dp": 1, "tp": 2, "pp": 1, "sequence_parallel": True, "async_tp": True},
                                   training={"compile": True})
    problems = composition_problems(cfg)
    assert len(problems) == 1
    assert problems[0].startswith("parallel.async_tp")
    assert "fused_all_gather_matmul" in problems[0] and "no CPU kernel" in problems[0]
    assert composition_problems(cfg.replace(parallel={"async_tp": False})) == []


def test_float8_with_lora_is_refused_and_with_tp_is_not():
    f8 = {"precision": "bf16-mixed", "grad_dtype": "bf16", "float8": "rowwise"}
    tp = default_config().replace(cluster={"gpus": 2}, parallel={"dp": 1, "tp": 2, "pp": 1}, training=f8)
    assert composition_problems(tp) == []  # test_float8_with_tp_runs_as_the_engine_predicts
    lora = default_config().replace(cluster={"gpus": 2}, parallel={"dp": 2, "pp": 1},
                                    training={**f8, "finetune": "lora"})
    assert any(p.startswith("training.float8 with LoRA") for p in composition_problems(lora))


def test_async_tp_exactly_fails_as_the_refusal_says():
    """The op async TP rewrites into has no CPU kernel in this torch."""
    import torch.distributed._symmetric_memory  # noqa: F401  (registers the symm_mem ops)

    t = torch.randn(4, 8)
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.symm_mem.fused_all_gather_matmul(t, [torch.randn(8, 8)], 0, "0")


# --------------------------------------------------------------------------- recompute, one process


def test_layer_sac_picks_every_nth_block_of_the_stage():
    from backend.parallel.recompute import layer_sac_blocks

    names = [str(i) for i in range(8)]
    assert layer_sac_blocks(names, 2) == ["1", "3", "5", "7"]
    assert layer_sac_blocks(names, 3) == ["2", "5"]
    assert layer_sac_blocks(names, 1) == names
    assert layer_sac_blocks(["5", "6", "7"], 2) == ["6"]  # counted within the stage ...
    assert layer_sac_blocks(["5", "6", "7"], 2, before=1) == ["5", "7"]  # ... after the rank's earlier stages
    with pytest.raises(ValueError, match="recompute_every"):
        layer_sac_blocks(names, 0)


@pytest.mark.parametrize("schedule, v, layers", [("Interleaved1F1B", 2, 8), ("ZBVZeroBubble", 2, 4),
                                                 ("InterleavedZeroBubble", 2, 6), ("1F1B", 1, 8)])
def test_per_layer_recompute_counts_across_a_ranks_stages_as_the_engine_predicts(schedule, v, layers):
    """torchtitan's per-layer AC counter runs on through a rank's model parts; each stage module the backend
    builds (apply_pp, then parallelize with the blocks of the rank's earlier stages) checkpoints the blocks
    ``engine.model.recompute.checkpointed_blocks`` predicts, stage by stage."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from backend.model import Transformer
    from backend.parallel.pipeline import apply_pp
    from backend.parallel.recompute import apply_recompute
    from engine import Config
    from engine.model.recompute import checkpointed_blocks

    cfg = Config.from_dict({"model": {"preset": "tiny", "layers": layers, "hidden": 32, "heads": 2, "kv_heads": 2,
                                      "ffn_hidden": 64},
                            "cluster": {"preset": "local-cpu", "gpus": 2},
                            "parallel": {"pp": 2, "schedule": schedule, "virtual_stages": v, "microbatches": 4},
                            "training": {"recompute": "selective-layer", "recompute_every": 2}})
    want = checkpointed_blocks(cfg)
    got = {}
    for pp_rank in range(2):
        parts = apply_pp(Transformer(cfg.model), cfg.parallel, pp_rank)
        before = 0
        for stage, module in parts:
            n = len(module.layers)
            apply_recompute(module, "selective-layer", 2, before)
            before += n
            got[stage] = sum(isinstance(b, CheckpointWrapper) for b in module.layers.values())
        assert sum(got[s] for s, _ in parts) == before // 2  # every 2nd block of the rank
    assert [got[s] for s in range(len(want))] == want


def test_op_sac_policy_saves_every_other_mm_and_the_attention():
    from torch.utils.checkpoint import CheckpointPolicy

    from backend.parallel.recompute import SAVE_OPS, op_sac_policy

    class Ctx:
        is_recompute = False

    policy, mm = op_sac_policy(), torch.ops.aten.mm.default
    got = [policy(Ctx, mm) for _ in range(4)]
    assert got == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in SAVE_OPS
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in SAVE_OPS
    assert policy(Ctx, torch.ops.aten.max.default) == CheckpointPolicy.MUST_SAVE
    assert policy(Ctx, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def _grads_and_saved(kind: str):
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    from backend.model import Transformer
    from backend.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    model = Transformer(TINY)
    apply_recompute(model, kind, 2)
    x = torch.randint(TINY.vocab, (4, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        snap = tracker.get_tracker_snapshot("current")
        loss.backward()
    saved = sum(v for cats in snap.values() for k, v in cats.items() if getattr(k, "value", str(k)) == "Activation")
    return loss.item(), [p.grad.clone() for p in model.parameters()], saved


def test_selective_op_and_layer_give_the_same_gradients_and_save_between_none_and_full():
    ref_loss, ref_grads, none_saved = _grads_and_saved("none")
    _, _, full_saved = _grads_and_saved("full")
    for kind in ("selective-op", "selective-layer"):
        loss, grads, saved = _grads_and_saved(kind)
        assert loss == ref_loss
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)), kind
        assert full_saved < saved < none_saved, (kind, full_saved, saved, none_saved)


# --------------------------------------------------------------------------- float8 / split, one process


def test_float8_converts_the_block_linears_not_the_head():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from backend.model import Transformer
    from backend.parallel.float8 import apply_float8, float8_linear_count

    model = Transformer(TINY)
    apply_float8(model, "tensorwise")
    per_block = 7 if TINY.mlp == "swiglu" else 6  # wq wk wv wo w1 w2 (w3)
    assert float8_linear_count(model) == per_block * TINY.layers
    assert not isinstance(model.output, Float8Linear)
    apply_float8(model := Transformer(TINY), "none")
    assert float8_linear_count(model) == 0


def test_torchtitan_split_cuts_the_stages_engine_layout_names():
    from backend.model import Transformer, cut_stage

    for split in ("even", "torchtitan"):
        blocks = split_layers(TINY.layers, 4, split)
        for s in range(4):
            part = cut_stage(Transformer(TINY), s, 4, split)
            assert list(part.layers.keys()) == [str(i) for i in blocks[s]]
    assert [len(r) for r in split_layers(TINY.layers, 4, "torchtitan")] == [2, 3, 2, 1]


# --------------------------------------------------------------------------- integration: real ranks


def _run(tmp_path, name, cfg, steps=2, timeout_s=400):
    from backend.launch import launch

    run = launch(cfg, tmp_path / name, steps=steps, timeout_s=timeout_s)
    list(run.events())
    res = run.wait()
    assert res["event"] == "finished", f"{res.get('reason')}\n{res.get('log_tail')}"
    return run.measurement(), run.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, cfg)``: the finished run of ``cfg`` (2 steps), launched once for the module. A
    layout two tests need (the eager fp32 DDP run is the recompute test's "none" and the compile
    test's eager reference) runs once; a name stands for one config only."""
    base = tmp_path_factory.mktemp("knobs")
    done: dict[str, tuple] = {}

    def get(name, cfg):
        if name not in done:
            done[name] = (cfg, *_run(base, name, cfg))
        assert done[name][0] == cfg, f"run {name!r} was launched with another config"
        return done[name][1:]

    return get


def _acts(meas):
    return [r.activations for r in meas.memory.per_rank]


@pytest.mark.integration
def test_recompute_kinds_match_none_exactly_and_measure_between_none_and_full(runs):
    meas = {k: runs(k, _tiny_cfg(recompute=k))[0]
            for k in ("none", "full", "selective-op", "selective-layer")}
    for kind in ("selective-op", "selective-layer"):
        assert meas[kind].step.losses == meas["none"].step.losses, kind
        for none, mid, full in zip(_acts(meas["none"]), _acts(meas[kind]), _acts(meas["full"]), strict=True):
            assert full < mid < none, (kind, full, mid, none)


#: a smaller model for the float8 runs: torch's CPU _scaled_mm runs oneDNN's reference fp8 matmul
#: ("ref:any", ~0.04 GFLOP/s on this machine's Xeon), so the tiny preset's 8 blocks of 512 tokens took
#: ~60 s a step; 2 blocks of 32-wide matmuls over 128 tokens take well under a second
SMALL_F8 = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 160, "seq_len": 32}


@pytest.mark.integration
def test_float8_trains_close_to_its_bf16_run(tmp_path):
    pytest.importorskip("torchao")
    bf16 = {"precision": "bf16-mixed", "grad_dtype": "bf16", "micro_batch_size": 4}
    base, _ = _run(tmp_path, "bf16", _tiny_cfg(zero=3, **bf16).replace(model=SMALL_F8))
    for kind, extra in (("tensorwise", {"float8_all_gather": True}), ("rowwise", {})):
        f8, path = _run(tmp_path, kind, _tiny_cfg(zero=3, **bf16, float8=kind, **extra).replace(model=SMALL_F8))
        first, second = f8.step.losses
        assert first == pytest.approx(base.step.losses[0], rel=1e-3), kind
        assert second == pytest.approx(base.step.losses[1], rel=2e-2), kind
        assert first != base.step.losses[0]  # float8 matmuls really ran


@pytest.mark.integration
def test_float8_with_tp_runs_as_the_engine_predicts(tmp_path):
    """Float8Linear layers under the backend's TP plan (ColwiseParallel / RowwiseParallel, the TP
    collectives in bf16, as torchtitan runs rowwise): TP 2 with sequence parallelism trains close to its
    bf16 run, and each rank's states are the engine's exactly, its activations within 1 %."""
    pytest.importorskip("torchao")
    from engine.memory import memory_per_rank

    bf16 = {"precision": "bf16-mixed", "grad_dtype": "bf16", "micro_batch_size": 4}
    par = {"dp": 1, "tp": 2, "pp": 1, "microbatches": 1, "sequence_parallel": True}
    base, _ = _run(tmp_path, "bf16", _tiny_cfg(**bf16).replace(model=SMALL_F8, parallel=par))
    cfg = _tiny_cfg(**bf16, float8="tensorwise").replace(model=SMALL_F8, parallel=par)
    f8, _ = _run(tmp_path, "tensorwise", cfg)
    assert f8.step.losses[0] == pytest.approx(base.step.losses[0], rel=1e-3)
    assert f8.step.losses[0] != base.step.losses[0]  # float8 matmuls really ran
    predicted = memory_per_rank(cfg).per_rank
    for r, measured in enumerate(f8.ranks):
        exact = measured["memory"]["exact"]
        assert (exact["params"], exact["optimizer"]) == (predicted[r].params, predicted[r].optimizer), r
        assert predicted[r].activations == pytest.approx(measured["memory"]["categories"]["activations"],
                                                         rel=0.01), r


@pytest.mark.integration
def test_compile_matches_eager_and_says_what_it_did_not_measure(runs):
    eager, eager_path = runs("none", _tiny_cfg())  # the recompute test's "none": the same eager layout
    comp, path = runs("compiled", _tiny_cfg(compile=True))
    assert comp.step.losses == pytest.approx(eager.step.losses, rel=1e-5)
    for r in range(2):
        rec = json.loads((path / "ranks" / f"rank{r}.measurement.json").read_text())
        assert any(n.startswith("training.compile") and "not measured" in n for n in rec["memory"]["notes"])
        # what the compiled blocks save, counted apart (saved_tensors_hooks): less than the eager blocks
        saved = rec["memory"]["saved_for_backward"]
        assert 0 < saved["compiled"] < saved["eager"]
    eager_rec = json.loads((eager_path / "ranks" / "rank0.measurement.json").read_text())
    assert eager_rec["memory"]["notes"] == []


@pytest.mark.integration
def test_torchtitan_split_runs_the_stages_it_names(tmp_path):
    from test_backend_model import expected_params

    cfg = default_config().replace(cluster={"gpus": 4},
                                   parallel={"dp": 1, "pp": 4, "microbatches": 4, "pipeline_split": "torchtitan"})
    meas, path = _run(tmp_path, "tt", cfg)
    even, _ = _run(tmp_path, "even", cfg.replace(parallel={"pipeline_split": "even"}))
    assert meas.step.losses == pytest.approx(even.step.losses, rel=1e-5)  # same math, other cut
    one_block = (expected_params(TINY.__class__(**{**vars(TINY), "layers": 2}))
                 - expected_params(TINY.__class__(**{**vars(TINY), "layers": 1})))
    blocks = [len(r) for r in split_layers(TINY.layers, 4, "torchtitan")]
    params = [r.params for r in meas.memory.per_rank]
    even_params = [r.params for r in even.memory.per_rank]
    even_blocks = [len(r) for r in split_layers(TINY.layers, 4, "even")]
    for s in range(4):
        assert params[s] - even_params[s] == 4 * one_block * (blocks[s] - even_blocks[s])  # fp32: 4 B each
