"""What one SmolLM2-135M linear costs by rows: bf16 as the lean forward runs it against torch's CPU
weight-only int4 and int8 matrix products (docs/quantized.md has the figures).

For each of SmolLM2's linear shapes (q/o 576->576, k/v 576->192, gate/up 576->1536, down
1536->576, the LM head 576->49152) and each row count, one thread, the variants interleaved in a
random order each repeat:

* ``bf16``: oneDNN over a prepacked bf16 copy (``workers/lean.py``'s ``_prepacked``: what the
  lean forward runs for a bf16 level);
* ``int4 bf16`` / ``int4 f32``: ``_weight_int4pack_mm_for_cpu`` over 4-bit codes in groups of 32
  (Q4_1's layout), activations in bf16 / float32;
* ``int8``: ``_weight_int8pack_mm`` (per-output-channel scales only), bf16 activations.

``int4 f32`` only with ``--f32``: torch runs it through a slow generic loop (tens of times slower).

Each weight set is many copies of the shape (about 64 MB in all) cycled so that every call reads
its weight from memory, as a decode step does. The last table sums one decoder layer (q, k, v,
o, gate, up, down) x 30 plus the head: the linear part of a token's pass.

    OMP_NUM_THREADS=1 python examples/models/smollm2/quant_curve.py [--repeats 15]

``--passes``: the pulled authority's whole pass instead (one score pass of W new positions after
a 200-token prefix, batch 1, the workers interleaved: cascade/tools/cost_curve.py), bf16 against
``quantize: gguf`` with the width measured at load and with the kernel at every width
(needs the GGUF beside the pulled model: ``cascade pull --force smollm2-135m-instruct``).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576),
          "head": (576, 49152)}
LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # per decoder layer
LAYERS = 30
GROUP = 32
COLD_BYTES = 64 << 20


def _variants(k: int, n: int, copies: int, f32: bool) -> dict:
    """name -> (call(x_bf16, x_f32, i)) over ``copies`` independent weights of shape [n, k]."""
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(copies)]
    bf16 = [torch.ops.mkldnn._reorder_linear_weight(w) for w in dense]
    codes = [torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen) for _ in range(copies)]
    packed4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 1) for c in codes]
    sz = torch.rand(k // GROUP, n, 2, generator=gen) * 0.01
    sz_bf16, sz_f32 = sz.bfloat16(), sz
    int8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen) for _ in range(copies)]
    scales = torch.rand(n, generator=gen).bfloat16()
    variants = {
        "bf16": lambda xb, xf, i: torch.ops.mkldnn._linear_pointwise(xb, bf16[i], None, "none", [], ""),
        "int4 bf16": lambda xb, xf, i: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed4[i], GROUP, sz_bf16),
        "int4 f32": lambda xb, xf, i: torch.ops.aten._weight_int4pack_mm_for_cpu(xf, packed4[i], GROUP, sz_f32),
        "int8": lambda xb, xf, i: torch.ops.aten._weight_int8pack_mm(xb, int8[i], scales),
    }
    if not f32:
        del variants["int4 f32"]
    return variants


def measure(rows: list[int], repeats: int, calls: int, f32: bool) -> dict:
    """(shape, variant, rows) -> list of microseconds per call (median over ``calls`` calls)."""
    out: dict = {}
    for shape, (k, n) in SHAPES.items():
        copies = max(2, min(32, COLD_BYTES // (k * n * 2)))
        variants = _variants(k, n, copies, f32)
        xs = {m: (torch.randn(m, k).bfloat16(), torch.randn(m, k)) for m in rows}
        for fn in variants.values():  # warm up: first calls build kernels
            for m in rows:
                fn(*xs[m], 0)
        for _ in range(repeats):
            order = [(name, m) for name in variants for m in rows]
            random.shuffle(order)
            for name, m in order:
                xb, xf = xs[m]
                times = []
                for c in range(calls):
                    t0 = time.perf_counter()
                    variants[name](xb, xf, c % copies)
                    times.append(time.perf_counter() - t0)
                out.setdefault((shape, name, m), []).append(statistics.median(times) * 1e6)
    return out


def passes(widths: list[int], repeats: int) -> None:
    """The authority's pass by width, bf16 and quantized, side by side."""
    import os

    from cascade.pull import cache_dir
    from cascade.tools.cost_curve import measure
    from workers.hf import HFWorker

    path = str(cache_dir("smollm2-135m-instruct"))
    workers = {"bf16": HFWorker(path, "bfloat16", "cpu")}
    workers["q4, measured"] = HFWorker(path, "bfloat16", "cpu", quantize="gguf")
    os.environ["CASCADE_QUANT_MOST_ROWS"] = "1024"
    workers["q4, kernel always"] = HFWorker(path, "bfloat16", "cpu", quantize="gguf")
    print(f"kernel up to {workers['q4, measured']._quantized.most_rows} rows (measured at load)")
    times = measure(workers, widths, 200, repeats)
    print(f"ms per pass, median [min-max of {repeats}], batch 1, after 200 tokens, one thread")
    print(f"{'new positions':<20}" + "".join(f"{w:>18}" for w in widths))
    for name, by_width in times.items():
        cells = [f"{statistics.median(t) * 1e3:6.1f} [{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}]" for t in by_width.values()]
        print(f"{name:<20}" + "".join(f"{c:>18}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=16, help="calls per timing (over distinct weights)")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--f32", action="store_true", help="also int4 with float32 activations (slow)")
    parser.add_argument("--passes", action="store_true", help="whole authority passes (see above)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    random.seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    if args.passes:
        return passes(rows, args.repeats)
    times = measure(rows, args.repeats, args.calls, args.f32)
    names = sorted({v for _, v, _ in times}, key=["bf16", "int4 bf16", "int4 f32", "int8"].index)
    print(f"microseconds per call, median [min-max of {args.repeats} repeats], one thread")
    for shape in SHAPES:
        print(f"\n{shape} {SHAPES[shape][0]}->{SHAPES[shape][1]}")
        print(f"{'rows':<10}" + "".join(f"{m:>22}" for m in rows))
        for name in names:
            cells = []
            for m in rows:
                t = times[(shape, name, m)]
                cells.append(f"{statistics.median(t):7.1f} [{min(t):.0f}-{max(t):.0f}]")
            print(f"{name:<10}" + "".join(f"{c:>22}" for c in cells))
    print(f"\nlinears of one token's pass ({LAYERS} layers + head), ms, medians summed")
    print(f"{'rows':<10}" + "".join(f"{m:>9}" for m in rows))
    for name in names:
        total = []
        for m in rows:
            med = lambda s: statistics.median(times[(s, name, m)])  # noqa: E731
            body = LAYERS * sum(count * med(s) for s, count in LAYER.items())
            total.append((body + med("head")) / 1000)
        print(f"{name:<10}" + "".join(f"{t:9.2f}" for t in total))


if __name__ == "__main__":
    main()
