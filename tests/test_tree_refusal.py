"""A tree named for a level that does not start the path would do nothing: it is refused, naming
the level, the same at every door (FixedPolicy.bind, before any model loads): the API, a topology
file (``cascade validate``), the CLI's ``--policy`` and a served request's ``policy`` field."""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from cascade import Cascade
from cascade.cli import main
from cascade.errors import RequestError
from draws import table_topology
from policies.fixed import FixedPolicy

SPEC = "fixed:path=[small, medium, large],tree={medium: [2, 2]}"
SAYS = ("params.tree: level 'medium' does not start the path small -> medium -> large: only the path's first "
        "level ('small') drafts a tree (policy 'fixed')")


def test_the_api_refuses_it_and_serves_a_tree_at_the_start(tmp_path):
    with Cascade.from_topology(table_topology(tmp_path, 3)) as c:
        for policy in (SPEC, FixedPolicy(path=["small", "medium", "large"], tree={"medium": [2, 2]})):
            with pytest.raises(RequestError) as info:
                c.generate([0], max_new_tokens=2, policy=policy)
            assert str(info.value) == "policy: " + SAYS
        with pytest.raises(RequestError, match="level 'medium' does not start the path small -> medium -> large"):
            c.generate([0], max_new_tokens=2, policy="fixed:tree={medium: [2]}")  # the default path's
        g = c.generate([0], max_new_tokens=6, policy="fixed:path=[medium, large],tree={medium: [2, 2]}")
        assert g.stats.edges["medium->large"].tree_nodes > 0


def test_the_cli_refuses_it_in_a_file_and_as_an_option(tmp_path, capsys):
    bad = table_topology(tmp_path, 3, policy={"name": "fixed", "params": {"path": ["small", "medium", "large"],
                                                                       "tree": {"medium": [2, 2]}}})
    assert main(["validate", bad]) == 1
    assert capsys.readouterr().err == f"error: {bad}: policy.{SAYS}\n"
    assert main(["generate", "-t", table_topology(tmp_path, 3), "--policy", SPEC, "x"]) == 1
    assert capsys.readouterr().err == f"error: policy: {SAYS}\n"


def test_the_server_refuses_it_with_a_400_naming_the_field(tmp_path):
    import uvicorn

    from cascade.serve.app import build_app
    from cascade.serve.server import Server

    server = Server(Cascade.from_topology(table_topology(tmp_path, 3))).start()
    web = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not web.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        conn = http.client.HTTPConnection("127.0.0.1", web.servers[0].sockets[0].getsockname()[1], timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [0], "max_tokens": 2, "policy": SPEC}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        error = json.loads(reply.read())["error"]
        assert reply.status == 400 and error["param"] == "policy" and error["message"] == "policy: " + SAYS, error
    finally:
        web.should_exit = True
        thread.join(timeout=30)
        server.close()
