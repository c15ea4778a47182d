"""Prometheus metrics of one server, under vLLM's names with a ``cascade:`` prefix.

Each :class:`Metrics` has its own ``CollectorRegistry`` (never the process-global one), so one
process can hold several servers (tests, a Ray Serve replica per app). Facts are recorded where
they happen: the engine thread records steps and tokens, :class:`RecordingPolicy` sees every
step's plan and edge outcomes, the ``/metrics`` route renders.

Meanings (vLLM's where the name is vLLM's):

- ``spec_decode_num_drafts{edge,mode}``: blocks proposed along ``edge`` ("proposer->verifier");
  ``spec_decode_num_draft_tokens{edge,mode}``, ``spec_decode_num_accepted_tokens{edge,mode}``:
  tokens proposed and accepted; ``spec_decode_num_accepted_tokens_per_pos{edge,mode,position}``:
  accepted tokens at each 0-based draft position. A tree's block counts its depth as proposed,
  and adds ``spec_decode_num_tree_candidates{edge,mode}`` (its nodes) and
  ``spec_decode_num_accepted_tokens_per_rank{edge,mode,position,rank}``: accepted tokens by
  position and by which sibling they were (0: the proposer's first choice). ``mode`` is
  ``greedy`` or ``sampled`` (temperature > 0): a draft is accepted far more often under greedy
  decoding (several-fold, docs/policies.md), and the adaptive policies keep the two apart too; sum over ``mode`` for vLLM's per-edge figure.
- ``time_to_first_token_seconds``: arrival to the first committed token;
  ``inter_token_latency_seconds``: time between two engine steps that committed tokens for a
  request (one observation per step, as vLLM counts one per engine iteration — a step may
  commit several tokens); ``e2e_request_latency_seconds``: arrival to finish.
- ``num_requests_running`` / ``num_requests_waiting``: in the batch / admitted but queued.
- ``generation_tokens_total`` / ``prompt_tokens_total``.
- ``request_success_total{finished_reason}``: finished requests by OpenAI's reason (stop,
  length), ``abort`` for a client that went away, ``error`` for a failure.
- ``path_selected_total{path}``: sequence-steps that ran ``path`` ("tiny->small->large").
- ``num_cached_sequences{level}`` (cascade's own): sequences whose KV cache a level holds, where
  the level can tell; finished and cancelled requests must leave it.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from policies.base import PassCost, PlanContext, Policy, StepFeedback, StepPlan

PREFIX = "cascade:"
EDGE = ("edge", "mode")  # the labels of every speculative-decoding counter
MODES = ("greedy", "sampled")  # a step's mode, indexed by StepFeedback.sampled
# vLLM's buckets for request-level latencies (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """The instruments of one server, in their own registry."""

    def __init__(self, edges: list[tuple[str, str]], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, p = self.registry, PREFIX
        self.drafts = Counter(p + "spec_decode_num_drafts", "Blocks proposed, per edge", EDGE, registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed, per edge",
                                    EDGE, registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted, per edge",
                                       EDGE, registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens at each draft position, per edge",
                                        [*EDGE, "position"], registry=r)
        self.tree_candidates = Counter(p + "spec_decode_num_tree_candidates",
                                       "Candidates scored in draft trees, per edge", EDGE, registry=r)
        self.accepted_per_rank = Counter(p + "spec_decode_num_accepted_tokens_per_rank",
                                         "Accepted tree tokens by draft position and sibling rank (0: the "
                                         "proposer's first choice), per edge", [*EDGE, "position", "rank"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to the first committed token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between steps committing tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", buckets=_E2E_BUCKETS,
                             registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for the batch", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.finished = Counter(p + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.path_selected = Counter(p + "path_selected", "Sequence-steps per path", ["path"], registry=r)
        self.cached = Gauge(p + "num_cached_sequences", "Sequences a level holds a cache for", ["level"],
                            registry=r)
        for a, b in edges:  # every edge shows from the start, at zero, in both modes
            for mode in MODES:
                for c in (self.drafts, self.draft_tokens, self.accepted_tokens):
                    c.labels(edge=f"{a}->{b}", mode=mode)

    def observe_step(self, feedback: StepFeedback) -> None:
        self.path_selected.labels(path="->".join(feedback.plan.path)).inc()
        mode = MODES[feedback.sampled]
        for outcome in feedback.edges:
            on = {"edge": f"{outcome.proposer}->{outcome.verifier}", "mode": mode}
            self.drafts.labels(**on).inc()
            self.draft_tokens.labels(**on).inc(outcome.proposed)
            self.accepted_tokens.labels(**on).inc(outcome.accepted)
            for pos in range(outcome.accepted):
                self.accepted_per_pos.labels(**on, position=str(pos)).inc()
            if outcome.candidates:
                self.tree_candidates.labels(**on).inc(outcome.candidates)
                for pos, rank in enumerate(outcome.ranks):
                    self.accepted_per_rank.labels(**on, position=str(pos), rank=str(rank)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RecordingPolicy(Policy):
    """Wraps the serving policy so that every step's plan and edge outcomes reach the metrics.

    It decides nothing itself: every call goes to ``inner``, so the tokens are the inner
    policy's exactly. Attributes it does not define are the inner policy's."""

    def __init__(self, inner: Policy, metrics: Metrics):
        self.inner = inner
        self.metrics = metrics
        self.name = inner.name

    def bind(self, graph, authority: str) -> None:
        self.inner.bind(graph, authority)

    def plan(self, ctx: PlanContext) -> StepPlan:
        return self.inner.plan(ctx)

    def observe(self, feedback: StepFeedback) -> None:
        self.inner.observe(feedback)
        self.metrics.observe_step(feedback)

    def observe_pass(self, cost: PassCost) -> None:
        self.inner.observe_pass(cost)

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes not found here (e.g. a policy's learned estimates)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
