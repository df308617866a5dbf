"""Context parallelism's ring attention against ``measure --fake`` of a middle pipeline stage (seconds): the ring keeps
its merged output for its backward and wo saves the heads' reshape of it, a copy (``engine.memory.activations``'
SAVED_TENSORS); at a forward's moment the layer holds the forward's workspace, not the backward's
(``context_parallel_forward_workspace``)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_a_forward_moment_holds_the_rings_output_its_copy_and_the_forward_workspace(tmp_path):
    """GPT-2 (4 blocks) s8K cp2 pp4 1F1B ZeRO-2, b = 4: stage 1 peaks at a forward. With one attention output a block
    and the backward's workspace (624 MiB at 8 blocks) laid at every forward the engine read +12.3 % (seed 20261239's
    8-block HSDP layout +5.3 %); with the ring's output and wo's copy, 24 MiB each a block, and the forward's own
    workspace (the gathered K, V, the sent copy, the fp32 merger) +0.6 %."""
    cfg = Config.from_dict({
        "model": {"preset": "gpt2-124m", "layers": 4, "seq_len": 8192},
        "cluster": {"gpu": "h100-96g", "gpus": 16, "gpus_per_node": 8},
        "parallel": {"dp": 2, "pp": 4, "cp": 2, "zero": 2, "schedule": "1F1B", "microbatches": 8},
        "training": {"micro_batch_size": 4, "precision": "bf16-mixed", "recompute": "none"}})
    rank = rank_as_the_fake_holds_it(cfg, 8, tmp_path, rel=0.02)
    labels = [t.label for t in rank.catalogue("activations")] + [t.label for t in rank.catalogue("temporaries")]
    assert any("in a forward" in x for x in labels)
