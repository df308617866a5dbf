"""The shape family of a model preset: the sizes the size slider walks along.

A family keeps what makes a preset what it is (head size, query heads per KV head, the
FFN/hidden ratio, the depth/width aspect) and scales its width and depth together, the way
real model families grow (Llama 3 8B -> 70B -> 405B keeps 8 KV heads, a 128-wide head and
roughly 100-130 hidden units per layer). Head counts are rounded to powers of two (then to
multiples of 8) so that the usual TP degrees stay valid along the way.

Pure Python (no Qt) so that it is testable by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden")

#: Each step of the slider multiplies the width-and-depth scale by 2**(1/STEPS_PER_DOUBLING).
STEPS_PER_DOUBLING = 3


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int

    def as_model_fields(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in SHAPE_KEYS}

    @property
    def approx_params(self) -> int:
        """A label for the slider only (attention + MLP + embeddings, no norms/biases).

        The engine's parameter count is authoritative; this just names a size ("≈ 7.2B").
        """
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = 3 * self.hidden * self.ffn_hidden
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


def _round_heads(x: float) -> int:
    if x <= 8:
        p = 1
        while p * 2 <= x * 1.3:
            p *= 2
        return max(1, p)
    return max(8, int(round(x / 8)) * 8)


def _round_to(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def shape_of(model: dict[str, Any]) -> Shape:
    return Shape(*(int(model[k]) for k in SHAPE_KEYS), vocab=int(model["vocab"]))


def shape_family(base: dict[str, Any], *, down: int = 9, up: int = 6) -> tuple[list[Shape], int]:
    """Sizes of the family of ``base`` (a preset's model table) and the index of ``base`` itself.

    Shapes are sorted by size and de-duplicated; ``base`` is always a member.
    """
    shapes, index = _family(shape_of(base), down, up)
    return list(shapes), index


@lru_cache(maxsize=64)
def _family(b: Shape, down: int, up: int) -> tuple[tuple[Shape, ...], int]:
    head_dim = b.hidden // b.heads
    group = b.heads // b.kv_heads
    ffn_ratio = b.ffn_hidden / b.hidden
    ffn_multiple = 64 if b.hidden >= 1024 else 8
    min_layers = min(b.layers, 2)
    shapes = {b}
    for k in range(-down, up + 1):
        if k == 0:
            continue
        scale = 2 ** (k / STEPS_PER_DOUBLING)  # parameters grow ~ scale**3 (width² × depth)
        kv = _round_heads(b.kv_heads * scale)
        heads = kv * group
        hidden = heads * head_dim
        layers = max(min_layers, int(round(b.layers * scale)))
        ffn = _round_to(ffn_ratio * hidden, ffn_multiple)
        shapes.add(Shape(layers, hidden, heads, kv, ffn, b.vocab))
    ordered = sorted(shapes, key=lambda s: (s.approx_params, s.layers))
    # keep sizes strictly increasing: drop a shape that is not larger than the one before,
    # unless it is the base itself
    out: list[Shape] = []
    for s in ordered:
        if out and s.approx_params <= out[-1].approx_params and s != b:
            continue
        if out and out[-1].approx_params >= s.approx_params and out[-1] != b:
            out.pop()
        out.append(s)
    return tuple(out), out.index(b)


def family_for(model: dict[str, Any], preset: dict[str, Any] | None) -> tuple[list[Shape], int]:
    """The family the slider shows for a config's model table, and the current index.

    The family is the preset's; a shape outside it (a custom file) is inserted where its size
    puts it, so the slider always shows the config as it is.
    """
    shapes, _ = shape_family(preset if preset is not None else model)
    current = shape_of(model)
    if current not in shapes:
        shapes = sorted([*shapes, current], key=lambda s: (s.approx_params, s.layers))
    return shapes, shapes.index(current)


def format_params(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            v = n / div
            return f"{v:.3g}{unit}"
    return str(int(n))
