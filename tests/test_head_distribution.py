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

import pytest
import torch

from conftest import make_llama, write_topology
from head_util import VOCAB, check, copy_head, draw, exact_pairs, misreport_head_probs
from stats_util import chi_square_pvalue

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)



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

    monkeypatch.setattr(cascade.engine, "verify_trees", trees_without_residual)
    n = 20_000
    counts, _, _, _ = draw(topology(setup, ["head", "auth"], tree=[3, 2, 1]), n, seed=5)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(setup / "auth"), n)
    assert pvalue < 1e-9


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
