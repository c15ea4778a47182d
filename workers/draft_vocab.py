"""A trimmed draft vocabulary: a drafter that predicts only the authority tokens that matter.

At 49,152 tokens the output head, not the body, is what a small drafter pays for. A drafter
trained over a *draft vocabulary* — the ``n`` authority tokens that carry most of the authority's
probability mass (FR-Spec, NanoSpec) — computes logits for those alone. Its model is a plain
causal LM whose vocabulary is the draft vocabulary plus one last row, OTHER, the input embedding
of every authority token outside it (never predicted). ``draft_vocab.json`` beside the weights
lists the authority ids in draft order::

    {"authority_vocab_size": 49152, "ids": [2, 198, 28, ...]}

Exactness is untouched: the worker hands the engine rows over the authority's whole vocabulary,
``-inf`` outside the draft vocabulary, so the drafter's ``draft_probs`` are zero there — the
distribution it really sampled from — and those tokens stay reachable through the verifier's
residual (DESIGN.md §2).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

FILE = "draft_vocab.json"


class DraftVocab:
    """Authority ids <-> draft ids for a trimmed drafter."""

    def __init__(self, ids: Sequence[int], authority_vocab_size: int):
        ids = [int(i) for i in ids]
        if len(set(ids)) != len(ids) or not all(0 <= i < authority_vocab_size for i in ids):
            raise ValueError(f"{FILE}: ids must be distinct authority ids in [0, {authority_vocab_size})")
        self.authority_vocab_size = authority_vocab_size
        self.ids = torch.tensor(ids, dtype=torch.long)  # draft id -> authority id
        self.other = len(ids)  # the input row of every authority token outside the draft vocabulary
        table = [self.other] * authority_vocab_size
        for d, a in enumerate(ids):
            table[a] = d
        self._to_draft = table  # a list: indexing it per token beats a tensor gather for short lists
        # the draft vocabulary in authority id order: rows over these columns are what a drafter
        # drafts from (Worker.draft_columns); ``order`` picks them from a draft-order row
        self.columns, self.order = torch.sort(self.ids)

    @property
    def size(self) -> int:
        """Rows of the drafter's model: the draft vocabulary plus OTHER."""
        return self.other + 1

    @classmethod
    def load(cls, model_dir: str | Path) -> "DraftVocab | None":
        path = Path(model_dir) / FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(data["ids"], int(data["authority_vocab_size"]))

    def save(self, model_dir: str | Path, **extra) -> None:
        data = {"authority_vocab_size": self.authority_vocab_size, "ids": self.ids.tolist(), **extra}
        (Path(model_dir) / FILE).write_text(json.dumps(data) + "\n")

    def to_draft(self, token_ids: Sequence[int]) -> list[int]:
        table = self._to_draft
        return [table[t] for t in token_ids]

    def to_columns(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[n, size]`` -> rows over :attr:`columns` ``[n, size - 1]`` (OTHER dropped)."""
        return logits[:, self.order]

    def to_authority_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[n, size]`` -> authority-width rows ``[n, authority_vocab_size]``,
        ``-inf`` outside the draft vocabulary (OTHER is never predicted)."""
        rows = logits.new_full((logits.shape[0], self.authority_vocab_size), float("-inf"))
        rows[:, self.ids] = logits[:, :self.other]
        return rows
