"""engine.memory.allocator: PyTorch's CUDA caching allocator, case by case from
``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13), and its invariants (hypothesis)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.memory.allocator import (
    AllocatorOutOfMemory,
    AllocatorStats,
    CachingAllocator,
    get_allocation_size,
    kLargeBuffer,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kSmallBuffer,
    kSmallSize,
    replay,
    round_size,
)

MIB = 1 << 20


def test_constants_are_the_sources():
    assert (kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge) == (
        512, 1 * MIB, 2 * MIB, 20 * MIB, 10 * MIB, 2 * MIB)


def test_round_size_rounds_to_512_bytes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]


def test_get_allocation_size_picks_the_segment():
    assert get_allocation_size(512) == kSmallBuffer
    assert get_allocation_size(kSmallSize) == kSmallBuffer  # "size <= kSmallSize"
    assert get_allocation_size(kSmallSize + 512) == kLargeBuffer
    assert get_allocation_size(kMinLargeAlloc - 512) == kLargeBuffer  # "size < kMinLargeAlloc"
    assert get_allocation_size(kMinLargeAlloc) == kMinLargeAlloc
    assert get_allocation_size(11 * MIB) == 12 * MIB  # kRoundLarge


def test_one_byte_takes_512_bytes_of_a_2_mib_small_segment():
    a = CachingAllocator()
    a.malloc(1)
    assert (a.allocated, a.reserved) == (512, 2 * MIB)
    # the small pool packs further requests into the same kSmallBuffer segment (split remainder >= 512)
    for _ in range(3):
        a.malloc(1000)
    assert (a.allocated, a.reserved, a.segments) == (512 + 3 * 1024, 2 * MIB, 1)


def test_five_mib_takes_a_20_mib_segment_that_four_share():
    a = CachingAllocator()
    a.malloc(5 * MIB)
    assert (a.allocated, a.reserved) == (5 * MIB, 20 * MIB)
    for _ in range(3):  # should_split: the remainder 15, 10, 5 MiB > kSmallSize
        a.malloc(5 * MIB)
    assert (a.allocated, a.reserved, a.segments) == (20 * MIB, 20 * MIB, 1)
    a.malloc(5 * MIB)
    assert (a.reserved, a.segments) == (40 * MIB, 2)


def test_eleven_mib_takes_a_12_mib_segment():
    a = CachingAllocator()
    a.malloc(11 * MIB)
    # the 1 MiB remainder is not split off (large pool: the remainder must exceed kSmallSize), so
    # the whole 12 MiB block is handed out and counted in allocated_bytes
    assert (a.allocated, a.reserved) == (12 * MIB, 12 * MIB)
    a.malloc(MIB // 2)  # small pool: a new kSmallBuffer segment
    assert a.reserved == 14 * MIB


def test_an_unsplit_block_counts_whole_in_allocated():
    """alloc_found_block raises allocated_bytes by block->size: the found block, not the request."""
    a = CachingAllocator()
    a.malloc(9 * MIB + MIB // 2)  # 20 MiB segment, split: 10.5 MiB left
    a.malloc(10 * MIB)  # takes the 10.5 MiB block; remainder 0.5 MiB <= kSmallSize: no split
    assert (a.allocated, a.reserved) == (20 * MIB, 20 * MIB)


def test_a_split_then_free_re_merges():
    a = CachingAllocator()
    x, y = a.malloc(5 * MIB), a.malloc(5 * MIB)
    a.free(x)
    a.free(y)  # try_merge_blocks with both neighbours: one 20 MiB block again
    a.check_invariants()
    h = a.malloc(18 * MIB)  # fits only in the merged block
    assert (a.reserved, a.segments) == (20 * MIB, 1)
    a.free(h)
    a.empty_cache()  # release_cached_blocks frees it: it is unsplit again
    assert (a.reserved, a.segments) == (0, 0)
    assert a.max_reserved == 20 * MIB


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    big, small = a.malloc(20 * MIB), a.malloc(12 * MIB)
    a.free(big)
    a.free(small)
    a.malloc(11 * MIB)  # the 12 MiB block, not the 20 MiB one
    assert a.reserved == 32 * MIB
    a.malloc(19 * MIB)  # so the 20 MiB block is still there
    assert a.reserved == 32 * MIB


def test_two_streams_never_share_a_block():
    a = CachingAllocator()
    h = a.malloc(5 * MIB, stream=0)
    a.free(h)
    a.malloc(5 * MIB, stream=1)  # stream 0's cached 20 MiB segment is not reused
    assert a.reserved == 40 * MIB
    a.malloc(5 * MIB, stream=0)  # stream 0 reuses its own
    assert a.reserved == 40 * MIB
    s1 = a.malloc(100, stream=1)
    a.free(s1)
    a.malloc(100, stream=2)
    assert a.reserved == 40 * MIB + 2 * kSmallBuffer


def test_capacity_reached_releases_cached_segments_then_retries():
    a = CachingAllocator(capacity=40 * MIB)
    a.malloc(11 * MIB)  # a 12 MiB segment, handed out whole
    x = a.malloc(5 * MIB)  # a 20 MiB segment: 32 MiB reserved
    a.free(x)  # the 20 MiB segment is cached, unsplit
    a.malloc(21 * MIB)  # a new 22 MiB segment would make 54 > 40: release_cached_blocks, retry
    assert (a.reserved, a.max_reserved, a.allocated) == (34 * MIB, 34 * MIB, 34 * MIB)
    assert a.num_alloc_retries == 1
    a.check_invariants()


def test_a_split_cached_segment_cannot_be_released_so_out_of_memory():
    a = CachingAllocator(capacity=40 * MIB)
    x, _ = a.malloc(5 * MIB), a.malloc(5 * MIB)  # both in one 20 MiB segment
    a.malloc(11 * MIB)  # 32 MiB reserved
    a.free(x)  # 5 MiB cached, but its segment is split (the other half is live)
    with pytest.raises(AllocatorOutOfMemory, match="Tried to allocate 16.00 MiB") as exc:
        a.malloc(16 * MIB)  # needs a 16 MiB segment: 48 > 40; nothing can be released
    e = exc.value
    assert (e.requested, e.allocation, e.reserved, e.capacity) == (16 * MIB, 16 * MIB, 32 * MIB, 40 * MIB)
    assert e.stats.max_reserved == 32 * MIB
    assert a.num_ooms == 1


def test_max_split_size_oversize_rules():
    a = CachingAllocator(max_split_size=30 * MIB)
    a.free(a.malloc(40 * MIB))  # an oversize cached block
    a.malloc(11 * MIB)  # below max_split_size: never takes an oversize block
    assert a.reserved == 52 * MIB
    a.malloc(35 * MIB)  # at or above: takes one less than kLargeBuffer larger, unsplit
    assert (a.reserved, a.allocated) == (52 * MIB, 52 * MIB)  # 12 MiB (unsplit, see above) + 40 MiB
    b = CachingAllocator(max_split_size=30 * MIB)
    b.free(b.malloc(60 * MIB))
    b.malloc(32 * MIB)  # 60 >= 32 + kLargeBuffer: too much to waste, a new segment
    assert b.reserved == 92 * MIB


def test_max_split_size_releases_oversize_blocks_first():
    """release_available_cached_blocks runs before release_cached_blocks: only oversize cached
    blocks go, the largest first, until their bytes reach the request; other cached segments stay."""
    a = CachingAllocator(max_split_size=30 * MIB, capacity=120 * MIB)
    for h in [a.malloc(n * MIB) for n in (40, 32, 5)]:  # cached: 40 and 32 MiB (oversize), a whole 20 MiB
        a.free(h)
    a.malloc(50 * MIB)  # 92 + 50 > 120: the 40 then the 32 MiB block are released (72 >= 50)
    assert (a.reserved, a.segments) == (70 * MIB, 2)
    b = CachingAllocator(max_split_size=30 * MIB, capacity=100 * MIB)
    for n in (60, 5):
        b.free(b.malloc(n * MIB))
    b.malloc(35 * MIB)  # 60 >= 35 + kLargeBuffer, so a 36 MiB segment: 116 > 100, the 60 MiB block goes
    assert b.reserved == 56 * MIB
    with pytest.raises(ValueError, match="max_split_size"):
        CachingAllocator(max_split_size=20 * MIB)


def test_expandable_segments_map_pages():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(1)
    assert (a.allocated, a.reserved) == (512, kSmallBuffer)  # one 2 MiB page of the small pool
    a.malloc(5 * MIB)
    assert a.reserved == kSmallBuffer + kLargeBuffer  # one 20 MiB page of the large pool
    a.malloc(30 * MIB)  # the large segment grows (15 MiB free + one more page): still one range
    assert (a.reserved, a.segments) == (kSmallBuffer + 2 * kLargeBuffer, 2)
    a.check_invariants()


def test_expandable_segments_grow_instead_of_fragmenting():
    default, expandable = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for a in (default, expandable):
        a.free(a.malloc(12 * MIB))
        a.malloc(14 * MIB)
    assert default.reserved == 26 * MIB  # a 12 MiB segment left cached and a new 14 MiB one
    assert expandable.reserved == 20 * MIB  # the page mapped for 12 MiB holds 14 MiB


def test_expandable_segments_split_any_remainder():
    """should_split with expandable segments: remainder >= kMinBlockSize in the large pool too."""
    a = CachingAllocator(expandable_segments=True)
    a.malloc(9 * MIB + MIB // 2)
    a.malloc(10 * MIB)
    assert (a.allocated, a.reserved) == (19 * MIB + MIB // 2, 20 * MIB)


def test_expandable_segments_unmap_cached_pages_at_capacity():
    a = CachingAllocator(expandable_segments=True, capacity=60 * MIB)
    a.free(a.malloc(30 * MIB))  # two 20 MiB pages mapped, cached on stream 0
    a.malloc(30 * MIB, stream=1)  # stream 1's own segment: 80 > 60, so stream 0's pages are unmapped
    assert (a.reserved, a.max_reserved, a.segments) == (40 * MIB, 40 * MIB, 1)
    a.check_invariants()


def test_expandable_segments_keep_live_pages_when_unmapping():
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(30 * MIB)
    y = a.malloc(15 * MIB)  # 45 MiB in 3 pages
    a.free(x)
    a.empty_cache()  # x's range [0, 30) holds the whole page [0, 20): unmapped; y's pages stay
    assert a.reserved == 40 * MIB
    a.check_invariants()
    a.free(y)
    a.empty_cache()
    assert (a.reserved, a.segments) == (0, 0)
    a.check_invariants()


def test_zero_bytes_count_nothing_and_bad_input_is_named():
    a = CachingAllocator()
    h = a.malloc(0)
    assert (a.allocated, a.reserved) == (0, 0)
    a.free(h)
    with pytest.raises(ValueError, match="nbytes"):
        a.malloc(-1)
    with pytest.raises(TypeError, match="nbytes"):
        a.malloc(1.5)
    with pytest.raises(TypeError, match="nbytes"):
        a.malloc(True)
    import numpy as np

    a.malloc(np.int64(600))  # engine arrays hand out numpy integers
    assert a.allocated == 1024
    with pytest.raises(KeyError, match="handle"):
        a.free(h)
    with pytest.raises(ValueError, match="capacity"):
        CachingAllocator(capacity=0)


def test_replay_events():
    stats = replay([("alloc", "a", 5 * MIB), ("alloc", "b", 5 * MIB, 1), ("free", "a"), ("alloc", "c", 1)])
    assert stats == AllocatorStats(max_allocated=10 * MIB, max_reserved=40 * MIB + 2 * MIB,
                                   reserved_end=42 * MIB, segments=3)
    assert replay([("alloc", 0, 30 * MIB)], expandable_segments=True).max_reserved == 40 * MIB
    with pytest.raises(ValueError, match="kind 'malloc'"):
        replay([("malloc", 0, 1)])
    with pytest.raises(ValueError, match="allocated again"):
        replay([("alloc", 0, 1), ("alloc", 0, 1)])
    with pytest.raises(ValueError, match="not live"):
        replay([("free", 0)])
    with pytest.raises(AllocatorOutOfMemory) as exc:
        replay([("alloc", 0, 5 * MIB), ("alloc", 1, 30 * MIB)], capacity=40 * MIB)
    assert exc.value.event_index == 1


# -- properties ----------------------------------------------------------------------------------

SIZES = st.one_of(
    st.integers(min_value=0, max_value=kSmallSize),
    st.integers(min_value=kSmallSize + 1, max_value=kMinLargeAlloc),
    st.integers(min_value=kMinLargeAlloc, max_value=64 * MIB),
    st.sampled_from([1, 512, 513, kSmallSize, kSmallSize + 1, 20 * MIB, 20 * MIB + 1]),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), SIZES, st.integers(min_value=0, max_value=2)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=10_000)),
        st.tuples(st.just("empty_cache")),
    ),
    max_size=120,
)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(ops, **kw):
    """Apply ``ops``; check the invariants at every step; return the allocator and live rounded sizes."""
    a = CachingAllocator(**kw)
    live: list[tuple[int, int]] = []  # (handle, rounded bytes)
    last_max = (0, 0)
    for op in ops:
        if op[0] == "alloc":
            try:
                live.append((a.malloc(op[1], op[2]), round_size(op[1]) if op[1] else 0))
            except AllocatorOutOfMemory:
                assert kw.get("capacity") is not None
        elif op[0] == "free" and live:
            h, _ = live.pop(op[1] % len(live))
            a.free(h)
        elif op[0] == "empty_cache":
            a.empty_cache()
        assert a.reserved >= a.allocated
        if kw.get("capacity") is not None:
            assert a.reserved <= kw["capacity"]
        rounded = sum(r for _, r in live)
        large = sum(1 for _, r in live if r > kSmallSize)
        if kw.get("expandable_segments"):
            assert a.allocated == rounded  # every remainder >= 512 is split off
        else:
            # the sum of live rounded sizes, plus each unsplit large block's remainder (<= kSmallSize)
            assert rounded <= a.allocated <= rounded + large * kSmallSize
        assert a.max_allocated >= last_max[0] and a.max_reserved >= last_max[1]
        assert a.max_allocated >= a.allocated and a.max_reserved >= a.reserved
        last_max = (a.max_allocated, a.max_reserved)
        a.check_invariants()
    return a, live


@PROPS
@given(OPS, st.booleans())
def test_invariants_at_every_step(ops, expandable):
    _run(ops, expandable_segments=expandable)


@PROPS
@given(OPS, st.booleans(), st.integers(min_value=4, max_value=200))
def test_invariants_with_a_capacity(ops, expandable, capacity_mib):
    _run(ops, expandable_segments=expandable, capacity=capacity_mib * MIB)


@PROPS
@given(OPS, st.booleans())
def test_freeing_everything_leaves_zero_allocated_and_reserved_unchanged(ops, expandable):
    a, live = _run([op for op in ops if op[0] != "empty_cache"], expandable_segments=expandable)
    reserved = a.reserved
    for h, _ in live:
        a.free(h)
    assert a.allocated == 0
    assert a.reserved == reserved
    a.check_invariants()
    a.empty_cache()
    assert (a.reserved, a.segments) == (0, 0)


@PROPS
@given(OPS, st.booleans())
def test_replay_agrees_with_the_allocator(ops, expandable):
    events, live, key = [], [], 0
    a = CachingAllocator(expandable_segments=expandable)
    handles = {}
    for op in ops:
        if op[0] == "alloc":
            events.append(("alloc", key, op[1], op[2]))
            handles[key] = a.malloc(op[1], op[2])
            live.append(key)
            key += 1
        elif op[0] == "free" and live:
            k = live.pop(op[1] % len(live))
            events.append(("free", k))
            a.free(handles.pop(k))
    assert replay(events, expandable_segments=expandable) == a.stats()


class _NaiveAllocator:
    """The default (non-expandable) policy written plainly, with linear scans, as the source reads:
    round_size, get_pool, get_allocation_size, best fit by (size, address) on the same stream and
    pool, should_split, merge on free, release of unsplit cached segments at capacity."""

    def __init__(self, capacity=None):
        self.capacity, self.segments, self.next_addr = capacity, [], 1 << 30
        self.allocated = self.reserved = 0

    def malloc(self, nbytes, stream):
        size = round_size(nbytes)
        small = size <= kSmallSize
        for attempt in range(2):
            free = [(b[1], b[0], seg) for seg in self.segments if seg["key"] == (stream, small)
                    for b in seg["blocks"] if not b[2] and b[1] >= size]
            if free:
                _, addr, seg = min(free, key=lambda t: (t[0], t[1]))
                break
            alloc = get_allocation_size(size)
            if self.capacity is None or self.reserved + alloc <= self.capacity:
                seg = {"key": (stream, small), "blocks": [[self.next_addr, alloc, False]]}
                addr = self.next_addr
                self.next_addr += alloc + kLargeBuffer
                self.segments.append(seg)
                self.reserved += alloc
                break
            if attempt == 0:  # release_cached_blocks
                keep = [s for s in self.segments if len(s["blocks"]) > 1 or s["blocks"][0][2]]
                self.reserved -= sum(s["blocks"][0][1] for s in self.segments if s not in keep)
                self.segments = keep
        else:
            raise AllocatorOutOfMemory("naive", requested=nbytes, allocation=0, allocated=0, reserved=0,
                                       capacity=0, stream=stream, stats=None)
        i = next(i for i, b in enumerate(seg["blocks"]) if b[0] == addr)
        b = seg["blocks"][i]
        rem = b[1] - size
        if (rem >= kMinBlockSize) if small else (rem > kSmallSize):
            seg["blocks"][i:i + 1] = [[addr, size, True], [addr + size, rem, False]]
        else:
            b[2] = True
        self.allocated += seg["blocks"][i][1]
        return addr

    def free(self, addr):
        seg = next(s for s in self.segments if any(b[0] == addr and b[2] for b in s["blocks"]))
        bl = seg["blocks"]
        i = next(i for i, b in enumerate(bl) if b[0] == addr)
        bl[i][2] = False
        self.allocated -= bl[i][1]
        if i + 1 < len(bl) and not bl[i + 1][2]:
            bl[i][1] += bl.pop(i + 1)[1]
        if i > 0 and not bl[i - 1][2]:
            bl[i - 1][1] += bl.pop(i)[1]


@PROPS
@given(OPS, st.one_of(st.none(), st.integers(min_value=4, max_value=200)))
def test_the_model_agrees_with_a_plain_reading_of_the_source(ops, capacity_mib):
    capacity = None if capacity_mib is None else capacity_mib * MIB
    model, naive = CachingAllocator(capacity=capacity), _NaiveAllocator(capacity)
    live = []
    for op in ops:
        if op[0] == "alloc" and op[1] > 0:
            try:
                want = naive.malloc(op[1], op[2])
            except AllocatorOutOfMemory:
                with pytest.raises(AllocatorOutOfMemory):
                    model.malloc(op[1], op[2])
                continue
            live.append((model.malloc(op[1], op[2]), want))
            assert model._live[live[-1][0]].addr == want  # the same block, at the same address
        elif op[0] == "free" and live:
            h, addr = live.pop(op[1] % len(live))
            model.free(h)
            naive.free(addr)
        assert (model.allocated, model.reserved, model.segments) == (
            naive.allocated, naive.reserved, len(naive.segments))


# -- cycles: a pipeline's steady state ------------------------------------------------------------

class _Shift:
    """Keys ("mb", slot, microbatch) shift with the microbatch; every other key stays."""

    @staticmethod
    def shift(key, d):
        return (key[0], key[1], key[2] + d) if isinstance(key, tuple) and key[0] == "mb" else key

    @staticmethod
    def shape(key):
        return key[:2] if isinstance(key, tuple) and key[0] == "mb" else key

    @staticmethod
    def shift_events(events, d):
        return [(e[0], _Shift.shift(e[1], d)) + e[2:] for e in events]

    @staticmethod
    def distance(a, b):
        if _Shift.shape(a) != _Shift.shape(b):
            return None
        return b[2] - a[2] if isinstance(a, tuple) and a[0] == "mb" else 0


def _written_out(events):
    """``events`` with each ("cycle", chunk, n, delta, keys) written out n times, the k-th with its keys
    shifted by k·delta."""
    out = []
    for ev in events:
        if ev[0] != "cycle":
            out.append(ev)
            continue
        _, chunk, n, delta, keys = ev
        for k in range(n):
            out.extend((e[0], keys.shift(e[1], k * delta)) + e[2:] for e in chunk)
    return out


def _pipeline(in_flight, sizes, kept_size, n, delta=1):
    """A steady state as a pipeline rank has it: each period allocates microbatch k + in_flight's
    tensors (``sizes``, on streams 0/1), frees microbatch k's, and keeps ``kept_size`` bytes for good."""
    prefix = [("alloc", "params", 300 * MIB)]
    for mb in range(in_flight):
        prefix += [("alloc", ("mb", j, mb), x, j % 2) for j, x in enumerate(sizes)]
    chunk = [("alloc", ("mb", j, in_flight), x, j % 2) for j, x in enumerate(sizes)]
    chunk += [("alloc", "work", 3 * MIB), ("free", "work")]
    if kept_size:
        chunk.append(("alloc", ("mb", "kept", 0), kept_size))
    chunk += [("free", ("mb", j, 0)) for j in range(len(sizes))]
    tail = [("free", ("mb", j, mb)) for mb in range(n * delta, n * delta + in_flight) for j in range(len(sizes))]
    if kept_size:  # the kept tensors freed after the steady state, every other one first (each key where it is
        # matters: which blocks merge), then a request as large as two
        order = list(range(0, n, 2)) + list(range(1, n, 2))
        tail += [("free", ("mb", "kept", k * delta)) for k in order] + [("alloc", "after-kept", 2 * kept_size)]
    return prefix + [("cycle", tuple(chunk), n, delta, _Shift)] + tail


def test_a_cycle_replays_as_written_out_and_stops_once_the_allocator_loops():
    import engine.memory.allocator as allocator

    for in_flight, sizes, kept in ((1, [5 * MIB], 0), (4, [12 * MIB, 700, 3 * MIB], 0), (3, [30 * MIB], 40 * MIB),
                                   (8, [9 * MIB, 2 * MIB], 20 * MIB)):
        for n in (1, 2, 7, 300):
            ev = _pipeline(in_flight, sizes, kept, n)
            for es in (False, True):
                ran = []
                real = allocator._replay_into
                allocator._replay_into = lambda a, e, live, at, ran=ran, real=real: (ran.append(at),
                                                                                     real(a, e, live, at))
                try:
                    fast = replay(ev, expandable_segments=es)
                finally:
                    allocator._replay_into = real
                assert fast == replay(_written_out(ev), expandable_segments=es), (in_flight, sizes, kept, n, es)
                if n == 300 and not es:
                    assert ran.count(len(ev) - 1 - len(sizes) * in_flight) < 60  # periods run of 300


def test_a_cycle_is_checked_like_any_event():
    with pytest.raises(ValueError, match="expected \\('cycle', chunk, count, delta, keys\\)"):
        replay([("cycle", (), 2)])
    with pytest.raises(ValueError, match="kind 'cycle'"):  # no cycle inside a cycle
        replay([("cycle", (("cycle", (), 1, 1, _Shift),), 2, 1, _Shift)])
    with pytest.raises(AllocatorOutOfMemory) as exc:
        replay([("alloc", 0, MIB), ("cycle", (("alloc", 1, 50 * MIB), ("free", 1)), 2, 0, _Shift)], capacity=40 * MIB)
    assert exc.value.event_index == 1


@PROPS
@given(OPS, st.integers(min_value=1, max_value=5), st.lists(SIZES, min_size=1, max_size=4),
       st.sampled_from([0, 0, 700, 3 * MIB, 24 * MIB]), st.integers(min_value=1, max_value=40), st.booleans(),
       st.one_of(st.none(), st.integers(min_value=200, max_value=2000)))
def test_prop_cycles_replay_as_written_out(ops, in_flight, sizes, kept, n, expandable, cap_mib):
    """A steady state of n periods after an arbitrary prefix (microbatches in flight freed in order,
    a transient, maybe a lasting tensor each period) gives the stats of its periods written out, or
    the same error."""
    prefix, live = [], []
    for k, op in enumerate(ops):
        if op[0] == "alloc":
            prefix.append(("alloc", k, op[1], op[2]))
            live.append(k)
        elif op[0] == "free" and live:
            prefix.append(("free", live.pop(op[1] % len(live))))
    ev = prefix + _pipeline(in_flight, sizes, kept, n) + [("alloc", "after", 3 * MIB)]
    kw = dict(expandable_segments=expandable, capacity=None if cap_mib is None else cap_mib * MIB)
    outcomes = []
    for events in (ev, _written_out(ev)):
        try:
            outcomes.append(replay(events, **kw))
        except AllocatorOutOfMemory as exc:
            outcomes.append(("oom", exc.requested, exc.allocated, exc.reserved))
    assert outcomes[0] == outcomes[1]
