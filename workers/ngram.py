"""Prompt lookup: propose the continuation of the longest earlier match of the current suffix.

Free (no model), deterministic, so its ``draft_probs`` are one-hot. It can only propose: a
topology that makes it a verifier is rejected at load time.
"""
from __future__ import annotations

from typing import Annotated, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cascade.errors import describe
from cascade.sampling import Sampling
from policies.base import StopRule
from workers.base import Draft, Worker


def _integer(value):
    """numpy integer scalars count as ints; a bool does not."""
    import numbers

    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


class NGramParams(BaseModel):
    """An n-gram level's ``params`` in a topology file (checked when the topology loads)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_ngram: Annotated[int, Field(ge=1, strict=True)] = Field(3, description="Longest suffix to look up.")
    min_ngram: Annotated[int, Field(ge=1, strict=True)] = Field(1, description="Shortest suffix to look up.")

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data):
        return {k: _integer(v) for k, v in data.items()} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _ordered(self) -> "NGramParams":
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self


class NGramWorker(Worker):
    can_score = False

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
        # Deterministic proposals: one-hot draft_probs, and a confidence stop never fires.
        out = []
        for tokens, n in zip(token_ids, max_tokens):
            proposal = self.lookup(tokens, n) if n > 0 else []
            probs = torch.zeros(len(proposal), self.vocab_size)
            if proposal:
                probs[torch.arange(len(proposal)), torch.tensor(proposal)] = 1.0
            out.append(Draft(proposal, probs, 0, [1.0] * len(proposal)))
        return out
