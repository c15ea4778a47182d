"""The real authority end to end: SmolLM2-135M-Instruct from the user cache (`cascade pull
smollm2-135m-instruct`). Marked slow and real_model: the default run never downloads it and skips
these; run them with `python -m pytest -o addopts="" -m real_model` once it is in the cache."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import write_topology

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

NAME = "smollm2-135m-instruct"
CHATS = ["What is the capital of France?", "Write a Python function that reverses a string.",
         "Give me three tips for sleeping better."]


@pytest.fixture(scope="module")
def authority():
    from cascade.pull import MANIFEST, cache_dir

    path = cache_dir(NAME)
    if not (path / MANIFEST).is_file():
        pytest.skip(f"{NAME} is not in the cache: cascade pull {NAME}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def _topology(tmp_path):
    return write_topology(tmp_path / "real.yaml", {
        "levels": [{"name": "ngram", "kind": "ngram"},
                   {"name": "smollm2", "model": f"pulled:{NAME}", "dtype": "float32"}],
        "policy": {"name": "fixed", "params": {"lookahead": {"ngram": 4}}}})


def _chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def test_greedy_output_is_plain_greedy_decoding(authority, tmp_path):
    from cascade import Cascade

    _, model, tok = authority
    with Cascade.from_topology(_topology(tmp_path)) as c:
        for text in CHATS:
            ids = list(_chat_ids(tok, text))
            got = c.generate(ids, max_new_tokens=48, temperature=0.0).token_ids
            with torch.inference_mode():
                want = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                      pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
            assert got == want[:len(got)], text


def test_sampled_output_follows_the_authority(authority, tmp_path):
    from cascade import Cascade
    from cascade.tools.exactness import check_distribution

    _, model, tok = authority
    ids = list(_chat_ids(tok, "Name a colour."))
    draws = 300
    with Cascade.from_topology(_topology(tmp_path)) as c:  # request i is seeded with i
        ours = [g.token_ids for g in c.generate([ids] * draws, max_new_tokens=2, temperature=0.8, top_p=0.95,
                                                seed=0, batch_size=50)]
    torch.manual_seed(10_000)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids] * draws), max_new_tokens=2, do_sample=True, temperature=0.8,
                             top_p=0.95, top_k=0, pad_token_id=tok.eos_token_id)
    plain = out[:, len(ids):].tolist()
    check = check_distribution("ngram->smollm2", plain, ours, tokens=2, eos=tok.eos_token_id)
    assert check.passed, check


def _real_topology(tmp_path, policy, name="smollm2"):
    """topologies/<name>.yaml with the repository's drafters and head, every model level in
    float32 (a head runs in its source's dtype), under ``policy``."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "topologies" / f"{name}.yaml").read_text())
    for level in data["levels"]:
        if level.get("model", "").startswith("../"):
            level["model"] = str((root / "topologies" / level["model"]).resolve())
        if level.get("kind") != "head" and "model" in level:
            level["dtype"] = "float32"
    data["policy"] = policy
    return write_topology(tmp_path / f"{name}.yaml", data)


@pytest.mark.parametrize("name, policy", [
    ("smollm2-drafters", {"name": "fixed", "params": {"path": ["ngram", "draft-s", "draft-m", "smollm2"],
                                                      "lookahead": {"ngram": 2, "draft-s": 3, "draft-m": 4}}}),
    ("smollm2-drafters", {"name": "fixed", "params": {"path": ["draft-s", "smollm2"], "lookahead": 4,
                                                      "tree": {"draft-s": [3, 2, 1]}}}),
    ("smollm2-drafters", {"name": "auto"}),
    ("smollm2", {"name": "auto"}),
], ids=["chain", "tree", "auto-drafters", "auto"])
def test_the_real_hierarchy_is_plain_greedy_decoding(authority, tmp_path, name, policy):
    """The main topology (with the feature head) and the drafters-only one, under ``auto``, and
    the drafters' chains through a middle level and trees, for the float32 authority."""
    from cascade import Cascade

    _, model, tok = authority
    with Cascade.from_topology(_real_topology(tmp_path, policy, name)) as c:
        _assert_plain_greedy(c, model, tok, policy)


def _assert_plain_greedy(c, model, tok, label):
    """Two chats x 32 tokens through ``c`` equal the authority's own greedy ``generate``; the results."""
    results = []
    for text in CHATS[:2]:
        ids = list(_chat_ids(tok, text))
        g = c.generate(ids, max_new_tokens=32, temperature=0.0)
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                  pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        assert g.token_ids == want[:len(g.token_ids)], (label, text)
        results.append(g)
    return results


@pytest.mark.parametrize("tree", [None, [3, 2, 1]], ids=["chain", "tree"])
def test_the_shipped_feature_head_keeps_plain_greedy_decoding(authority, tmp_path, tree):
    """topologies/smollm2.yaml: the shipped feature head drafts chains and trees for the
    float32 authority."""
    from cascade import Cascade

    _, model, tok = authority
    params = {"path": ["head", "smollm2"], "lookahead": 3, **({"tree": {"head": tree}} if tree else {})}
    with Cascade.from_topology(_real_topology(tmp_path, {"name": "fixed", "params": params})) as c:
        for g in _assert_plain_greedy(c, model, tok, "head"):
            edge = g.stats.edges["head->smollm2"]
            assert edge.accepted > 0
            assert (edge.tree_nodes > 0) == bool(tree)
