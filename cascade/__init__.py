"""cascade: exact hierarchical speculative decoding.

The public names are imported lazily, so that ``workers`` and ``policies`` can use
``cascade.verify`` and ``cascade.sampling`` without importing the whole engine.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Cascade": "cascade.api",
    "Generation": "cascade.api",
    "CascadeError": "cascade.errors",
    "ClosedError": "cascade.errors",
    "ClusterError": "cascade.errors",
    "RequestError": "cascade.errors",
    "TopologyError": "cascade.errors",
    "WorkerError": "cascade.errors",
    "Topology": "cascade.topology",
    "load_topology": "cascade.topology",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cascade' has no attribute {name!r}")
