"""``greedy_divergence``: how demo and bench tell a low-precision near-tie from a wrong token
(cascade/DESIGN.md §2, Numerics)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade.tools.exactness import FLOAT32_NEAR_TIE_LOGITS, NEAR_TIE_LOGITS, greedy_divergence
from conftest import make_llama


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request, tmp_path_factory):
    path = make_llama(tmp_path_factory.mktemp("m"), 64, seed=3, logit_scale=4.0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=request.param).eval()


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_same_continuations_do_not_diverge(model):
    assert greedy_divergence(model, [1, 2, 3], [5, 6], [5, 6]) is None


def test_the_gap_is_the_logit_difference_of_the_two_tokens_after_the_shared_prefix(model):
    prompt, shared = [1, 2, 3], [7, 8]
    logits = _logits(model, prompt + shared)
    order = logits.argsort(descending=True).tolist()
    for other in (order[1], order[-1]):  # the runner-up (close) and the least likely token (far)
        d = greedy_divergence(model, prompt, shared + [other, 9], shared + [order[0], 4])
        assert (d.position, d.ours, d.theirs) == (2, other, order[0])
        assert d.gap == pytest.approx(float(logits[order[0]] - logits[other]), abs=1e-4)
        low = model.dtype == torch.bfloat16
        assert d.low_precision == low
        assert d.near_tie == (d.gap <= (NEAR_TIE_LOGITS if low else FLOAT32_NEAR_TIE_LOGITS))
    assert not greedy_divergence(model, prompt, shared + [order[-1]], shared + [order[0]]).near_tie or \
        float(logits[order[0]] - logits[order[-1]]) <= NEAR_TIE_LOGITS


def test_float32_allows_only_its_own_rounding():
    """float32 logits move with a pass's width by ~5e-5 of a logit; a gap of a thousandth is
    rounding, a hundredth is not, and float64 allows nothing."""
    from cascade.tools.exactness import Divergence

    assert Divergence(0, 1, 2, 5e-4, False, True).near_tie
    assert not Divergence(0, 1, 2, 1e-2, False, True).near_tie
    assert not Divergence(0, 1, 2, 1e-12, False, False).near_tie


def test_an_early_end_counts_as_the_stop_token(model):
    d = greedy_divergence(model, [1, 2], [5], [5, 6], eos=0)
    assert (d.position, d.ours, d.theirs) == (1, 0, 6)
    unknown = greedy_divergence(model, [1, 2], [5], [5, 6], eos=None)
    assert unknown.gap == float("inf") and not unknown.near_tie


def _bf16_cascade_divergences(family, tokenizer, tmp_path):
    """Greedy ``small -> large`` with every level in bf16 against plain bf16 decoding of
    ``large``: the divergences of six prompts (None where identical)."""
    from cascade import Cascade
    from conftest import family_topology, write_topology
    from hf_util import prompts_from_text

    data = family_topology(family, ["small", "large"], policy={"name": "fixed", "params": {"lookahead": {"small": 5}}})
    for level in data["levels"]:
        level["dtype"] = "bfloat16"
    large = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.bfloat16).eval()
    found = []
    with Cascade.from_topology(write_topology(tmp_path / "bf16.yaml", data)) as c:
        for prompt in prompts_from_text(tokenizer, 6):
            got = c.generate(prompt, max_new_tokens=32, temperature=0.0).token_ids
            with torch.inference_mode():
                want = large.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            found.append(greedy_divergence(large, prompt, got, want[:len(got)]))  # the cascade stops at EOS
    return found


def test_a_bf16_authority_diverges_only_at_near_ties(family, tokenizer, tmp_path):
    found = _bf16_cascade_divergences(family, tokenizer, tmp_path)
    assert all(d is None or d.near_tie for d in found), [d.describe() for d in found if d]


def test_an_inexact_rule_is_caught_under_a_bf16_authority(family, tokenizer, tmp_path, monkeypatch):
    """The negative control: the near-tie allowance does not hide a wrong acceptance rule (here:
    every draft accepted)."""
    import cascade.engine as engine
    from cascade.verify import Verdict

    def accept_all(sampling, tokens, draft_probs, target_probs, draws):
        return [Verdict(len(t), int(p[len(t)].argmax()), True) for t, p in zip(tokens, target_probs)]

    monkeypatch.setattr(engine, "_verdicts", accept_all)
    found = _bf16_cascade_divergences(family, tokenizer, tmp_path)
    assert any(d is not None and not d.near_tie for d in found)
