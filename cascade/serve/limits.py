"""What a request's own policy may ask of a server: :class:`PolicyLimits`.

A client names a policy in its request (``"policy": "fixed:lookahead=8"``), and its parameters
scale what the request costs: a block of lookahead ``L`` costs ``L`` drafting passes and an
authority pass ``L`` tokens wide every step, however few of them are accepted; a draft tree
costs a drafting pass per depth and a verifying pass as wide as its nodes. The Python API
bounds these loosely (it trusts its caller); the HTTP door is stricter. A parameter beyond a
limit is refused (400 naming it, e.g. ``policy.lookahead``), never clamped: a clamped request
would run as something its client did not ask for.

The limits apply to the policy's parameters by name, after its own validation, defaults
included (so a limit also holds for a client that asks for ``auto`` and gets its default
``max_lookahead``): ``lookahead`` and ``max_lookahead`` (one int, or a mapping level -> int),
``tree`` (level -> widths per depth) and ``trees`` (a list of widths per depth). A ``path`` is
bounded by the topology itself: a path of its acyclic graph names each level at most once. The
server's own policy (the topology's, or ``cascade serve --policy``) is the operator's: it is
not checked.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cascade.errors import RequestError, describe
from policies.params import tree_size

#: how the operator raises or lowers a limit (named in the errors a client gets)
FLAG = "cascade serve --policy-limit"


class PolicyLimits(BaseModel):
    """The most a request's policy may ask for (``cascade serve --policy-limit KEY=N``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    lookahead: int = Field(32, ge=1, description="Longest block a level may draft (lookahead, max_lookahead): "
                                                 "auto's own default, 32, passes.")
    tree_nodes: int = Field(64, ge=1, description="Most nodes in a draft tree (the width of its verifying pass).")
    tree_depth: int = Field(16, ge=1, description="Deepest draft tree (a drafting pass per depth).")
    tree_width: int = Field(8, ge=1, description="Most candidates below one node of a draft tree.")

    @classmethod
    def parse(cls, items: Sequence[str]) -> "PolicyLimits":
        """``["lookahead=16", "tree_nodes=32"]`` (the command line's) -> the limits, the rest
        at their defaults; a RequestError naming the key otherwise."""
        values: dict[str, Any] = {}
        for item in items:
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or not key:
                raise RequestError(f"policy-limit: expected KEY=N, got {item!r} (keys: {', '.join(cls.model_fields)})")
            try:
                values[key] = int(value)
            except ValueError:
                raise RequestError(f"policy-limit.{key}: must be an integer (got {value.strip()!r})") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            raise RequestError(describe(exc, root="policy-limit", must=True,
                                        unknown=f"unknown limit (keys: {', '.join(cls.model_fields)})")) from None

    def check(self, params: Any) -> None:
        """Raise a RequestError naming the first parameter of ``params`` (a policy's validated
        ``Params``, or the mapping a policy without one takes) beyond a limit."""
        values = params.model_dump() if isinstance(params, BaseModel) else params
        if not isinstance(values, Mapping):
            return
        for field in ("lookahead", "max_lookahead"):
            for where, value in _per_level(f"policy.{field}", values.get(field)):
                if _int(value) and value > self.lookahead:
                    raise self._beyond(where, f"a block of {value} tokens", "lookahead", self.lookahead)
        trees = values.get("tree")
        for where, widths in _per_level("policy.tree", trees if isinstance(trees, Mapping) else None):
            self._check_tree(where, widths)
        trees = values.get("trees")
        for i, widths in enumerate(trees if isinstance(trees, (list, tuple)) else ()):
            self._check_tree(f"policy.trees.{i}", widths)

    def _check_tree(self, where: str, widths: Any) -> None:
        if not isinstance(widths, (list, tuple)) or not all(_int(w) for w in widths):
            return  # not a tree shape: the policy's own validation says so
        if len(widths) > self.tree_depth:
            raise self._beyond(where, f"a tree {len(widths)} deep", "tree_depth", self.tree_depth)
        if max(widths, default=0) > self.tree_width:
            raise self._beyond(where, f"{max(widths)} candidates below a node", "tree_width", self.tree_width)
        nodes = tree_size(widths)
        if nodes > self.tree_nodes:
            raise self._beyond(where, f"a tree of {nodes} nodes", "tree_nodes", self.tree_nodes)

    @staticmethod
    def _beyond(where: str, what: str, key: str, limit: int) -> RequestError:
        return RequestError(f"{where}: {what} is over this server's limit of {limit} ({key}; its operator "
                            f"sets it with {FLAG} {key}=N)")


def _per_level(where: str, value: Any) -> list[tuple[str, Any]]:
    """A per-level parameter's values, each with its field path (``policy.lookahead.tiny``)."""
    if isinstance(value, Mapping):
        return [(f"{where}.{level}", item) for level, item in value.items()]
    return [] if value is None else [(where, value)]


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
