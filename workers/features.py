"""A transformers worker's own hidden states, kept for a feature head (:mod:`workers.head`).

A feature is the last hidden state at a position (the LM head's input), or, for a head that fuses
layers (EAGLE-3, ``fuse_layers``), the inputs of those decoder layers side by side (layer ``k``'s
input: transformers' ``hidden_states[k]``). The level computes them anyway while it scores;
:class:`FeatureStore` keeps them per sequence, following the worker's KV cache by positions (row
``i``: the state after reading tokens ``0..i``), so handing them to the head costs no extra pass
and a rejected block leaves none behind (docs/engine.md, "Feature heads").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from workers.trees import accepted_path


@dataclass
class _Held:
    length: int = 0  # the positions whose features it holds
    rows: torch.Tensor | None = None  # [capacity, hidden]; rows [0, length) hold features
    # a scored tree's (tokens, parents, rows [n, hidden]) after those positions, until settled
    tree: tuple[list[int], list[int], torch.Tensor] | None = None


def check_layers(layers: Sequence[int] | None, num_layers: int) -> list[int] | None:
    """``layers`` (a head's ``fuse_layers``) as a list, each a decoder layer of a model of
    ``num_layers`` layers; a clear error otherwise."""
    if layers is None:
        return None
    layers = [int(k) for k in layers]
    if not layers or len(set(layers)) != len(layers) or not all(0 <= k < num_layers for k in layers):
        raise ValueError(f"fuse_layers {layers}: distinct decoder layers in 0..{num_layers - 1} (this model has "
                         f"{num_layers})")
    return layers


def capture_layer_inputs(model, layers: Sequence[int], capture: Callable[[torch.Tensor], None]) -> list:
    """Hooks on a transformers causal LM that call ``capture`` once per forward pass with the
    inputs of its decoder ``layers``, side by side ``[rows, width, len(layers) * hidden]``, as
    the lean forward's ``capture_layers`` does (:func:`workers.lean.lean_forward`). Returns the
    hook handles."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    taken: dict[int, torch.Tensor] = {}

    def take(k):
        def hook(module, args, kwargs):
            taken[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def done(module, args, output):
        if len(taken) == len(layers):
            capture(torch.cat([taken[k] for k in layers], dim=-1))
        taken.clear()

    handles = [body.layers[k].register_forward_pre_hook(take(k), with_kwargs=True) for k in layers]
    return handles + [body.register_forward_hook(done)]


class FeatureStore:
    """Per sequence: the feature at each position a worker has fed (``hidden_size`` wide: the
    features' width, several layers' hidden states where a head fuses them)."""

    def __init__(self, hidden_size: int, layers: Sequence[int] | None = None):
        self.hidden_size = hidden_size
        self.layers = None if layers is None else list(layers)  # None: the last hidden state
        self.seqs: dict[str, _Held] = {}
        self.last: torch.Tensor | None = None  # the hidden states of the pass that ran last

    def capture(self, hidden: torch.Tensor) -> None:
        """Called by the worker's forward pass with its features ``[rows, width, hidden_size]``
        (every position of the pass, pads included); the worker then :meth:`record`\\ s each row."""
        self.last = hidden.detach()

    @torch.inference_mode()  # the worker's passes make inference tensors
    def record(self, seq_id: str, past: int, hidden: torch.Tensor, start: int, fed: int,
               tree: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        """A pass fed ``fed`` positions after the first ``past`` (which the worker's cache held) and,
        with ``tree``, that tree's nodes after them, pending until settled: their features are rows
        ``start ..`` of ``hidden`` ``[width, hidden_size]`` (the sequence's row of :attr:`last`). A
        tree still pending here is one the cache dropped (it tells :meth:`settle` what it keeps)."""
        held = self.seqs.setdefault(seq_id, _Held())
        held.tree = None
        held.length = min(held.length, past)  # what the cache kept, it kept of these (hold)
        if held.length < past:
            # the cache holds positions the store never saw (features were asked for late): keep the
            # contiguous part; :meth:`HFWorker.features` recomputes the rest when asked
            return
        self._append(held, hidden[start:start + fed])
        if tree is not None and len(tree[0]):
            nodes = hidden[start + fed:start + fed + len(tree[0])]
            held.tree = (list(tree[0]), list(tree[1]), nodes.detach().clone())

    def settle(self, seq_id: str, path: Sequence[int]) -> None:
        """The tree scored last is settled: keep the features of its nodes ``path`` (root first),
        drop the others'."""
        held = self.seqs.get(seq_id)
        if held is not None and held.tree is not None:
            rows, held.tree = held.tree[2], None
            if len(path):
                self._append(held, rows[list(path)])

    @torch.inference_mode()
    def read(self, seq_id: str, token_ids: Sequence[int], start: int) -> torch.Tensor | None:
        """The features of positions ``start .. len(token_ids) - 2`` of ``token_ids`` (those that
        predicted its tokens after ``start``), or None where the store does not hold them all.
        A pending tree is settled against ``token_ids`` first."""
        held = self.seqs.get(seq_id)
        end = len(token_ids) - 1
        if end <= start:
            return torch.zeros(0, self.hidden_size) if held is None or held.rows is None else held.rows[:0].clone()
        if held is None:
            return None
        if held.tree is not None:  # scored last, the cache not called since: the path ``token_ids`` take
            tokens, parents, _ = held.tree
            self.settle(seq_id, accepted_path(tokens, parents, token_ids, held.length))
        if held.length < end:  # ``token_ids`` continue what it holds (hold)
            return None
        return held.rows[start:end].clone()

    def hold(self, seq_ids: Sequence[str], held: Sequence[int]) -> None:
        """:meth:`workers.kvcache.KVCache.hold`, for the features."""
        for s, n in zip(seq_ids, held):
            kept = self.seqs.get(s)
            if kept is not None:
                if kept.tree is not None and n < kept.length:
                    kept.tree = None
                kept.length = min(kept.length, n)

    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self.seqs.pop(s, None)

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _append(held: _Held, rows: torch.Tensor) -> None:
        n, add = held.length, rows.shape[0]
        if not add:
            return
        if held.rows is None or held.rows.shape[0] < n + add:  # grow geometrically: appends stay cheap
            grown = rows.new_zeros((max(2 * (n + add), 64), rows.shape[-1]))
            if held.rows is not None and n:
                grown[:n] = held.rows[:n]
            held.rows = grown
        held.rows[n:n + add] = rows
        held.length = n + add
