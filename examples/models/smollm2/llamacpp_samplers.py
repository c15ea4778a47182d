"""llama.cpp (llama-cpp-python, ``pip install -e '.[llama]'``) on the pulled SmolLM2 GGUF, one
thread, the prompts of examples/prompts/chat-unseen.jsonl, 128 new tokens: tokens/s with the
prefill, greedy and under several sampler chains, interleaved per prompt in a fresh random order
(docs/benchmarks.md, "llama.cpp beside every row"). Chains: cascade's order (temperature, then
top-k, then top-p: what cascade bench's llama.cpp row uses) with top-k off and with top-k 40, and
llama-cpp-python's own ``generate`` (top-k, top-p, min-p 0.05, then temperature) with top-k 40
(its default) and 0 (off). Run from the repository root: python examples/models/smollm2/llamacpp_samplers.py
"""
import random
import statistics
import sys
import time

from cascade.build import load_tokenizer
from cascade.sampling import Sampling
from cascade.tools import llamacpp
from cascade.tools.baselines import load_prompts
from cascade.topology import load_topology

N = int(sys.argv[1]) if len(sys.argv) > 1 else 128
topo = load_topology("topologies/smollm2.yaml")
tokenizer = load_tokenizer(topo)
base, note = llamacpp.baseline(topo, threads=1)
if base is None:
    sys.exit(note)
prompts = [tokenizer.encode(p) for p in load_prompts("examples/prompts/chat-unseen.jsonl")]
eos = tokenizer.eos_token_id


def cascade_order(sampling):
    def run(ids, n, seed):
        new, seconds, _ = base.generate(ids, n, sampling, seed, eos)
        return len(new), seconds
    return run


def llama_cpp_python(top_k):
    """llama-cpp-python's generate with its default chain (min-p 0.05, top-p and top-k before the temperature)."""
    def run(ids, n, seed):
        llm = base.llm
        llm.set_seed(seed)
        llm.reset()  # no cached prefix: the prefill is paid, as in every other run
        t0, count = time.perf_counter(), 0
        for token in llm.generate(ids, top_k=top_k, top_p=0.95, min_p=0.05, temp=0.8, reset=True):
            count += 1
            if token == eos or count == n:
                break
        return count, time.perf_counter() - t0
    return run


chains = {
    "greedy": cascade_order(Sampling()),
    "T 0.8, top-p 0.95, top-k off (cascade's order)": cascade_order(Sampling(temperature=0.8, top_p=0.95)),
    "T 0.8, top-k 40, top-p 0.95 (cascade's order)": cascade_order(Sampling(temperature=0.8, top_k=40, top_p=0.95)),
    "llama-cpp-python generate, top-k 40 (its default)": llama_cpp_python(40),
    "llama-cpp-python generate, top-k 0": llama_cpp_python(0),
}
for run in chains.values():  # warm-up
    run(prompts[0], 8, 0)
rates = {name: [] for name in chains}
rng = random.Random(0)
for i, ids in enumerate(prompts):
    for name in rng.sample(list(chains), len(chains)):
        tokens, seconds = chains[name](ids, N, i)
        rates[name].append(tokens / seconds)
for name, xs in rates.items():
    print(f"{name}: {statistics.median(xs):.1f} tokens/s (median over {len(xs)} prompts; {min(xs):.1f}–{max(xs):.1f})")
base.close()
