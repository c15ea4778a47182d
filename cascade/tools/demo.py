"""``cascade demo``: the bundled family on held-out prompts, against plain decoding, in one run.

Two kinds of text side by side: greedy decoding, where every output must equal plain greedy
decoding's token for token, and sampled decoding (T = 0.8, top-p 0.95 unless told otherwise),
how most people sample. Small models loop under greedy decoding, and a loop is what every draft
predicts best, so each kind's speedup is shown with how repetitive its text was.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

from cascade.cli import args as types
from cascade.cli.commands import DEFAULT_TOPOLOGY, guarded

DEFAULT_PROMPTS = "examples/prompts/heldout.jsonl"
ABOUT_THE_MODELS = ("The bundled models are tiny (0.7-11.6 M parameters), trained from scratch on a CPU on "
                    "19 M tokens of permissively licensed Python (the standard library and the dependencies' code) "
                    "to exercise the cascade: not a coding assistant, and their text shows it.")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="run the default topology on held-out prompts next to plain decoding",
        description="Generate code for a few held-out prompts with the cascade and with plain decoding of the "
                    "authority (transformers generate), interleaved in one run, greedily (outputs must be "
                    "identical) and sampled (--temperature, default 0.8, --top-p 0.95); print the code and, for "
                    "each, a table of tokens/s, speedup and the text's repetition, tokens per authority pass "
                    "and acceptance per edge.",
    )
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL file with a 'prompt' field per line")
    p.add_argument("--num-prompts", "-n", type=types.positive_int, default=4)
    p.add_argument("--max-new-tokens", type=types.positive_int, default=96)
    p.add_argument("--policy", type=types.policy_spec, default=None, help="NAME[:key=value,...] (default: the topology's)")
    types.add_sampling_args(p, default_temperature=0.8, default_top_p=0.95,
                            what="the sampled runs (0 = show greedy decoding only)")
    p.add_argument("--quiet", action="store_true", help="print only the tables")
    p.set_defaults(func=run)


@dataclass
class Mode:
    """One kind of decoding over the prompts: the cascade's merged statistics, plain decoding's
    tokens and seconds, and each side's texts."""
    label: str
    stats: object
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    mismatches: int = 0
    cascade_ids: list[list[int]] = field(default_factory=list)
    plain_ids: list[list[int]] = field(default_factory=list)


@guarded
def run(args) -> int:
    from cascade.api import Cascade
    from cascade.sampling import Sampling
    from cascade.tools.baselines import load_prompts, plain_generate

    prompts = load_prompts(args.prompts, args.num_prompts)
    sampled = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    with Cascade.from_topology(args.topology, policy=args.policy or None) as c:
        model = getattr(c.workers[c.topology.authority], "model", None)
        if model is None:
            print("error: demo needs a transformers authority to compare against", file=sys.stderr)
            return 1
        print(ABOUT_THE_MODELS)
        # Warm-up: first calls pay for allocation and lazy initialisation, and an adaptive
        # policy measures the levels and paths (on a prompt from the end of the file, which the
        # timed runs use only if the file is short).
        warm = load_prompts(args.prompts)[-1]
        c.generate(warm, max_new_tokens=64, temperature=0.0)
        plain_generate(model, c.tokenizer.encode(warm), 8)
        modes = [_decode(c, model, prompts, Sampling(), args)]
        if not sampled.greedy:
            modes.append(_decode(c, model, prompts, sampled, args))
    for mode in modes:
        _table(mode, c.topology.authority, c.topology.spec.policy.name)
    if modes[0].mismatches:
        print(f"\nEXACTNESS FAILURE: {modes[0].mismatches} prompt(s) differ from plain greedy decoding", file=sys.stderr)
        return 2
    print(f"\nall {len(prompts)} outputs identical to plain greedy decoding")
    if len(modes) > 1:
        print(f"sampled outputs differ from plain sampling's by design (other random draws); exactness under sampling "
              f"is checked by distribution: cascade bench --temperature {args.temperature:g} --top-p {args.top_p:g}")
    return 0


def _decode(c, model, prompts: list[str], sampling, args) -> Mode:
    """Every prompt through the cascade and plain decoding, alternating which runs first so that
    drift in machine load hits both alike; prompt ``i`` sampled with seed ``args.seed + i``."""
    from cascade.stats import RequestStats
    from cascade.tools.baselines import plain_generate
    from cascade.tools.bench import mode_label

    mode = Mode(mode_label(sampling), RequestStats(c.topology.authority))
    for i, prompt in enumerate(prompts):
        ids = c.tokenizer.encode(prompt)
        seed = args.seed + i

        def cascade():
            return c.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=sampling.temperature,
                              top_k=sampling.top_k, top_p=sampling.top_p, seed=seed)

        if i % 2:
            ref, secs = plain_generate(model, ids, args.max_new_tokens, sampling, seed)
            g = cascade()
        else:
            g = cascade()
            ref, secs = plain_generate(model, ids, args.max_new_tokens, sampling, seed)
        mode.plain_tokens += len(ref)
        mode.plain_seconds += secs
        mode.stats.merge(g.stats)
        mode.cascade_ids.append(g.token_ids)
        mode.plain_ids.append(ref)
        same = g.token_ids == ref
        mode.mismatches += sampling.greedy and not same
        if not args.quiet:
            verdict = f", {'identical to' if same else 'DIFFERS FROM'} plain decoding" if sampling.greedy else ""
            print(f"\n=== prompt {i + 1}/{len(prompts)}, {mode.label} ({len(g.token_ids)} tokens, "
                  f"{g.stats.tokens_per_second:.1f} tok/s{verdict})")
            print(prompt + g.text)
    return mode


def _table(mode: Mode, authority: str, policy: str) -> None:
    from cascade.repetition import repetition

    cascade_tps = mode.stats.tokens_per_second
    plain_tps = mode.plain_tokens / mode.plain_seconds if mode.plain_seconds else 0.0

    def rep(texts: list[list[int]]) -> float:
        return statistics.median(repetition(t) for t in texts) if texts else 0.0

    print(f"\n{mode.label}:")
    print(f"{'':<28}{'tokens/s':>10}{'speedup':>9}{'repetition':>12}")
    print(f"{'plain decoding (' + authority + ')':<28}{plain_tps:>10.1f}{1.0:>8.2f}x{rep(mode.plain_ids):>12.2f}")
    print(f"{'cascade (' + policy + ' policy)':<28}{cascade_tps:>10.1f}"
          f"{(cascade_tps / plain_tps if plain_tps else 0):>8.2f}x{rep(mode.cascade_ids):>12.2f}")
    print("(repetition: median share of generated tokens that close a 4-gram already in the same text)")
    print(f"tokens per authority pass: {mode.stats.tokens_per_authority_pass:.2f}")
    print(f"{'edge':<20}{'acceptance':>11}{'mean block':>12}")
    for key, e in mode.stats.edges.items():
        print(f"{key:<20}{e.acceptance_rate:>11.2f}{e.mean_accepted_block:>12.2f}")
