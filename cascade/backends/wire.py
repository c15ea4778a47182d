"""The Ray backend's wire format: sampling rows as plain tuples of ints and bytes, dense or only
their nonzero entries, whichever is smaller, and :class:`WireStats`, the payload a worker moved.
Lossless: what :func:`unpack_rows` returns equals what :func:`pack_rows` was given, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.base import DTYPES

# Plain tuples of bytes pickle several times faster than dataclasses of arrays (or pydantic
# objects), and pickling is a large share of a small call's round trip.
Packed = tuple  # ("dense", n, vocab, dtype, data) | ("sparse", n, vocab, dtype, rows, cols, values)


def pack_rows(t: torch.Tensor) -> Packed:  # t: [n, vocab]
    """A ``[n, vocab]`` tensor for the wire: its raw bytes, or only its nonzero entries (row,
    column, value) when that is smaller; a greedy row is one entry. Lossless (see unpack_rows)."""
    t = t.detach().cpu().contiguous()
    n, vocab = t.shape
    dtype = str(t.dtype).removeprefix("torch.")
    itemsize = t.element_size()
    if dtype == "bfloat16":  # numpy has no bfloat16: ship the raw 16-bit words
        return ("dense", n, vocab, dtype, t.view(torch.int16).numpy().tobytes())
    nnz = int(torch.count_nonzero(t))
    if nnz * (8 + itemsize) >= t.numel() * itemsize:
        return ("dense", n, vocab, dtype, to_bytes(t))
    rows, cols = t.nonzero(as_tuple=True)
    return ("sparse", n, vocab, dtype, to_bytes(rows.to(torch.int32)), to_bytes(cols.to(torch.int32)),
            to_bytes(t[rows, cols]))


def unpack_rows(packed: Packed) -> torch.Tensor:  # [n, vocab], equal to the packed tensor
    kind, n, vocab, dtype = packed[:4]
    dt = DTYPES[dtype]
    if kind == "dense":
        if not packed[4]:
            return torch.zeros(n, vocab, dtype=dt)
        return from_bytes(packed[4], dt).reshape(n, vocab)
    out = torch.zeros(n, vocab, dtype=dt)
    if packed[4]:
        rows, cols = from_bytes(packed[4], torch.int32).long(), from_bytes(packed[5], torch.int32).long()
        out[rows, cols] = from_bytes(packed[6], dt)
    return out


def packed_nbytes(packed: Packed) -> int:
    return sum(len(x) for x in packed[4:]) + 16


def dense_nbytes(packed: Packed) -> int:
    return packed[1] * packed[2] * DTYPES[packed[3]].itemsize


def to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    # bytes are immutable; torch wants writable memory it can own
    return torch.frombuffer(bytearray(data), dtype=dtype)


@dataclass
class WireStats:
    """Payload bytes a :class:`RayWorker` moved (array bytes and 8 per scalar; Ray's framing excluded)."""

    calls: int = 0
    sent: int = 0
    received: int = 0
    resyncs: int = 0  # calls repeated with the whole sequence (a restarted actor)
    rows_dense: int = 0  # what the rows received would have taken as dense tensors

    @property
    def total(self) -> int:
        return self.sent + self.received
