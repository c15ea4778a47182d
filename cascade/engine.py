"""The engine: one exact speculative step along a path of the hierarchy, repeated.

A step runs a path ``l_0 -> l_1 -> ... -> authority`` chosen by the policy. ``extend(i, budget)``
produces up to ``budget`` tokens that are exact samples of level ``l_i``'s distribution:

- the first level of the path drafts them autoregressively (``Worker.draft``);
- any other level repeats rounds of: get a block from ``l_{i-1}`` (its lookahead), score it in
  one forward pass, keep the accepted prefix plus the recovered/bonus token (verify.py).

Every token ``l_i`` emits is an exact sample of ``l_i``'s distribution and ``l_i`` computed that
distribution at its position, so (tokens, rows) go up as (draft tokens, ``draft_probs``) to
``l_{i+1}``, which verifies with the same rule. By induction the authority's output is exact
(DESIGN.md §2). Block lengths depend only on information the proposer had (its lookahead and
its own confidence): stopping times, which keep it exact.

Sequences run in batches (:class:`Batch`, a solo request is a batch of one): each forward pass
of a level covers every sequence that needs one at that point, each sequence accepts its own
number of tokens, and each draws its randomness from its own generator.
"""
from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import networkx as nx
import torch

from cascade.errors import RequestError, WorkerError
from cascade.sampling import Sampling, SamplingOverride
from cascade.stats import RequestStats
from cascade.verify import verify_block
from policies.base import EdgeOutcome, PassCost, PlanContext, Policy, PolicyError, StepFeedback, StepPlan, draft_step
from workers.base import Worker


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None


@dataclass
class RequestState:
    """A request in flight: what has been committed so far and what it cost."""

    request: Request
    seq_id: str
    generator: torch.Generator
    stats: RequestStats
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "eos", "stop" or "context"
    # per level, the tokens its cache holds (as far as the engine can tell): what a call
    # really feeds, prefill included, is priced for the policy's cost model
    level_tokens: dict[str, list[int]] = field(default_factory=dict)

    def fed(self, level: str, tokens: list[int], num_positions: int, cached_after: int) -> int:
        """Positions a call on ``level`` computes for this sequence: those of ``tokens`` past
        the level's cached prefix (at least ``num_positions``); then the level holds
        ``tokens[:cached_after]``."""
        held = self.level_tokens.get(level, [])
        n = min(len(held), len(tokens) - num_positions)
        keep = n if held[:n] == tokens[:n] else next((i for i in range(n) if held[i] != tokens[i]), n)
        # the callers build ``tokens`` afresh for each call: keep it, no copy, when it is all cached
        self.level_tokens[level] = tokens if cached_after == len(tokens) else tokens[:cached_after]
        return len(tokens) - keep


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


class Engine:
    """Runs requests over a graph of workers. Backend-agnostic: workers may be local or remote."""

    def __init__(
        self,
        graph: nx.DiGraph,
        authority: str,
        workers: Mapping[str, Worker],
        policy: Policy,
        level_sampling: Mapping[str, SamplingOverride | None] | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        context_length: int | None = None,
    ):
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
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        return RequestState(
            request=request,
            seq_id=uuid.uuid4().hex,
            generator=torch.Generator().manual_seed(seed),
            stats=RequestStats(self.authority, prompt_tokens=len(request.prompt_ids)),
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

    def _extend(self, group, plan, i, prefixes, budgets, records, policy) -> list[tuple[list[int], torch.Tensor | None]]:
        try:
            return self._extend_level(group, plan, i, prefixes, budgets, records, policy)
        except WorkerError as exc:
            if exc.level is None:  # name the failing level (the innermost call sets it first)
                exc.level = plan.path[i]
            raise

    def _extend_level(
        self,
        group: list[RequestState],  # sequences sharing one sampling configuration
        plan: StepPlan,
        i: int,
        prefixes: list[list[int]],
        budgets: list[int],
        records: list["_StepRecord"],
        policy: Policy,
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each sequence, up to ``budgets[b]`` exact samples of level ``plan.path[i]`` after
        ``prefixes[b]``, with the rows they were sampled from. Every forward pass covers all the
        sequences that still need one; each accepts its own number of tokens. The authority (top
        of the path) runs a single round."""
        level = plan.path[i]
        worker = self.workers[level]
        sampling = self._sampling(group[0], level)
        stop = plan.stop.get(level)
        n = len(group)
        if i == 0 and level != self.authority:
            todo = [b for b in range(n) if budgets[b] > 0]
            uniforms = [torch.rand(budgets[b], generator=group[b].generator, dtype=torch.float64) for b in todo]
            t0 = time.perf_counter()
            drafts = worker.draft([group[b].seq_id for b in todo], [prefixes[b] for b in todo],
                                  [budgets[b] for b in todo], sampling, uniforms, stop)
            seconds = time.perf_counter() - t0
            share = seconds / max(1, len(todo))
            if todo:
                # the first pass feeds what the level has not cached, each later one the token before
                fed = [group[b].fed(level, prefixes[b] + d.tokens[:-1], len(d.tokens), len(prefixes[b]) + len(d.tokens) - 1)
                       for b, d in zip(todo, drafts)]
                policy.observe_pass(PassCost(level, len(todo), max(d.forward_passes for d in drafts), sum(fed), seconds,
                                             rows=sum(d.forward_passes for d in drafts),
                                             catch_up=max(f - d.forward_passes for f, d in zip(fed, drafts))))
            results: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in range(n)]
            for b, draft in zip(todo, drafts):
                records[b].cost(level, share, draft.forward_passes)
                records[b].confidence.extend(draft.confidence or [])
                records[b].draft_confidence = draft.confidence if draft.tokens else None
                records[b].stats.level(level).early_stops += draft.stopped_early
                results[b] = (draft.tokens, draft.probs)
            return results

        below = plan.path[i - 1] if i > 0 else None
        top = i == len(plan.path) - 1
        outs: list[list[int]] = [[] for _ in range(n)]
        rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
        last: list = [None] * n  # each sequence's previous DraftStep in this block (stop rules)
        stopped = [False] * n
        while True:
            active = [b for b in range(n) if not stopped[b] and len(outs[b]) < budgets[b]]
            if not active:
                break
            # Ask the level below for at most budget-1-len(out) tokens: with the bonus token a
            # fully accepted block then lands exactly on the budget.
            ks = {b: min(plan.lookahead.get(below, 0), budgets[b] - len(outs[b]) - 1) if below else 0 for b in active}
            subs: dict[int, tuple[list[int], torch.Tensor | None]] = {b: ([], None) for b in active}
            need = [b for b in active if ks[b] > 0]
            if need:
                got = self._extend([group[b] for b in need], plan, i - 1, [prefixes[b] + outs[b] for b in need],
                                   [ks[b] for b in need], [records[b] for b in need], policy)
                subs.update(zip(need, got))
            scored = ([group[b].seq_id for b in active], [prefixes[b] + outs[b] + subs[b][0] for b in active],
                      [len(subs[b][0]) + 1 for b in active])
            t0 = time.perf_counter()
            if stop is None:
                # Only the sampling rows are needed: a remote worker warps next to the model and
                # ships the nonzero entries alone.
                logits = None
                level_probs = worker.score_probs(*scored, sampling)  # per sequence [k_b + 1, vocab]
            else:  # the stop rule reads the model's own logits
                logits = worker.score(*scored)
                level_probs = [sampling.probs(x) for x in logits]
            seconds = time.perf_counter() - t0
            share = seconds / len(active)
            fed = [group[b].fed(level, t, m, len(t)) for b, t, m in zip(active, scored[1], scored[2])]
            policy.observe_pass(PassCost(level, len(active), 1, sum(fed), seconds,
                                         catch_up=max(f - m for f, m in zip(fed, scored[2]))))
            # Each sequence draws from its own generator, k + 1 uniforms, as it always has.
            uniforms = [torch.rand(len(subs[b][0]) + 1, generator=group[b].generator, dtype=torch.float64)
                        for b in active]
            # Sequences with nothing proposed sample one token each: all in one call.
            alone = [a for a, b in enumerate(active) if not subs[b][0]]
            sampled = {}
            if alone:
                picked = sampling.draw(torch.stack([level_probs[a][0] for a in alone]),
                                       torch.stack([uniforms[a][0] for a in alone]))
                sampled = dict(zip(alone, picked.tolist()))
            for a, b in enumerate(active):
                records[b].cost(level, share, 1)
                sub_tokens, sub_probs = subs[b]
                k = len(sub_tokens)
                if k:
                    verdict = verify_block(sub_tokens, sub_probs, level_probs[a], uniforms[a])
                    records[b].edge(below, level, k, verdict.accepted)
                    emitted = sub_tokens[: verdict.accepted] + [verdict.next_token]
                else:  # nothing proposed: the level sampled one token itself
                    emitted = [sampled[a]]
                for j, tok in enumerate(emitted):
                    outs[b].append(tok)
                    rows[b].append(level_probs[a][j])
                    if stop is not None and not top and len(outs[b]) < budgets[b]:
                        step = last[b] = draft_step(len(outs[b]) - 1, logits[a][j], tok, previous=last[b])
                        if stop.should_stop(step):
                            records[b].stats.level(level).early_stops += 1
                            stopped[b] = True
                            break
            if top:
                break  # the authority commits after one verification
        return [(outs[b], torch.stack(rows[b]) if rows[b] else None) for b in range(n)]


class Batch:
    """Continuous batching: requests join with :meth:`add` and leave when finished; each
    :meth:`step` runs one speculative step for all active requests, every level's forward pass
    covering all of them at once.

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
        self._limits[state.seq_id] = limit
        self._started[state.seq_id] = time.perf_counter()
        self._available[state.seq_id] = set(self.engine.workers)
        self.active.append(state)
        return state

    def step(self) -> list[tuple[RequestState, list[int]]]:
        """One step for every active request; returns what each committed. Finished requests
        leave the batch (their caches are released)."""
        self._retire()  # e.g. stopped by the caller on a stop string since the last step
        groups: dict[tuple, list[RequestState]] = {}
        for state in self.active:
            key = (state.request.sampling, frozenset(self._available[state.seq_id]))
            groups.setdefault(key, []).append(state)
        committed: list[tuple[RequestState, list[int]]] = []
        try:
            for (_, available), group in groups.items():
                committed.extend(self._step_group(group, available))
        finally:
            self._retire()
        return committed

    def _step_group(self, group: list[RequestState], available: frozenset[str]) -> list[tuple[RequestState, list[int]]]:
        engine = self.engine
        remaining = [self._limits[s.seq_id] - len(s.generated) for s in group]
        ctx = PlanContext(engine.graph, engine.authority, max(remaining), min(s.stats.steps for s in group),
                          available, batch_size=len(self.active))
        plan = self.policy.plan(ctx)
        records = [_StepRecord(s.stats) for s in group]
        prefixes = [s.request.prompt_ids + s.generated for s in group]
        try:
            outs = engine._extend(group, plan, len(plan.path) - 1, prefixes, remaining, records, self.policy)
        except WorkerError as exc:
            if not self._drop_level(exc, group):
                for s in group:
                    s.finish_reason = s.finish_reason or "error"
                exc.partial = {s.seq_id: list(s.generated) for s in group} if len(group) > 1 else list(group[0].generated)
                raise
            return []  # redo the step without the level next time; nothing was committed
        committed = []
        for state, record, (new, _) in zip(group, records, outs):
            state.stats.steps += 1
            confidence = sum(record.confidence) / len(record.confidence) if record.confidence else None
            self.policy.observe(StepFeedback(plan, tuple(record.edges), record.seconds, record.passes, len(new),
                                             confidence, state.seq_id))
            for j, tok in enumerate(new):
                if tok in engine.eos_token_ids:
                    new = new[: j + 1]
                    state.finish_reason = "eos"
                    break
            state.generated.extend(new)
            state.stats.new_tokens = len(state.generated)
            state.stats.wall_seconds = time.perf_counter() - self._started[state.seq_id]
            limit = self._limits[state.seq_id]
            if state.finish_reason is None and len(state.generated) >= limit:
                state.finish_reason = "length" if limit == state.request.max_new_tokens else "context"
            committed.append((state, new))
        return committed

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
        for w in self.engine.workers.values():
            w.release([s.seq_id for s in done])

    def close(self) -> None:
        """Abandon what is still active (releasing its caches)."""
        for state in self.active:
            state.finish_reason = state.finish_reason or "cancelled"
        self._retire()
