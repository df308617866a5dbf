"""engine.compare.measured: exact errors on hand-built dicts, a real 2-rank run end to end, the CLI's errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Config, default_config
from engine.compare.measured import compare
from engine.memory.lifetimes import PARTIAL_STATE_KINDS
from engine.names import MEMORY_CATEGORIES
from engine.predict import predict
from gui.text import comparison_table

ROOT = Path(__file__).resolve().parents[3]


def _row(rank, stage=0, **cats):
    row = {"rank": rank, "stage": stage, **dict.fromkeys(MEMORY_CATEGORIES, 0), **cats}
    row["total"] = sum(row[c] for c in MEMORY_CATEGORIES)
    return row


def _pred(rows, step_s=1.0, pipeline=None):
    return {"memory": {"per_rank": rows}, "pipeline": pipeline or {"pp": 1, "per_rank": []},
            "step": {"seconds": step_s}}


def _meas(rows, step_s=1.0, actions=None, ranks=None):
    return {"memory": {"per_rank": rows}, "step": {"seconds": step_s, "per_step": [step_s], "losses": []},
            "pipeline": {"per_rank": actions or []}, "ranks": ranks or []}


def test_memory_errors_are_exact_per_rank_and_category():
    pred = _pred([_row(0, params=100, activations=300, temporaries=10),
                  _row(1, params=100, activations=200)], step_s=2.0)
    meas = _meas([_row(0, params=100, activations=400, temporaries=0),
                  _row(1, params=100, activations=250)], step_s=2.5)
    cmp = compare(pred, meas)
    r0, r1 = cmp.memory
    assert r0.categories["params"].error == 0 and r0.categories["params"].relative == 0.0
    assert r0.categories["activations"].error == -100 and r0.categories["activations"].relative == -0.25
    assert r0.categories["temporaries"].relative is None  # measured 0, predicted 10: undefined, not hidden
    assert r0.categories["overhead"].relative == 0.0
    assert r0.peak.predicted == 410 and r0.peak.measured == 500 and r0.peak.relative == pytest.approx(-0.18)
    assert r1.categories["activations"].relative == pytest.approx(-0.2)
    assert cmp.step.relative == pytest.approx(-0.2)
    s = cmp.summary()
    assert s["activations"] == 0.25 and s["params"] == 0.0 and math.isinf(s["temporaries"])
    assert s["bubble_error"] is None and cmp.bubble is None
    json.dumps(cmp.to_json())  # serialisable
    text = comparison_table(cmp)
    assert "activations" in text and "-25.0 %" in text and "n/a" in text


def test_bytes_the_tracker_cannot_see_are_explained_not_hidden():
    row = _row(0, params=100, overhead=50)
    row["explain"] = {"overhead": [{"label": "runtime context (h100)", "bytes": 50, "formula": "0.5 GiB",
                                    "category": "overhead", "tracked": False, "stage": None,
                                    "in_flight": None, "kind": "runtime_context"}]}
    cmp = compare(_pred([row]), _meas([_row(0, params=100)]))
    cell = cmp.memory[0].categories["overhead"]
    assert cell.relative is None and cell.untracked == 50 and cell.relative_tracked == 0.0
    assert any("outside PyTorch's allocator" in n for n in cell.notes)
    assert cmp.memory[0].peak.relative == pytest.approx(0.5) and cmp.max_relative("peak") == 0.0
    assert cmp.max_relative("peak", tracked=False) == pytest.approx(0.5)


def test_pipeline_order_start_end_and_bubble():
    # two pipeline ranks, one microbatch: F0 F1 B1 B0
    pipeline = {"pp": 2, "makespan_s": 4.0, "bubble_fraction": 0.5, "per_rank": [
        {"pp_rank": 0, "rank": 0, "actions": [["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 3.0, 4.0]]},
        {"pp_rank": 1, "rank": 1, "actions": [["F", 1, 0, 1.0, 2.0], ["B", 1, 0, 2.0, 3.0]]}]}
    actions = [  # measured: everything 10 % slower, rank 1 runs B before F (a different order)
        {"rank": 0, "actions": [["F", 0, 0, 0.0, 1.1], ["B", 0, 0, 3.3, 4.4]]},
        {"rank": 1, "actions": [["B", 1, 0, 1.1, 2.2], ["F", 1, 0, 2.2, 3.3]]}]
    ranks = [{"rank": 0, "coords": {"pp": 0, "dp": 0, "tp": 0}}, {"rank": 1, "coords": {"pp": 1, "dp": 0, "tp": 0}}]
    cmp = compare(_pred([_row(0), _row(1, 1)], 4.0, pipeline), _meas([_row(0), _row(1, 1)], 4.4, actions, ranks))
    t0, t1 = cmp.timeline
    assert t0.order_identical and t0.first_difference is None and t0.matched == 2
    assert t0.start_error_s.tolist() == pytest.approx([0.0, -0.3])
    assert t0.end_error_s.tolist() == pytest.approx([-0.1, -0.4])
    assert not t1.order_identical and t1.first_difference == 0 and t1.pp_rank == 1
    assert cmp.orders_identical is False and any("differs" in n for n in cmp.notes)
    assert cmp.makespan.measured == pytest.approx(4.4)
    assert cmp.bubble.measured == pytest.approx(0.5) and cmp.bubble.error == pytest.approx(0.0)
    assert "order differs at action 0" in comparison_table(cmp)
    # per action kind, one action's mean duration over the matched actions of every rank: 1.0 s predicted, 1.1 measured
    kinds = cmp.action_kinds()
    assert list(kinds) == ["F", "B"]
    assert all(c.predicted == pytest.approx(1.0) and c.measured == pytest.approx(1.1) for c in kinds.values())
    assert kinds["B"].relative == pytest.approx(-1 / 11) and "over 2 matched actions" in kinds["B"].notes[0]
    assert t0.kind_durations["B"] == pytest.approx((1.0, 1.1, 1))
    assert cmp.to_json()["pipeline"]["action_kinds_s"]["F"]["measured"] == pytest.approx(1.1)
    assert "F 1000.00 ms predicted, 1100.00 ms measured (-9.1 %)" in comparison_table(cmp)


def test_a_prediction_object_is_accepted_and_compared_with_itself():
    pred = predict(default_config())
    j = pred.to_json()
    meas = _meas([{k: r[k] for k in ("rank", "stage", *MEMORY_CATEGORIES, "total")} for r in j["memory"]["per_rank"]],
                 j["step"]["seconds"])
    cmp = compare(pred, meas)
    assert all(c.error == 0 for r in cmp.memory for c in r.categories.values())
    assert cmp.step.error == 0


def shardscope(*args):
    return subprocess.run([sys.executable, "-m", "gui.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_compare_errors_are_clean(tmp_path):
    out = shardscope("compare", str(tmp_path / "nope"))
    assert out.returncode == 2 and "not found" in out.stderr and "Traceback" not in out.stderr
    run = tmp_path / "run"
    run.mkdir()
    default_config().save(run / "config.toml")
    out = shardscope("compare", str(run))
    assert out.returncode == 2 and "no measurement.json" in out.stderr and "Traceback" not in out.stderr
    out = shardscope("predict", str(ROOT / "assets/presets/default.toml"), "--calibration", str(run))
    assert out.returncode == 2 and "no measurement.json" in out.stderr and "Traceback" not in out.stderr
    (run / "measurement.json").write_text("{not json")
    out = shardscope("compare", str(run))
    assert out.returncode == 2 and "not a readable measurement" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.integration
def test_a_real_two_rank_pipeline_run_end_to_end(tmp_path):
    pytest.importorskip("torch")
    from backend.launch import launch

    raw = default_config().to_dict()
    raw["cluster"]["gpus"] = 2
    raw["parallel"].update({"dp": 1, "pp": 2, "microbatches": 4})
    cfg = Config.from_dict(raw)
    run = launch(cfg, tmp_path / "run", steps=3, timeout_s=120)
    assert run.wait(150)["event"] == "finished", run.result
    cmp = compare(predict(cfg), json.loads((tmp_path / "run" / "measurement.json").read_text()))
    assert len(cmp.memory) == 2
    for r in cmp.memory:  # model states are exact
        assert all(r.categories[c].error == 0 for c in ("params", "grads", "optimizer"))
    assert cmp.orders_identical is True and all(t.matched == 8 for t in cmp.timeline)
    assert cmp.bubble is not None and 0 <= cmp.bubble.measured < 1
    assert cmp.step.measured > 0
    # the run keeps what timed its prediction on this machine: the clock from ops on the cpu device profile
    recorded = json.loads((tmp_path / "run" / "device-profile.json").read_text())
    assert recorded["clock"] == "ops" and recorded["gpu"] == "cpu" and recorded["figures"]["launch_us"] > 0
    out = shardscope("compare", str(tmp_path / "run"))
    assert out.returncode == 0 and "peak" in out.stdout and "bubble" in out.stdout, out.stderr
    out = shardscope("predict", str(tmp_path / "run" / "config.toml"), "--calibration", str(tmp_path / "run"),
                     "--json")
    assert out.returncode == 0, out.stderr
    calibrated = json.loads(out.stdout)
    assert calibrated["calibration"]["measured_durations"] is not None
    # the run's own durations move the prediction and reproduce its step: closer than the analytic guess, or, where
    # that guess was close already (the clock from ops: 4.2 % on a CI run whose calibrated step read 6.8 %, a noisy
    # machine's step to step), within 15 %
    analytic_err = abs(cmp.step.relative)
    cal_err = abs(calibrated["step"]["seconds"] - cmp.step.measured) / cmp.step.measured
    assert calibrated["step"]["seconds"] != pytest.approx(cmp.step.predicted, rel=1e-9)
    assert cal_err < max(analytic_err, 0.15)


def _compiled_meas(saved):
    """A one-rank CPU measurement of a compiled run: MemTracker's eager step, with or without the
    backend's count of the compiled blocks' saved tensors."""
    from backend.parallel.compile import COMPILED_MEMORY_NOTE

    mem = {"tracker_peak": {"Activation": 1000, "Temp": 10, "Total": 1510}, "notes": [COMPILED_MEMORY_NOTE],
           "categories": {**dict.fromkeys(MEMORY_CATEGORIES, 0), "params": 500, "activations": 1000, "temporaries": 10}}
    if saved is not None:
        mem["saved_for_backward"] = saved
    return _meas([_row(0, params=500, activations=1000, temporaries=10)], ranks=[{"rank": 0, "memory": mem}])


def test_compiled_activations_take_the_compiled_blocks_saved_tensors():
    pred = _pred([{**_row(0, params=500, activations=800, temporaries=10), "allocated": 1310}])
    cmp = compare(pred, _compiled_meas({"eager": 900, "compiled": 700}))
    act = cmp.memory[0].categories["activations"]
    # the eager step's 1000 B with the blocks' 900 B saved eagerly replaced by the 700 B they save compiled
    assert act.measured == 800 and act.relative == 0.0
    assert any("saved_tensors_hooks" in n and "700 B compiled" in n for n in act.notes)
    assert cmp.memory[0].allocated.measured == 1310  # the tracker's total moves by the same 200 B
    assert cmp.memory[0].peak.measured == 1310


def test_compiled_activations_without_a_count_say_they_are_the_eager_blocks():
    pred = _pred([_row(0, params=500, activations=800, temporaries=10)])
    act = compare(pred, _compiled_meas(None)).memory[0].categories["activations"]
    assert act.measured == 1000  # what the tracker saw, not a number it did not measure
    assert any("eager blocks'" in n and "saved_for_backward" in n for n in act.notes)


def _plain_run(grads_seen: int):
    """A one-rank (dp 1, no FSDP2) prediction and a CPU record of it whose tracker peak saw ``grads_seen``
    bytes of gradients; the record's categories carry the exact sizes, as ``backend.measure`` writes them."""
    cfg = default_config().replace(cluster={"gpus": 1}, parallel={"dp": 1, "pp": 1, "microbatches": 1})
    pred = predict(cfg)
    r = pred.memory.per_rank[0]
    exact = {c: sum(t.bytes for t in r.catalogue(c) if t.kind not in PARTIAL_STATE_KINDS)
             for c in ("params", "grads", "optimizer")}
    cats = {c: getattr(r, c) for c in MEMORY_CATEGORIES} | exact
    raw = {"Parameter": exact["params"], "Gradient": grads_seen, "Optstate": exact["optimizer"],
           "Activation": r.activations, "Temp": r.temporaries, "Buffer": 0, "Other": 0}
    raw["Total"] = sum(raw.values())
    mem = {"categories": cats, "exact": exact, "tracker_peak": raw}
    return cfg, pred, _meas([_row(0, **cats)], ranks=[{"rank": 0, "memory": mem}]), exact


def test_plain_gradients_are_measured_as_the_tracker_saw_them_at_its_peak():
    """Plain .grad exists from the first backward on (zero_grad(set_to_none=True), then AccumulateGrad):
    a peak before it holds none. The record's categories carry the exact sizes; compare takes what
    MemTracker tagged Gradient at its peak instead (at most the exact size), so a run that peaks at its
    loss, with no gradient yet, agrees with the prediction that peaks there too — and its states are
    still exact in size."""
    from engine.compare.measured import states_exact

    cfg, pred, meas, exact = _plain_run(grads_seen=0)
    r = pred.memory.per_rank[0]
    assert "loss" in r.peak_moment and r.grads == 0 < exact["grads"]  # the engine's peak: no gradient
    cell = compare(pred, meas).memory[0].categories["grads"]
    assert cell.measured == 0 and cell.error == 0
    assert any("MemTracker tagged Gradient" in n for n in cell.notes)
    assert states_exact(pred, meas)
    # a tracker that saw every gradient at its peak: the exact size, no note; a size off by one is not exact
    _, _, meas_all, _ = _plain_run(grads_seen=exact["grads"] + 4)
    cell = compare(pred, meas_all).memory[0].categories["grads"]
    assert cell.measured == exact["grads"] and not any("MemTracker tagged" in n for n in cell.notes)
    meas_all["ranks"][0]["memory"]["exact"]["grads"] -= 4
    assert not states_exact(pred, meas_all)
