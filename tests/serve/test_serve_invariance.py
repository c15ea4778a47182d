"""Through the server, with the levels' ``batch_invariant`` mode on in bf16: a seeded request gives
the same tokens alone and beside changing load, greedy and sampled (docs/exactness.md, "Batch
invariance"). Where the CPU does not compute bf16 natively the mode is refused and this skips."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import make_llama, write_topology
from serve_util import serve

openai = pytest.importorskip("openai")

PROMPT = "def parse(line):\n"
OTHERS = ["import os\n", "class Queue:\n    def push(self, x):", "for i in range(10):\n", "x = [1, 2, 3]\n"]


@pytest.fixture(scope="module")
def topology(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    from workers.lean import batch_invariance_unsupported

    root = tmp_path_factory.mktemp("invariant-serve")
    large = make_llama(root / "large", len(tokenizer), seed=11, hidden=64, layers=2, logit_scale=8.0,
                       dtype=torch.bfloat16, tokenizer=tokenizer)
    why = batch_invariance_unsupported(AutoModelForCausalLM.from_pretrained(large, dtype=torch.bfloat16))
    if why:
        pytest.skip(f"batch_invariant: {why}")
    small = make_llama(root / "small", len(tokenizer), seed=12, hidden=32, layers=1, logit_scale=8.0,
                       dtype=torch.bfloat16, tokenizer=tokenizer)
    level = {"dtype": "bfloat16", "device": "cpu", "batch_invariant": True}
    return write_topology(root / "invariant.yaml", {
        "name": "invariant",
        "levels": [{"name": "ngram", "kind": "ngram"}, {"name": "small", "model": str(small), **level},
                   {"name": "large", "model": str(large), **level}],
        "edges": [["ngram", "small"], ["small", "large"], ["ngram", "large"]],
        "policy": {"name": "auto"},
    })


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_seeded_request_repeats_alone_and_beside_other_requests(topology, tmp_path, temperature):
    with serve(topology, log_dir=tmp_path) as served:
        client = openai.OpenAI(base_url=served.base, api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        mine = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=temperature, seed=1234)
        alone = [client.completions.create(**mine).choices[0].text for _ in range(2)]
        with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
            load = [pool.submit(client.completions.create, model=model, prompt=p, max_tokens=24 + 8 * i,
                                temperature=0.7 * (i % 2), seed=i) for i, p in enumerate(OTHERS)]
            beside = pool.submit(client.completions.create, **mine)
            for f in load:
                f.result()
            beside = beside.result().choices[0].text
    assert alone[0] == alone[1] == beside and len(alone[0]) > 0
