"""A worker for any transformers causal LM, with one KV cache per sequence.

Every call reconciles a sequence's cache with the tokens it is handed: keep the longest common
prefix, crop the rest, prefill what is new. Rejected drafts therefore roll back by themselves.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from workers.base import Worker

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the first visible CUDA device, else CPU; ``cuda:N`` without CUDA -> CPU, said."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available; falling back to CPU", device)
        return torch.device("cpu")
    return torch.device(device)


@dataclass
class _SeqCache:
    cache: object  # transformers DynamicCache
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys/values it holds


class HFWorker(Worker):
    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        device: str = "auto",
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            model,
            dtype=torch_dtype,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        ).to(self.device)
        self.model.eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = getattr(self.model.config, "max_position_embeddings", None)
        self._caches: dict[str, _SeqCache] = {}

    @classmethod
    def from_model(cls, model, device: str | None = None) -> "HFWorker":
        """Wrap an already-loaded model (tests, notebooks)."""
        self = cls.__new__(cls)
        self.device = resolve_device(device) if device else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self._caches = {}
        return self

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def score(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_positions: Sequence[int],
    ) -> list[torch.Tensor]:
        # One forward per sequence for now; the batched engine pads them into one.
        return [self._score_one(s, list(t), n) for s, t, n in zip(seq_ids, token_ids, num_positions)]

    def _score_one(self, seq_id: str, tokens: list[int], num_positions: int) -> torch.Tensor:
        if not 1 <= num_positions <= len(tokens):
            raise ValueError(f"num_positions={num_positions} for a sequence of {len(tokens)} tokens")
        entry = self._caches.get(seq_id)
        if entry is None:
            entry = self._caches[seq_id] = _SeqCache(self._new_cache())
        keep = _common_prefix(entry.tokens, tokens)
        # The positions we need logits for must be fed, even if cached.
        keep = min(keep, len(tokens) - num_positions)
        if keep < len(entry.tokens):
            entry.cache.crop(keep - len(entry.tokens))
            del entry.tokens[keep:]
        new = torch.tensor([tokens[keep:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=new, cache=entry.cache, use_cache=True, logits_to_keep=num_positions)
        entry.cache = out.cache
        entry.tokens.extend(tokens[keep:])
        logits = out.logits[0, -num_positions:]
        # Verification runs on the host in at least float32.
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits.cpu()

    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self._caches.pop(s, None)

    def close(self) -> None:
        self._caches.clear()
        self.model = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: the cache is a prefix of the new sequence
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
