"""Helpers for the tests over real transformers models: the authority alone, and prompts."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from conftest import TEXT

_MODELS = {}


def reference_greedy(model_dir, prompt_ids, max_new_tokens):
    """The authority alone, through transformers' own generate."""
    if model_dir not in _MODELS:
        _MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model = _MODELS[model_dir]
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def prompts_from_text(tokenizer, count):
    lines = [ln for ln in TEXT.splitlines() if ln.strip()]
    prompts = []
    for i in range(count):
        text = "\n".join(lines[i % len(lines): i % len(lines) + 1 + i % 3]) + "\n"
        prompts.append(tokenizer.encode(text))
    return prompts
