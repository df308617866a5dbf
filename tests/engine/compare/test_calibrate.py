"""engine.compare.calibrate: what a run measures comes back out, and a calibration predicts other layouts better."""

import pytest

from engine import Config, default_config
from engine.compare.calibrate import CalibrationError, calibrate, load_calibration
from engine.names import MEMORY_CATEGORIES
from engine.predict import predict

TRUE_EFFICIENCY = 0.08  # "the machine": much slower than the config's analytic 0.5
# a run calibrates the efficiency clock's one scalar (engine.compare.calibrate): these layouts are timed by it


def _cfg(gpus=4, **par) -> Config:
    raw = default_config().to_dict()
    raw["cluster"]["gpus"] = gpus
    raw["cluster"]["cpu_cores"] = 0  # "the machine" gives every rank its own core (calibrate(cores=64))
    p = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "schedule": "1F1B", "virtual_stages": 1, "microbatches": 4}
    p.update(par)
    raw["parallel"] = p
    raw["conventions"] = {**raw.get("conventions", {}), "clock": "efficiency"}
    return Config.from_dict(raw)


def _machine(cfg: Config) -> Config:
    return cfg.replace(conventions={"compute_efficiency": TRUE_EFFICIENCY})


def _measurement_of(cfg: Config) -> dict:
    """What a run of ``cfg`` on "the machine" would record: the engine at the true efficiency."""
    pred = predict(_machine(cfg))
    j = pred.to_json()
    par = cfg.parallel
    ranks, actions = [], []
    for r in range(par.world_size):
        pp, rest = divmod(r, par.dp * par.tp)
        dp, tp = divmod(rest, par.tp)
        ranks.append({"rank": r, "coords": {"pp": pp, "dp": dp, "tp": tp}})
        if par.pp > 1:
            actions.append({"rank": r, "actions": j["pipeline"]["per_rank"][pp]["actions"]})
    rows = [{k: row[k] for k in ("rank", "stage", *MEMORY_CATEGORIES, "total")} for row in j["memory"]["per_rank"]]
    s = pred.step.seconds
    return {"memory": {"per_rank": rows}, "step": {"seconds": s, "per_step": [s, s]},
            "pipeline": {"per_rank": actions}, "ranks": ranks}


def test_pipeline_durations_and_efficiency_come_back_out():
    cfg = _cfg(dp=1, pp=4, schedule="1F1B")
    cal = calibrate(cfg, _measurement_of(cfg), cores=64)
    truth = predict(_machine(cfg)).pipeline.durations
    assert cal.measured.forward_s == pytest.approx(truth.forward_s)
    assert cal.measured.backward_s == pytest.approx(truth.backward_s)
    assert cal.compute_efficiency == pytest.approx(TRUE_EFFICIENCY)
    assert cal.forward_efficiency == pytest.approx(TRUE_EFFICIENCY)
    # the same layout predicted with its own measurement reproduces the step
    assert cal.predict(cfg).step.seconds == pytest.approx(predict(_machine(cfg)).step.seconds, rel=0.02)


def test_calibration_beats_the_analytic_guess_on_other_layouts():
    source = _cfg(dp=2, pp=2, schedule="1F1B")
    cal = calibrate(source, _measurement_of(source), cores=64)
    for target in (_cfg(dp=1, pp=4, schedule="GPipe"), _cfg(dp=4, microbatches=2),
                   _cfg(dp=1, pp=4, schedule="Interleaved1F1B", virtual_stages=2)):
        truth = predict(_machine(target)).step.seconds
        analytic = abs(predict(target).step.seconds - truth) / truth
        calibrated = abs(cal.predict(target).step.seconds - truth) / truth
        assert calibrated < 0.05 < analytic, (target.parallel, analytic, calibrated)


def _ops_machine(cfg: Config, speed: float = 0.4):
    """ "The machine" under the clock from ops: every op's duration over ``speed`` (its profile too fast)."""
    from engine.compare.calibrate import clock_durations
    from engine.time.durations import StageDurations

    c = cfg.replace(conventions={"clock": "ops"})
    d = clock_durations(c)
    slow = StageDurations.of(d.num_stages, d.forward_s / speed, d.backward_s / speed, d.backward_input_s / speed,
                             d.backward_weight_s / speed, d.p2p_s)
    return c, predict(c, slow)


def test_under_the_clock_from_ops_a_run_corrects_the_ops_durations_of_other_layouts():
    """The run's per-stage durations over the op lists' (on the device profile) are its speeds; another
    layout's ops are timed over them, so its shapes (a GEMM of another size, another stage's blocks) carry
    over where one FLOP efficiency cannot."""
    # "the machine" lays DDP's all-reduce after its last action, where the backend's runs inside the last backward
    # (calibrate reads the step's tail as the optimizer's): a link latency after a barrier keeps that tail small
    def lat(c: Config) -> Config:
        return c.replace(cluster={"intra_node_latency_us": 150.0, "cpu_wake_latency_us": 0.0})
    source, machine = _ops_machine(lat(_cfg(dp=2, pp=2, schedule="1F1B")))
    meas = _measurement_of(source)
    j = machine.to_json()
    meas["pipeline"]["per_rank"] = [{"rank": r["rank"], "actions": j["pipeline"]["per_rank"][r["rank"] // 2]["actions"]}
                                    for r in meas["pipeline"]["per_rank"]]
    meas["step"] = {"seconds": machine.step.seconds, "per_step": [machine.step.seconds] * 2}
    cal = calibrate(source, meas, cores=64)
    assert cal.config.conventions.clock == "ops" and cal.to_json()["clock"] == "ops"
    assert cal.forward_efficiency == pytest.approx(0.4, rel=1e-6) and cal.backward_efficiency == pytest.approx(0.4, rel=1e-6)
    for target in (lat(_cfg(dp=1, pp=4, schedule="GPipe")), lat(_cfg(dp=1, pp=4, schedule="Interleaved1F1B",
                                                                     virtual_stages=2))):
        t_ops, truth = _ops_machine(target)
        assert cal.predict(target).step.seconds == pytest.approx(truth.step.seconds, rel=0.02), target.parallel
        assert abs(predict(t_ops).step.seconds - truth.step.seconds) > 0.2 * truth.step.seconds  # uncalibrated: far


def test_without_pipeline_actions_one_efficiency_is_fitted_to_the_step():
    cfg = _cfg(dp=4, microbatches=2)
    meas = _measurement_of(cfg)
    cal = calibrate(cfg, meas, cores=64)
    assert cal.measured is None
    assert cal.predict(cfg).step.seconds == pytest.approx(meas["step"]["seconds"], rel=1e-3)
    other = _cfg(dp=2, pp=2)
    truth = predict(_machine(other)).step.seconds
    assert abs(cal.predict(other).step.seconds - truth) < abs(predict(other).step.seconds - truth)


def test_ranks_sharing_cores_are_scaled_by_the_ranks_that_work_at_once():
    source = _cfg(dp=2, pp=2)
    meas = _measurement_of(source)
    cal = calibrate(source, meas, cores=2)  # 4 ranks on 2 cores, idle part of the time in bubbles
    acts = [a for r in meas["pipeline"]["per_rank"] for a in r["actions"]]
    span = max(a[4] for a in acts) - min(a[3] for a in acts)
    u = sum(a[4] - a[3] for a in acts) / (4 * span)
    assert cal.busy_fraction == pytest.approx(u) and 0.5 < u < 1
    src_share = min(1.0, 2 / (4 * u))  # about 4u ranks compete for the 2 cores
    two = _cfg(gpus=2, dp=1, pp=2)
    assert cal.speed_factor(two) == pytest.approx(1.0 / src_share)
    assert cal.speed_factor(source, cal.busy_fraction) == pytest.approx(1.0)
    assert cal.durations_for(two).forward_s == pytest.approx(cal.measured.forward_s * src_share)
    # all four ranks busy at once (dp4): slower than the source's per-action rate, by its busy fraction
    dp4 = _cfg(dp=4, microbatches=2)
    assert cal.speed_factor(dp4) == pytest.approx(0.5 / src_share) and 0.5 / src_share < 1
    # without a busy fraction (pp = 1 source) the rule is cores / world
    plain = calibrate(_cfg(dp=4, microbatches=2), _measurement_of(_cfg(dp=4, microbatches=2)), cores=2)
    assert plain.busy_fraction is None and plain.speed_factor(two) == pytest.approx(2.0)


def test_target_busy_fraction_is_a_fixed_point_of_the_prediction():
    from engine.compare.calibrate import timeline_busy_fraction
    from engine.time.step import step_time

    source = _cfg(dp=2, pp=2)
    cal = calibrate(source, _measurement_of(source), cores=2)
    target = _cfg(dp=1, pp=4, schedule="GPipe")
    pred = cal.predict(target)
    u = timeline_busy_fraction(pred.step.timeline)
    assert 0 < u < 1  # GPipe's bubble: ranks idle part of the step
    # the durations used are the ones at the predicted busy fraction
    at_u = step_time(cal.config_for(target, u), cal.durations_for(target, u))
    assert pred.step.seconds == pytest.approx(at_u.seconds, rel=1e-2)


def test_unusable_runs_are_refused(tmp_path):
    cfg = _cfg(dp=2, pp=2)
    meas = _measurement_of(cfg)
    meas["step"]["seconds"] = 0.0
    with pytest.raises(CalibrationError, match="no timed step"):
        calibrate(cfg, meas)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_calibration(tmp_path / "nope")
    (tmp_path / "run").mkdir()
    cfg.save(tmp_path / "run" / "config.toml")
    with pytest.raises(FileNotFoundError, match="measurement.json"):
        load_calibration(tmp_path / "run")


def _dataparallel(n=4, microbatches=2) -> Config:
    return _cfg(gpus=n, dp=n, microbatches=microbatches).replace(parallel={"dp_mode": "dataparallel"})


def test_a_calibrated_dataparallel_config_is_predicted_by_the_legacy_model():
    """Calibrations go through predict(): nn.DataParallel keeps GPU 0's extra load and its step model."""
    from engine import legacy_dp
    from engine.time.step import step_time

    cfg = _dataparallel()
    meas = _measurement_of(cfg)  # "the machine" runs the legacy model too
    cal = calibrate(cfg, meas, cores=64)
    pred = cal.predict(cfg)
    # the step fitted with the legacy model reproduces the measured one
    assert pred.step.seconds == pytest.approx(meas["step"]["seconds"], rel=1e-3)
    assert {"python_gil_exposed", "loss_on_gpu0"} <= set(pred.step.breakdown)
    c = cal.config_for(cfg)
    legacy_step = legacy_dp.step(c, cal.durations_for(cfg))
    assert (pred.step.seconds, pred.step.breakdown) == (legacy_step.seconds, legacy_step.breakdown)
    assert pred.step.seconds != pytest.approx(step_time(c, cal.durations_for(cfg)).seconds, rel=1e-3)  # not DDP's
    # memory: GPU 0 holds the optimizer state and the whole batch's loss; the others do not
    legacy_mem = legacy_dp.memory(c)
    assert [r.total for r in pred.memory.per_rank] == [r.total for r in legacy_mem.per_rank]
    assert pred.memory.per_rank[0].optimizer > 0 == pred.memory.per_rank[1].optimizer
    assert pred.memory.per_rank[0].total > pred.memory.per_rank[1].total
    # calibrated from a DDP run of the same job, the DataParallel target is still the legacy model
    ddp = _cfg(gpus=4, dp=4, microbatches=2)
    from_ddp = calibrate(ddp, _measurement_of(ddp), cores=64).predict(cfg)
    assert "loss_on_gpu0" in from_ddp.step.breakdown
    assert from_ddp.memory.per_rank[0].total > from_ddp.memory.per_rank[1].total


def test_legacy_dataparallel_step_takes_measured_durations_and_links():
    from engine.compare.calibrate import LinkCalibration
    from engine.legacy_dp import single_gpu_config, step, transfers
    from engine.time.comm import LinkFit, MeasuredLinks
    from engine.time.durations import StageDurations, stage_durations

    cfg = _dataparallel()
    d = stage_durations(single_gpu_config(cfg))
    slow = StageDurations.of(1, d.forward_s * 3, d.backward_s * 3, d.backward_input_s * 3, d.backward_weight_s * 3,
                             d.p2p_s, source="measured")
    assert step(cfg, slow).breakdown["compute"] == pytest.approx(3 * step(cfg).breakdown["compute"])
    assert predict(cfg, slow).step.breakdown == step(cfg, slow).breakdown
    # measured point-to-point links time the traffic through GPU 0
    fit = LinkFit("p2p", 2, 1e-3, 1e8)
    links = MeasuredLinks((fit,))
    moved = transfers(cfg, links)
    assert [t.bytes_through_gpu0 for t in moved] == [t.bytes_through_gpu0 for t in transfers(cfg)]
    broadcast = moved[1]
    assert broadcast.seconds == pytest.approx(3 * fit.latency_s + broadcast.bytes_through_gpu0 / fit.bytes_per_s)
    with_links = predict(cfg, None, links).step
    m = cfg.parallel.microbatches
    assert with_links.breakdown["dp_comm_exposed"] == pytest.approx(m * sum(t.seconds for t in moved))
    assert with_links.breakdown["dp_comm_exposed"] > predict(cfg).step.breakdown["dp_comm_exposed"]
    # a link calibration alone predicts the legacy model as well
    lc = LinkCalibration("given", 4, None, "nccl", (fit,), {"fp32": 1e12})
    assert "loss_on_gpu0" in lc.predict(cfg).step.breakdown
