"""torchao's Float8Linear casts its input to the autocast dtype under CUDA's autocast only; the fake steps of a GPU
config run CPU autocast in its place, so ``backend.fake_worker`` makes the cast the GPU run makes
(``_float8_inputs_cast_as_on_cuda``): checked against the engine's GPU prediction (seconds)."""

from __future__ import annotations

import pytest

from engine.config import Config
from tests.fake_helpers import rank_as_the_fake_holds_it


@pytest.mark.integration
def test_a_gpu_configs_float8_linears_save_their_input_in_the_autocast_dtype(tmp_path):
    """Llama 3 8B DDP dp2 under autocast, float8 tensorwise, no recompute: exact to 0.1 % (the fake kept fp32 Linear
    inputs before: +0.33 %, the loss moment's forward tensors)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": 2, "seq_len": 4096},
        "cluster": {"gpu": "h100-96g", "gpus": 2, "gpus_per_node": 8},
        "parallel": {"dp": 2, "zero": 0},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "recompute": "none", "float8": "tensorwise"}})
    rank_as_the_fake_holds_it(cfg, 0, tmp_path, rel=0.001)
