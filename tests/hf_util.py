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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """A toy byte-level BPE tokenizer with ChatML's special tokens and chat template (the records' tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    out.chat_template = CHATML
    return out
