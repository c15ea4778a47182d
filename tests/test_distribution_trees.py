"""Exactness of sampling with trees, through the real engine: the path's first level drafts a
tree of its top candidates, the next verifies all of it in one pass with the matching rule
(cascade/tree.py, docs/exactness.md: Trees), and the first two generated tokens follow the
authority's own warped distribution, computed by enumeration (tests/draws.py), under both
couplings and in 2 and 3 levels (where the tree's accepted path goes on up as a chain).

A file of their own so that they run beside test_distribution.py, not after it.
"""
from __future__ import annotations

from collections import Counter

import pytest

import cascade.engine
from cascade import Cascade
from draws import BATCH, MAX_NEW, PROMPT, TREE_CASES, exact_pairs, table_topology, tree_policy, trees_without_residual
from stats_util import chi_square_pvalue, total_variation

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)


@pytest.mark.parametrize("coupling,depth,temperature,top_k,widths", TREE_CASES,
                         ids=[f"{c or 'keyed'}-{d}level-T{t}-k{k}-{'x'.join(map(str, w))}" for c, d, t, k, w in TREE_CASES])
def test_trees_give_the_exact_joint_distribution(tmp_path, coupling, depth, temperature, top_k, widths):
    """The path's first level drafts a tree of its top candidates (width >= 2, 3 deep), the next
    verifies it with the matching rule; in 3 levels its accepted path goes on up as a chain."""
    n = 100_000
    topo = table_topology(tmp_path, depth, policy=tree_policy(depth, widths))
    with Cascade.from_topology(topo) as c:
        results = c.generate([PROMPT] * n, max_new_tokens=MAX_NEW, seed=depth, batch_size=BATCH, coupling=coupling,
                             temperature=temperature, top_k=top_k)
    first = ["tiny", "small", "medium", "large"][4 - depth]
    edge = f"{first}->{['tiny', 'small', 'medium', 'large'][5 - depth]}"
    ranks = [0] * 4
    for g in results:
        for r, count in enumerate(g.stats.edges[edge].accepted_by_rank):
            ranks[r] += count
    assert ranks[1] > n / 20  # second choices were taken: the tree was really used
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    expected = exact_pairs(depth, temperature, top_k, 1.0)
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue, total_variation(counts, expected, n))
    assert total_variation(counts, expected, n) < 0.012


def test_a_tree_rule_without_the_residual_fails_the_same_bound(tmp_path, monkeypatch):
    """The trees' negative control: siblings tried against the unmodified row (no residual)."""
    monkeypatch.setattr(cascade.engine, "verify_trees", trees_without_residual)
    n = 30_000
    topo = table_topology(tmp_path, 2, policy=tree_policy(2, [3, 2, 2]))
    with Cascade.from_topology(topo) as c:
        results = c.generate([PROMPT] * n, max_new_tokens=MAX_NEW, seed=99, batch_size=BATCH, coupling="residual",
                             temperature=1.0)
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(2, 1.0, 0, 1.0), n)
    assert pvalue < 1e-9


