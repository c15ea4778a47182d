"""A transformers worker with faults to order, for the server's failure tests (loaded by the
server subprocess as ``kind: serve_workers:FlakyHFWorker``)."""
from __future__ import annotations

import time

from cascade.errors import WorkerError
from workers.hf import HFWorker


class FlakyHFWorker(HFWorker):
    """:class:`HFWorker` that sleeps ``delay`` seconds per forward pass (so that requests stay
    in flight long enough to watch), and fails any call holding a sequence that starts with
    ``poison`` once ``after`` tokens follow it (so that some were committed first)."""

    def __init__(self, model: str, dtype: str = "float64", device: str = "cpu", poison: list[int] | None = None,
                 after: int = 6, delay: float = 0.0):
        super().__init__(model, dtype, device)
        self.poison = list(poison or [])
        self.after = after
        self.delay = delay

    def score(self, seq_ids, token_ids, num_positions):
        if self.delay:
            time.sleep(self.delay)
        n = len(self.poison)
        for tokens in token_ids:
            if n and list(tokens[:n]) == self.poison and len(tokens) >= n + self.after:
                raise WorkerError("flaky worker: this sequence is poisoned")
        return super().score(seq_ids, token_ids, num_positions)
