"""Shared fixtures: small real transformers models and tokenizers, saved and reloaded from disk."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

# The engine's verification math runs on tiny tensors; on a 2-core machine intra-op threads only
# add synchronisation (10x slower under load). Tests use one thread.
torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks
def pytest_collection_modifyitems(items):
    """What pytest-xdist (``--dist loadgroup``) hands a worker as one unit: a whole test file,
    so that a file's module-scoped fixtures (models, a Ray runtime, a server) are built once —
    except in a file that sets ``SPLIT_ACROSS_WORKERS = True``, whose tests (long independent
    draws) go one by one to whichever worker is free, and first, the longest work before the
    rest fills the gaps, so that no one file sets CI's pace."""
    def split(item) -> bool:
        return bool(getattr(getattr(item, "module", None), "SPLIT_ACROSS_WORKERS", False))

    items.sort(key=lambda item: not split(item))  # stable: each file's own order is kept
    for item in items:
        if not split(item):  # unmarked: a unit of its own
            item.add_marker(pytest.mark.xdist_group(Path(item.nodeid.split("::")[0]).stem))

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "import os\nimport sys\nfor i in range(10):\n    print(i, os.path.join('a', str(i)))\n"
)


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a little code, with an EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def make_llama(
    path: Path,
    vocab_size: int,
    seed: int,
    hidden: int = 32,
    layers: int = 1,
    logit_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    base: Path | None = None,
    noise: float = 0.0,
    tokenizer=None,
    max_positions: int = 512,
) -> Path:
    """Save a random-init Llama. ``logit_scale`` sharpens its distributions; ``base`` + ``noise``
    makes it a perturbed copy of another model, so that levels partly agree."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if base is not None:
        model = LlamaForCausalLM.from_pretrained(base, dtype=dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
    else:
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=max_positions, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
        )
        model = LlamaForCausalLM(config).to(dtype)
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a dict shared by several levels out in full: topology files refuse YAML aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


def write_topology(path: Path, data: dict) -> Path:
    path.write_text(yaml.dump(data, Dumper=_NoAliasDumper, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def family(tmp_path_factory, tokenizer) -> Path:
    """Four float64 Llama levels sharing one tokenizer: the drafts are perturbed copies of the
    authority (partial agreement) except tiny, a different random network."""
    root = tmp_path_factory.mktemp("family")
    vocab = len(tokenizer)
    large = make_llama(root / "large", vocab, seed=1, hidden=48, layers=2, logit_scale=30.0,
                       dtype=torch.float64, tokenizer=tokenizer)
    make_llama(root / "medium", vocab, seed=2, base=large, noise=0.15, dtype=torch.float64, tokenizer=tokenizer)
    make_llama(root / "small", vocab, seed=3, base=large, noise=0.4, dtype=torch.float64, tokenizer=tokenizer)
    make_llama(root / "tiny", vocab, seed=4, hidden=16, layers=1, logit_scale=30.0,
               dtype=torch.float64, tokenizer=tokenizer)
    return root


def family_topology(root: Path, levels: list[str], ngram: bool = False, **extra) -> dict:
    spec_levels = [{"name": "ngram", "kind": "ngram"}] if ngram else []
    spec_levels += [{"name": n, "model": str(root / n), "dtype": "float64", "device": "cpu"} for n in levels]
    return {"name": "test", "levels": spec_levels, **extra}


@pytest.fixture
def without_few_rows(monkeypatch):
    """The lean forward's several-row and one-row products as where the few-row kernel is not
    available (workers/kernels/few_rows.py): oneDNN from prepacked copies, column-major weights."""
    from workers.kernels import few_rows

    monkeypatch.setattr(few_rows, "_state", {"fn": None, "reason": "turned off by a test"})
