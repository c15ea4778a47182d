"""The engine: one exact speculative step along a path of the hierarchy, repeated.

A step runs a path ``l_0 -> l_1 -> ... -> authority`` chosen by the policy
(:meth:`Engine.step`). :meth:`Engine._extend` (read it first: the whole step on one screen)
produces, per sequence, up to its budget of tokens that are exact samples of level ``l_i``'s
distribution:

- the first level of the path drafts them autoregressively (:meth:`Engine._draft`,
  ``Worker.draft``);
- any other level repeats rounds of: draft (a block from ``l_{i-1}``, up to its lookahead),
  verify (score it in one forward pass, the exact rule of ``cascade/verify.py``), commit (the
  accepted prefix plus the recovered/bonus token join ``l_i``'s block).

Every token ``l_i`` emits is an exact sample of ``l_i``'s distribution and ``l_i`` computed that
distribution at its position, so (tokens, rows) go up as (draft tokens, ``draft_probs``) to
``l_{i+1}``, which verifies with the same rule. By induction the authority's output is exact
(cascade/DESIGN.md §2, §3). Block lengths depend only on information the proposer had (its
lookahead and its own confidence): stopping times, which keep it exact.

Sequences run in batches (:class:`Batch`, a solo request is a batch of one): each forward pass
of a level covers every sequence that needs one at that point, each sequence accepts its own
number of tokens, and each draws its randomness from its own generator. Bookkeeping is
recorded beside the step, not threaded through it: every worker call is priced once
(:meth:`Engine._price`: each sequence's stats get their share, the policy's cost model the
positions the call really computed), edge outcomes and draft confidence go into the step's
:class:`_StepRecord`, and each token's origin travels with it in its :class:`_Seq`.
"""
from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping, NamedTuple

import networkx as nx
import torch

from cascade.errors import RequestError, WorkerError
from cascade.sampling import Sampling, SamplingOverride
from cascade.stats import BlockOutcome, RequestStats, StepProvenance, cut_provenance
from cascade.tree import DraftTree, verify_trees
from cascade.verify import Verdict, verify_block_keyed, verify_blocks
from policies.base import (DraftStep, EdgeOutcome, PassCost, PlanContext, Policy, PolicyError, StepFeedback,
                           StepPlan, StopRule, draft_step)
from workers.base import Draft, Worker

@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None
    provenance: bool = False  # record where each committed token came from (RequestState.provenance)


@dataclass
class RequestState:
    """A request in flight: what has been committed so far and what it cost."""

    request: Request
    seq_id: str
    generator: torch.Generator
    stats: RequestStats
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "eos", "stop" or "context"
    # per level, the tokens its cache holds: the one record of the sequence's progress. Before
    # each call the level is told how much of the call's sequence it holds (Worker.hold), and
    # what the call really feeds, prefill included, is priced for the policy's cost model
    level_tokens: dict[str, list[int]] = field(default_factory=dict)

    # with request.provenance, one record per committed step (else None: nothing is recorded)
    provenance: list[StepProvenance] | None = None
    policy: Policy | None = None  # this request's own policy (None: its batch's)
    seed: int = 0  # the request's seed (drawn when it had none): keys its positions' noise (coupling="gumbel")

    def fed(self, level: str, tokens: list[int], held: int, num_positions: int, cached_after: int) -> int:
        """Positions a call on ``level`` computes for this sequence: those of ``tokens`` past the
        ``held`` the level was told it holds before the call (at least ``num_positions``); then
        the level holds ``tokens[:cached_after]``."""
        keep = min(held, len(tokens) - num_positions)
        # the callers build ``tokens`` afresh for each call: keep it, no copy, when it is all cached
        self.level_tokens[level] = tokens if cached_after == len(tokens) else tokens[:cached_after]
        return len(tokens) - keep

    def held(self, level: str, tokens: list[int]) -> int:
        """How many leading positions of ``tokens`` ``level`` holds: where they leave what it was
        handed (and drafted) for this sequence."""
        have = self.level_tokens.get(level, [])
        n = min(len(have), len(tokens))
        if have[:n] == tokens[:n]:  # the usual case: the sequence continues what the level holds
            return n
        return next(i for i in range(n) if have[i] != tokens[i])


@dataclass
class _StepRecord:
    """Accumulates one step's costs and edge outcomes for the stats and the policy."""

    stats: RequestStats
    edges: list[EdgeOutcome] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)
    confidence: list[float] = field(default_factory=list)  # the first level's own token probabilities
    draft_confidence: list[float] | None = None  # those of the block drafted last, until it is verified

    def cost(self, level: str, seconds: float, passes: int) -> None:
        s = self.stats.level(level)
        s.seconds += seconds
        s.forward_passes += passes
        self.seconds[level] = self.seconds.get(level, 0.0) + seconds
        self.passes[level] = self.passes.get(level, 0) + passes

    def edge(self, proposer: str, verifier: str, proposed: int, accepted: int) -> None:
        self.stats.edge(proposer, verifier).observe(proposed, accepted)
        self.stats.level(proposer).tokens_proposed += proposed
        confidence, self.draft_confidence = self.draft_confidence, None
        if confidence is not None:
            confidence = tuple(confidence[:proposed])
        self.edges.append(EdgeOutcome(proposer, verifier, proposed, accepted, confidence))

    def tree(self, proposer: str, verifier: str, tree, verdict) -> None:
        """A verified tree (after :meth:`edge` recorded it as a block): its size, and the rank
        among its siblings of every accepted candidate."""
        parents = [-1, *verdict.path[:-1]]
        ranks = [tree.children(p).index(node) for p, node in zip(parents, verdict.path)]
        self.stats.edge(proposer, verifier).observe_tree(tree.size, ranks)
        self.edges[-1] = replace(self.edges[-1], candidates=tree.size, ranks=tuple(ranks))

    def drafted(self, level: str, draft: Draft) -> None:
        """The first level's block: its own token probabilities, and whether its stop rule ended it."""
        self.confidence.extend(draft.confidence or [])
        self.draft_confidence = draft.confidence if draft.tokens else None
        self.stats.level(level).early_stops += draft.stopped_early

    def provenance(self, plan: StepPlan, tokens: list[int], origins: list[str]) -> StepProvenance:
        blocks = tuple(BlockOutcome(e.proposer, e.verifier, e.proposed, e.accepted, e.candidates, e.ranks)
                       for e in self.edges)
        return StepProvenance(plan.path, tuple(tokens), tuple(origins), blocks)

    def feedback(self, plan: StepPlan, produced: int, seq_id: str, sampled: bool, seconds: float) -> StepFeedback:
        confidence = sum(self.confidence) / len(self.confidence) if self.confidence else None
        return StepFeedback(plan, tuple(self.edges), self.seconds, self.passes, produced, confidence, seq_id,
                            sampled=sampled, seconds=seconds)


@dataclass(slots=True)
class _Seq:
    """One sequence's part in one level's work during a step: up to ``budget`` exact samples of
    the level after ``prefix``, gathered in ``tokens`` with the rows they were sampled from and
    the level whose draft each one is (``origins``, for provenance)."""

    state: RequestState
    record: _StepRecord
    prefix: list[int]
    budget: int
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)  # [k, vocab] chunks, a row per token
    origins: list[str] = field(default_factory=list)
    last: DraftStep | None = None  # the block's previous step, for the stop rule
    stopped: bool = False  # the stop rule ended the block

    @property
    def open(self) -> bool:
        return not self.stopped and len(self.tokens) < self.budget

    def below(self, budget: int) -> "_Seq":
        """The sequence's part for the level below: a block after what this level has so far
        (an empty one, ``budget`` 0, needs no prefix)."""
        return _Seq(self.state, self.record, self.prefix + self.tokens if budget else [], budget)

    def probs(self) -> torch.Tensor | None:  # [len(tokens), vocab]
        if len(self.rows) > 1:
            self.rows = [torch.cat(self.rows)]
        return self.rows[0] if self.rows else None

    def draws(self, sampling: Sampling, n: int) -> torch.Tensor:  # [n] float64
        """The sequence's randomness for its next ``n`` positions (cascade/sampling.py)."""
        return sampling.draws(self.state.seed, self.state.generator, len(self.prefix) + len(self.tokens), n)

    def emit(self, level: str, tokens: list[int], rows: torch.Tensor, origins: list[str],
             logits: torch.Tensor | None, stop: StopRule | None) -> None:
        """Append a round's tokens with the rows they were sampled from and their origins.
        ``stop`` (never the authority's) may end the block after any of them short of the budget."""
        kept = len(tokens)
        if stop is not None:
            for j, tok in enumerate(tokens):
                if len(self.tokens) + j + 1 >= self.budget:
                    break
                self.last = draft_step(len(self.tokens) + j, logits[j], tok, previous=self.last)
                if stop.should_stop(self.last):
                    self.record.stats.level(level).early_stops += 1
                    self.stopped = True
                    kept = j + 1
                    break
        self.tokens.extend(tokens[:kept])
        self.rows.append(rows[:kept])
        self.origins.extend(origins[:kept])


class _Feed(NamedTuple):
    """What one worker call handed a level for one sequence, to price the call."""

    tokens: list[int]  # the sequence as the call saw it
    positions: int  # the trailing positions it computes whatever the level has cached
    cached_after: int  # the level then holds tokens[:cached_after]
    passes: int  # forward passes the call ran for the sequence
    scored: int  # positions it scores for the sequence: fed beyond them is catch-up (prefill)


# Prompt positions a long prompt's prefill computes per batch step (Batch): a few hundred keep
# the others' steps short while costing the long request little over one piece (docs/serving.md)
PREFILL_CHUNK = 256


class Engine:
    """Runs requests over a graph of workers. Backend-agnostic: workers may be local or remote.

    ``prefill_chunk``: a prompt longer than this is computed that many positions per
    :meth:`Batch.step` (:meth:`prefill`) before it joins the steps; None: in one piece."""

    def __init__(
        self,
        graph: nx.DiGraph,
        authority: str,
        workers: Mapping[str, Worker],
        policy: Policy,
        level_sampling: Mapping[str, SamplingOverride | None] | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        context_length: int | None = None,
        prefill_chunk: int | None = PREFILL_CHUNK,
    ):
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk: an integer >= 1 or None (one piece), got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.graph = graph
        self.authority = authority
        self.workers = dict(workers)
        self.level_sampling = dict(level_sampling or {})
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.policy = policy
        policy.bind(graph, authority)

    # -- request lifecycle -------------------------------------------------------------------

    def start(self, request: Request) -> RequestState:
        if not request.prompt_ids:
            raise RequestError("prompt: empty prompt (need at least one token)")
        if isinstance(request.max_new_tokens, bool) or not isinstance(request.max_new_tokens, int) \
                or request.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: must be an integer >= 1, got {request.max_new_tokens!r}")
        if self.context_length is not None and len(request.prompt_ids) >= self.context_length:
            raise RequestError(
                f"prompt: {len(request.prompt_ids)} tokens does not fit the authority's context of "
                f"{self.context_length} tokens (need room for at least one new token)"
            )
        # an unset coupling follows the seed: one given means the same tokens (Sampling.for_seed)
        request = replace(request, sampling=request.sampling.for_seed(request.seed))
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        return RequestState(
            request=request,
            seq_id=uuid.uuid4().hex,
            generator=torch.Generator().manual_seed(seed),
            seed=seed,
            stats=RequestStats(self.authority, prompt_tokens=len(request.prompt_ids)),
            provenance=[] if request.provenance else None,
        )

    def bind(self, policy: Policy | None) -> Policy:
        """The engine's policy, or a per-call one bound to this graph."""
        if policy is None:
            return self.policy
        try:
            policy.bind(self.graph, self.authority)
        except PolicyError as exc:
            raise RequestError(f"policy: {exc}") from None
        return policy

    def run(self, state: RequestState, policy: Policy | None = None) -> Iterator[list[int]]:
        """Run a started request to the end, yielding the tokens each step commits."""
        batch = Batch(self, policy)
        batch.add(state)
        try:
            while batch.active:
                for _, new in batch.step():
                    yield new
        finally:  # also when the caller stops early (a stop string)
            batch.close()

    def generate(self, request: Request, policy: Policy | None = None) -> RequestState:
        state = self.start(request)
        for _ in self.run(state, policy):
            pass
        return state

    # -- one step for a group of sequences ---------------------------------------------------------

    def _sampling(self, state: RequestState, level: str) -> Sampling:
        override = self.level_sampling.get(level)
        base = state.request.sampling
        return override.apply(base) if (override is not None and level != self.authority) else base

    def step(self, group: list[RequestState], plan: StepPlan, budgets: list[int], policy: Policy) -> list[list[int]]:
        """One speculative step along ``plan.path`` for ``group``, sequences sharing one sampling
        configuration: for each, up to ``budgets[b]`` (>= 1) new tokens, exact samples of the
        authority after the sequence's prompt and generated tokens.

        Each level's time and passes and each edge's outcome go into the sequences' stats, and
        to ``policy``: every worker call as a :class:`PassCost`, every sequence's step as a
        :class:`StepFeedback`. Nothing is committed: the caller cuts at EOS and appends. A failing
        worker raises :class:`WorkerError` naming its level (``exc.level``). A request with
        provenance gets the step's :class:`StepProvenance` appended (uncut; the caller cuts it too).
        """
        seqs = [_Seq(s, _StepRecord(s.stats), s.request.prompt_ids + s.generated, b) for s, b in zip(group, budgets)]
        t0 = time.perf_counter()
        self._extend(seqs, len(plan.path) - 1, plan, policy)
        share = (time.perf_counter() - t0) / len(seqs)
        for s in seqs:
            policy.observe(s.record.feedback(plan, len(s.tokens), s.state.seq_id, not s.state.request.sampling.greedy,
                                             share))
            if s.state.provenance is not None:
                s.state.provenance.append(s.record.provenance(plan, s.tokens, s.origins))
        return [s.tokens for s in seqs]

    def prefill(self, group: list[RequestState], ends: list[int], levels: list[str], policy: Policy) -> None:
        """Compute each request's prompt positions ``[0, ends[b])`` on ``levels``
        (``Worker.prefill``: nothing sampled, nothing committed): a chunk of a long prompt, so
        that its prefill interleaves with the others' steps (:class:`Batch`). Caches keep what they
        are told they hold (``Worker.hold``), so the step that follows computes only the rest, as
        it computes a whole prompt otherwise. Each call is priced as a pass that catches up."""
        seqs = [_Seq(s, _StepRecord(s.stats), s.request.prompt_ids[:e], 0) for s, e in zip(group, ends)]
        for level in levels:
            t0 = time.perf_counter()
            try:
                held = self._hold(level, seqs, [s.prefix for s in seqs])
                self.workers[level].prefill([s.state.seq_id for s in seqs], [s.prefix for s in seqs])
            except WorkerError as exc:
                exc.level = exc.level or level
                raise
            self._price(level, seqs, policy, time.perf_counter() - t0,
                        [_Feed(s.prefix, 1, len(s.prefix), 1, 1) for s in seqs], held)

    def _extend(self, seqs: list[_Seq], i: int, plan: StepPlan, policy: Policy) -> None:
        """Fill each sequence's block with up to its budget of exact samples of level ``plan.path[i]``.

        The path's first level drafts them. Any other level works in rounds: draft (a block from
        the level below, itself verified up to there), verify (one forward pass of this level over
        every sequence and its block, then the exact rule), commit (the accepted prefix and one
        recovered or bonus token join this level's block). The authority runs a single round.
        """
        level, top = plan.path[i], i == len(plan.path) - 1
        sampling, stop = self._sampling(seqs[0].state, level), plan.stop.get(level)
        try:
            if i == 0 and not top:
                self._draft(seqs, level, sampling, stop, policy)
                return
            widths = plan.tree.get(plan.path[0]) if i == 1 else None
            if widths and self.workers[plan.path[0]].drafts_trees:
                while active := [s for s in seqs if s.open]:
                    self._tree_round(active, plan, widths, sampling, stop, policy)
                    if top:
                        break
                return
            while active := [s for s in seqs if s.open]:
                blocks = self._blocks_below(active, i, plan, policy)  # draft
                logits, target_probs = self._score(level, active, blocks, sampling, stop, policy)  # verify
                draws = [s.draws(sampling, len(b.tokens) + 1) for s, b in zip(active, blocks)]
                # nothing proposed: the verdict is the level's own sample (accepted 0, a bonus)
                verdicts = _verdicts(sampling, [b.tokens for b in blocks], [b.probs() for b in blocks],
                                     target_probs, draws)
                for a, (s, b, verdict) in enumerate(zip(active, blocks, verdicts)):
                    if b.tokens:  # the first level's block may be its stand-in's
                        proposer = b.origins[0] if i == 1 else plan.path[i - 1]
                        s.record.edge(proposer, level, len(b.tokens), verdict.accepted)
                    tokens = b.tokens[: verdict.accepted] + [verdict.next_token]
                    origins = b.origins[: verdict.accepted] + [level]  # accepted drafts keep theirs
                    s.emit(level, tokens, target_probs[a], origins,  # commit to this level's block
                           None if logits is None else logits[a], None if top else stop)
                if top:
                    break  # the authority commits after one verification
        except WorkerError as exc:
            if exc.level is None:  # name the failing level (the innermost call sets it first)
                exc.level = level
            raise

    def _tree_round(self, seqs: list[_Seq], plan: StepPlan, widths: tuple[int, ...], sampling: Sampling,
                    stop: StopRule | None, policy: Policy) -> None:
        """One round at ``plan.path[1]`` with a tree from ``plan.path[0]``: the drafter grows each
        sequence's tree of top-k candidates (one pass per depth), the level scores all nodes in
        one pass, and the matching rule (cascade/tree.py; docs/exactness.md, Trees) walks it: at
        each depth the level draws its own token, with the draw of that position, and follows
        the child holding it. The path and the token drawn where it ends are exact samples of the
        level, and go into its block as a chain with the level's rows."""
        drafter, level = plan.path[0], plan.path[1]
        prefixes = [s.prefix + s.tokens for s in seqs]
        ids = [s.state.seq_id for s in seqs]
        # as a block: at most budget - 1 - len(tokens) deep, so that the bonus lands on the budget
        shapes = [widths[:max(0, s.budget - len(s.tokens) - 1)] for s in seqs]
        self._hand_features(drafter, seqs, policy)  # a feature head's, as before a block
        t0 = time.perf_counter()
        held = self._hold(drafter, seqs, prefixes)
        grown = self.workers[drafter].draft_tree(ids, prefixes, shapes)
        depth = [len(x) for x in shapes]
        self._price(drafter, seqs, policy, time.perf_counter() - t0,
                    [_Feed(p, 1, len(p), d, len(t[0])) for p, d, t in zip(prefixes, depth, grown)], held)
        trees = [DraftTree(tokens, parents) for tokens, parents in grown]
        t0 = time.perf_counter()
        worker = self.workers[level]
        held = self._hold(level, seqs, prefixes)
        logits, rows = _rows(stop, sampling, lambda: worker.score_tree_probs(ids, prefixes, grown, sampling),
                             lambda: worker.score_tree(ids, prefixes, grown))
        self._price(level, seqs, policy, time.perf_counter() - t0,
                    [_Feed(p, t.size + 1, len(p), 1, t.size + 1) for p, t in zip(prefixes, trees)], held)
        draws = [s.draws(sampling, t.max_depth + 1) for s, t in zip(seqs, trees)]
        verdicts = verify_trees(sampling, trees, rows, draws)
        for a, (s, tree, verdict) in enumerate(zip(seqs, trees, verdicts)):
            if tree.size:
                s.record.edge(drafter, level, tree.max_depth, verdict.accepted)
                s.record.tree(drafter, level, tree, verdict)
            # the level keeps the accepted path's entries (its next call settles the tree), so a
            # feature head's hand-off and the next pass are priced as what it really computes
            s.state.level_tokens[level] = prefixes[a] + list(verdict.emitted[:verdict.accepted])
            taken = list(verdict.rows)
            s.emit(level, list(verdict.emitted), rows[a][taken], [drafter] * verdict.accepted + [level],
                   None if logits is None else logits[a][taken], stop)

    def _blocks_below(self, seqs: list[_Seq], i: int, plan: StepPlan, policy: Policy) -> list[_Seq]:
        """This round's block from the level below ``plan.path[i]`` for each sequence (empty at
        the path's first level), with the level each of its tokens came from."""
        lookahead = plan.lookahead.get(plan.path[i - 1], 0) if i > 0 else 0
        # Ask for at most budget-1-len(tokens): with the bonus token a fully accepted block then
        # lands exactly on the budget.
        blocks = [s.below(min(lookahead, s.budget - len(s.tokens) - 1)) for s in seqs]
        asked = [b for b in blocks if b.budget > 0]
        if asked:
            self._extend(asked, i - 1, plan, policy)
            stand_in = plan.stand_in.get(plan.path[0]) if i == 1 else None
            idle = [(b, s) for b, s in zip(blocks, seqs) if b.budget > 0 and not b.tokens] if stand_in else []
            if idle:  # nothing proposed (prompt lookup without a match): the stand-in drafts instead
                k = plan.lookahead.get(stand_in, lookahead)
                for b, s in idle:
                    b.budget, b.stopped = min(k, s.budget - len(s.tokens) - 1), False
                idle = [b for b, _ in idle if b.budget > 0]
                if idle:
                    self._draft(idle, stand_in, self._sampling(idle[0].state, stand_in), plan.stop.get(stand_in),
                                policy)
        return blocks

    def _hand_features(self, level: str, seqs: list[_Seq], policy: Policy) -> None:
        """A feature head (``workers/head.py``) drafts from the last hidden states of the level it
        reads (its ``features_of``): hand it those of each prefix it lacks, as far as that level
        has computed them — every committed position (the first step computes the prompt's: the
        prefill that level's own first pass then skips), and of this step's tokens those it has
        scored. Past them the head feeds its own predictions. A pass the level runs for this is
        priced to it."""
        head = self.workers[level]
        source = head.features_of
        if source is None:
            return
        seen = [s.state.held(source, s.prefix) for s in seqs]
        # features of positions < end: the level holds those of the tokens it was fed
        ends = [max(len(s.state.request.prompt_ids) + len(s.state.generated) - 1, min(n, len(s.prefix) - 1))
                for s, n in zip(seqs, seen)]
        computed = [a for a, (n, end) in enumerate(zip(seen, ends)) if n < end]
        t0 = time.perf_counter()
        self._hold(level, seqs, [s.prefix for s in seqs])
        # a level that computes positions for the hand-off first drops what it holds past them
        self.workers[source].hold([seqs[a].state.seq_id for a in computed], [seen[a] for a in computed])
        head.hand_off(self.workers[source], [s.state.seq_id for s in seqs], [s.prefix for s in seqs], ends)
        seconds = time.perf_counter() - t0
        if computed:  # the level has not seen these positions: it computes them now
            self._price(source, [seqs[a] for a in computed], policy, seconds,
                        [_Feed(seqs[a].prefix[:ends[a] + 1], 1, ends[a] + 1, 1, 1) for a in computed],
                        [seen[a] for a in computed])

    def _draft(self, seqs: list[_Seq], level: str, sampling: Sampling, stop: StopRule | None,
               policy: Policy) -> None:
        """The path's first level drafts each block autoregressively, one forward pass per token
        for all sequences still drafting; ``stop`` may end a block early."""
        self._hand_features(level, seqs, policy)
        uniforms = [s.draws(sampling, s.budget) for s in seqs]  # a block's draws, all up front
        t0 = time.perf_counter()
        held = self._hold(level, seqs, [s.prefix for s in seqs])
        drafts = self.workers[level].draft([s.state.seq_id for s in seqs], [s.prefix for s in seqs],
                                           [s.budget for s in seqs], sampling, uniforms, stop)
        # the first pass feeds what the level has not cached, each later one the token before
        self._price(level, seqs, policy, time.perf_counter() - t0,
                    [_Feed(s.prefix + d.tokens[:-1], len(d.tokens), len(s.prefix) + len(d.tokens) - 1,
                           d.forward_passes, d.forward_passes) for s, d in zip(seqs, drafts)], held)
        for s, d in zip(seqs, drafts):
            s.tokens, s.origins = list(d.tokens), [level] * len(d.tokens)
            s.rows = [d.probs] if d.tokens else []
            s.record.drafted(level, d)

    def _score(self, level: str, seqs: list[_Seq], blocks: list[_Seq], sampling: Sampling,
               stop: StopRule | None, policy: Policy) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        """One forward pass of ``level`` over each sequence with its proposed block: the level's
        sampling rows ``[k_b + 1, vocab]`` per sequence, and its logits where a stop rule reads
        them (else None)."""
        worker = self.workers[level]
        ids = [s.state.seq_id for s in seqs]
        tokens = [s.prefix + s.tokens + b.tokens for s, b in zip(seqs, blocks)]
        positions = [len(b.tokens) + 1 for b in blocks]
        t0 = time.perf_counter()
        held = self._hold(level, seqs, tokens)
        logits, rows = _rows(stop, sampling, lambda: worker.score_probs(ids, tokens, positions, sampling),
                             lambda: worker.score(ids, tokens, positions))
        self._price(level, seqs, policy, time.perf_counter() - t0,
                    [_Feed(t, m, len(t), 1, m) for t, m in zip(tokens, positions)], held)
        return logits, rows

    def _hold(self, level: str, seqs: list[_Seq], tokens: list[list[int]]) -> list[int]:
        """Before a call: tell ``level`` how much of each sequence (``tokens[b]``) it still holds
        (``Worker.hold``), from the engine's record; nothing else reconciles what a cache holds.
        Returns those counts, for :meth:`_price` to price the call with."""
        held = [s.state.held(level, t) for s, t in zip(seqs, tokens)]
        self.workers[level].hold([s.state.seq_id for s in seqs], held)
        return held

    @staticmethod
    def _price(level: str, seqs: list[_Seq], policy: Policy, seconds: float, fed: list[_Feed],
               held: list[int]) -> None:
        """Record what one worker call for ``seqs`` cost: each sequence's record gets an equal
        share of the ``seconds`` and its forward passes; the policy one :class:`PassCost` with the
        positions the level really computed, prefill included (``fed``: what the call handed the
        level for each sequence; ``held``: what :meth:`_hold` told it it held before)."""
        computed = [s.state.fed(level, f.tokens, h, f.positions, f.cached_after) for s, f, h in zip(seqs, fed, held)]
        passes = [f.passes for f in fed]
        policy.observe_pass(PassCost(level, len(seqs), max(passes), sum(computed), seconds, rows=sum(passes),
                                     catch_up=max(c - f.scored for c, f in zip(computed, fed))))
        share = seconds / len(seqs)
        for s, p in zip(seqs, passes):
            s.record.cost(level, share, p)


class Batch:
    """Continuous batching: requests join with :meth:`add` and leave when finished; each
    :meth:`step` runs one speculative step for all active requests, every level's forward pass
    covering all of them at once.

    A prompt longer than the engine's ``prefill_chunk`` is prefilled a chunk per step on every
    level that keeps a cache (:meth:`Engine.prefill`), beside the others' steps; it joins the
    steps when at most a chunk of it is left, which its first step computes. So a long prompt
    holds up the others by a chunk's pass per step, not by its whole prefill. Its tokens are
    those it gets in one piece: the levels compute the same positions, in more passes.

    Requests with different sampling parameters step as separate groups (a worker call shares
    one sampling configuration). A level that fails is dropped for the requests in flight.
    """

    def __init__(self, engine: Engine, policy: Policy | None = None):
        self.engine = engine
        self.policy = engine.bind(policy)
        self.active: list[RequestState] = []
        self._limits: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._available: dict[str, set[str]] = {}
        self._prefilled: dict[str, int] = {}  # a long prompt's positions its levels hold, until it steps

    def add(self, state: RequestState) -> RequestState:
        if state.seq_id in self._limits:
            raise RequestError("state: this request is already in the batch (added twice)")
        if state.finish_reason is not None:
            raise RequestError(f"state: this request has already finished ({state.finish_reason!r}); "
                               "make a new one with Cascade.request")
        request = state.request
        limit = request.max_new_tokens
        if self.engine.context_length is not None:
            limit = min(limit, self.engine.context_length - len(request.prompt_ids))
        if state.policy is not None:  # a request's own policy plans for this graph too
            self.engine.bind(state.policy)
        self._limits[state.seq_id] = limit
        self._started[state.seq_id] = time.perf_counter()
        self._available[state.seq_id] = set(self.engine.workers)
        chunk = self.engine.prefill_chunk
        if chunk is not None and len(request.prompt_ids) > chunk:
            self._prefilled[state.seq_id] = 0
        self.active.append(state)
        return state

    def step(self) -> list[tuple[RequestState, list[int]]]:
        """One step for every active request; returns what each committed. Finished requests
        leave the batch (their caches are released)."""
        self._retire()  # e.g. stopped by the caller on a stop string since the last step
        groups: dict[tuple, list[RequestState]] = {}
        for state in self.active:
            if state.seq_id not in self._prefilled:
                key = (state.request.sampling, frozenset(self._available[state.seq_id]), id(state.policy))
                groups.setdefault(key, []).append(state)
        committed: list[tuple[RequestState, list[int]]] = []
        try:
            for (_, available, _), group in groups.items():
                committed.extend(self._step_group(group, available))
            self._prefill([s for s in self.active if s.seq_id in self._prefilled])
        finally:
            self._retire()
        return committed

    def _step_group(self, group: list[RequestState], available: frozenset[str]) -> list[tuple[RequestState, list[int]]]:
        engine = self.engine
        policy = group[0].policy or self.policy  # the group shares one (see step)
        remaining = [self._limits[s.seq_id] - len(s.generated) for s in group]
        ctx = PlanContext(engine.graph, engine.authority, max(remaining), min(s.stats.steps for s in group),
                          available, batch_size=len(self.active), sampled=not group[0].request.sampling.greedy)
        plan = policy.plan(ctx)
        ok, outs = self._guarded(group, lambda: engine.step(group, plan, remaining, policy))
        if not ok:
            return []  # redo the step without the level next time; nothing was committed
        return [(state, self._commit(state, new)) for state, new in zip(group, outs)]

    def _prefill(self, states: list[RequestState]) -> None:
        """One chunk more of each long prompt still prefilling, on the levels with a cache that
        the request may use (grouped as steps are, by those levels and policy)."""
        chunk, workers = self.engine.prefill_chunk, self.engine.workers
        groups: dict[tuple, list[RequestState]] = {}
        for state in states:
            groups.setdefault((frozenset(self._available[state.seq_id]), id(state.policy)), []).append(state)
        for (available, _), group in groups.items():
            ends = [self._prefilled[s.seq_id] + chunk for s in group]
            levels = [name for name, w in workers.items() if name in available and w.can_score]
            policy = group[0].policy or self.policy
            if not self._guarded(group, lambda: self.engine.prefill(group, ends, levels, policy))[0]:
                continue  # again next step, without the level that failed
            for state, end in zip(group, ends):
                if len(state.request.prompt_ids) - end > chunk:
                    self._prefilled[state.seq_id] = end
                else:  # the rest, at most a chunk, is computed by its first step
                    del self._prefilled[state.seq_id]

    def _guarded(self, group: list[RequestState], call) -> tuple[bool, object]:
        """``(True, call())``; ``(False, None)`` where a draft level failed (it is left out for
        ``group`` from now on). A failing authority ends the group's requests ("error") and
        raises, with what each had committed (``exc.partial``)."""
        try:
            return True, call()
        except WorkerError as exc:
            if not self._drop_level(exc, group):
                for s in group:
                    s.finish_reason = s.finish_reason or "error"
                exc.partial = {s.seq_id: list(s.generated) for s in group} if len(group) > 1 else list(group[0].generated)
                raise
            return False, None

    def _commit(self, state: RequestState, new: list[int]) -> list[int]:
        """Append a step's tokens to the request (up to an EOS) and settle whether it finished."""
        state.stats.steps += 1
        for j, tok in enumerate(new):
            if tok in self.engine.eos_token_ids:
                new = new[: j + 1]
                state.finish_reason = "eos"
                if state.provenance:  # the step's record loses what was cut too
                    state.provenance[-1] = cut_provenance(state.provenance[-1:], len(new))[0]
                break
        state.generated.extend(new)
        state.stats.new_tokens = len(state.generated)
        state.stats.wall_seconds = time.perf_counter() - self._started[state.seq_id]
        limit = self._limits[state.seq_id]
        if state.finish_reason is None and len(state.generated) >= limit:
            state.finish_reason = "length" if limit == state.request.max_new_tokens else "context"
        return new

    def _drop_level(self, exc: WorkerError, group: list[RequestState]) -> bool:
        """A draft level failed: leave it out for these requests and say so. Its tokens were
        never committed unverified, so the output does not depend on it. The authority (or an
        unknown level, or one already dropped) cannot be skipped: False."""
        if exc.level is None or exc.level == self.engine.authority:
            return False
        dropped = False
        for state in group:
            available = self._available[state.seq_id]
            if exc.level in available:
                available.discard(exc.level)
                dropped = True
                state.stats.notes.append(
                    f"level {exc.level!r} unavailable from step {state.stats.steps}, continuing without it: {exc}"
                )
        return dropped

    def _retire(self) -> None:
        done = [s for s in self.active if s.finish_reason is not None]
        if not done:
            return
        self.active = [s for s in self.active if s.finish_reason is None]
        for state in done:
            state.stats.wall_seconds = time.perf_counter() - self._started.pop(state.seq_id)
            self._limits.pop(state.seq_id)
            self._available.pop(state.seq_id)
            self._prefilled.pop(state.seq_id, None)
        for w in self.engine.workers.values():
            w.release([s.seq_id for s in done])

    def close(self) -> None:
        """Abandon what is still active (releasing its caches)."""
        for state in self.active:
            state.finish_reason = state.finish_reason or "cancelled"
        self._retire()


def _rows(stop: StopRule | None, sampling: Sampling, probs, logits) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
    """A verifying call's sampling rows, and the level's logits where a stop rule reads them
    (else None). Without a stop rule only the rows are asked for (``probs()``): a remote worker
    then warps next to the model and ships the nonzero entries alone."""
    if stop is None:
        return None, probs()
    out = logits()
    if len(out) < 2:
        return out, [sampling.probs(x) for x in out]
    # one warp for every sequence's rows: warping is row-wise, each row as it is alone
    return out, list(sampling.probs(torch.cat(out)).split([x.shape[0] for x in out]))


def _verdicts(sampling: Sampling, tokens: list[list[int]], draft_probs: list[torch.Tensor | None],
              target_probs: list[torch.Tensor], draws: list[torch.Tensor]) -> list[Verdict]:
    """Per sequence ``tokens [n]``, ``draft_probs [n, vocab]`` (None when n = 0), ``target_probs
    [n + 1, vocab]``, ``draws [n + 1]``: the speculative rule, or (a keyed coupling) keep drafts
    while they equal the level's own keyed draws, all rows' draws in one call. Either way the
    emitted tokens are exact samples of the level."""
    if sampling.rule.keyed:
        mine = sampling.draw(torch.cat(target_probs), torch.cat(draws)).split([len(t) + 1 for t in tokens])
        return [verify_block_keyed(t, m.tolist()) for t, m in zip(tokens, mine)]
    return verify_blocks(tokens, draft_probs, target_probs, draws)
