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
from cascade.verify import sample_with_uniform, verify_block
from policies.base import EdgeOutcome, PlanContext, Policy, PolicyError, StepFeedback, StepPlan, draft_step
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


@dataclass
class _StepRecord:
    """Accumulates one step's costs and edge outcomes for the stats and the policy."""

    stats: RequestStats
    edges: list[EdgeOutcome] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)
    confidence: list[float] = field(default_factory=list)  # the first level's own token probabilities

    def cost(self, level: str, seconds: float, passes: int) -> None:
        s = self.stats.level(level)
        s.seconds += seconds
        s.forward_passes += passes
        self.seconds[level] = self.seconds.get(level, 0.0) + seconds
        self.passes[level] = self.passes.get(level, 0) + passes

    def edge(self, proposer: str, verifier: str, proposed: int, accepted: int) -> None:
        self.stats.edge(proposer, verifier).observe(proposed, accepted)
        self.stats.level(proposer).tokens_proposed += proposed
        self.edges.append(EdgeOutcome(proposer, verifier, proposed, accepted))


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

    def run(self, state: RequestState, policy: Policy | None = None) -> Iterator[list[int]]:
        """Run a started request to the end, yielding the tokens each step commits."""
        if policy is None:
            policy = self.policy
        else:
            try:
                policy.bind(self.graph, self.authority)
            except PolicyError as exc:
                raise RequestError(f"policy: {exc}") from None
        request = state.request
        limit = request.max_new_tokens
        if self.context_length is not None:
            limit = min(limit, self.context_length - len(request.prompt_ids))
        started = time.perf_counter()
        available = set(self.workers)
        try:
            while state.finish_reason is None:
                remaining = limit - len(state.generated)
                ctx = PlanContext(self.graph, self.authority, remaining, state.stats.steps,
                                  frozenset(available))
                plan = policy.plan(ctx)
                record = _StepRecord(state.stats)
                try:
                    new = self._step(state, plan, remaining, record)
                except WorkerError as exc:
                    if not self._drop_level(exc, available, state):
                        exc.partial = list(state.generated)
                        raise
                    continue  # redo the step without the level; nothing was committed
                state.stats.steps += 1
                confidence = sum(record.confidence) / len(record.confidence) if record.confidence else None
                policy.observe(StepFeedback(plan, tuple(record.edges), record.seconds, record.passes, len(new),
                                            confidence))
                for i, tok in enumerate(new):
                    if tok in self.eos_token_ids:
                        new = new[: i + 1]
                        state.finish_reason = "eos"
                        break
                state.generated.extend(new)
                state.stats.new_tokens = len(state.generated)
                state.stats.wall_seconds = time.perf_counter() - started
                if state.finish_reason is None and len(state.generated) >= limit:
                    state.finish_reason = "length" if limit == request.max_new_tokens else "context"
                yield new
        finally:
            state.stats.wall_seconds = time.perf_counter() - started
            for w in self.workers.values():
                w.release([state.seq_id])

    def _drop_level(self, exc: WorkerError, available: set[str], state: RequestState) -> bool:
        """A draft level failed: leave it out for the rest of the request and say so. Its
        tokens were never committed unverified, so the output does not depend on it. The
        authority (or an unknown level, or one already dropped) cannot be skipped: False."""
        if exc.level is None or exc.level == self.authority or exc.level not in available:
            return False
        available.discard(exc.level)
        state.stats.notes.append(
            f"level {exc.level!r} unavailable from step {state.stats.steps}, continuing without it: {exc}"
        )
        return True

    def generate(self, request: Request, policy: Policy | None = None) -> RequestState:
        state = self.start(request)
        for _ in self.run(state, policy):
            pass
        return state

    # -- one step ----------------------------------------------------------------------------

    def _step(self, state: RequestState, plan: StepPlan, remaining: int, record: _StepRecord) -> list[int]:
        """Commit at least one token (at most ``remaining``) by verifying up the plan's path."""
        prefix = state.request.prompt_ids + state.generated
        top = len(plan.path) - 1
        tokens, _ = self._extend(state, plan, top, prefix, remaining, record)
        return tokens

    def _sampling(self, state: RequestState, level: str) -> Sampling:
        override = self.level_sampling.get(level)
        base = state.request.sampling
        return override.apply(base) if (override is not None and level != self.authority) else base

    def _extend(
        self, state: RequestState, plan: StepPlan, i: int, prefix: list[int], budget: int, record: _StepRecord
    ) -> tuple[list[int], torch.Tensor | None]:
        try:
            return self._extend_level(state, plan, i, prefix, budget, record)
        except WorkerError as exc:
            if exc.level is None:  # name the failing level (the innermost call sets it first)
                exc.level = plan.path[i]
            raise

    def _extend_level(
        self, state: RequestState, plan: StepPlan, i: int, prefix: list[int], budget: int, record: _StepRecord
    ) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``budget`` exact samples of level ``plan.path[i]`` after ``prefix``, with the
        rows they were sampled from. The authority (top of the path) runs a single round."""
        level = plan.path[i]
        worker = self.workers[level]
        sampling = self._sampling(state, level)
        stop = plan.stop.get(level)
        if i == 0 and level != self.authority:
            uniforms = torch.rand(budget, generator=state.generator, dtype=torch.float64)
            t0 = time.perf_counter()
            draft = worker.draft([state.seq_id], [prefix], [budget], sampling, [uniforms], stop)[0]
            record.cost(level, time.perf_counter() - t0, draft.forward_passes)
            if draft.confidence:
                record.confidence.extend(draft.confidence)
            record.stats.level(level).early_stops += draft.stopped_early
            return draft.tokens, draft.probs

        out: list[int] = []
        rows: list[torch.Tensor] = []
        block_prob = 1.0
        while len(out) < budget:
            # Ask the level below for at most budget-1-len(out) tokens: with the bonus token a
            # fully accepted block then lands exactly on the budget.
            below = plan.path[i - 1] if i > 0 else None
            k = min(plan.lookahead.get(below, 0), budget - len(out) - 1) if below else 0
            if k > 0:
                sub_tokens, sub_probs = self._extend(state, plan, i - 1, prefix + out, k, record)
            else:
                sub_tokens, sub_probs = [], None
            t0 = time.perf_counter()
            scored = ([state.seq_id], [prefix + out + sub_tokens], [len(sub_tokens) + 1])
            if stop is None:
                # Only the sampling rows are needed: a remote worker warps next to the model and
                # ships the nonzero entries alone.
                level_probs = worker.score_probs(*scored, sampling)[0]  # [len(sub_tokens) + 1, vocab]
            else:  # the stop rule reads the model's own logits
                logits = worker.score(*scored)[0]
                level_probs = sampling.probs(logits)
            record.cost(level, time.perf_counter() - t0, 1)
            n = len(sub_tokens)
            uniforms = torch.rand(n + 1, generator=state.generator, dtype=torch.float64)
            if n:
                verdict = verify_block(sub_tokens, sub_probs, level_probs, uniforms)
                record.edge(below, level, n, verdict.accepted)
                emitted = sub_tokens[: verdict.accepted] + [verdict.next_token]
            else:
                # Nothing proposed: the level samples one token itself.
                emitted = [int(sample_with_uniform(level_probs[0], uniforms[n]))]
            for j, tok in enumerate(emitted):
                out.append(tok)
                rows.append(level_probs[j])
                if i == len(plan.path) - 1:
                    continue
                if stop is not None and len(out) < budget:
                    step = draft_step(len(out) - 1, logits[j], tok, block_prob)
                    block_prob = step.block_prob
                    if stop.should_stop(step):
                        record.stats.level(level).early_stops += 1
                        return out, torch.stack(rows)
            if i == len(plan.path) - 1:
                break  # the authority commits after one verification
        return out, torch.stack(rows)

