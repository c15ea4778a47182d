"""llama.cpp as a baseline row (cascade/tools/llamacpp.py): left out with one line where the
binding or the GGUF is missing; where both are here, a row decoding the pulled model's GGUF from
the same prompt ids. Its speed is measured in docs/benchmarks.md, not asserted here, and its text
is not compared with cascade's (another program, other kernels and rounding)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cascade.cli import main
from cascade.sampling import Sampling
from cascade.tools import llamacpp
from conftest import family_topology, write_topology

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "topologies" / "smollm2.yaml"


def test_the_row_is_skipped_with_one_line_where_the_binding_is_absent(family, tmp_path, capsys, monkeypatch):
    """No binding (as on a machine without it: the module's switch, nothing mocked): the bench runs
    its other rows and says in one line, on stderr and in bench.md, why llama.cpp is not among them."""
    monkeypatch.setattr(llamacpp, "ENABLED", False)
    topo = write_topology(tmp_path / "t.yaml", family_topology(family, ["large"], ngram=True))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}))
    out = tmp_path / "bench"
    code = main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--only", "cascade:authority", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.out
    note = "llama.cpp: skipped: llama-cpp-python is not installed (pip install 'cascade[llama]')"
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["llama_cpp"] == [note]
    assert [r["name"] for r in data["reports"]] == ["plain", "cascade:authority"]
    assert f"- {note}" in (out / "bench.md").read_text()
    assert [line for line in captured.err.splitlines() if "llama.cpp" in line] == [f"cascade bench: {note}"]


def test_a_topology_whose_authority_has_no_gguf_has_no_row(family, tmp_path):
    from cascade.topology import load_topology

    topo = load_topology(write_topology(tmp_path / "t.yaml", family_topology(family, ["large"])))
    path, why = llamacpp.gguf_of(topo)
    assert path is None and "has no GGUF" in why


def test_the_sampler_chain_is_named_as_cascade_warps():
    assert llamacpp.chain_label(Sampling()) == "greedy (argmax)"
    assert llamacpp.chain_label(Sampling(temperature=0.8, top_p=0.95)) == (
        "temperature 0.8 -> top-p 0.95 -> draw, as cascade warps (top-k off on both sides)")
    assert llamacpp.chain_label(Sampling(temperature=0.8, top_k=40, top_p=0.95)) == (
        "temperature 0.8 -> top-k 40 -> top-p 0.95 -> draw, as cascade warps")


def _real_topology():
    pytest.importorskip("llama_cpp")
    from cascade.pull import MANIFEST, cache_dir
    from cascade.topology import load_topology

    if not (cache_dir("smollm2-135m-instruct") / MANIFEST).is_file():
        pytest.skip("smollm2-135m-instruct is not in the cache: cascade pull smollm2-135m-instruct")
    topo = load_topology(REAL)
    if llamacpp.gguf_of(topo)[0] is None:
        pytest.skip("the pulled model's GGUF is not kept beside it: cascade pull --force smollm2-135m-instruct")
    return topo


def _chat_prompt() -> str:
    return json.loads((ROOT / "examples" / "prompts" / "chat-unseen.jsonl").read_text().splitlines()[0])["prompt"]


@pytest.mark.slow
@pytest.mark.real_model
def test_llama_cpp_decodes_the_pulled_gguf_from_the_same_prompt_ids():
    """16 greedy tokens of the real GGUF from the tokenizer's ids: one pass per token, prefill
    timed; a seeded sampled run is repeatable (llama.cpp's own draws, seeded as asked)."""
    from cascade.build import load_tokenizer

    topo = _real_topology()
    tokenizer = load_tokenizer(topo)
    ids = tokenizer.encode(_chat_prompt())
    base, note = llamacpp.baseline(topo, threads=1)
    assert base is not None, note
    try:
        new, seconds, stats = base.generate(ids, 16, Sampling(), 0, tokenizer.eos_token_id)
        assert 0 < len(new) <= 16 and (len(new) == 16 or new[-1] == tokenizer.eos_token_id)
        assert stats.authority_passes == len(new) and 0 < stats.prefill_seconds < seconds
        assert tokenizer.decode(new, skip_special_tokens=True).strip()  # text, not noise of ids
        sampled = Sampling(temperature=0.8, top_p=0.95)
        first = base.generate(ids, 16, sampled, 7, tokenizer.eos_token_id)[0]
        assert base.generate(ids, 16, sampled, 7, tokenizer.eos_token_id)[0] == first
        assert "temperature 0.8 -> top-p 0.95" in base.describe(sampled)
    finally:
        base.close()


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_reports_a_llama_cpp_row_on_the_real_model(tmp_path, capsys):
    """The row runs interleaved with the others and is reported, timed and not checked: its greedy
    text may part from plain decoding's at a near-tie without failing the bench."""
    _real_topology()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": _chat_prompt()}))
    out = tmp_path / "bench"
    code = main(["bench", "--topology", str(REAL), "--prompts", str(prompts), "--max-new-tokens", "16",
                 "--only", "cascade:authority", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().out
    data = json.loads((out / "bench.json").read_text())
    row = next(r for r in data["reports"] if r["name"] == "llama.cpp")
    assert row["tokens_per_second_median"] > 0 and row["mismatches"] == []
    assert row["authority_passes_per_token"] == pytest.approx(1.0)
    assert data["config"]["llama_cpp"][0].startswith("llama.cpp: llama-cpp-python ")
    assert "| llama.cpp |" in (out / "bench.md").read_text()
    assert "not checked (another program" in (out / "bench.md").read_text()
