"""Policy parameters as pydantic models: declared once per policy, validated once, at the boundary.

Each policy class names its parameters in a nested ``Params`` model (``extra="forbid"``,
constrained fields with descriptions); :func:`check_params` turns a mapping into that model or
raises one :class:`PolicyError` that names the field and the policy, e.g.
``params.lookahead.tiny: Input should be greater than or equal to 0 (policy 'fixed', got -1)``.

Numbers are strict: a bool is not an integer, ``3.0`` or ``"3"`` is not a lookahead, and
non-finite floats are refused; integer-like numpy scalars count as integers.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Annotated, Any, Union

from pydantic import (
    AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Strict, Tag, ValidationError,
)

from cascade.errors import describe


class PolicyError(ValueError):
    """A policy's parameters are invalid (or do not fit the topology); the message names the
    field and the policy."""


def _integer(value: Any) -> Any:
    """numpy integer scalars (and other ``Integral`` types) count as ints; a bool does not."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _real(value: Any) -> Any:
    """Any real number but a bool, as a float (non-finite ones are refused after this)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


Int = Annotated[int, BeforeValidator(_integer), Strict()]
Float = Annotated[float, BeforeValidator(_real), Strict(), AllowInfNan(False)]
Unit = Annotated[Float, Field(ge=0.0, le=1.0)]  # a probability, share or rate in [0, 1]
Lookahead = Annotated[Int, Field(ge=1, le=64)]
LevelName = Annotated[str, Strict()]
# a draft tree's shape: candidates below every node at each depth (cascade/tree.py), e.g. [3, 2, 1]
MAX_TREE_NODES = 256  # what one verifying pass may be asked to score per sequence (a request names it)


def tree_size(widths) -> int:
    """The nodes of a tree of ``widths`` per depth (``widths[d]`` below every node at depth d)."""
    nodes, level = 0, 1
    for w in widths:
        level *= w
        nodes += level
    return nodes


def _tree_nodes(widths: list[int]) -> list[int]:
    if tree_size(widths) > MAX_TREE_NODES:
        raise ValueError(f"a tree of widths {widths} has more than {MAX_TREE_NODES} nodes")
    return widths


TreeShape = Annotated[list[Annotated[Int, Field(ge=1, le=16)]], Field(min_length=1, max_length=32),
                      AfterValidator(_tree_nodes)]

# Tags of the per-level union: left out of the field path in messages.
_ONE, _EACH = "for every level", "per level"


def _one_or_each(value: Any) -> str:
    return _EACH if isinstance(value, Mapping) else _ONE


def per_level(item: Any) -> Any:
    """The type "``item`` for every level, or a mapping level -> ``item``". Errors name the
    level (``params.lookahead.tiny``) and come from one branch only."""
    return Annotated[
        Union[Annotated[item, Tag(_ONE)], Annotated[dict[LevelName, item], Tag(_EACH)]],
        Discriminator(_one_or_each),
    ]


class PolicyParams(BaseModel):
    """Base of every policy's parameters: unknown names refused, values immutable once checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PathParams(PolicyParams):
    path: list[LevelName] | None = Field(
        None, min_length=1,
        description="Level names from the first proposer to the authority (default: the longest path).",
    )


def check_params(model: type[PolicyParams], policy: str, params: Any) -> PolicyParams:
    """``params`` (a mapping, or already a ``model``) validated as ``model``; one PolicyError
    naming the first bad field and the policy otherwise."""
    if type(params) is model:  # exactly: a subclass's model carries parameters this policy lacks
        return params
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise PolicyError(f"params: expected a mapping of parameters (policy {policy!r}), got {params!r}")
    bad = [k for k in params if not isinstance(k, str)]
    if bad:
        raise PolicyError(f"params: parameter names are strings (policy {policy!r}), got {bad[0]!r}")
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        # params.<field>: <what> (policy '<name>', got <value>); the per-level union's tag left out
        known = ", ".join(model.model_fields) or "none"
        unknown = f"unknown parameter (policy {policy!r} takes: {known})"
        raise PolicyError(describe(exc, root="params", unions=True, context=f"policy {policy!r}", more=True,
                                   unknown=unknown, bare=True)) from None


__all__ = ["Float", "Int", "LevelName", "Lookahead", "PathParams", "PolicyError", "PolicyParams", "Unit", "check_params",
           "per_level", "tree_size"]
