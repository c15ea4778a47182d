"""The authority's pass of W new positions (topologies/smollm2.yaml in bf16, topologies/smollm2-q4.yaml
from the GGUF's 4-bit groups) against llama.cpp's pass of the same W tokens on the same GGUF, with
logits for every one of them as a verification needs (W = 1, one token's decode step: the target is
at most 1.2x), each after the same 200-token prefix, interleaved in one process in a fresh random
order per repeat, one thread. Needs llama-cpp-python (pip install -e '.[llama]'). Run from the
repository root: python examples/models/smollm2/llamacpp_pass.py [repeats, default 30] [W ..., default 1]"""
import random, statistics, sys, time
import torch
from cascade.api import Cascade
from cascade.tools import llamacpp

torch.set_num_threads(1)
R = int(sys.argv[1]) if len(sys.argv) > 1 else 30
WIDTHS = [int(w) for w in sys.argv[2:]] or [1]
cs = {t: Cascade.from_topology(f"topologies/{t}.yaml") for t in ("smollm2", "smollm2-q4")}
workers = {t: c.workers[c.topology.authority] for t, c in cs.items()}
base, note = llamacpp.baseline(cs["smollm2"].topology, 1, logits_all=max(WIDTHS) > 1)  # a verification reads all
rng = random.Random(0)
vocab = 49152  # SmolLM2-135M's vocabulary
prefix = [rng.randrange(vocab) for _ in range(200)]
ids = ["pass"]

def torch_pass(w):
    def f(new):
        w.score(ids, [prefix], [1])  # the cache holds the prefix alone
        t0 = time.perf_counter()
        w.score(ids, [prefix + new], [len(new)])
        return time.perf_counter() - t0
    return f

def llama_pass(new):
    base.llm.reset()
    base.llm.eval(prefix)
    t0 = time.perf_counter()
    base.llm.eval(new)
    return time.perf_counter() - t0

sides = {"bf16 (smollm2.yaml)": torch_pass(workers["smollm2"]),
         "4-bit groups (smollm2-q4.yaml)": torch_pass(workers["smollm2-q4"]),
         "llama.cpp": llama_pass}
for f in sides.values():
    f([1]); f([2, 3])
times = {(k, w): [] for w in WIDTHS for k in sides}
for r in range(R):
    for k, w in rng.sample(list(times), len(times)):
        times[k, w].append(sides[k]([rng.randrange(vocab) for _ in range(w)]))
for w in WIDTHS:
    print(f"{w} new position{'s' * (w > 1)}:")
    ll = times["llama.cpp", w]
    for k in sides:
        ts = times[k, w]
        m = statistics.median(ts)
        per_rep = sorted(a / b for a, b in zip(ts, ll))
        print(f"  {k}: median {1000*m:.1f} ms (min {1000*min(ts):.1f}, max {1000*max(ts):.1f}); "
              f"÷ llama.cpp {m/statistics.median(ll):.2f}x (per-repeat ratio median {statistics.median(per_rep):.2f}, "
              f"quartiles {per_rep[len(per_rep)//4]:.2f}–{per_rep[3*len(per_rep)//4]:.2f})")
