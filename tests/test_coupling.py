"""Position-keyed randomness (``coupling="gumbel"``, the default for a request with a seed):
the same tokens for a seed whatever the policy, path, lookahead or batch — under sampling,
token for token — and the pure functions it rests on.

Its exactness by distribution is tested with the residual rule's, by one parametrised test in
tests/test_distribution.py: ≥ 100k draws through the real engine over bigram-table workers
(the default path, a seed and no coupling), against the authority's distribution computed by
enumeration, with a negative control (a rule that accepts every draft) failing the same bound.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from cascade import Cascade
from cascade.engine import Request
from cascade.sampling import SPARSE_RACE_FRACTION, Sampling, position_keys, race_noise, sample_with_keys
from cascade.verify import Verdict, verify_block_keyed
from conftest import write_topology
from draws import VOCAB, table_topology
from stats_util import chi_square_pvalue, total_variation

FOUR_LEVEL = Path(__file__).resolve().parents[1] / "topologies" / "4level.yaml"


# -- the pure functions ---------------------------------------------------------------------------

def test_keyed_samples_follow_the_distribution():
    """200k keyed draws (one position each) from a row with a zero entry: exact frequencies."""
    n = 200_000
    probs = torch.tensor([0.45, 0.3, 0.0, 0.15, 0.1], dtype=torch.float64)
    keys = position_keys(3, range(n))
    tokens = sample_with_keys(probs.expand(n, -1), keys)
    counts = Counter((int(t),) for t in tokens)
    expected = {(v,): float(p) for v, p in enumerate(probs)}
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4 and total_variation(counts, expected, n) < 0.005, (stat, pvalue)
    # one row alone is the same draw as in a batch, and a key always gives the same noise
    assert int(sample_with_keys(probs, keys[17])) == int(tokens[17])
    assert torch.equal(position_keys(3, [5, 6]), position_keys(3, range(7))[5:])
    assert not torch.equal(position_keys(3, [5]), position_keys(4, [5]))


def test_the_race_over_the_tokens_with_mass_is_the_race_over_the_row():
    """Where a row's mass sits on few tokens the race computes their noise alone: the same winner
    as the whole row's race, token for token (ties, one-token rows, batches, a nucleus of a
    49,152-token row), and 200k draws from such a row follow it."""
    gen = torch.Generator().manual_seed(0)

    def whole_row(rows, keys):
        return (rows.to(torch.float64) / race_noise(keys, rows.shape[-1])).argmax(-1)

    for vocab, support, n in ((64, 1, 50), (64, 5, 500), (1000, 40, 200), (49_152, 300, 8)):
        rows = torch.zeros(n, vocab, dtype=torch.float32)
        for r in range(n):
            tokens = torch.randperm(vocab, generator=gen)[:support]
            rows[r, tokens] = torch.rand(support, generator=gen)
            if support > 1 and r % 3 == 0:
                rows[r, tokens[1]] = rows[r, tokens[0]]  # a tie
        keys = position_keys(r, range(n))
        assert (rows > 0).sum() * SPARSE_RACE_FRACTION < rows.numel()  # the subset's path
        assert torch.equal(sample_with_keys(rows, keys), whole_row(rows, keys)), (vocab, support)
    n = 200_000
    probs = torch.zeros(40, dtype=torch.float64)
    probs[[3, 11, 12, 30, 39]] = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    tokens = sample_with_keys(probs.expand(n, -1), position_keys(5, range(n)))
    counts = Counter((int(t),) for t in tokens)
    expected = {(v,): float(p) for v, p in enumerate(probs)}
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4 and total_variation(counts, expected, n) < 0.005, (stat, pvalue)


def test_keyed_verdicts():
    assert verify_block_keyed([1, 2, 3], [1, 2, 3, 4]) == Verdict(3, 4, True)  # all kept, bonus
    assert verify_block_keyed([1, 2, 3], [1, 5, 3, 4]) == Verdict(1, 5, False)  # the verifier's own token
    assert verify_block_keyed([], [2]) == Verdict(0, 2, True)  # nothing proposed


def test_the_same_noise_couples_levels():
    """Two close distributions agree on most keyed draws: the coupling that makes acceptance."""
    n = 20_000
    draft = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).expand(n, -1)
    target = torch.tensor([0.45, 0.35, 0.2], dtype=torch.float64).expand(n, -1)
    keys = position_keys(1, range(n))
    agree = (sample_with_keys(draft, keys) == sample_with_keys(target, keys)).double().mean()
    assert agree > 0.85  # total variation 0.05: Gumbel coupling agrees >= (1 - tv) / (1 + tv)


# -- through the engine ------------------------------------------------------------------------------

def _levels(names: list[str]) -> list[dict]:
    seeds = {"tiny": 10, "small": 11, "medium": 12, "large": 13}  # large: the authority of every variant
    return [{"name": n, "kind": "ngram"} if n == "ngram" else
            {"name": n, "kind": "table_worker:TableWorker", "params": {"vocab_size": VOCAB, "seed": seeds[n]}}
            for n in names]


VARIANTS = [  # (levels, policy): the same authority, every other decision different
    (["large"], {"name": "fixed"}),
    (["small", "large"], {"name": "fixed", "params": {"lookahead": 1}}),
    (["tiny", "small", "medium", "large"], {"name": "fixed", "params": {"lookahead": {"tiny": 2, "small": 3,
                                                                                        "medium": 5}}}),
    (["tiny", "small", "medium", "large"], {"name": "confidence", "params": {"lookahead": 6}}),
    (["tiny", "small", "medium", "large"], {"name": "auto", "params": {"explore": 0.3}}),
    (["ngram", "large"], {"name": "fixed", "params": {"lookahead": 3}}),  # one-hot drafts: prompt lookup
    (["ngram", "small", "large"], {"name": "fixed", "params": {"lookahead": {"ngram": 4, "small": 2}}}),
]


def test_same_seed_same_tokens_whatever_the_policy_and_batch(tmp_path):
    """The API table's promise, token for token under sampling: every variant and batch size
    gives what the authority alone gives for each seed, with the default coupling as with
    "gumbel" named (and the residual rule does not)."""
    prompts = [[i % VOCAB, (3 * i) % VOCAB] for i in range(24)]
    outputs, residual, looked_up = [], [], 0
    for v, (names, policy) in enumerate(VARIANTS):
        path = write_topology(tmp_path / f"v{v}.yaml", {"levels": _levels(names), "policy": policy})
        with Cascade.from_topology(path) as c:
            for batch_size, coupling in ((1, None), (5, None), (5, "gumbel")):
                gs = c.generate(prompts, max_new_tokens=20, temperature=1.0, seed=40, coupling=coupling,
                                batch_size=batch_size)
                outputs.append([g.token_ids for g in gs])
                looked_up += sum(e.accepted for g in gs for k, e in g.stats.edges.items() if k.startswith("ngram->"))
            residual.append([g.token_ids for g in c.generate(prompts, max_new_tokens=20, temperature=1.0,
                                                             seed=40, coupling="residual")])
    assert all(out == outputs[0] for out in outputs)
    assert looked_up > 100  # prompt lookup's one-hot drafts were accepted, and changed no token
    assert any(out != residual[0] for out in residual[1:])  # without it, block boundaries move the draws


@pytest.mark.parametrize("coupling,seed,expected", [
    (None, 7, "gumbel"),  # a seed means the same tokens
    (None, None, "residual"),  # no seed: the most acceptance
    ("residual", 7, "residual"),  # named: honoured
    ("gumbel", None, "gumbel"),
])
def test_unset_coupling_follows_the_seed(tmp_path, coupling, seed, expected):
    assert Sampling(temperature=1.0, coupling=coupling).for_seed(seed).coupling == expected
    with Cascade.from_topology(table_topology(tmp_path, 2)) as c:
        request = Request([0], 4, Sampling(temperature=1.0, coupling=coupling), seed)
        assert c.engine.start(request).request.sampling.coupling == expected
        # the API's path: the topology's unset default, then the request's
        assert c.request([0], 4, temperature=1.0, seed=seed, coupling=coupling).request.sampling.coupling == expected


def test_a_seed_gives_the_same_tokens_on_the_bundled_family_under_auto():
    """Issue 28's probe, with the defaults: four calls in a row with ``auto`` on the bundled
    4-level topology at T = 0.8 gave four outputs; a seed now gives one, alone or batched."""
    prompts = ["import os\n", "class Stack:", "def fibonacci(n):\n"]
    kwargs = dict(max_new_tokens=24, temperature=0.8)
    with Cascade.from_topology(FOUR_LEVEL, policy="auto") as c:
        runs = [c.generate("class Stack:", seed=11, **kwargs).token_ids for _ in range(4)]
        assert all(run == runs[0] for run in runs), runs
        alone = [c.generate(p, seed=10 + i, **kwargs).token_ids for i, p in enumerate(prompts)]
        batched = [g.token_ids for g in c.generate(prompts, seed=10, batch_size=3, **kwargs)]  # prompt i: seed + i
    assert alone[1] == runs[0] and batched == alone
