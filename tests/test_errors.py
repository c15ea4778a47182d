"""The one formatter of pydantic errors (cascade.errors.describe): each boundary's wording from the
same first error, so a message reads the same wherever a value is refused."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cascade.errors import QUOTE_CHARS, describe, error_path, quote


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = Field(1, ge=1)


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    items: list[Inner] = []
    prompt: str | list[int] = "x"


def error(**data) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(data)
    return info.value


def test_the_path_dotted_or_bracketed_under_a_root():
    exc = error(items=[{}, {"size": 0}])
    assert error_path(exc) == "items.1.size"
    assert error_path(exc, root="levels[0].params", brackets=True) == "levels[0].params.items[1].size"


def test_the_value_the_context_and_the_count():
    exc = error(items=[{"size": 0}, {"size": -1}])
    assert describe(exc) == "items.0.size: Input should be greater than or equal to 1 (got 0)"
    assert describe(exc, must=True) == "items.0.size: must be greater than or equal to 1 (got 0)"
    assert describe(exc, got=False, more=True) == (
        "items.0.size: Input should be greater than or equal to 1 (and 1 more error)")
    assert describe(exc, context="policy 'x'", more=True) == (
        "items.0.size: Input should be greater than or equal to 1 (policy 'x', got 0; and 1 more error)")


def test_unknown_fields():
    exc = error(items=[{"sise": 2}])
    assert describe(exc) == "items.0.sise: unknown field (got 2)"
    assert describe(exc, unknown="unknown field {name}", got=False) == "items.0.sise: unknown field 'sise'"
    assert describe(exc, context="policy 'x'", bare=True) == "items.0.sise: unknown field"


def test_a_union_names_the_types_it_takes():
    exc = error(prompt=[1, "a"])
    assert describe(exc, unions=True) == "prompt: expected str or list[int] (got [1, 'a'])"
    assert error_path(exc, unions=True) == "prompt"
    assert error_path(exc) == "prompt.str"  # without unions, pydantic's own path


def test_a_huge_value_is_quoted_by_a_short_prefix():
    # a refused megabyte is not echoed back (issue 56): its first QUOTE_CHARS characters, then "…"
    assert quote("x" * 10) == "'xxxxxxxxxx'"  # a short value whole
    for value in ("x" * 3_000_000, list(range(1_000_000)), {str(i): 1.0 for i in range(300_000)}):
        text = quote(value)
        assert len(text) == QUOTE_CHARS + 1 and text.endswith("…") and repr(value).startswith(text[:-1])
    message = describe(error(items="i" * 3_000_000))
    assert message.startswith("items: Input should be a valid list (got 'iii") and len(message) < 200, message[:300]
    message = describe(error(**{"k" * 1_000_000: 1}), unknown="unknown field {name}")
    assert "unknown field '" + "k" * (QUOTE_CHARS - 1) + "… (got 1)" in message  # the name it quotes, cut
