"""The lean forward (workers/lean.py) gives transformers' logits, through the worker's caches,
on Llama variants the bundled family does not cover (grouped-query attention, scaled RoPE,
biases) and on the other architectures it supports (Mistral, Qwen2, Qwen3), and stands aside
for any model it does not know exactly."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from told import Told
from workers.hf import HFWorker
from workers.lean import lean_forward

TOL = 1e-10


def make(arch: str = "llama", **overrides):
    """A small random model of transformers' ``arch`` (a model_type), float64, in eval mode."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    params = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    params.update(overrides)
    torch.manual_seed(0)
    config = CONFIG_MAPPING[arch](**params)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


def llama(**overrides):
    return make("llama", **overrides)


VARIANTS = {
    "mha": {},
    "mistral-gqa": dict(arch="mistral", num_key_value_heads=2, sliding_window=None),
    "qwen2-gqa-qkv-biases": dict(arch="qwen2", num_key_value_heads=2),
    "qwen3-gqa-head-norms": dict(arch="qwen3", num_key_value_heads=2, head_dim=12),
    "gqa-biases-llama3-rope": dict(
        num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mqa-linear-rope": dict(num_key_value_heads=1,
                            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


def solo(model, tokens, n):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -n:]


@pytest.mark.parametrize("pack", [0.0, 1.0], ids=["padded", "packed"])
@pytest.mark.parametrize("fold_one", [False, True], ids=["grouped-one", "folded-one"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lean_worker_equals_transformers_through_rollbacks_joins_and_solo_calls(variant, fold_one, pack, monkeypatch):
    # one-position passes fold grouped-query attention in bfloat16 on a CPU: here in float64 both ways
    monkeypatch.setattr("workers.lean.fold_one_position", lambda dtype, device: fold_one)
    # packed: every pass with a pad runs its products over its real positions only (packed_positions)
    monkeypatch.setattr("workers.lean.PACK_BELOW", pack)
    model = make(**VARIANTS[variant])
    assert type(model).__name__.lower().startswith(VARIANTS[variant].get("arch", "llama"))
    worker = Told(HFWorker(model))  # as the engine drives it
    assert worker.lean is not None
    rng = random.Random(0)
    seqs = {s: [rng.randrange(61) for _ in range(rng.randrange(2, 30))] for s in "abc"}

    def check(ids, nums):
        got = worker.score(ids, [seqs[s] for s in ids], nums)
        for s, n, logits in zip(ids, nums, got):
            torch.testing.assert_close(logits, solo(model, seqs[s], n), rtol=0, atol=TOL)

    check(["a"], [2])  # alone: a DynamicCache of its own
    seqs["a"].extend([5, 6, 7])
    check(["a"], [3])
    for step in range(20):
        ids = rng.sample(sorted(seqs), rng.randrange(1, len(seqs) + 1))
        nums = []
        for s in ids:
            toks = seqs[s]
            cut = rng.randrange(0, 4)  # a rejected block rolls back
            if cut and len(toks) > cut + 1:
                del toks[-cut:]
            grow = rng.randrange(1, 6)
            toks.extend(rng.randrange(61) for _ in range(grow))
            nums.append(rng.randrange(1, grow + 1))
        check(ids, nums)
        if step == 8:  # one leaves; a long newcomer joins the running batch (prefilled alone)
            worker.release(["b"])
            del seqs["b"]
            seqs["d"] = [rng.randrange(61) for _ in range(40)]
        if step == 12:
            seqs["e"] = [rng.randrange(61) for _ in range(3)]


def test_a_bfloat16_pass_over_one_position_folds_grouped_query_attention(monkeypatch):
    """In bfloat16 on a CPU a one-position pass folds each key/value head's query group into the
    query length (torch's grouped-query kernel is slow there on some CPUs); in float32 it keeps
    the grouped call. Either way its logits are transformers' (to bfloat16's rounding)."""
    import torch.nn.functional as F

    from workers.lean import fold_one_position

    assert fold_one_position(torch.bfloat16, torch.device("cpu"))
    assert not fold_one_position(torch.float32, torch.device("cpu"))
    calls, attention = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], q.shape[2], kw.get("enable_gqa", False)))
        return attention(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for dtype, folded in ((torch.bfloat16, True), (torch.float32, False)):
        model = llama(num_key_value_heads=2).to(dtype)
        worker = HFWorker(model)
        tokens = [random.Random(1).randrange(61) for _ in range(9)]
        worker.score(["a"], [tokens[:8]], [1])
        calls.clear()
        got = worker.score(["a"], [tokens], [1])[0]  # one new position after 8 cached
        assert calls and all(c == ((2, 2, False) if folded else (4, 1, True)) for c in calls), calls
        torch.testing.assert_close(got.float(), solo(model, tokens, 1).float(), rtol=0,
                                   atol=0.05 if dtype == torch.bfloat16 else 1e-5)


def test_packed_positions_are_a_pass_s_real_new_positions_where_pads_are_many():
    from workers.lean import packed_positions

    valid = torch.tensor([[True, False, False, True],  # cached column, then 3 new: 2 pads, 1 real
                          [True, True, True, True]])  # 3 real new
    assert packed_positions(valid, 2, 3).tolist() == [2, 3, 4, 5]  # 4 real of 6
    assert packed_positions(valid[1:], 1, 3) is None  # no pad
    assert packed_positions(None, 2, 3) is None  # no mask: every position real
    assert packed_positions(torch.tensor([[True, False, True, True, True]]), 1, 4) is None  # 3 of 4: not worth it


def test_lean_and_transformers_forward_agree_on_the_bundled_family(family, monkeypatch):
    """float32, as served: the two forwards give the same logits, bit for bit, on the bundled family
    (passes padded as transformers' are: a packed pass's products have other row counts, and
    float32's rounding can differ in the last bit; packing's agreement is tested above, in float64)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("workers.lean.PACK_BELOW", 0.0)

    rng = random.Random(1)
    for level in ("tiny", "large"):
        model = AutoModelForCausalLM.from_pretrained(family / level, dtype=torch.float32).eval()
        lean, plain = HFWorker(model), HFWorker(model, lean=False)
        assert lean.lean is not None and plain.lean is None
        seqs = [[rng.randrange(1, plain.vocab_size) for _ in range(n)] for n in (5, 17, 9)]
        for step in range(6):
            for t in seqs:
                t.extend(rng.randrange(1, plain.vocab_size) for _ in range(1 + step % 3))
            a = lean.score(["x", "y", "z"], seqs, [1, 2, 1])
            b = plain.score(["x", "y", "z"], seqs, [1, 2, 1])
            for x, y in zip(a, b):
                assert torch.equal(x, y)  # the same ops on the same tensors: bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_rotary_embedding_are_transformers_own_bit_for_bit(dtype, monkeypatch):
    """The lean forward's RMSNorm (F.rms_norm on a CPU) and its rotary embedding (queries and keys
    at once, a roll by half a head against a sign-folded sin) give transformers' values exactly:
    the norm alone at any scale, and whole passes with F.linear's products and no folded
    attention, whose logits equal transformers' forward bit for bit in float32 and bfloat16."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from workers.lean import _rms

    norm = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=torch.Generator().manual_seed(0)))
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1)) * scale).to(dtype)
        assert torch.equal(_rms(x, norm.weight, norm.variance_epsilon), norm(x))
    monkeypatch.setattr("workers.lean.fold_one_position", lambda dtype, device: False)
    for variant in ("mha", "qwen3-gqa-head-norms"):
        model = make(**{**VARIANTS[variant], "num_key_value_heads": 4}).to(dtype)  # no grouped-query fold
        lean, plain = HFWorker(model), HFWorker(model, lean=False)
        lean.lean = lean_forward(model, pack=False)
        rng = random.Random(3)
        seqs = [[rng.randrange(61) for _ in range(n)] for n in (5, 11)]
        for step in range(4):
            for t in seqs:
                t.extend(rng.randrange(61) for _ in range(1 + step % 2))
            for x, y in zip(lean.score(["a", "b"], seqs, [1, 2]), plain.score(["a", "b"], seqs, [1, 2])):
                assert torch.equal(x, y), variant


def test_several_row_passes_through_prepacked_weights_keep_float32_products(without_few_rows):
    """Without the few-row kernel, where oneDNN is there (float32, CPU), a large weight gets a prepacked copy for passes of
    several rows and is itself stored column-major (same values) for passes of one row: the
    same product up to float32 rounding, every row as if alone. The packed lean worker scores
    like the unpacked one through rollbacks."""
    import torch.nn.functional as F

    from workers.kernels.products import PACK_MIN_ELEMENTS
    from workers.lean import _linear_op, _packable

    torch.manual_seed(0)
    module = torch.nn.Linear(576, 1024, bias=True)  # 589,824 elements: packed
    assert module.weight.numel() >= PACK_MIN_ELEMENTS
    before = module.weight.detach().clone()
    product = _linear_op([module], pack=True)
    assert module.weight.stride() == (1, 1024) and torch.equal(module.weight, before)  # column-major, same values
    assert isinstance(module.weight, torch.nn.Parameter)
    for rows in (1, 2, 3, 4, 8, 17):
        x = torch.randn(1, rows, 576)
        with torch.inference_mode():
            got, want = product(x), F.linear(x, before, module.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _linear_op([module], pack=True)
    assert module.weight.stride() == (1, 1024)  # built again (a forward with a capture): left as it is
    small = torch.nn.Linear(64, 64)
    x = torch.randn(4, 64)
    assert torch.equal(_linear_op([small], pack=True)(x), F.linear(x, small.weight, small.bias))  # not packed

    model = llama(hidden_size=256, intermediate_size=2304, vocab_size=97).to(torch.float32)
    assert _packable(model) and not _packable(model.to(torch.float64))
    model.to(torch.float32)
    packed, plain = HFWorker(model), HFWorker(model)
    plain.lean = lean_forward(model, pack=False)
    rng = random.Random(2)
    seqs = [[rng.randrange(97) for _ in range(n)] for n in (5, 17, 9)]
    for step in range(5):
        for t in seqs:
            if step % 2:
                del t[-1]  # a rejected token rolls back
            t.extend(rng.randrange(97) for _ in range(1 + step % 4))
        nums = [1 + step % 4, 1, 2]
        for a, b in zip(packed.score(["x", "y", "z"], seqs, nums), plain.score(["x", "y", "z"], seqs, nums)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_products_side_by_side_are_each_modules_product():
    """Linear layers reading the same input, multiplied as one over their weights side by side
    (``_linear_op`` of several modules, as the lean forward runs q/k/v and gate/up), give each
    module's own product once split back, a missing bias beside a present one adding nothing."""
    from workers.lean import _linear_op

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        modules = [torch.nn.Linear(64, n, bias=b).to(dtype) for n, b in ((48, True), (16, False), (32, True))]
        for pack in (False, True):
            joined = _linear_op(modules, pack=pack)
            for rows in (1, 2, 5):
                x = torch.randn(rows, 64).to(dtype)
                with torch.inference_mode():
                    got = joined(x).split([48, 16, 32], -1)
                    for module, part in zip(modules, got):
                        torch.testing.assert_close(part.float(), module(x).float(), rtol=2e-2, atol=2e-2)


def test_bfloat16_products_come_from_prepacked_copies():
    """In bfloat16, where oneDNN computes it natively, every product of the lean forward and of a
    small level's own layers (``own_product``) comes from a copy prepacked once, at any size and
    row count: F.linear's product (up to bf16 rounding), the weight itself left as it is; the
    packed worker scores like the unpacked one through rollbacks. Elsewhere nothing is packed."""
    import torch.nn.functional as F

    from workers.kernels.products import own_product, packable
    from workers.lean import _linear_op, _packable

    torch.manual_seed(0)
    small = torch.nn.Linear(64, 48).to(torch.bfloat16)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # e.g. an AVX2-only CPU
        assert not packable(small.weight) and own_product(small.weight, small.bias) is None
        pytest.skip("oneDNN computes no bfloat16 here")
    for module in (small, torch.nn.Linear(576, 1024, bias=False).to(torch.bfloat16)):
        before = module.weight.detach().clone()
        products = [_linear_op([module], pack=True), own_product(module.weight, module.bias)]
        assert torch.equal(module.weight, before) and module.weight.is_contiguous()  # left as it is
        for rows in (1, 2, 3, 8, 17):
            x = torch.randn(2, rows, module.in_features).to(torch.bfloat16)
            with torch.inference_mode():
                want = F.linear(x, before, module.bias).float()
                for product in products:
                    got = product(x)
                    assert got.shape == want.shape and got.dtype == torch.bfloat16
                    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)

    model = llama(hidden_size=64, intermediate_size=160, vocab_size=97).to(torch.bfloat16)
    assert _packable(model)
    packed, plain = HFWorker(model), HFWorker(model)
    plain.lean = lean_forward(model, pack=False)
    rng = random.Random(2)
    seqs = [[rng.randrange(97) for _ in range(n)] for n in (5, 17, 9)]
    for step in range(5):
        for t in seqs:
            if step % 2:
                del t[-1]  # a rejected token rolls back
            t.extend(rng.randrange(97) for _ in range(1 + step % 4))
        nums = [1 + step % 4, 1, 2]
        for a, b in zip(packed.score(["x", "y", "z"], seqs, nums), plain.score(["x", "y", "z"], seqs, nums)):
            torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_baselines_run_the_model_as_transformers_loaded_it(without_few_rows):
    """Without the few-row kernel, a worker's lean forward stores the large weights column-major; transformers' own runs of
    that model in the bench, the batch bench and the demo (``as_loaded``) get a row-major copy
    — same values, tied weights still tied, made once — and the same logits as a fresh load;
    a model left as loaded is its own."""
    from cascade.tools.baselines import as_loaded

    torch.manual_seed(3)
    model = llama(hidden_size=256, intermediate_size=2304, vocab_size=97, tie_word_embeddings=True).to(torch.float32)
    assert as_loaded(model) is model
    fresh = copy.deepcopy(model)
    HFWorker(model)
    assert model.model.layers[0].mlp.up_proj.weight.stride() == (1, 2304)  # 589,824 elements: column-major
    loaded = as_loaded(model)
    assert loaded is not model and as_loaded(model) is loaded
    assert all(p.is_contiguous() for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert "_cascade_as_loaded" not in "".join(model.state_dict())
    ids = torch.tensor([[5, 9, 2, 44, 7]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, fresh(ids).logits)


def test_models_it_does_not_know_exactly_keep_the_transformers_forward():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    assert lean_forward(llama()) is not None
    eager = llama()
    eager.config._attn_implementation = "eager"
    assert lean_forward(eager) is None  # another attention kernel: another numeric path

    class MyLlama(LlamaForCausalLM):  # a subclass may change anything
        pass

    sub = MyLlama(llama().config).eval()
    assert lean_forward(sub) is None
    hooked = llama()
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert lean_forward(hooked) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=2)).eval()
    assert lean_forward(gpt2) is None and HFWorker(gpt2).lean is None
    training = llama().train()
    assert lean_forward(training) is None
    # A sliding attention window masks columns by position, which the lean mask does not do.
    assert lean_forward(make("mistral", sliding_window=16)) is None
    assert lean_forward(make("mistral", sliding_window=None)) is not None
    assert lean_forward(make("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)) is None
    assert lean_forward(make("qwen3")) is not None
    swapped = make("qwen3")  # a module replaced by another kind: not the architecture any more
    swapped.model.layers[1].self_attn.k_norm = torch.nn.LayerNorm(8)
    assert lean_forward(swapped) is None
    assert lean_forward(make("qwen3").to(torch.float64).train()) is None
