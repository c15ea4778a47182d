"""What SmolLM2-135M-Instruct's float32 matrix products cost alone, by rows, through each path of
workers/kernels/products.py: the few-row kernel, torch's products without it (oneDNN from
prepacked copies for several rows, MKL over column-major weights for one: what a level gets
where the kernel is not built) and plain F.linear. Random weights of the model's shapes (its 30
layers' seven projections and its LM head), each read once per pass as a pass reads them; the
paths interleaved in each round, the first round a warm-up, min–max over the rest, one thread:

    OMP_NUM_THREADS=1 python examples/models/smollm2/product_curve.py [--rounds 6]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from workers.kernels import few_rows
from workers.kernels.products import PACK_MIN_ELEMENTS, column_major, prepacked

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def torch_path(weight: torch.Tensor):
    """linear_product's float32 path where the few-row kernel is not used."""
    if weight.numel() < PACK_MIN_ELEMENTS:
        return lambda x: F.linear(x, weight)
    column_major(weight)
    packed = prepacked(weight, None)
    return lambda x: F.linear(x, weight) if x.shape[0] == 1 else packed(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not few_rows.enabled():
        raise SystemExit(f"the few-row kernel is not used here: {few_rows.why_not()}")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g) for s in SHAPES]
    paths = {"kernel": [few_rows.product(w, None) or (lambda x, w=w: F.linear(x, w)) for w in weights],
             "torch": [torch_path(w.clone()) for w in weights],
             "F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    print("rows  " + "  ".join(f"{name:>15}" for name in paths) + "   (ms, min-max)")
    for rows in map(int, args.rows.split(",")):
        inputs = {s[1]: torch.randn(rows, s[1], generator=g) for s in SHAPES}
        times: dict = {name: [] for name in paths}
        for r in range(args.rounds):
            for name, products in paths.items():
                start = time.perf_counter()
                for product, shape in zip(products, SHAPES):
                    product(inputs[shape[1]])
                if r:
                    times[name].append((time.perf_counter() - start) * 1e3)
        print(f"{rows:>4}  " + "  ".join(f"{min(t):>7.1f}-{max(t):<7.1f}" for t in times.values()))


if __name__ == "__main__":
    main()
