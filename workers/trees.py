"""Trees of candidate tokens, as the workers see them: scoring all nodes in one pass, and what a
cache keeps of a scored tree afterwards.

A tree is ``(tokens, parents)``: node ``i`` holds ``tokens[i]`` and hangs below node
``parents[i]``, or below the root (the position after the committed sequence) where that is -1;
a parent comes before its children. A node at depth ``d`` (0 for a child of the root) stands
at position ``len(prefix) + d``: the position it would have on its root-to-node path as a chain.

One pass scores a tree by feeding its nodes as new positions after the uncached tail of the
prefix, with per-node position ids and an attention mask in which a node sees the prefix, its
ancestors and itself, nothing else. Its logits at a node are those of its root-to-node path as
a chain. The cache then holds the prefix and every node; the next call, which hands the whole
new sequence as always, *settles* the tree: the longest root-to-node path matching the new
sequence stays (its keys/values moved to the columns right after the prefix, where a chain
would have put them), every other node goes (:func:`accepted_path`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Tree = tuple[list[int], list[int]]  # (tokens, parents)


def as_tree(tree) -> Tree:
    """``(tokens, parents)`` as two lists of ints, checked: from a pair of tensors or sequences,
    or from anything with ``tokens`` and ``parents`` attributes (``cascade.tree.DraftTree``)."""
    tokens, parents = (tree.tokens, tree.parents) if hasattr(tree, "parents") else tree
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    parents = parents.tolist() if isinstance(parents, torch.Tensor) else [int(p) for p in parents]
    if len(tokens) != len(parents):
        raise ValueError(f"a tree has {len(tokens)} tokens but {len(parents)} parents")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}: a parent is -1 (the root) or an earlier node")
    return tokens, parents


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 0 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


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
    matched = [False] * len(tokens)
    depth = [0] * len(tokens)
    best, best_depth = -1, -1
    length = len(sequence)
    for i, (token, p) in enumerate(zip(tokens, parents)):
        if p >= 0 and not matched[p]:
            continue
        d = 0 if p < 0 else depth[p] + 1
        if base + d < length and sequence[base + d] == token:
            matched[i], depth[i] = True, d
            if d > best_depth:
                best, best_depth = i, d
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
