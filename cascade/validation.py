"""Request validation at the API boundary: one pydantic model for the generation parameters and
one function for prompts. Everything :class:`cascade.Cascade` (and so the HTTP server, which
calls ``Cascade.request`` / ``Cascade.generate``) accepts passes through here first, and every
bad value becomes one :class:`~cascade.errors.RequestError` of the form
``"param: what is wrong (got X)"``.

Integers: Python ints and integer-like scalars (``numpy.int64``, a one-element integer tensor:
anything with ``__index__``) count; ``bool``, floats and strings do not. Floats: real numbers,
finite only (``inf`` and ``nan`` are refused everywhere).
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Annotated, Any, Sequence

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, field_validator

from cascade.errors import RequestError, describe
from cascade.sampling import SamplingParams

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"  # a level's device, and the device= / --device overrides


def as_int(value: Any) -> int:
    """``value`` as a Python int if it is integer-like (not a bool), else ValueError."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError("must be an integer, not a bool")
    if isinstance(value, (str, bytes, float)):
        raise ValueError("must be an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError("must be an integer") from None


def as_finite_float(value: Any) -> float:
    """``value`` as a finite Python float if it is a real number (not a bool), else ValueError."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError("must be a number, not a bool")
    if not isinstance(value, numbers.Real):
        try:  # a one-element tensor or array
            value = value.item() if getattr(value, "ndim", None) == 0 else value
        except Exception:  # noqa: BLE001
            pass
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError("must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _int_field(value: Any) -> Any:
    return None if value is None else as_int(value)


def _float_field(value: Any) -> Any:
    return None if value is None else as_finite_float(value)


def _stop_field(value: Any) -> Any:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    return tuple(stops)


Int = Annotated[int, BeforeValidator(_int_field)]
Stops = Annotated[tuple[str, ...] | None, BeforeValidator(_stop_field)]


class GenerationParams(SamplingParams):
    """The parameters of one generation request: the sampling parameters, declared in
    :class:`cascade.sampling.SamplingParams` (unset ones follow the topology's ``sampling``), and
    the rest. Integer-like and real scalars count as ints and floats (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_new_tokens: Int = Field(128, ge=1, description="Most tokens to generate.")
    stop: Stops = Field(None, description="Stop strings.")
    batch_size: Int = Field(1, ge=1, description="Prompts in flight at once (generate only).")
    provenance: StrictBool = Field(False, description="Record each step's path, blocks and token origins.")

    _ints = field_validator("top_k", "seed", mode="before")(_int_field)
    _floats = field_validator("temperature", "top_p", mode="before")(_float_field)


def generation_params(**kwargs: Any) -> GenerationParams:
    """:class:`GenerationParams` from keyword arguments, or one RequestError naming the first
    bad parameter."""
    try:
        return GenerationParams(**kwargs)
    except ValidationError as exc:
        raise RequestError(describe(exc, must=True, unknown="unknown parameter")) from None


# -- prompts ----------------------------------------------------------------------------------------

def normalize_prompts(prompts: Any, name: str = "prompts") -> tuple[bool, list[str | list[int]]]:
    """``(single, prompts)``: a prompt is a non-empty string or a non-empty sequence of token
    ids (Python or numpy ints; a 1-D integer array or tensor); ``prompts`` is one prompt or a
    non-empty list/tuple of them. Anything else is a RequestError naming ``prompt`` or
    ``prompts[i]``."""
    if _is_token_ids(prompts) or isinstance(prompts, str):
        return True, [normalize_prompt(prompts, name)]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise RequestError(f"{name}: empty list (got [])")
        return False, [normalize_prompt(p, f"{name}[{i}]") for i, p in enumerate(prompts)]
    raise RequestError(f"{name}: {_what_a_prompt_is()} (got {_short(prompts)})")


def normalize_prompt(prompt: Any, where: str = "prompt") -> str | list[int]:
    """One prompt: a non-empty string, or its token ids as a list of Python ints."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{where}: empty prompt (got '')")
        return prompt
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # numpy array or torch tensor
        if prompt.ndim != 1:
            raise RequestError(f"{where}: token ids must be 1-D (got an array of shape {tuple(prompt.shape)})")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise RequestError(f"{where}: {_what_a_prompt_is()} (got {_short(prompt)})")
    if not prompt:
        raise RequestError(f"{where}: empty prompt (need at least one token) (got {_short(prompt)})")
    ids = []
    for j, token in enumerate(prompt):
        try:
            ids.append(as_int(token))
        except ValueError:
            raise RequestError(f"{where}[{j}]: token ids must be integers (got {_short(token)})") from None
    return ids


def check_token_ids(ids: Sequence[int], vocab_size: int | None, where: str = "prompt") -> None:
    """Every id is a row of the authority's vocabulary: ``0 <= id < vocab_size``."""
    if vocab_size is None:
        return
    for j, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise RequestError(f"{where}[{j}]: token id out of the vocabulary [0, {vocab_size}) (got {token})")


def _is_token_ids(value: Any) -> bool:
    """Whether ``value`` is one prompt given as token ids (not a list of prompts)."""
    if hasattr(value, "ndim") and hasattr(value, "tolist"):
        return True
    if isinstance(value, (list, tuple)) and value:
        first = value[0]  # a number (or a 0-d array): token ids; anything else: a list of prompts
        return isinstance(first, numbers.Number) or getattr(first, "ndim", None) == 0
    return False


def _what_a_prompt_is() -> str:
    return "must be a non-empty string or a list of token ids (ints), or a list of those"


def _short(value: Any) -> str:
    text = repr(value)
    kind = type(value).__name__
    return f"{kind} {text[:60] + '...' if len(text) > 60 else text}"
