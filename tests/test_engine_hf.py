"""The engine over real transformers models (random-init, saved and reloaded from disk)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade import Cascade
from policies.fixed import FixedPolicy
from conftest import family_topology, make_llama, write_topology
from hf_util import prompts_from_text, reference_greedy
from stats_util import chi_square_pvalue, total_variation


# A level's block is built from blocks of the level below, so lookaheads rise toward the top.
LOOKAHEAD = {"tiny": 3, "small": 5, "medium": 7}


def lookahead(ngram: bool) -> dict:
    return {"ngram": 3, **LOOKAHEAD} if ngram else LOOKAHEAD


@pytest.mark.parametrize("ngram", [False, True], ids=["4level", "4level+ngram"])
def test_greedy_identity_with_authority_generate(family, tokenizer, tmp_path, ngram):
    topo = write_topology(tmp_path / "t.yaml", family_topology(
        family, ["tiny", "small", "medium", "large"], ngram=ngram,
        policy={"name": "fixed", "params": {"lookahead": lookahead(ngram)}}))
    prompts = prompts_from_text(tokenizer, 20)
    total = None
    with Cascade.from_topology(topo) as c:
        for prompt in prompts:
            g = c.generate(prompt, max_new_tokens=64, temperature=0.0)
            assert g.token_ids == reference_greedy(family / "large", prompt, 64), prompt
            total = g.stats if total is None else total.merge(g.stats)
    # the drafts really took part, and some of their tokens were rejected
    for edge in total.edges.values():
        assert edge.proposed > 0
    assert 0 < total.edges["medium->large"].accepted < total.edges["medium->large"].proposed
    assert total.tokens_per_authority_pass > 1.0
    if ngram:
        assert total.edges["ngram->tiny"].proposed > 0


def test_greedy_identity_on_every_path_shape(family, tokenizer, tmp_path):
    """A DAG with shortcut edges: each policy path gives the authority's tokens."""
    data = family_topology(family, ["tiny", "small", "medium", "large"])
    data["edges"] = [["tiny", "small"], ["small", "medium"], ["medium", "large"],
                     ["tiny", "large"], ["small", "large"]]
    topo = write_topology(tmp_path / "dag.yaml", data)
    prompt = tokenizer.encode("class Stack:\n")
    want = reference_greedy(family / "large", prompt, 40)
    with Cascade.from_topology(topo) as c:
        for path in (["tiny", "large"], ["small", "large"], ["tiny", "small", "large"],
                     ["tiny", "small", "medium", "large"], ["large"]):
            policy = FixedPolicy(lookahead=LOOKAHEAD, path=path)
            assert c.generate(prompt, max_new_tokens=40, policy=policy).token_ids == want, path


def test_the_policy_is_told_whether_a_step_samples(family, tokenizer, tmp_path):
    """Each plan and each step's feedback say whether the group samples, so that `auto` keeps
    greedy and sampled estimates apart: a sampled request leaves the greedy ones as they were.
    The feedback carries the sequence's share of the step's wall time too."""
    from policies.adaptive import AutoPolicy

    class Told(AutoPolicy):
        def plan(self, ctx):
            told.append(("plan", ctx.sampled))
            return super().plan(ctx)

        def observe(self, feedback):
            told.append(("observe", feedback.sampled))
            # and its share of the step's wall time, which holds the levels' passes
            assert feedback.seconds >= 0.999 * sum(feedback.level_seconds.values()) > 0
            super().observe(feedback)

    told: list[tuple[str, bool]] = []
    topo = write_topology(tmp_path / "t.yaml", family_topology(family, ["small", "large"]))
    prompt = tokenizer.encode("class Stack:\n")
    with Cascade.from_topology(topo) as c:
        policy = Told(warmup=1)
        c.generate(prompt, max_new_tokens=30, temperature=0.0, policy=policy)
        greedy, n = policy.estimates, len(told)
        before = {key: list(edge.seen) for key, edge in greedy.edges.items()}
        assert before and {sampled for _, sampled in told} == {False}
        c.generate(prompt, max_new_tokens=30, temperature=0.8, seed=3, policy=policy)
    assert told[n:] and {sampled for _, sampled in told[n:]} == {True}
    assert policy.estimates is not greedy and policy.estimates.edges
    assert {key: list(edge.seen) for key, edge in greedy.edges.items()} == before


@pytest.fixture(scope="module")
def peaked_family(tmp_path_factory):
    """Three levels over an 8-token vocabulary with sharp, disagreeing distributions."""
    root = tmp_path_factory.mktemp("peaked")
    for i, name in enumerate(["tiny", "small", "large"]):
        make_llama(root / name, 8, seed=20 + i, hidden=16, layers=1 + (name == "large"),
                   logit_scale=60.0, dtype=torch.float64)
    return root


def exact_pairs_hf(model_dir, prompt, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [a] for a in range(8)])
        second = torch.softmax(model(seqs).logits[:, -1] / temperature, -1)
    return {(a, b): float(first[a] * second[a, b]) for a in range(8) for b in range(8)}


def test_hf_three_levels_joint_distribution(peaked_family, tmp_path):
    data = {"levels": [{"name": n, "model": str(peaked_family / n), "dtype": "float64", "device": "cpu"}
                       for n in ["tiny", "small", "large"]],
            "policy": {"name": "fixed", "params": {"lookahead": 3}}}
    topo = write_topology(tmp_path / "peaked.yaml", data)
    prompt = [1, 2, 3]
    n = 3000
    with Cascade.from_topology(topo) as c:
        results = c.generate([prompt] * n, max_new_tokens=4, temperature=1.0, seed=0)
        edges = Counter()
        for g in results:
            for key, e in g.stats.edges.items():
                edges[key] += e.proposed - e.accepted
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    expected = exact_pairs_hf(peaked_family / "large", prompt, 1.0)
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue)
    assert total_variation(counts, expected, n) < 0.05
    assert all(rejections > 100 for rejections in edges.values()), edges  # the levels disagree
