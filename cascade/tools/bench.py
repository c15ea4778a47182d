"""``cascade bench``: cascade against the peers, side by side in one process.

Every configuration runs on the same prompts, interleaved (a fresh random order per prompt and
repeat) after a warm-up, and every speed is reported as a ratio to plain decoding measured in
the same run. Configurations:

1. ``plain``: transformers ``generate`` of the authority, greedy (the baseline);
2. ``cascade:authority``: cascade with the authority alone (cascade's own overhead);
3. ``hf-assisted:<draft>``: transformers assisted generation, each draft as ``assistant_model``;
4. ``hf-prompt-lookup``: transformers prompt-lookup decoding;
5. ``cascade:<draft>-><authority>``: 2-level cascade with each draft, ``fixed`` policy;
6. ``cascade:3level`` / ``cascade:4level`` (with and without the n-gram level), ``fixed`` and ``auto``:
   those levels, with the chain's edges and every edge of the topology between them (its
   shortcuts), so ``auto`` chooses among the same paths as on the topology itself; ``fixed``
   drafts along the whole chain.

Each cascade configuration also gets a *predicted* speedup from its measured acceptance per
draft position and measured seconds per forward pass of each level (the seed's equation, §9,
composed up the hierarchy: ``Estimates.path_cost``), for the path its steps mostly took
(``predicted_path``: a chain's own path; for ``auto``, the one it settled on). Measured ÷
predicted is the share of that ideal the configuration kept.
"""
from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cascade.cli import args as types
from cascade.cli.commands import DEFAULT_TOPOLOGY, guarded


@dataclass
class Config:
    name: str
    kind: str  # "plain", "hf", "cascade"
    path: tuple[str, ...] = ()
    policy: str = ""
    run: Callable[[list[int], int], tuple[list[int], float, Any]] | None = None
    graph: Any = None  # a cascade configuration's graph (networkx.DiGraph)


@dataclass
class Sample:
    config: str
    prompt: int
    repeat: int
    tokens: int
    seconds: float
    authority_passes: int
    token_ids: list[int]
    stats: Any = None  # cascade's RequestStats


@dataclass
class ConfigReport:
    name: str
    tokens_per_second_median: float
    tokens_per_second_ci: tuple[float, float]
    speedup_median: float  # median over prompts of (this / plain), both measured in this run
    speedup_ci: tuple[float, float]
    authority_passes_per_token: float
    acceptance: dict[str, float] = field(default_factory=dict)
    acceptance_by_position: dict[str, list[float]] = field(default_factory=dict)
    level_seconds_per_token: dict[str, float] = field(default_factory=dict)
    orchestration_seconds_per_token: float | None = None
    predicted_speedup: float | None = None
    predicted_path: list[str] = field(default_factory=list)
    edges: list[str] = field(default_factory=list)  # a cascade configuration's graph
    measured_over_predicted: float | None = None
    mismatches: list[int] = field(default_factory=list)  # prompts whose output differs from plain


def _median_ci(values: list[float], resamples: int = 5000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median."""
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(values[rng.randrange(n)] for _ in range(n)) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


class _PassCounter:
    """Counts forward passes of a model through a hook on its LM head, which every pass calls once
    (transformers' own loops and the workers' lean forward alike)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += 1

    def close(self):
        self.handle.remove()


def build_configs(topo, workers, tokenizer, prompt_lookup: int, assisted: bool = True) -> list[Config]:
    """The configurations of the module docstring, for this topology's levels."""
    import torch

    from cascade.api import Cascade
    from cascade.tools.baselines import plain_generate
    from cascade.topology import topology_from_dict
    from policies import from_spec

    authority = topo.authority
    auth_model = workers[authority].model
    hf_drafts = [lv.name for lv in topo.spec.levels if lv.kind == "hf" and lv.name != authority]
    ngram = next((lv.name for lv in topo.spec.levels if lv.kind == "ngram"), None)
    fixed = topo.spec.policy.params.get("lookahead", {}) if topo.spec.policy.name == "fixed" else {}

    def hf_run(**kwargs):
        def run(ids: list[int], n: int):
            t = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = auth_model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                          max_new_tokens=n, **kwargs)
            return out[0, len(ids):].tolist(), time.perf_counter() - t0, None
        return run

    def plain(ids, n):
        new, secs = plain_generate(auth_model, ids, n)
        return new, secs, None

    cascades: dict[tuple[str, ...], Cascade] = {}

    def cascade_config(name: str, path: tuple[str, ...], policy_spec: str) -> Config:
        if path not in cascades:
            levels = [topo.spec.level(n).model_dump() for n in path]
            chain = list(zip(path, path[1:]))
            edges = [list(e) for e in chain + [e for e in topo.graph.subgraph(path).edges if e not in chain]]
            sub = topology_from_dict({"levels": levels, "edges": edges}, topo.source, topo.base_dir,
                                     check_models=False)
            cascades[path] = Cascade(sub, {n: workers[n] for n in path}, tokenizer, from_spec("fixed"))
        c = cascades[path]
        policy = from_spec(policy_spec)

        def run(ids: list[int], n: int):
            g = c.generate(ids, max_new_tokens=n, temperature=0.0, policy=policy)
            return g.token_ids, g.stats.wall_seconds, g.stats
        return Config(name, "cascade", path, policy_spec, run, c.topology.graph)

    def fixed_spec(path: tuple[str, ...]) -> str:
        defaults = {n: fixed.get(n, 3 + 2 * i) for i, n in enumerate(path[:-1])}
        return "fixed:lookahead={" + ", ".join(f"{k}: {v}" for k, v in defaults.items()) + "}"

    configs = [Config("plain", "plain", (authority,), run=plain)]
    configs.append(cascade_config("cascade:authority", (authority,), "fixed"))
    if assisted:
        for d in hf_drafts:
            configs.append(Config(f"hf-assisted:{d}", "hf", (d, authority),
                                  run=hf_run(assistant_model=workers[d].model)))
        configs.append(Config("hf-prompt-lookup", "hf", (authority,),
                              run=hf_run(prompt_lookup_num_tokens=prompt_lookup)))
    for d in hf_drafts:
        path = (d, authority)
        configs.append(cascade_config(f"cascade:{d}->{authority}", path, fixed_spec(path)))
    chain = tuple(hf_drafts) + (authority,)
    paths: list[tuple[str, str]] = []
    if len(chain) >= 4:
        paths.append((f"{len(chain) - 1}level", chain[:1] + chain[2:]))  # skip the second level
    if len(chain) >= 3:
        paths.append((f"{len(chain)}level", chain))
    if ngram and len(chain) >= 2:
        paths.append((f"{len(chain)}level+ngram", (ngram,) + chain))
    for label, path in paths:
        for policy in (fixed_spec(path), "auto"):
            short = "fixed" if policy.startswith("fixed") else policy
            configs.append(cascade_config(f"cascade:{label}:{short}", path, policy))
    return configs


def predicted_seconds_per_token(path: tuple[str, ...], stats, max_lookahead: int = 8) -> float | None:
    """Seconds per committed token that the measured acceptance and costs (a ``RequestStats``)
    predict for this path, with the best lookahead per edge."""
    from policies.estimates import EdgeAcceptance, Estimates, LevelCost

    est = Estimates()
    for level, s in stats.levels.items():
        if s.forward_passes:
            est.costs[level] = LevelCost(seconds=s.seconds / s.forward_passes)
    if path[0] not in est.costs:  # a free proposer (n-gram): no forward passes
        est.costs[path[0]] = LevelCost(seconds=1e-6)
    for below, level in zip(path, path[1:]):
        e = stats.edges.get(f"{below}->{level}")
        if e is None:
            return None
        acc = EdgeAcceptance(prior=0.0, prior_weight=0.0, decay=1.0)
        acc.seen = [float(x) for x in e.examined_by_position]
        acc.accepted = [float(x) for x in e.accepted_by_position] + [0.0] * (len(acc.seen) - len(e.accepted_by_position))
        est.edges[(below, level)] = acc
    per_token, _ = est.path_cost(path, max_lookahead)
    return per_token


def main_path(stats) -> tuple[str, ...]:
    """The path a configuration's steps mostly took (a ``RequestStats``): from the authority down,
    the proposer of each level's most verified blocks. A policy that chooses paths (``auto``)
    probes the others now and then, too briefly for their measurements to predict anything."""
    edges = [(*key.split("->"), e.blocks) for key, e in stats.edges.items() if e.blocks]
    path = [stats.authority]
    while True:
        blocks = {below: n for below, above, n in edges if above == path[0] and below not in path}
        if not blocks:
            return tuple(path)
        path.insert(0, max(blocks, key=blocks.get))


def run_bench(topology: str, prompts: list[str], max_new_tokens: int = 128, repeats: int = 1,
              out: str | Path | None = None, prompt_lookup: int = 10, only: list[str] | None = None,
              progress: bool = True, seed: int = 0) -> tuple[list[ConfigReport], list[Sample]]:
    from tqdm import tqdm

    from cascade.build import build_workers, load_tokenizer
    from cascade.topology import load_topology, topology_from_dict

    topo = load_topology(topology)
    if not any(lv.kind == "ngram" for lv in topo.spec.levels):  # add the free level for the ngram configs
        data = topo.spec.model_dump()
        data["levels"].insert(0, {"name": "ngram", "kind": "ngram"})
        if data["edges"] is not None:  # else the chain in listed order, the n-gram level first
            data["edges"] = [["ngram", data["levels"][1]["name"]]] + data["edges"]
        data["policy"] = {"name": "fixed", "params": {}}
        topo = topology_from_dict(data, topo.source, topo.base_dir, check_models=False)
    workers = build_workers(topo)
    tokenizer = load_tokenizer(topo)
    configs = build_configs(topo, workers, tokenizer, prompt_lookup)
    if only:
        configs = [c for c in configs if c.name == "plain" or any(o in c.name for o in only)]
    counter = _PassCounter(workers[topo.authority].model)
    ids = [tokenizer.encode(p) for p in prompts]
    samples: list[Sample] = []
    try:
        for c in configs:  # warm-up
            c.run(ids[0], 8)
        rng = random.Random(seed)
        trials = [(r, i) for r in range(repeats) for i in range(len(ids))]
        bar = tqdm(total=len(trials) * len(configs), desc="bench", unit="run", disable=not progress, file=sys.stderr)
        for r, i in trials:
            order = list(configs)
            rng.shuffle(order)
            for c in order:
                before = counter.count
                tokens, seconds, stats = c.run(ids[i], max_new_tokens)
                samples.append(Sample(c.name, i, r, len(tokens), seconds, counter.count - before, tokens, stats))
                bar.update()
        bar.close()
    finally:
        counter.close()
        for w in workers.values():
            w.close()
    reports = summarize(configs, samples, len(ids))
    if out is not None:
        write_report(Path(out), reports, samples, dict(topology=topology, prompts=len(prompts),
                                                       max_new_tokens=max_new_tokens, repeats=repeats,
                                                       prompt_lookup=prompt_lookup, seed=seed))
    return reports, samples


def summarize(configs: list[Config], samples: list[Sample], n_prompts: int) -> list[ConfigReport]:
    from cascade.stats import RequestStats

    def per_prompt(name: str) -> list[float]:
        rates = []
        for i in range(n_prompts):
            xs = [s for s in samples if s.config == name and s.prompt == i]
            rates.append(sum(s.tokens for s in xs) / sum(s.seconds for s in xs))
        return rates

    plain = per_prompt("plain")
    plain_ids = {(s.prompt, s.repeat): s.token_ids for s in samples if s.config == "plain"}
    plain_spt = sum(s.seconds for s in samples if s.config == "plain") / sum(
        s.tokens for s in samples if s.config == "plain")
    reports = []
    for c in configs:
        xs = [s for s in samples if s.config == c.name]
        rates = per_prompt(c.name)
        speedups = [a / b for a, b in zip(rates, plain)]
        tokens = sum(s.tokens for s in xs)
        rep = ConfigReport(
            c.name, statistics.median(rates), _median_ci(rates), statistics.median(speedups), _median_ci(speedups),
            sum(s.authority_passes for s in xs) / tokens,
            mismatches=sorted({s.prompt for s in xs if s.token_ids != plain_ids[(s.prompt, s.repeat)]}),
        )
        if c.kind == "cascade":
            rep.edges = [f"{a}->{b}" for a, b in c.graph.edges]
            merged = RequestStats(c.path[-1])
            for s in xs:
                merged.merge(s.stats)
            rep.acceptance = {k: e.acceptance_rate for k, e in merged.edges.items()}
            rep.acceptance_by_position = {k: e.conditional_acceptance() for k, e in merged.edges.items()}
            rep.level_seconds_per_token = {k: v.seconds / tokens for k, v in merged.levels.items()}
            wall = sum(s.seconds for s in xs)
            rep.orchestration_seconds_per_token = (wall - sum(v.seconds for v in merged.levels.values())) / tokens
            path = main_path(merged)
            predicted = predicted_seconds_per_token(path, merged) if len(path) > 1 else None
            if predicted:
                rep.predicted_path = list(path)
                rep.predicted_speedup = plain_spt / predicted
                rep.measured_over_predicted = (plain_spt / (wall / tokens)) / rep.predicted_speedup
        reports.append(rep)
    return reports


def markdown(reports: list[ConfigReport], config: dict) -> str:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines = [
        f"Topology `{config['topology']}`, {config['prompts']} prompts x {config['repeats']} repeat(s), "
        f"{config['max_new_tokens']} new tokens, greedy; all configurations interleaved in one process "
        f"(peak RSS of the process: {rss:.0f} MiB).",
        "",
        "| configuration | tokens/s (median, 95% CI) | speedup vs plain | authority passes/token | "
        "predicted speedup | measured ÷ predicted | output |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        pred = f"{r.predicted_speedup:.2f}x" if r.predicted_speedup else "—"
        share = f"{r.measured_over_predicted:.2f}" if r.measured_over_predicted else "—"
        same = "identical" if not r.mismatches else f"**DIFFERS** (prompts {r.mismatches})"
        lines.append(
            f"| {r.name} | {r.tokens_per_second_median:.1f} ({r.tokens_per_second_ci[0]:.1f}–"
            f"{r.tokens_per_second_ci[1]:.1f}) | {r.speedup_median:.2f}x ({r.speedup_ci[0]:.2f}–{r.speedup_ci[1]:.2f}) "
            f"| {r.authority_passes_per_token:.3f} | {pred} | {share} | {same} |"
        )
    lines += ["", "Acceptance per edge (cascade configurations):", ""]
    for r in reports:
        if r.acceptance:
            accs = ", ".join(f"{k} {v:.2f}" for k, v in r.acceptance.items())
            best = f" (prediction's path: {' -> '.join(r.predicted_path)})" if r.predicted_path else ""
            lines.append(f"- {r.name}: {accs}{best}")
    return "\n".join(lines) + "\n"


def write_report(out: Path, reports: list[ConfigReport], samples: list[Sample], config: dict) -> None:
    from dataclasses import asdict

    out.mkdir(parents=True, exist_ok=True)
    raw = [asdict(s) | {"stats": s.stats.to_dict() if s.stats is not None else None} for s in samples]
    (out / "bench.json").write_text(json.dumps({"config": config, "reports": [asdict(r) for r in reports],
                                                "samples": raw}, indent=1))
    (out / "bench.md").write_text(markdown(reports, config))
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    names = [r.name for r in reports]
    ax.barh(names, [r.speedup_median for r in reports],
            xerr=[[r.speedup_median - r.speedup_ci[0] for r in reports], [r.speedup_ci[1] - r.speedup_median for r in reports]],
            color=["tab:gray" if not n.startswith("cascade") else "tab:blue" for n in names])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("speedup over plain decoding (median over prompts, 95% CI)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)

    cascade_reports = [r for r in reports if r.acceptance_by_position]
    if cascade_reports:
        full = max(cascade_reports, key=lambda r: len(r.acceptance_by_position))
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, rates in full.acceptance_by_position.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=k)
        ax.set_title(f"acceptance by draft position: {full.name}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accept | previous accepted)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=100)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(10, 4))
        levels = sorted({k for r in cascade_reports for k in r.level_seconds_per_token})
        left = [0.0] * len(cascade_reports)
        for level in levels + ["orchestration"]:
            vals = [1000 * (r.orchestration_seconds_per_token if level == "orchestration"
                            else r.level_seconds_per_token.get(level, 0.0)) for r in cascade_reports]
            ax.barh([r.name for r in cascade_reports], vals, left=left, label=level)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("milliseconds per committed token")
        ax.invert_yaxis()
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "time_breakdown.png", dpi=100)
        plt.close(fig)


def run_batch_bench(topology: str, prompts: list[str], batch_sizes: list[int], max_new_tokens: int = 128,
                    policy: str | None = None, out: str | Path | None = None, progress: bool = True,
                    requests: int = 32, repeats: int = 1) -> list[dict]:
    """Throughput under load: at each concurrency B, the same ``max(requests, B)`` requests
    (the prompts, cycled) are served B at a time, by plain batched decoding of the authority
    (transformers ``generate`` with left padding, in batches of B) and by the cascade
    (``generate(..., batch_size=B)``: continuous batching, a finished request's place goes to
    the next), alternating which goes first, ``repeats`` times, after an untimed cascade run
    at that concurrency (one policy instance lives through the whole bench, as in a server).
    Reports total tokens/s and mean per-request latency of each, and the ratio of throughputs
    (median over repeats, with its range)."""
    import statistics

    import torch
    from tqdm import tqdm

    from cascade.api import Cascade
    from policies import from_spec

    rows = []
    with Cascade.from_topology(topology) as c:
        model = c.workers[c.topology.authority].model
        tok = c.tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        pol = from_spec(policy) if policy else None

        def plain(batch: list[str], size: int) -> tuple[int, float, float]:
            """(tokens, seconds, mean latency per request) serving ``batch`` in batches of ``size``; a
            request's latency is its batch's time (time waiting for a slot is not counted)."""
            tokens, seconds, latency = 0, 0.0, 0.0
            for i in range(0, len(batch), size):
                enc = [tok.encode(p) for p in batch[i:i + size]]
                width = max(len(e) for e in enc)
                ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
                mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out_ids = model.generate(ids, attention_mask=mask, do_sample=False,
                                             max_new_tokens=max_new_tokens, pad_token_id=pad)
                spent = time.perf_counter() - t0
                tokens += sum(int((row != eos).cumprod(0).sum()) + int((row == eos).any())
                              for row in out_ids[:, width:])
                seconds += spent
                latency += spent * len(enc)
            return tokens, seconds, latency / len(batch)

        def cascade(batch: list[str], size: int) -> tuple[int, float, float]:
            t0 = time.perf_counter()
            gs = c.generate(batch, max_new_tokens=max_new_tokens, temperature=0.0, batch_size=size, policy=pol)
            seconds = time.perf_counter() - t0
            # a request's latency runs from when it joined the batch to its end
            return sum(len(g.token_ids) for g in gs), seconds, statistics.fmean(g.stats.wall_seconds for g in gs)

        plain(prompts[:2], 2)
        cascade(prompts[:2], 2)  # warm-up
        bar = tqdm(total=len(batch_sizes) * repeats, desc="batch sizes", disable=not progress, file=sys.stderr)
        for i, size in enumerate(batch_sizes):
            batch = [prompts[j % len(prompts)] for j in range(max(requests, size))]
            # a serving policy lives on: let it learn this batch size (costs, paths) untimed first
            cascade(batch[:size], size)
            runs: dict[str, list[tuple[int, float, float]]] = {"plain": [], "cascade": []}
            for r in range(repeats):
                for name in (("plain", "cascade") if (i + r) % 2 == 0 else ("cascade", "plain")):
                    runs[name].append((plain if name == "plain" else cascade)(batch, size))
                bar.update()
            ratios = [(ct / cs) / (pt / ps) for (pt, ps, _), (ct, cs, _) in zip(runs["plain"], runs["cascade"])]
            rows.append({"batch_size": size, "requests": len(batch), "repeats": repeats,
                         "plain_tokens_per_second": statistics.median(t / s for t, s, _ in runs["plain"]),
                         "cascade_tokens_per_second": statistics.median(t / s for t, s, _ in runs["cascade"]),
                         "plain_latency_s": statistics.median(lat for _, _, lat in runs["plain"]),
                         "cascade_latency_s": statistics.median(lat for _, _, lat in runs["cascade"]),
                         "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "ratios": ratios})
        bar.close()
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "batch.json").write_text(json.dumps({"topology": topology, "max_new_tokens": max_new_tokens,
                                                    "policy": policy, "requests": requests, "repeats": repeats,
                                                    "rows": rows}, indent=1))
        (out / "batch.md").write_text(batch_markdown(rows, topology, max_new_tokens))
    return rows


def batch_markdown(rows: list[dict], topology: str, max_new_tokens: int) -> str:
    r0 = rows[0] if rows else {}
    lines = [f"Topology `{topology}`, greedy, {max_new_tokens} new tokens per request; at each concurrency B the same "
             f"{r0.get('requests', '?')} requests (64 at B = 64) are served B at a time: plain = transformers `generate` "
             f"of the authority in batches of B, cascade = `generate(..., batch_size=B)` (continuous batching). Latency: "
             f"mean per request, from the start of its batch (plain) or its joining (cascade) to its end. "
             f"Ratios are the median of {r0.get('repeats', 1)} side-by-side repeats (range in brackets).", "",
             "| concurrency B | plain tokens/s | cascade tokens/s | cascade ÷ plain | plain latency (s) | "
             "cascade latency (s) |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spread = f" [{r['ratio_min']:.2f}–{r['ratio_max']:.2f}]" if r.get("repeats", 1) > 1 else ""
        lines.append(f"| {r['batch_size']} | {r['plain_tokens_per_second']:.1f} | {r['cascade_tokens_per_second']:.1f} "
                     f"| {r['ratio']:.2f}x{spread} | {r['plain_latency_s']:.2f} | {r['cascade_latency_s']:.2f} |")
    return "\n".join(lines) + "\n"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark cascade against plain and transformers' assisted decoding",
                       description="Run plain decoding, transformers assisted generation and prompt lookup, and "
                                   "cascade configurations on the same prompts, interleaved in one process; report "
                                   "tokens/s, speedup over plain decoding measured in the same run, authority passes "
                                   "per token, acceptance, predicted vs measured speedup; write bench.json, bench.md "
                                   "and PNG plots to --out.")
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--prompts", default="examples/prompts/heldout.jsonl")
    p.add_argument("--num-prompts", type=types.positive_int, default=None)
    p.add_argument("--max-new-tokens", type=types.positive_int, default=128)
    p.add_argument("--repeats", type=types.positive_int, default=1)
    p.add_argument("--prompt-lookup", type=types.positive_int, default=10, help="prompt_lookup_num_tokens for transformers")
    p.add_argument("--only", action="append", default=None,
                   help="run only configurations whose name contains this (plain always runs; repeatable)")
    p.add_argument("--batch-sizes", type=types.positive_int_list, default=None,
                   help="throughput mode: comma-separated batch sizes (e.g. 1,4,16,64), plain batched decoding "
                        "vs the batched cascade")
    p.add_argument("--policy", type=types.policy_spec, default=None, help="cascade policy for --batch-sizes (default: the topology's)")
    p.add_argument("--requests", type=types.positive_int, default=32,
                   help="--batch-sizes: requests served at each concurrency (at least the batch size)")
    p.add_argument("--out", required=True)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_main)


@guarded
def _main(args) -> int:
    from cascade.tools.baselines import load_prompts

    prompts = load_prompts(args.prompts, args.num_prompts)
    t0 = time.perf_counter()
    if args.batch_sizes:
        run_batch_bench(args.topology, prompts, args.batch_sizes, args.max_new_tokens, args.policy, args.out,
                        progress=not args.no_progress, requests=args.requests, repeats=args.repeats)
        print((Path(args.out) / "batch.md").read_text())
        print(f"({time.perf_counter() - t0:.0f} s; report in {args.out})")
        return 0
    reports, _ = run_bench(args.topology, prompts, args.max_new_tokens, args.repeats, args.out, args.prompt_lookup,
                           args.only, progress=not args.no_progress)
    print((Path(args.out) / "bench.md").read_text())
    print(f"({time.perf_counter() - t0:.0f} s; report in {args.out})")
    bad = [r.name for r in reports if r.mismatches]
    if bad:
        print(f"OUTPUT MISMATCH against plain decoding: {bad}", file=sys.stderr)
        return 2
    return 0
