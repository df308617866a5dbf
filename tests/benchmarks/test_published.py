"""benchmarks/published.py: every published torchtitan row loads as a config and is predicted with one efficiency."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("published", ROOT / "benchmarks" / "published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_of_tables_1_3_5_is_a_config():
    mod = _module()
    data = mod.rows()
    assert sorted((r["table"], r["row"]) for r in data) == sorted(
        [(t, row) for t in (1, 3) for row in ("FSDP", "FSDP + torch.compile", "FSDP + torch.compile + Float8")]
        + [(5, "1F1B"), (5, "Interleaved 1F1B")])
    assert len({r["efficiency"] for r in data}) == 1
    assert all(r["tps"] > 0 and r["gib"] > 0 for r in data)
    assert len(mod.table(data)) == 2 + len(data)


def test_every_row_reserves_within_ten_percent_of_the_published_memory():
    """The predicted reserve (the step's events replayed through the caching allocator) against the
    memory torchtitan logged, every row of Tables 1, 3 and 5."""
    for r in _module().rows():
        assert abs(r["gib_error"]) <= 0.10, (r["table"], r["row"], r["gib"], r["published_gib"])
        assert r["allocated_gib"] <= r["gib"]
