"""Adaptive policies: confidence, entropy, cost-aware, escalation and auto.

All of them choose only *execution* (path, lookahead, early stop); acceptance stays with the
exact rule, so none can change the output distribution. Plans may depend on anything that
happened in earlier steps; stop rules see only the drafter's own distribution.
"""
from __future__ import annotations

import random

import networkx as nx

from policies.base import PlanContext, Policy, PolicyError, StepFeedback, StepPlan, longest_path
from policies.estimates import Estimates
from policies.fixed import check_path
from policies.stops import ConfidenceStop, EntropyStop


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

    From measured acceptance per draft position and measured seconds per forward pass of each
    level, it picks the k that minimises expected seconds per emitted token on each edge (the
    seed's speedup equation, §9, composed up the hierarchy: see ``Estimates.path_cost``), and
    explores a random k on one edge with probability ``explore``.

    Under load the authority's pass is shared by the whole batch: ``verify_budget`` caps the
    tokens one authority pass verifies across the batch, so the authority's proposer gets at
    most ``verify_budget // batch_size - 1`` tokens per sequence, and none — plain batched
    decoding — once the batch is that large. ``None`` switches the cap off.
    """

    name = "cost-aware"

    def __init__(self, max_lookahead: int = 8, explore: float = 0.1, prior: float = 0.6, decay: float = 0.98,
                 seed: int = 0, path: list[str] | None = None, verify_budget: int | None = 128):
        if verify_budget is not None and (isinstance(verify_budget, bool) or not isinstance(verify_budget, int)
                                          or verify_budget < 1):
            raise PolicyError(f"verify_budget: expected a positive integer or null, got {verify_budget!r}")
        self.verify_budget = verify_budget
        self.max_lookahead = _check_lookahead("max_lookahead", max_lookahead)
        self.explore = _check_unit("explore", explore)
        self.estimates = Estimates(prior=_check_unit("prior", prior), decay=_check_unit("decay", decay))
        self.rng = random.Random(seed)
        self._init_path(path)

    def _explore(self, lookahead: dict[str, int]) -> dict[str, int]:
        """With probability ``explore``, try a random lookahead (>= 1) on one edge, so that an
        edge whose estimate says "does not pay" (k = 0) is still measured now and then."""
        if lookahead and self.rng.random() < self.explore:
            level = self.rng.choice(sorted(lookahead))
            lookahead = dict(lookahead)
            lookahead[level] = self.rng.randint(1, self.max_lookahead)
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
        _, lookahead = self.estimates.path_cost(path, self.max_lookahead)
        return self._under_load(ctx, path, self._explore(lookahead))

    def observe(self, feedback: StepFeedback) -> None:
        self.estimates.observe(feedback)


class EscalationPolicy(CostAwarePolicy):
    """Chooses the path per step, and the lookahead on it.

    Every path through the graph to the authority is priced with the measured acceptance and
    costs (``Estimates.path_cost``): a level whose edge does not pay for its cost
    (A <= 1 + T_draft / T_verify) makes its paths dearer and is skipped. Acceptance is kept
    separately for confident and unconfident contexts — the mean probability the first level
    gave its own drafts in the previous step, against ``confident`` — so that when drafts are
    confident a block goes straight to the authority along a shortcut edge, and through the
    middle levels when they are not. Untried paths start from an optimistic prior and are
    explored with probability ``explore``.
    """

    name = "escalation"

    def __init__(self, max_lookahead: int = 8, explore: float = 0.05, prior: float = 0.7, decay: float = 0.98,
                 confident: float = 0.8, seed: int = 0, verify_budget: int | None = 128):
        super().__init__(max_lookahead, explore, prior, decay, seed, verify_budget=verify_budget)
        self.confident = _check_unit("confident", confident)
        self.contexts = {True: Estimates(prior=prior, decay=decay), False: self.estimates}
        self._context = False
        self._all_paths: dict[frozenset[str], list[tuple[str, ...]]] = {}

    def _candidates(self, ctx: PlanContext) -> list[tuple[str, ...]]:
        if ctx.available not in self._all_paths:
            sub = ctx.graph.subgraph(ctx.available)
            paths = [(ctx.authority,)]
            for source in sub:
                if source != ctx.authority:
                    paths.extend(tuple(p) for p in nx.all_simple_paths(sub, source, ctx.authority))
            self._all_paths[ctx.available] = paths
        return self._all_paths[ctx.available]

    def plan(self, ctx: PlanContext) -> StepPlan:
        estimates = self.contexts[self._context]
        # Costs are measured per level whatever the context: share them.
        estimates.costs = self.estimates.costs
        candidates = self._candidates(ctx)
        drafting = [p for p in candidates if len(p) > 1]
        if drafting and self.rng.random() < self.explore:
            path = self.rng.choice(drafting)
            lookahead = {n: self.rng.randint(1, self.max_lookahead) for n in path[:-1]}
        else:
            priced = [(estimates.path_cost(p, self.max_lookahead), p) for p in candidates]
            (_, lookahead), path = min(priced, key=lambda item: item[0][0])
        return self._under_load(ctx, path, lookahead)

    def observe(self, feedback: StepFeedback) -> None:
        self.contexts[self._context].observe(feedback)
        if feedback.confidence is not None:
            self._context = feedback.confidence >= self.confident


class AutoPolicy(EscalationPolicy):
    """The default: escalation's path and lookahead choice, plus a confidence stop that ends a
    block early at a token the drafter itself finds unlikely."""

    name = "auto"

    def __init__(self, max_lookahead: int = 8, explore: float = 0.05, prior: float = 0.7, decay: float = 0.98,
                 confident: float = 0.8, stop_threshold: float = 0.2, seed: int = 0, verify_budget: int | None = 128):
        super().__init__(max_lookahead, explore, prior, decay, confident, seed, verify_budget)
        self.stop_threshold = _check_unit("stop_threshold", stop_threshold)

    def plan(self, ctx: PlanContext) -> StepPlan:
        plan = super().plan(ctx)
        if self.stop_threshold <= 0:
            return plan
        rule = ConfidenceStop(self.stop_threshold)
        return StepPlan(plan.path, plan.lookahead, {n: rule for n in plan.path[:-1]})
