"""Timing that says how far to trust it: torch's threads chosen on purpose, every speed figure a
median over repeats with its range, and a warning when the range shows the machine was busy.

One slow repeat (a stall, another process taking the core) moves a mean or a single run as
much as a real difference does; it moves the median of three repeats not at all, and it shows
as a wide range. So the tools (``cascade demo``, ``cascade bench``, ``cascade bench-serve``)
measure the sides they compare interleaved in time, repeat, and report ``median (min–max)``
over the repeats; a range wider than :data:`BUSY_SPREAD` of its median is named in a warning.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

# A figure whose range across repeats exceeds this share of its median was measured on a busy
# (or drifting) machine. On a quiet machine, interleaved repeats of the same work agree within a
# few per cent; a third of the median is a stall or a competing process, not noise.
BUSY_SPREAD = 0.3

DEFAULT_THREADS = 1

# The measuring tools seed their requests so that a run repeats; those seeds are not a user's
# "same tokens". They measure the speculative rule, which a request without a seed gets (a seed
# alone would select the keyed coupling, "gumbel": docs/seeds.md).
COUPLING = "residual"


@dataclass(frozen=True)
class Spread:
    """The median of one figure over repeats, and its range."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        xs = [float(v) for v in values]
        if not xs:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    @property
    def relative(self) -> float:
        """(high - low) / median: 0 when every repeat agrees (and for a single repeat)."""
        if self.median == 0:
            return 0.0 if self.high == self.low else float("inf")
        return (self.high - self.low) / abs(self.median)

    def busy(self, limit: float = BUSY_SPREAD) -> bool:
        return self.relative > limit

    def format(self, spec: str = ".2f", unit: str = "") -> str:
        """``1.17x (1.10–1.25)``; a single value has no range to show."""
        head = f"{self.median:{spec}}{unit}"
        if self.count < 2:
            return head
        return f"{head} ({self.low:{spec}}–{self.high:{spec}})"

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.low, "max": self.high, "repeats": self.count}


def busy_warning(spreads: Mapping[str, Spread], limit: float = BUSY_SPREAD) -> str | None:
    """One sentence naming every figure of ``spreads`` (name -> spread over repeats) whose range
    exceeds ``limit`` of its median, with the machine's load; None when none does (or when no
    figure has two repeats to compare)."""
    wide = {name: s for name, s in spreads.items() if s.count > 1 and s.busy(limit)}
    if not wide:
        return None
    parts = "; ".join(f"{name} ranged {s.low:.3g}–{s.high:.3g} around a median of {s.median:.3g} "
                      f"({s.relative:.0%})" for name, s in wide.items())
    return (f"warning: the machine looks busy{_load()}: across repeats, {parts}; more than {limit:.0%} is "
            f"not noise. The medians discount a slow repeat, but these figures are less certain than on a "
            f"quiet machine: close other work (or give --threads a core each) and run again.")


def _load() -> str:
    try:
        one_minute = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ""
    return f" (load average {one_minute:.1f} on {os.cpu_count()} CPUs)"


@contextmanager
def torch_threads(threads: int | None = DEFAULT_THREADS) -> Iterator[int]:
    """Within the block, torch's intra-op threads are ``threads`` (None: torch's own choice);
    yields how many it uses, and restores the former count after (a command run inside a test
    leaves the process as it found it).

    One by default: the models here are small, a second thread buys little, and a thread that
    waits for a core other work holds stalls every operation it shares (the same code measured
    0.38x with torch's default two threads on a busy 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def threads_line(threads: int) -> str:
    return f"torch threads: {threads} (--threads to change; one keeps timings steady on a shared machine)"


# CPU features that decide what a bfloat16 (or float32) pass costs, as /proc/cpuinfo names them
CPU_FEATURES = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def machine() -> dict[str, Any]:
    """What a figure is measured on, for its report: the date (UTC), the CPU's model name and the
    features that decide what a bf16 pass costs (AMX-BF16, AVX-512 BF16: the same model runs at
    very different bf16 speeds on processors with and without them), the CPUs, the GPU when torch
    sees one, and torch's and transformers' versions."""
    import torch
    import transformers

    name, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name is None:
                name = value.strip()
            elif key == "flags" and flags is None:
                flags = set(value.split())
    except OSError:  # not Linux
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "cpu": name or platform.processor() or platform.machine(),
            "cpu_features": None if flags is None else [label for flag, label in CPU_FEATURES if flag in flags],
            "cpus": os.cpu_count(), "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__}


def machine_line(m: Mapping[str, Any]) -> str:
    """:func:`machine` as the sentence a report opens with."""
    features = m.get("cpu_features")
    cpu = m["cpu"] + (f" ({', '.join(features) or 'none of ' + ', '.join(x for _, x in CPU_FEATURES)})"
                      if features is not None else "")
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    return (f"Measured {m['date']} on {cpu}, {m['cpus']} CPUs{gpu}; torch {m['torch']}, "
            f"transformers {m['transformers']}.")
