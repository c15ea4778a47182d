"""Exactness at T > 0, checked by distribution inside the benchmarks.

Under sampling, token identity with plain decoding no longer applies (the two draw from
different random streams), but the distribution must still be the authority's own. The check:

1. on one fixed prompt, draw the first ``tokens`` generated tokens (default 2) ``draws`` times
   from the configuration under test (one seed per draw), and as many times from **plain
   sampling of the authority** (transformers ``generate(do_sample=True)``, the bench's
   baseline). The prompt: a short prefix of a measured prompt after which the next token is
   uncertain among a few common outcomes (:func:`uncertain_prefix`), so that draws are cheap
   and a wrong sampler shows;
2. at each position ``j < tokens``, compare the two samples of the token there (or "ended", past
   an EOS) with Pearson's chi-square test of homogeneity on the 2 x C table of counts, after
   pooling: an outcome keeps its own column only if its expected count is at least
   :data:`MIN_EXPECTED` in both rows, the rest share one "other" column (merged into the
   smallest kept column if it is itself below that). Positions are tested one by one, not
   jointly: a few hundred draws spread over pairs of tokens are too thin to test;
3. **the bound**: the configuration passes if ``tokens x`` the smallest per-position p-value
   (Bonferroni) is above :data:`P_BOUND` = 1e-3. With a dozen configurations checked, a
   correct bench fails by chance about once in eighty runs. A wrong sampler is far outside it:
   on the bundled models, 300 draws of plain sampling at T = 0.6 or 1.0 where 0.8 (top-p 0.95)
   is asked give p ~ 1e-5 and 1e-9 at the first position. A subtle error (a few percent of
   the mass moved, as top-p 0.95 against 1 does) is below what a few hundred draws can see:
   the exhaustive tests in ``tests/test_distribution.py`` (100k draws) cover those.

The empirical total variation between the two samples of the first token is reported beside
the test, as a size of the difference (biased upwards by sampling noise: two samples of one
distribution with many outcomes do not have zero TV; at later positions, where the outcomes are
many more, it says little, so each position's is kept in ``position_total_variations`` only).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Sequence

P_BOUND = 1e-3
MIN_EXPECTED = 5.0
ENDED = -1  # the outcome at a position past the continuation's EOS


@dataclass
class DistributionCheck:
    config: str
    draws: int  # per side
    tokens: int  # leading positions compared, one by one
    prompt: int  # index of the prompt used
    prompt_tokens: int  # length of its prefix used
    p_value: float  # Bonferroni: tokens x the smallest per-position p-value, at most 1
    position_p_values: list[float] = field(default_factory=list)
    columns: int = 0  # at the worst position: outcomes after pooling,
    chi_square: float = 0.0  # the statistic,
    dof: int = 0  # and its degrees of freedom
    total_variation: float = 0.0  # empirical TV between the two samples of the first token
    position_total_variations: list[float] = field(default_factory=list)
    bound: float = P_BOUND

    @property
    def passed(self) -> bool:
        return self.p_value > self.bound


def homogeneity(reference: Sequence[Hashable], observed: Sequence[Hashable],
                min_expected: float = MIN_EXPECTED) -> tuple[float, int, float, int]:
    """Pearson chi-square test that two samples of outcomes come from one distribution.

    Returns (statistic, degrees of freedom, p-value, columns after pooling, as in the module
    docstring). One column (every draw the same outcome, or too few draws to keep two) leaves
    nothing to test: statistic 0, p-value 1.
    """
    rows = [Counter(reference), Counter(observed)]
    n = [len(reference), len(observed)]
    total = sum(n)
    if min(n) == 0:
        raise ValueError("homogeneity: both samples must be non-empty")
    totals = rows[0] + rows[1]
    # expected count of an outcome in row r: n[r] * column total / total; the smaller row binds
    kept = [k for k, c in totals.most_common() if min(n) * c / total >= min_expected]
    rest = [k for k in totals if k not in set(kept)]
    columns = [[rows[0][k], rows[1][k]] for k in kept]
    if rest:
        other = [sum(rows[0][k] for k in rest), sum(rows[1][k] for k in rest)]
        if columns and min(n) * sum(other) / total < min_expected:
            columns[-1] = [columns[-1][0] + other[0], columns[-1][1] + other[1]]  # the smallest kept
        else:
            columns.append(other)
    if len(columns) < 2:
        return 0.0, 0, 1.0, len(columns)
    stat = 0.0
    for col in columns:
        col_total = col[0] + col[1]
        for r in (0, 1):
            expected = n[r] * col_total / total
            stat += (col[r] - expected) ** 2 / expected
    dof = len(columns) - 1
    return stat, dof, chi_square_sf(stat, dof), len(columns)


def chi_square_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma function."""
    import torch

    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def total_variation(reference: Sequence[Hashable], observed: Sequence[Hashable]) -> float:
    a, b = Counter(reference), Counter(observed)
    return 0.5 * sum(abs(a[k] / len(reference) - b[k] / len(observed)) for k in set(a) | set(b))


def position(continuations: Sequence[Sequence[int]], j: int, eos: int | None) -> list[int]:
    """The token at position ``j`` of each continuation, or :data:`ENDED` past its EOS (or its end)."""
    out = []
    for x in continuations:
        x = list(x)
        ended = len(x) <= j or (eos is not None and eos in x[:j])
        out.append(ENDED if ended else int(x[j]))
    return out


def check_distribution(config: str, reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]],
                       tokens: int = 2, eos: int | None = None, prompt: tuple[int, int] = (0, 0)) -> DistributionCheck:
    """Test ``candidate``'s continuations against ``reference``'s (plain sampling's) at each of
    the first ``tokens`` positions (module docstring). The two must be drawn independently:
    seeded from different seeds or generators."""
    tests = []
    for j in range(tokens):
        ref, got = position(reference, j, eos), position(candidate, j, eos)
        tests.append((*homogeneity(ref, got), total_variation(ref, got)))
    worst = min(range(tokens), key=lambda j: tests[j][2])
    stat, dof, p, columns, _ = tests[worst]
    return DistributionCheck(config, len(candidate), tokens, *prompt, p_value=min(1.0, tokens * p),
                             position_p_values=[t[2] for t in tests], columns=columns, chi_square=stat, dof=dof,
                             total_variation=tests[0][4], position_total_variations=[t[4] for t in tests])


def uncertain_prefix(model, prompts_ids: Sequence[Sequence[int]], sampling, shortest: int = 8,
                     longest: int = 24, common: float = 0.05) -> tuple[int, int]:
    """(prompt index, length): the prefix of ``shortest``..``longest`` tokens, over all the
    prompts, after which the authority's next token is most uncertain *among common outcomes*
    under ``sampling``: the most mass on tokens of probability >= ``common`` other than the
    likeliest (one forward pass per prompt). Short, so that hundreds of draws cost little;
    uncertain among a few tokens each drawn often, so that a wrong sampler shows (a flat
    distribution spreads a few hundred draws too thin to test)."""
    import torch

    best, best_score = (0, min(longest, len(prompts_ids[0]))), -1.0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for i, ids in enumerate(prompts_ids):
            ids = list(ids)[:longest]
            probs = sampling.probs(model(torch.tensor([ids], device=device)).logits[0])  # [len, vocab]
            score = probs.masked_fill(probs < common, 0.0).sum(-1) - probs.max(-1).values  # [len]: after ids[:j + 1]
            for j in range(min(shortest, len(ids)) - 1, len(ids)):
                if float(score[j]) > best_score:
                    best, best_score = (i, j + 1), float(score[j])
    return best


# -- greedy identity and low-precision arithmetic (cascade/DESIGN.md §2, "Numerics") ---------------

# A model's logits depend, by rounding, on how many positions a pass scores (matrix kernels block
# by the number of rows): in bf16 or float16 a good fraction of a logit, in float32 some 1e-5 of
# one (docs/real-model.md, "Greedy identity in bf16"). A greedy divergence whose
# two tokens are this close is a near-tie that rounding can flip; a wrong acceptance rule shows
# as a divergence far outside it.
NEAR_TIE_LOGITS = 1.0
FLOAT32_NEAR_TIE_LOGITS = 1e-3  # 20x float32's width dependence (docs/real-model.md); float64 gets none


@dataclass(frozen=True)
class Divergence:
    """Where a greedy output first differs from plain greedy decoding, and how close the two
    tokens there are in the model's own logits (the shared prefix scored in one pass)."""
    position: int
    ours: int
    theirs: int
    gap: float  # |logit(ours) - logit(theirs)|
    low_precision: bool  # the model computes in bf16 or float16
    float32: bool = False  # the model computes in float32

    @property
    def near_tie(self) -> bool:
        """Within what the model's rounding can flip: a logit in bf16 or float16, a thousandth
        of one in float32, nothing in float64."""
        if self.low_precision:
            return self.gap <= NEAR_TIE_LOGITS
        return self.float32 and self.gap <= FLOAT32_NEAR_TIE_LOGITS

    def describe(self) -> str:
        kind = f"a near-tie ({'bf16/fp16' if self.low_precision else 'float32'} rounding)" if self.near_tie \
            else "NOT a near-tie"
        return (f"first differs at generated token {self.position} ({self.ours} against plain decoding's "
                f"{self.theirs}; logit gap {self.gap:.3f}: {kind})")


def greedy_divergence(model, prompt_ids: Sequence[int], ours: Sequence[int], theirs: Sequence[int],
                      eos: int | None = None) -> Divergence | None:
    """Compare two greedy continuations of ``prompt_ids``; None if they are the same. A
    continuation that ended before the other counts as having emitted ``eos`` there."""
    import torch

    ours, theirs = list(ours), list(theirs)
    k = 0
    while k < len(ours) and k < len(theirs) and ours[k] == theirs[k]:
        k += 1
    if k == len(ours) == len(theirs):
        return None
    a = ours[k] if k < len(ours) else eos
    b = theirs[k] if k < len(theirs) else eos
    param = next(model.parameters())
    low, single = param.dtype in (torch.bfloat16, torch.float16), param.dtype == torch.float32
    if a is None or b is None:  # one stopped where the other did not, and the stop token is unknown
        return Divergence(k, -1 if a is None else a, -1 if b is None else b, float("inf"), low, single)
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + theirs[:k]], device=param.device)
        logits = model(ids).logits[0, -1].float()
    return Divergence(k, a, b, abs(float(logits[a] - logits[b])), low, single)
