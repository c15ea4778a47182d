"""Serving: cascade behind an OpenAI-compatible HTTP API (``cascade serve``).

- :mod:`cascade.serve.server` — :class:`~cascade.serve.server.Server`: owns one
  :class:`~cascade.api.Cascade` and the engine thread that steps its continuous batch;
  ``submit`` / ``cancel`` from the event loop, tokens back through per-request asyncio queues.
- :mod:`cascade.serve.app` — ``build_app(server) -> FastAPI``: the routes; they find the
  server at ``request.app.state.server`` (a Ray Serve ingress installs its own there).
- :mod:`cascade.serve.protocol` — OpenAI request models (unknown fields refused) and the error
  body ``{"error": {"message", "type", "param", "code"}}``.
- :mod:`cascade.serve.metrics` — Prometheus metrics under vLLM's names, ``cascade:`` prefix.
- :mod:`cascade.serve.cli` — the ``serve`` subcommand.
- :mod:`cascade.serve.playground` — ``GET /``: the playground page (``static/playground.html``),
  tokens coloured by the level they came from; :mod:`cascade.serve.provenance` — the
  ``return_provenance`` extension's JSON (each token's level and share of the text).

Nothing is imported here, so that ``cascade --help`` stays cheap.
"""
