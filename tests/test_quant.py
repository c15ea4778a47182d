"""A level that multiplies from quantized weights (workers/quant.py, ``quantize:``): it computes the
model it names — the GGUF's own 4-bit groups — to bf16's rounding, decodes greedily as its own
one-token passes do, and samples its own distribution exactly.

The model is a random 2-layer Llama written as a GGUF by the ``gguf`` package (Q4_1 projections,
Q4_0 values, a Q8_0 tied embedding, as llama.cpp lays them out) beside the float model it
dequantizes to, as ``cascade pull`` keeps them: no download.
"""
from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import cascade.engine  # noqa: E402
from cascade import Cascade  # noqa: E402
from cascade.errors import TopologyError  # noqa: E402
from cascade.sampling import Sampling  # noqa: E402
from conftest import make_llama, write_topology  # noqa: E402
from draws import per_row, verify_ignoring_draft_probs  # noqa: E402
from stats_util import chi_square_pvalue, total_variation  # noqa: E402
from workers import quant  # noqa: E402
from workers.hf import HFWorker  # noqa: E402

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)

VOCAB, HEADS, KV_HEADS = 32, 4, 2
PROMPT = [1, 2, 3]
T = gguf.GGMLQuantizationType
KINDS = {"attn_v": T.Q4_0, "token_embd": T.Q8_0}  # the rest Q4_1, as the real model ships


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k projections (tests/test_pull.py's, which transformers undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_quantized(folder, seed: int = 5):
    """A random Llama quantized into a GGUF in ``folder``, and the float model of its dequantized
    weights saved there with a manifest naming the GGUF (what ``cascade pull`` leaves)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked distributions: the draws below tell rules apart
        model.model.embed_tokens.weight.mul_(2.5)
    writer = gguf.GGUFWriter(str(folder / "toy.gguf"), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 2:
                continue
            short = name.split(".")[-2]
            gg = "token_embd" if "embed" in name else parts[short]
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(gg)
            data, kind = param.numpy().astype(np.float32), KINDS.get(gg, T.Q4_1)
            # groups lie along a row, so quantizing commutes with llama.cpp's row order
            raw = gguf.quants.quantize(_permute(data, heads) if heads else data, kind)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind)))
            layer = f"blk.{name.split('.')[2]}." if "layers" in name else ""
            writer.add_tensor(f"{layer}{gg}.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(folder)
    (folder / "cascade-model.json").write_text(json.dumps({"source": {"file": "pkg/toy.gguf"}}))
    return folder


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return write_quantized(tmp_path_factory.mktemp("quant"))


@pytest.fixture(autouse=True)
def kernel_at_every_width(monkeypatch):
    """The kernel for every pass (a level measures up to which width it is faster; here fixed)."""
    monkeypatch.setenv("CASCADE_QUANT_MOST_ROWS", "1024")
    if quant.kernel_works() is not None:
        pytest.skip(quant.kernel_works())


def _float_logits(path, ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_blocks_are_read_as_the_gguf_package_dequantizes_them(toy):
    reader = gguf.GGUFReader(str(toy / "toy.gguf"))
    seen = set()
    for t in reader.tensors:
        groups = quant.parse_blocks(t.data, t.tensor_type.name, int(t.shape[0]))
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        # the kernel's scales and zeros are bfloat16: a weight moves by up to 2^-8 of its group's range
        assert torch.allclose(groups.dequantize(), want, rtol=0, atol=2 ** -7 * float(want.abs().max()))
        seen.add(t.tensor_type.name)
    assert seen == {"Q4_0", "Q4_1", "Q8_0"}


def test_quantized_logits_are_the_dequantized_models_to_bf16_rounding(toy):
    """Against float32 over the same (dequantized) weights, the quantized pass is as close as the
    same model's bfloat16 pass is (cascade/DESIGN.md §2: bf16 moves a logit by its rounding)."""
    ids = PROMPT + [5, 9, 17, 30, 4]
    worker = HFWorker(str(toy), "bfloat16", "cpu", quantize="gguf")
    # per layer: q/k/v as one product, o, gate/up as one, down; and the LM head
    assert worker._quantized.why_not is None and len(worker._quantized.products) == 2 * 4 + 1
    ours = worker.score(["s"], [ids], [len(ids)])[0].float()
    exact, bf16 = _float_logits(toy, ids), _float_logits(toy, ids, torch.bfloat16)
    bound = 2 * float((bf16 - exact).abs().max()) + 0.05
    assert float((ours - exact).abs().max()) < bound
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))


def test_a_gguf_that_is_not_the_models_is_refused(toy, tmp_path):
    other = write_quantized(tmp_path, seed=6)
    (toy / "other.gguf").write_bytes((other / "toy.gguf").read_bytes())
    with pytest.raises(quant.QuantError, match="its weights are not this model's"):
        quant.Quantizer.build(_bf16(toy), "gguf", str(toy), "other.gguf")
    with pytest.raises(quant.QuantError, match="no such GGUF"):
        quant.Quantizer.build(_bf16(toy), "gguf", str(toy), "missing.gguf")


def _bf16(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def test_a_float32_level_keeps_its_float_products(toy):
    """The kernel takes bf16 rows: a float32 level is not quantized (with a warning), and its
    logits are the float model's."""
    ids = PROMPT + [7]
    worker = HFWorker(str(toy), "float32", "cpu", quantize="gguf")
    assert "float32" in worker._quantized.why_not
    plain = HFWorker(str(toy), "float32", "cpu")
    assert torch.equal(worker.score(["a"], [ids], [2])[0], plain.score(["a"], [ids], [2])[0])


def test_int4_from_float_weights_is_close_to_the_model(tmp_path):
    path = make_llama(tmp_path / "m", 32, seed=3, hidden=64, layers=1, logit_scale=4.0)
    worker = HFWorker(str(path), "bfloat16", "cpu", quantize="int4")
    ids = PROMPT + [8, 9]
    ours = worker.score(["s"], [ids], [3])[0].float()
    exact = _float_logits(path, ids)[-3:]
    assert float((ours - exact).abs().max()) < 0.1 * float(exact.abs().max())


def test_quantize_is_for_hf_levels_and_names_the_field(tmp_path):
    from cascade.topology import load_topology

    data = {"levels": [{"name": "n", "kind": "ngram", "quantize": "gguf"},
                       {"name": "a", "kind": "table_worker:TableWorker", "params": {"vocab_size": 4}}]}
    with pytest.raises(TopologyError, match="quantize"):
        load_topology(str(write_topology(tmp_path / "t.yaml", data)))
    data["levels"][0] = {"name": "n", "model": "x", "quantize": "int2"}
    with pytest.raises(TopologyError, match="quantize"):
        load_topology(str(write_topology(tmp_path / "t.yaml", data)))


def _topology(toy, tmp_path, drafter: bool = True) -> str:
    auth = {"name": "auth", "model": str(toy), "dtype": "bfloat16", "device": "cpu", "quantize": "gguf"}
    if not drafter:
        return str(write_topology(tmp_path / "alone.yaml", {"levels": [auth]}))
    small = make_llama(tmp_path / "small", VOCAB, seed=8, base=toy, noise=2.0)
    levels = [{"name": "small", "model": str(small), "device": "cpu"}, auth]
    data = {"levels": levels, "policy": {"name": "fixed", "params": {"lookahead": 3}}}
    return str(write_topology(tmp_path / "q.yaml", data))


def test_greedy_cascade_is_the_quantized_levels_own_decoding(toy, tmp_path):
    prompts = [PROMPT, [4, 4, 9], [30, 1], [12, 7, 7, 2]]
    with Cascade.from_topology(_topology(toy, tmp_path, drafter=False)) as alone:
        plain = [g.token_ids for g in alone.generate(prompts, max_new_tokens=16, temperature=0.0)]
    with Cascade.from_topology(_topology(toy, tmp_path)) as c:
        results = c.generate(prompts, max_new_tokens=16, temperature=0.0)
    assert sum(g.stats.edges["small->auth"].accepted for g in results) > 0
    assert [g.token_ids for g in results] == plain


def _exact_pairs(toy) -> dict:
    """The quantized level's own distribution of the first two tokens at T = 1, by enumeration."""
    worker = HFWorker(str(toy), "bfloat16", "cpu", quantize="gguf")
    sampling = Sampling(temperature=1.0)
    first = worker.score_probs(["p"], [PROMPT], [1], sampling)[0][0].double()
    rows = worker.score_probs([f"r{t}" for t in range(VOCAB)], [PROMPT + [t] for t in range(VOCAB)],
                              [1] * VOCAB, sampling)
    return {(a, b): float(first[a] * rows[a][0][b]) for a in range(VOCAB) for b in range(VOCAB)}


def _draw(topology: str, n: int, seed: int) -> Counter:
    with Cascade.from_topology(topology) as c:
        results = c.generate([PROMPT] * n, max_new_tokens=2, seed=seed, batch_size=256, coupling="residual",
                             temperature=1.0)
    assert sum(g.stats.edges["small->auth"].proposed for g in results) > n / 2
    return Counter(tuple(g.token_ids[:2]) for g in results)


def test_sampled_output_is_the_quantized_levels_distribution(toy, tmp_path):
    n = 100_000
    counts, expected = _draw(_topology(toy, tmp_path), n, seed=21), _exact_pairs(toy)
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue, total_variation(counts, expected, n))
    # The kernel wants a vocabulary of at least 16 (32 here): over 1,024 pairs, 100k exact draws
    # already sit ~0.03 from the distribution in total variation; bound what is beyond that.
    floor = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in expected.values())
    assert total_variation(counts, expected, n) < floor + 0.01


def test_sampled_negative_control(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(cascade.engine, "verify_blocks", per_row(verify_ignoring_draft_probs))
    n = 20_000
    counts = _draw(_topology(toy, tmp_path), n, seed=22)
    _, pvalue = chi_square_pvalue(counts, _exact_pairs(toy), n)
    assert pvalue < 1e-9


@pytest.mark.slow
@pytest.mark.real_model
def test_quantized_smollm2_is_the_pulled_model_to_bf16_rounding():
    """The pulled SmolLM2 authority multiplied from its GGUF's own groups, on a chat prompt: as
    close to the float32 model it was dequantized into as the same model's bf16 pass is."""
    from transformers import AutoTokenizer

    from cascade.pull import MANIFEST, cache_dir

    path = cache_dir("smollm2-135m-instruct")
    if not (path / MANIFEST).is_file():
        pytest.skip("smollm2-135m-instruct is not in the cache: cascade pull smollm2-135m-instruct")
    try:
        quant.gguf_path(str(path), None)
    except quant.QuantError as exc:
        pytest.skip(str(exc))
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    worker = HFWorker(str(path), "bfloat16", "cpu", quantize="gguf")
    ours = worker.score(["s"], [ids], [4])[0].float()
    exact = _float_logits(path, ids)[-4:]
    bf16 = _float_logits(path, ids, torch.bfloat16)[-4:]
    error = float((ours - exact).abs().max())
    assert error < 2 * float((bf16 - exact).abs().max()) + 0.05
    # where its top token differs from the float model's, the two were within that rounding (a near tie)
    shortfall = exact.max(-1).values - exact.gather(-1, ours.argmax(-1, keepdim=True))[:, 0]
    assert float(shortfall.max()) <= 2 * error
