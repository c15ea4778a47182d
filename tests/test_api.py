"""The Python API and the generate CLI: results, streaming, stops, errors."""
from __future__ import annotations

import json

import networkx as nx
import pytest

from cascade import Cascade, RequestError
from cascade.cli import main
from cascade.engine import Engine, Request
from cascade.sampling import Sampling
from conftest import family_topology, write_topology
from policies.fixed import FixedPolicy
from table_worker import TableWorker


@pytest.fixture(scope="module")
def cascade4(family, tmp_path_factory):
    path = write_topology(tmp_path_factory.mktemp("api") / "c.yaml", family_topology(
        family, ["tiny", "small", "medium", "large"],
        policy={"name": "fixed", "params": {"lookahead": {"tiny": 2, "small": 4, "medium": 6}}}))
    with Cascade.from_topology(path) as c:
        yield c


def test_single_and_list_prompts(cascade4):
    g = cascade4.generate("def fibonacci(n):", max_new_tokens=24, temperature=0.0)
    assert len(g.token_ids) == 24 and g.finish_reason == "length"
    assert g.text == cascade4.tokenizer.decode(g.token_ids, skip_special_tokens=True)
    assert g.stats.new_tokens == 24 and g.stats.authority_passes >= 1
    assert g.stats.tokens_per_authority_pass == 24 / g.stats.authority_passes
    gs = cascade4.generate(["import os\n", "class Stack:"], max_new_tokens=16, temperature=0.8, top_p=0.95, seed=7)
    assert [len(x.token_ids) for x in gs] == [16, 16]
    assert gs[0].prompt == "import os\n" and gs[1].prompt == "class Stack:"
    again = cascade4.generate(["import os\n", "class Stack:"], max_new_tokens=16, temperature=0.8, top_p=0.95, seed=7)
    assert [x.token_ids for x in again] == [x.token_ids for x in gs]
    # prompt i of a list uses seed + i: the same as generating it alone with that seed
    alone = cascade4.generate("class Stack:", max_new_tokens=16, temperature=0.8, top_p=0.95, seed=8)
    assert alone.token_ids == gs[1].token_ids


def test_stream_yields_the_generated_text(cascade4):
    chunks = list(cascade4.stream("def merge_sort(xs):", max_new_tokens=40, temperature=0.0))
    full = cascade4.generate("def merge_sort(xs):", max_new_tokens=40, temperature=0.0)
    assert "".join(chunks) == full.text
    assert len(chunks) > 1


def test_stop_strings_cut_text_and_tokens(cascade4):
    free = cascade4.generate("import os\n", max_new_tokens=48, temperature=0.0)
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    g = cascade4.generate("import os\n", max_new_tokens=48, temperature=0.0, stop=stop)
    assert g.finish_reason == "stop"
    assert g.text == text[: text.find(stop)]
    assert stop in cascade4.tokenizer.decode(g.token_ids)
    assert stop not in cascade4.tokenizer.decode(g.token_ids[:-1])
    streamed = "".join(cascade4.stream("import os\n", max_new_tokens=48, temperature=0.0, stop=[stop]))
    assert streamed == g.text


def test_eos_stops_generation():
    graph = nx.DiGraph([("d", "t")])
    workers = {"d": TableWorker(6, seed=1), "t": TableWorker(6, seed=2)}
    plain = Engine(graph, "t", workers, FixedPolicy(3)).generate(Request([0], 12, Sampling()))
    eos = plain.generated[4]
    first = plain.generated.index(eos)
    stopped = Engine(graph, "t", workers, FixedPolicy(3), eos_token_ids={eos}).generate(Request([0], 12, Sampling()))
    assert stopped.generated == plain.generated[: first + 1]
    assert stopped.finish_reason == "eos"


@pytest.mark.parametrize("kwargs,field", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"policy": "nosuch"}, "policy"),
])
def test_bad_request_parameters(cascade4, kwargs, field):
    with pytest.raises(RequestError) as info:
        cascade4.generate("x = 1", **kwargs)
    assert str(info.value).startswith(field), str(info.value)


def test_empty_and_too_long_prompts(cascade4):
    with pytest.raises(RequestError, match="^prompts: empty"):
        cascade4.generate("")
    with pytest.raises(RequestError, match=r"^prompts\[0\]: empty"):
        cascade4.generate([[]])
    with pytest.raises(RequestError, match="^prompts: 600 tokens does not fit the authority's context of 512"):
        cascade4.generate([5] * 600)


def test_generation_stops_at_the_context_end(cascade4):
    g = cascade4.generate([5] * 500, max_new_tokens=64, temperature=0.0)
    assert len(g.token_ids) == 12 and g.finish_reason == "context"


def test_cli_generate(family, tmp_path, capsys):
    path = write_topology(tmp_path / "c.yaml", family_topology(family, ["tiny", "large"]))
    assert main(["generate", "--topology", str(path), "--max-new-tokens", "8", "--json",
                 "--policy", "fixed:lookahead=3", "def f(x):"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8 and out["stats"]["authority_passes"] >= 1
    assert "tiny->large" in out["stats"]["edges"]
    assert main(["generate", "--topology", str(path), "--temperature", "-1", "x"]) == 2
    assert "temperature" in capsys.readouterr().err
