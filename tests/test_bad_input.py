"""Every bad input is one named error (issue 20): a table of cases per boundary — the Python
API, lifecycle misuse, topology files, the command line — each asserting the error type and
that the message names the parameter, file or field. Plus threads and batch jobs."""
from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cascade import Cascade, ClosedError, RequestError, TopologyError
from cascade.build import build_worker
from cascade.cli import main
from cascade.topology import load_topology
from conftest import family_topology, write_topology

VOCAB = 6  # the table workers' vocabulary


def _table_level(name: str, seed: int) -> dict:
    return {"name": name, "kind": "table_worker:TableWorker", "params": {"vocab_size": VOCAB, "seed": seed}}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A two-level cascade of bigram-table workers (token-id prompts only): cheap and real."""
    path = write_topology(tmp_path_factory.mktemp("bad") / "t.yaml", {
        "levels": [_table_level("draft", 1), _table_level("target", 2)],
        "policy": {"name": "fixed", "params": {"lookahead": 3}}})
    with Cascade.from_topology(path) as c:
        yield c


# -- the Python API -------------------------------------------------------------------------------

API_CASES = [  # (keyword arguments, the parameter the message must start with)
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": "8"}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": None}, "max_new_tokens"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.0}, "batch_size"),
    ({"policy": "nosuch"}, "policy"),
]


@pytest.mark.parametrize("kwargs,param", API_CASES, ids=[f"{k}={v!r}" for k, v in (next(iter(c[0].items())) for c in API_CASES)])
def test_bad_parameter_is_a_request_error_naming_it(table, kwargs, param):
    with pytest.raises(RequestError) as info:
        table.generate([1, 2], **kwargs)
    assert str(info.value).startswith(f"{param}: "), str(info.value)
    assert "(got " in str(info.value) or param == "policy"


PROMPT_CASES = [  # (prompts, what the message must start with)
    ({"a": 1}, "prompts: "),  # was generated from its key string
    (b"abc", "prompts: "),  # became token ids
    (None, "prompts: "),
    (3, "prompts: "),
    (1.5, "prompts: "),
    ([], "prompts: empty"),
    ([[]], "prompts[0]: empty"),
    ([1.5, 2], "prompts[0]: "),
    ([[1, [2]]], "prompts[0][1]: "),
    ([[1, 2], {"x": 1}], "prompts[1]: "),
    ([True, 1], "prompts[0]: "),
    ([-1], "prompts[0]: token id out of the vocabulary"),
    ([VOCAB], "prompts[0]: token id out of the vocabulary"),
    ([[1, 2], [3, 4096]], "prompts[1][1]: token id out of the vocabulary"),
    (np.array([[1, 2], [3, 4]]), "prompts: token ids must be 1-D"),
    (torch.tensor([1.0, 2.0]), "prompts[0]: "),
]


@pytest.mark.parametrize("prompts,start", PROMPT_CASES, ids=[repr(p)[:24] for p, _ in PROMPT_CASES])
def test_bad_prompt_is_a_request_error_naming_it(table, prompts, start):
    with pytest.raises(RequestError) as info:
        table.generate(prompts, max_new_tokens=4)
    assert str(info.value).startswith(start), str(info.value)


def test_request_and_stream_name_their_prompt(table):
    with pytest.raises(RequestError, match=r"^prompt\[1\]: token id out of the vocabulary \[0, 6\) \(got 6\)"):
        table.request([1, VOCAB])
    with pytest.raises(RequestError, match="^prompt: "):
        table.request({"a": 1})
    with pytest.raises(RequestError, match="^max_new_tokens: "):
        table.stream([1], max_new_tokens=0)  # checked at the call, not at the first chunk


def test_text_that_is_not_valid_unicode_is_named(family, tmp_path):
    """A lone surrogate (half of a UTF-16 pair) can sit in a Python str but no tokenizer can
    encode it: a RequestError naming the prompt, not the tokenizer's TypeError."""
    path = write_topology(tmp_path / "t.yaml", family_topology(family, ["tiny", "large"]))
    with Cascade.from_topology(path) as c:
        calls = [(lambda: c.generate("def f(\ud800):", max_new_tokens=2), "prompts"),
                 (lambda: c.generate(["x = 1", "a\udc00"], max_new_tokens=2), r"prompts\[1\]"),
                 (lambda: c.request("\ud800"), "prompt"),
                 (lambda: c.stream("\udfff", max_new_tokens=2), "prompt")]
        for call, where in calls:
            with pytest.raises(RequestError, match=rf"^{where}: text that is not valid Unicode: a lone surrogate "
                                                   r"'\\ud[8-f]..' at character \d+"):
                call()
        assert c.generate("def f(x):", max_new_tokens=2).token_ids  # and it goes on


def test_what_needs_a_tokenizer_is_named(table):
    """Without a tokenizer, the error names what needed one: the text prompt, the stop strings,
    the text stream."""
    with pytest.raises(RequestError, match="^prompt: this topology has no tokenizer; pass token ids"):
        table.generate("text", max_new_tokens=2)
    with pytest.raises(RequestError, match="^stop: this topology has no tokenizer; stop strings are matched"):
        table.generate([1], max_new_tokens=2, stop="x")
    with pytest.raises(RequestError, match="^stop: "):
        table.text_stream(stop=["x"])
    with pytest.raises(RequestError, match="^stream: this topology has no tokenizer; it yields text"):
        table.stream([1], max_new_tokens=2)
    assert len(table.generate([1], max_new_tokens=2).token_ids) == 2  # and it goes on serving


def test_integer_like_values_count_as_integers(table):
    ref = table.generate([1, 2, 3], max_new_tokens=8, temperature=0.8, seed=5, top_k=4)
    for prompt in ([np.int64(1), np.int32(2), 3], np.array([1, 2, 3]), torch.tensor([1, 2, 3])):
        g = table.generate(prompt, max_new_tokens=np.int64(8), temperature=np.float32(0.8), seed=np.int64(5),
                           top_k=np.int16(4))
        assert g.token_ids == ref.token_ids
        assert g.prompt == [1, 2, 3]  # normalised to Python ints
    gs = table.generate([[1, 2, 3], np.array([4, 5])], max_new_tokens=4, batch_size=np.int64(2))
    assert len(gs) == 2


def test_every_prompt_is_checked_before_any_runs(table):
    calls = [w.calls for w in table.workers.values()]
    for batch_size in (1, 2):
        with pytest.raises(RequestError, match=r"^prompts\[2\]\[0\]: token id out of the vocabulary"):
            table.generate([[1, 2], [3], [VOCAB + 3]], max_new_tokens=4, batch_size=batch_size)
    assert [w.calls for w in table.workers.values()] == calls  # nothing ran


def test_device_override_is_checked_before_loading(tmp_path):
    with pytest.raises(RequestError, match=r"^device: must be auto, cpu or cuda:N \(got 'foo'\)"):
        Cascade.from_topology(tmp_path / "none.yaml", device="foo")


# -- lifecycle ------------------------------------------------------------------------------------

def test_lifecycle_misuse(tmp_path):
    path = write_topology(tmp_path / "t.yaml", {"levels": [_table_level("draft", 1), _table_level("target", 2)]})
    c = Cascade.from_topology(path)
    never_ran = c.request([1, 2], max_new_tokens=4)
    with pytest.raises(RequestError, match="^state: the request has not finished"):
        c.result(never_ran)  # was finish_reason='length'
    batch = c.batch()
    batch.add(never_ran)
    with pytest.raises(RequestError, match="^state: this request is already in the batch"):
        batch.add(never_ran)  # failed deep in a worker
    while batch.active:
        batch.step()
    assert c.result(never_ran).finish_reason == "length"
    with pytest.raises(RequestError, match="^state: this request has already finished"):
        batch.add(never_ran)
    c.close()
    c.close()  # idempotent
    for call in (lambda: c.generate([1]), lambda: c.request([1]), lambda: c.stream([1]), c.batch, batch.step):
        with pytest.raises(ClosedError, match="closed"):  # was AttributeError
            call()


# -- threads ---------------------------------------------------------------------------------------

def test_threads_sharing_a_cascade_get_exact_outputs(family, tmp_path):
    """4 threads mixing batched greedy and seeded sampling on one Cascade (real transformers
    workers, whose batched caches crashed when shared): every output equals the same call alone."""
    path = write_topology(tmp_path / "t.yaml", family_topology(
        family, ["tiny", "small", "large"], policy={"name": "fixed", "params": {"lookahead": {"tiny": 2, "small": 4}}}))
    prompts = ["def f(x):", "import os\n", "class Stack:", "for i in range(3):"]
    calls = [  # (kwargs): batched greedy, seeded sampling, batched seeded sampling, streaming
        dict(prompts=prompts, max_new_tokens=12, temperature=0.0, batch_size=4),
        dict(prompts=prompts[:2], max_new_tokens=12, temperature=0.8, seed=11),
        dict(prompts=prompts[1:], max_new_tokens=10, temperature=0.9, top_p=0.9, seed=3, batch_size=2),
        dict(prompts=prompts[3], max_new_tokens=12, temperature=0.7, seed=5),
    ]
    with Cascade.from_topology(path) as c:
        alone = [_tokens(c.generate(**kw)) for kw in calls]
        streamed_alone = "".join(c.stream(prompts[2], max_new_tokens=12, temperature=0.8, seed=9))
        got: dict[int, list] = {}
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for r in range(2):
                    got[(t, r)] = _tokens(c.generate(**calls[t]))
                got[(t, "stream")] = "".join(c.stream(prompts[2], max_new_tokens=12, temperature=0.8, seed=9))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
    assert not errors, errors
    for t in range(4):
        assert got[(t, 0)] == got[(t, 1)] == alone[t]
        assert got[(t, "stream")] == streamed_alone


def _tokens(result) -> list:
    return [g.token_ids for g in result] if isinstance(result, list) else result.token_ids


# -- topology files ---------------------------------------------------------------------------------

def _hf_topology(tmp_path: Path, family: Path, **extra) -> dict:
    """A three-level topology whose models are copies under tmp_path (so they can be damaged)."""
    for name in ("tiny", "small", "large"):
        if not (tmp_path / name).exists():
            shutil.copytree(family / name, tmp_path / name)
    return family_topology(tmp_path, ["tiny", "small", "large"], **extra)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _config(key: str, value):
    def damage(path: Path) -> None:
        config = path.parent / "config.json"
        data = json.loads(config.read_text())
        data[key] = value
        config.write_text(json.dumps(data))
    return damage


WEIGHT_CASES = [  # (damage to levels[1]'s model.safetensors, what the message must say after the field)
    (lambda p: p.unlink(), "no model.safetensors"),
    (lambda p: p.write_bytes(b""), "model.safetensors: empty or truncated"),
    (_truncate, "model.safetensors: truncated or corrupt"),
    (lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"), "model.safetensors: corrupt header"),
    (lambda p: p.write_bytes(bytes(range(256)) * 8), "model.safetensors: corrupt or truncated"),
    (_config("num_hidden_layers", 7), "config.json: num_hidden_layers 7 does not match"),
    (_config("hidden_size", 40), "config.json: hidden_size 40 does not match"),
]


@pytest.mark.parametrize("damage,says", WEIGHT_CASES, ids=[s.split(":")[0][:30] for _, s in WEIGHT_CASES])
def test_bad_weights_are_named_by_validate_and_loading(family, tmp_path, capsys, damage, says):
    path = write_topology(tmp_path / "t.yaml", _hf_topology(tmp_path, family))
    damage(tmp_path / "small" / "model.safetensors")
    where = f"{path}: levels[1].model: "
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(where) and says in str(info.value), str(info.value)
    assert main(["validate", str(path)]) == 1  # was OK
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and where in err and says in err
    # building the worker (what each backend does, a Ray actor included) names the level too
    topo = load_topology(path, check_models=False)
    level = topo.spec.levels[1]
    with pytest.raises(TopologyError) as info:
        build_worker(level, topo.model_path(level), 1, topo.source, "cpu")
    assert str(info.value).startswith(where) and says in str(info.value)


def test_validate_ok_means_it_loads(family, tmp_path, capsys):
    path = write_topology(tmp_path / "t.yaml", _hf_topology(tmp_path, family))
    assert main(["validate", str(path)]) == 0
    assert "OK" in capsys.readouterr().out
    with Cascade.from_topology(path) as c:
        assert c.generate([1, 2, 3], max_new_tokens=2).token_ids


ALIAS_BOMB = """
a: &a [x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
levels:
  - {name: t, kind: "table_worker:TableWorker", params: {vocab_size: 6, junk: [*c, *c, *c, *c, *c, *c, *c]}}
"""

TOPOLOGY_CASES = [  # (file text, what the message must say after the file name)
    (ALIAS_BOMB, "YAML aliases (*name) are not allowed"),
    ("levels: [{name: t, kind: 'table_worker:TableWorker'}]\nsampling: {temperature: .inf}\n",
     "sampling.temperature: "),
    ("levels: [{name: t, kind: 'table_worker:TableWorker'}]\nsampling: {top_p: .nan}\n", "sampling.top_p: "),
    ("levels:\n - {name: d, kind: 'table_worker:TableWorker', sampling: {temperature: .inf}}\n"
     " - {name: t, kind: 'table_worker:TableWorker'}\n", "levels[0].sampling.temperature: "),
    ("levels: [{name: t, kind: 'table_worker:TableWorker', resources: {num_gpus: .inf}}]\n",
     "levels[0].resources.num_gpus: "),
    ("levels: [{name: t, kind: 'table_worker:TableWorker'}]\nray: {call_timeout_s: .inf}\n",
     "ray.call_timeout_s: "),
    ("levels: [{name: t, kind: 'table_worker:TableWorker', device: foo}]\n", "levels[0].device: "),
]


@pytest.mark.parametrize("text,says", TOPOLOGY_CASES, ids=[s.split(":")[0][:24] for _, s in TOPOLOGY_CASES])
def test_bad_topology_file_is_a_topology_error_naming_the_field(tmp_path, text, says):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: ") and says in str(info.value), str(info.value)
    assert len(str(info.value)) < 400  # the alias bomb printed 4.3 MB


def test_non_utf8_topology_and_missing_tokenizer(family, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\nlevels: [{name: t, kind: 'table_worker:TableWorker'}]\n".encode("latin-1"))
    with pytest.raises(TopologyError, match=rf"^{re.escape(str(path))}: not UTF-8 text"):
        load_topology(path)
    path = write_topology(tmp_path / "t.yaml", _hf_topology(tmp_path, family, tokenizer="nowhere/tok"))
    with pytest.raises(TopologyError, match=rf"^{re.escape(str(path))}: tokenizer: path does not exist"):
        load_topology(path)
    (tmp_path / "empty_tok").mkdir()
    path = write_topology(tmp_path / "t.yaml", _hf_topology(tmp_path, family, tokenizer="empty_tok"))
    with pytest.raises(TopologyError, match=rf"^{re.escape(str(path))}: tokenizer: cannot load"):
        load_topology(path)


# -- the command line -------------------------------------------------------------------------------

CLI_CASES = [  # (arguments, the option the one-line message must name); the topology does not exist,
    # so exit status 2 (not 1, a TopologyError) shows that nothing was loaded
    (["ab", "--a", "fixed", "--b", "auto", "--prompts", "p", "--out", "o", "--repeats", "0"], "--repeats"),
    (["ab", "--a", "fixed", "--b", "auto", "--prompts", "p", "--out", "o", "--num-prompts", "0"], "--num-prompts"),
    (["ab", "--a", "fixed:lookahead=-1", "--b", "auto", "--prompts", "p", "--out", "o"], "--a"),
    (["bench", "--out", "o", "--batch-sizes", "abc"], "--batch-sizes"),
    (["bench", "--out", "o", "--batch-sizes", "1,0"], "--batch-sizes"),
    (["bench", "--out", "o", "--num-prompts", "-1"], "--num-prompts"),
    (["tune", "--num-prompts", "0"], "--num-prompts"),
    (["tune", "--max-lookahead", "0"], "--max-lookahead"),
    (["demo", "-n", "0"], "--num-prompts"),
    (["generate", "--device", "foo", "x"], "--device"),
    (["generate", "--temperature", "inf", "x"], "--temperature"),
    (["generate", "--temperature", "nan", "x"], "--temperature"),
    (["generate", "--top-p", "0", "x"], "--top-p"),
    (["generate", "--max-new-tokens", "0", "x"], "--max-new-tokens"),
    (["generate", "--seed", "-3", "x"], "--seed"),
    (["generate", "--policy", "nosuch", "x"], "--policy"),
    (["run", "--prompts", "p", "-o", "o", "--limit", "0"], "--limit"),
    (["run", "--prompts", "p", "-o", "o", "--limit", "-1"], "--limit"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes"),
    (["serve", "--allow-policy", "fixed"], "--allow-policy"),  # registered: allowed already
    (["serve", "--allow-policy", "no_such_module:Policy"], "--allow-policy"),
    (["serve", "--allow-policy", "builtins:eval"], "--allow-policy"),  # not a Policy
]


@pytest.mark.parametrize("argv,option", CLI_CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CLI_CASES])
def test_bad_cli_value_is_one_line_and_status_2(tmp_path, capsys, argv, option):
    assert main([*argv, "-t", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}" in err, err


# -- batch jobs (cascade run) ----------------------------------------------------------------------

def _run_files(tmp_path: Path, family: Path, prompts: list[str]) -> tuple[Path, Path]:
    topo = write_topology(tmp_path / "t.yaml", family_topology(
        family, ["small", "large"], policy={"name": "fixed", "params": {"lookahead": 3}}))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return topo, src


def test_run_refuses_its_input_as_output(family, tmp_path, capsys):
    topo, src = _run_files(tmp_path, family, ["x = 1"])
    before = src.read_text()
    assert main(["run", "-t", str(topo), "--prompts", str(src), "-o", str(src)]) == 2  # was exit 0, input lost
    assert "is the input file" in capsys.readouterr().err and src.read_text() == before


def test_run_goes_on_after_a_failing_prompt_and_resumes(family, tmp_path, capsys):
    prompts = ["def f(x):", "x = 1\n" * 300, "import os\n", "class A:"]  # line 2 does not fit the context
    topo, src = _run_files(tmp_path, family, prompts)
    out = tmp_path / "out.jsonl"
    args = ["run", "-t", str(topo), "--prompts", str(src), "-o", str(out), "--max-new-tokens", "6",
            "--temperature", "0.8", "--seed", "3"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{src}:2 (prompt 2/4): prompts: " in err and "context" in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["line"] for x in lines] == [1, 2, 3, 4] and "error" in lines[1] and "context" in lines[1]["error"]
    assert all("error" not in x for x in lines[:1] + lines[2:])
    assert main(args) == 2  # an existing output is not truncated without --resume / --overwrite
    assert "--resume" in capsys.readouterr().err
    # an interrupted job: two whole lines and a torn one; --resume runs only what is missing
    text = out.read_text().splitlines()
    out.write_text(text[0] + "\n" + text[2] + "\n" + text[3][:20])
    assert main([*args, "--resume"]) == 1  # line 2 still fails
    resumed = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["line"] for x in resumed) == [1, 2, 3, 4] and len(resumed) == 4
    by_line = {x["line"]: x for x in resumed}
    assert by_line[4]["token_ids"] == lines[3]["token_ids"]  # prompt i still uses seed + i
    assert "resuming: 2 of 4" in capsys.readouterr().err
    assert main([*args, "--overwrite", "--limit", "1"]) == 0
    assert [json.loads(x)["line"] for x in out.read_text().splitlines()] == [1]
