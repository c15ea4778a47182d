"""The policy interface: per-step plans, per-token stop rules, feedback.

A policy decides *execution* only — which path through the graph a step takes, how far each
level looks ahead, when a drafting level stops early — never what is accepted. Whatever it
decides, the exact acceptance rule keeps the output distributed as the authority's.

Stop rules see only the drafting level's own distribution at tokens it has already drafted (a
stopping time of the proposer's process); they never see the verifier.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import networkx as nx
import torch


@dataclass(frozen=True)
class DraftStep:
    """What a drafting level knows right after drafting the token at ``index`` of its block."""

    index: int  # 0-based position of this token in the block
    token_prob: float  # the drafter's probability of the token it drew
    max_prob: float  # the drafter's largest probability at this position
    entropy: float  # entropy of the drafter's distribution at this position (nats)
    block_prob: float  # product of token_prob over the block so far


def draft_step(index: int, probs: torch.Tensor, token: int, prev_block_prob: float) -> DraftStep:
    """Build the :class:`DraftStep` for one drafted token from its sampling row ``probs`` [vocab]."""
    token_prob = float(probs[token])
    positive = probs[probs > 0]
    entropy = float(-(positive * positive.log()).sum())
    return DraftStep(index, token_prob, float(probs.max()), entropy, prev_block_prob * token_prob)


class StopRule(abc.ABC):
    """Decides, after each drafted token, whether the block ends there (that token is kept).

    Instances travel to workers (possibly over Ray), so keep them small and picklable.
    """

    @abc.abstractmethod
    def should_stop(self, step: DraftStep) -> bool: ...


@dataclass(frozen=True)
class PlanContext:
    """What the engine tells a policy before each step."""

    graph: nx.DiGraph
    authority: str
    remaining: int  # tokens the request may still commit
    step: int  # 0-based step index within the request
    available: frozenset[str]  # levels that are up; the authority is always among them
    batch_size: int = 1


@dataclass(frozen=True)
class StepPlan:
    """One step: ``path`` runs from the first proposer up to the authority (a path in the graph).

    ``lookahead[level]`` is how many tokens ``level`` proposes to the next level of the path in
    one block (0 = that level only samples, no block from below). ``stop[level]`` optionally
    ends a level's block early on its own confidence.
    """

    path: tuple[str, ...]
    lookahead: dict[str, int]
    stop: dict[str, StopRule] = field(default_factory=dict)


@dataclass(frozen=True)
class EdgeOutcome:
    proposer: str
    verifier: str
    proposed: int
    accepted: int


@dataclass(frozen=True)
class StepFeedback:
    """What one step produced and cost, handed to :meth:`Policy.observe`."""

    plan: StepPlan
    edges: tuple[EdgeOutcome, ...]
    level_seconds: dict[str, float]
    level_passes: dict[str, int]
    committed: int


class PolicyError(ValueError):
    """A policy's parameters are invalid for the topology; the message names the parameter."""


class Policy(abc.ABC):
    """Decides, per step, the path and lookahead; learns from feedback.

    ``bind`` is called once with the topology's graph before any plan; raise
    :class:`PolicyError` there for parameters that do not fit it.
    """

    name: str = "policy"

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        self.graph = graph
        self.authority = authority

    @abc.abstractmethod
    def plan(self, ctx: PlanContext) -> StepPlan: ...

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from one step's outcome. The default learns nothing."""


def longest_path(graph: nx.DiGraph, authority: str, available: frozenset[str] | None = None) -> tuple[str, ...]:
    """The longest path of available levels ending at the authority (ties: listed order)."""
    nodes = [n for n in graph.nodes if available is None or n in available]
    sub = graph.subgraph(nodes)
    best: tuple[str, ...] = (authority,)
    for source in nodes:
        if source == authority or not nx.has_path(sub, source, authority):
            continue
        for p in nx.all_simple_paths(sub, source, authority):
            if len(p) > len(best):
                best = tuple(p)
    return best


__all__ = [
    "DraftStep", "draft_step", "StopRule", "PlanContext", "StepPlan", "EdgeOutcome",
    "StepFeedback", "Policy", "PolicyError", "longest_path",
]
