"""The HTTP door under hostile requests (issue 28), over real HTTP on a loopback port: a body
over the limit is refused with 413 before it is read; a multi-MB prompt delays no other request
(it is tokenized outside the lock the engine steps under) and leaves no memory behind once
refused; a request names only the policies the server offers, and nothing it names is imported;
what its policy may ask (lookahead, tree size) is bounded (issue 56), refused naming the field
beyond the limit, never clamped; an error quotes at most a short prefix of a refused value;
deep nesting and text that is not valid Unicode are 400s naming the field; an OpenAI tool
message (with its ``tool_call_id``) is accepted."""
from __future__ import annotations

import asyncio
import gc
import json
import socket
import statistics
import threading
import time
import weakref

import openai
import pytest

from cascade import Cascade, RequestError
from cascade.serve.protocol import MAX_BODY_BYTES, MAX_MESSAGE_CHARS, ApiError
from cascade.serve.server import Server
from conftest import TEXT, family_topology, write_topology
from serve_util import ROOT, serve

TEMPLATE = ROOT / "examples" / "models" / "large" / "chat_template.jinja"
BIG = 3 * 1024 * 1024  # characters of a big prompt: under the default body limit, far over the context


@pytest.fixture(scope="module")
def server(family, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("door") / "door.yaml", family_topology(
        family, ["tiny", "large"], name="door", policy={"name": "fixed", "params": {"lookahead": 3}}))
    with serve(topology, "--max-num-seqs", "4", "--chat-template", str(TEMPLATE),
               "--allow-policy", "door_policy:DoorPolicy", "--policy-limit", "tree_width=4",
               log_dir=tmp_path_factory.mktemp("door-log")) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def big_prompt(n: int = BIG) -> str:
    return (TEXT * (n // len(TEXT) + 1))[:n]


def raw_exchange(port: int, head: bytes, body_parts: list[bytes]) -> tuple[int, dict]:
    """Send a request by hand (so its headers can lie or its body be chunked); the status and
    the error body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):  # refused before the rest was read
                break
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data[data.index(b"\r\n\r\n") + 4:])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


# -- the body limit ---------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    # declared: refused on the header, without waiting for a byte of the (never sent) body
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10 ** 12}\r\n\r\n").encode()
    status, body = raw_exchange(server.port, head, [])
    assert status == 413, body
    assert body["error"]["code"] == 413 and f"limit of {MAX_BODY_BYTES} bytes" in body["error"]["message"]
    # chunked (no length declared): refused once more than the limit has come
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b'{"prompt": "' + b"x" * (1 << 20)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] + [b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))] * 4
    status, body = raw_exchange(server.port, head, chunks)
    assert status == 413, body
    # and the server goes on
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


# -- a big prompt delays no other, and leaves no memory behind ---------------------------------------------


def _small(server) -> float:
    start = time.perf_counter()
    r = server.post("/v1/completions", {"prompt": "def f(x):\n", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_refused_big_prompts_leave_no_memory_behind(server):
    _small(server)
    before = _rss_mb(server.proc.pid)
    for _ in range(2):  # two at once (they take turns in the long prompts' thread)
        replies = []
        threads = [threading.Thread(target=lambda: replies.append(
            server.post("/v1/completions", {"prompt": big_prompt(), "max_tokens": 4}))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in replies] == [400, 400]
    _small(server)
    after = _rss_mb(server.proc.pid)
    # tokenizing one such prompt takes hundreds of MB for a moment: kept by the allocator, the
    # server grew by about 320 MB here; handed back, by a few MB
    assert after - before < 100, f"the server's memory grew from {before:.0f} to {after:.0f} MB"


class _Prompt(str):
    """A prompt a test can watch: a str subclass takes a weak reference."""


def test_nothing_keeps_a_refused_request(family, tmp_path):
    """In process, with the cycle collector off: once its error is handled, nothing holds a refused
    request's prompt (not its thread, its future, nor its traceback's frames)."""
    topology = write_topology(tmp_path / "t.yaml", family_topology(family, ["tiny", "large"]))
    server = Server(Cascade.from_topology(topology)).start()

    async def refused(prompt: str) -> str:
        try:
            await server.submit(prompt, 4)
        except RequestError as exc:
            return str(exc)
        raise AssertionError("not refused")

    gc.disable()
    try:
        for text, says in [(big_prompt(200_000), "prompt: "), ("def f(\ud800):", "prompt: text that is not valid")]:
            prompt = _Prompt(text)  # over the context (a long prompt: its own thread); not valid Unicode
            watch = weakref.ref(prompt)
            assert asyncio.run(refused(prompt)).startswith(says)
            del prompt
            deadline = time.monotonic() + 2  # (a worker thread drops its job just after answering)
            while watch() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert watch() is None, [type(r).__name__ for r in gc.get_referrers(watch())]
    finally:
        gc.enable()
        server.close()


def test_a_big_prompt_delays_no_other_request(server):
    _small(server)  # warm
    alone = statistics.median(_small(server) for _ in range(5))
    big: dict = {}

    def send_big():
        big["reply"] = server.post("/v1/completions", {"prompt": big_prompt(), "max_tokens": 4})
        big["done"] = time.perf_counter()

    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.5)  # the big prompt is being tokenized (seconds)
    beside = _small(server)
    small_done = time.perf_counter()
    thread.join()
    assert beside < 3 * alone + 1.0, f"a small request took {beside:.2f} s beside a big prompt, {alone:.2f} s alone"
    # the big one was refused (it does not fit the context) only after the small one was answered
    assert big["reply"].status_code == 400 and big["reply"].json()["error"]["param"] == "prompt"
    assert small_done < big["done"], "the small request did not overlap the big one's tokenizing"


# -- policies: only those the server offers; nothing a client names is imported -------------------


def test_a_request_names_only_the_policies_the_server_offers(server, client):
    for spec in ("this:s", "door_untrusted:Policy", "door_untrusted:Policy:lookahead=2", "os:system"):
        r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "policy": spec})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "policy" and "is not a policy this server offers" in error["message"], error
        assert "--allow-policy" in error["message"]
    # the registered policies, and the one the operator allowed, are served
    for spec in ("fixed:lookahead=2", "auto", "door_policy:DoorPolicy:lookahead=2"):
        r = client.completions.create(model="door", prompt="x", max_tokens=2, extra_body={"policy": spec})
        assert r.usage.completion_tokens == 2, spec
    log = server.log.read_text()
    assert "door_policy imported" in log  # the operator's, at start: the log shows imports
    assert "door_untrusted imported" not in log and "Beautiful is better than ugly" not in log


# -- what a request's policy may ask: bounded, refused naming the field, never clamped ----------------

BEYOND = [  # (spec, the field named, the limit the message quotes); the fixture sets tree_width=4
    ("fixed:lookahead=100000", "policy.lookahead", 32),
    ("fixed:lookahead={tiny: 33}", "policy.lookahead.tiny", 32),
    ("confidence:lookahead=33", "policy.lookahead", 32),
    ("auto:max_lookahead=64", "policy.max_lookahead", 32),
    ("door_policy:DoorPolicy:lookahead=33", "policy.lookahead", 32),  # an allowed plug-in's too
    ("fixed:tree={tiny: [5]}", "policy.tree.tiny", 4),  # wider than the fixture's --policy-limit
    ("fixed:tree={tiny: [4, 4, 4]}", "policy.tree.tiny", 64),  # 84 nodes
    ("auto:trees=[[2, 2], [" + ", ".join(["1"] * 17) + "]]", "policy.trees.1", 16),  # 17 deep
]


@pytest.mark.parametrize("spec,param,limit", BEYOND, ids=[b[0][:40] for b in BEYOND])
def test_a_policy_beyond_the_servers_limits_is_refused_naming_the_field(client, spec, param, limit):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="door", prompt="x", max_tokens=2, extra_body={"policy": spec})
    error = info.value.body
    assert error["param"] == param and error["message"].startswith(param + ":"), error
    assert f"over this server's limit of {limit}" in error["message"] and "--policy-limit" in error["message"]


def test_a_policy_at_the_limits_is_served_as_asked(server, client):
    # a block of 32 (auto's own default longest block), and a tree as wide as the operator allows
    for spec in ("fixed:lookahead=32", "auto", "fixed:tree={tiny: [4, 2]}"):
        r = client.completions.create(model="door", prompt="x", max_tokens=2, extra_body={"policy": spec})
        assert r.usage.completion_tokens == 2, spec
    # the chat route is the same door
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="door", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"policy": "fixed:lookahead=33"})
    assert info.value.body["param"] == "policy.lookahead"


@pytest.mark.parametrize("value", ["x=1", "lookahead=0", "lookahead", "tree_nodes=a"])
def test_a_bad_policy_limit_is_refused_before_anything_loads(tmp_path, capsys, value):
    from cascade.cli import main

    assert main(["serve", "--policy-limit", value, "-t", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --policy-limit" in err, err


# -- a refused value is quoted short --------------------------------------------------------------------

HUGE = 3_000_000  # characters: under the body limit


@pytest.mark.parametrize("body,param,status", [
    ({"logit_bias": {str(i): 1.0 for i in range(240_000)}}, "logit_bias", 400),  # ~3.6 MB of JSON
    ({"stop": ["s" * HUGE, ""]}, "stop", 400),  # refused by cascade itself, not by pydantic
    ({"user": ["u" * HUGE]}, "user", 400),
    ({"policy": "fixed:lookahead=3," + "x" * HUGE}, "policy", 400),
    ({"model": "m" * HUGE}, "model", 404),
], ids=["logit_bias", "stop", "user", "policy", "model"])
def test_an_error_quotes_a_short_prefix_of_the_value(server, body, param, status):
    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error["message"][:300]
    assert len(error["message"]) < 400 and "…" in error["message"], error["message"][:300]


def test_no_error_message_is_long():
    # the last line of defence, whatever a message quotes
    error = ApiError(400, "x: " + "y" * HUGE, "z" * HUGE).body()["error"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS + 1 and len(error["param"]) <= 101


# -- malformed bodies: 400 naming the field ------------------------------------------------------------

DEEP = 100_000
MALFORMED = [  # (path, raw body, the field named)
    ("/v1/completions", '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}", "prompt"),
    ("/v1/completions", '{"prompt": "x", "extra": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}", "extra"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": ' + "[" * 40 + "]" * 40 + "}", "logit_bias"),
    ("/v1/completions", r'{"prompt": "def f(\ud800):"}', "prompt"),
    ("/v1/completions", r'{"prompt": "x", "stop": ["ok", "\udfff"]}', "stop.1"),
    ("/v1/completions", r'{"prompt": "x", "\ud800": 1}', "\\ud800"),
    ("/v1/completions", '{"prompt": "x", "policy": "fixed:lookahead=' + "[" * 50_000 + '"}', "policy"),
    ("/v1/completions", '{"prompt": "x", "seed": 9223372036854775808}', "seed"),  # seeds lie in [0, 2^63)
    ("/v1/completions", '{"prompt": "x", "seed": -1}', "seed"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "def f(\ud800):"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]}',
     "messages.0.content.0.text"),
]


@pytest.mark.parametrize("path,body,param", MALFORMED, ids=[
    "deep-prompt", "deep-unknown-field", "deep-known-field", "surrogate-prompt", "surrogate-stop",
    "surrogate-key", "deep-policy", "seed-2^63", "seed-negative", "surrogate-chat", "surrogate-chat-part"])
def test_a_malformed_body_is_a_400_naming_the_field(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error


def test_a_tool_message_is_accepted(server, client):
    messages = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "add(2, 2)"},
                {"role": "tool", "content": "4", "tool_call_id": "call_1"}]
    r = client.chat.completions.create(model="door", messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    # the id reaches the chat template; this one does not print it, so the prompt is the same without
    plain = client.chat.completions.create(model="door", messages=[*messages[:2], {"role": "tool", "content": "4"}],
                                           max_tokens=4, temperature=0)
    assert (plain.usage.prompt_tokens, plain.choices[0].message.content) == \
        (r.usage.prompt_tokens, r.choices[0].message.content)
    bad = server.post("/v1/chat/completions", {"messages": [{"role": "tool", "content": "4", "tool_call_id": 5}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.tool_call_id"
