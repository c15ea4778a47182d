"""A worker driven as the engine drives it, for tests that call workers directly: before each
call it is told (``Worker.hold``) how much of each sequence it still holds of what it was handed
before (and drafted), the common prefix, as ``Engine._hold`` tells it from the engine's record."""
from __future__ import annotations

CALLS = {"score", "score_probs", "score_tree", "score_tree_probs", "draft", "draft_tree", "prefill", "features"}


class Told:
    def __init__(self, worker):
        self.worker = worker
        self.handed: dict[str, list[int]] = {}

    def __getattr__(self, name):
        attr = getattr(self.worker, name)
        if name not in CALLS:
            return attr

        def call(seq_ids, token_ids, *args, **kwargs):
            self.worker.hold(seq_ids, [_common(self.handed.get(s, []), t) for s, t in zip(seq_ids, token_ids)])
            out = attr(seq_ids, token_ids, *args, **kwargs)
            drafted = [d.tokens[:-1] for d in out] if name == "draft" else [[] for _ in seq_ids]
            for s, t, d in zip(seq_ids, token_ids, drafted):
                self.handed[s] = list(t) + d
            return out
        return call

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.handed.pop(s, None)
        self.worker.release(seq_ids)


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
