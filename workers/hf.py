"""A worker for any transformers causal LM.

Its sequences' keys and values live in a :class:`~workers.kvcache.KVCache`: rows of one batched
pool for sequences scored together (:class:`workers.pool.Pool`), a cache of its own for a solo
sequence until it is batched, or one per sequence where the model's cache layout rules the pool
out (:class:`workers.kvcache.SeqCaches`). Trees of candidates are scored in one pass on either
(:mod:`workers.trees`; docs/engine.md, "Scoring a tree of candidates").
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from workers.base import Worker
from workers.devices import resolve_device, resolve_dtype
from workers.draft_vocab import DraftVocab
from workers.features import FeatureStore, capture_layer_inputs, check_layers
from workers.kvcache import SeqCaches
from workers.lean import attention_mask, batch_invariant_setting, lean_forward
from workers.pool import Pool
from workers.trees import as_tree


class HFWorker(Worker):
    def __init__(
        self,
        model,  # a name or path (loaded here), or an already-loaded transformers model (tests, notebooks)
        dtype: str = "float32",
        device: str | torch.device | None = None,  # None: "auto" for a name, a loaded model's own device
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
        named = isinstance(model, (str, os.PathLike))
        self.device = resolve_device(str(device or ("auto" if named else next(model.parameters()).device)))
        if named:
            from transformers import AutoModelForCausalLM

            name = str(model)
            # A GGUF file is dequantized by transformers into a plain model of this dtype.
            source = {"gguf_file": gguf_file} if gguf_file else {"use_safetensors": True}
            model = AutoModelForCausalLM.from_pretrained(name, dtype=resolve_dtype(dtype, self.device),
                                                         trust_remote_code=trust_remote_code, **source).to(self.device)
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
        # transformers' forward minus its per-call plumbing, where the model is one it knows
        # (packed_weights: float32 products on a CPU from copies laid out for them, workers/lean.py)
        self._pack = None if packed_weights else False
        # a position's logits whatever the pass's width and rows (topology batch_invariant; workers/lean.py)
        self._invariant = batch_invariant_setting(batch_invariant, self.model)
        self._quantized = quantized
        self.lean = (lean_forward(self.model, pack=self._pack, quantized=quantized,
                                  batch_invariant=self._invariant) if lean else None)
        for setting, needs, wanted in (("batch_invariant", "batch invariance needs", self._invariant),
                                       ("quantize", "quantized products need", quantized is not None)):
            if wanted and self.lean is None:
                raise ValueError(f"{setting}: the level's model is not one the lean forward runs "
                                 f"(workers/lean.py), which {needs}")
        if quantized is not None:
            quantized.measure()
        self._features: FeatureStore | None = None  # the last hidden states, kept once a head reads them
        # The sequences' keys and values (workers/kvcache.py): rows of one pool for batches, and a
        # cache of its own for a sequence served alone or where the model's layout rules the pool out.
        self._caches = SeqCaches(self.model, self.device, self._logits, self._tree_attention)
        self._pool = Pool(self.model, self.device, self.context_length, self._logits) if self._caches.growing else None

    def keep_features(self, layers: Sequence[int] | None = None) -> None:
        """From now on keep, per sequence, the features of every position each pass computes, for a
        feature head to read (:meth:`features`): the last hidden state, or with ``layers`` (a head's
        ``fuse_layers``) the inputs of those decoder layers side by side (:mod:`workers.features`)."""
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
        self._caches.features = store
        if self._pool:
            self._pool.features = store

    @torch.inference_mode()
    def features(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                 starts: Sequence[int]) -> list[torch.Tensor]:
        """The last hidden states (the LM head's inputs) of positions ``starts[b] .. len - 2`` of
        each sequence ``token_ids[b]``: ``[len - 1 - starts[b], hidden]``, row ``j`` the state
        after reading tokens ``0 .. starts[b] + j``. What the passes kept (:meth:`keep_features`);
        positions never computed for a sequence are computed now, in one pass for all."""
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

    def _logits(self, input_ids, position_ids, cache, valid, keep: int, among=None) -> torch.Tensor:
        """One forward pass writing into ``cache`` (a transformers Cache, or a list of cache
        layers): logits ``[rows, keep, vocab]`` of the last ``keep`` positions; ``valid`` and
        ``among`` as :func:`workers.lean.lean_forward` takes them (None: all columns; causal)."""
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
        trees are scored path by path (:meth:`Worker.score_tree`). One pass needs plain
        full-attention cache layers and a module that builds its mask with transformers'
        ``create_causal_mask`` (which returns a ready 4D mask untouched) and runs SDPA or eager
        attention (docs/engine.md, "Scoring a tree of candidates")."""
        import sys

        from transformers import masking_utils

        module = sys.modules.get(type(self.model).__module__)
        kind = {"sdpa": "bool", "eager": "float"}.get(getattr(self.model.config, "_attn_implementation", None))
        uses_mask = getattr(module, "create_causal_mask", None) is masking_utils.create_causal_mask
        return kind if kind and uses_mask and self._caches.growing else None

    def _tree_attention(self, valid, among: torch.Tensor, columns: int) -> torch.Tensor:
        """The 4D attention mask ``[rows, 1, width, columns]`` for transformers' forward of a pass
        with a tree (``among``: see :meth:`_logits`), in the form the model's attention takes."""
        mask = attention_mask(valid, among.shape[-1], columns, among.device, among)
        if self._tree_support() == "float":
            dtype = self.model.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return mask

    @torch.inference_mode()
    def score(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], num_positions: Sequence[int]):
        return self._wide(self._score(seq_ids, token_ids, num_positions))

    @torch.inference_mode()
    def score_tree(self, seq_ids, token_ids, trees) -> list[torch.Tensor]:
        """:meth:`Worker.score_tree <workers.base.Worker.score_tree>` in one forward pass for all
        trees (models :meth:`_tree_support` accepts; others score path by path)."""
        trees = [as_tree(t) for t in trees]
        if self._tree_support() is None:
            return super().score_tree(seq_ids, token_ids, trees)
        # no candidates: the root rows, as score gives them
        return self._wide(self._score(seq_ids, token_ids, [1] * len(seq_ids),
                                      trees if any(tokens for tokens, _ in trees) else None))

    @torch.inference_mode()
    def prefill(self, seq_ids, token_ids) -> None:
        """:meth:`Worker.prefill <workers.base.Worker.prefill>` (a chunk of a long prompt) goes
        straight into the pool, in a pass of its own rows: a sequence prefilled in a cache of its
        own would be computed again when it joins the pool."""
        if not self._pool or not seq_ids:
            return super().prefill(seq_ids, token_ids)
        self._caches.release(seq_ids)
        self._pool.prefill(seq_ids, self._cache_ids(token_ids))

    @torch.inference_mode()
    def _next_logits(self, seq_ids, token_ids) -> list[torch.Tensor]:
        vocab = self.draft_vocab
        if vocab is None:
            return super()._next_logits(seq_ids, token_ids)
        rows = self._score(seq_ids, token_ids, [1] * len(seq_ids))
        return [vocab.to_columns(r) for r in rows]  # over draft_columns (Worker.draft)

    def _score(self, seq_ids, token_ids, num_positions, trees=None) -> list[torch.Tensor]:
        """The model's own rows (a trimmed drafter's: over draft ids) from the cache that serves
        these sequences: a solo request's own cache, which beats the pool's masked buffers at
        batch 1 (docs/results-log.md), else the pool, which a sequence served alone so far
        joins (prefilled there once)."""
        if trees is not None and self.draft_vocab is not None:
            trees = [(self.draft_vocab.to_draft(tokens), parents) for tokens, parents in trees]
        cache = self._caches
        if self._pool and (len(seq_ids) > 1 or self._pool.row_of):
            self._caches.release(seq_ids)
            cache = self._pool
        return cache.score(seq_ids, self._cache_ids(token_ids), num_positions, trees)

    def _cache_ids(self, token_ids):
        """What the caches hold: a trimmed drafter's, draft ids (tokens outside it are one: OTHER)."""
        vocab = self.draft_vocab
        return token_ids if vocab is None else [vocab.to_draft(t) for t in token_ids]

    def _wide(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rows at the authority's width (a trimmed drafter's: -inf outside its vocabulary)."""
        vocab = self.draft_vocab
        return rows if vocab is None else [vocab.to_authority_rows(r) for r in rows]

    def _stores(self) -> list:
        """What keeps per-sequence state: the caches, and the features kept for a head."""
        return [s for s in (self._caches, self._pool, self._features) if s is not None]

    def hold(self, seq_ids: Sequence[str], held: Sequence[int]) -> None:
        for store in self._stores():
            store.hold(seq_ids, held)

    def release(self, seq_ids: Sequence[str]) -> None:
        for store in self._stores():
            store.release(seq_ids)

    def cached_sequences(self) -> int:
        return len(self._caches.seqs) + (len(self._pool.row_of) if self._pool else 0)

    def close(self) -> None:
        self._caches.seqs.clear()
        self._pool = self._features = None
        self.model = None
