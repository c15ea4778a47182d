"""Does the feature head draft as well for the 4-bit authority as for the bf16 one? The same fixed
head chain (``fixed:path=[head,smollm2],lookahead=4``) on both topologies, the same chats, greedy
and T = 0.8: tokens per authority pass, drafted tokens accepted, and the first drafted token's
acceptance. The head reads the authority's features; the 4-bit pass computes the same model (its
GGUF's weights) to bf16's rounding, so the figures should agree.

    OMP_NUM_THREADS=1 python examples/models/smollm2/head_on_q4.py --prompts 6 --tokens 96
"""
from __future__ import annotations

import argparse
import json

from cascade import Cascade

POLICY = "fixed:path=[head,smollm2],lookahead=4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--file", default="examples/prompts/chat-unseen.jsonl")
    args = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(args.file)][:args.prompts]
    for topology in ("topologies/smollm2.yaml", "topologies/smollm2-q4.yaml"):
        with Cascade.from_topology(topology) as c:
            for temperature in (0.0, 0.8):
                tokens = passes = accepted = proposed = first_seen = first_accepted = 0
                for i, prompt in enumerate(prompts):
                    g = c.generate(prompt, max_new_tokens=args.tokens, temperature=temperature,
                                   top_p=0.95 if temperature else None, seed=i, policy=POLICY)
                    edge = g.stats.edges["head->smollm2"]
                    tokens, passes = tokens + g.stats.new_tokens, passes + g.stats.authority_passes
                    accepted, proposed = accepted + edge.accepted, proposed + edge.proposed
                    first_seen += edge.examined_by_position[0]
                    first_accepted += edge.accepted_by_position[0]
                print(f"{topology} T={temperature}: {tokens / passes:.2f} tokens a pass, drafted tokens accepted "
                      f"{accepted / proposed:.2f}, the first {first_accepted / first_seen:.2f}")


if __name__ == "__main__":
    main()
