"""Trees through the engine: the path's first level drafts a tree of its top candidates, the next
level verifies it in one pass with the matching rule (cascade/tree.py), and the accepted path
goes on up as a chain. Greedy output is plain greedy decoding's token for token, on real
transformers models (random-init Llama levels), whatever the tree, the path and the batch."""
from __future__ import annotations

import pytest

from cascade import Cascade
from policies.fixed import FixedPolicy
from conftest import family_topology, write_topology
from hf_util import prompts_from_text, reference_greedy

TREES = [(1,), (2,), (3, 2, 1), (2, 2, 2, 2), (4, 1, 1, 1, 1)]


@pytest.fixture(scope="module")
def four(family, tmp_path_factory):
    names = ["tiny", "small", "medium", "large"]
    data = family_topology(family, names)
    data["edges"] = [[a, b] for i, a in enumerate(names) for b in names[i + 1:]]
    topo = write_topology(tmp_path_factory.mktemp("trees") / "t.yaml", data)
    with Cascade.from_topology(topo) as c:
        yield c


@pytest.mark.parametrize("widths", TREES, ids=lambda w: "x".join(map(str, w)))
def test_greedy_identity_with_a_tree_at_the_authority(four, family, tokenizer, widths):
    total = None
    for prompt in prompts_from_text(tokenizer, 4):
        policy = FixedPolicy(lookahead=4, path=["small", "large"], tree={"small": list(widths)})
        g = four.generate(prompt, max_new_tokens=40, temperature=0.0, policy=policy)
        assert g.token_ids == reference_greedy(family / "large", prompt, 40), (widths, prompt)
        total = g.stats if total is None else total.merge(g.stats)
    edge = total.edges["small->large"]
    assert edge.tree_nodes > 0 and edge.accepted > 0
    if max(widths) > 1:  # a second choice was taken somewhere: what a chain would have lost
        assert sum(edge.accepted_by_rank[1:]) > 0, edge.accepted_by_rank


@pytest.mark.parametrize("path", [["tiny", "small", "large"], ["tiny", "medium", "large"],
                                  ["tiny", "small", "medium", "large"]])
def test_greedy_identity_with_a_tree_below_a_middle_level(four, family, tokenizer, path):
    policy = FixedPolicy(lookahead={"tiny": 3, "small": 5, "medium": 7}, path=path, tree={"tiny": [3, 2, 1]})
    for prompt in prompts_from_text(tokenizer, 3):
        g = four.generate(prompt, max_new_tokens=40, temperature=0.0, policy=policy)
        assert g.token_ids == reference_greedy(family / "large", prompt, 40), (path, prompt)
        assert g.stats.edges[f"tiny->{path[1]}"].tree_nodes > 0


def test_greedy_identity_with_trees_in_a_batch(four, family, tokenizer):
    prompts = prompts_from_text(tokenizer, 5)
    policy = FixedPolicy(lookahead=4, path=["small", "large"], tree={"small": [3, 2, 2]})
    outs = four.generate(prompts, max_new_tokens=40, temperature=0.0, policy=policy, batch_size=5)
    for prompt, g in zip(prompts, outs):  # ragged prompts, each accepting its own path
        assert g.token_ids == reference_greedy(family / "large", prompt, 40)


def test_a_tree_for_an_unknown_level_or_the_authority_is_refused(four):
    from cascade.errors import RequestError

    with pytest.raises(RequestError, match="tree"):
        four.generate([5, 6, 7], max_new_tokens=4, policy=FixedPolicy(tree={"nope": [2]}))
    with pytest.raises(RequestError, match="tree"):
        four.generate([5, 6, 7], max_new_tokens=4, policy=FixedPolicy(tree={"large": [2]}))


def test_provenance_shows_the_branch_taken(four, tokenizer):
    policy = FixedPolicy(lookahead=4, path=["small", "large"], tree={"small": [3, 2, 1]})
    prompt = prompts_from_text(tokenizer, 1)[0]
    g = four.generate(prompt, max_new_tokens=30, temperature=0.0, policy=policy, provenance=True)
    steps = [s.to_dict() for s in g.provenance]
    trees = [b for s in steps for b in s["blocks"]]
    assert trees and all(b["proposer"] == "small" and b["candidates"] > 0 for b in trees)
    for b in trees:
        assert len(b["ranks"]) == b["accepted"] and all(0 <= r < 3 for r in b["ranks"])
    assert any(r > 0 for b in trees for r in b["ranks"])  # a second choice was taken somewhere
    for s in steps:  # accepted tokens are small's, the last of each step large's own
        accepted = s["blocks"][0]["accepted"]
        assert s["origins"][:accepted] == ["small"] * accepted and s["origins"][accepted] == "large"


def test_a_tree_is_bounded_in_size():
    """A request may name a tree (a policy spec over HTTP): its nodes per pass are bounded."""
    from policies import from_spec
    from policies.base import PolicyError

    with pytest.raises(PolicyError, match="more than 256 nodes"):
        from_spec("fixed:tree={small: [16, 16, 16]}")
    assert from_spec("fixed:tree={small: [4, 4, 4, 2]}").tree_param == {"small": (4, 4, 4, 2)}  # 212 nodes


def test_auto_chooses_between_chains_and_trees_with_greedy_identity(four, family, tokenizer):
    """`auto` prices its tree shapes beside the chain on every path whose first level can score,
    and its probes try each, measuring every edge of the path: greedy output stays plain
    decoding's whatever it chose."""
    from policies.adaptive import AutoPolicy

    class Recorded(AutoPolicy):
        def plan(self, ctx):
            p = super().plan(ctx)
            if len(p.path) > 1:
                drafted.append(bool(p.tree))
            return p

    drafted: list[bool] = []  # per drafting step: whether its first level drafted a tree
    policy = Recorded(warmup=2, probe_every=4, trees=[[2, 2, 1], [3, 1]])
    total = None
    for prompt in prompts_from_text(tokenizer, 4):
        g = four.generate(prompt, max_new_tokens=40, temperature=0.0, policy=policy)
        assert g.token_ids == reference_greedy(family / "large", prompt, 40), prompt
        total = g.stats if total is None else total.merge(g.stats)
    assert True in drafted and False in drafted  # trees and chains were drafted
    assert sum(e.tree_nodes for e in total.edges.values()) > 0
    # probes give a middle level room for the level below: each of the six edges was measured
    names = ["tiny", "small", "medium", "large"]
    edges = {f"{a}->{b}" for i, a in enumerate(names) for b in names[i + 1:]}
    assert edges <= {k for k, e in total.edges.items() if e.proposed > 0}, sorted(total.edges)
