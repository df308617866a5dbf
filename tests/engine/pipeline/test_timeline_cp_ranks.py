"""The measured pipeline view picks one replica per pipeline rank in torchtitan's rank order
[pp, dp, cp, tp]: with cp > 1 the pipeline rank of a global rank is rank // (dp·cp·tp)."""

import os

import pytest

pytest.importorskip("PySide6")

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from gui.widgets.timeline import actions_from_measurement  # noqa: E402


def _meas(world: int) -> dict:
    return {"pipeline": {"per_rank": [{"rank": r, "actions": [["F", r, 0, 0.1 * r, 0.1 * r + 0.05]]}
                                      for r in range(world)]}}


def test_one_replica_per_pipeline_rank_with_cp():
    dp, cp, tp, pp = 2, 2, 2, 2  # 16 ranks; pipeline rank 1 starts at rank 8
    a = actions_from_measurement(_meas(dp * cp * tp * pp), dp, tp, cp)
    assert sorted(a.row.tolist()) == [0, 1]
    assert sorted(a.stage.tolist()) == [0, 8]  # ranks 0 and 8 are the (dp, cp, tp) = (0, 0, 0) replicas


def test_without_cp_the_old_order_holds():
    a = actions_from_measurement(_meas(8), 2, 2)  # dp2 tp2 pp2
    assert sorted(a.stage.tolist()) == [0, 4]
