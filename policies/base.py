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
from typing import Any, ClassVar

import networkx as nx
import torch

from policies.params import PolicyError, PolicyParams, check_params


class DraftStep:
    """What a drafting level knows right after drafting the token at ``index`` of its block.

    Read from the model's own distribution (softmax of its logits at temperature 1), not from
    the warped sampling row: a greedy drafter samples from a one-hot row, which says nothing
    about how sure the model was. ``max_prob`` and ``entropy`` are computed on first use.
    """

    __slots__ = ("index", "token_prob", "block_prob", "previous", "memo", "_logits", "_max_prob", "_entropy")

    def __init__(self, index: int, token_prob: float, block_prob: float, logits: torch.Tensor | None = None,
                 max_prob: float | None = None, entropy: float | None = None, previous: "DraftStep | None" = None):
        self.index = index  # 0-based position of this token in the block
        self.token_prob = token_prob  # the model's probability of the drafted token
        self.block_prob = block_prob  # product of token_prob over the block so far
        self.previous = previous  # the step before in the same block (None at index 0)
        self.memo = None  # a stop rule may keep its running state here (read via ``previous.memo``)
        self._logits = logits  # [vocab]
        self._max_prob = max_prob
        self._entropy = entropy

    @property
    def max_prob(self) -> float:
        """The model's largest probability at this position."""
        if self._max_prob is None:
            self._max_prob = float(torch.softmax(self._logits.to(torch.float64), -1).max())
        return self._max_prob

    @property
    def entropy(self) -> float:
        """Entropy of the model's distribution at this position (nats)."""
        if self._entropy is None:
            logp = torch.log_softmax(self._logits.to(torch.float64), -1)
            self._entropy = float(-(logp.exp() * logp).nan_to_num().sum())
        return self._entropy


def draft_step(index: int, logits: torch.Tensor, token: int, prev_block_prob: float = 1.0,
               previous: DraftStep | None = None, token_prob: float | None = None) -> DraftStep:
    """The :class:`DraftStep` for a token drafted from ``logits`` [vocab], after ``previous``
    (the block's step before; its ``block_prob`` then replaces ``prev_block_prob``).
    ``token_prob``, if the caller computed it already (for a whole batch at once), is used."""
    logits = logits.to(torch.float64)
    if token_prob is None:
        token_prob = float(torch.exp(logits[token] - torch.logsumexp(logits, -1)))
    if previous is not None:
        prev_block_prob = previous.block_prob
        previous.previous = None  # keep one link: a rule reads its state from the step before
    return DraftStep(index, token_prob, prev_block_prob * token_prob, logits, previous=previous)


class StopRule(abc.ABC):
    """Decides, after each drafted token, whether the block ends there (that token is kept).

    Instances travel to workers (possibly over Ray), so keep them small and picklable.
    """

    @abc.abstractmethod
    def should_stop(self, step: DraftStep) -> bool: ...

    def stop_batch(self, steps: "list[DraftStep]", batch: int) -> list[bool]:
        """The decisions for the rows of a batch that drafted a token in the same pass (one
        step each), out of ``batch`` rows whose blocks the draft call builds (rows that already
        ended their block count, the ``steps`` are the others). The default decides each row
        on its own. A rule may decide for the rows together — they share the verifier's pass,
        which is as wide as the longest block — still only from the drafters' own
        distributions: another row's draft is independent of this row's verification, so each
        row's block length stays a stopping time of its proposer."""
        return [self.should_stop(step) for step in steps]


@dataclass(frozen=True)
class PlanContext:
    """What the engine tells a policy before each step."""

    graph: nx.DiGraph
    authority: str
    remaining: int  # tokens the request may still commit
    step: int  # 0-based step index within the request
    available: frozenset[str]  # levels that are up; the authority is always among them
    batch_size: int = 1
    sampled: bool = False  # whether the step samples (temperature > 0) or decodes greedily


@dataclass(frozen=True)
class StepPlan:
    """One step: ``path`` runs from the first proposer up to the authority (a path in the graph).

    ``lookahead[level]`` is how many tokens ``level`` proposes to the next level of the path in
    one block (0 = that level only samples, no block from below). ``stop[level]`` optionally
    ends a level's block early on its own confidence. ``tree[path[0]]``: the first level drafts
    a tree instead, ``widths[d]`` of its top candidates below every node at depth d, which the
    next level verifies in one pass (cascade/tree.py; cut where deeper than the budget allows; a
    level that cannot score drafts a block). ``stand_in[path[0]]``: a level with an edge into
    ``path[1]`` that drafts a sequence's block where the first level proposes nothing (an n-gram
    level without a match); its lookahead and stop are its own entries in ``lookahead`` and ``stop``.
    """

    path: tuple[str, ...]
    lookahead: dict[str, int]
    stop: dict[str, StopRule] = field(default_factory=dict)
    tree: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stand_in: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EdgeOutcome:
    proposer: str
    verifier: str
    proposed: int
    accepted: int
    # the proposer's own (T=1) probability of each proposed token, where the proposer drafted
    # them (the path's first level); None for blocks built by verification below
    confidence: tuple[float, ...] | None = None
    # a tree (StepPlan.tree): its nodes, and which sibling each accepted token was (0: first choice)
    candidates: int = 0
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepFeedback:
    """What one step produced and cost, handed to :meth:`Policy.observe`."""

    plan: StepPlan
    edges: tuple[EdgeOutcome, ...]
    level_seconds: dict[str, float]
    level_passes: dict[str, int]
    committed: int
    confidence: float | None = None  # mean probability the path's first level gave its drafts
    seq_id: str | None = None  # the sequence this step advanced
    sampled: bool = False  # whether the step sampled (temperature > 0) or decoded greedily
    # the sequence's share of the step's wall time: the levels' passes and the engine's work
    # around them (verification, sampling); None where the step was not timed
    seconds: float | None = None


@dataclass(frozen=True)
class PassCost:
    """What one worker call cost: ``passes`` forward passes of ``level`` over ``sequences``
    sequences, ``tokens`` positions computed in all (the sum over sequences and passes)."""

    level: str
    sequences: int
    passes: int
    tokens: int
    seconds: float
    rows: int | None = None  # sequence-passes (a sequence in one pass); None: sequences * passes
    # the most positions one sequence fed beyond those the call scores for it: a prompt's
    # prefill, a request joining a running batch, a level catching up on tokens it skipped
    catch_up: int = 0


class Policy(abc.ABC):
    """Decides, per step, the path and lookahead; learns from feedback.

    Parameters: a policy declares them as a pydantic model, ``Params`` (a subclass of
    :class:`~policies.params.PolicyParams`), and is built from keyword arguments or from one
    ``Params`` instance; :meth:`__init__` validates them once into ``self.params`` (one
    :class:`PolicyError` naming the field and the policy). A policy without ``Params`` takes
    its parameters in its own ``__init__``.

    ``bind`` is called with the topology's graph before any plan; raise :class:`PolicyError`
    there for parameters that do not fit it. A policy caches paths and learns per topology,
    so it serves one graph: binding it to a different one is refused.
    """

    name: str = "policy"
    Params: ClassVar[type[PolicyParams] | None] = None

    def __init__(self, params: PolicyParams | None = None, /, **kwargs: Any):
        if self.Params is None:
            if params is not None or kwargs:
                raise PolicyError(f"params: policy {self.name!r} declares no parameters")
            return
        if params is not None and (kwargs or type(params) is not self.Params):
            raise PolicyError(
                f"params: {type(self).__name__} takes keyword arguments or one {type(self).__name__}.Params "
                f"(policy {self.name!r}), got {params!r}" + (f" and {sorted(kwargs)}" if kwargs else ""))
        self.params = self.check_params(kwargs if params is None else params)

    @classmethod
    def check_params(cls, params: Any) -> PolicyParams:
        """``params`` (a mapping or a ``Params``) validated against ``cls.Params``."""
        assert cls.Params is not None
        return check_params(cls.Params, cls.name, params)

    def param_error(self, field: str, message: str) -> PolicyError:
        """The error for a parameter that does not fit the topology (raised from ``bind``)."""
        return PolicyError(f"params.{field}: {message} (policy {self.name!r})")

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        bound = getattr(self, "graph", None)
        if bound is not None and bound is not graph and not _same_graph(bound, self.authority, graph, authority):
            raise PolicyError(
                f"bind: this {self.name!r} policy object already serves another topology (levels "
                f"{sorted(bound.nodes)}, authority {self.authority!r}); it caches paths and learns per "
                "topology, so give each cascade its own (e.g. policies.from_spec(...))")
        self.graph = graph
        self.authority = authority

    @abc.abstractmethod
    def plan(self, ctx: PlanContext) -> StepPlan: ...

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from one step's outcome (called once per sequence). The default learns nothing."""

    def observe_pass(self, cost: PassCost) -> None:
        """Learn from the cost of one worker call (shared by the sequences it covered)."""


def _same_graph(a: nx.DiGraph, a_authority: str, b: nx.DiGraph, b_authority: str) -> bool:
    """Same levels, edges and authority: what a policy's caches and estimates are keyed by."""
    return a_authority == b_authority and set(a.nodes) == set(b.nodes) and set(a.edges) == set(b.edges)


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
    "StepFeedback", "PassCost", "Policy", "PolicyError", "longest_path",
]
