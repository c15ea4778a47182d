"""A drafter with a trimmed draft vocabulary (workers.draft_vocab): its rows are the authority's
width with -inf outside its vocabulary, so its draft_probs are zero there, and the output stays
exact — tokens it cannot draft come through the verifier's residual."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import cascade.engine
from cascade import Cascade
from conftest import make_llama, write_topology
from draws import exact_pairs, per_row, verify_ignoring_draft_probs
from stats_util import chi_square_pvalue, total_variation
from workers.draft_vocab import FILE, DraftVocab
from told import Told
from workers.hf import HFWorker

AUTHORITY_VOCAB = 6
DRAFT_IDS = [4, 1, 3]  # tokens 0, 2 and 5 can only come from the authority's residual


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    """A random 4-row Llama (3 draft tokens + OTHER) with its draft_vocab.json."""
    path = make_llama(tmp_path_factory.mktemp("trimmed") / "draft", len(DRAFT_IDS) + 1, seed=7, hidden=16,
                      logit_scale=8.0)
    DraftVocab(DRAFT_IDS, AUTHORITY_VOCAB).save(path)
    return path


def test_rows_are_the_models_logits_at_its_ids_and_minus_inf_elsewhere(trimmed):
    from transformers import AutoModelForCausalLM

    worker = HFWorker(str(trimmed), "float32", "cpu")
    assert worker.vocab_size == AUTHORITY_VOCAB
    model = AutoModelForCausalLM.from_pretrained(trimmed, dtype=torch.float32).eval()
    tokens = [0, 4, 2, 1, 5, 3]  # 0, 2 and 5 are outside: fed to the model as OTHER (row 3)
    rows = worker.score(["s"], [tokens], [3])[0]
    with torch.inference_mode():
        want = model(torch.tensor([[3, 0, 3, 1, 3, 2]])).logits[0, -3:]
    assert torch.equal(rows[:, DRAFT_IDS], want[:, :3])
    outside = [t for t in range(AUTHORITY_VOCAB) if t not in DRAFT_IDS]
    assert torch.isinf(rows[:, outside]).all() and (rows[:, outside] < 0).all()
    from cascade.sampling import Sampling

    probs = worker.score_probs(["t"], [tokens], [2], Sampling(temperature=1.0))[0]
    assert torch.all(probs[:, outside] == 0) and torch.allclose(probs.sum(-1), torch.ones(2, dtype=probs.dtype))


def test_a_draft_vocab_that_does_not_fit_the_model_is_refused(trimmed, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(trimmed, bad)
    DraftVocab([1, 2], AUTHORITY_VOCAB).save(bad)
    with pytest.raises(ValueError, match="lists 2 tokens \\+ OTHER but the model has 4 output rows"):
        HFWorker(str(bad), "float32", "cpu")
    with pytest.raises(ValueError, match="distinct authority ids"):
        DraftVocab([1, 1], AUTHORITY_VOCAB)
    assert (trimmed / FILE).is_file()


def _topology(tmp_path, trimmed) -> str:
    levels = [{"name": "draft", "model": str(trimmed), "device": "cpu"},
              {"name": "large", "kind": "table_worker:TableWorker",
               "params": {"vocab_size": AUTHORITY_VOCAB, "seed": 11, "scale": 2.0}}]
    data = {"levels": levels, "policy": {"name": "fixed", "params": {"lookahead": 2}}}
    return str(write_topology(tmp_path / "trimmed.yaml", data))


def _draw(topology: str, n: int, seed: int, **sampling) -> Counter:
    with Cascade.from_topology(topology) as c:
        results = c.generate([[0]] * n, max_new_tokens=2, seed=seed, batch_size=256, coupling="residual", **sampling)
    proposed = sum(g.stats.edges["draft->large"].proposed for g in results)
    assert proposed > n / 2  # the trimmed drafter really drafted
    return Counter(tuple(g.token_ids[:2]) for g in results)


def test_trimmed_drafter_output_is_exact(tmp_path, trimmed):
    """100k draws of the first two tokens through the engine; the authority's distribution is
    known by enumeration (its table is the same as the 2-level table topology's authority, tests/draws.py)."""
    n = 100_000
    counts = _draw(_topology(tmp_path, trimmed), n, seed=3, temperature=1.0)
    expected = exact_pairs(2, 1.0, 0, 1.0)
    assert any(counts[(a, b)] for a, b in counts if a not in DRAFT_IDS)  # reached through the residual
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue, total_variation(counts, expected, n))
    assert total_variation(counts, expected, n) < 0.012


def test_trimmed_drafter_negative_control(tmp_path, trimmed, monkeypatch):
    monkeypatch.setattr(cascade.engine, "verify_blocks", per_row(verify_ignoring_draft_probs))
    n = 20_000
    counts = _draw(_topology(tmp_path, trimmed), n, seed=4, temperature=1.0)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(2, 1.0, 0, 1.0), n)
    assert pvalue < 1e-9


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.3, top_k=2), dict(temperature=1.0, coupling="gumbel"),
], ids=["greedy", "t1", "top_p", "top_k", "keyed"])
def test_drafts_warped_over_the_draft_columns_are_the_wide_rows_draws(trimmed, sampling):
    """Worker.draft warps a trimmed drafter's rows over its draft columns alone (ascending ids,
    DRAFT_IDS is not): its rows and tokens are those of the authority-width rows (-inf outside)
    warped and drawn as before, keyed races included (noise at authority ids)."""
    from cascade.sampling import Sampling, position_keys

    sampling = Sampling(**sampling)
    worker = Told(HFWorker(str(trimmed), "float64", "cpu"))  # as the engine drives it
    assert worker.draft_columns.tolist() == sorted(DRAFT_IDS)
    gen = torch.Generator().manual_seed(5)
    for trial in range(60):
        prompt = torch.randint(0, AUTHORITY_VOCAB, (4,), generator=gen).tolist()
        draws = (position_keys(trial, range(3)) if sampling.rule.keyed
                 else torch.rand(3, generator=gen, dtype=torch.float64))
        draft = worker.draft([f"d{trial}"], [prompt], [3], sampling, [draws])[0]
        seq = list(prompt)
        for j, token in enumerate(draft.tokens):
            wide = sampling.probs(worker.score(["wide"], [seq], [1])[0])  # [1, authority vocab]
            torch.testing.assert_close(draft.probs[j], wide[0], rtol=0, atol=1e-12)
            assert token == int(sampling.draw(wide, draws[j:j + 1])[0])
            row = worker.score(["wide"], [seq], [1])[0][0].double()
            assert draft.confidence[j] == pytest.approx(float(torch.softmax(row, -1)[token]), abs=1e-12)
            seq.append(token)
