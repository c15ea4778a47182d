"""A transformers worker with faults to order, for the server's failure tests (loaded by the
server subprocess as ``kind: serve_workers:FlakyHFWorker``)."""
from __future__ import annotations

import time

from cascade.errors import WorkerError
from workers.hf import HFWorker


class FlakyHFWorker(HFWorker):
    """:class:`HFWorker` that sleeps ``delay`` seconds per forward pass (so that requests stay
    in flight long enough to watch), and fails any call holding a sequence that starts with
    ``poison`` once ``after`` tokens follow it (so that some were committed first); a sequence
    that starts with ``crash`` raises a plain RuntimeError instead (a bug, not a worker failure)."""

    def __init__(self, model: str, dtype: str = "float64", device: str = "cpu", poison: list[int] | None = None,
                 crash: list[int] | None = None, after: int = 6, delay: float = 0.0):
        super().__init__(model, dtype, device)
        self.poison = list(poison or [])
        self.crash = list(crash or [])
        self.after = after
        self.delay = delay

    def score(self, seq_ids, token_ids, num_positions):
        if self.delay:
            time.sleep(self.delay)
        for tokens in token_ids:
            if self._starts(tokens, self.poison):
                raise WorkerError("flaky worker: this sequence is poisoned")
            if self._starts(tokens, self.crash):
                raise RuntimeError("flaky worker: a bug")
        return super().score(seq_ids, token_ids, num_positions)

    def _starts(self, tokens, prefix: list[int]) -> bool:
        n = len(prefix)
        return bool(n) and list(tokens[:n]) == prefix and len(tokens) >= n + self.after
