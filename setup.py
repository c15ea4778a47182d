"""The one compiled piece of the package: the few-row kernel (``workers/kernels/few_rows.c``), an
optional extension. Everything else about the package is in pyproject.toml.

A machine where it cannot be built — no C compiler, not an x86-64 CPU, Windows — installs
without it (setuptools skips an optional extension whose build fails, with a warning), and
:mod:`workers.kernels.few_rows` then leaves every product to torch, logging why once.
"""
import platform
import sys

from setuptools import Extension, setup

FEW_ROWS = Extension(
    "workers.kernels._few_rows",
    sources=["workers/kernels/few_rows.c"],
    # AVX2 and FMA code: the loader checks the CPU has them before calling it
    extra_compile_args=["-O3", "-mavx2", "-mfma", "-std=c99"],
    optional=True,
)
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")

setup(ext_modules=[FEW_ROWS] if X86 and sys.platform != "win32" else [])
