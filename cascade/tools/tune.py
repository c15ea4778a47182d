"""``cascade tune``: the best fixed lookahead per level on a tuning prompt set.

Coordinate descent over ``lookahead[level] in 1..max`` (one level at a time, the others held),
measuring committed tokens/s of greedy generation on the tuning prompts. The result is the
strongest ``fixed`` baseline to A/B adaptive policies against — tuned on prompts that the
A/B run does not use.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cascade.cli import args as types
from cascade.cli.args import DEFAULT_TOPOLOGY, guarded


def measure(c, prompts: list[str], lookahead: dict[str, int], max_new_tokens: int,
            path: list[str] | None = None) -> float:
    from policies.fixed import FixedPolicy

    policy = FixedPolicy(dict(lookahead), path=path)
    tokens = seconds = 0.0
    for prompt in prompts:
        g = c.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, policy=policy)
        tokens += g.stats.new_tokens
        seconds += g.stats.wall_seconds
    return tokens / seconds


def tune_fixed(c, prompts: list[str], max_new_tokens: int = 64, max_lookahead: int = 8, passes: int = 2,
               start: dict[str, int] | None = None, log=print, path: list[str] | None = None
               ) -> tuple[dict[str, int], float, list[dict]]:
    from policies.base import longest_path

    path = list(path or longest_path(c.topology.graph, c.topology.authority))
    lookahead = dict(start or {n: min(max_lookahead, 2 + 2 * i) for i, n in enumerate(path[:-1])})
    measure(c, prompts[:1], lookahead, 16, path)  # warm-up
    history = []
    best = measure(c, prompts, lookahead, max_new_tokens, path)
    history.append({"lookahead": dict(lookahead), "tokens_per_second": best})
    for _ in range(passes):
        improved = False
        for level in path[:-1]:
            current = lookahead[level]
            for k in range(1, max_lookahead + 1):
                if k == current:
                    continue
                trial = dict(lookahead, **{level: k})
                rate = measure(c, prompts, trial, max_new_tokens, path)
                history.append({"lookahead": trial, "tokens_per_second": rate})
                if rate > best:
                    best, lookahead, improved = rate, trial, True
            log(f"  {level}: best so far {lookahead} at {best:.1f} tok/s")
        if not improved:
            break
    return lookahead, best, history


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="find the best fixed lookahead per level on tuning prompts",
                       description="Coordinate descent over the fixed policy's lookahead per level (1..max), "
                                   "measuring greedy tokens/s on a tuning prompt set.")
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--prompts", default="examples/prompts/tuning.jsonl")
    p.add_argument("--num-prompts", type=types.positive_int, default=None)
    p.add_argument("--max-new-tokens", type=types.positive_int, default=64)
    p.add_argument("--max-lookahead", type=types.positive_int, default=8)
    p.add_argument("--passes", type=types.positive_int, default=2)
    p.add_argument("--path", default=None, help="comma-separated levels ending at the authority (default: the longest)")
    p.add_argument("--out", default=None, help="write the result and every trial as JSON here")
    p.set_defaults(func=_main)


@guarded
def _main(args) -> int:
    from cascade.api import Cascade
    from cascade.tools.baselines import load_prompts

    prompts = load_prompts(args.prompts, args.num_prompts)
    t0 = time.perf_counter()
    with Cascade.from_topology(args.topology) as c:
        path = args.path.split(",") if args.path else None
        lookahead, best, history = tune_fixed(c, prompts, args.max_new_tokens, args.max_lookahead, args.passes,
                                              log=lambda m: print(m, file=sys.stderr), path=path)
    spec = "fixed:lookahead={" + ", ".join(f"{k}: {v}" for k, v in lookahead.items()) + "}"
    if path:
        spec += ",path=[" + ", ".join(path) + "]"
    print(f"best fixed lookahead: {lookahead}  ({best:.1f} tok/s, {len(history)} trials, "
          f"{time.perf_counter() - t0:.0f} s)")
    print(f"policy spec: '{spec}'")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"lookahead": lookahead, "tokens_per_second": best,
                                              "policy": spec, "trials": history}, indent=1))
    return 0
