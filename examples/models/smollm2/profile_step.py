"""Where a step's time goes: cProfile of ``Cascade.generate`` on the real topology.

    OMP_NUM_THREADS=1 python examples/models/smollm2/profile_step.py [--policy auto] [--temperature 0.8] [--batch 4]

Runs the first held-out chat prompt three times (seeds 0-2, 128 tokens, top-p 0.95) after a warm-up
(with ``--batch B``: the first B held-out chats together, three times)
and prints the functions by cumulative and by own time: the authority's forward
(``workers/lean.py:forward``), drafting (``workers/base.py:draft``), sampling
(``cascade/sampling.py``) and the engine's own work. Needs the pulled model
(``cascade pull smollm2-135m-instruct``).
"""
import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

from cascade import Cascade

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default=str(ROOT / "topologies" / "smollm2.yaml"))
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (the first B held-out chats)")
    parser.add_argument("--top", type=int, default=40, help="rows of each table")
    args = parser.parse_args()
    cascade = Cascade.from_topology(args.topology)
    with open(ROOT / "examples" / "prompts" / "chat-heldout.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:args.batch]
    prompt = prompts[0] if args.batch == 1 else prompts
    # the speculative rule, as the benchmarks and unseeded requests use (a seed alone would pick "gumbel")
    run = dict(max_new_tokens=128, temperature=args.temperature, top_p=0.95, policy=args.policy, coupling="residual")
    if args.batch > 1:
        run["batch_size"] = args.batch
    cascade.generate(prompt, **{**run, "max_new_tokens": 16}, seed=0)  # warm-up
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    tokens = 0
    for seed in range(3):
        out = cascade.generate(prompt, **run, seed=seed)
        tokens += sum(len(g.token_ids) for g in (out if isinstance(out, list) else [out]))
    profile.disable()
    wall = time.perf_counter() - start
    print(f"{tokens} tokens in {wall:.2f} s under the profiler ({1000 * wall / tokens:.1f} ms a token)")
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top // 2)


if __name__ == "__main__":
    main()
