"""What a SmolLM2-135M-Instruct pass costs with and without the few-row kernel (workers/kernels/few_rows.py).

Two lean workers of the pulled model side by side in one process, one multiplying through the
kernel and one through torch's products (oneDNN from prepacked copies, MKL over column-major
weights for one row) — and, where the CPU computes bf16 natively (AVX-512 BF16, AMX), two in bf16
(what `dtype: fastest` loads there), from oneDNN's prepacked copies and through F.linear
(`packed_weights: false`); one score pass of W new positions after a 200-token prefix, the
widths interleaved and the workers alternated in a random order each repeat, one thread:

    OMP_NUM_THREADS=1 python examples/models/smollm2/kernel_curve.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--widths", default="1,2,4,8,12,16")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (the kernel runs at one; with more, both workers use torch's products)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from cascade.pull import cache_dir
    from cascade.tools.cost_curve import measure
    from workers.kernels import few_rows
    from workers.devices import native_bf16
    from workers.hf import HFWorker

    if not few_rows.enabled():
        raise SystemExit(f"the few-row kernel is not used here: {few_rows.why_not()}")
    path = cache_dir("smollm2-135m-instruct")
    load = lambda dtype=torch.float32: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()  # noqa: E731
    workers = {"kernel": HFWorker(load())}
    few_rows._state.update(fn=None, reason="the comparison's other workers")  # built without it
    workers["torch"] = HFWorker(load())
    if native_bf16(torch.device("cpu")):
        workers["bf16, prepacked"] = HFWorker(load(torch.bfloat16))
        workers["bf16, F.linear"] = HFWorker(load(torch.bfloat16), packed_weights=False)
    widths = [int(w) for w in args.widths.split(",")]
    times = measure(workers, widths, 200, args.repeats)
    median = {name: {w: statistics.median(v) * 1000 for w, v in t.items()} for name, t in times.items()}
    print(f"{'new positions':<22}" + "".join(f"{w:>8}" for w in widths))
    for name in times:
        print(f"{name + ' (ms)':<22}" + "".join(f"{median[name][w]:8.1f}" for w in widths))
    for name in times:
        if name != "kernel":
            print(f"{name + ' / kernel':<22}" + "".join(f"{median[name][w] / median['kernel'][w]:7.2f}x" for w in widths))


if __name__ == "__main__":
    main()
