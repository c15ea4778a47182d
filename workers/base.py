"""The worker interface: one model, many sequences; it scores and samples, it decides nothing.

A worker keeps whatever per-sequence state it likes (a KV cache), keyed by ``seq_id``. Every call
hands the full sequence (prompt + committed + proposed) as a list (a reference, no copy); the
engine owns each sequence's progress and says before each call how many leading positions the
level still holds (:meth:`Worker.hold`), so a rolled-back block is dropped without any list
being compared, and the worker computes only what follows.

Randomness comes in as uniforms drawn by the caller from the request's generator: a worker
never owns a random state, so every backend gives the same tokens for the same seed.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch

from cascade.sampling import Sampling
from policies.base import StopRule, draft_step

# dtype names as topologies (``levels[*].dtype``) and the Ray wire format spell them
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def host_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as the engine reads them: on the host, in float32 at least (verification and
    sampling run there, and a half-precision row would round their sums)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits.cpu()


@dataclass
class Draft:
    """A block drafted by one level for one sequence."""

    tokens: list[int]
    probs: torch.Tensor  # [len(tokens), vocab]: the distribution each token was sampled from
    forward_passes: int
    confidence: list[float] | None = None  # the model's own (T=1) probability of each token
    stopped_early: bool = False  # the stop rule ended the block before max_tokens


class Worker(abc.ABC):
    """One level's model host. Subclasses implement :meth:`score`; drafting and scoring a tree
    of candidates (:meth:`score_tree`) are built on it.

    ``vocab_size`` is the width of the rows :meth:`score` returns.
    """

    vocab_size: int
    can_score: bool = True
    # The authority ids, ascending, outside which this level never drafts (a trimmed draft
    # vocabulary, workers.draft_vocab): where set, :meth:`_next_logits` returns rows over these
    # columns alone and :meth:`draft` warps them there (cheaper than over the whole vocabulary:
    # docs/engine.md, "Feature heads"); None: rows over the whole vocabulary.
    draft_columns: torch.Tensor | None = None
    # whether :meth:`draft_tree` works here (the generic one scores nodes with :meth:`score`)
    drafts_trees: bool = True
    # a feature head: the level whose features it drafts from, handed over by :meth:`hand_off`
    features_of: str | None = None

    def hand_off(self, source: "Worker", seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                 ends: Sequence[int]) -> list[int]:
        """A feature head takes from ``source`` (the worker of its ``features_of`` level) the
        features of each sequence ``token_ids[b]`` it lacks, up to position ``ends[b] - 1``; the
        indices of the sequences the source was asked for them (it computes positions it has not
        seen). Only feature heads implement it (:class:`workers.head.HeadWorker`)."""
        raise NotImplementedError(f"{type(self).__name__} reads no level's features")

    def hold(self, seq_ids: Sequence[str], held: Sequence[int]) -> None:
        """Before a call, the engine says how many leading positions of each sequence the level
        still holds (``held[b]``: those of the sequences it was handed, and drafted itself, that
        the call's sequence keeps); a worker drops whatever it holds past them and trusts that
        the call's ``token_ids`` continue the rest. A scored tree pending right after them stays,
        for the call to settle against its tokens. This default holds nothing (a worker without
        a cache, or one that keeps its own bookkeeping)."""

    @abc.abstractmethod
    def score(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_positions: Sequence[int],
    ) -> list[torch.Tensor]:
        """Logits ``[num_positions[b], vocab]`` for each sequence ``b``: row ``j`` predicts the
        token after ``token_ids[b][len - num_positions[b] + j]``. One forward pass per call."""

    def prefill(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """Compute and keep each sequence's positions ``token_ids[b]`` (all of them: a chunk of a
        prompt), sampling nothing, so that a later call finds them cached. A level without a
        cache to fill (``can_score`` False: prompt lookup, a feature head that catches up from
        its source's features when it drafts) does nothing. This version scores the last
        position and drops its row; a worker with a cheaper way overrides it."""
        if self.can_score and seq_ids:
            self.score(seq_ids, token_ids, [1] * len(seq_ids))

    def score_probs(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_positions: Sequence[int],
        sampling: Sampling,
    ) -> list[torch.Tensor]:
        """:meth:`score`, turned into the level's sampling distribution ``[num_positions[b], vocab]``.

        What the engine verifies with. A remote backend overrides it to warp next to the model
        and ship only the nonzero entries (a greedy row is one entry, not ``vocab``)."""
        return _warp(self.score(seq_ids, token_ids, num_positions), sampling)

    def score_tree(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        trees: Sequence[tuple[Sequence[int], Sequence[int]]],
    ) -> list[torch.Tensor]:
        """Logits ``[n_b + 1, vocab]`` for a tree of candidate tokens after each sequence.

        ``token_ids[b]`` is the committed sequence (as :meth:`score` takes it) and ``trees[b]``
        is ``(tokens, parents)``: node ``i`` holds ``tokens[i]`` below node ``parents[i]``, or
        below the root (the position after the sequence) where it is -1; parents come before
        their children (:mod:`workers.trees`). Row 0 predicts the token after the sequence,
        row ``1 + i`` the token after the root-to-node-``i`` path.

        This generic version scores each root-to-leaf path as a chain with :meth:`score` (one
        call per leaf, all sequences' ``j``-th leaves together); a worker that can score the
        whole tree in one pass overrides it. The worker then holds each sequence alone, as
        handed: no path is left pending."""
        from workers.trees import as_tree, leaf_paths

        trees = [as_tree(t) for t in trees]
        paths = [leaf_paths(parents) for _, parents in trees]
        out: list[torch.Tensor | None] = [None] * len(seq_ids)
        for j in range(max((len(p) for p in paths), default=0)):
            batch = [b for b in range(len(seq_ids)) if j < len(paths[b])]
            logits = self.score(
                [seq_ids[b] for b in batch],
                [list(token_ids[b]) + [trees[b][0][i] for i in paths[b][j]] for b in batch],
                [len(paths[b][j]) + 1 for b in batch],
            )
            for b, rows in zip(batch, logits):
                if out[b] is None:
                    out[b] = rows.new_empty((len(trees[b][0]) + 1, rows.shape[-1]))
                out[b][[0] + [1 + i for i in paths[b][j]]] = rows
        self.hold(seq_ids, [len(t) for t in token_ids])  # the last path goes
        return out  # type: ignore[return-value]

    def score_tree_probs(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        trees: Sequence[tuple[Sequence[int], Sequence[int]]],
        sampling: Sampling,
    ) -> list[torch.Tensor]:
        """:meth:`score_tree`, turned into the level's sampling distribution ``[n_b + 1, vocab]``."""
        return _warp(self.score_tree(seq_ids, token_ids, trees), sampling)

    def draft_tree(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        widths: Sequence[Sequence[int]],  # per sequence: children per node at each depth
    ) -> list[tuple[list[int], list[int]]]:
        """Grow a tree of candidates after each sequence, one :meth:`score_tree` pass per depth for
        all sequences: every node at depth ``d`` (the root: 0) gets the ``widths[b][d]`` tokens
        this level ranks highest after it (:func:`grow_children`). Returns ``(tokens, parents)``
        per sequence, siblings best first. The candidates are chosen, not sampled: the verifier
        follows them with the matching rule (:func:`cascade.tree.verify_tree_matching`)."""
        trees: list[tuple[list[int], list[int]]] = [([], []) for _ in seq_ids]
        frontier: list[list[int]] = [[-1] for _ in seq_ids]
        for depth in range(max((len(w) for w in widths), default=0)):
            grow = [b for b in range(len(seq_ids)) if depth < len(widths[b]) and frontier[b]]
            if not grow:
                break
            logits = self.score_tree([seq_ids[b] for b in grow], [token_ids[b] for b in grow],
                                     [trees[b] for b in grow])
            for b, rows in zip(grow, logits):
                frontier[b] = grow_children(trees[b], frontier[b], rows[[parent + 1 for parent in frontier[b]]],
                                            widths[b][depth])
        return trees

    def draft(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        sampling: Sampling,
        uniforms: Sequence[torch.Tensor],  # per sequence: [max_tokens[b]] in [0, 1)
        stop: StopRule | None = None,
    ) -> list[Draft]:
        """Sample up to ``max_tokens[b]`` tokens autoregressively for each sequence, stopping
        early where ``stop`` says so. All still-drafting sequences share each forward pass."""
        drafted: list[list[int]] = [[] for _ in seq_ids]
        rows: list[list[torch.Tensor]] = [[] for _ in seq_ids]
        last: list = [None] * len(seq_ids)  # each sequence's previous DraftStep in this block
        confidence: list[list[float]] = [[] for _ in seq_ids]
        stopped = [False] * len(seq_ids)
        active = [b for b in range(len(seq_ids)) if max_tokens[b] > 0]
        while active:
            logits = self._next_logits(
                [seq_ids[b] for b in active],
                [list(token_ids[b]) + drafted[b] for b in active],
            )
            # All active rows at once: warp, sample with each row's own uniform, and the model's
            # own (T=1) probability of each drafted token. Row-wise ops: each row is as if alone.
            last_logits = torch.stack([x[-1] for x in logits])  # [n, vocab] or [n, draft columns]
            probs = sampling.probs(last_logits)
            columns = self.draft_columns
            if columns is not None:
                # The warp over the draft columns is the warp of the authority-width row that is
                # -inf elsewhere (zero there: the same softmax, top-k and nucleus; ascending ids
                # break ties as the wide row does), drawn from at full width: a keyed race
                # reads its noise at authority ids.
                probs = probs.new_zeros(len(active), self.vocab_size).index_copy_(1, columns, probs)
            draws = torch.stack([uniforms[b][len(drafted[b])] for b in active]).to(torch.float64)
            tokens = sampling.draw(probs, draws)
            at = tokens if columns is None else torch.searchsorted(columns, tokens)
            logits64 = last_logits.to(torch.float64)
            token_probs = torch.exp(logits64.gather(1, at[:, None])[:, 0] - torch.logsumexp(logits64, -1)).tolist()
            deciding: list[int] = []  # rows that may still go on: the stop rule decides
            steps = []
            for a, (b, token) in enumerate(zip(active, tokens.tolist())):
                j = len(drafted[b])
                drafted[b].append(token)
                rows[b].append(probs[a])
                confidence[b].append(token_probs[a])
                if stop is not None:
                    last[b] = draft_step(j, logits64[a], token, previous=last[b], token_prob=token_probs[a])
                    steps.append(last[b])
                if len(drafted[b]) < max_tokens[b]:
                    deciding.append(a)
            if stop is not None and deciding:
                verdicts = stop.stop_batch([steps[a] for a in deciding], len(seq_ids))
                for a, verdict in zip(deciding, verdicts):
                    stopped[active[a]] = bool(verdict)
            active = [active[a] for a in deciding if not stopped[active[a]]]
        return [
            Draft(drafted[b], torch.stack(rows[b]) if rows[b] else torch.zeros(0, self.vocab_size), len(drafted[b]),
                  confidence[b], stopped[b])  # one pass a drafted token
            for b in range(len(seq_ids))
        ]

    def _next_logits(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One drafting pass of :meth:`draft`: logits whose last row predicts the token after each
        sequence, over :attr:`draft_columns` where they are set. :meth:`score` of the last
        position; a worker that drafts otherwise than it scores (a feature head,
        :mod:`workers.head`) or over draft columns overrides it."""
        return self.score(seq_ids, token_ids, [1] * len(seq_ids))

    def release(self, seq_ids: Sequence[str]) -> None:
        """Forget the state of finished sequences."""

    def cached_sequences(self) -> int | None:
        """How many sequences this worker holds state (a KV cache) for, until released; None
        when it cannot say. For monitoring: a count that only grows is a leak."""
        return None

    def close(self) -> None:
        """Free resources (models, caches)."""


def _warp(logits: list[torch.Tensor], sampling: Sampling) -> list[torch.Tensor]:
    """Each sequence's logits rows as sampling distributions."""
    if len(logits) == 1:
        return [sampling.probs(logits[0])]
    # One warp for all rows: the warping is row-wise, so each row is what it would be alone.
    return list(sampling.probs(torch.cat(logits)).split([x.shape[0] for x in logits]))


def grow_children(tree: tuple[list[int], list[int]], frontier: Sequence[int], rows: torch.Tensor,
                  width: int, columns: torch.Tensor | None = None) -> list[int]:
    """Append below each ``frontier`` node (-1: the root) of ``tree`` (``(tokens, parents)``,
    grown in place) the ``width`` tokens its row of ``rows`` ``[len(frontier), vocab]`` ranks
    highest, best first; returns the new nodes. A stable descending sort: equal logits keep
    token order (deterministic); ``-inf`` (outside a trimmed vocabulary) is never a candidate.
    ``columns``: the ascending authority ids of rows over a draft vocabulary's columns alone
    (the same candidates as the authority-width rows, ``-inf`` elsewhere)."""
    tokens, parents = tree
    order = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :width]
    finite = torch.isfinite(rows.gather(1, order)).tolist()
    nodes = []
    for parent, best, ok in zip(frontier, (order if columns is None else columns[order]).tolist(), finite):
        for token, keep in zip(best, ok):
            if not keep:
                break
            nodes.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
    return nodes
