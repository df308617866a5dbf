"""A run's expert load: the tokens each routed expert received in the run's last step (plain Python, no Qt).

The backend records, in each rank's entry of ``measurement.json``'s ``ranks``, the routed-token
counts of every step: ``expert_tokens`` (one entry per timed step) and ``memory.expert_tokens``
(the untimed step whose memory was measured, run last), each ``{"k": step, "blocks": {...this
rank's view...}, "total": {block: [tokens per expert]}}``, where ``total`` is summed over every
rank (so it is the same on every rank). The imbalance is ``conventions.moe_imbalance``'s
definition: the busiest expert's tokens over the mean, the largest over the MoE blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLoad:
    """The tokens per expert of one step of a run, per MoE block (blocks numbered as the model's)."""

    step: int
    blocks: dict[int, tuple[int, ...]]

    @property
    def experts(self) -> int:
        return len(next(iter(self.blocks.values()), ()))

    def summed(self) -> tuple[int, ...]:
        """Tokens per expert over every MoE block."""
        rows = list(self.blocks.values())
        return tuple(sum(col) for col in zip(*rows)) if rows else ()

    @staticmethod
    def ratio(counts) -> float | None:
        """max / mean of one row of counts; None when it routed nothing."""
        total = sum(counts)
        return max(counts) * len(counts) / total if total > 0 else None

    def imbalance(self, block: int | None = None) -> float | None:
        """The busiest expert over the mean: of ``block``, or the largest over the blocks (None: no tokens)."""
        if block is not None:
            return self.ratio(self.blocks[block])
        ratios = [r for r in (self.ratio(c) for c in self.blocks.values()) if r is not None]
        return max(ratios) if ratios else None

    def worst_block(self) -> int | None:
        ratios = {b: self.ratio(c) for b, c in self.blocks.items()}
        ratios = {b: r for b, r in ratios.items() if r is not None}
        return max(ratios, key=ratios.get) if ratios else None


def expert_load(measurement: dict | None) -> ExpertLoad | None:
    """The last step's tokens per expert recorded in a run's measurement; None when it has none
    (a dense model, a simulated run, or a run from before the counts were recorded)."""
    if not isinstance(measurement, dict):
        return None
    steps: list[dict] = []
    for rank in measurement.get("ranks") or []:
        if not isinstance(rank, dict):
            continue
        steps += [s for s in rank.get("expert_tokens") or [] if isinstance(s, dict)]
        measured = (rank.get("memory") or {}).get("expert_tokens")
        if isinstance(measured, dict):
            steps.append(measured)
        if steps:
            break  # every rank's totals are the same sums: the first rank that has them suffices
    steps = [s for s in steps if isinstance(s.get("total"), dict) and s["total"]]
    if not steps:
        return None
    last = max(steps, key=lambda s: int(s.get("k", 0)))
    blocks = {int(b): tuple(int(v) for v in counts) for b, counts in last["total"].items()}
    return ExpertLoad(step=int(last.get("k", 0)), blocks=dict(sorted(blocks.items())))
