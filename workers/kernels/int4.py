"""torch's CPU weight-only int4 kernel, the product of a quantized level (:mod:`workers.quant`).

``_weight_int4pack_mm_for_cpu`` (what torchao drives) multiplies bf16 rows by 4-bit codes in groups
of 32 inputs, each weight ``(code - 8) * scale + zero`` (:class:`Groups`), with its scales and
zeros in bfloat16, accumulating in float32. It is a private op: :func:`kernel_works` runs it on a
probe against the dequantized product, and a level whose check fails keeps its float products.
Its cost grows with the rows of a pass, where a bf16 product's barely does, so
:func:`most_rows` measures, when a level loads, the widest pass at which it beats the level's float
products (docs/quantized.md has the figures).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

GROUP = 32
ROW_STEPS = (1, 2, 4, 8, 16, 32)  # pass widths at which the kernel is timed against the float product
Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Groups:
    """A weight ``[out, in]`` as torch's int4 kernel takes it: ``codes`` ``[out, in]`` (0..15),
    ``scales`` and ``zeros`` ``[out, in / 32]``, each weight ``(code - 8) * scale + zero``.
    ``repeat`` 2: the weight is twice as wide as the product's input, which is given twice (Q8_0)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    repeat: int = 1

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` the kernel computes with (its scales rounded to bf16)."""
        scale = self.scales.bfloat16().float().repeat_interleave(GROUP, 1)
        zero = self.zeros.bfloat16().float().repeat_interleave(GROUP, 1)
        w = (self.codes.float() - 8) * scale + zero
        return sum(w.chunk(self.repeat, dim=1))

    def permute_rows(self, order: np.ndarray) -> "Groups":
        index = torch.from_numpy(order)
        return Groups(self.codes[index], self.scales[index], self.zeros[index], self.repeat)


def groups_from_float(weight: torch.Tensor) -> Groups:
    """4-bit groups of 32 from a float weight ``[out, in]``: each group's range in 16 steps."""
    w = weight.detach().float().reshape(weight.shape[0], -1, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return Groups(codes.reshape(weight.shape), scale, low + 8 * scale)


class QuantProduct:
    """``x @ W.T + bias`` from a weight's :class:`Groups` through torch's int4 kernel, for passes of
    at most ``most_rows`` rows of bf16; ``plain`` (the level's float product) for the rest."""

    def __init__(self, groups: Groups, bias: torch.Tensor | None, plain: Product):
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.contiguous(), 1)
        # [in / 32, out, 2]: each group's scale and zero, as the kernel takes them
        self.scales_zeros = torch.stack([groups.scales.t(), groups.zeros.t()], -1).bfloat16().contiguous()
        self.repeat, self.bias, self.plain = groups.repeat, bias, plain
        self.out, self.columns = groups.codes.shape[0], groups.codes.shape[1] // groups.repeat
        self.most_rows = 0  # set by quantized_products once measured

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (the lean forward's rows are 2-D)
        if self.repeat > 1:
            flat = flat.repeat(1, self.repeat)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.numel() // x.shape[-1] <= self.most_rows:
            return self.kernel(x)
        return self.plain(x)


def kernel_works() -> str | None:
    """None where torch's int4 CPU kernel runs here and matches its reference on a probe, else why not."""
    try:
        gen = torch.Generator().manual_seed(0)
        groups = groups_from_float(torch.randn(32, 64, generator=gen))
        x = torch.randn(3, 64, generator=gen).bfloat16()
        ours = QuantProduct(groups, None, None).kernel(x).float()
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        return f"torch's int4 CPU kernel is not available ({exc})"
    reference = x.float() @ groups.dequantize().t()
    if not torch.allclose(ours, reference, rtol=2e-2, atol=2e-2):
        return "torch's int4 CPU kernel does not match its reference here"
    return None


def most_rows(products: list[QuantProduct]) -> int:
    """The widest pass (of :data:`ROW_STEPS`) up to which the kernel beat the float products on
    these weights, each width timed over all of them (every weight read from memory, as a pass
    does), the two interleaved, the better of 2 after a warm-up; 0 where it never did.
    ``CASCADE_QUANT_MOST_ROWS`` fixes it."""
    fixed = os.environ.get("CASCADE_QUANT_MOST_ROWS")
    if fixed is not None:
        return int(fixed)
    runs = {"kernel": lambda p, x: p.kernel(x), "plain": lambda p, x: p.plain(x)}
    # every third weight and the largest (an LM head): a pass's mix of shapes, in less time
    largest = max(products, key=lambda p: p.out * p.columns)
    products = products[::3] + ([largest] if largest not in products[::3] else [])
    best = 0
    for rows in ROW_STEPS:
        inputs = {p.columns: torch.randn(rows, p.columns).bfloat16() for p in products}
        times: dict = {"kernel": [], "plain": []}
        for repeat in range(3):  # the first round warms up (oneDNN builds a kernel per shape)
            for name, run in runs.items():
                start = time.perf_counter()
                for p in products:
                    run(p, inputs[p.columns])
                if repeat:
                    times[name].append(time.perf_counter() - start)
        if min(times["kernel"]) >= min(times["plain"]):
            break
        best = rows
    return best
