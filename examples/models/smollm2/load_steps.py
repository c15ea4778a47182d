"""Where a continuous batch's time goes under `auto`, against the authority decoding alone.

Two measurements on a topology (default ``topologies/smollm2.yaml``), one process, one thread:

* ``--mode load``: requests served as a server serves them, ``--concurrency`` at a time out of
  ``--requests`` (chat prompts from ``--prompts``, repeated), ``--max-new-tokens`` each. Each round
  runs `auto` — a fresh policy warmed by one request at one sequence first, as ``cascade bench
  serve``'s warm-up warms a server — then the authority alone (``fixed:path=[<authority>]``), and
  prints tokens/s of each and, for `auto`, every plan's kind (probe / explore / exploit), path and
  batch size with the seconds its steps took and the tokens they committed.
* ``--mode sampled``: the authority alone at ``--concurrency`` sequences, greedy and T = 0.8
  (top-p 0.95) side by side, their steps alternated; the median of the sampled/greedy ratio of
  neighbouring steps, and its quartiles.

    OMP_NUM_THREADS=1 python examples/models/smollm2/load_steps.py --mode load --concurrency 4
    OMP_NUM_THREADS=1 python examples/models/smollm2/load_steps.py --mode sampled --concurrency 16
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from cascade import Cascade
from cascade.engine import Batch
from policies import make_policy
from policies.adaptive import EscalationPolicy


def prompts(path: str, n: int) -> list[str]:
    chats = [json.loads(line)["prompt"] for line in open(path)]
    return [chats[i % len(chats)] for i in range(n)]


class Recorder:
    """Each of an escalation policy's plans (kind, path, batch size) with its step's seconds and
    the tokens it committed, through the real Batch.step (wrapped, not replaced)."""

    def __init__(self):
        self.rows: list[tuple[str, str, int, float, int]] = []
        plan, step, rec = EscalationPolicy.plan, Batch.step, self

        def planning(policy, ctx):
            out = plan(policy, ctx)
            rec.planned.append((policy._planned[3].value, "->".join(policy._planned[1]), ctx.batch_size))
            return out

        def stepping(batch):
            rec.planned = []
            t0 = time.perf_counter()
            out = step(batch)
            seconds, tokens = time.perf_counter() - t0, sum(len(new) for _, new in out)
            for kind, path, size in rec.planned:  # a step of several groups: shared evenly
                rec.rows.append((kind, path, size, seconds / len(rec.planned), tokens / len(rec.planned)))
            return out

        EscalationPolicy.plan, Batch.step = planning, stepping

    def table(self) -> str:
        by = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for kind, path, size, seconds, tokens in self.rows:
            row = by[kind, path, size]
            row[0], row[1], row[2] = row[0] + 1, row[1] + seconds, row[2] + tokens
        lines = []
        for (kind, path, size), (n, seconds, tokens) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"    {kind:8s} {path:28s} batch {size:2d}: {n:4d} plans {seconds:6.2f} s "
                         f"{tokens:5.0f} tokens {1000 * seconds / max(tokens, 1):6.1f} ms/token")
        return "\n".join(lines)


def load(args, cascade: Cascade) -> None:
    requests, alone = prompts(args.prompts, args.requests), f"fixed:path=[{cascade.engine.authority}]"
    sampling = dict(temperature=args.temperature, top_p=0.95 if args.temperature else None, seed=1)
    recorder = Recorder()

    def run(policy) -> float:
        t0 = time.perf_counter()
        out = cascade.generate(requests, max_new_tokens=args.max_new_tokens, batch_size=args.concurrency,
                               policy=policy, **sampling)
        return sum(len(g.token_ids) for g in out) / (time.perf_counter() - t0)

    for r in range(args.rounds):
        auto = make_policy("auto", {})
        cascade.generate(requests[0], max_new_tokens=args.max_new_tokens, policy=auto, **sampling)  # the warm-up
        recorder.rows.clear()
        fast = run(auto)
        table = recorder.table()
        plain = run(alone)
        print(f"round {r}: auto {fast:.1f} tokens/s, authority alone {plain:.1f}: {fast / plain:.2f}x\n{table}",
              flush=True)


def sampled(args, cascade: Cascade) -> None:
    policy = cascade.engine.bind(make_policy("fixed", {"path": [cascade.engine.authority]}))
    chats = prompts(args.prompts, args.concurrency)

    def batch(temperature: float) -> Batch:
        b = Batch(cascade.engine, policy)
        for i, chat in enumerate(chats):
            b.add(cascade.request(chat, max_new_tokens=args.max_new_tokens, temperature=temperature,
                                  top_p=0.95 if temperature else None, seed=i))
        return b

    greedy, sampling = batch(0.0), batch(0.8)
    for _ in range(3):
        greedy.step(), sampling.step()
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(args.max_new_tokens - 8):
        for which in ((0, 1) if i % 2 else (1, 0)):
            t0 = time.perf_counter()
            (greedy, sampling)[which].step()
            times[which].append(time.perf_counter() - t0)
    ratios = sorted(s / g for g, s in zip(times[0], times[1]))
    q = len(ratios) // 4
    print(f"{args.concurrency} sequences: a greedy step {1000 * statistics.median(times[0]):.1f} ms, a sampled one "
          f"{1000 * statistics.median(times[1]):.1f} ms (medians); sampled / greedy, neighbouring steps: median "
          f"{statistics.median(ratios):.3f}, quartiles {ratios[q]:.3f}-{ratios[-q - 1]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("load", "sampled"), default="load")
    p.add_argument("--topology", "-t", default="topologies/smollm2.yaml")
    p.add_argument("--prompts", default="examples/prompts/chat-unseen.jsonl")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    with Cascade.from_topology(args.topology) as cascade:
        (load if args.mode == "load" else sampled)(args, cascade)


if __name__ == "__main__":
    main()
