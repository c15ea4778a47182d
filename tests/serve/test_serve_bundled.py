"""Chat out of the box: ``cascade serve`` on the bundled family answers chat requests with the
family's own chat template (examples/models/*/chat_template.jinja), exactly as its authority
decodes greedily."""
from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serve_util import ROOT, serve

LARGE = ROOT / "examples" / "models" / "large"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(ROOT / "topologies" / "2level.yaml", log_dir=tmp_path_factory.mktemp("serve-bundled")) as served:
        yield served


def test_chat_on_the_bundled_family_uses_its_template(server):
    tokenizer = AutoTokenizer.from_pretrained(LARGE)
    assert tokenizer.chat_template, "the bundled family ships a chat template"
    messages = [{"role": "system", "content": "Python, please."},
                {"role": "user", "content": "a function that returns the n-th fibonacci number"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 0  # the template writes no BOS, and none is added
    model = AutoModelForCausalLM.from_pretrained(LARGE, dtype=torch.float32)  # the topology's dtype
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
    client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="2level", messages=messages, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content.strip()  # the code model answers with code
