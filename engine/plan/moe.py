"""The planner for a mixture of experts: layouts with expert parallelism, ranked by throughput.

``engine.plan.search.plan`` hands a model with experts to :func:`plan_moe`. What it enumerates
(every layout trains the same global batch, as the dense planner's):

    tp   divides gpus and heads, kv_heads, ffn_hidden (and expert_ffn_hidden without EP); tp ≤ GPUs per node
    pp   divides gpus / tp, pp ≤ layers;  dp = gpus / (tp · pp), dividing the global batch
    ep   divides the experts and the dense region dp·tp (torchtitan's sparse mesh efsdp · ep)
    zero 0, 2, 3 (and 1 without EP: ZeroRedundancyOptimizer cannot partition experts that differ by EP rank)
    sequence parallel on whenever tp > 1 (it only saves memory and moves the same bytes)
    schedule 1F1B when pp > 1 (plain accumulation when pp = 1)
    micro-batch size  divisors b ≤ 8 of global_batch / dp with microbatches ≥ pp
    recompute none, selective, full

Branch and bound, with bounds that hold for the engine's own numbers (tests check it):

* memory lower bound per rank: its model states as engine.memory counts them (the experts'
  FSDP shards over efsdp), the saved tensors of its blocks (dense and MoE rows) × 1F1B's
  min(m, p − r) microbatches in flight (full recompute: each block's input), the runtime context;
* step lower bound: each pipeline rank's busy time (F + B with the TP and EP collectives, × m)
  plus the forward and backward chain of the stages before it.

Best bound first, a layout that may fit is fully evaluated (``memory_per_rank``, then
``step_time``); the search stops when the next bound exceeds the K-th best step.
"""

from __future__ import annotations

import heapq
import math
import time
from functools import lru_cache
from typing import Any

import numpy as np

from engine import names
from engine.backend_limits import predict_only
from engine.config import Config, ConfigError
from engine.memory import memory_per_rank
from engine.memory.activations import layer_activation_terms, moe_layer_terms, shape_of
from engine.memory.overhead import runtime_context_bytes
from engine.model.params import _moe_params_per_rank
from engine.model.routing import load_shares, mean_expert_load
from engine.names import OPTIMIZER_STATES
from engine.pipeline.layout import placement_style
from engine.plan.results import PlanCancelled, PlanCounts, PlanResult, explain
from engine.time.comm import GroupSpan, all_to_all_seconds, collective_seconds, group_span
from engine.time.durations import block_flops, stage_block_counts
from engine.time.ops import DeviceProfile, device_profile, unit_seconds
from engine.time.step import step_time, tp_seconds_per_layer

MOE_RECOMPUTE = ("none", "selective", "full")
MAX_MICRO_BATCH = 8


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _MoeGrid:
    """What the MoE planner's bounds are made of, each computed once per shape it depends on: probe
    configs, a block's saved bytes, each pp rank's model states and the time it spends beside the
    pipeline, the TP and EP collectives of a block."""

    def __init__(self, base: Config):
        m, cl, tr = base.model, base.cluster, base.training
        self.base = base
        self.gpus, self.gpn = cl.gpus, cl.gpus_per_node
        self.k_states = OPTIMIZER_STATES[tr.optimizer]
        self.torch_acc = base.conventions.state_accounting == "pytorch"
        self.act = 4 if tr.precision == "fp32" else 2
        self.s_len = m.seq_len
        master = 4 if tr.master_weights else 0
        self.opt_bytes = tr.grad_bytes + 2 * (master or tr.param_bytes) + 8 * self.k_states + (tr.param_bytes if master else 0)
        self.hbm = cl.gpu.hbm_bandwidth_gb_per_s * 1e9
        self.phi_ep = base.conventions.moe_capacity_factor or base.conventions.moe_imbalance
        self._probes: dict[tuple, Config | None] = {}
        self._per_layer: dict[tuple, tuple[int, int, int]] = {}
        self._states: dict[tuple, tuple[np.ndarray, np.ndarray, float]] = {}
        self._dp_probes: dict[tuple[int, int], Config] = {}
        self._tp: dict[tuple, tuple[float, float]] = {}
        self._ep: dict[tuple, tuple[float, float]] = {}
        self._units: dict[tuple, tuple[np.ndarray, np.ndarray] | None] = {}

    def probe(self, tp: int, pp: int, ep: int, b: int, rc: str, mb: int = 1) -> Config | None:
        """The base with this layout (1F1B, ZeRO-0); None where validation refuses it."""
        key = (tp, pp, ep, b, rc, mb)
        if key not in self._probes:
            try:
                self._probes[key] = self.base.replace(
                    parallel={"dp": self.gpus // (tp * pp), "tp": tp, "pp": pp, "ep": ep, "sequence_parallel": tp > 1,
                              "microbatches": mb, "schedule": "1F1B", "zero": 0},
                    training={"micro_batch_size": b, "recompute": rc})
            except ConfigError:
                self._probes[key] = None
        return self._probes[key]

    def dp_probe(self, tp: int, pp: int) -> Config:
        if (tp, pp) not in self._dp_probes:
            self._dp_probes[tp, pp] = self.probe(tp, pp, 1, 1, "none", pp) or self.base
        return self._dp_probes[tp, pp]

    def units(self, tp: int, ep: int, b: int, rc: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Under ``conventions.clock = "ops"``: engine.time.ops.unit_seconds with a dense block and with a block
        with experts (each block's F, I with recompute, W; the head's F, I, W; the embedding's F, W)."""
        key = (tp, ep, b, rc)
        if key not in self._units:
            self._units[key] = _units_of(self.base, device_profile(self.base.cluster.gpu.name), tp, ep, b, rc)
        return self._units[key]

    def per_layer(self, tp: int, ep: int, b: int, rc: str) -> tuple[int, int, int] | None:
        """(dense block, MoE block, checkpointed block input) bytes per microbatch, lower bounds
        (they depend on ep only through whether it is > 1)."""
        key = (tp, ep > 1, b, rc)
        if key not in self._per_layer:
            cfg = self.probe(tp, 1, ep, b, rc)
            if cfg is None:
                return None
            terms, _ = layer_activation_terms(shape_of(cfg))
            dense = sum(x for _, x, _ in terms)
            rows, _ = moe_layer_terms(cfg, autocast=False)  # autocast's casts: not under FSDP2's policy
            moe = dense - sum(x for _, x, part in terms if part == "mlp") + sum(x for _, x, _ in rows)
            kept = self.act * self.s_len * b * self.base.model.hidden // tp  # sequence parallel whenever tp > 1
            self._per_layer[key] = (dense, moe, kept)
        return self._per_layer[key]

    def states(self, tp: int, pp: int, ep: int, z: int) -> tuple[np.ndarray, np.ndarray, float]:
        """Per pp rank (its tp-rank 0: the largest vocabulary chunk), the bytes its model states and fixed
        buffers hold and the bytes it adds per microbatch, and the most time a rank spends beside the
        pipeline (its optimizer step and exposed data-parallel collectives)."""
        key = (tp, pp, ep, z)
        if key not in self._states:
            dp = self.gpus // (tp * pp)
            held = _moe_params_per_rank(self.base.model, tp, pp, 1, placement_style("1F1B"),
                                        self.base.parallel.pipeline_split, ep, dp * tp // ep, 1)
            out = []
            same: dict[tuple, tuple[int, int, float]] = {}  # pp ranks holding the same units (the middle ones)
            for row in held:
                rp = row[0]
                if rp.unit_groups not in same:
                    same[rp.unit_groups] = ((*self._rank_state_bytes(rp, tp, dp, ep, z),
                                             self._rank_time_beside(rp, tp, pp, dp, ep, z))
                                            if self.torch_acc else (0, 0, 0))
                out.append(same[rp.unit_groups])
            self._states[key] = (np.array([o[0] for o in out], dtype=np.float64),
                                 np.array([o[1] for o in out], dtype=np.float64), max(o[2] for o in out))
        return self._states[key]

    def _rank_state_bytes(self, rp, tp: int, dp: int, ep: int, z: int) -> tuple[int, int]:
        """A pp rank's model states and fixed buffers at its least, and what it adds per microbatch."""
        psi, k_states, act = rp.total, self.k_states, self.act
        # FSDP2 (fully_shard, or replicate for DP × TP) makes its fp32 sharded gradients in each
        # unit's post-backward: the first backward's own moment has none (engine.memory.lifetimes),
        # so the bound counts 4 B (parameter) + the optimizer's per element there
        # plain gradients (no FSDP2: ``per_rank.plain_grads_late``) exist from the first backward on,
        # so the bound holds none of them either (a weaker bound of the moments after it)
        bucket_view = self.base.conventions.ddp_gradient_as_bucket_view
        plain = not (tp > 1 and dp > 1) and not bucket_view
        if z in (2, 3):
            e_deg = dp * tp // ep if ep > 1 else None
            x = (4 + 4 * k_states) * rp.sharded_numel(dp, e_deg)
        elif z == 1:
            x = (4 if plain else 8) * psi + 4 * k_states * -(-psi // dp)
        elif tp > 1 and dp > 1:
            x = (4 + 4 * k_states) * psi
        else:
            x = (4 if plain else 8) * psi + 4 * k_states * psi
        # the smallest buffers FSDP2 / DDP keep besides (every category counts at the peak):
        # ZeRO-2 (and replicate) hold every unit gathered, ZeRO-3 one unit; DDP its buckets
        if dp == 1:
            fixed = 0
        elif z == 2:
            fixed = act * psi
        elif z == 0 and tp > 1:  # replicate: every unit gathered but the routed experts, which it ignores under ep
            fixed = act * (psi - (rp.experts if ep > 1 else 0))
        elif z == 3:
            fixed = act * rp.largest_unit_numels(1)[0]
        elif bucket_view:
            fixed = 0
        else:
            fixed = 4 * (psi - rp.experts)  # DDP's buckets leave the routed experts out
        # unsharded gradients accumulated over microbatches (FSDP2, m > 1): at least 2 B each
        per_mb = 2 * psi if z in (2, 3) and dp > 1 else 0
        return x + fixed, per_mb

    def _rank_time_beside(self, rp, tp: int, pp: int, dp: int, ep: int, z: int) -> float:
        """The time every layout of this shape spends besides the pipeline on a pp rank: the optimizer
        step over the local shard, and (ZeRO-2/3) FSDP's gradient reduce-scatters, counted exposed."""
        base, psi = self.base, rp.total
        opt = (psi / (dp if z >= 1 else 1)) * self.opt_bytes / self.hbm
        rs = 0.0
        e_units = sum(c for _, c in rp.expert_units)
        dense_psi = psi - (rp.experts if e_units else 0)
        units = max(1, rp.unit_count - e_units)
        dp_span = group_span(self.dp_probe(tp, pp), "dp")
        n_e = dp * tp // ep
        e_local = max(1, min(n_e, self.gpn // ep))
        e_span = GroupSpan("dp", n_e, math.ceil(n_e / e_local), e_local)
        gb, pb = base.training.grad_bytes, base.training.param_bytes

        def coll(kind, size, span):
            return collective_seconds(base, kind, size, span) if span.size > 1 else 0.0

        if z in (2, 3) and dp > 1:
            # exposed: every reduce-scatter, and at least one all-gather call (dense and experts)
            rs = units * coll("reduce_scatter", dense_psi * gb / units, dp_span)
            rs += coll("all_gather", dense_psi * pb / units, dp_span)
            if e_units:
                rs += e_units * coll("reduce_scatter", rp.experts * gb / e_units, e_span)
                rs += coll("all_gather", rp.experts * pb / e_units, e_span)
        elif z == 0 and dp > 1:
            # DDP: at least one bucket's all-reduce is exposed; the experts' one all-reduce whole
            grads = dense_psi * gb
            buckets = max(1, math.ceil(grads / (base.conventions.ddp_bucket_mb * 1e6)))
            rs = coll("all_reduce", grads / buckets, dp_span)
            if e_units:
                rs += coll("all_reduce", rp.experts * gb, GroupSpan("dp", n_e, e_span.nodes, e_span.local))
        return opt + rs

    def comm(self, tp: int, ep: int, b: int, rc: str) -> tuple[float, float, float, float] | None:
        """(TP forward, TP backward per block, EP forward, EP backward per MoE block) seconds per
        microbatch: a TP group (tp ≤ GPUs per node) lies in one node whatever pp, and an EP group is
        ep consecutive ranks (engine.time.comm.ep_span)."""
        if (tp, b, rc) not in self._tp:
            cfg = self.probe(tp, 1, 1, b, rc)
            if cfg is None:
                return None
            self._tp[tp, b, rc] = tp_seconds_per_layer(cfg)
        m = self.base.model
        if ep > 1 and (tp, ep, b, rc) not in self._ep:
            local = min(ep, self.gpn)
            span = GroupSpan("ep", ep, math.ceil(ep / local), local)
            size = b * self.s_len // tp * m.experts_per_token * m.hidden * self.base.training.param_bytes * self.phi_ep
            one = all_to_all_seconds(self.base, size, span)
            self._ep[tp, ep, b, rc] = (2 * one, (2 + (2 if rc == "full" else 0)) * one)
        tf, tb = self._tp[tp, b, rc]
        ef, eb = self._ep[tp, ep, b, rc] if ep > 1 else (0.0, 0.0)
        return tf, tb, ef, eb


@lru_cache(maxsize=4096)
def _units_of(base: Config, profile: DeviceProfile, tp: int, ep: int, b: int,
              rc: str) -> tuple[np.ndarray, np.ndarray] | None:
    """_MoeGrid.units, kept across plans (``profile``: the device profile it was timed on, so a new
    ``calibrate --device`` is never read from a stale entry); None where validation refuses the probe
    (_MoeGrid.probe's layout at pp = 1)."""
    try:
        cfg = base.replace(
            parallel={"dp": base.cluster.gpus // tp, "tp": tp, "pp": 1, "ep": ep, "sequence_parallel": tp > 1,
                      "microbatches": 1, "schedule": "1F1B", "zero": 0},
            training={"micro_batch_size": b, "recompute": rc})
    except ConfigError:
        return None
    dense, moe = (np.array(unit_seconds(cfg, e, profile=profile, casts=False)[rc]) for e in (False, True))
    dense.setflags(write=False)
    moe.setflags(write=False)
    return dense, moe


def moe_candidates(base: Config, G: int, zero: tuple[int, ...], recompute: tuple[str, ...],
                   micro_batch_sizes: tuple[int, ...] | None) -> tuple[list[tuple[float, float, dict]], dict]:
    """Every layout of the grid with its (step lower bound, memory lower bound), and the counts."""
    m, cl = base.model, base.cluster
    gpus, gpn = cl.gpus, cl.gpus_per_node
    rcs = tuple(r for r in recompute if r in MOE_RECOMPUTE) or ("none",)
    g_tp = math.gcd(m.heads, m.kv_heads, m.ffn_hidden)
    grid = _MoeGrid(base)
    torch_acc, act, s_len, phi_ep = grid.torch_acc, grid.act, grid.s_len, grid.phi_ep
    kept_outputs = base.conventions.pipeline_outputs == "kept"
    overhead = runtime_context_bytes(base)
    fd = block_flops(base, False)
    rate1 = cl.gpu.peak_flops(base.training.precision) * base.conventions.compute_efficiency
    ops_clock = base.conventions.clock == "ops"
    fm_cache: dict[float, Any] = {}
    cands: list[tuple[float, float, dict[str, Any]]] = []
    counts = {"enumerated": 0, "skipped_global_batch": 0, "memory_bound_rejected": 0}
    for tp in [t for t in _divisors(gpus) if t <= gpn and g_tp % t == 0]:
        if tp > 1 and s_len % tp:
            continue
        for pp in [p for p in _divisors(gpus // tp) if p <= m.layers]:
            dp = gpus // (tp * pp)
            if G % dp:
                counts["skipped_global_batch"] += 1
                continue
            dn, mn = stage_block_counts(base, pp)
            stage_index = np.arange(pp, dtype=np.float64)
            p2p = ((stage_index > 0).astype(np.float64) + (stage_index < pp - 1)) if pp > 1 else np.zeros(1)
            last = (stage_index == pp - 1).astype(np.float64)
            first = (stage_index == 0).astype(np.float64)
            head = last * fd.head
            for ep in _divisors(math.gcd(m.experts, dp * tp)):
                if ep == 1 and m.expert_hidden % tp:
                    continue
                phi = phi_ep if ep > 1 else (base.conventions.moe_capacity_factor or 1.0)
                if ep > 1 and base.conventions.moe_expert_load:  # the busiest of this ep's ranks
                    phi = ep * max(load_shares(mean_expert_load(base), ep))
                if phi not in fm_cache:
                    fm_cache[phi] = block_flops(base, True, phi)
                fm = fm_cache[phi]
                zs = [z for z in zero if not (z == 1 and ep > 1) and (dp > 1 or z == 0)]
                bs = [b for b in (micro_batch_sizes or _divisors(G // dp)) if (G // dp) % b == 0
                      and b <= MAX_MICRO_BATCH and (pp == 1 or G // (dp * b) >= pp)]
                for b in bs:
                    mb = G // (dp * b)
                    tokens = b * s_len
                    for rc in rcs:
                        pl = grid.per_layer(tp, ep, b, rc)
                        cm = grid.comm(tp, ep, b, rc)
                        if pl is None or cm is None:
                            continue
                        d_b, m_b, kept = pl
                        tf, tb, ef, eb = cm
                        nb = dn + mn
                        # per stage, as arrays: compute (F, B = I + W with recompute) and the critical-path
                        # collectives; the stage chain before each rank; the saved tensors in flight (1F1B)
                        if ops_clock:  # the blocks' ops exactly as engine.time.ops.op_durations adds them
                            units = grid.units(tp, ep, b, rc)
                            if units is None:
                                continue
                            (f_d, i_d, w_d, hf, hi, hw, emb_f, emb_w), (f_m, i_m, w_m, *_) = units
                            stage_f = dn * f_d + mn * f_m + last * hf + first * emb_f + nb * tf + mn * ef
                            stage_b = (dn * (i_d + w_d) + mn * (i_m + w_m) + last * (hi + hw) + first * emb_w
                                       + nb * tb + mn * eb)
                        else:
                            rate = rate1 * tp
                            blk = dn * fd.block + mn * fm.block
                            mm = dn * fd.matmuls + mn * fm.matmuls
                            core = dn * fd.attention_core + mn * fm.attention_core
                            rec = blk if rc == "full" else core if rc == "selective" else 0.0
                            stage_f = tokens * (blk + head) / rate + nb * tf + mn * ef
                            stage_b = tokens * (2 * mm + 2 * core + rec + 2 * head) / rate + nb * tb + mn * eb
                        work = stage_f + stage_b
                        step_lb = float(np.max(np.cumsum(work) - work + mb * work))
                        if base.training.compile and not ops_clock:  # compile's fused-elementwise saving: not here
                            step_lb = 0.0
                        in_flight = np.minimum(mb, pp - stage_index)
                        acts = in_flight * (nb * kept if rc == "full" else dn * d_b + mn * m_b)
                        # buffers every layout of this shape keeps: the pipeline's receive buffers and, on the
                        # last stage under conventions.pipeline_outputs = "kept", every microbatch's logits; EP's
                        # all-to-all buffers of one layer
                        sbh = act * tokens * m.hidden // tp
                        bufs = mb * sbh * p2p
                        if torch_acc and pp > 1 and kept_outputs:  # the logits, vocabulary-parallel under SP
                            bufs = bufs + last * (mb * act * tokens * -(-m.vocab // tp))
                        if ep > 1:
                            bufs = bufs + (mn > 0) * (act * (tokens // tp) * m.experts_per_token * m.hidden * 2)
                        ab = acts + bufs
                        for z in zs:
                            fixed, per_mb, rest = grid.states(tp, pp, ep, z)
                            counts["enumerated"] += 1
                            mem_lb = float(np.max(fixed + (per_mb if mb > 1 else 0.0) + ab)) + overhead
                            layout = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "zero": z, "b": b, "m": mb, "rc": rc}
                            # (1 − 1e-9): the bounds are sums in another order than the engine's; float rounding
                            cands.append(((step_lb + rest) * (1 - 1e-9) if step_lb else 0.0, mem_lb, layout))
    return cands, counts


def moe_layout_config(base: Config, lay: dict[str, Any]) -> Config:
    """The Config of one candidate layout of :func:`moe_candidates`."""
    return base.replace(parallel={"dp": lay["dp"], "tp": lay["tp"], "pp": lay["pp"], "ep": lay["ep"],
                                  "zero": lay["zero"], "sequence_parallel": lay["tp"] > 1, "schedule": "1F1B",
                                  "virtual_stages": 1, "microbatches": lay["m"]},
                        training={"micro_batch_size": lay["b"], "recompute": lay["rc"]})


def plan_moe(t0: float, base: Config, *, top: int, G: int, zero: tuple[int, ...], recompute: tuple[str, ...],
             micro_batch_sizes: tuple[int, ...] | None, exhaustive: bool = False, cancelled=None,
             runnable_only: bool = False):
    """The ``top`` fastest layouts (with ep) of ``base``'s MoE model on its cluster; a PlanResult.
    ``runnable_only``: leave out the layouts the backend cannot run (engine.backend_limits)."""

    m, cl = base.model, base.cluster
    capacity = cl.gpu.memory_bytes
    all_cands, counts = moe_candidates(base, G, zero, recompute, micro_batch_sizes)
    cands = []
    for serial, (step_lb, mem_lb, layout) in enumerate(all_cands):
        if not exhaustive and mem_lb > capacity:
            counts["memory_bound_rejected"] += 1
            continue
        cands.append((step_lb, serial, layout))
    heapq.heapify(cands)
    best: list[tuple[float, tuple, int, Config, Any, Any]] = []
    evaluated = no_fit = invalid = not_runnable = 0
    while cands:
        if cancelled is not None and cancelled():
            raise PlanCancelled("cancelled while searching the top layouts")
        bound, i, lay = heapq.heappop(cands)
        if not exhaustive and len(best) >= top and bound > best[top - 1][0]:
            heapq.heappush(cands, (bound, i, lay))
            break
        try:
            cfg = moe_layout_config(base, lay)
        except ConfigError:
            invalid += 1
            continue
        if runnable_only and predict_only(cfg):
            not_runnable += 1
            continue
        evaluated += 1
        mem = memory_per_rank(cfg)
        if not mem.fits:
            no_fit += 1
            continue
        st = step_time(cfg)
        key = (lay["tp"], lay["pp"], lay["ep"], lay["zero"], lay["b"], names.RECOMPUTE_KINDS.index(lay["rc"]))
        entry = (st.seconds, key, i, cfg, st, mem)
        if len(best) < top or (entry[0], entry[1]) < (best[-1][0], best[-1][1]):
            best.append(entry)
            best.sort(key=lambda e: (e[0], e[1]))
            del best[top:]
    counts.update(pruned_by_time_bound=len(cands), pipelines_simulated=0, fully_evaluated=evaluated,
                  did_not_fit=no_fit, rejected_by_validation=invalid, fitting_timed=evaluated - no_fit,
                  predict_only_skipped=not_runnable)
    notes = (
        f"every layout trains the same global batch: {G} sequences × {m.seq_len} tokens = {G * m.seq_len:,} tokens "
        "per step "
        "(--global-batch changes it)",
        "mixture of experts: ep searched over the divisors of the experts and of dp·tp (torchtitan's sparse mesh); "
        "1F1B when pp > 1, sequence parallel whenever tp > 1, tp within a node, recompute none | selective | full, "
        f"micro-batch sizes ≤ {MAX_MICRO_BATCH}; ZeRO-1 only without EP",
        "time = engine.time.step (makespan with TP collectives and EP all-to-alls inside F/B + exposed DP communication "
        "+ optimizer); fit = engine.memory on every rank against cluster.gpu.memory_gib",
    )
    return PlanResult(model=m.preset or "custom", gpus=cl.gpus, gpu=cl.gpu.name, gpus_per_node=cl.gpus_per_node,
                      global_batch=G,
                      tokens_per_step=G * m.seq_len, capacity_bytes=capacity, entries=explain(best, capacity),
                      counts=PlanCounts(**counts), elapsed_s=time.perf_counter() - t0, exhaustive=exhaustive,
                      notes=notes, base=base)
