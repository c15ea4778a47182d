"""Checks on a local model directory that read no weights: ``config.json`` and the safetensors
headers (8 bytes of length, then a JSON table of tensors), against each other and the file sizes.

What loading would trip over — a missing, empty, truncated or corrupt ``model.safetensors``, a
config the weights do not match — is found here, as one :class:`~cascade.errors.TopologyError`
naming the level: ``topologies/x.yaml: levels[2].model: model.safetensors: truncated ...``.
``cascade validate`` runs it for every hf level, and so does building a worker.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from cascade.errors import TopologyError

_HEADER_LIMIT = 100_000_000  # safetensors' own cap on the JSON header
_INDEX = "model.safetensors.index.json"


def check_checkpoint(model_dir: str | Path, where: str) -> None:
    """Raise ``TopologyError("<where>: <file>: problem")`` unless ``model_dir`` holds a readable
    ``config.json`` and safetensors weights whose headers agree with it. ``where`` names the
    level (``"topologies/x.yaml: levels[2].model"``). A hub id (no such directory) is skipped."""
    root = Path(model_dir)
    if not root.is_dir():
        return
    config = _read_json(root / "config.json", where)
    if not isinstance(config, dict):
        raise TopologyError(f"{where}: config.json: expected a JSON object")
    shapes: dict[str, list[int]] = {}
    for file in _weight_files(root, where):
        shapes.update(read_header(file, f"{where}: {file.name}"))
    _check_against_config(config, shapes, where)


def read_header(path: Path, where: str) -> dict[str, list[int]]:
    """The tensors' shapes from one safetensors file's header; checks that the header is whole
    JSON and that the data it describes fills the file exactly (so a truncated file is caught)."""
    size = path.stat().st_size
    if size < 8:
        raise TopologyError(f"{where}: empty or truncated file ({size} bytes; a safetensors file starts "
                            "with an 8-byte header length)")
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(_HEADER_LIMIT, size - 8):
            raise TopologyError(f"{where}: corrupt or truncated: header of {length} bytes in a file of {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TopologyError(f"{where}: corrupt header: {exc}") from None
    if not isinstance(header, dict):
        raise TopologyError(f"{where}: corrupt header: not a JSON object")
    shapes, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            shapes[name] = [int(d) for d in info["shape"]]
            str(info["dtype"])
        except (TypeError, KeyError, ValueError):
            raise TopologyError(f"{where}: corrupt header: bad entry for tensor {name!r}") from None
        end = max(end, int(stop))
    if 8 + length + end != size:
        raise TopologyError(f"{where}: truncated or corrupt: the header describes {8 + length + end} bytes, "
                            f"the file has {size}")
    return shapes


def _weight_files(root: Path, where: str) -> list[Path]:
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    if (root / _INDEX).is_file():
        index = _read_json(root / _INDEX, where)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise TopologyError(f"{where}: {_INDEX}: no weight_map")
        files = sorted({root / str(name) for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise TopologyError(f"{where}: {_INDEX}: shard(s) missing: {missing}")
        return files
    raise TopologyError(f"{where}: no model.safetensors (or {_INDEX}) in {root}; weights load from "
                        "safetensors only")


def _check_against_config(config: dict[str, Any], shapes: dict[str, list[int]], where: str) -> None:
    """The few facts any causal LM's config and weights share: vocabulary rows, hidden width,
    number of layers. Names follow transformers' conventions; a tensor not found is not judged."""
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    for name, shape in shapes.items():
        if re.search(r"(embed_tokens|wte|lm_head)\.weight$", name) and len(shape) == 2:
            if isinstance(vocab, int) and shape[0] != vocab:
                raise TopologyError(f"{where}: config.json: vocab_size {vocab} does not match the weights "
                                    f"({name} has {shape[0]} rows)")
            if isinstance(hidden, int) and shape[1] != hidden:
                raise TopologyError(f"{where}: config.json: hidden_size {hidden} does not match the weights "
                                    f"({name} is {shape[1]} wide)")
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    found = {int(m.group(1)) for n in shapes if (m := re.search(r"\.(?:layers|h)\.(\d+)\.", n))}
    if isinstance(layers, int) and found and max(found) + 1 != layers:
        raise TopologyError(f"{where}: config.json: num_hidden_layers {layers} does not match the weights "
                            f"({max(found) + 1} layers)")


def _read_json(path: Path, where: str) -> Any:
    if not path.is_file():
        raise TopologyError(f"{where}: {path.name}: missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TopologyError(f"{where}: {path.name}: not valid JSON: {exc}") from None
