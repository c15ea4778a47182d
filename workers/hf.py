"""A worker for any transformers causal LM, with its sequences' KV caches in one batched cache.

Every call reconciles a sequence's cache with the tokens it is handed: keep the longest common
prefix, roll back the rest, prefill what is new. Rejected drafts therefore roll back by themselves.

The sequences a worker scores live as rows of one persistent batched cache, the pool
(:class:`workers.pool.Pool`: preallocated buffers written in place, rows rolled back by a
validity mask). A solo sequence keeps a cache of its own until it is batched (buffers that
grow in place, :func:`workers.pool.growing_cache`), and a model whose cache layout the pool does
not handle keeps a DynamicCache per sequence
(:meth:`HFWorker._score_batch`).

A tree of candidate tokens (:meth:`HFWorker.score_tree`) is scored in one forward pass on all
three: its nodes are fed after the prefix's uncached tail with a tree attention mask and
per-node position ids, and stay in the cache until the next call keeps the path that call's
sequence took and drops the rest (:mod:`workers.trees`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from workers.base import Worker, common_prefix, host_logits
from workers.devices import resolve_device, resolve_dtype
from workers.draft_vocab import DraftVocab
from workers.features import FeatureStore, capture_layer_inputs, check_layers
from workers.lean import attention_mask, batch_invariant_setting, lean_forward
from workers.pool import Pool, growing_cache, poolable
from workers.trees import Pending, accepted_path, as_tree, depths, window_mask


@dataclass
class _SeqCache:
    cache: object  # a transformers Cache: growing_cache's, or a DynamicCache
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys/values it holds
    # a scored tree whose nodes follow ``tokens`` in the cache, until the next call settles it
    tree: Pending | None = None


class HFWorker(Worker):
    def __init__(
        self,
        model,  # a name or path (loaded here), or an already-loaded transformers model
        dtype: str = "float32",
        device: str = "auto",
        trust_remote_code: bool = False,
        lean: bool = True,
        gguf_file: str | None = None,
        packed_weights: bool = True,
        batch_invariant: bool | str = False,
        quantize: str | None = None,
        *,
        draft_vocab: DraftVocab | None = None,  # a loaded model's trimmed vocabulary (a name's is read beside it)
        quantized=None,  # a loaded model's workers.quant.Quantizer
    ):
        self.device = resolve_device(str(device))
        if isinstance(model, (str, os.PathLike)):
            name = str(model)
            model = _load(name, resolve_dtype(dtype, self.device), trust_remote_code, gguf_file).to(self.device)
            if draft_vocab is None and not gguf_file:
                draft_vocab = DraftVocab.load(name)
            if quantize is not None:  # products from quantized weights (workers/quant.py)
                from workers.quant import Quantizer

                quantized = Quantizer.build(model.eval(), quantize, name, gguf_file)
        elif quantize is not None:
            raise ValueError("quantize: needs the model's name or path (a loaded model takes `quantized`)")
        self.model = model.to(self.device).eval()
        self._setup(lean, draft_vocab, packed_weights, quantized, batch_invariant)

    def _setup(self, lean: bool, draft_vocab: DraftVocab | None, packed_weights: bool, quantized,
               batch_invariant: bool | str) -> None:
        # A trimmed drafter (workers.draft_vocab) is fed draft ids and answers authority-width rows.
        self.draft_vocab = draft_vocab
        rows = int(self.model.get_output_embeddings().weight.shape[0])
        if draft_vocab is not None and draft_vocab.size != rows:
            raise ValueError(f"draft_vocab.json lists {draft_vocab.size - 1} tokens + OTHER but the model "
                             f"has {rows} output rows")
        self.vocab_size = draft_vocab.authority_vocab_size if draft_vocab is not None else rows
        # on the host, where the logits come back (Worker.draft)
        self.draft_columns = draft_vocab.columns if draft_vocab is not None else None
        self.context_length = getattr(self.model.config, "max_position_embeddings", None)
        self._caches: dict[str, _SeqCache] = {}
        self._pool: Pool | bool | None = None  # None: not decided yet; False: per-sequence caches
        # transformers' forward minus its per-call plumbing, where the model is one it knows
        # (packed_weights: float32 products on a CPU from copies laid out for them, workers/lean.py)
        self._pack = None if packed_weights else False
        # a position's logits whatever the pass's width and rows (topology batch_invariant; workers/lean.py)
        self._invariant = batch_invariant_setting(batch_invariant, self.model)
        self._quantized = quantized
        self.lean = (lean_forward(self.model, pack=self._pack, quantized=quantized,
                                  batch_invariant=self._invariant) if lean else None)
        if self._invariant and self.lean is None:
            raise ValueError("batch_invariant: the level's model is not one the lean forward runs "
                             "(workers/lean.py), which batch invariance needs")
        if quantized is not None:
            if self.lean is None:
                raise ValueError("quantize: the level's model is not one the lean forward runs "
                                 "(workers/lean.py), which quantized products need")
            quantized.measure()
        self._trees: str | None | bool = False  # how trees are masked (see _tree_support); False: not decided
        self._features: FeatureStore | None = None  # the last hidden states, kept once a head reads them

    @classmethod
    def from_model(cls, model, device: str | None = None, lean: bool = True,
                   draft_vocab: DraftVocab | None = None, packed_weights: bool = True,
                   quantized=None) -> "HFWorker":
        """Wrap an already-loaded model (tests, notebooks), on its own device unless ``device``
        says otherwise; ``quantized``: a :class:`workers.quant.Quantizer` of it."""
        return cls(model, device=device or next(model.parameters()).device, lean=lean,
                   packed_weights=packed_weights, draft_vocab=draft_vocab, quantized=quantized)

    def keep_features(self, layers: Sequence[int] | None = None) -> None:
        """From now on keep the last hidden state (the LM head's input) at every position each pass
        computes, per sequence, for a feature head to read (:meth:`features`); with ``layers``
        (a head's ``fuse_layers``), the inputs of those decoder layers side by side instead
        (:mod:`workers.features`). Set when a topology has a head reading this level; nothing is
        kept otherwise."""
        layers = check_layers(layers, int(self.model.config.num_hidden_layers))
        if self._features is not None:
            if self._features.layers != layers:
                raise ValueError(f"feature heads reading one level read the same features: this level keeps "
                                 f"those of layers {self._features.layers}, another head asks for {layers}")
            return
        if self.draft_vocab is not None:
            raise ValueError("a feature head reads a model over the authority's whole vocabulary; this is a "
                             "trimmed drafter (draft_vocab.json)")
        hidden = int(self.model.get_output_embeddings().weight.shape[1])
        store = self._features = FeatureStore(hidden * len(layers or [None]), layers)
        if self.lean is not None:  # before the hook below, which the lean forward would refuse
            self.lean = lean_forward(self.model, capture=store.capture, pack=self._pack,
                                     capture_layers=layers, quantized=self._quantized,
                                     batch_invariant=self._invariant)
        # transformers' forward (no lean one, and the per-sequence fallback's batched passes): the
        # base model's output is the final norm's, at every position
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        if layers:
            capture_layer_inputs(self.model, layers, store.capture)
        else:
            decoder.register_forward_hook(lambda module, args, output: store.capture(output[0]))
        if self._pool:
            self._pool.features = store

    @torch.inference_mode()
    def features(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                 starts: Sequence[int]) -> list[torch.Tensor]:
        """The last hidden states (the LM head's inputs) of positions ``starts[b] .. len - 2`` of
        each sequence ``token_ids[b]``: ``[len - 1 - starts[b], hidden]``, row ``j`` the state
        after reading tokens ``0 .. starts[b] + j``, which predicts the next one.

        What a pass computed is handed over as it was kept (:meth:`keep_features`); positions
        this worker has not computed for the sequence are computed now, in one pass for all
        sequences that lack some (a prefill: the first step of a request)."""
        store = self._features
        if store is None:
            raise RuntimeError("features: this level keeps no features (keep_features was not called)")
        out = [store.read(s, t, a) for s, t, a in zip(seq_ids, token_ids, starts)]
        for attempt in range(2):
            lacking = [b for b, f in enumerate(out) if f is None]
            if not lacking:
                break
            if attempt:  # the cache held positions the store did not (kept late): recompute them
                self.release([seq_ids[b] for b in lacking])
            self.score([seq_ids[b] for b in lacking], [token_ids[b] for b in lacking], [1] * len(lacking))
            for b in lacking:
                out[b] = store.read(seq_ids[b], token_ids[b], starts[b])
        if any(f is None for f in out):  # pragma: no cover - a bookkeeping bug, not an input
            raise RuntimeError("features: the worker's passes left positions without features")
        return out

    def _record(self, seq_id: str, prefix: list[int], fed: list[int], row: int, at: int,
                tree: tuple[list[int], list[int]] | None = None) -> None:
        """Keep the features of one row of the pass that just ran: ``fed`` at window columns
        ``at .. at + len(fed) - 1``, a tree's nodes right after them."""
        hidden = self._features.last[row]
        n = len(tree[0]) if tree else 0
        self._features.record(seq_id, prefix, fed, hidden[at:at + len(fed)], tree,
                              hidden[at + len(fed):at + len(fed) + n] if n else None)

    def _logits(self, input_ids, position_ids, cache, valid, keep: int, among=None) -> torch.Tensor:
        """One forward pass writing into ``cache`` (a transformers Cache, or a list of cache
        layers): logits ``[rows, keep, vocab]`` of the last ``keep`` positions. ``valid``
        ``[rows, columns]`` says which cached columns (the new ones included) each row attends
        to; None: all of them. ``among`` ``[rows, width, width]``: which new positions each new
        one sees (a tree); None: causal (see :func:`workers.lean.lean_forward`)."""
        from transformers.cache_utils import Cache

        if self.lean is not None:
            return self.lean(input_ids, position_ids, cache.layers if isinstance(cache, Cache) else cache,
                             valid, keep, among)
        if not isinstance(cache, Cache):
            cache = Cache(layers=cache)
        if among is not None:
            valid = self._tree_attention(valid, among, cache.get_seq_length() + input_ids.shape[1])
        return self.model(input_ids=input_ids, attention_mask=valid, position_ids=position_ids,
                          cache=cache, use_cache=True, logits_to_keep=keep).logits

    def _tree_support(self) -> str | None:
        """How this model takes a tree's attention mask in one pass: ``"bool"`` or ``"float"``
        (the 4D mask transformers' forward gets; the lean forward builds its own), or None:
        trees are scored path by path (:meth:`Worker.score_tree`).

        One pass needs a cache of plain full-attention layers (a sliding-window layer would
        evict prefix columns for the tree's rejected nodes; a recurrent one cannot branch), and
        a forward that uses a ready 4D mask as it is: transformers 5's ``create_causal_mask``
        returns a 4D mask untouched, so a model whose module builds its mask with it and runs
        SDPA (boolean mask) or eager attention (additive mask) qualifies."""
        if self._trees is False:
            import sys

            from transformers import masking_utils

            module = sys.modules.get(type(self.model).__module__)
            kind = {"sdpa": "bool", "eager": "float"}.get(getattr(self.model.config, "_attn_implementation", None))
            uses_mask = getattr(module, "create_causal_mask", None) is masking_utils.create_causal_mask
            self._trees = kind if kind and uses_mask and poolable(self.model) else None
        return self._trees

    def _tree_attention(self, valid, among: torch.Tensor, columns: int) -> torch.Tensor:
        """The 4D attention mask ``[rows, 1, width, columns]`` for transformers' forward of a pass
        with a tree (``among``: see :meth:`_logits`), in the form the model's attention takes."""
        mask = attention_mask(valid, among.shape[-1], columns, among.device, among)
        if self._tree_support() == "float":
            dtype = self.model.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return mask

    def _new_cache(self):
        if self._pool:  # plain full-attention layers: a solo sequence's buffers grow in place
            return growing_cache(self.model)
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def score(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_positions: Sequence[int],
    ) -> list[torch.Tensor]:
        vocab = self.draft_vocab
        if vocab is None:
            return self._score(seq_ids, token_ids, num_positions)
        return [vocab.to_authority_rows(r) for r in self._draft_rows(seq_ids, token_ids, num_positions)]

    @torch.inference_mode()
    def prefill(self, seq_ids, token_ids) -> None:
        """:meth:`Worker.prefill <workers.base.Worker.prefill>` (a chunk of a long prompt) goes
        straight into the pool, in a pass of its own rows: a sequence prefilled in a cache of its
        own would be computed again when it joins the pool."""
        self._decide_pool()
        if not self._pool or not seq_ids:
            return super().prefill(seq_ids, token_ids)
        for s in seq_ids:
            self._caches.pop(s, None)
        vocab = self.draft_vocab  # a trimmed drafter's cache holds draft ids
        self._pool.prefill(seq_ids, [vocab.to_draft(t) for t in token_ids] if vocab is not None else token_ids)

    @torch.inference_mode()
    def _next_logits(self, seq_ids, token_ids) -> list[torch.Tensor]:
        vocab = self.draft_vocab
        if vocab is None:
            return super()._next_logits(seq_ids, token_ids)
        rows = self._draft_rows(seq_ids, token_ids, [1] * len(seq_ids))
        return [vocab.to_columns(r) for r in rows]  # over draft_columns (Worker.draft)

    def _draft_rows(self, seq_ids, token_ids, num_positions) -> list[torch.Tensor]:
        """A trimmed drafter's rows in draft ids ``[n, size]``. Caches hold draft ids: two
        authority tokens outside the draft vocabulary are one input."""
        vocab = self.draft_vocab
        return self._score(seq_ids, [vocab.to_draft(t) for t in token_ids], num_positions)

    @torch.inference_mode()
    def score_tree(self, seq_ids, token_ids, trees) -> list[torch.Tensor]:
        """:meth:`Worker.score_tree <workers.base.Worker.score_tree>` in one forward pass for all
        trees (models :meth:`_tree_support` accepts; others score path by path)."""
        trees = [as_tree(t) for t in trees]
        if self._tree_support() is None:
            return super().score_tree(seq_ids, token_ids, trees)
        vocab = self.draft_vocab
        if vocab is None:
            return self._score_tree(seq_ids, token_ids, trees)
        # Draft ids in: two siblings outside the draft vocabulary are one input (OTHER), twice.
        rows = self._score_tree(seq_ids, [vocab.to_draft(t) for t in token_ids],
                                [(vocab.to_draft(tokens), parents) for tokens, parents in trees])
        return [vocab.to_authority_rows(r) for r in rows]

    def _score_tree(self, seq_ids, token_ids, trees) -> list[torch.Tensor]:
        if not any(tokens for tokens, _ in trees):  # no candidates: the root row, as score gives it
            return self._score(seq_ids, token_ids, [1] * len(seq_ids))
        self._decide_pool()
        if self._pool is False:
            if len(seq_ids) == 1:
                return [self._score_tree_one(seq_ids[0], list(token_ids[0]), trees[0])]
            return self._score_batch(seq_ids, token_ids, [1] * len(seq_ids), trees)
        if len(seq_ids) == 1 and not self._pool.row_of:
            return [self._score_tree_one(seq_ids[0], list(token_ids[0]), trees[0])]
        for s in seq_ids:
            self._caches.pop(s, None)
        return self._pool.score_tree(seq_ids, token_ids, trees)

    def _decide_pool(self) -> None:
        if self._pool is None:
            self._pool = (Pool(self.model, self.device, self.context_length, self._logits)
                          if poolable(self.model) else False)
            if self._pool:
                self._pool.features = self._features

    def _score(self, seq_ids, token_ids, num_positions) -> list[torch.Tensor]:
        if self._pool is None:
            self._decide_pool()
        if self._pool is False:  # a cache layout the pool does not handle: one cache per sequence
            if len(seq_ids) == 1:
                return [self._score_one(seq_ids[0], list(token_ids[0]), num_positions[0])]
            return self._score_batch(seq_ids, token_ids, num_positions)
        if len(seq_ids) == 1 and not self._pool.row_of:
            # A solo request: its own cache beats the pool's masked buffers at batch 1
            # (docs/results-log.md). It joins the pool if it is ever batched.
            return [self._score_one(seq_ids[0], list(token_ids[0]), num_positions[0])]
        for s in seq_ids:  # sequences served alone so far move to the pool (prefilled there once)
            self._caches.pop(s, None)
        return self._pool.score(seq_ids, token_ids, num_positions)

    def _reconcile(self, seq_id: str, tokens: list[int], num_positions: int) -> tuple[_SeqCache, list[int]]:
        """Crop the sequence's cache to its longest common prefix with ``tokens`` (keeping the
        positions that need logits uncached) and return it with the tokens still to feed."""
        if not 1 <= num_positions <= len(tokens):
            raise ValueError(f"num_positions={num_positions} for a sequence of {len(tokens)} tokens")
        entry = self._caches.get(seq_id)
        if entry is None:
            entry = self._caches[seq_id] = _SeqCache(self._new_cache())
        elif entry.tree is not None:
            self._settle(entry, tokens)
        keep = min(common_prefix(entry.tokens, tokens), len(tokens) - num_positions)
        if keep < len(entry.tokens):
            entry.cache.crop(keep - len(entry.tokens))
            del entry.tokens[keep:]
        return entry, tokens[keep:]

    @staticmethod
    def _settle(entry: _SeqCache, tokens: list[int]) -> None:
        """Resolve the tree scored last: keep the root-to-node path that ``tokens`` continues
        with (its keys/values moved next to the prefix, as a chain would have put them), drop
        every other node."""
        tree, entry.tree = entry.tree, None
        base = len(entry.tokens)
        path = accepted_path(tree.tokens, tree.parents, tokens, base) if tokens[:base] == entry.tokens else []
        k = len(path)
        if path != list(range(k)):
            for layer in entry.cache.layers:
                src = torch.tensor(path, device=layer.keys.device) + base
                layer.keys[:, :, base:base + k] = layer.keys.index_select(2, src)
                layer.values[:, :, base:base + k] = layer.values.index_select(2, src)
        entry.cache.crop(k - len(tree.tokens))
        entry.tokens.extend(tree.tokens[i] for i in path)

    def _score_batch(self, seq_ids, token_ids, num_positions, trees=None) -> list[torch.Tensor]:
        """One forward pass over several sequences with ragged caches (the fallback for models
        whose cache layout the pool does not handle).

        Each sequence keeps its own cache. For the pass, the caches are left-padded to a common
        length and the new tokens right-padded, with an attention mask hiding every pad and
        explicit position ids per row; afterwards each row's new keys/values are appended to its
        own cache. (HF's dynamic cache already copies the whole cache on every append, so the
        padding copy does not change the order of the cost.)

        With ``trees`` (``num_positions`` all 1: the root rows), each row feeds its tree's nodes
        after its tail, at their depths' positions, under a 4D tree mask; they stay pending in
        its cache (:meth:`_settle`). Rows ``[n_b + 1, vocab]``.
        """
        rows = [self._reconcile(s, list(t), n) for s, t, n in zip(seq_ids, token_ids, num_positions)]
        news = [new + tree[0] for (_, new), tree in zip(rows, trees)] if trees else [new for _, new in rows]
        if trees:
            num_positions = [len(tree[0]) + 1 for tree in trees]
        pasts = [len(entry.tokens) for entry, _ in rows]
        width = max(len(new) for new in news)
        longest = max(pasts)
        batch = len(rows)
        dev = self.device
        mask = torch.zeros(batch, longest + width, dtype=torch.long, device=dev)
        input_ids = torch.zeros(batch, width, dtype=torch.long, device=dev)
        for b, (new, past) in enumerate(zip(news, pasts)):
            mask[b, longest - past:longest + len(new)] = 1
            input_ids[b, :len(new)] = torch.tensor(new, dtype=torch.long)
        positions = torch.tensor(pasts, device=dev).unsqueeze(1) + torch.arange(width, device=dev)
        if trees:  # nodes at their depths' positions; each sees the prefix and its ancestors
            among = torch.zeros(batch, width, width, dtype=torch.bool)
            for b, ((_, fresh), (tokens, parents)) in enumerate(zip(rows, trees)):
                t = len(fresh)
                among[b] = window_mask(width, t, parents)
                positions[b, t:t + len(tokens)] = pasts[b] + t + torch.tensor(depths(parents), device=dev)
            mask = self._tree_attention(mask.bool(), among.to(dev), longest + width)
        cache = self._new_cache()
        if longest:
            data = []
            template = next(entry.cache for (entry, _), past in zip(rows, pasts) if past)
            for layer_idx, layer in enumerate(template.layers):
                keys, values = [], []
                for (entry, _), past in zip(rows, pasts):
                    own = entry.cache.layers[layer_idx]
                    k = own.keys if past else layer.keys[:, :, :0]
                    v = own.values if past else layer.values[:, :, :0]
                    keys.append(torch.nn.functional.pad(k, (0, 0, longest - past, 0)))
                    values.append(torch.nn.functional.pad(v, (0, 0, longest - past, 0)))
                data.append((torch.cat(keys), torch.cat(values)))
            cache = _cache_from(data, self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                         use_cache=True)
        results = []
        for b, ((entry, fresh), new, n) in enumerate(zip(rows, news, num_positions)):
            if self._features is not None:  # row b's new tokens start the window
                self._record(seq_ids[b], entry.tokens, fresh, b, 0, trees[b] if trees else None)
            for layer_idx, layer in enumerate(out.cache.layers):
                entry.cache.update(layer.keys[b:b + 1, :, longest:longest + len(new)],
                                   layer.values[b:b + 1, :, longest:longest + len(new)], layer_idx)
            entry.tokens.extend(fresh)
            if trees and trees[b][0]:
                entry.tree = Pending(list(trees[b][0]), list(trees[b][1]))
            results.append(host_logits(out.logits[b, len(new) - n:len(new)]))
        return results

    def _score_one(self, seq_id: str, tokens: list[int], num_positions: int) -> torch.Tensor:
        entry, fresh = self._reconcile(seq_id, tokens, num_positions)
        new = torch.tensor([fresh], dtype=torch.long, device=self.device)
        past = len(entry.tokens)
        positions = torch.arange(past, past + len(fresh), device=self.device)[None]
        logits = self._logits(new, positions, entry.cache, None, num_positions)[0]
        if self._features is not None:
            self._record(seq_id, entry.tokens, fresh, 0, 0)
        entry.tokens.extend(fresh)
        return host_logits(logits)

    def _score_tree_one(self, seq_id: str, tokens: list[int], tree) -> torch.Tensor:
        """One sequence's tree on its own cache: the uncached tail, then the nodes."""
        entry, fresh = self._reconcile(seq_id, tokens, 1)
        nodes, parents = tree
        past, t, dev = len(entry.tokens), len(fresh), self.device
        new = torch.tensor([fresh + list(nodes)], dtype=torch.long, device=dev)
        positions = torch.tensor([list(range(past, past + t)) + [past + t + d for d in depths(parents)]], device=dev)
        among = window_mask(t + len(nodes), t, parents)[None].to(dev)
        logits = self._logits(new, positions, entry.cache, None, len(nodes) + 1, among)[0]
        if self._features is not None:
            self._record(seq_id, entry.tokens, fresh, 0, 0, (list(nodes), list(parents)))
        entry.tokens.extend(fresh)
        entry.tree = Pending(list(nodes), list(parents))
        return host_logits(logits)

    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self._caches.pop(s, None)
        if self._pool:
            self._pool.release(seq_ids)
        if self._features is not None:
            self._features.release(seq_ids)

    def cached_sequences(self) -> int:
        return len(self._caches) + (len(self._pool.row_of) if self._pool else 0)

    def close(self) -> None:
        self._caches.clear()
        self._pool = None
        if self._features is not None:
            self._features.clear()
        self.model = None


def _load(name: str, dtype, trust_remote_code: bool, gguf_file: str | None):
    from transformers import AutoModelForCausalLM

    # A GGUF file is dequantized by transformers into a plain model of this dtype.
    source = {"gguf_file": gguf_file} if gguf_file else {"use_safetensors": True}
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code, **source)


def _cache_from(data, config):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=data, config=config)
