"""Presets are data (assets/presets/*.toml); this module only reads them."""

from __future__ import annotations

import tomllib
from functools import cache
from typing import Any

from assets import PRESETS_DIR


@cache
def _read(name: str) -> dict[str, dict[str, Any]]:
    with open(PRESETS_DIR / f"{name}.toml", "rb") as fh:
        return tomllib.load(fh)


def model_presets() -> dict[str, dict[str, Any]]:
    """Model shape presets by name (tiny, gpt2-124m, llama2-7b, llama3-8b/70b/405b)."""
    return _read("models")


def gpu_presets() -> dict[str, dict[str, Any]]:
    """GPU kinds by name (a100-40g, a100-80g, h100-sxm, h200, b200, mi300x, rtx4090, cpu)."""
    return _read("gpus")


def cluster_presets() -> dict[str, dict[str, Any]]:
    """Clusters by name: a GPU kind, a size and the links between GPUs."""
    return _read("clusters")
