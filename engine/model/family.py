"""The shape family of a model: the one rule behind the size slider and ``largest_fitting_model``.

A family keeps what makes a model what it is and grows it the way real families grow (Llama 3
8B -> 70B -> 405B keeps 8 KV heads, a 128-wide head and a similar depth/width aspect):

* fixed: head_dim, the GQA group (heads / kv_heads), vocabulary, sequence length and every
  non-shape field (mlp, norm, attention, ...);
* width: ``kv_heads = n · step`` for n = 1, 2, 3, ... — ``step`` is the tensor-parallel degree
  when one is given, else the largest of 1, 2, 4, 8 that divides the base's kv_heads and
  ffn_hidden. So every member is valid for every tp that divides ``step`` (heads, kv_heads and
  ffn_hidden stay multiples of it); ``ffn_hidden`` keeps the base's f/h ratio, rounded to a
  multiple of lcm(step, gcd(base ffn_hidden, 64));
* depth: width n's *aspect member* has ``round(layers · n / n_base)`` layers (the base's
  layers/width ratio, never fewer than ``min_layers``); between the aspect members of widths
  n − 1 and n the family continues at width n with fewer layers, from the fewest that are
  larger than the aspect member of width n − 1. So parameter counts strictly increase along
  the family, the steps are fine (one layer) even where widths are coarse, and no member is
  deeper than its width's aspect;
* the family ends where a member would leave ``engine.config.FIELD_RANGES``.

A mixture of experts (``experts > 0``) grows along its experts and depth instead, the way MoE
families scale (Switch and GShard add experts at a fixed width; DeepSeek-V2-Lite -> V2 -> V3 go
64 -> 160 -> 256 experts and 27 -> 60 -> 61 blocks): see ``ExpertFamily``. Width (hidden, heads,
head dims, MLA ranks, ffn and expert widths), top-k, shared experts, leading dense blocks and
router groups stay the base's, so every tp the base allows stays allowed.

The base model is the aspect member of its own width, exactly. Parameter counts are
``engine.model.params.param_counts(spec).total`` (exact). ``walk`` is the size slider's: the members
nearest to 2^(k/3) × the base's size. ``largest_fitting_model`` searches the same family for
the largest member that fits a layout. Pure (no Qt, no torch).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from engine.config import FIELD_RANGES, Config, ConfigError, ModelSpec
from engine.memory import memory_per_rank
from engine.model.params import param_counts

#: The slider's step multiplies the parameter count by about 2**(1/STEPS_PER_DOUBLING).
STEPS_PER_DOUBLING = 3
#: Without a given tp, widths stay valid for tp = 1, 2, 4, 8 (as far as the base itself is).
USUAL_TP = 8

SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden")
#: A mixture of experts' family also changes its routed expert count.
MOE_SHAPE_FIELDS = (*SHAPE_FIELDS, "experts")
#: Without a given ep, expert counts stay valid for ep = 1, 2, 4, 8 (as far as the base itself is).
USUAL_EP = 8


def shape_of(spec: ModelSpec) -> dict[str, int]:
    """The fields the size slider writes: the shape, and the expert count of a mixture of experts."""
    return {k: getattr(spec, k) for k in (MOE_SHAPE_FIELDS if spec.experts > 0 else SHAPE_FIELDS)}


@dataclass(frozen=True)
class Member:
    """One model of a family and its exact parameter count."""

    spec: ModelSpec
    params: int

    def shape(self) -> dict[str, int]:
        """The shape fields of the model table (what the size slider writes; ``shape_of``)."""
        return shape_of(self.spec)

    @property
    def active(self) -> int:
        """Parameters one token passes through (``engine.model.params.param_counts``: all of a dense model)."""
        return param_counts(self.spec).active


def step_of(base: ModelSpec, tp: int | None = None) -> int:
    """KV heads per width step: tp, or the largest of 1, 2, 4, 8 dividing kv_heads and ffn_hidden."""
    if tp is not None:
        return tp
    return math.gcd(base.kv_heads, base.ffn_hidden, USUAL_TP)


class Family:
    """The family of ``base``: members indexed by width ``n`` (kv_heads = n · step) and layers.

    ``tp``: keep tp dividing heads, kv_heads and ffn_hidden (else the usual degrees, see
    ``step_of``); ``min_layers``: no member has fewer (pp · virtual_stages for a layout).
    """

    def __init__(self, base: ModelSpec, tp: int | None = None, min_layers: int = 1):
        self.base = base
        self.step = step_of(base, tp)
        if base.kv_heads % self.step or base.ffn_hidden % self.step:
            raise ValueError(f"step {self.step} must divide kv_heads ({base.kv_heads}) and "
                             f"ffn_hidden ({base.ffn_hidden})")
        self.min_layers = max(1, min_layers)
        self.base_width = base.kv_heads // self.step
        self.group = base.heads // base.kv_heads
        self.ffn_multiple = math.lcm(self.step, math.gcd(base.ffn_hidden, 64))

    # ------------------------------------------------------------------ the rule

    def aspect_layers(self, n: int) -> int:
        """Layers of width n's aspect member (the base's layers / width ratio)."""
        return max(self.min_layers, round(self.base.layers * n / self.base_width))

    def spec(self, n: int, layers: int) -> ModelSpec | None:
        """The model of width n with ``layers`` layers; None where it leaves FIELD_RANGES."""
        return _spec(self.base, self.step, self.ffn_multiple, n, layers)

    def params(self, n: int, layers: int) -> int:
        """Exact parameter count (parameters are linear in the layer count at a fixed width)."""
        fixed, per_layer = _line(self.base, self.step, self.ffn_multiple, n, self.aspect_layers(n))
        return fixed + layers * per_layer

    def first_layers(self, n: int) -> int:
        """The fewest layers width n has in the family: just larger than width n − 1's aspect member."""
        if n == 1:
            return self.min_layers
        below = self.params(n - 1, self.aspect_layers(n - 1))
        fixed, per_layer = _line(self.base, self.step, self.ffn_multiple, n, self.aspect_layers(n))
        return max(self.min_layers, (below - fixed) // per_layer + 1)

    def exists(self, n: int) -> bool:
        """Width n is in the family (its aspect member is inside FIELD_RANGES)."""
        return n >= 1 and self.spec(n, self.aspect_layers(n)) is not None

    def member(self, n: int, layers: int) -> Member:
        spec = self.spec(n, layers)
        if spec is None:
            raise ValueError(f"width {n} with {layers} layers leaves the configurable ranges")
        return Member(spec, self.params(n, layers))

    first_n = 1  # the smallest width index (an ExpertFamily starts where top-k experts exist)

    def members(self, max_params: float = math.inf) -> Iterator[Member]:
        """Every member in order, parameter counts strictly increasing, up to ``max_params``."""
        n = self.first_n
        while self.exists(n):
            for layers in range(self.first_layers(n), self.aspect_layers(n) + 1):
                if self.params(n, layers) > max_params:
                    return
                yield self.member(n, layers)
            n += 1


def expert_step_of(base: ModelSpec, ep: int | None = None) -> int:
    """Routed experts per step of an ExpertFamily: lcm(router_groups, ep), ep being the given
    expert-parallel degree or else the largest of 1, 2, 4, 8 dividing the base's experts."""
    return math.lcm(base.router_groups, ep if ep is not None else math.gcd(base.experts, USUAL_EP))


class ExpertFamily:
    """The family of a mixture of experts: members indexed by ``n`` (experts = n · step) and layers.

    The same rule as ``Family`` with the expert count in the role of the width: n's *aspect member*
    has ``round(layers · n / n_base)`` blocks (the base's blocks per expert step); between the aspect
    members of n − 1 and n the family continues at n with fewer blocks. Everything else is the base's
    (width, top-k, shared experts, the ``dense_layers`` leading dense blocks, router groups). So
    ``step`` (``expert_step_of``) divides every member's experts (ep and the router groups stay
    valid), every member has at least ``dense_layers`` + 1 blocks and ``min_layers``, and the
    smallest n is the first whose experts can give every token its top-k (within its best groups).
    """

    def __init__(self, base: ModelSpec, tp: int | None = None, min_layers: int = 1, ep: int | None = None):
        if base.experts <= 0:
            raise ValueError("an ExpertFamily needs a mixture of experts (model.experts > 0)")
        self.base = base
        self.tp = tp
        self.step = expert_step_of(base, ep)
        if base.experts % self.step:
            raise ValueError(f"expert step {self.step} (router_groups, ep) must divide experts ({base.experts})")
        self.min_layers = max(1, min_layers, base.dense_layers + 1)
        self.base_width = base.experts // self.step
        k, g = base.experts_per_token, base.router_groups
        # the fewest experts that route top-k: at least k, and k within the best topk_groups groups
        need = k if g <= 1 else max(k, -(-k * g // max(1, base.router_topk_groups)))
        self.first_n = max(1, -(-need // self.step))

    def aspect_layers(self, n: int) -> int:
        return max(self.min_layers, round(self.base.layers * n / self.base_width))

    def spec(self, n: int, layers: int) -> ModelSpec | None:
        return _expert_spec(self.base, self.step, n, layers)

    def params(self, n: int, layers: int) -> int:
        fixed, per_layer = _expert_line(self.base, self.step, n)
        return fixed + layers * per_layer

    def first_layers(self, n: int) -> int:
        if n <= self.first_n:
            return self.min_layers
        below = self.params(n - 1, self.aspect_layers(n - 1))
        fixed, per_layer = _expert_line(self.base, self.step, n)
        return max(self.min_layers, (below - fixed) // per_layer + 1)

    def exists(self, n: int) -> bool:
        return n >= self.first_n and self.spec(n, self.aspect_layers(n)) is not None

    member = Family.member
    members = Family.members


def family_of(base: ModelSpec, tp: int | None = None, min_layers: int = 1, ep: int | None = None
              ) -> Family | ExpertFamily:
    """The family the size slider and ``largest_fitting_model`` walk: an ExpertFamily for a
    mixture of experts, else the shape Family (``ep`` only matters to the former)."""
    if base.experts > 0:
        return ExpertFamily(base, tp, min_layers=min_layers, ep=ep)
    return Family(base, tp, min_layers=min_layers)


@lru_cache(maxsize=4096)
def _expert_spec(base: ModelSpec, step: int, n: int, layers: int) -> ModelSpec | None:
    experts = n * step
    if not (FIELD_RANGES["model.layers"].contains(layers) and FIELD_RANGES["model.experts"].contains(experts)):
        return None
    if base.experts == experts and base.layers == layers:
        return base
    return replace(base, experts=experts, layers=layers, preset=None)


@lru_cache(maxsize=1024)
def _expert_line(base: ModelSpec, step: int, n: int) -> tuple[int, int]:
    """(parameters outside the MoE blocks' line, parameters per block) with n · step experts: the
    leading dense blocks are fixed, so the count is affine in the layer count."""
    counts = param_counts(replace(base, experts=n * step, preset=None))
    return counts.total - counts.layers * counts.per_layer, counts.per_layer


def _shape(base: ModelSpec, step: int, ffn_multiple: int, n: int, layers: int) -> dict[str, int]:
    kv_heads = n * step
    heads = kv_heads * (base.heads // base.kv_heads)
    ffn = round(base.ffn_hidden * n / (base.kv_heads // step) / ffn_multiple) * ffn_multiple
    return {"layers": layers, "hidden": heads * base.head_dim, "heads": heads, "kv_heads": kv_heads,
            "ffn_hidden": max(ffn_multiple, ffn)}


@lru_cache(maxsize=4096)
def _spec(base: ModelSpec, step: int, ffn_multiple: int, n: int, layers: int) -> ModelSpec | None:
    shape = _shape(base, step, ffn_multiple, n, layers)
    if not all(FIELD_RANGES[f"model.{k}"].contains(v) for k, v in shape.items()):
        return None
    if all(getattr(base, k) == v for k, v in shape.items()):
        return base
    return replace(base, **shape, preset=None)


@lru_cache(maxsize=1024)
def _line(base: ModelSpec, step: int, ffn_multiple: int, n: int, layers: int) -> tuple[int, int]:
    """(parameters outside the blocks, parameters per block) at width n (counted past the ranges too)."""
    counts = param_counts(replace(base, **_shape(base, step, ffn_multiple, n, layers), preset=None))
    return counts.total - counts.layers * counts.per_layer, counts.per_layer


# --------------------------------------------------------------------------- the size slider


def walk(base: ModelSpec, current: ModelSpec | None = None, *, tp: int | None = None, min_layers: int = 1,
         ep: int | None = None, down: int = 9 * STEPS_PER_DOUBLING, up: int = 6 * STEPS_PER_DOUBLING
         ) -> tuple[list[Member], int]:
    """The size slider's members: nearest to 2^(k/3) × the base's size, k = −down … up.

    ``min_layers`` (a layout's pp · virtual_stages): no member has fewer layers, so a step of the
    slider never lands on a model the layout cannot place. ``ep`` (a mixture of experts: the
    layout's expert-parallel degree): every member's experts are a multiple of it.

    Sorted, strictly increasing, de-duplicated; the base is one exactly. ``current`` (the model
    as it is now; the base when None) is in the list too — inserted by size when it is not a
    member — and its index is returned. Cached: the GUI asks on every redraw.
    """
    members, index = _walk(base, current, tp, max(1, min_layers), ep if base.experts > 0 else None, down, up)
    return list(members), index


@lru_cache(maxsize=64)
def _walk(base: ModelSpec, current: ModelSpec | None, tp: int | None, min_layers: int, ep: int | None,
          down: int, up: int) -> tuple[tuple[Member, ...], int]:
    out = _picked(base, tp, min_layers, ep, down, up)
    mine_spec = current if current is not None else base  # a base outside its own family (MLA, head_size)
    shape = shape_of(mine_spec)
    for i, m in enumerate(out):
        if m.shape() == shape:
            return out, i
    mine = Member(mine_spec, param_counts(mine_spec).total)
    inserted = sorted([*out, mine], key=lambda m: (m.params, m.spec.layers))
    return tuple(inserted), inserted.index(mine)


@lru_cache(maxsize=32)
def _picked(base: ModelSpec, tp: int | None, min_layers: int, ep: int | None, down: int, up: int
            ) -> tuple[Member, ...]:
    """The family's members nearest to 2^(k/3) × the base's size (independent of the model as it is
    now, so a slider move that lands on a member reuses them)."""
    fam = family_of(base, tp, min_layers=min_layers, ep=ep)
    p0 = param_counts(base).total
    ratio = 2 ** (1 / STEPS_PER_DOUBLING)
    pool = list(fam.members(max_params=p0 * ratio ** (up + 1)))
    sizes = [m.params for m in pool]
    picked: dict[int, Member] = {}
    for k in range(-down, up + 1):
        target = math.log(p0 * ratio**k)
        i = bisect.bisect_left(sizes, p0 * ratio**k)
        near = [j for j in (i - 1, i) if 0 <= j < len(pool)]
        j = min(near, key=lambda j: abs(math.log(sizes[j]) - target))
        picked[sizes[j]] = pool[j]
    return tuple(sorted(picked.values(), key=lambda m: m.params))


# --------------------------------------------------------------------------- capacity


def largest_fitting_model(cfg: Config) -> tuple[ModelSpec, int] | None:
    """The largest member of ``cfg.model``'s family that fits every rank of this layout.

    The family (see the module docstring) keeps tp dividing heads, kv_heads and ffn_hidden (ep
    dividing the experts of a mixture of experts) and never has fewer layers than pp · virtual_stages. Returns (spec, exact parameters) of a member
    that fits while the next member does not, or None when even the smallest does not fit.
    """

    fam = family_of(cfg.model, tp=cfg.parallel.tp, min_layers=cfg.parallel.num_stages, ep=cfg.parallel.ep)

    def fits(n: int, layers: int) -> bool:
        spec = fam.spec(n, layers)
        if spec is None:
            return False
        try:
            trial = replace(cfg, model=spec)
        except ConfigError:
            return False
        return memory_per_rank(trial).fits

    def largest_layers(n: int, lo: int, hi: int) -> int | None:
        """The largest L in lo..hi − 1 that fits while L + 1 does not (hi known not to fit)."""
        if lo >= hi or not fits(n, lo):
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(n, mid) else (lo, mid)
        return lo

    if not fits(1, fam.aspect_layers(1)):
        layers = largest_layers(1, fam.first_layers(1), fam.aspect_layers(1))
        return None if layers is None else _answer(fam.member(1, layers))
    lo, hi = 1, 2  # aspect members: lo fits, hi does not (or is past the family's end)
    while fam.exists(hi) and fits(hi, fam.aspect_layers(hi)):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fam.exists(mid) and fits(mid, fam.aspect_layers(mid)) else (lo, mid)
    if fam.exists(hi):  # between lo's aspect member and hi's: width hi with fewer layers
        layers = largest_layers(hi, fam.first_layers(hi), fam.aspect_layers(hi))
        if layers is not None:
            return _answer(fam.member(hi, layers))
    return _answer(fam.member(lo, fam.aspect_layers(lo)))


def _answer(m: Member) -> tuple[ModelSpec, int]:
    return m.spec, m.params
