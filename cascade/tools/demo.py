"""``cascade demo``: a topology (the main one by default) on held-out prompts, against plain
decoding and against cascade with the authority alone, in one run.

Two kinds of text side by side: greedy decoding, where every output must equal plain greedy
decoding's token for token, and sampled decoding (T = 0.8, top-p 0.95 unless told otherwise),
how most people sample. Small models loop under greedy decoding, and a loop is what every draft
predicts best, so each kind's speedup is shown with how repetitive its text was. Beside the
speedup over plain decoding, the speedup over the authority alone in cascade (its own forward,
no drafting; ``cascade bench``'s ``cascade:authority``): what drafting itself bought. Where
llama-cpp-python is installed and the authority came from a GGUF, llama.cpp decoding that file
with the same warping runs beside them as a fourth side (:mod:`cascade.tools.llamacpp`); else one
line says why not.

Timing: torch's threads are set (one unless ``--threads`` says otherwise) and printed; the
cascade, the authority alone and plain decoding run interleaved, each prompt's three in a
rotating order, over
``--repeats`` repeats of every prompt in both kinds; every speed is the median over the repeats
with its range (:mod:`cascade.tools.timing`), and a range that shows the machine was busy is
named in a warning.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from dataclasses import dataclass, field

from cascade.cli import args as types
from cascade.cli.args import MAIN_TOPOLOGY_HELP, REAL_TOPOLOGY, guarded, main_topology
from cascade.tools.timing import (BUSY_SPREAD, COUPLING, DEFAULT_THREADS, Spread, busy_warning, machine, machine_line,
                                  threads_line, torch_threads)

DEFAULT_PROMPTS = "examples/prompts/heldout.jsonl"
ABOUT_THE_MODELS = ("The bundled models are tiny (0.7-11.6 M parameters), trained from scratch on a CPU on "
                    "19 M tokens of permissively licensed Python (the standard library and the dependencies' code) "
                    "to exercise the cascade: not a coding assistant, and their text shows it.")
# The real model's demo: chats in its own template and code questions, none of them seen in training.
REAL_PROMPTS = "examples/prompts/chat-heldout.jsonl"
ABOUT_THE_REAL_MODEL = ("The authority is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; dequantized from the "
                        "Q4_1 GGUF that cascade pull fetched), drafted for by a feature head that reads its hidden "
                        "states and a small model, both trained on its own conversations "
                        "(examples/models/smollm2/README.md), and an n-gram level.")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="run the default topology on held-out prompts next to plain decoding",
        description="Generate text for a few held-out prompts with the cascade, with cascade's authority alone "
                    "(no drafting) and with plain decoding of the authority (transformers generate), interleaved in "
                    "one run over --repeats repeats, greedily (outputs must be identical) and sampled (--temperature, "
                    "default 0.8, --top-p 0.95); print the text and, for each, a table of tokens/s, speedup over "
                    "plain decoding and over the authority alone (median over the repeats, with their range), the "
                    "text's repetition, tokens per authority pass and acceptance per edge; warn when the range shows "
                    "the machine was busy.",
    )
    p.add_argument("--topology", "-t", default=None, help=MAIN_TOPOLOGY_HELP)
    p.add_argument("--prompts", default=None,
                   help=f"JSONL file with a 'prompt' field per line (default: {REAL_PROMPTS} for {REAL_TOPOLOGY}, "
                        f"else {DEFAULT_PROMPTS})")
    p.add_argument("--num-prompts", "-n", type=types.positive_int, default=None,
                   help="prompts to run (default 4; 3 on the real model)")
    p.add_argument("--max-new-tokens", type=types.positive_int, default=None, help="default 96; 64 on the real model")
    p.add_argument("--repeats", type=types.positive_int, default=None,
                   help="times every prompt is timed on each side, interleaved; figures are medians over them "
                        "(default 3; 2 on the real model, whose passes cost ~10x the bundled family's)")
    p.add_argument("--threads", type=types.positive_int, default=DEFAULT_THREADS,
                   help=f"torch's intra-op threads (default {DEFAULT_THREADS}: steady timings on a shared machine)")
    p.add_argument("--policy", type=types.policy_spec, default=None, help="NAME[:key=value,...] (default: the topology's)")
    p.add_argument("--backend", choices=("local", "ray"), default=None,
                   help="where the levels run (default: the topology's backend)")
    types.add_sampling_args(p, default_temperature=0.8, default_top_p=0.95,
                            what="the sampled runs (0 = show greedy decoding only)")
    p.add_argument("--quiet", action="store_true", help="print only the tables")
    p.set_defaults(func=run)


@dataclass
class Mode:
    """One kind of decoding over the prompts: the cascade's statistics merged over every run, each
    side's tokens and seconds per repeat, the prompts whose greedy output differed in any repeat,
    and each side's texts (the first repeat's)."""
    label: str
    sampling: object  # cascade.sampling.Sampling
    stats: object  # cascade.stats.RequestStats
    repeats: int
    cascade_time: list[list[float]] = field(default_factory=list)  # per repeat: [tokens, seconds]
    plain_time: list[list[float]] = field(default_factory=list)
    alone_time: list[list[float]] = field(default_factory=list)  # the authority alone in cascade
    llama_time: list[list[float]] = field(default_factory=list)  # llama.cpp on the GGUF, where it runs
    mismatches: set[int] = field(default_factory=set)
    divergences: dict = field(default_factory=dict)  # prompt -> exactness.Divergence (greedy)
    cascade_ids: list[list[int]] = field(default_factory=list)
    plain_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.cascade_time = [[0, 0.0] for _ in range(self.repeats)]
        self.plain_time = [[0, 0.0] for _ in range(self.repeats)]
        self.alone_time = [[0, 0.0] for _ in range(self.repeats)]
        self.llama_time = [[0, 0.0] for _ in range(self.repeats)]

    def spreads(self) -> dict[str, Spread]:
        """Per repeat, over all prompts: each side's tokens/s, the speedup (cascade over plain), the
        authority alone's speedup over plain, and drafting's (cascade over the authority alone)."""
        def rates(per_repeat):
            return [t / s if s else 0.0 for t, s in per_repeat]

        def ratio(xs, ys):
            return Spread.of(x / y if y else 0.0 for x, y in zip(xs, ys))

        plain, cascade, alone = rates(self.plain_time), rates(self.cascade_time), rates(self.alone_time)
        llama = rates(self.llama_time)  # all 0 where llama.cpp did not run
        return {"plain tok/s": Spread.of(plain), "cascade tok/s": Spread.of(cascade),
                "authority alone tok/s": Spread.of(alone), "speedup": ratio(cascade, plain),
                "authority alone speedup": ratio(alone, plain), "drafting speedup": ratio(cascade, alone),
                "llama.cpp tok/s": Spread.of(llama), "llama.cpp speedup": ratio(llama, plain),
                "over llama.cpp": ratio(cascade, llama)}


@guarded
def run(args) -> int:
    from cascade.api import Cascade
    from cascade.sampling import Sampling
    from cascade.stats import RequestStats
    from cascade.tools.baselines import as_loaded, authority_alone, load_prompts, plain_generate
    from cascade.tools.bench_records import mode_label
    from cascade.tools.llamacpp import baseline

    args.topology = args.topology or main_topology(lambda line: print(line, file=sys.stderr))
    real = Path(args.topology).resolve() == Path(REAL_TOPOLOGY).resolve()
    args.prompts = args.prompts or (REAL_PROMPTS if real else DEFAULT_PROMPTS)
    for name, bundled, real_model in (("num_prompts", 4, 3), ("max_new_tokens", 96, 64), ("repeats", 3, 2)):
        if getattr(args, name) is None:
            setattr(args, name, real_model if real else bundled)
    prompts = load_prompts(args.prompts, args.num_prompts)
    sampled = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    with torch_threads(args.threads) as threads, Cascade.from_topology(args.topology, policy=args.policy or None,
                                                                             backend=args.backend) as c:
        model = getattr(c.workers[c.topology.authority], "model", None)
        if model is None:
            print("error: demo needs a transformers authority to compare against", file=sys.stderr)
            return 1
        model = as_loaded(model)  # plain decoding as transformers runs it
        alone = authority_alone(c)  # shares the authority's worker, which c closes
        print(ABOUT_THE_REAL_MODEL if real else ABOUT_THE_MODELS)
        print(threads_line(threads))
        print(machine_line(machine()))
        llama, note = baseline(c.topology, threads)
        print(note or llama.describe(sampled))
        # Warm-up: first calls pay for allocation and lazy initialisation, and an adaptive
        # policy measures the levels and paths (on a prompt from the end of the file, which the
        # timed runs use only if the file is short).
        warm = load_prompts(args.prompts)[-1]
        c.generate(warm, max_new_tokens=64, temperature=0.0)
        alone.generate(warm, max_new_tokens=8, temperature=0.0)
        plain_generate(model, c.tokenizer.encode(warm), 8)
        if llama is not None:
            llama.generate(c.tokenizer.encode(warm), 8, Sampling(), 0, c.tokenizer.eos_token_id)
        kinds = [Sampling()] + ([sampled] if not sampled.greedy else [])
        modes = [Mode(mode_label(s), s, RequestStats(c.topology.authority), args.repeats) for s in kinds]
        # Repeat by repeat, both kinds in each: a busy spell hits one repeat, which the median discounts.
        try:
            for r in range(args.repeats):
                for mode in modes:
                    _decode(c, alone, model, llama, prompts, mode, r, args)
        finally:
            if llama is not None:
                llama.close()
    for mode in modes:
        _table(mode, c.topology.authority, c.topology.spec.policy.name, llama is not None)
    _headline(modes)
    greedy = modes[0]
    real = [i for i in sorted(greedy.mismatches) if not greedy.divergences[i].near_tie]
    if real:
        print(f"\nEXACTNESS FAILURE: {len(real)} prompt(s) differ from plain greedy decoding",
              file=sys.stderr)
        return 2
    repeats = f" in each of {args.repeats} repeats" if args.repeats > 1 else ""
    if greedy.mismatches:
        gaps = ", ".join(f"{greedy.divergences[i].gap:.2f}" for i in sorted(greedy.mismatches))
        print(f"\n{len(prompts) - len(greedy.mismatches)} of {len(prompts)} outputs identical to plain greedy decoding"
              f"{repeats}; {len(greedy.mismatches)} first differ at a near-tie (logit gaps {gaps}), which the "
              f"authority's arithmetic rounds differently when a pass scores several positions "
              f"(cascade/DESIGN.md §2, Numerics); in float32 such ties are ~5e-5 of a logit and rare")
    else:
        print(f"\nall {len(prompts)} outputs identical to plain greedy decoding{repeats}")
    if len(modes) > 1:
        print(f"sampled outputs differ from plain sampling's by design (other random draws); exactness under sampling "
              f"is checked by distribution: cascade bench --temperature {args.temperature:g} --top-p {args.top_p:g}")
    return 0


def _decode(c, alone, model, llama, prompts: list[str], mode: Mode, repeat: int, args) -> None:
    """One repeat of every prompt through the cascade, the authority alone (``alone``), plain
    decoding and llama.cpp (``llama``, where it runs), rotating which runs first (by prompt and by
    repeat) so that drift in machine load hits all sides alike; prompt ``i`` sampled with seed
    ``args.seed + i`` in every repeat, so the repeats time the same work."""
    from cascade.tools.baselines import plain_generate
    from cascade.tools.exactness import greedy_divergence

    sampling = mode.sampling
    for i, prompt in enumerate(prompts):
        ids = c.tokenizer.encode(prompt)
        seed = args.seed + i

        def run(which):
            return which.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, coupling=COUPLING)

        done = {}
        sides = {"plain": lambda: plain_generate(model, ids, args.max_new_tokens, sampling, seed),
                 "cascade": lambda: run(c), "alone": lambda: run(alone)}
        if llama is not None:
            eos = c.tokenizer.eos_token_id
            sides["llama.cpp"] = lambda: llama.generate(ids, args.max_new_tokens, sampling, seed, eos)
        order = list(sides)
        first = (i + repeat) % len(order)
        for name in order[first:] + order[:first]:
            done[name] = sides[name]()
        if llama is not None:
            _add(mode.llama_time[repeat], len(done["llama.cpp"][0]), done["llama.cpp"][1])
        (ref, secs), g, a = done["plain"], done["cascade"], done["alone"]
        _add(mode.plain_time[repeat], len(ref), secs)
        _add(mode.cascade_time[repeat], len(g.token_ids), g.stats.wall_seconds)
        _add(mode.alone_time[repeat], len(a.token_ids), a.stats.wall_seconds)
        mode.stats.merge(g.stats)
        if sampling.greedy:
            for got in (g.token_ids, a.token_ids):  # the authority alone must match plain decoding too
                if got != ref:
                    mode.mismatches.add(i)
                    found = greedy_divergence(model, ids, got, ref, c.tokenizer.eos_token_id)
                    if i not in mode.divergences or not found.near_tie:  # any repeat's real divergence is kept
                        mode.divergences[i] = found
        if repeat:
            continue
        mode.cascade_ids.append(g.token_ids)
        mode.plain_ids.append(ref)
        if not args.quiet:
            verdict = ""
            if sampling.greedy:
                verdict = ", identical to plain decoding" if i not in mode.mismatches else \
                    f", {mode.divergences[i].describe()}"
            print(f"\n=== prompt {i + 1}/{len(prompts)}, {mode.label} ({len(g.token_ids)} tokens, "
                  f"{g.stats.tokens_per_second:.1f} tok/s{verdict})")
            print(prompt + g.text)


def _add(total: list[float], tokens: int, seconds: float) -> None:
    total[0] += tokens
    total[1] += seconds


def _table(mode: Mode, authority: str, policy: str, llama: bool) -> None:
    from cascade.repetition import repetition

    spreads = mode.spreads()

    def rep(texts: list[list[int]]) -> float:
        return statistics.median(repetition(t) for t in texts) if texts else 0.0

    print(f"\n{mode.label}:")
    print(f"{'':<28}{'tokens/s':>20}{'speedup':>20}{'vs authority alone':>20}{'repetition':>12}")
    print(f"{'plain decoding (' + authority + ')':<28}{spreads['plain tok/s'].format('.1f'):>20}{'1.00x':>20}"
          f"{'':>20}{rep(mode.plain_ids):>12.2f}")
    print(f"{'cascade, authority alone':<28}{spreads['authority alone tok/s'].format('.1f'):>20}"
          f"{spreads['authority alone speedup'].format(unit='x'):>20}{'1.00x':>20}")
    print(f"{'cascade (' + policy + ' policy)':<28}{spreads['cascade tok/s'].format('.1f'):>20}"
          f"{spreads['speedup'].format(unit='x'):>20}{spreads['drafting speedup'].format(unit='x'):>20}"
          f"{rep(mode.cascade_ids):>12.2f}")
    if llama:  # another program on the same GGUF: timed, its text not compared (cascade.tools.llamacpp)
        print(f"{'llama.cpp (same GGUF)':<28}{spreads['llama.cpp tok/s'].format('.1f'):>20}"
              f"{spreads['llama.cpp speedup'].format(unit='x'):>20}")
    print(f"(tokens/s and speedups: median over {mode.repeats} interleaved repeat(s), min–max in brackets; speedup: "
          "over plain decoding; vs authority alone: over cascade with the authority alone, its own forward with no "
          "drafting, timed in the same run: what drafting bought; repetition: median share of generated tokens that "
          "close a 4-gram already in the same text)")
    print(f"tokens per authority pass: {mode.stats.tokens_per_authority_pass:.2f}")
    print(f"{'edge':<20}{'acceptance':>11}{'mean block':>12}")
    for key, e in mode.stats.edges.items():
        print(f"{key:<20}{e.acceptance_rate:>11.2f}{e.mean_accepted_block:>12.2f}")


def _headline(modes: list[Mode]) -> None:
    """The speedups in one line, then a warning naming every figure whose range says the machine was busy."""
    n = modes[0].repeats
    figures = "; ".join(f"{m.label}: {m.spreads()['speedup'].format(unit='x')}" for m in modes)
    print(f"\nspeedup over plain decoding, median of {n} repeat(s){' (min–max)' if n > 1 else ''}: {figures}")
    drafting = "; ".join(f"{m.label}: {m.spreads()['drafting speedup'].format(unit='x')}" for m in modes)
    print(f"of which drafting (over cascade with the authority alone, in the same run): {drafting}")
    if modes[0].llama_time[0][0]:
        versus = "; ".join(f"{m.label}: {m.spreads()['over llama.cpp'].format(unit='x')}" for m in modes)
        print(f"cascade over llama.cpp decoding the same GGUF (same warping, same run): {versus}")
    spreads = {f"{m.label} {name}": s for m in modes for name, s in m.spreads().items()
               if name in ("plain tok/s", "speedup")}
    warning = busy_warning(spreads)
    if warning:
        print(warning)
        if not any(s.busy() for name, s in spreads.items() if name.endswith("speedup")):
            print(f"The speedups stayed steady (each range within {BUSY_SPREAD:.0%} of its median): cascade and plain "
                  "decoding were timed interleaved, so the busy spells slowed both alike.")
