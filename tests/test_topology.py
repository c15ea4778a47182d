"""Topology files: loading, graph checks, and one clear error per kind of bad input."""
from __future__ import annotations

import re

import pytest

from cascade import TopologyError, load_topology
from cascade.cli import main
from conftest import family_topology, make_llama, make_tokenizer, write_topology


def table_level(name, **extra):
    return {"name": name, "kind": "table_worker:TableWorker", "params": {"vocab_size": 6}, **extra}


def load(tmp_path, data, name="t.yaml"):
    return load_topology(write_topology(tmp_path / name, data))


def test_chain_by_default_and_paths(family, tmp_path):
    topo = load(tmp_path, family_topology(family, ["tiny", "small", "medium", "large"], ngram=True))
    assert topo.authority == "large"
    assert list(topo.graph.edges) == [("ngram", "tiny"), ("tiny", "small"), ("small", "medium"), ("medium", "large")]
    assert topo.paths() == [["ngram", "tiny", "small", "medium", "large"]]


def test_relative_model_paths_resolve_against_the_yaml(family, tmp_path):
    data = {"levels": [{"name": "large", "model": "../" + family.name + "/large"}]}
    sub = family.parent / "topos"
    sub.mkdir(exist_ok=True)
    topo = load_topology(write_topology(sub / "rel.yaml", data))
    assert topo.model_path(topo.spec.levels[0]) == str((family / "large").resolve())


def test_explicit_dag_edges(tmp_path):
    data = {"levels": [table_level("a"), table_level("b"), table_level("c")],
            "edges": [["a", "b"], ["b", "c"], ["a", "c"]]}
    topo = load(tmp_path, data)
    assert sorted(topo.paths()) == [["a", "b", "c"], ["a", "c"]]


def expect_error(tmp_path, data, *fragments, name="t.yaml"):
    with pytest.raises(TopologyError) as info:
        load(tmp_path, data, name)
    message = str(info.value)
    assert message.startswith(str(tmp_path / name)), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="nope.yaml: topology file not found"):
        load_topology(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path):
    (tmp_path / "bad.yaml").write_text("levels: [\n  - name: a\n  kind: : :\n")
    with pytest.raises(TopologyError, match="bad.yaml: invalid YAML"):
        load_topology(tmp_path / "bad.yaml")


def test_unknown_field(tmp_path):
    expect_error(tmp_path, {"levels": [table_level("a", modle="x")]}, "levels[0].modle", "unknown field")


def test_mistyped_field(tmp_path):
    expect_error(tmp_path, {"levels": [table_level("a", dtype="float8")]}, "levels[0].dtype")
    expect_error(tmp_path, {"levels": [table_level("a", device="gpu")]}, "levels[0].device")
    expect_error(tmp_path, {"levels": [table_level("a")], "sampling": {"top_p": 1.5}}, "sampling.top_p")


def test_hf_level_needs_model(tmp_path):
    expect_error(tmp_path, {"levels": [{"name": "a", "kind": "hf"}]}, "levels[0]", "needs a 'model'")


def test_cycle(tmp_path):
    data = {"levels": [table_level("a"), table_level("b"), table_level("c")],
            "edges": [["a", "b"], ["b", "a"], ["b", "c"]]}
    expect_error(tmp_path, data, "edges", "cycle", "a -> b -> a")


def test_two_sinks(tmp_path):
    data = {"levels": [table_level("a"), table_level("b"), table_level("c")], "edges": [["a", "b"], ["a", "c"]]}
    expect_error(tmp_path, data, "exactly one sink", "'b'", "'c'")


def test_unreachable_level(tmp_path):
    data = {"levels": [table_level("a"), table_level("b"), table_level("orphan")], "edges": [["a", "b"]]}
    expect_error(tmp_path, data, "orphan", "does not reach the authority")


def test_duplicate_names(tmp_path):
    expect_error(tmp_path, {"levels": [table_level("a"), table_level("a")]}, "levels[1].name", "duplicate")


def test_edge_to_unknown_level(tmp_path):
    expect_error(tmp_path, {"levels": [table_level("a")], "edges": [["a", "zz"]]}, "edges[0]", "'zz'")


def test_ngram_cannot_verify(tmp_path):
    data = {"levels": [table_level("a"), {"name": "ng", "kind": "ngram"}]}
    expect_error(tmp_path, data, "levels[1] (ng)", "only propose")


def test_packed_weights_is_for_hf_levels_and_reaches_the_worker(tmp_path, family):
    data = {"levels": [{"name": "ng", "kind": "ngram", "packed_weights": False}, table_level("a")]}
    expect_error(tmp_path, data, "levels[0]", "'packed_weights' is for 'hf' levels")
    from cascade.build import build_worker  # noqa: PLC0415 - the loader a backend calls

    topo = load_topology(write_topology(tmp_path / "f.yaml", family_topology(family, ["tiny", "large"])))
    level = topo.spec.levels[1].model_copy(update={"packed_weights": False})
    assert build_worker(level, topo.model_path(level), 1, topo.source)._pack is False
    assert build_worker(topo.spec.levels[1], topo.model_path(level), 1, topo.source)._pack is None  # where it pays


def test_authority_sampling_override_is_rejected(tmp_path):
    data = {"levels": [table_level("a"), table_level("b", sampling={"temperature": 0.5})]}
    expect_error(tmp_path, data, "levels[1].sampling", "drafts only")


def test_missing_model_path(tmp_path):
    data = {"levels": [{"name": "a", "model": "./does/not/exist"}]}
    expect_error(tmp_path, data, "levels[0].model", "path does not exist")


def test_mismatched_vocabularies(tmp_path):
    a = make_llama(tmp_path / "a", 300, seed=0, tokenizer=make_tokenizer(300))
    b = make_llama(tmp_path / "b", 320, seed=0, tokenizer=make_tokenizer(320))
    data = {"levels": [{"name": "a", "model": str(a)}, {"name": "b", "model": str(b)}]}
    expect_error(tmp_path, data, "levels[0].model", "vocabulary differs", "(b)")


def test_policy_params_checked_against_the_graph(tmp_path):
    from cascade import Cascade

    data = {"levels": [table_level("a"), table_level("b")],
            "policy": {"name": "fixed", "params": {"lookahead": {"zz": 3}}}}
    with pytest.raises(TopologyError, match=r"policy\.params\.lookahead: unknown level"):
        Cascade.from_topology(write_topology(tmp_path / "p.yaml", data))
    data["policy"] = {"name": "nosuch"}
    with pytest.raises(TopologyError, match=r"policy\.name: unknown policy 'nosuch'"):
        Cascade.from_topology(write_topology(tmp_path / "p.yaml", data))


def test_cli_validate(family, tmp_path, capsys):
    path = write_topology(tmp_path / "ok.yaml", family_topology(family, ["tiny", "large"], ngram=True))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "authority: large" in out and "ngram -> tiny -> large" in out
    bad = write_topology(tmp_path / "bad.yaml", {"levels": [table_level("a"), table_level("a")]})
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.yaml" in err and "duplicate" in err


# -- validate's OK means from_topology loads: every 'module:Class' a level names is imported and
# checked (a concrete Worker whose constructor takes the level's params) when the file loads

BAD_WORKERS = [  # (the authority level's changes, what the error says)
    ({"kind": "no_such_module_xyz:Worker"}, r"levels\[1\]\.kind: cannot import 'no_such_module_xyz:Worker': "
                                            r"No module named 'no_such_module_xyz'"),
    ({"kind": "table_worker:NoSuchClass"}, r"levels\[1\]\.kind: cannot import .*no attribute 'NoSuchClass'"),
    ({"kind": "builtins:eval"}, r"levels\[1\]\.kind: 'builtins:eval' is not a Worker subclass"),
    ({"kind": "os:system"}, r"levels\[1\]\.kind: 'os:system' is not a Worker subclass"),
    ({"kind": "workers.base:Worker"}, r"levels\[1\]\.kind: 'workers.base:Worker' is abstract "
                                      r"\(it does not implement score\)"),
    ({"params": {"vocab_size": 6, "colour": "red"}}, r"levels\[1\]\.params: got an unexpected keyword argument "
                                                     r"'colour' \(table_worker:TableWorker takes \(vocab_size"),
    ({"kind": "workers.ngram:NGramWorker", "params": {}}, r"levels\[1\]\.params: missing a required argument: "
                                                          r"'vocab_size'"),
]


@pytest.mark.parametrize("change,says", BAD_WORKERS, ids=[c.get("kind", "params") for c, _ in BAD_WORKERS])
def test_validate_imports_and_checks_every_worker_class(tmp_path, capsys, change, says):
    from cascade import Cascade

    path = write_topology(tmp_path / "w.yaml", {"levels": [table_level("a"), {**table_level("b"), **change}]})
    assert main(["validate", str(path)]) == 1  # was OK
    err = capsys.readouterr().err
    assert re.search(says, err) and err.startswith(f"error: {path}: "), err
    with pytest.raises(TopologyError, match=says):  # loading says the same, before any worker is built
        Cascade.from_topology(path)


def test_a_worker_module_that_fails_on_import_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_worker_mod.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_topology(tmp_path / "w.yaml", {"levels": [table_level("a"),
                                                           {"name": "b", "kind": "broken_worker_mod:W"}]})
    assert main(["validate", str(path)]) == 1
    assert "levels[1].kind: cannot import 'broken_worker_mod:W': RuntimeError: no GPU here" in capsys.readouterr().err


def test_validate_still_accepts_custom_workers_that_load(tmp_path, capsys):
    levels = [{"name": "a", "kind": "workers.ngram:NGramWorker", "params": {"vocab_size": 6, "max_ngram": 2}},
              table_level("b")]
    assert main(["validate", str(write_topology(tmp_path / "w.yaml", {"levels": levels}))]) == 0
    assert "OK (2 levels, authority: b)" in capsys.readouterr().out


@pytest.mark.parametrize("path", [None, 3, ["t.yaml"]])
def test_from_topology_names_a_path_that_is_not_one(path):
    from cascade import Cascade

    with pytest.raises(TopologyError, match=r"^topology: expected the path of a YAML file \(a str or "
                                            r"pathlib\.Path\), got "):
        Cascade.from_topology(path)
