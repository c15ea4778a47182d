"""The baseline policy: one path and a fixed lookahead per level, every step."""
from __future__ import annotations

from typing import Annotated, Any

import networkx as nx
from pydantic import Field

from policies.base import PlanContext, Policy, PolicyError, StepPlan, longest_path
from policies.params import Int, LevelName, PathParams, TreeShape, per_level


class FixedParams(PathParams):
    lookahead: per_level(Annotated[Int, Field(ge=0)]) = Field(
        4, description="Tokens each proposing level drafts per block: one int for every level, or a "
                       "mapping level -> int (levels left out: 4). 0 = that level only samples.")
    tree: dict[LevelName, TreeShape] = Field(
        default_factory=dict,
        description="level -> widths per depth, e.g. {draft: [3, 2, 1]}, for the path's first level (another is "
                    "refused): it drafts a tree of its top candidates (widths[d] below every node at depth d) "
                    "instead of a block, verified in one pass by the next level.")
    stand_in: dict[LevelName, LevelName] = Field(
        default_factory=dict,
        description="level -> level, e.g. {ngram: head}: where the first level of the path proposes nothing for a "
                    "sequence (prompt lookup without a match), the second drafts that sequence's block in its place "
                    "(with its own lookahead); it needs an edge into the path's next level.")


class PathChoice:
    """A mixin: the path given (``path_param``), or else the longest over the levels available,
    cached per available set; ``bind`` checks a given path against the graph."""

    path_param: list[str] | None
    _paths: dict

    def _init_path(self, path: list[str] | None) -> None:
        self.path_param = list(path) if path is not None else None
        self._paths = {}

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        super().bind(graph, authority)
        if self.path_param is not None:
            check_path(self, graph, authority, self.path_param)

    def _path(self, ctx: PlanContext) -> tuple[str, ...]:
        if self.path_param is not None and all(n in ctx.available for n in self.path_param):
            return tuple(self.path_param)
        if ctx.available not in self._paths:
            self._paths[ctx.available] = longest_path(ctx.graph, ctx.authority, ctx.available)
        return self._paths[ctx.available]


class FixedPolicy(PathChoice, Policy):
    """Always the same path (default: the longest path to the authority) and lookahead; the
    parameters are :class:`FixedParams`. ``lookahead`` may also be passed positionally:
    ``FixedPolicy(3)``, ``FixedPolicy({"tiny": 2})``."""

    name = "fixed"
    Params = FixedParams

    def __init__(self, lookahead: Any = None, /, **kwargs: Any):
        if lookahead is not None and not isinstance(lookahead, FixedParams):
            if "lookahead" in kwargs:
                raise PolicyError(f"params.lookahead: given twice (policy {self.name!r})")
            kwargs["lookahead"], lookahead = lookahead, None
        super().__init__(lookahead, **kwargs)
        self.lookahead_param = self.params.lookahead
        self._init_path(self.params.path)
        self.tree_param = {level: tuple(widths) for level, widths in self.params.tree.items()}
        self.stand_in_param = dict(self.params.stand_in)

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        super().bind(graph, authority)

        def known(field: str, levels) -> None:
            unknown = set(levels) - set(graph.nodes)
            if unknown:
                raise self.param_error(field, f"unknown level(s) {sorted(unknown)}; levels: {list(graph.nodes)}")

        known("lookahead", self.lookahead_param if isinstance(self.lookahead_param, dict) else ())
        known("tree", self.tree_param)
        if authority in self.tree_param:
            raise self.param_error("tree", f"the authority {authority!r} proposes nothing")
        # a tree is drafted by the level that starts the path; one named elsewhere would do nothing
        path = self.path_param or longest_path(graph, authority)
        for level in self.tree_param:
            if level != path[0]:
                raise self.param_error("tree", f"level {level!r} does not start the path {' -> '.join(path)}: only "
                                               f"the path's first level ({path[0]!r}) drafts a tree")
        known("stand_in", set(self.stand_in_param) | set(self.stand_in_param.values()))
        if authority in self.stand_in_param.values():
            raise self.param_error("stand_in", f"the authority {authority!r} proposes nothing")

    def lookahead_for(self, level: str) -> int:
        if isinstance(self.lookahead_param, dict):
            return self.lookahead_param.get(level, 4)
        return self.lookahead_param

    def plan(self, ctx: PlanContext) -> StepPlan:
        path = self._path(ctx)
        tree = {path[0]: self.tree_param[path[0]]} if path[0] in self.tree_param and len(path) > 1 else {}
        lookahead = {n: self.lookahead_for(n) for n in path[:-1]}
        stand_in = {}
        sub = self.stand_in_param.get(path[0]) if len(path) > 1 and not tree else None
        if sub is not None and sub in ctx.available and ctx.graph.has_edge(sub, path[1]):
            stand_in, lookahead[sub] = {path[0]: sub}, self.lookahead_for(sub)
        return StepPlan(path=path, lookahead=lookahead, tree=tree, stand_in=stand_in)


def check_path(policy: Policy, graph: nx.DiGraph, authority: str, path: list[str]) -> None:
    """Raise PolicyError unless ``path`` is a path of the graph that ends at the authority."""
    if not path or path[-1] != authority:
        raise policy.param_error("path", f"must end at the authority {authority!r}, got {path!r}")
    for a, b in zip(path, path[1:]):
        if not graph.has_edge(a, b):
            raise policy.param_error("path", f"{a!r} -> {b!r} is not an edge of the topology")
