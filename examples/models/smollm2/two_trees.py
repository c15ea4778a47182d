"""The same topology run by two checkouts of cascade, to show that a change kept the output and
the speed: run it once per checkout, alternating, and compare the JSON files.

    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/old python examples/models/smollm2/two_trees.py tokens old.json
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/new python examples/models/smollm2/two_trees.py tokens new.json
    OMP_NUM_THREADS=1 PYTHONPATH=/path/to/old python examples/models/smollm2/two_trees.py speed old-1.json

``tokens``: the first 4 chats of ``--prompts`` at 48 new tokens, greedy and T = 0.8 (top-p 0.95,
seed 11), at batch 1 and 4, every level in float32 (so that a bf16 near-tie, which can tell two
pass shapes apart, does not tell two checkouts apart): the token ids. ``speed``: 8 chats at 96 new
tokens, greedy and T = 0.8 (seed 3), at batch 1 and 4, the topology as it is: tokens/s. Only the
public API is used (``Cascade.from_topology``, ``generate``), so an older checkout runs it too.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cascade import Cascade

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("tokens", "speed"))
    p.add_argument("out")
    p.add_argument("--topology", "-t", default=str(ROOT / "topologies/smollm2.yaml"))
    p.add_argument("--prompts", default=str(ROOT / "examples/prompts/chat-unseen.jsonl"))
    args = p.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:8]
    topology = Path(args.topology)
    if args.mode == "tokens":  # a float32 copy beside the original, so that its relative paths hold
        text = topology.read_text().replace("dtype: fastest", "dtype: float32")
        topology = topology.with_name(topology.stem + ".float32.tmp.yaml")
        topology.write_text(text)
    try:
        cascade = Cascade.from_topology(str(topology))
    finally:
        if args.mode == "tokens":
            topology.unlink()
    result = {}
    if args.mode == "speed":
        cascade.generate(prompts[0], max_new_tokens=16)  # warm
    for batch in (1, 4):
        for name, sampling in (("greedy", {}), ("sampled", dict(temperature=0.8, top_p=0.95))):
            if args.mode == "tokens":
                out = cascade.generate(prompts[:4], max_new_tokens=48, batch_size=batch, seed=11, **sampling)
                result[f"{name}-b{batch}"] = [g.token_ids for g in out]
            else:
                t0 = time.perf_counter()
                out = cascade.generate(prompts, max_new_tokens=96, batch_size=batch, seed=3, **sampling)
                result[f"{name}-b{batch}"] = sum(len(g.token_ids) for g in out) / (time.perf_counter() - t0)
    cascade.close()
    Path(args.out).write_text(json.dumps(result))
    print(result if args.mode == "speed" else {k: sum(map(len, v)) for k, v in result.items()})


if __name__ == "__main__":
    main()
