"""A float32 matrix product for passes of a few rows on a CPU: decoding one token, verifying a block.

Decoding reads every weight of the model once per pass to multiply it by one row (one position);
verifying a block of k drafted tokens reads them once to multiply by k + 1 rows. Both are bound
by reading the weights, so on paper the block costs what one row costs — the premise of
speculative decoding. MKL's and oneDNN's kernels do not get there for a few rows on an AVX2 CPU
(docs/engine.md has what a whole pass costs with each; docs/results-log.md the products alone).

The kernel (``few_rows.c`` beside this file, a small C function built with the package as an
optional extension: setup.py) does this: the weight is copied into
blocks of 16 output columns, each stored ``[in, 16]`` so that a block streams contiguously from
memory, and the block is multiplied by up to 4 rows kept in registers (AVX2 fused multiply-add;
a single row works on two blocks at once). Every output element is the same sequential sum over
the input dimension, in the same order, whatever the number of rows and wherever a row sits in
the pass: a row's product does not depend on the rows beside it, bit for bit (float32's
products rounded in another order than MKL's: ~1e-6 relative; cascade/DESIGN.md §2).

It is used where all of this holds, else the caller keeps torch's own products:

* an x86-64 CPU with AVX2 and FMA, and the extension built when the package was installed
  (``pip install -e .`` builds it where a C compiler is found and skips it otherwise; a source
  tree not installed: ``python setup.py build_ext --inplace``); where it is missing, or its
  load or check fails, that is logged once and not retried in the process;
* the kernel's products match ``F.linear`` on a probe when it is loaded;
* torch runs one intra-op thread (the kernel is single-threaded: :mod:`workers.lean` builds a
  level's products for it only where the level loads at one thread, and a pass run at more goes
  to F.linear), and the pass has at most :data:`MAX_ROWS` rows (more rows: MKL's blocked matrix
  product is faster);
* ``CASCADE_FEW_ROWS`` is not ``0``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BLOCK = 16  # output columns per block: two 8-float AVX2 registers per row
# More rows than this go to MKL, whose blocked product overtakes this kernel (docs/results-log.md).
MAX_ROWS = 32
# Weights smaller than this stay with F.linear: a call's fixed cost is not worth saving there.
MIN_ELEMENTS = 1 << 16


_state: dict = {}


def enabled() -> bool:
    """Whether the kernel is available here (built, loaded and checked; see the module's notes)."""
    return _function() is not None


def product(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> F.linear(x, weight, bias)``, through the kernel for passes of at most
    :data:`MAX_ROWS` rows at one thread and through F.linear otherwise; None where the kernel
    does not apply (see the module's notes; also a weight under :data:`MIN_ELEMENTS` elements,
    not float32 on a CPU; a pass that records gradients goes through F.linear). The weight is copied into the kernel's layout
    (memory: the weight once more); the copy does not follow later changes to the weight."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.numel() < MIN_ELEMENTS):
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return None
    fn = _function()
    if fn is None:
        return None
    out_features, in_features = weight.shape
    blocked = blocked_layout(weight.detach())
    bias_c = None if bias is None else bias.detach().contiguous()
    bias_ptr = None if bias_c is None else bias_c.data_ptr()
    w_ptr = blocked.data_ptr()

    def multiply(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // in_features if in_features else 0
        if (rows == 0 or rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.get_num_threads() != 1
                or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, in_features).contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32)
        fn(flat.data_ptr(), w_ptr, bias_ptr, y.data_ptr(), rows, in_features, out_features)
        return y.view(*x.shape[:-1], out_features)

    multiply.blocked = blocked  # keeps the copy alive with the function; also for tests
    multiply.bias = bias_c
    return multiply


def blocked_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` as the kernel reads it: ``[ceil(out / 16), in, 16]``, the last
    block's missing columns zero."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, in_features)
    padded[:out_features] = weight
    return padded.view(blocks, BLOCK, in_features).transpose(1, 2).contiguous()


def _function():
    """The loaded and checked kernel, or None (built and checked once per process)."""
    if "fn" in _state:
        return _state["fn"]
    fn = None
    reason = _unsupported()
    if reason is None:
        try:
            fn = _load(_library())
            reason = _check(fn)
        except ImportError:
            reason = ("not built (the package was installed without a C compiler; a source tree: "
                      "python setup.py build_ext --inplace)")
        except (OSError, AttributeError) as e:
            reason = f"loading it failed: {e}"
        if reason is not None:
            fn = None
    if reason is not None and os.environ.get("CASCADE_FEW_ROWS", "1") != "0":
        log.info("few-row matrix kernel not used (%s); torch's own products instead", reason)
    _state["fn"] = fn
    _state["reason"] = reason
    return fn


def why_not() -> str | None:
    """Why the kernel is not used here (None when it is)."""
    _function()
    return _state["reason"]


def _unsupported() -> str | None:
    if os.environ.get("CASCADE_FEW_ROWS", "1") == "0":
        return "CASCADE_FEW_ROWS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"no AVX2 (torch's CPU capability: {torch.backends.cpu.get_cpu_capability()})"
    flags = _cpu_flags()
    if flags is not None and not {"avx2", "fma"} <= flags:
        return "the CPU lacks avx2 or fma"
    return None


def _cpu_flags() -> set[str] | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _library() -> Path:
    """The kernel's shared library, built with the package (setup.py); ImportError where it was not."""
    from workers.kernels import _few_rows  # a CPython extension too: found like any module

    return Path(_few_rows.__file__)


def _load(path: Path):
    fn = ctypes.CDLL(str(path)).few_rows  # a CDLL call releases the GIL
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    return fn


def _check(fn) -> str | None:
    """None if the kernel's products match F.linear on a probe (every tile, a partial last
    block, a bias), else what differed."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(45, 37, generator=g)
    bias = torch.randn(45, generator=g)
    blocked = blocked_layout(weight)
    for rows in (1, 2, 3, 4, 5, 7, 9):
        x = torch.randn(rows, 37, generator=g)
        for b in (None, bias):
            y = torch.empty(rows, 45)
            fn(x.data_ptr(), blocked.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), rows, 37, 45)
            if not torch.allclose(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5):
                return f"its product differed from F.linear's at {rows} rows"
    return None
