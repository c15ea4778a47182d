"""``cascade bench --batch-sizes``: throughput under load, plain batched decoding of the
authority against the batched cascade, at each concurrency on the same requests.

Plain decoding is transformers ``generate`` with left padding, in batches of B; the cascade is
``generate(..., batch_size=B)``, continuous batching (a finished request's place goes to the
next). One policy instance lives through the whole bench, as in a server.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cascade.tools.bench_records import mode_label
from cascade.tools.bench_report import batch_markdown
from cascade.tools.exactness import DistributionCheck
from cascade.tools.timing import COUPLING, DEFAULT_THREADS, machine, torch_threads
from cascade.repetition import repetition

# (tokens, seconds, mean latency per request, repetition per request) of serving a list of requests
Served = tuple[int, float, float, list[float]]


@dataclass
class _Servers:
    """The two sides of the bench, serving the same requests with the same sampling and seeds."""

    cascade: Any  # cascade.api.Cascade
    policy: Any  # the cascade's policy (None: the topology's), one instance for the whole bench
    sampling: Any  # cascade.sampling.Sampling
    seed: int
    max_new_tokens: int

    def serve_plain(self, batch: list[str], size: int) -> Served:
        """``batch`` served in batches of ``size`` by transformers ``generate``; a request's latency is
        its batch's time (time waiting for a slot is not counted)."""
        import torch

        from cascade.tools.baselines import as_loaded, generate_kwargs

        c = self.cascade
        model, tok = as_loaded(c.workers[c.topology.authority].model), c.tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        tokens, seconds, latency, reps = 0, 0.0, 0.0, []
        for i in range(0, len(batch), size):
            enc = [tok.encode(p) for p in batch[i:i + size]]
            width = max(len(e) for e in enc)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            torch.manual_seed(self.seed + i)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out_ids = model.generate(ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                         pad_token_id=pad, **generate_kwargs(self.sampling))
            spent = time.perf_counter() - t0
            for row in out_ids[:, width:].tolist():  # up to and with the first EOS
                row = row[:row.index(eos) + 1] if eos in row else row
                tokens += len(row)
                reps.append(repetition(row))
            seconds += spent
            latency += spent * len(enc)
        return tokens, seconds, latency / len(batch), reps

    def serve_cascade(self, batch: list[str], size: int) -> Served:
        s = self.sampling
        t0 = time.perf_counter()
        gs = self.cascade.generate(batch, max_new_tokens=self.max_new_tokens, temperature=s.temperature,
                                    top_k=s.top_k, top_p=s.top_p, seed=self.seed, batch_size=size, policy=self.policy,
                                    coupling=COUPLING)
        seconds = time.perf_counter() - t0
        # a request's latency runs from when it joined the batch to its end
        return (sum(len(g.token_ids) for g in gs), seconds, statistics.fmean(g.stats.wall_seconds for g in gs),
                [repetition(g.token_ids) for g in gs])


def run_batch_bench(topology: str, prompts: list[str], batch_sizes: list[int], max_new_tokens: int = 128,
                    policy: str | None = None, out: str | Path | None = None, progress: bool = True,
                    requests: int = 32, repeats: int = 1, sampling=None, seed: int = 0,
                    exactness_draws: int = 300, exactness_tokens: int = 2,
                    threads: int | None = DEFAULT_THREADS) -> tuple[list[dict], DistributionCheck | None]:
    """Throughput under load: at each concurrency B, the same ``max(requests, B)`` requests
    (the prompts, cycled) are served B at a time, by plain batched decoding of the authority
    (transformers ``generate`` with left padding, in batches of B) and by the cascade
    (``generate(..., batch_size=B)``: continuous batching, a finished request's place goes to
    the next), alternating which goes first, ``repeats`` times, after an untimed cascade run
    at that concurrency (one policy instance lives through the whole bench, as in a server).
    Reports total tokens/s and mean per-request latency of each, the ratio of throughputs
    (median over repeats, with its range), and the median repetition of each side's texts.
    ``sampling`` (a :class:`cascade.sampling.Sampling`; default greedy) applies to both sides;
    each batch is seeded from ``seed``. Sampled, the batched cascade's first tokens are checked
    against plain sampling's distribution (:mod:`cascade.tools.exactness`; ``exactness_draws``
    rows at the largest batch size); returns (rows, that check or None). Torch runs ``threads``
    intra-op threads throughout (None: its own choice)."""
    with torch_threads(threads) as used:
        return _run_batch_bench(topology, prompts, batch_sizes, max_new_tokens, policy, out, progress, requests,
                                repeats, sampling, seed, exactness_draws, exactness_tokens, used)


def _run_batch_bench(topology, prompts, batch_sizes, max_new_tokens, policy, out, progress, requests, repeats,
                     sampling, seed, exactness_draws, exactness_tokens, threads) -> tuple[list[dict], DistributionCheck | None]:
    from tqdm import tqdm

    from cascade.api import Cascade
    from cascade.sampling import Sampling
    from policies import from_spec

    sampling = sampling or Sampling()
    rows = []
    with Cascade.from_topology(topology) as c:
        servers = _Servers(c, from_spec(policy) if policy else None, sampling, seed, max_new_tokens)
        servers.serve_plain(prompts[:2], 2)
        servers.serve_cascade(prompts[:2], 2)  # warm-up
        bar = tqdm(total=len(batch_sizes) * repeats, desc="batch sizes", disable=not progress, file=sys.stderr)
        for i, size in enumerate(batch_sizes):
            batch = [prompts[j % len(prompts)] for j in range(max(requests, size))]
            runs = _measure(servers, batch, size, repeats, first=i, bar=bar)
            rows.append(_row(runs, size, len(batch), repeats, mode_label(sampling)))
        bar.close()
        check = None
        if not sampling.greedy and exactness_draws:
            check = _batch_distribution_check(c, servers.policy, prompts, sampling, seed, exactness_draws,
                                              exactness_tokens, max(batch_sizes))
    if out is not None:
        config = dict(topology=topology, max_new_tokens=max_new_tokens, policy=policy, requests=requests,
                      repeats=repeats, sampling=sampling.model_dump(), seed=seed, threads=threads,
                      machine=machine())
        _write_batch_report(Path(out), config, rows, check, mode_label(sampling))
    return rows, check


def _measure(servers: _Servers, batch: list[str], size: int, repeats: int, first: int, bar) -> dict[str, list[Served]]:
    """One concurrency: ``batch`` served ``size`` at a time by each side, ``repeats`` times; which
    side goes first alternates with the repeat and with ``first`` (the concurrency's index)."""
    # a serving policy lives on: let it learn this batch size (costs, paths) untimed first
    servers.serve_cascade(batch[:size], size)
    runs: dict[str, list[Served]] = {"plain": [], "cascade": []}
    for r in range(repeats):
        for name in (("plain", "cascade") if (first + r) % 2 == 0 else ("cascade", "plain")):
            runs[name].append((servers.serve_plain if name == "plain" else servers.serve_cascade)(batch, size))
        bar.update()
    return runs


def _row(runs: dict[str, list[Served]], size: int, requests: int, repeats: int, mode: str) -> dict:
    """A concurrency's row of the report: the throughput ratio per repeat (cascade / plain), its
    median and range, each side's tokens/s per repeat, and each side's median tokens/s, latency
    and repetition."""
    ratios = [(ct / cs) / (pt / ps) for (pt, ps, *_), (ct, cs, *_) in zip(runs["plain"], runs["cascade"])]
    row = {"batch_size": size, "requests": requests, "repeats": repeats, "mode": mode,
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "ratios": ratios}
    for name, xs in runs.items():
        row[f"{name}_tokens_per_second_by_repeat"] = [t / s for t, s, _, _ in xs]
        row[f"{name}_tokens_per_second"] = statistics.median(t / s for t, s, _, _ in xs)
        row[f"{name}_latency_s"] = statistics.median(lat for _, _, lat, _ in xs)
        row[f"{name}_repetition"] = statistics.median(x for *_, reps in xs for x in reps)
    return row


def _write_batch_report(out: Path, config: dict, rows: list[dict], check: DistributionCheck | None,
                        mode: str) -> None:
    """``batch.json`` (the run's configuration, the rows, the distribution check) and ``batch.md``."""
    out.mkdir(parents=True, exist_ok=True)
    distribution = check and asdict(check) | {"passed": check.passed}
    (out / "batch.json").write_text(json.dumps(config | {"rows": rows, "distribution": distribution}, indent=1))
    (out / "batch.md").write_text(batch_markdown(rows, config["topology"], config["max_new_tokens"], mode, check,
                                                 config["threads"], config.get("machine")))


def _batch_distribution_check(c, policy, prompts: list[str], sampling, seed: int, draws: int, tokens: int,
                              batch_size: int) -> DistributionCheck:
    """The batched cascade (``batch_size`` rows at a time, the serving policy) against plain
    sampling of the authority, on the short prompt prefix whose next token is most uncertain."""
    import torch

    from cascade.tools.baselines import as_loaded, generate_kwargs
    from cascade.tools.exactness import check_distribution, uncertain_prefix

    model = as_loaded(c.workers[c.topology.authority].model)
    ids = [c.tokenizer.encode(p) for p in prompts]
    prompt, length = uncertain_prefix(model, ids, sampling)
    prefix = ids[prompt][:length]
    t = torch.tensor([prefix])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=tokens, num_return_sequences=draws,
                             **generate_kwargs(sampling))
    reference = out[:, len(prefix):].tolist()
    gs = c.generate([prefix] * draws, max_new_tokens=tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, seed=seed + 1, batch_size=batch_size, policy=policy,
                    coupling=COUPLING)
    return check_distribution(f"cascade, batch size {batch_size}", reference, [g.token_ids for g in gs], tokens,
                              c.tokenizer.eos_token_id, (prompt, length))
