"""``greedy_divergence``: how demo and bench tell a low-precision near-tie from a wrong token
(cascade/DESIGN.md §2, Numerics)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade.tools.exactness import NEAR_TIE_LOGITS, greedy_divergence
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
        assert d.near_tie == (low and d.gap <= NEAR_TIE_LOGITS)  # never in float32
    assert not greedy_divergence(model, prompt, shared + [order[-1]], shared + [order[0]]).near_tie or \
        float(logits[order[0]] - logits[order[-1]]) <= NEAR_TIE_LOGITS


def test_an_early_end_counts_as_the_stop_token(model):
    d = greedy_divergence(model, [1, 2], [5], [5, 6], eos=0)
    assert (d.position, d.ours, d.theirs) == (1, 0, 6)
    unknown = greedy_divergence(model, [1, 2], [5], [5, 6], eos=None)
    assert unknown.gap == float("inf") and not unknown.near_tie
