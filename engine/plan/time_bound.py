"""The planner's lower bound on a layout's step time, vectorised over a structure's candidate rows.

The exact per-stage F/B durations (compute at float8's rate with its casts and compile's fused elementwise
time, as ``engine.time.step.with_float8_and_compile``, + TP collectives + the exposed CP exchange, as
``engine.time.step``), each pipeline rank's busy time plus the forward chain before its first stage, the
one-microbatch critical path, the exact exposed DP communication and optimizer step."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from engine.config import Config, ConfigError
from engine.plan.space import (
    _FLOAT8,
    _RECOMPUTE,
    _Rows,
    _Struct,
)
from engine.time.comm import collective_seconds, group_span
from engine.time.durations import FLOAT8_CAST_BYTES, block_linears, per_op_recompute_flops_per_token
from engine.time.ops import DeviceProfile, bound_efficiency, device_profile, unit_seconds
from engine.time.step import cp_seconds_per_layer


@lru_cache(maxsize=4096)
def _ops_units_of(base: Config, profile: DeviceProfile, tp: int, cp: int, key: tuple[int, int, int, int],
                  recomputes: tuple[str, ...]) -> np.ndarray:
    """TimeBound._ops_units, kept across plans (``profile``: the device profile it was timed on, so a new
    ``calibrate --device`` is never read from a stale entry); zeros (a valid, loose bound) for a
    combination validation refuses: its rows are refused when evaluated. Without autocast's casts (a row's
    ZeRO stage decides whether it has them: FSDP2's policy has none), so a bound, exact where none are run."""
    b, sp, cmp, f8 = key
    out = np.zeros((len(_RECOMPUTE), 8))
    try:
        cfg = base.replace(parallel={"dp": base.cluster.gpus // (tp * cp), "tp": tp, "pp": 1, "cp": cp,
                                     "schedule": "GPipe", "microbatches": 1, "sequence_parallel": bool(sp)},
                           training={"micro_batch_size": b, "compile": bool(cmp), "float8": _FLOAT8[f8]})
    except ConfigError:
        return out
    for kind, terms in unit_seconds(cfg, recomputes=recomputes, profile=profile, casts=False).items():
        out[_RECOMPUTE.index(kind)] = terms
    out.setflags(write=False)
    return out


class TimeBound:
    """The step-time lower bound's methods of ``engine.plan.grid._Planner``."""

    def _cp_per_layer(self, rep: Config, b: int) -> tuple[float, float]:
        """engine.time.step's exposed context-parallel exchange of one layer (forward, backward) for micro-batch
        size ``b``: exact, as the stage durations of the engine add it."""
        par = rep.parallel
        key = (par.dp, par.tp, par.pp, par.cp, b)
        out = self._cp_layer.get(key)
        if out is None:
            out = self._cp_layer[key] = cp_seconds_per_layer(rep.replace(training={"micro_batch_size": b}))
        return out

    def _collective(self, rep: Config, dim: str, kind: str, size: float) -> float:
        par = rep.parallel
        key = (par.dp, par.tp, par.pp, par.cp, dim, kind, size)
        out = self._coll.get(key)
        if out is None:
            out = self._coll[key] = collective_seconds(self.base, kind, size, group_span(rep, dim))
        return out

    def _stage_seconds(self, st: _Struct, r: _Rows, gf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate [rows] and stage [columns], one microbatch's F, I and W seconds: exactly
        engine.time.durations (CPU ranks sharing cores, float8, compile) + engine.time.step's TP and CP terms."""
        k, tp, cp, sh = self._k, st.tp, st.cp, st.sh
        L = sh["L"]
        gb, gs, gr = r.b, r.sp, r.rc
        n = len(gb)
        if self.base.conventions.clock == "ops":
            f, i_, w_ = self._ops_stage_seconds(st, r, gf)
        else:
            f, i_, w_ = self._flop_stage_seconds(st, r, gf)
        if k.over != 1.0:  # CPU ranks sharing cores run each action that much longer (engine.time.step)
            f, i_, w_ = f * k.over, i_ * k.over, w_ * k.over
        if any(k.fsdp_unit):  # FSDP2's units: each stage's blocks and its root (engine.time.ops.fsdp_unit_seconds)
            gather, kept, back = k.fsdp_unit
            fully = r.zero >= 2
            rep = ~fully & (st.dpc > 1) & (tp > 1)  # replicate: DTensor parameters over dp
            units = L[None, :] + 1.0
            f = f + units * np.where(fully, gather, np.where(rep, kept, 0.0))[:, None]
            i_ = i_ + units * np.where(fully | rep, back, 0.0)[:, None]
        one_tp = np.zeros(n)
        if tp > 1:
            for b in st.bs:
                size = b * st.s_len * k.h * k.w_b
                ar = self._collective(st.rep, "tp", "all_reduce", size)
                agrs = (self._collective(st.rep, "tp", "all_gather", size)
                        + self._collective(st.rep, "tp", "reduce_scatter", size))
                one_tp[(gb == b) & ~gs] = ar
                one_tp[(gb == b) & gs] = agrs
        fwd_tp = 2 * one_tp
        bwd_tp = 2 * one_tp * np.where(gr == _RECOMPUTE.index("full"), 2.0, 1.0)
        f = f + L[None, :] * fwd_tp[:, None]
        i_ = i_ + L[None, :] * bwd_tp[:, None]
        if cp > 1:  # the exposed K, V exchange, exactly as engine.time.step adds it
            cp_f, cp_b = np.zeros(n), np.zeros(n)
            for b in st.bs:
                cp_f[gb == b], cp_b[gb == b] = self._cp_per_layer(st.rep, b)
            # the blocks that recompute their forward repeat its exchange in the backward
            redo = np.where(np.isin(gr, [_RECOMPUTE.index("full"), _RECOMPUTE.index("selective")])[:, None],
                            L[None, :], 0.0) + np.where(gr == _RECOMPUTE.index("selective-layer"), 1.0, 0.0)[:, None] \
                * sh["ckpt"][None, :]
            f = f + L[None, :] * cp_f[:, None]
            i_ = i_ + L[None, :] * cp_b[:, None] + redo * cp_f[:, None]
        return f, i_, w_

    def _flop_stage_seconds(self, st: _Struct, r: _Rows, gf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Under ``conventions.clock = "efficiency"``: engine.time.durations' FLOP-based stage seconds with
        float8 and compile (engine.time.step.with_float8_and_compile), at the bound's rate."""
        k, fl, tp, sh = self._k, self._k.fl, st.tp, st.sh
        L, head = sh["L"], sh["head"]
        gs, gr, gc = r.sp, r.rc, r.cmp
        tokens = r.bf * st.s_len
        rate = k.peak_rate * tp
        rc_flops = np.zeros(len(_RECOMPUTE))  # recomputed forward flops per token and layer, by recompute kind
        rc_flops[_RECOMPUTE.index("full")], rc_flops[_RECOMPUTE.index("selective")] = fl.block, fl.attention_core
        rc_flops[_RECOMPUTE.index("selective-op")] = per_op_recompute_flops_per_token(self.base)
        rc_extra = rc_flops[gr]
        # selective-layer: the checkpointed blocks of each stage recompute their whole forward
        sl = gr == _RECOMPUTE.index("selective-layer")
        ck_extra = np.where(sl, 1.0, 0.0)[:, None] * (sh["ckpt"][None, :] * fl.block)
        f = tokens[:, None] * (L[None, :] * fl.block + head[None, :]) / rate
        i_ = tokens[:, None] * (L[None, :] * (fl.matmuls + 2 * fl.attention_core + rc_extra[:, None])
                                + ck_extra + head[None, :]) / rate
        w_ = tokens[:, None] * (L[None, :] * fl.matmuls + head[None, :]) / rate
        if len(self.float8) > 1 or len(self.compile) > 1 or _FLOAT8.index(self.float8[0]) or self.compile[0]:
            f, i_, w_ = self._float8_and_compile(f, i_, w_, tp, L, sh["ckpt"], tokens, gs, gr, gf, gc, fl, k.act_b,
                                                 rate)
        return f, i_, w_

    def _ops_stage_seconds(self, st: _Struct, r: _Rows, gf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Under ``conventions.clock = "ops"``: each candidate's per-stage compute seconds exactly as
        engine.time.ops.op_durations adds them — one block's, the head's and the embedding's ops for each
        distinct (micro-batch size, sequence parallelism, recompute, compile, float8) of the rows, timed once
        per mesh (tp, cp)."""
        sh = st.sh
        L, ckpt = sh["L"], sh["ckpt"]
        last = (sh["head"] > 0).astype(np.float64)
        first = np.zeros(len(L))
        first[0] = 1.0
        code = ((r.b * 2 + r.sp) * 2 + r.cmp) * len(_FLOAT8) + gf  # one integer per (b, sp, compile, float8)
        uniq, inv = np.unique(code, return_inverse=True)
        keys = [(c // (4 * len(_FLOAT8)), c // (2 * len(_FLOAT8)) % 2, c // len(_FLOAT8) % 2, c % len(_FLOAT8))
                for c in uniq.tolist()]
        table = np.stack([self._ops_units(st.rep, k) for k in keys])  # [key, recompute, term]
        per = table[inv, r.rc]
        f1, ir1, w1, hf, hi, hw, ef, ew = per.T
        sl = np.where(r.rc == _RECOMPUTE.index("selective-layer"), 1.0, 0.0)
        f = L[None, :] * f1[:, None] + last[None, :] * hf[:, None] + first[None, :] * ef[:, None]
        i_ = L[None, :] * ir1[:, None] + (sl * f1)[:, None] * ckpt[None, :] + last[None, :] * hi[:, None]
        w_ = L[None, :] * w1[:, None] + last[None, :] * hw[:, None] + first[None, :] * ew[:, None]
        return f, i_, w_

    def _ops_units(self, rep: Config, key: tuple[int, int, int, int]) -> np.ndarray:
        """engine.time.ops.unit_seconds of the mesh ``rep`` with a row's (b, sp, compile, float8), one row per
        recompute kind (``_RECOMPUTE``'s order)."""
        par = rep.parallel
        cache_key = (par.tp, par.cp, key)
        out = self._ops_unit_cache.get(cache_key)
        if out is None:
            out = self._ops_unit_cache[cache_key] = _ops_units_of(
                self.base, device_profile(self.base.cluster.gpu.name), par.tp, par.cp, key, tuple(self.recompute))
        return out

    def _time_bounds(self, st: _Struct, r: _Rows, f: np.ndarray, i_: np.ndarray,
                     w_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate, a lower bound of the simulated makespan from its stage seconds (each rank busy with
        its stages' F and B of every microbatch after its first forward's wait; one microbatch down the whole
        chain), and per candidate and pp rank the exposed DP communication + optimizer (as engine.time.step)."""
        sh, gm, gz, dpc = st.sh, r.m, r.zero, st.dpc
        member, fwd_prefix_mask = sh["member"], sh["fwd_prefix_mask"]
        b_ = i_ + w_
        chain_back = i_ if st.split else b_
        busy = gm[:, None] * ((f + b_) @ member.T)  # [n, pp]
        head_wait = f @ fwd_prefix_mask.T  # [n, pp]
        mk = np.maximum((busy + head_wait).max(axis=1), f.sum(axis=1) + chain_back.sum(axis=1))
        zc = gz[:, None]
        opt = (self._k.opt_per_param * sh["psi"][None, :] / np.where(zc >= 1, dpc, 1)
               + self._k.opt_per_tensor * sh["tensors"][None, :] / np.where(zc == 1, dpc, 1))
        if dpc > 1:
            nb, one_bucket, ar, ag, rs, n_units = (sh[k] for k in ("nb", "one_bucket", "ar", "ag", "rs", "n_units"))
            if self.base.cluster.gpu.name == "cpu":  # CPU ranks: nothing overlaps (engine.time.comm._dp_items); FSDP
                # gathers every unit at least once a microbatch without pipelining, once a step with it: the
                # parameters' bytes once and each unit's call its latency (a ring's time is linear in the bytes)
                rounds = gm[:, None] if st.pp == 1 else 1
                gathers = rounds * (ag + (n_units - 1) * sh["ag_latency"])
                # ZeRO-1's per-tensor broadcasts: their bytes at least (the queued ones skip the wake)
                # FSDP2 reduce-scatters each unit's gradients: a call's latency each
                scatters = rs + (n_units - 1) * sh["rs_latency"]
                exposed = np.where(zc == 0, nb * one_bucket, np.where(zc == 1, ar + ag - sh["ag_latency"], gathers + scatters))
            else:  # the gradients' collectives hide behind the backward, FSDP's gathers behind F and B
                back_one = b_ @ member.T  # [n, pp]
                window = (f @ member.T + back_one) * gm[:, None]
                calls = np.where(zc == 3, 2 * gm[:, None], 1)
                exposed = np.where(zc == 0, np.maximum(one_bucket, nb * one_bucket - back_one),
                                   np.where(zc == 1, ar + ag, np.maximum(ag / n_units, calls * ag - window) + rs))
        else:
            exposed = 0.0
        if self._k.opt_dtensor:  # each DTensor parameter's step (FSDP2's, TP's; engine.time.step.optimizer_seconds)
            dtensor = (gz >= 2) | (st.tp > 1)
            opt = opt + np.where(dtensor, self._k.opt_dtensor, 0.0)[:, None] * sh["tensors"][None, :] \
                / np.where(zc == 1, dpc, 1)
        if "sp_step" in sh:  # SP rows: the norms' partial gradients all-reduced in the optimizer step
            opt = opt + (r.sp & (gz < 2))[:, None] * sh["sp_step"][None, :]  # fully_shard's post-backward reduces them
        return mk, exposed + opt

    def _float8_and_compile(self, f, i_, w_, tp, L, ckpt, tokens, gs, gr, gf, gc, fl, act_b, rate):
        """engine.time.step.with_float8_and_compile over the grid: float8's matmul rate and casts, compile's fused
        elementwise chains, on the per-stage compute durations (before the mesh's collectives), clamped at 0."""
        base = self.base
        m, gpu = base.model, base.cluster.gpu
        hbm = gpu.hbm_bandwidth_gb_per_s * 1e9
        on8 = gf > 0
        if on8.any():
            sums = self._linear_sums.get(tp)
            if sums is None:  # per tp: a validated replace each structure cost a sixth of the grid
                lin = block_linears(base.replace(parallel={"dp": base.cluster.gpus // tp, "tp": tp}))
                sums = self._linear_sums[tp] = (sum(a for a, _ in lin), sum(o for _, o in lin),
                                                sum(a * o for a, o in lin))
            s_in, s_out, wts = sums
            per = np.where(gc, FLOAT8_CAST_BYTES[True], FLOAT8_CAST_BYTES[False])
            again = np.where(gf == _FLOAT8.index("rowwise"), 2, 1)
            cast_f = per * (tokens * s_in + wts)
            cast_b = per * (again * tokens * s_out + (again - 1) * tokens * s_in + wts)
            cast_f, cast_b = np.where(on8, cast_f, 0.0)[:, None], np.where(on8, cast_b, 0.0)[:, None]
            peak8 = gpu.peak_fp8_tflops * 1e12 * bound_efficiency(base) * tp
            per_block = (np.where(on8, 1.0, 0.0) * tokens * fl.matmuls * (1 / rate - 1 / peak8))[:, None]
            # engine.time.step.recomputed_linear_blocks: the blocks' worth of matmuls the backward runs again
            redo = np.zeros((len(gr), len(L)))
            redo[gr == _RECOMPUTE.index("full")] = L
            redo[gr == _RECOMPUTE.index("selective-layer")] = ckpt
            redo[gr == _RECOMPUTE.index("selective-op")] = L * (per_op_recompute_flops_per_token(base) / fl.matmuls)
            f = f + L[None, :] * (cast_f / hbm - per_block)
            i_ = i_ + L[None, :] * cast_b / hbm + redo * (cast_f / hbm - per_block) - L[None, :] * per_block
            w_ = w_ - L[None, :] * per_block
        if gc.any():
            ffn = m.ffn_hidden / tp if m.mlp == "swiglu" else 0.0
            rope = (m.heads * m.head_dim + m.kv_dim) / tp if m.position == "rope" else 0.0
            residual_norm = 2 * m.hidden / np.where(gs, tp, 1)
            save_f = np.where(gc, 2 * act_b * tokens * (ffn + residual_norm + rope), 0.0)[:, None]
            f = f - L[None, :] * save_f / hbm
            i_ = i_ - L[None, :] * (2 * save_f) / hbm
        return np.maximum(f, 0.0), np.maximum(i_, 0.0), np.maximum(w_, 0.0)
