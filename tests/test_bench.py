"""``cascade bench`` end to end on small real models: files, fields, identical outputs."""
from __future__ import annotations

import json

import pytest

from cascade.cli import main
from conftest import family_topology, write_topology


def test_bench_end_to_end(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "b.yaml", family_topology(
        family, ["tiny", "small", "large"], edges=[["tiny", "small"], ["small", "large"], ["tiny", "large"]],
        policy={"name": "fixed", "params": {"lookahead": {"tiny": 2, "small": 4}}}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n", "class A:\n"]))
    out = tmp_path / "bench"
    code = main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "16",
                 "--only", "hf-assisted:tiny", "--only", "cascade:tiny->large", "--only", "cascade:3level:",
                 "--out", str(out), "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    data = json.loads((out / "bench.json").read_text())
    names = [r["name"] for r in data["reports"]]
    assert names == ["plain", "hf-assisted:tiny", "cascade:tiny->large", "cascade:3level:fixed", "cascade:3level:auto"]
    by_name = {r["name"]: r for r in data["reports"]}
    assert by_name["plain"]["speedup_median"] == 1.0
    assert by_name["plain"]["authority_passes_per_token"] >= 1.0 - 1e-9  # one pass per token (+ prefill)
    for r in data["reports"]:
        assert r["mismatches"] == [], r["name"]
        lo, hi = r["tokens_per_second_ci"]
        assert lo <= r["tokens_per_second_median"] <= hi
    full = by_name["cascade:3level:fixed"]
    assert set(full["acceptance"]) == {"tiny->small", "small->large"}
    assert full["predicted_speedup"] > 0 and full["measured_over_predicted"] > 0
    # The 3-level configurations keep the topology's shortcut: fixed drafts along the chain, auto
    # may take either path, and the prediction is for the best measured one.
    assert full["predicted_path"] == ["tiny", "small", "large"]
    auto = by_name["cascade:3level:auto"]
    assert set(auto["edges"]) == set(full["edges"]) == {"tiny->small", "small->large", "tiny->large"}
    # (these stand-in models are too small for drafting to pay, so auto may stay on the authority)
    assert auto["predicted_path"] in ([], ["tiny", "small", "large"], ["tiny", "large"])
    assert by_name["cascade:tiny->large"]["edges"] == ["tiny->large"]
    assert set(full["level_seconds_per_token"]) == {"tiny", "small", "large"}
    assert full["orchestration_seconds_per_token"] >= 0
    assert len(data["samples"]) == 5 * 3
    for name in ("bench.md", "speedup.png", "acceptance.png", "time_breakdown.png"):
        assert (out / name).stat().st_size > 0
    assert "| cascade:3level:fixed |" in stdout


def test_prediction_follows_the_path_mostly_taken():
    """A configuration whose graph has several paths is predicted on the one its steps mostly took:
    from the authority down, the proposer of each level's most verified blocks; a path probed a
    few times (high, noisy acceptance) does not set the prediction."""
    from cascade.tools.bench import main_path, predicted_seconds_per_token
    from cascade.stats import RequestStats

    stats = RequestStats("large")
    for name, passes, seconds in (("ngram", 0, 0.0), ("tiny", 100, 0.01), ("small", 100, 0.1),
                                  ("large", 100, 1.0)):
        stats.level(name).forward_passes, stats.level(name).seconds = passes, seconds
    for _ in range(200):
        stats.edge("ngram", "tiny").observe(3, 1)
        stats.edge("tiny", "large").observe(4, 2)
    for _ in range(3):  # probes: all accepted
        stats.edge("tiny", "small").observe(4, 4)
        stats.edge("small", "large").observe(4, 4)
    assert main_path(stats) == ("ngram", "tiny", "large")
    assert predicted_seconds_per_token(main_path(stats), stats) > predicted_seconds_per_token(
        ("tiny", "small", "large"), stats)  # the probed path looks better, on 3 blocks
    assert main_path(RequestStats("large")) == ("large",)


def test_bench_batch_sizes(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "b.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n", "class A:\n"]))
    out = tmp_path / "batch"
    assert main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--batch-sizes", "1,3", "--requests", "4", "--repeats", "2", "--out", str(out), "--no-progress"]) == 0
    rows = json.loads((out / "batch.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:  # the same 4 requests served 1 and 3 at a time, twice
        assert r["requests"] == 4 and len(r["ratios"]) == 2
        assert r["plain_tokens_per_second"] > 0 and r["cascade_tokens_per_second"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["ratio"] == pytest.approx(sum(r["ratios"]) / 2)  # the median of two
        assert r["plain_latency_s"] > 0 and r["cascade_latency_s"] > 0
    assert "| 3 |" in capsys.readouterr().out
