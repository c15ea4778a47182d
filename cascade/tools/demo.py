"""``cascade demo``: the bundled family on held-out prompts, against plain decoding, in one run."""
from __future__ import annotations

import sys

from cascade.cli import args as types
from cascade.cli.commands import DEFAULT_TOPOLOGY, guarded

DEFAULT_PROMPTS = "examples/prompts/heldout.jsonl"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="run the default topology on held-out prompts next to plain decoding",
        description="Generate code for a few held-out prompts with the cascade and with plain greedy "
                    "decoding of the authority (transformers generate), interleaved in one run; print "
                    "the code and a table of tokens/s, tokens per authority pass and acceptance per edge.",
    )
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL file with a 'prompt' field per line")
    p.add_argument("--num-prompts", "-n", type=types.positive_int, default=4)
    p.add_argument("--max-new-tokens", type=types.positive_int, default=96)
    p.add_argument("--policy", type=types.policy_spec, default=None, help="NAME[:key=value,...] (default: the topology's)")
    p.add_argument("--quiet", action="store_true", help="print only the table")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:

    from cascade.api import Cascade
    from cascade.tools.baselines import load_prompts, plain_generate
    from cascade.stats import RequestStats

    prompts = load_prompts(args.prompts, args.num_prompts)
    with Cascade.from_topology(args.topology, policy=args.policy or None) as c:
        authority = c.workers[c.topology.authority]
        model = getattr(authority, "model", None)
        if model is None:
            print("error: demo needs a transformers authority to compare against", file=sys.stderr)
            return 1
        tok = c.tokenizer
        # Warm-up: first calls pay for allocation and lazy initialisation, and an adaptive
        # policy measures the levels and paths (on a prompt from the end of the file, which the
        # timed runs use only if the file is short).
        warm = load_prompts(args.prompts)[-1]
        c.generate(warm, max_new_tokens=64, temperature=0.0)
        plain_generate(model, tok.encode(warm), 8)

        total = RequestStats(c.topology.authority)
        plain_tokens = plain_seconds = 0
        mismatches = 0
        for i, prompt in enumerate(prompts):
            ids = tok.encode(prompt)
            # Alternate which runs first so drift in machine load hits both alike.
            if i % 2:
                ref, secs = plain_generate(model, ids, args.max_new_tokens)
                g = c.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0)
            else:
                g = c.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0)
                ref, secs = plain_generate(model, ids, args.max_new_tokens)
            plain_tokens += len(ref)
            plain_seconds += secs
            total.merge(g.stats)
            same = g.token_ids == ref
            mismatches += not same
            if not args.quiet:
                print(f"\n=== prompt {i + 1}/{len(prompts)} "
                      f"({len(g.token_ids)} tokens, {g.stats.tokens_per_second:.1f} tok/s, "
                      f"{'identical to' if same else 'DIFFERS FROM'} plain decoding)")
                print(prompt + g.text)

    cascade_tps = total.tokens_per_second
    plain_tps = plain_tokens / plain_seconds if plain_seconds else 0.0
    print(f"\n{'':<28}{'tokens/s':>10}{'speedup':>9}")
    print(f"{'plain decoding (' + c.topology.authority + ')':<28}{plain_tps:>10.1f}{1.0:>8.2f}x")
    print(f"{'cascade (' + c.topology.spec.policy.name + ' policy)':<28}{cascade_tps:>10.1f}"
          f"{(cascade_tps / plain_tps if plain_tps else 0):>8.2f}x")
    print(f"\ntokens per authority pass: {total.tokens_per_authority_pass:.2f}")
    print(f"{'edge':<20}{'acceptance':>11}{'mean block':>12}")
    for key, e in total.edges.items():
        print(f"{key:<20}{e.acceptance_rate:>11.2f}{e.mean_accepted_block:>12.2f}")
    if mismatches:
        print(f"\nEXACTNESS FAILURE: {mismatches} prompt(s) differ from plain greedy decoding", file=sys.stderr)
        return 2
    print(f"\nall {len(prompts)} outputs identical to plain greedy decoding")
    return 0
