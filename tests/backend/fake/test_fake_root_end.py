"""The end of an unpipelined FSDP2 backward in the allocator replay, checked against ``measure --fake`` of one rank
(seconds): the root's post-backward allocates its reduce-scatter input whole, in the reduce dtype, after resharding
the root (torch's ``foreach_reduce``); the events lay it as that one tensor where it is the end's largest side
(``engine.memory.lifetimes._Laying._copy_in``)."""

from __future__ import annotations

import pytest

from backend.fake import reserved_rows, simulate
from engine.config import Config
from engine.predict import predict

V, H = 128_256, 4_096  # Llama 3 8B: the root unit is the token embeddings, the final norm and the head


def _cfg(layers: int) -> Config:
    return Config.from_dict({
        "model": {"preset": "llama3-8b", "layers": layers, "seq_len": 2048},
        "cluster": {"gpu": "h100-96g", "gpus": 32, "gpus_per_node": 8},
        "parallel": {"dp": 32, "zero": 3},
        "training": {"micro_batch_size": 4, "precision": "bf16-mixed", "grad_dtype": "fp32",
                     "recompute": "selective-layer", "recompute_every": 2}})


def test_the_events_lay_the_roots_reduce_scatter_input_whole():
    """fp32 reduce over 32 ranks: the input is 4 B × (2·V·h + h) — 16 KiB past the loss's 4,008 MiB fp32 tensors
    (the final norm's weight), so no block they leave cached can take it. The end's net term (1,879 MiB beyond the
    gathered root, the root's sharded gradients left out) fitted in one."""
    r = next(x for x in predict(_cfg(8)).memory.per_rank if x.rank == 0)
    assert "fsdp_root_end" in {t.kind for t in r.catalogue("comm_buffers")}
    sizes = [e[2] for e in r._body.timeline.events() if e[0] == "alloc" and e[1][0] == "rci"]
    assert sizes == [4 * (2 * V * H + H)]


@pytest.mark.integration
def test_the_roots_copy_in_grows_the_reserve_as_the_fake_does(tmp_path):
    """Llama 3 8B (2 blocks) dp32 ZeRO-3, fp32 reduce, rank 0: the fake reserves a new segment for the root's input at
    the end of the backward; the replay reserved −26 % of the fake's with the net term laid, −11 % with the input."""
    r = next(x for x in predict(_cfg(2)).memory.per_rank if x.rank == 0)
    (row,) = reserved_rows(simulate(_cfg(2), out_dir=tmp_path / "run", ranks=[0], timeout_s=300))
    assert r.allocated == pytest.approx(row["max_allocated"], rel=0.01)
    assert r.reserved == pytest.approx(row["max_reserved"], rel=0.12)
