"""Trees of candidate tokens, as the workers see them: scoring all nodes in one pass, and what a
cache keeps of a scored tree afterwards (docs/engine.md, "Scoring a tree of candidates").

A tree is ``(tokens, parents)``, checked and measured as :mod:`cascade.tree` says (a child of the
root has depth 1); a node at depth ``d`` stands at position ``len(prefix) + d - 1``, as on its
root-to-node path as a chain (:func:`positions`), and sees the prefix, its ancestors and itself
(:func:`ancestry`, the one builder of that mask). The next call settles a scored tree: the
longest root-to-node path its sequence continues stays, moved where a chain would have put it;
every other node goes (:func:`accepted_path`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cascade import tree as cascade_tree

Tree = tuple[list[int], list[int]]  # (tokens, parents)


def as_tree(tree) -> Tree:
    """``(tokens, parents)`` as two lists of ints, checked (:func:`cascade.tree.check_tree`): from a
    pair of tensors or sequences, or from anything with ``tokens`` and ``parents`` (a ``DraftTree``)."""
    tokens, parents = cascade_tree.check_tree(*((tree.tokens, tree.parents) if hasattr(tree, "parents") else tree))
    return list(tokens), list(parents)


def positions(parents: Sequence[int]) -> list[int]:
    """Each node's position counted from the first after the prefix: its depth - 1."""
    return [d - 1 for d in cascade_tree.depths(parents)]


def ancestry(parents: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` bool: ``[i, j]`` is True where node ``j`` is node ``i`` or one of its ancestors."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] |= seen[p]
    return seen


def window_mask(width: int, start: int, parents: Sequence[int]) -> torch.Tensor:
    """``[width, width]`` bool over a pass's new positions: causal, except that the tree's nodes,
    at ``[start, start + n)``, see among themselves only their ancestors and themselves."""
    mask = torch.ones(width, width, dtype=torch.bool).tril()
    n = len(parents)
    if n:
        mask[start:start + n, start:start + n] = ancestry(parents)
    return mask


def leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """The root-to-leaf paths (node indices), depth first, so that consecutive paths share their
    longest prefix; ``[[]]`` for an empty tree."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # last: the root's
    for i, p in enumerate(parents):
        children[p].append(i)
    paths: list[list[int]] = []
    stack: list[tuple[int, list[int]]] = [(-1, [])]
    while stack:
        node, path = stack.pop()
        kids = children[node]
        if not kids:
            paths.append(path)
        for child in reversed(kids):
            stack.append((child, path + [child]))
    return paths


def accepted_path(tokens: Sequence[int], parents: Sequence[int], sequence: Sequence[int], base: int) -> list[int]:
    """The nodes of the longest root-to-node path whose tokens continue ``sequence`` after its
    first ``base`` tokens (the prefix the tree was scored after), root first; the first such
    path where several are as long (siblings with the same token)."""
    matched, at, best = [False] * len(tokens), positions(parents), -1
    for i, (token, p) in enumerate(zip(tokens, parents)):
        if (p < 0 or matched[p]) and base + at[i] < len(sequence) and sequence[base + at[i]] == token:
            matched[i] = True
            if best < 0 or at[i] > at[best]:
                best = i
    path = []
    while best >= 0:
        path.append(best)
        best = parents[best]
    return path[::-1]


@dataclass
class Pending:
    """A scored tree still in a cache: its nodes in columns ``start .. start + n - 1``, node order,
    right after the prefix it was scored after."""

    tokens: list[int]
    parents: list[int]
    start: int = 0
