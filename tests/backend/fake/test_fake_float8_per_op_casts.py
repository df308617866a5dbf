"""Float8 under autocast with per-op selective recompute and sequence parallelism: a forward peaks at its last up
projection casting its input to float8 (``engine.memory.activations._float8_forward_input_cast_term``), a backward at
the replay's down projection casting its input (``_replay_end_parts``' ``x8``); checked per pipeline action against
``measure --fake`` of one rank (``benchmarks/fake_actions.py``, seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import fake_actions  # noqa: E402


def _per_action(cfg: Config, rank: int) -> list[tuple[tuple, int, int]]:
    """(action, the fake's most bytes inside it, the engine's most over its moments), in the rank's order."""
    fake = fake_actions.fake_actions(fake_actions.record(cfg, rank))
    engine = dict(fake_actions.engine_actions(cfg, rank))
    return [(key, most, engine[key]) for key, most, _ in fake if key in engine]


@pytest.mark.integration
def test_each_forward_and_backward_of_a_float8_per_op_stage_holds_what_the_fake_holds():
    """Llama 3 70B (8 blocks) s16K b2 tp4 SP pp4 1F1B, per-op recompute, tensorwise float8 under DDP's autocast (fake
    seed 20261270 #17, stage 2): each F peaks at its second block's w3 input cast (the fp32 gathered input, its bf16
    copy, the fp32 scaled copy and its clamp, the float8 result: 3.6 GiB beyond the engine's F before), each B at the
    replay's w2 input cast beside the stash's w2 and reduce-scatter outputs not yet handed back (0.9 GiB)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-70b", "layers": 8, "seq_len": 16384},
        "cluster": {"gpu": "h100-96g", "gpus": 16},
        "parallel": {"tp": 4, "pp": 4, "sequence_parallel": True, "schedule": "1F1B", "microbatches": 4},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "selective-op", "float8": "tensorwise"}})
    rows = _per_action(cfg, 8)
    assert {key[0] for key, _, _ in rows} == {"F", "B"} and len(rows) == 8
    for key, fake, engine in rows:
        assert engine == pytest.approx(fake, rel=0.002), key


@pytest.mark.integration
def test_a_first_backward_holds_the_gradients_its_first_block_made_by_the_ring_attentions_backward():
    """Llama 2 7B (8 blocks) s16K b2 pp2 cp4 1F1B ZeRO-2 with bf16 gradients (FSDP2 accumulates in the parameters'
    dtype), attention-core recompute, tensorwise float8 (fake seed 20261270 #35, stage 0): the first B peaks in its first
    block's ring attention backward with w1, w2, w3 and wo's bf16 gradients made (0.28 GiB), which the engine left to the
    end of the first backward (−3.6 % at the rank's peak before)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama2-7b", "layers": 8, "seq_len": 16384},
        "cluster": {"gpu": "h100-96g", "gpus": 128},
        "parallel": {"dp": 16, "pp": 2, "cp": 4, "zero": 2, "schedule": "1F1B", "microbatches": 2},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "bf16", "recompute": "selective",
                     "float8": "tensorwise"}})
    rows = _per_action(cfg, 0)
    first_b = next((fake, engine) for key, fake, engine in rows if key[0] == "B")
    assert first_b[1] == pytest.approx(first_b[0], rel=0.02)
