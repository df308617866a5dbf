"""Measuring one rank: exact local bytes of params / grads / optimizer state, and the
PyTorch MemTracker's peak breakdown mapped onto engine.names.MEMORY_CATEGORIES.

The tracker runs over a separate, untimed step, so the timed steps carry no tracking cost.
"""

from __future__ import annotations

import resource
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from engine.names import MEMORY_CATEGORIES

#: MemTracker / FSDPMemTracker reference types -> our categories.
TRACKER_TO_CATEGORY: dict[str, str] = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "comm_buffers",  # all-gathered copy of FSDP parameters
    "Buffer": "overhead",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "comm_buffers",  # full gradient before the reduce-scatter
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
    "Other": "overhead",
}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def unique_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _held_bytes(tensors) -> int:
    """Bytes ``tensors`` hold: a plain tensor its elements; a DTensor the storage behind its local
    tensor, each storage once. An FSDP2 shard is a view into its own padded storage (dim 0 padded to a
    multiple of the shard degree: ``FSDPParam._init_sharded_param``), and its gradient a view into the
    group's reduce-scatter output (``foreach_reduce``'s ``as_strided``): a rank whose chunk is short or
    empty still holds the padded bytes."""
    total, storages = 0, {}
    for t in tensors:
        if isinstance(t, DTensor):
            storage = t.to_local().untyped_storage()  # hashed by the storage itself (fake ones too)
            storages[storage] = storage.nbytes()
        else:
            total += t.numel() * t.element_size()
    return total + sum(storages.values())


def param_bytes(params: list[nn.Parameter]) -> int:
    return _held_bytes(params)


def param_count_local(params: list[nn.Parameter]) -> int:
    return sum(local_tensor(p).numel() for p in params)


def grad_bytes(params: list[nn.Parameter]) -> int:
    return _held_bytes(p.grad for p in params if p.grad is not None)


def optimizer_state_of(optimizer: torch.optim.Optimizer) -> dict:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer
    return inner.state


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """State tensors (exp_avg, exp_avg_sq, momentum_buffer, ...), without Adam's scalar step."""
    total = 0
    for state in optimizer_state_of(optimizer).values():
        for key, v in state.items():
            if key != "step" and isinstance(v, torch.Tensor):
                total += _nbytes(v)
    return total


def p2p_buffer_bytes(schedule) -> int:
    """Bytes of the receive buffers torch.distributed.pipelining keeps per microbatch and stage.

    Each PipelineStage allocates one activation receive buffer (``args_recv_info``) and one
    gradient receive buffer (``grad_recv_info``) per microbatch in its first step and reuses them;
    they predate the MemTracker of the measuring step, so it never sees them. Counted here, as
    comm_buffers, like DDP's buckets. (The activation buffer is also the stage's input that its
    first block saves for backward — so that input is not in the tracker's activations either.)
    """
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    seen: set[int] = set()
    total = 0
    for st in stages:
        for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
            for info in infos if isinstance(infos, (tuple, list)) else (infos,):
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor) and buf.untyped_storage().data_ptr() not in seen:
                    seen.add(buf.untyped_storage().data_ptr())
                    total += _nbytes(buf)
    return total


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def tracker_for(modules: list[nn.Module], optimizer: torch.optim.Optimizer, inputs: Iterable[torch.Tensor] = ()):
    """FSDPMemTracker for a single fully_shard'ed module whose every parameter FSDP2 manages, else the general
    MemTracker; either one
    leaving out what existed before it (:func:`_without_pre_existing`) except ``inputs`` (the batch)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    # ZeRO-1's wrappers (ZeroRedundancyOptimizer, TensorParallelZeRO1) keep their shard's states in the
    # inner ``optim``; their own ``state`` is empty, so a tracker given the wrapper saw the states only
    # from the optimizer step on, and a ZeRO-1 rank's forward and backward without them (FSDP2's
    # replicate under ZeRO-1 × TP too: found by the fake sweep, seed 2612 #19, whose replay lacked 5.2 GiB
    # of optimizer state)
    inner = getattr(optimizer, "optim", optimizer)
    if len(modules) == 1 and isinstance(modules[0], FSDPModule) and _all_fsdp_managed(modules[0]):
        tracker = _without_pre_existing(FSDPMemTracker, inputs)(modules[0], inner)
    else:
        tracker = _without_pre_existing(MemTracker, inputs)()
        tracker.track_external(*modules, inner)
        _filing_fsdp_groups(tracker, modules)
    _allow_repeated_root_calls(tracker)
    tracker._param_to_grad_hook_handles = _FrozenReadAsHooked()
    return tracker


class _FrozenReadAsHooked(WeakIdKeyDictionary):
    """MemTracker's parameter → gradient-hook handles, where a parameter that takes no gradient (LoRA's
    frozen base) reads as hooked: the tracker registers a gradient hook on every parameter of a module it
    enters, which torch refuses for a frozen one. It looks them up at each forward, so FSDP2's unsharded
    parameters, new objects swapped in for the forward, are covered too (marking the sharded ones
    beforehand was not: LoRA × FSDP2 × pipelining failed to measure, fake sweep seed 20261208 #32)."""

    _NONE = (None, None)

    def get(self, key, default=None):
        if isinstance(key, torch.Tensor) and not key.requires_grad:
            return self._NONE
        return super().get(key, default)


def _all_fsdp_managed(module: nn.Module) -> bool:
    """Every parameter of ``module`` is one an FSDP2 wrapper manages. FSDPMemTracker registers only those (its
    ``_instrument_fsdp_sharded_params_grads``): a parameter left out of the wrappers — the routed experts
    ``replicate`` ignores under expert parallelism (``backend.parallel.data_parallel.apply_replicate``) — it never
    files, and the tracker's first sight of its storage, an op's input, made it pre-existing and uncounted
    (measure --fake of Mixtral 8x7B, ZeRO-0 × TP2 × EP4: 10.5 GiB of expert weights and their gradients missing).
    The general MemTracker registers every parameter of the modules it is given."""
    from torch.distributed.fsdp import FSDPModule

    managed: set[int] = set()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or ():
                managed.update(id(fp.sharded_param) for fp in group.fsdp_params)
    return all(id(p) in managed for p in module.parameters())


def _storage_key(t) -> int | None:
    """What identifies ``t``'s storage while it lives (its StorageImpl; a view shares its base's), for a
    plain tensor or parameter, or a fake one (``measure --fake``); None for tensor subclasses (DTensor,
    float8: the tracker files their inner tensors) and meta tensors."""
    if type(t) in _PLAIN or (_FAKE is not None and type(t) is _FAKE):
        if t.device.type == "meta":
            return None
        try:
            return t.untyped_storage()._cdata
        except RuntimeError:  # a storage without data (functional tensors)
            return None
    return None


def _storage_keys(tree) -> set[int]:
    """:func:`_storage_key` of every tensor in ``tree``."""
    from torch.utils._pytree import tree_flatten

    return {k for k in map(_storage_key, tree_flatten(tree)[0]) if k is not None}


_PLAIN = (torch.Tensor, nn.Parameter)
try:
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE
except ImportError:  # pragma: no cover - torch without fake tensors
    _FAKE = None


#: the reference types the trackers give an op's output as it is made (MemTracker and FSDPMemTracker's
#: ``__torch_dispatch__``), before any hook names what it is
_AS_MADE = ("Activation", "Temp")
#: what FSDPMemTracker's hooks and this backend's filing (``_file_unsharded``) name FSDP2's buffers
_FSDP_NAMES = ("Unsharded Param", "Unsharded Grad", "Sharded Grad", "Reduce Scatter")


def _without_pre_existing(base: type, inputs: Iterable[torch.Tensor] = ()) -> type:
    """``base`` (MemTracker or FSDPMemTracker) not counting memory that existed before it.

    MemTracker files a storage the first time an op under it outputs a tensor on it — a fresh
    allocation, or a view of / write into memory it has never seen. The second kind predates the
    tracker: DDP's gradient buckets (the Reducer writes each gradient into its bucket with
    ``mul.out``: first seen in the backward, as Temp), torch.distributed.pipelining's receive buffers
    (allocated in the first step and reused: first seen as a view, or as ``recv_``'s output). The
    backend counts those at their exact sizes as comm_buffers, alive all step (they are), so filing
    them as well from the moment the tracker first sees them counts them twice from then on — a
    gradient-sized "temporary" in DDP's synchronised backward, one activation per receive buffer —
    and moves its peak to where they appear. A storage first seen among the op's own inputs is that
    kind: it is left out (``pre_existing`` records it, by op, with its bytes). ``inputs`` (the batch,
    made before the tracker) are counted as before."""
    keep = _storage_keys(list(inputs))

    class Tracker(base):
        def __init__(self, *a, **k):
            self.pre_existing: dict[str, int] = {}
            self._skipped: dict[int, tuple[str, int]] = {}  # storage key -> (first op, bytes)
            self._clock = 0  # counts the snapshot's updates (:meth:`_update_snap`)
            self._peak_at = 0  # the clock when the overall peak was last taken (``_overall_peak_only``)
            super().__init__(*a, **k)

        def __enter__(self):
            out = super().__enter__()
            if self._depth == 1:  # the peak snapshot it starts from is the current one
                self._peak_at = self._clock
            return out

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            from torch.distributed._tools.mem_tracker import _UpdateType

            if u_type == _UpdateType.REF:
                self._refile_at_peak(winfo, old_reftype)
            super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
            self._clock += 1
            if u_type == _UpdateType.ADD:
                winfo._shardscope_born = self._clock
            elif u_type in (_UpdateType.REF, _UpdateType.SIZE):
                winfo._shardscope_changed = self._clock

        def _refile_at_peak(self, winfo, old_reftype) -> None:
            """A storage filed anew (``old_reftype`` → ``winfo.reftype``) from the label an op's output gets as it is
            made ("Temp", "Activation"), alive at the peak with that label and its size now, is filed anew in the
            peak's snapshot too: the trackers take a peak on the op that makes a tensor, before a hook names it
            (FSDP2's post-backward makes a unit's accumulated gradient with ``.to(reduce_dtype)``, a "Temp" until the
            filing after that post-backward calls it "Unsharded Grad": at a peak set by that allocation a full
            gradient counted as a temporary — measure --fake of Llama 3 405B tp8 pp4 cp4 ZeRO-2, stage 0: the token
            embedding's 8,016 MiB fp32 accumulation). Only FSDP2's names: a name a hook gave already stays at the
            peak (the general MemTracker's gradient hook and this backend's filing name a pipelined unit's gradient in
            turn "Gradient" and "Unsharded Grad"), and the general MemTracker's gradient hook names a fresh gradient
            "Gradient" before autograd adds it into the one accumulated (a temporary, never the parameter's .grad)."""
            born = getattr(winfo, "_shardscope_born", None)
            if born is None or born > self._peak_at or getattr(winfo, "_shardscope_changed", 0) > self._peak_at:
                return
            if getattr(old_reftype, "value", old_reftype) not in _AS_MADE or \
                    getattr(winfo.reftype, "value", winfo.reftype) not in _FSDP_NAMES:
                return
            peak = self._peak_mem_snap.get(winfo.device)
            if peak is not None and winfo.mem_consumed:
                peak[old_reftype] = peak.get(old_reftype, 0) - winfo.mem_consumed
                peak[winfo.reftype] = peak.get(winfo.reftype, 0) + winfo.mem_consumed

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                restore = self.__dict__.pop("_shardscope_restore", None)
                if restore is not None:
                    restore()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op = (func, args, kwargs)
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._op = None

        def _track(self, reftype, t: torch.Tensor) -> None:
            op = getattr(self, "_op", None)
            ptr = _storage_key(t) if op is not None else None
            if ptr is not None:
                st = t.untyped_storage()
                if (ptr not in keep and self._WINFO.get(st) is None
                        and ptr in _storage_keys((op[1], op[2]))):
                    if ptr not in self._skipped:
                        name = str(op[0])
                        self._skipped[ptr] = (name, st.nbytes())
                        self.pre_existing[name] = self.pre_existing.get(name, 0) + st.nbytes()
                    return
            super()._track(reftype, t)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            # FSDPMemTracker files FSDP2's unsharded parameters itself (their storages predate it, resized
            # by each all-gather, and an op may see them first): those are counted, not pre-existing
            out = super()._update_and_maybe_create_winfos(t, reftype, update_existing=update_existing)
            if self._skipped and isinstance(t, torch.Tensor):
                for ptr in _storage_keys(t):
                    if ptr in self._skipped:
                        name, n = self._skipped.pop(ptr)
                        self.pre_existing[name] -= n
                        if not self.pre_existing[name]:
                            del self.pre_existing[name]
            return out

    if hasattr(base, "_fsdp_param_group_post_backward"):
        Tracker = _filing_fsdp_buffers(Tracker)
    Tracker.__name__ = Tracker.__qualname__ = base.__name__
    return Tracker


def _filing_fsdp_buffers(base: type) -> type:
    """FSDPMemTracker filing what FSDP2 holds unsharded by what it is, as its reference types name them: the
    gradient a unit accumulates across microbatches in the reduce dtype ("Unsharded Grad": the full gradient before
    the reduce-scatter; ``FSDPParam.to_accumulated_grad_if_needed`` makes it in the post-backward of a microbatch that
    does not reduce, with ``.to(reduce_dtype)``, which the tracker files as a temporary — it relabels only
    ``unsharded_param.grad``) and each unit's all-gather outputs, the unsharded parameters' storage ("Unsharded
    Param", as its pre-forward files the parameter; after the pre-backward too, where the backward gathers them
    again), after each of the three hooks it wraps.

    And the recomputation's tensors as activations, as MemTracker files them: both trackers file what an op makes
    in the backward as a temporary unless they are in an activation-checkpointing region, which MemTracker marks
    from the first module whose forward runs in the backward until its forward returns (its ``_pre_fw_hook``, "Case
    2"). FSDPMemTracker marks it only from an FSDP module's pre-forward, which a recomputation never runs where the
    checkpoint wrapper is inside the FSDP unit (``fully_shard(checkpoint_wrapper(block))``, as this backend and
    torchtitan wrap blocks): the recomputed block's activations, alive through its backward, were temporaries (a
    fake Llama 2 7B pp4 cp2 HSDP full-recompute stage at its backward peak: activations 6.0 GiB, the engine's 13.5,
    7.5 GiB more in the temporaries). Module hooks on its ModTracker mark the region the same way."""
    class Filing(base):
        def __enter__(self):
            if self._depth == 0 and self._mod_tracker._user_pre_fw_hook is None:
                self._mod_tracker.register_user_hooks(pre_fw_hook=self._ac_enter, post_fw_hook=self._ac_exit)
            return super().__enter__()

        def _ac_enter(self, module, _inputs):
            if self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _ac_exit(self, module, _inputs, _outputs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _then_file(self, inner, fsdp_mod):
            def hooked(*args, **kwargs):
                out = inner(*args, **kwargs)
                _file_unsharded(self, fsdp_mod._get_fsdp_state()._fsdp_param_group)
                return out
            return hooked

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            return self._then_file(super()._fsdp_state_pre_forward(fsdp_mod, orig), fsdp_mod)

        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
            return self._then_file(super()._fsdp_param_group_pre_backward(fsdp_mod, orig), fsdp_mod)

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            return self._then_file(super()._fsdp_param_group_post_backward(fsdp_mod, orig), fsdp_mod)

    return Filing


def _file_unsharded(tracker, group, sharded_grads: bool = False) -> None:
    """File FSDP param group ``group``'s all-gather outputs (the unsharded parameters' storage) as "Unsharded
    Param", its unsharded gradients (autograd's, and the accumulation in the reduce dtype) as "Unsharded Grad",
    where ``sharded_grads``, the sharded gradients its reduce-scatter made as "Sharded Grad", and HSDP's kept
    all-reduce input as "Reduce Scatter" (a communication buffer)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    for fp in group.fsdp_params if group else ():
        for t in getattr(fp, "all_gather_outputs", None) or ():
            if t.untyped_storage().nbytes():
                tracker._update_and_maybe_create_winfos(t, _FSDPRefType.UNSHARDED_PARAM)
        for g in (fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None, fp.unsharded_accumulated_grad):
            if g is not None:
                tracker._update_and_maybe_create_winfos(g, _FSDPRefType.UNSHARDED_GRAD)
        g = fp.sharded_param.grad if sharded_grads else None
        if g is not None:
            tracker._update_and_maybe_create_winfos(local_tensor(g), _FSDPRefType.SHARDED_GRAD)
    # HSDP's all-reduce input in the reduce dtype, which the group keeps to its next unshard or the backward's end
    # (torch 2.13 FSDPParamGroup._all_reduce_state, PR #140044): a communication buffer, not a temporary — where the
    # reduce dtype is the parameters' it is the sharded gradients' own storage, filed as those above
    held = getattr(getattr(group, "_all_reduce_state", None), "all_reduce_input", None)
    winfo = tracker._WINFO.get(held.untyped_storage(), (None, None))[0] if held is not None else None
    if winfo is not None and getattr(winfo.reftype, "value", None) in _AS_MADE:
        tracker._update_and_maybe_create_winfos(held, _FSDPRefType.REDUCE_SCATTER)


def _filing_fsdp_groups(tracker, modules) -> None:
    """The general MemTracker (a rank of several modules: pipeline stages, each fully_shard'ed) filing FSDP2's
    buffers as FSDPMemTracker does (:func:`_filing_fsdp_buffers`): left to itself it tags the unsharded parameters
    "Parameter" or, made in a forward, "Activation" (ZeRO-2 keeps them), the unsharded gradients "Gradient" and the
    sharded ones "Temp" (a fake Mixtral 8x7B pp2 ZeRO-2 stage: 5.7 GiB of unsharded parameters as activations). After
    each FSDP module's pre-forward (a forward pre-hook behind FSDP2's own), its param group's pre-backward and
    post-backward, the group's buffers are filed by what they are; the hooks go when the tracker exits."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for mod in modules:
        for m in mod.modules():
            g = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
            if g is not None:
                groups.append((m, g))
    if not groups:
        return
    # the snapshots' keys: its own reference types and the four of FSDP2's it files
    fsdp_kinds = [_FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.UNSHARDED_GRAD, _FSDPRefType.SHARDED_GRAD,
                  _FSDPRefType.REDUCE_SCATTER]
    tracker._ref_class = list(tracker._ref_class) + fsdp_kinds
    for dev_snap in tracker._curr_mem_snap.values():  # the snapshots it began with (its parameters')
        for k in fsdp_kinds:
            dev_snap.setdefault(k, 0)
    undo = []
    for m, g in groups:
        h = m.register_forward_pre_hook(lambda _m, _a, g=g: _file_unsharded(tracker, g))
        pre, post = g.pre_backward, g.post_backward

        def pre_backward(*a, _f=pre, _g=g, **k):
            out = _f(*a, **k)
            _file_unsharded(tracker, _g)
            return out

        def post_backward(*a, _f=post, _g=g, **k):
            _file_unsharded(tracker, _g)
            out = _f(*a, **k)
            _file_unsharded(tracker, _g, sharded_grads=True)
            return out

        g.pre_backward, g.post_backward = pre_backward, post_backward
        undo.append((h, g, pre, post))

    def restore() -> None:
        for h, g, pre, post in undo:
            h.remove()
            g.pre_backward, g.post_backward = pre, post
    tracker._shardscope_restore = restore


_STEP_PARENT = "<shardscope step>"


def _allow_repeated_root_calls(tracker) -> None:
    """Let the trackers follow microbatches and every pipeline schedule.

    Both trackers refuse a second forward of a root module (they take it for a second
    iteration, which their per-module statistics do not support). Gradient accumulation and
    every pipeline schedule call the root once per microbatch. We only read the tracker's
    overall peak, not its per-module statistics, so we make every module look nested in one
    enclosing "step": the tracker's ModTracker always reports that parent.
    """
    mt = tracker._mod_tracker
    base = type(mt)

    class _StepModTracker(base):
        # Module-level backward hooks (multi-grad hooks) break the split backward of the
        # zero-bubble schedules (autograd.grad); the tracker needs them only for per-module
        # backward statistics. Backward vs forward is still known from the autograd engine.
        def _fw_pre_hook(self, mod, input):
            name = self._get_mod_name(mod)
            self._get_append_fn(weakref.ref(mod), name, False)()
            if self._user_pre_fw_hook is not None:
                self._user_pre_fw_hook(mod, input)

        def _fw_post_hook(self, mod, input, output):
            name = self._get_mod_name(mod)
            if self._user_post_fw_hook is not None:
                self._user_post_fw_hook(mod, input, output)
            self._get_pop_fn(weakref.ref(mod), name, False)()

        @property
        def parents(self):
            s = self.__dict__["_shardscope_parents"]
            s.add(_STEP_PARENT)
            return s

        @parents.setter
        def parents(self, value):
            self.__dict__["_shardscope_parents"] = value

    current = mt.__dict__.pop("parents", {"Global"})
    mt.__class__ = _StepModTracker
    mt.parents = current
    _overall_peak_only(tracker)


def _overall_peak_only(tracker) -> None:
    """Keep only the tracker's overall peak up to date on each op (what ``tracker_peak`` reads).

    torch's ``_update_peak_stats`` also walks every tracked module on every op to keep its
    per-module peaks, which nothing here reads (every module looks nested in one step, above),
    and which costs most of a measured step on a small model; the overall peak is updated by the
    same comparison as torch's own."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def update_overall_peak(peak_state) -> None:
        for dev, dev_snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                tracker._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                tracker._peak_mem_snap[dev] = deepcopy(dev_snap)
                tracker._peak_at = tracker._clock  # (the clock of _without_pre_existing's trackers)

    tracker._update_peak_stats = update_overall_peak


def tracker_peak(tracker, device: torch.device) -> dict[str, int]:
    """The tracker's peak snapshot for ``device`` as {tracker category name: bytes}."""
    snap = tracker.get_tracker_snapshot("peak")
    out: dict[str, int] = {}
    for dev, cats in snap.items():
        if torch.device(dev).type != device.type:
            continue
        for k, v in cats.items():
            name = getattr(k, "value", str(k))
            out[name] = out.get(name, 0) + int(v)
    return out


def categories_from(tracker_raw: dict[str, int], exact: dict[str, int]) -> dict[str, int]:
    """Our seven categories at the tracker's peak: params / grads / optimizer exact, the rest from the
    tracker's peak (what it tags optimizer state beyond the exact states: temporaries of the step) — except the
    gradients where a tracker tags them ("Sharded Grad": FSDPMemTracker's FSDP2 sharded gradients; "Gradient": the
    general MemTracker's): FSDP2 makes its sharded ones in each unit's post-backward (under pipelining only at the
    schedule's REDUCE_GRAD), autograd makes plain ones during the backward, and ``zero_grad(set_to_none=True)``
    drops them after the step, so at a peak inside the step fewer or none exist; grads are then what the tracker
    saw at its peak (never more than the exact size, which stays in the record's ``exact``). What the general
    tracker saw as parameters or gradients beyond their exact sizes is FSDP2's unsharded copies: comm_buffers.
    (Measured on the fake sweep's records, re-filed from their tracker peaks: categories within 5 % on 389 → 444 of
    977 ranks of twelve seeds, the gradients out of bounds on 114 → 38.)"""
    cats = dict.fromkeys(MEMORY_CATEGORIES, 0)
    for name, v in tracker_raw.items():
        cat = TRACKER_TO_CATEGORY.get(name)
        if cat is not None:
            cats[cat] += v
    # MemTracker tags everything made inside optimizer.step() as optimizer state (its ``_in_opt``: OPT), so
    # beyond the state tensors, what the tracker counts as optimizer at its peak is the step's temporaries
    # (AdamW's denominators: engine.memory.states.optimizer_step_term)
    cats["temporaries"] += max(0, cats["optimizer"] - int(exact["optimizer"]))
    # the general MemTracker (a rank of several modules: pipeline stages) files FSDP2's unsharded parameters as
    # "Parameter" (FSDP2 swaps them into the module for its forward and backward) and their gradients as "Gradient";
    # the exact sizes hold the sharded ones, so what the tracker saw beyond them is FSDP2's unsharded copies, filed
    # as FSDPMemTracker files them ("Unsharded Param", "Unsharded Grad": comm_buffers)
    unsharded = max(0, int(tracker_raw.get("Parameter", 0)) - int(exact["params"]))
    cats.update({k: exact[k] for k in ("params", "grads", "optimizer")})
    if "Sharded Grad" in tracker_raw or "Gradient" in tracker_raw:  # what the tracker saw of them at its peak
        seen = int(tracker_raw.get("Sharded Grad", 0)) + int(tracker_raw.get("Gradient", 0))
        unsharded += max(0, seen - int(exact["grads"]))
        cats["grads"] = min(int(exact["grads"]), seen)
    cats["comm_buffers"] += unsharded
    return cats


def memory_notes(cfg) -> list[str]:
    """What this rank's memory measurement could not see, in words (``memory.notes`` of its record)."""
    from backend.parallel.compile import COMPILED_MEMORY_NOTE

    return [COMPILED_MEMORY_NOTE] if cfg.training.compile else []


class SavedTensorPeak:
    """The bytes of the tensors autograd saves for backward that are alive at once, at their peak.

    ``torch.autograd.graph.saved_tensors_hooks`` see every tensor an op saves — inside a compiled
    region too: AOTAutograd's compiled function saves its tensors through ``ctx.save_for_backward``,
    where a TorchDispatchMode such as MemTracker cannot run (``backend.parallel.compile``). Each
    storage counts once, from the first time a tensor on it is saved until autograd drops the last
    saved handle to it (a node frees its saved tensors after its backward); parameters, and views of
    them, are not activations and are left out. A region checkpointed with its own hooks
    (``torch.utils.checkpoint``) saves through those instead, so this does not see it.

    ``modules``: their parameters as registered at each save are left out too. FSDP2 registers a
    unit's unsharded parameters on its module only while it is gathered, each all-gather into a fresh
    storage, and the matmuls save views of them (``weight.t()``), which the sharded parameters given
    up front do not name.

    Use as a context manager around forward and backward; ``peak`` is the largest live sum.
    """

    def __init__(self, params: Iterable[torch.Tensor], modules: Iterable[nn.Module] = ()):
        self._params = self._given = {ptr for ptr in map(_storage_ptr, params) if ptr}
        self._modules = list(modules)
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [saved handles alive, bytes]
        self.live = 0
        self.peak = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        t = local_tensor(t)
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return t
        if self._modules:
            self._params = self._given | {ptr for m in self._modules
                                          for ptr in map(_storage_ptr, m.parameters()) if ptr}
        ptr = _storage_ptr(t)
        if not ptr or ptr in self._params:
            return t
        storage = t.untyped_storage()
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _SavedHandle(self, ptr, t)

    @staticmethod
    def _unpack(h):
        return h.tensor if isinstance(h, _SavedHandle) else h

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._live[ptr]

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of a tensor's storage; 0 where it has none to read (a tensor subclass such as torchao's
    float8 weight wrapper, FSDP2's freed unsharded storage)."""
    try:
        return local_tensor(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


class _SavedHandle:
    """What autograd keeps for one saved tensor: the tensor, and a release of its storage on deletion."""

    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, owner: SavedTensorPeak, ptr: int, tensor: torch.Tensor):
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self):
        self.owner._release(self.ptr)
