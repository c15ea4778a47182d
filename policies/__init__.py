"""Policies: decisions only (path, lookahead, early stop), never acceptance.

Name a policy in a topology (``policy: {name: fixed, params: {lookahead: 4}}``) or per
``generate`` call, either by a registered name or by a ``"module:Class"`` path.
"""
from __future__ import annotations

from typing import Any

from policies.base import (
    DraftStep, EdgeOutcome, PlanContext, Policy, PolicyError, StepFeedback, StepPlan, StopRule,
    draft_step, longest_path,
)

REGISTRY: dict[str, str] = {
    "fixed": "policies.fixed:FixedPolicy",
    "confidence": "policies.adaptive:ConfidencePolicy",
    "entropy": "policies.adaptive:EntropyPolicy",
    "cost-aware": "policies.adaptive:CostAwarePolicy",
    "escalation": "policies.adaptive:EscalationPolicy",
    "auto": "policies.adaptive:AutoPolicy",
}


def resolve(name: str) -> type[Policy]:
    """A registered policy name or a ``"module:Class"`` path -> the Policy class."""
    from cascade.plugins import load_class

    target = REGISTRY.get(name, name)
    if ":" not in target:
        raise PolicyError(f"name: unknown policy {name!r}; known: {sorted(REGISTRY)} or 'module:Class'")
    try:
        return load_class(target, Policy)
    except LookupError as exc:
        raise PolicyError(f"name: {exc}") from None


def make_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    cls = resolve(name)
    try:
        return cls(**(params or {}))
    except TypeError as exc:
        raise PolicyError(f"params: {exc}") from exc


__all__ = [
    "DraftStep", "EdgeOutcome", "PlanContext", "Policy", "PolicyError", "StepFeedback", "StepPlan",
    "StopRule", "draft_step", "longest_path", "make_policy", "parse_policy_spec", "resolve", "REGISTRY",
]


def parse_policy_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:key=value,...]`` -> (name, params). NAME may itself be ``module:Class``.

    Values are YAML scalars or flow collections: ``fixed:lookahead=3``,
    ``fixed:lookahead={tiny: 2, small: 4}``, ``mypkg.pol:MyPolicy:threshold=0.3``.
    """
    import yaml

    import re

    name, params_text = text, ""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "[{"
        depth -= ch in "]}"
        # the parameters start at the first top-level ':' followed by 'key='
        if ch == ":" and depth == 0 and re.match(r"\s*[A-Za-z_][\w-]*\s*=", text[i + 1:]):
            name, params_text = text[:i], text[i + 1:]
            break
    params: dict[str, Any] = {}
    for item in _split_top_level(params_text):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PolicyError(f"params: expected key=value, got {item!r} in {text!r}")
        try:
            params[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise PolicyError(f"params: cannot parse {key.strip()}={value!r}: {exc}") from None
    if not name:
        raise PolicyError(f"name: empty policy name in {text!r}")
    return name, params


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and braces."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        items.append(text[start:])
    return [s for s in items if s.strip()]
