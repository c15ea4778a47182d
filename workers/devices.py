"""Device names to torch devices: one rule for every place that puts a model somewhere.

A worker that loads a model asked for CUDA on a machine without it falls back to the CPU with a
warning (a topology written on a GPU box still runs on a laptop, only slower). A training run
that names an unavailable device refuses instead (``fallback=False``): hours of training on the
wrong device are worse than an error. A name torch does not know is always an error.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def resolve_device(name: str, *, fallback: bool = True) -> torch.device:
    """``auto`` -> the first visible CUDA device, else the CPU; anything else as torch reads it. An
    unavailable CUDA device (no CUDA, or an index past the last) falls back to the CPU with a
    warning or, ``fallback`` false, raises ``ValueError``, as an unknown name always does."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from exc
    if device.type == "cuda" and not _cuda_has(device):
        if not fallback:
            raise ValueError(f"device {name!r} requested but it is not available "
                             f"({torch.cuda.device_count()} CUDA device(s) visible)")
        log.warning("device %s requested but it is not available; falling back to CPU", name)
        return torch.device("cpu")
    return device


def _cuda_has(device: torch.device) -> bool:
    if not torch.cuda.is_available():
        return False
    return device.index is None or device.index < torch.cuda.device_count()


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: CUDA that supports it, or a CPU with AVX-512
    BF16 or AMX-BF16. Elsewhere torch emulates bf16 matrix products, several times slower than
    float32 (docs/real-model.md, "What a pass costs, and why bf16 matters")."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device):
    """A topology's ``dtype`` for a model on ``device``: ``fastest`` is bfloat16 where the device
    computes it natively, else float32 (``native_bf16``); ``auto`` stays ``"auto"`` (the
    checkpoint's own); any other name is that dtype."""
    from workers.base import DTYPES

    if name == "fastest":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return "auto" if name == "auto" else DTYPES[name]
