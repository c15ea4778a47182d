"""Stop rules: end a draft block on the drafting level's own confidence.

Each sees only a :class:`~policies.base.DraftStep` — the drafter's distribution at tokens it has
already drawn — so a block's length is a stopping time of the proposer and the output stays
exact whatever the thresholds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from policies.base import DraftStep, StopRule
from policies.estimates import confidence_bin


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


@dataclass(frozen=True)
class CalibratedStop(StopRule):
    """Stop when the estimated probability that the whole block so far is accepted falls below
    ``threshold``.

    Each token's acceptance is read from measured tables (``Calibration``): ``first`` for the
    block's first token, ``later`` for the others (given those before were accepted), indexed
    by the bin of the drafter's own probability of the token. The running product is kept on
    the steps (``DraftStep.memo``). The tables are a snapshot taken when the step was planned,
    so the stop is still a stopping time of the proposer.
    """

    first: tuple[float, ...]
    later: tuple[float, ...]
    threshold: float

    def survival(self, step: DraftStep) -> float:
        """The estimated probability that the block up to ``step`` is accepted whole."""
        previous = step.previous
        survival = previous.memo if previous is not None and previous.memo is not None else 1.0
        table = self.first if step.index == 0 else self.later
        survival *= table[confidence_bin(step.token_prob)]
        step.memo = survival
        return survival

    def should_stop(self, step: DraftStep) -> bool:
        return self.survival(step) < self.threshold

    def stop_batch(self, steps: list[DraftStep], batch: int) -> list[bool]:
        """Rows of a batch go on or stop together. The verifier scores every row as wide as
        the longest block, so one more drafted column costs the batch a drafter pass and a
        verifier position per row whichever rows use it, and earns the sum of their
        survivals: the rows go on while that sum is at least ``threshold`` per row (rows that
        already ended add nothing). A lone row is :meth:`should_stop`."""
        survival = [self.survival(step) for step in steps]
        stop = sum(survival) < self.threshold * max(batch, len(steps))
        return [stop] * len(steps)
