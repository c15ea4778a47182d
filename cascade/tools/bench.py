"""``cascade bench``: cascade against the peers, side by side in one process.

Every configuration runs on the same prompts, interleaved (a fresh random order per prompt and
repeat) after a warm-up, and every speed is reported as a ratio to plain decoding measured in
the same run; torch's threads are set (``--threads``, default 1) and recorded. With
``--repeats`` > 1 each configuration's speedup is also given per repeat (median over prompts),
as the median and range over the repeats, and a range that shows the machine was busy is named
in a warning (:mod:`cascade.tools.timing`). Configurations:

1. ``plain``: transformers ``generate`` of the authority, greedy or sampled (the baseline);
2. ``cascade:authority``: cascade with the authority alone (cascade's own overhead);
3. ``hf-assisted:<draft>``: transformers assisted generation, each draft as ``assistant_model``;
4. ``hf-prompt-lookup``: transformers prompt-lookup decoding;
5. ``cascade:<draft>-><authority>``: 2-level cascade with each draft, ``fixed`` policy;
6. ``cascade:3level`` / ``cascade:4level`` (with and without the n-gram level), ``fixed`` and ``auto``:
   those levels, with the chain's edges and every edge of the topology between them (its
   shortcuts), so ``auto`` chooses among the same paths as on the topology itself; ``fixed``
   drafts along the whole chain;
7. ``llama.cpp``: llama.cpp decoding the authority's GGUF with cascade's warping, where
   llama-cpp-python is installed (:mod:`cascade.tools.llamacpp`; timed, not checked for exactness).

``plain``, ``cascade:authority`` and ``llama.cpp`` run whatever ``--only`` says: every
configuration's speedup is given over the first two, the second being what drafting itself bought
beside the authority's own forward.
A configuration that cannot apply to the topology's levels (transformers' assisted generation
with a drafter over another vocabulary, a tree from a level that drafts none) is left out before
anything runs, with a line saying why. Every level runs in this process, whatever the topology's
``backend`` says: transformers' rows need the models here.

Each cascade configuration also gets a *predicted* speedup from its measured acceptance per
draft position and measured seconds per forward pass of each level (cascade/DESIGN.md §4,
composed up the hierarchy: ``Estimates.path_cost``), for the path its steps mostly took
(``predicted_path``: a chain's own path; for ``auto``, the one it settled on). Measured ÷
predicted is the share of that ideal the configuration kept.

Greedy or sampled (``--temperature``/``--top-p``/``--top-k``/``--seed``; ``--with-greedy`` runs
both, interleaved in the same run and reported side by side). Small models loop under greedy
decoding and a loop is what every draft predicts best, so every row also reports how
repetitive its text was (:mod:`cascade.repetition`), and beside the overall speedup the
speedup over the prompts whose plain continuation is not a loop. Exactness: under greedy
decoding every output must equal plain decoding's; under sampling every configuration's first
tokens on one prompt must follow the distribution of plain sampling
(:mod:`cascade.tools.exactness`). Either failure sets exit status 2.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cascade.cli import args as types
from cascade.cli.args import DEFAULT_TOPOLOGY, guarded
from cascade.tools.bench_batch import run_batch_bench
from cascade.tools.bench_predict import cascade_fields, main_path, predicted_seconds_per_token  # noqa: F401 (re-exported)
from cascade.tools.bench_records import ConfigReport, Sample, mode_label
from cascade.tools.bench_report import write_report
from cascade.tools.exactness import DistributionCheck
from cascade.tools.llamacpp import NAME as LLAMA_CPP, baseline as llama_cpp_baseline
from cascade.tools.timing import COUPLING, DEFAULT_THREADS, machine, torch_threads
from cascade.repetition import LOOP_THRESHOLD, NGRAM, repetition


@dataclass
class Config:
    name: str
    kind: str  # "plain", "hf", "cascade", "llama.cpp"
    path: tuple[str, ...] = ()
    policy: str = ""
    # (prompt ids, max new tokens, sampling, seed) -> (new ids, seconds, cascade's RequestStats)
    run: Callable[[list[int], int, Any, int], tuple[list[int], float, Any]] | None = None
    graph: Any = None  # a cascade configuration's graph (networkx.DiGraph)
    # (prompt ids, max new tokens, sampling, seed, count) -> ``count`` independent continuations, batched
    # for speed (the distribution check); None: not checked (transformers' assisted decoding, batch 1 only)
    draw: Callable[[list[int], int, Any, int, int], list[list[int]]] | None = None


def _median_ci(values: list[float], resamples: int = 5000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median."""
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(values[rng.randrange(n)] for _ in range(n)) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


class _PassCounter:
    """Counts forward passes of a model by a hook on its LM head, which every pass calls once,
    while attached: around transformers' own runs (plain ``generate`` and its assisted modes).
    cascade's runs report their authority's passes in their stats, and run without the hook: with
    one, the workers' lean forward calls the LM head module instead of its own product
    (workers/lean.py), which would time another kernel than the one served."""

    def __init__(self, model):
        self.count = 0
        self.model = model
        self.handle = None

    def attach(self) -> None:
        if self.handle is None:
            self.handle = self.model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += 1

    def close(self):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def build_configs(topo, workers, tokenizer, prompt_lookup: int, assisted: bool = True,
                  trees: tuple[tuple[int, ...], ...] = ()) -> tuple[list[Config], list[str]]:
    """The configurations of the module docstring, for this topology's levels; with ``trees``
    (widths per depth), a tree row for every model edge into the authority and shape too. Also
    the configurations that cannot apply to these levels, each as ``"name: why"``: decided here,
    from the topology and its loaded levels, so that a run never fails on one minutes in."""
    from cascade.tools.baselines import as_loaded, assisted_unfit

    authority = topo.authority
    hf_drafts = [lv.name for lv in topo.spec.levels if lv.kind == "hf" and lv.name != authority]
    ngram = next((lv.name for lv in topo.spec.levels if lv.kind == "ngram"), None)
    make = _ConfigBuilder(topo, workers, tokenizer)
    configs = [make.plain(), make.cascade("cascade:authority", (authority,), "fixed")]
    left_out: list[str] = []
    if assisted:
        for d in hf_drafts:
            why = assisted_unfit(workers[d], workers[authority])
            if why:
                left_out.append(f"hf-assisted:{d}: {d} {why}")
                continue
            configs.append(make.hf(f"hf-assisted:{d}", (d, authority), assistant_model=as_loaded(workers[d].model)))
        configs.append(make.hf("hf-prompt-lookup", (authority,), prompt_lookup_num_tokens=prompt_lookup))
    # a speculative row for every edge into the authority, whatever the proposer's kind
    into = set(topo.graph.predecessors(authority))
    for d in [lv.name for lv in topo.spec.levels if lv.name in into]:
        path = (d, authority)
        configs.append(make.cascade(f"cascade:{d}->{authority}", path, make.fixed_spec(path)))
        for widths in trees:
            name, shape = f"cascade:{d}->{authority}:tree{'x'.join(map(str, widths))}", ", ".join(map(str, widths))
            if not workers[d].drafts_trees:
                left_out.append(f"{name}: {d} drafts no trees")
                continue
            configs.append(make.cascade(name, path, f"fixed:lookahead={{{d}: {len(widths)}}},tree={{{d}: [{shape}]}}"))
    paths = _multilevel_paths(hf_drafts, authority, ngram)
    for label, path in paths:
        for policy in (make.fixed_spec(path), "auto"):
            short = "fixed" if policy.startswith("fixed") else policy
            configs.append(make.cascade(f"cascade:{label}:{short}", path, policy))
    # the topology as written, under auto, where no path above holds every level (a feature head
    # beside independent drafters, say): auto chooses among all its paths per step
    everything = tuple(lv.name for lv in topo.spec.levels if lv.name != authority) + (authority,)
    if len(everything) > 2 and not any(set(p) == set(everything) for _, p in paths):
        configs.append(make.cascade(f"cascade:{topo.spec.name}:auto", everything, "auto",
                                    edges=[tuple(e) for e in topo.graph.edges]))
    return configs, left_out


def _multilevel_paths(hf_drafts: list[str], authority: str, ngram: str | None) -> list[tuple[str, tuple[str, ...]]]:
    """(label, path) of the configurations over three levels or more: the chain of every model
    level, the chain without its second level, and the n-gram level below the whole chain."""
    chain = tuple(hf_drafts) + (authority,)
    paths: list[tuple[str, tuple[str, ...]]] = []
    if len(chain) >= 4:
        paths.append((f"{len(chain) - 1}level", chain[:1] + chain[2:]))  # skip the second level
    if len(chain) >= 3:
        paths.append((f"{len(chain)}level", chain))
    if ngram and len(chain) >= 2:
        paths.append((f"{len(chain)}level+ngram", (ngram,) + chain))
    return paths


class _ConfigBuilder:
    """Configurations over one topology's loaded workers: plain and transformers' decoding of the
    authority, and cascades over a path of levels (one ``Cascade`` per path, shared by the
    configurations on that path: each run passes its own policy)."""

    def __init__(self, topo, workers, tokenizer):
        from cascade.tools.baselines import as_loaded

        self.topo, self.workers, self.tokenizer = topo, workers, tokenizer
        self.auth_model = as_loaded(workers[topo.authority].model)  # transformers' rows: as it loads it
        policy = topo.spec.policy
        self.lookahead = policy.params.get("lookahead", {}) if policy.name == "fixed" else {}
        self.cascades: dict[tuple, Any] = {}  # (path, edges or None) -> cascade.api.Cascade

    def plain(self) -> Config:
        import torch

        from cascade.tools.baselines import generate_kwargs, plain_generate

        model = self.auth_model

        def run(ids, n, sampling, seed):
            new, secs = plain_generate(model, ids, n, sampling, seed)
            return new, secs, None

        def draw(ids, n, sampling, seed, count):
            t = torch.tensor([ids])
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n,
                                     num_return_sequences=count, **generate_kwargs(sampling))
            return out[:, len(ids):].tolist()
        return Config("plain", "plain", (self.topo.authority,), run=run, draw=draw)

    def hf(self, name: str, path: tuple[str, ...], **kwargs) -> Config:
        """transformers ``generate`` of the authority with ``kwargs`` (an assistant model, prompt lookup)."""
        import torch

        from cascade.tools.baselines import generate_kwargs

        model = self.auth_model

        def run(ids: list[int], n: int, sampling, seed: int):
            t = torch.tensor([ids])
            torch.manual_seed(seed)  # transformers samples from torch's global generator
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n,
                                     **generate_kwargs(sampling), **kwargs)
            return out[0, len(ids):].tolist(), time.perf_counter() - t0, None
        return Config(name, "hf", path, run=run)

    def cascade(self, name: str, path: tuple[str, ...], policy_spec: str,
                edges: list[tuple[str, str]] | None = None) -> Config:
        """The levels of ``path`` with the chain's edges and every topology edge between them
        (``edges``: these edges instead, the chain's not added)."""
        from policies import from_spec

        c = self._cascade(path, edges)
        policy = from_spec(policy_spec)

        def run(ids: list[int], n: int, sampling, seed: int):
            g = c.generate(ids, max_new_tokens=n, temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p, seed=seed, policy=policy, coupling=COUPLING)
            return g.token_ids, g.stats.wall_seconds, g.stats

        def draw(ids: list[int], n: int, sampling, seed: int, count: int):
            # the batched engine, one row per draw; row i is seeded seed + i
            gs = c.generate([ids] * count, max_new_tokens=n, temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p, seed=seed, policy=policy, batch_size=min(count, 64),
                            coupling=COUPLING)
            return [g.token_ids for g in gs]
        return Config(name, "cascade", path, policy_spec, run, c.topology.graph, draw)

    def _cascade(self, path: tuple[str, ...], edges: list[tuple[str, str]] | None = None):
        from cascade.api import Cascade
        from cascade.topology import topology_from_dict
        from policies import from_spec

        key = (path, tuple(edges) if edges is not None else None)
        if key not in self.cascades:
            topo = self.topo
            levels = [topo.spec.level(n).model_dump(exclude_unset=True) for n in path]  # as written (a head takes no dtype)
            if edges is None:
                chain = list(zip(path, path[1:]))
                edges = chain + [e for e in topo.graph.subgraph(path).edges if e not in chain]
            sub = topology_from_dict({"levels": levels, "edges": [list(e) for e in edges]}, topo.source,
                                     topo.base_dir, check_models=False)
            self.cascades[key] = Cascade(sub, {n: self.workers[n] for n in path}, self.tokenizer, from_spec("fixed"))
        return self.cascades[key]

    def fixed_spec(self, path: tuple[str, ...]) -> str:
        """``fixed`` with the topology's lookahead per level of ``path``, else 3, 5, 7, ... up the path."""
        defaults = {n: self.lookahead.get(n, 3 + 2 * i) for i, n in enumerate(path[:-1])}
        return "fixed:lookahead={" + ", ".join(f"{k}: {v}" for k, v in defaults.items()) + "}"


def run_bench(topology: str, prompts: list[str], max_new_tokens: int = 128, repeats: int = 1,
              out: str | Path | None = None, prompt_lookup: int = 10, only: list[str] | None = None,
              progress: bool = True, seed: int = 0, samplings: list | None = None,
              exactness_draws: int = 300, exactness_tokens: int = 2,
              threads: int | None = DEFAULT_THREADS, trees: tuple[tuple[int, ...], ...] = ()
              ) -> tuple[list[ConfigReport], list[Sample]]:
    """Every configuration on every prompt, ``repeats`` times, in each sampling mode of
    ``samplings`` (:class:`cascade.sampling.Sampling`; default greedy), all interleaved; then,
    for each sampled mode, the distribution check of every configuration against plain
    sampling (``exactness_draws`` draws of the first ``exactness_tokens`` tokens each; 0 skips
    it). Torch runs ``threads`` intra-op threads throughout (None: its own choice). The reports
    come per mode, in the order of ``samplings``."""
    with torch_threads(threads) as used:
        return _run_bench(topology, prompts, max_new_tokens, repeats, out, prompt_lookup, only, progress, seed,
                          samplings, exactness_draws, exactness_tokens, used, trees)


# the rows every run measures, whatever --only says: the baselines of every speedup
ALWAYS = ("plain", "cascade:authority")


class UnknownConfiguration(ValueError):
    """An ``--only`` that names none of the bench's configurations (a typo would otherwise
    silently drop rows from a run that takes minutes)."""


def _run_bench(topology, prompts, max_new_tokens, repeats, out, prompt_lookup, only, progress, seed, samplings,
               exactness_draws, exactness_tokens, threads, trees=()) -> tuple[list[ConfigReport], list[Sample]]:
    from cascade.sampling import Sampling
    from cascade.tools.baselines import as_loaded

    samplings = samplings or [Sampling()]
    topo, workers, tokenizer = _load(topology)
    configs, left_out = build_configs(topo, workers, tokenizer, prompt_lookup, trees=trees)
    if only:
        unmatched = [o for o in only if not any(o in c.name for c in configs)]
        if unmatched:
            for w in workers.values():
                w.close()
            raise UnknownConfiguration(
                f"--only {', '.join(map(repr, unmatched))} matches no configuration of this topology's bench; "
                f"its configurations: {', '.join(c.name for c in configs)}"
                + (f"; left out, as they cannot apply here: {'; '.join(left_out)}" if left_out else ""))
        # plain and cascade:authority always run: every speedup is over plain decoding and over
        # the authority alone, measured in the same run
        configs = [c for c in configs if c.name in ALWAYS or any(o in c.name for o in only)]
    # llama.cpp on the authority's GGUF: a baseline, run whatever --only says (cascade.tools.llamacpp)
    llama, note = llama_cpp_baseline(topo, threads)
    if llama is not None:
        configs.append(Config(LLAMA_CPP, LLAMA_CPP, (topo.authority,), run=llama.runner(tokenizer.eos_token_id)))
    llama_lines = [llama.describe(s) for s in samplings] if llama is not None else [note]
    for line in [f"left out {why}" for why in left_out] + ([] if llama else llama_lines):
        print(f"cascade bench: {line}", file=sys.stderr)
    ids = [tokenizer.encode(p) for p in prompts]
    checks: dict[tuple[str, str], DistributionCheck] = {}
    try:
        reference = as_loaded(workers[topo.authority].model)  # the one transformers' rows run
        samples = _timed_runs(configs, samplings, ids, max_new_tokens, repeats, seed, progress,
                              _PassCounter(reference))
        divergences = _greedy_divergences(samples, ids, reference, tokenizer.eos_token_id)
        if exactness_draws:
            for sampling in samplings:
                if not sampling.greedy:
                    checks.update(_check_distributions(configs, sampling, ids, reference,
                                                       tokenizer.eos_token_id, exactness_draws, exactness_tokens,
                                                       seed, progress))
    finally:
        for w in workers.values():
            w.close()
        if llama is not None:
            llama.close()
    reports = [r for sampling in samplings
               for r in summarize(configs, samples, len(ids), mode_label(sampling), repeats)]
    for r in reports:
        r.distribution = checks.get((r.mode, r.name))
        r.near_ties = sorted(i for i in r.mismatches if all(d.near_tie for d in divergences.get((r.name, i), [])))
    if out is not None:
        write_report(Path(out), reports, samples, dict(
            topology=topology, prompts=len(prompts), max_new_tokens=max_new_tokens, repeats=repeats,
            prompt_lookup=prompt_lookup, seed=seed, modes=[mode_label(s) for s in samplings],
            samplings=[s.model_dump() for s in samplings], exactness_draws=exactness_draws,
            exactness_tokens=exactness_tokens, threads=threads, machine=machine(), left_out=left_out,
            llama_cpp=llama_lines))
    return reports, samples


def _greedy_divergences(samples: list[Sample], ids: list[list[int]], model, eos) -> dict:
    """(configuration, prompt) -> the greedy divergences from plain decoding over the repeats
    (:func:`cascade.tools.exactness.greedy_divergence`): where a low-precision authority's
    rounding flipped a near-tie, and where something else did."""
    from cascade.tools.exactness import greedy_divergence

    greedy = [s for s in samples if s.mode == "greedy"]
    plain = {(s.prompt, s.repeat): s.token_ids for s in greedy if s.config == "plain"}
    found: dict[tuple[str, int], list] = {}
    for s in greedy:
        ref = plain.get((s.prompt, s.repeat))
        if s.config not in ("plain", LLAMA_CPP) and ref is not None and s.token_ids != ref:
            found.setdefault((s.config, s.prompt), []).append(
                greedy_divergence(model, ids[s.prompt], s.token_ids, ref, eos))
    return found


def _load(topology: str):
    """The topology (with a free n-gram level added if it has none, for the n-gram
    configurations), its workers and its tokenizer."""
    from cascade.build import build_workers, load_tokenizer
    from cascade.topology import load_topology, topology_from_dict

    topo = load_topology(topology)
    if not any(lv.kind == "ngram" for lv in topo.spec.levels):
        data = topo.spec.model_dump()
        data["levels"] = [lv.model_dump(exclude_unset=True) for lv in topo.spec.levels]
        data["levels"].insert(0, {"name": "ngram", "kind": "ngram"})
        if data["edges"] is not None:  # else the chain in listed order, the n-gram level first
            data["edges"] = [["ngram", data["levels"][1]["name"]]] + data["edges"]
        data["policy"] = {"name": "fixed", "params": {}}
        topo = topology_from_dict(data, topo.source, topo.base_dir, check_models=False)
    return topo, build_workers(topo), load_tokenizer(topo)


def _timed_runs(configs: list[Config], samplings: list, ids: list[list[int]], max_new_tokens: int, repeats: int,
                seed: int, progress: bool, counter: _PassCounter) -> list[Sample]:
    """After a warm-up, each (repeat, prompt): every configuration in every mode, in a fresh
    random order. Run ``r`` of prompt ``i`` is seeded ``seed + 1000 r + i`` in every
    configuration (their random streams differ all the same: only distributions compare)."""
    from tqdm import tqdm

    samples: list[Sample] = []
    try:
        for sampling in samplings:
            for c in configs:
                c.run(ids[0], 8, sampling, seed)
        rng = random.Random(seed)
        runs = [(sampling, c) for sampling in samplings for c in configs]
        trials = [(r, i) for r in range(repeats) for i in range(len(ids))]
        bar = tqdm(total=len(trials) * len(runs), desc="bench", unit="run", disable=not progress, file=sys.stderr)
        for r, i in trials:
            order = list(runs)
            rng.shuffle(order)
            for sampling, c in order:
                before = counter.count
                if c.kind != "cascade":  # transformers' own loop
                    counter.attach()
                try:
                    tokens, seconds, stats = c.run(ids[i], max_new_tokens, sampling, seed + 1000 * r + i)
                finally:
                    counter.close()
                passes = stats.authority_passes if stats is not None else counter.count - before
                samples.append(Sample(c.name, mode_label(sampling), i, r, len(tokens), seconds, passes, tokens, stats))
                bar.update()
        bar.close()
    finally:
        counter.close()
    return samples


def _check_distributions(configs: list[Config], sampling, ids: list[list[int]], authority_model, eos: int | None,
                         draws: int, tokens: int, seed: int, progress: bool) -> dict[tuple[str, str], DistributionCheck]:
    """The distribution check (:mod:`cascade.tools.exactness`) of every configuration that can
    draw (all but transformers' assisted decoding), on the short prompt prefix whose next token
    is most uncertain, against one sample of plain sampling (torch's generator seeded ``seed``; the
    cascade's rows seeded ``seed + 1 ...``, their own generators)."""
    from tqdm import tqdm

    from cascade.tools.exactness import check_distribution, uncertain_prefix

    prompt, length = uncertain_prefix(authority_model, ids, sampling)
    prefix = ids[prompt][:length]
    plain = next(c for c in configs if c.kind == "plain")
    reference = plain.draw(prefix, tokens, sampling, seed, draws)
    checks = {}
    for c in tqdm([c for c in configs if c is not plain and c.draw is not None],
                  desc=f"distribution check ({mode_label(sampling)})", disable=not progress, file=sys.stderr):
        got = c.draw(prefix, tokens, sampling, seed + 1, draws)
        checks[(mode_label(sampling), c.name)] = check_distribution(c.name, reference, got, tokens, eos,
                                                                    (prompt, length))
    return checks


def summarize(configs: list[Config], samples: list[Sample], n_prompts: int, mode: str = "greedy",
              repeats: int = 1) -> list[ConfigReport]:
    """One report per configuration from the samples of one mode. Speedups are per prompt (this
    configuration's tokens/s over plain's, summed over repeats), median over prompts, and the
    same over ``cascade:authority``'s where that row ran (what drafting bought); the
    non-loop speedup takes only the prompts whose plain continuation has repetition below
    ``LOOP_THRESHOLD`` (mean over repeats). Per repeat, the same speedup from that repeat's
    samples alone, and the configuration's tokens/s over all prompts."""
    samples = [s for s in samples if s.mode == mode]

    def per_prompt(name: str, value: Callable[[list[Sample]], float], repeat: int | None = None) -> list[float]:
        return [value([s for s in samples if s.config == name and s.prompt == i and repeat in (None, s.repeat)])
                for i in range(n_prompts)]

    def rate(xs: list[Sample]) -> float:
        return sum(s.tokens for s in xs) / sum(s.seconds for s in xs)

    def mean_repetition(xs: list[Sample]) -> float:
        return statistics.fmean(repetition(s.token_ids, NGRAM) for s in xs)

    plain = per_prompt("plain", rate)
    alone = per_prompt("cascade:authority", rate) if any(c.name == "cascade:authority" for c in configs) else None
    plain_by_repeat = [per_prompt("plain", rate, r) for r in range(repeats)]
    nonloop = [i for i, x in enumerate(per_prompt("plain", mean_repetition)) if x < LOOP_THRESHOLD]
    plain_ids = {(s.prompt, s.repeat): s.token_ids for s in samples if s.config == "plain"}
    plain_spt = sum(s.seconds for s in samples if s.config == "plain") / sum(
        s.tokens for s in samples if s.config == "plain")
    reports = []
    for c in configs:
        xs = [s for s in samples if s.config == c.name]
        rates = per_prompt(c.name, rate)
        speedups = [a / b for a, b in zip(rates, plain)]
        drafting = [a / b for a, b in zip(rates, alone)] if alone else None
        rep = ConfigReport(
            c.name, mode, statistics.median(rates), _median_ci(rates), statistics.median(speedups),
            _median_ci(speedups), sum(s.authority_passes for s in xs) / sum(s.tokens for s in xs),
            speedup_over_authority_median=statistics.median(drafting) if drafting else None,
            speedup_over_authority_ci=_median_ci(drafting) if drafting else None,
            repetition_median=statistics.median(per_prompt(c.name, mean_repetition)),
            speedup_nonloop_median=statistics.median([speedups[i] for i in nonloop]) if nonloop else None,
            nonloop_prompts=len(nonloop),
            speedup_by_repeat=[statistics.median(a / b for a, b in zip(per_prompt(c.name, rate, r), plain_by_repeat[r]))
                               for r in range(repeats)],
            tokens_per_second_by_repeat=[rate([s for s in xs if s.repeat == r]) for r in range(repeats)],
        )
        # under sampling the random streams differ: checked by distribution instead; llama.cpp is
        # another program, timed and not checked (cascade.tools.llamacpp)
        if mode == "greedy" and c.kind != LLAMA_CPP:
            rep.mismatches = sorted({s.prompt for s in xs if s.token_ids != plain_ids[(s.prompt, s.repeat)]})
        if c.kind == "cascade":
            cascade_fields(rep, c.graph, c.path, xs, plain_spt)
        reports.append(rep)
    return reports


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark cascade against plain and transformers' assisted decoding",
                       description="Run plain decoding, transformers assisted generation and prompt lookup, and "
                                   "cascade configurations on the same prompts, interleaved in one process; report "
                                   "tokens/s, speedup over plain decoding and over cascade with the authority alone "
                                   "(what drafting bought), both measured in the same run, authority passes "
                                   "per token, acceptance, predicted vs measured speedup, the repetition of each "
                                   "configuration's text and the speedup over the prompts whose plain text is no "
                                   "loop; check exactness (greedy: token identity; sampled: a chi-square test of "
                                   "the first tokens' distribution against plain sampling; exit status 2 on a "
                                   "failure); write bench.json, bench.md and PNG plots to --out.")
    p.add_argument("--topology", "-t", default=DEFAULT_TOPOLOGY)
    p.add_argument("--prompts", default="examples/prompts/heldout.jsonl")
    p.add_argument("--num-prompts", type=types.positive_int, default=None)
    p.add_argument("--max-new-tokens", type=types.positive_int, default=128)
    p.add_argument("--repeats", type=types.positive_int, default=1,
                   help="times every configuration runs on every prompt, interleaved (default 1); with 2 or more the "
                        "summary gives each speedup's median and range over the repeats and warns on a busy machine")
    p.add_argument("--threads", type=types.positive_int, default=DEFAULT_THREADS,
                   help=f"torch's intra-op threads (default {DEFAULT_THREADS}: steady timings on a shared machine)")
    p.add_argument("--prompt-lookup", type=types.positive_int, default=10, help="prompt_lookup_num_tokens for transformers")
    p.add_argument("--only", action="append", default=None,
                   help="run only configurations whose name contains this (plain and cascade:authority always run; "
                        "repeatable; one that no configuration contains is an error that lists them)")
    p.add_argument("--batch-sizes", type=types.positive_int_list, default=None,
                   help="throughput mode: comma-separated batch sizes (e.g. 1,4,16,64), plain batched decoding "
                        "vs the batched cascade")
    p.add_argument("--policy", type=types.policy_spec, default=None, help="cascade policy for --batch-sizes (default: the topology's)")
    p.add_argument("--requests", type=types.positive_int, default=32,
                   help="--batch-sizes: requests served at each concurrency (at least the batch size)")
    types.add_sampling_args(p, what="every configuration, plain decoding included")
    p.add_argument("--with-greedy", action="store_true",
                   help="with --temperature > 0: also run every configuration greedily, interleaved in the same run, "
                        "and report both side by side")
    p.add_argument("--exactness-draws", type=types.nonnegative_int, default=300,
                   help="sampled runs: draws per configuration (and of plain sampling) for the distribution check; "
                        "0 = skip it (default 300)")
    p.add_argument("--exactness-tokens", type=types.positive_int, default=2,
                   help="sampled runs: leading tokens compared, jointly, by the distribution check (default 2)")
    p.add_argument("--tree", type=types.positive_int_list, action="append", default=[], metavar="W1,W2,...",
                   help="also time a tree of these widths per depth on every model edge into the authority "
                        "(repeatable), beside its chain")
    p.add_argument("--out", required=True)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_main)


@guarded
def _main(args) -> int:
    from cascade.tools.baselines import load_prompts

    from cascade.sampling import Sampling

    prompts = load_prompts(args.prompts, args.num_prompts)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    t0 = time.perf_counter()
    if args.batch_sizes:
        _, check = run_batch_bench(args.topology, prompts, args.batch_sizes, args.max_new_tokens, args.policy,
                                   args.out, progress=not args.no_progress, requests=args.requests,
                                   repeats=args.repeats, sampling=sampling, seed=args.seed,
                                   exactness_draws=args.exactness_draws, exactness_tokens=args.exactness_tokens,
                                   threads=args.threads)
        print((Path(args.out) / "batch.md").read_text())
        print(f"({time.perf_counter() - t0:.0f} s; report in {args.out})")
        if check is not None and not check.passed:
            print(f"EXACTNESS FAILURE against plain sampling: {check.config} (p = {check.p_value:.2g})", file=sys.stderr)
            return 2
        return 0
    samplings = [Sampling(), sampling] if args.with_greedy and not sampling.greedy else [sampling]
    try:
        reports, _ = run_bench(args.topology, prompts, args.max_new_tokens, args.repeats, args.out,
                               args.prompt_lookup, args.only, progress=not args.no_progress, seed=args.seed,
                               samplings=samplings, exactness_draws=args.exactness_draws,
                               exactness_tokens=args.exactness_tokens, threads=args.threads,
                               trees=tuple(tuple(t) for t in args.tree))
    except UnknownConfiguration as exc:
        print(f"cascade bench: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "bench.md").read_text())
    print(f"({time.perf_counter() - t0:.0f} s; report in {args.out})")
    bad = [f"{r.name} ({r.mode})" for r in reports if not r.exact]
    if bad:
        print(f"EXACTNESS FAILURE against plain decoding: {bad}", file=sys.stderr)
        return 2
    return 0
