"""How repetitive a continuation is: the measure every benchmark row reports beside its speed.

A loop is what every draft, the n-gram level above all, predicts best, so a speedup measured on
looping text flatters speculation. The measure, defined once here:

**repetition** of a continuation ``t[0..n-1]`` (generated tokens only, never the prompt) is the
share of its tokens ``t[i]`` for which the n-gram ending at ``i``, ``t[i-n+1..i]``, already
occurred earlier in the same continuation, ending at some ``j < i`` (occurrences may overlap).
The first ``n - 1`` tokens can never count; an empty continuation scores 0. With ``n = 4``:
``a b c d a b c d`` scores 1/8 (only the second ``d`` closes a seen 4-gram), ``a a a a a a``
scores 2/6, and text with no repeated 4-gram scores 0.

A continuation is treated as a **loop** when its repetition is at least :data:`LOOP_THRESHOLD`.
"""
from __future__ import annotations

import statistics
from typing import Sequence

NGRAM = 4
LOOP_THRESHOLD = 0.2


def repetition(token_ids: Sequence[int], n: int = NGRAM) -> float:
    """Share of ``token_ids`` closing an ``n``-gram already seen earlier in them (module docstring)."""
    if n < 1:
        raise ValueError(f"n: must be >= 1 (got {n})")
    ids = list(token_ids)
    if not ids:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(n - 1, len(ids)):
        gram = tuple(ids[i - n + 1:i + 1])
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(ids)


def median_repetition(continuations: Sequence[Sequence[int]], n: int = NGRAM) -> float:
    """Median over continuations of :func:`repetition` (0 for none)."""
    return statistics.median(repetition(c, n) for c in continuations) if continuations else 0.0


def is_loop(token_ids: Sequence[int], threshold: float = LOOP_THRESHOLD, n: int = NGRAM) -> bool:
    return repetition(token_ids, n) >= threshold
