"""A level host's KV cache: its sequences' keys and values, rows x positions.

One interface (:class:`KVCache`) for the two ways :class:`~workers.hf.HFWorker` keeps them: the
pool, one batched cache whose rows are the sequences (:class:`workers.pool.Pool`), and a cache
per sequence (:class:`SeqCaches`). The engine says how many positions of each sequence the cache
still holds (:meth:`KVCache.hold`: a rejected block goes); a call hands each sequence's whole token
list, which continues what the cache holds: the cache appends the rest in one forward pass for all
the call's sequences, and answers the logits of the last positions asked for, on the host
(:func:`workers.base.host_logits`). A tree's nodes stay pending until the sequence's next call
settles them (:mod:`workers.trees`).
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from workers.base import host_logits
from workers.trees import Pending, accepted_path, window_mask
from workers.trees import positions as node_offsets  # a tree node's position after its prefix

# A worker's forward pass: (input_ids, position_ids, cache layers, valid [rows, columns], keep,
# among [rows, width, width]: a tree's mask over the new columns, or None) -> logits
# [rows, keep, vocab] of the last ``keep`` positions (HFWorker._logits).
Forward = Callable[..., torch.Tensor]
Trees = Sequence[tuple[list[int], list[int]]] | None  # per sequence (tokens, parents), or no trees


class KVCache(abc.ABC):
    """Sequences' keys and values, as far as the engine says they still hold (module docstring)."""

    features = None  # a feature head's FeatureStore (workers/features.py): each pass's rows go into it

    @abc.abstractmethod
    def score(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], num_positions: Sequence[int],
              trees: Trees = None) -> list[torch.Tensor]:
        """:meth:`Worker.score <workers.base.Worker.score>`: logits ``[num_positions[b], vocab]``;
        with ``trees`` (``num_positions`` all 1), ``[len(tokens_b) + 1, vocab]``: the root's row,
        then each node's (:meth:`Worker.score_tree <workers.base.Worker.score_tree>`)."""

    @abc.abstractmethod
    def hold(self, seq_ids: Sequence[str], held: Sequence[int]) -> None:
        """Keep each sequence's first ``held[b]`` positions (:meth:`Worker.hold <workers.base.Worker.hold>`)."""

    @abc.abstractmethod
    def release(self, seq_ids: Sequence[str]) -> None:
        """Forget these sequences."""


def move_columns(buffers: Sequence[torch.Tensor], moves: Sequence[tuple[int, int, int]]) -> None:
    """Copy cache columns in each of ``buffers`` ``[rows, heads, columns, head_dim]``, per move
    ``(row, src, dst)`` that row's column ``src`` to ``dst``: a settled path to its chain's place."""
    dev = buffers[0].device
    rr, s, d = (torch.tensor(x, device=dev) for x in zip(*moves))
    for buf in buffers:
        buf[rr, :, d] = buf[rr, :, s]


# -- cache layers over preallocated buffers -------------------------------------------------------

def buffer_layer(kbuf, vbuf, length: int):
    """A cache layer over preallocated buffers ``[rows, heads, capacity, head_dim]`` whose first
    ``length`` columns are in use: an update writes the new columns in place and returns views
    (transformers' DynamicLayer concatenates, copying the whole cache every step). Without
    buffers (None) it allocates them on its first update, ``capacity`` columns if set; past the
    capacity it grows them by doubling; :meth:`crop` moves its length back."""
    return _buffer_layer_class()(kbuf, vbuf, length)


@functools.cache
def _buffer_layer_class():
    # built on first use: importing transformers is left to the workers that need it
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):
        def __init__(self, kbuf, vbuf, length):
            super().__init__()
            self.compact_views = False
            self.kbuf, self.vbuf, self.length = kbuf, vbuf, length
            self.capacity = 0 if kbuf is None else kbuf.shape[2]
            self.is_initialized = kbuf is not None
            if kbuf is not None:
                self.device = kbuf.device
                self.keys, self.values = kbuf[:, :, :length], vbuf[:, :, :length]

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            if self.kbuf is None or end > self.capacity:  # the first pass (the pool's: at its capacity), or full
                self._grow(key_states, value_states, max(end, self.capacity if self.kbuf is None else 2 * self.capacity,
                                                         64))
            width = end - self.length
            self.kbuf.narrow(2, self.length, width).copy_(key_states)
            self.vbuf.narrow(2, self.length, width).copy_(value_states)
            self.length = end
            self.keys, self.values = self.kbuf.narrow(2, 0, end), self.vbuf.narrow(2, 0, end)
            if self.compact_views:  # attention reads a small contiguous copy faster than a strided view
                return self.keys.contiguous(), self.values.contiguous()
            return self.keys, self.values

        def _grow(self, key_states, value_states, capacity: int) -> None:
            # zeroed: a masked column still enters attention as 0 x value, so garbage (NaN) must not
            kbuf = key_states.new_zeros((*key_states.shape[:2], capacity, key_states.shape[-1]))
            vbuf = value_states.new_zeros((*value_states.shape[:2], capacity, value_states.shape[-1]))
            if self.kbuf is not None:
                kbuf.narrow(2, 0, self.length).copy_(self.kbuf.narrow(2, 0, self.length))
                vbuf.narrow(2, 0, self.length).copy_(self.vbuf.narrow(2, 0, self.length))
            self.kbuf, self.vbuf, self.capacity = kbuf, vbuf, capacity
            self.device, self.is_initialized = kbuf.device, True

        def get_seq_length(self) -> int:
            return self.length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def crop(self, tokens_to_remove: int) -> None:
            """Drop the last ``-tokens_to_remove`` columns (transformers' convention: negative);
            a solo sequence's rollback (the pool rolls rows back with its validity mask)."""
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative count of tokens to remove, not {tokens_to_remove}")
            if tokens_to_remove == 0 or self.kbuf is None:
                return
            self.length = max(0, self.length + tokens_to_remove)
            self.keys, self.values = self.kbuf.narrow(2, 0, self.length), self.vbuf.narrow(2, 0, self.length)

    return BufferLayer


def poolable(model) -> bool:
    """Whether the model's cache is plain full-attention dynamic layers, which buffers written in
    place replace (the pool, a solo sequence's growing cache); anything else (sliding windows,
    linear attention, encoder-decoder caches) keeps one DynamicCache per sequence."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - an exotic config: stay on the generic path
        return False
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def num_layers(model) -> int:
    from transformers import DynamicCache

    return len(DynamicCache(config=model.config).layers)


def growing_cache(model):
    """A solo sequence's cache: one :func:`buffer_layer` per decoder layer (what it saves:
    docs/engine.md, "Batches underneath"). The same keys and values, in the same order."""
    from transformers.cache_utils import Cache

    return Cache(layers=[buffer_layer(None, None, 0) for _ in range(num_layers(model))])


# -- a cache per sequence -------------------------------------------------------------------------

@dataclass
class _SeqCache:
    cache: object  # a transformers Cache: growing_cache's, or a DynamicCache
    length: int = 0  # the positions whose keys/values it holds
    # a scored tree whose nodes follow those positions in the cache, until the next call settles it
    tree: Pending | None = None


class SeqCaches(KVCache):
    """A cache of its own per sequence, by ``seq_id``: buffers that grow in place where the
    model's layers are plain full attention (:func:`growing_cache`), else a DynamicCache. One
    sequence runs on the worker's forward pass; several, on transformers' (:meth:`_batch`: the
    fallback for models the pool does not handle)."""

    def __init__(self, model: Any, device: torch.device, forward: Forward,
                 tree_attention: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]):
        # the worker's forward pass (HFWorker._logits); a tree's 4D mask for transformers' (_tree_attention)
        self.model, self.device, self.forward, self.tree_attention = model, device, forward, tree_attention
        self.growing = poolable(model)
        self.seqs: dict[str, _SeqCache] = {}

    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self.seqs.pop(s, None)

    def hold(self, seq_ids, held) -> None:
        for s, n in zip(seq_ids, held):
            entry = self.seqs.get(s)
            if entry is not None:
                if entry.tree is not None and n < entry.length:
                    self._settle(s, entry, None)  # rolled back past the tree's root
                self._crop(entry, n)

    def score(self, seq_ids, token_ids, num_positions, trees: Trees = None) -> list[torch.Tensor]:
        if len(seq_ids) == 1:
            return [self._one(seq_ids[0], list(token_ids[0]), num_positions[0], trees[0] if trees else None)]
        return self._batch(seq_ids, token_ids, num_positions, trees)

    def _one(self, seq_id: str, tokens: list[int], num_positions: int, tree=None) -> torch.Tensor:
        """One sequence on its own cache: its uncached tail, then a tree's nodes."""
        entry, fresh = self._reconcile(seq_id, tokens, num_positions)
        nodes, parents = tree if tree else ([], [])
        past, t, dev = entry.length, len(fresh), self.device
        new = torch.tensor([fresh + list(nodes)], dtype=torch.long, device=dev)
        positions = past + torch.tensor([list(range(t)) + [t + d for d in node_offsets(parents)]], device=dev)
        among = window_mask(t + len(nodes), t, parents)[None].to(dev) if nodes else None
        logits = self.forward(new, positions, entry.cache, None, num_positions + len(nodes), among)[0]
        if self.features is not None:
            self.features.record(seq_id, past, self.features.last[0], 0, t, tree)
        entry.length += t
        entry.tree = Pending(list(nodes), list(parents)) if nodes else None
        return host_logits(logits)

    def _batch(self, seq_ids, token_ids, num_positions, trees: Trees = None) -> list[torch.Tensor]:
        """One pass of transformers' forward over several sequences' caches left-padded to a common
        length (:meth:`_padded`: a DynamicCache copies the whole cache on every append anyway), new
        tokens right-padded, a mask hiding every pad, position ids per row; each row's new
        keys/values go to its own cache. A tree's nodes follow its row's tail, pending after."""
        rows = [self._reconcile(s, list(t), n) for s, t, n in zip(seq_ids, token_ids, num_positions)]
        news = [new + tree[0] for (_, new), tree in zip(rows, trees)] if trees else [new for _, new in rows]
        if trees:
            num_positions = [len(tree[0]) + 1 for tree in trees]
        pasts = [entry.length for entry, _ in rows]
        width, longest, batch, dev = max(len(new) for new in news), max(pasts), len(rows), self.device
        mask = torch.zeros(batch, longest + width, dtype=torch.long, device=dev)
        input_ids = torch.zeros(batch, width, dtype=torch.long, device=dev)
        for b, (new, past) in enumerate(zip(news, pasts)):
            mask[b, longest - past:longest + len(new)] = 1
            input_ids[b, :len(new)] = torch.tensor(new, dtype=torch.long)
        positions = torch.tensor(pasts, device=dev).unsqueeze(1) + torch.arange(width, device=dev)
        if trees:  # nodes at their own positions (workers.trees.positions); each sees the prefix and its ancestors
            among = torch.zeros(batch, width, width, dtype=torch.bool)
            for b, ((_, fresh), (tokens, parents)) in enumerate(zip(rows, trees)):
                t = len(fresh)
                among[b] = window_mask(width, t, parents)
                positions[b, t:t + len(tokens)] = pasts[b] + t + torch.tensor(node_offsets(parents), device=dev)
            mask = self.tree_attention(mask.bool(), among.to(dev), longest + width)
        cache = self._padded([entry for entry, _ in rows], pasts)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                         use_cache=True)
        results = []
        for b, ((entry, fresh), new, n) in enumerate(zip(rows, news, num_positions)):
            tree = trees[b] if trees and trees[b][0] else None
            if self.features is not None:  # row b's new tokens start the window
                self.features.record(seq_ids[b], pasts[b], self.features.last[b], 0, len(fresh), tree)
            for layer_idx, layer in enumerate(out.cache.layers):
                entry.cache.update(layer.keys[b:b + 1, :, longest:longest + len(new)],
                                   layer.values[b:b + 1, :, longest:longest + len(new)], layer_idx)
            entry.length += len(fresh)
            entry.tree = Pending(list(tree[0]), list(tree[1])) if tree else None
            results.append(host_logits(out.logits[b, len(new) - n:len(new)]))
        return results

    def _padded(self, entries: list[_SeqCache], pasts: list[int]):
        """A DynamicCache of these caches, each left-padded to the longest."""
        from transformers import DynamicCache

        longest = max(pasts)
        if not longest:
            return self._new_cache()
        template = next(entry.cache for entry, past in zip(entries, pasts) if past).layers

        def rows(i: int, kind: str) -> torch.Tensor:  # layer i's keys or values, every row left-padded
            return torch.cat([torch.nn.functional.pad(getattr(entry.cache.layers[i], kind) if past else
                                                      getattr(template[i], kind)[:, :, :0], (0, 0, longest - past, 0))
                              for entry, past in zip(entries, pasts)])

        data = [(rows(i, "keys"), rows(i, "values")) for i in range(len(template))]
        return DynamicCache(ddp_cache_data=data, config=self.model.config)

    def _new_cache(self):
        if self.growing:
            return growing_cache(self.model)
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _reconcile(self, seq_id: str, tokens: list[int], num_positions: int) -> tuple[_SeqCache, list[int]]:
        """The sequence's cache, which ``tokens`` continue (:meth:`hold`), its pending tree settled
        and cropped to leave the positions that need logits uncached, and the tokens still to feed."""
        if not 1 <= num_positions <= len(tokens):
            raise ValueError(f"num_positions={num_positions} for a sequence of {len(tokens)} tokens")
        entry = self.seqs.get(seq_id)
        if entry is None:
            entry = self.seqs[seq_id] = _SeqCache(self._new_cache())
        elif entry.tree is not None:
            self._settle(seq_id, entry, tokens)
        keep = min(entry.length, len(tokens) - num_positions)
        self._crop(entry, keep)
        return entry, tokens[keep:]

    @staticmethod
    def _crop(entry: _SeqCache, keep: int) -> None:
        if keep < entry.length:
            entry.cache.crop(keep - entry.length)
            entry.length = keep

    def _settle(self, seq_id: str, entry: _SeqCache, tokens: list[int] | None) -> None:
        """Resolve the tree scored last: keep the path ``tokens`` take through it
        (:func:`~workers.trees.accepted_path`; None: drop it), and so do the features."""
        tree, entry.tree = entry.tree, None
        base = entry.length
        path = [] if tokens is None else accepted_path(tree.tokens, tree.parents, tokens, base)
        moves = [(0, base + i, base + j) for j, i in enumerate(path) if i != j]
        if moves:
            move_columns([kv for layer in entry.cache.layers for kv in (layer.keys, layer.values)], moves)
        entry.cache.crop(len(path) - len(tree.tokens))
        entry.length += len(path)
        if self.features is not None:
            self.features.settle(seq_id, path)
