"""The pulled authority's lean forward pass alone, bf16 and 4-bit (``quantize: gguf``), best of N.

    OMP_NUM_THREADS=1 python examples/models/smollm2/lean_pass.py [--widths 1,8] [--repeats 40]
    OMP_NUM_THREADS=1 python examples/models/smollm2/lean_pass.py --profile q4:1   # torch.profiler's table

Calls ``workers/lean.py``'s forward directly (no worker bookkeeping) for W new positions after a
200-token prefix, on a cache cropped back after each pass; the levels and widths interleaved in a
random order each repeat. The per-op cost of a pass shows against the products': compare two
trees by running this with ``PYTHONPATH`` set to each in turn (docs/results-log.md, 2026-12-07).
Needs the pulled model and its GGUF (``cascade pull --force smollm2-135m-instruct``).
"""
import argparse
import random
import statistics
import time

import torch

from cascade.pull import cache_dir
from workers.hf import HFWorker
from workers.kvcache import growing_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,8")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--kinds", default="bf16,q4")
    parser.add_argument("--profile", default=None, help="KIND:WIDTH: torch.profiler's table of 20 such passes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = str(cache_dir("smollm2-135m-instruct"))
    workers = {k: HFWorker(path, "bfloat16", "cpu", quantize="gguf" if k == "q4" else None)
               for k in args.kinds.split(",")}
    rng = random.Random(0)
    widths = [int(w) for w in args.widths.split(",")]
    new = {w: torch.tensor([[rng.randrange(49152) for _ in range(w)]]) for w in widths}
    caches = {}
    with torch.inference_mode():
        for kind, worker in workers.items():
            caches[kind] = growing_cache(worker.model)
            prefix = torch.tensor([[rng.randrange(49152) for _ in range(200)]])
            worker.lean(prefix, torch.arange(200)[None], caches[kind].layers, None, 1)

        def run(kind: str, width: int) -> None:
            layers = caches[kind].layers
            workers[kind].lean(new[width], torch.arange(200, 200 + width)[None], layers, None, width)
            for layer in layers:
                layer.crop(-width)

        if args.profile:
            from torch.profiler import profile

            kind, width = args.profile.split(":")
            for _ in range(10):
                run(kind, int(width))
            with profile() as prof:
                for _ in range(20):
                    run(kind, int(width))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            return
        times: dict = {(k, w): [] for k in workers for w in widths}
        for _ in range(args.repeats + 1):  # the first round warms up
            for w in rng.sample(widths, len(widths)):
                for kind in rng.sample(list(workers), len(workers)):
                    start = time.perf_counter()
                    run(kind, w)
                    times[(kind, w)].append(time.perf_counter() - start)
    print(f"ms per pass after 200 tokens, batch 1, one thread, {args.repeats} repeats")
    for (kind, w), t in times.items():
        t = sorted(t[1:])
        print(f"{kind} at {w}: best {t[0] * 1e3:.2f}, tenth {t[len(t) // 10] * 1e3:.2f}, "
              f"median {statistics.median(t) * 1e3:.2f}")


if __name__ == "__main__":
    main()
