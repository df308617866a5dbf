"""The window's context-parallel control: cp moves, dp follows, activations per rank drop; long sequences;
and what Run executes for a cp layout (gui.runnable: pure, no window)."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from engine import Config, default_config  # noqa: E402
from engine.config import FIELD_RANGES  # noqa: E402
from gui.runnable import runnable_version  # noqa: E402


def _activations(window) -> dict[int, int]:
    return {r.rank: r.activations for r in window.state.prediction.prediction.memory.per_rank}


@pytest.mark.gui
def test_moving_cp_shards_activations_per_rank(window, qtbot):
    before = _activations(window)
    assert window.state.config.parallel.cp == 1
    window.controls.cp.setValue(2)  # 4 GPUs, pp 2: dp follows to 4 / (cp 2 · pp 2) = 1
    qtbot.waitUntil(lambda: window.state.config.parallel.cp == 2, timeout=2000)
    qtbot.waitUntil(lambda: window.state.prediction is not None and window.state.prediction.config.parallel.cp == 2,
                    timeout=3000)
    cfg = window.state.prediction.config
    assert (cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.pp) == (1, 2, 2)
    after = _activations(window)
    assert len(after) == 4
    # each stage's first rank before (dp 2) against its ranks now (cp 2): every rank holds half the tokens
    stage_before = {0: before[0], 1: before[2]}
    for rank, act in after.items():
        assert act < stage_before[rank // 2], (rank, act, stage_before)
    assert not window.controls.errors["parallel.cp"].isVisible()
    window.tabs.setCurrentWidget(window.metrics.explainer)
    qtbot.waitUntil(lambda: "Context parallel (CP)" in window.metrics.explainer.toPlainText(), timeout=2000)
    text = window.metrics.explainer.toPlainText()
    assert "In this configuration:" in text and "Context parallel (CP)" in text.split(".")[0]


@pytest.mark.gui
def test_cp_the_gpu_count_cannot_hold_is_explained_next_to_cp(window, qtbot):
    window.controls.cp.setValue(4)  # 4 GPUs with pp 2: dp · 4 · 2 cannot make 4
    qtbot.waitUntil(lambda: window.controls.errors["parallel.cp"].isVisible(), timeout=2000)
    assert "must equal cluster.gpus (4)" in window.controls.errors["parallel.cp"].text()
    assert window.state.config.parallel.cp == 1  # the last valid config stays
    window.controls.cp.setValue(2)
    qtbot.waitUntil(lambda: window.state.config.parallel.cp == 2, timeout=2000)
    assert not window.controls.errors["parallel.cp"].isVisible()


@pytest.mark.gui
def test_sequence_length_slider_reaches_256k_and_the_field_bound(window, qtbot):
    s = window.controls.seq_len
    assert 262144 in s.values and max(s.values) == int(FIELD_RANGES["model.seq_len"].hi)
    s.slider.setValue(s.values.index(262144))
    qtbot.waitUntil(lambda: window.state.config.model.seq_len == 262144, timeout=3000)
    assert s.label.text() == "262,144"
    s.slider.setValue(s.values.index(1 << 20))
    qtbot.waitUntil(lambda: window.state.config.model.seq_len == 1 << 20, timeout=3000)
    assert s.label.text() == "1M"


def test_a_local_cp_layout_runs_as_it_is():
    cfg = default_config().replace(parallel={"dp": 1, "cp": 2, "pp": 2})
    r = runnable_version(cfg)
    assert r.is_original and r.config == cfg


def test_the_ring_runs_on_cpu_ranks_with_flash_attention():
    cfg = default_config().replace(parallel={"dp": 1, "cp": 2, "pp": 2, "cp_rotate": "alltoall"},
                                   model={"attention": "flash"})
    r = runnable_version(cfg)
    assert r.is_original and r.config == cfg and not r.problems


def test_a_long_context_cp_layout_runs_its_runnable_version_with_cp():
    cfg = Config.from_dict({"model": {"preset": "llama3-8b", "seq_len": 131072}, "cluster": {"preset": "h100-pod-64"},
                            "parallel": {"dp": 4, "cp": 16, "zero": 3, "microbatches": 16}})
    assert runnable_version(cfg).config is None  # cp 16 alone is 16 ranks: more than this machine runs
    cfg = cfg.replace(parallel={"dp": 16, "cp": 4, "cp_rotate": "alltoall"}, model={"attention": "flash"})
    r = runnable_version(cfg)
    small = r.config
    assert small is not None, r.problems
    assert (small.parallel.cp, small.parallel.cp_rotate, small.parallel.zero) == (4, "allgather", 3)
    assert small.parallel.world_size == small.cluster.gpus <= 8
    assert any("all-gather K/V" in c for c in r.changes) and "cp 4" in r.describe()
