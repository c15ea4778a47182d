"""Online estimates the adaptive policies share: acceptance per edge and position, cost per level.

Everything here is measured from :class:`~policies.base.StepFeedback` — what the engine saw —
and decays exponentially so that estimates follow the text (boilerplate accepts more than
novel logic).
"""
from __future__ import annotations

import bisect
import copy
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from policies.base import PassCost, StepFeedback
from policies.params import tree_size


@dataclass
class EdgeAcceptance:
    """Conditional acceptance per draft position: P(accept position j | positions < j accepted).

    Starts from a prior of ``prior`` with ``prior_weight`` pseudo-observations per position.
    """

    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98
    seen: list[float] = field(default_factory=list)  # decayed count of positions examined
    accepted: list[float] = field(default_factory=list)  # decayed count of those accepted

    def observe(self, proposed: int, accepted: int) -> None:
        examined = min(proposed, accepted + 1)  # positions the verifier actually looked at
        while len(self.seen) < examined:
            self.seen.append(0.0)
            self.accepted.append(0.0)
        for j in range(len(self.seen)):
            self.seen[j] *= self.decay
            self.accepted[j] *= self.decay
        for j in range(examined):
            self.seen[j] += 1.0
            self.accepted[j] += 1.0 if j < accepted else 0.0

    def soften(self, weight: float) -> None:
        """Keep each position's estimated acceptance but at most ``weight`` observations of it."""
        if self.seen and self.seen[0] > weight:
            scale = weight / self.seen[0]
            self.seen = [s * scale for s in self.seen]
            self.accepted = [a * scale for a in self.accepted]

    def rate(self, j: int, pool: tuple[float, float] | None = None) -> float:
        """Estimated acceptance at position j (later positions borrow the last one seen): the
        edge's own rounds, its prior, and ``pool`` (a rate and the observations it is worth,
        e.g. what other edges into the same verifier measured), each by its weight."""
        seen = accepted = 0.0
        if self.seen:
            j = min(j, len(self.seen) - 1)
            seen, accepted = self.seen[j], self.accepted[j]
        rate, weight = pool if pool is not None else (0.0, 0.0)
        total = seen + self.prior_weight + weight
        return (accepted + self.prior * self.prior_weight + rate * weight) / total if total else self.prior


@dataclass
class TreeAcceptance:
    """For trees of the proposer's top-k candidates (cascade/tree.py: the matching rule): the
    probability that the verifier's token at depth j is the proposer's rank-r candidate there,
    given that the walk reached depth j and rank r was offered. The events are disjoint across
    ranks (the verifier draws one token), so a depth of width w is passed with probability
    ``sum(rate(j, r) for r < w)``.

    Rank 0 starts from the chain's measured acceptance at the same position, later ranks from a
    prior that halves with each rank, both worth ``prior_weight`` observations."""

    prior_weight: float = 2.0
    decay: float = 0.98
    later_prior: float = 0.3  # share of the first choice's misses the second choice catches, at first
    seen: list[list[float]] = field(default_factory=list)  # [depth][rank], decayed
    hits: list[list[float]] = field(default_factory=list)

    def observe(self, widths: tuple[int, ...], ranks: tuple[int, ...]) -> None:
        """One verified tree of ``widths`` per depth, whose walk took the candidates of ``ranks``
        (one per accepted depth; it ended at depth ``len(ranks)``, where no candidate matched
        unless the tree ended there)."""
        for row in (*self.seen, *self.hits):
            for r in range(len(row)):
                row[r] *= self.decay
        for j, width in enumerate(widths[:len(ranks) + 1]):
            while len(self.seen) <= j:
                self.seen.append([])
                self.hits.append([])
            for row in (self.seen[j], self.hits[j]):
                row.extend([0.0] * (width - len(row)))
            offered = width if j == len(ranks) else ranks[j] + 1  # the walk stops at the first match
            for r in range(offered):
                self.seen[j][r] += 1.0
            if j < len(ranks):
                self.hits[j][ranks[j]] += 1.0

    def rate(self, j: int, r: int, first_prior: float) -> float:
        prior = first_prior if r == 0 else (1.0 - first_prior) * self.later_prior * 0.5 ** (r - 1)
        measured = j < len(self.seen) and r < len(self.seen[j])
        seen, hits = (self.seen[j][r], self.hits[j][r]) if measured else (0.0, 0.0)
        return (hits + prior * self.prior_weight) / (seen + self.prior_weight)

    def expected_tokens(self, widths: tuple[int, ...], chain: "EdgeAcceptance") -> float:
        """Expected tokens one tree round emits: the accepted path + 1."""
        total, survive = 1.0, 1.0
        for j, width in enumerate(widths):
            survive *= min(1.0, sum(self.rate(j, r, chain.rate(j)) for r in range(width)))
            total += survive
        return total


def tree_passes(widths: tuple[int, ...]) -> tuple[list[int], int]:
    """A tree's drafting passes (positions each scores: the nodes one depth up, the root first)
    and its size."""
    return [math.prod(widths[:d]) for d in range(len(widths))], tree_size(widths)


def width_bucket(positions: float) -> int:
    """Positions per pass 1 to 8 each their own bucket; above, four buckets per doubling."""
    if positions <= 8.5:
        return max(1, round(positions))
    return 8 + round(4 * math.log2(positions / 8))


@dataclass
class PassModel:
    """Seconds of a call of ``passes`` forward passes computing ``tokens`` positions in all: a
    line (``per_pass * passes + per_token * tokens``, exponentially weighted non-negative least
    squares, stalls clipped) and, per :func:`width_bucket`, the median of its last ``window``
    passes. :meth:`pass_seconds` interpolates the measured buckets (``min_samples`` passes each,
    made non-decreasing), each pass rescaled by how the narrowest bucket has moved since it was
    measured (:meth:`_reference`), and follows the line's slope beyond them
    (docs/policies.md, "Costs")."""

    fit_decay: float = 0.97
    window: int = 15
    min_samples: int = 3
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # pp, pt, tt, ps, ts
    _fit: tuple[float, float] | None = None
    # bucket -> (positions, seconds, the reference when measured: (bucket, seconds) or None)
    _widths: dict[int, tuple[deque, deque, deque]] = field(default_factory=dict)
    _points: tuple[list[float], list[float]] | None = None
    calls: int = 0

    def observe(self, passes: float, tokens: float, seconds: float) -> None:
        fit = self.fit
        if fit is not None and self.calls >= 3:
            # a call stalled by something else (another process, a GC pause, a batch being
            # regrouped) says nothing about the passes the policy prices: clip it (loosely while
            # the fit is young), so that one stall cannot dominate
            seconds = min(seconds, (10.0 if self.calls < 10 else 3.0) * (fit[0] * passes + fit[1] * tokens))
        self.calls += 1
        self._sums = [self.fit_decay * x for x in self._sums]
        for i, v in enumerate((passes * passes, passes * tokens, tokens * tokens, passes * seconds, tokens * seconds)):
            self._sums[i] += v
        self._fit = None
        if passes > 0:
            width = tokens / passes
            reference = self._reference()
            kept = self._widths.setdefault(width_bucket(width), tuple(deque(maxlen=self.window) for _ in range(3)))
            kept[0].append(width)
            kept[1].append(seconds / passes)
            kept[2].append(reference)
            self._points = None

    def _reference(self) -> tuple[int, float] | None:
        """The narrowest bucket with ``min_samples`` passes and its median seconds, or None."""
        settled = [b for b, kept in self._widths.items() if len(kept[1]) >= self.min_samples]
        if not settled:
            return None
        bucket = min(settled)
        return bucket, statistics.median(self._widths[bucket][1])

    def _bucket_seconds(self, bucket: int, reference: tuple[int, float] | None) -> float:
        """A bucket's median seconds, each pass scaled by how the reference bucket's median has
        moved since it was measured (passes measured without that reference: as they were)."""
        _, seconds, refs = self._widths[bucket]
        if reference is None or bucket == reference[0]:
            return statistics.median(seconds)
        ref_bucket, now = reference
        return statistics.median(s * now / r[1] if r is not None and r[0] == ref_bucket and r[1] > 0 else s
                                 for s, r in zip(seconds, refs))

    def _curve(self) -> tuple[list[float], list[float]]:
        """The measured buckets' (positions, seconds), ascending, made non-decreasing."""
        if self._points is None:
            reference = self._reference()
            measured = sorted((statistics.median(w), self._bucket_seconds(b, reference))
                              for b, (w, s, _) in self._widths.items() if len(s) >= self.min_samples)
            xs, ys, top = [], [], 0.0
            for x, y in measured:
                top = max(top, y)  # a pass over more positions costs no less
                xs.append(x)
                ys.append(top)
            self._points = (xs, ys)
        return self._points

    def span(self) -> tuple[float, float] | None:
        """The fewest and most positions per pass measured (by buckets of ``min_samples``
        passes); None while no bucket has that many."""
        xs = self._curve()[0]
        return (xs[0], xs[-1]) if xs else None

    def pass_seconds(self, positions: float) -> float | None:
        """Seconds of one pass computing ``positions`` positions; None before any call."""
        fit = self.fit
        if fit is None:
            return None
        xs, ys = self._curve()
        a, b = fit
        if not xs:
            return a + b * positions
        if positions <= xs[0]:
            return max(0.0, ys[0] - b * (xs[0] - positions))
        if positions >= xs[-1]:
            return ys[-1] + b * (positions - xs[-1])
        i = bisect.bisect_right(xs, positions)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (positions - x0) / (x1 - x0) if x1 > x0 else y1

    @property
    def fit(self) -> tuple[float, float] | None:
        """(seconds per pass, seconds per position), both >= 0; None before any call."""
        if self._fit is None and self._sums[0] > 0:
            pp, pt, tt, ps, ts = self._sums
            ridge = 1e-9 * (pp + tt)  # a tiny ridge: one call shape alone gives the min-norm split
            det = (pp + ridge) * (tt + ridge) - pt * pt
            a = ((tt + ridge) * ps - pt * ts) / det
            b = ((pp + ridge) * ts - pt * ps) / det
            if b < 0:
                a, b = ps / pp, 0.0
            elif a < 0:
                a, b = 0.0, ts / (tt + ridge)
            self._fit = (a, b)
        return self._fit


def batch_bucket(sequences: float) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: one bucket per doubling."""
    return max(1, int(round(sequences))).bit_length()


@dataclass
class LevelCost:
    """What a level's forward passes cost, learned from measured calls: a :class:`PassModel`
    per batch-size bucket (1, 2-3, 4-7, ...). A sequence of a batch of B pays ``per_pass / B +
    per_token * width``. Calls in which a sequence feeds more than ``catch_up_positions``
    positions beyond those scored for it, or more than ``prefill_positions`` per sequence on
    average, are not fitted: the policy prices decoding passes (docs/policies.md, "Costs").
    Until a call has been measured, :meth:`observe` gives a moving average of seconds per pass.
    """

    decay: float = 0.9
    seconds: float | None = None  # moving average of seconds per pass (the fallback)
    prefill_positions: int = 40
    catch_up_positions: int = 4
    min_calls: int = 8
    buckets: dict[int, PassModel] = field(default_factory=dict)
    _models: dict[int, PassModel] = field(default_factory=dict)  # per bucket wanted, until a call

    def observe(self, seconds: float, passes: int) -> None:
        # A level without forward passes (prompt lookup) still costs its call time.
        per_pass = seconds / max(1, passes)
        self.seconds = per_pass if self.seconds is None else self.decay * self.seconds + (1 - self.decay) * per_pass

    def observe_pass(self, passes: int, tokens: int, seconds: float, rows: int | None = None,
                     catch_up: int = 0) -> None:
        """A call of ``passes`` passes covering ``rows`` sequence-passes, ``tokens`` positions, in
        which one sequence fed at most ``catch_up`` positions beyond those scored for it."""
        passes = max(1, passes)
        rows = passes if rows is None else max(1, rows)
        if tokens > self.prefill_positions * rows or catch_up > self.catch_up_positions:
            return
        self.buckets.setdefault(batch_bucket(rows / passes), PassModel()).observe(passes, tokens, seconds)
        self._models.clear()

    def model(self, batch: int = 1) -> PassModel | None:
        """The pass model at this batch size: its bucket's, else the nearest measured bucket's
        (preferring models of at least ``min_calls`` calls); None if none is."""
        if not self.buckets:
            return None
        want = batch_bucket(batch)
        if want not in self._models:
            # the nearest bucket with enough calls behind its fit (a young fit splits badly)
            settled = [k for k, m in self.buckets.items() if m.calls >= self.min_calls] or list(self.buckets)
            nearest = min(settled, key=lambda k: (abs(k - want), -k))
            self._models[want] = self.buckets[nearest]
        return self._models[want]

    def per_sequence(self, batch: int, width: int) -> float | None:
        """Seconds one of ``batch`` sequences is charged for a pass scoring ``width`` positions of
        its own (the pass's fixed cost is shared by the batch)."""
        model = self.model(batch)
        if model is None or model.fit is None:
            return self.seconds
        batch = max(1, batch)
        return self._pass_seconds(model, batch_bucket(batch), batch * width) / batch

    def _pass_seconds(self, model: PassModel, bucket: int, positions: float) -> float:
        """``model``'s pass over ``positions``; outside the positions it has measured, its
        measured edge times the ratio the nearest other batch size that has measured both
        widths finds between them: a batch that has only decoded splits a pass into fixed and
        per-position cost arbitrarily, which can price a wider pass out for good (docs/policies.md)."""
        span = model.span()
        if span is None or span[0] <= positions <= span[1]:
            return model.pass_seconds(positions)
        edge = span[1] if positions > span[1] else span[0]
        lo, hi = min(edge, positions), max(edge, positions)
        for _, other in sorted(self.buckets.items(), key=lambda kv: (abs(kv[0] - bucket), -kv[0])):
            other_span = other.span() if other is not model else None
            if other_span is not None and other_span[0] <= lo and hi <= other_span[1]:
                base = other.pass_seconds(edge)
                if base:
                    return model.pass_seconds(edge) * other.pass_seconds(positions) / base
        return model.pass_seconds(positions)


BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # lower edges of confidence bins


def confidence_bin(p: float) -> int:
    return bisect.bisect_right(BINS, p) - 1


@dataclass
class Calibration:
    """How often the verifier accepts a draft token, by the bin of the drafter's own probability
    of it (a small model's probabilities are not acceptance probabilities), in three contexts:
    a block's first token after a fully accepted block, after a rejection, and later tokens.
    Starts from ``prior`` with ``prior_weight`` pseudo-observations per bin."""

    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.998
    seen: list[list[float]] = field(default_factory=lambda: [[0.0] * len(BINS) for _ in range(3)])
    accepted: list[list[float]] = field(default_factory=lambda: [[0.0] * len(BINS) for _ in range(3)])
    rounds: int = 0

    FIRST_AFTER_FULL, FIRST_AFTER_REJECT, LATER = 0, 1, 2

    def observe(self, confidence: tuple[float, ...], accepted: int, after_full: bool) -> None:
        examined = min(len(confidence), accepted + 1)
        for table in (*self.seen, *self.accepted):
            for i in range(len(table)):
                table[i] *= self.decay
        for j in range(examined):
            ctx = (self.FIRST_AFTER_FULL if after_full else self.FIRST_AFTER_REJECT) if j == 0 else self.LATER
            i = confidence_bin(confidence[j])
            self.seen[ctx][i] += 1.0
            self.accepted[ctx][i] += 1.0 if j < accepted else 0.0
        self.rounds += 1

    def table(self, ctx: int) -> tuple[float, ...]:
        w = self.prior_weight
        return tuple((a + self.prior * w) / (n + w) if n + w > 0 else self.prior
                     for n, a in zip(self.seen[ctx], self.accepted[ctx]))

    def mean(self, ctx: int) -> float:
        n, a = sum(self.seen[ctx]), sum(self.accepted[ctx])
        return (a + self.prior * self.prior_weight) / (n + self.prior_weight) if n + self.prior_weight > 0 else self.prior


class Estimates:
    """Acceptance of every edge (by position, and by the drafter's confidence) and cost of every
    level, updated from step feedback and measured calls."""

    def __init__(self, prior: float = 0.6, decay: float = 0.98, pool_weight: float = 0.0,
                 costs: dict[str, LevelCost] | None = None):
        self.prior = prior
        self.decay = decay
        self.pool_weight = pool_weight
        self.kinds: dict[str, str] = {}  # level -> its kind (hf, ngram, head, ...): pools stay within a kind
        self.edges: dict[tuple[str, str], EdgeAcceptance] = {}
        self.trees: dict[tuple[str, str], TreeAcceptance] = {}
        self.calibrations: dict[tuple[str, str], Calibration] = {}
        self.costs: dict[str, LevelCost] = {} if costs is None else costs  # shareable: they are the levels'
        self.after_full: dict[tuple[str, str], bool] = {}  # was the edge's last block accepted whole?

    def fork(self, carry: float) -> "Estimates":
        """A copy of what was measured of acceptance, each edge's kept with at most ``carry``
        observations of it; the costs (and the levels' kinds) shared, not copied."""
        twin = Estimates(self.prior, self.decay, self.pool_weight, self.costs)
        twin.kinds = self.kinds
        twin.edges, twin.trees, twin.calibrations, twin.after_full = copy.deepcopy(
            (self.edges, self.trees, self.calibrations, self.after_full))
        for edge in twin.edges.values():
            edge.soften(carry)
        return twin

    def edge(self, proposer: str, verifier: str) -> EdgeAcceptance:
        key = (proposer, verifier)
        if key not in self.edges:
            self.edges[key] = EdgeAcceptance(prior=self.prior, decay=self.decay)
        return self.edges[key]

    def tree(self, proposer: str, verifier: str) -> TreeAcceptance:
        key = (proposer, verifier)
        if key not in self.trees:
            self.trees[key] = TreeAcceptance(decay=self.decay)
        return self.trees[key]

    def calibration(self, proposer: str, verifier: str) -> Calibration:
        key = (proposer, verifier)
        if key not in self.calibrations:
            self.calibrations[key] = Calibration(prior=self.prior)
        return self.calibrations[key]

    def cost(self, level: str, batch: int = 1, width: int = 1) -> float | None:
        """Seconds one of ``batch`` sequences pays for a pass of ``level`` scoring ``width`` of
        its positions; None if never measured."""
        c = self.costs.get(level)
        return c.per_sequence(batch, width) if c else None

    def observe(self, feedback: StepFeedback) -> None:
        for e in feedback.edges:
            if e.candidates:  # a tree: its own estimates (a chain accepts less)
                widths = feedback.plan.tree.get(e.proposer, ())[:e.proposed]
                self.tree(e.proposer, e.verifier).observe(widths, e.ranks)
                continue
            self.edge(e.proposer, e.verifier).observe(e.proposed, e.accepted)
            if e.confidence:
                key = (e.proposer, e.verifier)
                self.calibration(*key).observe(e.confidence, e.accepted, self.after_full.get(key, False))
                self.after_full[key] = e.accepted >= e.proposed
        for level, seconds in feedback.level_seconds.items():
            self.costs.setdefault(level, LevelCost()).observe(seconds, feedback.level_passes.get(level, 0))

    def observe_pass(self, cost: PassCost) -> None:
        rows = cost.rows if cost.rows is not None else cost.sequences * max(1, cost.passes)
        self.costs.setdefault(cost.level, LevelCost()).observe_pass(cost.passes, cost.tokens, cost.seconds, rows,
                                                                    cost.catch_up)

    def path_cost(self, path: tuple[str, ...], max_lookahead: int, default_cost: float = 1e-3, batch: int = 1,
                  rates: dict[str, float] | None = None, tree: tuple[int, ...] | None = None
                  ) -> tuple[float, dict[str, int]]:
        """Expected seconds per token the authority commits along ``path``, for one of ``batch``
        sequences, and the lookahead per level that minimises it: the speedup equation
        (cascade/DESIGN.md §4) applied edge by edge, bottom-up. Level ``path[0]`` drafts one
        token a pass; level ``path[i]`` takes k tokens from below and runs one pass over k + 1
        positions, for ``expected_tokens(k)`` tokens (``rates``, if given, receives each level's
        seconds per token). With ``pool_weight`` an edge's acceptance is shrunk towards the rate
        pooled over the other edges of its proposer's kind into the same verifier; with ``tree``
        the first edge is a tree of the first level's top candidates (:class:`TreeAcceptance`).
        docs/policies.md ("Path choice", "Trees") says why.
        """
        def cost(level: str, width: int) -> float:
            c = self.cost(level, batch, width)
            return default_cost if c is None else c

        into: dict[tuple[str, str], list[EdgeAcceptance]] = {}

        def pooled(below: str, level: str, j: int) -> tuple[float, float] | None:
            """(acceptance at position j pooled over the other edges into ``level`` from a
            proposer of ``below``'s kind, worth ``pool_weight`` observations at most and no more
            than the pool has seen); not the edge itself, whose own rounds would count twice."""
            if not self.pool_weight:
                return None
            key = (below, level)
            if key not in into:
                kind = self.kinds.get(below)
                into[key] = [e for (proposer, verifier), e in self.edges.items()
                             if verifier == level and proposer != below and e.seen and self.kinds.get(proposer) == kind]
            seen = accepted = 0.0
            for e in into[key]:
                i = min(j, len(e.seen) - 1)
                seen, accepted = seen + e.seen[i], accepted + e.accepted[i]
            return (accepted / seen, min(self.pool_weight, seen)) if seen else None

        per_token = cost(path[0], 1)
        lookahead: dict[str, int] = {}
        edges = list(zip(path, path[1:]))
        if tree and edges:
            below, level = edges.pop(0)
            drafts, size = tree_passes(tree)
            seconds = sum(cost(below, width) for width in drafts) + cost(level, size + 1)
            per_token = seconds / self.tree(below, level).expected_tokens(tree, self.edge(below, level))
            lookahead[below] = len(tree)
            if rates is not None:
                rates[level] = per_token
        for below, level in edges:
            acc = self.edge(below, level)
            best_k, best = 0, cost(level, 1)  # k = 0: the level samples a token itself, one pass per token
            expected, survive = 1.0, 1.0  # expected_tokens(k), built up incrementally
            for k in range(1, max_lookahead + 1):
                pool = pooled(below, level, k - 1)
                survive *= acc.rate(k - 1, pool)
                expected += survive
                per = (k * per_token + cost(level, k + 1)) / expected
                if per < best:
                    best_k, best = k, per
            lookahead[below] = best_k
            per_token = best
            if rates is not None:
                rates[level] = best
        return per_token, lookahead
