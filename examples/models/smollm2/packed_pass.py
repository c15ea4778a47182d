"""What a batched verifying pass costs when its rows verify blocks of different lengths: padded to
the widest row, or packed (the products over the real positions only; workers/lean.py
``packed_positions``).

Loads the main topology's authority (SmolLM2-135M-Instruct, the dtype ``fastest`` picks), caches
``--rows`` chat prompts, then times passes in which ``d`` rows score ``k + 1`` new positions and the
others one, each padded (``PACK_BELOW = 0``) and packed (the default), best of 3, rounds
interleaved.

    OMP_NUM_THREADS=1 python examples/models/smollm2/packed_pass.py --rows 16 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import time

from cascade.api import Cascade
from workers import lean

SHAPES = [(0, 0), (1, 12), (4, 12), (8, 4), (16, 12)]  # (rows drafting, tokens each drafts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", default="examples/prompts/chat-unseen.jsonl")
    args = ap.parse_args()
    default = lean.PACK_BELOW
    with Cascade.from_topology("topologies/smollm2.yaml") as c:
        worker, rows = c.workers[c.topology.authority], args.rows
        prompts = [json.loads(line)["prompt"] for line in open(args.prompts)]
        ids = [f"s{i}" for i in range(rows)]
        base = [c.tokenizer(prompts[i % len(prompts)])["input_ids"] for i in range(rows)]
        worker.score(ids, base, [1] * rows)

        def seconds(drafting: int, k: int, share: float) -> float:
            lean.PACK_BELOW = share
            tokens = [b + list(range(1000, 1001 + k)) if i < drafting else b + [1000] for i, b in enumerate(base)]
            t0 = time.perf_counter()
            worker.score(ids, tokens, [k + 1 if i < drafting else 1 for i in range(rows)])
            dt = time.perf_counter() - t0
            worker.score(ids, base, [1] * rows)  # back to the prompts
            return dt

        for r in range(args.rounds):
            for drafting, k in SHAPES:
                padded = min(seconds(drafting, k, 0.0) for _ in range(3))
                packed = min(seconds(drafting, k, default) for _ in range(3))
                print(f"round {r + 1}: {rows} rows, {drafting} verifying {k} drafted: "
                      f"padded {padded * 1000:.0f} ms, packed {packed * 1000:.0f} ms")
    lean.PACK_BELOW = default


if __name__ == "__main__":
    main()
