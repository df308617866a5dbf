"""A split backward's weight pass under float8: every parameter group's recompute ends with the down projection's
forward casting its input to float8 (torchao's fp32 upcast, scaled copy and float8 result over tokens × f/t), on top
of everything the block saves (``engine.memory.activations.float8_input_cast_bytes``); checked against
``measure --fake`` of one rank (seconds)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_each_groups_recompute_ends_with_the_down_projections_input_cast(tmp_path):
    """GPT-2 (8 blocks) s64K ZBV pp4 × 2 full recompute, tensorwise float8: the W of stage 6 peaks at w2's group with
    its 432 MiB cast of 65,536 × 3,072 elements at 9 B (two 192 MiB fp32 copies and the float8 bytes); the engine,
    which took the weight's cast as the recompute's only float8 transient, read −10.3 % (seed 20261232 #14)."""
    cfg = Config.from_dict({
        "model": {"preset": "gpt2-124m", "layers": 8, "seq_len": 65536},
        "cluster": {"gpu": "h100-96g", "gpus": 4},
        "parallel": {"pp": 4, "virtual_stages": 2, "schedule": "ZBVZeroBubble", "microbatches": 4},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "recompute": "full", "float8": "tensorwise"}})
    rank_as_the_fake_holds_it(cfg, 1, tmp_path, rel=0.02)
