"""The bundled model family (examples/models) and its tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
FAMILY = ROOT / "examples" / "models"
PROMPTS = ROOT / "examples" / "prompts"
LEVELS = ("tiny", "small", "medium", "large")
EOS = "<|endoftext|>"

TRICKY = [
    "def f(x):\n\tif x:\n\t\treturn x\t# tab-indented\n",
    "s = 'héllo wörld — ünïcode ✓ 日本語 🐍 \\u00e9 e\u0301'\n",
    "x = '" + "abc123 " * 700 + "'\n",  # one ~5 kB line
    "trailing spaces    \n\n\n    \n",
    "windows\r\nline endings\r\n",
    "    indented 4\n        indented 8\n            indented 12\n",
    "",
    "<not special> " + EOS[:-1],
    "\x00\x01\x7f control bytes \u200b zero width",
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(FAMILY / "large")


@pytest.fixture(scope="module")
def models():
    return {lv: transformers.AutoModelForCausalLM.from_pretrained(FAMILY / lv, dtype=torch.float32).eval()
            for lv in LEVELS}


def test_levels_load_with_auto_classes_standalone(models, tokenizer):
    vocab = tokenizer.get_vocab()
    for lv in LEVELS:
        d = FAMILY / lv
        assert (d / "model.safetensors").exists() and (d / "tokenizer.json").exists()
        cfg = transformers.AutoConfig.from_pretrained(d)
        assert cfg.model_type == "llama"
        assert isinstance(models[lv], transformers.LlamaForCausalLM)
        assert cfg.tie_word_embeddings
        tok = transformers.AutoTokenizer.from_pretrained(d)
        assert tok.get_vocab() == vocab, f"{lv} has a different tokenizer"
        assert cfg.vocab_size == len(tok)
        assert tok.eos_token == EOS and cfg.eos_token_id == tok.eos_token_id
        # portable across transformers 4.x / 5.x
        assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_weights_fit_the_size_budget():
    total = sum(f.stat().st_size for f in FAMILY.glob("*/*.safetensors"))
    assert total <= 40 * 2**20, f"{total / 2**20:.1f} MiB of weights"


def test_cost_rises_with_level(models):
    layers = [models[lv].config.num_hidden_layers for lv in LEVELS]
    params = [sum(p.numel() for p in models[lv].parameters()) for lv in LEVELS]
    assert layers[0] == 1
    assert all(a < b for a, b in zip(layers, layers[1:]))
    assert all(a < b for a, b in zip(params, params[1:])) and params[-1] >= 8 * params[0]


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_round_trips_tricky_code(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id not in ids or EOS in text


def test_tokenizer_round_trips_real_source(tokenizer):
    import inspect

    import textwrap as module

    src = inspect.getsource(module)
    ids = tokenizer(src, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == src
    assert len(ids) < len(src) / 2.5  # BPE learned code: well under one token per 2.5 chars


def test_heldout_loss_decreases_with_level_by_margins(models, tokenizer):
    """Issue 18: strictly better with each level, large >= 0.10 nats/token below medium and
    >= 0.40 below tiny, on held-out code (the model card's 64 windows)."""
    from cascade.train.family_eval import heldout_losses, heldout_windows
    from cascade.train.heldout import heldout_text

    windows = heldout_windows(tokenizer, seq_len=256, n=64, text=heldout_text())
    losses = heldout_losses(models, windows)
    values = [losses[lv] for lv in LEVELS]
    assert all(a > b for a, b in zip(values, values[1:])), losses
    assert losses["medium"] - losses["large"] >= 0.10, losses
    assert losses["tiny"] - losses["large"] >= 0.40, losses
    assert values[-1] < 0.5 * torch.log(torch.tensor(4096.0)).item()  # far below uniform (8.3 nats)


def test_generation_is_code_like(models, tokenizer):
    prompt = "def add(a, b):\n    "
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = models["large"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, ids.size(1):])
    assert text.strip(), text
    assert any(ch.isalpha() for ch in text)


def test_large_greedy_text_loops_little(models, tokenizer):
    """Issue 18: large's greedy continuations of held-out prompts (96 tokens) repeat little:
    median repeated-4-gram share <= 0.30 (every fourth prompt here; the model card takes all:
    0.119). Maximum likelihood alone left it at 0.724; sequence-level unlikelihood training
    (examples/models/unlikelihood.sh) brought it down."""
    from cascade.repetition import median_repetition
    from cascade.train.family_eval import greedy_continuations
    from cascade.train.heldout import load_prompts

    prompts = load_prompts(PROMPTS / "heldout.jsonl")[::4]
    conts = [g.tolist() for _, g in greedy_continuations(models["large"], tokenizer, prompts, 96)]
    assert median_repetition(conts) <= 0.30


def test_adjacent_levels_agree(models, tokenizer):
    """Issue 18: each level's drafts are accepted by the level above >= 60% of the time,
    greedy and at T = 0.8."""
    from cascade.train.family_eval import acceptance_matrix
    from cascade.train.heldout import load_prompts

    prompts = load_prompts(PROMPTS / "heldout.jsonl")[::6]
    acc = acceptance_matrix(models, tokenizer, prompts, new_tokens=32, temperature=0.8)
    assert acc["greedy"]["tiny"]["tiny"] == 1.0
    for drafter, verifier in zip(LEVELS, LEVELS[1:]):
        for mode in ("greedy", "sampled"):
            assert 0.6 <= acc[mode][drafter][verifier] <= 1.0, (mode, drafter, verifier, acc[mode])


def test_prompt_sets():
    def rows(name):
        return [json.loads(line) for line in (PROMPTS / name).read_text(encoding="utf-8").splitlines() if line.strip()]

    heldout, tuning = rows("heldout.jsonl"), rows("tuning.jsonl")
    assert len(heldout) >= 50 and len(tuning) >= 20
    for r in heldout + tuning:
        assert r["prompt"].strip() and r["license"] in {"MIT", "BSD-3-Clause"}
    files = lambda rs: {r["source"].rsplit(":", 1)[0] for r in rs}  # noqa: E731
    assert not files(heldout) & files(tuning)
    # none of it is in the training corpus (the manifest the family was trained on)
    from cascade.train.corpus import read_manifest
    from cascade.train.heldout import TUNING_SOURCES, heldout_files, source_files

    train = {row.file().resolve() for row in read_manifest(FAMILY / "CORPUS.tsv")}
    held = {p.resolve() for p in heldout_files()} | {p.resolve() for _, _, p in source_files(TUNING_SOURCES)}
    assert held and not held & train
    assert all("site-packages" in p.parts for p in held)
    assert {"networkx", "attr"} <= {r["package"] for r in heldout}
