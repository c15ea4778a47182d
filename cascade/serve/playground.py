"""The playground: ``GET /`` serves one self-contained page (``static/playground.html``: plain
HTML, CSS and JavaScript, no build step, nothing fetched from elsewhere) that streams a
completion with ``return_provenance`` and colours each token by the level whose draft it came
from (a tree's block is noted with its candidates and the sibling rank of each accepted token,
and a token accepted from a later sibling is marked); ``GET /playground/topology`` tells it the
levels, their order and the authority.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

import networkx as nx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from cascade.serve.protocol import ApiError


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground/topology", topology, methods=["GET"])


@lru_cache(maxsize=1)
def _page() -> str:
    return resources.files("cascade.serve").joinpath("static/playground.html").read_text(encoding="utf-8")


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(_page())


async def topology(request: Request) -> dict[str, Any]:
    """The served topology as the page needs it: levels bottom up (the authority last)."""
    server = request.app.state.server
    if server is None:
        raise ApiError(503, "the server is starting: no engine installed yet", type="service_unavailable")
    topo = server.cascade.topology
    graph = topo.graph
    order = {lv.name: i for i, lv in enumerate(topo.spec.levels)}
    levels = list(nx.lexicographical_topological_sort(graph, key=lambda n: f"{order.get(n, 0):06d}{n}"))
    sampling = topo.spec.sampling
    return {
        "model": server.model_name,
        "levels": levels,
        "authority": topo.authority,
        "edges": [f"{a}->{b}" for a, b in graph.edges],
        "policy": getattr(server.batch.policy, "name", None),
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k},
        "context_length": server.cascade.engine.context_length,
    }
