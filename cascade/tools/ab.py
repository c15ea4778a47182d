"""Policy A/B experiments: two policies, the same prompts and seeds, interleaved in one run.

``cascade ab --topology T --a POLICY[:k=v,...] --b POLICY[:k=v,...] --prompts FILE.jsonl``
or, from Python, :func:`run_ab`. Summarises the per-prompt tokens/s ratios B/A by their geometric
mean (the mean of log ratios, so that a prompt twice as fast and one twice as slow cancel and no
single prompt's ratio, a looping prompt's, say, carries the summary) with a paired bootstrap 95%
confidence interval, their median, and a paired sign-flip permutation p-value on the log
ratios; writes JSON, a markdown summary and PNG plots. Under greedy decoding both policies must produce identical
tokens: any difference is reported as an exactness failure. Each arm's text is reported with
its repetition (:mod:`cascade.repetition`, median over prompts): a loop flatters any
speculative policy.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cascade.cli import args as types
from cascade.cli.args import DEFAULT_TOPOLOGY, guarded
from cascade.repetition import repetition
from cascade.tools.timing import COUPLING, machine, machine_line  # COUPLING: the rule an unseeded request gets


@dataclass
class Run:
    arm: str  # "A" or "B"
    prompt: int
    repeat: int
    tokens: int
    seconds: float
    authority_passes: int
    edges: dict[str, dict[str, Any]]  # acceptance per edge, with by-position counts
    token_ids: list[int]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Summary:
    a: str
    b: str
    prompts: int
    repeats: int
    geomean_ratio: float  # geometric mean over prompts of tokens/s(B) / tokens/s(A)
    ci_low: float | None  # its 95% interval (None with one prompt: nothing to resample)
    ci_high: float | None
    median_ratio: float  # median over prompts of the same ratios
    p_value: float  # sign-flip permutation test of the log ratios (no difference: they centre on 0)
    a_tokens_per_second: float
    b_tokens_per_second: float
    a_passes_per_token: float
    b_passes_per_token: float
    exactness_failures: list[dict[str, Any]] = field(default_factory=list)
    per_prompt_ratio: list[float] = field(default_factory=list)
    a_repetition: float = 0.0  # median over prompts (mean over repeats) of the arm's text's repetition
    b_repetition: float = 0.0




def geometric_mean(ratios: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def geometric_mean_ci(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float] | None:
    """95% percentile interval of the geometric mean ratio, resampling prompts with replacement
    (None for fewer than two prompts)."""
    n = len(ratios)
    if n < 2:
        return None
    rng = random.Random(seed)
    logs = [math.log(r) for r in ratios]
    means = sorted(sum(logs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])


def sign_flip_p_value(ratios: list[float], resamples: int = 20_000, seed: int = 0) -> float:
    """Two-sided paired permutation test of 'no difference' on log ratios (exact up to 2^16)."""
    logs = [math.log(r) for r in ratios]
    observed = abs(sum(logs))
    n = len(logs)
    if n <= 16:
        hits = 0
        for mask in range(2 ** n):
            total = sum(-x if mask >> i & 1 else x for i, x in enumerate(logs))
            hits += abs(total) >= observed - 1e-12
        return hits / 2 ** n
    rng = random.Random(seed)
    hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in logs)) >= observed - 1e-12 for _ in range(resamples))
    return (hits + 1) / (resamples + 1)


def run_ab(
    topology: str,
    a: str,
    b: str,
    prompts: list[str],
    max_new_tokens: int = 128,
    repeats: int = 3,
    out: str | Path | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    warmup: int = 2,
    progress: bool = True,
    top_k: int = 0,
    top_p: float = 1.0,
    backend: str | None = None,
) -> tuple[Summary, list[Run]]:
    """Run the experiment; write ``ab.json``, ``summary.md`` and plots to ``out`` if given.
    ``backend``: where the levels run ("local" or "ray"; None: the topology's)."""
    from tqdm import tqdm

    from cascade.api import Cascade
    from policies import from_spec

    arms = {"A": from_spec(a), "B": from_spec(b)}
    runs: list[Run] = []
    with Cascade.from_topology(topology, backend=backend) as c:
        for prompt in prompts[:warmup]:  # allocation, lazy init, and first estimates for adaptive arms
            for policy in arms.values():
                c.generate(prompt, max_new_tokens=min(32, max_new_tokens), temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, policy=policy, coupling=COUPLING)
        rng = random.Random(seed)
        trials = [(r, i) for r in range(repeats) for i in range(len(prompts))]
        rng.shuffle(trials)
        for r, i in tqdm(trials, desc="A/B", unit="pair", disable=not progress, file=sys.stderr):
            order = ["A", "B"] if rng.random() < 0.5 else ["B", "A"]
            for arm in order:
                g = c.generate(prompts[i], max_new_tokens=max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed + 1000 * r + i, policy=arms[arm],
                               coupling=COUPLING)
                s = g.stats
                edges = {k: {"proposed": e.proposed, "accepted": e.accepted, "blocks": e.blocks,
                             "examined_by_position": e.examined_by_position,
                             "accepted_by_position": e.accepted_by_position} for k, e in s.edges.items()}
                runs.append(Run(arm, i, r, s.new_tokens, s.wall_seconds, s.authority_passes, edges, g.token_ids))
    summary = summarize(a, b, runs, len(prompts), repeats, greedy=temperature == 0)
    if out is not None:
        write_report(Path(out), summary, runs, dict(topology=topology, a=a, b=b, max_new_tokens=max_new_tokens,
                                                    repeats=repeats, temperature=temperature, top_k=top_k,
                                                    top_p=top_p, seed=seed,
                                                    warmup=warmup, prompts=prompts, machine=machine()))
    return summary, runs


def summarize(a: str, b: str, runs: list[Run], n_prompts: int, repeats: int, greedy: bool) -> Summary:
    def arm_rate(arm: str, i: int) -> float:
        rs = [x for x in runs if x.arm == arm and x.prompt == i]
        return sum(x.tokens for x in rs) / sum(x.seconds for x in rs)

    ratios = [arm_rate("B", i) / arm_rate("A", i) for i in range(n_prompts)]
    lo, hi = geometric_mean_ci(ratios) or (None, None)
    failures = []
    if greedy:
        by_key = {(x.arm, x.prompt, x.repeat): x.token_ids for x in runs}
        for (arm, i, r), ids in by_key.items():
            if arm == "A" and ids != by_key[("B", i, r)]:
                failures.append({"prompt": i, "repeat": r})

    def total(arm: str, attr: str) -> float:
        return sum(getattr(x, attr) for x in runs if x.arm == arm)

    def median_repetition(arm: str) -> float:
        return statistics.median(statistics.fmean(repetition(x.token_ids) for x in runs if x.arm == arm and x.prompt == i)
                                 for i in range(n_prompts))

    return Summary(
        a=a, b=b, prompts=n_prompts, repeats=repeats,
        geomean_ratio=geometric_mean(ratios), ci_low=lo, ci_high=hi, median_ratio=statistics.median(ratios),
        p_value=sign_flip_p_value(ratios),
        a_tokens_per_second=total("A", "tokens") / total("A", "seconds"),
        b_tokens_per_second=total("B", "tokens") / total("B", "seconds"),
        a_passes_per_token=total("A", "authority_passes") / total("A", "tokens"),
        b_passes_per_token=total("B", "authority_passes") / total("B", "tokens"),
        exactness_failures=failures, per_prompt_ratio=ratios,
        a_repetition=median_repetition("A"), b_repetition=median_repetition("B"),
    )


def _acceptance_by_position(runs: list[Run], arm: str) -> dict[str, list[float]]:
    """Per edge, [j]: acceptance at draft position j given the positions before it accepted."""
    examined: dict[str, list[int]] = {}
    accepted: dict[str, list[int]] = {}
    for x in runs:
        if x.arm != arm:
            continue
        for key, e in x.edges.items():
            for counts, src in ((examined.setdefault(key, []), e["examined_by_position"]),
                                (accepted.setdefault(key, []), e["accepted_by_position"])):
                counts.extend([0] * (len(src) - len(counts)))
                for j, v in enumerate(src):
                    counts[j] += v
    return {k: [accepted[k][j] / n if j < len(accepted[k]) and n else 0.0 for j, n in enumerate(v)]
            for k, v in examined.items()}


def _edge_rates(runs: list[Run], arm: str) -> dict[str, float]:
    prop: dict[str, int] = {}
    acc: dict[str, int] = {}
    for x in runs:
        if x.arm == arm:
            for k, e in x.edges.items():
                prop[k] = prop.get(k, 0) + e["proposed"]
                acc[k] = acc.get(k, 0) + e["accepted"]
    return {k: acc[k] / prop[k] if prop[k] else 0.0 for k in prop}


def write_report(out: Path, summary: Summary, runs: list[Run], config: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"config": config, "summary": asdict(summary),
               "acceptance_by_position": {arm: _acceptance_by_position(runs, arm) for arm in "AB"},
               "runs": [asdict(x) | {"tokens_per_second": x.tokens_per_second} for x in runs]}
    (out / "ab.json").write_text(json.dumps(payload, indent=1))
    (out / "summary.md").write_text(markdown(summary, runs, config))
    _plots(out, summary, runs)


def markdown(s: Summary, runs: list[Run], config: dict[str, Any]) -> str:
    if s.ci_low is None:
        interval, verdict = "one prompt: no interval", "too few prompts to tell"
    else:
        interval = f"95% paired bootstrap CI {s.ci_low:.3f}–{s.ci_high:.3f}"
        verdict = "B faster" if s.ci_low > 1 else "A faster" if s.ci_high < 1 else "no significant difference"
    lines = [
        f"# A/B: `{s.a}` (A) vs `{s.b}` (B)",
        "",
        f"Topology `{config['topology']}`, {s.prompts} prompts x {s.repeats} repeats, "
        f"{config['max_new_tokens']} new tokens, temperature {config['temperature']}"
        f"{', top-p ' + format(config.get('top_p', 1.0), 'g') if config.get('top_p', 1.0) < 1 else ''}"
        f"{', top-k ' + str(config.get('top_k', 0)) if config.get('top_k', 0) else ''}, seed {config['seed']}; "
        "pairs run in randomised interleaved order after a warm-up."
        + (" " + machine_line(config["machine"]) if config.get("machine") else ""),
        "",
        "| | A | B |",
        "|---|---:|---:|",
        f"| tokens/s (all runs) | {s.a_tokens_per_second:.1f} | {s.b_tokens_per_second:.1f} |",
        f"| authority passes per token | {s.a_passes_per_token:.3f} | {s.b_passes_per_token:.3f} |",
        f"| repetition of the text (median over prompts) | {s.a_repetition:.2f} | {s.b_repetition:.2f} |",
    ]
    rates = {arm: _edge_rates(runs, arm) for arm in "AB"}
    for key in sorted(set(rates["A"]) | set(rates["B"])):
        fa = f"{rates['A'][key]:.2f}" if key in rates["A"] else "—"
        fb = f"{rates['B'][key]:.2f}" if key in rates["B"] else "—"
        lines.append(f"| acceptance {key} | {fa} | {fb} |")
    lines += [
        "",
        f"**Per-prompt speed ratio B/A, geometric mean: {s.geomean_ratio:.3f}** ({interval}; median "
        f"{s.median_ratio:.3f}; sign-flip permutation test of the log ratios, p = {s.p_value:.4f}): {verdict}. "
        f"Per prompt: {', '.join(f'{r:.3f}' for r in s.per_prompt_ratio)}.",
        "",
    ]
    if config["temperature"] == 0:
        lines.append("Exactness: " + ("**FAILED** — outputs differ for " + json.dumps(s.exactness_failures)
                                      if s.exactness_failures else "both policies produced identical tokens on every run."))
    else:
        lines.append("Exactness under sampling is not checked here (the arms draw differently from the same seed); "
                     "`cascade bench --temperature T` checks it by distribution.")
    lines += ["", "Plots: `speedup.png` (per-prompt ratio), `acceptance.png` (acceptance by draft position per edge).", ""]
    return "\n".join(lines)


def _plots(out: Path, s: Summary, runs: list[Run]) -> None:
    try:
        import matplotlib
    except ImportError:  # plots are optional: pip install "cascade-spec[plots]"
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(range(len(s.per_prompt_ratio)), s.per_prompt_ratio, color="tab:blue")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(s.geomean_ratio, color="tab:red", lw=1, label=f"geometric mean {s.geomean_ratio:.3f}")
    ax.axhline(s.median_ratio, color="tab:green", lw=1, ls="--", label=f"median {s.median_ratio:.3f}")
    if s.ci_low is not None:
        ax.axhspan(s.ci_low, s.ci_high, color="tab:red", alpha=0.15, label="95% CI of the geometric mean")
    ax.set_xlabel("prompt")
    ax.set_ylabel("tokens/s ratio B/A")
    ax.set_title(f"B = {s.b}  vs  A = {s.a}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, arm, name in zip(axes, "AB", (s.a, s.b)):
        for key, rates in sorted(_acceptance_by_position(runs, arm).items()):
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=key)
        ax.set_title(f"{arm}: {name}")
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("acceptance (given the previous accepted)")
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=100)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("ab", help="compare two policies on the same prompts (A/B)",
                       description="Run two policies on the same prompts and seeds, interleaved in random order "
                                   "after a warm-up; report the per-prompt tokens/s ratios B/A by their geometric "
                                   "mean with a paired bootstrap 95% CI, their median, and a permutation p-value on "
                                   "the log ratios; write ab.json, summary.md and PNG plots to --out.")
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--a", required=True, type=types.policy_spec, help="policy A: NAME[:key=value,...]")
    p.add_argument("--b", required=True, type=types.policy_spec, help="policy B: NAME[:key=value,...]")
    p.add_argument("--prompts", required=True, help="JSONL file, one object with a 'prompt' field per line")
    p.add_argument("--num-prompts", type=types.positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=types.positive_int, default=128)
    p.add_argument("--repeats", type=types.positive_int, default=3)
    types.add_sampling_args(p, what="both arms")
    p.add_argument("--warmup", type=types.nonnegative_int, default=2, help="prompts run once per arm before measuring")
    p.add_argument("--backend", choices=("local", "ray"), default=None,
                   help="where the levels run (default: the topology's backend)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_main)


@guarded
def _main(args) -> int:
    from cascade.tools.baselines import load_prompts

    prompts = load_prompts(args.prompts, args.num_prompts)
    t0 = time.perf_counter()
    s, _ = run_ab(args.topology, args.a, args.b, prompts, args.max_new_tokens, args.repeats, args.out,
                  args.temperature, args.seed, args.warmup, progress=not args.no_progress, top_k=args.top_k,
                  top_p=args.top_p, backend=args.backend)
    print((Path(args.out) / "summary.md").read_text())
    print(f"({time.perf_counter() - t0:.0f} s; report in {args.out})")
    if s.exactness_failures:
        print(f"EXACTNESS FAILURE: {len(s.exactness_failures)} run pair(s) differ", file=sys.stderr)
        return 2
    return 0
