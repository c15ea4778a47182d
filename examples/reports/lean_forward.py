"""Per-pass time of transformers' forward against the worker's lean forward (workers/lean.py),
side by side, on the bundled family: the pool's cache layers over the same buffers, the same
inputs, batch 4, widths 1 / 4 / 8 over 200 cached columns (a fifth of them holes).

    OMP_NUM_THREADS=1 python examples/reports/lean_forward.py > examples/reports/lean_forward.md
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="examples/models")
    p.add_argument("--levels", nargs="+", default=["tiny", "small", "medium", "large"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cached", type=int, default=200)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from workers.hf import HFWorker
    from workers.pool import buffer_layer

    print(f"batch {args.batch}, {args.cached} cached columns; ms per pass, best of {args.rounds} rounds of "
          f"{args.calls} calls, the two forwards interleaved\n")
    print("| level | width | transformers forward (ms) | lean forward (ms) | lean ÷ transformers | max abs logit difference |")
    print("|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for level in args.levels:
        model = AutoModelForCausalLM.from_pretrained(f"{args.family}/{level}", dtype=torch.float32).eval()
        lean, plain = HFWorker(model), HFWorker(model, lean=False)
        c = model.config
        shape = (args.batch, c.num_key_value_heads, args.cached + max(args.widths), c.head_dim)
        kbufs = [torch.randn(shape, generator=gen) for _ in range(c.num_hidden_layers)]
        vbufs = [torch.randn(shape, generator=gen) for _ in range(c.num_hidden_layers)]
        valid = torch.rand(args.batch, shape[2], generator=gen) > 0.2
        for width in args.widths:
            ids = torch.randint(1, c.vocab_size, (args.batch, width), generator=gen)
            start = valid[:, :args.cached].sum(1)
            positions = start[:, None] + torch.arange(width)
            mask = valid[:, :args.cached + width].clone()
            mask[:, args.cached:] = True

            def run(worker):
                layers = [buffer_layer(k, v, args.cached) for k, v in zip(kbufs, vbufs)]
                return worker._logits(ids, positions, layers, mask, width)

            with torch.inference_mode():
                diff = (run(lean) - run(plain)).abs().max().item()
                best = {"plain": float("inf"), "lean": float("inf")}
                for _ in range(args.rounds):
                    for name, worker in (("plain", plain), ("lean", lean)):
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            run(worker)
                        best[name] = min(best[name], (time.perf_counter() - t0) / args.calls * 1e3)
            print(f"| {level} | {width} | {best['plain']:.2f} | {best['lean']:.2f} | "
                  f"{best['lean'] / best['plain']:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
