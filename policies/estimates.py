"""Online estimates the adaptive policies share: acceptance per edge and position, cost per level.

Everything here is measured from :class:`~policies.base.StepFeedback` — what the engine saw —
and decays exponentially so that estimates follow the text (boilerplate accepts more than
novel logic).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import StepFeedback


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

    def rate(self, j: int) -> float:
        """Estimated acceptance at position j (later positions borrow the last one seen)."""
        if not self.seen:
            return self.prior
        j = min(j, len(self.seen) - 1)
        weight = self.seen[j] + self.prior_weight
        return (self.accepted[j] + self.prior * self.prior_weight) / weight if weight else self.prior

    def expected_tokens(self, k: int) -> float:
        """Expected tokens one round emits with a block of k: accepted prefix + 1."""
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= self.rate(j)
            total += survive
        return total

    @property
    def observations(self) -> float:
        return self.seen[0] if self.seen else 0.0


@dataclass
class LevelCost:
    """Seconds per forward pass of a level (exponential moving average)."""

    decay: float = 0.9
    seconds: float | None = None

    def observe(self, seconds: float, passes: int) -> None:
        # A level without forward passes (prompt lookup) still costs its call time.
        per_pass = seconds / max(1, passes)
        self.seconds = per_pass if self.seconds is None else self.decay * self.seconds + (1 - self.decay) * per_pass


class Estimates:
    """Acceptance of every edge and cost of every level, updated from step feedback."""

    def __init__(self, prior: float = 0.6, decay: float = 0.98):
        self.prior = prior
        self.decay = decay
        self.edges: dict[tuple[str, str], EdgeAcceptance] = {}
        self.costs: dict[str, LevelCost] = {}

    def edge(self, proposer: str, verifier: str) -> EdgeAcceptance:
        key = (proposer, verifier)
        if key not in self.edges:
            self.edges[key] = EdgeAcceptance(prior=self.prior, decay=self.decay)
        return self.edges[key]

    def cost(self, level: str) -> float | None:
        c = self.costs.get(level)
        return c.seconds if c else None

    def observe(self, feedback: StepFeedback) -> None:
        for e in feedback.edges:
            self.edge(e.proposer, e.verifier).observe(e.proposed, e.accepted)
        for level, seconds in feedback.level_seconds.items():
            self.costs.setdefault(level, LevelCost()).observe(seconds, feedback.level_passes.get(level, 0))

    def path_cost(self, path: tuple[str, ...], max_lookahead: int, default_cost: float = 1e-3
                  ) -> tuple[float, dict[str, int]]:
        """Expected seconds per token the authority commits along ``path``, and the lookahead per
        level that minimises it (the seed's speedup equation, §9, applied edge by edge).

        Level ``path[0]`` drafts one token per forward pass. Level ``path[i]`` builds its tokens
        in rounds: k tokens from below (k times the cost per token below) plus one forward pass
        of its own, yielding ``expected_tokens(k)`` tokens. The best k per edge is chosen bottom-up.
        """
        per_token = self.cost(path[0]) or default_cost
        lookahead: dict[str, int] = {}
        for below, level in zip(path, path[1:]):
            acc = self.edge(below, level)
            own = self.cost(level) or default_cost
            best_k, best = 0, own  # k = 0: the level samples a token itself, one pass per token
            expected, survive = 1.0, 1.0  # expected_tokens(k), built up incrementally
            for k in range(1, max_lookahead + 1):
                survive *= acc.rate(k - 1)
                expected += survive
                per = (k * per_token + own) / expected
                if per < best:
                    best_k, best = k, per
            lookahead[below] = best_k
            per_token = best
        return per_token, lookahead
