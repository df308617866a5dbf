"""GPipe under ZeRO-3 resharding after forward, on a stage of few units, in the engine against ``measure --fake`` of one
rank (seconds): each backward leaves every unit it gathered so (``set_reshard_after_backward(False)``) and no forward
comes between GPipe's backwards, so a later B holds the stage's every unit and gathers none — no all-gather output
(``engine.memory.buffers._current_units``, the output's lifetime ``gathering``)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_a_later_gpipe_backward_holds_every_unit_and_no_all_gather_output(tmp_path):
    """Qwen3 30B-A3B (4 blocks) dp2 pp2 ep2 GPipe ZeRO-3 reshard "always", full recompute: the experts are a unit of
    their own, so a stage of two blocks has five units (its root and two per block). Seed 20261261 #31 (Qwen3 235B,
    pp4 the same way) read +3.4 % on two ranks with the current, prefetched and output units at the second B, where
    the fake held the stage's units alone."""
    cfg = Config.from_dict({
        "model": {"preset": "qwen3-30b-a3b", "layers": 4, "seq_len": 8192},
        "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 4},
        "parallel": {"dp": 2, "pp": 2, "ep": 2, "zero": 3, "schedule": "GPipe", "microbatches": 4,
                     "fsdp_reshard_after_forward": "always"},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "bf16", "recompute": "full"}})
    r = rank_as_the_fake_holds_it(cfg, 0, tmp_path, rel=0.01)
    assert r.peak_moment.startswith("stage 0 B of microbatch")
    held = {t.kind for t in r.explain("comm_buffers")}
    assert "fsdp_units_kept_after_backward" in held and "all_gather_output" not in held
