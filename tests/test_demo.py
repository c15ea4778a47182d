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
    assert "plain decoding (large)" in out and "cascade (fixed policy)" in out
    assert "tiny->small" in out and "small->large" in out
    assert "all 2 outputs identical to plain greedy decoding" in out
    assert out.count("=== prompt") == 2


def test_demo_reports_a_bad_prompts_file(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "d.yaml", family_topology(family, ["large"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert main(["demo", "--topology", str(topo), "--prompts", str(bad)]) == 1
    assert "bad.jsonl:1" in capsys.readouterr().err
