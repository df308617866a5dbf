"""Link calibration: the α/β fit recovers the ring formulas, a link calibration feeds predictions,
the CLI refuses mistakes cleanly, and (with torch) the benchmark runs end to end."""

import importlib.util
import json
import math
import sys

import pytest

from engine import Config, default_config
from engine.compare.calibrate import (
    CalibrationError,
    LinkCalibration,
    calibrate,
    fit_alpha_beta,
    fit_links,
    links_from_benchmark,
    load_links,
)
from engine.predict import predict
from engine.time.comm import LinkFit, ring_seconds
from gui.cli import main as cli


def _samples(alpha: float, bw: float, kinds=("all_reduce", "all_gather", "reduce_scatter", "p2p"), ns=(2, 4)):
    out = []
    for kind in kinds:
        for n in ((2,) if kind == "p2p" else ns):
            for size in (2**10, 2**14, 2**18, 2**22):
                t = ring_seconds(kind, size, 2 if kind == "p2p" else n, bw, alpha)
                out.append({"kind": kind, "n": n, "bytes": size, "seconds": [t * 1.01, t, t * 0.99]})
    return out


@pytest.mark.parametrize("kind,n", [("all_reduce", 4), ("all_gather", 2), ("reduce_scatter", 8), ("p2p", 2)])
def test_fit_recovers_alpha_and_beta_of_the_ring_formula(kind, n):
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    times = [ring_seconds(kind, s, n, 2e9, 30e-6) for s in sizes]
    a, b = fit_alpha_beta(kind, n, sizes, times)
    assert a == pytest.approx(30e-6, rel=1e-6) and b == pytest.approx(2e9, rel=1e-6)


def test_fit_clamps_to_non_negative():
    a, b = fit_alpha_beta("all_reduce", 2, [1e3, 1e6], [1e-3, 0.9e-3])  # larger was faster: latency only
    assert a > 0 and math.isinf(b)
    a, b = fit_alpha_beta("p2p", 2, [1e3, 1e6], [1e-6, 1e-3])  # proportional to size: bandwidth only
    assert a == pytest.approx(0.0, abs=1e-9) and b == pytest.approx(1e9, rel=1e-2)
    with pytest.raises(CalibrationError, match="positive"):
        fit_alpha_beta("all_reduce", 2, [1e3], [0.0])


def test_one_fit_per_collective_and_group_size():
    fits = fit_links(_samples(100e-6, 1e9))
    assert {(f.kind, f.group_size) for f in fits} == {("all_reduce", 2), ("all_reduce", 4), ("all_gather", 2),
                                                      ("all_gather", 4), ("reduce_scatter", 2),
                                                      ("reduce_scatter", 4), ("p2p", 2)}
    assert all(f.latency_s == pytest.approx(100e-6, rel=1e-3) and f.bytes_per_s == pytest.approx(1e9, rel=1e-3)
               for f in fits)


def test_busy_samples_are_fitted_where_measured():
    """CPU ranks' collectives as training pays them (after compute, no barrier) replace the synced samples of
    the same (collective, group size); the others keep theirs."""
    synced = _samples(100e-6, 1e9)
    busy = [{**s, "mode": "busy"} for s in _samples(1.3e-3, 0.5e9) if s["kind"] in ("all_reduce", "p2p")]
    fits = {(f.kind, f.group_size): f for f in fit_links(synced + busy)}
    assert fits[("all_reduce", 4)].latency_s == pytest.approx(1.3e-3, rel=1e-3)
    assert fits[("p2p", 2)].bytes_per_s == pytest.approx(0.5e9, rel=1e-3)
    assert fits[("all_gather", 2)].latency_s == pytest.approx(100e-6, rel=1e-3)


def _raw(alpha=500e-6, bw=1e9, world=4):
    return {"backend": "gloo", "world": world, "device": "cpu", "samples": _samples(alpha, bw),
            "matmul": [{"dtype": "float32", "shape": [512, 512, 512], "flops_per_s_per_rank": [5e10, 6e10, 7e10]},
                       {"dtype": "float32", "shape": [128, 128, 352], "flops_per_s_per_rank": [1e10] * 3}]}


def test_link_calibration_round_trips_and_drives_the_prediction(tmp_path):
    cal = links_from_benchmark(_raw(), source="bench", cores=2)
    assert cal.flops_per_rank == {"fp32": 6e10}  # the largest shape's median
    (tmp_path / "links.json").write_text(json.dumps(cal.to_json()))
    back = load_links(tmp_path)
    assert back.cores == 2 and back.world == 4 and len(back.fits) == len(cal.fits)
    for x, y in zip(back.fits, cal.fits):
        assert (x.kind, x.group_size) == (y.kind, y.group_size)
        assert (x.latency_s, x.bytes_per_s) == pytest.approx((y.latency_s, y.bytes_per_s))
    cfg = default_config().replace(parallel={"dp": 4, "pp": 1, "microbatches": 2})
    slow = links_from_benchmark(_raw(alpha=5e-3), cores=2)
    a, b = cal.predict(cfg).step, slow.predict(cfg).step
    # one all-reduce over 4 ranks: 6 ring steps of α more each
    assert b.breakdown["dp_comm_exposed"] - a.breakdown["dp_comm_exposed"] == pytest.approx(6 * 4.5e-3)
    # 4 ranks on 2 cores: the measured per-rank rate is half a core; the peak it sets is per core
    assert cal.config_for(cfg).cluster.gpu.peak_fp32_tflops == pytest.approx(0.12)
    # 8 ranks on the same 2 cores: links twice as slow as measured at 4
    assert cal.links_for(default_config().replace(cluster={"gpus": 8}, parallel={"dp": 8, "pp": 1})).scale == 2.0


def test_training_calibration_with_links_uses_them_for_communication():
    cfg = default_config().replace(parallel={"dp": 4, "pp": 1, "microbatches": 2}, cluster={"cpu_cores": 0})
    meas = predict(cfg).to_json()
    meas = {"step": {"seconds": meas["step"]["seconds"] * 3, "per_step": [1.0]}, "pipeline": {"per_rank": []}}
    fast = calibrate(cfg, meas, cores=64, links=links_from_benchmark(_raw(alpha=1e-6), cores=64))
    slow = calibrate(cfg, meas, cores=64, links=links_from_benchmark(_raw(alpha=1e-3), cores=64))
    # the same measured step: slower links leave less of it to compute
    assert slow.compute_efficiency > fast.compute_efficiency
    assert slow.predict(cfg).step.seconds == pytest.approx(meas["step"]["seconds"], rel=1e-3)
    other = cfg.replace(parallel={"dp": 2, "pp": 2, "microbatches": 4})
    assert slow.predict(other).step.breakdown["dp_comm_exposed"] > fast.predict(other).step.breakdown["dp_comm_exposed"]


def test_unreadable_link_calibrations_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibrate --links"):
        load_links(tmp_path)
    (tmp_path / "links.json").write_text("{}")
    with pytest.raises(CalibrationError, match="not a link calibration"):
        load_links(tmp_path)
    with pytest.raises(CalibrationError):
        LinkCalibration.from_json({"world": 4, "fits": [{"kind": "all_reduce"}], "flops_per_rank": {}})
    assert LinkFit("p2p", 2, 1e-4, 1e9).group_size == 2


def test_cli_calibrate_mistakes_exit_2_without_traceback(capsys):
    assert cli(["calibrate"]) == 2
    assert "--links" in capsys.readouterr().err
    assert cli(["calibrate", "--links", "--ranks", "1"]) == 2
    err = capsys.readouterr().err
    assert "at least 2 ranks" in err and "Traceback" not in err


def test_launching_side_imports_no_torch():
    code = "import sys, backend.linkbench; sys.exit(1 if 'torch' in sys.modules else 0)"
    import subprocess

    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_benchmark_runs_end_to_end(tmp_path):
    from backend.linkbench import measure_links

    cal = measure_links(2, tmp_path, timeout_s=120)
    assert (tmp_path / "links.json").exists()
    kinds = {f.kind for f in cal.fits}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    assert all(f.latency_s >= 0 and f.bytes_per_s > 0 for f in cal.fits)
    assert cal.flops_per_rank["fp32"] > 0
    raw = json.loads((tmp_path / "links_raw.json").read_text())  # CPU ranks: each collective also as training pays it
    assert {s["kind"] for s in raw["samples"] if s.get("mode") == "busy"} == kinds
    assert Config.load  # the engine stays importable beside it


def test_cli_calibrate_takes_links_or_device_not_both(capsys):
    assert cli(["calibrate", "--links", "--device"]) == 2
    err = capsys.readouterr().err
    assert "--links or --device" in err and "Traceback" not in err


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_calibrate_device_measures_this_cpu_and_the_engine_uses_it(tmp_path, monkeypatch, capsys):
    """``shardscope calibrate --device``: a rank's GEMM rates, bandwidth and per-op dispatch, kept where the
    engine reads the CPU's profile; a prediction under the clock from ops then uses it."""
    import socket

    from engine.time.ops import device_profile

    monkeypatch.setenv("SHARDSCOPE_CACHE_DIR", str(tmp_path))
    assert cli(["calibrate", "--device"]) == 0
    out = capsys.readouterr().out
    assert "GEMM fp32" in out and "per-op cost" in out and str(tmp_path / "device-cpu.json") in out
    doc = json.loads((tmp_path / "device-cpu.json").read_text())
    assert doc["host"] == socket.gethostname() and doc["raw"]["threads"] == 1
    prof = doc["profile"]
    assert prof["launch_us"] > 0 and prof["launch_backward_us"] > 0 and prof["gemm_fraction_fp32"] > 0 and prof["hbm_fraction"] > 0
    assert device_profile("cpu").launch_us == pytest.approx(prof["launch_us"])
    # a softmax computes an exp per element: it streams below the elementwise add on a CPU core
    assert 0 < prof["softmax_fraction"] < 1 and device_profile("cpu").softmax_fraction == prof["softmax_fraction"]
    # the blocks' kernels under each recompute wrapper: per-op selective checkpointing's dispatch mode runs in Python
    # on every op, well above the plain and checkpoint-wrapped blocks' costs (those two are not ordered: a
    # checkpointed forward runs under no_grad and builds no graph, and CI measured it 0.2 % below the plain one)
    assert prof["launch_us_full"] > 0
    assert prof["launch_us_selective_op"] > 2 * max(prof["launch_us_full"], prof["launch_us"])
    assert device_profile("cpu").launch("F", "selective-op") == pytest.approx(prof["launch_us_selective_op"])
    assert "under recompute = selective-op" in out
    # DTensor's and FSDP2's host work (fake-process-group probes): a sharded Linear costs many plain kernels (173 and
    # 241 µs forward here, TP and SP, against 4.2; their order is not held: the two differ by less than a loaded
    # machine's noise); each FSDP2 figure and the DTensor optimizer call measured, not left at 0
    assert min(prof["tp_linear_us"], prof["sp_linear_us"]) > 10 * prof["launch_us"]
    assert min(prof[k] for k in ("tp_linear_backward_us", "sp_linear_backward_us", "fsdp_unit_us", "fsdp_unit_kept_us",
                                 "fsdp_unit_backward_us", "dtensor_optimizer_op_us")) > 0
    assert device_profile("cpu").tp_linear("F", True) == prof["sp_linear_us"]
    # float8: torch._scaled_mm as torchao calls it, each kernel measured. Torch 2.13's CPU kernel with one scale a
    # tensor (a reference loop) ran 0.064 GFLOP/s here, the one with a scale a row 36 (bf16's GEMM 1,180)
    assert 0 < prof["gemm_fraction_fp8_tensorwise"] < prof["gemm_fraction_fp8_rowwise"]
    assert device_profile("cpu").gemm_half("fp8_rowwise") == pytest.approx(prof["gemm_half_gflop_fp8_rowwise"])
    # in a chain of blocks: the probe model's measured forward and backward over its op lists at the hot figures; the
    # profile then times the probe as measured (a CPU core runs interleaved ops slower than alone: 1.47 / 1.24 here)
    from backend.devicebench import context_config
    from engine.time.ops import op_durations

    for t in doc["raw"]["context"].values():
        d = op_durations(context_config(t["precision"]))
        assert float(d.forward_s[0]) == pytest.approx(t["forward_s"], rel=1e-6)
        assert float(d.backward_s[0]) == pytest.approx(t["step_s"] - t["forward_s"], rel=1e-6)
    assert min(prof[k] for k in ("context_forward", "context_backward", "context_forward_bf16",
                                 "context_backward_bf16")) > 0
    assert "in a chain of blocks" in out
    cfg = default_config().replace(conventions={"clock": "ops"})
    assert predict(cfg).step.seconds > 0
