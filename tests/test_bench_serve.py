"""``cascade bench-serve``: its statistics on known timings, its load shapes against a scripted
client (bounds honoured, nothing about speed), and one run against a real ``cascade serve``."""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cascade.tools import bench_serve as bs
from conftest import family_topology, write_topology
from plots import bar_series, line_series, png_size, record_figures, same_pixels, tick_labels

sys.path.insert(0, str(Path(__file__).parent / "serve"))
from serve_util import ROOT, serve  # noqa: E402


# -- statistics on known timings ---------------------------------------------------------------

def test_chunk_token_counts_match_the_usage_total():
    # by characters: 2, 4 and 2 characters share 8 tokens as 2, 4, 2
    assert bs.chunk_token_counts(["ab", "cdef", "gh"], 8) == [2, 4, 2]
    # largest remainders: 1:1:1 of 4 tokens gives one chunk the extra token, the counts sum to 4
    counts = bs.chunk_token_counts(["a", "b", "c"], 4)
    assert sum(counts) == 4 and sorted(counts) == [1, 1, 2]
    # a tokenizer counts the cumulative text: "hel" + "lo" is one word, not two
    words = lambda text: len(text.split())  # noqa: E731 - a one-line stand-in tokenizer
    assert bs.chunk_token_counts(["one tw", "o three", " four five"], 5, words) == [2, 1, 2]
    # the server's count wins where the tokenizer disagrees (here it found 5, usage says 10)
    assert bs.chunk_token_counts(["one tw", "o three", " four five"], 10, words) == [4, 2, 4]
    assert bs.chunk_token_counts([], 3) == [] and bs.chunk_token_counts(["x", ""], 0) == [0, 0]


def test_inter_token_latency_counts_a_chunk_of_k_tokens_as_k_gaps():
    # chunks at 0, 1, 3 and 3.5 s bringing 2, 1, 4 and 1 tokens
    per_token, raw = bs.per_token_gaps([0.0, 1.0, 3.0, 3.5], [2, 1, 4, 1])
    assert raw == [1.0, 2.0, 0.5]
    assert per_token == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]  # 1 gap of 1 s, 4 of 2/4 s, 1 of 0.5 s
    assert len(per_token) == 8 - 2  # every token but the first chunk's has a gap
    # a chunk with no token passes its gap to the next one
    per_token, raw = bs.per_token_gaps([0.0, 1.0, 2.0], [1, 0, 2])
    assert raw == [1.0, 1.0] and per_token == [1.0, 1.0]


def test_request_metrics_ttft_tpot_e2e():
    r = bs.Record(start=10.0, end=12.5, chunk_times=[10.5, 11.0, 12.0], chunk_texts=["aa", "bb", "cc"], tokens=6)
    m = bs.request_metrics(r)
    assert m.ttft == pytest.approx(0.5) and m.e2e == pytest.approx(2.5)
    assert m.tpot == pytest.approx((12.5 - 10.5) / 5)  # (end - first token) / (tokens - 1)
    assert m.chunk_gaps == pytest.approx([0.5, 1.0])
    assert m.itl == pytest.approx([0.25, 0.25, 0.5, 0.5])  # 2 tokens per chunk
    one = bs.request_metrics(bs.Record(start=0.0, end=1.0, chunk_times=[0.4], chunk_texts=["x"], tokens=1))
    assert one.tpot is None and one.itl == [] and one.ttft == pytest.approx(0.4)


def test_distribution_median_p99():
    d = bs.distribution([x / 1000 for x in range(1, 101)])  # 1..100 ms
    assert d["n"] == 100 and d["median_ms"] == pytest.approx(50.5) and d["mean_ms"] == pytest.approx(50.5)
    assert d["p99_ms"] == pytest.approx(99.01) and d["p90_ms"] == pytest.approx(90.1)
    assert bs.distribution([])["median_ms"] is None


def test_summary_of_a_run():
    ok = [bs.Record(start=0.0, end=2.0, chunk_times=[0.5, 1.0], chunk_texts=["a", "b"], tokens=4),
          bs.Record(start=1.0, end=4.0, chunk_times=[2.0, 3.0], chunk_texts=["a", "b"], tokens=6)]
    bad = [bs.Record(start=1.5, end=1.6, error="HTTP 429: server overloaded", status=429),
           bs.Record(start=2.0, cancelled=True)]
    s = bs.summarize(ok + bad)
    assert (s["requests"], s["completed"], s["failed"], s["cancelled"]) == (4, 2, 1, 1)
    assert s["duration_s"] == pytest.approx(4.0)  # first sent (0) to last finished (4)
    assert s["request_throughput"] == pytest.approx(0.5) and s["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["tpot"]["median_ms"] == pytest.approx(1e3 * (1.5 / 3 + 2.0 / 5) / 2)
    assert s["tokens_per_chunk"] == pytest.approx(10 / 4)
    assert s["errors"] == {"HTTP 429: server overloaded": 1}
    table = bs.markdown_table([{"label": "x", "summary": s}, {"label": "none", "summary": bs.summarize(bad)}])
    assert "| x | 0.50 | 2.5 | - |" in table and "| none | - | - | - |" in table  # one repeat: no range
    assert "busy" not in table


def _repeat(tokens: int, seconds: float) -> list[bs.Record]:
    """One repeat of a single request: ``tokens`` tokens in ``seconds``, chunks at even steps."""
    times = [seconds * (i + 1) / tokens for i in range(tokens)]
    return [bs.Record(start=0.0, end=seconds, chunk_times=times, chunk_texts=["x"] * tokens, tokens=tokens)]


def test_repeats_give_medians_with_their_range_and_a_busy_warning():
    steady = bs.summarize_repeats([_repeat(10, 1.0), _repeat(10, 1.05), _repeat(10, 0.95)])
    assert steady["repeats"] == 3 and len(steady["by_repeat"]) == 3
    assert steady["output_tokens_per_s"] == pytest.approx(10.0)  # the median repeat, not a pooled rate
    assert steady["spread"]["output_tokens_per_s"] == pytest.approx(
        {"median": 10.0, "min": 10 / 1.05, "max": 10 / 0.95, "repeats": 3})
    assert steady["completed"] == 3 and steady["tpot"]["n"] == 3  # latencies pool every repeat's requests
    stalled = bs.summarize_repeats([_repeat(10, 1.0), _repeat(10, 3.0), _repeat(10, 1.1)])  # one slow repeat
    assert stalled["output_tokens_per_s"] == pytest.approx(10 / 1.1)
    table = bs.markdown_table([{"label": "steady", "summary": steady}, {"label": "stalled", "summary": stalled}])
    assert "| steady | 1.00 | 10.0 | 9.5–10.5 |" in table and "| stalled | 0.91 | 9.1 | 3.3–10.0 |" in table
    assert table.count("warning: the machine looks busy") == 1
    assert "stalled out tok/s ranged 3.33–10" in table and "stalled median TPOT ranged" in table
    assert "steady out tok/s" not in table
    assert bs.summarize_repeats([_repeat(10, 1.0)]) == bs.summarize(_repeat(10, 1.0))  # one repeat: as before


def test_a_report_names_the_machine_and_its_bf16_features():
    from cascade.tools.timing import machine, machine_line

    m = machine()
    assert m["cpus"] >= 1 and m["torch"] and m["transformers"] and len(m["date"]) == 10
    line = machine_line({"date": "2026-12-06", "cpu": "AMD EPYC", "cpu_features": ["AVX-512 BF16", "AVX2"],
                         "cpus": 2, "gpu": None, "torch": "2.13.0", "transformers": "5.25.0"})
    assert line == ("Measured 2026-12-06 on AMD EPYC (AVX-512 BF16, AVX2), 2 CPUs, no GPU; torch 2.13.0, "
                    "transformers 5.25.0.")
    bare = machine_line(m | {"cpu_features": []})  # none of the features a bf16 pass's cost depends on: said
    assert "none of AMX-BF16, AVX-512 BF16" in bare


def test_loopback_only():
    for url in ["http://127.0.0.1:8000/v1", "http://127.1.2.3:1/v1/", "http://[::1]:8000/v1", "http://localhost:80"]:
        assert bs.loopback_url(url) == url.rstrip("/")
    for url in ["http://10.0.0.1:8000/v1", "http://example.com/v1", "http://0.0.0.0:8000", "ftp://127.0.0.1/",
                "127.0.0.1:8000"]:
        with pytest.raises(ValueError):
            bs.loopback_url(url)
    refused = subprocess.run([sys.executable, "-c", "import sys; from cascade.cli import main; sys.exit(main())",
                              "bench-serve", "--base-url", "http://192.168.1.1:8000/v1", "--prompts", "x"],
                             capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and "--base-url: must be a loopback address" in refused.stderr


def test_poisson_arrivals_are_seeded():
    a = bs.arrival_times(2000, rate=4.0, seed=3)
    assert a == bs.arrival_times(2000, rate=4.0, seed=3) and a != bs.arrival_times(2000, rate=4.0, seed=4)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0 and min(gaps) >= 0
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.25 * 4 / math.sqrt(len(gaps))  # mean 1/rate, 4 sigma


# -- load shapes against a scripted client -----------------------------------------------------

class ScriptedClient:
    """Streams ``chunks`` chunks of one token each, ``delay`` seconds apart, then a usage chunk;
    records how many requests were in flight at once."""

    def __init__(self, chunks: int = 3, delay: float = 0.01):
        self.chunks, self.delay = chunks, delay
        self.in_flight = self.most_in_flight = self.sent = 0
        self.bodies: list[dict] = []
        self.completions = SimpleNamespace(create=self._create)

    async def _create(self, **body):
        self.sent += 1
        self.bodies.append(body)
        return self._stream()

    async def _stream(self):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for _ in range(self.chunks):
                await asyncio.sleep(self.delay)
                yield SimpleNamespace(choices=[SimpleNamespace(text="x")], usage=None)
            yield SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=self.chunks, prompt_tokens=2))
        finally:
            self.in_flight -= 1


def test_closed_loop_keeps_the_concurrency_and_the_request_count():
    client = ScriptedClient()
    load = bs.Load(["p0", "p1"], num_requests=7, max_seconds=60, concurrency=3,
                   body={"max_tokens": 3, "temperature": 0.0, "seed": 10, "top_k": 5})
    records = asyncio.run(bs.run_load(client, "m", load))
    assert len(records) == 7 == client.sent and all(r.ok and r.tokens == 3 for r in records)
    assert client.most_in_flight == 3
    assert sorted(b["seed"] for b in client.bodies) == list(range(10, 17))  # request i: seed + i
    assert all(b["extra_body"] == {"top_k": 5} and b["stream_options"] == {"include_usage": True}
               for b in client.bodies)
    assert sorted(b["prompt"] for b in client.bodies) == ["p0"] * 4 + ["p1"] * 3


def test_poisson_load_with_a_cap_and_the_time_bound():
    client = ScriptedClient()
    load = bs.Load(["p"], num_requests=5, max_seconds=60, concurrency=2, rate=50.0)
    records = asyncio.run(bs.run_load(client, "m", load))
    assert len(records) == 5 and all(r.ok for r in records) and client.most_in_flight <= 2
    # requests still streaming at --max-seconds are cancelled, counted apart, left out of latencies
    slow = ScriptedClient(chunks=1000, delay=0.05)
    records = asyncio.run(bs.run_load(slow, "m", bs.Load(["p"], num_requests=3, max_seconds=0.3, concurrency=3)))
    assert [r.cancelled for r in records] == [True] * 3 and slow.in_flight == 0
    assert bs.summarize(records)["completed"] == 0


# -- against a real server ---------------------------------------------------------------------

def test_against_cascade_serve(family, tmp_path, monkeypatch):
    topo = write_topology(tmp_path / "t.yaml", family_topology(
        family, ["small", "large"], ngram=True, name="served",
        policy={"name": "fixed", "params": {"lookahead": {"ngram": 3, "small": 4}}}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["def fibonacci(n):\n", "class Stack:\n    def push(self, x):", "import os\n"]))
    out = tmp_path / "out"
    with serve(topo, "--max-num-seqs", "4", log_dir=tmp_path) as served:
        run = subprocess.run(
            [sys.executable, "-c", "import sys; from cascade.cli import main; sys.exit(main())", "bench-serve",
             "--base-url", served.base, "--prompts", str(prompts), "--concurrency", "2", "--num-requests", "2",
             "--repeats", "2",
             "--max-tokens", "12", "--seed", "1", "--temperature", "0.8", "--tokenizer", str(family / "large"),
             "--label", "cascade c=2", "--json", str(out / "r.json"), "--markdown", str(out / "r.md"),
             "--plot", str(out / "r.png")], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        metrics = served.get("/metrics").text
    result = json.loads((out / "r.json").read_text())
    s = result["summary"]
    assert result["model"] == "served" and (s["requests"], s["completed"], s["failed"]) == (4, 4, 0)
    # two repeats of two requests: the distributions pool all four, the throughput is a median with a range
    assert result["repeats"] == 2 and [r["repeat"] for r in result["records"]] == [0, 0, 1, 1]
    assert len(s["by_repeat"]) == 2 and s["spread"]["output_tokens_per_s"]["repeats"] == 2
    assert "out tok/s by repeat" in run.stdout
    assert s["output_tokens"] == sum(r["tokens"] for r in result["records"])
    assert all(0 < r["tokens"] <= 12 for r in result["records"])
    assert s["ttft"]["n"] == 4 and s["itl"]["n"] == s["output_tokens"] - 4 - _tokens_in_first_chunks(
        result, bs._token_counter(str(family / "large")))
    assert "| cascade c=2 |" in (out / "r.md").read_text()
    assert result["machine"]["cpu"] and (out / "r.md").read_text().startswith("Measured ")  # the machine, named
    _check_run_plot(out / "r.png", result, tmp_path, monkeypatch)
    # the server counted the same tokens (and the warm-up request's)
    generated = [line for line in metrics.splitlines() if line.startswith("cascade:generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) >= s["output_tokens"]
    # --table renders saved runs side by side
    table = subprocess.run([sys.executable, "-c", "import sys; from cascade.cli import main; sys.exit(main())",
                            "bench-serve", "--table", str(out / "r.json"), str(out / "r.json"),
                            "--plot", str(out / "t.png")], capture_output=True, text=True, cwd=ROOT)
    assert table.returncode == 0 and table.stdout.count("| cascade c=2 |") == 2
    _check_table_plot(out / "t.png", [result, result], tmp_path, monkeypatch)


# The plots come from another process: each is checked for its size in pixels, and for showing
# the same pixels as a plot rendered here from the saved run(s), whose figure shows the series.

def _check_run_plot(path, result, tmp_path, monkeypatch):
    """Three panels of empirical CDFs, in ms: TTFT, TPOT, and the gaps per token and between chunks."""
    assert png_size(path) == (1430, 396)
    figures = record_figures(monkeypatch)
    bs.plot_run(result, result["raw_s"], tmp_path / "run.png")
    assert same_pixels(path, tmp_path / "run.png")
    fig = figures["run.png"]
    assert fig.get_suptitle() == "cascade c=2"
    for ax, keys in zip(fig.axes, (["ttft"], ["tpot"], ["itl", "chunk_gap"]), strict=True):
        want = {}
        for key in keys:
            xs = sorted(1e3 * x for x in result["raw_s"][key])
            if xs:
                want[{"itl": "per token", "chunk_gap": "between chunks"}.get(key, key)] = (
                    xs, [(i + 1) / len(xs) for i in range(len(xs))])
        assert line_series(ax) == want
    assert result["raw_s"]["ttft"] and result["raw_s"]["itl"]  # something was drawn


def _check_table_plot(path, results, tmp_path, monkeypatch):
    """Each run's output tokens/s and median TPOT, side by side."""
    assert png_size(path) == (1320, 264)
    figures = record_figures(monkeypatch)
    bs.plot_table(results, tmp_path / "table.png")
    assert same_pixels(path, tmp_path / "table.png")
    tps, tpot = figures["table.png"].axes
    assert tick_labels(tps) == [r["label"] for r in results]
    assert [bars for _, bars in bar_series(tps)] == [[r["summary"]["output_tokens_per_s"] for r in results]]
    assert [bars for _, bars in bar_series(tpot)] == [[r["summary"]["tpot"]["median_ms"] for r in results]]


def _tokens_in_first_chunks(result, count) -> int:
    """Tokens after the first in each request's first chunk (they have no gap either)."""
    return sum(bs.chunk_token_counts(r["chunk_texts"], r["tokens"], count)[0] - 1 for r in result["records"])


def test_a_mixed_length_load_reports_short_and_long_requests_apart():
    """--long-prompt-tokens / --long-every: requests 0, K, 2K, ... send the long prompt, and the
    short and long requests' time to first token are reported apart."""
    client = ScriptedClient()
    load = bs.Load(["p0", "p1"], num_requests=7, max_seconds=60, concurrency=1, long_prompt="LONG", long_every=3)
    records = asyncio.run(bs.run_load(client, "m", load))
    assert [b["prompt"] for b in client.bodies] == ["LONG", "p1", "p0", "LONG", "p0", "p1", "LONG"]
    assert [r.long for r in records] == [True, False, False, True, False, False, True]
    s = bs.summarize(records)
    assert s["by_length"]["short"]["ttft"]["n"] == 4 and s["by_length"]["long"]["ttft"]["n"] == 3
    line = bs.length_lines([{"label": "mixed", "summary": s}])
    assert line.startswith("mixed: short (4) TTFT med / p99 ms ") and "long (3, [2] prompt tokens)" in line
    assert "by_length" not in bs.summarize(records[1:3]) and bs.length_lines([{"label": "x", "summary": bs.summarize(records[1:3])}]) == ""
