"""Size presets of the bundled model family and helpers to build/save Llama models.

The shapes were chosen by timing random-init models on the 2-core CPU this project was
developed on (see ``examples/models/README.md``): at batch 1 with a KV cache, HuggingFace's
per-layer Python overhead dominates, so the decode cost grows mainly with depth.  The tiny
model has one layer; each level is roughly 2.5-3x deeper/wider than the one below.
"""
from __future__ import annotations

import os
from pathlib import Path

LEVELS = ("tiny", "small", "medium", "large")

#: name -> Llama shape.  ``heads`` divides ``hidden``; every level uses tied embeddings.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(layers=1, hidden=128, heads=4, intermediate=384),
    "small": dict(layers=4, hidden=128, heads=4, intermediate=384),
    "medium": dict(layers=7, hidden=192, heads=4, intermediate=512),
    "large": dict(layers=14, hidden=256, heads=4, intermediate=640),
}


def parse_size(spec: str) -> dict[str, int]:
    """A preset name or ``LAYERSxHIDDEN[xHEADS[xINTERMEDIATE]]`` (e.g. ``2x96x4x256``)."""
    if spec in SIZES:
        return dict(SIZES[spec])
    parts = [int(p) for p in spec.lower().split("x")]
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"bad size {spec!r}: use one of {list(SIZES)} or LAYERSxHIDDEN[xHEADS[xFFN]]")
    layers, hidden = parts[0], parts[1]
    heads = parts[2] if len(parts) > 2 else max(1, hidden // 32)
    inter = parts[3] if len(parts) > 3 else 3 * hidden
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
    return dict(layers=layers, hidden=hidden, heads=heads, intermediate=inter)


def make_config(size: dict[str, int], tokenizer, max_positions: int = 1024):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        intermediate_size=size["intermediate"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_dropout=0.0,
    )


def make_model(size: dict[str, int], tokenizer, seed: int, max_positions: int = 1024):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(make_config(size, tokenizer, max_positions))


def save_model(model, tokenizer, out_dir: str | os.PathLike, dtype: str = "float16", extra: dict | None = None):
    """Save ``model`` (cast to ``dtype`` for storage) plus tokenizer files, loadable standalone."""
    import copy
    import json

    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to("cpu")
    if dtype == "float16":
        m = m.to(torch.float16)
    elif dtype == "bfloat16":
        m = m.to(torch.bfloat16)
    m.generation_config.pad_token_id = tokenizer.pad_token_id
    m.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out)
    if extra:
        (out / "training.json").write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    return out


def portable_tokenizer_config(model_dir: str | os.PathLike) -> None:
    """Name the tokenizer class ``PreTrainedTokenizerFast`` (transformers 5 writes its internal
    ``TokenizersBackend``, which transformers 4.x cannot resolve; both load the former)."""
    import json

    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
