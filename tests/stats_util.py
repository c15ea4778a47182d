"""Goodness-of-fit helpers for the distribution tests (independent of the code under test)."""
from __future__ import annotations

import math
from collections import Counter

import torch


def reference_warp(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Temperature, top-k, top-p written out plainly (not via cascade.verify)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k]) if top_k else set(order)
    m = max(scaled)
    weights = [math.exp(x - m) if i in keep else 0.0 for i, x in enumerate(scaled)]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= top_p or probs[i] == 0:
                break
            kept.add(i)
            mass += probs[i]
        probs = [p if i in kept else 0.0 for i, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


def chi_square_pvalue(counts: Counter, expected_probs: dict, n: int) -> tuple[float, float]:
    """Pearson chi-square of observed pair counts against exact probabilities.

    Cells with an expected count below 5 are pooled; an observation in a cell of zero
    probability makes the p-value 0 outright. Returns (statistic, p-value).
    """
    if any(expected_probs.get(k, 0.0) == 0.0 for k in counts):
        return math.inf, 0.0
    stat, dof = 0.0, -1
    pooled_obs, pooled_exp = 0, 0.0
    for key, p in expected_probs.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, pvalue


def total_variation(counts: Counter, expected_probs: dict, n: int) -> float:
    keys = set(counts) | set(expected_probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - expected_probs.get(k, 0.0)) for k in keys)
