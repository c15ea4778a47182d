"""Policies: decisions only (path, lookahead, early stop), never acceptance.

Name a policy in a topology (``policy: {name: fixed, params: {lookahead: 4}}``) or per
``generate`` call, either by a registered name or by a ``"module:Class"`` path.
"""
from __future__ import annotations

import importlib
from typing import Any

from policies.base import (
    DraftStep, EdgeOutcome, PlanContext, Policy, PolicyError, StepFeedback, StepPlan, StopRule,
    draft_step, longest_path,
)

REGISTRY: dict[str, str] = {
    "fixed": "policies.fixed:FixedPolicy",
}


def resolve(name: str) -> type[Policy]:
    """A registered policy name or a ``"module:Class"`` path -> the Policy class."""
    target = REGISTRY.get(name, name)
    if ":" not in target:
        raise PolicyError(f"name: unknown policy {name!r}; known: {sorted(REGISTRY)} or 'module:Class'")
    module_name, _, attr = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PolicyError(f"name: cannot import policy {target!r}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        raise PolicyError(f"name: {target!r} is not a Policy subclass")
    return obj


def make_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    cls = resolve(name)
    try:
        return cls(**(params or {}))
    except TypeError as exc:
        raise PolicyError(f"params: {exc}") from exc


__all__ = [
    "DraftStep", "EdgeOutcome", "PlanContext", "Policy", "PolicyError", "StepFeedback", "StepPlan",
    "StopRule", "draft_step", "longest_path", "make_policy", "resolve", "REGISTRY",
]
