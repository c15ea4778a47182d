"""The batched sampling paths against their row-by-row references, bit for bit.

A batch of rows is sampled and warped in a few tensor operations (cascade/sampling.py); a
seed's tokens must not depend on that: every vectorised path gives each row exactly what the
plain per-row computation gives, on random inputs and at the edges (one-hot rows, a draw
rounding up to the total, a nucleus of one token, of every token, flat rows past every topk
width, ties, dense and sparse rows in one batch).
"""
from __future__ import annotations

import pytest
import torch

from cascade.sampling import Sampling, position_keys, race_noise, sample_with_keys, sample_with_uniform, sampling_probs

VOCAB = 49152


def reference_uniform(probs: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse CDF over one whole row in float64, as the sampler always defined it."""
    cdf = probs.to(torch.float64).cumsum(-1)
    idx = int(torch.searchsorted(cdf, u.to(torch.float64).reshape(1) * cdf[-1:], right=True))
    return idx if idx < probs.shape[-1] else int((probs > 0).nonzero()[-1, 0])


def random_rows(g: torch.Generator, n: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of every shape a sampler meets: one-hot, a few tokens, a nucleus, dense."""
    rows = torch.zeros(n, vocab, dtype=dtype)
    for r in range(n):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        k = [1, int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(9, 2000, (1,), generator=g)), vocab][kind]
        k = min(k, vocab)
        at = torch.randperm(vocab, generator=g)[:k]
        rows[r, at] = (torch.rand(k, generator=g, dtype=torch.float64) ** 4 + 1e-12).to(dtype)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sample_with_uniform_batch_equals_each_row_alone(dtype):
    g = torch.Generator().manual_seed(3)
    for trial in range(12):
        vocab = [5, 300, VOCAB][trial % 3]
        n = int(torch.randint(1, 33, (1,), generator=g))
        rows = random_rows(g, n, vocab, dtype)
        if trial % 2:  # sparse batches only: the packed path
            rows[:, : vocab // 2] = 0
            rows[:, vocab // 2] += (rows.sum(-1) == 0).to(dtype)
        u = torch.rand(n, generator=g, dtype=torch.float64)
        u[0] = 1 - 2.0**-53  # rounds u * total up to the total: the last token with mass
        u[-1] = 0.0
        got = sample_with_uniform(rows, u)
        want = [reference_uniform(rows[r], u[r]) for r in range(n)]
        assert got.tolist() == want, trial
        assert [int(sample_with_uniform(rows[r], u[r])) for r in range(n)] == want, trial


def test_sample_with_uniform_at_every_boundary_of_a_sparse_row():
    """Draws landing exactly on each cumulative boundary pick the same token packed or dense."""
    row = torch.zeros(VOCAB, dtype=torch.float64)
    at = torch.tensor([7, 100, 101, 30000, VOCAB - 1])
    row[at] = torch.tensor([0.25, 0.125, 0.375, 0.0625, 0.1875], dtype=torch.float64)
    bounds = row[at].cumsum(0)
    u = torch.cat([bounds, bounds - 2.0**-52, torch.tensor([0.0])]).clamp(0, 1 - 2.0**-53)
    got = sample_with_uniform(row.expand(len(u), VOCAB), u)
    assert got.tolist() == [reference_uniform(row, x) for x in u]


@pytest.mark.parametrize("top_p", [1e-6, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_warping_a_batch_equals_each_row_alone(top_p):
    """sampling_probs over a batch (temperature, top-k, top-p with its widening topk) gives each
    row the row it gives alone: peaked and flat rows, bf16 logits with ties, a top-k."""
    g = torch.Generator().manual_seed(11)
    scales = torch.tensor([0.01, 0.3, 1.0, 3.0, 8.0, 40.0])
    logits = (torch.randn(len(scales), VOCAB, generator=g) * scales[:, None]).to(torch.bfloat16)
    logits[2, :50] = logits[2].max()  # a tie at the top
    for temperature, top_k in ((0.8, 0), (1.3, 40), (0.0, 0)):
        batch = sampling_probs(logits, temperature, top_k, top_p)
        for r in range(len(scales)):
            assert torch.equal(sampling_probs(logits[r], temperature, top_k, top_p), batch[r]), (r, temperature)


@pytest.mark.parametrize("coupling", ["residual", "gumbel"])
def test_drawing_a_batch_equals_each_row_alone(coupling):
    """Sampling.draw over a warped batch, each row with its own draw, equals drawing every row
    alone, under both couplings (the keyed race over packed or whole rows)."""
    g = torch.Generator().manual_seed(5)
    sampling = Sampling(temperature=0.8, top_p=0.95, coupling=coupling)
    logits = (torch.randn(32, VOCAB, generator=g) * torch.linspace(0.1, 12, 32)[:, None]).to(torch.bfloat16)
    probs = sampling.probs(logits)
    draws = sampling.draws(42, torch.Generator().manual_seed(42), 17, 32)
    got = sampling.draw(probs, draws)
    assert got.tolist() == [int(sampling.draw(probs[r:r + 1], draws[r:r + 1])) for r in range(32)]
    if coupling == "gumbel":
        assert torch.equal(got, sample_with_keys(probs, draws))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keyed_race_over_packed_rows_equals_the_race_over_whole_rows(dtype):
    """sample_with_keys races each row over its tokens with mass, packed: the winner is the
    whole row's race winner with race_noise (the keyed contract: noise a function of
    (seed, position, token) alone), for sparse batches and mixed ones."""
    g = torch.Generator().manual_seed(9)
    for trial in range(10):
        n = int(torch.randint(1, 33, (1,), generator=g))
        rows = random_rows(g, n, VOCAB, dtype)
        if trial % 2:
            rows[rows.sum(-1) > 0.0] *= (torch.rand(n, VOCAB, generator=g) < 0.01)[rows.sum(-1) > 0.0].to(dtype)
            rows[:, 0] += (rows.sum(-1) == 0).to(dtype)
        keys = position_keys(trial, range(100, 100 + n))
        want = (rows.to(torch.float64) / race_noise(keys, VOCAB)).argmax(-1)
        assert torch.equal(sample_with_keys(rows, keys), want), trial
