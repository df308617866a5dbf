"""The mixture-of-experts controls: routed experts, top-k and the expert-parallel degree.

They live in their own group of the controls panel. For a dense model (``model.experts = 0``) the
experts box reads "dense" and top-k and ep are greyed out (ep stays editable while it is above 1,
so the problem the config then has can be fixed where it is shown). The ep box offers the degrees
the config's validation allows: the divisors of gcd(experts, dp_shard·cp·tp) — ep splits each MoE
block's experts and covers ranks of the dense region (torchtitan's ParallelDims); a value outside
them (a loaded file) stays listed, and its problem shows under the box.
"""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtWidgets import QComboBox, QLabel, QSpinBox

from engine.config import FIELD_RANGES

EP_KEY, EXPERTS_KEY, TOPK_KEY = "parallel.ep", "model.experts", "model.experts_per_token"
DENSE_TIP = "A dense model has no experts: set routed experts above 0 first"


def dense_region(par: dict[str, Any]) -> int:
    """dp_shard · cp · tp: the ranks the sparse region efsdp · ep lays out again (0 when unknown)."""
    try:
        dp, replicate = int(par.get("dp", 1)), int(par.get("replicate", 1) or 1)
        return (dp // replicate if replicate > 0 and dp % replicate == 0 else 0) * int(par.get("cp", 1)) \
            * int(par.get("tp", 1))
    except (TypeError, ValueError):
        return 0


def allowed_ep(experts: Any, par: dict[str, Any]) -> list[int]:
    """The expert-parallel degrees the validation accepts for this model and layout: 1 for a dense
    model, else the divisors of gcd(experts, dp_shard·cp·tp)."""
    if not isinstance(experts, int) or experts <= 0:
        return [1]
    g = math.gcd(experts, dense_region(par)) or 1
    return [d for d in range(1, g + 1) if g % d == 0]


class ExpertControls:
    """Builds the "Mixture of experts" group on ``panel`` (a ControlsPanel) and mirrors the desired config."""

    def __init__(self, panel, outer) -> None:
        self.panel = panel
        _, grid = panel._group("Mixture of experts", outer)
        self.experts = panel._spin(0, int(FIELD_RANGES[EXPERTS_KEY].hi), EXPERTS_KEY)
        self.experts.setSpecialValueText("0 (dense)")
        self.experts.setToolTip("Routed experts per MoE block (0: a dense model, every block has the MLP)")
        panel._row(grid, "Routed experts", EXPERTS_KEY, self.experts)
        self.top_k = panel._spin(1, int(FIELD_RANGES[TOPK_KEY].hi), TOPK_KEY)
        self.top_k.setToolTip("Experts each token is routed to (top-k of the router's scores); at most the experts")
        panel._row(grid, "Top-k", TOPK_KEY, self.top_k)
        self.ep = QComboBox()
        self.ep.setToolTip("Expert parallel: each MoE block's experts split over ep ranks, tokens sent to them "
                           "by all-to-all; ep divides the experts and dp_shard·cp·tp")
        self.ep.currentIndexChanged.connect(self._ep_chosen)
        self.hint = QLabel()
        self.hint.setObjectName("hint")
        self.hint.setWordWrap(True)
        panel._row(grid, "Expert parallel (ep)", EP_KEY, self.ep, hint=self.hint)
        self._ep_values: list[int] = []

    def _ep_chosen(self, index: int) -> None:
        if index >= 0:
            self.panel._edit(EP_KEY, int(self.ep.itemData(index)))

    def sync(self, model: dict[str, Any], par: dict[str, Any]) -> None:
        """Show the desired config's experts, top-k and ep (signals blocked: the panel is syncing)."""
        experts = model.get("experts", 0)
        experts = experts if isinstance(experts, int) else 0
        ep = par.get("ep", 1)
        ep = ep if isinstance(ep, int) else 1
        moe = experts > 0
        self.panel._set_spin(self.experts, experts)
        self.panel._set_spin(self.top_k, model.get("experts_per_token", 1))
        values = allowed_ep(experts, par)
        if ep not in values:
            values = sorted({*values, ep})
        if values != self._ep_values:
            self._ep_values = values
            self.ep.blockSignals(True)
            self.ep.clear()
            for v in values:
                self.ep.addItem(str(v), v)
            self.ep.blockSignals(False)
        self.ep.blockSignals(True)
        self.ep.setCurrentIndex(values.index(ep))
        self.ep.blockSignals(False)
        for widget, on in ((self.top_k, moe), (self.ep, moe or ep > 1)):
            if widget.isEnabled() != on:
                widget.setEnabled(on)
        tip = "" if moe else DENSE_TIP
        if self.top_k.statusTip() != tip:
            self.top_k.setStatusTip(tip)
            self.ep.setStatusTip(tip)
        self._show_hint(moe, experts, ep, par)

    def _show_hint(self, moe: bool, experts: int, ep: int, par: dict[str, Any]) -> None:
        if not moe:
            text = "a dense model: no experts to split"
        elif experts % ep:
            text = ""
        else:
            dense = dense_region(par)
            efsdp = dense // ep if dense and dense % ep == 0 else None
            text = f"{experts // ep} experts per rank of each MoE block"
            if efsdp is not None and ep > 1:
                text += f" · efsdp = dp_shard·cp·tp / ep = {efsdp}"
        if text != self.hint.text():
            self.hint.setText(text)
