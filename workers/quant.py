"""A level that multiplies from quantized weights: 4-bit codes in groups of 32, as a GGUF ships them.

torch's CPU weight-only kernel (:mod:`workers.kernels.int4`) multiplies bf16 rows by groups whose
weights are ``(code - 8) * scale + zero``: Q4_0, Q4_1 and Q8_0 map onto that exactly
(:func:`parse_blocks`), and ``quantize: int4`` makes such groups from any model's float weights
(an approximation of that model). Each product runs the kernel up to a number of rows measured
when the level loads (:meth:`Quantizer.measure`; ``CASCADE_QUANT_MOST_ROWS`` fixes it) and its
float product (workers/lean.py) above; where the kernel is missing or wrong, or the level is not
bfloat16 on a CPU, every product stays float, with a warning. Formats, exactness and costs:
docs/quantized.md.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

# the kernel's weight format, product, check and measurement (imported back for this module's callers)
from workers.kernels.int4 import (  # noqa: F401
    GROUP, Groups, Product, QuantProduct, groups_from_float, kernel_works, most_rows)
from workers.kernels.products import side_by_side

log = logging.getLogger(__name__)


# GGUF tensor names of a Llama-shaped decoder -> the module of transformers' model
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


class QuantError(ValueError):
    """A quantized level cannot be built as asked (named file, tensor or field)."""


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 4-bit codes of each block, from 16 bytes at ``start``: low nibbles first (ggml's order)."""
    qs = blocks[..., start:start + 16]
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def parse_blocks(data: np.ndarray, kind: str, columns: int) -> Groups:
    """Groups from a GGUF tensor's raw blocks ``data`` ``[out, bytes]`` of type ``kind``."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, columns // GROUP, -1)
    d = _f16(blocks, 0)
    if kind == "Q4_0":
        codes, scales, zeros = _halves(blocks, 2), d, np.zeros_like(d)
    elif kind == "Q4_1":
        codes, scales, zeros = _halves(blocks, 4), d, _f16(blocks, 2) + 8 * d
    elif kind == "Q8_0":
        unsigned = blocks[..., 2:34].view(np.int8).astype(np.int16) + 128
        hi, lo = (unsigned >> 4).astype(np.uint8), (unsigned & 15).astype(np.uint8)
        codes = np.concatenate([hi, lo], axis=1)
        scales, zeros = np.concatenate([16 * d, d], 1), np.concatenate([8 * d, np.zeros_like(d)], 1)
    else:
        raise QuantError(f"GGUF type {kind} is not read here (Q4_0, Q4_1, Q8_0 are)")
    codes = torch.from_numpy(codes.reshape(rows, -1).astype(np.int32))
    return Groups(codes, torch.from_numpy(scales), torch.from_numpy(zeros), 2 if kind == "Q8_0" else 1)


def _unpermute(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a q/k weight (transformers'
    GGUF loader undoes it the same way: ``_reverse_permute_weights``)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(-1)


def gguf_groups(path: Path, model) -> dict:
    """module -> Groups for every quantized linear weight of ``model`` found in the GGUF at ``path``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if arch != "llama":
        raise QuantError(f"{path}: a '{arch}' GGUF; quantize: gguf reads Llama-shaped ones")
    config, layers = model.config, model.model.layers
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    found = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            module = layers[int(parts[1])].get_submodule(_LAYER_NAMES[parts[2]])
        elif tensor.name == "output.weight" or (tensor.name == "token_embd.weight"
                                                and model.lm_head.weight is model.model.embed_tokens.weight):
            module = model.lm_head
        else:
            continue
        kind = tensor.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0"):
            continue  # a float tensor: the level's own float product serves it
        groups = parse_blocks(tensor.data, kind, int(tensor.shape[0]))
        if parts[0] == "blk" and parts[2] in heads:
            groups = groups.permute_rows(_unpermute(groups.codes.shape[0], heads[parts[2]]))
        found[module] = groups
    return found


def gguf_path(model_dir: str, gguf_file: str | None) -> Path:
    """The GGUF a ``quantize: gguf`` level reads: ``gguf_file`` in its model folder, else the file a
    pulled model's manifest names (``cascade pull`` keeps it beside the converted model)."""
    folder = Path(model_dir)
    if gguf_file is not None:
        return folder / gguf_file
    manifest = folder / "cascade-model.json"
    if manifest.is_file():
        name = Path(json.loads(manifest.read_text())["source"]["file"]).name
        if (folder / name).is_file():
            return folder / name
        raise QuantError(f"{folder}: quantize: gguf needs the GGUF it was converted from ({name}); "
                         f"pull it again (cascade pull --force keeps it) or set gguf_file")
    raise QuantError(f"{folder}: quantize: gguf needs a GGUF: set gguf_file, or use a pulled model")


def check_matches(groups: dict, path: Path) -> None:
    """Every quantized weight is the model's own, as loaded (to its dtype's rounding): a GGUF that
    is not the one the model came from is named, not multiplied."""
    for module, g in groups.items():
        ours, theirs = g.dequantize(), module.weight.detach().float()
        if ours.shape != theirs.shape:
            raise QuantError(f"{path}: a weight of shape {tuple(ours.shape)} for {tuple(theirs.shape)}")
        # bf16 rounding of either side (2^-8 of a weight) and the scale's rounding to bf16
        bound = 2 ** -7 * theirs.abs().amax(1, keepdim=True) + 1e-6
        if not bool(((ours - theirs).abs() <= bound).all()):
            raise QuantError(f"{path}: its weights are not this model's (a {tuple(theirs.shape)} weight "
                             f"differs by up to {float((ours - theirs).abs().max()):.3g})")


class Quantizer:
    """The products of a quantized level, for :func:`workers.lean.lean_forward`'s ``quantized`` hook:
    called with a module and the level's float product for it, it returns the quantized product
    where the module has quantized weights (packed once per module), else the float one."""

    def __init__(self, groups: dict, why_not: str | None = None):
        self.groups, self.why_not = groups, why_not
        self.products: dict = {}
        self.most_rows: int | None = None

    @classmethod
    def build(cls, model, how: str, model_dir: str | None = None, gguf_file: str | None = None) -> "Quantizer":
        """``how``: ``gguf`` (the groups of the GGUF the model came from) or ``int4`` (groups made
        from the model's float weights)."""
        if how == "gguf":
            path = gguf_path(model_dir or "", gguf_file)
            if not path.is_file():
                raise QuantError(f"{path}: no such GGUF file (quantize: gguf)")
            groups = gguf_groups(path, model)
            check_matches(groups, path)
        elif how == "int4":
            groups = {m: groups_from_float(m.weight) for m in _linears(model)}
        else:
            raise QuantError(f"quantize: {how!r} is not one of 'gguf', 'int4'")
        why = None if model.dtype == torch.bfloat16 else f"the level runs in {model.dtype}, the kernel in bfloat16"
        why = why or (None if next(model.parameters()).device.type == "cpu" else "the level is not on a CPU")
        why = why or kernel_works()
        if why is not None:
            log.warning("quantize: %s: multiplying from the float weights instead", why)
        return cls(groups, why)

    def __call__(self, modules: tuple, plain: Product) -> Product:
        """The product of ``modules`` (linear layers reading the same input, outputs side by side,
        :func:`workers.kernels.products.side_by_side`): quantized where each has groups."""
        parts = [self.groups.get(m) for m in modules]
        if any(g is None for g in parts) or len({g.repeat for g in parts}) > 1 or self.why_not is not None:
            return plain
        if modules not in self.products:
            groups = parts[0] if len(parts) == 1 else Groups(*(torch.cat([getattr(g, f) for g in parts])
                                                               for f in ("codes", "scales", "zeros")), parts[0].repeat)
            self.products[modules] = QuantProduct(groups, side_by_side(modules)[1], plain)
            self.products[modules].most_rows = self.most_rows or 0
        return self.products[modules]

    def measure(self) -> None:
        """Decide, once the products are built, up to how many rows the kernel serves (:func:`most_rows`)."""
        if self.most_rows is None and self.products:
            self.most_rows = most_rows(list(self.products.values()))
            for product in self.products.values():
                product.most_rows = self.most_rows


def _linears(model) -> list:
    """The decoder's projections and the LM head: the weights a pass reads."""
    names = list(_LAYER_NAMES.values())
    found = [layer.get_submodule(n) for layer in model.model.layers for n in names]
    return found + [model.lm_head]
