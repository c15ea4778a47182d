"""Exactness of sampling: the first two generated tokens, drawn through the real engine, follow
the authority's own warped distribution, computed by enumeration.

Table-driven workers (tests/table_worker.py: the real Worker interface over a bigram table)
make 100k draws cheap. The levels are peaked and disagree, so a wrong acceptance rule (one
that ignores draft_probs) fails the same bound — checked below.

The draws run 64 requests at a time: under a fixed policy a request's tokens depend only on its
seed, not on its batch (each request draws from its own generator; tests/test_batch.py pins
batched == solo token for token on each of these topologies), so this is the distribution of
one request alone too, at half the cost. The adaptive policies, whose batched decisions do
depend on the batch, are drawn one request at a time (test_distribution_policies.py).

They name ``coupling="residual"``: the speculative rule, which a request without a seed gets by
default (a seeded request gets the keyed coupling by default: tests/test_coupling.py draws it).
"""
from __future__ import annotations

from collections import Counter

import pytest

import cascade.engine
from cascade import Cascade
from cascade.verify import Verdict, sample_with_uniform
from conftest import write_topology
from stats_util import chi_square_pvalue, reference_warp, total_variation
from table_worker import bigram_table

VOCAB = 6
SCALE = 2.0
PROMPT = [0]
# 4 new tokens with lookahead 3 at every level: every level of a 4-level path takes part.
MAX_NEW = 4
BATCH = 64


def table_topology(tmp_path, depth: int, policy: dict | None = None, draft_sampling=None,
                   ngram: bool = False) -> str:
    names = ["tiny", "small", "medium", "large"][4 - depth:]
    levels = [{"name": "ngram", "kind": "ngram"}] if ngram else []
    for i, name in enumerate(names):
        level = {"name": name, "kind": "table_worker:TableWorker",
                 "params": {"vocab_size": VOCAB, "seed": 10 + i, "scale": SCALE}}
        if draft_sampling and name != "large":
            level["sampling"] = draft_sampling
        levels.append(level)
    data = {"levels": levels, "policy": policy or {"name": "fixed", "params": {"lookahead": 3}}}
    return str(write_topology(tmp_path / f"table{depth}.yaml", data))


def exact_pairs(depth: int, temperature: float, top_k: int, top_p: float, prompt=PROMPT) -> dict:
    table = bigram_table(VOCAB, 10 + depth - 1, SCALE)  # the authority's table
    first = reference_warp(table[prompt[-1]].tolist(), temperature, top_k, top_p)
    out = {}
    for a in range(VOCAB):
        second = reference_warp(table[a].tolist(), temperature, top_k, top_p)
        for b in range(VOCAB):
            out[(a, b)] = first[a] * second[b]
    return out


def draw_pairs(topology: str, n: int, seed: int, prompt=PROMPT, max_new=MAX_NEW, **sampling) -> Counter:
    with Cascade.from_topology(topology) as c:
        results = c.generate([prompt] * n, max_new_tokens=max_new, seed=seed, batch_size=BATCH, coupling="residual",
                             **sampling)
    return Counter(tuple(g.token_ids[:2]) for g in results)


NGRAM_PROMPT = [0, 1, 2, 0, 1]
NGRAM_POLICY = {"name": "fixed", "params": {"lookahead": {"ngram": 3, "small": 3, "medium": 5}}}

CASES = [
    # depth, temperature, top_k, top_p, draft sampling override
    (2, 1.0, 0, 1.0, None),
    (3, 0.8, 0, 0.9, None),
    (4, 1.0, 4, 1.0, None),
    (4, 1.0, 0, 0.85, {"temperature": 1.6}),
]


@pytest.mark.parametrize("depth,temperature,top_k,top_p,draft", CASES)
def test_joint_distribution_of_two_tokens_is_exact(tmp_path, depth, temperature, top_k, top_p, draft):
    n = 100_000
    counts = draw_pairs(table_topology(tmp_path, depth, draft_sampling=draft), n, seed=depth,
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


def _verify_ignoring_draft_probs(draft_tokens, draft_probs, target_probs, uniforms):
    """A wrong rule: accept x_j with probability target[x_j] and resample from the target."""
    n = len(draft_tokens)
    for j, x in enumerate(draft_tokens):
        if not float(uniforms[j]) < float(target_probs[j][x]):
            return Verdict(j, int(sample_with_uniform(target_probs[j], uniforms[n])), False)
    return Verdict(n, int(sample_with_uniform(target_probs[n], uniforms[n])), True)


def test_wrong_rule_fails_the_same_bound(tmp_path, monkeypatch):
    """The negative check: the same test with draft_probs ignored is rejected decisively."""
    monkeypatch.setattr(cascade.engine, "verify_block", _verify_ignoring_draft_probs)
    n = 30_000
    counts = draw_pairs(table_topology(tmp_path, 4), n, seed=99, temperature=1.0)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(4, 1.0, 0, 1.0), n)
    assert pvalue < 1e-9


def test_seeded_determinism(tmp_path):
    topo = table_topology(tmp_path, 4)
    with Cascade.from_topology(topo) as c:
        a = [g.token_ids for g in c.generate([PROMPT] * 20, max_new_tokens=16, seed=5, temperature=1.0)]
        b = [g.token_ids for g in c.generate([PROMPT] * 20, max_new_tokens=16, seed=5, temperature=1.0)]
        other = [g.token_ids for g in c.generate([PROMPT] * 20, max_new_tokens=16, seed=6, temperature=1.0)]
    assert a == b
    assert a != other
