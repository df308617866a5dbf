"""The planner's lower bound on a layout's peak memory, vectorised over a structure's candidate rows.

The terms of ``engine.memory`` minus a few small ones and rounding — model states, activations in
flight (in the order torch's schedules run), p2p and bucket buffers, FSDP2's unsharded parameters and
gradients, logits, overhead — at three moments: the activation peak, a forward after the rank's first backward (where FSDP2
holds every unit's accumulated gradient) and the end of the backward (the last stage's kept logits). Any
pp rank bounds the peak; ranks 0 and pp − 1 are read. ``_in_flight_sums`` replays torch's order once per
pipeline shape, across plans."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from engine import names
from engine.memory import activation_bytes_per_layer
from engine.memory.activations import TABLE_RECOMPUTE, weight_op_outputs
from engine.model.recompute import checkpointed_per_stage
from engine.pipeline.schedules import (
    in_flight_states_after_first_backward,
    microbatches_in_flight,
    split_backward_in_flight,
)
from engine.plan.space import (
    _RECOMPUTE,
    _SAFETY,
    _RowBytes,
    _Rows,
    _Struct,
)
from engine.wrapping import _COMPUTE_DTYPE, PLAN_DTYPE_BYTES, reshard_after_forward


class MemoryBound:
    """The memory lower bound's methods of ``engine.plan.grid._Planner``."""

    def _act_per_layer_b1(self, tp: int, sp: bool, rc: str, cp: int = 1, compiled: bool = False) -> int:
        """Saved bytes of one block per sequence — b times this is ≤ the engine's b-value. The table's
        terms are linear in b, a few independent of it (rope's cos / sin: s·d/2 per layer), so this is the
        increment from b = 1 to b = 2, not the b = 1 value (which b times would count those b times)."""
        table = rc if rc in TABLE_RECOMPUTE else "none"  # full, selective-layer: the plain blocks' table
        key = (tp, sp, table, cp, compiled)
        out = self._act1.get(key)
        if out is None:
            def at(b: int, f8: str) -> int:
                cfg = self.base.replace(parallel={"dp": self.base.cluster.gpus // (tp * cp), "tp": tp, "cp": cp,
                                                  "sequence_parallel": sp},
                                        training={"micro_batch_size": b, "recompute": table, "compile": compiled,
                                                  "float8": f8})
                return activation_bytes_per_layer(cfg)
            # float8 moves the per-op policy's stash where the Linears have a bias (Float8Linear adds it after
            # a plain mm the policy's counter counts: ``block_linears_addmm``): the least over the float8 axis
            kinds = {self.base.training.float8} | (set(getattr(self, "float8", ())) if table == "selective-op"
                                                   and self.base.model.bias else set())
            ones = {f: at(1, f) for f in kinds}
            out = self._act1[key] = min(min(one, at(2, f) - one) for f, one in sorted(ones.items()))
        return out

    def _per_layer_vec(self, tp, gs, gr, cp=1, gc=None) -> np.ndarray:
        gc = np.zeros(len(gs), dtype=bool) if gc is None else gc
        lut = np.zeros((2, len(_RECOMPUTE), 2))
        for s in set(gs.tolist()):  # (sets of a few values: np.unique costs more on these short axes)
            for r in set(gr.tolist()):
                for c in set(gc.tolist()):
                    lut[int(s), r, int(c)] = self._act_per_layer_b1(tp, s, _RECOMPUTE[r], cp, bool(c))
        return lut[gs.astype(np.int64), gr, gc.astype(np.int64)]

    def _memory_bound(self, st: _Struct, r: _Rows) -> np.ndarray:
        """The memory lower bound on pp ranks 0 and pp-1 (any rank bounds the peak) on the (compile, b, zero,
        sp, recompute) rows, compile the slowest axis: float8 moves none of its terms."""
        k, conv, tp, cp = self._k, self.base.conventions, st.tp, st.cp
        full = r.rc == _RECOMPUTE.index("full")
        per_layer1 = self._per_layer_vec(tp, r.sp, r.rc, cp, r.cmp)
        sbh1 = np.floor(st.s_len * k.h / r.rep_div)  # one sequence's hidden state, /t under SP (≤ the engine's floor)
        n_comms = (1 if self.base.cluster.gpus > 1 else 0) + (st.dpc > 1) + (cp > 1) + (tp > 1) + (st.pp > 1)
        # FSDP2 (fully_shard, or replicate for DP × TP) makes its sharded gradients in each unit's
        # post-backward (under pipelining only at REDUCE_GRAD): the first backward's own moment and the
        # loss moment before it have none, so the bound holds none (the "pytorch" accounting, where the
        # bound's states per element, w_b + g_b + o_b, are the engine's 4 + 4 + optimizer bytes;
        # "zero-paper" counts the gradients all step)
        torch_acc = getattr(conv, "state_accounting", "pytorch") == "pytorch"
        fsdp2 = self._fsdp2_bytes(tp, st.pp, st.v, st.sc, st.dpc, r.zero, r.m, torch_acc, k.g_b)
        # plain gradients (no FSDP2, no DDP bucket view: ``per_rank.plain_grads_late``) exist from the
        # first backward on: before it the engine holds the fp32 parameters and the optimizer states
        # (ZeRO-1: its share) and no gradient, so those rows bound the states by that (none under LoRA,
        # whose states the bound does not follow), and the end of the backward by it plus 4 B an element
        plain = (np.zeros(len(r.zero), dtype=bool) if not torch_acc or getattr(conv, "ddp_gradient_as_bucket_view", False)
                 else ~fsdp2["on"] & (r.zero <= 1))
        c = _RowBytes(
            full=full, sl=r.rc == _RECOMPUTE.index("selective-layer"), per_layer1=per_layer1, sbh1=sbh1,
            stored1=np.where(full, k.act_b * sbh1, per_layer1), overhead=k.ctx + n_comms * k.buf,
            torch_acc=torch_acc,
            fsdp2_grads=(np.where(r.zero >= 2, 1.0, 1.0 if (tp > 1 and st.dpc > 1) else 0.0) if torch_acc
                         else np.zeros(len(r.zero))),
            # ZeRO-3's gathered units are alive at a backward's own moment when they are the current
            # (+ prefetched) unit (not pipelined) or every unit all step (pipelined, not resharded after
            # forward); resharded after forward under pipelining they are kept only from the first backward on
            gathered_at_b=st.pp == 1 or not reshard_after_forward(3, self.base.parallel.fsdp_reshard_after_forward,
                                                                  True),
            fsdp2=fsdp2, plain=plain, lora=self.base.training.finetune == "lora",
            k_opt=4 * names.OPTIMIZER_STATES[self.base.training.optimizer],
            # a split backward's I keeps each microbatch's weight-op output gradients until its W
            # (engine.memory.activations.split_backward_terms' condition)
            keeps_split=(st.split and torch_acc and self.base.training.finetune != "lora" and st.pp > 1
                         and self.base.model.attention != "mla"))
        capacity = self.base.cluster.gpu.memory_bytes
        mem = np.zeros(len(r.b))
        # the last pp rank first: its logits kept to the step's end (below) reject most pipelined rows
        # before the in-flight replays are read
        for ri, stages, sizes, last_psi in reversed(st.sh["ends"]):
            mem, held = self._rank_held_bytes(st, r, c, ri, stages, sizes, last_psi, mem)
            if self.prefilter and (mem * _SAFETY > capacity).all():
                return mem  # every row is rejected already: the later moments only raise it
            mem = self._in_flight_bound(st, r, c, ri, stages, held, mem)
        return mem

    def _rank_held_bytes(self, st: _Struct, r: _Rows, c: _RowBytes, ri: int, stages: tuple[int, ...],
                         sizes: tuple, last_psi: float, mem: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """pp rank ``ri``'s bytes that do not depend on the microbatches in flight: ``mem`` raised by the end
        of the backward (plain gradients, a split backward's kept gradients, the last stage's kept logits),
        and what the in-flight moments add to (``_in_flight_bound``)."""
        k, conv, model = self._k, self.base.conventions, self.base.model
        w_b, g_b, o_b, act_b, dpc, n_stages = k.w_b, k.g_b, k.o_b, k.act_b, st.dpc, st.n_stages
        gz, gs, bf = r.zero, r.sp, r.bf
        p_ = st.sh["psi"][ri]
        states_by_zero = np.array([(w_b + g_b + o_b) * p_, (w_b + g_b) * p_ + o_b * p_ / dpc,
                                   w_b * p_ + (g_b + o_b) * p_ / dpc, (w_b + g_b + o_b) * p_ / dpc])
        # FSDP2's sharded gradient is in the parameter dtype, fp32 (``states.pytorch_states``)
        sharded_grads = np.array([4 * p_, 4 * p_, 4 * p_ / dpc, 4 * p_ / dpc])
        states = np.maximum(states_by_zero[gz] - c.fsdp2_grads * sharded_grads[gz], 0.0)
        if c.torch_acc:
            # torch's accounting before any gradient: the fp32 parameters (FSDP2's sharded master under ZeRO-2/3) and
            # the optimizer states (ZeRO-1 and up: a share), whatever the gradients' dtype (the paper's w_b + g_b + o_b
            # less the sharded gradients matched it only with 16-bit gradients: a bound above the engine with fp32
            # ones); ZeRO-2's gathered 16-bit units are FSDP2's (``_fsdp2_bytes``' all_units)
            states = np.minimum(states, 4 * p_ / np.where(gz >= 2, dpc, 1) + c.k_opt * p_ / np.where(gz >= 1, dpc, 1))
        if c.plain.any():
            before = 0.0 if c.lora else 4 * p_ + c.k_opt * p_ / np.where(gz == 1, dpc, 1)
            states = np.where(c.plain, before, states)
        fixed = states + c.overhead
        units = tuple(len(st.sh["layers_of"][s]) for s in stages)
        ckpt_units = tuple(checkpointed_per_stage(units, self.base.training.recompute_every))
        # a peak holds either the loss (the moment that opens a last-stage backward) or a backward's
        # own transients (the recomputed block — activations, alive in its backward —, a unit's
        # gradient, the gathered unit), never both
        # (under layer-selective AC a stage's last checkpointed block is recomputed after the plain blocks behind
        # it freed theirs: where every such stage has one, the recompute never tops the backward's start,
        # ``activations._plain_blocks_after_last_checkpoint``)
        every, ends = self.base.training.recompute_every, np.cumsum(units)
        trailing = min((int(e) % every for e, n in zip(ends, ckpt_units) if n), default=0)
        backward = np.where(c.full | (c.sl & (sum(ckpt_units) > 0) & (trailing == 0)), bf * c.per_layer1, 0.0)
        loss = np.zeros(len(r.b))
        if n_stages - 1 in stages:  # fp32 logits and their gradient at the loss
            loss = loss + bf * st.s_len * st.vocab_t * (act_b + (4 if act_b != 4 else 0))
            if c.torch_acc:  # loss_parallel's backward: three fp32 vocabulary shards at once
                loss = np.where(gs, np.maximum(loss, bf * 12.0 * st.s_len * st.vocab_t), loss)
            if c.torch_acc and st.pp > 1:  # the pipeline stage keeps the B's own logits to its end (fwd_cache)
                loss = loss + bf * act_b * st.s_len * np.where(gs, st.vocab_t, model.vocab)
        ag_units = np.zeros(len(r.b))
        all_units = c.fsdp2["all_units"]
        if dpc > 1:
            if not getattr(conv, "ddp_gradient_as_bucket_view", False):
                fixed = fixed + np.where((gz <= 1) & ~c.fsdp2["on"], g_b * p_, 0.0)  # DDP's buckets
            backward = backward + np.where(gz >= 2, c.fsdp2["unit_grad"] * sizes[0], 0.0)
            if c.gathered_at_b:
                gathered = sum(sizes[:2] if conv.fsdp_prefetch and len(sizes) > 1 else sizes[:1])
                ag_units = np.where(gz == 3, w_b * gathered, 0.0)
                backward = backward + ag_units
        # FSDP2's unsharded parameters of every unit, all step, where no unit reshards between its
        # forward and backward (ZeRO-2, replicate, ZeRO-3 not resharded after forward: lifetime
        # "step", engine.memory.buffers.fsdp2_buffers), in place of the current (+ prefetched) unit
        fixed = fixed + all_units * p_
        backward = backward - np.where(all_units > 0, ag_units, 0.0)
        if st.pp > 1:
            ends = sum((s > 0) + (s < n_stages - 1) for s in stages)
            fixed = fixed + ends * r.m * bf * act_b * c.sbh1
        steady = fixed
        if c.plain.any() and not c.lora:  # the end of the backward: every plain gradient made
            mem = np.maximum(mem, np.where(c.plain, steady + 4 * p_, 0.0))
        if c.keeps_split:
            mem = np.maximum(mem, steady + self._split_keep(st.sc, st.tp, ri, st.pp, st.v, stages,
                                                             st.sh["layers_of"], n_stages, r.m, bf, c.sbh1,
                                                             st.s_len, act_b, st.vocab_t))
        fixed = steady + np.maximum(backward, loss)
        head_up = np.zeros(len(r.b))
        if n_stages - 1 in stages:
            # an F's own moment comes before the final norm and the head make the loss side of its
            # microbatch, a B's after their backward freed it, and the in-flight activations below
            # count it: less one microbatch's loss side, at most fp32 norm input, x̂, rstd, head
            # input and log-probabilities over the loss's vocabulary (its shard under SP's
            # loss_parallel, the whole of it otherwise)
            v_up = np.where(gs, st.vocab_t, model.vocab)
            s_len, h = st.s_len, k.h
            # (the head input gathered from the sequence shards under SP: at most 4 B an element)
            head_up = bf * (8 * np.ceil(s_len * h / r.rep_div) + 4 * np.where(gs, s_len * h, np.ceil(s_len * h / r.rep_div))
                            + 4 * s_len + 4 * s_len * v_up)
        # the end of the backward, conventions.pipeline_outputs = "kept": torch.distributed.pipelining has kept
        # every microbatch's logits on the last stage (lifetime "to_step_end"), beside the step terms
        if c.torch_acc and st.pp > 1 and n_stages - 1 in stages and conv.pipeline_outputs == "kept":
            kept = act_b * st.s_len * np.where(gs, st.vocab_t, model.vocab)
            mem = np.maximum(mem, steady + r.m * bf * kept)
        # (a rank of several stages holds each stage's unsharded gradients only from that stage's
        # first backward to its REDUCE_GRAD after its m-th, lifetimes.STAGE_LIFETIMES: then, with m > 1,
        # those of the stage whose backward came first, the rank's last: nearest the loss)
        grads_unsharded, gacc = c.fsdp2["grads_unsharded"], c.fsdp2["gacc"]
        # (under a split backward a stage's gradients are made by its W, after the rank's first I, and in the
        # accumulation dtype only after an I that follows a W: none counted on a rank of several stages)
        late = steady + np.where(grads_unsharded, gacc * p_, 0.0) if len(stages) == 1 else \
            steady + np.where(grads_unsharded & (r.m > 1) & (not c.fsdp2["split"]), gacc * last_psi, 0.0)
        # plain gradients: each stage's from that stage's first backward on (``states.stage_plain_gradients``): on a
        # rank of several stages at least those of the stage whose backward came first, the rank's last; under a split
        # backward its W makes them, and a forward may come between the rank's first I and that W: none counted
        plain_late = c.plain & (not c.lora)
        late = late + np.where(plain_late, 4 * (p_ if len(stages) == 1 else 0 if st.split else last_psi), 0.0)
        return mem, {"fixed": fixed, "late": late, "after_on": grads_unsharded | plain_late, "head_up": head_up,
                     "units": units, "ckpt_units": ckpt_units}

    def _in_flight_bound(self, st: _Struct, r: _Rows, c: _RowBytes, ri: int, stages: tuple[int, ...],
                         held: dict[str, Any], mem: np.ndarray) -> np.ndarray:
        """``mem`` raised by pp rank ``ri``'s in-flight moments, each of which the engine's peak is at least:
        the layer-weighted activation peak of torch's order, with a backward's transients or the loss, and
        a forward after the rank's first backward (with none, any later action before the backward ends),
        where FSDP2 holds every unit's unsharded gradient (lifetime "after_first_backward": pipelined, or
        m > 1) beside the step terms and what is in flight then (ranks of one stage); both less the loss
        side an F's own moment lacks."""
        k, act_b, s_len, gs, bf = self._k, self._k.act_b, st.s_len, r.sp, r.bf
        capacity = self.base.cluster.gpu.memory_bytes
        kc = len(self.compile)
        torch_acc = c.torch_acc
        for rows_held, after_backward in ((held["fixed"], False), (held["late"], True)):
            if after_backward and not held["after_on"].any():
                break
            # replay torch's order only where it matters: the m values whose held part fits; per m the
            # (layer-weighted, first-stage, last-stage, checkpointed-layer-weighted) in-flight counts
            lut = np.zeros((4, st.per_dp + 1))
            # (b: the slowest axis after compile)
            fit_b = (rows_held * _SAFETY <= capacity).reshape(kc, len(st.bs), -1).any(axis=(0, 2)).tolist()
            for m_val in sorted({st.per_dp // b for b, ok in zip(st.bs, fit_b) if ok}):
                lut[:, m_val] = _in_flight_sums(st.sc, ri, st.pp, st.v, m_val, stages, held["units"], st.n_stages,
                                                held["ckpt_units"], after_backward)
            lsum, first, last, lck = lut[:, r.m]
            layers_act = np.where(c.sl, (lsum - lck) * c.per_layer1 + lck * (act_b * c.sbh1), lsum * c.stored1)
            # the last stage's loss side: final-norm input, head input (gathered under SP), fp32 log-probs
            head_in = act_b * np.where(gs, s_len * k.h, c.sbh1) if torch_acc else act_b * c.sbh1
            act = bf * (layers_act + first * 8 * s_len + last * (act_b * c.sbh1 + head_in + 4 * s_len * st.vocab_t))
            if after_backward:
                mem = np.maximum(mem, np.where(held["after_on"], rows_held + np.where(lsum > 0, act - held["head_up"],
                                                                                      0.0), 0.0))
            else:
                mem = np.maximum(mem, rows_held + act - held["head_up"])
        return mem

    def _split_keep(self, sc, tp, ri, pp, v, stages, layers_of, n_stages, gm, bf, sbh1, s_len, act_b,
                    vocab_t) -> np.ndarray:
        """Per row, the most a split backward keeps at once on pp rank ``ri`` from its I's to their W's on one
        stage: that stage's microbatches between I and W at most (``schedules.split_backward_in_flight``)
        times what one keeps (``engine.memory.activations.split_backward_terms`` with the residual stream at
        the activation dtype, ≤ its own): every Linear's and norm weight's output gradient of its blocks and
        the stage input's gradient, and on the last stage the final norm's and the head's."""
        linear_out = weight_op_outputs(self.base.model, tp)
        counts = np.zeros((len(stages), int(gm.max(initial=0)) + 1))  # [local stage, m]
        for m_val in set(gm.tolist()):
            counts[:, m_val] = split_backward_in_flight(sc, pp, v, m_val)[ri]
        out = np.zeros(len(gm))
        for j, st in enumerate(sorted(stages)):
            if st == 0:  # the first stage runs no I: its W is the whole backward
                continue
            one = len(layers_of[st]) * (act_b * s_len * linear_out + 2 * act_b * sbh1) + act_b * sbh1
            if st == n_stages - 1:
                one = one + act_b * sbh1 + act_b * s_len * vocab_t
            out = np.maximum(out, counts[j, gm] * bf * one)
        return out

    def _fsdp2_bytes(self, tp: int, pp: int, v: int, sc: str, dpc: int, gz: np.ndarray, gm: np.ndarray,
                     torch_acc: bool, g_b: int) -> dict[str, Any]:
        """What FSDP2 holds, per candidate of one (tp, pp, v, schedule, cp) on the (b, zero, sp, recompute) axes,
        for the memory bound (``engine.memory.buffers.fsdp2_buffers``, ``engine.wrapping.wrapping_plan``):
        ``on`` (fully_shard for ZeRO-2/3, replicate for ZeRO-0/1 with TP), ``all_units`` (bytes per parameter
        of every unit unsharded all step), ``unit_grad`` (bytes per element of a backward's one-unit gradient),
        ``grads_unsharded`` (every unit's gradient accumulated unsharded at some moment) and ``gacc`` (its
        bytes per element)."""
        base = self.base
        on = (torch_acc and dpc > 1 and base.parallel.dp_mode != "dataparallel") & ((gz >= 2) | (tp > 1))
        z3_reshards = reshard_after_forward(3, base.parallel.fsdp_reshard_after_forward, pp > 1)
        compute = _COMPUTE_DTYPE[base.training.precision]
        pd = PLAN_DTYPE_BYTES[compute]  # MixedPrecisionPolicy's param dtype: what FSDP2 gathers
        gacc = PLAN_DTYPE_BYTES["fp32" if compute == "fp32" else base.training.grad_dtype]
        if base.training.finetune == "lora":  # only the adapters' gradients: none counted
            gacc = 0
        # every unit unsharded from its forward through the backward: replicate, ZeRO-2, and ZeRO-3 not resharded
        # after forward (the states hold torch's fp32 master and optimizer shares only: ``_rank_held_bytes``)
        all_units = np.where(on & ((gz <= 2) | ((gz == 3) & ~z3_reshards)), float(pd), 0.0)
        # a backward's gradient of one unit: the reduce-scatter input (in the reduce dtype) where each backward
        # syncs (FSDP2: one microbatch, no pipeline; the paper's accounting: always), else FSDP2's fresh
        # gradient in the parameter dtype where it accumulates in another (until post-backward adds it in)
        synced = ~on | ((pp == 1) & (gm == 1))
        # (outside a split backward a B's own moment holds only what its first block's MLP backward made of a dense
        # unit's, engine.memory.buffers._made_by_the_b_moment: the bound counts none of it there)
        split = sc in names.SPLIT_BACKWARD_SCHEDULES
        unit_grad = np.where(synced, float(g_b), float(pd) if gacc != pd and split else 0.0)
        if base.training.finetune != "lora":
            # FSDP2 (ZeRO-2/3) reducing unit by unit, one microbatch, no pipeline: the B's own moment is its start,
            # before any post-backward, where no reduce-scatter input exists yet (engine.memory.buffers'
            # ``_unit_by_unit_reduce``: the inputs are laid at later moments of the walk, where they are)
            unit_grad = np.where(on & (gz >= 2) & (pp == 1) & (gm == 1), 0.0, unit_grad)
        # some moment after the rank's first backward (B or I) and before the end of the backward: a later
        # microbatch, a second local stage, or a split backward's W
        grads_unsharded = on & ((gm > 1) | (pp > 1 and (v > 1 or sc in names.SPLIT_BACKWARD_SCHEDULES)))
        return {"on": on, "all_units": all_units, "unit_grad": unit_grad, "grads_unsharded": grads_unsharded,
                "gacc": gacc, "split": split}


@lru_cache(maxsize=8192)
def _in_flight_sums(schedule: str, pp_rank: int, pp: int, v: int, m: int, stages: tuple[int, ...],
                    units: tuple[int, ...], n_stages: int, ckpt: tuple[int, ...] = (),
                    late: bool = False) -> tuple[int, int, int, int]:
    """At the rank's activation peak (``engine.pipeline.schedules.microbatches_in_flight``; ``late``: the layer-weighted
    most of the states after a forward that runs after the rank's first backward, all 0 where none does):
    in-flight microbatches weighted by each local stage's layer count, those on the first and on the last stage,
    and the microbatches weighted by each local stage's checkpointed blocks ``ckpt`` (selective-layer; 0 without).

    Pure in its arguments, so shared by every layout group (tp, b, ZeRO, SP, recompute) with this
    pipeline shape, within one plan and across plans: replaying torch's order is the costly part.
    """
    if late:
        states = in_flight_states_after_first_backward(schedule, pp_rank, pp, v, m)
        if not states:
            return 0, 0, 0, 0
        counts = max(states, key=lambda st: sum(n * u for n, u in zip(st, units)))
    else:
        counts = microbatches_in_flight(schedule, pp_rank, pp, v, m, units)
    lsum = sum(c * u for c, u in zip(counts, units))
    first = sum(c for c, s in zip(counts, stages) if s == 0)
    last = sum(c for c, s in zip(counts, stages) if s == n_stages - 1)
    return lsum, first, last, sum(c * k for c, k in zip(counts, ckpt))
