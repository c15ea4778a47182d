"""Stop rules: end a draft block on the drafting level's own confidence.

Each sees only a :class:`~policies.base.DraftStep` — the drafter's distribution at tokens it has
already drawn — so a block's length is a stopping time of the proposer and the output stays
exact whatever the thresholds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from policies.base import DraftStep, StopRule


@dataclass(frozen=True)
class ConfidenceStop(StopRule):
    """Stop when the drafted token's probability (``mode="token"``) or the running product over
    the block (``mode="block"``, an estimate of the whole block's acceptance) is below threshold."""

    threshold: float
    mode: str = "token"

    def should_stop(self, step: DraftStep) -> bool:
        value = step.block_prob if self.mode == "block" else step.token_prob
        return value < self.threshold


@dataclass(frozen=True)
class EntropyStop(StopRule):
    """Stop when ``exp(-entropy)`` falls below threshold.

    ``exp(-H) <= max_prob`` (min-entropy never exceeds Shannon entropy), so it is a lower bound
    on the drafter's top probability — the acceptance probability of a calibrated drafter's
    greedy token.
    """

    threshold: float

    def should_stop(self, step: DraftStep) -> bool:
        return math.exp(-step.entropy) < self.threshold
