"""Measure what the Ray backend costs: tokens/s over Ray ÷ tokens/s in-process, and payload bytes
per committed token, on one topology, in one run on this machine.

    python -m cascade.tools.ray_overhead --topology topologies/4level.yaml --prompts examples/prompts/heldout.jsonl

Both backends are loaded side by side and the prompts alternate between them (in-process, then
Ray, prompt by prompt), so that a noisy machine slows both alike; each backend first runs one
unmeasured warm-up prompt. The in-process backend gets as many torch threads as each actor
(``--threads``). Every pair of outputs must be token-identical (greedy, or the same seed).
Ray starts privately on loopback unless ``--address`` names a cluster.

Without a trained family, ``--random-family DIR --tokenizer PATH`` first writes one with the
bundled family's shapes (``cascade.train.family.SIZES``) and a topology for it: ``independent`` drafts
(random, so they rarely agree: many calls per committed token) or ``truncated`` drafts (the
authority's first 1/4/7 layers, which agree with it often, as trained drafts do).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cascade.tools.ray_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", "-t", default="topologies/4level.yaml")
    p.add_argument("--prompts", default="examples/prompts/heldout.jsonl")
    p.add_argument("--limit", type=int, default=8, help="prompts to measure")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the in-process backend")
    p.add_argument("--address", default="local", help="Ray address (default: a private local runtime)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--random-family", metavar="DIR", default=None,
                   help="write a random family with the bundled shapes to DIR and measure on it")
    p.add_argument("--drafts", choices=("independent", "truncated"), default="truncated")
    p.add_argument("--tokenizer", default="examples/models/large", help="tokenizer for --random-family")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.random_family:
        args.topology = str(write_random_family(args.random_family, args.tokenizer, args.drafts))

    import torch

    from cascade.api import Cascade
    from cascade.tools.baselines import load_prompts

    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit + 1)
    warmup, prompts = prompts[0], prompts[1:]
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p)
    seconds = {"local": 0.0, "ray": 0.0}
    tokens = {"local": 0, "ray": 0}
    with Cascade.from_topology(args.topology, backend="local") as local, \
            Cascade.from_topology(args.topology, backend="ray", address=args.address) as remote:
        cascades = {"local": local, "ray": remote}
        for c in cascades.values():
            c.generate(warmup, seed=args.seed, **kwargs)
        remote.backend.reset_wire_stats()
        for i, prompt in enumerate(prompts):
            out = {}
            for name, c in cascades.items():
                t0 = time.perf_counter()
                out[name] = c.generate(prompt, seed=args.seed + i, **kwargs)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out[name].token_ids)
            if out["local"].token_ids != out["ray"].token_ids:
                print(f"error: prompt {i}: Ray and in-process outputs differ", file=sys.stderr)
                return 1
        wire = remote.backend.wire_stats()
    rate = {k: tokens[k] / seconds[k] for k in seconds}
    figures = {
        "topology": args.topology,
        "prompts": len(prompts),
        "tokens": tokens["ray"],
        "local_tokens_per_s": round(rate["local"], 2),
        "ray_tokens_per_s": round(rate["ray"], 2),
        "ratio_ray_over_local": round(rate["ray"] / rate["local"], 3),
        "remote_calls": wire.calls,
        "calls_per_token": round(wire.calls / tokens["ray"], 2),
        "bytes_per_token": round(wire.total / tokens["ray"], 1),
        "bytes_sent_per_token": round(wire.sent / tokens["ray"], 1),
        "bytes_received_per_token": round(wire.received / tokens["ray"], 1),
        "received_vs_dense_rows": round(wire.received / max(1, wire.rows_dense), 4),
        "identical": True,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for k, v in figures.items():
            print(f"{k:<26}{v}")
    return 0


def write_random_family(root: str, tokenizer_path: str, drafts: str):
    """A family with the bundled shapes and random weights, and ``root/topology.yaml``."""
    from pathlib import Path

    import yaml
    from transformers import AutoTokenizer

    from cascade.train.family import LEVELS, SIZES, make_model, save_model

    root_dir = Path(root)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    large = make_model(SIZES["large"], tokenizer, seed=0)
    for i, name in enumerate(LEVELS):
        if name == "large":
            model = large
        elif drafts == "truncated":  # the authority's first layers, its own embeddings and head
            size = {**SIZES["large"], "layers": SIZES[name]["layers"]}
            model = make_model(size, tokenizer, seed=0)
            model.load_state_dict(large.state_dict(), strict=False)
        else:
            model = make_model(SIZES[name], tokenizer, seed=i + 1)
        save_model(model, tokenizer, root_dir / name, dtype="float32")
    # Four actors on however few CPUs: a share each (one torch thread apiece either way).
    topo = {"name": f"random-{drafts}",
            "levels": [{"name": n, "model": n, "resources": {"num_cpus": 0.25}} for n in LEVELS],
            "policy": {"name": "fixed", "params": {"lookahead": {"tiny": 3, "small": 5, "medium": 8}}},
            "ray": {"ngram_in_driver": True}}
    path = root_dir / "topology.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


if __name__ == "__main__":
    sys.exit(main())
