"""``cascade serve`` over real HTTP with the real ``openai`` client: a subprocess serving a
4-level hierarchy (+ n-gram) of small random Llama models. Every output is checked exact against
the authority's own greedy decoding and against ``Cascade.generate`` (seeded sampling too)."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from cascade import Cascade
from conftest import family_topology, write_topology
from hf_util import prompts_from_text, reference_greedy
from serve_util import ROOT, serve

TEMPLATE = ROOT / "examples" / "models" / "large" / "chat_template.jinja"
LOOKAHEAD = {"ngram": 3, "tiny": 3, "small": 5, "medium": 7}


@pytest.fixture(scope="module")
def topology(family, tmp_path_factory):
    return write_topology(tmp_path_factory.mktemp("serve") / "serve.yaml", family_topology(
        family, ["tiny", "small", "medium", "large"], ngram=True, name="served",
        policy={"name": "fixed", "params": {"lookahead": LOOKAHEAD}}))


@pytest.fixture(scope="module")
def server(topology, tmp_path_factory):
    with serve(topology, "--max-num-seqs", "4", "--max-queued", "16", "--chat-template", str(TEMPLATE),
               log_dir=tmp_path_factory.mktemp("serve-log")) as served:
        yield served


@pytest.fixture(scope="module")
def cascade(topology):
    """The same topology in this process: the reference for seeded sampling and stop strings."""
    with Cascade.from_topology(topology) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def greedy_text(family, tokenizer, prompt_ids, max_tokens):
    ids = reference_greedy(str(family / "large"), prompt_ids, max_tokens)
    eos = tokenizer.eos_token_id
    ids = ids[: ids.index(eos) + 1] if eos in ids else ids
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def test_completion_is_the_authoritys_greedy_decoding(server, client, family, tokenizer):
    prompt = "def fibonacci(n):\n"
    want, count = greedy_text(family, tokenizer, tokenizer.encode(prompt), 40)
    r = client.completions.create(model="served", prompt=prompt, max_tokens=40, temperature=0)
    assert r.choices[0].text == want
    assert r.object == "text_completion" and r.model == "served"
    assert r.choices[0].finish_reason == ("length" if count == 40 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tokenizer.encode(prompt)), count)
    # token ids as the prompt: the same request
    ids = client.completions.create(model="served", prompt=tokenizer.encode(prompt), max_tokens=40, temperature=0)
    assert ids.choices[0].text == want


def test_streamed_completion_equals_the_whole(server, client, family, tokenizer):
    prompt = "class Stack:\n    def __init__(self):\n"
    want, count = greedy_text(family, tokenizer, tokenizer.encode(prompt), 48)
    chunks = list(client.completions.create(model="served", prompt=prompt, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want
    assert len(texts) > 2  # one chunk per engine step, not one at the end
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count


def test_eight_concurrent_clients_arriving_at_different_times_are_all_exact(server, family, tokenizer, cascade):
    prompts = prompts_from_text(tokenizer, 8)
    sampled = {5: 11, 6: 12}  # request -> seed: sampled requests ride in the same batches

    async def one(aclient, i):
        await asyncio.sleep(0.07 * i)  # arrivals spread over several engine steps
        kwargs = dict(model="served", prompt=prompts[i], max_tokens=16 + 3 * i)
        kwargs.update(temperature=0.8, top_p=0.95, seed=sampled[i]) if i in sampled else kwargs.update(temperature=0)
        if i % 2:
            stream = await aclient.completions.create(stream=True, **kwargs)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return (await aclient.completions.create(**kwargs)).choices[0].text

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(8)))

    got = asyncio.run(all_of_them())
    for i, text in enumerate(got):
        if i in sampled:  # the same tokens as this request alone, in process, with its seed
            want = cascade.generate(prompts[i], max_new_tokens=16 + 3 * i, temperature=0.8, top_p=0.95,
                                    seed=sampled[i]).text
        else:
            want = greedy_text(family, tokenizer, prompts[i], 16 + 3 * i)[0]
        assert text == want, f"request {i}"


def test_seeded_sampling_equals_generate_and_repeats(client, cascade):
    kwargs = dict(max_tokens=32, temperature=0.9, top_k=40, seed=123)
    want = cascade.generate("import os\n", max_new_tokens=32, temperature=0.9, top_k=40, seed=123).text
    for stream in (False, True):
        r = client.completions.create(model="served", prompt="import os\n", stream=stream,
                                      max_tokens=32, temperature=0.9, seed=123, extra_body={"top_k": 40})
        text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        assert text == want, kwargs


def test_stop_strings_match_the_api_streamed_or_not(client, cascade):
    free = cascade.generate("import os\n", max_new_tokens=48, temperature=0.0).text
    stop = free[5:8]
    want = cascade.generate("import os\n", max_new_tokens=48, temperature=0.0, stop=stop)
    assert want.finish_reason == "stop"
    r = client.completions.create(model="served", prompt="import os\n", max_tokens=48, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = client.completions.create(model="served", prompt="import os\n", max_tokens=48, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_chat_uses_the_template_streamed_or_not(client, cascade, tokenizer, family):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "a function that adds two numbers"}]
    prompt = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False,
                                           add_generation_prompt=True)
    want, count = greedy_text(family, tokenizer, tokenizer.encode(prompt), 30)
    r = client.chat.completions.create(model="served", messages=messages, max_tokens=30, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == count
    chunks = list(client.chat.completions.create(model="served", messages=messages, max_completion_tokens=30,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stats_only_when_asked(client):
    plain = client.completions.create(model="served", prompt="x = 1\n", max_tokens=8, temperature=0)
    assert "cascade_stats" not in (plain.model_extra or {})
    r = client.completions.create(model="served", prompt="x = 1\n", max_tokens=8, temperature=0,
                                  extra_body={"return_stats": True})
    stats = r.model_extra["cascade_stats"]
    assert stats["authority"] == "large" and stats["new_tokens"] == 8
    assert stats["levels"]["large"]["forward_passes"] >= 1 and "tiny->small" in stats["edges"]
    chunks = list(client.completions.create(model="served", prompt="x = 1\n", max_tokens=8, temperature=0,
                                            stream=True, extra_body={"return_stats": True}))
    assert chunks[-1].model_extra["cascade_stats"]["new_tokens"] == 8  # on the chunk that finishes
    assert all("cascade_stats" not in (c.model_extra or {}) for c in chunks[:-1])


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["served"]
    health = server.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    client.completions.create(model="served", prompt="def f(x):", max_tokens=12, temperature=0)
    text = server.get("/metrics").text
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "generation_tokens_total", "prompt_tokens_total", "path_selected_total"):
        assert "cascade:" + name in text, name
    for edge in ("ngram->tiny", "tiny->small", "small->medium", "medium->large"):
        for mode in ("greedy", "sampled"):  # every edge from the start, in both modes
            assert f'cascade:spec_decode_num_drafts_total{{edge="{edge}",mode="{mode}"}}' in text
    assert server.metric("cascade:path_selected_total", path="ngram->tiny->small->medium->large") > 0
    assert server.metric("cascade:generation_tokens_total") >= 12
    assert server.metric("cascade:spec_decode_num_accepted_tokens_per_pos_total", edge="medium->large",
                         mode="greedy", position="0") > 0


def test_metrics_count_greedy_and_sampled_drafts_apart(server, client):
    def drafted(mode):
        return sum(server.metric("cascade:spec_decode_num_draft_tokens_total", edge=e, mode=mode)
                   for e in ("ngram->tiny", "tiny->small", "small->medium", "medium->large"))

    greedy, sampled = drafted("greedy"), drafted("sampled")
    client.completions.create(model="served", prompt="def f(x):", max_tokens=16, temperature=0.8, seed=3)
    assert drafted("sampled") > sampled and drafted("greedy") == greedy
    client.completions.create(model="served", prompt="def f(x):", max_tokens=16, temperature=0)
    assert drafted("greedy") > greedy


def test_a_client_that_disconnects_is_cancelled_and_the_server_goes_on(server, client, family, tokenizer):
    stream = server.open_stream("/v1/completions", {"prompt": "for i in range(10):\n", "max_tokens": 400,
                                                    "temperature": 0})
    first = json.loads(stream.next_event())
    assert first["choices"][0]["finish_reason"] is None
    stream.close()
    # the request leaves the batch and every level forgets it
    server.wait_for(lambda h: h["running"] == 0 and not any(h["cached_sequences"].values()),
                    what="the cancelled request to be released")
    want, _ = greedy_text(family, tokenizer, tokenizer.encode("import sys\n"), 16)
    assert client.completions.create(model="served", prompt="import sys\n", max_tokens=16,
                                     temperature=0).choices[0].text == want


# -- bad input: an OpenAI-style error naming the field, and the server goes on --------------------

COMPLETION_ERRORS = [
    ('{"prompt": "x",', 400, None),  # malformed JSON
    ("[1, 2]", 400, None),  # not an object
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),
    ({"prompt": [5] * 600}, 400, "prompt"),  # longer than the authority's context (512)
    ({"prompt": [1, 99999]}, 400, "prompt[1]"),  # not a token of the vocabulary
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ('{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ('{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": -1}, 400, "top_k"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": 7}, 400, "prompt"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "max_token": 4}, 400, "max_token"),  # unknown fields are refused
    ({"prompt": "x", "echo": True}, 400, "echo"),  # known to OpenAI, not implemented
]


@pytest.mark.parametrize("body,status,param", COMPLETION_ERRORS)
def test_bad_completion_requests(server, body, status, param):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status
    if param:
        assert error["message"].startswith(param), error["message"]


@pytest.mark.parametrize("body,message", [
    ({"prompt": "x", "temperature": -0.5}, "temperature: must be greater than or equal to 0 (got -0.5)"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature: must be a finite number (got inf)"),
    ({"prompt": "x", "top_p": 0}, "top_p: must be greater than 0 (got 0)"),
])
def test_sampling_ranges_are_worded_as_the_api_words_them(server, body, message):
    """The door checks the ranges declared once in cascade.sampling, in the API's wording."""
    r = server.post("/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["message"] == message


CHAT_ERRORS = [
    ({"max_tokens": 4}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ({"messages": "hi"}, "messages"),
]


@pytest.mark.parametrize("body,param", CHAT_ERRORS)
def test_bad_chat_requests(server, body, param):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="served", prompt="x", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    # and the server still serves
    assert client.completions.create(model="served", prompt="x", max_tokens=2).usage.completion_tokens == 2



def test_the_cache_count_reads_solo_and_pooled_sequences(cascade):
    """/health's cached_sequences asks each worker (Worker.cached_sequences): a transformers
    worker counts a sequence served alone and sequences in its batched pool, until released."""
    large = cascade.workers["large"]
    batch = cascade.batch()
    batch.add(cascade.request("import os\n", max_new_tokens=64, temperature=0.0))
    batch.step()
    assert large.cached_sequences() == 1  # alone: its own cache
    batch.add(cascade.request("class Stack:\n", max_new_tokens=64, temperature=0.0))
    batch.step()
    assert large.cached_sequences() == 2  # batched: rows of the pool
    batch.close()
    assert large.cached_sequences() == 0


def test_a_seed_gives_the_same_tokens_through_the_server_whatever_the_policy(client, cascade):
    """With the defaults (no coupling named), ``seed: 1234`` at T = 0.8 through the server under
    ``auto`` equals ``Cascade.generate(..., seed=1234)`` in this process under the topology's fixed
    policy: a seed means the same tokens, whatever the policy, batch or process."""
    want = cascade.generate("def fibonacci(n):\n", max_new_tokens=32, temperature=0.8, seed=1234).text
    for stream in (False, True):
        r = client.completions.create(model="served", prompt="def fibonacci(n):\n", stream=stream, max_tokens=32,
                                      temperature=0.8, seed=1234, extra_body={"policy": "auto"})
        text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        assert text == want


TREE = "fixed:path=[tiny, small, medium, large],tree={tiny: [3, 2, 1]},lookahead={tiny: 3, small: 5, medium: 7}"


def test_a_tree_through_the_server_is_exact_shows_its_branch_and_counts_in_metrics(server, client, family, tokenizer):
    prompt = "def fibonacci(n):\n"
    want, _ = greedy_text(family, tokenizer, tokenizer.encode(prompt), 24)
    before = server.metric("cascade:spec_decode_num_tree_candidates_total", edge="tiny->small", mode="greedy")
    streamed = client.completions.create(model="served", prompt=prompt, stream=True, max_tokens=24, temperature=0,
                                         extra_body={"policy": TREE})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    body = server.post("/v1/completions", {"model": "served", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                           "policy": TREE, "return_provenance": True}).json()
    assert body["choices"][0]["text"] == want
    blocks = [b for step in body["cascade_provenance"] for b in step["blocks"] if b["proposer"] == "tiny"]
    assert blocks and all(b["candidates"] > 0 and len(b["ranks"]) == b["accepted"] for b in blocks)
    assert server.metric("cascade:spec_decode_num_tree_candidates_total", edge="tiny->small", mode="greedy") > before
