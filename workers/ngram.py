"""Prompt lookup: propose the continuation of the longest earlier match of the current suffix.

Free (no model), deterministic, so its ``draft_probs`` are one-hot. It can only propose: a
topology that makes it a verifier is rejected at load time.
"""
from __future__ import annotations

from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cascade.errors import describe
from cascade.sampling import Sampling
from policies.base import DraftStep, StopRule
from policies.params import Int
from workers.base import Draft, Worker


class NGramParams(BaseModel):
    """An n-gram level's ``params`` in a topology file (checked when the topology loads)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_ngram: Int = Field(3, ge=1, description="Longest suffix to look up.")
    min_ngram: Int = Field(1, ge=1, description="Shortest suffix to look up.")

    @model_validator(mode="after")
    def _ordered(self) -> "NGramParams":
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self


class NGramWorker(Worker):
    can_score = False
    drafts_trees = False

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        try:
            params = NGramParams(max_ngram=max_ngram, min_ngram=min_ngram)
        except ValidationError as exc:
            raise ValueError(describe(exc, root="params", got=False,
                                      context=f"max_ngram={max_ngram!r}, min_ngram={min_ngram!r}")) from None
        self.vocab_size = vocab_size
        self.max_ngram = params.max_ngram
        self.min_ngram = params.min_ngram

    def score(self, seq_ids, token_ids, num_positions):
        raise TypeError("an n-gram level cannot verify; it can only propose")

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """The continuation after the most recent earlier occurrence of the longest suffix."""
        tokens = list(tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = tokens[length - n:]
            first = suffix[0]
            # Most recent match first: recent context predicts best.
            for start in range(length - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + max_tokens]
        return []

    def draft(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        sampling: Sampling,
        uniforms: Sequence[torch.Tensor],
        stop: StopRule | None = None,
    ) -> list[Draft]:
        # Deterministic proposals: one-hot draft_probs, every token drafted with probability 1.
        proposals = [self.lookup(tokens, n) if n > 0 else [] for tokens, n in zip(token_ids, max_tokens)]
        keep = self._stop(proposals, stop) if stop is not None else [len(p) for p in proposals]
        out = []
        for proposal, k in zip(proposals, keep):
            tokens = proposal[:k]
            probs = torch.zeros(len(tokens), self.vocab_size)
            if tokens:
                probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            out.append(Draft(tokens, probs, 0, [1.0] * len(tokens), stopped_early=k < len(proposal)))
        return out

    @staticmethod
    def _stop(proposals: list[list[int]], stop: StopRule) -> list[int]:
        """How much of each proposal the stop rule keeps, column by column across the rows as a
        model drafter's would be (``StopRule.stop_batch``). Each token's probability is 1, so a
        rule on the drafter's confidence or entropy never fires; ``auto``'s reads the measured
        acceptance of the n-gram level's tokens (docs/policies.md, "auto's stop")."""
        keep = [len(p) for p in proposals]
        last: list[DraftStep | None] = [None] * len(proposals)
        for j in range(max(keep, default=0)):
            live = [r for r in range(len(proposals)) if j < keep[r]]
            steps = []
            for r in live:
                step = DraftStep(j, 1.0, 1.0, max_prob=1.0, entropy=0.0, previous=last[r])
                if last[r] is not None:
                    last[r].previous = None  # one link: a rule reads its state from the step before
                last[r] = step
                steps.append(step)
            for r, ends in zip(live, stop.stop_batch(steps, len(proposals))):
                if ends:
                    keep[r] = j + 1
        return keep
