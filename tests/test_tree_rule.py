"""cascade/tree.py: the exact rule for a tree of drafts.

Unit tests first: the tree's structure and its checks, forced outcomes (near-one-hot rows and
hand-computed residuals), a chain giving verify_block's verdict, which draws a verdict uses,
greedy and keyed. Then distributions, 100k draws each, driven the way the engine will drive the
rule: every round drafts a tree from a known drafter table (width >= 2, depth 3, siblings drawn
without replacement with draw_siblings, or the drafter's top-k for the matching rule), the
verifier's rows come from a known target table, the emitted tokens are appended and the next
round drafts from there, until three tokens are out. Their joint distribution is compared with
the target's, computed by enumeration with an independent warping (stats_util.reference_warp).
The tables' context is the last two tokens, so a row taken from the wrong node shows. A rule
that skips the residual step, and the rule fed sibling rows the tokens were not drawn from, fail
the same test (asserted).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from cascade.sampling import position_keys, sample_with_keys, sample_with_uniform, sampling_probs
from cascade.tree import (ROOT, DraftTree, TreeVerdict, draw_siblings, verify_tree, verify_tree_greedy,
                          verify_tree_keyed, verify_tree_matching)
from cascade.verify import Verdict, verify_block
from stats_util import chi_square_pvalue, reference_warp, total_variation

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)

V = 5
BIG = 1e4
PROMPT = (0, 1)  # the committed prefix
LENGTH = 3  # emitted tokens whose joint distribution is compared
DRAWS = 100_000
TV_BOUND = 0.02  # measured under the exact rules: about 0.01 (T = 1, 125 cells) and 0.005 (warped, 27)


def u(*values):
    return torch.tensor(values, dtype=torch.float64)


def near_one_hot(argmaxes):
    """Target rows from +-large logits: one-hot in float64."""
    logits = torch.full((len(argmaxes), V), -BIG, dtype=torch.float64)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = BIG
    return torch.softmax(logits, -1)


def one_hot(tokens):
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), V).double()


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


def test_tree_structure():
    tree = DraftTree(HAND_TOKENS, HAND_PARENTS, one_hot(HAND_TOKENS))
    assert tree.size == 6 and tree.token_list == tuple(HAND_TOKENS)
    assert tree.children() == tree.children(ROOT) == (0, 1)
    assert [tree.children(i) for i in range(6)] == [(2,), (3, 4), (), (), (5,), ()]
    assert tree.depths == (1, 1, 2, 2, 2, 3) and tree.max_depth == 3
    assert tree.row_depths == (0, 1, 1, 2, 2, 2, 3)
    assert tree.path(5) == (1, 4, 5) and tree.path(2) == (0, 2) and tree.path(ROOT) == ()
    assert tree.uniform_count == 6 + 3 + 1
    chain = DraftTree.chain([4, 2, 2])
    assert chain.parent_list == (ROOT, 0, 1) and chain.depths == (1, 2, 3) and chain.draft_probs is None
    empty = DraftTree([], [])
    assert empty.size == 0 and empty.max_depth == 0 and empty.uniform_count == 1 and empty.children() == ()


@pytest.mark.parametrize("tokens,parents,draft_probs,message", [
    ([1, 2], [ROOT, 1], None, r"parents\[1\] = 1: a node's parent must be ROOT \(-1\) or an earlier node \(0..0\)"),
    ([1, 2], [0, ROOT], None, r"parents\[0\] = 0"),
    ([1, 2], [ROOT, -2], None, r"parents\[1\] = -2"),
    ([1, 2], [ROOT], None, "parents must have one entry per node: 2 tokens, 1 parents"),
    ([[1, 2]], [[ROOT, 0]], None, r"tokens must be one-dimensional \[n\], got shape \[1, 2\]"),
    ([1.0, 2.0], [ROOT, 0], None, "tokens must be integers"),
    ([1, -3], [ROOT, 0], None, "tokens must be non-negative ids"),
    ([1, 2], [ROOT, 0], torch.zeros(3, V), r"draft_probs must be \[n, vocab\] with n = 2, got shape \[3, 5\]"),
    ([1, 2], [ROOT, 0], torch.zeros(2, V, 1), r"draft_probs must be \[n, vocab\]"),
    ([1, V], [ROOT, 0], torch.zeros(2, V), "tokens must lie below the vocabulary size 5"),
])
def test_malformed_trees_are_refused(tokens, parents, draft_probs, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents, draft_probs)


def test_verifying_refuses_mismatched_rows_and_draws():
    tree = DraftTree(HAND_TOKENS, HAND_PARENTS, one_hot(HAND_TOKENS))
    rows, draws = near_one_hot([0] * 7), torch.zeros(10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"target_probs must be \[n \+ 1, vocab\] = \[7, 5\].*got shape \[6, 5\]"):
        verify_tree(tree, rows[:6], draws)
    with pytest.raises(ValueError, match=r"target_probs must be \[n \+ 1, vocab\] = \[7, 5\].*got shape \[7, 4\]"):
        verify_tree(tree, rows[:, :4], draws)
    with pytest.raises(ValueError, match=r"tokens must lie below the vocabulary size 4"):
        verify_tree_matching(tree, rows[:, :4], draws)
    with pytest.raises(ValueError, match=r"uniforms must be \[n \+ max_depth \+ 1\] = \[10\].*got shape \[7\]"):
        verify_tree(tree, rows, draws[:7])
    with pytest.raises(ValueError, match=r"uniforms must be .* = \[10\]"):
        verify_tree_matching(tree, rows, draws[:9])
    with pytest.raises(ValueError, match="verify_tree needs the tree's draft_probs"):
        verify_tree(DraftTree(HAND_TOKENS, HAND_PARENTS), rows, draws)
    with pytest.raises(ValueError, match=r"target_tokens must have n \+ 1 = 7 entries, got 6"):
        verify_tree_keyed(tree, [0] * 6)
    with pytest.raises(ValueError, match=r"target_probs must be \[n \+ 1, vocab\] = \[7, vocab\]"):
        verify_tree_greedy(tree, rows[:5])


# -- forced outcomes -------------------------------------------------------------------------------

def test_the_walk_follows_the_verifiers_tokens_down_to_a_bonus():
    # root wants 2 (node 0 rejected, node 1 accepted), node 1 wants 4 (node 3 rejected, node 4
    # accepted), node 4 wants 1 (node 5 accepted), node 5 is a leaf: bonus from its row (3)
    tree = DraftTree(HAND_TOKENS, HAND_PARENTS, one_hot(HAND_TOKENS))
    target = near_one_hot([2, 0, 4, 0, 0, 1, 3])
    verdict = verify_tree(tree, target, torch.full((10,), 0.5, dtype=torch.float64))
    assert verdict == TreeVerdict(path=(1, 4, 5), tokens=(2, 4, 1), next_token=3, bonus=True)
    assert verdict.accepted == 3 and verdict.emitted == (2, 4, 1, 3)
    assert verdict.as_verdict() == Verdict(3, 3, True)
    assert verdict.rows == (0, 2, 5, 6) and torch.equal(verdict.target_rows(target), target[[0, 2, 5, 6]])


def test_every_sibling_rejected_emits_from_the_residual():
    tree = DraftTree(HAND_TOKENS, HAND_PARENTS, one_hot(HAND_TOKENS))
    verdict = verify_tree(tree, near_one_hot([0, 0, 0, 0, 0, 0, 0]), torch.full((10,), 0.5, dtype=torch.float64))
    assert verdict == TreeVerdict(path=(), tokens=(), next_token=0, bonus=False)
    # one level down: node 1 accepted, both its children rejected, its own token 3 recovered
    verdict = verify_tree(tree, near_one_hot([2, 0, 3, 0, 0, 0, 0]), torch.full((10,), 0.5, dtype=torch.float64))
    assert verdict == TreeVerdict(path=(1,), tokens=(2,), next_token=3, bonus=False)


def test_an_empty_tree_emits_a_bonus_token_from_the_root_row():
    assert verify_tree(DraftTree([], [], torch.zeros(0, V)), near_one_hot([4]), u(0.3)) == \
        TreeVerdict((), (), 4, True)


def test_the_next_sibling_is_tested_against_the_normalised_residual():
    # Two siblings drawn without replacement from the drafter's row [.5, .3, .2, 0, 0]: token 0
    # (its row the drafter's), then token 2 (its row [0, .6, .4, 0, 0]). Target [.2, .5, .3, 0, 0].
    drafter = u(0.5, 0.3, 0.2, 0, 0)
    tokens, rows = draw_siblings(drafter, u(0.1, 0.9))
    assert tokens.tolist() == [0, 2]
    assert torch.allclose(rows, torch.stack([drafter, u(0, 0.6, 0.4, 0, 0)]))
    tree = DraftTree(tokens, [ROOT, ROOT], rows)
    target = torch.cat([u(0.2, 0.5, 0.3, 0, 0).unsqueeze(0), near_one_hot([3, 4])])
    # node 0: accepted iff u * 0.5 < 0.2, i.e. u < 0.4; then its row's bonus, 3
    assert verify_tree(tree, target, u(0.39, 0.99, 0.5, 0.5)).emitted == (0, 3)
    # rejected: residual [0, .2, .1] -> [0, 2/3, 1/3]; node 1 (token 2) accepted iff u * 0.4 < 1/3
    assert verify_tree(tree, target, u(0.41, 0.83, 0.5, 0.5)).emitted == (2, 4)
    # both rejected: residual max(0, [0, 2/3, 1/3] - [0, .6, .4]) = [0, 1/15, 0]: token 1 whatever the draw
    for emission in (0.0, 0.5, 0.999):
        assert verify_tree(tree, target, u(0.41, 0.84, emission, 0.5)) == TreeVerdict((), (), 1, False)


def test_a_degenerate_residual_falls_back_to_the_current_row():
    # a sibling whose draft row exceeds the target everywhere it has mass is rejected, and the
    # residual is then all zeros: the row it was tested against is used instead of NaN
    row = u(0.0, 0.5, 0.5, 0, 0)
    tree = DraftTree([1, 3], [ROOT, ROOT], torch.stack([row * 2, one_hot([3])[0]]))
    verdict = verify_tree(tree, torch.stack([row, row, row]), u(0.9, 0.5, 0.75, 0.5))
    assert verdict == TreeVerdict((), (), 2, False)


# -- equal to the chain rule; which draws count ----------------------------------------------------

def random_rows(g, n):
    return torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)


def test_a_chain_gives_verify_blocks_verdict():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        n = int(torch.randint(0, 6, (1,), generator=g))
        draft_probs, target_probs = random_rows(g, n), random_rows(g, n + 1)
        tokens = [int(torch.multinomial(draft_probs[j], 1, generator=g)) for j in range(n)]
        uniforms = torch.rand(n + 1, generator=g, dtype=torch.float64)
        chain = DraftTree.chain(tokens, draft_probs)
        # the tree's layout: n acceptance draws, then one emission draw per depth 0..n (all the same)
        tree_uniforms = torch.cat([uniforms[:n], uniforms[n:].expand(n + 1)])
        got = verify_tree(chain, target_probs, tree_uniforms)
        assert got.as_verdict() == verify_block(tokens, draft_probs if n else None, target_probs, uniforms), trial
        assert got.path == tuple(range(got.accepted)) and got.tokens == tuple(tokens[:got.accepted])


def grown_tree(g, max_width=3, max_depth=4):
    """A random tree: each node (down to max_depth) gets 0..max_width children drawn without
    replacement from a random drafter row; random target rows."""
    tokens, parents, rows = [], [], []
    frontier = [(ROOT, 0)]
    while frontier:
        node, depth = frontier.pop(0)
        if depth == max_depth:
            continue
        width = int(torch.randint(0, max_width + 1, (1,), generator=g))
        drawn, drawn_rows = draw_siblings(random_rows(g, 1)[0], torch.rand(width, generator=g, dtype=torch.float64))
        for token, row in zip(drawn.tolist(), drawn_rows):
            frontier.append((len(tokens), depth + 1))
            tokens.append(token), parents.append(node), rows.append(row)
    draft_probs = torch.stack(rows) if rows else torch.zeros(0, V, dtype=torch.float64)
    return DraftTree(tokens, parents, draft_probs), random_rows(g, len(tokens) + 1)


def test_only_the_stopping_depths_emission_draw_counts():
    """One emission draw per depth, but the walk uses the one where it stops (the matching rule
    those down to it): the others can change without changing the verdict."""
    g = torch.Generator().manual_seed(1)
    for trial in range(300):
        tree, target = grown_tree(g)
        uniforms = torch.rand(tree.uniform_count, generator=g, dtype=torch.float64)
        others = torch.rand(tree.uniform_count, generator=g, dtype=torch.float64)
        for rule in (verify_tree, verify_tree_matching):
            verdict = rule(tree, target, uniforms)
            used = tree.size + verdict.accepted
            kept = list(range(tree.size)) + list(range(tree.size, used + 1) if rule is verify_tree_matching else [used])
            mixed = others.clone()
            mixed[kept] = uniforms[kept]
            assert rule(tree, target, mixed) == verdict, (trial, rule.__name__)


def test_greedy_follows_the_argmax_as_one_hot_rows_do():
    g = torch.Generator().manual_seed(2)
    for trial in range(200):
        tree, target = grown_tree(g)
        logits = torch.randn(tree.size + 1, V, generator=g, dtype=torch.float64).round()  # ties: the first argmax
        greedy_rows = sampling_probs(logits, 0.0)
        uniforms = torch.rand(tree.uniform_count, generator=g, dtype=torch.float64)
        verdict = verify_tree_greedy(tree, greedy_rows)
        assert verdict == verify_tree(tree, greedy_rows, uniforms) == verify_tree_matching(tree, greedy_rows, uniforms)
        assert verdict == verify_tree_greedy(tree, logits)
        assert all(int(greedy_rows[row].argmax()) == token for row, token in zip(verdict.rows, verdict.emitted))


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
    lengths = Counter()
    for trial in range(200):
        tree, _ = grown_tree(g)
        # what the verifier draws at the root and after each node: the row of the node's token,
        # with the key of the position it predicts (tree.row_depths past the prefix)
        row_tokens = [last, *tree.token_list]
        target_tokens = [int(sample_with_keys(table[t], keys[d])) for t, d in zip(row_tokens, tree.row_depths)]
        verdict = verify_tree_keyed(tree, target_tokens)
        assert list(verdict.emitted) == alone[:len(verdict.emitted)], trial
        assert verdict.bonus == (not tree.children(verdict.path[-1] if verdict.path else ROOT))
        lengths[verdict.accepted] += 1
    assert len(lengths) >= 3  # trees accepted 0, 1, 2, ... of the verifier's draws


def test_keyed_forced():
    tree = DraftTree(HAND_TOKENS, HAND_PARENTS)
    assert verify_tree_keyed(tree, [2, 9, 4, 9, 9, 1, 0]) == TreeVerdict((1, 4, 5), (2, 4, 1), 0, True)
    assert verify_tree_keyed(tree, [1, 0, 4, 9, 9, 1, 0]) == TreeVerdict((0,), (1,), 0, False)


# -- draw_siblings --------------------------------------------------------------------------------

def test_draw_siblings_rows_are_the_conditionals_and_batch():
    g = torch.Generator().manual_seed(5)
    drafter = random_rows(g, 12).reshape(3, 4, V)
    tokens, rows = draw_siblings(drafter, torch.rand(3, 4, 3, generator=g, dtype=torch.float64))
    assert tokens.shape == (3, 4, 3) and rows.shape == (3, 4, 3, V)
    for i in range(3):
        for j in range(4):
            drawn = tokens[i, j].tolist()
            assert len(set(drawn)) == 3
            assert torch.equal(rows[i, j, 0], drafter[i, j])
            for k in range(1, 3):
                expected = drafter[i, j].clone()
                expected[drawn[:k]] = 0
                assert torch.allclose(rows[i, j, k], expected / expected.sum())
    empty_tokens, empty_rows = draw_siblings(drafter[0, 0], torch.zeros(0, dtype=torch.float64))
    assert empty_tokens.shape == (0,) and empty_rows.shape == (0, V)
    # the whole support can be drawn (the last sibling's row is then one-hot); one more cannot
    tokens, rows = draw_siblings(u(0.5, 0, 0.25, 0.25, 0), u(0.9, 0.9, 0.9))
    assert sorted(tokens.tolist()) == [0, 2, 3] and rows[2].tolist().count(1.0) == 1
    with pytest.raises(ValueError, match="cannot draw 4 distinct siblings from a row with 3 tokens of nonzero mass"):
        draw_siblings(u(0.5, 0, 0.25, 0.25, 0), u(0.1, 0.2, 0.3, 0.4))


def test_draw_siblings_is_sampling_without_replacement():
    drafter = u(0.4, 0.3, 0.15, 0.1, 0.05)
    n = 50_000
    tokens, _ = draw_siblings(drafter.expand(n, V), torch.rand(n, 2, generator=torch.Generator().manual_seed(6),
                                                               dtype=torch.float64))
    counts = Counter(map(tuple, tokens.tolist()))
    p = drafter.tolist()
    expected = {(a, b): p[a] * p[b] / (1 - p[a]) for a in range(V) for b in range(V) if a != b}
    _, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4 and total_variation(counts, expected, n) < 0.01


# -- the matching rule is RRS with one-hot draft rows --------------------------------------------------

def matching_verdicts(tree: DraftTree, target_probs: torch.Tensor) -> dict:
    """The exact distribution of (path, next_token) under the matching rule: at each node the
    verifier's token y, drawn from its row, goes to the first child holding it or is emitted."""
    out = {}

    def visit(node, path, reach):
        row = target_probs[node + 1].tolist()
        holder = {}
        for child in tree.children(node):
            holder.setdefault(tree.token_list[child], child)
        for y in range(V):
            if y in holder:
                visit(holder[y], path + (holder[y],), reach * row[y])
            elif row[y] > 0:
                out[(path, y)] = reach * row[y]

    visit(ROOT, (), 1.0)
    return out


def test_matching_equals_rejection_sampling_with_one_hot_rows():
    """On top-k trees (one-hot draft rows) both rules give the verdicts of the matching rule's
    exact distribution: which node is accepted, which token is emitted, how often."""
    draft_rows, target_rows = table_rows(1.0, 0)
    tokens, _, row_contexts = draft_trees(torch.tensor([context_of(PROMPT)]), (3, 2, 2), draft_rows, top_k_children)
    tree = DraftTree(tokens[0], tree_parents((3, 2, 2)), one_hot(tokens[0].tolist()))
    target = target_rows[row_contexts[0]]
    expected = matching_verdicts(tree, target)
    n = 20_000
    g = torch.Generator().manual_seed(7)
    for rule in (verify_tree, verify_tree_matching):
        uniforms = torch.rand(n, tree.uniform_count, generator=g, dtype=torch.float64)
        counts = Counter()
        for b in range(n):
            verdict = rule(tree, target, uniforms[b])
            counts[(verdict.path, verdict.next_token)] += 1
        stat, pvalue = chi_square_pvalue(counts, expected, n)
        # 89 cells: total variation about 0.018 under the exact rule at 20k draws
        assert pvalue > 1e-4 and total_variation(counts, expected, n) < 0.03, (rule.__name__, stat, pvalue)


# -- distributions through rounds of drafting and verifying ------------------------------------------

def logits_table(seed: int, scale: float) -> torch.Tensor:  # [V * V, V]: a row per context (last two tokens)
    return torch.randn(V * V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


TARGET_LOGITS = logits_table(2, 2.0)
DRAFT_LOGITS = TARGET_LOGITS + logits_table(1, 0.7)  # a drafter that mostly agrees, as drafters do


def context_of(last_two) -> int:
    return last_two[0] * V + last_two[1]


def table_rows(temperature: float, top_k: int, draft_temperature: float | None = None, draft_top_k: int | None = None):
    """The drafter's and the target's warped rows per context (the drafter's own sampling if given)."""
    draft = sampling_probs(DRAFT_LOGITS, temperature if draft_temperature is None else draft_temperature,
                           top_k if draft_top_k is None else draft_top_k)
    return draft, sampling_probs(TARGET_LOGITS, temperature, top_k)


def exact_joint(temperature: float, top_k: int) -> dict:
    """The target's exact distribution of the first LENGTH tokens after PROMPT, by enumeration."""
    rows = [reference_warp(TARGET_LOGITS[c].tolist(), temperature, top_k, 1.0) for c in range(V * V)]
    out = {}
    for a in range(V):
        for b in range(V):
            for c in range(V):
                out[(a, b, c)] = (rows[context_of(PROMPT)][a] * rows[context_of((PROMPT[1], a))][b]
                                  * rows[context_of((a, b))][c])
    return out


def tree_parents(widths) -> list[int]:
    """The parents of a full tree, breadth first: every node at depth d has widths[d] children."""
    parents, level = [], [ROOT]
    for width in widths:
        next_level = []
        for parent in level:
            for _ in range(width):
                next_level.append(len(parents))
                parents.append(parent)
        level = next_level
    return parents


def draft_trees(contexts, widths, draft_rows, children):
    """One full tree per context, all drafted together depth by depth (as a batched drafter
    would): ``children(rows [..., V], width) -> tokens [..., width], their draft rows or None``.
    Returns tokens [B, n], draft_probs [B, n, V] or None, and each target row's context [B, n + 1]."""
    batch = contexts.shape[0]
    context, last = contexts, contexts % V
    tokens, rows, row_contexts = [], [], [contexts.unsqueeze(1)]
    for width in widths:
        drawn, drawn_rows = children(draft_rows[context], width)
        context, last = last.unsqueeze(-1) * V + drawn, drawn
        tokens.append(drawn.reshape(batch, -1))
        rows.append(None if drawn_rows is None else drawn_rows.reshape(batch, -1, V))
        row_contexts.append(context.reshape(batch, -1))
    draft_probs = None if rows[0] is None else torch.cat(rows, 1)
    return torch.cat(tokens, 1), draft_probs, torch.cat(row_contexts, 1)


def top_k_children(rows, width):
    return rows.topk(width, dim=-1).indices, None


def emitted_tokens(n: int, seed: int, one_round) -> Counter:
    """The first LENGTH tokens of ``n`` sequences after PROMPT, each continued round after round:
    ``one_round(contexts [B], generator)`` drafts and verifies one tree per sequence and returns
    what each emitted."""
    g = torch.Generator().manual_seed(seed)
    sequences = [list(PROMPT) for _ in range(n)]
    active = list(range(n))
    while active:
        contexts = torch.tensor([context_of(sequences[i][-2:]) for i in active])
        for i, emitted in zip(active, one_round(contexts, g)):
            sequences[i].extend(emitted)
        active = [i for i in active if len(sequences[i]) < len(PROMPT) + LENGTH]
    return Counter(tuple(s[len(PROMPT):len(PROMPT) + LENGTH]) for s in sequences)


def sampled_rounds(widths, draft_rows, target_rows, rule, draw=draw_siblings):
    """Rounds on sampled trees: siblings drawn without replacement (``draw``), verified by ``rule``."""
    parents = torch.tensor(tree_parents(widths))

    def one_round(contexts, g):
        def sampled_children(rows, width):
            return draw(rows, torch.rand(*rows.shape[:-1], width, generator=g, dtype=torch.float64))

        tokens, draft_probs, row_contexts = draft_trees(contexts, widths, draft_rows, sampled_children)
        targets = target_rows[row_contexts]
        uniforms = torch.rand(len(contexts), len(parents) + len(widths) + 1, generator=g, dtype=torch.float64)
        return [rule(DraftTree(tokens[b], parents, draft_probs[b]), targets[b], uniforms[b]).emitted
                for b in range(len(contexts))]

    return one_round


def top_k_rounds(widths, draft_rows, target_rows):
    """Rounds on the drafter's top-k trees (deterministic: one per context), verified by the matching rule."""
    parents = torch.tensor(tree_parents(widths))
    tokens, _, row_contexts = draft_trees(torch.arange(V * V), widths, draft_rows, top_k_children)
    trees = [(DraftTree(tokens[c], parents), target_rows[row_contexts[c]]) for c in range(V * V)]

    def one_round(contexts, g):
        uniforms = torch.rand(len(contexts), len(parents) + len(widths) + 1, generator=g, dtype=torch.float64)
        return [verify_tree_matching(*trees[c], uniforms[b]).emitted for b, c in enumerate(contexts.tolist())]

    return one_round


def verify_tree_skipping_residual(tree, target_probs, uniforms):
    """A wrong rule: every sibling is tested against the verifier's unmodified row, and after the
    last rejection the token is drawn from that row too, not from the residual."""
    draws, tokens, n = uniforms.tolist(), tree.token_list, tree.size
    path, node = [], ROOT
    while True:
        row = target_probs[node + 1]
        for child in tree.children(node):
            draft_at = float(tree.draft_probs[child, tokens[child]])
            if draft_at > 0 and draws[child] * draft_at < float(row[tokens[child]]):
                break
        else:
            token = int(sample_with_uniform(row, uniforms[n + len(path)]))
            return TreeVerdict(tuple(path), tuple(tokens[i] for i in path), token, not tree.children(node))
        path.append(child)
        node = child


# temperature, top_k, the drafter's own (temperature, top_k) or None, widths per depth
CASES = [
    (1.0, 0, None, (2, 2, 2)),
    # the user's warping on the target; a drafter with its own (top-3 at T = 1): the root's three
    # siblings draw its whole support, the last with a one-hot row
    (0.7, 3, (1.0, 3), (3, 2, 2)),
]


@pytest.mark.parametrize("temperature,top_k,draft_sampling,widths", CASES, ids=["T1", "T0.7-top3"])
def test_sampled_trees_emit_the_targets_joint_distribution(temperature, top_k, draft_sampling, widths):
    rows = table_rows(temperature, top_k, *(draft_sampling or ()))
    counts = emitted_tokens(DRAWS, 10, sampled_rounds(widths, *rows, verify_tree))
    expected = exact_joint(temperature, top_k)
    stat, pvalue = chi_square_pvalue(counts, expected, DRAWS)
    tv = total_variation(counts, expected, DRAWS)
    assert pvalue > 1e-4 and tv < TV_BOUND, (stat, pvalue, tv)


@pytest.mark.parametrize("temperature,top_k,widths", [(1.0, 0, (2, 2, 2)), (0.7, 3, (3, 2, 1))],
                         ids=["T1", "T0.7-top3"])
def test_top_k_trees_under_the_matching_rule_emit_the_targets_joint_distribution(temperature, top_k, widths):
    counts = emitted_tokens(DRAWS, 11, top_k_rounds(widths, *table_rows(temperature, top_k)))
    expected = exact_joint(temperature, top_k)
    stat, pvalue = chi_square_pvalue(counts, expected, DRAWS)
    tv = total_variation(counts, expected, DRAWS)
    assert pvalue > 1e-4 and tv < TV_BOUND, (stat, pvalue, tv)


def siblings_reported_with_the_parents_row(draft_probs, uniforms):
    """A wrong drafter: siblings drawn without replacement, each reported with the drafter's row
    at the parent (the classic bug: a row the token was not drawn from)."""
    tokens, _ = draw_siblings(draft_probs, uniforms)
    return tokens, draft_probs.unsqueeze(-2).expand(*tokens.shape, draft_probs.shape[-1])


@pytest.mark.parametrize("rule,draw,draws", [
    (verify_tree_skipping_residual, draw_siblings, 20_000),
    (verify_tree, siblings_reported_with_the_parents_row, 50_000),
], ids=["skipping-the-residual", "unconditional-sibling-rows"])
def test_wrong_rules_fail_the_same_bound(rule, draw, draws):
    """The negative controls, on the T = 1 case: a rule that never takes the residual (fails by
    far), and the right rule fed rows the siblings were not drawn from (subtler: it needs more
    draws; at 100k the tests above reject it at p ~ 1e-54)."""
    counts = emitted_tokens(draws, 12, sampled_rounds((2, 2, 2), *table_rows(1.0, 0), rule, draw))
    _, pvalue = chi_square_pvalue(counts, exact_joint(1.0, 0), draws)
    assert pvalue < 1e-9
