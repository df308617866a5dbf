"""The planner's candidate grid: every (tp, pp, cp) mesh, schedule and virtual-stage count, and within each
such structure every (micro-batch size, ZeRO stage, SP, recompute, float8, compile) as a row, with the
memory and time lower bounds of ``engine.plan.memory_bound`` and ``engine.plan.time_bound``; what does
not depend on the rows is computed once per structure (``_Planner._shape``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine import names
from engine.config import Config
from engine.memory.overhead import collective_buffer_bytes, runtime_context_bytes
from engine.model.params import params_per_rank
from engine.model.recompute import checkpointed_per_stage
from engine.pipeline.layout import placement_style, split_layers, stage_to_pp_rank
from engine.pipeline.schedules import (
    pipeline_actions,
    schedule_problems,
    single_rank_plan,
)
from engine.pipeline.timeline import simulate
from engine.plan.memory_bound import MemoryBound
from engine.plan.space import (
    _COLS,
    _FLOAT8,
    _RECOMPUTE,
    _SAFETY,
    _SCHEDULE_INDEX,
    _Consts,
    _divisors,
    _Grid,
    _Rows,
    _Struct,
)
from engine.plan.time_bound import TimeBound
from engine.time.comm import PARTIAL_GRADIENT_REDUCES, cpu_oversubscription, norm_tensors, zero1_broadcast_tensors
from engine.time.durations import flops_per_token
from engine.time.ops import bound_efficiency, device_profile
from engine.time.step import (
    FOR_LOOP_OPTIMIZER,
    analytic_durations,
    optimizer_seconds,
    with_mesh_communication,
)
from engine.wrapping import data_parallel_wrapper


class _Planner(MemoryBound, TimeBound):
    """Every candidate layout of a base config as a grid of columns with its memory and time lower bounds
    (``grid``), and the exact pieces the search reads per candidate: its Config and pipeline makespan."""

    def __init__(self, base: Config, global_batch: int, zero: tuple[int, ...], schedules: tuple[str, ...],
                 recompute: tuple[str, ...], max_virtual_stages: int, micro_batch_sizes: tuple[int, ...] | None,
                 cp: tuple[int, ...] = (1,), float8: tuple[str, ...] = ("none",),
                 compile: tuple[bool, ...] = (False,)):
        self.base = base
        self.float8 = float8
        self.compile = compile
        self.prefilter = False  # True: leave layouts whose memory bound exceeds capacity out of the grid
        self.cps = cp
        self.G = global_batch
        self.zero = zero
        self.schedules = schedules
        self.recompute = recompute
        self.max_v = max_virtual_stages
        self.mbs = micro_batch_sizes
        self.structs: list[tuple[int, int, int, str, int]] = []  # (tp, pp, v, schedule, cp)
        self._coll: dict[tuple, float] = {}
        self._act1: dict[tuple, int] = {}
        self._linear_sums: dict[int, tuple[int, int, int]] = {}  # tp -> (inputs, outputs, weights) of a block's linears
        self._plans: dict[tuple, Any] = {}
        self._makespans: dict[tuple, float] = {}
        self._shapes: dict[tuple, dict[str, Any]] = {}
        self._cp_layer: dict[tuple, tuple[float, float]] = {}
        self._ops_unit_cache: dict[tuple, np.ndarray] = {}  # (tp, cp, row key) -> unit_seconds by recompute
        self._k: _Consts | None = None  # grid(): what every struct's bounds read of the base config

    # ----------------------------------------------------------------- helpers

    def _rep(self, tp: int, pp: int, cp: int = 1) -> Config:
        """A valid config with this mesh (GPipe has no microbatch rule) for group spans."""
        return self.base.replace(parallel={"dp": self.base.cluster.gpus // (tp * pp * cp), "tp": tp, "pp": pp,
                                           "cp": cp, "schedule": "GPipe", "microbatches": 1})

    # ----------------------------------------------------------------- enumeration + bounds

    def grid(self) -> _Grid:
        base = self.base
        model, cl, tr = base.model, base.cluster, base.training
        gpus = cl.gpus
        fl = flops_per_token(base)
        s_len, h = model.seq_len, model.hidden
        act_b = 4 if tr.precision == "fp32" else 2
        w_b, g_b = tr.param_bytes, tr.grad_bytes
        o_b = (4 if tr.master_weights else 0) + 4 * names.OPTIMIZER_STATES[tr.optimizer]
        opt_per_param = optimizer_seconds(base, 1.0)  # base has zero 0: seconds per local parameter
        opt_per_tensor = optimizer_seconds(base, 0.0, 1)  # ... and per tensor it steps (0 where torch steps them all at once)
        ctx, buf = runtime_context_bytes(base), collective_buffer_bytes(base)
        peak_rate = cl.gpu.peak_flops(tr.precision) * bound_efficiency(base)
        over = cpu_oversubscription(base)
        # the host work of DTensor and FSDP2 the device profile measured (engine.time.ops.fsdp_unit_seconds,
        # engine.time.step.optimizer_seconds): per unit and microbatch, per DTensor parameter stepped
        prof = device_profile(cl.gpu.name)
        ops = base.conventions.clock == "ops"
        unit = tuple(x * 1e-6 * over if ops else 0.0
                     for x in (prof.fsdp_unit_us, prof.fsdp_unit_kept_us, prof.fsdp_unit_backward_us))
        opt_dtensor = (FOR_LOOP_OPTIMIZER[tr.optimizer][0] * prof.dtensor_optimizer_op_us * 1e-6 * over
                       if ops and cl.gpu.name == "cpu" else 0.0)
        self._k = _Consts(fl, h, act_b, w_b, g_b, o_b, opt_per_param, opt_per_tensor, ctx, buf, peak_rate, over,
                          unit, opt_dtensor)
        tps = [t for t in _divisors(gpus) if model.heads % t == 0 and model.kv_heads % t == 0
               and model.ffn_hidden % t == 0]
        cols: dict[str, list[np.ndarray]] = {c: [] for c in _COLS}
        mem_parts, rest_parts, mk_parts, rest_rank = [], [], [], []
        skipped = prefiltered = 0
        meshes = [(tp, pp, cp) for tp in tps for pp in _divisors(gpus // tp) for cp in self.cps
                  if cp == 1 or ((gpus // (tp * pp)) % cp == 0 and s_len % (2 * cp) == 0)]
        for tp, pp, cp in meshes:
            if pp > model.layers:
                continue
            dp = gpus // (tp * pp * cp)
            if self.G % dp:
                skipped += 1
                continue
            per_dp = self.G // dp
            rep = self._rep(tp, pp, cp)
            bs = [b for b in _divisors(per_dp) if self.mbs is None or b in self.mbs]
            if pp == 1:
                shapes = [(1, "1F1B")]
            else:
                shapes = []
                for sc in self.schedules:
                    if sc in names.SINGLE_STAGE_SCHEDULES:
                        shapes.append((1, sc))
                    elif sc in names.V_SCHEDULES:
                        if 2 * pp <= model.layers:
                            shapes.append((2, sc))
                    else:
                        shapes += [(v, sc) for v in range(2, self.max_v + 1) if pp * v <= model.layers]
            # ZeRO stages differ only with a gradient group (dp·cp > 1); cp refuses ZeRO-1
            zeros = [z for z in self.zero if (dp * cp > 1 or z == 0) and not (cp > 1 and z == 1)] or [0]
            sps = [False] + ([True] if tp > 1 and (s_len // cp) % tp == 0 else [])
            for v, sc in shapes:
                ok_b = [b for b in bs if pp == 1 or not schedule_problems(sc, pp, per_dp // b, v, model.layers)]
                if not ok_b or not zeros:
                    continue
                si = len(self.structs)
                self.structs.append((tp, pp, v, sc, cp))
                part = self._struct_bounds(_Struct(
                    tp=tp, pp=pp, v=v, sc=sc, cp=cp, bs=ok_b, per_dp=per_dp, zeros=zeros, sps=sps, rep=rep,
                    sh=self._shape(tp, pp, v, sc, per_dp // ok_b[0], dp, rep, fl, cp), s_len=s_len // cp,
                    n_stages=pp * v, dpc=dp * cp, split=sc in names.SPLIT_BACKWARD_SCHEDULES,
                    vocab_t=-(-model.vocab // tp)))
                n = len(part["b"])
                prefiltered += part["rejected"]
                for c in ("m", "b", "zero", "sp", "rc", "f8", "cmp"):
                    cols[c].append(part[c])
                for c, val in (("tp", tp), ("pp", pp), ("cp", cp), ("v", v), ("sched", _SCHEDULE_INDEX[sc]),
                               ("struct", si)):
                    cols[c].append(np.full(n, val, dtype=np.int64))
                mem_parts.append(part["mem"])
                rest_parts.append(part["rest"])
                mk_parts.append(part["mk"])
                rest_rank.append(part["rest_rank"])
        if not mem_parts:
            empty = np.zeros(0)
            return _Grid({c: np.zeros(0, dtype=np.int64) for c in _COLS}, empty, empty, empty, [], skipped,
                         prefiltered)
        out = {c: np.concatenate(v) for c, v in cols.items()}
        return _Grid(out, np.concatenate(mem_parts), np.concatenate(rest_parts), np.concatenate(mk_parts),
                     rest_rank, skipped, prefiltered)

    def _struct_bounds(self, st: _Struct) -> dict[str, np.ndarray]:
        """Bounds for every (b, zero, sp, recompute, float8, compile) of one (tp, pp, v, schedule, cp)."""
        # grid axes: b (with m), zero, sp, recompute, float8, compile
        B = np.array(st.bs, dtype=np.int64)
        Z = np.array(st.zeros, dtype=np.int64)
        SP = np.array(st.sps, dtype=bool)
        RC = np.array([_RECOMPUTE.index(r) for r in self.recompute], dtype=np.int64)
        F8 = np.array([_FLOAT8.index(k) for k in self.float8], dtype=np.int64)
        CMP = np.array(self.compile, dtype=bool)
        gb, gz, gs, gr = (a.ravel() for a in np.meshgrid(B, Z, SP, RC, indexing="ij"))
        axes = (gb, gz, gs, gr, st.per_dp // gb, gb.astype(np.float64), np.where(gs, st.tp, 1))
        # every compile setting at once (the rows tiled, compile the slowest axis): [compile, base rows]
        n0, k8, kc = len(gb), len(F8), len(CMP)
        mem_by_compile = self._memory_bound(st, _Rows(*(np.tile(a, kc) for a in axes),
                                                      np.repeat(CMP, n0))).reshape(kc, n0)
        # expand to (b, zero, sp, recompute) × float8 × compile; outside an exhaustive search only the rows
        # that may fit go on (the rest are counted as rejected by the memory bound)
        base_i = np.repeat(np.arange(n0), k8 * kc)
        gf = np.tile(np.repeat(F8, kc), n0)
        ci = np.tile(np.arange(kc), n0 * k8)
        mem = mem_by_compile[ci, base_i]
        rejected = 0
        if self.prefilter:
            keep = mem * _SAFETY <= self.base.cluster.gpu.memory_bytes
            rejected = int(len(keep) - keep.sum())
            base_i, gf, ci, mem = base_i[keep], gf[keep], ci[keep], mem[keep]
        rows = _Rows(*(a[base_i] for a in axes), CMP[ci])
        out = {"b": rows.b, "m": rows.m, "zero": rows.zero, "sp": rows.sp.astype(np.int64), "rc": rows.rc, "f8": gf,
               "cmp": rows.cmp.astype(np.int64), "mem": mem, "rejected": rejected}
        if len(rows.b) == 0:  # the memory bound left none: no durations to bound
            none = np.zeros(0)
            return {**out, "mk": none, "rest": none, "rest_rank": np.zeros((0, st.pp))}
        f, i_, w_ = self._stage_seconds(st, rows, gf)
        mk, rest = self._time_bounds(st, rows, f, i_, w_)
        return {**out, "mk": mk, "rest": rest.max(axis=1), "rest_rank": rest}

    def _shape(self, tp: int, pp: int, v: int, sc: str, m: int, dp: int, rep: Config, fl,
               cp: int = 1) -> dict[str, Any]:
        """What the bounds need from one (tp, pp, v, placement style, cp), shared by the schedules with it:
        parameters per pp rank, the stage placement and the DP collectives of each rank's gradients."""
        style = placement_style(sc)
        key = (tp, pp, v, style, cp)
        out = self._shapes.get(key)
        if out is not None:
            return out
        model, conv = self.base.model, self.base.conventions
        n_stages = pp * v
        held = params_per_rank(self.base.replace(parallel={"dp": dp, "tp": tp, "pp": pp, "cp": cp, "schedule": sc,
                                                          "virtual_stages": v, "microbatches": m}))
        rows = [row[0] for row in held]  # tp-rank 0 of each pp rank: the largest vocabulary chunk
        psi = np.array([r.total for r in rows], dtype=np.float64)  # [pp]
        layers_of = split_layers(model.layers, n_stages, self.base.parallel.pipeline_split)
        head = np.zeros(n_stages)
        head[-1] = fl.head
        owners = stage_to_pp_rank(n_stages, pp, style) if pp > 1 else [0]
        member = np.zeros((pp, n_stages))
        member[owners, np.arange(n_stages)] = 1.0
        first_stage = np.array([min(r.stage_indices) for r in rows])
        # selective-layer's checkpointed blocks per stage: every N-th of each rank's blocks (engine.time.durations)
        ckpt = np.zeros(n_stages)
        for r in rows:
            mine = sorted(r.stage_indices)
            for s_, c_ in zip(mine, checkpointed_per_stage([len(layers_of[x]) for x in mine],
                                                           self.base.training.recompute_every)):
                ckpt[s_] = c_
        out = {"psi": psi, "tensors": np.array([zero1_broadcast_tensors(self.base, r) for r in rows], dtype=np.float64),
               "layers_of": layers_of, "L": np.array([len(x) for x in layers_of], dtype=np.float64),
               "head": head, "member": member, "ckpt": ckpt,
               "fwd_prefix_mask": (np.arange(n_stages)[None, :] < first_stage[:, None]).astype(np.float64),
               "ends": [(ri, rows[ri].stage_indices,
                         rows[ri].largest_unit_numels(2),
                         max(rows[ri].stages, key=lambda st: st.stage).total)  # its last stage's elements
                        for ri in sorted({0, pp - 1})]}
        if dp * cp == 1 and tp > 1 and self.base.training.finetune != "lora":
            # under SP (a row's flag), the optimizer step's all-reduces of the norms' Partial gradients (engine.time.comm)
            one = self._collective(rep, "tp", "all_reduce", model.hidden * 4)
            out["sp_step"] = np.array([norm_tensors(self.base, r.layers, n_stages - 1 in r.stage_indices) for r in rows],
                                      dtype=np.float64) * PARTIAL_GRADIENT_REDUCES[self.base.training.optimizer] * one
        if dp * cp > 1:
            g_bytes, w_b = self.base.training.grad_bytes, self.base.training.param_bytes
            grad_group = "dp" if cp == 1 else "dp_cp"  # gradients reduce over dp·cp (engine.time.comm)

            def per_rank(fn) -> np.ndarray:
                return np.array([fn(int(t)) for t in psi])

            out["nb"] = per_rank(lambda t: max(1, math.ceil(t * g_bytes / (conv.ddp_bucket_mb * 1e6))))
            out["one_bucket"] = per_rank(lambda t: self._collective(
                rep, grad_group, "all_reduce",
                t * g_bytes / max(1, math.ceil(t * g_bytes / (conv.ddp_bucket_mb * 1e6)))))
            out["ar"] = per_rank(lambda t: self._collective(rep, grad_group, "all_reduce", t * g_bytes))
            out["ag"] = per_rank(lambda t: self._collective(rep, grad_group, "all_gather", t * w_b))
            out["rs"] = per_rank(lambda t: self._collective(rep, grad_group, "reduce_scatter", t * g_bytes))
            out["n_units"] = np.array([max(1, r.unit_count) for r in rows], dtype=np.float64)
            out["ag_latency"] = self._collective(rep, grad_group, "all_gather", 0.0)  # one call's α terms
            out["rs_latency"] = self._collective(rep, grad_group, "reduce_scatter", 0.0)
        self._shapes[key] = out
        return out

    # ----------------------------------------------------------------- exact pieces

    def config(self, g: _Grid, i: int) -> Config:
        c = g.cols
        tp, pp, v, sc, cp = self.structs[int(c["struct"][i])]
        return self.base.replace(
            parallel={"dp": self.base.cluster.gpus // (tp * pp * cp), "tp": tp, "pp": pp, "cp": cp,
                      "zero": int(c["zero"][i]),
                      "sequence_parallel": bool(c["sp"][i]), "schedule": sc, "virtual_stages": v,
                      "microbatches": int(c["m"][i])},
            training={"micro_batch_size": int(c["b"][i]), "recompute": _RECOMPUTE[int(c["rc"][i])],
                      "float8": _FLOAT8[int(c["f8"][i])], "compile": bool(c["cmp"][i])})

    def makespan_key(self, g: _Grid, i: int) -> tuple:
        """``makespan``'s cache key of candidate ``i``, from the grid's columns (no Config built)."""
        c = g.cols
        tp, pp, v, sc, cp = self.structs[int(c["struct"][i])]
        return (tp, pp, v, sc, int(c["m"][i]), int(c["b"][i]), bool(c["sp"][i]), _RECOMPUTE[int(c["rc"][i])], cp,
                _FLOAT8[int(c["f8"][i])], bool(c["cmp"][i]),
                self._wrapper_key(int(c["zero"][i]), self.base.cluster.gpus // (tp * pp), tp))

    def _wrapper_key(self, zero: int, dp_cp: int, tp: int) -> str:
        """What of the data-parallel wrapper (engine.wrapping.data_parallel_wrapper) the stage durations read: where
        the device profile times FSDP2's units (engine.time.ops.fsdp_unit_seconds), the wrapper; else, in mixed
        precision, whether it is FSDP2 (whose policy casts; autocast's casts are ops: engine.time.ops.autocast_casts);
        in fp32 nothing."""
        kind = data_parallel_wrapper(zero, dp_cp, tp)
        if any(self._k.fsdp_unit):
            return kind
        fsdp2 = kind in ("fully_shard", "replicate")
        return "fsdp2" if fsdp2 and self.base.training.precision != "fp32" else ""


    def makespan(self, cfg: Config) -> float:
        """The simulated pipeline makespan (as engine.time.step computes it), cached per pipeline shape."""
        par, tr = cfg.parallel, cfg.training
        key = (par.tp, par.pp, par.virtual_stages, par.schedule, par.microbatches, tr.micro_batch_size,
               par.sequence_parallel, tr.recompute, par.cp, tr.float8, tr.compile,
               self._wrapper_key(par.zero, par.dp_cp, par.tp))
        out = self._makespans.get(key)
        if out is None:
            pkey = (par.schedule, par.pp, par.microbatches, par.virtual_stages)
            plan = self._plans.get(pkey)
            if plan is None:
                plan = self._plans[pkey] = (single_rank_plan(par.schedule, par.microbatches) if par.pp == 1 else
                                            pipeline_actions(par.schedule, par.pp, par.microbatches, par.virtual_stages))
            d = with_mesh_communication(cfg, analytic_durations(cfg))
            out = self._makespans[key] = simulate(plan, d).makespan_s
        return out
