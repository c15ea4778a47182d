"""The FastAPI app: OpenAI-compatible routes over a :class:`~cascade.serve.server.Server`.

``build_app(server)`` returns the app; every route finds its server at
``request.app.state.server``, so a host that builds the server later (a Ray Serve ingress
replica) installs it there: ``app.state.server = Server(...)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200, or 503 when the engine loop is not running or the authority is down) and
``GET /metrics`` (Prometheus text); ``GET /`` is the playground page
(:mod:`cascade.serve.playground`). Streaming answers are server-sent events, one
``data: {json}`` chunk per engine step that committed text, then ``data: [DONE]``. Every
error is ``{"error": {"message", "type", "param", "code"}}``; see :mod:`cascade.serve.protocol`
for what is refused. A body over ``max_body_bytes`` is refused with 413 before it is read whole
(by its Content-Length, or as a chunked body streams in).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from cascade.errors import RequestError, quote
from cascade.serve import playground
from cascade.serve import protocol as proto
from cascade.serve.provenance import TokenPieces, step_dicts
from cascade.serve.server import Job, Overloaded, Server, Unavailable

# how often a non-streaming handler checks whether its client is still there
_DISCONNECT_POLL_S = 0.5


def build_app(server: Server | None = None, *, max_body_bytes: int = proto.MAX_BODY_BYTES) -> FastAPI:
    """The app; ``server`` is installed as ``app.state.server`` (or install it later).
    ``max_body_bytes``: larger request bodies are refused with 413."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise RequestError(f"max_body_bytes: must be an integer >= 1 (got {max_body_bytes!r})")
    app = FastAPI(title="cascade", description="OpenAI-compatible server over an exact speculative cascade")
    app.state.server = server
    app.state.max_body_bytes = max_body_bytes
    app.add_exception_handler(proto.ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    playground.add_routes(app)
    return app


# -- routes -------------------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    server = _server(request)
    req = await _parse(request, proto.CompletionRequest, server)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    job = await _submit(server, req, req.prompt, max_tokens, "max_tokens", "prompt")
    return await _respond(request, server, req, job, chat=False)


async def chat_completions(request: Request) -> Response:
    server = _server(request)
    req = await _parse(request, proto.ChatRequest, server)
    try:
        prompt = server.chat_prompt([m.as_template_input() for m in req.messages])
    except RequestError as exc:
        raise proto.request_error(exc, "messages") from None
    max_tokens, field = req.limit
    if max_tokens is None:  # up to the authority's context (the batch stops there)
        max_tokens = server.cascade.engine.context_length or 1024
    job = await _submit(server, req, prompt, max_tokens, field, "messages")
    return await _respond(request, server, req, job, chat=True)


async def models(request: Request) -> dict[str, Any]:
    server = _server(request)
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                        "owned_by": "cascade", "root": server.model_name}]}


async def health(request: Request) -> Response:
    server = request.app.state.server
    if server is None:
        return JSONResponse({"status": "no server installed"}, status_code=503)
    ok, info = server.health()
    return JSONResponse(info, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    server = _server(request)
    server.cached_sequences()  # refresh the gauge
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# -- request handling ---------------------------------------------------------------------------


def _server(request: Request) -> Server:
    server = request.app.state.server
    if server is None:
        raise proto.ApiError(503, "the server is starting: no engine installed yet", type="service_unavailable")
    return server


async def _parse(request: Request, model: type, server: Server):
    body = proto.parse_body(await _read_body(request))
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise proto.validation_error(exc) from None
    if req.model is not None and req.model != server.model_name:
        raise proto.ApiError(404, f"model: the model {quote(req.model)} does not exist; this server serves "
                                  f"{server.model_name!r}", "model", type="not_found_error")
    return req


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 above the app's limit: by its Content-Length before any of it
    is read, and (a chunked body declares none) as soon as what came exceeds the limit."""
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> proto.ApiError:
    return proto.ApiError(413, f"request body: {size} is over this server's limit of {limit} bytes "
                               "(cascade serve --max-body-bytes)")


async def _submit(server: Server, req, prompt, max_tokens: int, limit_field: str, prompt_field: str) -> Job:
    try:
        return await server.submit(prompt, max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                             seed=req.seed, stop=req.stop, provenance=req.return_provenance,
                             policy=req.policy)
    except RequestError as exc:
        # raised straight from the call: an error bound to a name here would hold this frame,
        # and with it the refused prompt, in a reference cycle until the collector ran
        raise _refused(exc, limit_field, prompt_field) from None
    except Overloaded as exc:
        raise proto.ApiError(429, f"server overloaded: {exc}; retry later", type="rate_limit_error",
                             extra={"retry_after": exc.retry_after}) from None
    except Unavailable as exc:
        raise proto.ApiError(503, f"server unavailable: {exc}", type="service_unavailable") from None


def _refused(exc: RequestError, limit_field: str, prompt_field: str) -> proto.ApiError:
    err = proto.request_error(exc, prompt_field)
    if err.param == "max_tokens" and limit_field != "max_tokens":
        err = proto.ApiError(400, limit_field + err.message[len("max_tokens"):], limit_field)
    return err


async def _respond(request: Request, server: Server, req, job: Job, chat: bool) -> Response:
    rid = proto.new_id(chat)
    if req.stream:
        return _CancellingStream(_sse(server, req, job, rid, chat), lambda: server.cancel(job))
    try:
        final = await _last_update(request, server, job)
    except asyncio.CancelledError:
        server.cancel(job)
        raise
    gen = final.generation
    if final.error is not None:
        raise proto.ApiError(500, f"generation failed: {final.error}", type="worker_error", extra={
            "partial": {"text": gen.text, "token_ids": gen.token_ids,
                        "usage": proto.usage(job.prompt_tokens, len(gen.token_ids))}})
    body = proto.envelope(rid, server.model_name, chat, False,
                          [proto.choice(chat, False, gen.text, proto.finish_reason(gen.finish_reason))])
    body["usage"] = proto.usage(job.prompt_tokens, len(gen.token_ids))
    if req.return_stats:
        body["cascade_stats"] = gen.stats.to_dict()
    if req.return_provenance:
        body["cascade_provenance"] = step_dicts(gen.provenance or [], TokenPieces(server.cascade, job.stops), final=True)
    return JSONResponse(body)


async def _last_update(request: Request, server: Server, job: Job):
    """Wait for the request to finish; cancel it if the client goes away meanwhile."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + _DISCONNECT_POLL_S
    while True:
        try:  # (a cancelled Queue.get loses nothing; a cancelled async generator would end)
            update = await asyncio.wait_for(job.queue.get(), _DISCONNECT_POLL_S)
            if update.finish_reason is not None:
                return update
        except asyncio.TimeoutError:
            pass
        if loop.time() >= check_at:  # updates come every step: look at the clock, not for a lull
            check_at = loop.time() + _DISCONNECT_POLL_S
            if await request.is_disconnected():
                server.cancel(job)
                raise proto.ApiError(499, "client disconnected")


async def _sse(server: Server, req, job: Job, rid: str, chat: bool) -> AsyncIterator[str]:
    """The stream: a chunk per step that committed text (held back, as ``Cascade.stream``
    does, while it may still become a stop string or is an incomplete UTF-8 character: the
    engine thread decodes it, :attr:`Update.text`)."""
    model = server.model_name
    pieces = TokenPieces(server.cascade, job.stops) if req.return_provenance else None
    if chat:  # OpenAI's first chat chunk announces the role
        yield _event(proto.envelope(rid, model, chat, True, [proto.choice(chat, True, "", None, first=True)]))
    async for update in job.updates():
        # with provenance, every step gets a chunk (its text may be held back: then empty)
        steps = None if pieces is None else step_dicts(update.steps, pieces, final=update.finish_reason is not None)
        if update.error is not None:
            if update.text or steps:
                yield _event(_provenance(steps, proto.envelope(rid, model, chat, True,
                                                               [proto.choice(chat, True, update.text, None)])))
            yield _event(proto.ApiError(500, f"generation failed: {update.error}", type="worker_error").body())
            break
        if update.finish_reason is not None:
            yield _event(_provenance(steps, _last_chunk(req, rid, model, chat, update.text, update)))
        elif update.text or steps:
            yield _event(_provenance(steps, proto.envelope(rid, model, chat, True,
                                                           [proto.choice(chat, True, update.text, None)])))
    else:
        if req.include_usage:
            tokens = len(update.generation.token_ids)
            chunk = proto.envelope(rid, model, chat, True, [])
            chunk["usage"] = proto.usage(job.prompt_tokens, tokens)
            yield _event(chunk)
    yield "data: [DONE]\n\n"


def _last_chunk(req, rid: str, model: str, chat: bool, text: str, update) -> dict[str, Any]:
    reason = proto.finish_reason(update.finish_reason)
    chunk = proto.envelope(rid, model, chat, True, [proto.choice(chat, True, text if text or not chat else None,
                                                                 reason)])
    if req.return_stats:
        chunk["cascade_stats"] = update.generation.stats.to_dict()
    return chunk


def _provenance(steps: list[dict[str, Any]] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    if steps is not None:
        chunk["cascade_provenance"] = steps
    return chunk


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


class _CancellingStream(StreamingResponse):
    """A streamed answer that cancels its request however the stream ends (a client that
    disconnects makes Starlette cancel the body; ``on_close`` then frees the request's place
    and caches at the next engine step). Cancelling a finished request does nothing."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# -- errors -------------------------------------------------------------------------------------


async def _api_error(request: Request, exc: proto.ApiError) -> JSONResponse:
    headers = {"Retry-After": str(exc.extra["retry_after"])} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: still the OpenAI error shape (the engine loop is not affected)."""
    message = f"internal error: {type(exc).__name__}: {exc}"
    return JSONResponse(proto.ApiError(500, message, type="internal_error").body(), status_code=500)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in the OpenAI error shape."""
    status = getattr(exc, "status_code", 400)
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    detail = getattr(exc, "detail", None) or str(exc)
    return JSONResponse(proto.ApiError(status, f"{request.method} {request.url.path}: {detail}", type=kind).body(),
                        status_code=status)
