"""Plug-in points named by ``"module:attr"`` paths (custom workers, custom policies)."""
from __future__ import annotations

import importlib


def load_class(path: str, base: type) -> type:
    """The class at ``"module:Class"``, checked to subclass ``base``.

    Raises ``LookupError`` with the reason (not importable, no such attribute, wrong type), for
    callers to re-raise as their own error type naming the field.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise LookupError(f"{path!r} is not a 'module:Class' path")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"cannot import {path!r}: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise LookupError(f"{path!r} is not a {base.__name__} subclass")
    return obj
