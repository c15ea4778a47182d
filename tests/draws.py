"""Draws through the real engine over bigram-table workers, and what they must follow.

The exactness tests (test_distribution.py, test_distribution_policies.py, test_draft_vocab.py)
and the tests that pin behaviour on the same topologies (test_batch.py, test_provenance.py,
serve/test_serve_policies.py) share these: the topologies, the authority's exact distribution of
the first two tokens computed by enumeration, one function drawing them under either coupling,
and the wrong acceptance rules the negative controls put in the engine's place.
"""
from __future__ import annotations

from collections import Counter

from cascade import Cascade
from cascade.sampling import sample_with_uniform
from cascade.verify import Verdict
from conftest import write_topology
from stats_util import reference_warp
from table_worker import bigram_table

VOCAB = 6
SCALE = 2.0
PROMPT = [0]
# 4 new tokens with lookahead 3 at every level: every level of a 4-level path takes part.
MAX_NEW = 4
BATCH = 64

NGRAM_PROMPT = [0, 1, 2, 0, 1]
NGRAM_POLICY = {"name": "fixed", "params": {"lookahead": {"ngram": 3, "small": 3, "medium": 5}}}

# depth, temperature, top_k, top_p, draft sampling override: the cases drawn under each coupling
RESIDUAL_CASES = [
    (2, 1.0, 0, 1.0, None),
    (3, 0.8, 0, 0.9, None),
    (4, 1.0, 4, 1.0, None),
    (4, 1.0, 0, 0.85, {"temperature": 1.6}),
]
KEYED_CASES = [
    (4, 0.8, 4, 0.9, None),
    (2, 1.0, 0, 1.0, {"temperature": 0.0}),  # greedy drafts: still the authority's keyed samples
]


# trees (cascade/tree.py): (coupling, depth, temperature, top_k, widths at the path's first level);
# with MAX_NEW = 4 a tree is at most 3 deep
TREE_CASES = [
    ("residual", 2, 1.0, 0, [2, 2, 2]),
    ("residual", 3, 0.7, 3, [3, 2, 2]),  # tiny's tree verified by small, whose chain goes to large
    (None, 2, 0.8, 0, [3, 2, 2]),  # keyed: the seeded default
]


def tree_policy(depth: int, widths: list[int]) -> dict:
    first = ["tiny", "small", "medium", "large"][4 - depth]
    return {"name": "fixed", "params": {"lookahead": 3, "tree": {first: widths}}}


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
    """The authority's exact distribution of the first two tokens (a depth-level table topology)."""
    table = bigram_table(VOCAB, 10 + depth - 1, SCALE)  # the authority's table
    first = reference_warp(table[prompt[-1]].tolist(), temperature, top_k, top_p)
    out = {}
    for a in range(VOCAB):
        second = reference_warp(table[a].tolist(), temperature, top_k, top_p)
        for b in range(VOCAB):
            out[(a, b)] = first[a] * second[b]
    return out


def draw_pairs(topology: str, n: int, seed: int, coupling: str | None, prompt=PROMPT, max_new=MAX_NEW,
               **sampling) -> Counter:
    """The first two tokens of ``n`` seeded requests, drawn ``BATCH`` at a time.

    ``coupling=None`` takes the default path, where a seed alone selects the keyed coupling.
    Batched draws cost half as much, and under a fixed policy they are the distribution of one
    request alone too: each request draws from its own generator (residual) or its own keys
    (keyed), so its tokens depend on its seed, not its batch (test_batch.py and
    test_coupling.py pin batched == solo token for token).
    """
    with Cascade.from_topology(topology) as c:
        results = c.generate([prompt] * n, max_new_tokens=max_new, seed=seed, batch_size=BATCH, coupling=coupling,
                             **sampling)
    return Counter(tuple(g.token_ids[:2]) for g in results)


# -- wrong rules, for the negative controls -------------------------------------------------------

def verify_ignoring_draft_probs(draft_tokens, draft_probs, target_probs, uniforms):
    """A wrong residual rule: accept x_j with probability target[x_j] and resample from the target."""
    n = len(draft_tokens)
    for j, x in enumerate(draft_tokens):
        if not float(uniforms[j]) < float(target_probs[j][x]):
            return Verdict(j, int(sample_with_uniform(target_probs[j], uniforms[n])), False)
    return Verdict(n, int(sample_with_uniform(target_probs[n], uniforms[n])), True)


def per_row(rule):
    """A one-block rule (``verify_block``'s signature) in ``verify_blocks``' place, for the engine."""
    return lambda *rows: [rule(*row) for row in zip(*rows)]


def trees_without_residual(sampling, trees, target_probs, draws):
    """:func:`tree_without_residual` for a batch, in the engine's ``verify_trees``' place."""
    return [tree_without_residual(sampling, t, p, d) for t, p, d in zip(trees, target_probs, draws)]


def tree_without_residual(sampling, tree, target_probs, draws):
    """A wrong tree rule: try each child against the level's unmodified row with the depth's one
    draw (accept ``x`` if ``u < row[x]``) - no residual between siblings - and at the end draw
    from the unmodified row. A chain is verified right by it; siblings are not."""
    from cascade.tree import ROOT, TreeVerdict

    tokens, path, node = tree.tokens, [], ROOT
    while True:
        u, row = float(draws[len(path)]), target_probs[node + 1]
        child = next((c for c in tree.children(node) if u < float(row[tokens[c]])), None)
        if child is None:
            token = int(sample_with_uniform(row, draws[len(path)]))
            return TreeVerdict(tuple(path), tuple(tokens[i] for i in path), token, not tree.children(node))
        path.append(child)
        node = child


def accept_every_draft(draft_tokens, target_tokens):
    """A wrong keyed rule: keep the whole block, whatever the verifier would have sampled."""
    return Verdict(len(draft_tokens), int(target_tokens[len(draft_tokens)]), True)
