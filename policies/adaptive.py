"""Adaptive policies: confidence, entropy, cost-aware, escalation and auto.

All of them choose only *execution* (path, lookahead, early stop); acceptance stays with the
exact rule, so none can change the output distribution. Plans may depend on anything that
happened in earlier steps; stop rules see only the drafter's own distribution.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import networkx as nx
from pydantic import Field, StrictBool

from policies.base import PassCost, PlanContext, Policy, StepFeedback, StepPlan, StopRule
from policies.estimates import Calibration, Estimates, LevelCost, batch_bucket, tree_passes
from policies.fixed import PathChoice
from policies.params import Float, Int, Lookahead, PathParams, PolicyParams, TreeShape, Unit
from policies.stops import CalibratedStop, ConfidenceStop, EntropyStop

Path = tuple[str, ...]  # levels from the first proposer to the authority
Weight = Annotated[Float, Field(ge=0.0, le=1e6)]  # observations' worth, or a relative margin
Positive = Annotated[Int, Field(ge=1)]


class _StopParams(PathParams):
    lookahead: Lookahead = Field(8, description="The most tokens a block drafts (the stop may end it sooner).")


class ConfidenceParams(_StopParams):
    threshold: Unit = Field(0.4, description="Stop at a drafter probability below this.")
    mode: Literal["token", "block"] = Field(
        "token", description="'token': the drafted token's probability; 'block': the block's running product.")


class EntropyParams(_StopParams):
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
    verify_budget: Positive | None = Field(
        None, description="Cap on the tokens one authority pass verifies across the batch (null: none).")
    explore_steps: Positive = Field(200, description="Steps by which exploration halves: explore x n / (n + steps).")
    explore_lookahead: Lookahead = Field(8, description="The longest random block an exploring step drafts.")
    regime_carry: Weight = Field(4.0, description="Observations' worth of each edge's acceptance a sampling regime "
                                 "(greedy or sampled) seen for the first time takes from the other.")


class CostAwareParams(CostParams, PathParams):
    pass


class EscalationParams(CostParams):
    explore: Unit = Field(0.05, description="Probability of a random path, decaying with the steps seen.")
    prior: Unit = Field(0.7, description="Acceptance assumed for an edge before it is measured.")
    confident: Unit | None = Field(
        None, description="Keep acceptance apart for contexts whose drafts were at least this confident (null: off).")
    warmup: Annotated[Int, Field(ge=0)] = Field(2, description="Probe rounds (every path once) at the start.")
    switch_margin: Unit = Field(0.05, description="Leave the current path only for one priced this much cheaper.")
    probe_every: Positive = Field(128, description="Steps between probe rounds, at first.")
    stand_in: StrictBool = Field(
        True, description="Where the chosen path is prompt lookup straight into the authority, let the model "
        "proposer priced cheapest (if it beats the authority alone) draft the steps where prompt lookup has no match.")
    pool_weight: Weight = Field(
        20.0, description="Observations' worth of the verifier's pooled acceptance in each edge's estimate "
        "(the other edges of its kind into that verifier; at most what they have seen).")
    draft_margin: Unit = Field(0.1, description="A drafting path must be priced this much cheaper than none.")
    probe_backoff: Positive = Field(8, description="Probe interval grows up to this many times probe_every while "
                                    "the choice holds.")
    lookup_carry: Weight = Field(
        4.0, description="Observations' worth of prompt lookup's acceptance a new request starts from "
        "(it depends on the request: does the answer repeat its prompt?).")
    trees: list[TreeShape] = Field(
        [], max_length=4, description="Tree shapes (widths per depth) priced beside the chain on every path whose "
        "first level can score: a step takes one where it is priced cheapest.")
    probe_retries: Annotated[Int, Field(ge=0)] = Field(8, description="Times a probe that proposed nothing is taken "
                                                       "again (a request's own, the authority decoding alone: no cap).")
    contender_margin: Weight = Field(0.25, description="Every other probe round after the warm-up takes only the "
                                     "paths priced within 1 + this of the cheapest.")
    reprice_every: Positive = Field(8, description="Plans one pricing of the paths serves (a probe round reprices).")
    realized_after: Weight = Field(
        16.0, description="Sequence-steps of a drafting path measured at a batch size after which, if its measured "
        "seconds per committed token exceed the authority alone's, the authority decodes alone (0: never).")
    realized_decay: Unit = Field(0.99, description="Per sequence-step decay of the measured seconds per token.")
    realized_retry: Weight = Field(
        512.0, description="Sequence-steps after which a drafting path that gave way to the authority alone is "
        "measured afresh (0: never): a text or a load that changed is seen, and a path that gave way on noise comes "
        "back; doubled, up to 8 times, each time it measures dearer again.")


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


def _stop_plan(path: Path, lookahead: int, rule: StopRule) -> StepPlan:
    """``path``, one lookahead for every proposing level, and one stop rule for each."""
    return StepPlan(path, {n: lookahead for n in path[:-1]}, {n: rule for n in path[:-1]})


class ConfidencePolicy(PathChoice, Policy):
    """Draft up to ``lookahead`` tokens per block, stopping at the first token whose drafter
    probability (or the block's running product, ``mode: block``) is below ``threshold``."""

    name = "confidence"
    Params = ConfidenceParams

    def __init__(self, params: ConfidenceParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.lookahead, self.threshold, self.mode = self.params.lookahead, self.params.threshold, self.params.mode
        self._init_path(self.params.path)

    def plan(self, ctx: PlanContext) -> StepPlan:
        return _stop_plan(self._path(ctx), self.lookahead, ConfidenceStop(self.threshold, self.mode))


class EntropyPolicy(PathChoice, Policy):
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
        return _stop_plan(self._path(ctx), self.lookahead, EntropyStop(self.threshold))

    def observe(self, feedback: StepFeedback) -> None:
        for e in feedback.edges:
            if e.proposed:
                share = e.accepted / e.proposed
                self.threshold = min(0.99, max(0.01, self.threshold + self.rate * (self.target - share)))


class Step(str, enum.Enum):
    """What a step of escalation (or auto) does."""

    PROBE = "probe"  # measures a path whatever its price: a probe round's, a new request's own, or a retry
    EXPLORE = "explore"  # a random drafting path and lookahead (probability ``explore``, decaying)
    EXPLOIT = "exploit"  # the path priced cheapest, held against near-equal ones (hysteresis)


Choice = tuple[Path, dict[str, int], Step, "tuple[int, ...] | None"]  # path, lookahead, step, first edge's tree


@dataclass
class Regime:
    """What a cost-model policy learned and chose in one sampling regime (greedy or sampled): a
    drafter agrees with the authority's most likely token far more often than with its sample,
    so each regime prices paths with its own blocks. Costs are the levels' and shared."""

    contexts: dict[bool, Estimates]  # acceptance per confidence context (True: escalation's ``confident``)
    current: dict[frozenset[str], Path] = field(default_factory=dict)  # the exploited path per available set
    prices: dict[tuple, tuple[int, Any]] = field(default_factory=dict)  # key -> (plan number when priced, prices)

    def carried(self, carry: float) -> "Regime":
        """A regime seen for the first time starts from this one, each edge's acceptance carried
        as ``carry`` observations: its own blocks soon outweigh them, and no path is unpriced."""
        return Regime({c: e.fork(carry) for c, e in self.contexts.items()}, dict(self.current), dict(self.prices))


@dataclass
class Realized:
    """What a path's steps really cost per committed token, as its sequences saw it: each
    sequence's share of the step's wall time against the tokens committed (decayed sums; one per
    sampling regime, batch-size bucket and path chosen). The price is a model and leaves costs
    out; this is the measured outcome (docs/policies.md, "Path choice")."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: float = 0.0  # sequence-steps
    waited: float = 0.0  # sequence-steps it has given way since it was measured dearer
    wait: float | None = None  # sequence-steps it waits before it is measured afresh (None: realized_retry)

    def observe(self, seconds: float, tokens: int, decay: float) -> None:
        self.seconds, self.tokens = decay * self.seconds + seconds, decay * self.tokens + tokens
        self.steps, self.waited = decay * self.steps + 1.0, 0.0

    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None


@dataclass
class Probes:
    """Escalation's probing, shared by the regimes: rounds (``warmup`` at the start, then one
    every ``interval`` steps, backing off while rounds leave the choice as it was), a new
    request's own probes, and the probe in flight."""

    interval: float  # steps between probe rounds, now
    since: float = 0.0  # steps since the last round began (a step of a batch of B counts 1/B)
    plans: int = 0  # plans made, retries not counted: the warm-up is the first ``warmup`` x paths
    rounds: int = 0  # rounds begun
    queue: list[Path] = field(default_factory=list)  # probes to take, the last first
    requests: set[Path] = field(default_factory=set)  # those queued at a request's start, not by a round
    last: Path | None = None  # the probe in flight (None: none, or its retry was decided)
    drafted: bool | None = None  # whether anything was proposed in it (None: not told yet)
    tries: int = 0  # how often it had been taken again (a retry is queued last: it is taken at once)
    by_request: bool = False  # whether it was a request's own, its first proposal not yet seen
    judging: bool = False  # a round just ended: the next exploit tells whether it changed the choice
    turns: dict[Path, int] = field(default_factory=dict)  # probes of a path go round its chain and trees

    def retry(self, candidates: list[Path], retries: int, free: bool) -> None:
        """A probe that proposed nothing (prompt lookup without a match) measured nothing: it is
        taken again, up to ``retries`` times, or with no cap where it costs nothing (``free``: a
        request's own probe while the authority decodes alone, a one-token pass either way)."""
        probed, self.last = self.last, None
        again = self.drafted is False and (self.tries < retries or free) and probed in candidates
        self.tries = self.tries + 1 if again else 0
        if again:
            self.queue.append(probed)
            if self.by_request:
                self.requests.add(probed)
            self.plans -= 1  # a retry does not use up the warm-up

    def take(self, prices: dict, candidates: list[Path]) -> Path | None:
        """The next probe, if any; after a round's last, prices afresh and judges the round.
        Probes queued while other levels were up and now through a level that is down go."""
        self.queue = [path for path in self.queue if path in candidates]
        if not self.queue:
            return None
        path = self.queue.pop()
        self.last, self.drafted = path, (True if len(path) < 2 else None)
        self.by_request = path in self.requests
        if self.by_request:  # a request's own probe: no round to judge
            self.requests.discard(path)
        elif not self.queue:
            prices.clear()
            self.judging = True
        return path

    def back_off(self, changed: bool, every: int, most: int) -> None:
        """A round that left the choice as it was doubles the interval to the next, up to
        ``most``; a changed choice (the text has moved) brings it back to ``every``."""
        if changed:
            self.interval = float(every)
        elif self.judging:
            self.interval = min(2 * self.interval, float(most))
        self.judging = False


class CostAwarePolicy(PathChoice, Policy):
    """Lookahead per edge chosen online to maximise committed tokens per second: the k that
    minimises the expected seconds per emitted token on each edge (``Estimates.path_cost``),
    from measured acceptance by draft position and measured pass costs (``LevelCost``, per
    batch size: speculation stops paying as the batch grows), now and then a random k on one
    edge (``explore``, decaying); ``verify_budget`` caps the tokens one authority pass verifies
    across the batch. Greedy and sampled steps keep their own estimates (:class:`Regime`).
    """

    name = "cost-aware"
    Params: type[CostParams] = CostAwareParams
    _contexts: tuple[bool, ...] = (False,)  # the confidence contexts a regime keeps apart

    def __init__(self, params: CostParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.rng = random.Random(self.params.seed)
        self.steps = 0
        self._init_path(getattr(self.params, "path", None))  # escalation and auto choose the path per step
        self.costs: dict[str, LevelCost] = {}  # per level, whatever the regime and context
        self.regimes = {False: Regime({c: self._new_estimates() for c in self._contexts})}
        self.regime = False  # the sampling regime of the last plan or feedback (True: sampled)
        self._context = False  # the confidence context of the next step

    def _new_estimates(self) -> Estimates:
        p = self.params  # only escalation and auto pool acceptance across edges
        return Estimates(p.prior, p.decay, getattr(p, "pool_weight", 0.0), self.costs)

    @property
    def estimates(self) -> Estimates:
        """The estimates of the current regime (its only context, or its unconfident one)."""
        return self.regimes[self.regime].contexts[False]

    def _estimates(self) -> Estimates:
        """The estimates of the current regime and confidence context."""
        return self.regimes[self.regime].contexts[self._context]

    def _regime_for(self, sampled: bool) -> Regime:
        """The regime of a step; one seen for the first time starts from the last one's."""
        if sampled not in self.regimes:
            self.regimes[sampled] = self.regimes[self.regime].carried(self.params.regime_carry)
        self.regime = sampled
        return self.regimes[sampled]

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        super().bind(graph, authority)
        kinds = {n: graph.nodes[n].get("kind", "hf") for n in graph}
        for regime in self.regimes.values():
            for estimates in regime.contexts.values():
                estimates.kinds = kinds

    def _exploring(self) -> bool:
        explore, steps = self.params.explore, self.params.explore_steps
        return explore > 0 and self.rng.random() < explore * steps / (steps + self.steps)

    def _random_lookahead(self, max_lookahead: int) -> int:
        return self.rng.randint(1, min(self.params.explore_lookahead, max_lookahead))

    def _explore(self, lookahead: dict[str, int]) -> dict[str, int]:
        """Now and then, try a random lookahead (>= 1) on one edge, so that an edge whose
        estimate says "does not pay" (k = 0) is still measured."""
        if lookahead and self._exploring():
            level = self.rng.choice(sorted(lookahead))
            lookahead = dict(lookahead)
            lookahead[level] = self._random_lookahead(self.params.max_lookahead)
        return lookahead

    def _under_load(self, ctx: PlanContext, path: Path, lookahead: dict[str, int]) -> StepPlan:
        """Apply the verification budget, then drop levels left idle (k = 0 on their edge)."""
        budget = self.params.verify_budget
        if budget is not None and len(path) > 1:
            cap = budget // max(1, ctx.batch_size) - 1
            lookahead = dict(lookahead, **{path[-2]: max(0, min(lookahead[path[-2]], cap))})
        # A level asked for no tokens cuts the path: nothing below it can be used.
        for j in range(len(path) - 2, -1, -1):
            if lookahead.get(path[j], 0) == 0:
                path = path[j + 1:]
                break
        return StepPlan(path, {n: lookahead[n] for n in path[:-1]})

    def plan(self, ctx: PlanContext) -> StepPlan:
        self._regime_for(ctx.sampled)
        path = self._path(ctx)
        _, lookahead = self.estimates.path_cost(path, self.params.max_lookahead, batch=ctx.batch_size)
        return self._under_load(ctx, path, self._explore(lookahead))

    def observe(self, feedback: StepFeedback) -> None:
        self.steps += 1
        self._regime_for(feedback.sampled)
        self._estimates().observe(feedback)

    def observe_pass(self, cost: PassCost) -> None:
        self.estimates.observe_pass(cost)


class EscalationPolicy(CostAwarePolicy):
    """Chooses the path per step, and the lookahead on it: every path to the authority is priced
    (``Estimates.path_cost``), and a step probes, explores or exploits (:class:`Step`;
    docs/policies.md, "States"): probe rounds keep every path measured (:class:`Probes`), a new
    request at batch 1 probes at once (:meth:`_new_request`), and the exploited path is the one
    priced cheapest, held against near-equal ones, given up for the authority alone where its
    steps measured dearer (:meth:`_paying`).
    """

    name = "escalation"
    Params = EscalationParams
    _contexts = (True, False)

    def __init__(self, params: EscalationParams | None = None, /, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.probes = Probes(float(self.params.probe_every))
        self.trees = [tuple(t) for t in self.params.trees]
        self._last_step: int | None = None  # the step of the last plan: a drop means a new request
        self._all_paths: dict[frozenset[str], list[Path]] = {}
        self._stand_in: tuple[str, int] | None = None  # the last exploit's stand-in for prompt lookup
        self.realized: dict[tuple, Realized] = {}  # (regime, batch bucket, path chosen) -> measured cost
        self._planned: tuple[StepPlan, Path, int, Step] | None = None  # the last plan, its path, batch size, kind
        self._catching_up = False  # whether a call of the last plan's step fed positions it did not score

    def _shapes(self, ctx: PlanContext, path: Path) -> list[tuple[int, ...] | None]:
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

    def _candidates(self, ctx: PlanContext) -> list[Path]:
        if ctx.available not in self._all_paths:
            sub = ctx.graph.subgraph(ctx.available)
            self._all_paths[ctx.available] = [(ctx.authority,)] + [
                tuple(p) for s in sub if s != ctx.authority for p in nx.all_simple_paths(sub, s, ctx.authority)]
        return self._all_paths[ctx.available]

    def _choose(self, ctx: PlanContext, max_lookahead: int) -> Choice:
        """(path, lookahead up to ``max_lookahead``, what the step does, tree shape of the first
        edge or None)."""
        regime = self._regime_for(ctx.sampled)
        candidates = self._candidates(ctx)
        if self._last_step is not None and ctx.step < self._last_step and ctx.batch_size == 1:
            self._new_request(candidates, ctx, max_lookahead)
        self._last_step = ctx.step
        priced = self._priced(("paths", ctx.available, ctx.batch_size, max_lookahead),
                              lambda estimates: self._price_paths(ctx, candidates, max_lookahead, estimates))
        path = self._next_probe(ctx, candidates, priced, regime)
        if path is not None:
            return self._probe(ctx, path, priced, max_lookahead)
        drafting = [p for p in candidates if len(p) > 1]
        if drafting and self._exploring():
            path = self.rng.choice(drafting)
            return path, {n: self._random_lookahead(max_lookahead) for n in path[:-1]}, Step.EXPLORE, None
        return self._exploit(ctx, regime, priced, max_lookahead)

    def _next_probe(self, ctx: PlanContext, candidates: list[Path], priced: dict, regime: Regime) -> Path | None:
        """The path this step probes, if any: a probe that proposed nothing, again; the rest of
        the queue; or the first of a round that is due."""
        probes, p = self.probes, self.params
        probes.plans += 1
        probes.since += 1.0 / max(1, ctx.batch_size)
        if probes.last is not None:
            probes.retry(candidates, p.probe_retries,
                         probes.by_request and regime.current.get(ctx.available) == (ctx.authority,))
        if not probes.queue and (probes.plans <= p.warmup * len(candidates) or probes.since >= probes.interval):
            probes.since = 0.0
            probes.queue = self._probe_round(priced, ctx.batch_size)
        return probes.take(regime.prices, candidates)

    def _exploit(self, ctx: PlanContext, regime: Regime, priced: dict, max_lookahead: int) -> Choice:
        """The path priced cheapest (a drafting one by ``draft_margin``), kept unless another is
        ``switch_margin`` cheaper, so that near-equal paths do not flap the choice on noise."""
        p = self.params
        score = {path: cost * (1 + p.draft_margin if len(path) > 1 else 1) for path, (cost, *_) in priced.items()}
        path = min(score, key=score.get)
        current = regime.current.get(ctx.available)
        if current in score and score[path] > (1 - p.switch_margin) * score[current]:
            path = current
        path = self._paying(ctx, path, priced)
        regime.current[ctx.available] = path
        self.probes.back_off(path != current, p.probe_every, p.probe_every * p.probe_backoff)
        self._stand_in = self._stand_in_for(ctx, path, priced, max_lookahead)
        return path, priced[path][1], Step.EXPLOIT, priced[path][2]

    def _paying(self, ctx: PlanContext, path: Path, priced: dict) -> Path:
        """``path``, unless it drafts and its steps, measured at this batch size (after
        ``realized_after`` sequence-steps), cost more per committed token than the authority
        alone does (measured, or priced): then the authority alone. A path that gave way is
        measured afresh after ``realized_retry`` sequence-steps, twice as long (up to 8 times)
        each time it measures dearer again (docs/policies.md, "Path choice")."""
        alone = (ctx.authority,)
        measured = self._realized(ctx, path)
        if len(path) < 2 or alone not in priced or measured is None:
            return path
        if self._no_dearer_than_alone(ctx, measured, priced[alone][0]):
            measured.wait = None
            return path
        measured.waited += ctx.batch_size
        wait = self.params.realized_retry if measured.wait is None else measured.wait
        if wait and measured.waited >= wait:  # measured afresh; again dearer, it waits twice as long
            self.realized[self.regime, batch_bucket(ctx.batch_size), path] = Realized(
                wait=min(2 * wait, 8 * self.params.realized_retry))
            return path
        return alone

    def _no_dearer_than_alone(self, ctx: PlanContext, measured: Realized, alone_price: float) -> bool:
        """Whether ``measured`` cost no more a token than the authority alone at this batch size:
        its own measurement there, or else its price."""
        alone = self._realized(ctx, (ctx.authority,))
        return measured.per_token() <= (alone.per_token() if alone else alone_price)

    def _realized(self, ctx: PlanContext, path: Path) -> Realized | None:
        """What ``path``'s steps measured at this batch size, if measured over ``realized_after``
        sequence-steps at least."""
        realized = self.realized.get((self.regime, batch_bucket(ctx.batch_size), path))
        if realized is None or not self.params.realized_after or realized.steps < self.params.realized_after \
                or realized.per_token() is None:
            return None
        return realized

    def _probe(self, ctx: PlanContext, path: Path, priced: dict, max_lookahead: int) -> Choice:
        """A probe of ``path``: a round's at one sequence takes its chain and its trees in turn;
        a request's own, and any at more than one sequence, only the shape priced cheapest there
        (a tree's nodes cost the verifier a position each per sequence; docs/policies.md)."""
        if ctx.batch_size > 1 or self.probes.by_request:
            shape = priced[path][2]
        else:
            shapes, turn = self._shapes(ctx, path), self.probes.turns.get(path, 0)
            self.probes.turns[path], shape = turn + 1, shapes[turn % len(shapes)]
        lookahead = priced[path][1]
        if shape is None and priced[path][2] is not None:  # the chain's own lookahead
            lookahead = self._estimates().path_cost(path, max_lookahead, batch=ctx.batch_size)[1]
        return path, _probing(path, lookahead), Step.PROBE, shape

    def _probe_round(self, priced: dict[Path, tuple], batch: int) -> list[Path]:
        """The paths of the next probe round, in random order: all of them in the warm-up and in
        every other round at one sequence; otherwise those priced within ``1 +
        contender_margin`` of the best (under load a probe costs every sequence a step)."""
        self.probes.rounds += 1
        paths = list(priced)
        if self.probes.rounds > self.params.warmup and (self.probes.rounds % 2 or batch > 1):
            best = min(cost for cost, *_ in priced.values())
            paths = [p for p in paths if priced[p][0] <= (1 + self.params.contender_margin) * best]
        self.rng.shuffle(paths)
        return paths

    def _stand_in_for(self, ctx: PlanContext, path: Path, priced, max_lookahead: int) -> tuple[str, int] | None:
        """(level, lookahead) that drafts in prompt lookup's place on ``path`` (an n-gram level
        straight into the authority) where it has no match: the model proposer whose own chain
        into the authority is priced cheapest, if that beats the authority alone (no
        ``draft_margin``: it is measured at every step it drafts); at more than one sequence its
        chain must also have measured no dearer than the authority alone there (docs/policies.md)."""
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
        if ctx.batch_size > 1:
            measured = self._realized(ctx, (best[1], ctx.authority))
            if measured is None or not self._no_dearer_than_alone(ctx, measured, alone[0]):
                return None
        return best[1], best[2]

    def _with_stand_in(self, ctx: PlanContext, plan: StepPlan, kind: Step) -> StepPlan:
        """``plan`` with the stand-in :meth:`_choose` picked, where the plan still starts with
        that n-gram level and drafts no tree."""
        pick = self._stand_in if kind == Step.EXPLOIT else None
        if pick is None or len(plan.path) != 2 or plan.tree or pick[0] not in ctx.available:
            return plan
        level, k = pick
        k, rule = self._block(ctx, (level, plan.path[1]), k)
        stop = plan.stop if rule is None else {**plan.stop, level: rule}
        return StepPlan(plan.path, {**plan.lookahead, level: k}, stop, plan.tree, {plan.path[0]: level})

    def _new_request(self, candidates: list[Path], ctx: PlanContext, max_lookahead: int) -> None:
        """A new request (at batch 1) is a new text: prompt lookup's paths, and drafters' paths
        priced out (first level drafting nothing), keep their estimates' means with only
        ``lookup_carry`` observations and are probed at once, so the request's own blocks decide
        (docs/policies.md, "Path choice")."""
        kinds = self.estimates.kinds
        lookup = [p for p in candidates if len(p) > 1 and kinds.get(p[0]) == "ngram"]
        priced = self._price_paths(ctx, candidates, max_lookahead, self._estimates())
        out = [p for p in candidates if len(p) > 1 and kinds.get(p[0]) != "ngram"
               and priced[p][2] is None and priced[p][1].get(p[0], 0) == 0]
        if not lookup and not out:
            return
        soften = {p[:2] for p in out}
        regime = self.regimes[self.regime]
        for estimates in regime.contexts.values():
            for (proposer, verifier), edge in estimates.edges.items():
                if kinds.get(proposer) == "ngram" or (proposer, verifier) in soften:
                    edge.soften(self.params.lookup_carry)
        regime.prices.clear()
        for path in lookup + out:
            if path not in self.probes.queue:
                self.probes.queue.append(path)
                self.probes.requests.add(path)

    def _priced(self, key: tuple, price):
        """``price(estimates)``, reused for ``reprice_every`` plans (the estimates move slowly)."""
        key, prices, plans = (self._context, *key), self.regimes[self.regime].prices, self.probes.plans
        hit = prices.get(key)
        if hit is None or plans - hit[0] >= self.params.reprice_every:
            hit = prices[key] = (plans, price(self._estimates()))
        return hit[1]

    def _price_lookahead(self) -> int:
        """The longest block paths are priced with."""
        return self.params.max_lookahead

    def _block(self, ctx: PlanContext, edge: tuple[str, str], k: int) -> tuple[int, StopRule | None]:
        """The lookahead and stop rule of ``edge``'s proposer drafting the block the cost model
        priced at ``k`` (escalation: that block, no stop)."""
        return k, None

    def plan(self, ctx: PlanContext) -> StepPlan:
        path, lookahead, kind, shape = self._choose(ctx, self._price_lookahead())
        p = self.params
        plan = _with_tree(self._under_load(ctx, path, lookahead), path, shape, p.verify_budget, ctx.batch_size)
        if not plan.tree and kind != Step.EXPLORE and len(plan.path) > 1:
            first = plan.path[0]
            k, rule = self._block(ctx, plan.path[:2], plan.lookahead[first])
            if rule is not None:
                plan = StepPlan(plan.path, {**plan.lookahead, first: k}, {first: rule})
        plan = self._with_stand_in(ctx, plan, kind)
        self._planned, self._catching_up = (plan, path, ctx.batch_size, kind), False
        return plan

    def observe_pass(self, cost: PassCost) -> None:
        super().observe_pass(cost)
        # A level catching up (a prompt, a request joining, skipped tokens) pays once what its
        # steps then do not: that step says nothing of the path's cost. Prompt lookup runs no pass.
        if cost.catch_up > LevelCost.catch_up_positions and self.estimates.kinds.get(cost.level) != "ngram":
            self._catching_up = True

    def observe(self, feedback: StepFeedback) -> None:
        super().observe(feedback)
        probes, proposed = self.probes, any(e.proposed > 0 for e in feedback.edges)
        # A probe that proposed nothing (prompt lookup without a match) was the authority alone:
        # it says nothing of what its path costs when chosen.
        if self._planned is not None and feedback.plan is self._planned[0] and not self._catching_up \
                and (proposed or self._planned[3] != Step.PROBE):
            _, path, batch, _ = self._planned
            key = (self.regime, batch_bucket(batch), path)
            spent = feedback.seconds if feedback.seconds is not None else sum(feedback.level_seconds.values())
            self.realized.setdefault(key, Realized()).observe(spent, feedback.committed, self.params.realized_decay)
        if probes.last is not None and not probes.drafted and feedback.plan.path == probes.last:
            probes.drafted = proposed
        if probes.by_request and proposed:
            self.regimes[self.regime].prices.clear()  # the request's first measurement: price with it
            probes.by_request = False
        if self.params.confident is not None and feedback.confidence is not None:
            self._context = feedback.confidence >= self.params.confident


class AutoPolicy(EscalationPolicy):
    """The default: escalation's choice of path, and on its first edge either a long block cut
    short by a calibrated stop (the drafter goes on while the estimated probability that its
    whole block is accepted stays above the point where one more token stops paying:
    :meth:`_threshold`; ``stop_threshold`` fixes it, ``stop: false`` switches it off) or a tree
    of ``trees``, whichever is priced cheaper. Paths are priced with blocks of at most
    ``price_lookahead``."""

    name = "auto"
    Params = AutoParams

    def _price_lookahead(self) -> int:
        # With the stop, the price only has to rank paths: price with short blocks, the stop and
        # the long cap decide the block length.
        p = self.params
        return min(p.max_lookahead, p.price_lookahead) if p.stop else p.max_lookahead

    def _block(self, ctx: PlanContext, edge: tuple[str, str], k: int) -> tuple[int, StopRule | None]:
        """Up to ``max_lookahead`` (within a verification budget: ``k``), cut by the calibrated stop."""
        p = self.params
        if not p.stop:
            return k, None
        return (k if p.verify_budget is not None else max(k, p.max_lookahead)), self._stop_rule(ctx, edge)

    def _stop_rule(self, ctx: PlanContext, edge: tuple[str, str]) -> CalibratedStop:
        estimates = self._estimates()
        calibration = estimates.calibration(*edge)
        threshold = self.params.stop_threshold
        if threshold is None:
            threshold = self._priced(("stop", edge, ctx.batch_size),
                                     lambda estimates: self._threshold(estimates, edge, ctx.batch_size))
        after_full = estimates.after_full.get(edge, False)
        table = calibration.table(Calibration.FIRST_AFTER_FULL if after_full else Calibration.FIRST_AFTER_REJECT)
        return CalibratedStop(table, calibration.table(Calibration.LATER), threshold)

    def _threshold(self, estimates: Estimates, edge: tuple[str, str], batch: int) -> float:
        """The block survival below which one more drafted token stops paying: drafting it costs
        the drafter's pass plus the verifier's extra position (its average share over a block),
        and it earns its chance of acceptance times the seconds a committed token costs on this
        edge."""
        first, verifier = edge
        rates: dict[str, float] = {}
        price_lookahead = self.params.price_lookahead
        _, lookahead = estimates.path_cost(edge, price_lookahead, batch=batch, rates=rates)
        draft = estimates.cost(first, batch, 1) or 0.0
        # A drafted position's share of the verifying pass: averaged over the block the cost
        # model would draft (the price lookahead if none), since a pass is not linear in its
        # positions — on a CPU the second position can cost most of a pass, the next few little.
        k = lookahead.get(first) or price_lookahead
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
