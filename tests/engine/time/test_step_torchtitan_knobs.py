"""Step time under torchtitan's knobs: float8 Linears, torch.compile's fused-elementwise convention,
async TP — each checked against hand arithmetic on llama3-8b / h100-sxm."""

import numpy as np
import pytest

from engine import Config
from engine.time.durations import float8_cast_bytes, flops_per_token, stage_durations
from engine.time.step import (
    COMPILE_CONVENTION,
    analytic_durations,
    compile_saved_bytes,
    step_time,
    tp_stage_seconds,
)


def cfg(tp=1, dp=8, zero=3, float8="none", compile=False, async_tp=False, sp=False, f8ag=False):
    return Config.from_dict({
        "model": {"preset": "llama3-8b", "seq_len": 8192}, "cluster": {"gpu": "h100-sxm", "gpus": dp * tp},
        "parallel": {"dp": dp, "tp": tp, "zero": zero, "sequence_parallel": sp, "async_tp": async_tp},
        "training": {"precision": "bf16-mixed", "micro_batch_size": 2, "float8": float8, "compile": compile,
                     "float8_all_gather": f8ag},
        "conventions": {"clock": "efficiency"}})  # the FLOP clock's float8 and compile conventions


def test_float8_runs_linear_matmuls_at_fp8_rate_plus_casts():
    base, f8 = cfg(), cfg(float8="tensorwise")
    c = base
    fl = flops_per_token(c)
    tokens = 2 * 8192
    eff = c.conventions.compute_efficiency
    saved = 32 * tokens * fl.matmuls / eff * (1 / 989e12 - 1 / 1979e12)
    cast_f, cast_b = float8_cast_bytes(f8)
    # q, k, v, gate, up read h = 4096 per token, o 4096, down 14336; weights cast once per pass
    lin_in = 4096 * 6 + 14336
    weights = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 4096 * 14336 * 3
    assert cast_f == 5 * (tokens * lin_in + weights)
    d0, d8 = stage_durations(c), analytic_durations(f8)
    assert d8.forward_s[0] == pytest.approx(d0.forward_s[0] - saved + 32 * cast_f / 3350e9)
    assert d8.backward_weight_s[0] == pytest.approx(d0.backward_weight_s[0] - saved)
    assert step_time(f8).seconds < step_time(base).seconds


def test_float8_all_gather_casts_the_weight_shard_only():
    a, b = float8_cast_bytes(cfg(float8="tensorwise")), float8_cast_bytes(cfg(float8="tensorwise", f8ag=True))
    weights = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 4096 * 14336 * 3
    assert a[0] - b[0] == pytest.approx(5 * weights * (1 - 1 / 8))


def test_compile_convention_removes_elementwise_round_trips():
    assert COMPILE_CONVENTION == "fused-elementwise"
    fwd, bwd = compile_saved_bytes(cfg(compile=True))
    tokens = 2 * 8192
    assert fwd == 2 * 2 * tokens * (14336 + 2 * 4096 + 4096 + 1024) and bwd == 2 * fwd
    d0, dc = stage_durations(cfg()), analytic_durations(cfg(compile=True))
    assert dc.forward_s[0] == pytest.approx(d0.forward_s[0] - 32 * fwd / 3350e9)
    assert compile_saved_bytes(cfg()) == (0.0, 0.0)
    # compile fuses the float8 casts' amax: 3 B per element instead of 5
    assert float8_cast_bytes(cfg(float8="rowwise", compile=True))[0] * 5 == pytest.approx(
        float8_cast_bytes(cfg(float8="rowwise"))[0] * 3)


def test_async_tp_exposes_only_what_the_matmuls_cannot_hide():
    sync = cfg(tp=8, dp=1, zero=0, sp=True, compile=True)
    overlapped = cfg(tp=8, dp=1, zero=0, sp=True, compile=True, async_tp=True)
    f0, b0 = tp_stage_seconds(sync, 1)
    f1, b1 = tp_stage_seconds(overlapped, 1)
    fl = flops_per_token(sync)
    mm = 32 * 2 * 8192 * fl.matmuls / (989e12 * sync.conventions.compute_efficiency * 8)
    # the edge collectives (embedding's reduce-scatter; head's gather, reduce-scatter, loss all-reduces) stay
    from engine.time.comm import collective_seconds, group_span, tp_edge_collectives
    span = group_span(sync, "tp")
    edge_f = sum(n * collective_seconds(sync, c, s, span) for c, ph, n, s in tp_edge_collectives(sync, True, True)
                 if ph == "forward")
    blocks_f = f0[0] - edge_f
    assert f1[0] == pytest.approx(max(0.0, blocks_f - mm) + edge_f)
    assert np.all(f1 <= f0) and np.all(b1 <= b0)
    assert step_time(overlapped).breakdown["tp_comm"] < step_time(sync).breakdown["tp_comm"]
