"""``cascade bench-serve``: a load generator for any OpenAI-compatible endpoint on this machine.

Sends streaming completions (or chat completions) to ``--base-url`` (loopback addresses only),
either from ``--concurrency`` clients that each send their next request as soon as the last one
ends, or as Poisson arrivals at ``--request-rate`` requests per second (at most
``--concurrency`` in flight when both are given), until ``--num-requests`` have been sent or
``--max-seconds`` have passed (requests still running then are cancelled and counted apart).

What is measured, per request (times on the client's clock):

- TTFT: from sending the request to the first chunk that carries text;
- TPOT = (end - first token) / (tokens - 1), where end is the end of the stream and tokens is
  the completion's token count from the final usage chunk (``stream_options.include_usage``):
  a chunk is not a token (cascade commits several tokens per step);
- inter-token latency *per token*: a chunk that brought k tokens, g seconds after the previous
  chunk, counts k gaps of g / k; the raw gaps between chunks are reported beside it. How many
  tokens each chunk brought is counted with ``--tokenizer`` (the cumulative text re-tokenized)
  or, without one, in proportion to its characters, then matched to the usage total;
- end-to-end latency.

Over the run: requests and output tokens per second (over the time from the first request sent
to the last one finished), and the median, mean and p99 of each latency. With ``--repeats`` N
the same load is sent N times in a row: the throughputs and median latencies become the median
over the repeats with their range (min–max), the latency distributions pool every repeat's
requests, and a range that shows the machine (client and server share it) was busy is named
in a warning (:mod:`cascade.tools.timing`). Written as JSON
(``--json``), a markdown table (``--markdown``, also printed) and a PNG of the latency
distributions (``--plot``). ``--table A.json B.json ...`` renders earlier runs side by side
instead (markdown, and ``--plot`` a chart of output tokens/s).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from cascade.cli import args as types
from cascade.tools.timing import Spread, busy_warning, machine, machine_line

# -- what one request recorded -----------------------------------------------------------------


@dataclass
class Record:
    """One request as the client saw it. ``chunk_times[i]`` is when the i-th chunk carrying
    text arrived and ``chunk_texts[i]`` that text; ``tokens`` is the usage count."""

    start: float
    end: float = math.nan
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    status: int | None = None  # the HTTP status of a refused request
    cancelled: bool = False  # still running at --max-seconds
    long: bool = False  # sent the long prompt of a mixed-length load (--long-prompt-tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.tokens is not None


def chunk_token_counts(texts: Sequence[str], total: int,
                       count: Callable[[str], int] | None = None) -> list[int]:
    """How many of the ``total`` tokens each chunk brought.

    ``count(text)`` gives the token count of a text (a tokenizer); the cumulative text is
    counted, so a word split across chunks is not counted twice. Without it a chunk's share is
    its share of the characters. Either estimate is then matched to ``total`` (the server's
    own count) by largest remainders, so the counts always sum to ``total``.
    """
    if not texts:
        return []
    if count is not None:
        weights, seen, text = [], 0, ""
        for t in texts:
            text += t
            now = count(text)
            weights.append(max(0, now - seen))
            seen = max(seen, now)
    else:
        weights = [len(t) for t in texts]
    return _apportion(weights, total)


def _apportion(weights: Sequence[float], total: int) -> list[int]:
    if total <= 0:
        return [0] * len(weights)
    mass = float(sum(weights))
    if mass <= 0:  # nothing to go by: spread evenly
        weights, mass = [1.0] * len(weights), float(len(weights))
    exact = [w * total / mass for w in weights]
    counts = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def per_token_gaps(times: Sequence[float], counts: Sequence[int]) -> tuple[list[float], list[float]]:
    """(inter-token latency per token, raw gaps between chunks). The first chunk's tokens have
    no gap (that is TTFT); chunk i > 0 brought ``counts[i]`` tokens ``g`` seconds after chunk
    i - 1: each counts ``g / counts[i]``. A chunk with no token (text the tokenizer merged into
    the next one) passes its gap on to the next chunk that has one."""
    per_token: list[float] = []
    raw: list[float] = []
    carried = 0.0
    for i in range(1, len(times)):
        gap = times[i] - times[i - 1]
        raw.append(gap)
        carried += gap
        if counts[i] > 0:
            per_token.extend([carried / counts[i]] * counts[i])
            carried = 0.0
    return per_token, raw


@dataclass
class RequestMetrics:
    ttft: float
    tpot: float | None  # None for a one-token completion
    e2e: float
    tokens: int
    itl: list[float]
    chunk_gaps: list[float]


def request_metrics(r: Record, count: Callable[[str], int] | None = None) -> RequestMetrics:
    """TTFT, TPOT, end-to-end latency and the inter-token gaps of one finished request."""
    tokens = int(r.tokens or 0)
    first = r.chunk_times[0] if r.chunk_times else r.end
    tpot = (r.end - first) / (tokens - 1) if tokens > 1 else None
    counts = chunk_token_counts(r.chunk_texts, tokens, count)
    itl, raw = per_token_gaps(r.chunk_times, counts)
    return RequestMetrics(first - r.start, tpot, r.end - r.start, tokens, itl, raw)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, mean, p90 and p99 (linear interpolation between order statistics), in ms."""
    xs = sorted(values)
    if not xs:
        return {"n": 0, "median_ms": None, "mean_ms": None, "p90_ms": None, "p99_ms": None}
    return {"n": len(xs), "median_ms": 1e3 * _quantile(xs, 0.5), "mean_ms": 1e3 * sum(xs) / len(xs),
            "p90_ms": 1e3 * _quantile(xs, 0.9), "p99_ms": 1e3 * _quantile(xs, 0.99)}


def _quantile(xs: Sequence[float], q: float) -> float:  # xs sorted
    pos = q * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[Record], count: Callable[[str], int] | None = None) -> dict[str, Any]:
    """The run's figures from its records (see the module docstring)."""
    done = [r for r in records if r.ok]
    metrics = [request_metrics(r, count) for r in done]
    if done:
        duration = max(r.end for r in done) - min(r.start for r in records)
    else:
        duration = math.nan
    tokens = sum(m.tokens for m in metrics)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = r.error[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records), "completed": len(done),
        "failed": sum(r.error is not None for r in records),
        "cancelled": sum(r.cancelled for r in records),
        "duration_s": duration,
        "request_throughput": len(done) / duration if done and duration > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if done and duration > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "ttft": distribution([m.ttft for m in metrics]),
        "tpot": distribution([m.tpot for m in metrics if m.tpot is not None]),
        "itl": distribution([g for m in metrics for g in m.itl]),
        "chunk_gap": distribution([g for m in metrics for g in m.chunk_gaps]),
        "e2e": distribution([m.e2e for m in metrics]),
        "tokens_per_chunk": tokens / max(1, sum(len(r.chunk_times) for r in done)) if done else None,
        "errors": errors,
        **({"by_length": by_length(done, count)} if any(r.long for r in records) else {}),
    }


def by_length(done: Sequence[Record], count: Callable[[str], int] | None = None) -> dict[str, Any]:
    """A mixed-length load's latencies apart: the short requests' and the long ones'."""
    out = {}
    for name, long in (("short", False), ("long", True)):
        metrics = [request_metrics(r, count) for r in done if r.long == long]
        out[name] = {"ttft": distribution([m.ttft for m in metrics]), "e2e": distribution([m.e2e for m in metrics]),
                     "prompt_tokens": sorted({r.prompt_tokens for r in done if r.long == long and r.prompt_tokens})}
    return out


def length_lines(results: Sequence[dict[str, Any]]) -> str:
    """One line per mixed-length run: time to first token and end to end, short and long apart."""
    def ms(d, key):
        return "-" if d[key]["median_ms"] is None else f"{d[key]['median_ms']:.0f} / {d[key]['p99_ms']:.0f}"

    lines = []
    for res in results:
        split = res["summary"].get("by_length")
        if split:
            short, long = split["short"], split["long"]
            lines.append(f"{res['label']}: short ({short['ttft']['n']}) TTFT med / p99 ms {ms(short, 'ttft')}, "
                         f"e2e {ms(short, 'e2e')}; long ({long['ttft']['n']}, {long['prompt_tokens']} prompt "
                         f"tokens) TTFT {ms(long, 'ttft')}, e2e {ms(long, 'e2e')}")
    return "\n".join(lines)


# Figures of one repeat whose spread over repeats is reported (name -> how to read it off a summary)
_REPEATED: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "request_throughput": lambda s: s["request_throughput"],
    "output_tokens_per_s": lambda s: s["output_tokens_per_s"],
    "ttft_median_ms": lambda s: s["ttft"]["median_ms"],
    "tpot_median_ms": lambda s: s["tpot"]["median_ms"],
}


def summarize_repeats(per_repeat: Sequence[Sequence[Record]],
                      count: Callable[[str], int] | None = None) -> dict[str, Any]:
    """:func:`summarize` of every repeat's requests pooled, with, for more than one repeat, each
    figure of ``_REPEATED`` per repeat (``by_repeat``) and its median and range (``spread``); the
    throughputs become the median over the repeats (a slow repeat moves them less than a pool)."""
    summary = summarize([r for rs in per_repeat for r in rs], count)
    if len(per_repeat) < 2:
        return summary
    figures = [{k: get(summarize(rs, count)) for k, get in _REPEATED.items()} for rs in per_repeat]
    spread = {k: Spread.of(f[k] for f in figures).to_dict() for k in _REPEATED
              if all(f[k] is not None for f in figures)}
    summary.update(repeats=len(per_repeat), by_repeat=figures, spread=spread)
    for k in ("request_throughput", "output_tokens_per_s"):
        summary[k] = spread[k]["median"] if k in spread else None
    return summary


def run_warning(result: dict[str, Any]) -> str | None:
    """The busy-machine warning for one run's summary (None: steady, or a single repeat)."""
    names = {"output_tokens_per_s": "out tok/s", "tpot_median_ms": "median TPOT"}
    spread = result["summary"].get("spread", {})
    return busy_warning({f"{result['label']} {name}": Spread(d["median"], d["min"], d["max"], d["repeats"])
                         for key, name in names.items() if (d := spread.get(key))})


# -- the load ----------------------------------------------------------------------------------


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash if its host is a loopback address; else ValueError.
    Host names other than ``localhost`` are refused without being looked up."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL such as http://127.0.0.1:8000/v1 (got {url!r})")
    host = parts.hostname
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"must be a loopback address (127.0.0.0/8, ::1 or localhost); got host {host!r}")
    return url.rstrip("/")


@dataclass
class Load:
    """What to send and how. ``rate`` None: closed loop, ``concurrency`` clients back to back."""

    prompts: list[str]
    num_requests: int
    max_seconds: float
    concurrency: int | None = 1
    rate: float | None = None
    chat: bool = False
    body: dict[str, Any] = field(default_factory=dict)  # max_tokens, temperature, seed, ...
    arrival_seed: int = 0
    long_prompt: str | None = None  # a mixed-length load: request i sends it where i % long_every == 0
    long_every: int = 0

    def prompt(self, i: int) -> tuple[str, bool]:
        """Request ``i``'s prompt, and whether it is the long one."""
        if self.long_prompt is not None and self.long_every and i % self.long_every == 0:
            return self.long_prompt, True
        return self.prompts[i % len(self.prompts)], False


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: offsets in seconds of ``n`` requests at ``rate`` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(client, model: str, load: Load) -> list[Record]:
    """Send the requests of ``load``; every record, in the order the requests were sent."""
    records: list[Record] = []
    deadline = time.perf_counter() + load.max_seconds
    limit = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def one(i: int) -> None:
        r = Record(start=time.perf_counter())
        records.append(r)
        try:
            await asyncio.wait_for(_stream(client, model, load, i, r),
                                   max(0.0, deadline - r.start))
        except asyncio.TimeoutError:
            r.cancelled = True

    async def gated(i: int) -> None:
        if limit is None:
            return await one(i)
        async with limit:
            if time.perf_counter() < deadline:
                await one(i)

    if load.rate is None:  # closed loop: each client sends its next request when one ends
        counter = iter(range(load.num_requests))

        async def client_loop() -> None:
            for i in counter:
                if time.perf_counter() >= deadline:
                    return
                await one(i)
        await asyncio.gather(*(client_loop() for _ in range(load.concurrency or 1)))
        return records
    tasks = []
    t0 = time.perf_counter()
    for i, at in enumerate(arrival_times(load.num_requests, load.rate, load.arrival_seed)):
        wait = t0 + at - time.perf_counter()
        if t0 + at >= deadline:
            break
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(gated(i)))
    await asyncio.gather(*tasks)
    return records


async def _stream(client, model: str, load: Load, i: int, r: Record) -> None:
    import openai

    prompt, r.long = load.prompt(i)
    body = dict(load.body)
    if body.get("seed") is not None:  # request i samples with seed + i
        body["seed"] += i
    extra = {k: body.pop(k) for k in [k for k in body if k not in _OPENAI_FIELDS]}
    kwargs = dict(model=model, stream=True, stream_options={"include_usage": True},
                  extra_body=extra or None, **body)
    stream = None
    try:
        if load.chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kwargs)
        else:
            stream = await client.completions.create(prompt=prompt, **kwargs)
        async for chunk in stream:
            now = time.perf_counter()
            text = _chunk_text(chunk, load.chat)
            if text:
                r.chunk_times.append(now)
                r.chunk_texts.append(text)
            usage = getattr(chunk, "usage", None)
            if usage is not None and usage.completion_tokens is not None:
                r.tokens = int(usage.completion_tokens)
                r.prompt_tokens = usage.prompt_tokens
        r.end = time.perf_counter()
        if r.tokens is None:
            r.error = "no usage chunk: the server ignored stream_options.include_usage"
    except openai.APIStatusError as exc:
        r.end, r.status = time.perf_counter(), exc.status_code
        r.error = f"HTTP {exc.status_code}: {_message(exc)}"
    except openai.APIError as exc:  # an error event inside the stream, or the connection
        r.end = time.perf_counter()
        r.error = f"{type(exc).__name__}: {_message(exc)}"
    finally:  # cancelled at --max-seconds too: close the connection, so the server cancels it
        close = getattr(stream, "close", None) or getattr(stream, "aclose", None)
        if close is not None:
            await close()


_OPENAI_FIELDS = {"max_tokens", "temperature", "top_p", "seed", "stop"}


def _chunk_text(chunk, chat: bool) -> str:
    if not chunk.choices:
        return ""
    c = chunk.choices[0]
    return (c.delta.content or "") if chat else (c.text or "")


def _message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(exc)


# -- reports -----------------------------------------------------------------------------------

_COLUMNS = [("req/s", lambda s: s["request_throughput"], "{:.2f}"),
            ("out tok/s", lambda s: s["output_tokens_per_s"], "{:.1f}"),
            ("out tok/s by repeat", lambda s: _range(s, "output_tokens_per_s"), "{:.1f}–{:.1f}"),
            ("TTFT med / p99 ms", lambda s: (s["ttft"]["median_ms"], s["ttft"]["p99_ms"]), "{:.0f} / {:.0f}"),
            ("TPOT med / p99 ms", lambda s: (s["tpot"]["median_ms"], s["tpot"]["p99_ms"]), "{:.1f} / {:.1f}"),
            ("ITL/token med / p99 ms", lambda s: (s["itl"]["median_ms"], s["itl"]["p99_ms"]), "{:.1f} / {:.1f}"),
            ("chunk gap med / p99 ms", lambda s: (s["chunk_gap"]["median_ms"], s["chunk_gap"]["p99_ms"]),
             "{:.1f} / {:.1f}"),
            ("tok/chunk", lambda s: s["tokens_per_chunk"], "{:.2f}"),
            ("done / failed", lambda s: (s["completed"], s["failed"] + s["cancelled"]), "{} / {}")]


def _range(summary: dict[str, Any], key: str) -> tuple[float | None, float | None]:
    d = summary.get("spread", {}).get(key)
    return (d["min"], d["max"]) if d else (None, None)


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per run: its label and the columns above (throughputs: the median over the repeats,
    their range beside them; "-" for a single repeat), then a warning for each run whose range
    says the machine was busy."""
    head = "| run | " + " | ".join(c for c, _, _ in _COLUMNS) + " |"
    rows = [head, "|" + "---|" * (len(_COLUMNS) + 1)]
    for res in results:
        s = res["summary"]
        cells = []
        for _, get, fmt in _COLUMNS:
            value = get(s)
            values = value if isinstance(value, tuple) else (value,)
            cells.append("-" if any(v is None for v in values) else fmt.format(*values))
        rows.append(f"| {res['label']} | " + " | ".join(cells) + " |")
    warnings = [w for w in map(run_warning, results) if w]
    return "\n".join(rows + ([""] + [f"**{w}**" for w in warnings] if warnings else []))


def plot_run(result: dict[str, Any], raw: dict[str, list[float]], path: Path) -> None:
    """Empirical CDFs of TTFT, TPOT and inter-token latency (per token and per chunk), in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, keys, title in zip(axes, (["ttft"], ["tpot"], ["itl", "chunk_gap"]),
                               ("time to first token", "time per output token", "inter-token latency")):
        for key in keys:
            xs = sorted(1e3 * x for x in raw[key])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label={"itl": "per token", "chunk_gap": "between chunks"}.get(key, key))
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    axes[0].set_ylabel("fraction of requests / gaps")
    fig.suptitle(result["label"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_table(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Output tokens/s and median TPOT of each run, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results]
    tps = [r["summary"]["output_tokens_per_s"] or 0.0 for r in results]
    tpot = [r["summary"]["tpot"]["median_ms"] or 0.0 for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(labels) + 1.5))
    for ax, values, title in zip(axes, (tps, tpot), ("output tokens/s", "median TPOT (ms)")):
        ax.barh(range(len(labels)), values)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_yticks(range(len(labels)), [""] * len(labels))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line ------------------------------------------------------------------------------


_DESCRIPTION = __doc__.split(": ", 1)[1].replace("``", "'")
_DESCRIPTION = _DESCRIPTION[0].upper() + _DESCRIPTION[1:]


def add_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="load-test an OpenAI-compatible endpoint on this machine",
                       description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: cascade bench-serve --base-url http://127.0.0.1:8000/v1 "
                              "--prompts examples/prompts/heldout.jsonl --concurrency 4 --num-requests 32 "
                              "--max-tokens 64 --tokenizer examples/models/large --json out.json")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", type=_base_url,
                   help="the endpoint's /v1 URL; loopback addresses only (default http://127.0.0.1:8000/v1)")
    p.add_argument("--model", default=None, help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--prompts", required=False, default=None, metavar="JSONL",
                   help='one {"prompt": ...} per line, sent in order and cycled')
    p.add_argument("--concurrency", type=types.positive_int, default=None,
                   help="clients sending back to back (default 1); with --request-rate: most in flight")
    p.add_argument("--request-rate", type=_rate, default=None, metavar="R",
                   help="Poisson arrivals at R requests per second instead of back-to-back clients")
    p.add_argument("--num-requests", type=types.positive_int, default=None,
                   help="requests to send (default: one per prompt)")
    p.add_argument("--max-seconds", type=_rate, default=600.0,
                   help="stop after this long; requests still running are cancelled (default 600)")
    p.add_argument("--warmup", type=types.nonnegative_int, default=1,
                   help="requests sent one at a time first, not counted (default 1)")
    p.add_argument("--repeats", type=types.positive_int, default=1,
                   help="send the same load this many times in a row; throughputs and median latencies are then the "
                        "median over the repeats with their range, and a wide range is warned of (default 1)")
    p.add_argument("--max-tokens", type=types.positive_int, default=64)
    p.add_argument("--temperature", type=types.temperature, default=0.0)
    p.add_argument("--top-p", type=types.top_p, default=None)
    p.add_argument("--seed", type=types.seed, default=None,
                   help="request seed (request i gets seed + i) and the Poisson arrivals' seed")
    p.add_argument("--long-prompt-tokens", type=types.positive_int, default=None, metavar="N",
                   help="a mixed-length load: every --long-every-th request (the first included) sends a prompt of "
                        "N tokens (the prompts' texts cycled, counted with --tokenizer, which it needs); the short "
                        "and long requests' latencies are reported apart")
    p.add_argument("--long-every", type=types.positive_int, default=4, metavar="K",
                   help="with --long-prompt-tokens: requests 0, K, 2K, ... are long (default 4)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer to count each chunk's tokens (default: in proportion to characters)")
    p.add_argument("--label", default=None, help="the run's name in the table (default: URL and load)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures and raw latencies here")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the table here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs (or, with --table, a bar chart)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="render earlier runs' JSON side by side instead of sending requests")
    p.add_argument("--timeout", type=_rate, default=600.0, help="seconds per request (default 600)")
    p.set_defaults(func=main)


def _base_url(text: str) -> str:
    try:
        return loopback_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_rate = types._number(lambda v: v > 0, "a number > 0")


def main(args) -> int:
    if args.table:
        results = [json.loads(Path(p).read_text()) for p in args.table]
        _emit(results, args, raw=None)
        return 0
    if not args.prompts:
        print("cascade bench-serve: error: --prompts is required (or --table)", file=sys.stderr)
        return 2
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    count = _token_counter(args.tokenizer) if args.tokenizer else None
    long_prompt = None
    if args.long_prompt_tokens:
        if not args.tokenizer:
            print("cascade bench-serve: error: --long-prompt-tokens needs --tokenizer (to count the long prompt's "
                  "tokens)", file=sys.stderr)
            return 2
        long_prompt = make_long_prompt(prompts, args.long_prompt_tokens, args.tokenizer)
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        body["top_p"] = args.top_p
    load = Load(prompts, args.num_requests or len(prompts), args.max_seconds,
                concurrency=args.concurrency or (None if args.request_rate else 1), rate=args.request_rate,
                chat=args.endpoint == "chat", body=body, arrival_seed=args.seed or 0,
                long_prompt=long_prompt, long_every=args.long_every if long_prompt else 0)
    per_repeat, model = asyncio.run(_bench(args, load))
    records = [r for rs in per_repeat for r in rs]
    summary = summarize_repeats(per_repeat, count)
    metrics = [request_metrics(r, count) for r in records if r.ok]
    raw = {"ttft": [m.ttft for m in metrics], "tpot": [m.tpot for m in metrics if m.tpot is not None],
           "itl": [g for m in metrics for g in m.itl], "chunk_gap": [g for m in metrics for g in m.chunk_gaps],
           "e2e": [m.e2e for m in metrics]}
    load_name = f"rate {args.request_rate}/s" if args.request_rate else f"c={load.concurrency}"
    result = {"label": args.label or f"{args.base_url} {load_name}", "base_url": args.base_url, "model": model,
              "endpoint": args.endpoint, "concurrency": load.concurrency, "request_rate": args.request_rate,
              "num_requests": load.num_requests, "max_seconds": args.max_seconds, "request": body,
              "seed": args.seed, "token_count": "tokenizer" if count else "characters",
              "summary": summary, "raw_s": raw, "machine": machine(),  # the server's too: loopback only
              "repeats": len(per_repeat),
              "records": [asdict(r) | {"repeat": k} for k, rs in enumerate(per_repeat) for r in rs]}
    _emit([result], args, raw)
    return 0 if summary["completed"] else 1


async def _bench(args, load: Load) -> tuple[list[list[Record]], str]:
    """The warm-up, then the load ``args.repeats`` times in a row: each repeat's records."""
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=args.timeout)
    try:
        model = args.model or (await client.models.list()).data[0].id
        if args.seed is not None:
            load.body["seed"] = args.seed
        warm = Load(load.prompts, args.warmup, load.max_seconds, concurrency=1, chat=load.chat, body=load.body)
        if args.warmup:
            await run_load(client, model, warm)
        return [await run_load(client, model, load) for _ in range(args.repeats)], model
    finally:
        await client.close()


def make_long_prompt(prompts: Sequence[str], tokens: int, tokenizer: str) -> str:
    """A prompt of ``tokens`` tokens (by ``tokenizer``): the prompts' texts cycled, cut there."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tok.encode("\n\n".join(prompts) + "\n\n", add_special_tokens=False)
    return tok.decode(ids[:tokens])


def _token_counter(path: str) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def _emit(results: list[dict[str, Any]], args, raw) -> None:
    machines = sorted({machine_line(r["machine"]) for r in results if r.get("machine")})
    table = "".join(line + "\n" for line in machines) + markdown_table(results)
    if lengths := length_lines(results):
        table += "\n\n" + lengths
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table + "\n")
    if getattr(args, "json", None) and not args.table:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results[0], indent=1) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        if args.table:
            plot_table(results, Path(args.plot))
        else:
            plot_run(results[0], raw, Path(args.plot))
