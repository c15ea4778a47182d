"""The product a level uses for a weight: ``x -> x @ weight.T + bias``, by the fastest path that
holds here, each checked on a probe against ``F.linear`` and left for ``F.linear`` where it fails.

* **bfloat16** (where oneDNN computes it natively: AVX-512 BF16, AMX): oneDNN from a copy of the
  weight in its blocked layout made once (:func:`prepacked`), at every row count — F.linear
  reorders a bf16 weight on every call. oneDNN's kernel either way, each output accumulated in
  float32: the same product.
* **float32 at one intra-op thread** with the few-row kernel (:mod:`workers.kernels.few_rows`):
  its blocked copies for passes of a few rows, F.linear for more.
* **float32 otherwise**: a weight of at least :data:`PACK_MIN_ELEMENTS` gets a prepacked oneDNN
  copy for passes of several rows, where MKL's float32 kernel for a few rows is poor, and is
  itself stored column-major (:func:`column_major`) for passes of one row, which MKL's
  matrix-vector product then streams faster. Float32's product, rounded in another order
  (~1e-5 of a logit: cascade/DESIGN.md §2).

oneDNN is reached through private ops (``torch.ops.mkldnn._reorder_linear_weight``,
``_linear_pointwise``); :func:`onednn_agrees` checks them once per dtype and :func:`packable` on a
weight's own rows. What each path costs: docs/engine.md ("Batches underneath"), docs/results-log.md.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from workers.kernels import few_rows

Product = Callable[[torch.Tensor], torch.Tensor]

# Weights of at least this many elements are worth a oneDNN call for a float32 pass of several
# rows; on a smaller one oneDNN's fixed cost per call eats what it saves (docs/results-log.md).
PACK_MIN_ELEMENTS = 1 << 19

_agrees: dict = {}  # dtype -> whether oneDNN's prepacked product runs and matches F.linear here


def linear_product(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> Product:
    """``x @ weight.T + bias`` as a function. Without ``pack``: F.linear. With ``pack``: a bfloat16
    weight is multiplied from a prepacked copy at every row count and size (:func:`prepacked`);
    a float32 one through the few-row kernel where :func:`few_rows_now`, else (at least
    :data:`PACK_MIN_ELEMENTS` elements) from a prepacked copy for several rows and stored
    column-major, from then on, for one row (memory: the weight once more either way)."""
    if pack and weight.dtype == torch.bfloat16:
        return prepacked(weight, bias)
    if pack and few_rows_now():
        return few_rows.product(weight, bias) or (lambda x: F.linear(x, weight, bias))
    if not pack or weight.numel() < PACK_MIN_ELEMENTS:
        return lambda x: F.linear(x, weight, bias)
    column_major(weight)
    packed = prepacked(weight, bias)

    def product(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            return F.linear(x, weight, bias)
        return packed(x)

    return product


def side_by_side(modules) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of linear ``modules`` that read the same input, as one layer whose
    outputs are theirs side by side (a module's own tensors where there is one; zeros for a
    missing bias beside present ones, which adds nothing)."""
    if len(modules) == 1:
        return modules[0].weight, modules[0].bias
    weight = torch.cat([m.weight.detach() for m in modules])
    if all(m.bias is None for m in modules):
        return weight, None
    return weight, torch.cat([m.weight.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias.detach()
                              for m in modules])


def prepacked(weight: torch.Tensor, bias: torch.Tensor | None) -> Product:
    """``x @ weight.T + bias`` through oneDNN from a copy of ``weight`` in its blocked layout, made
    once (F.linear reorders the weight on every call); F.linear where oneDNN's ops are missing
    or disagree with it on a probe here (:func:`onednn_agrees`)."""
    if not onednn_agrees(weight.dtype):
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def product(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the lean forward's rows, as the op takes them (a reshape is an op call too)
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        flat = x.reshape(-1, x.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "").view(*x.shape[:-1], -1)

    return product


def onednn_agrees(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked product of ``dtype`` (float32; bfloat16 where oneDNN computes
    it natively) runs on this CPU and matches F.linear on a probe (checked once per dtype)."""
    if dtype not in _agrees:
        g = torch.Generator().manual_seed(0)
        _agrees[dtype] = _matches(torch.randn(64, 96, generator=g).to(dtype), g)
    return _agrees[dtype]


def packable(weight: torch.Tensor) -> bool:
    """Whether a level's products from ``weight`` (float32, or bfloat16 where oneDNN computes it
    natively: AVX-512 BF16, AMX; on a CPU) can be packed here: float32 where the few-row kernel
    takes them (:func:`few_rows_now`), else where oneDNN's prepacked product matches F.linear on
    the weight's first rows."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32 and few_rows_now():
        return True
    return onednn_agrees(weight.dtype) and _matches(weight[:256].detach(), torch.Generator().manual_seed(0))


def _matches(probe: torch.Tensor, generator: torch.Generator) -> bool:
    """Whether oneDNN's product from a prepacked copy of ``probe`` runs here and matches F.linear."""
    if probe.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if probe.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        rows = torch.randn(3, probe.shape[1], generator=generator).to(probe.dtype)
        ours = torch.ops.mkldnn._linear_pointwise(rows, torch.ops.mkldnn._reorder_linear_weight(probe),
                                                  None, "none", [], "")
        tol = 1e-4 if probe.dtype == torch.float32 else 2e-2
        return bool(torch.allclose(ours.float(), F.linear(rows, probe).float(), rtol=tol, atol=tol))
    except (AttributeError, RuntimeError):  # an older torch, or a build without these ops
        return False


def column_major(weight: torch.Tensor) -> None:
    """Store a 2-D weight ``[out, in]`` column-major, in place: the same values and shape, the
    storage of its transpose. F.linear of one row then runs MKL's non-transposed matrix-vector
    product, which streams the weight faster than the transposed one does over the row-major
    layout (for large weights such as an LM head or an MLP's; the attention's smaller projections
    gain nothing: docs/engine.md). Every module sharing the parameter (a tied embedding) sees the
    new layout; an embedding's lookups are as exact from it."""
    if weight.dim() == 2 and weight.stride() != (1, weight.shape[0]):
        weight.data = weight.data.t().contiguous().t()


def own_product(weight: torch.Tensor, bias: torch.Tensor | None) -> Product | None:
    """A faster product than F.linear for a small level's own layer (a feature head's), or None:
    from a prepacked copy in bfloat16 (:func:`prepacked`), through the few-row kernel in float32
    at one thread (:mod:`workers.kernels.few_rows`)."""
    if weight.dtype == torch.bfloat16:
        return prepacked(weight, bias) if packable(weight) else None
    return few_rows.product(weight, bias) if few_rows_now() else None


def few_rows_now() -> bool:
    """Whether products built now go through the few-row kernel: where it is available and torch
    runs one intra-op thread. The kernel is single-threaded; with more threads, oneDNN's and
    MKL's parallel products over prepacked and column-major weights are faster (docs/engine.md),
    so the layout is chosen for the thread count when the model loads."""
    return few_rows.enabled() and torch.get_num_threads() == 1
