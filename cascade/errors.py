"""Exception types raised by cascade, and :func:`describe`, the one wording of a pydantic error
that every boundary validating with pydantic uses. Each message names the file, field or
parameter at fault."""
from __future__ import annotations

import itertools
from typing import Any

from pydantic import ValidationError

#: the most characters of an offending value an error quotes (a refused value may be megabytes)
QUOTE_CHARS = 100


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


# -- pydantic errors, as every boundary words them ---------------------------------------------------

def describe(exc: ValidationError, *, root: str = "", brackets: bool = False, unions: bool = False,
             must: bool = False, unknown: str = "unknown field", got: bool = True, context: str = "",
             more: bool = False, bare: bool = False) -> str:
    """The first error of ``exc`` as one line, ``where: what (context, got X; and N more errors)``:
    the message of every boundary that validates with pydantic (a request's parameters, a topology
    file, a policy's parameters, an HTTP body, an n-gram level's parameters).

    - ``where``: :func:`error_path` (``root``, ``brackets``, ``unions``); where it is empty (the
      error is about the whole input) the line is ``what`` and its note alone.
    - ``what``: pydantic's message without its "Value error, " prefix; ``must`` also turns "Input
      should be" into "must be". An unknown field's is ``unknown`` (``{name}``: the field's name,
      quoted). With ``unions``, a field that takes one of several types and matched none says so:
      "expected str or list[int]".
    - the note: ``context``, the value given (``got``: never for a missing field, whose "value" is
      the mapping it is missing from; its first :data:`QUOTE_CHARS` characters at most:
      :func:`quote`) and, with ``more``, how many further errors pydantic found.
      ``bare``: a missing or unknown field's message has no note.
    """
    errors = exc.errors()
    err = errors[0]
    cut, types = _union(errors, unions)
    kind, value = err["type"], err.get("input")
    if len(types) > 1:
        what, kind = "expected " + " or ".join(types), "union"
        value = value if len(err["loc"]) == cut + 1 else "..."  # past the type, the input is a part of the value
    elif kind == "extra_forbidden":
        what = unknown.replace("{name}", quote(err["loc"][-1]))
    else:
        what = err["msg"].removeprefix("Value error, ")
        if must and what.startswith("Input should be "):
            what = "must be " + what.removeprefix("Input should be ")
    notes = ""
    if not (bare and kind in ("missing", "extra_forbidden")):
        shown = [context] if context else []
        if got and kind != "missing":
            shown.append(f"got {quote(value)}")
        notes = ", ".join(shown)
        if more and len(errors) > 1:
            n = len(errors) - 1
            notes += ("; " if notes else "") + f"and {n} more error{'s' if n > 1 else ''}"
    where = error_path(exc, root=root, brackets=brackets, unions=unions)
    line = f"{where}: {what}" if where else what
    return f"{line} ({notes})" if notes else line


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, or its first ``limit`` characters and "…" when longer: an error names
    what it refused without echoing a megabyte back. A long string, list or mapping is cut
    before it is repr'd (to its first ``limit + 1`` items): a flat one costs no more than its cut."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > limit:
        value = value[:limit + 1]
    elif isinstance(value, dict) and len(value) > limit:
        value = dict(itertools.islice(value.items(), limit + 1))
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def error_path(exc: ValidationError, *, root: str = "", brackets: bool = False, unions: bool = False) -> str:
    """Where the first error of ``exc`` is, as a field path under ``root``: ``levels.0.model``, or
    with ``brackets`` ``levels[0].model``. With ``unions``, the type pydantic names in the path
    when a field takes one of several types is left out (and the path ends there where more than
    one type failed: what failed inside each is not the field's problem)."""
    errors = exc.errors()
    loc = list(errors[0]["loc"])
    cut, types = _union(errors, unions)
    loc = loc[:cut] if len(types) > 1 else loc[:cut] + loc[cut + 1:]
    parts = [root] if root else []
    for item in loc:
        if brackets and isinstance(item, int):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{item}]"]
        else:
            parts.append(str(item))
    return ".".join(parts)


def _union(errors: list[dict[str, Any]], unions: bool) -> tuple[int, list[str]]:
    """(where the first error's path names a union member's type, the types of the members that
    failed there), or (the path's length, []). Pydantic puts the member's type in the path:
    ``str``, ``list[int]``, ``TextPart`` or a tag; field names are snake_case, indices ints."""
    loc = errors[0]["loc"]
    cut = next((i for i, part in enumerate(loc) if unions and _is_type(part)), len(loc))
    if cut == len(loc):
        return cut, []
    types = [str(e["loc"][cut]) for e in errors if e["loc"][:cut] == loc[:cut] and len(e["loc"]) > cut]
    return cut, list(dict.fromkeys(types))


def _is_type(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or not part.islower()
                                      or not part.replace("_", "").isalnum())
