"""``cascade cost-curve``: what one forward pass of each level costs, by the number of new
positions it scores, after a prefix — measured through the level's own worker (the pass a
verification makes), so that drafters can be sized against the authority on *this* machine.

Speculation pays when scoring a block costs little more than scoring one token (the weights are
read once either way); how much more depends on the processor and the dtype (in bf16, on
which bf16 instructions the CPU has). Widths and levels are measured interleaved, in a fresh
random order each repeat, and reported as median (min–max) over the repeats, with torch's threads set
and said. ``--batch B`` measures a pass over B sequences at once, each scoring the width (B x width
positions in all): what a verification costs a server decoding B requests, where a drafted position
costs the verifier more than at batch 1.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from cascade.cli import args as types
from cascade.cli.args import DEFAULT_TOPOLOGY, guarded
from cascade.tools.timing import (DEFAULT_THREADS, Spread, busy_warning, machine, machine_line, threads_line,
                                  torch_threads)


def add_parser(sub) -> None:
    p = sub.add_parser("cost-curve", help="each level's forward-pass cost by the number of positions it scores",
                       description=__doc__.split("\n\n")[0].replace("``", "'"))
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--levels", nargs="*", default=None, help="levels to measure (default: every model level)")
    p.add_argument("--positions", default="1,2,4,8,16,32", help="widths to score, comma-separated")
    p.add_argument("--prefix", type=types.positive_int, default=200, help="tokens already in the cache")
    p.add_argument("--batch", type=types.positive_int, default=1,
                   help="sequences in each pass, each scoring the width (default 1)")
    p.add_argument("--repeats", type=types.positive_int, default=7)
    p.add_argument("--threads", type=types.positive_int, default=DEFAULT_THREADS)
    p.add_argument("--backend", choices=("local", "ray"), default=None,
                   help="where the levels run (default: the topology's backend)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    from cascade.api import Cascade

    widths = [int(w) for w in args.positions.split(",") if w.strip()]
    if not widths or min(widths) < 1:
        print("cascade cost-curve: --positions must be integers >= 1", file=sys.stderr)
        return 2
    with torch_threads(args.threads) as threads, Cascade.from_topology(args.topology, backend=args.backend) as c:
        scoring = [lv.name for lv in c.topology.spec.levels if c.workers[lv.name].can_score]
        levels = args.levels or scoring
        wrong = [level for level in levels if level not in scoring]
        if wrong:
            print(f"cascade cost-curve: --levels: {', '.join(wrong)} has no forward pass to measure here "
                  f"(an n-gram level, a feature head, or not in the topology); levels with one: "
                  f"{', '.join(scoring)}", file=sys.stderr)
            return 2
        print(threads_line(threads))
        result = {"topology": args.topology, "threads": threads, "prefix": args.prefix, "batch": args.batch,
                  "machine": machine(), "levels": {}}
        print(machine_line(result["machine"]))
        times = measure({level: c.workers[level] for level in levels}, widths, args.prefix, args.repeats, args.batch)
        per = f", {args.batch} sequences a pass, each" if args.batch > 1 else ""
        for level in levels:
            spreads = {w: Spread.of([t * 1000 for t in ts]) for w, ts in times[level].items()}
            dtype = c.topology.spec.level(level).dtype
            print(f"{level} ({dtype}), ms by new positions{per}: "
                  + "  ".join(f"{w}: {s.format('.1f')}" for w, s in spreads.items()))
            one = spreads[widths[0]].median
            print(f"  cost relative to {widths[0]} position(s): "
                  + "  ".join(f"{w}: {s.median / one:.2f}x" for w, s in spreads.items()))
            result["levels"][level] = {"dtype": dtype, "ms": {w: s.to_dict() for w, s in spreads.items()}}
            warning = busy_warning({f"{level} at {w}": s for w, s in spreads.items()})
            if warning:
                print(warning)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def measure(workers: dict, widths: list[int], prefix: int, repeats: int,
            batch: int = 1) -> dict[str, dict[int, list[float]]]:
    """Seconds of one ``score`` call over ``w`` new positions after ``prefix`` cached tokens for
    each of ``batch`` sequences, per level and width, ``repeats`` times: each repeat takes the
    widths in a fresh random order and, for each width, the levels in a fresh random order (side
    by side, so that levels compare under the same conditions)."""
    rng = random.Random(0)
    vocab = min(worker.vocab_size for worker in workers.values())
    ids = [f"cost-curve-{b}" for b in range(batch)]
    bases = [[rng.randrange(vocab) for _ in range(prefix)] for _ in ids]
    ones = [1] * batch
    for worker in workers.values():
        worker.score(ids, bases, ones)  # warm-up and prefill
    times: dict[str, dict[int, list[float]]] = {level: {w: [] for w in widths} for level in workers}
    for _ in range(repeats):
        for w in rng.sample(widths, len(widths)):
            new = [base + [rng.randrange(vocab) for _ in range(w)] for base in bases]
            for level in rng.sample(list(workers), len(workers)):
                worker = workers[level]
                worker.score(ids, bases, ones)  # the cache holds the prefix alone
                started = time.perf_counter()
                worker.score(ids, new, [w] * batch)
                times[level][w].append(time.perf_counter() - started)
    for worker in workers.values():
        worker.release(ids)
    return times
