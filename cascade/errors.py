"""Exception types raised by cascade. Each message names the file, field or parameter at fault."""
from __future__ import annotations


class CascadeError(Exception):
    """Base class of every error cascade raises on purpose."""


class TopologyError(CascadeError, ValueError):
    """A topology file (or spec) is missing, malformed or inconsistent.

    The message starts with the file (when there is one) and names the field, e.g.
    ``topologies/bad.yaml: levels[1].model: path does not exist: /x/y``.
    """


class RequestError(CascadeError, ValueError):
    """A generation request is invalid; the message names the parameter."""


class ClusterError(CascadeError, ConnectionError):
    """The Ray cluster cannot be reached (the message names the address, where it came from:
    argument, variable or file, and what to do), or did not start what was asked of it."""


class ClosedError(CascadeError, RuntimeError):
    """A :class:`cascade.Cascade` was used after ``close()``."""


class WorkerError(CascadeError, RuntimeError):
    """A worker failed. ``level`` names it (when known); ``partial`` carries what was committed
    before the failure: the engine sets the token ids, :class:`cascade.Cascade` replaces them
    with a :class:`cascade.api.Generation` (``finish_reason="error"``, ``.text``)."""

    def __init__(self, message: str, partial=None, level: str | None = None):
        super().__init__(message)
        self.partial = partial
        self.level = level
