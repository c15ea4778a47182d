"""``cascade validate`` and ``cascade generate``."""
from __future__ import annotations

import argparse
import json
import sys

DEFAULT_TOPOLOGY = "topologies/4level.yaml"


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check a topology file and show its graph",
                       description="Validate a topology: print its levels, edges and paths to the "
                                   "authority, or the error (exit status 1).")
    p.add_argument("topology", help="path to a topology YAML file")
    p.add_argument("--no-models", action="store_true", help="skip checking model files and vocabularies")
    p.set_defaults(func=validate)

    p = sub.add_parser("generate", help="generate from one prompt and print the text and statistics",
                       description="Generate a continuation of PROMPT with the topology's hierarchy.")
    p.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    add_generation_args(p)
    p.add_argument("--stream", action="store_true", help="print text as it is committed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=generate)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    from cascade.cli import args as types

    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY, help=f"topology file (default {DEFAULT_TOPOLOGY})")
    p.add_argument("--max-new-tokens", type=types.positive_int, default=128)
    p.add_argument("--temperature", type=types.temperature, default=None, help="0 = greedy (default: the topology's)")
    p.add_argument("--top-k", type=types.nonnegative_int, default=None, help="0 = off")
    p.add_argument("--top-p", type=types.top_p, default=None, help="in (0, 1]; 1 = off")
    p.add_argument("--seed", type=types.seed, default=None)
    p.add_argument("--coupling", choices=("residual", "gumbel"), default=None,
                   help="gumbel: a seed gives the same tokens whatever the policy; residual: the most "
                        "acceptance (default: the topology's; unset there, gumbel with --seed, else residual)")
    p.add_argument("--stop", action="append", type=types.nonempty, default=None, help="stop string (repeatable)")
    p.add_argument("--policy", type=types.policy_spec, default=None,
                   help="NAME[:key=value,...], e.g. fixed:lookahead=4")
    p.add_argument("--device", type=types.device, default=None,
                   help="override every level's device (cpu, cuda:0, auto)")


def load_cascade(args):
    from cascade.api import Cascade

    # a spec string: parsed by policies.from_spec and checked against the graph before models load
    return Cascade.from_topology(args.topology, policy=args.policy or None, device=args.device)


def guarded(func):
    """Report cascade's own errors as one line on stderr with exit status 1."""
    def wrapper(args) -> int:
        from cascade.errors import CascadeError
        from policies import PolicyError

        try:
            return func(args)
        except (CascadeError, PolicyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper


@guarded
def validate(args) -> int:
    from cascade.topology import load_topology

    topo = load_topology(args.topology, check_models=not args.no_models)
    spec = topo.spec
    print(f"topology {topo.source}: OK ({len(spec.levels)} levels, authority: {topo.authority})")
    print("levels:")
    for level in spec.levels:
        where = level.model if level.kind == "hf" else level.params or ""
        print(f"  {level.name:<12} {level.kind:<8} {level.dtype:<8} {level.device:<7} {where}")
    print("edges (proposer -> verifier):")
    for a, b in topo.graph.edges:
        print(f"  {a} -> {b}")
    print("paths to the authority:")
    for path in topo.paths():
        print("  " + " -> ".join(path))
    print(f"policy: {spec.policy.name} {spec.policy.params or ''}".rstrip())
    return 0


@guarded
def generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with load_cascade(args) as c:
        kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, stop=args.stop, coupling=args.coupling)
        if args.stream:
            for chunk in c.stream(prompt, **kwargs):
                print(chunk, end="", flush=True)
            print()
            return 0
        g = c.generate(prompt, **kwargs)
    if args.json:
        print(json.dumps(g.to_dict(), indent=2))
    else:
        print(prompt + g.text)
        print(f"\n--- finish: {g.finish_reason}")
        print(g.stats)
    return 0
