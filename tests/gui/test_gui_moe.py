"""Mixtures of experts in the window: the experts / top-k / ep controls, the size slider over a MoE
family, the routed experts' band inside each bar's params, and the expert load of a run."""

from __future__ import annotations

import json

import pytest

from engine import Config, ConfigError
from engine.model.params import param_counts
from gui.load_balance import ExpertLoad, expert_load
from gui.widgets.moe_controls import allowed_ep


def moe_config(**parallel) -> Config:
    return Config.from_dict({"model": {"preset": "qwen3-30b-a3b", "seq_len": 4096},
                             "cluster": {"gpu": "h100-sxm", "gpus": 8}, "parallel": {"dp": 8, **parallel}})


# --------------------------------------------------------------------------- without a window


@pytest.mark.parametrize("parallel", [{"dp": 8}, {"dp": 4, "tp": 2}, {"dp": 8, "replicate": 2, "zero": 3},
                                      {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4}])
def test_the_offered_ep_degrees_are_exactly_the_ones_the_validation_accepts(parallel):
    base = moe_config(**parallel)
    par = base.to_dict()["parallel"]
    offered = allowed_ep(base.model.experts, par)
    for ep in range(1, 17):
        try:
            Config.from_dict({**base.to_dict(), "parallel": {**par, "ep": ep}})
            valid = True
        except ConfigError as exc:
            assert "parallel.ep" in str(exc)  # a refused ep is named
            valid = False
        assert valid == (ep in offered), (parallel, ep)
    assert allowed_ep(0, par) == [1]


def test_the_size_slider_survives_an_ep_the_experts_refuse():
    from engine.model.presets import model_presets
    from gui.family import family_for

    preset = model_presets()["qwen3-30b-a3b"]
    members, index = family_for({"preset": "qwen3-30b-a3b", **preset}, preset, ep=3)
    assert members[index].params == param_counts(moe_config().model).total
    members, _ = family_for({"preset": "qwen3-30b-a3b", **preset}, preset, ep=16)
    assert all(m.spec.experts % 16 == 0 for m in members)


def _rank(steps, measured=None) -> dict:
    rank = {"rank": 0, "expert_tokens": steps}
    if measured is not None:
        rank["memory"] = {"categories": {}, "expert_tokens": measured}
    return rank


def test_the_expert_load_is_the_last_step_recorded():
    steps = [{"k": 1, "blocks": {}, "total": {"0": [4, 4, 4, 4], "1": [4, 4, 4, 4]}},
             {"k": 2, "blocks": {}, "total": {"0": [8, 4, 2, 2], "1": [4, 4, 4, 4]}}]
    load = expert_load({"ranks": [_rank(steps)]})
    assert load.step == 2 and load.blocks == {0: (8, 4, 2, 2), 1: (4, 4, 4, 4)}
    assert load.imbalance(0) == 2.0 and load.imbalance(1) == 1.0 and load.imbalance() == 2.0
    assert load.worst_block() == 0 and load.summed() == (12, 8, 6, 6) and load.experts == 4
    measured = {"k": 3, "blocks": {}, "total": {"0": [1, 1, 1, 1], "1": [6, 2, 0, 0]}}
    load = expert_load({"ranks": [_rank(steps, measured)]})  # the measured step runs after the timed ones
    assert load.step == 3 and load.imbalance() == 3.0 and load.worst_block() == 1
    assert expert_load({"ranks": [{"rank": 0}]}) is None and expert_load(None) is None
    assert ExpertLoad(1, {0: (0, 0)}).imbalance() is None


# --------------------------------------------------------------------------- the window



@pytest.fixture
def moe_window(window, qtbot):
    window.state.set_config(moe_config())
    window.state.recompute_now()
    qtbot.waitUntil(lambda: window.controls.moe.experts.value() == 128, timeout=2000)
    return window


@pytest.mark.gui
def test_a_dense_model_greys_out_top_k_and_ep(window, qtbot):
    moe = window.controls.moe
    assert window.state.config.model.experts == 0
    assert moe.experts.text() == "0 (dense)" and not moe.top_k.isEnabled() and not moe.ep.isEnabled()
    assert [moe.ep.itemData(i) for i in range(moe.ep.count())] == [1]
    assert window.memory.expert_bytes == [0] * len(window.memory.groups)
    assert window.memory.expert_band.band_count() == 0 and "routed experts" not in window.memory.legend.text()


@pytest.mark.gui
def test_picking_a_moe_preset_and_moving_ep_drops_the_expert_params_per_rank(window, qtbot):
    s = window.state
    s.edit("cluster.gpus", 8)
    s.edit("parallel.pp", 1)
    qtbot.waitUntil(lambda: s.config.parallel.dp == 8, timeout=2000)
    window.controls.preset.setCurrentText("qwen3-30b-a3b")
    qtbot.waitUntil(lambda: s.config.model.preset == "qwen3-30b-a3b", timeout=2000)
    s.recompute_now()
    moe = window.controls.moe
    assert moe.experts.value() == 128 and moe.top_k.value() == 8 and moe.top_k.isEnabled() and moe.ep.isEnabled()
    assert [moe.ep.itemData(i) for i in range(moe.ep.count())] == [1, 2, 4, 8]
    chart = window.memory
    before = chart.expert_bytes[0]
    params_before = chart.groups[0].values["params"]
    assert before > 0.5 * params_before  # most of a 30B-A3B's weights are its routed experts
    moe.ep.setCurrentIndex(moe.ep.findData(4))
    qtbot.waitUntil(lambda: s.config.parallel.ep == 4, timeout=2000)
    s.recompute_now()
    assert chart.expert_bytes[0] == pytest.approx(before / 4, rel=1e-6)
    assert chart.groups[0].values["params"] == params_before - (before - chart.expert_bytes[0])
    assert "32 experts per rank" in moe.hint.text()
    # switching back to a dense preset puts ep back to 1 (nothing to split)
    window.controls.preset.setCurrentText("llama3-8b")
    qtbot.waitUntil(lambda: s.config.model.preset == "llama3-8b", timeout=2000)
    assert s.config.parallel.ep == 1 and not moe.ep.isEnabled()


@pytest.mark.gui
def test_a_refused_top_k_is_shown_under_its_control(moe_window, qtbot):
    moe = moe_window.controls.moe
    moe.top_k.setValue(200)
    qtbot.waitUntil(lambda: moe_window.controls.errors["model.experts_per_token"].isVisible(), timeout=2000)
    assert "model.experts_per_token" in moe_window.controls.problem_text("model.experts_per_token")
    moe.top_k.setValue(8)
    qtbot.waitUntil(lambda: not moe_window.controls.errors["model.experts_per_token"].isVisible(), timeout=2000)


@pytest.mark.gui
def test_the_expert_band_is_drawn_named_and_explained(moe_window, qtbot):
    from PySide6.QtGui import QColor

    from gui.widgets.expert_band import EXPERT_FILL

    chart = moe_window.memory
    assert chart.expert_band.band_count() == len(chart.groups) > 0
    assert "routed experts (their part of params)" in chart.legend.text()
    image = chart.plot.grab().toImage()
    fill = QColor(EXPERT_FILL).rgb()
    hits = sum(1 for x in range(0, image.width(), 2) for y in range(0, image.height(), 2)
               if image.pixel(x, y) == fill)
    assert hits > 50, hits
    text = chart.explain_at(0.0, chart.expert_bytes[0] / chart.unit / 2)
    assert text.startswith("ranks 0-7 · params · routed experts:") and "all 128 experts" in text
    above = chart.explain_at(0.0, chart.expert_bytes[0] / chart.unit * 1.01)  # the rest of params
    assert above.startswith("ranks 0-7 · params:") and "· params · routed experts" not in above


@pytest.mark.gui
def test_the_size_slider_walks_the_moe_family_with_exact_counts(moe_window, qtbot):
    from gui.family import format_params
    from tests.gui.test_gui_window import drag_slider

    w = moe_window
    before = w.state.config.model
    assert w.controls.size.label.text() == format_params(param_counts(before).total) == "30.5B"
    assert "128 experts (top-8)" in w.controls.size_label.text() and "active" in w.controls.size_label.text()
    drag_slider(w.controls.size.slider, 3)
    qtbot.waitUntil(lambda: w.state.config.model != before, timeout=2000)
    now = w.state.config.model
    exact = param_counts(now).total
    assert exact > param_counts(before).total and w.controls.size.label.text() == format_params(exact)
    assert now.experts > before.experts and now.hidden == before.hidden and now.expert_ffn_hidden == 768
    assert now.experts % w.state.config.parallel.ep == 0


def _write_moe_run(d, cfg, ranks_extra):
    from tests.gui.test_gui_run import stand_in_measurement

    d.mkdir(parents=True)
    cfg.save(d / "config.toml")
    (d / "events.jsonl").write_text(json.dumps({"event": "finished"}) + "\n")
    m = stand_in_measurement(cfg)
    m["ranks"] = [{**r, **ranks_extra} for r in m["ranks"]]
    (d / "measurement.json").write_text(json.dumps(m))


@pytest.mark.gui
def test_the_load_view_draws_the_tokens_per_expert_of_a_run(window, qtbot, tmp_path):
    from gui.widgets.load_balance import NO_RUN

    view = window.load_balance
    assert view.header.text() == NO_RUN and view.plot.isHidden()
    cfg = Config.from_dict({"model": {"preset": "tiny", "experts": 8, "experts_per_token": 2},
                            "cluster": {"preset": "local-cpu", "gpus": 4}, "parallel": {"dp": 4, "ep": 2}})
    # written as the backend writes a MoE run's records: per timed step and for the measured step
    steps = [{"k": k, "blocks": {"0": {"routed": [1] * 8, "received": [1] * 4, "first_expert": 0}},
              "total": {str(b): [64] * 8 for b in range(8)}} for k in (1, 2)]
    measured = {"k": 3, "blocks": {}, "total": {**{str(b): [64] * 8 for b in range(8)},
                                                 "5": [160, 96, 64, 64, 32, 32, 32, 32]}}
    _write_moe_run(tmp_path / "moe-run", cfg, {"expert_tokens": steps,
                                               "memory": {"categories": {}, "expert_tokens": measured}})
    window.tabs.setCurrentWidget(view)
    window.state.open_run(tmp_path / "moe-run")
    qtbot.waitUntil(lambda: view.load is not None, timeout=2000)
    assert view.load.step == 3 and view.selected() == 5  # the worst block is shown first
    assert view.counts() == (160, 96, 64, 64, 32, 32, 32, 32)
    assert "imbalance 2.50×" in view.header.text() and "step 3" in view.header.text()
    assert view.busiest.opts["height"][0] == 160 and len(view.bars.opts["height"]) == 7
    assert view.mean_line.value() == pytest.approx(64.0)
    view.block.setCurrentIndex(view.block.findData(-1))
    assert view.counts()[0] == 7 * 64 + 160
    view.use.click()
    qtbot.waitUntil(lambda: window.state.config.conventions.moe_imbalance == 2.5, timeout=2000)
    # a run without token counts says so
    _write_moe_run(tmp_path / "dense-run", window.state.config.replace(model={"experts": 0}, parallel={"ep": 1}), {})
    window.state.open_run(tmp_path / "dense-run")
    qtbot.waitUntil(lambda: view.load is None, timeout=2000)
    assert "recorded no tokens per expert" in view.header.text() and view.plot.isHidden()


@pytest.mark.gui
@pytest.mark.parametrize("size", [(1280, 800), (1600, 1000), (1920, 1080)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_nothing_is_clipped_with_the_moe_controls_band_and_load_view(window, qtbot, size, tmp_path):
    from tests.gui.test_gui_layout import at_size, clipped, clipped_in_every_tab, report

    w = window
    at_size(w, *size)
    w.state.set_config(moe_config())
    w.state.edit("parallel.ep", 4)
    qtbot.waitUntil(lambda: w.state.config.parallel.ep == 4, timeout=2000)
    w.state.recompute_now()
    problems = [f"[moe ep4] {p}" for p in clipped_in_every_tab(w)]
    w.state.edit("parallel.ep", 3)  # not a divisor of 128: the problem shows under the ep box
    qtbot.waitUntil(lambda: w.controls.errors["parallel.ep"].isVisible(), timeout=2000)
    assert "parallel.ep" in w.controls.problem_text("parallel.ep")
    problems += [f"[ep refused] {p}" for p in clipped(w.controls)]  # the problem under the ep box
    w.state.edit("parallel.ep", 4)
    cfg = Config.from_dict({"model": {"preset": "tiny", "experts": 8, "experts_per_token": 2},
                            "cluster": {"preset": "local-cpu", "gpus": 4}, "parallel": {"dp": 4, "ep": 2}})
    measured = {"k": 3, "blocks": {}, "total": {str(b): [100, 90, 80, 70, 60, 50, 40, 30] for b in range(8)}}
    _write_moe_run(tmp_path / "run", cfg, {"memory": {"categories": {}, "expert_tokens": measured}})
    w.state.open_run(tmp_path / "run")
    qtbot.waitUntil(lambda: w.load_balance.load is not None, timeout=2000)
    w.tabs.setCurrentWidget(w.load_balance)
    QApplication_process()
    problems += [f"[load view] {p}" for p in clipped(w)]
    w.grab().save(f"/tmp/layout-moe-{size[0]}x{size[1]}.png", "PNG")
    assert not problems, report(problems)


def QApplication_process() -> None:
    from PySide6.QtWidgets import QApplication

    QApplication.processEvents()


@pytest.mark.parametrize("parallel", [{"ep": 4}, {"ep": 8, "zero": 3}, {"ep": 1}])
def test_the_runnable_version_of_a_mixture_of_experts_stays_one(parallel):
    from gui.runnable import RUNNABLE_EXPERTS, runnable_version

    r = runnable_version(moe_config(**parallel))
    small = r.config
    assert small is not None and small.model.experts == RUNNABLE_EXPERTS and small.model.experts_per_token == 2
    assert small.parallel.ep == min(parallel["ep"], RUNNABLE_EXPERTS)
    assert any(f"{RUNNABLE_EXPERTS} routed experts, top-2 instead of 128, top-8" in c for c in r.changes)
