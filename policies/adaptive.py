"""Adaptive policies: confidence, entropy, cost-aware, escalation and auto.

All of them choose only *execution* (path, lookahead, early stop); acceptance stays with the
exact rule, so none can change the output distribution. Plans may depend on anything that
happened in earlier steps; stop rules see only the drafter's own distribution.
"""
from __future__ import annotations

import random

import networkx as nx

from policies.base import PassCost, PlanContext, Policy, PolicyError, StepFeedback, StepPlan, longest_path
from policies.estimates import Calibration, Estimates
from policies.fixed import check_path
from policies.stops import CalibratedStop, ConfidenceStop, EntropyStop


def _check_unit(name: str, value: float, low: float = 0.0, high: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise PolicyError(f"{name}: expected a number in [{low}, {high}], got {value!r}")
    return float(value)


def _check_lookahead(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise PolicyError(f"{name}: expected an integer in [1, 64], got {value!r}")
    return value


class _PathMixin:
    """A fixed path (given, or the longest over available levels), cached per available set."""

    path_param: list[str] | None
    _paths: dict

    def _init_path(self, path: list[str] | None) -> None:
        self.path_param = list(path) if path is not None else None
        self._paths = {}

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        super().bind(graph, authority)
        if self.path_param is not None:
            check_path(graph, authority, self.path_param)

    def _stop_plan(self, ctx: PlanContext, lookahead: int, rule) -> StepPlan:
        """The path, one lookahead for every proposing level, and one stop rule for each."""
        path = self._path(ctx)
        return StepPlan(path, {n: lookahead for n in path[:-1]}, {n: rule for n in path[:-1]})

    def _path(self, ctx: PlanContext) -> tuple[str, ...]:
        if self.path_param is not None and all(n in ctx.available for n in self.path_param):
            return tuple(self.path_param)
        if ctx.available not in self._paths:
            self._paths[ctx.available] = longest_path(ctx.graph, ctx.authority, ctx.available)
        return self._paths[ctx.available]


class ConfidencePolicy(_PathMixin, Policy):
    """Draft up to ``lookahead`` tokens per block, stopping at the first token whose drafter
    probability (or the block's running product, ``mode: block``) is below ``threshold``."""

    name = "confidence"

    def __init__(self, lookahead: int = 8, threshold: float = 0.4, mode: str = "token", path: list[str] | None = None):
        self.lookahead = _check_lookahead("lookahead", lookahead)
        self.threshold = _check_unit("threshold", threshold)
        if mode not in ("token", "block"):
            raise PolicyError(f"mode: expected 'token' or 'block', got {mode!r}")
        self.mode = mode
        self._init_path(path)

    def plan(self, ctx: PlanContext) -> StepPlan:
        return self._stop_plan(ctx, self.lookahead, ConfidenceStop(self.threshold, self.mode))


class EntropyPolicy(_PathMixin, Policy):
    """Stop drafting when ``exp(-entropy)`` (a lower bound on the drafter's top probability) is
    below a threshold that adapts online: blocks that are accepted whole lower it (draft
    further), blocks rejected early raise it, steering the accepted share of each block
    towards ``target``."""

    name = "entropy"

    def __init__(self, lookahead: int = 8, threshold: float = 0.4, target: float = 0.75, rate: float = 0.05,
                 path: list[str] | None = None):
        self.lookahead = _check_lookahead("lookahead", lookahead)
        self.threshold = _check_unit("threshold", threshold)
        self.target = _check_unit("target", target)
        self.rate = _check_unit("rate", rate)
        self._init_path(path)

    def plan(self, ctx: PlanContext) -> StepPlan:
        return self._stop_plan(ctx, self.lookahead, EntropyStop(self.threshold))

    def observe(self, feedback: StepFeedback) -> None:
        for e in feedback.edges:
            if e.proposed:
                share = e.accepted / e.proposed
                self.threshold = min(0.99, max(0.01, self.threshold + self.rate * (self.target - share)))


class CostAwarePolicy(_PathMixin, Policy):
    """Lookahead per edge chosen online to maximise committed tokens per second.

    From measured acceptance per draft position and the measured cost of each level's passes
    (a fixed cost per pass plus a cost per position scored, fitted from every call: see
    ``LevelCost``), it picks the k that minimises expected seconds per emitted token on each
    edge (the seed's speedup equation, §9, composed up the hierarchy: see
    ``Estimates.path_cost``), and explores a random k on one edge with probability ``explore``
    (decaying as ``explore * 200 / (200 + steps)``).

    Under load a pass's fixed cost is shared by the batch while every drafted position still
    costs the verifier its own compute, so the same equation stops paying for speculation as
    the batch grows: the policy drops to plain batched decoding by itself. ``verify_budget``
    optionally caps the tokens one authority pass verifies across the batch on top of that
    (the authority's proposer gets at most ``verify_budget // batch_size - 1`` per sequence).
    """

    name = "cost-aware"

    def __init__(self, max_lookahead: int = 8, explore: float = 0.1, prior: float = 0.6, decay: float = 0.98,
                 seed: int = 0, path: list[str] | None = None, verify_budget: int | None = None):
        if verify_budget is not None and (isinstance(verify_budget, bool) or not isinstance(verify_budget, int)
                                          or verify_budget < 1):
            raise PolicyError(f"verify_budget: expected a positive integer or null, got {verify_budget!r}")
        self.verify_budget = verify_budget
        self.max_lookahead = _check_lookahead("max_lookahead", max_lookahead)
        self.explore = _check_unit("explore", explore)
        self.estimates = Estimates(prior=_check_unit("prior", prior), decay=_check_unit("decay", decay))
        self.rng = random.Random(seed)
        self.steps = 0
        self._init_path(path)

    def _exploring(self) -> bool:
        return self.explore > 0 and self.rng.random() < self.explore * 200 / (200 + self.steps)

    def _explore(self, lookahead: dict[str, int]) -> dict[str, int]:
        """Now and then, try a random lookahead (>= 1) on one edge, so that an edge whose
        estimate says "does not pay" (k = 0) is still measured."""
        if lookahead and self._exploring():
            level = self.rng.choice(sorted(lookahead))
            lookahead = dict(lookahead)
            lookahead[level] = self.rng.randint(1, min(8, self.max_lookahead))
        return lookahead

    def _under_load(self, ctx: PlanContext, path: tuple[str, ...], lookahead: dict[str, int]) -> StepPlan:
        """Apply the verification budget, then drop levels left idle (k = 0 on their edge)."""
        if self.verify_budget is not None and len(path) > 1:
            cap = self.verify_budget // max(1, ctx.batch_size) - 1
            lookahead = dict(lookahead, **{path[-2]: max(0, min(lookahead[path[-2]], cap))})
        # A level asked for no tokens cuts the path: nothing below it can be used.
        for j in range(len(path) - 2, -1, -1):
            if lookahead.get(path[j], 0) == 0:
                path = path[j + 1:]
                break
        return StepPlan(path, {n: lookahead[n] for n in path[:-1]})

    def plan(self, ctx: PlanContext) -> StepPlan:
        path = self._path(ctx)
        _, lookahead = self.estimates.path_cost(path, self.max_lookahead, batch=ctx.batch_size)
        return self._under_load(ctx, path, self._explore(lookahead))

    def observe(self, feedback: StepFeedback) -> None:
        self.steps += 1
        self.estimates.observe(feedback)

    def observe_pass(self, cost: PassCost) -> None:
        self.estimates.observe_pass(cost)


class EscalationPolicy(CostAwarePolicy):
    """Chooses the path per step, and the lookahead on it.

    Every path through the graph to the authority is priced with the measured acceptance and
    costs (``Estimates.path_cost``): a level whose edge does not pay for its cost
    (A <= 1 + T_draft / T_verify) makes its paths dearer and is skipped. Untried paths start
    from an optimistic prior. Probe rounds — every path once, in random order, ``warmup``
    rounds at the start, then one round of the contenders every ``probe_every`` steps (a step
    of a batch of B counting 1/B: a probe of a large batch is dear and teaches a lot) — keep
    every edge's estimates sampled across the run: acceptance swings several-fold between
    texts, so estimates of paths measured at different times would not compare. A round that
    leaves the choice unchanged doubles the interval to the next, up to ``probe_backoff`` x
    ``probe_every`` (on the bundled 4-level topology a round is eight steps, most of them on
    slower paths); a change of path brings it back to ``probe_every``. The current
    path is kept unless another is priced ``switch_margin`` cheaper. A path that drafts is
    taken only if it is priced ``draft_margin`` cheaper than the authority decoding alone: a
    speculative step has costs the price leaves out (the engine's work per drafted token, the
    verifier scoring every row of a batch as wide as the longest block, cache holes left by
    rolled-back tokens) — a few percent, which decide where speculation only breaks even, as
    under heavy load. A random path is also explored with probability ``explore`` (decaying
    with the steps seen). Prices are reused for ``reprice_every`` (8) plans at one batch size,
    and priced afresh after a probe round: the estimates move slowly between rounds, and
    pricing every path each step costs a sizeable share of a small model's step.

    With ``confident`` set, acceptance is also kept separately
    for confident and unconfident contexts — the mean probability the first level gave its own
    drafts in the previous step, against ``confident`` — so that confident blocks may go
    straight to the authority along a shortcut edge and unsure ones through the middle levels.
    """

    name = "escalation"

    def __init__(self, max_lookahead: int = 8, explore: float = 0.05, prior: float = 0.7, decay: float = 0.98,
                 confident: float | None = None, seed: int = 0, verify_budget: int | None = None, warmup: int = 2,
                 switch_margin: float = 0.05, probe_every: int = 128, pool_weight: float = 20.0,
                 draft_margin: float = 0.1, probe_backoff: int = 8):
        super().__init__(max_lookahead, explore, prior, decay, seed, verify_budget=verify_budget)
        self.draft_margin = _check_unit("draft_margin", draft_margin)
        self.confident = None if confident is None else _check_unit("confident", confident)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise PolicyError(f"warmup: expected an integer >= 0, got {warmup!r}")
        self.warmup = warmup
        self.switch_margin = _check_unit("switch_margin", switch_margin)
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise PolicyError(f"probe_every: expected an integer >= 1, got {probe_every!r}")
        self.probe_every = probe_every
        if isinstance(probe_backoff, bool) or not isinstance(probe_backoff, int) or probe_backoff < 1:
            raise PolicyError(f"probe_backoff: expected an integer >= 1, got {probe_backoff!r}")
        self.probe_backoff = probe_backoff
        self._interval = float(probe_every)  # steps between probe rounds, now
        self._judge_round = False  # the next exploit choice tells whether the last round changed it
        self._current: dict[frozenset[str], tuple[str, ...]] = {}
        self._plans = self._rounds = 0
        self._since_probe = 0.0
        self._probes: list[tuple[str, ...]] = []  # the rest of the current probe round
        self.contender_margin = 0.25
        self.estimates.pool_weight = pool_weight = _check_unit("pool_weight", pool_weight, 0.0, 1e6)
        self.contexts = {True: Estimates(prior=prior, decay=decay, pool_weight=pool_weight), False: self.estimates}
        self._context = False
        self._all_paths: dict[frozenset[str], list[tuple[str, ...]]] = {}
        self.reprice_every = 8
        self._prices: dict[tuple, tuple[int, object]] = {}  # key -> (plan number when priced, prices)

    def _candidates(self, ctx: PlanContext) -> list[tuple[str, ...]]:
        if ctx.available not in self._all_paths:
            sub = ctx.graph.subgraph(ctx.available)
            paths = [(ctx.authority,)]
            for source in sub:
                if source != ctx.authority:
                    paths.extend(tuple(p) for p in nx.all_simple_paths(sub, source, ctx.authority))
            self._all_paths[ctx.available] = paths
        return self._all_paths[ctx.available]

    def _estimates(self) -> Estimates:
        estimates = self.contexts[self._context]
        estimates.costs = self.estimates.costs  # costs are measured per level whatever the context
        return estimates

    def _choose(self, ctx: PlanContext, max_lookahead: int) -> tuple[tuple[str, ...], dict[str, int], str]:
        """(path, lookahead up to ``max_lookahead``, kind): kind is "probe", "explore" or "exploit"."""
        candidates = self._candidates(ctx)
        priced = self._priced(("paths", ctx.available, ctx.batch_size, max_lookahead),
                              lambda estimates: {p: estimates.path_cost(p, max_lookahead, batch=ctx.batch_size)
                                                 for p in candidates})
        self._plans += 1
        # A probe step runs the whole batch on a path that is probably worse, and teaches in
        # proportion to the batch: so probes come every ``probe_every`` steps of one sequence
        # (a step of a batch of B counts 1/B).
        self._since_probe += 1.0 / max(1, ctx.batch_size)
        if not self._probes and (self._plans <= self.warmup * len(candidates) or self._since_probe >= self._interval):
            self._since_probe = 0.0
            self._probes = self._probe_round(priced)
        if self._probes:
            path = self._probes.pop()
            if not self._probes:  # the round's last probe: price afresh with what the round taught
                self._prices.clear()
                self._judge_round = True
            return path, {n: max(1, k) for n, k in priced[path][1].items()}, "probe"
        drafting = [p for p in candidates if len(p) > 1]
        if drafting and self._exploring():
            path = self.rng.choice(drafting)
            return path, {n: self.rng.randint(1, min(8, max_lookahead)) for n in path[:-1]}, "explore"
        score = {p: priced[p][0] * (1 + self.draft_margin if len(p) > 1 else 1) for p in candidates}
        path = min(score, key=score.get)
        # Hysteresis: leave the current path only for one that is clearly cheaper, so that
        # near-equal paths do not flap the choice on noise.
        current = self._current.get(ctx.available)
        if current in score and score[path] > (1 - self.switch_margin) * score[current]:
            path = current
        self._current[ctx.available] = path
        # Back off: a probe round that leaves the choice as it was (probes and explores do not
        # move ``current``) doubles the interval to the next, up to probe_backoff x probe_every;
        # a changed choice means the text has moved, and probing returns to every probe_every.
        if path != current:
            self._interval = float(self.probe_every)
        elif self._judge_round:
            self._interval = min(2 * self._interval, float(self.probe_every * self.probe_backoff))
        self._judge_round = False
        return path, priced[path][1], "exploit"

    def _priced(self, key: tuple, price):
        """``price(estimates)``, reused for ``reprice_every`` plans: the estimates move a little
        per step (they decay slowly), while pricing every path costs about a millisecond of
        Python, a sizeable share of a small model's step."""
        key = (self._context, *key)
        hit = self._prices.get(key)
        if hit is None or self._plans - hit[0] >= self.reprice_every:
            hit = self._prices[key] = (self._plans, price(self._estimates()))
        return hit[1]

    def _probe_round(self, priced: dict[tuple[str, ...], tuple[float, dict[str, int]]]) -> list[tuple[str, ...]]:
        """The paths of the next probe round, in random order: all of them in the warm-up and in
        every other round; otherwise the contenders, priced within ``1 + contender_margin`` of
        the best. Probes keep every edge's estimates sampled across the whole run, so that edges
        are compared over the same texts (acceptance swings several-fold between texts)."""
        self._rounds += 1
        paths = list(priced)
        if self._rounds > self.warmup and self._rounds % 2:
            best = min(cost for cost, _ in priced.values())
            paths = [p for p in paths if priced[p][0] <= (1 + self.contender_margin) * best]
        self.rng.shuffle(paths)
        return paths

    def plan(self, ctx: PlanContext) -> StepPlan:
        path, lookahead, _ = self._choose(ctx, self.max_lookahead)
        return self._under_load(ctx, path, lookahead)

    def observe(self, feedback: StepFeedback) -> None:
        self.steps += 1
        self.contexts[self._context].observe(feedback)
        if self.confident is not None and feedback.confidence is not None:
            self._context = feedback.confidence >= self.confident


class AutoPolicy(EscalationPolicy):
    """The default: escalation's choice of path (priced for the current batch size), and on
    the path's first edge a long lookahead cut short by a calibrated stop.

    The drafter keeps going while the estimated probability that its whole block is accepted
    — the product, over its tokens, of the measured acceptance for the drafter's own
    probability of each (``Calibration``, ``CalibratedStop``) — stays above a threshold at
    which one more token stops paying: drafting it costs the drafter's pass plus the
    verifier's extra position, and it earns that token's chance of acceptance times the
    seconds a committed token costs on this path. ``stop_threshold`` fixes that threshold
    instead; ``stop: false`` switches the stop off (lookahead from the cost model alone). Paths
    are priced with blocks of at most ``price_lookahead``.
    """

    name = "auto"

    def __init__(self, max_lookahead: int = 32, explore: float = 0.0, prior: float = 0.7, decay: float = 0.999,
                 confident: float | None = None, stop: bool = True, stop_threshold: float | None = None,
                 seed: int = 0, verify_budget: int | None = None, warmup: int = 2, switch_margin: float = 0.05,
                 probe_every: int = 128, pool_weight: float = 20.0, price_lookahead: int = 12,
                 draft_margin: float = 0.1, probe_backoff: int = 8):
        super().__init__(max_lookahead, explore, prior, decay, confident, seed, verify_budget, warmup, switch_margin,
                         probe_every, pool_weight, draft_margin, probe_backoff)
        if not isinstance(stop, bool):
            raise PolicyError(f"stop: expected true or false, got {stop!r}")
        self.stop = stop
        self.stop_threshold = None if stop_threshold is None else _check_unit("stop_threshold", stop_threshold)
        self.price_lookahead = _check_lookahead("price_lookahead", price_lookahead)

    def plan(self, ctx: PlanContext) -> StepPlan:
        # With the stop, the price only has to rank paths: price with short blocks, the stop and
        # the long cap decide the block length.
        path, lookahead, kind = self._choose(ctx, min(self.max_lookahead, self.price_lookahead)
                                             if self.stop else self.max_lookahead)
        plan = self._under_load(ctx, path, lookahead)
        if not self.stop or kind == "explore" or len(plan.path) < 2:
            return plan
        first = plan.path[0]
        lookahead = dict(plan.lookahead)
        if self.verify_budget is None:
            lookahead[first] = max(lookahead[first], self.max_lookahead)
        return StepPlan(plan.path, lookahead, {first: self._stop_rule(ctx, plan.path)})

    def _stop_rule(self, ctx: PlanContext, path: tuple[str, ...]) -> CalibratedStop:
        estimates = self._estimates()
        first, verifier = path[0], path[1]
        calibration = estimates.calibration(first, verifier)
        threshold = self.stop_threshold
        if threshold is None:
            threshold = self._priced(("stop", path[:2], ctx.batch_size),
                                     lambda estimates: self._threshold(estimates, path[:2], ctx.batch_size))
        after_full = estimates.after_full.get((first, verifier), False)
        table = calibration.table(Calibration.FIRST_AFTER_FULL if after_full else Calibration.FIRST_AFTER_REJECT)
        return CalibratedStop(table, calibration.table(Calibration.LATER), threshold)

    def _threshold(self, estimates: Estimates, edge: tuple[str, str], batch: int) -> float:
        """The block survival below which one more drafted token stops paying: drafting it costs
        the drafter's pass plus the verifier's extra position, and it earns its chance of
        acceptance times the seconds a committed token costs on this edge."""
        first, verifier = edge
        rates: dict[str, float] = {}
        estimates.path_cost(edge, self.price_lookahead, batch=batch, rates=rates)
        draft = estimates.cost(first, batch, 1) or 0.0
        one, two = estimates.cost(verifier, batch, 1), estimates.cost(verifier, batch, 2)
        extra = (two - one) if one is not None and two is not None else 0.0
        value = rates[verifier] * estimates.calibration(first, verifier).mean(Calibration.LATER)
        return min(0.9, max(0.02, (draft + extra) / value)) if value > 0 else 0.9
