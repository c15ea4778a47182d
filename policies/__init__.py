"""Policies: decisions only (path, lookahead, early stop), never acceptance.

Name a policy in a topology (``policy: {name: fixed, params: {lookahead: 4}}``), per
``generate`` call or on the command line, by a registered name or a ``"module:Class"`` path.
:func:`from_spec` is the one parser for all of them: a spec string
(``"fixed:lookahead={tiny: 3}"``), a mapping ``{"name": ..., "params": {...}}``, or a
:class:`Policy` (passed through). Parameters are validated by each policy's ``Params`` model.
"""
from __future__ import annotations

from collections.abc import Mapping
import re
from typing import Any

import yaml

from cascade.errors import quote
from policies.base import (
    DraftStep, EdgeOutcome, PlanContext, Policy, PolicyError, StepFeedback, StepPlan, StopRule,
    draft_step, longest_path,
)
from policies.params import PolicyParams

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


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """The policy ``name`` (registered, or ``"module:Class"``) built from ``params``."""
    cls = resolve(name)
    if cls.Params is not None:
        return cls(cls.check_params(params))
    if params is not None and not isinstance(params, Mapping):
        raise PolicyError(f"params: expected a mapping of parameters (policy {name!r}), got {params!r}")
    try:  # a plug-in policy that takes its parameters in its own __init__
        return cls(**(params or {}))
    except TypeError as exc:
        raise PolicyError(f"params: {exc} (policy {name!r})") from exc


def from_spec(spec: "str | Mapping[str, Any] | Policy") -> Policy:
    """A policy from a spec string (``"auto"``, ``"fixed:lookahead={tiny: 3}"``: see
    :func:`parse_policy_spec`), a mapping ``{"name": ..., "params": {...}}`` (as in a topology
    file; ``name`` defaults to ``fixed``), or a :class:`Policy`, returned as it is. Raises one
    :class:`PolicyError` naming the field (``name``, ``params.<field>``) and the policy."""
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, str):
        return make_policy(*parse_policy_spec(spec))
    if isinstance(spec, Mapping):
        unknown = sorted(str(k) for k in spec if k not in ("name", "params"))
        if unknown:
            raise PolicyError(f"{unknown[0]}: unknown field (a policy mapping has 'name' and 'params')")
        name = spec.get("name", "fixed")
        if not isinstance(name, str) or not name.strip():
            raise PolicyError(f"name: expected a policy name, got {name!r}")
        return make_policy(name.strip(), spec.get("params"))
    raise PolicyError(f"name: expected a spec string, a mapping {{name, params}} or a Policy, got {spec!r}")


__all__ = [
    "DraftStep", "EdgeOutcome", "PlanContext", "Policy", "PolicyError", "PolicyParams", "StepFeedback",
    "StepPlan", "StopRule", "draft_step", "from_spec", "longest_path", "make_policy", "parse_policy_spec",
    "resolve", "REGISTRY",
]


def parse_policy_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:key=value,...]`` -> (name, params). NAME may itself be ``module:Class``.

    Values are YAML scalars or flow collections: ``fixed:lookahead=3``,
    ``fixed:lookahead={tiny: 2, small: 4}``, ``mypkg.pol:MyPolicy:threshold=0.3``. YAML aliases
    are refused (a few characters of them can expand to gigabytes).
    """
    name, params_text = text, ""
    for i, ch in _top_level(text):  # the parameters start at the first top-level ':' followed by 'key='
        if ch == ":" and re.match(r"\s*[A-Za-z_][\w-]*\s*=", text[i + 1:]):
            name, params_text = text[:i], text[i + 1:]
            break
    params: dict[str, Any] = {}
    for item in _split_top_level(params_text):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PolicyError(f"params: expected key=value, got {quote(item)} in {quote(text)}")
        if key.strip() in params:
            raise PolicyError(f"params.{key.strip()}: given twice in {quote(text)}")
        try:
            params[key.strip()] = yaml.load(value, Loader=_NoAliasLoader)  # a SafeLoader without aliases
        except yaml.YAMLError as exc:
            raise PolicyError(f"params.{key.strip()}: cannot parse {quote(value)}: {exc}") from None
        except RecursionError:  # yaml composes recursively: a few KB of brackets overflow it
            raise PolicyError(f"params.{key.strip()}: cannot parse the value: nested too deeply") from None
    name = name.strip()
    if not name:
        raise PolicyError(f"name: empty policy name in {quote(text)}")
    return name, params


class _NoAliasLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing aliases."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases are not allowed", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _top_level(text: str):
    """(index, character) of each character outside brackets and braces."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if depth == 0:
            yield i, ch


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and braces."""
    items, start = [], 0
    for i, ch in _top_level(text):
        if ch == ",":
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s for s in items if s.strip()]
