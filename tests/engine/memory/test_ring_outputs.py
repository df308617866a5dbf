"""Context parallelism's ring attention under the per-op policy: every cp step's flash output and log-sum-exp is
saved (the op is in torchtitan's save list; torch's ``_templated_ring_attention`` calls it once a step), and the
steps' query spans depend on the cp-rank (head-tail load balancing), so cp-ranks differ. Hand-worked numbers."""

from __future__ import annotations

import pytest

from engine.config import Config
from engine.memory import memory_per_rank
from engine.memory.activations import cp_ranks_differ, layer_activation_terms, shape_of

# Llama 3 8B at s = 16K over cp = 4: each rank holds s = 4,096 tokens (two chunks of 2,048), b = 2, h = 4,096, a = 32
CFG = {
    "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 16384},
    "cluster": {"gpu": "h100-96g", "gpus": 4, "gpus_per_node": 8},
    "parallel": {"dp": 1, "cp": 4},
    "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "selective-op"},
}


def _cfg(**training) -> Config:
    return Config.from_dict({**CFG, "training": {**CFG["training"], **training}})


def _ring_rows(cfg: Config, cp_rank: int) -> dict[str, int]:
    return {label: x for label, x, _ in layer_activation_terms(shape_of(cfg, cp_rank))[0] if "ring" in label}


@pytest.mark.parametrize("cp_rank, halves", [(0, 5), (1, 6), (2, 7), (3, 8)])
def test_each_cp_step_saves_its_output_over_the_queries_it_took(cp_rank, halves):
    """cp-rank r: step 0 and the r steps of earlier keys over all 4,096 queries, the 3 − r others over the tail
    2,048: (cp + 1 + r) halves of 2,048 queries. Output bf16 × h; log-sum-exp fp32 × a."""
    rows = _ring_rows(_cfg(), cp_rank)
    (out,) = [x for label, x in rows.items() if "outputs" in label]
    (lse,) = [x for label, x in rows.items() if "log-sum-exps" in label]
    assert out == 2 * 2048 * halves * 2 * 4096
    assert lse == 4 * 32 * 2048 * halves * 2


def test_only_the_per_op_policy_over_the_ring_tells_cp_ranks_apart():
    assert cp_ranks_differ(_cfg())
    assert not cp_ranks_differ(_cfg(recompute="none"))
    assert not cp_ranks_differ(Config.from_dict({**CFG, "model": {**CFG["model"], "attention": "eager"}}))
    assert not _ring_rows(_cfg(recompute="none"), 3)


def test_each_cp_rank_has_its_own_body_with_its_steps_outputs():
    """One microbatch, two blocks: cp-rank r + 1 keeps two more output halves a block than r (2 × (2·2,048·2·4,096 +
    4·32·2,048·2) B), and the report's groups are the four cp-ranks."""
    report = memory_per_rank(_cfg())
    layers = [sum(t.bytes for t in report.per_rank[r].catalogue("activations") if t.kind == "layers")
              for r in range(4)]
    step = 2 * (2 * 2048 * 2 * 4096 + 4 * 32 * 2048 * 2)
    assert [b - a for a, b in zip(layers, layers[1:])] == [step] * 3
    assert len(report.groups) == 4
    flat = memory_per_rank(_cfg(recompute="none"))
    assert len(flat.groups) == 1
