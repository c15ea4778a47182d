"""A cheap worker for the statistical tests: next-token logits from a fixed random bigram table.

It implements the real Worker interface (score; drafting is the base class's), so tests drive
the real engine through it. The distribution of a whole continuation is known in closed form,
which is what the distribution tests compare against.
"""
from __future__ import annotations

import torch

from cascade.errors import WorkerError
from workers.base import Worker


def bigram_table(vocab_size: int, seed: int, scale: float) -> torch.Tensor:  # [vocab, vocab]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, vocab_size, generator=g, dtype=torch.float64) * scale


class TableWorker(Worker):
    """Logits after token ``t`` are ``table[t]``; peaked (scale) and seed-specific so levels disagree."""

    def __init__(self, vocab_size: int = 6, seed: int = 0, scale: float = 2.0):
        self.vocab_size = vocab_size
        self.table = bigram_table(vocab_size, seed, scale)
        self.calls = 0

    def score(self, seq_ids, token_ids, num_positions):
        self.calls += 1
        last = [t for tokens, n in zip(token_ids, num_positions) for t in tokens[len(tokens) - n:]]
        return list(self.table[torch.as_tensor(last, dtype=torch.long)].split(list(num_positions)))

    def score_tree(self, seq_ids, token_ids, trees):
        """A bigram's row after a node is the table's row of the node's token: every node of
        every tree in one call (the row at the root is the last committed token's)."""
        self.calls += 1
        out = []
        for tokens, tree in zip(token_ids, trees):
            nodes = tree[0] if isinstance(tree, tuple) else tree.tokens
            last = [int(tokens[-1])] + [int(t) for t in nodes]
            out.append(self.table[torch.as_tensor(last, dtype=torch.long)])
        return out


class FailingTableWorker(TableWorker):
    """A table worker that goes down for good after ``fail_after`` score calls."""

    def __init__(self, vocab_size: int = 6, seed: int = 0, scale: float = 2.0, fail_after: int = 10**9):
        super().__init__(vocab_size, seed, scale)
        self.fail_after = fail_after

    def score(self, seq_ids, token_ids, num_positions):
        if self.calls >= self.fail_after:
            raise WorkerError("table worker is down")
        return super().score(seq_ids, token_ids, num_positions)
