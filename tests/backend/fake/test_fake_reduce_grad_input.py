"""The schedule's REDUCE_GRAD in the allocator replay against ``measure --fake`` of a pipeline stage (seconds): torch's
``foreach_reduce`` allocates a unit's whole reduce-scatter input while that unit's accumulated gradient is still
there (it drops it after the copy-in), so the moment asks the allocator for the whole input, more than the moment's
net; the events lay it whole where the live bytes stay within the peak (``Terms.reduce_gross``)."""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine.config import Config
from engine.predict import predict


@pytest.mark.integration
def test_the_stage_roots_reduce_scatter_input_takes_a_segment_of_its_own(tmp_path):
    """Llama 3 70B (4 blocks) s2K dp8 pp4 1F1B ZeRO-2, m = 16, stage 0: its root's (the token embedding's) 4,008 MiB
    fp32 reduce-scatter input fits no block the step's cache holds. Laid as the moment's net (the input less the root's
    gathered parameters) the replay reserved −6.5 %; whole, −2.0 % (seed 20261240's 8-block 70B pp8 cp4 stage 0: −4.3 → +0.8 %)."""
    cfg = Config.from_dict({
        "model": {"preset": "llama3-70b", "layers": 4, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
        "parallel": {"dp": 8, "pp": 4, "zero": 2, "schedule": "1F1B", "microbatches": 16},
        "training": {"micro_batch_size": 2, "precision": "bf16-mixed", "grad_dtype": "fp32", "recompute": "selective"}})
    r = next(x for x in predict(cfg).memory.per_rank if x.rank == 0)
    (row,) = reserved_rows(simulate(cfg, out_dir=tmp_path / "run", ranks=[0], timeout_s=300))
    assert r.allocated == pytest.approx(row["max_allocated"], rel=0.01)
    assert r.reserved == pytest.approx(row["max_reserved"], rel=0.04)
