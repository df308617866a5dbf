"""The clock from ops (conventions.clock = "ops", engine/time/ops.py): rooflines worked by hand, the
op lists' invariants, the device profiles' data, validation."""

import dataclasses

import pytest

from engine import Config, ConfigError, default_config
from engine.model.params import params_per_rank
from engine.predict import predict
from engine.time.ops import (
    GEMM_DTYPES,
    Op,
    _profiles,
    block_ops,
    device_profile,
    op_durations,
    op_seconds,
    op_table,
    rms_norm_op,
    unit_seconds,
)
from engine.time.step import FOR_LOOP_OPTIMIZER, analytic_durations, optimizer_seconds, optimizer_tensors, step_time


def _cfg(preset: str = "llama3-8b", gpu: str = "h100-sxm", **training) -> Config:
    return Config.from_dict({"model": {"preset": preset}, "cluster": {"gpu": gpu, "gpus": 8, "gpus_per_node": 8},
                             "parallel": {"dp": 8, "zero": 3},
                             "training": {"precision": "bf16-mixed", "micro_batch_size": 1, **training},
                             "conventions": {"clock": "ops"}})


def test_a_large_gemm_runs_at_the_profiles_fraction_of_the_peak_worked_by_hand():
    cfg = _cfg()
    prof = device_profile("h100-sxm")
    F = 2.0 * 8192 * 4096 * 4096  # 274.9 GFLOP
    op = Op("g", "F", "gemm", F, 3 * 8192 * 4096 * 2, 1, "bf16")
    rate = 989e12 * 0.75 * 1.0 * F / (F + 2.0e9)  # peak · gemm_fraction_bf16 · power · F / (F + F_half)
    assert op_seconds(op, cfg, prof) == pytest.approx(F / rate + 3e-6, rel=1e-12)
    assert F / rate == pytest.approx(0.3733e-3, rel=1e-3)  # 274.9 GFLOP at 736 TFLOP/s (0.75 × 989 × 274.9 / 276.9)


def test_a_memory_bound_op_takes_its_bytes_over_the_achieved_bandwidth_plus_its_launches():
    cfg = _cfg()
    prof = device_profile("h100-sxm")
    op = Op("norm", "F", "memory", 0.0, 1e9, 3)
    assert op_seconds(op, cfg, prof) == pytest.approx(1e9 / (3350e9 * 0.85) + 3 * 3e-6, rel=1e-12)


def test_small_gemms_run_below_the_large_gemm_rate():
    cfg = _cfg()
    prof = dataclasses.replace(device_profile("h100-sxm"), launch_us=0.0, launch_backward_us=0.0)
    per_flop = [op_seconds(Op("g", "F", "gemm", 2.0 * n**3, 0.0, 1, "bf16"), cfg, prof) / (2.0 * n**3)
                for n in (256, 1024, 4096, 16384)]
    assert per_flop == sorted(per_flop, reverse=True)
    assert per_flop[1] / per_flop[-1] > 1.8  # a 1024³ GEMM at about half the large rate (gemm_half_gflop = 2)


def test_the_ops_clock_does_not_read_compute_efficiency():
    a = _cfg().replace(conventions={"compute_efficiency": 0.2})
    b = _cfg().replace(conventions={"compute_efficiency": 0.9})
    assert predict(a).step.seconds == predict(b).step.seconds
    eff = _cfg().replace(conventions={"clock": "efficiency"})
    assert predict(eff.replace(conventions={"compute_efficiency": 0.2})).step.seconds \
        != predict(eff.replace(conventions={"compute_efficiency": 0.9})).step.seconds


def test_compile_fuses_the_elementwise_ops_into_fewer_bytes_and_kernels():
    eager, compiled = block_ops(_cfg()), block_ops(_cfg(compile=True))
    for phase in ("F", "I"):
        mem_e = [o for o in eager[phase] if o.kind == "memory"]
        mem_c = [o for o in compiled[phase] if o.kind == "memory"]
        assert sum(o.bytes for o in mem_c) < sum(o.bytes for o in mem_e)
        assert sum(o.kernels for o in mem_c) < sum(o.kernels for o in mem_e)
    # the GEMMs and the attention are the same ops
    assert [o for o in eager["F"] if o.kind != "memory"] == [o for o in compiled["F"] if o.kind != "memory"]
    d_e, d_c = op_durations(_cfg()), op_durations(_cfg(compile=True))
    assert d_c.forward_s[0] < d_e.forward_s[0] and d_c.backward_input_s[0] < d_e.backward_input_s[0]


def test_torchtitans_2024_rms_norm_streams_its_tensor_through_fp32_eight_times_worked_by_hand():
    """conventions.rms_norm = "fp32-composite": torchtitan's norms.py of 2024, ``self._norm(x.float()).type_as(x)
    * self.weight`` with ``_norm`` = ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``. A bf16 element:
    x.float() 2 + 4, pow 4 + 4, mean 4, the product 4 + 4, type_as 4 + 2, × weight 2 + 2 = 36 bytes in 8 kernels
    (+ eps and rsqrt: one value a row); fp32 has no casts: 28 bytes, 6 kernels. Fused: read and write, 1 kernel."""
    n = 1000
    fused, composite = _cfg(), _cfg().replace(conventions={"rms_norm": "fp32-composite"})
    assert (rms_norm_op("n", n, 2, fused).bytes, rms_norm_op("n", n, 2, fused).kernels) == (4 * n, 1)
    assert (rms_norm_op("n", n, 2, composite).bytes, rms_norm_op("n", n, 2, composite).kernels) == (36 * n, 8)
    assert (rms_norm_op("n", n, 4, composite).bytes, rms_norm_op("n", n, 4, composite).kernels) == (28 * n, 6)
    # eager blocks and the final norm run it; compiled blocks fuse their norms whatever the convention says
    eager = {o.name: o for o in block_ops(composite)["F"]}
    assert eager["RMSNorm ×2"].bytes == 2 * 36 * 4096 * 8192 and eager["RMSNorm ×2"].kernels == 16
    compiled = composite.replace(training={"compile": True})
    assert block_ops(compiled)["F"] == block_ops(_cfg(compile=True))["F"]
    assert op_durations(compiled).forward_s[-1] > op_durations(_cfg(compile=True)).forward_s[-1]  # the final norm
    assert op_durations(composite).backward_input_s[0] > op_durations(fused).backward_input_s[0]
    with pytest.raises(ConfigError, match="conventions.rms_norm.*fused"):
        fused.replace(conventions={"rms_norm": "apex"})


def test_autocast_casts_each_weight_once_and_the_stream_for_each_reader_worked_by_hand():
    """bf16-mixed under DDP runs torch.autocast (engine.wrapping): a TorchDispatchMode trace of the backend's block
    shows 7 weight casts and 5 casts of the norm outputs (q, k, v, gate, up) forward; backward 5 input-gradient casts
    and 2 of the stream's gradient (into o and down), and 7 weight-gradient casts. 6 bytes an element each."""
    cfg = default_config().replace(training={"precision": "bf16-mixed"})  # tiny: h 128, q 128, kv 64, f 352, T 128
    ops = block_ops(cfg)
    cast = {ph: [o for o in ops[ph] if o.name.startswith("autocast")] for ph in "FIW"}
    weights = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 352
    inputs = 128 * 128 * 3 + 128 * 128 * 2
    assert [(o.kernels, o.bytes) for o in cast["F"]] == [(12, 6 * (weights + inputs))]
    assert [(o.kernels, o.bytes) for o in cast["I"]] == [(7, 6 * (inputs + 2 * 128 * 128))]
    assert [(o.kernels, o.bytes) for o in cast["W"]] == [(7, 6 * weights)]
    for other in (default_config(), _cfg()):  # fp32; FSDP2's policy casts nothing per Linear
        assert not [o for ph in "FIW" for o in block_ops(other)[ph] if o.name.startswith("autocast")]


def test_cpu_ranks_run_torchs_composite_rms_norm_whatever_the_convention():
    """torch 2.13 has no fused RMSNorm on CPU: nn.RMSNorm runs pow, mean, add_, rsqrt, mul, mul (a cast either side
    in bf16), as a TorchDispatchMode trace shows: fp32 28 bytes an element in 6 kernels."""
    cpu = default_config()
    assert cpu.cluster.gpu.name == "cpu" and cpu.conventions.rms_norm == "fused"
    assert (rms_norm_op("n", 1000, 4, cpu).bytes, rms_norm_op("n", 1000, 4, cpu).kernels) == (28_000, 6)
    assert rms_norm_op("n", 1000, 2, cpu).kernels == 8
    assert rms_norm_op("n", 1000, 2, _cfg()).kernels == 1  # an H100: torch's fused kernel


def test_float8_is_faster_on_large_gemms_but_far_from_the_peak_ratio():
    """Float8's gain is its GEMMs' achieved rate (0.6 of the fp8 peak, tensorwise) less its casts, not
    the 2× of the peaks; rowwise runs slower than tensorwise (its own kernel, casts along both axes)."""
    bf16 = op_durations(_cfg(compile=True))
    tw = op_durations(_cfg(compile=True, float8="tensorwise"))
    rw = op_durations(_cfg(compile=True, float8="rowwise"))
    gain = (bf16.forward_s + bf16.backward_s)[0] / (tw.forward_s + tw.backward_s)[0]
    assert 1.0 < gain < 1.6
    assert (rw.forward_s + rw.backward_s)[0] > (tw.forward_s + tw.backward_s)[0]
    names = [o.name for o in block_ops(_cfg(float8="tensorwise"))["F"]]
    assert "float8 casts" in names
    assert {o.dtype for o in block_ops(_cfg(float8="tensorwise"))["F"] if o.kind == "gemm"} == {"fp8_tensorwise"}


def test_a_rowwise_recipes_gradient_gemms_run_the_tensorwise_kernel_and_scale_their_outputs_worked_by_hand():
    """torchao's rowwise recipe turns fast accumulation off for grad_input and grad_weight
    (``Float8LinearConfig.from_recipe_name("rowwise")``), and ``addmm_float8_unwrapped`` then calls the tensorwise
    ``_scaled_mm`` with unit scales and multiplies the output by the outer product of the scales: each gradient GEMM
    at the tensorwise rate, and per GEMM 2 kernels moving (8 + 2·2) B an output element in bf16 (1 kernel, 2·2 B,
    under compile). Llama 3 8B, one 8,192-token microbatch: the float8 Linears are q (4096 → 4096), k, v (4096 →
    1024), o (4096 → 4096), w1, w3 (4096 → 14336), w2 (14336 → 4096)."""
    ops = block_ops(_cfg(float8="rowwise"))
    assert {o.dtype for o in ops["F"] if o.kind == "gemm"} == {"fp8_rowwise"}
    assert {o.dtype for phase in ("I", "W") for o in ops[phase] if o.kind == "gemm"} == {"fp8_tensorwise"}
    linears = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    tokens = 8192
    dx = tokens * sum(d_in for d_in, _ in linears)  # each input gradient: T × d_in
    dw = sum(d_in * d_out for d_in, d_out in linears)
    post = {phase: next(o for o in ops[phase] if o.name == f"float8 rowwise post-scale ({phase})") for phase in "IW"}
    assert (post["I"].bytes, post["I"].kernels) == (12 * dx, 14)
    assert (post["W"].bytes, post["W"].kernels) == (12 * dw, 14)
    compiled = block_ops(_cfg(float8="rowwise", compile=True))
    assert next(o for o in compiled["I"] if o.name.startswith("float8 rowwise post-scale")).bytes == 4 * dx
    tensorwise = block_ops(_cfg(float8="tensorwise"))
    assert not [o for phase in ("I", "W") for o in tensorwise[phase] if "post-scale" in o.name]


def test_float8_on_cpu_ranks_runs_at_the_rates_torchs_cpu_kernels_run():
    """The shipped cpu profile holds torch 2.13's CPU ``_scaled_mm`` rates as torchao calls it (devices.toml: 0.064
    GFLOP/s with one scale a tensor, 35.6 with a scale a row, bf16's GEMM 890): on CPU ranks float8 is far slower
    than bf16, tensorwise slowest (every GEMM on the first kernel), rowwise between (its forward on the second, its
    gradient GEMMs on the first). The accuracy matrix's float8 rows measured 50-68 s a step, the bf16 rate had
    predicted 0.1-0.2 s."""
    base = default_config().replace(training={"precision": "bf16-mixed"}, conventions={"clock": "ops"})
    d = {k: op_durations(base.replace(training={"float8": k})) for k in ("none", "tensorwise", "rowwise")}
    total = {k: float(v.forward_s.sum() + v.backward_s.sum()) for k, v in d.items()}
    assert total["tensorwise"] > 100 * total["none"]
    assert total["none"] < total["rowwise"] < total["tensorwise"]
    assert float(d["rowwise"].forward_s.sum()) < float(d["tensorwise"].forward_s.sum()) / 100


def test_a_profiles_in_context_figures_scale_a_stages_ops_by_phase_and_precision_not_the_optimizer(tmp_path,
                                                                                                    monkeypatch):
    """``context_forward`` / ``context_backward`` (backend/devicebench.py's chain-of-blocks probe over its op lists)
    multiply every stage op's time in F (and a recompute's forward again) and in I and W; the bf16 figures under
    bf16-mixed, the fp32 ones where a profile has no bf16 figure; the optimizer step, which the probe does not run,
    keeps its time. Shipped GPU profiles have none (1)."""
    import json
    import socket

    monkeypatch.setenv("SHARDSCOPE_CACHE_DIR", str(tmp_path))
    doc = _measured_doc(socket.gethostname())
    path = tmp_path / "device-cpu.json"
    path.write_text(json.dumps(doc))
    base = default_config().replace(training={"precision": "fp32", "recompute": "full"}, conventions={"clock": "ops"})
    bf16 = base.replace(training={"precision": "bf16-mixed"})
    before = {k: op_durations(c) for k, c in (("fp32", base), ("bf16", bf16))}
    opt = step_time(base).optimizer_s
    doc["profile"].update(context_forward=1.5, context_backward=1.25)
    path.write_text(json.dumps(doc))
    after = op_durations(base)
    assert after.forward_s == pytest.approx(1.5 * before["fp32"].forward_s)
    # I holds the recomputed forward (its ops' phase is F) beside the backward's own ops: between the two figures
    ratio = after.backward_input_s / before["fp32"].backward_input_s
    assert ((ratio > 1.25) & (ratio < 1.5)).all()
    assert after.backward_weight_s == pytest.approx(1.25 * before["fp32"].backward_weight_s)
    assert op_durations(bf16).forward_s == pytest.approx(1.5 * before["bf16"].forward_s)  # no bf16 figure: fp32's
    assert step_time(base).optimizer_s == pytest.approx(opt)
    doc["profile"].update(context_forward_bf16=2.0)
    path.write_text(json.dumps(doc))
    assert op_durations(bf16).forward_s == pytest.approx(2.0 * before["bf16"].forward_s)
    assert op_durations(base).forward_s == pytest.approx(1.5 * before["fp32"].forward_s)
    assert all(p.context("F", "bf16-mixed") == p.context("I", "fp32") == 1.0
               for k, p in _profiles().items() if k != "cpu")
    # float8's GEMMs, which the probe does not run, at their own time; the casts beside them in context
    f8 = bf16.replace(training={"float8": "tensorwise"})
    prof = device_profile("cpu")
    ops = {o.name: o for o in block_ops(f8)["F"]}
    rows = {name: us for where, phase, name, *_, us in op_table(f8) if where == "block" and phase == "F"}
    assert rows["wq.F"] == pytest.approx(op_seconds(ops["wq.F"], f8, prof) * 1e6)
    assert rows["float8 casts"] == pytest.approx(2.0 * op_seconds(ops["float8 casts"], f8, prof) * 1e6)


def test_recompute_adds_the_forward_ops_it_repeats_to_the_input_backward():
    none, full = op_durations(_cfg(recompute="none")), op_durations(_cfg(recompute="full"))
    sel = op_durations(_cfg(recompute="selective-op"))
    assert none.forward_s[0] == full.forward_s[0] == sel.forward_s[0]
    assert none.backward_weight_s[0] == full.backward_weight_s[0]
    layers = 32
    blk = block_ops(_cfg())
    prof = device_profile("h100-sxm")
    one_forward = sum(op_seconds(o, _cfg(), prof) for o in blk["F"])
    assert full.backward_input_s[0] - none.backward_input_s[0] == pytest.approx(layers * one_forward, rel=1e-9)
    assert none.backward_input_s[0] < sel.backward_input_s[0] < full.backward_input_s[0]


def test_under_the_ops_clock_analytic_durations_are_the_op_durations():
    cfg = _cfg(compile=True, float8="tensorwise")
    a, b = analytic_durations(cfg), op_durations(cfg)
    assert a.forward_s.tolist() == b.forward_s.tolist() and a.backward_s.tolist() == b.backward_s.tolist()


def test_every_device_profile_holds_fractions_and_the_generic_one_stands_for_unknown_kinds():
    profiles = _profiles()
    assert "generic" in profiles and "h100-96g" in profiles
    for prof in profiles.values():
        for dtype in GEMM_DTYPES:
            assert 0 < prof.gemm_fraction(dtype) <= 1
        for f in ("attention_fraction_forward", "attention_fraction_backward", "hbm_fraction", "power_factor"):
            assert 0 < getattr(prof, f) <= 1, (prof.name, f)
        assert prof.gemm_half_gflop > 0 and prof.launch_us >= 0 and prof.launch_backward_us >= 0
    assert device_profile("a-card-nobody-profiled") is profiles["generic"]
    # the one fitted figure (torchtitan Table 1 row 1; benchmarks/published.py) and the card it is for
    assert profiles["h100-96g"].power_factor == 0.72 and profiles["h100-sxm"].power_factor == 1.0


def test_the_op_table_lists_every_op_with_its_time():
    rows = op_table(_cfg())
    assert {r[0] for r in rows} == {"block", "head", "embedding"}
    assert any(r[2] == "attention" for r in rows) and all(r[6] > 0 for r in rows)
    from gui.text import prediction_table  # predict --explain lists them under the clock from ops only

    assert "wq.F" in prediction_table(predict(_cfg()), explain=True)
    assert "wq.F" not in prediction_table(predict(_cfg().replace(conventions={"clock": "efficiency"})), explain=True)


def _kind_cfg(preset: str, training: dict | None = None, **parallel) -> Config:
    par = {"dp": 8, "zero": 3, **parallel}
    gpus = par["dp"] * par.get("tp", 1) * par.get("pp", 1)
    return Config.from_dict({"model": {"preset": preset}, "cluster": {"gpu": "h100-sxm", "gpus": gpus, "gpus_per_node": 8},
                             "parallel": par, "training": {"precision": "bf16-mixed", "micro_batch_size": 1,
                                                           **(training or {})},
                             "conventions": {"clock": "ops"}})


def test_experts_run_as_grouped_gemms_over_the_routed_copies_worked_by_hand():
    """Qwen3 30B-A3B, ep 8: 128 experts, 16 on each rank, each token to 8 of them: the rank's grouped
    GEMMs multiply T·8 routed copies (balanced), 2·T·8·h·f FLOPs each, at the rate of one expert's
    share; the router multiplies the T tokens by h × E; a grouped GEMM runs below one GEMM of its FLOPs."""
    cfg = _kind_cfg("qwen3-30b-a3b", ep=8)
    T, h, f, E = 40960, 2048, 768, 128
    ops = {o.name: o for o in block_ops(cfg, experts=True)["F"]}
    w1 = ops["experts.w1.F"]
    assert w1.flops == 2.0 * (T * 8) * h * f and w1.groups == E // 8 and w1.dtype == "bf16"
    assert ops["router.F"].flops == 2.0 * T * h * E
    assert "w1.F" not in ops and "router scores, top-k" in ops and "dispatch, combine" in ops
    prof = device_profile("h100-sxm")
    assert op_seconds(w1, cfg, prof) > op_seconds(dataclasses.replace(w1, groups=1), cfg, prof)
    # an imbalance of 1.5 makes the busiest rank's copies (and its grouped GEMMs) 1.5 × the mean
    hot = {o.name: o for o in block_ops(cfg.replace(conventions={"moe_imbalance": 1.5}), experts=True)["F"]}
    assert hot["experts.w1.F"].flops == 1.5 * w1.flops


def test_a_stage_adds_its_dense_blocks_and_its_blocks_with_experts():
    """DeepSeek-V3's first 3 blocks are dense, the other 58 have experts: one stage's F is the sum."""
    cfg = _kind_cfg("deepseek-v3", ep=8)
    prof = device_profile("h100-sxm")
    dense, moe = (sum(op_seconds(o, cfg, prof) for o in block_ops(cfg, e)["F"]) for e in (False, True))
    from engine.time.ops import embedding_ops, head_ops

    edges = sum(op_seconds(o, cfg, prof) for o in head_ops(cfg)["F"] + embedding_ops(cfg)["F"])
    assert op_durations(cfg).forward_s[0] == pytest.approx(3 * dense + 58 * moe + edges, rel=1e-12)


def test_latent_attention_and_sliding_windows_execute_what_their_kernels_execute_worked_by_hand():
    """MLA (DeepSeek-V3, 128 heads, d_qk = 128 + 64, d_v = 128, s = 4096): the flash kernel executes half
    of 2·T·s·a·(d_qk + d_v). gpt-oss-20b (s = 4096, window 128 on every other block): query i meets
    min(i + 1, 128) keys, (128 − 128²/8192)/4096 of the square, half the blocks; the rest half of it."""
    T, s = 4096, 4096
    att = {o.name: o for o in block_ops(_kind_cfg("deepseek-v3", ep=8), True)["F"]}["attention"]
    assert att.flops == 0.5 * 2.0 * T * s * 128 * (192 + 128)
    share = (12 * 0.5 + 12 * (128 - 128 * 128 / 8192) / 4096) / 24
    att = {o.name: o for o in block_ops(_kind_cfg("gpt-oss-20b", ep=8), True)["F"]}["attention"]
    assert att.flops == pytest.approx(share * 2.0 * T * s * 64 * (64 + 64), rel=1e-12)


def test_lora_trains_only_its_adapters_the_frozen_base_still_passes_its_input_gradients():
    cfg = _kind_cfg("llama3-8b", {"finetune": "lora", "lora_rank": 16, "lora_targets": "attention"})
    blk = block_ops(cfg)
    w = [o.name for o in blk["W"]]
    assert w == [f"{n}.lora_{x}.W" for n in ("wq", "wk", "wv", "wo") for x in "AB"]
    assert {"wq.I", "w2.I", "wq.lora_A.I"} <= {o.name for o in blk["I"]}
    a = {o.name: o for o in blk["F"]}["wq.lora_A.F"]
    assert a.flops == 2.0 * 8192 * 4096 * 16  # T × h × r
    from engine.time.ops import embedding_ops, head_ops

    assert head_ops(cfg)["W"] == [] and embedding_ops(cfg)["W"] == []
    full = _kind_cfg("llama3-8b")
    assert op_durations(cfg).backward_weight_s[0] < op_durations(full).backward_weight_s[0] / 10


def test_an_unknown_clock_is_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        _cfg().replace(conventions={"clock": "wallclock"})
    assert "conventions.clock" in str(err.value) and "efficiency" in str(err.value) and "ops" in str(err.value)


def _measured_doc(host: str, launch_us: float = 25.0) -> dict:
    prof = {f: 0.5 for f in ("gemm_fraction_bf16", "gemm_fraction_fp32", "gemm_fraction_fp8_tensorwise",
                             "gemm_fraction_fp8_rowwise", "attention_fraction_forward", "attention_fraction_backward",
                             "hbm_fraction")}
    prof.update(gemm_half_gflop=0.001, launch_us=launch_us, launch_backward_us=2 * launch_us, power_factor=1.0)
    return {"gpu": "cpu", "host": host, "measured": "2026-12-03T00:00:00+00:00", "profile": prof}


def test_the_cpu_uses_this_machines_measured_profile_and_never_another_machines(tmp_path, monkeypatch):
    import json
    import socket

    monkeypatch.setenv("SHARDSCOPE_CACHE_DIR", str(tmp_path))
    shipped = _profiles()["cpu"]
    assert device_profile("cpu") is shipped  # nothing measured here yet
    path = tmp_path / "device-cpu.json"
    path.write_text(json.dumps(_measured_doc("some-other-host")))
    assert device_profile("cpu") is shipped  # a profile copied from another machine is not this one's
    path.write_text(json.dumps(_measured_doc(socket.gethostname(), launch_us=25.0)))
    got = device_profile("cpu")
    assert got.launch_us == 25.0 and got.gemm_fraction_fp32 == 0.5 and got.name.startswith("cpu (measured")
    path.write_text("{not json")
    assert device_profile("cpu") is shipped  # unreadable: the shipped one, no exception
    assert device_profile("h100-sxm") is _profiles()["h100-sxm"]  # only the CPU is measured here


def test_eager_attention_is_its_gemms_and_elementwise_ops_and_selective_recompute_repeats_them():
    cfg = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 2, "gpus_per_node": 2},
                            "parallel": {"dp": 2}, "training": {"precision": "fp32", "recompute": "selective"},
                            "conventions": {"clock": "ops"}})
    ops = block_ops(cfg)
    names = [o.name for o in ops["F"]]
    assert "scores Q·Kᵀ" in names and "probs · V" in names and "scale, mask" in names and "softmax" in names
    assert "attention" not in names  # no flash kernel: the tiny preset's attention is eager
    assert "repeat K, V (GQA)" in names  # 8 heads over 4 KV heads
    assert [o.name for o in ops["R"]] == [n for n in names if n in {o.name for o in ops["R"]}]
    assert {o.name for o in ops["R"]} == {"repeat K, V (GQA)", "scores Q·Kᵀ", "scale, mask", "softmax", "probs · V",
                                          "heads reshape"}
    # the scores' GEMMs compute the full square (the mask is applied after): 2·s·q_dim FLOPs a token each
    m = cfg.model
    T = cfg.training.micro_batch_size * m.seq_len
    scores = next(o for o in ops["F"] if o.name == "scores Q·Kᵀ")
    assert scores.flops == 2.0 * T * m.seq_len * m.heads * m.head_dim


def test_a_softmax_streams_at_the_profiles_softmax_fraction_of_the_bandwidth(tmp_path, monkeypatch):
    """A kernel of exponentials (softmax, the loss's log-softmax) is memory-bound on a GPU like any other, but a
    CPU core computes each exp: its bandwidth is the profile's ``softmax_fraction`` of the streaming one
    (``shardscope calibrate --device`` times ``torch.softmax``)."""
    import json
    import socket

    monkeypatch.setenv("SHARDSCOPE_CACHE_DIR", str(tmp_path))
    cfg = _cfg()
    gpu = device_profile("h100-sxm")
    assert gpu.softmax_fraction == 1.0  # optional in devices.toml: a GPU's kernels all stream
    plain, exp = Op("add", "F", "memory", 0.0, 1e9, 1), Op("softmax", "F", "memory", 0.0, 1e9, 1, exp_bound=True)
    assert op_seconds(exp, cfg, gpu) == op_seconds(plain, cfg, gpu)
    slow = dataclasses.replace(gpu, softmax_fraction=0.25)
    assert op_seconds(exp, cfg, slow) - 3e-6 == pytest.approx(4 * (op_seconds(plain, cfg, slow) - 3e-6), rel=1e-12)
    # the shipped CPU profile says its own; the eager attention's softmax and the loss are marked, the mask is not
    assert 0 < _profiles()["cpu"].softmax_fraction < 1
    tiny = Config.from_dict({"model": {"preset": "tiny"}, "cluster": {"gpu": "cpu", "gpus": 1},
                             "conventions": {"clock": "ops"}})
    marked = {o.name for phase in block_ops(tiny).values() for o in phase if o.exp_bound}
    assert marked == {"softmax", "softmax backward"}
    # a profile measured before the field existed still loads, at 1
    doc = _measured_doc(socket.gethostname())
    doc["profile"].pop("softmax_fraction", None)
    (tmp_path / "device-cpu.json").write_text(json.dumps(doc))
    assert device_profile("cpu").softmax_fraction == 1.0 and device_profile("cpu").name.startswith("cpu (measured")


def test_the_cpu_optimizer_is_torchs_one_tensor_step_worked_by_hand():
    # the tiny preset on one CPU rank: 8 blocks of 9 tensors (wq 128², wk and wv 128 × 64, wo 128², w1, w3 and w2
    # 128 × 352, two norms of 128) + the embedding and the head (512 × 128) + the final norm = 75 tensors,
    # 8 · 184,576 + 131,200 = 1,607,808 elements
    cfg = default_config().replace(cluster={"gpus": 1}, parallel={"dp": 1, "pp": 1, "microbatches": 1},
                                   training={"precision": "fp32"}, conventions={"clock": "ops"})
    rp = params_per_rank(cfg)[0][0]
    assert (rp.total, optimizer_tensors(cfg, rp)) == (1_607_808, 75)
    prof = device_profile("cpu")
    bw = cfg.cluster.gpu.hbm_bandwidth_gb_per_s * 1e9 * prof.hbm_fraction
    # AdamW, fp32: 9 aten calls a tensor; 72 B an element (lerp_ 12, mul_ 8, addcmul_ 12, sqrt 8, div 8, add_ 8,
    # addcdiv_ 16)
    assert FOR_LOOP_OPTIMIZER["adamw"] == (9, 56, 4)
    expected = 1_607_808 * 72 / bw + 75 * 9 * prof.launch_us * 1e-6
    assert step_time(cfg).optimizer_s == pytest.approx(expected, rel=1e-12)
    # ZeRO-1 over 4 ranks on 2 cores: a quarter of the elements, ⌈75 / 4⌉ = 19 whole tensors, twice the time a core
    z1 = cfg.replace(cluster={"gpus": 4, "cpu_cores": 2}, parallel={"dp": 4, "zero": 1})
    assert step_time(z1).optimizer_s == pytest.approx(2 * (1_607_808 / 4 * 72 / bw + 19 * 9 * prof.launch_us * 1e-6),
                                                      rel=1e-12)
    # SGD with momentum: buf.mul_ (8), buf.add_(grad) (12), param.add_(buf) (12): 32 B, 3 calls a tensor
    sgd = cfg.replace(training={"optimizer": "sgd-momentum"})
    assert step_time(sgd).optimizer_s == pytest.approx(1_607_808 * 32 / bw + 75 * 3 * prof.launch_us * 1e-6,
                                                       rel=1e-12)
    # GPUs step every tensor at once (foreach): one pass over the bytes the step must touch, no per-tensor term
    gpu = _cfg()
    assert optimizer_seconds(gpu, 1000, 10) == optimizer_seconds(gpu, 1000, 0)


def test_a_blocks_kernels_cost_what_its_recompute_wrapper_makes_them_cost_worked_by_hand():
    # the shipped cpu profile: each kernel of a block under per-op selective checkpointing 37.1 µs forward (its
    # dispatch mode's Python on every op) against 5.2 unwrapped; backward 7.9 against 4.4; head, embedding alike
    base = default_config().replace(training={"precision": "fp32"}, conventions={"clock": "ops"})
    prof = _profiles()["cpu"]
    assert (prof.launch("F"), prof.launch("I"), prof.launch("F", "selective-op"), prof.launch("W", "selective-op")) \
        == (5.2, 4.4, 37.1, 7.9)
    assert prof.launch("F", "selective-layer") == 5.2  # no field of its own: the plain cost
    assert _profiles()["h100-sxm"].launch("F", "selective-op") == _profiles()["h100-sxm"].launch_us
    none = unit_seconds(base, recomputes=("none", "selective-op", "full"), profile=prof)
    ops = block_ops(base)
    f_k, i_k, w_k = (sum(o.kernels for o in ops[p]) for p in ("F", "I", "W"))
    sop = base.replace(training={"recompute": "selective-op"})
    r_k = sum(o.kernels for o in block_ops(sop)["R"])
    # each op in a chain of blocks (the profile's in-context figures: forward and recomputed ops, backward ones)
    cf, cb = prof.context("F", "fp32"), prof.context("I", "fp32")
    assert none["selective-op"][0] - none["none"][0] == pytest.approx(cf * f_k * (37.1 - 5.2) * 1e-6, rel=1e-9)
    assert none["selective-op"][2] - none["none"][2] == pytest.approx(cb * w_k * (7.9 - 4.4) * 1e-6, rel=1e-9)
    redo = sum(op_seconds(o, sop, prof, "selective-op") for o in block_ops(sop)["R"])
    assert none["selective-op"][1] - none["none"][1] == pytest.approx(cb * i_k * (7.9 - 4.4) * 1e-6 + cf * redo,
                                                                      rel=1e-9)
    assert redo == pytest.approx(sum(op_seconds(o, sop, prof) for o in block_ops(sop)["R"]) + r_k * (37.1 - 5.2) * 1e-6)
    assert none["selective-op"][3:] == none["none"][3:]  # the head and the embedding run unwrapped
    # selective-layer (every 2nd block checkpoint-wrapped): a wrapped block's F, I and W at full's costs, its forward
    # again in I; one stage of 8 blocks holds 4
    sl = base.replace(training={"recompute": "selective-layer", "recompute_every": 2}, parallel={"pp": 1, "dp": 4})
    d, plain = op_durations(sl), op_durations(sl.replace(training={"recompute": "none"}))
    full = none["full"]
    assert d.forward_s[0] - plain.forward_s[0] == pytest.approx(4 * (full[0] - none["none"][0]), rel=1e-9)
    assert d.backward_input_s[0] - plain.backward_input_s[0] == pytest.approx(4 * (full[1] - none["none"][1]), rel=1e-9)
    assert d.backward_weight_s[0] - plain.backward_weight_s[0] == pytest.approx(4 * (full[2] - none["none"][2]),
                                                                                rel=1e-9)


def test_dtensor_and_fsdp2_cost_what_the_profile_measured_beyond_the_kernels_worked_by_hand(tmp_path, monkeypatch):
    """A profile's DTensor and FSDP2 figures (backend/devicebench.py's fake-process-group probes): each TP-sharded
    Linear of a block (the tiny preset's 7) costs ``tp_linear_us`` more in F, ``tp_linear_backward_us`` in I, the SP
    figures under sequence parallelism, and a full recompute runs the forward's again; each FSDP2 unit (8 blocks and
    the root) ``fsdp_unit_us`` in F (``fsdp_unit_kept_us`` under replicate, which gathers nothing) and
    ``fsdp_unit_backward_us`` in I; each aten call of the one-tensor optimizer step on a DTensor parameter
    ``dtensor_optimizer_op_us``. Shipped GPU profiles have none (their launch queue hides the host's work)."""
    import json
    import os
    import socket

    from engine.time.ops import tp_sharded_linears
    from engine.time.step import optimizer_tensors

    monkeypatch.setenv("SHARDSCOPE_CACHE_DIR", str(tmp_path))
    extra = {"tp_linear_us": 100.0, "tp_linear_backward_us": 200.0, "sp_linear_us": 300.0,
             "sp_linear_backward_us": 400.0, "fsdp_unit_us": 1000.0, "fsdp_unit_kept_us": 500.0,
             "fsdp_unit_backward_us": 2000.0, "dtensor_optimizer_op_us": 10.0}
    doc = _measured_doc(socket.gethostname())
    base = default_config().replace(cluster={"gpus": 4, "cpu_cores": 4}, training={"precision": "fp32"},
                                    conventions={"clock": "ops"})
    (tmp_path / "device-cpu.json").write_text(json.dumps(doc))
    plain = {k: base.replace(parallel=p) for k, p in (
        ("tp", {"dp": 1, "tp": 4, "pp": 1, "microbatches": 1}),
        ("sp", {"dp": 1, "tp": 4, "pp": 1, "microbatches": 1, "sequence_parallel": True}),
        ("full", {"dp": 1, "tp": 4, "pp": 1, "microbatches": 1}),
        ("z3", {"dp": 4, "tp": 1, "pp": 1, "zero": 3, "microbatches": 1}),
        ("rep", {"dp": 2, "tp": 2, "pp": 1, "zero": 0, "microbatches": 1}))}
    plain["full"] = plain["full"].replace(training={"recompute": "full"})
    before = {k: op_durations(c) for k, c in plain.items()}
    opt_before = {k: step_time(c).optimizer_s for k, c in plain.items()}
    doc["profile"].update(extra)
    path = tmp_path / "device-cpu.json"
    stamp = path.stat().st_mtime_ns
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # a new profile, whatever the file system's clock grain
    after = {k: op_durations(c) for k, c in plain.items()}
    assert tp_sharded_linears(plain["tp"]) == 7 and tp_sharded_linears(base) == 0
    blocks = 8
    f, i = (lambda k: after[k].forward_s[0] - before[k].forward_s[0],
            lambda k: after[k].backward_input_s[0] - before[k].backward_input_s[0])
    assert (f("tp"), i("tp")) == (pytest.approx(blocks * 7 * 100e-6), pytest.approx(blocks * 7 * 200e-6))
    assert (f("sp"), i("sp")) == (pytest.approx(blocks * 7 * 300e-6), pytest.approx(blocks * 7 * 400e-6))
    assert i("full") == pytest.approx(blocks * 7 * (200e-6 + 100e-6))  # the recomputed forward's DTensor ops
    assert (f("z3"), i("z3")) == (pytest.approx((blocks + 1) * 1000e-6), pytest.approx((blocks + 1) * 2000e-6))
    # dp2 × tp2: FSDP2's replicate (no gather) and TP's DTensor Linears
    assert f("rep") == pytest.approx((blocks + 1) * 500e-6 + blocks * 7 * 100e-6)
    for k in ("z3", "tp"):
        rp = params_per_rank(plain[k])[0][0]
        calls = FOR_LOOP_OPTIMIZER["adamw"][0] * optimizer_tensors(plain[k], rp)
        assert step_time(plain[k]).optimizer_s - opt_before[k] == pytest.approx(calls * 10e-6)
    assert all(getattr(device_profile(g), k) == 0.0 for g in ("h100-sxm", "a100-80g") for k in extra)
