"""The baseline policy: one path and a fixed lookahead per level, every step."""
from __future__ import annotations

import networkx as nx

from policies.base import PlanContext, Policy, PolicyError, StepPlan, longest_path


class FixedPolicy(Policy):
    """Always the same path (default: the longest path to the authority) and lookahead.

    Params:
      lookahead: int for every proposing level, or a mapping level -> int (default 4).
      path: list of level names ending at the authority (default: the longest path).
    """

    name = "fixed"

    def __init__(self, lookahead: int | dict[str, int] = 4, path: list[str] | None = None):
        if isinstance(lookahead, bool) or not isinstance(lookahead, (int, dict)):
            raise PolicyError(f"lookahead: expected an int or a mapping level -> int, got {lookahead!r}")
        values = lookahead.values() if isinstance(lookahead, dict) else [lookahead]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PolicyError(f"lookahead: expected non-negative ints, got {v!r}")
        self.lookahead_param = lookahead
        self.path_param = list(path) if path is not None else None
        self._paths: dict[frozenset[str], tuple[str, ...]] = {}

    def bind(self, graph: nx.DiGraph, authority: str) -> None:
        super().bind(graph, authority)
        if self.path_param is not None:
            check_path(graph, authority, self.path_param)
        if isinstance(self.lookahead_param, dict):
            unknown = set(self.lookahead_param) - set(graph.nodes)
            if unknown:
                raise PolicyError(f"lookahead: unknown level(s) {sorted(unknown)}")

    def lookahead_for(self, level: str) -> int:
        if isinstance(self.lookahead_param, dict):
            return self.lookahead_param.get(level, 4)
        return self.lookahead_param

    def plan(self, ctx: PlanContext) -> StepPlan:
        if self.path_param is not None and all(n in ctx.available for n in self.path_param):
            path = tuple(self.path_param)
        else:
            path = self._paths.get(ctx.available)
            if path is None:
                path = self._paths[ctx.available] = longest_path(ctx.graph, ctx.authority, ctx.available)
        return StepPlan(path=path, lookahead={n: self.lookahead_for(n) for n in path[:-1]})


def check_path(graph: nx.DiGraph, authority: str, path: list[str]) -> None:
    """Raise PolicyError unless ``path`` is a path of the graph that ends at the authority."""
    if not path or path[-1] != authority:
        raise PolicyError(f"path: must end at the authority {authority!r}, got {path!r}")
    for a, b in zip(path, path[1:]):
        if not graph.has_edge(a, b):
            raise PolicyError(f"path: {a!r} -> {b!r} is not an edge of the topology")
