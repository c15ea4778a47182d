"""Batch invariance (docs/exactness.md, "Batch invariance"): with ``batch_invariant`` the lean
forward's bf16 logits for a position do not depend on how many positions or rows a pass scores,
so greedy output is plain one-token-at-a-time decoding's, token for token with no near-tie
allowance, and a seed gives the same tokens whatever the policy and the batch.

bf16 products need a CPU where oneDNN computes bf16 natively (AVX-512 BF16, AMX); elsewhere the
mode is refused and these tests skip. They compare the forward with itself, so they hold
whatever a CPU's bf16 rounding is."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.lean import batch_invariance_unsupported, lean_forward

VOCAB = 320  # conftest.make_tokenizer's


class _Layer:
    """A cache layer as the lean forward uses one (update returns all keys/values)."""

    def __init__(self, keys=None, values=None):
        self.keys, self.values = keys, values

    def update(self, k, v):
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def get_seq_length(self):
        return 0 if self.keys is None else self.keys.shape[2]

    def copy(self, rows=1, pad=0):
        """The layer for ``rows`` copies of its sequence, each after ``pad`` columns of garbage."""
        keys, values = self.keys.repeat(rows, 1, 1, 1), self.values.repeat(rows, 1, 1, 1)
        if pad:
            junk = torch.randn(rows, keys.shape[1], pad, keys.shape[3]).to(keys.dtype)
            keys, values = torch.cat([junk, keys], 2), torch.cat([junk, values], 2)
        return _Layer(keys, values)


def _toy(path, seed, hidden=64, layers=2, logit_scale=8.0, tokenizer=None):
    """A random bf16 Llama with grouped-query attention (4 query heads over 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.to(torch.bfloat16).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    assert len(tokenizer) == VOCAB
    path = _toy(tmp_path_factory.mktemp("invariant") / "large", seed=11, tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    why = batch_invariance_unsupported(model)
    if why:
        pytest.skip(f"batch_invariant: {why}")
    return path, model


def _prefilled(forward, model, length, seed=0):
    tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    layers = [_Layer() for _ in range(model.config.num_hidden_layers)]
    with torch.inference_mode():
        forward(tokens[None], torch.arange(length)[None], layers, None, 1)
    return layers


def _score(forward, layers, tokens, start, rows=1, pad=0):
    width = tokens.numel()
    valid = None
    if pad:
        valid = torch.ones(rows, pad + start + width, dtype=torch.bool)
        valid[:, :pad] = False
    with torch.inference_mode():
        return forward(tokens[None].repeat(rows, 1), (start + torch.arange(width))[None].repeat(rows, 1),
                       [layer.copy(rows, pad) for layer in layers], valid, width)


def _width_mismatches(forward, model, prefix):
    """(position, width) pairs whose logits differ from the same position scored in the
    narrowest pass that reaches it, widths 1..16 after ``prefix`` tokens."""
    layers = _prefilled(forward, model, prefix)
    new = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(1))
    by_width = {w: _score(forward, layers, new[:w], prefix)[0] for w in range(1, 17)}
    return [(j, w) for j in range(16) for w in range(j + 2, 17) if not torch.equal(by_width[w][j], by_width[j + 1][j])]


@pytest.mark.parametrize("prefix", [40, 250])  # 250: passes cross a block of keys (INVARIANT_BLOCK)
def test_a_positions_logits_do_not_depend_on_the_passs_width(toy, prefix):
    _, model = toy
    forward = lean_forward(model, batch_invariant=True)
    assert _width_mismatches(forward, model, prefix) == []


def test_a_rows_logits_do_not_depend_on_the_other_rows_or_where_its_columns_sit(toy):
    """Rows 1..8 of one sequence, and the sequence after masked columns (a pool's left padding)."""
    _, model = toy
    forward = lean_forward(model, batch_invariant=True)
    layers = _prefilled(forward, model, 60)
    new = torch.randint(0, VOCAB, (4,), generator=torch.Generator().manual_seed(2))
    for width in (1, 4):
        alone = _score(forward, layers, new[:width], 60)[0]
        for rows in range(2, 9):
            out = _score(forward, layers, new[:width], 60, rows)
            assert all(torch.equal(out[r], alone) for r in range(rows)), (width, rows)
        for pad in (1, 7, 200):
            assert torch.equal(_score(forward, layers, new[:width], 60, 3, pad)[1], alone), (width, pad)


def test_a_tree_nodes_logits_are_its_paths_as_a_chain(toy):
    """A tree pass (nodes that skip their siblings' columns) gives each node the logits its path
    gets scored as a chain, and after a row whose columns sit elsewhere."""
    _, model = toy
    forward = lean_forward(model, batch_invariant=True)
    layers = _prefilled(forward, model, 70)
    parents = [-1, 0, 0, 1, 2, 2, 3, 5]
    tokens = torch.randint(0, VOCAB, (len(parents),), generator=torch.Generator().manual_seed(4))
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    among = torch.zeros(1, len(parents), len(parents), dtype=torch.bool)
    for node, path in enumerate(paths):
        among[0, node, path] = True
    depth = torch.tensor([len(path) - 1 for path in paths])
    with torch.inference_mode():
        tree = forward(tokens[None], (70 + depth)[None], [layer.copy() for layer in layers], None, len(parents),
                       among)[0]
    for node, path in enumerate(paths):
        chain = _score(forward, layers, tokens[path], 70)[0]
        assert torch.equal(tree[node], chain[-1]), node


def test_without_the_mode_the_width_moves_the_logits(toy):
    """The negative control: torch's attention rounds by the pass's key columns (skipped on a CPU
    where these passes happen to agree without the mode)."""
    _, model = toy
    found = [m for prefix in (40, 90, 250) for m in _width_mismatches(lean_forward(model), model, prefix)]
    if not found:
        pytest.skip("the plain forward's widths agree on this CPU for this model")
    assert found


def test_float32_is_refused_by_name(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_toy(tmp_path / "m", seed=3), dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="batch_invariant: needs a bfloat16 model"):
        lean_forward(model, batch_invariant=True)


def _plain_greedy(model, prompt, count):
    """One token at a time through the same (batch-invariant) forward: the prompt in one pass,
    then one position per pass."""
    forward = lean_forward(model, batch_invariant=True)
    layers = [_Layer() for _ in range(model.config.num_hidden_layers)]
    out, tokens = [], list(prompt)
    with torch.inference_mode():
        logits = forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], layers, None, 1)
        for _ in range(count):
            out.append(int(logits[0, -1].float().argmax()))
            logits = forward(torch.tensor([[out[-1]]]), torch.tensor([[len(tokens)]]), layers, None, 1)
            tokens.append(out[-1])
    return out


@pytest.fixture(scope="module")
def cascade_topology(toy, tmp_path_factory, tokenizer):
    from conftest import write_topology

    path, _ = toy
    root = tmp_path_factory.mktemp("topology")
    draft = _toy(root / "small", seed=12, hidden=32, layers=1, tokenizer=tokenizer)
    level = {"dtype": "bfloat16", "device": "cpu", "batch_invariant": True}
    return write_topology(root / "invariant.yaml", {
        "name": "invariant",
        "levels": [{"name": "ngram", "kind": "ngram"}, {"name": "small", "model": str(draft), **level},
                   {"name": "large", "model": str(path), **level}],
        "edges": [["ngram", "small"], ["small", "large"], ["ngram", "large"]],
        "policy": {"name": "fixed", "params": {"lookahead": {"small": 5}}},
    })


PROMPTS = [[5, 17, 3, 88, 41], [9] * 12, list(range(20, 60)), [1, 2, 3, 1, 2, 3, 1, 2]]


@pytest.mark.parametrize("policy", [None, "fixed:lookahead=1", "fixed:lookahead=9", "auto"])
def test_greedy_output_is_one_token_at_a_time_decoding_token_for_token(toy, cascade_topology, policy):
    from cascade import Cascade

    _, model = toy
    with Cascade.from_topology(cascade_topology) as c:
        got = c.generate(PROMPTS, max_new_tokens=40, temperature=0.0, policy=policy, batch_size=3)
    for prompt, generation in zip(PROMPTS, got):
        assert generation.token_ids == _plain_greedy(model, prompt, len(generation.token_ids)), prompt


def test_a_seed_gives_the_same_tokens_whatever_the_policy_and_the_batch(cascade_topology):
    from cascade import Cascade

    runs = []
    with Cascade.from_topology(cascade_topology) as c:
        for policy, batch in ((None, 1), ("fixed:lookahead=1", 1), ("fixed:lookahead=9", 4), ("auto", 2)):
            got = c.generate(PROMPTS, max_new_tokens=40, temperature=0.8, seed=1234, policy=policy,
                             batch_size=batch)
            runs.append([g.token_ids for g in got])
    assert all(run == runs[0] for run in runs[1:])


def test_the_topology_field(tmp_path, toy):
    from cascade.errors import TopologyError
    from cascade.topology import load_topology
    from conftest import write_topology

    path, _ = toy
    bad = write_topology(tmp_path / "bad.yaml", {"name": "t", "levels": [
        {"name": "ngram", "kind": "ngram", "batch_invariant": True}, {"name": "large", "model": str(path)}]})
    with pytest.raises(TopologyError, match="batch_invariant"):
        load_topology(bad)
    bad = write_topology(tmp_path / "bad2.yaml", {"name": "t", "levels": [
        {"name": "large", "model": str(path), "batch_invariant": "sometimes"}]})
    with pytest.raises(TopologyError, match="batch_invariant"):
        load_topology(bad)
    # float32: true is refused naming the field; auto is off there
    from cascade import Cascade

    f32 = write_topology(tmp_path / "f32.yaml", {"name": "t", "levels": [
        {"name": "large", "model": str(path), "dtype": "float32", "batch_invariant": True}]})
    with pytest.raises(TopologyError, match=r"levels\[0\]\.batch_invariant: needs a bfloat16"):
        Cascade.from_topology(f32)
    auto = write_topology(tmp_path / "auto.yaml", {"name": "t", "levels": [
        {"name": "large", "model": str(path), "dtype": "float32", "batch_invariant": "auto"}]})
    with Cascade.from_topology(auto) as c:
        assert len(c.generate([1, 2, 3], max_new_tokens=4, temperature=0.0).token_ids) == 4


REAL = "smollm2-135m-instruct"
REAL_CHATS = ["What is the capital of France?", "Write a Python function that reverses a string.",
              "Explain why the sky is blue, in a few sentences."]


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_greedy_is_one_token_at_a_time_decoding_without_a_near_tie_allowance(tmp_path):
    """topologies/smollm2.yaml (head, drafter, n-gram, the auto policy) with the authority in bf16 and
    batch_invariant on: 3 chats x 64 tokens equal to one-token-at-a-time decoding by the same forward."""
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cascade import Cascade
    from cascade.pull import MANIFEST, cache_dir
    from conftest import write_topology

    path = cache_dir(REAL)
    if not (path / MANIFEST).is_file():
        pytest.skip(f"{REAL} is not in the cache: cascade pull {REAL}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    why = batch_invariance_unsupported(model)
    if why:
        pytest.skip(f"batch_invariant: {why}")
    bundled = Path(__file__).resolve().parents[1] / "topologies"
    data = yaml.safe_load((bundled / "smollm2.yaml").read_text())
    for level in data["levels"]:
        if str(level.get("model", "")).startswith("../"):
            level["model"] = str((bundled / level["model"]).resolve())
        if level["name"] == "smollm2":
            level.update(dtype="bfloat16", batch_invariant=True)
    tok = AutoTokenizer.from_pretrained(path)
    chats = [list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)) for text in REAL_CHATS]
    with Cascade.from_topology(write_topology(tmp_path / "smollm2.yaml", data)) as c:
        got = c.generate(chats, max_new_tokens=64, temperature=0.0, batch_size=2)
    for chat, generation, text in zip(chats, got, REAL_CHATS):
        assert generation.token_ids == _plain_greedy(model, chat, len(generation.token_ids)), text
