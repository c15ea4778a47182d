"""``cascade run`` in-process: JSONL in, one result per line out, in input order."""
from __future__ import annotations

import json
from pathlib import Path

from cascade import Cascade
from cascade.cli import main
from conftest import family_topology, write_topology

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:"]


def test_run_writes_results_in_input_order(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "t.yaml", family_topology(
        family, ["small", "large"], policy={"name": "fixed", "params": {"lookahead": 3}}))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)) + "\n")
    out = tmp_path / "deep" / "out.jsonl"
    args = ["run", "-t", str(topo), "--prompts", str(src), "--output", str(out), "--max-new-tokens", "10",
            "--temperature", "0.9", "--seed", "4"]
    assert main(args) == 0
    assert "3 prompts, 30 tokens" in capsys.readouterr().out
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == PROMPTS
    assert {"text", "token_ids", "finish_reason", "stats"} <= set(lines[0])
    assert all(x["stats"]["new_tokens"] == 10 for x in lines)
    # prompt i uses seed + i: the same tokens as generate() on the list
    with Cascade.from_topology(topo) as c:
        expected = c.generate(PROMPTS, max_new_tokens=10, temperature=0.9, seed=4)
    assert [x["token_ids"] for x in lines] == [g.token_ids for g in expected]
    assert [x["text"] for x in lines] == [g.text for g in expected]


def test_run_reports_bad_input(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "t.yaml", family_topology(family, ["large"]))
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "no prompt field"}\n')
    assert main(["run", "-t", str(topo), "--prompts", str(src), "--output", str(tmp_path / "o.jsonl")]) == 1
    assert "prompts:" in capsys.readouterr().err
    src.write_text('{"prompt": "x = 1"}\n')
    assert main(["run", "-t", str(topo), "--prompts", str(src), "--output", str(tmp_path / "o.jsonl"),
                 "--backend", "local", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_run_output_under_a_file_is_refused(tmp_path, capsys):
    """-o file.jsonl/x.jsonl: one line naming the file in the way, exit 2, no traceback."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x = 1"}\n')
    (tmp_path / "file.jsonl").write_text("")
    for out in ("file.jsonl/x.jsonl", "file.jsonl/deeper/x.jsonl"):
        assert main(["run", "--prompts", str(src), "--output", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert err == f"cascade run: error: --output {tmp_path / out}: {tmp_path / 'file.jsonl'} is a file, " \
                      "not a folder; choose another path\n"


def test_a_policy_spec_error_says_what_a_spec_is(capsys):
    from policies import REGISTRY

    """'fixed:3' reads as a 'module:Class' path: the error says the syntax and the registered names."""
    assert main(["generate", "--policy", "fixed:3", "x"]) == 2
    err = capsys.readouterr().err
    assert "argument --policy: " in err and "(got 'fixed:3')" in err
    assert "a spec is NAME[:key=value,...]" in err and "fixed:lookahead={tiny: 3}" in err
    assert f"({', '.join(sorted(REGISTRY))})" in err


# -- the topology a command runs when it is run outside the checkout (issue 56) ----------------------

def _pulled(tmp_path, monkeypatch, pulled: bool) -> None:
    """A model cache of its own, holding the real model's manifest (as ``cascade pull`` leaves it) or not."""
    from cascade.cli.args import REAL_MODEL
    from cascade.pull import MANIFEST

    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path / "cache"))
    if pulled:
        folder = tmp_path / "cache" / "models" / REAL_MODEL
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text("{}")


def test_outside_the_checkout_the_bundled_topologies_are_found(tmp_path, monkeypatch):
    from cascade.cli.args import DEFAULT_TOPOLOGY, REAL_TOPOLOGY, main_topology

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    said = []
    _pulled(tmp_path, monkeypatch, pulled=True)  # the model is pulled: the real topology, nothing said
    assert main_topology(said.append) == str(root / REAL_TOPOLOGY) and said == []
    _pulled(tmp_path / "other", monkeypatch, pulled=False)  # not pulled: the family, and how to pull it
    assert main_topology(said.append) == str(root / DEFAULT_TOPOLOGY)
    assert "cascade pull" in said[0]


def test_a_missing_topology_file_is_named_with_where_the_bundled_ones_live(tmp_path, monkeypatch, capsys):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    _pulled(tmp_path, monkeypatch, pulled=True)
    assert main(["generate", "-t", "topologies/smollm2.yaml", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: topologies/smollm2.yaml: topology file not found")
    assert f"relative to {tmp_path}" in err and str(root / "topologies") in err
    assert "cascade pull" not in err  # the model is there: pulling it again would not help


def test_no_bundled_topologies_at_all_is_named_not_blamed_on_the_model(tmp_path, monkeypatch, capsys):
    import cascade.cli.args as cli_args

    monkeypatch.chdir(tmp_path)
    _pulled(tmp_path, monkeypatch, pulled=True)
    monkeypatch.setattr(cli_args, "bundled_topologies", lambda: None)  # as from an installed wheel
    assert main(["generate", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: topologies/4level.yaml: topology file not found") and "--topology" in err, err
    assert "cascade pull" not in err
