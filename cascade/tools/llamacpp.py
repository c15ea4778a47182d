"""llama.cpp as a baseline row of ``cascade bench`` and ``cascade demo``: plain decoding of the
GGUF the topology's authority was converted from, through llama-cpp-python (the optional extra
``pip install 'cascade[llama]'``), on the same prompt token ids, with the same sampling.

A CPU user's alternative to cascade is llama.cpp on the same file, so the reports show it beside
every other row, interleaved with them and timed the same way (prefill included, to the last
token or the tokenizer's end-of-sequence token, which counts like in the other rows). Where the
binding is not installed, or the authority has no GGUF, the row is left out with one line
saying why.

Like with like: the prompt is fed as the token ids the other rows decode (no BOS added, no
re-tokenization), and the sampler chain is built here rather than taken from llama-cpp-python's
``generate``, whose chain applies top-k, typical-p, top-p and min-p 0.05 *before* the
temperature, so its top-p would cut another distribution than cascade's. Here: greedy is the
argmax (``llama_sampler_init_greedy``); sampled is temperature, then top-k (only where the
bench's top-k is on), then top-p, then a seeded draw — cascade's warping
(:func:`cascade.sampling.sampling_probs`). With top-k off llama.cpp's top-p works over the whole
49k vocabulary each token, as cascade's does; what that costs llama.cpp against its default
top-k 40 is measured in docs/benchmarks.md ("llama.cpp beside every row").

The row is timed, never checked for exactness: llama.cpp is another program (its own kernels,
its own rounding of the 4-bit products), so its greedy text may part from plain decoding's at a
near-tie and its random draws are its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

NAME = "llama.cpp"  # the row's name in every report
# False: behave as on a machine without the binding (tests of the skip note; nothing is mocked)
ENABLED = True


@dataclass
class LlamaCppStats:
    """What one llama.cpp run recorded: its forward passes (``llama_decode`` calls: the prompt's
    prefill, then one per token after the first) and the prefill's share of the wall time."""

    authority_passes: int
    prefill_seconds: float
    wall_seconds: float

    def to_dict(self) -> dict:
        return {"authority_passes": self.authority_passes, "prefill_seconds": self.prefill_seconds,
                "wall_seconds": self.wall_seconds}


def binding():
    """The ``llama_cpp`` module, or None where it is absent (or switched off by :data:`ENABLED`)."""
    if not ENABLED:
        return None
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def gguf_of(topo) -> tuple[Path | None, str]:
    """The GGUF the topology's authority was converted from and ''; or None and why there is none
    (the authority is no transformers model, or came from no GGUF this machine still has)."""
    from workers.quant import QuantError, gguf_path

    level = topo.spec.level(topo.authority)
    if level.kind != "hf":
        return None, f"the authority {topo.authority!r} is a '{level.kind}' level, not a model from a GGUF"
    try:
        path = gguf_path(topo.model_path(level), level.gguf_file)
    except QuantError as exc:
        return None, f"the authority {topo.authority!r} has no GGUF to decode: {exc}"
    if not path.is_file():
        return None, f"the authority's GGUF is not on this machine: {path}"
    return path, ""


def baseline(topo, threads: int | None, context: int = 4096,
             logits_all: bool = False) -> tuple["LlamaCppBaseline | None", str]:
    """The llama.cpp baseline of ``topo``'s authority on ``threads`` threads (None: one), or None and a
    one-line note saying why it is skipped. ``logits_all``: every position's logits, as a verifier
    would read them (decoding reads the last)."""
    module = binding()
    if module is None:
        return None, f"{NAME}: skipped: llama-cpp-python is not installed (pip install 'cascade[llama]')"
    path, why = gguf_of(topo)
    if path is None:
        return None, f"{NAME}: skipped: {why}"
    try:
        return LlamaCppBaseline(module, path, threads or 1, context, logits_all), ""
    except (ValueError, RuntimeError) as exc:  # what llama-cpp-python raises on a file it cannot load
        return None, f"{NAME}: skipped: llama.cpp cannot load {path}: {exc}"


class LlamaCppBaseline:
    """One llama.cpp model over a GGUF, decoding one sequence at a time from token ids."""

    def __init__(self, module, gguf: Path, threads: int, context: int = 4096, logits_all: bool = False):
        self.lib = module.llama_cpp  # the C API, as llama.h spells it
        self.version = getattr(module, "__version__", "?")
        self.gguf, self.threads = Path(gguf), threads
        # logits of the last position only unless asked (llama.cpp's default); the context holds prompt + new tokens
        self.llm = module.Llama(model_path=str(gguf), n_ctx=context, n_batch=512, n_threads=threads,
                                n_threads_batch=threads, logits_all=logits_all, verbose=False)

    def describe(self, sampling) -> str:
        """One line for a report: the program, the file, the threads and the sampler chain."""
        return (f"{NAME}: llama-cpp-python {self.version} decoding {self.gguf.name} on {self.threads} thread(s), "
                f"the same prompt token ids; sampler: {chain_label(sampling)}; timed, not checked for exactness "
                f"(its own kernels and random draws)")

    def generate(self, ids: list[int], max_new_tokens: int, sampling, seed: int,
                 eos: int | None) -> tuple[list[int], float, LlamaCppStats]:
        """Decode ``max_new_tokens`` after the prompt ``ids`` (stopping after ``eos``, which is kept,
        as the other rows keep it): (new ids, seconds with the prefill, stats)."""
        if len(ids) + max_new_tokens > self.llm.n_ctx():
            raise ValueError(f"{NAME}: prompt ({len(ids)}) + {max_new_tokens} new tokens exceed its context "
                             f"({self.llm.n_ctx()})")
        lib, llm = self.lib, self.llm
        chain = self._chain(sampling, seed)
        try:
            t0 = time.perf_counter()
            llm.reset()  # position 0: no cached prefix, so every run pays its prefill
            llm.eval(ids)
            prefill = time.perf_counter() - t0
            new, passes = [], 1
            while True:
                token = lib.llama_sampler_sample(chain, llm.ctx, -1)  # samples and accepts
                new.append(token)
                if token == eos or len(new) == max_new_tokens:
                    break
                llm.eval([token])
                passes += 1
            seconds = time.perf_counter() - t0
        finally:
            lib.llama_sampler_free(chain)
        return new, seconds, LlamaCppStats(passes, prefill, seconds)

    def _chain(self, sampling, seed: int):
        """cascade's warping as a llama.cpp sampler chain (module docstring)."""
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if sampling.greedy:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(sampling.temperature))
        if sampling.top_k:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(sampling.top_k))
        if sampling.top_p < 1:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(sampling.top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def runner(self, eos: int | None):
        """:meth:`generate` as ``cascade bench`` calls a row: (prompt ids, max new tokens, sampling,
        seed) -> (new ids, seconds, stats)."""
        def run(ids: list[int], n: int, sampling, seed: int):
            return self.generate(ids, n, sampling, seed, eos)
        return run

    def close(self) -> None:
        self.llm.close()


def chain_label(sampling) -> str:
    """The sampler chain :meth:`LlamaCppBaseline._chain` builds, in words."""
    if sampling.greedy:
        return "greedy (argmax)"
    steps = [f"temperature {sampling.temperature:g}"]
    steps += [f"top-k {sampling.top_k}"] if sampling.top_k else []
    steps += [f"top-p {sampling.top_p:g}"] if sampling.top_p < 1 else []
    return " -> ".join(steps + ["draw"]) + (", as cascade warps" + ("" if sampling.top_k else
                                                                     " (top-k off on both sides)"))


