"""The few-row matrix kernel (workers/kernels/few_rows.py): float32's products to rounding, each row's
product independent of the rows beside it, torch's own products wherever the kernel does not
apply, and a clear fallback where it cannot be built."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import few_rows

ROOT = Path(__file__).resolve().parents[1]
available = pytest.mark.skipif(not few_rows.enabled(), reason=f"few-row kernel not used here: {few_rows.why_not()}")


def _build(tmp_path: Path, env: dict | None = None) -> list[Path]:
    """The package's extension built as ``pip install`` builds it (setup.py), into ``tmp_path``."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # an optional extension: its failure fails no install
    return list((tmp_path / "lib").rglob("_few_rows*"))


def test_the_packaged_build_compiles_and_passes_its_check(tmp_path):
    """A CPU with AVX2 and FMA and a C compiler gets the kernel from the package's build: a build
    that fails there is a regression, not a reason to skip the tests below."""
    if few_rows._unsupported() is not None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip(f"not buildable here: {few_rows._unsupported() or 'no C compiler'}")
    built = _build(tmp_path)
    assert len(built) == 1, built
    assert few_rows._check(few_rows._load(built[0])) is None


@available
@pytest.mark.parametrize("shape", [(1536, 576), (1000, 300), (45, 3001)])
def test_products_are_float32_s_and_rows_do_not_depend_on_each_other(shape):
    """Every row count up to MAX_ROWS (every tile, one or two blocks at once, a partial last
    block), with and without a bias, 2-D and 3-D inputs: F.linear's product to float32 rounding,
    and each row bit for bit what it is alone or beside any other rows."""
    out_features, in_features = shape
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    bias = torch.randn(out_features, generator=g)
    for b in (None, bias):
        product = few_rows.product(weight, b)
        assert product is not None
        x = torch.randn(few_rows.MAX_ROWS, in_features, generator=g)
        full = product(x)
        torch.testing.assert_close(full, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        rng = random.Random(1)
        for rows in range(1, few_rows.MAX_ROWS + 1):
            start = rng.randrange(few_rows.MAX_ROWS - rows + 1)
            assert torch.equal(product(x[start:start + rows]), full[start:start + rows]), rows
        assert torch.equal(product(x[:6].view(2, 3, in_features)), full[:6].view(2, 3, -1))


@available
def test_torch_s_own_product_wherever_the_kernel_does_not_apply():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(600, 256, generator=g)
    product = few_rows.product(weight, None)
    many = torch.randn(few_rows.MAX_ROWS + 1, 256, generator=g)
    assert torch.equal(product(many), F.linear(many, weight))  # more rows: MKL's blocked product
    x = torch.randn(3, 256, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the kernel is single-threaded: MKL's parallel product
        assert torch.equal(product(x), F.linear(x, weight))
    finally:
        torch.set_num_threads(threads)
    leaf = x.clone().requires_grad_()
    y = product(leaf)  # a pass that records gradients goes through F.linear
    y.sum().backward()
    assert y.grad_fn is not None
    torch.testing.assert_close(leaf.grad, weight.sum(0).expand(3, -1))
    assert few_rows.product(torch.randn(64, 64), None) is None  # under MIN_ELEMENTS
    assert few_rows.product(weight.double(), None) is None
    assert few_rows.product(weight.to(torch.bfloat16), None) is None


def _probe(env: dict, first: str = "") -> str:
    code = first + "from workers.kernels import few_rows; print(few_rows.enabled(), '|', few_rows.why_not())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_no_compiler_or_turned_off_is_a_clear_fallback(tmp_path):
    """Without a compiler the install skips the extension, and a process without it says why and
    keeps torch's products."""
    assert _probe({"CASCADE_FEW_ROWS": "0"}) == "False | CASCADE_FEW_ROWS=0"
    if few_rows._unsupported() is not None:
        pytest.skip(few_rows._unsupported())
    assert _build(tmp_path, {"CC": str(tmp_path / "no-such-compiler")}) == []
    out = _probe({}, first="import sys; sys.modules['workers.kernels._few_rows'] = None; ")
    assert out.startswith("False | not built"), out


@available
def test_a_lean_worker_with_the_kernel_scores_like_one_without():
    """Through rollbacks, rows of several sequences and several widths: the kernel's logits are
    the unpacked lean forward's to float32 rounding, and the kernel is what ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.hf import HFWorker
    from workers.lean import lean_forward

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    calls = []
    real, threads = few_rows._state["fn"], torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel's condition, when the model loads and when it runs
    try:
        with_kernel = HFWorker(model)
        without = HFWorker(model)
        without.lean = lean_forward(model, pack=False)
        assert model.model.layers[0].mlp.up_proj.weight.is_contiguous()  # the model's own weights left as they are
        few_rows._state["fn"] = lambda *a: (calls.append(a[4]), real(*a))[1]
        rebuilt = HFWorker(model)  # its products call the counting kernel
        rng = random.Random(2)
        seqs = [[rng.randrange(97) for _ in range(n)] for n in (5, 17, 9)]
        for step in range(5):
            for t in seqs:
                if step % 2:
                    del t[-1]
                t.extend(rng.randrange(97) for _ in range(1 + step % 4))
            nums = [1 + step % 4, 1, 2]
            got = rebuilt.score(["x", "y", "z"], seqs, nums)
            assert all(torch.equal(a, b) for a, b in zip(got, with_kernel.score(["x", "y", "z"], seqs, nums)))
            for a, b in zip(got, without.score(["x", "y", "z"], seqs, nums)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        few_rows._state["fn"] = real
        torch.set_num_threads(threads)
    assert calls and max(calls) <= few_rows.MAX_ROWS


@available
def test_the_layout_is_chosen_for_the_thread_count_at_load():
    """The kernel is single-threaded: a model loaded at one thread gets its blocked copies, one
    loaded at more gets oneDNN's prepacked copies and column-major weights (workers/lean.py)."""
    from workers.kernels.products import linear_product

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.randn(1024, 576)
        assert hasattr(linear_product(one, None, pack=True), "blocked") and one.is_contiguous()
        torch.set_num_threads(2)
        two = torch.randn(1024, 576)
        product = linear_product(two, None, pack=True)
        assert not hasattr(product, "blocked") and two.stride() == (1, 1024)
        x = torch.randn(3, 576)
        torch.testing.assert_close(product(x), x @ two.T, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
