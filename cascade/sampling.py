"""Sampling parameters, validated once at the boundary."""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from cascade.verify import sample_with_keys, sample_with_uniform, sampling_probs


class Sampling(BaseModel):
    """How a level turns logits into the distribution it samples from.

    The authority always samples with the user's parameters; drafts use them too unless their
    level overrides some fields (``LevelSpec.sampling``). Exactness holds either way because
    verification sees the distribution each draft really sampled from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf would sample noise

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (argmax); >0 divides the logits.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the smallest set of mass >= top_p; 1 = off.")
    coupling: Literal["residual", "gumbel"] | None = Field(
        None,
        description="How drafts and verifiers share randomness. 'residual': the speculative rule "
        "(accept with min(1, target/draft), else resample the residual): the most acceptance, but "
        "a seed's tokens depend on where blocks fall. 'gumbel': per-position noise keyed by "
        "(seed, position), the same at every level (cascade/verify.py): a seed gives the same "
        "tokens whatever the policy, batch or backend, for somewhat lower acceptance. Unset: "
        "'gumbel' for a request with a seed (a seed means the same tokens), else 'residual' "
        "(resolved when the request starts: Engine.start).",
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_seed(self, seed: int | None) -> "Sampling":
        """This sampling with its coupling decided: an explicit one is kept; unset, a request
        with a seed gets 'gumbel' (its tokens then follow the seed alone, whatever the policy,
        batch or backend) and one without gets 'residual' (the most acceptance)."""
        if self.coupling is not None:
            return self
        return self.model_copy(update={"coupling": "residual" if seed is None else "gumbel"})

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [..., vocab]
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # [n, vocab], [n] -> [n]
        """One token per row of ``probs`` (rows of :meth:`probs`), by inverse CDF with the row's
        uniform, or (``coupling="gumbel"``) by the exponential race with the noise of the row's
        position key, which then travels in the uniform's place. Greedy rows are one-hot, for
        which either is the hot token: taken directly (no cumulative sum over the vocabulary)."""
        if self.greedy:
            return probs.argmax(-1)
        if self.coupling == "gumbel":
            return sample_with_keys(probs, uniforms)
        return sample_with_uniform(probs, uniforms)


class SamplingOverride(BaseModel):
    """Per-level overrides for a draft's sampling; unset fields follow the request."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf would sample noise

    temperature: float | None = Field(None, ge=0.0, description="Draft temperature; 0 = greedy drafts.")
    top_k: int | None = Field(None, ge=0, description="Draft top-k; 0 = off.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Draft top-p; 1 = off.")

    def apply(self, base: Sampling) -> Sampling:
        changes = {k: v for k, v in self.model_dump().items() if v is not None}
        return base.model_copy(update=changes) if changes else base
