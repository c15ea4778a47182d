"""OpenAI request and response shapes, and the error body every failure is sent as.

Requests are validated here for shape (types, known fields, ``n``) and for the sampling
parameters' ranges, declared once in :mod:`cascade.sampling`; the prompt's meaning (its tokens,
the context length) is checked by cascade itself (``Cascade.request`` raises
:class:`cascade.errors.RequestError`), and both end up as the same OpenAI-style error:
``{"error": {"message", "type", "param", "code"}}``.

Unknown fields are refused (400, naming the field), as OpenAI's own API does: a typo such as
``max_token`` would otherwise silently fall back to a default. OpenAI fields cascade does not
implement (``logprobs``, ``echo``, ``presence_penalty``, ...) are accepted at their neutral
value and refused otherwise.

Before any of that, :func:`parse_body` refuses a body that is not a JSON object, that nests
deeper than :data:`MAX_DEPTH` (100k levels would otherwise exhaust the parser's recursion), or
whose text is not valid Unicode (a lone surrogate such as ``"\\ud800"`` that no tokenizer can
encode), each as a 400 naming the field. The body's size is bounded before it is read
(:data:`MAX_BODY_BYTES`, 413: :mod:`cascade.serve.app`).

An error quotes at most the first :data:`~cascade.errors.QUOTE_CHARS` characters of a value it
refuses (:func:`cascade.errors.quote`, where every pydantic error is worded), and no message is
longer than :data:`MAX_MESSAGE_CHARS`: a refused megabyte is not sent back.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cascade.errors import QUOTE_CHARS, describe, error_path
from cascade.sampling import Seed, Temperature, TopK, TopP

# cascade's parameter names -> the request fields they come from
PARAM_NAMES = {"max_new_tokens": "max_tokens"}
#: the largest request body read by default (``cascade serve --max-body-bytes``): far more text
#: than any served context holds, small enough that a body is never a memory or time hazard
MAX_BODY_BYTES = 4 * 1024 * 1024
#: how deeply a request body may nest (OpenAI's shapes need 4: messages[i].content[j].text)
MAX_DEPTH = 32
#: the longest error message sent: values are quoted short where errors are worded
#: (:func:`cascade.errors.quote`); this bounds what any other message could echo back
MAX_MESSAGE_CHARS = 1000
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's \uXXXX escapes can write them; UTF-8 cannot


class ApiError(Exception):
    """An error to send as an OpenAI-style body with ``status``; ``param`` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 extra: dict[str, Any] | None = None):
        message = _cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _cut(param, QUOTE_CHARS)  # a field's name can be a client's text
        self.type = type
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status,
                          **self.extra}}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body -> its JSON object; an :class:`ApiError` (400) otherwise, naming the field
    where one is at fault: too deeply nested, or text that is not valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser's recursion allows: find the field it is in
        field = _deep_field(raw)
        where = f"{field}: " if field else "request body: "
        raise ApiError(400, f"{where}nested too deeply (more than {MAX_DEPTH} levels)", field) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body: malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Refuse nesting deeper than MAX_DEPTH and lone surrogates, in values and keys, naming the
    field (walked with a stack, not recursion: the check must not be what overflows)."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if len(path) >= MAX_DEPTH:
            raise ApiError(400, f"{path[0]}: nested too deeply (more than {MAX_DEPTH} levels)", path[0])
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path + (_printable(key),), "a field name")
            if isinstance(item, (str, list, dict)):  # numbers, booleans, null: nothing to check
                stack.append((path + (_printable(str(key)),), item))


def _check_text(text: str, path: tuple[str, ...], what: str = "text") -> None:
    bad = _SURROGATE.search(text)
    if bad is not None:
        param = ".".join(path)
        raise ApiError(400, f"{param}: {what} that is not valid Unicode: a lone surrogate "
                            f"{bad.group()!r} at character {bad.start()} (text must be encodable as UTF-8)",
                       param)


def _printable(key: str) -> str:
    """A field name fit for an error message (a lone surrogate cannot be sent as UTF-8)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _deep_field(raw: bytes) -> str | None:
    """The top-level field whose value the JSON parser could not descend, or None: the
    object's members are decoded one at a time until one overflows."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        decoder, ws = json.JSONDecoder(), json.decoder.WHITESPACE
        i = ws.match(text, 0).end()
        if text[i:i + 1] != "{":
            return None
        i = ws.match(text, i + 1).end()
        while text[i:i + 1] == '"':
            key, i = json.decoder.scanstring(text, i + 1)
            i = ws.match(text, i).end()
            if text[i:i + 1] != ":":
                return None
            try:
                _, i = decoder.raw_decode(text, ws.match(text, i + 1).end())
            except RecursionError:
                return _printable(key)
            i = ws.match(text, i).end()
            if text[i:i + 1] != ",":
                return None
            i = ws.match(text, i + 1).end()
    except ValueError:  # malformed around the members: no field to name
        return None
    return None


def request_error(exc: Exception, prompt_field: str = "prompt") -> ApiError:
    """A :class:`cascade.errors.RequestError` ("param: message") -> a 400 naming the HTTP field."""
    text = str(exc)
    param, sep, _ = text.partition(":")
    param = param.strip() if sep and " " not in param.strip() else None
    if param is not None:
        name = prompt_field if param == "prompt" else PARAM_NAMES.get(param, param)
        if name != param:
            text = name + text[len(param):]
        param = name
    return ApiError(400, text, param)


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error, as a 400 whose ``param`` is the field's dotted path. Where a
    field takes one of several types, the message lists them instead of one member's failure."""
    message = describe(exc, unions=True, must=True, bare=True,
                       unknown="unknown field (this server refuses fields it does not know)")
    return ApiError(400, message, error_path(exc, unions=True) or None)


class _Strict(BaseModel):
    # strict: "5" is not an int, 1.5 is not an int, true is not a number
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def _neutral(*neutral: Any):
    """A validator that accepts only the values meaning "off" for a field cascade does not implement."""
    def check(cls, v):
        if v is not None and (v not in neutral or isinstance(v, bool) != isinstance(neutral[-1], bool)):
            raise ValueError(f"not supported by cascade (only {neutral[-1]!r})")
        return v
    return classmethod(check)


class _Common(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="the served model's id (GET /v1/models); unset: that one")
    # the sampling parameters as cascade.sampling declares them (types, ranges); unset: the topology's
    temperature: Temperature | None = Field(None, description="unset: the topology's default")
    top_p: TopP | None = None
    top_k: TopK | None = Field(None, description="extension (vLLM's): 0 = off")
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's own attribution field
    return_stats: bool = Field(False, description="extension: add cascade's per-request statistics")
    return_provenance: bool = Field(False, description="extension: add each step's path, blocks and the level "
                                                        "each token came from (cascade_provenance)")
    policy: str | None = Field(None, min_length=1, description="extension: a policy spec string for this request "
                                                               "(unset: the server's); requests naming the same "
                                                               "spec share one policy")
    # OpenAI fields cascade does not implement, accepted at their neutral value only
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    _penalties = field_validator("presence_penalty", "frequency_penalty")(_neutral(None, 0.0))
    _logit_bias = field_validator("logit_bias")(_neutral(None, {}))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, description="OpenAI's default: 16")
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    _echo = field_validator("echo")(_neutral(False))
    _logprobs = field_validator("logprobs")(_neutral(None))
    _best_of = field_validator("best_of")(_neutral(None, 1))
    _suffix = field_validator("suffix")(_neutral(None))


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(None, description="a tool message's answer to that call (OpenAI's); "
                                                      "handed to the chat template")

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # text parts are joined; other part types are refused above
            content = "".join(p.text for p in content)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: ``messages`` go through the chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="unset: up to the authority's context")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name; wins over max_tokens")
    logprobs: bool | None = None

    _logprobs = field_validator("logprobs")(_neutral(None, False))

    @property
    def limit(self) -> tuple[int | None, str]:
        """The token limit asked for, and the field it came from (for errors)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# -- responses -------------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str | None:
    """cascade's finish reasons -> OpenAI's: EOS and stop strings are "stop", the token limit
    and the context end are "length"."""
    if reason is None:
        return None
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def envelope(rid: str, model: str, chat: bool, chunk: bool, choices: list[dict]) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}


def choice(chat: bool, chunk: bool, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
    """One choice: the whole answer (``chunk=False``) or one streamed piece of it."""
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    if not chunk:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
