"""The exact rule for verifying a *tree* of drafted tokens, as pure tensor functions.

A chain of drafts dies at its first rejection; a tree keeps the drafter's other candidates for
the same position alive, so one verifying pass can accept more. The argument for each rule is
in docs/exactness.md (Trees). Names, by role, as in :mod:`cascade.verify`:

- a :class:`DraftTree` is one sequence's drafted nodes: ``tokens``, ``parents`` (:data:`ROOT`
  for a child of the root, the position right after the committed prefix; otherwise an earlier
  node) and ``draft_probs``, node ``i``'s row being the distribution its token was *really*
  drawn from. Siblings are tried in index order. For siblings drawn one after another without
  replacement (:func:`draw_siblings`) the ``k``-th one's row is the drafter's row with the
  earlier siblings removed and renormalised; with replacement, the drafter's row itself; for
  deterministic candidates (the drafter's top-k), one-hot.
- ``target_probs [n + 1, vocab]``: the verifying level's rows, row 0 at the root and row
  ``1 + i`` after node ``i`` (one forward pass over the tree computes them all).
- the *path*: the accepted nodes, root to leaf. Then one more token is emitted: *recovered*
  (drawn from the residual after the last sibling tried) or *bonus* (the walk reached a node
  with no children; drawn from its target row).
- a node's *depth* is the length of its root-to-node path (the root's children have depth 1),
  so the token emitted after ``d`` accepted tokens is emitted *at depth* ``d``.

Randomness is passed in, so the caller owns the generator. The uniforms' layout, the same for
:func:`verify_tree` and :func:`verify_tree_matching` (``DraftTree.uniform_count`` of them):
``uniforms[i]`` (``i < n``) is node ``i``'s acceptance draw, ``uniforms[n + d]`` draws the
token emitted at depth ``d``. The walk uses one emission draw (at the depth where it stops) and
the matching rule one per depth it reaches; each is fresh when it is used, since whether the
walk gets there depends on other draws only.

No models, no caches, no Ray here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from cascade.sampling import sample_with_uniform
from cascade.verify import Verdict, residual

ROOT = -1  # the parent of a depth-1 node: the position right after the committed prefix


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One sequence's drafted tree; node ``i``'s parent is ``ROOT`` or a node before ``i``.

    The structure (children, depths) is read once, when the tree is made and checked."""

    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long: ROOT (-1) or an index < the node's own
    draft_probs: torch.Tensor | None = None  # [n, vocab]; None: the candidates were chosen, not sampled

    # read from them by __post_init__:
    token_list: tuple[int, ...] = field(init=False, repr=False)
    parent_list: tuple[int, ...] = field(init=False, repr=False)
    depths: tuple[int, ...] = field(init=False, repr=False)  # each node's depth: 1 for the root's children
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self):
        tokens = _index_vector("tokens", self.tokens)
        parents = _index_vector("parents", self.parents)
        n = tokens.shape[0]
        if parents.shape[0] != n:
            raise ValueError(f"parents must have one entry per node: {n} tokens, {parents.shape[0]} parents")
        token_list, parent_list = tuple(tokens.tolist()), tuple(parents.tolist())
        children: list[list[int]] = [[] for _ in range(n + 1)]  # index 0: the root's, 1 + i: node i's
        depths: list[int] = []
        for i, parent in enumerate(parent_list):
            if not ROOT <= parent < i:
                raise ValueError(f"parents[{i}] = {parent}: a node's parent must be ROOT (-1) or an earlier "
                                 f"node (0..{i - 1})")
            children[parent + 1].append(i)
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        if n and min(token_list) < 0:
            raise ValueError(f"tokens must be non-negative ids, got {list(token_list)}")
        if self.draft_probs is not None:
            rows = self.draft_probs
            if rows.dim() != 2 or rows.shape[0] != n:
                raise ValueError(f"draft_probs must be [n, vocab] with n = {n}, got shape {list(rows.shape)}")
            if n and max(token_list) >= rows.shape[1]:
                raise ValueError(f"tokens must lie below the vocabulary size {rows.shape[1]}, got {list(token_list)}")
        for name, value in [("tokens", tokens), ("parents", parents), ("token_list", token_list),
                            ("parent_list", parent_list), ("_children", tuple(tuple(c) for c in children)),
                            ("depths", tuple(depths))]:
            object.__setattr__(self, name, value)

    @classmethod
    def chain(cls, tokens: torch.Tensor | Sequence[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A block as a tree: every node the only child of the one before."""
        n = len(tokens)
        return cls(torch.as_tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1), draft_probs)

    @property
    def size(self) -> int:
        return len(self.token_list)

    def children(self, node: int = ROOT) -> tuple[int, ...]:
        """A node's children (the root's for ``ROOT``), in the order they are tried."""
        return self._children[node + 1]

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def row_depths(self) -> tuple[int, ...]:
        """The depth each row of ``target_probs`` predicts (0 for the root's row): the position,
        counted from the first position after the prefix, of the token drawn from it."""
        return (0, *self.depths)

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root down to ``node``, ``node`` included (``()`` for ``ROOT``)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parent_list[node]
        return tuple(reversed(path))

    @property
    def uniform_count(self) -> int:
        """How many uniforms verifying this tree takes: one acceptance draw per node, then one
        emission draw per depth ``0..max_depth``."""
        return self.size + self.max_depth + 1


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying one tree: keep the nodes of ``path``, then emit ``next_token``."""

    path: tuple[int, ...]  # the accepted nodes, root to leaf
    tokens: tuple[int, ...]  # their tokens
    next_token: int
    bonus: bool  # True: the walk reached a node with no children; next_token is drawn from its target row

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def emitted(self) -> tuple[int, ...]:
        """The tokens the level emits: the accepted path's, then the recovered or bonus token."""
        return (*self.tokens, self.next_token)

    @property
    def rows(self) -> tuple[int, ...]:
        """The rows of ``target_probs`` at the emitted positions: 0, then ``1 + i`` for ``i`` in the path."""
        return (0, *(1 + i for i in self.path))

    def target_rows(self, target_probs: torch.Tensor) -> torch.Tensor:  # [n + 1, vocab] -> [accepted + 1, vocab]
        """The verifier's rows at the emitted positions: what each emitted token is an exact sample
        of, given the tokens before it (the recovered token too: a residual was its route, not its
        distribution). A level sends ``emitted`` up as a chain with these as its ``draft_probs``."""
        return target_probs[list(self.rows)]

    def as_verdict(self) -> Verdict:
        """The chain verdict this amounts to once the tree is flattened to its path."""
        return Verdict(self.accepted, self.next_token, self.bonus)


def draw_siblings(
    draft_probs: torch.Tensor,  # [..., vocab]: the drafter's row at the parent
    uniforms: torch.Tensor,  # [..., k]: one draw per sibling
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [..., k] long, draft_probs [..., k, vocab]
    """Draw ``k`` distinct siblings one after another, without replacement: the ``j``-th from the
    drafter's row with the first ``j - 1`` removed and renormalised. Returns the tokens and those
    rows (the first one the drafter's row itself): each token's ``draft_probs`` in a tree.

    Every row needs at least ``k`` tokens with mass (a sibling cannot be drawn from nothing).
    """
    k = uniforms.shape[-1]
    if k == 0:
        return (torch.zeros(draft_probs.shape[:-1] + (0,), dtype=torch.long),
                draft_probs.new_zeros(draft_probs.shape[:-1] + (0, draft_probs.shape[-1])))
    support = int((draft_probs > 0).sum(-1).min())
    if k > support:
        raise ValueError(f"cannot draw {k} distinct siblings from a row with {support} tokens of nonzero mass")
    rows, tokens = [draft_probs], []
    for j in range(k):
        if j:  # the row without the siblings drawn so far
            remaining = rows[-1].scatter(-1, tokens[-1].unsqueeze(-1), 0.0)
            rows.append(remaining / remaining.sum(-1, keepdim=True))
        tokens.append(sample_with_uniform(rows[-1], uniforms[..., j]))
    return torch.stack(tokens, -1), torch.stack(rows, -2)


def verify_tree(
    tree: DraftTree,  # draft_probs required
    target_probs: torch.Tensor,  # [n + 1, vocab]
    uniforms: torch.Tensor,  # [tree.uniform_count]: n acceptance draws, then one emission draw per depth
) -> TreeVerdict:
    """Verify a tree by recursive rejection sampling (docs/exactness.md, Trees).

    From the root, with ``row`` the verifier's row at the current node, try its children in
    order: accept child ``c`` with probability ``min(1, row[x_c] / draft_probs[c][x_c])`` and
    move to it (``row`` = the verifier's row after ``c``); on rejection replace ``row`` by the
    normalised residual ``max(0, row - draft_probs[c])`` and try the next sibling. After the last
    sibling is rejected, emit a recovered token from the residual; at a node with no children,
    a bonus token from its row. A chain gives :func:`cascade.verify.verify_block`'s verdict.
    """
    draft_probs = tree.draft_probs
    if draft_probs is None:
        raise ValueError("verify_tree needs the tree's draft_probs (deterministic candidates: verify_tree_matching)")
    _check_rows(tree, target_probs, draft_probs.shape[1])
    _check_uniforms(tree, uniforms)
    draws, tokens, n = uniforms.tolist(), tree.token_list, tree.size
    path: list[int] = []
    node = ROOT
    while True:
        row = emit_from = target_probs[node + 1]
        for child in tree.children(node):
            x = tokens[child]
            draft_row = draft_probs[child]
            draft_at = float(draft_row[x])
            # u < min(1, t/d)  <=>  u * d < t (as verify_block; a token of zero draft mass is rejected)
            if draft_at > 0 and draws[child] * draft_at < float(row[x]):
                break
            emit_from = residual(row, draft_row)
            row = emit_from / emit_from.sum()  # the next sibling is tested against a distribution
        else:  # every child rejected (recovered), or none to try (bonus)
            token = int(sample_with_uniform(emit_from, uniforms[n + len(path)]))
            return _verdict(tree, path, token)
        path.append(child)
        node = child


def verify_tree_matching(
    tree: DraftTree,  # draft_probs not needed
    target_probs: torch.Tensor,  # [n + 1, vocab]
    uniforms: torch.Tensor,  # [tree.uniform_count]: the layout of verify_tree (acceptance draws unused)
) -> TreeVerdict:
    """The rule for candidates chosen deterministically (the drafter's top-k): at each node the
    verifier draws its own token from its row with that depth's emission draw; if a child has
    that token, accept it (the first such) and go on, else emit the token. Equal in distribution
    to :func:`verify_tree` with one-hot draft rows, without touching a residual."""
    _check_rows(tree, target_probs, None)
    _check_uniforms(tree, uniforms)
    n = tree.size
    path, token = _follow(tree, lambda node, depth: int(sample_with_uniform(target_probs[node + 1],
                                                                            uniforms[n + depth])))
    return _verdict(tree, path, token)


def verify_tree_keyed(
    tree: DraftTree,  # draft_probs not needed
    target_tokens: torch.Tensor | Sequence[int],  # [n + 1]: the verifier's own keyed draw at the root and after each node
) -> TreeVerdict:
    """The keyed coupling (:func:`cascade.verify.verify_block_keyed` for trees): follow the child
    equal to the verifier's own draw (``sample_with_keys`` of the row, with the key of its
    position: ``tree.row_depths`` past the prefix); at the first node with none, emit that draw.
    The output is the verifier's own draws, whatever the tree."""
    target_tokens = [int(t) for t in target_tokens]
    if len(target_tokens) != tree.size + 1:
        raise ValueError(f"target_tokens must have n + 1 = {tree.size + 1} entries, got {len(target_tokens)}")
    path, token = _follow(tree, lambda node, depth: target_tokens[node + 1])
    return _verdict(tree, path, token)


def verify_tree_greedy(
    tree: DraftTree,  # draft_probs not needed
    target_probs: torch.Tensor,  # [n + 1, vocab]: greedy rows (one-hot) or logits
) -> TreeVerdict:
    """Greedy: follow the child equal to the verifier's argmax (the first one, as
    ``sampling_probs`` at temperature 0), then emit the argmax; :func:`verify_tree` with one-hot
    target rows gives the same."""
    _check_rows(tree, target_probs, None)
    argmaxes = target_probs.argmax(-1).tolist()
    path, token = _follow(tree, lambda node, depth: argmaxes[node + 1])
    return _verdict(tree, path, token)


# -- helpers ---------------------------------------------------------------------------------------

def _follow(tree: DraftTree, token_at: Callable[[int, int], int]) -> tuple[list[int], int]:
    """Walk down from the root: at each node the verifier's token is ``token_at(node, depth)``;
    move to the first child holding it, or stop there and return the path and that token."""
    tokens = tree.token_list
    path: list[int] = []
    node = ROOT
    while True:
        token = token_at(node, len(path))
        child = next((c for c in tree.children(node) if tokens[c] == token), None)
        if child is None:
            return path, token
        path.append(child)
        node = child


def _verdict(tree: DraftTree, path: list[int], token: int) -> TreeVerdict:
    tokens = tree.token_list
    return TreeVerdict(tuple(path), tuple(tokens[i] for i in path), token, not tree.children(path[-1] if path else ROOT))


def _index_vector(name: str, values) -> torch.Tensor:
    vector = torch.as_tensor(values)
    if vector.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional [n], got shape {list(vector.shape)}")
    if vector.numel() and (vector.is_floating_point() or vector.is_complex() or vector.dtype == torch.bool):
        raise ValueError(f"{name} must be integers, got {vector.dtype}")
    return vector.to(torch.long)


def _check_rows(tree: DraftTree, target_probs: torch.Tensor, vocab: int | None) -> None:
    n = tree.size
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1 or (vocab is not None and target_probs.shape[1] != vocab):
        want = f"[{n + 1}, {vocab if vocab is not None else 'vocab'}]"
        raise ValueError(f"target_probs must be [n + 1, vocab] = {want} (row 0 at the root, 1 + i after node i), "
                         f"got shape {list(target_probs.shape)}")
    if n and max(tree.token_list) >= target_probs.shape[1]:
        raise ValueError(f"tokens must lie below the vocabulary size {target_probs.shape[1]}, got {tree.token_list}")


def _check_uniforms(tree: DraftTree, uniforms: torch.Tensor) -> None:
    if uniforms.shape != (tree.uniform_count,):
        raise ValueError(f"uniforms must be [n + max_depth + 1] = [{tree.uniform_count}] (one acceptance draw per "
                         f"node, then one emission draw per depth), got shape {list(uniforms.shape)}")
