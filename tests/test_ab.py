"""``cascade ab``: the statistics, and an end-to-end run on small real models."""
from __future__ import annotations

import json

import pytest

from cascade.tools.ab import geometric_mean, geometric_mean_ci, sign_flip_p_value
from cascade.cli import main
from conftest import family_topology, write_topology
from plots import bar_series, line_series, png_size, record_figures


def test_bootstrap_ci_brackets_the_geometric_mean_and_narrows_with_agreement():
    ratios = [1.2, 1.3, 1.1, 1.25, 1.15, 1.22, 1.18, 1.3]
    lo, hi = geometric_mean_ci(ratios)
    assert lo < geometric_mean(ratios) < hi and lo > 1.1 and hi < 1.3
    lo2, hi2 = geometric_mean_ci([1.2] * 8)
    assert lo2 == hi2 == pytest.approx(1.2)
    assert geometric_mean_ci([1.2]) is None  # one prompt: nothing to resample


def test_one_looping_prompt_cannot_carry_the_summary():
    """Five prompts where B is a little slower and one where it loops 50x faster: the arithmetic
    mean of the ratios (9.2) would call B nine times faster; the geometric mean and the median
    stay near the other prompts, the interval spans 1, and the test of the log ratios finds no
    difference."""
    from cascade.tools.ab import Run, summarize

    tokens_per_second_b = [95.0, 96.0, 94.0, 97.0, 95.0, 5000.0]
    runs = [Run(arm, i, 0, 100, 1.0 if arm == "A" else 100 / b, 10, {}, [i]) for i, b in enumerate(tokens_per_second_b)
            for arm in "AB"]
    s = summarize("a", "b", runs, 6, 1, greedy=True)
    assert sum(s.per_prompt_ratio) / 6 > 9
    assert s.median_ratio == pytest.approx(0.955) and s.geomean_ratio == pytest.approx(
        (0.95 * 0.96 * 0.94 * 0.97 * 0.95 * 50) ** (1 / 6))
    assert s.geomean_ratio < 2 and s.ci_low < 1 < s.ci_high and s.p_value > 0.5
    # one prompt: a ratio, but no interval and no verdict
    from cascade.tools.ab import markdown

    one = summarize("a", "b", runs[:2], 1, 1, greedy=True)
    assert one.ci_low is one.ci_high is None and one.geomean_ratio == one.median_ratio == pytest.approx(0.95)
    text = markdown(one, runs[:2], dict(topology="t.yaml", max_new_tokens=4, temperature=0.0, seed=0))
    assert "geometric mean: 0.950** (one prompt: no interval; median 0.950;" in text and "too few prompts" in text


def test_sign_flip_p_value():
    # all 8 ratios above 1: only the all-plus and all-minus flips reach it -> 2 / 256
    assert sign_flip_p_value([1.1, 1.2, 1.3, 1.15, 1.25, 1.05, 1.12, 1.18]) == pytest.approx(2 / 256)
    assert sign_flip_p_value([1.1, 0.9, 1.05, 0.95]) > 0.5
    big = [1.1 + 0.01 * (i % 5) for i in range(40)]  # sampled, not enumerated
    assert sign_flip_p_value(big) < 0.001


def test_ab_end_to_end(family, tmp_path, capsys, monkeypatch):
    figures = record_figures(monkeypatch)
    topo = write_topology(tmp_path / "ab.yaml", family_topology(family, ["tiny", "small", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n", "class A:\n"]))
    out = tmp_path / "report"
    code = main(["ab", "--topology", str(topo), "--a", "fixed:lookahead=2", "--b", "auto:explore=0.2",
                 "--prompts", str(prompts), "--max-new-tokens", "12", "--repeats", "2", "--warmup", "1",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "Per-prompt speed ratio B/A, geometric mean: " in stdout and "identical tokens on every run" in stdout
    assert "; median " in stdout and "test of the log ratios" in stdout
    assert "| repetition of the text (median over prompts) |" in stdout
    data = json.loads((out / "ab.json").read_text())
    s = data["summary"]
    assert s["prompts"] == 3 and s["repeats"] == 2 and len(s["per_prompt_ratio"]) == 3
    assert s["ci_low"] <= s["geomean_ratio"] <= s["ci_high"] and 0 < s["p_value"] <= 1
    assert s["geomean_ratio"] == pytest.approx(geometric_mean(s["per_prompt_ratio"]))
    assert s["median_ratio"] == pytest.approx(sorted(s["per_prompt_ratio"])[1])
    assert s["exactness_failures"] == []
    assert s["a_repetition"] == s["b_repetition"]  # greedy: the same text
    assert len(data["runs"]) == 2 * 3 * 2
    assert {r["arm"] for r in data["runs"]} == {"A", "B"}
    assert "tiny->small" in data["acceptance_by_position"]["A"]
    assert (out / "summary.md").stat().st_size > 0 and data["config"]["machine"]["cpu"]
    assert " Measured " in (out / "summary.md").read_text()
    # the plots: their sizes in pixels, and what the figures ab saved drew
    assert set(figures) == {"speedup.png", "acceptance.png"}
    assert png_size(out / "speedup.png") == (800, 350) and png_size(out / "acceptance.png") == (1000, 350)
    (ax,) = figures["speedup.png"].axes
    assert [bars for _, bars in bar_series(ax)] == [s["per_prompt_ratio"]]  # a bar per prompt
    assert line_series(ax) == {f"geometric mean {s['geomean_ratio']:.3f}": ([0.0, 1.0], [s["geomean_ratio"]] * 2),
                               f"median {s['median_ratio']:.3f}": ([0.0, 1.0], [s["median_ratio"]] * 2)}
    for ax, arm in zip(figures["acceptance.png"].axes, "AB", strict=True):
        assert ax.get_title() == f"{arm}: {s[arm.lower()]}"
        assert line_series(ax) == {edge: ([float(i) for i in range(1, len(rates) + 1)], rates)
                                   for edge, rates in data["acceptance_by_position"][arm].items()}


def test_ab_sampled_takes_top_p_top_k_and_refuses_bad_values(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "ab.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}))
    out = tmp_path / "report"
    args = ["ab", "--topology", str(topo), "--a", "fixed:lookahead=2", "--b", "fixed:lookahead=3",
            "--prompts", str(prompts), "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--out", str(out),
            "--no-progress"]
    assert main(args + ["--temperature", "2", "--top-p", "0.9", "--top-k", "20", "--seed", "4"]) == 0
    stdout = capsys.readouterr().out
    assert "temperature 2.0, top-p 0.9, top-k 20, seed 4" in stdout and "checks it by distribution" in stdout
    config = json.loads((out / "ab.json").read_text())["config"]
    assert (config["top_p"], config["top_k"], config["seed"]) == (0.9, 20, 4)
    for flag, value in (("--top-p", "0"), ("--top-k", "-1"), ("--temperature", "nan"), ("--seed", "x")):
        assert main(args + [flag, value]) == 2
        assert f"argument {flag}" in capsys.readouterr().err


def test_tune_finds_a_lookahead(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "tune.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n"]))
    out = tmp_path / "tune.json"
    assert main(["tune", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--max-lookahead", "3", "--passes", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["lookahead"]) == {"tiny"} and 1 <= data["lookahead"]["tiny"] <= 3
    assert len(data["trials"]) == 3  # the start and the two other values
    assert data["tokens_per_second"] == max(t["tokens_per_second"] for t in data["trials"])
    assert "policy spec: 'fixed:lookahead={tiny:" in capsys.readouterr().out
