"""Requests that name their own policy (the ``policy`` extension field): one policy per spec,
shared by the requests that name it, so they batch together and it learns from all of them.

Driven through the real :class:`~cascade.serve.server.Server` (its engine thread, its batch) in
this process, over table workers; the HTTP field itself is tested in test_playground.py."""
from __future__ import annotations

import asyncio

import pytest

from cascade import Cascade
from cascade.serve.server import SPEC_POLICIES, Server
from draws import SCALE, VOCAB, table_topology
from table_worker import bigram_table

NEW = 12


@pytest.fixture()
def server(tmp_path):
    srv = Server(Cascade.from_topology(table_topology(tmp_path, 3)), max_num_seqs=8).start()
    yield srv
    srv.close()


def _run(server: Server, specs: list[str | None]) -> list:
    """Submit one greedy request per spec at once; wait for all; return the jobs."""
    async def go():
        jobs = [await server.submit([i % VOCAB], NEW, temperature=0.0, policy=spec) for i, spec in enumerate(specs)]
        for job in jobs:
            async for _ in job.updates():
                pass
        return jobs
    return asyncio.run(go())


def _greedy(prompt: list[int]) -> list[int]:
    """Plain greedy decoding of the depth-3 topology's authority (its bigram table), by hand."""
    table, out = bigram_table(VOCAB, 12, SCALE), list(prompt)
    for _ in range(NEW):
        out.append(int(table[out[-1]].argmax()))
    return out[len(prompt):]


def test_requests_naming_the_same_spec_share_one_policy(server):
    auto = "auto:explore=0.3,max_lookahead=3"
    jobs = _run(server, [auto, "auto:max_lookahead=3, explore=0.30", "fixed:lookahead=2", None, auto])
    policies = [job.state.policy for job in jobs]
    assert policies[0] is policies[1] is policies[4]  # the same name and parameters, however written
    assert policies[2] is not policies[0] and policies[2].name == "fixed"
    assert policies[3] is None  # the served policy's group
    # it learned from all three requests, and goes on learning from the next one that names it
    steps = policies[0].inner.steps
    assert steps >= 3 * 2  # each request took at least two steps (12 tokens, lookahead <= 3)
    later = _run(server, [auto])[0]
    assert later.state.policy is policies[0] and policies[0].inner.steps > steps
    # and no policy changed a token: greedy output is the authority's own
    for job in jobs + [later]:
        assert job.state.generated == _greedy(job.state.request.prompt_ids)


def test_the_server_keeps_a_bounded_number_of_spec_policies(server):
    specs = [f"fixed:lookahead={k}" for k in range(1, SPEC_POLICIES + 3)]
    first = _run(server, specs[:1])[0].state.policy
    for spec in specs[1:]:
        _run(server, [spec])
    assert len(server._spec_policies) == SPEC_POLICIES
    assert _run(server, specs[:1])[0].state.policy is not first  # the oldest was let go, then rebuilt
