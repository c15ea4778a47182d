"""Adaptive policies: confidence, entropy, cost-aware, escalation and auto.

All of them choose only *execution* (path, lookahead, early stop); acceptance stays with the
exact rule, so none can change the output distribution. Plans may depend on anything that
happened in earlier steps; stop rules see only the drafter's own distribution.
"""
from __future__ import annotations

import copy
import random
from typing import Annotated, Any, Literal

import networkx as nx
from pydantic import Field, StrictBool

from policies.base import PassCost, PlanContext, Policy, StepFeedback, StepPlan, longest_path
from policies.estimates import Calibration, Estimates, tree_passes
from policies.fixed import check_path
from policies.params import Float, Int, Lookahead, PathParams, PolicyParams, TreeShape, Unit
from policies.stops import CalibratedStop, ConfidenceStop, EntropyStop


class ConfidenceParams(PathParams):
    lookahead: Lookahead = Field(8, description="The most tokens a block drafts (the stop may end it sooner).")
    threshold: Unit = Field(0.4, description="Stop at a drafter probability below this.")
    mode: Literal["token", "block"] = Field(
        "token", description="'token': the drafted token's probability; 'block': the block's running product.")


class EntropyParams(PathParams):
    lookahead: Lookahead = Field(8, description="The most tokens a block drafts (the stop may end it sooner).")
    threshold: Unit = Field(0.4, description="Starting threshold on exp(-entropy); it adapts online.")
    target: Unit = Field(0.75, description="The accepted share of each block the threshold steers towards.")
    rate: Unit = Field(0.05, description="How far one block moves the threshold.")


class CostParams(PolicyParams):
    """What the cost-model policies share (cost-aware, escalation, auto)."""

    max_lookahead: Lookahead = Field(8, description="The longest block the cost model may choose.")
    explore: Unit = Field(0.1, description="Probability of a random choice, decaying with the steps seen.")
    prior: Unit = Field(0.6, description="Acceptance assumed for an edge before it is measured.")
    decay: Unit = Field(0.98, description="Per-step decay of the acceptance estimates (1 = never forget).")
    seed: Int = Field(0, description="Seed of the policy's own random choices (exploration, probe order).")
    verify_budget: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="Cap on the tokens one authority pass verifies across the batch (null: none).")


class CostAwareParams(CostParams, PathParams):
    pass


class EscalationParams(CostParams):
    explore: Unit = Field(0.05, description="Probability of a random path, decaying with the steps seen.")
    prior: Unit = Field(0.7, description="Acceptance assumed for an edge before it is measured.")
    confident: Unit | None = Field(
        None, description="Keep acceptance apart for contexts whose drafts were at least this confident (null: off).")
    warmup: Annotated[Int, Field(ge=0)] = Field(2, description="Probe rounds (every path once) at the start.")
    switch_margin: Unit = Field(0.05, description="Leave the current path only for one priced this much cheaper.")
    probe_every: Annotated[Int, Field(ge=1)] = Field(128, description="Steps between probe rounds, at first.")
    stand_in: StrictBool = Field(
        True, description="Where the chosen path is prompt lookup straight into the authority, let the model "
        "proposer priced cheapest (if it beats the authority alone) draft the steps where prompt lookup has no match.")
    pool_weight: Annotated[Float, Field(ge=0.0, le=1e6)] = Field(
        20.0, description="Observations' worth of the verifier's pooled acceptance in each edge's estimate "
        "(the other edges of its kind into that verifier; at most what they have seen).")
    draft_margin: Unit = Field(0.1, description="A drafting path must be priced this much cheaper than none.")
    probe_backoff: Annotated[Int, Field(ge=1)] = Field(
        8, description="Probe interval grows up to this many times probe_every while the choice holds.")
    lookup_carry: Annotated[Float, Field(ge=0.0, le=1e6)] = Field(
        4.0, description="Observations' worth of prompt lookup's acceptance a new request starts from "
        "(it depends on the request: does the answer repeat its prompt?).")
    trees: list[TreeShape] = Field(
        [], max_length=4, description="Tree shapes (widths per depth) priced beside the chain on every path whose "
        "first level can score: a step takes one where it is priced cheapest.")


class AutoParams(EscalationParams):
    max_lookahead: Lookahead = Field(32, description="The longest block; the calibrated stop ends most sooner.")
    explore: Unit = Field(0.0, description="Probability of a random path, decaying with the steps seen.")
    decay: Unit = Field(0.999, description="Per-step decay of the acceptance estimates (1 = never forget).")
    stop: StrictBool = Field(True, description="Cut blocks with the calibrated stop (false: cost model alone).")
    stop_threshold: Unit | None = Field(
        None, description="Fixed block-survival threshold for the stop (null: derived from the costs).")
    price_lookahead: Lookahead = Field(12, description="Block length paths are priced with.")
    trees: list[TreeShape] = Field(
        [[2, 2, 1, 1], [3, 2, 2, 1]], max_length=4, description="Tree shapes (widths per depth) priced beside the "
        "chain on every path whose first level can score: a step takes one where it is priced cheapest.")


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
            check_path(self, graph, authority, self.path_param)

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
    Params = ConfidenceParams

    def __init__(self, params: ConfidenceParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.lookahead, self.threshold, self.mode = self.params.lookahead, self.params.threshold, self.params.mode
        self._init_path(self.params.path)

    def plan(self, ctx: PlanContext) -> StepPlan:
        return self._stop_plan(ctx, self.lookahead, ConfidenceStop(self.threshold, self.mode))


class EntropyPolicy(_PathMixin, Policy):
    """Stop drafting when ``exp(-entropy)`` (a lower bound on the drafter's top probability) is
    below a threshold that adapts online: blocks that are accepted whole lower it (draft
    further), blocks rejected early raise it, steering the accepted share of each block
    towards ``target``."""

    name = "entropy"
    Params = EntropyParams

    def __init__(self, params: EntropyParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        p = self.params
        self.lookahead, self.threshold, self.target, self.rate = p.lookahead, p.threshold, p.target, p.rate
        self._init_path(p.path)

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
    edge (cascade/DESIGN.md §4, the speedup equation, composed up the hierarchy: see
    ``Estimates.path_cost``), and explores a random k on one edge with probability ``explore``
    (decaying as ``explore * 200 / (200 + steps)``).

    Under load a pass's fixed cost is shared by the batch while every drafted position still
    costs the verifier its own compute, so the same equation stops paying for speculation as
    the batch grows: the policy drops to plain batched decoding by itself. ``verify_budget``
    optionally caps the tokens one authority pass verifies across the batch on top of that
    (the authority's proposer gets at most ``verify_budget // batch_size - 1`` per sequence).
    """

    name = "cost-aware"
    Params: type[CostParams] = CostAwareParams

    def __init__(self, params: CostParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        p = self.params
        self.verify_budget = p.verify_budget
        self.max_lookahead = p.max_lookahead
        self.explore = p.explore
        self.estimates = Estimates(prior=p.prior, decay=p.decay)
        self.rng = random.Random(p.seed)
        self.steps = 0
        self._init_path(getattr(p, "path", None))  # escalation and auto choose the path per step
        self._regime = False  # whether the estimates in use are sampled steps' (or greedy ones')
        self._regimes: dict[bool, list] = {}  # the other regime's state, once it has been seen

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        super().bind(graph, authority)
        kinds = {n: graph.nodes[n].get("kind", "hf") for n in graph}
        for estimates in (self.estimates, *getattr(self, "contexts", {}).values()):
            estimates.kinds = kinds

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

    #: what the policy learned of acceptance and chose from it, kept apart per sampling regime
    _regime_state: tuple[str, ...] = ("estimates",)

    def _use_regime(self, sampled: bool) -> None:
        """Greedy and sampled steps keep apart what they measure of acceptance (and what they
        chose from it): a drafter agrees with the authority's most likely token far more often
        than with its sample (SmolLM2's prompt lookup: 0.59 accepted greedy, 0.17 at T = 0.8),
        so one set of estimates for both would price each regime with the other's blocks — a
        server taking greedy and sampled requests side by side, or a benchmark interleaving
        them. Costs are the levels' and stay shared. A regime seen for the first time starts
        from the other's estimates, each edge's acceptance carried over as ``REGIME_CARRY``
        observations: its own blocks soon outweigh them, and every path keeps a measured
        price rather than the optimistic prior (which would be tried path by path)."""
        if sampled == self._regime:
            return
        self._regimes[self._regime] = [getattr(self, a) for a in self._regime_state]
        state = self._regimes.pop(sampled, None)
        if state is None:
            costs = self.estimates.costs
            state = copy.deepcopy(self._regimes[self._regime], {id(costs): costs})
            for estimates in _all_estimates(state):
                for edge in estimates.edges.values():
                    edge.soften(REGIME_CARRY)
        for attr, value in zip(self._regime_state, state):
            setattr(self, attr, value)
        self._regime = sampled

    def plan(self, ctx: PlanContext) -> StepPlan:
        self._use_regime(ctx.sampled)
        path = self._path(ctx)
        _, lookahead = self.estimates.path_cost(path, self.max_lookahead, batch=ctx.batch_size)
        return self._under_load(ctx, path, self._explore(lookahead))

    def observe(self, feedback: StepFeedback) -> None:
        self.steps += 1
        self._use_regime(feedback.sampled)
        self.estimates.observe(feedback)

    def observe_pass(self, cost: PassCost) -> None:
        self.estimates.observe_pass(cost)


#: observations' worth of acceptance a sampling regime seen for the first time takes from the other
REGIME_CARRY = 4


def _all_estimates(state: list) -> list[Estimates]:
    """The :class:`Estimates` in a policy's regime state (directly, or as a dict's values)."""
    found = {}
    for value in state:
        for e in (value.values() if isinstance(value, dict) else (value,)):
            if isinstance(e, Estimates):
                found[id(e)] = e
    return list(found.values())


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
    slower paths); a change of path brings it back to ``probe_every``. At batch 1 a new
    request probes the n-gram level's paths at once and starts from only ``lookup_carry``
    observations of its acceptance (:meth:`_new_request`): whether prompt lookup pays is the
    request's; while the authority decodes alone, that probe waits for the request's first
    match. The current path is kept unless another is priced ``switch_margin`` cheaper. A path that drafts is
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
    Params = EscalationParams
    # per sampling regime: the estimates (per context), the path chosen from them, their prices
    _regime_state = ("estimates", "contexts", "_current", "_prices")

    def __init__(self, params: EscalationParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        p = self.params
        self.draft_margin = p.draft_margin
        self.confident = p.confident
        self.warmup = p.warmup
        self.switch_margin = p.switch_margin
        self.probe_every = p.probe_every
        self.probe_backoff = p.probe_backoff
        self._interval = float(p.probe_every)  # steps between probe rounds, now
        self._judge_round = False  # the next exploit choice tells whether the last round changed it
        self._current: dict[frozenset[str], tuple[str, ...]] = {}
        self._plans = self._rounds = 0
        self._since_probe = 0.0
        self._probes: list[tuple[str, ...]] = []  # the rest of the current probe round
        # the last probe, whether anything was proposed in it (None: not told yet), and how often
        # it was retried
        self._probing: tuple[tuple[str, ...], bool | None, int] | None = None
        self.probe_retries = 8
        self._retry = 0
        self.lookup_carry = p.lookup_carry
        self._last_step: int | None = None  # the step of the last plan: a drop means a new request
        self._request_probes: set[tuple[str, ...]] = set()  # queued at a request's start, not a round's
        self._probing_request = False  # whether the last probe was one of those
        self.contender_margin = 0.25
        self.estimates.pool_weight = p.pool_weight
        self.contexts = {True: Estimates(prior=p.prior, decay=p.decay, pool_weight=p.pool_weight),
                         False: self.estimates}
        self._context = False
        self._all_paths: dict[frozenset[str], list[tuple[str, ...]]] = {}
        self.reprice_every = 8
        self._prices: dict[tuple, tuple[int, object]] = {}  # key -> (plan number when priced, prices)
        self.trees = [tuple(t) for t in p.trees]
        self._tree_turn: dict[tuple[str, ...], int] = {}  # probes of a path go round its chain and trees
        self._stand_in: tuple[str, int] | None = None  # the last exploit's stand-in for prompt lookup

    def _shapes(self, ctx: PlanContext, path: tuple[str, ...]) -> list[tuple[int, ...] | None]:
        """The first edge's choices on ``path``: a chain (None), or a tree of each shape where
        the first level grows trees (a model or a feature head; an n-gram level does not)."""
        if not self.trees or len(path) < 2 or ctx.graph.nodes[path[0]].get("kind") == "ngram":
            return [None]
        return [None, *self.trees]

    def _price_paths(self, ctx: PlanContext, candidates, max_lookahead: int, estimates: Estimates):
        """path -> (seconds per token, lookahead, tree shape or None): the cheapest of its shapes."""
        priced = {}
        for path in candidates:
            for shape in self._shapes(ctx, path):
                cost, lookahead = estimates.path_cost(path, max_lookahead, batch=ctx.batch_size, tree=shape)
                if path not in priced or cost < priced[path][0]:
                    priced[path] = (cost, lookahead, shape)
        return priced

    def _probe_shape(self, ctx: PlanContext, path: tuple[str, ...]) -> tuple[int, ...] | None:
        """A probe of ``path`` measures its chain and its trees in turn."""
        shapes = self._shapes(ctx, path)
        turn = self._tree_turn.get(path, 0)
        self._tree_turn[path] = turn + 1
        return shapes[turn % len(shapes)]

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

    def _choose(self, ctx: PlanContext, max_lookahead: int
                ) -> tuple[tuple[str, ...], dict[str, int], str, tuple[int, ...] | None]:
        """(path, lookahead up to ``max_lookahead``, kind, tree shape of the first edge or None):
        kind is "probe", "explore" or "exploit"."""
        self._use_regime(ctx.sampled)
        candidates = self._candidates(ctx)
        if self._last_step is not None and ctx.step < self._last_step and ctx.batch_size == 1:
            self._new_request(candidates, ctx, max_lookahead)
        self._last_step = ctx.step
        priced = self._priced(("paths", ctx.available, ctx.batch_size, max_lookahead),
                              lambda estimates: self._price_paths(ctx, candidates, max_lookahead, estimates))
        self._plans += 1
        # A probe step runs the whole batch on a path that is probably worse, and teaches in
        # proportion to the batch: so probes come every ``probe_every`` steps of one sequence
        # (a step of a batch of B counts 1/B).
        self._since_probe += 1.0 / max(1, ctx.batch_size)
        if self._probing is not None:
            # A probe in which nothing was proposed (prompt lookup without a match) measured no
            # acceptance: it is taken again, so that such a level is measured at all — up to
            # ``probe_retries`` times, and for as long as the request lasts where it is the
            # request's own probe and the authority would decode alone anyway (such a retry
            # then costs nothing: the step is the authority's one-token pass either way).
            probed, drafted, tries = self._probing
            self._probing = None
            free = self._probing_request and self._current.get(ctx.available) == (ctx.authority,)
            if drafted is False and (tries < self.probe_retries or free) and probed in candidates:
                self._probes.append(probed)
                if self._probing_request:
                    self._request_probes.add(probed)
                self._retry = tries + 1
                self._plans -= 1  # a retry does not use up the warm-up
        if not self._probes and (self._plans <= self.warmup * len(candidates) or self._since_probe >= self._interval):
            self._since_probe = 0.0
            self._probes = self._probe_round(priced)
        if self._probes:
            path = self._probes.pop()
            self._probing, self._retry = (path, True if len(path) < 2 else None, self._retry), 0
            self._probing_request = path in self._request_probes
            if self._probing_request:  # a request's own probe: no round to judge
                self._request_probes.discard(path)
            elif not self._probes:  # the round's last probe: price afresh with what the round taught
                self._prices.clear()
                self._judge_round = True
            shape = self._probe_shape(ctx, path)
            lookahead = priced[path][1]
            if shape is None and priced[path][2] is not None:  # the chain's own lookahead
                lookahead = self._estimates().path_cost(path, max_lookahead, batch=ctx.batch_size)[1]
            return path, _probing(path, lookahead), "probe", shape
        drafting = [p for p in candidates if len(p) > 1]
        if drafting and self._exploring():
            path = self.rng.choice(drafting)
            return path, {n: self.rng.randint(1, min(8, max_lookahead)) for n in path[:-1]}, "explore", None
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
        self._stand_in = self._stand_in_for(ctx, path, priced, max_lookahead)
        return path, priced[path][1], "exploit", priced[path][2]

    def _stand_in_for(self, ctx: PlanContext, path: tuple[str, ...], priced, max_lookahead: int
                      ) -> tuple[str, int] | None:
        """(level, lookahead) that drafts in prompt lookup's place on ``path`` (an n-gram level
        straight into the authority) at the steps where it finds nothing to propose: the model
        proposer whose own chain into the authority is priced cheapest, if that beats the
        authority alone. Prompt lookup is priced by its acceptance where it proposes, so at the
        many steps of a chat where it has no match the step would otherwise be the authority's
        one-token pass.

        The stand-in needs only to beat the authority alone, not by ``draft_margin``: it is
        measured at every step it drafts, so a price too low corrects itself, while a margin lets
        an unlucky early estimate (a few rounds accepted below the drafter's rate) turn it off
        for good — a declined stand-in is measured again only by rare probes. Seen once: SmolLM2's
        head, measured at 0.31 by the first request's rounds (0.45-0.50 in other runs), fell short
        of the margin, and every later request decoded its steps without a match one token a pass."""
        kinds = self.estimates.kinds
        if not self.params.stand_in or len(path) != 2 or kinds.get(path[0]) != "ngram":
            return None
        best = None
        for p, (cost, lookahead, shape) in priced.items():
            if len(p) != 2 or kinds.get(p[0]) == "ngram":
                continue
            if shape is not None:  # a stand-in drafts a chain: price that
                cost, lookahead = self._estimates().path_cost(p, max_lookahead, batch=ctx.batch_size)
            if lookahead.get(p[0], 0) > 0 and (best is None or cost < best[0]):
                best = (cost, p[0], lookahead[p[0]])
        alone = priced.get((ctx.authority,))
        if best is None or alone is None or best[0] >= alone[0]:
            return None
        return best[1], best[2]

    def _with_stand_in(self, ctx: PlanContext, plan: StepPlan, kind: str) -> StepPlan:
        """``plan`` with the stand-in :meth:`_choose` picked, where the plan still starts with
        that n-gram level and drafts no tree."""
        pick = self._stand_in if kind == "exploit" else None
        if pick is None or len(plan.path) != 2 or plan.tree or pick[0] not in ctx.available:
            return plan
        level, k = pick
        stop = dict(plan.stop)
        if isinstance(self, AutoPolicy) and self.stop:
            stop[level] = self._stop_rule(ctx, (level, plan.path[1]))
            k = k if self.verify_budget is not None else max(k, self.max_lookahead)
        return StepPlan(plan.path, {**plan.lookahead, level: k}, stop, plan.tree, {plan.path[0]: level})

    def _new_request(self, candidates: list[tuple[str, ...]], ctx: PlanContext, max_lookahead: int) -> None:
        """A new request (at batch 1) is a new text. Prompt lookup's acceptance belongs to the
        request — it pays where the answer repeats its prompt, up to 9 of 10 tokens, and not at
        all elsewhere — so its estimates keep their means but carry only ``lookup_carry``
        observations' worth into the new request, and its paths are probed at once (a probe
        that finds no match to propose is retried at no cost): the request's own blocks then
        decide, instead of whichever requests the shared estimates last saw.

        A drafter's path priced out (its first level drafting nothing: lookahead 0) is treated
        so too — its first edge softened to ``lookup_carry`` observations, the path probed at
        once. Priced out, it is neither chosen nor named to stand in, so nothing but sparse
        probe rounds would measure it again: one text where it drafted badly (a drafter's
        acceptance swings several-fold between texts) would rule it out for good. A drafter
        priced in keeps its estimates (its own blocks keep measuring it)."""
        kinds = self.estimates.kinds
        lookup = [p for p in candidates if len(p) > 1 and kinds.get(p[0]) == "ngram"]
        priced = self._price_paths(ctx, candidates, max_lookahead, self._estimates())
        out = [p for p in candidates if len(p) > 1 and kinds.get(p[0]) != "ngram"
               and priced[p][2] is None and priced[p][1].get(p[0], 0) == 0]
        if not lookup and not out:
            return
        soften = {p[:2] for p in out}
        for estimates in self.contexts.values():
            for (proposer, verifier), edge in estimates.edges.items():
                if kinds.get(proposer) == "ngram" or (proposer, verifier) in soften:
                    edge.soften(self.lookup_carry)
        self._prices.clear()
        for path in lookup + out:
            if path not in self._probes:
                self._probes.append(path)
                self._request_probes.add(path)

    def _priced(self, key: tuple, price):
        """``price(estimates)``, reused for ``reprice_every`` plans: the estimates move a little
        per step (they decay slowly), while pricing every path costs about a millisecond of
        Python, a sizeable share of a small model's step."""
        key = (self._context, *key)
        hit = self._prices.get(key)
        if hit is None or self._plans - hit[0] >= self.reprice_every:
            hit = self._prices[key] = (self._plans, price(self._estimates()))
        return hit[1]

    def _probe_round(self, priced: dict[tuple[str, ...], tuple]) -> list[tuple[str, ...]]:
        """The paths of the next probe round, in random order: all of them in the warm-up and in
        every other round; otherwise the contenders, priced within ``1 + contender_margin`` of
        the best. Probes keep every edge's estimates sampled across the whole run, so that edges
        are compared over the same texts (acceptance swings several-fold between texts)."""
        self._rounds += 1
        paths = list(priced)
        if self._rounds > self.warmup and self._rounds % 2:
            best = min(cost for cost, *_ in priced.values())
            paths = [p for p in paths if priced[p][0] <= (1 + self.contender_margin) * best]
        self.rng.shuffle(paths)
        return paths

    def plan(self, ctx: PlanContext) -> StepPlan:
        path, lookahead, kind, shape = self._choose(ctx, self.max_lookahead)
        plan = _with_tree(self._under_load(ctx, path, lookahead), path, shape, self.verify_budget, ctx.batch_size)
        return self._with_stand_in(ctx, plan, kind)

    def observe(self, feedback: StepFeedback) -> None:
        self.steps += 1
        self._use_regime(feedback.sampled)
        if self._probing is not None and not self._probing[1] and feedback.plan.path == self._probing[0]:
            self._probing = (self._probing[0], any(e.proposed > 0 for e in feedback.edges), self._probing[2])
        self.contexts[self._context].observe(feedback)
        if self._probing_request and any(e.proposed > 0 for e in feedback.edges):
            self._prices.clear()  # the request's first measurement of prompt lookup: price with it
            self._probing_request = False
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
    are priced with blocks of at most ``price_lookahead``. With ``trees``, each shape is priced
    beside the chain on the path's first edge (``Estimates.path_cost``) and a step takes the
    cheapest: a tree has no stop.
    """

    name = "auto"
    Params = AutoParams

    def __init__(self, params: AutoParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.stop = self.params.stop
        self.stop_threshold = self.params.stop_threshold
        self.price_lookahead = self.params.price_lookahead

    def plan(self, ctx: PlanContext) -> StepPlan:
        # With the stop, the price only has to rank paths: price with short blocks, the stop and
        # the long cap decide the block length.
        path, lookahead, kind, shape = self._choose(ctx, min(self.max_lookahead, self.price_lookahead)
                                                    if self.stop else self.max_lookahead)
        plan = self._under_load(ctx, path, lookahead)
        if shape is not None:  # a tree's shape is its length: no stop
            treed = _with_tree(plan, path, shape, self.verify_budget, ctx.batch_size)
            if treed.tree:
                return treed
        if not self.stop or kind == "explore" or len(plan.path) < 2:
            return self._with_stand_in(ctx, plan, kind)
        first = plan.path[0]
        lookahead = dict(plan.lookahead)
        if self.verify_budget is None:
            lookahead[first] = max(lookahead[first], self.max_lookahead)
        return self._with_stand_in(ctx, StepPlan(plan.path, lookahead, {first: self._stop_rule(ctx, plan.path)}), kind)

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
        the drafter's pass plus the verifier's extra position (its average share over a block),
        and it earns its chance of acceptance times the seconds a committed token costs on this
        edge."""
        first, verifier = edge
        rates: dict[str, float] = {}
        _, lookahead = estimates.path_cost(edge, self.price_lookahead, batch=batch, rates=rates)
        draft = estimates.cost(first, batch, 1) or 0.0
        # A drafted position's share of the verifying pass: averaged over the block the cost
        # model would draft (the price lookahead if none), since a pass is not linear in its
        # positions — on a CPU the second position can cost most of a pass, the next few little.
        k = lookahead.get(first) or self.price_lookahead
        one, wide = estimates.cost(verifier, batch, 1), estimates.cost(verifier, batch, k + 1)
        extra = (wide - one) / k if one is not None and wide is not None else 0.0
        value = rates[verifier] * estimates.calibration(first, verifier).mean(Calibration.LATER)
        return min(0.9, max(0.02, (draft + extra) / value)) if value > 0 else 0.9


def _probing(path: tuple[str, ...], lookahead: dict[str, int]) -> dict[str, int]:
    """``lookahead`` for a probe of ``path``, which must measure every edge on it: the first
    level drafts at least one token, and a middle level at least two — one from the level below
    and its own — since a level asks the one below for at most its lookahead less one (a middle
    level priced at 1 would leave the edge below it unmeasured, probe after probe)."""
    return {n: max(1 if j == 0 else 2, lookahead.get(n, 0)) for j, n in enumerate(path[:-1])}


def _with_tree(plan: StepPlan, path: tuple[str, ...], shape: tuple[int, ...] | None,
               verify_budget: int | None = None, batch_size: int = 1) -> StepPlan:
    """``plan`` with a tree of ``shape`` on its first edge, if the path kept its first level (and
    if the authority verifies the tree, within the verification budget)."""
    if shape is None or len(plan.path) < 2 or plan.path[0] != path[0]:
        return plan
    if verify_budget is not None and len(plan.path) == 2:
        if tree_passes(shape)[1] > verify_budget // max(1, batch_size) - 1:
            return plan
    return StepPlan(plan.path, plan.lookahead, {}, {path[0]: shape})
