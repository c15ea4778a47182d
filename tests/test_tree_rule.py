"""cascade/tree.py: one tree's shape and check, and the rule the engine runs (``verify_trees``,
over ``walk_trees``).

Unit tests first: the structure and its checks (the same for the workers' ``as_tree``), forced
outcomes, the vectorised walk equal to a naive walk on ragged batches of random trees, which
draws a verdict uses, greedy and keyed. Then distributions, vectorised over 100k sequences: the
exact distribution of one tree's verdict, and rounds driven the way the engine drives the rule:
every round drafts the drafter's top-k tree from a known drafter table, the verifier's rows come
from a known target table, the emitted tokens are appended and the next round drafts from there,
until three tokens are out. Their joint distribution is compared with the target's, computed by
enumeration with an independent warping (stats_util.reference_warp). The tables' context is the
last two tokens, so a row taken from the wrong node shows: the rule fed its parents' rows, and
the rule drawing every depth with one draw, fail the same test (asserted).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from cascade.sampling import Sampling, position_keys, sample_with_keys, sampling_probs
from cascade.tree import ROOT, DraftTree, TreeVerdict, check_tree, verify_trees, walk_trees
from stats_util import chi_square_pvalue, reference_warp, total_variation
from workers.trees import as_tree, positions

V = 5
PROMPT = (0, 1)  # the committed prefix
LENGTH = 3  # emitted tokens whose joint distribution is compared
DRAWS = 100_000
TV_BOUND = 0.02  # measured under the exact rule: about 0.01 (T = 1, 125 cells) and 0.005 (warped, 27)
RESIDUAL, GREEDY = Sampling(temperature=1.0, coupling="residual"), Sampling(temperature=0.0)


def one_hot(tokens):
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), V).double()


def random_rows(g, *shape):
    return torch.softmax(torch.randn(*shape, V, generator=g, dtype=torch.float64) * 2, -1)


# -- the tree -------------------------------------------------------------------------------------

#        root
#       /    \
#     0:1    1:2          node:token; siblings in index order
#      |     /  \
#     2:3  3:0  4:4
#                 |
#                5:1
HAND_PARENTS = [ROOT, ROOT, 0, 1, 1, 4]
HAND_TOKENS = [1, 2, 3, 0, 4, 1]
HAND = DraftTree(HAND_TOKENS, HAND_PARENTS)


def test_tree_structure():
    assert HAND.size == 6 and HAND.tokens == tuple(HAND_TOKENS) and HAND.parents == tuple(HAND_PARENTS)
    assert HAND.children() == HAND.children(ROOT) == (0, 1)
    assert [HAND.children(i) for i in range(6)] == [(2,), (3, 4), (), (), (5,), ()]
    assert HAND.depths == (1, 1, 2, 2, 2, 3) and HAND.max_depth == 3
    assert HAND.row_depths == (0, 1, 1, 2, 2, 2, 3)
    assert positions(HAND_PARENTS) == [0, 0, 1, 1, 1, 2]  # where the workers put the nodes: depth - 1
    assert HAND.path(5) == (1, 4, 5) and HAND.path(2) == (0, 2) and HAND.path(ROOT) == ()
    from_tensors = DraftTree(torch.tensor(HAND_TOKENS), torch.tensor(HAND_PARENTS))
    assert from_tensors.tokens == HAND.tokens and from_tensors.parents == HAND.parents
    empty = DraftTree([], [])
    assert empty.size == 0 and empty.max_depth == 0 and empty.children() == ()


@pytest.mark.parametrize("tokens,parents,message", [
    ([1, 2], [ROOT, 1], r"parents\[1\] = 1: a node's parent must be ROOT \(-1\) or an earlier node \(0..0\)"),
    ([1, 2], [0, ROOT], r"parents\[0\] = 0"),
    ([1, 2], [ROOT, -2], r"parents\[1\] = -2"),
    ([1, 2], [ROOT], "parents must have one entry per node: 2 tokens, 1 parents"),
    ([[1, 2]], [[ROOT, 0]], r"tokens must be one-dimensional \[n\], got shape \[1, 2\]"),
    ([1.0, 2.0], [ROOT, 0], "tokens must be integers"),
    ([True, False], [ROOT, 0], "tokens must be integers"),
    ([1, -3], [ROOT, 0], "tokens must be non-negative ids"),
])
@pytest.mark.parametrize("check", [DraftTree, check_tree, lambda t, p: as_tree((t, p))],
                         ids=["DraftTree", "check_tree", "as_tree"])
def test_malformed_trees_are_refused_the_same_everywhere(check, tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        check(tokens, parents)


def test_verifying_refuses_mismatched_rows_and_draws():
    rows, draws = one_hot([0] * 7), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"target_probs\[0\] must be \[n \+ 1, vocab\] = \[7, 5\].*got shape \[6, 5\]"):
        verify_trees(RESIDUAL, [HAND], [rows[:6]], [draws])
    with pytest.raises(ValueError, match=r"target_probs\[0\] must be .* = \[7, 4\] .*over the tree's tokens"):
        verify_trees(RESIDUAL, [HAND], [rows[:, :4]], [draws])
    with pytest.raises(ValueError, match=r"draws\[1\] must hold a draw per depth 0..3, got 3"):
        verify_trees(RESIDUAL, [HAND, HAND], [rows, rows], [draws, draws[:3]])
    with pytest.raises(ValueError, match="zip"):
        verify_trees(RESIDUAL, [HAND, HAND], [rows], [draws, draws])


# -- forced outcomes -------------------------------------------------------------------------------

def test_the_walk_follows_the_verifiers_tokens_down_to_a_bonus():
    # root draws 2 (node 1), node 1 draws 4 (node 4), node 4 draws 1 (node 5), a leaf: bonus 3
    target = one_hot([2, 0, 4, 0, 0, 1, 3])
    for sampling in (GREEDY, RESIDUAL):
        verdict, = verify_trees(sampling, [HAND], [target], [torch.full((4,), 0.5, dtype=torch.float64)])
        assert verdict == TreeVerdict(path=(1, 4, 5), tokens=(2, 4, 1), next_token=3, bonus=True)
        assert verdict.accepted == 3 and verdict.emitted == (2, 4, 1, 3) and verdict.rows == (0, 2, 5, 6)


def test_the_walk_stops_at_the_first_node_without_the_verifiers_token():
    draws = [torch.zeros(4, dtype=torch.float64)] * 3
    none, one, empty = verify_trees(GREEDY, [HAND, HAND, DraftTree([], [])],
                                    [one_hot([0] * 7), one_hot([2, 0, 3, 0, 0, 0, 0]), one_hot([4])], draws)
    assert none == TreeVerdict(path=(), tokens=(), next_token=0, bonus=False)
    assert one == TreeVerdict(path=(1,), tokens=(2,), next_token=3, bonus=False)  # node 1's children both missed
    assert empty == TreeVerdict((), (), 4, True)


def test_of_siblings_with_one_token_the_first_is_taken():
    tree = DraftTree([3, 3, 1, 2], [ROOT, ROOT, 1, 0])
    verdict, = verify_trees(GREEDY, [tree], [one_hot([3, 2, 1, 4, 4])], [torch.zeros(3, dtype=torch.float64)])
    assert verdict == TreeVerdict(path=(0, 3), tokens=(3, 2), next_token=4, bonus=True)


# -- the vectorised walk is the naive one; which draws count -------------------------------------

def naive_verdict(tree: DraftTree, mine: list[int]) -> TreeVerdict:
    """The rule as a loop: at each node the verifier's token ``mine[node + 1]`` goes to the first
    child holding it, else is emitted."""
    path, node = [], ROOT
    while True:
        child = next((c for c in tree.children(node) if tree.tokens[c] == mine[node + 1]), None)
        if child is None:
            return TreeVerdict(tuple(path), tuple(tree.tokens[i] for i in path), mine[node + 1],
                               not tree.children(node))
        path.append(child)
        node = child


def random_tree(g, max_width=3, max_depth=4, distinct=True) -> DraftTree:
    """Each node down to ``max_depth`` gets 0..max_width children, distinct tokens or any."""
    tokens, parents, frontier = [], [], [(ROOT, 0)]
    while frontier:
        node, depth = frontier.pop(0)
        width = int(torch.randint(0, max_width + 1, (1,), generator=g)) if depth < max_depth else 0
        drawn = torch.randperm(V, generator=g)[:width] if distinct else torch.randint(0, V, (width,), generator=g)
        for token in drawn.tolist():
            frontier.append((len(tokens), depth + 1))
            tokens.append(token), parents.append(node)
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("coupling", ["residual", "gumbel"])
def test_a_ragged_batch_gives_the_naive_walks_verdicts(coupling):
    """300 random trees of every size (empty ones, repeated sibling tokens), in one call."""
    g = torch.Generator().manual_seed(0)
    sampling = Sampling(temperature=1.0, coupling=coupling)
    trees = [random_tree(g, distinct=bool(i % 2)) for i in range(300)]
    rows = [random_rows(g, t.size + 1) for t in trees]
    draws = [(torch.rand(t.max_depth + 1 + i % 3, generator=g, dtype=torch.float64) if coupling == "residual"
              else position_keys(i, range(t.max_depth + 1 + i % 3))) for i, t in enumerate(trees)]
    got = verify_trees(sampling, trees, rows, draws)
    lengths = Counter()
    for tree, row, draw, verdict in zip(trees, rows, draws, got):
        mine = sampling.draw(row, draw[list(tree.row_depths)]).tolist()  # each row with its depth's draw
        assert verdict == naive_verdict(tree, mine)
        lengths[verdict.accepted] += 1
    assert len(lengths) >= 3  # trees accepted 0, 1, 2, ... tokens


def test_only_the_draws_down_to_the_stopping_depth_count():
    """One draw per depth, of which the walk uses those down to where it stops: the others can
    change without changing the verdict (so each one it uses is fresh)."""
    g = torch.Generator().manual_seed(1)
    trees = [random_tree(g) for _ in range(300)]
    rows = [random_rows(g, t.size + 1) for t in trees]
    draws = [torch.rand(t.max_depth + 1, generator=g, dtype=torch.float64) for t in trees]
    verdicts = verify_trees(RESIDUAL, trees, rows, draws)
    mixed = [torch.cat([d[:v.accepted + 1], torch.rand(len(d) - v.accepted - 1, generator=g, dtype=torch.float64)])
             for d, v in zip(draws, verdicts)]
    assert verify_trees(RESIDUAL, trees, rows, mixed) == verdicts


def test_greedy_follows_the_argmax():
    g = torch.Generator().manual_seed(2)
    trees = [random_tree(g) for _ in range(200)]
    logits = [torch.randn(t.size + 1, V, generator=g, dtype=torch.float64).round() for t in trees]  # ties
    rows = [sampling_probs(x, 0.0) for x in logits]
    draws = [torch.rand(t.max_depth + 1, generator=g, dtype=torch.float64) for t in trees]
    for tree, x, verdict in zip(trees, logits, verify_trees(GREEDY, trees, rows, draws)):
        assert verdict == naive_verdict(tree, x.argmax(-1).tolist())  # the first argmax
        assert all(int(x[row].argmax()) == token for row, token in zip(verdict.rows, verdict.emitted))


def test_keyed_output_is_the_verifiers_own_draws_whatever_the_tree():
    """With position keys every emitted token is the one the verifier draws alone: a tree only
    decides how many of them one pass gets. Rows here come from a table on the last token."""
    table = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64), -1)
    g = torch.Generator().manual_seed(4)
    seed, start, last = 17, 9, 2
    keys = position_keys(seed, range(start, start + 5))
    alone, token = [], last
    for d in range(5):
        token = int(sample_with_keys(table[token], keys[d]))
        alone.append(token)
    trees = [random_tree(g) for _ in range(200)]
    keyed = Sampling(temperature=1.0, coupling="gumbel")
    verdicts = verify_trees(keyed, trees, [table[[last, *t.tokens]] for t in trees], [keys] * len(trees))
    for trial, (tree, verdict) in enumerate(zip(trees, verdicts)):
        assert list(verdict.emitted) == alone[:len(verdict.emitted)], trial
        assert verdict == naive_verdict(tree, sample_with_keys(table[[last, *tree.tokens]],
                                                               keys[list(tree.row_depths)]).tolist())
    assert len({v.accepted for v in verdicts}) >= 3  # trees accepted 0, 1, 2, ... of the verifier's draws


# -- distributions, vectorised over 100k sequences -----------------------------------------------------

def logits_table(seed: int, scale: float) -> torch.Tensor:  # [V * V, V]: a row per context (last two tokens)
    return torch.randn(V * V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


TARGET_LOGITS = logits_table(2, 2.0)
DRAFT_LOGITS = TARGET_LOGITS + logits_table(1, 0.7)  # a drafter that mostly agrees, as drafters do


def tree_parents(widths) -> list[int]:
    """The parents of a full tree, breadth first: every node at depth d has widths[d] children."""
    parents, level = [], [ROOT]
    for width in widths:
        next_level = []
        for parent in level:
            next_level += range(len(parents), len(parents) + width)
            parents += [parent] * width
        level = next_level
    return parents


def top_k_trees(widths, draft_rows):
    """The drafter's top-k tree after every context, as a batched drafter grows it (depth by depth):
    tokens [V * V, n] and each row's context [V * V, n + 1] (the last two tokens before it)."""
    context = torch.arange(V * V)
    tokens, row_contexts = [], [context[:, None]]
    for width in widths:
        drawn = draft_rows[context].topk(width, dim=-1).indices  # [..., width]
        context = (context % V).unsqueeze(-1) * V + drawn
        tokens.append(drawn.reshape(V * V, -1))
        row_contexts.append(context.reshape(V * V, -1))
    return torch.cat(tokens, 1), torch.cat(row_contexts, 1)


def exact_joint(temperature: float, top_k: int) -> dict:
    """The target's exact distribution of the first LENGTH tokens after PROMPT, by enumeration."""
    rows = [reference_warp(TARGET_LOGITS[c].tolist(), temperature, top_k, 1.0) for c in range(V * V)]
    return {(a, b, c): rows[PROMPT[0] * V + PROMPT[1]][a] * rows[PROMPT[1] * V + a][b] * rows[a * V + b][c]
            for a in range(V) for b in range(V) for c in range(V)}


def emitted_tokens(n: int, seed: int, widths, temperature: float, top_k: int, rule=walk_trees) -> Counter:
    """The first LENGTH tokens of ``n`` sequences after PROMPT, all continued together round after
    round: each drafts the top-k tree after its last two tokens, ``rule`` verifies them all
    (:func:`walk_trees`' signature) and each appends what it emitted."""
    g = torch.Generator().manual_seed(seed)
    sampling = Sampling(temperature=temperature, top_k=top_k, coupling="residual")
    target_rows = sampling_probs(TARGET_LOGITS, temperature, top_k)
    tree_tokens, row_contexts = top_k_trees(widths, sampling_probs(DRAFT_LOGITS, temperature, top_k))
    parents = torch.tensor(tree_parents(widths))
    depths = torch.tensor(DraftTree([0] * len(parents), parents).depths)
    seqs = torch.full((n, len(PROMPT) + LENGTH + len(widths)), -1)  # room for the last round's overshoot
    seqs[:, :len(PROMPT)] = torch.tensor(PROMPT)
    length = torch.full((n,), len(PROMPT))
    while bool((active := length < len(PROMPT) + LENGTH).any()):
        b = active.nonzero()[:, 0]
        context = seqs[b, length[b] - 2] * V + seqs[b, length[b] - 1]
        tokens = tree_tokens[context]
        draws = torch.rand(len(b), len(widths) + 1, generator=g, dtype=torch.float64)
        rows = target_rows[row_contexts[context]].reshape(-1, V)  # each tree's rows in turn
        path, next_token, _ = rule(sampling, tokens, parents.expand_as(tokens), depths.expand_as(tokens), rows, draws)
        accepted = path.sum(1)
        slots = torch.where(path, depths - 1, len(widths) + 1)  # a path node's token at its depth; others aside
        out = torch.full((len(b), len(widths) + 2), -1).scatter_(1, slots, tokens)
        out[torch.arange(len(b)), accepted] = next_token
        keep = torch.arange(len(widths) + 1) <= accepted[:, None]  # the path's tokens, then the next
        column = length[b, None] + torch.arange(len(widths) + 1)
        seqs[b[:, None].expand_as(column)[keep], column[keep]] = out[:, :-1][keep]
        length[b] += accepted + 1
    first = seqs[:, len(PROMPT):len(PROMPT) + LENGTH]
    codes, counts = torch.unique(first, dim=0, return_counts=True)
    return Counter({tuple(c): int(k) for c, k in zip(codes.tolist(), counts.tolist())})


@pytest.mark.parametrize("temperature,top_k,widths", [(1.0, 0, (2, 2, 2)), (0.7, 3, (3, 2, 1))],
                         ids=["T1", "T0.7-top3"])
def test_top_k_trees_emit_the_targets_joint_distribution(temperature, top_k, widths):
    counts = emitted_tokens(DRAWS, 11, widths, temperature, top_k)
    expected = exact_joint(temperature, top_k)
    stat, pvalue = chi_square_pvalue(counts, expected, DRAWS)
    tv = total_variation(counts, expected, DRAWS)
    assert pvalue > 1e-4 and tv < TV_BOUND, (stat, pvalue, tv)


def parents_rows(sampling, tokens, parents, depths, target_probs, draws):
    """A wrong rule: each node's row replaced by its parent's (an off-by-one depth)."""
    above = torch.cat([parents.new_zeros(len(parents), 1), parents + 1], 1)  # the root's row stays
    rows = target_probs.reshape(len(parents), -1, V).gather(1, above[..., None].expand(-1, -1, V))
    return walk_trees(sampling, tokens, parents, depths, rows.reshape(-1, V), draws)


def one_draw(sampling, tokens, parents, depths, target_probs, draws):
    """A wrong rule: every depth drawn with the root's draw (a draw used twice)."""
    return walk_trees(sampling, tokens, parents, depths, target_probs, draws[:, :1].expand_as(draws))


@pytest.mark.parametrize("rule", [parents_rows, one_draw], ids=["parents-rows", "one-draw"])
def test_wrong_rules_fail_the_same_bound(rule):
    """The negative controls, on the T = 1 case, with the same number of draws."""
    counts = emitted_tokens(DRAWS, 12, (2, 2, 2), 1.0, 0, rule)
    _, pvalue = chi_square_pvalue(counts, exact_joint(1.0, 0), DRAWS)
    assert pvalue < 1e-9


def exact_verdicts(tree: DraftTree, target_probs: torch.Tensor) -> dict:
    """The exact distribution of (path, next_token) of one tree, by enumeration: at each node the
    verifier's token y, drawn from its row, goes to the first child holding it or is emitted."""
    out = {}

    def visit(node, path, reach):
        holder = {}
        for child in tree.children(node):
            holder.setdefault(tree.tokens[child], child)
        for y, p in enumerate(target_probs[node + 1].tolist()):
            if y in holder:
                visit(holder[y], path + (holder[y],), reach * p)
            elif p > 0:
                out[(path, y)] = reach * p

    visit(ROOT, (), 1.0)
    return out


def test_one_trees_verdicts_follow_their_exact_distribution():
    """The drafter's 3-2-2 top-k tree after PROMPT, 100k draws: which node is accepted, which
    token is emitted, how often (89 cells)."""
    tokens, row_contexts = top_k_trees((3, 2, 2), sampling_probs(DRAFT_LOGITS, 1.0))
    context = PROMPT[0] * V + PROMPT[1]
    tree = DraftTree(tokens[context], tree_parents((3, 2, 2)))
    target = sampling_probs(TARGET_LOGITS, 1.0)[row_contexts[context]]
    draws = torch.rand(DRAWS, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    batch = torch.tensor(tree.tokens).expand(DRAWS, -1)
    path, next_token, _ = walk_trees(RESIDUAL, batch, torch.tensor(tree.parents).expand_as(batch),
                                     torch.tensor(tree.depths).expand_as(batch), target.repeat(DRAWS, 1), draws)
    codes, counts = torch.unique(torch.cat([path.long(), next_token[:, None]], 1), dim=0, return_counts=True)
    got = Counter({(tuple(i for i, on in enumerate(c[:-1]) if on), c[-1]): k
                   for c, k in zip(codes.tolist(), counts.tolist())})
    expected = exact_verdicts(tree, target)
    stat, pvalue = chi_square_pvalue(got, expected, DRAWS)
    assert pvalue > 1e-4 and total_variation(got, expected, DRAWS) < 0.015, (stat, pvalue)
