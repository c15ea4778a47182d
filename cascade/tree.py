"""Trees of drafted tokens: their one shape, check and depth convention, and the exact rule that
verifies them, as pure tensor functions (the argument is in docs/exactness.md, Trees).

A chain of drafts dies at its first rejection; a tree keeps the drafter's other candidates for
the same position alive, so one verifying pass can accept more. Names, by role, as in
:mod:`cascade.verify`:

- a tree is one sequence's drafted nodes, ``tokens`` and ``parents``: node ``i`` hangs below node
  ``parents[i]``, or below the root (:data:`ROOT`, the position right after the committed
  prefix); a parent comes before its children; siblings are tried in index order.
  :func:`check_tree` is the one check, for the engine's :class:`DraftTree` and the workers'
  ``workers.trees.as_tree`` (and so the Ray wire) alike.
- *depth*, the one convention: the length of a node's root-to-node path. The root has depth 0,
  its children depth 1. A node at depth ``d`` stands at position ``len(prefix) + d - 1`` (where
  its path, as a chain, puts it; ``workers.trees`` places nodes so), and the row scored after it
  predicts position ``len(prefix) + d``: the token emitted after ``d`` accepted tokens is
  emitted *at depth* ``d``, with the draw of that position. A tree drafted with widths
  ``[3, 2, 1]`` is 3 deep.
- ``target_probs [n + 1, vocab]``: the verifying level's rows, row 0 at the root and row
  ``1 + i`` after node ``i`` (one forward pass over the tree computes them all).

The rule, for candidates the drafter *chose* (its top-k, never sampled): the verifier draws its
own token from every row with the draw of the row's depth, under either coupling
(``Sampling.draw``); from the root the walk moves to the first child holding the verifier's token
and, at the first node where none does, emits that token (*bonus* where the node has no
children). The output is the verifier's own draws, cut where the walk stops, which only this
edge's drafts and draws decide: exact whatever the candidates.

Randomness is passed in, so the caller owns the generator. No models, no caches, no Ray here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from cascade.sampling import Sampling

ROOT = -1  # the parent of a depth-1 node: the position right after the committed prefix


def check_tree(tokens, parents) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(tokens, parents)`` as tuples of ints, checked: one-dimensional integer sequences or
    tensors of the same length, each parent :data:`ROOT` or an earlier node, tokens non-negative."""
    tokens, parents = _ints("tokens", tokens), _ints("parents", parents)
    if len(parents) != len(tokens):
        raise ValueError(f"parents must have one entry per node: {len(tokens)} tokens, {len(parents)} parents")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a node's parent must be ROOT (-1) or an earlier "
                             f"node (0..{i - 1})")
    if tokens and min(tokens) < 0:
        raise ValueError(f"tokens must be non-negative ids, got {list(tokens)}")
    return tokens, parents


def depths(parents: Sequence[int]) -> tuple[int, ...]:
    """Each node's depth (the module's convention: 1 for a child of the root), from checked parents."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent == ROOT else out[parent] + 1)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One sequence's drafted tree, checked (:func:`check_tree`) and its structure read once."""

    tokens: tuple[int, ...]  # [n]; sequences or tensors are taken and kept as tuples of ints
    parents: tuple[int, ...]  # [n]: ROOT (-1) or an index below the node's own
    depths: tuple[int, ...] = field(init=False, repr=False)  # each node's: 1 for the root's children
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # 0: the root's, 1 + i: node i's

    def __post_init__(self):
        tokens, parents = check_tree(self.tokens, self.parents)
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)
        for name, value in [("tokens", tokens), ("parents", parents), ("depths", depths(parents)),
                            ("_children", tuple(map(tuple, children)))]:
            object.__setattr__(self, name, value)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def row_depths(self) -> tuple[int, ...]:
        """The depth each row of ``target_probs`` predicts (0 for the root's row): the position,
        counted from the first position after the prefix, of the token drawn from it."""
        return (0, *self.depths)

    def children(self, node: int = ROOT) -> tuple[int, ...]:
        """A node's children (the root's for ``ROOT``), in the order they are tried."""
        return self._children[node + 1]

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root down to ``node``, ``node`` included (``()`` for ``ROOT``)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying one tree: keep the nodes of ``path``, then emit ``next_token``."""

    path: tuple[int, ...]  # the accepted nodes, root to leaf
    tokens: tuple[int, ...]  # their tokens
    next_token: int
    bonus: bool  # True: the walk reached a node with no children

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def emitted(self) -> tuple[int, ...]:
        """The tokens the level emits: the accepted path's, then the verifier's own at the end."""
        return (*self.tokens, self.next_token)

    @property
    def rows(self) -> tuple[int, ...]:
        """The rows of ``target_probs`` at the emitted positions: 0, then ``1 + i`` for ``i`` in the
        path. Each emitted token is an exact sample of its row given the tokens before it, so a
        level sends ``emitted`` up as a chain with these rows as its ``draft_probs``."""
        return (0, *(1 + i for i in self.path))


def walk_trees(
    sampling: Sampling,  # the verifier's: its coupling draws a token per row (greedy: the argmax)
    tokens: torch.Tensor,  # [batch, n] long; -1 past a tree's own nodes (trees of different sizes)
    parents: torch.Tensor,  # [batch, n] long: ROOT or an earlier node; ROOT past a tree's own nodes
    depths: torch.Tensor,  # [batch, n] long: each node's (DraftTree.depths); 0 past a tree's own nodes
    target_probs: torch.Tensor,  # [rows, vocab]: each tree's rows in turn, the root's then its nodes'
    draws: torch.Tensor,  # [batch, depth + 1]: each depth's draw (sampling.draws), to the deepest tree's
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # path [batch, n] bool, next_token [batch], bonus [batch]
    """The rule for a batch of trees, vectorised: the verifier's own token at every row, drawn
    with the draw of the row's depth, all in one ``sampling.draw``; then every tree's walk, a
    depth at a time: to the first child of its node holding the verifier's token there, or stop
    and emit that token. Inputs are trusted: :func:`verify_trees` checks and pads them."""
    batch, n = tokens.shape
    real = tokens >= 0
    rows = torch.cat([real.new_ones(batch, 1), real], 1)  # [batch, n + 1]: the root's and the nodes'
    mine = torch.full((batch, n + 1), -1, dtype=torch.long)  # the verifier's token at each row
    row_depths = torch.cat([depths.new_zeros(batch, 1), depths], 1)  # the root's row: depth 0
    mine[rows] = sampling.draw(target_probs, draws.gather(1, row_depths)[rows])
    above = parents + 1  # each node's parent's row
    holds = real & (tokens == mine.gather(1, above))  # the node holds the verifier's token at its parent
    at = torch.zeros(batch, dtype=torch.long)  # the walk's row (0: the root)
    path = torch.zeros(batch, n + 1, dtype=torch.bool)  # by row; the root's column is dropped
    for _ in range(int(depths.max()) if n else 0):
        here = holds & (above == at[:, None])  # at most the walk's node's children
        # the first of them (argmax takes the first maximum); where there is none, the walk stays
        at = torch.where(here.any(1), here.to(torch.uint8).argmax(1) + 1, at)
        path.scatter_(1, at[:, None], True)
    bonus = ~(real & (above == at[:, None])).any(1)  # the walk's node has no children
    return path[:, 1:], mine.gather(1, at[:, None])[:, 0], bonus


def verify_trees(
    sampling: Sampling,
    trees: Sequence[DraftTree],
    target_probs: Sequence[torch.Tensor],  # per tree [n + 1, vocab]
    draws: Sequence[torch.Tensor],  # per tree [max_depth + 1] at least: each depth's draw
) -> list[TreeVerdict]:
    """:func:`walk_trees` over the engine's trees: padded into one batch, checked, and each
    tree's outcome as a :class:`TreeVerdict`."""
    if not trees:
        return []
    n, deepest = max(t.size for t in trees), max(t.max_depth for t in trees)
    vocab = target_probs[0].shape[-1]
    padded = torch.zeros(len(trees), deepest + 1, dtype=draws[0].dtype)
    for b, (tree, row, draw) in enumerate(zip(trees, target_probs, draws, strict=True)):
        if row.shape != (tree.size + 1, vocab) or (tree.size and max(tree.tokens) >= vocab):
            raise ValueError(f"target_probs[{b}] must be [n + 1, vocab] = [{tree.size + 1}, {vocab}] (row 0 at the "
                             f"root, 1 + i after node i) over the tree's tokens, got shape {list(row.shape)}")
        if draw.shape[0] <= tree.max_depth:
            raise ValueError(f"draws[{b}] must hold a draw per depth 0..{tree.max_depth}, got {draw.shape[0]}")
        padded[b, :tree.max_depth + 1] = draw[:tree.max_depth + 1]
    tokens, parents, depths = (torch.tensor([[*getattr(t, name), *[pad] * (n - t.size)] for t in trees],
                                            dtype=torch.long)
                               for name, pad in [("tokens", -1), ("parents", ROOT), ("depths", 0)])
    path, next_token, bonus = walk_trees(sampling, tokens, parents, depths, torch.cat(list(target_probs)), padded)
    out = []
    for tree, on, token, leaf in zip(trees, path.tolist(), next_token.tolist(), bonus.tolist()):
        nodes = tuple(i for i in range(tree.size) if on[i])
        out.append(TreeVerdict(nodes, tuple(tree.tokens[i] for i in nodes), token, leaf))
    return out


def _ints(name: str, values) -> tuple[int, ...]:
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        return tuple(values)  # the workers' own lists: checked on every call, so without a tensor
    vector = torch.as_tensor(values)
    if vector.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional [n], got shape {list(vector.shape)}")
    if vector.numel() and (vector.is_floating_point() or vector.is_complex() or vector.dtype == torch.bool):
        raise ValueError(f"{name} must be integers, got {vector.dtype}")
    return tuple(vector.tolist())
