"""The largest model of a config's shape family that fits every rank of its layout."""

from __future__ import annotations

from dataclasses import replace

from engine.config import Config, ConfigError, ModelSpec
from engine.memory.per_rank import memory_per_rank
from engine.params import param_counts


def _family_member(base: ModelSpec, tp: int, n: int, min_layers: int) -> ModelSpec:
    """Member ``n`` of ``base``'s shape family (see ``largest_fitting_model``)."""
    group = base.heads // base.kv_heads
    kv_heads = n * tp
    heads = kv_heads * group
    hidden = heads * base.head_dim
    ffn = max(tp, round(base.ffn_hidden / base.hidden * hidden / tp) * tp)
    layers = max(min_layers, round(base.layers * hidden / base.hidden))
    return replace(base, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn, layers=layers,
                   preset=None)


def largest_fitting_model(cfg: Config) -> tuple[ModelSpec, int] | None:
    """The largest model of ``cfg.model``'s shape family that fits every rank of this layout.

    Family rule: head_dim, the GQA group (heads / kv_heads), the FFN ratio (f / h), the
    aspect ratio (layers / hidden), vocabulary and sequence length stay fixed; the width grows
    in steps of ``tp`` KV heads (so tp always divides heads and kv_heads), f is rounded to a
    multiple of tp, and layers never drop below pp·virtual_stages. Returns (spec, parameters),
    or None when even the smallest member (tp KV heads) does not fit.
    """
    tp = cfg.parallel.tp
    min_layers = cfg.parallel.num_stages

    def fits(n: int) -> tuple[bool, ModelSpec | None]:
        spec = _family_member(cfg.model, tp, n, min_layers)
        try:
            trial = replace(cfg, model=spec)
        except ConfigError:
            return False, None
        return memory_per_rank(trial).fits, spec

    ok, spec = fits(1)
    if not ok:
        return None
    lo, hi = 1, 2
    while hi <= 1 << 16:
        ok, _ = fits(hi)
        if not ok:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid)[0]:
            lo = mid
        else:
            hi = mid
    best = _family_member(cfg.model, tp, lo, min_layers)
    return best, param_counts(best).total
