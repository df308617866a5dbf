"""Device overhead: the runtime context, collective-library buffers, allocator slack.

None of it is a tensor PyTorch's MemTracker or caching allocator can see (``Term.tracked`` is
False): the runtime context (CUDA/ROCm context: ``cluster.gpu.runtime_context_gib``, switch
with ``conventions.runtime_context``) is the driver's; the collective library (NCCL) allocates
its own buffers, ``conventions.collective_buffer_mib`` per communicator the rank belongs to
(the world and each mesh dimension's group of size > 1); allocator slack (reserved, not
allocated) is ``conventions.allocator_slack_fraction`` × the live tensors of the other
categories. A caching-allocator model belongs here.

The overhead follows the device: local CPU ranks (``cluster.gpu = "cpu"``) talk through gloo,
which keeps no per-communicator device buffers, and have no runtime context — so a CPU prediction
counts neither, whatever the conventions say, and its total compares with a gloo run's.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from functools import lru_cache

from engine.config import Config
from engine.memory.allocator import (
    AllocatorOutOfMemory,
    get_allocation_size,
    kLargeBuffer,
    kMinLargeAlloc,
    kSmallBuffer,
    kSmallSize,
    replay,
    round_size,
)
from engine.memory.lifetimes import (
    MicrobatchKeys,
    canonical_event_signature,
    laid_most_live,
    replay_events,
    without_step_rows,
)
from engine.memory.report import GIB, MIB, Terms, gib
from engine.names import MEMORY_CATEGORIES


def communicators(cfg: Config) -> list[str]:
    """Communicators a rank belongs to (size > 1): the world, and each mesh dimension's group."""
    par = cfg.parallel
    out = []
    if par.world_size > 1:
        out.append("world")
    if par.replicate > 1:
        out.append("dp-replicate")
        if par.shard_degree > 1:
            out.append("dp-shard")
    elif par.dp_cp > 1:
        out.append("dp" if par.cp == 1 else "dp_shard_cp")
    if par.cp > 1:
        out.append("cp")
    if par.tp > 1:
        out.append("tp")
    if par.pp > 1:
        out.append("pp")
    return out


def collective_library(cfg: Config) -> str:
    """The collective library the ranks use: gloo on CPU ranks, RCCL on AMD GPUs, NCCL on the others."""
    name = cfg.cluster.gpu.name
    return "gloo" if name == "cpu" else "rccl" if name.startswith("mi") else "nccl"


def collective_buffer_bytes(cfg: Config) -> int:
    """Device bytes the collective library keeps per communicator (0 under gloo or with the convention off)."""
    if not cfg.conventions.collective_buffers or collective_library(cfg) == "gloo":
        return 0
    return int(round(cfg.conventions.collective_buffer_mib * MIB))


def runtime_context_bytes(cfg: Config) -> int:
    """The runtime context before the first tensor (none on CPU ranks or with the convention off)."""
    gpu = cfg.cluster.gpu
    if not cfg.conventions.runtime_context or collective_library(cfg) == "gloo":
        return 0
    return int(round(gpu.runtime_context_gib * GIB))


def overhead(cfg: Config, T: Terms, live: int | None = None) -> None:
    """The overhead terms; call last (the slack is a fraction of ``live``: the tracked bytes at the
    rank's peak, every other term's when not given)."""
    conv, gpu = cfg.conventions, cfg.cluster.gpu
    ctx = runtime_context_bytes(cfg)
    if ctx:
        T.add("overhead", f"runtime context ({gpu.name}; cluster.gpu.runtime_context_gib)", ctx,
              f"{gpu.runtime_context_gib:g} GiB (conventions.runtime_context)", tracked=False, kind="runtime_context")
    per = collective_buffer_bytes(cfg)
    if per:
        comms = communicators(cfg)
        if comms:
            T.add("overhead", f"collective-library buffers ({', '.join(comms)})", len(comms) * per,
                  f"{len(comms)} communicators × {conv.collective_buffer_mib:g} MiB (conventions.collective_buffer_mib)",
                  tracked=False, kind="collective_buffers")
    if conv.allocator_slack_fraction > 0:
        if live is None:
            live = sum(x.bytes for c in MEMORY_CATEGORIES for x in T[c] if c != "overhead")
        slack = int(live * conv.allocator_slack_fraction)
        T.add("overhead", "allocator slack (reserved, not allocated)", slack,
              f"{conv.allocator_slack_fraction:g} × live tensors {gib(live)} (conventions.allocator_slack_fraction)",
              tracked=False, kind="allocator_slack")
    if not T["overhead"]:
        why = ("CPU ranks over gloo: no runtime context, no per-communicator device buffers"
               if collective_library(cfg) == "gloo" else "all overhead conventions off")
        T.add("overhead", f"no overhead counted ({why})", 0, "0", kind="none")


def reserved_bytes(cfg: Config, timeline, allocated: int, snapshot: dict) -> int:
    """What the caching allocator reserves at most on this rank (``torch.cuda.max_memory_reserved()``).

    On a GPU the step's allocation events (``timeline.events()``, engine.memory.lifetimes) are replayed
    through the caching allocator (``engine.memory.allocator.replay``, with
    ``conventions.expandable_segments``; its capacity is the card's memory less the runtime context
    and the collective-library buffers, which are cudaMalloc'd outside it); where even the allocator's
    retries run out of memory, the reserve it would need without a capacity. Local CPU ranks
    (``cluster.gpu = "cpu"``, gloo) have no caching allocator: reserved = allocated.
    ``conventions.allocator_slack_fraction`` (the snapshot's ``allocator_slack`` term, that fraction
    of ``allocated``) is a floor on the reserve, never added to the replay's:
    reserved = max(replayed, allocated + slack).
    """
    slack = sum(t.bytes for t in snapshot["overhead"] if t.kind == "allocator_slack")
    if collective_library(cfg) == "gloo":
        return allocated + slack
    untracked = sum(t.bytes for t in snapshot["overhead"] if not t.tracked and t.kind != "allocator_slack")
    # what the allocator may reserve; None (unbounded: the reserve it would need) where the runtime
    # context and collective buffers alone fill the card
    capacity = cfg.cluster.gpu.memory_bytes - untracked
    capacity = capacity if capacity > 0 else None
    # ranks whose events differ only in their keys' names (GPipe's middle stages) replay once
    replayed = replayed_reserve(canonical_event_signature(timeline._event_signature()),
                                cfg.conventions.expandable_segments, capacity)
    return max(replayed, allocated + slack)


def replayed_reserve(event_signature: tuple, expandable_segments: bool, capacity: int | None) -> int:
    """``max_reserved`` of one rank's step replayed through the caching allocator (cached on the
    rank's event signature: identical ranks and repeated slider positions replay once).

    A step tensor (allocated before anything else, never freed) of the large pool that takes a
    segment of its own and leaves nothing a later request can use takes part in nothing: its segment
    is never released and never serves another request. Its segment is fresh where no earlier step
    tensor of its stream left a free remainder it fits in; the segment's rounding
    (``get_allocation_size`` less its size) is left unsplit where it is at most 1 MiB, and split off
    as a cached block otherwise, which no request uses where every later request of its pool (later
    step tensors, the rest of the step's events) is larger. So it is replayed as nothing, the capacity
    less its segment, and its segment added back: ranks that differ only in such tensors (the
    dp-ranks' ZeroRedundancyOptimizer shares, whose roundings differ) replay once. (Not with
    expandable segments: there it shares its stream's segment.) Such a row is left out of the
    signature, as is a step row of no bytes (malloc(0): no block), so ranks whose shares are inert or
    empty share one signature wherever their rows stood."""
    sig, rows = event_signature[:2]
    inert = 0
    kept = []
    # per row, the least large-pool request of its stream after it (later step tensors, then the rest;
    # read only where a step tensor's cached rest could make it inert)
    fine = (not expandable_segments and len(event_signature) > 3 and event_signature[2] is not None
            and any(life == "step" and nbytes > kSmallSize
                    and get_allocation_size(round_size(nbytes)) - round_size(nbytes) > kSmallSize
                    for life, nbytes, _ in rows))
    least = dict(_least_large_requests(without_step_rows(event_signature))) if fine else {}
    after: list[int | None] = [None] * len(rows)
    for j in range(len(rows) - 1, -1, -1) if fine else ():
        life, nbytes, stream = rows[j]
        after[j] = least.get(stream)
        size = round_size(nbytes) if nbytes > 0 else 0
        if life == "step" and size > kSmallSize:
            least[stream] = min(least.get(stream, size), size)
    left: dict[int, int] = {}  # per stream, the largest remainder an earlier step tensor left cached
    for j, (life, nbytes, stream) in enumerate(rows):
        size = round_size(nbytes) if nbytes > 0 else 0
        if life == "step" and size == 0:
            continue  # malloc(0): no block, nothing the allocator does
        if not expandable_segments and life == "step" and size > kSmallSize:
            segment = get_allocation_size(size)
            rest = segment - size if segment - size > kSmallSize else 0  # split off and cached
            if (left.get(stream, 0) < size  # a fresh segment
                    and ((rest == 0 and size >= kMinLargeAlloc)
                         or (fine and (after[j] is None or after[j] > rest)))):  # nothing uses its rest
                inert += segment
                sig = sig._replace(step_bytes=sig.step_bytes - nbytes)
                continue
            left[stream] = max(left.get(stream, 0), rest)
        kept.append((life, nbytes, stream))
    if len(kept) != len(rows):
        event_signature = (sig, tuple(kept)) + tuple(event_signature[2:])
    if capacity is not None and capacity - inert <= 0:  # its own step tensors exceed the card: the reserve it needs
        capacity = None
    else:
        capacity = None if capacity is None else capacity - inert
    with _no_cyclic_gc():
        return _replayed_reserve(event_signature, expandable_segments, capacity) + inert


@lru_cache(maxsize=256)
def _least_large_requests(rest_signature: tuple) -> dict[int, int]:
    """Per stream, the least rounded large-pool request (more than 1 MiB) of the events after the step
    tensors (a cycle's periods request what its chunk does)."""
    least: dict[int, int] = {}

    def walk(events) -> None:
        for ev in events:
            if ev[0] == "alloc":
                n = ev[2]
                if n > kSmallSize:  # round_size(n) > kSmallSize exactly then (kSmallSize is a multiple of 512)
                    stream = ev[3] if len(ev) > 3 else 0
                    size = (n + 511) & ~511
                    if size < least.get(stream, size + 1):
                        least[stream] = size
            elif ev[0] == "cycle":
                walk(ev[1])

    with _no_cyclic_gc():
        walk(replay_events(rest_signature))
    return least


@contextmanager
def _no_cyclic_gc():
    """Python's cyclic garbage collector paused while events are laid and replayed: they make
    hundreds of thousands of tuples and blocks, each allocation counting towards a collection, and
    in a process that holds many objects (the window, a fuzz, the caches) each full collection walks
    them all: 124 full collections took 9 s of a 52-s fuzz of 10,000 configs. Nothing they make is
    garbage that only the collector frees but the allocator's blocks, which the next collection
    does. Re-enabled only where it was enabled (another thread, or the caller, may have paused it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@lru_cache(maxsize=1024)
def _unbounded_replay(event_signature: tuple, expandable_segments: bool) -> tuple[int, int]:
    """(max_allocated, max_reserved) of the events replayed without a capacity."""
    stats = replay(replay_events(event_signature), expandable_segments=expandable_segments, capacity=None)
    return stats.max_allocated, stats.max_reserved


def _unbounded_reserve(event_signature: tuple, expandable_segments: bool) -> tuple[int, int]:
    """(at most the most allocated, ``max_reserved``) of the events replayed without a capacity, pool
    by pool where it can be.

    Without a capacity the allocator never releases a segment (only an out-of-memory retry or
    empty_cache does), so each pool's reserve only grows, and a pool's requests are served from its
    own segments alone: the step's most reserved is the sum of each pool's replayed alone. A rank's
    events are its step tensors (first, never freed) and the rest, which does not depend on them
    (``replay_events``): each pool replays its own step tensors and its share of the rest, so ranks
    whose step tensors differ in one pool (a dp-rank's ZeroRedundancyOptimizer share of a few KiB, in
    the small pool) replay the other pools once. The most allocated is then known only from below:
    a pool's most plus every other pool's step tensors, which are live from the start. The whole
    replay (both exact) where the events are not laid by stage-microbatch (no grain), or where a tensor's
    pool cannot be told from its key's shape. Expandable segments too: each pool maps pages of its own
    segments, and unmaps them only when the allocator releases its cache."""
    if len(event_signature) < 4 or event_signature[2] is None:
        return _unbounded_replay(event_signature, expandable_segments)
    rest = without_step_rows(event_signature)
    pools = _events_by_pool(rest)
    if pools is None:
        return _unbounded_replay(event_signature, expandable_segments)
    steps: dict[tuple[int, bool], list[int]] = {}
    for life, nbytes, stream in event_signature[1]:
        if life == "step" and nbytes > 0:
            steps.setdefault(_pool(nbytes, stream), []).append(nbytes)
    held = {pool: sum(map(round_size, sizes)) for pool, sizes in steps.items()}
    most, reserved = {}, 0
    for pool in set(pools) | set(steps):
        most[pool], r = _pool_reserve_of(rest, pool, tuple(steps.get(pool, ())), expandable_segments)
        reserved += r
    everyone = sum(held.values())
    return max(a + everyone - held.get(pool, 0) for pool, a in most.items()), reserved


def _pool(nbytes: int, stream: int) -> tuple[int, bool]:
    """``get_pool``: (stream, small pool) of a request."""
    return stream, round_size(nbytes) <= kSmallSize


@lru_cache(maxsize=256)
def _events_by_pool(rest_signature: tuple) -> dict[tuple[int, bool], tuple] | None:
    """The rest's events split by pool (a cycle into one cycle per pool of its period's events), each
    free with the pool of its key's allocation (a key's shape names the same tensor in every
    microbatch); requests of no bytes (no block) dropped. None where a shape's tensors fall in
    different pools."""
    tags = MicrobatchKeys.TAGS
    pool_of: dict = {}  # key shape -> pool (None: no bytes)
    out: dict[tuple[int, bool], list] = {}

    def route(ev: tuple, into: dict) -> bool:
        # MicrobatchKeys.shape and _pool inlined (a call each per event was a fifth of a replay's cost);
        # round_size(n) <= kSmallSize exactly when n <= kSmallSize (a multiple of the 512-byte rounding)
        key = ev[1]
        if key.__class__ is tuple and key and key[0] in tags:
            key = key[:2] + key[3:]
        if ev[0] == "alloc":
            n = ev[2]
            pool = (ev[3] if len(ev) > 3 else 0, n <= kSmallSize) if n > 0 else None
            if pool_of.setdefault(key, pool) != pool:
                return False
        else:
            pool = pool_of.get(key, False)
            if pool is False:
                return False
        if pool is not None:
            lst = into.get(pool)
            if lst is None:
                lst = into[pool] = []
            lst.append(ev)
        return True

    for ev in replay_events(rest_signature):
        if ev[0] == "cycle":
            _, chunk, count, delta, keys = ev
            if keys is not MicrobatchKeys:
                return None
            parts: dict[tuple[int, bool], list] = {}
            if not all(route(e, parts) for e in chunk):
                return None
            for pool, part in parts.items():
                out.setdefault(pool, []).append(("cycle", tuple(part), count, delta, keys))
        elif not route(ev, out):
            return None
    return {pool: tuple(evs) for pool, evs in out.items()}


def _pool_reserve_of(rest_signature: tuple, pool: tuple[int, bool], steps: tuple[int, ...],
                     expandable_segments: bool) -> tuple[int, int]:
    """``_pool_reserve``, with expandable segments replayed for the step tensors' bytes past whole pages.

    With expandable segments and no capacity a pool's step tensors (allocated first, never freed) lie
    end to end from its one segment's base: each takes the free rest of the last mapped page where it
    fits (best fit: the only cached block) and else maps the pages it lacks after it
    (``find_expandable_block`` takes the unmapped range with the free block before it; ``map_block``
    merges them), so what they leave is one free block of ``pages·page − T`` bytes (T: their rounded
    sizes' sum, ``page``: 2 MiB small pool, 20 MiB large) before the unmapped rest, whatever their
    sizes. Blocks that are never freed never merge or move, so the rest of the step sees the same
    state, ``(T // page)`` whole pages further on, as after one step tensor of ``T mod page`` bytes
    (or none): every later address, page boundary and stat is shifted by those whole pages. Ranks
    whose step tensors differ (the dp-ranks' ZeroRedundancyOptimizer shares) but leave the same
    remainder replay once (tests/engine/memory/test_lifetimes.py checks it against the whole replay)."""
    if not expandable_segments or not steps:
        return _pool_reserve(rest_signature, pool, steps, expandable_segments)
    page = kSmallBuffer if pool[1] else kLargeBuffer
    whole, rem = divmod(sum(map(round_size, steps)), page)
    if not rem:
        kept: tuple[int, ...] = ()
    elif pool[1]:  # in the small pool as tensors of at most 1 MiB (the rest is below 2 MiB)
        kept = (rem,) if rem <= kSmallSize else (kSmallSize, rem - kSmallSize)
    elif rem <= kSmallSize:  # in the large pool as one tensor above 1 MiB (the steps' sum is: each is)
        whole, kept = whole - 1, (page + rem,)
    else:
        kept = (rem,)
    most, reserved = _pool_reserve(rest_signature, pool, kept, True)
    return most + whole * page, reserved + whole * page


@lru_cache(maxsize=4096)
def _pool_reserve(rest_signature: tuple, pool: tuple[int, bool], steps: tuple[int, ...],
                  expandable_segments: bool = False) -> tuple[int, int]:
    """(``max_allocated``, ``max_reserved``) of one pool: its step tensors, then its share of the rest,
    without a capacity."""
    events = tuple(("alloc", ("step", j), n, pool[0]) for j, n in enumerate(steps))
    stats = replay(events + _events_by_pool(rest_signature).get(pool, ()), expandable_segments=expandable_segments,
                   capacity=None)
    return stats.max_allocated, stats.max_reserved


@lru_cache(maxsize=1024)
def _replayed_reserve(event_signature: tuple, expandable_segments: bool, capacity: int | None) -> int:
    least_most, unbounded = _unbounded_reserve(event_signature, expandable_segments)
    # where the unbounded reserve stays within the capacity, nothing is ever released; where the live
    # bytes alone pass the capacity the allocator's retries cannot help: it runs out of memory, and the
    # reserve it would need is the unbounded replay's
    if capacity is None or unbounded <= capacity or least_most > capacity:
        return unbounded
    # the replay allocates at least what its events hold live (a block is at least its request): where
    # that passes the capacity, so does the most allocated, known without the whole replay that says so
    if laid_most_live(event_signature) > capacity:
        return unbounded
    most_allocated, unbounded = _unbounded_replay(event_signature, expandable_segments)
    if most_allocated > capacity:
        return unbounded
    try:
        return replay(replay_events(event_signature), expandable_segments=expandable_segments,
                      capacity=capacity).max_reserved
    except AllocatorOutOfMemory:
        return unbounded
