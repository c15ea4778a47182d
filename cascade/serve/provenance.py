"""The ``return_provenance`` extension: each step's path, blocks and per-token origins as JSON.

A step is sent as ``{"path", "blocks": [{"proposer", "verifier", "proposed", "accepted"}],
"tokens": [{"id", "level", "text"}]}``, ``level`` being the level whose draft the token was
(:class:`cascade.stats.StepProvenance`); a block that was a tree adds ``"candidates"`` (its
nodes) and ``"ranks"`` (the branch taken: which sibling each accepted token was, the ones before
it tried and refused). ``text`` splits the answer's text among its tokens so
that, in order, the pieces concatenate to exactly the text the client receives: a token that
ends in the middle of a UTF-8 character, or in what may still become a stop string, gets the
empty string and the token that settles it the whole piece (the same holding back as the
streamed text); a token past a stop string gets the empty string.
"""
from __future__ import annotations

from typing import Any, Iterable

from cascade.api import Cascade
from cascade.stats import StepProvenance


class TokenPieces:
    """Splits a request's text among its tokens as they are committed (one per request)."""

    def __init__(self, cascade: Cascade, stops: list[str]):
        self.text = cascade.text_stream(stops)  # incremental: a token costs its own decoding

    def add(self, tokens: Iterable[int], final: bool = False) -> list[str]:
        """The text pieces of ``tokens``; with ``final`` the last one takes the rest of the text."""
        tokens = list(tokens)
        return [self.text.add((tok,), final=final and j == len(tokens) - 1) for j, tok in enumerate(tokens)]


def step_dicts(steps: Iterable[StepProvenance], pieces: TokenPieces, final: bool = False) -> list[dict[str, Any]]:
    """The JSON form of ``steps`` (consecutive, not yet sent), their tokens' text from ``pieces``."""
    steps = list(steps)
    out = []
    for k, step in enumerate(steps):
        texts = pieces.add(step.tokens, final=final and k == len(steps) - 1)
        d = step.to_dict()
        d["tokens"] = [{"id": t, "level": o, "text": x} for t, o, x in zip(step.tokens, step.origins, texts)]
        del d["origins"]
        out.append(d)
    return out
