"""Exactness with a feature head: the first two tokens drawn through the real engine, with a head
drafting from the authority's features, follow the authority's own distribution, computed by
enumeration with plain forward passes — and a head whose ``Draft.probs`` are not what it sampled
from fails the same test.

The setup is the smallest honest one: a float64 Llama authority over 8 tokens (width 8, one
layer) and a head whose layer is a perturbed copy of the authority's, reading its features
(tests/head_util.py: it agrees with the authority often, not always, so blocks are accepted,
partly rejected and rejected, and the hand-off of real features after a rejection takes part).
Draws run 256 requests at a time, residual coupling (each request draws from its own generator,
so a batch gives the distribution of one request alone: tests/draws.py).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import workers.head
from cascade import Cascade
from conftest import make_llama, write_topology
from head_util import copy_head
from stats_util import chi_square_pvalue, total_variation

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)

VOCAB = 8
PROMPT = [1, 2, 3]
BATCH = 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-dist")
    auth = make_llama(root / "auth", VOCAB, seed=31, hidden=8, layers=1, logit_scale=15.0, dtype=torch.float64)
    make_llama(root / "small", VOCAB, seed=33, base=auth, noise=0.5, dtype=torch.float64)
    copy_head(auth, noise=0.2, seed=32, feature_weight=0.3).save_pretrained(root / "head")
    return root


def topology(root, path: list[str], tree: list[int] | None = None) -> str:
    levels = [{"name": "head", "kind": "head", "model": str(root / "head"), "features_of": "auth"}]
    levels += [{"name": n, "model": str(root / n), "dtype": "float64", "device": "cpu"} for n in path[1:]]
    lookahead = {"head": 3, "small": 3}
    params = {"lookahead": {n: lookahead[n] for n in path[:-1]}, **({"tree": {"head": tree}} if tree else {})}
    data = {"levels": levels, "policy": {"name": "fixed", "params": params}}
    return str(write_topology(root / f"{'-'.join(path)}{'-tree' if tree else ''}.yaml", data))


def stand_in_topology(root) -> str:
    """``ngram -> auth`` with the head standing in where prompt lookup finds no match (on the
    first token always: the prompt's last token appears once)."""
    levels = [{"name": "ngram", "kind": "ngram", "params": {"max_ngram": 1, "min_ngram": 1}},
              {"name": "head", "kind": "head", "model": str(root / "head"), "features_of": "auth"},
              {"name": "auth", "model": str(root / "auth"), "dtype": "float64", "device": "cpu"}]
    params = {"path": ["ngram", "auth"], "lookahead": {"ngram": 2, "head": 3}, "stand_in": {"ngram": "head"}}
    data = {"levels": levels, "edges": [["ngram", "auth"], ["head", "auth"]],
            "policy": {"name": "fixed", "params": params}}
    return str(write_topology(root / "stand-in.yaml", data))


def exact_pairs(model_dir) -> dict:
    """The authority's distribution of the first two tokens (T = 1), by enumeration."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
        second = torch.softmax(model(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1], -1)
    return {(a, b): float(first[a] * second[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


def draw(topo: str, n: int, seed: int, edge: str = "head->auth", also: list | None = None):
    """(counts of the first two tokens, proposed and accepted on ``edge``, second choices taken);
    ``also`` gets the proposed count on ``ngram->auth``."""
    with Cascade.from_topology(topo) as c:
        results = c.generate([PROMPT] * n, max_new_tokens=4, temperature=1.0, seed=seed, batch_size=BATCH,
                             coupling="residual")
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    if also is not None:
        also.append(sum(g.stats.edges["ngram->auth"].proposed for g in results if "ngram->auth" in g.stats.edges))
    edges = [g.stats.edges[edge] for g in results if edge in g.stats.edges]
    proposed, accepted = sum(e.proposed for e in edges), sum(e.accepted for e in edges)
    siblings = sum(sum(e.accepted_by_rank[1:]) for e in edges)  # a tree's second choices and below, taken
    return counts, proposed, accepted, siblings


def check(counts, expected, n, tv_bound):
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    tv = total_variation(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue, tv)
    assert tv < tv_bound, (stat, pvalue, tv)


def test_head_then_authority_is_exact(setup):
    """100k draws (about 130 s on one core of the development machine)."""
    n = 100_000
    counts, proposed, accepted, _ = draw(topology(setup, ["head", "auth"]), n, seed=1)
    assert 0.2 < accepted / proposed < 0.9  # the head drafts, the authority accepts some, rejects some
    check(counts, exact_pairs(setup / "auth"), n, 0.014)


def test_head_drafting_for_a_drafter_is_exact(setup):
    """head -> small -> auth: within a step the head drafts past the authority's features (the
    drafter's tokens), feeding its own predictions there."""
    n = 20_000
    counts, proposed, accepted, _ = draw(topology(setup, ["head", "small", "auth"]), n, seed=2, edge="head->small")
    assert proposed > n and 0 < accepted < proposed
    check(counts, exact_pairs(setup / "auth"), n, 0.03)


def test_a_heads_tree_is_exact(setup):
    """The head grows a tree of its top candidates (3 wide, then 2, then 1), the authority
    verifies it with the matching rule: 100k draws, second and third choices taken."""
    n = 100_000
    counts, proposed, accepted, siblings = draw(topology(setup, ["head", "auth"], tree=[3, 2, 1]), n, seed=4)
    assert siblings > n / 20 and 0 < accepted < proposed
    check(counts, exact_pairs(setup / "auth"), n, 0.014)


def test_a_heads_tree_without_the_residual_fails(setup, monkeypatch):
    """Its negative control: siblings tried against the unmodified row (tests/draws.py)."""
    import cascade.engine
    from draws import trees_without_residual

    monkeypatch.setattr(cascade.engine, "_tree_verdicts", trees_without_residual)
    n = 20_000
    counts, _, _, _ = draw(topology(setup, ["head", "auth"], tree=[3, 2, 1]), n, seed=5)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(setup / "auth"), n)
    assert pvalue < 1e-9


def misreport_head_probs(monkeypatch) -> None:
    """The head samples as before but reports uniform ``draft_probs``."""
    real = workers.head.HeadWorker.draft

    def misreported(self, *args, **kwargs):
        drafts = real(self, *args, **kwargs)
        for d in drafts:
            d.probs = torch.full_like(d.probs, 1.0 / d.probs.shape[-1])
        return drafts

    monkeypatch.setattr(workers.head.HeadWorker, "draft", misreported)


def test_draft_probs_that_are_not_what_the_head_sampled_from_fail(setup, monkeypatch):
    """The negative control: the head samples as before but reports uniform ``draft_probs``; the
    acceptance rule then favours the head's own likely tokens, and the same test fails decisively."""
    misreport_head_probs(monkeypatch)
    n = 20_000
    counts, _, _, _ = draw(topology(setup, ["head", "auth"]), n, seed=3)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(setup / "auth"), n)
    assert pvalue < 1e-9


def test_a_stand_in_for_prompt_lookup_is_exact(setup):
    """``ngram -> auth``, the head drafting where prompt lookup has nothing (every first token,
    and later ones without a 1-gram match), prompt lookup's one-hot blocks elsewhere: 100k draws."""
    n = 100_000
    ngram = []
    counts, proposed, accepted, _ = draw(stand_in_topology(setup), n, seed=6, also=ngram)
    assert proposed > n and 0 < accepted < proposed and ngram[0] > n / 10  # both propose
    check(counts, exact_pairs(setup / "auth"), n, 0.014)


def test_a_stand_in_that_misreports_its_draft_probs_fails(setup, monkeypatch):
    """Its negative control: the standing-in head reports uniform ``draft_probs``."""
    misreport_head_probs(monkeypatch)
    n = 20_000
    counts, _, _, _ = draw(stand_in_topology(setup), n, seed=7)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(setup / "auth"), n)
    assert pvalue < 1e-9
