"""``cascade validate`` and ``cascade generate``."""
from __future__ import annotations

import json
import sys

from cascade.cli.args import add_generation_args, guarded, topology_file


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


def load_cascade(args):
    from cascade.api import Cascade

    args.topology = topology_file(args.topology, lambda line: print(line, file=sys.stderr))
    # a spec string: parsed by policies.from_spec and checked against the graph before models load
    return Cascade.from_topology(args.topology, policy=args.policy or None, device=args.device)


@guarded
def validate(args) -> int:
    from cascade.topology import load_topology

    topo = load_topology(args.topology, check_models=not args.no_models)
    spec = topo.spec
    print(f"topology {topo.source}: OK ({len(spec.levels)} levels, authority: {topo.authority})")
    print("levels:")
    for level in spec.levels:
        where = level.model if level.kind == "hf" else level.params or ""
        dtype, device = level.dtype, level.device
        if level.kind == "head":  # on its source's device, in its dtype
            where, dtype, device = f"{level.model} (reads {level.features_of})", "-", "-"
        print(f"  {level.name:<12} {level.kind:<8} {dtype:<8} {device:<7} {where}")
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
