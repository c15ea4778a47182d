"""What position-keyed randomness (``coupling="gumbel"``) costs in acceptance, and that it keeps
its promise: under sampling, the same seed gives the same tokens whatever the policy.

    python examples/reports/coupling_cost.py [--prompts 8] [--max-new-tokens 64]

On the bundled family (topologies/4level.yaml) at T = 0.8, top-p 0.95: for the chain-tuned
fixed policy and for ``auto``, each coupling's acceptance per edge and tokens per authority pass
(same prompts, same seeds); then whether each policy's gumbel tokens equal the authority's alone.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cascade import Cascade
from cascade.tools.baselines import load_prompts

ROOT = Path(__file__).resolve().parents[2]
POLICIES = {"fixed (chain-tuned)": "fixed:lookahead={tiny: 3, small: 5, medium: 8},path=[tiny, small, medium, large]",
            "auto": "auto"}
SAMPLING = dict(temperature=0.8, top_p=0.95, seed=7)


def summary(results) -> dict:
    edges: dict[str, list[int]] = {}
    for g in results:
        for name, e in g.stats.edges.items():
            acc = edges.setdefault(name, [0, 0])
            acc[0] += e.accepted
            acc[1] += e.proposed
    passes = sum(g.stats.authority_passes for g in results)
    tokens = sum(len(g.token_ids) for g in results)
    return {"tokens_per_authority_pass": tokens / passes,
            "acceptance": {k: round(a / p, 3) for k, (a, p) in sorted(edges.items()) if p}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = load_prompts(ROOT / "examples/prompts/heldout.jsonl", args.prompts)
    out: dict = {}
    tokens: dict[str, list[list[int]]] = {}
    with Cascade.from_topology(ROOT / "topologies/4level.yaml") as c:
        c.generate(prompts[:1], max_new_tokens=16, **SAMPLING)  # warm-up
        for name, policy in POLICIES.items():
            for coupling in ("residual", "gumbel"):
                gs = c.generate(prompts, max_new_tokens=args.max_new_tokens, coupling=coupling, policy=policy,
                                **SAMPLING)
                out[f"{name}, {coupling}"] = summary(gs)
                if coupling == "gumbel":
                    tokens[name] = [g.token_ids for g in gs]
    with tempfile.TemporaryDirectory() as tmp:
        alone = Path(tmp) / "alone.yaml"
        alone.write_text(f"levels:\n  - {{name: large, model: {ROOT / 'examples/models/large'}}}\n")
        with Cascade.from_topology(alone) as c:
            ref = [g.token_ids for g in c.generate(prompts, max_new_tokens=args.max_new_tokens, coupling="gumbel",
                                                   **SAMPLING)]
    out["gumbel tokens equal the authority's alone"] = {name: t == ref for name, t in tokens.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
