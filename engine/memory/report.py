"""The result types of the memory model: ``Term``, one rank's body, ``RankMemory``, ``MemoryReport``.

Every number is per rank, in bytes, for a named rank (and its pipeline stages); a category is
the sum of its terms and a rank's total the sum of its categories, never a separate guess.
Ranks that hold the same thing (DP replicas, TP shards with equal vocabulary chunks) share one
body. A ``Term`` says in fields, not in its label, which category it belongs to, whether
PyTorch's MemTracker / caching allocator can see it, its pipeline stage and the microbatches
in flight it is multiplied by; ``kind`` names its source for machines (compare's notes, the
DataParallel model). Labels and formulas are for people and are never parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.names import MEMORY_CATEGORIES

GIB = 2**30
MB = 10**6
MIB = 2**20


class Term(NamedTuple):
    """One named contribution to a category: its bytes, the formula that gives them, and what it is.

    ``category``: one of ``engine.names.MEMORY_CATEGORIES`` (the one the term sits in; a rank's
    body refuses a term filed under another). ``tracked``: PyTorch's MemTracker and caching
    allocator see these bytes (False for the runtime context, collective-library buffers and
    allocator slack). ``stage``: the pipeline stage the term belongs to, or None. ``in_flight``:
    the microbatches in flight the term is multiplied by, or None. ``kind``: a short
    machine-readable name of the term's source. (A NamedTuple: immutable and cheap to build —
    a body has dozens and the GUI rebuilds them on every slider move.)
    """

    label: str
    bytes: int
    formula: str
    category: str
    tracked: bool = True
    stage: int | None = None
    in_flight: int | None = None
    kind: str = ""

    def to_json(self) -> dict:
        return {"label": self.label, "bytes": self.bytes, "formula": self.formula, "category": self.category,
                "tracked": self.tracked, "stage": self.stage, "in_flight": self.in_flight, "kind": self.kind}


class Terms(dict):
    """Terms being collected for one rank, by category: ``T.add(category, label, bytes, formula, ...)``."""

    def __init__(self) -> None:
        super().__init__((c, []) for c in MEMORY_CATEGORIES)
        #: what ``optimizer.step()`` allocates tensor by tensor (``engine.memory.states.optimizer_step_term``): whether
        #: it steps parameter by parameter (for-loop) or all at once (foreach), and the fp32 tensors' bytes as
        #: (bytes of one unit's tensors in order, count) groups; () where it allocates nothing
        self.optimizer_step: tuple = ()
        #: FSDP2's root post-backward at the end of an unpipelined backward (``engine.memory.buffers._unit_by_unit_reduce``,
        #: the ``fsdp_root_end`` term): the bytes of its reduce-scatter input, of the gathered root laid as a term of its
        #: own (``fsdp_root_params``) and whether the copy-in is the end's largest side; () without such an end
        self.root_end: tuple = ()
        #: what a split backward's I keeps for its W, per stage: the tensors' bytes in order (``engine.memory.
        #: activations.split_backward_terms``: each weight op's output gradient), for the allocation events
        self.split_backward_pieces: dict[int, tuple[int, ...]] = {}
        self.freed_at_input_pieces: dict[int, tuple[int, ...]] = {}  # per stage: what an I frees, as its tensors
        #: per stage whose W recomputes nothing and holds the experts' full-size weight gradients (``engine.memory.
        #: activations._plain_experts_weight_pass``): one gradient's bytes, the pieces the events lay its pass in
        self.weight_pass_piece: dict[int, int] = {}
        #: the largest tensor an I's float8 phase allocates (``engine.memory.activations._float8_input_pass``: a cast's
        #: fp32 copy): the events lay the I's own transients in pieces no larger; 0: whole
        self.input_backward_piece: int = 0
        #: the largest tensor of eager float8's casts in a forward's or a B's float8 term (a cast's fp32 copy): the events
        #: lay those moments' rows in pieces no larger; 0: whole
        self.float8_piece: int = 0
        # per stage with a weight pass that recomputes: (blocks whose gradients it has made by its peak, its blocks)
        self.weight_peak_blocks: dict[int, tuple[int, int]] = {}
        #: FSDP2's sharded gradients as the reduce-scatters make them: the largest unit's bytes (each unit's
        #: post-backward allocates its own output), for the allocation events; 0: one piece
        self.grad_piece: int = 0
        #: the context-parallel attention's backward workspace tensor by tensor (``activations.
        #: context_parallel_backward_tensors``), for the allocation events; (): one piece
        self.cp_pieces: tuple[int, ...] = ()
        #: without context parallelism, a B's attention phase where it may hold FSDP2's fresh gradients (``engine.
        #: memory.activations.attention_phase_of_fresh_gradients``): (its workspace, the MLP's and norm's saved bytes,
        #: the workspace's formula), laid by ``engine.memory.buffers`` where it outweighs the MLP's; (): none
        self.attention_phase: tuple = ()
        #: the REDUCE_GRAD moment's unit's whole reduce-scatter input (``buffers._reduce_grad``), which torch allocates
        #: beside that unit's accumulation and gathered parameters: the events lay it whole where it fits; 0: none
        self.reduce_gross: int = 0
        #: of the plain gradients (``kind="gradients"``, no FSDP2), the one tensor autograd makes after every block's:
        #: under TP the token embedding's at full V × h (``engine.memory.states``), laid whole by the events; 0: none
        self.plain_grad_whole: int = 0
        #: FSDP2's root all-gather output where the root is gathered first in a forward and kept to the first block's
        #: copy-out (``engine.memory.buffers._root_and_current_unit``), for the allocation events; 0: none
        self.root_gather: int = 0

    def add(self, category: str, label: str, nbytes: int, formula: str, tracked: bool = True,
            stage: int | None = None, in_flight: int | None = None, kind: str = "") -> None:
        self[category].append(Term(label, nbytes, formula, category, tracked, stage, in_flight, kind))


class _Body:
    """The categories of one distinct rank (shared by identical ranks).

    ``terms``: the snapshot at the rank's peak (what ``explain`` shows; categories and total are its
    sums); ``catalogue``: every term the modules produced, alive at the peak or not (the snapshot
    when not given); ``allocated``: the tracked bytes at the peak (the snapshot's tracked terms, summed when not given);
    ``reserved``: what the caching allocator holds at most (``allocated`` when not given; a callable
    is called once, when first asked: the allocator replay behind it costs more than the rest of the
    body, and a planner that rejects a layout on ``allocated`` alone never asks);
    ``timeline``: the ``engine.memory.lifetimes.RankTimeline`` the snapshot was taken from (None
    for a body assembled directly from terms).
    """

    __slots__ = ("terms", "catalogue", "values", "total", "stages", "pp_rank", "allocated", "_reserved",
                 "untracked", "timeline")

    def __init__(self, terms: dict[str, list[Term]], stages: tuple[int, ...], pp_rank: int, *,
                 catalogue: dict[str, list[Term]] | None = None, allocated: int | None = None,
                 reserved: int | Callable[[], int] | None = None, timeline=None):
        for c in MEMORY_CATEGORIES:
            for t in terms[c]:
                if t.category != c:
                    raise ValueError(f"term {t.label!r} has category {t.category!r} but sits in {c!r}; "
                                     f"allowed categories: {', '.join(MEMORY_CATEGORIES)}")
        self.terms = terms
        self.catalogue = catalogue if catalogue is not None else terms
        self.values = {c: sum(t.bytes for t in terms[c]) for c in MEMORY_CATEGORIES}
        self.total = sum(self.values.values())
        self.stages = stages
        self.pp_rank = pp_rank
        if allocated is None:
            allocated = sum(t.bytes for c in MEMORY_CATEGORIES for t in terms[c] if t.tracked)
        self.allocated = allocated
        self._reserved = self.allocated if reserved is None else reserved
        # not tensors and not the caching allocator's: runtime context, collective-library buffers
        # (the allocator slack is part of ``reserved``)
        self.untracked = sum(t.bytes for t in terms["overhead"] if not t.tracked and t.kind != "allocator_slack")
        self.timeline = timeline

    @property
    def reserved(self) -> int:
        if callable(self._reserved):
            self._reserved = self._reserved()
        return self._reserved

    @property
    def peak_moment(self) -> str:
        return self.timeline.peak_moment() if self.timeline is not None else ""


class RankMemory:
    """Memory of one rank: one attribute per category (bytes), ``total``, ``allocated``, ``reserved``,
    ``fits``, ``explain``.

    The categories are the snapshot at the rank's peak (``engine.memory.lifetimes``): ``total`` is
    their sum, ``allocated`` its tracked part (what ``torch.cuda.max_memory_allocated()`` reports),
    ``reserved`` what ``torch.cuda.max_memory_reserved()`` would (the caching allocator's segments;
    no runtime context, no collective-library buffers). ``fits``: reserved + those untracked
    overhead terms ≤ capacity.
    """

    __slots__ = ("rank", "tp_rank", "dp_rank", "_body", "_capacity")

    def __init__(self, rank: int, tp_rank: int, dp_rank: int, body: _Body, capacity: int):
        self.rank = rank
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self._body = body
        self._capacity = capacity

    def category_peaks(self) -> dict[str, int]:
        """Each category's most bytes at any moment of the step, the moments apart (``RankTimeline.category_peaks``):
        what the rank holds of each at its own worst, beside the snapshot at the rank's peak; the snapshot's
        values where the rank has no timeline."""
        tl = self._body.timeline
        if tl is None:
            return {c: int(getattr(self, c)) for c in MEMORY_CATEGORIES}
        return tl.category_peaks()

    # categories (params, grads, ...) are added as properties below the class
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    temporaries: int
    overhead: int

    @property
    def pp_rank(self) -> int:
        return self._body.pp_rank

    @property
    def stages(self) -> tuple[int, ...]:
        return self._body.stages

    @property
    def total(self) -> int:
        return self._body.total

    @property
    def allocated(self) -> int:
        """Tracked bytes at the peak: the tensors (categories less the untracked overhead terms)."""
        return self._body.allocated

    @property
    def reserved(self) -> int:
        """Bytes the caching allocator reserves at most (``torch.cuda.max_memory_reserved()``)."""
        return self._body.reserved

    @property
    def device_bytes(self) -> int:
        """What the device must hold: reserved + the untracked overhead (runtime context, collective buffers)."""
        return self._body.reserved + self._body.untracked

    @property
    def peak_moment(self) -> str:
        """The action at which the rank peaks, in words ("" without a timeline)."""
        return self._body.peak_moment

    @property
    def fits_allocated(self) -> bool:
        """Whether the tensors at the peak and the untracked overhead fit the card (no allocator
        replay needed: reserved >= allocated, so ``fits`` implies this)."""
        return self._body.allocated + self._body.untracked <= self._capacity

    @property
    def fits(self) -> bool:
        # a rank whose tensors alone pass the card does not fit, and its replay is not run to say so
        return self.fits_allocated and self.device_bytes <= self._capacity

    @property
    def model_states(self) -> int:
        """params + grads + optimizer."""
        v = self._body.values
        return v["params"] + v["grads"] + v["optimizer"]

    def explain(self, category: str) -> list[Term]:
        """The terms that make up ``category`` at the peak (their bytes sum to it)."""
        if category not in self._body.terms:
            raise KeyError(f"unknown memory category {category!r}; allowed: {', '.join(MEMORY_CATEGORIES)}")
        return list(self._body.terms[category])

    def catalogue(self, category: str) -> list[Term]:
        """Every term of ``category`` the model produced, each at its largest, alive at the peak or not."""
        if category not in self._body.catalogue:
            raise KeyError(f"unknown memory category {category!r}; allowed: {', '.join(MEMORY_CATEGORIES)}")
        return list(self._body.catalogue[category])

    def to_dict(self) -> dict:
        v = self._body.values
        out = {"rank": self.rank, "stage": self._body.stages[0], "stages": list(self._body.stages)}
        out.update((c, v[c]) for c in MEMORY_CATEGORIES)
        out["total"] = self._body.total
        out["allocated"] = self._body.allocated
        out["reserved"] = self._body.reserved
        out["fits"] = self.fits
        return out

    def __repr__(self) -> str:
        return (f"RankMemory(rank={self.rank}, stages={self.stages}, total={self.total / GIB:.2f} GiB, "
                f"reserved={self.reserved / GIB:.2f} GiB)")


def _category_property(name: str) -> property:
    return property(lambda self: self._body.values[name], doc=f"bytes of {name!r} on this rank")


for _name in MEMORY_CATEGORIES:
    setattr(RankMemory, _name, _category_property(_name))


@dataclass(frozen=True)
class RankSet:
    """Ranks of the (pp, dp, cp, tp) mesh that share one body, in rank order without listing them.

    A pipeline rank's ranks are ``p·block + x`` for x < block (= dp·cp·tp); this set holds those of
    ``pp_ranks`` whose offset ``x`` is ≡ one of ``residues`` (mod ``period``, which divides the
    block: tp, or lcm(tp, ep) when EP ranks differ) and, when ``dp_ranks`` is given, whose dp index
    ``x // (cp·tp)`` is one of them. Its size and first and last ranks cost nothing however large the
    world is (but a dp filter whose rows the period does not divide)."""

    block: int
    row: int  # cp·tp: the ranks of one dp index
    pp_ranks: tuple[int, ...]
    period: int
    residues: tuple[int, ...]
    dp_ranks: tuple[int, ...] | None = None

    def _offsets(self):
        if self.dp_ranks is None:
            for k in range(0, self.block, self.period):
                for j in self.residues:
                    yield k + j
            return
        wanted = set(self.residues)
        for d in self.dp_ranks:
            for x in range(d * self.row, (d + 1) * self.row):
                if x % self.period in wanted:
                    yield x

    def __iter__(self):
        for p in self.pp_ranks:
            for x in self._offsets():
                yield p * self.block + x

    def __len__(self) -> int:
        per_offset = len(self.residues)
        if self.dp_ranks is None:
            per_block = self.block // self.period * per_offset
        elif self.row % self.period == 0:
            per_block = len(self.dp_ranks) * (self.row // self.period) * per_offset
        else:
            per_block = sum(1 for _ in self._offsets())
        return len(self.pp_ranks) * per_block

    @property
    def last(self) -> int:
        base = self.pp_ranks[-1] * self.block
        if self.dp_ranks is None:
            return base + self.block - self.period + self.residues[-1]
        wanted = set(self.residues)
        return base + next(x for d in reversed(self.dp_ranks) for x in range((d + 1) * self.row - 1, d * self.row - 1, -1)
                           if x % self.period in wanted)


class RankGroup(NamedTuple):
    """Ranks that hold the same thing: ``first`` is the lowest of them (a RankMemory; every other
    one differs only in its rank and mesh coordinates), ``ranks`` all of them in rank order
    (iterable, with ``len``)."""

    first: RankMemory
    ranks: RankSet | tuple[int, ...]

    @property
    def label(self) -> str:
        """"3", "0-15", or the first four and the count ("0,2,4,6,… (512)")."""
        ranks, n = self.ranks, len(self.ranks)
        first = self.first.rank
        last = ranks.last if isinstance(ranks, RankSet) else ranks[-1]
        if n == 1:
            return str(first)
        if last - first + 1 == n:
            return f"{first}-{last}"
        shown = ",".join(str(r) for r, _ in zip(ranks, range(4)))
        return shown + (f",… ({n})" if n > 4 else "")


class LazyRanks(Sequence):
    """``MemoryReport.per_rank`` of a large world: rank ``i``'s RankMemory is made when asked for,
    from ``locate(i) -> (tp_rank, dp_rank, body)``; nothing per rank is built in advance."""

    __slots__ = ("_n", "_locate", "_capacity")

    def __init__(self, n: int, locate: Callable[[int], tuple[int, int, _Body]], capacity: int):
        self._n, self._locate, self._capacity = n, locate, capacity

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"rank {i} outside 0..{self._n - 1}")
        tp_rank, dp_rank, body = self._locate(i)
        return RankMemory(i, tp_rank, dp_rank, body, self._capacity)

    def __iter__(self):
        return (self[i] for i in range(self._n))


@dataclass(frozen=True)
class MemoryReport:
    """Every rank's memory (``per_rank``: a list, or a LazyRanks view of a large world) and the
    groups of ranks that hold the same thing (``groups``; found from ``per_rank`` when not given).
    ``peak``, ``fits`` and ``distinct_groups`` read the groups only, so their cost does not grow with
    the world."""

    per_rank: Sequence[RankMemory]
    capacity_bytes: int
    conventions: dict[str, str]
    groups: tuple[RankGroup, ...] | None = None

    def __post_init__(self) -> None:
        if self.groups is None:
            found: dict[int, list[RankMemory]] = {}
            for r in self.per_rank:
                found.setdefault(id(r._body), []).append(r)
            object.__setattr__(self, "groups", tuple(RankGroup(g[0], tuple(x.rank for x in g))
                                                    for g in found.values()))

    @property
    def peak(self) -> RankMemory:
        """The rank that needs the most memory (lowest rank on ties)."""
        return max((g.first for g in self.groups), key=lambda r: (r.total, -r.rank))

    @property
    def fits(self) -> bool:
        # every rank's tensors first: a layout one rank of which does not fit on them is rejected
        # before any allocator replay runs
        if any(not g.first.fits_allocated for g in self.groups):
            return False
        return all(g.first.fits for g in self.groups)

    def distinct_groups(self) -> list[RankGroup]:
        """The groups of identical ranks, in order of each group's first rank."""
        return sorted(self.groups, key=lambda g: g.first.rank)

    def distinct(self) -> list[list[RankMemory]]:
        """Ranks grouped by identical content, in rank order of each group's first rank (every
        rank listed: for a large world, :meth:`distinct_groups`)."""
        return [[self.per_rank[r] for r in g.ranks] for g in self.distinct_groups()]

    def to_json(self) -> dict:
        return {"per_rank": [r.to_dict() for r in self.per_rank], "capacity_bytes": self.capacity_bytes}


def gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
