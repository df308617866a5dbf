"""A pinned baseline prediction and its differences from the current one (gui.session, no Qt)."""

from __future__ import annotations

import json

import pytest

from engine import Config, default_config
from engine.names import MEMORY_CATEGORIES
from engine.predict import predict as engine_predict
from gui.predicted import Change, Predicted, compare_predictions, describe_config, predict
from gui.runs import RunRecord
from gui.session import Session


def _ddp(dp: int = 4) -> Config:
    """The default tiny model on ``dp`` CPU ranks, plain data parallel (no pipeline)."""
    raw = default_config().to_dict()
    raw["cluster"]["gpus"] = dp
    raw["cluster"]["gpus_per_node"] = dp
    raw["parallel"].update(dp=dp, tp=1, pp=1, zero=0, schedule="1F1B", virtual_stages=1, microbatches=1)
    return Config.from_dict(raw)


@pytest.fixture
def session(tmp_path):
    return Session(_ddp(), runs_dir=tmp_path / "runs")


class Heard:
    def __init__(self, session: Session):
        self.baselines: list = []
        session.subscribe("baseline", self.baselines.append)


def test_change_delta_and_relative():
    c = Change("step_seconds", 0.5, 0.4, "s")
    assert c.delta == pytest.approx(-0.1) and c.relative == pytest.approx(-0.2)
    assert Change("x", None, 1.0, "s").delta is None and Change("x", None, 1.0, "s").relative is None
    assert Change("x", 0.0, 1.0, "s").relative is None and Change("x", 0.0, 1.0, "s").delta == 1.0


def test_ddp_against_zero3_of_the_same_model_is_exact_where_the_sharding_is():
    dp = 4
    ddp, zero3 = predict(_ddp(dp)), predict(_ddp(dp).replace(parallel={"zero": 3}))
    diff = compare_predictions(ddp, zero3)
    # ZeRO-3 keeps 1/dp of the parameters, gradients and optimizer state on every rank
    for c in ("params", "optimizer"):
        base = getattr(ddp.prediction.memory.peak, c)
        assert diff.peak[c].baseline == base and diff.peak[c].current * dp == base
        assert diff.peak[c].relative == 1 / dp - 1  # exact: whole bytes divided by dp
    # the gradients too, but they are not alive at ZeRO-3's peak (m = 1: the first backward's own moment,
    # before any unit's post-backward). FSDP2 makes a sharded gradient only in its post-backward (torch
    # 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: "new_sharded_grad =
    # torch.as_strided(reduce_output, ...)" ... "fsdp_param.sharded_param.grad = new_sharded_dtensor_grad"),
    # and zero_grad(set_to_none=True) drops it after the step, so
    # before the first backward's post-backward hooks there is none
    # DDP's own .grad likewise exists only from the first backward on (zero_grad(set_to_none=True), then
    # AccumulateGrad makes each): its peak at the first backward's loss holds none either
    # (ZeRO-3's B peaks at its start: a block's saved tensors, fp32 here, outweigh the sharded gradients and the
    # reduce-scatter input its post-backward adds)
    base = sum(t.bytes for t in ddp.prediction.memory.peak.catalogue("grads") if t.kind == "gradients")
    assert diff.peak["grads"].baseline == ddp.prediction.memory.peak.grads == 0 and diff.peak["grads"].current == 0
    sharded = [t for t in zero3.prediction.memory.peak.catalogue("grads") if t.kind == "fsdp_sharded_grads"]
    assert sum(t.bytes for t in sharded) * dp == base
    # sharding the states leaves the activations alone: the same terms on both sides (the snapshot at each
    # side's own peak moment may differ: DDP's peaks in the first block's MLP backward, which frees the down input)
    # (ZeRO-3's late-backward moment adds the first block's saved tensors, still alive there; its loss moment, where
    # the root is gathered again, has freed the log-probabilities: fsdp_root_regather)
    acts = [sorted((t.kind, t.bytes) for t in side.prediction.memory.peak.catalogue("activations")
                   if t.kind not in ("late_block_activations", "plain_late_activations", "fsdp_root_regather"))
            for side in (ddp, zero3)]
    assert acts[0] == acts[1]
    # the totals are the sums of the categories, on both sides
    for side in ("baseline", "current"):
        assert getattr(diff.peak["total"], side) == sum(getattr(diff.peak[c], side) for c in MEMORY_CATEGORIES)
    assert diff.peak["total"].delta == zero3.prediction.memory.peak.total - ddp.prediction.memory.peak.total < 0
    assert diff.baseline_peak_rank == ddp.prediction.memory.peak.rank and diff.current_peak_rank == zero3.prediction.memory.peak.rank
    # per rank: the same four ranks on both sides, each with the same optimizer ratio
    assert sorted(diff.per_rank) == list(range(dp))
    for rank, changes in diff.per_rank.items():
        assert changes["optimizer"].current * dp == changes["optimizer"].baseline
        assert changes["total"].baseline == ddp.prediction.memory.per_rank[rank].total
    # time: the step and its communication, straight from the engine's StepTime
    m = diff.metrics
    assert m["step_seconds"].baseline == ddp.prediction.step.seconds and m["step_seconds"].current == zero3.prediction.step.seconds
    assert m["tokens_per_s"].current == pytest.approx(zero3.config.tokens_per_step / zero3.prediction.step.seconds)
    assert m["mfu"].unit == "fraction" and m["mfu"].baseline == ddp.prediction.step.mfu
    assert m["bubble_fraction"].baseline == ddp.prediction.pipeline.bubble_fraction
    assert m["makespan_s"].current == zero3.prediction.pipeline.makespan_s
    crit_b = ddp.prediction.step.comm.per_pp_rank[0]
    crit_c = zero3.prediction.step.comm.per_pp_rank[0]
    assert m["comm.dp.bytes_sent"].baseline == crit_b.bytes_sent("dp")
    assert m["comm.dp.bytes_sent"].current == crit_c.bytes_sent("dp")
    assert m["comm.dp.bytes_sent"].relative > 0  # ZeRO-3 all-gathers the parameters on top: more traffic
    assert m["comm.dp.seconds"].unit == "s" and m["comm.dp.bytes_sent"].unit == "bytes"
    assert sum(v.current for k, v in m.items() if k.startswith("breakdown.")) == pytest.approx(zero3.prediction.step.seconds)


def test_ranks_only_one_side_has_are_compared_with_nothing():
    small, large = predict(_ddp(2)), predict(_ddp(4))
    diff = compare_predictions(small, large)
    assert sorted(diff.per_rank) == [0, 1, 2, 3]
    assert diff.per_rank[3]["total"].baseline is None and diff.per_rank[3]["total"].delta is None
    assert diff.per_rank[0]["total"].baseline == small.prediction.memory.per_rank[0].total


def test_what_the_engine_could_not_predict_is_none_not_zero():
    good = predict(_ddp())
    broken = Predicted(config=good.config, error="engine.predict could not predict this config: ...")
    diff = compare_predictions(good, broken)
    assert diff.metrics["step_seconds"].current is None and diff.metrics["step_seconds"].delta is None
    assert diff.peak["total"].current is None and diff.peak["total"].delta is None
    assert diff.peak["total"].baseline == good.prediction.memory.peak.total
    assert diff.per_rank[0]["total"].current is None


def test_pin_keeps_the_prediction_through_edits_and_the_difference_follows(session):
    heard = Heard(session)
    assert session.baseline is None and session.difference is None
    pinned = session.pin_baseline()  # nothing predicted yet: predicts the valid config first
    assert pinned is session.prediction and session.baseline is pinned and heard.baselines == [pinned]
    assert session.difference.peak["total"].delta == 0 and session.difference.metrics["step_seconds"].delta == 0
    count = session.recompute_count
    assert session.edit("parallel.zero", 3)
    session.recompute()
    assert session.baseline is pinned and session.baseline.config.parallel.zero == 0  # survives the edit
    assert session.recompute_count == count + 1  # the baseline is not predicted again per edit
    diff = session.difference
    assert diff.baseline is pinned and diff.current is session.prediction
    assert diff.peak["optimizer"].relative == 1 / 4 - 1
    assert session.difference is diff  # computed once per pair
    session.edit("parallel.zero", 0)
    session.recompute()
    assert session.difference is not diff and session.difference.peak["total"].delta == 0
    # opening another config keeps it too: comparing across configs is what it is for
    session.set_config(_ddp(2))
    session.recompute()
    assert session.baseline is pinned and session.difference.current.config.parallel.dp == 2
    session.clear_baseline()
    assert session.baseline is None and session.difference is None and heard.baselines == [pinned, None]
    session.clear_baseline()  # nothing to clear: no notification
    assert heard.baselines == [pinned, None]


def test_pinning_a_stale_prediction_pins_the_valid_config_instead(session):
    session.recompute()
    session.edit("parallel.zero", 2)
    assert session.stale
    pinned = session.pin_baseline()
    assert pinned.config.parallel.zero == 2 and not session.stale


def test_a_calibration_retimes_the_baseline_once(session, tmp_path):
    """The baseline's config is predicted again with the calibration (and again without it when it
    is cleared), so the difference never compares a calibrated time with an analytic one."""
    pinned = session.pin_baseline()
    session.edit("parallel.zero", 1)
    session.recompute()
    run_dir = tmp_path / "runs" / "calibration-run"
    run_dir.mkdir(parents=True)
    cfg = session.config
    cfg.save(run_dir / "config.toml")
    slow = engine_predict(cfg.replace(conventions={"clock": "efficiency", "compute_efficiency": 0.05}))  # "the machine"
    j = slow.to_json()
    rows = [{k: row[k] for k in ("rank", "stage", *MEMORY_CATEGORIES, "total")} for row in j["memory"]["per_rank"]]
    s = slow.step.seconds
    ranks = [{"rank": r, "coords": {"pp": 0, "dp": r, "tp": 0}} for r in range(cfg.parallel.world_size)]
    (run_dir / "measurement.json").write_text(json.dumps(
        {"memory": {"per_rank": rows}, "step": {"seconds": s, "per_step": [s, s]}, "pipeline": {"per_rank": []},
         "ranks": ranks}))
    heard = Heard(session)
    session.set_calibration(RunRecord(config=cfg, out_dir=run_dir))
    base = session.baseline
    assert base is not pinned and base.config == pinned.config
    assert base.calibrated_from == str(run_dir) and session.prediction.calibrated_from == str(run_dir)
    assert base.prediction.step.seconds > 2 * pinned.prediction.step.seconds  # timed like the current one now
    assert [r.total for r in base.prediction.memory.per_rank] == [r.total for r in pinned.prediction.memory.per_rank]
    assert heard.baselines == [base]
    assert session.difference.baseline is base
    session.set_calibration(None)
    assert session.baseline.calibrated_from is None
    assert session.baseline.prediction.step.seconds == pytest.approx(pinned.prediction.step.seconds)


def test_describe_config_names_model_gpus_and_layout():
    text = describe_config(_ddp(4).replace(parallel={"zero": 3}))
    assert text.startswith("tiny · 4× cpu · dp4 tp1 pp1 ZeRO-3")
    assert "fp32" in text


def test_baseline_is_a_notification_of_the_session(session):
    with pytest.raises(ValueError, match="baseline"):
        session.subscribe("no-such-notification", print)
