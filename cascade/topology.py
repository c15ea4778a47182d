"""Topology files: YAML -> pydantic models -> a validated networkx graph.

A topology lists levels (models) and the edges "proposer -> verifier" between them. The graph
must be a DAG with exactly one sink, the *authority*, which every level reaches; all levels
share the authority's vocabulary. Every problem is reported as one :class:`TopologyError` whose
message names the file, the field and what is wrong.
"""
from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import networkx as nx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cascade.errors import TopologyError, describe
from cascade.pull import PULLED, PullError, resolve_pulled
from cascade.sampling import Sampling, SamplingOverride
from cascade.validation import DEVICE_PATTERN

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class Resources(BaseModel):
    """What a level's Ray actor asks the cluster for (ignored in-process)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the level's actor.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs for the actor; fractions share a GPU.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources.")


class LevelSpec(BaseModel):
    """One level of the hierarchy."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", description="Unique level name.")
    kind: str = Field(
        "hf",
        description="'hf' (transformers causal LM), 'ngram' (prompt lookup), 'head' (a feature head "
        "reading an hf level's hidden states) or 'module:Class' for a custom Worker built as Class(**params).",
    )
    model: str | None = Field(
        None, description="Hub id, path (relative to the YAML file), or 'pulled:NAME' for a model "
        "`cascade pull NAME` put in the user cache; hf and head (a folder) only.")
    features_of: str | None = Field(
        None, description="The hf level whose last hidden states a head reads (and whose embedding and "
        "LM head it uses); head only.")
    gguf_file: str | None = Field(
        None, description="A GGUF file inside 'model' (a folder) to load and dequantize, as "
        "transformers' from_pretrained(gguf_file=) does; hf only.")
    dtype: Literal["float32", "float16", "bfloat16", "float64", "auto", "fastest"] = Field(
        "float32", description="Weights and activations dtype; auto: the checkpoint's; fastest: bfloat16 "
                               "where the device computes it natively (CUDA, AVX-512 BF16, AMX), else float32."
    )
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto, cpu or cuda:N.")
    trust_remote_code: bool = Field(False, description="Allow the model repo's own code (hf only).")
    packed_weights: bool = Field(
        True, description="On a CPU, multiply the weights from a copy laid out for the pass: in "
        "float32 the few-row kernel's blocks (workers/kernels/few_rows.py) for passes of up to 32 rows at "
        "one thread, else oneDNN's prepacked layout with the weights stored column-major for "
        "one-row passes; in bfloat16 (where oneDNN computes it natively) oneDNN's prepacked layout "
        "for every pass — faster, for that much memory once more; false saves the memory and "
        "keeps transformers' products (hf only).")
    quantize: Literal["gguf", "int4"] | None = Field(
        None, description="Multiply from 4-bit weights in groups of 32 (docs/quantized.md): gguf, the "
        "groups of the GGUF the model came from (gguf_file, or the one `cascade pull` kept); int4, "
        "groups made from the float weights (an approximation of the model). Needs a bfloat16 "
        "level on a CPU, else it multiplies from the float weights; hf only.")
    batch_invariant: Literal["auto"] | bool = Field(
        False, description="A position's logits do not depend on how many positions and rows a pass "
        "scores, bit for bit, so greedy output equals one-token-at-a-time decoding and a seed gives the "
        "same tokens whatever the policy and the load (docs/exactness.md, 'Batch invariance'); it costs "
        "a share of each pass. true needs a bfloat16 level on a CPU where oneDNN computes it natively "
        "(AVX-512 BF16, AMX) and a model the lean forward runs; auto: on where that holds; hf only.")
    resources: Resources = Field(default_factory=Resources, description="Ray resources for this level.")
    sampling: SamplingOverride | None = Field(None, description="Draft-only sampling overrides.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Kind-specific: ngram {max_ngram, min_ngram}; custom kwargs."
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in ("hf", "ngram", "head") and not re.match(r"^[\w.]+:[\w.]+$", v):
            raise ValueError("must be 'hf', 'ngram', 'head' or a 'module:Class' path")
        return v

    @model_validator(mode="after")
    def _model_matches_kind(self) -> "LevelSpec":
        if self.kind == "hf" and not self.model:
            raise ValueError("an 'hf' level needs a 'model' (hub id or path)")
        if self.kind == "ngram" and self.model:
            raise ValueError("an 'ngram' level takes no 'model'")
        if self.gguf_file is not None and self.kind != "hf":
            raise ValueError("'gguf_file' is for 'hf' levels")
        if "batch_invariant" in self.model_fields_set and self.kind != "hf":
            raise ValueError("'batch_invariant' is for 'hf' levels")
        if "packed_weights" in self.model_fields_set and self.kind != "hf":
            raise ValueError("'packed_weights' is for 'hf' levels")
        if self.quantize is not None and self.kind != "hf":
            raise ValueError("'quantize' is for 'hf' levels")
        if self.kind == "head":
            if not self.model:
                raise ValueError("a 'head' level needs a 'model' (the folder of the head)")
            if not self.features_of:
                raise ValueError("a 'head' level needs 'features_of' (the hf level whose features it reads)")
            fixed = sorted(self.model_fields_set & {"dtype", "device", "trust_remote_code", "params"})
            if fixed:
                raise ValueError(f"a 'head' level runs on its features_of level's device and dtype; "
                                 f"it takes no {', '.join(repr(f) for f in fixed)}")
        elif self.features_of is not None:
            raise ValueError("'features_of' is for 'head' levels")
        return self


class RaySpec(BaseModel):
    """How the Ray backend (``backend: ray``) places and supervises the level actors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    address: str | None = Field(
        None,
        pattern=r"^(auto|local|(ray://)?[\w.-]+:\d+)$",
        description="'auto' (an existing cluster: RAY_ADDRESS or the one `ray start` runs here), "
        "'local' (start a private one, shut down on close), or 'host:port' / 'ray://host:port'. "
        "Default: auto when RAY_ADDRESS is set (e.g. inside a Ray job), else local.",
    )
    namespace: str | None = Field(None, description="Ray namespace when cascade connects (default: Ray's).")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Placement group strategy over the levels' bundles."
    )
    max_restarts: int = Field(3, ge=0, description="Times a dead level actor is restarted (its calls retried).")
    call_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for one remote call, including a restart's model reload."
    )
    placement_timeout_s: float = Field(120.0, gt=0, description="Longest wait for the placement group.")
    start_timeout_s: float = Field(300.0, gt=0, description="Longest wait for the actors to load their models.")
    ngram_in_driver: bool = Field(
        True, description="Run model-free n-gram levels in the driver process: as actors they would "
        "only add a round trip per block."
    )
    in_driver: list[str] = Field(
        default_factory=list, description="Levels to run in the driver process instead of an actor, "
        "e.g. a drafter whose forward pass is shorter than a round trip."
    )


class ServeSpec(BaseModel):
    """How ``cascade serve --backend ray`` deploys the server on Ray Serve."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    replicas: int = Field(1, ge=1, description="Ray Serve replicas; each owns one cascade (its level "
                          "actors in a placement group of its own) and one engine loop.")
    max_ongoing_requests: int = Field(16, ge=1, description="Requests Ray Serve sends one replica at "
                                      "once; more wait in Serve's own queue.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for each replica's process (its "
                            "engine loop and any level kept in the driver).")


class PolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("fixed", description="Registered policy name or 'module:Class'.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the policy.")


class TopologySpec(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="A label for reports.")
    levels: list[LevelSpec] = Field(min_length=1, description="Levels, cheapest first by convention.")
    edges: list[tuple[str, str]] | None = Field(
        None, description="[proposer, verifier] pairs; default: the chain in listed order."
    )
    policy: PolicySpec = Field(default_factory=PolicySpec, description="Default policy.")
    sampling: Sampling = Field(default_factory=Sampling, description="Default request sampling.")
    tokenizer: str | None = Field(None, description="Tokenizer path; default: the authority's model.")
    backend: Literal["local", "ray"] = Field("local", description="Where levels run.")
    ray: RaySpec = Field(default_factory=RaySpec, description="Ray backend settings (backend: ray).")
    serve: ServeSpec = Field(default_factory=ServeSpec, description="Ray Serve settings (cascade serve --backend ray).")
    prefill_chunk: Annotated[int, Field(ge=1, strict=True)] | None = Field(
        256, description="A prompt longer than this is prefilled this many positions per batch step, "
        "between the other requests' steps (docs/serving.md, 'Long prompts'); null: in one piece.")

    @model_validator(mode="after")
    def _names(self) -> "TopologySpec":
        seen: set[str] = set()
        for i, level in enumerate(self.levels):
            if level.name in seen:
                raise ValueError(f"levels[{i}].name: duplicate level name {level.name!r}")
            seen.add(level.name)
        for i, (a, b) in enumerate(self.edges or []):
            for end in (a, b):
                if end not in seen:
                    raise ValueError(f"edges[{i}]: unknown level {end!r}")
            if a == b:
                raise ValueError(f"edges[{i}]: a level cannot propose to itself ({a!r})")
        for i, name in enumerate(self.ray.in_driver):
            if name not in seen:
                raise ValueError(f"ray.in_driver[{i}]: unknown level {name!r}")
        return self

    def level(self, name: str) -> LevelSpec:
        return next(lv for lv in self.levels if lv.name == name)

    def level_index(self, name: str) -> int:
        return next(i for i, lv in enumerate(self.levels) if lv.name == name)


@dataclass
class Topology:
    """A validated topology: the spec, its graph, the authority and where the file was."""

    spec: TopologySpec
    graph: nx.DiGraph
    authority: str
    source: str  # file path or "<spec>"
    base_dir: Path

    def model_path(self, level: LevelSpec) -> str:
        """The model reference as from_pretrained should see it (paths made absolute, a
        ``pulled:NAME`` resolved to its cache folder)."""
        assert level.model is not None
        if level.model.startswith(PULLED):
            try:
                return str(resolve_pulled(level.model))
            except PullError as exc:
                raise TopologyError(f"{self.source}: levels[{self.spec.level_index(level.name)}].model: {exc}") from None
        candidate = (self.base_dir / level.model).expanduser()
        return str(candidate.resolve()) if candidate.exists() else level.model

    def paths(self) -> list[list[str]]:
        """Every path from a source level to the authority."""
        sources = [n for n in self.graph if self.graph.in_degree(n) == 0 and n != self.authority]
        out: list[list[str]] = []
        for s in sources:
            out.extend(nx.all_simple_paths(self.graph, s, self.authority))
        return out or [[self.authority]]


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without aliases: a few bytes of nested aliases expand to gigabytes."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"YAML aliases (*name) are not allowed (line {mark.line + 1}, "
                                 f"column {mark.column + 1}); write the value out")
        return super().compose_node(parent, index)


def load_topology(path: str | Path, check_models: bool = True) -> Topology:
    """Read, validate and graph a topology file. Raises :class:`TopologyError`."""
    if not isinstance(path, (str, os.PathLike)):
        raise TopologyError(f"topology: expected the path of a YAML file (a str or pathlib.Path), got {path!r}")
    path = Path(path)
    if not path.is_file():
        raise TopologyError(f"{path}: topology file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TopologyError(f"{path}: not UTF-8 text: {exc}") from None
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return topology_from_dict(data, source=str(path), base_dir=path.parent, check_models=check_models)


def topology_from_dict(
    data: dict[str, Any], source: str = "<spec>", base_dir: Path | str = ".", check_models: bool = True
) -> Topology:
    try:
        spec = TopologySpec.model_validate(data)
    except ValidationError as exc:
        raise TopologyError(f"{source}: {_describe(exc)}") from None
    graph, authority = build_graph(spec, source)
    check_params(spec, graph, authority, source)
    topo = Topology(spec, graph, authority, source, Path(base_dir))
    if check_models:
        check_model_files(topo)
    return topo


def check_params(spec: TopologySpec, graph: nx.DiGraph, authority: str, source: str = "<spec>") -> None:
    """The policy (its name, its parameters, and how they fit the graph), the n-gram levels'
    parameters and the custom levels' classes and parameters, checked as loading will use them,
    before any model loads."""
    from policies import PolicyError, from_spec
    from workers.ngram import NGramParams

    for i, level in enumerate(spec.levels):
        if level.kind not in ("hf", "ngram", "head"):
            check_custom_worker(level.kind, level.params, f"{source}: levels[{i}]")
        if level.kind == "ngram":
            try:
                NGramParams.model_validate(level.params)
            except ValidationError as exc:
                raise TopologyError(f"{source}: {_describe(exc, root=f'levels[{i}].params')}") from None
    try:
        from_spec(spec.policy.model_dump()).bind(graph, authority)
    except PolicyError as exc:
        raise TopologyError(f"{source}: policy.{exc}") from None


def check_custom_worker(kind: str, params: dict[str, Any], where: str) -> type:
    """The Worker class a ``"module:Class"`` level names, imported and checked as building it
    will use it: a concrete Worker subclass whose constructor takes ``params``. ``where`` (file
    and level) starts the :class:`TopologyError`'s message."""
    from cascade.plugins import load_class
    from workers.base import Worker

    try:
        cls = load_class(kind, Worker)
    except LookupError as exc:
        raise TopologyError(f"{where}.kind: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the module's own import-time code failed (the author's file)
        raise TopologyError(f"{where}.kind: cannot import {kind!r}: {type(exc).__name__}: {exc}") from None
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TopologyError(f"{where}.kind: {kind!r} is abstract (it does not implement {missing}); "
                            "name a concrete Worker subclass")
    signature = inspect.signature(cls)
    try:
        signature.bind(**params)
    except TypeError as exc:
        raise TopologyError(f"{where}.params: {exc} ({kind} takes {signature})") from None
    return cls


def build_graph(spec: TopologySpec, source: str = "<spec>") -> tuple[nx.DiGraph, str]:
    """The levels as a DAG; checks acyclicity, one sink, reachability and level roles."""
    graph = nx.DiGraph()
    for level in spec.levels:
        graph.add_node(level.name, kind=level.kind)
    if spec.edges is None:
        names = [lv.name for lv in spec.levels]
        graph.add_edges_from(zip(names, names[1:]))
    else:
        graph.add_edges_from(spec.edges)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        loop = " -> ".join([a for a, _ in cycle] + [cycle[0][0]])
        raise TopologyError(f"{source}: edges: the graph has a cycle: {loop}")
    sinks = [n for n in graph if graph.out_degree(n) == 0]
    if len(sinks) != 1:
        last = spec.levels[-1].name
        if last in sinks:
            # By convention the authority is listed last: name the levels that do not reach it.
            strays = [n for n in graph if not nx.has_path(graph, n, last)]
            where = ", ".join(f"levels[{spec.level_index(n)}] ({n})" for n in strays)
            raise TopologyError(
                f"{source}: {where}: does not reach the authority {last!r} "
                f"(edges: need exactly one sink, found {len(sinks)}: {sinks})"
            )
        raise TopologyError(
            f"{source}: edges: need exactly one sink (the authority), found {len(sinks)}: {sinks}"
        )
    authority = sinks[0]
    # One sink in a DAG means every node reaches it; keep the check explicit for clarity.
    for n in graph:
        if not nx.has_path(graph, n, authority):
            i = spec.level_index(n)
            raise TopologyError(f"{source}: levels[{i}] ({n}): does not reach the authority {authority!r}")
    for n in graph:
        level = spec.level(n)
        if level.kind in ("ngram", "head") and (graph.in_degree(n) > 0 or n == authority):
            i = spec.level_index(n)
            article = "an" if level.kind == "ngram" else "a"
            raise TopologyError(f"{source}: levels[{i}] ({n}): {article} {level.kind} level can only propose, not verify")
    check_heads(spec, source)
    auth = spec.level(authority)
    if auth.sampling is not None:
        i = spec.level_index(authority)
        raise TopologyError(
            f"{source}: levels[{i}].sampling: the authority samples with the request's parameters; "
            "overrides are for drafts only"
        )
    return graph, authority


def check_heads(spec: TopologySpec, source: str = "<spec>", backend: str | None = None) -> None:
    """Each feature head (``kind: head``) reads an hf level of the topology, and runs where its
    features can be handed to it without crossing a wire: beside its source, in process, or
    under ``backend: ray`` (``backend``: the one the topology will run on) in its source's
    actor, or in the driver with it (``ray.in_driver``), reserving nothing of its own."""
    backend = backend or spec.backend
    names = {lv.name: lv for lv in spec.levels}
    for i, level in enumerate(spec.levels):
        if level.kind != "head":
            continue
        target = names.get(level.features_of)
        if target is None:
            raise TopologyError(f"{source}: levels[{i}].features_of: unknown level {level.features_of!r}")
        if target.kind != "hf":
            raise TopologyError(f"{source}: levels[{i}].features_of: {level.features_of!r} is a {target.kind!r} "
                                "level; a head reads the hidden states of an 'hf' level")
        if backend != "ray":
            continue
        in_driver = spec.ray.in_driver
        if level.name in in_driver and level.features_of not in in_driver:
            raise TopologyError(
                f"{source}: ray.in_driver[{in_driver.index(level.name)}]: the feature head {level.name!r} runs "
                f"where its features_of level {level.features_of!r} runs, which is an actor: its features "
                f"never cross the wire (name {level.features_of!r} in ray.in_driver too, or neither)")
        if "resources" in level.model_fields_set:
            raise TopologyError(
                f"{source}: levels[{i}].resources: the feature head {level.name!r} runs in the actor of its "
                f"features_of level {level.features_of!r} and reserves nothing of its own; give that level "
                "the resources")


def check_model_files(topo: Topology) -> None:
    """Model paths exist, with a config.json and safetensors headers that agree with it
    (:mod:`cascade.checkpoint`: no weights are read); the tokenizer loads; every hf level shares
    the authority's vocabulary."""
    from cascade.checkpoint import check_checkpoint

    src = topo.source
    for i, level in enumerate(topo.spec.levels):
        if level.kind == "head":
            _check_head_files(topo, i, level)
        if level.kind != "hf":
            continue
        ref = level.model or ""
        local = Path(topo.model_path(level)) if ref.startswith(PULLED) else (topo.base_dir / ref).expanduser()
        if level.gguf_file is not None:
            if not (local / level.gguf_file).is_file():
                raise TopologyError(f"{src}: levels[{i}].gguf_file: no such file: {local / level.gguf_file}")
        elif local.exists():
            if not (local / "config.json").is_file():
                raise TopologyError(f"{src}: levels[{i}].model: {local} has no config.json")
            check_checkpoint(local, f"{src}: levels[{i}].model")
        elif ref.startswith((".", "/", "~")) or not _HUB_ID.match(ref):
            raise TopologyError(f"{src}: levels[{i}].model: path does not exist: {local}")
    _check_tokenizer(topo)
    _check_vocabularies(topo)


def _check_head_files(topo: Topology, i: int, level: LevelSpec) -> None:
    """A head's model is a folder with its config and weights (workers/head.py)."""
    import json

    from workers.head import CONFIG, WEIGHTS, HeadConfig

    where = f"{topo.source}: levels[{i}].model"
    path = Path(topo.model_path(level))
    if not path.is_dir():
        raise TopologyError(f"{where}: a head is a folder; no such folder: {path}")
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise TopologyError(f"{where}: {path} has no {name} (not a feature head)")
    try:
        config = HeadConfig.load(path)
    except (ValueError, TypeError) as exc:
        raise TopologyError(f"{where}: {CONFIG}: {exc}") from None
    source = Path(topo.model_path(topo.spec.level(level.features_of))) / "config.json"
    if source.is_file():  # the width and vocabulary it reads must be its source's
        try:
            reads = json.loads(source.read_text())
        except ValueError:
            return  # the source's own check names its config
        for key in ("hidden_size", "vocab_size"):
            if key in reads and reads[key] != getattr(config, key):
                raise TopologyError(f"{where}: {CONFIG}: {key} {getattr(config, key)} differs from its features_of "
                                    f"level's ({level.features_of}) {reads[key]}")


def _check_tokenizer(topo: Topology) -> None:
    """The ``tokenizer:`` path exists and loads (the authority's own is loaded with its vocabulary)."""
    if topo.spec.tokenizer is None:
        return
    path = (topo.base_dir / topo.spec.tokenizer).expanduser()
    if not path.exists():
        raise TopologyError(f"{topo.source}: tokenizer: path does not exist: {path}")
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(path.resolve()))
    except Exception as exc:  # noqa: BLE001 - any loader failure is a topology problem
        raise TopologyError(f"{topo.source}: tokenizer: cannot load from {path}: {exc}") from None


def _check_vocabularies(topo: Topology) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from workers.draft_vocab import DraftVocab

    src = topo.source
    hf = [(i, lv) for i, lv in enumerate(topo.spec.levels) if lv.kind == "hf"]
    if not hf:
        return
    auth_i = topo.spec.level_index(topo.authority)
    ref_i, ref = next(((i, lv) for i, lv in hf if i == auth_i), hf[-1])
    vocab_of: dict[int, tuple[dict[str, int] | None, int | None]] = {}
    speaks_authority_ids: dict[int, bool] = {}
    for i, lv in hf:
        path = topo.model_path(lv)
        vocab = None
        kwargs = {"trust_remote_code": lv.trust_remote_code}
        if lv.gguf_file is not None:
            kwargs["gguf_file"] = lv.gguf_file
        if lv.gguf_file is not None or has_tokenizer(path):
            try:
                tok = AutoTokenizer.from_pretrained(path, **kwargs)
                vocab = tok.get_vocab()
            except Exception as exc:  # noqa: BLE001 - any loader failure is a topology problem
                raise TopologyError(f"{src}: levels[{i}].model: cannot load its tokenizer: {exc}") from None
        try:
            trimmed = DraftVocab.load(path) if Path(path).is_dir() else None  # a trimmed drafter declares it
            size = trimmed.authority_vocab_size if trimmed else AutoConfig.from_pretrained(path, **kwargs).vocab_size
        except Exception as exc:  # noqa: BLE001
            raise TopologyError(f"{src}: levels[{i}].model: cannot read its config: {exc}") from None
        vocab_of[i] = (vocab, size)
        speaks_authority_ids[i] = trimmed is not None and vocab is None
    ref_vocab, ref_size = vocab_of[ref_i]
    for i, lv in hf:
        vocab, size = vocab_of[i]
        if speaks_authority_ids[i]:
            # a trimmed drafter without tokenizer files: draft_vocab.json maps it to authority ids
            vocab = ref_vocab
        if (vocab is None) != (ref_vocab is None):
            raise TopologyError(
                f"{src}: levels[{i}].model: cannot compare vocabularies: only one of this level and "
                f"the authority ({ref.name}) ships tokenizer files"
            )
        if vocab != ref_vocab:
            diff = len(set(vocab.items()) ^ set(ref_vocab.items()))
            raise TopologyError(
                f"{src}: levels[{i}].model: tokenizer vocabulary differs from the authority's "
                f"({ref.name}): {diff} differing entries"
            )
        if size != ref_size:
            raise TopologyError(
                f"{src}: levels[{i}].model: vocab_size {size} differs from the authority's "
                f"({ref.name}) {ref_size}"
            )


def _describe(exc: ValidationError, root: str = "") -> str:
    """A topology's wording of a pydantic error: ``levels[1].model: message (and 2 more errors)``."""
    return describe(exc, root=root, brackets=True, unknown="unknown field {name}", got=False, more=True)


def has_tokenizer(path: str) -> bool:
    """Whether a local model directory ships tokenizer files (a hub id is assumed to)."""
    p = Path(path)
    if not p.is_dir():
        return True
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
