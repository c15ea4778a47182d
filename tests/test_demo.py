"""``cascade demo`` end to end on small real models (the bundled family is tested in test_models)."""
from __future__ import annotations

import json
import re

import torch

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
    assert out.splitlines()[1].startswith("torch threads: 1 ")  # chosen, not torch's default, and said
    assert out.splitlines()[2].startswith("Measured ")  # and the machine the figures come from
    # both kinds of text: greedy (identity-checked) and sampled at the default T = 0.8, top-p 0.95
    assert "\ngreedy:\n" in out and "\nT=0.8, top-p 0.95:\n" in out
    assert out.count("plain decoding (large)") == 2 and out.count("cascade (fixed policy)") == 2
    # beside the speedup over plain decoding, the one over the authority alone timed in the same run
    assert out.count("cascade, authority alone") == 2 and out.count("vs authority alone") >= 2
    assert "repetition" in out
    assert "tiny->small" in out and "small->large" in out
    assert "all 2 outputs identical to plain greedy decoding" in out
    assert "checked by distribution: cascade bench --temperature 0.8 --top-p 0.95" in out
    # texts of the first repeat only; figures are medians over the 3 default repeats, with their range
    assert out.count("=== prompt") == 4 and out.count(", greedy (") == 2 and out.count(", T=0.8, top-p 0.95 (") == 2
    assert out.count("median over 3 interleaved repeat(s), min–max in brackets") == 2
    assert re.search(r"cascade \(fixed policy\) +[\d.]+ \([\d.]+–[\d.]+\) +[\d.]+x \([\d.]+–[\d.]+\) +"
                     r"[\d.]+x \([\d.]+–[\d.]+\)", out)
    assert re.search(r"cascade, authority alone +[\d.]+ \([\d.]+–[\d.]+\) +[\d.]+x \([\d.]+–[\d.]+\) +1.00x", out)
    assert re.search(r"of which drafting \(over cascade with the authority alone, in the same run\): greedy: [\d.]+x "
                     r"\([\d.]+–[\d.]+\); T=0.8, top-p 0.95: [\d.]+x \([\d.]+–[\d.]+\)", out)
    assert re.search(r"speedup over plain decoding, median of 3 repeat\(s\) \(min–max\): greedy: [\d.]+x "
                     r"\([\d.]+–[\d.]+\); T=0.8, top-p 0.95: [\d.]+x \([\d.]+–[\d.]+\)", out)
    assert "identical to plain greedy decoding in each of 3 repeats" in out


def test_demo_greedy_only_and_sampling_flags(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "d.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}))
    threads = torch.get_num_threads()
    base = ["demo", "--topology", str(topo), "--prompts", str(prompts), "-n", "1", "--max-new-tokens", "6"]
    assert main(base + ["--temperature", "0", "--quiet", "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "greedy:" in out and "T=" not in out and "=== prompt" not in out
    assert "torch threads: 2 " in out and torch.get_num_threads() == threads  # restored after the run
    # one repeat: a median without a range, and nothing to call the machine busy by
    assert "median of 1 repeat(s): greedy: " in out and "–" not in out.split("median of 1")[1] and "busy" not in out
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


def test_demo_headline_and_busy_warning_on_given_timings(capsys):
    """The headline is each kind's median speedup with its range over the repeats; a range of plain
    decoding's speed wider than the limit is warned of, and a steady speedup beside it is said."""
    from cascade.tools.demo import Mode, _headline

    def mode(label, plain_seconds, cascade_seconds):
        m = Mode(label, None, None, len(plain_seconds))
        m.plain_time = [[96, s] for s in plain_seconds]
        m.cascade_time = [[96, s] for s in cascade_seconds]
        m.alone_time = [[96, s * 0.9] for s in plain_seconds]  # the lean forward alone: 1.11x plain
        return m

    _headline([mode("greedy", [1.0, 1.05, 1.1], [0.8, 0.8, 0.9]), mode("sampled", [1.0, 1.0, 1.0], [0.9, 0.9, 0.9])])
    out = capsys.readouterr().out
    assert "median of 3 repeat(s) (min–max): greedy: 1.25x (1.22–1.31); sampled: 1.11x (1.11–1.11)" in out
    assert "of which drafting (over cascade with the authority alone, in the same run): greedy: 1.12x (1.10–1.18); " \
           "sampled: 1.00x (1.00–1.00)" in out
    assert "busy" not in out
    _headline([mode("greedy", [1.0, 2.0, 1.1], [0.8, 1.6, 0.88])])  # one repeat twice as slow on both sides
    out = capsys.readouterr().out
    assert "greedy plain tok/s ranged 48–96" in out and "The speedups stayed steady" in out
    _headline([mode("greedy", [1.0, 2.0, 1.1], [0.8, 0.8, 0.88])])  # ... on one side only
    out = capsys.readouterr().out
    assert "greedy speedup ranged" in out and "stayed steady" not in out
