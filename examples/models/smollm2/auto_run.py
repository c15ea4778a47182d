"""Tokens/s and per-edge use of one topology under ``auto``, prompt after prompt in one process.

    OMP_NUM_THREADS=1 python examples/models/smollm2/auto_run.py [--prompts runs/p8.jsonl] [--temperature 0.8]

For comparing two versions of the code on the same machine: run it alternately from each
checkout (``PYTHONPATH=<checkout>``, from that checkout's root), a few rounds, and compare the
rounds side by side. The policy learns across the prompts, as in a server. Requests use the
speculative rule ("residual", as the benchmarks and unseeded requests do), 128 tokens, top-p
0.95, seeds 0.. in prompt order. Needs the pulled model (``cascade pull smollm2-135m-instruct``).
"""
import argparse
import json
from collections import Counter
from pathlib import Path

from cascade import Cascade

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default=str(ROOT / "topologies" / "smollm2.yaml"))
    parser.add_argument("--prompts", default=str(ROOT / "examples" / "prompts" / "chat-heldout.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--label", default="", help="printed first on the result line")
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()][:args.num_prompts]
    cascade = Cascade.from_topology(args.topology)
    authority = cascade.topology.authority
    run = dict(max_new_tokens=128, temperature=args.temperature, top_p=0.95, policy="auto", coupling="residual")
    cascade.generate(prompts[0], **{**run, "max_new_tokens": 16}, seed=0)  # warm-up
    tokens = seconds = 0.0
    proposed, accepted, passes = Counter(), Counter(), Counter()
    for seed, prompt in enumerate(prompts):
        g = cascade.generate(prompt, **run, seed=seed)
        tokens += len(g.token_ids)
        seconds += g.stats.wall_seconds
        for edge, s in g.stats.edges.items():
            proposed[edge] += s.proposed
            accepted[edge] += s.accepted
        for level, s in g.stats.levels.items():
            passes[level] += s.forward_passes
    edges = "; ".join(f"{e}: {proposed[e]} proposed, {accepted[e] / max(1, proposed[e]):.2f} accepted"
                     for e in sorted(proposed))
    print(f"{args.label} {tokens / seconds:.2f} tok/s, {passes[authority] / tokens:.3f} authority passes a token; "
          f"{edges}", flush=True)


if __name__ == "__main__":
    main()
