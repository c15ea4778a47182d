"""``cascade bench`` end to end on small real models: files, fields, identical outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cascade.cli import main
from conftest import family_topology, write_topology
from plots import bar_series, line_series, png_size, record_figures, tick_labels


def test_bench_end_to_end(family, tmp_path, capsys, monkeypatch):
    figures = record_figures(monkeypatch)
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
    # plain and cascade:authority run whatever --only says: every speedup is over both
    assert names == ["plain", "cascade:authority", "hf-assisted:tiny", "cascade:tiny->large", "cascade:3level:fixed",
                     "cascade:3level:auto"]
    by_name = {r["name"]: r for r in data["reports"]}
    assert by_name["plain"]["speedup_median"] == 1.0
    # what drafting bought: each configuration's speed over the authority alone, in the same run
    assert by_name["cascade:authority"]["speedup_over_authority_median"] == 1.0
    samples = {(s["config"], s["prompt"]): s["tokens"] / s["seconds"] for s in data["samples"]}
    for r in data["reports"]:
        want = sorted(samples[(r["name"], i)] / samples[("cascade:authority", i)] for i in range(3))[1]
        assert r["speedup_over_authority_median"] == pytest.approx(want), r["name"]
        lo, hi = r["speedup_over_authority_ci"]
        assert lo <= r["speedup_over_authority_median"] <= hi
    assert data["config"]["left_out"] == []
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
    # (these stand-in models are too small for drafting to pay, so auto may stay on the authority;
    # any path of the topology is its to take)
    assert auto["predicted_path"] in ([], ["tiny", "small", "large"], ["tiny", "large"], ["small", "large"])
    assert by_name["cascade:tiny->large"]["edges"] == ["tiny->large"]
    assert set(full["level_seconds_per_token"]) == {"tiny", "small", "large"}
    assert full["orchestration_seconds_per_token"] >= 0
    assert len(data["samples"]) == 6 * 3
    assert (out / "bench.md").stat().st_size > 0
    # the report names the machine its figures were measured on (bf16's cost differs by CPU)
    assert data["config"]["machine"]["cpus"] >= 1 and (out / "bench.md").read_text().startswith("Measured ")
    # one mode: one panel per plot; the speedup plot's height grows with the configurations (5)
    _check_plots(out, figures, data["reports"], {"speedup.png": (700, 470), "acceptance.png": (600, 350),
                                                 "time_breakdown.png": (800, 400)})
    assert "| cascade:3level:fixed |" in stdout and "| speedup vs plain | speedup vs cascade:authority |" in stdout
    # torch's threads chosen and said; one repeat: a speedup per repeat of one, no range column
    assert data["config"]["threads"] == 1 and "torch threads: 1" in stdout
    assert all(len(r["speedup_by_repeat"]) == 1 for r in data["reports"]) and "speedup by repeat" not in stdout
    assert "one repeat, so no range over repeats" in stdout


def _check_plots(out, figures, reports, sizes):
    """bench's three plots: their sizes in pixels, and what the figures it saved drew, per mode
    (side by side): each configuration's speedup (all prompts, non-loop prompts), the acceptance
    by draft position of the configuration with the most edges, and the time per token by level."""
    modes = list(dict.fromkeys(r["mode"] for r in reports))
    cascade_reports = [r for r in reports if r["acceptance_by_position"]]
    assert set(figures) == set(sizes)
    for name, size in sizes.items():
        assert png_size(out / name) == size, name
    # the panels share their y axis: the first one's labels name every panel's bars
    for ax, mode in zip(figures["speedup.png"].axes, modes, strict=True):
        rows = [r for r in reports if r["mode"] == mode]
        assert ax.get_title() == mode and tick_labels(figures["speedup.png"].axes[0]) == [r["name"] for r in rows]
        assert bar_series(ax) == [("all prompts", [r["speedup_median"] for r in rows]),
                                  (f"{rows[0]['nonloop_prompts']} non-loop prompts",
                                   [r["speedup_nonloop_median"] or 0.0 for r in rows])]
    for ax, mode in zip(figures["acceptance.png"].axes, modes, strict=True):
        rows = [r for r in cascade_reports if r["mode"] == mode]
        full = max(rows, key=lambda r: len(r["acceptance_by_position"]))
        assert ax.get_title() == f"acceptance by draft position: {full['name']} ({mode})"
        assert line_series(ax) == {edge: ([float(i) for i in range(1, len(rates) + 1)], rates)
                                   for edge, rates in full["acceptance_by_position"].items()}
    levels = sorted({level for r in cascade_reports for level in r["level_seconds_per_token"]})
    for ax, mode in zip(figures["time_breakdown.png"].axes, modes, strict=True):
        rows = [r for r in cascade_reports if r["mode"] == mode]
        assert ax.get_title() == mode
        assert tick_labels(figures["time_breakdown.png"].axes[0]) == [r["name"] for r in rows]
        want = [(level, [1000 * r["level_seconds_per_token"].get(level, 0.0) for r in rows]) for level in levels]
        want.append(("orchestration", [1000 * r["orchestration_seconds_per_token"] for r in rows]))
        assert [(label, pytest.approx(ms)) for label, ms in want] == bar_series(ax)


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
    assert json.loads((out / "batch.json").read_text())["machine"]["cpu"]
    assert (out / "batch.md").read_text().startswith("Measured ")
    for r in rows:  # the same 4 requests served 1 and 3 at a time, twice
        assert r["requests"] == 4 and len(r["ratios"]) == 2
        assert r["plain_tokens_per_second"] > 0 and r["cascade_tokens_per_second"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["ratio"] == pytest.approx(sum(r["ratios"]) / 2)  # the median of two
        assert r["plain_latency_s"] > 0 and r["cascade_latency_s"] > 0
        assert len(r["plain_tokens_per_second_by_repeat"]) == len(r["cascade_tokens_per_second_by_repeat"]) == 2
    stdout = capsys.readouterr().out
    assert "| 3 |" in stdout and "Torch threads: 1." in stdout


def _report(name: str, by_repeat: list[float], tokens_per_second: list[float]):
    from cascade.tools.bench import ConfigReport

    return ConfigReport(name, "greedy", 100.0, (90.0, 110.0), 1.2, (1.1, 1.3), 0.5, speedup_by_repeat=by_repeat,
                        tokens_per_second_by_repeat=tokens_per_second)


def test_bench_speedup_by_repeat_on_given_samples():
    """Per repeat: the median over prompts of this configuration's tokens/s over plain's in that
    repeat; one slow repeat of plain decoding (repeat 1) shows as a wide range."""
    from cascade.tools.bench import Config, Sample, summarize

    seconds = {("plain", 0): [1.0, 1.0], ("plain", 1): [3.0, 3.0], ("plain", 2): [1.0, 1.2],
               ("c", 0): [0.5, 0.8], ("c", 1): [0.6, 0.8], ("c", 2): [0.5, 0.6]}
    samples = [Sample(name, "greedy", i, r, 10, secs[i], 10, [1, 2, 3]) for (name, r), secs in seconds.items()
               for i in range(2)]
    plain, c = summarize([Config("plain", "plain"), Config("c", "hf")], samples, 2, "greedy", repeats=3)
    assert plain.speedup_by_repeat == [1.0, 1.0, 1.0]
    assert plain.tokens_per_second_by_repeat == pytest.approx([10.0, 10 / 3, 20 / 2.2])
    assert c.speedup_by_repeat == pytest.approx([(2.0 + 1.25) / 2, (5.0 + 3.75) / 2, (2.0 + 2.0) / 2])


def test_bench_summary_gives_the_range_over_repeats_and_warns_on_a_busy_machine():
    """On given numbers: each speedup's median and range over the repeats, and the warning names
    exactly the figures whose range is wider than the limit."""
    from cascade.tools.bench_report import batch_markdown, markdown

    config = dict(topology="t.yaml", prompts=3, repeats=3, max_new_tokens=16, threads=1)
    steady = [_report("plain", [1.0] * 3, [90.0, 95.0, 100.0]), _report("cascade:a", [1.2, 1.25, 1.3], [110.0] * 3)]
    md = markdown(steady, config)
    assert "torch threads: 1" in md and "median (min–max) over the 3 repeats" in md
    assert "| speedup by repeat |" in md and "| 1.25x (1.20–1.30) |" in md and "busy" not in md
    busy = [_report("plain", [1.0] * 3, [45.0, 90.0, 100.0]), _report("cascade:a", [0.4, 1.2, 1.3], [110.0] * 3),
            _report("cascade:b", [1.1, 1.15, 1.2], [100.0] * 3)]
    md = markdown(busy, config)
    (warning,) = [line for line in md.splitlines() if "warning: the machine looks busy" in line]
    assert "plain tok/s ranged 45–100" in warning and "cascade:a speedup ranged 0.4–1.3" in warning
    assert "cascade:b" not in warning  # steady: not blamed
    rows = [{"batch_size": 4, "requests": 8, "repeats": 3, "ratio": 1.5, "ratio_min": 1.4, "ratio_max": 1.6,
             "ratios": [1.4, 1.5, 1.6], "plain_tokens_per_second_by_repeat": [50.0, 100.0, 98.0],
             "plain_tokens_per_second": 98.0, "cascade_tokens_per_second": 140.0, "plain_latency_s": 1.0,
             "cascade_latency_s": 0.7, "plain_repetition": 0.1, "cascade_repetition": 0.1}]
    md = batch_markdown(rows, "t.yaml", 16, threads=1)
    assert "Torch threads: 1." in md and "| 1.50x [1.40–1.60] |" in md
    assert "B=4 plain tok/s ranged 50–100" in md and "B=4 cascade ÷ plain" not in md
    rows[0]["plain_tokens_per_second_by_repeat"] = [95.0, 100.0, 98.0]
    assert "busy" not in batch_markdown(rows, "t.yaml", 16, threads=1)


def test_bench_batch_sizes_sampled(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "b.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n"]))
    out = tmp_path / "batch"
    assert main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--batch-sizes", "2", "--requests", "2", "--temperature", "3", "--top-p", "0.95", "--seed", "1",
                 "--exactness-draws", "40", "--out", str(out), "--no-progress"]) == 0
    data = json.loads((out / "batch.json").read_text())
    assert {k: data["sampling"][k] for k in ("temperature", "top_k", "top_p")} == {
        "temperature": 3.0, "top_k": 0, "top_p": 0.95} and data["seed"] == 1
    (row,) = data["rows"]
    assert row["mode"] == "T=3, top-p 0.95" and 0 <= row["plain_repetition"] <= 1 and 0 <= row["cascade_repetition"] <= 1
    check = data["distribution"]
    assert check["config"] == "cascade, batch size 2" and check["draws"] == 40 and check["passed"]
    assert "Exactness by distribution (cascade, batch size 2)" in capsys.readouterr().out


# -- sampling, repetition and the distribution check ------------------------------------------


def test_homogeneity_on_hand_made_samples():
    from cascade.tools.exactness import homogeneity

    same = [1] * 50 + [2] * 30 + [3] * 20
    stat, dof, p, columns = homogeneity(same, list(reversed(same)))
    assert (stat, dof, p, columns) == (0.0, 2, 1.0, 3)
    # rare outcomes (expected count < 5) share one column; here too few to stand alone: merged
    stat, dof, p, columns = homogeneity(same + [7, 8], same + [9, 9])
    assert columns == 3 and p > 0.5
    # one outcome only: nothing to test
    assert homogeneity([4] * 30, [4] * 30)[2] == 1.0
    far = homogeneity([1] * 80 + [2] * 20, [1] * 20 + [2] * 80)
    assert far[2] < 1e-12


def test_distribution_check_passes_the_cascade_and_fails_a_wrong_sampler(tmp_path):
    """The bench's check on the bundled models at T = 0.8, top-p 0.95: the cascade (tiny -> large)
    against plain sampling of the authority passes; plain sampling at T = 1.5 (a negative control)
    fails the same bound. Fixed seeds: the outcome is deterministic."""
    import torch

    from cascade import Cascade
    from cascade.sampling import Sampling
    from cascade.tools.baselines import generate_kwargs, load_prompts
    from cascade.tools.exactness import P_BOUND, check_distribution, uncertain_prefix

    models = Path(__file__).resolve().parents[1] / "examples" / "models"
    topo = write_topology(tmp_path / "t.yaml", {"name": "t", "levels": [
        {"name": n, "model": str(models / n), "device": "cpu"} for n in ("tiny", "large")],
        "policy": {"name": "fixed", "params": {"lookahead": {"tiny": 3}}}})
    asked = Sampling(temperature=0.8, top_p=0.95)
    n = 300
    with Cascade.from_topology(topo) as c:
        model, eos = c.workers["large"].model, c.tokenizer.eos_token_id
        prompts = [c.tokenizer.encode(p) for p in load_prompts(models.parents[1] / "examples/prompts/heldout.jsonl", 6)]
        i, length = uncertain_prefix(model, prompts, asked)
        ids = prompts[i][:length]

        def plain(sampling, seed):
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=2, num_return_sequences=n, **generate_kwargs(sampling))
            return out[:, len(ids):].tolist()

        reference = plain(asked, 0)
        cascade = [g.token_ids for g in c.generate([ids] * n, max_new_tokens=2, temperature=0.8, top_p=0.95,
                                                   seed=1, batch_size=50)]
        good = check_distribution("cascade", reference, cascade, eos=eos, prompt=(i, length))
        wrong = check_distribution("T=1.5", reference, plain(Sampling(temperature=1.5, top_p=0.95), 5), eos=eos)
    assert good.passed and good.p_value > 0.01, good
    assert not wrong.passed and wrong.p_value <= P_BOUND, wrong
    assert (good.prompt, good.prompt_tokens) == (i, length) and len(good.position_p_values) == 2
    assert good.total_variation == good.position_total_variations[0] < wrong.total_variation


def test_bench_sampled_with_greedy_side_by_side(family, tmp_path, capsys, monkeypatch):
    figures = record_figures(monkeypatch)
    topo = write_topology(tmp_path / "b.yaml", family_topology(
        family, ["tiny", "large"], policy={"name": "fixed", "params": {"lookahead": {"tiny": 3}}}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "import os\n", "class A:\n"]))
    out = tmp_path / "bench"
    # the test family's logits are sharp: a high temperature makes the first tokens uncertain
    code = main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--only", "cascade:tiny->large", "--only", "hf-prompt-lookup", "--temperature", "3", "--top-p", "0.95",
                 "--seed", "7", "--with-greedy", "--exactness-draws", "60", "--out", str(out), "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["modes"] == ["greedy", "T=3, top-p 0.95"] and data["config"]["seed"] == 7
    rows = {(r["mode"], r["name"]): r for r in data["reports"]}
    assert set(rows) == {(m, c) for m in data["config"]["modes"] for c in ("plain", "cascade:authority",
                                                                             "hf-prompt-lookup", "cascade:tiny->large")}
    for r in data["reports"]:
        assert 0.0 <= r["repetition_median"] <= 1.0 and r["exact"], r
        assert 0 <= r["nonloop_prompts"] <= 3
        assert (r["speedup_nonloop_median"] is None) == (r["nonloop_prompts"] == 0)
    greedy, sampled = rows[("greedy", "cascade:tiny->large")], rows[("T=3, top-p 0.95", "cascade:tiny->large")]
    assert greedy["distribution"] is None and greedy["mismatches"] == []
    check = sampled["distribution"]
    assert check["draws"] == 60 and check["tokens"] == 2 and check["passed"] and check["p_value"] > 1e-3
    assert rows[("T=3, top-p 0.95", "hf-prompt-lookup")]["distribution"] is None  # transformers' own
    samples = data["samples"]
    assert len(samples) == 2 * 4 * 3
    # the sampled runs really sampled: prompts x configurations not all equal to greedy
    by = {(s["mode"], s["config"], s["prompt"]): s["token_ids"] for s in samples}
    assert any(by[("greedy", c, i)] != by[("T=3, top-p 0.95", c, i)] for c in ("plain", "cascade:tiny->large")
               for i in range(3))
    assert "| configuration | speedup, greedy |" in stdout and "Exactness by distribution" in stdout
    assert "not checked (transformers' own sampler)" in stdout
    assert "| speedup, greedy | vs cascade:authority, greedy |" in stdout
    # two modes side by side: twice as wide; 4 configurations a mode
    _check_plots(out, figures, data["reports"], {"speedup.png": (1400, 380), "acceptance.png": (1200, 350),
                                                 "time_breakdown.png": (1600, 400)})


def test_bench_exit_status_says_a_distribution_failure(family, tmp_path, monkeypatch, capsys):
    import cascade.tools.exactness as exactness

    real = exactness.check_distribution

    def failing(*args, **kwargs):
        check = real(*args, **kwargs)
        check.p_value = 0.0
        return check

    monkeypatch.setattr(exactness, "check_distribution", failing)
    topo = write_topology(tmp_path / "b.yaml", family_topology(family, ["tiny", "large"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}))
    code = main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--only", "cascade:tiny->large", "--temperature", "2", "--exactness-draws", "20",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2
    assert "EXACTNESS FAILURE" in captured.err and "cascade:tiny->large (T=2)" in captured.err
    assert "**FAILS** (p = 0, TV " in captured.out


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "0"),
                                        ("--top-p", "1.5"), ("--top-k", "-2"), ("--seed", "-1"),
                                        ("--temperature", "inf")])
def test_bench_refuses_bad_sampling_values(flag, value, capsys):
    assert main(["bench", "--out", "x", flag, value]) == 2  # refused while parsing, before any model loads
    assert f"argument {flag}" in capsys.readouterr().err


def bench_reports(topo, tmp_path, capsys, prompts, *args):
    """``cascade bench`` on ``prompts`` (strings) with ``args``; its reports by name."""
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    out = tmp_path / "bench"
    code = main(["bench", "--topology", str(topo), "--prompts", str(path), *args, "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().out
    return {r["name"]: r for r in json.loads((out / "bench.json").read_text())["reports"]}


def test_every_edge_into_the_authority_has_a_speculative_row(family, tmp_path, capsys):
    """A 2-level ngram -> authority topology gets its cascade:ngram->large row (not only the
    authority alone and transformers' prompt lookup)."""
    topo = write_topology(tmp_path / "n.yaml", family_topology(family, ["large"], ngram=True))
    reports = bench_reports(topo, tmp_path, capsys, ["def f(x):\n    return f(x)\ndef f(x):\n"],
                            "--max-new-tokens", "8", "--only", "cascade:")
    assert {"cascade:authority", "cascade:ngram->large"} <= set(reports)
    assert reports["cascade:ngram->large"]["edges"] == ["ngram->large"]
    assert reports["cascade:ngram->large"]["mismatches"] == []


def test_bench_times_a_tree_beside_its_chain(family, tmp_path, capsys):
    topo = write_topology(tmp_path / "b.yaml", family_topology(
        family, ["small", "large"], policy={"name": "fixed", "params": {"lookahead": {"small": 3}}}))
    by_name = bench_reports(topo, tmp_path, capsys, ["def f(x):\n", "import os\n"], "--max-new-tokens", "16",
                            "--only", "cascade:small->large", "--tree", "3,2,1")
    assert set(by_name) == {"plain", "cascade:authority", "cascade:small->large", "cascade:small->large:tree3x2x1"}
    tree = by_name["cascade:small->large:tree3x2x1"]
    assert tree["mismatches"] == [] and tree["edges"] == ["small->large"]


def test_a_topology_with_a_head_gets_a_row_for_itself_under_auto(family, tmp_path, capsys):
    """A head beside an independent drafter is on no chain path: the topology as written gets its
    own auto row (edges as written), beside the head's and the drafter's edge rows."""
    from transformers import AutoModelForCausalLM

    from workers.head import random_head

    random_head(AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float64),
                seed=3).save_pretrained(tmp_path / "head")
    data = family_topology(family, ["small", "large"], ngram=True)
    data["levels"].insert(1, {"name": "head", "kind": "head", "model": str(tmp_path / "head"), "features_of": "large"})
    data["edges"] = [["head", "large"], ["ngram", "small"], ["small", "large"]]
    topo = write_topology(tmp_path / "h.yaml", data)
    reports = bench_reports(topo, tmp_path, capsys, ["def f(x):\n"], "--max-new-tokens", "8", "--only", "cascade:")
    assert {"cascade:head->large", "cascade:small->large", "cascade:test:auto"} <= set(reports)
    assert all(r["mismatches"] == [] for r in reports.values())


def test_an_only_that_names_no_configuration_is_an_error(family, tmp_path, capsys):
    """A misspelt --only is refused before anything runs, with the configurations it could name."""
    topo = write_topology(tmp_path / "b.yaml", family_topology(family, ["tiny", "large"], edges=[["tiny", "large"]]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}))
    code = main(["bench", "--topology", str(topo), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--only", "cascade:tiny->large", "--only", "cascade:nosuch:auto", "--out", str(tmp_path / "o"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "'cascade:nosuch:auto' matches no configuration" in err and "cascade:tiny->large" in err
    assert not (tmp_path / "o" / "bench.json").exists()


def test_assisted_generation_is_left_out_where_it_cannot_apply():
    """transformers' assisted generation needs a transformers drafter over the authority's own
    token ids: a trimmed draft vocabulary, another vocabulary size or no model at all is a
    reason to leave its row out (said before anything runs), never a traceback minutes in."""
    from types import SimpleNamespace

    from cascade.tools.baselines import assisted_unfit

    def level(vocab: int, draft_vocab=None):
        config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=vocab))
        return SimpleNamespace(model=SimpleNamespace(config=config, generate=None), draft_vocab=draft_vocab)

    authority = level(320)
    assert assisted_unfit(level(320), authority) is None
    assert "trimmed draft vocabulary" in assisted_unfit(level(8193, draft_vocab=object()), authority)
    assert assisted_unfit(level(400), authority) == "has a vocabulary of 400 tokens, the authority 320"
    assert "not a transformers model" in assisted_unfit(SimpleNamespace(), authority)
