"""PyTorch's CUDA caching allocator, modelled: what ``torch.cuda.max_memory_reserved()`` reads.

A pure-Python replay of ``DeviceCachingAllocator`` in torch's
``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13), block for block, so that an allocation
timeline (a sequence of mallocs and frees of byte counts, on streams) yields the bytes the
allocator reserves from the device (``reserved_bytes``: cudaMalloc'd segments, or mapped pages
of expandable segments) beside the bytes it hands out (``allocated_bytes``).

What is modelled, with the source's names:

* ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` (512 B).
  A 0-byte request never reaches the allocator (``NativeCachingAllocator::allocate`` returns a
  null pointer), so it counts nothing here either.
* ``get_pool``: rounded sizes ≤ ``kSmallSize`` (1 MiB) go to the small pool, larger to the
  large pool; each pool is kept per stream (``BlockComparatorSize`` orders by stream first, and
  ``get_free_block`` gives up at the first block of another stream), so a block freed by one
  stream is never reused by another.
* ``get_allocation_size``: a new segment is ``kSmallBuffer`` (2 MiB) for the small pool,
  ``kLargeBuffer`` (20 MiB) for requests below ``kMinLargeAlloc`` (10 MiB), else the request
  rounded up to ``kRoundLarge`` (2 MiB).
* ``get_free_block``: best fit, the smallest cached block ≥ the size on the same stream (ties by
  address), with ``max_split_size``'s oversize rules when it is set (a request below it never
  takes a block at or above it; a request at or above it takes a block less than
  ``kLargeBuffer`` larger).
* ``should_split`` / ``alloc_found_block``: the found block is split when the remainder is
  ≥ ``kMinBlockSize`` (small pool, or expandable segments) or > ``kSmallSize`` (large pool, and
  only for requests below ``max_split_size``); otherwise the whole block is handed out.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours.
* ``malloc``'s retries: when a new segment would take the reserved bytes past ``capacity``
  (the device's memory; ``None``: unlimited), ``release_available_cached_blocks`` (only with
  ``max_split_size``: free oversize cached blocks), then ``release_cached_blocks`` (free every
  cached segment that is not split, on every stream and pool) and retry; then out of memory.
* ``expandable_segments=True`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): one
  growable segment per (stream, pool) — ``find_expandable_block`` takes the lowest-addressed
  unmapped range of the pool (with the free block just before it) that fits, and creates a new
  segment only when none does; ``map_block`` maps whole pages, ``kSmallBuffer`` (2 MiB) pages in
  the small pool and ``kLargeBuffer`` (20 MiB) pages in the large pool (the source's
  ``segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer``), for the rounded request
  (not ``get_allocation_size``), merging the new pages into the free block before them;
  ``should_split`` splits any remainder ≥ 512 B; ``get_free_block``'s expandable best-fit walk
  (a block's size counts the unmapped range after it); on reaching ``capacity``,
  ``release_cached_blocks`` unmaps every whole free page (``unmap_block``) and drops segments
  left with no mapped page (``release_expandable_segment``). The address space a segment
  reserves is 9/8 of ``capacity`` (the source: 1 1/8 of the device's memory), 1 PiB without one.

Stats follow the source: ``allocated`` is ``stats.allocated_bytes``, increased in
``alloc_found_block`` by ``block->size`` — the rounded (and possibly unsplit, larger) block,
not the requested bytes (``increase_stat(stats.allocated_bytes[stat_type], block->size)``;
the requested bytes are the separate ``requested_bytes`` stat). ``reserved`` is
``stats.reserved_bytes``: raised by ``alloc_block`` (the segment size) and ``map_block`` (the
mapped pages), lowered by ``release_block`` and ``unmap_block``. ``max_*`` are their peaks.

Simplified or left out (each changes nothing for a single-device training step replay unless
its option is set): ``roundup_power2_divisions`` (the default, off, is modelled: plain 512 B
rounding); ``garbage_collection_threshold`` and ``set_per_process_memory_fraction``;
``record_stream`` (cross-stream uses and their deferred frees via CUDA events); CUDA-graph
private pools; the free-memory callbacks; turning expandable segments on or off mid-run (one
mode per allocator). Version notes: newer sources name the oversize rounding limit
``max_non_split_rounding_size`` (default ``kLargeBuffer``, the value used here), and the generic
``c10/core/CachingDeviceAllocator.h`` orders free blocks by size before stream, which only
changes which stream's block a lower bound lands on; this model keeps the CUDA file's order
(stream, then size, then address). Segment addresses are assigned in increasing order (cudaMalloc's real
addresses only break best-fit ties, between blocks of equal size). ``capacity`` is what the
allocator may reserve: the card's memory less whatever the CUDA context and libraries hold.

Out of memory raises :class:`AllocatorOutOfMemory` (a ``MemoryError``) with torch's wording
and the state at that moment, after the retries above, as torch raises ``OutOfMemoryError``.

Speed: free blocks live in per-(stream, pool) lists of integer keys ``size << 128 | address``,
kept sorted with ``bisect`` (best fit is one ``bisect_left``); no malloc or free scans the
blocks (see ``benchmarks/bench_allocator.py``).
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "AllocatorOutOfMemory",
    "AllocatorStats",
    "CachingAllocator",
    "get_allocation_size",
    "kLargeBuffer",
    "kMinBlockSize",
    "kMinLargeAlloc",
    "kRoundLarge",
    "kSmallBuffer",
    "kSmallSize",
    "replay",
    "round_size",
]

#: all sizes are rounded to at least 512 bytes
kMinBlockSize = 512
#: largest "small" allocation is 1 MiB
kSmallSize = 1048576
#: "small" allocations are packed in 2 MiB blocks
kSmallBuffer = 2097152
#: "large" allocations may be packed in 20 MiB blocks
kLargeBuffer = 20971520
#: allocations between 1 and 10 MiB may use kLargeBuffer
kMinLargeAlloc = 10485760
#: round up large allocations to 2 MiB
kRoundLarge = 2097152

_KEY_SHIFT = 128  # a free block's sort key: size << 128 | address (sizes first, then addresses; addresses of
# absurd configs pass 2**64: a predicted exabyte is refused by no range, and must not collide)
_ADDR_MASK = (1 << _KEY_SHIFT) - 1
_NO_CAPACITY_ADDRESS_SPACE = 1 << 100  # what an expandable segment reserves without a capacity (past any
# prediction: a replay of an absurd config without a capacity must not run out of address space)
_UNLIMITED = 1 << 200  # max_split_size's default: SIZE_MAX, i.e. no block is "oversize"


def round_size(nbytes: int) -> int:
    """``DeviceCachingAllocator::round_size`` without roundup_power2_divisions: a multiple of 512."""
    if nbytes < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * ((nbytes + kMinBlockSize - 1) // kMinBlockSize)


def get_allocation_size(size: int) -> int:
    """``get_allocation_size``: the bytes of the new segment a rounded ``size`` would cudaMalloc."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


def _fmt(nbytes: int) -> str:
    """torch's ``format_size``: bytes, KiB, MiB or GiB."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576:.2f} MiB"
    return f"{nbytes / 1073741824:.2f} GiB"


@dataclass(frozen=True)
class AllocatorStats:
    """What a replay leaves: the peaks of ``allocated_bytes`` / ``reserved_bytes``, the reserved
    bytes at the end, and the segments held at the end (as ``torch.cuda.memory_snapshot()`` lists
    them: one per cudaMalloc, or one per contiguous mapped range of an expandable segment)."""

    max_allocated: int
    max_reserved: int
    reserved_end: int
    segments: int


class AllocatorOutOfMemory(MemoryError):
    """A request the allocator could not satisfy within ``capacity``, after releasing its cache.

    ``requested`` (bytes asked), ``allocation`` (the segment or mapping it tried), ``allocated``
    and ``reserved`` at that moment, ``capacity``, ``stream``; ``stats``: the replay's stats so far;
    ``event_index``: the position in the replayed events (``replay`` only, else None)."""

    def __init__(self, message: str, *, requested: int, allocation: int, allocated: int, reserved: int,
                 capacity: int, stream: int, stats: AllocatorStats, event_index: int | None = None):
        super().__init__(message)
        self.requested = requested
        self.allocation = allocation
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity
        self.stream = stream
        self.stats = stats
        self.event_index = event_index


class _Block:
    """``Block``: a contiguous range of a segment, handed out (allocated) or cached (free);
    in an expandable segment also a range with no pages mapped (``mapped`` False)."""

    __slots__ = ("addr", "size", "prev", "next", "allocated", "mapped", "pool", "seg")

    def __init__(self, addr: int, size: int, pool: _Pool, seg: _ExpandableSegment | None = None):
        self.addr = addr
        self.size = size
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.pool = pool
        self.seg = seg


class _Pool:
    """``BlockPool`` of one stream: its free blocks (``blocks``, sorted by size then address, as
    integer keys) and, with expandable segments, its unmapped ranges (``unmapped``, by address)."""

    __slots__ = ("stream", "is_small", "keys", "unmapped")

    def __init__(self, stream: int, is_small: bool):
        self.stream = stream
        self.is_small = is_small
        self.keys: list[int] = []
        self.unmapped: list[int] = []


class _ExpandableSegment:
    """``ExpandableSegment``: a reserved address range mapped page by page."""

    __slots__ = ("base", "page", "pages")

    def __init__(self, base: int, page: int, pages: int):
        self.base = base
        self.page = page
        self.pages = pages

    @property
    def size(self) -> int:
        return self.page * self.pages


class CachingAllocator:
    """One device's ``DeviceCachingAllocator`` (see the module docstring for what is modelled).

    ``malloc(nbytes, stream)`` returns a handle for ``free``; ``allocated`` / ``reserved`` and
    their peaks ``max_allocated`` / ``max_reserved`` are in bytes. ``capacity``: the bytes the
    allocator may reserve (None: unlimited). ``max_split_size``: ``max_split_size_mb`` in bytes
    (None: unlimited, torch's default; torch requires more than 20 MiB)."""

    def __init__(self, *, expandable_segments: bool = False, capacity: int | None = None,
                 max_split_size: int | None = None):
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity: expected a positive number of bytes or None, got {capacity!r}")
        if max_split_size is not None and (isinstance(max_split_size, bool) or not isinstance(max_split_size, int)
                                           or max_split_size <= kLargeBuffer):
            raise ValueError(f"max_split_size: expected bytes > kLargeBuffer ({kLargeBuffer}, torch's "
                             f"max_split_size_mb > 20) or None, got {max_split_size!r}")
        self.expandable_segments = bool(expandable_segments)
        self.capacity = capacity
        self.max_split_size = max_split_size
        self._mss = _UNLIMITED if max_split_size is None else max_split_size
        self._allocated = 0
        self._reserved = 0
        self._max_allocated = 0
        self._max_reserved = 0
        self._pools: dict[tuple[int, bool], _Pool] = {}
        self._free: dict[int, _Block] = {}  # address -> cached (free, mapped) block
        self._unmapped: dict[int, _Block] = {}  # address -> unmapped range (expandable segments)
        self._live: dict[int, _Block | None] = {}  # handle -> allocated block (None: a 0-byte request)
        self._next_handle = 1
        self._next_addr = 1 << 30  # segment addresses, assigned in increasing order
        self.num_ooms = 0
        self.num_alloc_retries = 0

    # -- stats ----------------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """``allocated_bytes.current``: bytes of the blocks handed out (rounded sizes)."""
        return self._allocated

    @property
    def reserved(self) -> int:
        """``reserved_bytes.current``: bytes of the segments (or mapped pages) held."""
        return self._reserved

    @property
    def max_allocated(self) -> int:
        return self._max_allocated

    @property
    def max_reserved(self) -> int:
        return self._max_reserved

    @property
    def segments(self) -> int:
        """Segments held now, as ``torch.cuda.memory_snapshot()`` lists them."""
        n = 0
        for b in (*self._free.values(), *(b for b in self._live.values() if b is not None)):
            if b.prev is None or not b.prev.mapped:
                n += 1
        return n

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self._max_allocated, self._max_reserved, self._reserved, self.segments)

    def live_handles(self) -> int:
        return len(self._live)

    def relative_state(self, live: dict, name, lasting, smallest: dict | None = None) -> tuple[tuple, list]:
        """What the allocator's next calls depend on, with addresses as (segment ordinal, offset) and
        each live block named ``name(key)`` for the key ``live`` (key -> handle) holds it under; and the
        inert segments left out of it, first blocks in address order.

        A segment is inert when every block allocated in it holds a key ``lasting(key)`` says stays
        allocated and every cached block in it is smaller than any request to come in its pool
        (``smallest``: (stream, small pool) -> the least rounded request; a pool with none: every
        cached block is): nothing in it can be handed out, freed, merged or released (segment
        addresses only grow, so the other segments' ordinals keep their order; only the room left
        under a capacity depends on it, which the caller checks). Its bytes are taken off the
        counters. Equal relative states answer the same calls the same way, up to inert segments and
        the names of the keys."""
        smallest = smallest or {}
        key_of = {}
        empty = []
        for key, h in live.items():
            b = self._live.get(h)
            if b is None:
                empty.append(repr(name(key)))
            else:
                key_of[id(b)] = key
        heads = sorted(self._segment_heads(), key=lambda b: b.addr)
        segments, inert, dropped, dropped_a = [], [], 0, 0
        for head in heads:
            blocks, b, still, held = [], head, head.seg is None, 0
            while b is not None:
                if b.allocated:
                    key = key_of[id(b)]
                    still = still and lasting(key)
                    held += b.size
                    blocks.append((b.addr - head.addr, b.size, True, b.mapped, b.pool.stream, b.pool.is_small, name(key)))
                else:
                    still = still and b.size < smallest.get((b.pool.stream, b.pool.is_small), b.size + 1)
                    blocks.append((b.addr - head.addr, b.size, False, b.mapped, b.pool.stream, b.pool.is_small, None))
                b = b.next
            if still and held:
                inert.append(head)
                dropped += blocks[-1][0] + blocks[-1][1]
                dropped_a += held
            else:
                segments.append(tuple(blocks))
        state = (self._allocated - dropped_a, self._reserved - dropped, tuple(segments), tuple(sorted(empty)))
        return state, inert

    def _segment_heads(self) -> list[_Block]:
        """The first block of every segment."""
        return [b for b in (*self._free.values(), *self._unmapped.values(),
                            *(b for b in self._live.values() if b is not None)) if b.prev is None]

    def _copy_segment(self, head: _Block, key_of: dict, rename, live: dict) -> None:
        """A new segment laid out as the one ``head`` starts (no expandable segment): its blocks' sizes,
        allocated or cached, each allocated one held in ``live`` under ``rename(key_of[id(block)])``."""
        size, b = 0, head
        while b is not None:
            size += b.size
            b = b.next
        base = self._take_addresses(size)
        self._reserved += size
        prev, b = None, head
        while b is not None:
            c = _Block(base + (b.addr - head.addr), b.size, b.pool)
            c.prev = prev
            if prev is not None:
                prev.next = c
            if b.allocated:
                c.allocated = True
                self._allocated += c.size
                h = self._next_handle
                self._next_handle = h + 1
                self._live[h] = c
                live[rename(key_of[id(b)])] = h
            else:
                self._free[c.addr] = c
                insort(c.pool.keys, (c.size << _KEY_SHIFT) | c.addr)
            prev, b = c, b.next

    def _relocate(self, head: _Block) -> None:
        """Move the segment ``head`` starts (no expandable segment) past every segment there is:
        only the order of segment addresses means anything to the allocator (best fit's ties)."""
        base = self._take_addresses(sum(b.size for b in self._blocks_of(head)))
        offset = base - head.addr
        for b in self._blocks_of(head):
            if not b.allocated:
                keys = b.pool.keys
                del keys[bisect_left(keys, (b.size << _KEY_SHIFT) | b.addr)]
                del self._free[b.addr]
                b.addr += offset
                self._free[b.addr] = b
                insort(keys, (b.size << _KEY_SHIFT) | b.addr)
            else:
                b.addr += offset

    @staticmethod
    def _blocks_of(head: _Block):
        b = head
        while b is not None:
            yield b
            b = b.next

    def check_invariants(self) -> None:
        """Raise AssertionError unless the block structure is consistent (O(blocks); for tests):
        each segment's blocks tile it, no two neighbouring cached blocks are left unmerged, the
        free lists hold exactly the cached blocks, and the stats add up."""
        blocks = [*self._free.values(), *self._unmapped.values(), *(b for b in self._live.values() if b is not None)]
        assert len({id(b) for b in blocks}) == len(blocks), "a block is listed twice"
        mapped = allocated = 0
        for b in blocks:
            if b.prev is None:  # a segment's first block: walk it
                cur, end = b, b.addr
                while cur is not None:
                    assert cur.addr == end, "the blocks of a segment do not tile it"
                    if cur.next is not None:
                        assert cur.next.prev is cur, "broken links"
                        n = cur.next
                        assert not (not cur.allocated and not n.allocated and cur.mapped == n.mapped), \
                            "neighbouring cached blocks left unmerged"
                    end = cur.addr + cur.size
                    if cur.mapped:
                        mapped += cur.size
                    if cur.allocated:
                        allocated += cur.size
                    cur = cur.next
                if b.seg is not None:
                    assert b.addr == b.seg.base and end == b.seg.base + b.seg.size, "expandable segment not tiled"
        assert mapped == self._reserved, f"reserved {self._reserved} but segments map {mapped}"
        assert allocated == self._allocated, f"allocated {self._allocated} but blocks hold {allocated}"
        for pool in self._pools.values():
            assert pool.keys == sorted(pool.keys)
            for key in pool.keys:
                b = self._free[key & _ADDR_MASK]
                assert b.pool is pool and b.size == key >> _KEY_SHIFT and not b.allocated and b.mapped
            for addr in pool.unmapped:
                assert self._unmapped[addr].pool is pool and not self._unmapped[addr].mapped
        assert sum(len(p.keys) for p in self._pools.values()) == len(self._free)
        assert sum(len(p.unmapped) for p in self._pools.values()) == len(self._unmapped)
        assert self._max_allocated >= self._allocated and self._max_reserved >= self._reserved

    # -- the public calls -----------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """``DeviceCachingAllocator::malloc``: a handle to a block of at least ``nbytes`` on ``stream``."""
        if nbytes.__class__ is not int:  # numpy integers too; never a float or a bool
            try:
                if isinstance(nbytes, bool):
                    raise TypeError
                nbytes = operator.index(nbytes)
            except TypeError:
                raise TypeError(f"nbytes: expected an integer number of bytes, got {nbytes!r}") from None
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes: expected bytes >= 0, got {nbytes}")
            h = self._next_handle
            self._next_handle = h + 1
            self._live[h] = None
            return h
        size = kMinBlockSize if nbytes < kMinBlockSize else (nbytes + 511) & ~511
        is_small = size <= kSmallSize
        pool = self._pools.get((stream, is_small))
        if pool is None:
            pool = self._pools[(stream, is_small)] = _Pool(stream, is_small)

        # get_free_block's best fit (``_get_free_block``), inlined: the replay's hottest path
        keys = pool.keys
        i = bisect_left(keys, size << _KEY_SHIFT)
        block = None
        if i < len(keys):
            if self.expandable_segments:
                i = self._expandable_fit(keys, i)
            key = keys[i]
            bsize = key >> _KEY_SHIFT
            mss = self._mss
            if not ((size < mss and bsize >= mss) or (size >= mss and bsize >= size + kLargeBuffer)):
                del keys[i]
                block = self._free.pop(key & _ADDR_MASK)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None:
                if (self.max_split_size is not None and not self.expandable_segments
                        and self._release_available_cached_blocks(pool, size)):
                    block = self._alloc_block(pool, size)
                if block is None:
                    self._release_cached_blocks()
                    self.num_alloc_retries += 1
                    block = self._alloc_block(pool, size)
                    if block is None:
                        self._out_of_memory(nbytes, size, stream)

        # should_split / alloc_found_block: hand out ``size`` bytes of ``block`` (its remainder cached when
        # it is worth splitting off)
        remaining = block.size - size
        if (remaining >= kMinBlockSize if (is_small or self.expandable_segments)
                else (size < self._mss and remaining > kSmallSize)):
            rest = block
            block = _Block(rest.addr, size, pool, rest.seg)
            prev = rest.prev
            block.prev = prev
            if prev is not None:
                prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size = remaining
            self._free[rest.addr] = rest
            insort(pool.keys, (remaining << _KEY_SHIFT) | rest.addr)

        block.allocated = True
        a = self._allocated + block.size
        self._allocated = a
        if a > self._max_allocated:
            self._max_allocated = a
        h = self._next_handle
        self._next_handle = h + 1
        self._live[h] = block
        return h

    def free(self, handle: int) -> None:
        """``DeviceCachingAllocator::free``: the block returns to its pool, merged with free neighbours."""
        try:
            block = self._live.pop(handle)
        except KeyError:
            raise KeyError(f"handle: {handle!r} is not a live allocation of this allocator "
                           "(never returned by malloc, or already freed)") from None
        if block is None:
            return
        block.allocated = False
        self._allocated -= block.size
        pool = block.pool
        keys = pool.keys
        free = self._free
        # free_block: try_merge_blocks with prev, then next
        src = block.prev
        if src is not None and not src.allocated and src.mapped:
            del keys[bisect_left(keys, (src.size << _KEY_SHIFT) | src.addr)]
            del free[src.addr]
            block.addr = src.addr
            block.size += src.size
            p = src.prev
            block.prev = p
            if p is not None:
                p.next = block
        src = block.next
        if src is not None and not src.allocated and src.mapped:
            del keys[bisect_left(keys, (src.size << _KEY_SHIFT) | src.addr)]
            del free[src.addr]
            block.size += src.size
            n = src.next
            block.next = n
            if n is not None:
                n.prev = block
        free[block.addr] = block
        insort(keys, (block.size << _KEY_SHIFT) | block.addr)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: ``release_cached_blocks``."""
        self._release_cached_blocks()

    # -- internals, one per function of the source ----------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        keys = pool.keys
        i = bisect_left(keys, size << _KEY_SHIFT)
        if i == len(keys):
            return None
        if self.expandable_segments:
            i = self._expandable_fit(keys, i)
        key = keys[i]
        bsize = key >> _KEY_SHIFT
        mss = self._mss
        if size < mss and bsize >= mss:
            return None  # do not return an oversized block for a large request
        if size >= mss and bsize >= size + kLargeBuffer:
            return None  # an oversized block may be rounded up, but only within kLargeBuffer
        del keys[i]
        return self._free.pop(key & _ADDR_MASK)

    def _expandable_fit(self, keys: list[int], i: int) -> int:
        """The expandable best fit from ``keys[i]`` (the least cached block at least the request): a
        block followed by an unmapped range counts that range, and the walk goes on to the next larger
        block while its size so counted is smaller."""
        free = self._free
        last = len(keys) - 1
        cur = free[keys[i] & _ADDR_MASK]
        n = cur.next
        cur_size = cur.size + (n.size if n is not None and not n.mapped else 0)
        while i < last:
            nxt = free[keys[i + 1] & _ADDR_MASK]
            n = nxt.next
            nxt_size = nxt.size + (n.size if n is not None and not n.mapped else 0)
            if nxt_size < cur_size:
                i += 1
                cur_size = nxt_size
            else:
                break
        return i

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """``alloc_block``: a new segment (or, expandable, newly mapped pages) for ``size``;
        None when the capacity does not allow it."""
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        alloc = get_allocation_size(size)
        if self.capacity is not None and self._reserved + alloc > self.capacity:
            return None
        block = _Block(self._take_addresses(alloc), alloc, pool)
        r = self._reserved + alloc
        self._reserved = r
        if r > self._max_reserved:
            self._max_reserved = r
        return block

    def _take_addresses(self, nbytes: int) -> int:
        addr = self._next_addr
        self._next_addr = addr + nbytes + kLargeBuffer  # a gap: segments are never contiguous
        return addr

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached segments, enough for ``size``."""
        mss = self._mss
        target = max(size, mss)
        keys = pool.keys
        i = bisect_left(keys, target << _KEY_SHIFT)
        if i < len(keys):
            self._release_block(self._free[keys[i] & _ADDR_MASK])
            return True
        if i == 0:
            return False
        released = 0
        i -= 1  # the largest block of the stream
        while released < target and i >= 0 and (keys[i] >> _KEY_SHIFT) >= mss:
            b = self._free[keys[i] & _ADDR_MASK]
            released += b.size
            self._release_block(b)
            i -= 1
        return released >= target

    def _release_block(self, block: _Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        assert block.prev is None and block.next is None and block.seg is None
        pool = block.pool
        del pool.keys[bisect_left(pool.keys, (block.size << _KEY_SHIFT) | block.addr)]
        del self._free[block.addr]
        self._reserved -= block.size

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: ``release_blocks`` of every pool (large first, as the source)."""
        for pool in sorted(self._pools.values(), key=lambda p: p.is_small):
            to_unmap = []
            for key in list(pool.keys):
                b = self._free[key & _ADDR_MASK]
                if b.seg is not None:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if b.prev is None and b.next is None and not b.mapped:
                    # release_expandable_segment: nothing of it is mapped any more
                    del pool.unmapped[bisect_left(pool.unmapped, b.addr)]
                    del self._unmapped[b.addr]

    # -- expandable segments --------------------------------------------------------------------
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest-addressed free/unmapped run of ``size`` bytes."""
        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for addr in pool.unmapped:
            c = self._unmapped[addr]
            if allocatable(c.prev):
                c = c.prev
            b, nbytes = c, 0
            while nbytes < size and allocatable(b):
                nbytes += b.size
                b = b.next
            if nbytes >= size:
                return c
        page = kSmallBuffer if pool.is_small else kLargeBuffer
        space = (self.capacity + self.capacity // 8) if self.capacity is not None else _NO_CAPACITY_ADDRESS_SPACE
        seg = _ExpandableSegment(0, page, -(-space // page))
        seg.base = self._take_addresses(seg.size)
        c = _Block(seg.base, seg.size, pool, seg)
        c.mapped = False
        self._unmapped[c.addr] = c
        insort(pool.unmapped, c.addr)
        return c

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an unmapped range."""
        seg = to_map.seg
        page = seg.page
        begin = (to_map.addr - seg.base) // page
        end = -(-(to_map.addr + size - seg.base) // page)
        mapped = (end - begin) * page
        if self.capacity is not None and self._reserved + mapped > self.capacity:
            return False  # cuMemCreate out of memory: the pages of this call are all released
        pool = to_map.pool
        del pool.unmapped[bisect_left(pool.unmapped, to_map.addr)]
        del self._unmapped[to_map.addr]
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, pool, seg)
            rest.mapped = False
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            self._unmapped[rest.addr] = rest
            insort(pool.unmapped, rest.addr)
        self._merge_free(to_map, to_map.prev)
        self._merge_free(to_map, to_map.next)
        self._free[to_map.addr] = to_map
        insort(pool.keys, (to_map.size << _KEY_SHIFT) | to_map.addr)
        r = self._reserved + mapped
        self._reserved = r
        if r > self._max_reserved:
            self._max_reserved = r
        return True

    def _merge_free(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks`` for cached blocks: ``src`` (free, same mapped state) joins ``dst``."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool = src.pool
        if src.mapped:
            del pool.keys[bisect_left(pool.keys, (src.size << _KEY_SHIFT) | src.addr)]
            del self._free[src.addr]
        else:
            del pool.unmapped[bisect_left(pool.unmapped, src.addr)]
            del self._unmapped[src.addr]
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages until a free block of ``size`` exists."""
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt  # map_block merged the free block before it into it
        del pool.keys[bisect_left(pool.keys, (c.size << _KEY_SHIFT) | c.addr)]
        del self._free[c.addr]
        return c

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside a cached block of an expandable segment."""
        seg = block.seg
        page = seg.page
        begin = -(-(block.addr - seg.base) // page)
        end = (block.addr + block.size - seg.base) // page
        if begin >= end:
            return
        pool = block.pool
        del pool.keys[bisect_left(pool.keys, (block.size << _KEY_SHIFT) | block.addr)]
        del self._free[block.addr]
        lo, hi = seg.base + begin * page, seg.base + end * page
        if lo > block.addr:
            before = _Block(block.addr, lo - block.addr, pool, seg)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._free[before.addr] = before
            insort(pool.keys, (before.size << _KEY_SHIFT) | before.addr)
        if hi < block.addr + block.size:
            after = _Block(hi, block.addr + block.size - hi, pool, seg)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._free[after.addr] = after
            insort(pool.keys, (after.size << _KEY_SHIFT) | after.addr)
        block.addr, block.size, block.mapped = lo, hi - lo, False
        self._merge_free(block, block.prev)
        self._merge_free(block, block.next)
        self._unmapped[block.addr] = block
        insort(pool.unmapped, block.addr)
        self._reserved -= hi - lo

    def _out_of_memory(self, nbytes: int, size: int, stream: int) -> None:
        self.num_ooms += 1
        alloc = size if self.expandable_segments else get_allocation_size(size)
        cap = self.capacity
        free_dev = cap - self._reserved
        raise AllocatorOutOfMemory(
            f"CUDA out of memory (modelled caching allocator). Tried to allocate {_fmt(alloc)} "
            f"(a request of {nbytes:,} B on stream {stream}). The device has a capacity of {_fmt(cap)} "
            f"of which {_fmt(free_dev)} is free. Of the allocated memory {_fmt(self._allocated)} is "
            f"allocated by PyTorch, and {_fmt(self._reserved - self._allocated)} is reserved by PyTorch "
            f"but unallocated (cached segments were released first).",
            requested=nbytes, allocation=alloc, allocated=self._allocated, reserved=self._reserved,
            capacity=cap, stream=stream, stats=self.stats())


_EVENT_KINDS = ("alloc", "free", "cycle")


def replay(events: Iterable[tuple], *, expandable_segments: bool = False,
           capacity: int | None = None, max_split_size: int | None = None) -> AllocatorStats:
    """Replay an allocation timeline through a fresh :class:`CachingAllocator`.

    ``events``: ``("alloc", key, nbytes)`` or ``("alloc", key, nbytes, stream)`` and
    ``("free", key)``, in order; a key names one live allocation (any hashable). Allocations
    still live at the end stay allocated. ``("cycle", chunk, count, delta, keys)``: the events of
    ``chunk`` ``count`` times, each time with its keys shifted by ``delta`` more (a pipeline's steady
    state; :func:`_replay_cycle` stops running them once the allocator loops, which is exact).
    Raises ``ValueError`` for a malformed event, a key allocated twice or freed while not live;
    :class:`AllocatorOutOfMemory` (with ``event_index``) when a request does not fit in
    ``capacity``."""
    alloc = CachingAllocator(expandable_segments=expandable_segments, capacity=capacity,
                             max_split_size=max_split_size)
    _replay_into(alloc, events, {}, None)
    return alloc.stats()


def _replay_into(alloc: CachingAllocator, events: Iterable[tuple], live: dict, at: int | None) -> None:
    """Replay ``events`` into ``alloc``, ``live`` mapping keys to handles; ``at``: the index of the
    cycle event whose chunk these are (None: the top level, where cycles may appear)."""
    malloc, free = alloc.malloc, alloc.free
    for i, ev in enumerate(events):
        kind = ev[0]
        if kind == "alloc":
            key = ev[1]
            if key in live:
                raise ValueError(f"{_where(i, at)}: key {key!r} allocated again while still live")
            try:
                live[key] = malloc(ev[2]) if len(ev) == 3 else malloc(ev[2], ev[3])
            except AllocatorOutOfMemory as exc:
                exc.event_index = i if at is None else at
                raise
            except (TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"{_where(i, at)}: {ev!r}: {exc}") from None
        elif kind == "free":
            try:
                h = live.pop(ev[1])
            except KeyError:
                raise ValueError(f"{_where(i, at)}: free of key {ev[1]!r}, which is not live") from None
            free(h)
        elif kind == "cycle" and at is None:
            try:
                _, chunk, count, delta, keys = ev
            except ValueError:
                raise ValueError(f"{_where(i, at)}: expected ('cycle', chunk, count, delta, keys), "
                                 f"got {len(ev)} fields") from None
            _replay_cycle(alloc, chunk, count, delta, keys, live, i)
        else:
            allowed = _EVENT_KINDS if at is None else _EVENT_KINDS[:2]
            raise ValueError(f"{_where(i, at)}: kind {kind!r}; expected one of {allowed}")


def _replay_cycle(alloc: CachingAllocator, chunk: tuple, count: int, delta: int, keys, live: dict, at: int) -> None:
    """``("cycle", chunk, count, delta, keys)``: the events of ``chunk`` ``count`` times, the r-th time
    with every key shifted by r·delta (``keys.shift(key, d)``; ``keys.shape(key)``: the key without
    what shifts; ``keys.distance(a, b)``: the d that shifts a to b, or None; ``keys.shift_events(events,
    d)``: events with their keys shifted). A pipeline's steady state:
    each period allocates its microbatches' tensors, which a later period frees, and may allocate for
    good what no period frees (the last stage's kept outputs: "lasting").

    After each period whose usable free blocks' sizes are as an earlier period left them, the
    allocator's relative state (``CachingAllocator.relative_state``: each live key named as it was in
    the first period, inert segments — lasting tensors and cached blocks too small for any request of
    a period — left out) is kept. When a period ends in a state an earlier one ended in, L periods
    before, the allocator has entered a loop of L periods (best fit cycles through the blocks of the
    microbatches in flight): every later run of L periods does exactly what the last L did, and adds
    inert segments laid out as those the last L made inert. Those whole runs are not replayed: the
    live keys are renamed to the last of them, copies of those inert segments are made past every
    segment the loop started with, the segments the last L periods made that are still in use are
    moved past the copies (where the last run would have made them; only the order of addresses
    matters), and the peaks are the last L periods' plus the growth; the periods left over are
    replayed. That is done only where the grown reserve stays within the capacity (which then never
    binds) and no moved segment is an expandable one; else every period runs. Exact: equal to running them all (tests/engine/memory/test_allocator.py,
    tests/engine/memory/test_lifetimes.py)."""
    freed = {keys.shape(e[1]) for e in chunk if e[0] == "free"}

    def lasting(key) -> bool:
        return key is not None and keys.shape(key) not in freed

    before = set(live)  # the keys live when the cycle starts: never renamed

    smallest: dict[tuple[int, bool], int] = {}  # per pool, the least request of a period: smaller cached blocks are of no use
    for e in chunk:
        if e[0] == "alloc" and e[2] > 0:
            size = round_size(e[2])
            pool = (e[3] if len(e) > 3 else 0, size <= kSmallSize)
            smallest[pool] = min(smallest.get(pool, size), size)
    # a key lives a whole number of periods (its free comes that many shifts later): where best fit
    # rotates each shape's blocks with that period, the allocator loops in the lcm of those lives, or
    # one period more (a block freed in a period is handed out again in the next: 16 periods where keys
    # live 1 and 15, 61 where they live 60). The state is read every period at first (most loops are
    # short), then at the first two periods of every that many (two reads a loop of either length)
    frees = {keys.shape(e[1]): e[1] for e in chunk if e[0] == "free"}
    every = 1
    for e in chunk:
        if e[0] == "alloc" and not lasting(e[1]) and delta:
            d = keys.distance(frees[keys.shape(e[1])], e[1])  # the shift from the key freed to the key made
            if d is not None and d > 0 and d % delta == 0:
                every = math.lcm(every, d // delta)
    if every * 2 + 2 > count:  # no whole loop left to skip once one is seen
        every = 1
    short = 8 if every > 1 else count
    # the usable free blocks' sizes (cheap to read) first; a relative state only where they are as an
    # earlier period left them
    looks: set[tuple] = set()
    seen: dict[tuple, tuple] | None = {}  # relative state -> (period, totals, inert heads, next address)
    peaks: list[tuple[int, int]] = []
    spent, budget = 0, len(chunk) * count // 4  # the states read so far, and what they may cost (in events)
    r = 0
    while r < count:
        d = r * delta
        events = chunk if d == 0 else keys.shift_events(chunk, d)
        top = (alloc._max_allocated, alloc._max_reserved)
        alloc._max_allocated, alloc._max_reserved = alloc._allocated, alloc._reserved  # this period's peaks
        _replay_into(alloc, events, live, at)
        peak = (alloc._max_allocated, alloc._max_reserved)
        alloc._max_allocated, alloc._max_reserved = max(top[0], peak[0]), max(top[1], peak[1])
        peaks.append(peak)
        # a state costs about what its live keys and blocks are, each about an event (measured: 1.8 µs a
        # block, 1.6 µs an event): read one only where replaying the periods left would cost much more,
        # and all of them together at most a quarter of replaying every period (an allocator that never
        # loops then costs at most that much more than the plain replay)
        cost = len(live) + len(alloc._free) + len(alloc._live)
        worth = len(chunk) * (count - r) > 16 * cost and spent + cost <= budget
        look = (tuple((k, tuple(x >> _KEY_SHIFT for x in p.keys if x >> _KEY_SHIFT >= smallest.get(k, 0)),
                       len(p.unmapped)) for k, p in alloc._pools.items())
                if worth and (r < short or r % every < 2) else None)
        if look is None or seen is None or r + 1 >= count:
            pass
        elif look not in looks:
            looks.add(look)
        else:
            spent += cost
            # every key named as the first period's, a lasting one too (the periods' kept tensors beside their
            # microbatches' in a segment still in use are the same tensors of a later period), but one from
            # before the cycle
            state, inert = alloc.relative_state(live, lambda k, d=d: k if lasting(k) and k in before
                                                else keys.shift(k, -d), lasting, smallest)
            now = (alloc._allocated, alloc._reserved)
            hit = seen.get(state)
            if hit is None:
                seen[state] = (r, now, {id(h) for h in inert}, alloc._next_addr)
            else:
                skipped = _skip_loops(alloc, live, chunk, keys, lasting, before, inert, hit, now, peaks, r, count,
                                      delta)
                if skipped:
                    r += skipped
                    seen = None  # fewer than a loop's periods are left: they run
        r += 1


def _skip_loops(alloc: CachingAllocator, live: dict, chunk: tuple, keys, lasting, before: set, inert: list,
                hit: tuple, now: tuple, peaks: list, r: int, count: int, delta: int) -> int:
    """``_replay_cycle``'s skip, once period ``r`` ends in the relative state period ``hit[0]`` ended in: the
    whole runs of that loop left are not replayed (its docstring says how); returns the periods skipped, 0 where
    the skip is not exact (a moved expandable segment, a capacity the grown reserve would pass, lasting keys it
    would not leave as the plain replay does)."""
    loop = r - hit[0]
    runs = (count - 1 - r) // loop
    grew_a, grew_r = now[0] - hit[1][0], now[1] - hit[1][1]
    top_a = max(p[0] for p in peaks[-loop:]) + runs * grew_a
    top_r = max(p[1] for p in peaks[-loop:]) + runs * grew_r
    new = [h for h in inert if id(h) not in hit[2]]
    inert_ids = {id(h) for h in inert}
    recent = sorted((h for h in alloc._segment_heads() if h.addr >= hit[3] and id(h) not in inert_ids),
                    key=lambda h: h.addr)
    key_of = {id(alloc._live[h]): k for k, h in live.items() if alloc._live[h] is not None}
    held = _lasting_in_use(alloc, live, inert, lambda k: lasting(k) and k not in before)
    if not (runs and all(h.seg is None for h in recent) and (alloc.capacity is None or top_r <= alloc.capacity)
            and _skip_keeps_every_lasting_key(live, chunk, keys, lasting, held, new, key_of, r, loop, runs, delta)):
        return 0
    # each skipped run makes inert segments laid out as this one's, past every segment the loop started with; the
    # segments this run made that are still in use come after them
    moved = [(k, live.pop(k)) for k in list(live) if not lasting(k)] + [(k, live.pop(k)) for k in held]
    for q in range(1, runs + 1):
        for h in new:
            alloc._copy_segment(h, key_of, lambda k, n=q * loop * delta: keys.shift(k, n), live)
    for h in recent:
        alloc._relocate(h)
    skip = runs * loop
    for k, h in moved:
        live[keys.shift(k, skip * delta)] = h
    alloc._max_allocated = max(alloc._max_allocated, top_a)
    alloc._max_reserved = max(alloc._max_reserved, top_r)
    return skip


def _lasting_in_use(alloc: CachingAllocator, live: dict, inert: list, lasting) -> list:
    """The lasting keys of ``live`` (the cycle's) whose blocks lie in segments still in use (not among
    ``inert``'s): a later period's once the runs are skipped."""
    in_inert = {id(b) for h in inert for b in alloc._blocks_of(h)}
    return [k for k, h in live.items() if lasting(k) and alloc._live[h] is not None
            and id(alloc._live[h]) not in in_inert]


def _skip_keeps_every_lasting_key(live: dict, chunk: tuple, keys, lasting, held: list, new: list, key_of: dict,
                                  r: int, loop: int, runs: int, delta: int) -> bool:
    """Whether skipping ``runs`` loops of ``loop`` periods after period ``r`` leaves exactly the lasting keys
    the plain replay would: those live now and those the skipped periods allocate, each once — the copies of the
    loop's new inert segments (``new``) shifted by whole loops, and the lasting keys in segments still in use
    (``held``, the periods' own) shifted by all of them. (Equal relative states make that so for the periods'
    own keys; a loop's new inert segment holding a key from before the cycle would be copied as if a period had
    made it.)"""
    now = {k for k in live if lasting(k)}
    made = [e[1] for e in chunk if e[0] == "alloc" and lasting(e[1])]
    want = now | {keys.shift(k, p * delta) for p in range(r + 1, r + 1 + runs * loop) for k in made}
    copied = [keys.shift(key_of[id(b)], q * loop * delta) for q in range(1, runs + 1) for h in new
              for b in CachingAllocator._blocks_of(h) if b.allocated]
    kept = set(held)
    after = [k for k in now if k not in kept] + copied + [keys.shift(k, runs * loop * delta) for k in held]
    return len(after) == len(want) and set(after) == want


def _where(i: int, at: int | None) -> str:
    return f"events[{i}]" if at is None else f"events[{at}] (a cycle's event {i})"
