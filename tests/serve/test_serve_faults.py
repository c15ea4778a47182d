"""``cascade serve`` when things go wrong: the authority failing for one request, overload,
a client leaving mid-stream, a model without a chat template. The authority is a real
transformers worker slowed down and made to fail on a poisoned prompt (serve_workers.py), so
that requests stay in flight long enough to watch, deterministically."""
from __future__ import annotations

import json
import threading

import openai
import pytest

from conftest import write_topology
from hf_util import reference_greedy
from serve_util import serve

POISON = "# poison\n"
CRASH = "# crash\n"


@pytest.fixture(scope="module")
def server(family, tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-faults")
    authority = {"name": "large", "kind": "serve_workers:FlakyHFWorker",
                 "params": {"model": str(family / "large"), "poison": tokenizer.encode(POISON),
                            "crash": tokenizer.encode(CRASH), "delay": 0.01}}
    topo = write_topology(root / "flaky.yaml", {
        "name": "flaky", "tokenizer": str(family / "large"),
        "levels": [{"name": "small", "model": str(family / "small"), "dtype": "float64", "device": "cpu"}, authority],
        "policy": {"name": "fixed", "params": {"lookahead": {"small": 3}}}})
    with serve(topo, "--max-num-seqs", "1", "--max-queued", "1", log_dir=root) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def greedy(family, tokenizer, prompt, n):
    return tokenizer.decode(reference_greedy(str(family / "large"), tokenizer.encode(prompt), n))


def test_a_failing_authority_ends_its_request_with_what_was_committed(server, client, family, tokenizer):
    want = greedy(family, tokenizer, POISON, 40)
    r = server.post("/v1/completions", {"prompt": POISON, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "worker_error" and "poisoned" in error["message"]
    partial = error["partial"]
    assert 0 < len(partial["token_ids"]) < 40 and want.startswith(partial["text"])
    assert server.get("/health").status_code == 503  # the authority is down ...
    # ... and the server goes on: the next request is served (and health is back)
    ok = client.completions.create(model="flaky", prompt="import os\n", max_tokens=12, temperature=0)
    assert ok.choices[0].text == greedy(family, tokenizer, "import os\n", 12)
    assert server.get("/health").status_code == 200


def test_a_failure_mid_stream_is_an_error_event_then_done(server, family, tokenizer):
    events = server.open_stream("/v1/completions", {"prompt": POISON, "max_tokens": 40, "temperature": 0}).events()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "worker_error"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert greedy(family, tokenizer, POISON, 40).startswith(text)


def test_an_unexpected_error_ends_the_batch_and_the_server_goes_on(server, client, family, tokenizer):
    r = server.post("/v1/completions", {"prompt": CRASH, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"]
    assert server.get("/health").status_code == 503
    ok = client.completions.create(model="flaky", prompt="import os\n", max_tokens=12, temperature=0)
    assert ok.choices[0].text == greedy(family, tokenizer, "import os\n", 12)
    health = server.wait_for(lambda h: h["running"] == 0, what="an idle batch")
    assert health["status"] == "ok" and not any(health["cached_sequences"].values())


def test_overload_is_refused_with_429_and_a_leaving_client_frees_its_place(server, client, family, tokenizer):
    # A holds the only place in the batch; B waits (the one allowed); C finds the queue full.
    a = server.open_stream("/v1/completions", {"prompt": "def f(x):\n", "max_tokens": 300, "temperature": 0})
    assert json.loads(a.next_event())["choices"][0]["finish_reason"] is None
    assert server.wait_for(lambda h: h["running"] == 1)["cached_sequences"]["large"] == 1
    result = {}
    b = threading.Thread(target=lambda: result.update(b=client.completions.create(
        model="flaky", prompt="import sys\n", max_tokens=10, temperature=0)))
    b.start()
    server.wait_for(lambda h: h["waiting"] == 1, what="B to queue")
    c = server.post("/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert c.status_code == 429 and c.headers["Retry-After"] == "1"
    assert c.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="flaky", prompt="x", max_tokens=4)
    aborted = server.metric("cascade:request_success_total", finished_reason="abort")
    a.close()  # A's client goes away: A is cancelled, its caches released, B gets the place
    b.join(timeout=60)
    assert result["b"].choices[0].text == greedy(family, tokenizer, "import sys\n", 10)
    assert server.metric("cascade:request_success_total", finished_reason="abort") == aborted + 1
    server.wait_for(lambda h: h["running"] == 0 and h["waiting"] == 0
                    and not any(h["cached_sequences"].values()), what="every cache to be released")


def test_a_waiting_non_streaming_client_that_leaves_is_cancelled(server):
    aborted = server.metric("cascade:request_success_total", finished_reason="abort")
    request = server.leave_early("/v1/completions", {"prompt": "def g(y):\n", "max_tokens": 480, "temperature": 0})
    server.wait_for(lambda h: h["running"] == 1, what="the request to run")
    request.close()
    server.wait_for(lambda h: h["running"] == 0 and not any(h["cached_sequences"].values()),
                    what="the request to be cancelled and released")
    assert server.metric("cascade:request_success_total", finished_reason="abort") == aborted + 1


def test_chat_without_a_template_is_refused(server):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]
    assert "--chat-template" in error["message"]
