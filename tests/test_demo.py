"""``cascade demo`` end to end on small real models (the bundled family is tested in test_models)."""
from __future__ import annotations

import json

from cascade.cli import main
from conftest import family_topology, write_topology


def test_demo_runs_and_reports(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "d.yaml", family_topology(
        family, ["tiny", "small", "large"], policy={"name": "fixed", "params": {"lookahead": {"tiny": 2, "small": 4}}}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n", "class A:\n"]))
    code = main(["demo", "--topology", str(topo), "--prompts", str(prompts), "-n", "2", "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "not a coding assistant" in out.splitlines()[0]
    # both kinds of text: greedy (identity-checked) and sampled at the default T = 0.8, top-p 0.95
    assert "\ngreedy:\n" in out and "\nT=0.8, top-p 0.95:\n" in out
    assert out.count("plain decoding (large)") == 2 and out.count("cascade (fixed policy)") == 2
    assert "repetition" in out
    assert "tiny->small" in out and "small->large" in out
    assert "all 2 outputs identical to plain greedy decoding" in out
    assert "checked by distribution: cascade bench --temperature 0.8 --top-p 0.95" in out
    assert out.count("=== prompt") == 4 and out.count(", greedy (") == 2 and out.count(", T=0.8, top-p 0.95 (") == 2


def test_demo_greedy_only_and_sampling_flags(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "d.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}))
    base = ["demo", "--topology", str(topo), "--prompts", str(prompts), "-n", "1", "--max-new-tokens", "6"]
    assert main(base + ["--temperature", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "greedy:" in out and "T=" not in out and "=== prompt" not in out
    assert main(base + ["--temperature", "1.5", "--top-k", "5", "--top-p", "1", "--seed", "3", "--quiet"]) == 0
    assert "T=1.5, top-k 5:" in capsys.readouterr().out
    assert main(base + ["--top-p", "2"]) == 2
    assert "argument --top-p" in capsys.readouterr().err


def test_demo_reports_a_bad_prompts_file(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "d.yaml", family_topology(family, ["large"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert main(["demo", "--topology", str(topo), "--prompts", str(bad)]) == 1
    assert "bad.jsonl:1" in capsys.readouterr().err
