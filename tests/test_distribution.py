"""Exactness of sampling: the first two generated tokens, drawn through the real engine, follow
the authority's own warped distribution, computed by enumeration — under both couplings.

Table-driven workers (tests/table_worker.py: the real Worker interface over a bigram table)
make 100k draws cheap. The levels are peaked and disagree, so a wrong acceptance rule (one
that ignores draft_probs, or keeps every draft) fails the same bound — checked below.

The draws run 64 requests at a time (tests/draws.py says why that is the distribution of one
request alone too, at half the cost). The adaptive policies' batched decisions depend on the
batch; test_distribution_policies.py draws them batched and `auto` one request at a time too.

Each case names its coupling: ``"residual"``, the speculative rule, which a request without a
seed gets by default; or none, the default path of a seeded request, which is the keyed
coupling (tests/test_coupling.py checks the rest of its promise: the same tokens for a seed
whatever the policy, path or batch). The keyed negative control shows that path really is the
keyed rule.
"""
from __future__ import annotations

from collections import Counter

import pytest

import cascade.engine
from cascade import Cascade
from draws import (BATCH, KEYED_CASES, MAX_NEW, NGRAM_POLICY, NGRAM_PROMPT, PROMPT, RESIDUAL_CASES, accept_every_draft,
                   draw_pairs, exact_pairs, per_row, table_topology, verify_ignoring_draft_probs)
from stats_util import chi_square_pvalue, total_variation

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)


CASES = [("residual", *case) for case in RESIDUAL_CASES] + [(None, *case) for case in KEYED_CASES]


@pytest.mark.parametrize("coupling,depth,temperature,top_k,top_p,draft", CASES,
                         ids=[f"{c or 'keyed'}-{i}" for i, (c, *_) in enumerate(CASES)])
def test_joint_distribution_of_two_tokens_is_exact(tmp_path, coupling, depth, temperature, top_k, top_p, draft):
    n = 100_000
    counts = draw_pairs(table_topology(tmp_path, depth, draft_sampling=draft), n, seed=depth, coupling=coupling,
                        temperature=temperature, top_k=top_k, top_p=top_p)
    expected = exact_pairs(depth, temperature, top_k, top_p)
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue, total_variation(counts, expected, n))
    assert total_variation(counts, expected, n) < 0.012


def test_joint_distribution_with_ngram_bottom_level(tmp_path):
    """One-hot n-gram drafts under sampling: the prompt repeats, so prompt lookup proposes."""
    n = 100_000
    prompt = NGRAM_PROMPT
    topo = table_topology(tmp_path, 3, policy=NGRAM_POLICY, ngram=True)
    with Cascade.from_topology(topo) as c:
        results = c.generate([prompt] * n, max_new_tokens=MAX_NEW, seed=11, temperature=1.0, batch_size=BATCH,
                             coupling="residual")
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    proposed = sum(g.stats.edges["ngram->small"].proposed for g in results if "ngram->small" in g.stats.edges)
    assert proposed > n / 2  # the n-gram level really drafted
    expected = exact_pairs(3, 1.0, 0, 1.0, prompt=prompt)
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue)
    assert total_variation(counts, expected, n) < 0.012


@pytest.mark.parametrize("coupling,rule,wrong,depth", [
    ("residual", "verify_blocks", per_row(verify_ignoring_draft_probs), 4),
    (None, "verify_block_keyed", accept_every_draft, 2),  # the seeded default path: keyed
], ids=["residual", "keyed"])
def test_wrong_rule_fails_the_same_bound(tmp_path, monkeypatch, coupling, rule, wrong, depth):
    """The negative check: the same test with a wrong rule in the engine is rejected decisively."""
    monkeypatch.setattr(cascade.engine, rule, wrong)
    n = 30_000
    counts = draw_pairs(table_topology(tmp_path, depth), n, seed=99, coupling=coupling, temperature=1.0)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(depth, 1.0, 0, 1.0), n)
    assert pvalue < 1e-9


def test_seeded_determinism(tmp_path):
    topo = table_topology(tmp_path, 4)
    with Cascade.from_topology(topo) as c:
        a = [g.token_ids for g in c.generate([PROMPT] * 20, max_new_tokens=16, seed=5, temperature=1.0)]
        b = [g.token_ids for g in c.generate([PROMPT] * 20, max_new_tokens=16, seed=5, temperature=1.0)]
        other = [g.token_ids for g in c.generate([PROMPT] * 20, max_new_tokens=16, seed=6, temperature=1.0)]
    assert a == b
    assert a != other
