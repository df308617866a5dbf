"""Integration: under pipelining with autocast and plain gradients, each B after a stage's first ends with every
autocast-cast weight's bf16 gradient waiting for its cast (their ``ToCopyBackward0`` nodes come from the step's
first forward, and autograd runs the highest sequence number first), then the casts one by one; the first stage's
token embedding makes its fp32 gradient beside them, the last stage's head cast its fp32 one first. On real CPU
ranks of a model whose weights outweigh its activations, that is each rank's peak, byte for byte."""

from __future__ import annotations

import json

import pytest

from engine import Config
from engine.compare.measured import compare
from engine.predict import predict

pytestmark = pytest.mark.integration


def test_a_later_bs_end_holds_every_cast_weights_bf16_gradient(tmp_path):
    from backend.launch import launch

    cfg = Config.from_dict({
        "model": {"preset": "tiny", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn_hidden": 2048,
                  "vocab": 4096, "seq_len": 16},
        "cluster": {"preset": "local-cpu", "gpus": 2},
        "parallel": {"dp": 1, "pp": 2, "microbatches": 4, "schedule": "1F1B"},
        "training": {"micro_batch_size": 1, "precision": "bf16-mixed", "recompute": "none"}})
    run = launch(cfg, tmp_path / "run", steps=2, timeout_s=300)
    result = run.wait()
    assert run.ok, result
    measured = json.loads((tmp_path / "run" / "measurement.json").read_text())
    pred = predict(cfg)
    for rank, fp32 in ((0, 4096 * 512 * 4), (1, 4096 * 512 * 4)):  # the embedding's, the head's fp32 gradient
        r = pred.memory.per_rank[rank]
        assert "the end of stage" in r.peak_moment  # a B's end, its microbatch freed
        waiting = [t.bytes for t in r.explain("temporaries") if t.kind == "autocast_cast_gradients"]
        # 2 blocks × (2·512² + 2·512·256 + 3·512·2048) weights in bf16 (+ the head's 4096·512 on the last stage)
        assert waiting == [2 * 2 * 3_932_160 + (2 * 4096 * 512 if rank == 1 else 0) + fp32]
        tracked = json.loads((tmp_path / "run" / "ranks" / f"rank{rank}.measurement.json").read_text())
        # MemTracker's temporaries at the peak: these, and a few KiB of the loss's scalars
        assert abs(tracked["memory"]["tracker_peak"]["Temp"] - waiting[0]) <= 64 * 1024
    # the engine without the rule: the peaks 8.3 and 10.0 % low
    assert abs(compare(pred, measured).summary()["allocated"]) <= 0.005
