"""What ``cascade bench`` records: one :class:`Sample` per configuration, prompt and repeat, one
:class:`ConfigReport` per configuration and mode, and the label of a mode (:func:`mode_label`).
A leaf: the bench (:mod:`cascade.tools.bench`), its batch bench and its reports import it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cascade.tools.exactness import DistributionCheck


def mode_label(sampling) -> str:
    """``greedy``, or the sampling parameters that are on, e.g. ``T=0.8, top-p 0.95``."""
    if sampling.greedy:
        return "greedy"
    parts = [f"T={sampling.temperature:g}"]
    if sampling.top_p < 1:
        parts.append(f"top-p {sampling.top_p:g}")
    if sampling.top_k:
        parts.append(f"top-k {sampling.top_k}")
    return ", ".join(parts)


@dataclass
class Sample:
    config: str
    mode: str  # mode_label(sampling)
    prompt: int
    repeat: int
    tokens: int
    seconds: float
    authority_passes: int
    token_ids: list[int]
    stats: Any = None  # cascade's RequestStats


@dataclass
class ConfigReport:
    name: str
    mode: str  # "greedy" or e.g. "T=0.8, top-p 0.95"
    tokens_per_second_median: float
    tokens_per_second_ci: tuple[float, float]
    speedup_median: float  # median over prompts of (this / plain), both measured in this run
    speedup_ci: tuple[float, float]
    authority_passes_per_token: float
    # median over prompts of (this / cascade:authority), both measured in this run: what drafting
    # bought over the authority's own forward in cascade, alone (None: that row was not run)
    speedup_over_authority_median: float | None = None
    speedup_over_authority_ci: tuple[float, float] | None = None
    acceptance: dict[str, float] = field(default_factory=dict)
    acceptance_by_position: dict[str, list[float]] = field(default_factory=dict)
    level_seconds_per_token: dict[str, float] = field(default_factory=dict)
    orchestration_seconds_per_token: float | None = None
    predicted_speedup: float | None = None
    predicted_path: list[str] = field(default_factory=list)
    edges: list[str] = field(default_factory=list)  # a cascade configuration's graph
    measured_over_predicted: float | None = None
    mismatches: list[int] = field(default_factory=list)  # greedy: prompts whose output differs from plain
    # of those, the prompts where every divergence was a near-tie a low-precision authority's
    # rounding can flip (cascade/DESIGN.md §2, Numerics; cascade.tools.exactness.greedy_divergence)
    near_ties: list[int] = field(default_factory=list)
    repetition_median: float = 0.0  # median over prompts (mean over repeats) of repetition()
    speedup_nonloop_median: float | None = None  # over the prompts whose plain text is no loop
    nonloop_prompts: int = 0
    distribution: DistributionCheck | None = None  # sampled: the distribution check
    # per repeat, in order: the speedup (median over prompts of this / plain in that repeat) and
    # tokens/s (all prompts' tokens over their seconds); their spread says how steady the machine was
    speedup_by_repeat: list[float] = field(default_factory=list)
    tokens_per_second_by_repeat: list[float] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return set(self.mismatches) <= set(self.near_ties) and (self.distribution is None or self.distribution.passed)
