"""``cascade run``: a batch of prompts from JSONL to results in JSONL, locally or as a Ray job.

    cascade run --topology T --prompts in.jsonl --output out.jsonl [--max-new-tokens N ...]
    ray job submit --working-dir . -- cascade run --backend ray --topology T ...

Input: one JSON object per line with a ``prompt`` field. Output: one line per prompt, in input
order, ``Generation.to_dict()`` (text, token ids, finish reason, statistics). Prompt ``i`` uses
``seed + i``, as ``Cascade.generate`` does for a list. Inside a Ray job ``RAY_ADDRESS`` is set,
so ``--backend ray`` places the level actors on that cluster.

If the authority goes down, the line of the prompt it was working on holds ``error`` and the
``partial`` result committed so far; the command stops there with exit status 1.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cascade.cli.commands import add_generation_args, guarded


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate for every prompt of a JSONL file (locally or as a Ray job)",
                       description="Batch generation: read prompts (JSONL, a 'prompt' field per line), "
                                   "write one result per line, in input order.")
    p.add_argument("--prompts", required=True, help="input JSONL file: one {\"prompt\": ...} per line")
    p.add_argument("--output", "-o", required=True, help="output JSONL file (parent folders are created)")
    add_generation_args(p)
    p.add_argument("--backend", choices=("local", "ray"), default=None,
                   help="where the levels run (default: the topology's backend)")
    p.add_argument("--address", default=None,
                   help="Ray cluster: auto, local or host:port (default: the topology's ray.address)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    from cascade.api import Cascade
    from cascade.tools.baselines import load_prompts
    from cascade.errors import WorkerError
    from policies import make_policy, parse_policy_spec

    prompts = load_prompts(args.prompts, args.limit)
    policy = None
    if args.policy:
        name, params = parse_policy_spec(args.policy)
        policy = make_policy(name, params)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, stop=args.stop)
    started = time.perf_counter()
    tokens = 0
    with Cascade.from_topology(args.topology, policy=policy, device=args.device, backend=args.backend,
                               address=args.address) as c, out_path.open("w") as out:
        for i, prompt in enumerate(prompts):
            seed = None if args.seed is None else args.seed + i
            try:
                g = c.generate(prompt, seed=seed, **kwargs)
            except WorkerError as exc:
                partial = exc.partial.to_dict() if hasattr(exc.partial, "to_dict") else exc.partial
                out.write(json.dumps({"prompt": prompt, "error": str(exc), "partial": partial}) + "\n")
                print(f"error: prompt {i + 1}/{len(prompts)}: {exc}", file=sys.stderr)
                return 1
            out.write(json.dumps(g.to_dict()) + "\n")
            out.flush()
            tokens += len(g.token_ids)
            for note in g.stats.notes:
                print(f"note: prompt {i + 1}: {note}", file=sys.stderr)
    seconds = time.perf_counter() - started
    print(f"{len(prompts)} prompts, {tokens} tokens in {seconds:.2f} s -> {out_path}")
    return 0
