"""Worker construction: a topology's levels -> :class:`~workers.base.Worker` objects, and the
:class:`Backend` interface that says where they run.

A backend builds the workers of a topology and owns whatever they run on (nothing for the
local backend; actors and a placement group for Ray). ``Cascade.from_topology`` picks one by
name from :data:`BACKENDS` (or a ``"module:Class"`` path), so the core never imports a backend.
"""
from __future__ import annotations

import abc
from typing import Any

from cascade.errors import TopologyError
from cascade.topology import LevelSpec, Topology, has_tokenizer
from workers.base import Worker

BACKENDS: dict[str, str] = {
    "local": "cascade.backends.local:LocalBackend",
    "ray": "cascade.backends.ray:RayBackend",
}


class Backend(abc.ABC):
    """Where a topology's levels run. ``workers`` maps level name -> worker (local objects or
    proxies to remote ones: the engine cannot tell); :meth:`close` releases what ``start`` took."""

    workers: dict[str, Worker]

    @classmethod
    @abc.abstractmethod
    def start(cls, topo: Topology, address: str | None = None, device: str | None = None) -> "Backend":
        """Build every level's worker. ``address`` names a cluster (backends that have one);
        ``device`` overrides every level's device."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the workers and release what they ran on. Idempotent."""


def resolve_backend(name: str) -> type[Backend]:
    """A registered backend name or a ``"module:Class"`` path -> the Backend class."""
    from cascade.plugins import load_class

    target = BACKENDS.get(name, name)
    if ":" not in target:
        raise LookupError(f"unknown backend {name!r}; known: {sorted(BACKENDS)} or 'module:Class'")
    return load_class(target, Backend)


def build_workers(topo: Topology, device: str | None = None) -> dict[str, Worker]:
    """Instantiate every level's worker in this process."""
    workers: dict[str, Worker] = {}
    levels = list(enumerate(topo.spec.levels))
    # n-gram levels take the authority's vocabulary size, heads their source's modules: build them last.
    for i, level in sorted(levels, key=lambda il: il[1].kind in ("ngram", "head")):
        if level.kind == "head":
            workers[level.name] = build_head(level, level_model_path(topo, level), i, topo.source,
                                             workers[level.features_of])
            continue
        vocab = workers[topo.authority].vocab_size if level.kind == "ngram" else None
        workers[level.name] = build_worker(level, level_model_path(topo, level), i, topo.source, device, vocab)
    check_vocab_sizes(topo, {name: w.vocab_size for name, w in workers.items()})
    return workers


def level_model_path(topo: Topology, level: LevelSpec) -> str | None:
    return topo.model_path(level) if level.kind in ("hf", "head") else None


def build_head(level: LevelSpec, model_path: str, index: int, source: str, reads: Worker) -> Worker:
    """A feature head (``kind: head``, :mod:`workers.head`) over ``reads``, the worker of its
    ``features_of`` level in the same process (the driver, or under Ray that level's actor):
    the head shares that worker's embedding and LM head, runs on its device in its dtype, and
    the worker keeps its hidden states from now on."""
    from workers.head import HeadWorker
    from workers.hf import HFWorker

    where = f"{source}: levels[{index}]"
    if not isinstance(reads, HFWorker):
        raise TopologyError(f"{where}.features_of: {level.features_of!r} does not run in this process as a "
                            "transformers worker; a feature head needs its model's modules")
    try:
        return HeadWorker.load(model_path, reads, level.features_of)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise TopologyError(f"{where}.model: cannot load the head: {exc}") from None


def build_worker(
    level: LevelSpec,
    model_path: str | None,
    index: int,
    source: str,
    device: str | None = None,
    vocab_size: int | None = None,
) -> Worker:
    """One level's worker, from its spec alone (so that a Ray actor can build it remotely).

    ``model_path`` is the resolved model reference (hf levels); ``vocab_size`` the authority's
    (n-gram levels); ``index`` and ``source`` only name the level in errors.
    """
    if level.kind == "hf":
        from safetensors import SafetensorError

        from cascade.checkpoint import check_checkpoint
        from workers.hf import HFWorker
        from workers.quant import QuantError

        where = f"{source}: levels[{index}].model"
        if level.gguf_file is None:  # a corrupt or truncated file: named, before torch reads it
            check_checkpoint(model_path, where)
        try:
            return HFWorker(model_path, level.dtype, device or level.device, level.trust_remote_code,
                            gguf_file=level.gguf_file, packed_weights=level.packed_weights,
                            batch_invariant=level.batch_invariant,
                            quantize=level.quantize)
        except (OSError, SafetensorError) as exc:
            raise TopologyError(f"{where}: cannot load: {exc}") from None
        except QuantError as exc:
            raise TopologyError(f"{source}: levels[{index}].quantize: {exc}") from None
        except ValueError as exc:
            if not str(exc).startswith("batch_invariant:"):
                raise
            raise TopologyError(f"{source}: levels[{index}].{exc}") from None
    if level.kind == "ngram":
        from workers.ngram import NGramWorker

        return NGramWorker(vocab_size, **level.params)
    if level.kind == "head":
        raise TopologyError(f"{source}: levels[{index}] ({level.name}): a feature head is built beside the "
                            "worker of its features_of level (build_head: in process by build_workers, "
                            "in that level's actor under Ray)")
    return _custom_worker(source, index, level.kind, level.params)


def check_vocab_sizes(topo: Topology, sizes: dict[str, int]) -> None:
    vocab = sizes[topo.authority]
    for i, level in enumerate(topo.spec.levels):
        if sizes[level.name] != vocab:
            raise TopologyError(
                f"{topo.source}: levels[{i}]: vocabulary of {sizes[level.name]} rows "
                f"differs from the authority's {vocab}"
            )


def _custom_worker(source: str, i: int, kind: str, params: dict[str, Any]) -> Worker:
    from cascade.plugins import load_class

    try:
        cls = load_class(kind, Worker)
    except LookupError as exc:
        raise TopologyError(f"{source}: levels[{i}].kind: {exc}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise TopologyError(f"{source}: levels[{i}].params: {exc}") from None


def load_tokenizer(topo: Topology):
    from transformers import AutoTokenizer

    spec = topo.spec
    if spec.tokenizer is not None:
        path = str((topo.base_dir / spec.tokenizer).resolve())
    else:
        auth = spec.level(topo.authority)
        if auth.kind != "hf":
            return None
        path = topo.model_path(auth)
        if auth.gguf_file is not None:
            return _gguf_tokenizer(topo, path, auth.gguf_file)
        if not has_tokenizer(path):
            return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - report any loader failure as a topology problem
        raise TopologyError(f"{topo.source}: tokenizer: cannot load from {path}: {exc}") from None


def _gguf_tokenizer(topo: Topology, path: str, gguf_file: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    except Exception as exc:  # noqa: BLE001 - report any loader failure as a topology problem
        raise TopologyError(f"{topo.source}: tokenizer: cannot load from {path}/{gguf_file}: {exc}") from None
