"""verify.py: forced outcomes, a naive reference, warping, sampling, degenerate residuals."""
from __future__ import annotations

import torch

from cascade.sampling import sample_with_uniform, sampling_probs
from cascade.verify import Verdict, verify_block, verify_blocks

BIG = 1e4
V = 5


def one_hot_rows(tokens, vocab=V):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).double()


def target_rows(argmaxes, vocab=V):
    """Near-one-hot target rows from +-large logits."""
    logits = torch.full((len(argmaxes), vocab), -BIG, dtype=torch.float64)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = BIG
    return torch.softmax(logits, -1)


def u(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_full_match_emits_bonus():
    v = verify_block([1, 2, 3], one_hot_rows([1, 2, 3]), target_rows([1, 2, 3, 4]), u(0.5, 0.5, 0.5, 0.3))
    assert v == Verdict(accepted=3, next_token=4, bonus=True)


def test_early_mismatch_recovers_target_token():
    v = verify_block([1, 0, 3], one_hot_rows([1, 0, 3]), target_rows([1, 2, 3, 4]), u(0.9, 0.1, 0.1, 0.7))
    assert v == Verdict(accepted=1, next_token=2, bonus=False)


def test_first_token_rejected():
    v = verify_block([0, 2], one_hot_rows([0, 2]), target_rows([3, 2, 1]), u(0.0, 0.0, 0.99))
    assert v == Verdict(accepted=0, next_token=3, bonus=False)


def test_empty_block_samples_from_target():
    v = verify_block([], None, target_rows([2]), u(0.42))
    assert v == Verdict(accepted=0, next_token=2, bonus=True)


def test_several_sequences_ragged():
    verdicts = verify_blocks(
        [[1, 2], [4], []],
        [one_hot_rows([1, 2]), one_hot_rows([4]), None],
        [target_rows([1, 2, 0]), target_rows([3, 1]), target_rows([2])],
        [u(0.5, 0.5, 0.5), u(0.5, 0.5), u(0.5)],
    )
    assert verdicts == [Verdict(2, 0, True), Verdict(0, 3, False), Verdict(0, 2, True)]


def test_acceptance_uses_ratio_of_target_to_draft():
    # draft gives token 1 mass 0.8, target 0.4: accepted iff u < 0.5
    draft = torch.tensor([[0.1, 0.8, 0.1, 0.0, 0.0]], dtype=torch.float64)
    target = torch.tensor([[0.4, 0.4, 0.2, 0.0, 0.0], [0, 0, 0, 0, 1.0]], dtype=torch.float64)
    assert verify_block([1], draft, target, u(0.49, 0.5)).accepted == 1
    rejected = verify_block([1], draft, target, u(0.51, 0.5))
    # residual = max(0, target - draft) = [0.3, 0, 0.1, 0, 0] -> normalised [0.75, 0, 0.25]
    assert rejected.accepted == 0 and rejected.next_token == 0
    assert verify_block([1], draft, target, u(0.51, 0.8)).next_token == 2


def test_degenerate_residual_falls_back_to_target():
    # A rejection with target == draft can only come from rounding; the residual is then all
    # zeros and the target row is used instead of producing NaN.
    row = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    v = verify_block([1], row, torch.cat([row, row]), u(0.9999, 0.75))
    assert v.accepted == 1  # u * d < t holds for any u < 1 when d == t
    forced = verify_block([1], row * 2, torch.cat([row, row]), u(0.9, 0.75))  # draft > target
    assert forced.accepted == 0 and forced.next_token == 2


def naive_verify(draft_tokens, draft_probs, target_probs, uniforms):
    """The rule written out literally, one position at a time, in plain Python floats."""
    n = len(draft_tokens)
    for j, x in enumerate(draft_tokens):
        ratio = float(target_probs[j][x]) / float(draft_probs[j][x])
        if not float(uniforms[j]) < min(1.0, ratio):
            residual = [max(0.0, float(t) - float(d)) for t, d in zip(target_probs[j], draft_probs[j])]
            if sum(residual) <= 0:
                residual = [float(t) for t in target_probs[j]]
            return j, naive_sample(residual, float(uniforms[n]))
    return n, naive_sample([float(t) for t in target_probs[n]], float(uniforms[n]))


def naive_sample(weights, draw):
    total = sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if draw * total < acc and w > 0:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)


def test_matches_naive_reference_on_random_blocks():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        n = int(torch.randint(0, 6, (1,), generator=g))
        draft_probs = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
        target_probs = torch.softmax(torch.randn(n + 1, V, generator=g, dtype=torch.float64) * 2, -1)
        tokens = [int(torch.multinomial(draft_probs[j], 1, generator=g)) for j in range(n)]
        uniforms = torch.rand(n + 1, generator=g, dtype=torch.float64)
        got = verify_block(tokens, draft_probs if n else None, target_probs, uniforms)
        assert (got.accepted, got.next_token) == naive_verify(tokens, draft_probs, target_probs, uniforms), trial


def test_a_batch_gives_each_rows_verdict_bit_for_bit():
    """verify_blocks verifies a ragged batch in a few tensor operations: the verdicts are
    verify_block's, row by row, with float32 and float64 rows, zero-mass drafts and residuals
    that vanish (target == draft), so seeded tokens do not depend on the batch."""
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        batch = []
        for _ in range(int(torch.randint(1, 9, (1,), generator=g))):
            n = int(torch.randint(0, 5, (1,), generator=g))
            dtype = torch.float32 if torch.rand(1, generator=g) < 0.5 else torch.float64
            draft = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 3, -1).to(dtype)
            target = torch.softmax(torch.randn(n + 1, V, generator=g, dtype=torch.float64) * 3, -1).to(dtype)
            if n and torch.rand(1, generator=g) < 0.3:
                target[0] = draft[0]  # a residual of zero mass: falls back to the target row
            tokens = [int(torch.multinomial(draft[j].double(), 1, generator=g)) for j in range(n)]
            uniforms = torch.rand(n + 1, generator=g, dtype=torch.float64)
            batch.append((tokens, draft if n else None, target, uniforms))
        expected = [verify_block(*row) for row in batch]
        assert verify_blocks(*zip(*batch)) == expected, trial


def test_sampling_probs_greedy_is_one_hot_at_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0]])
    assert sampling_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_sampling_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64))
    top2 = sampling_probs(logits, 1.0, top_k=2)
    assert torch.allclose(top2, torch.tensor([5 / 7, 2 / 7, 0, 0, 0], dtype=torch.float64))
    # smallest set with mass >= 0.8: {0.5, 0.2, 0.15}
    nucleus = sampling_probs(logits, 1.0, top_p=0.8)
    assert torch.allclose(nucleus, torch.tensor([0.5, 0.2, 0.15, 0, 0], dtype=torch.float64) / 0.85)
    # a tiny top_p still keeps the most likely token
    assert sampling_probs(logits, 1.0, top_p=1e-6).tolist() == [1.0, 0, 0, 0, 0]
    hot = sampling_probs(logits, 0.5)
    assert torch.allclose(hot, torch.softmax(logits / 0.5, -1))


def test_top_p_ranks_only_as_far_as_the_nucleus_reaches_and_keeps_the_sorted_rule():
    """sampling_probs finds the nucleus with topk over 128, 1,024, ... ranks: the same tokens and
    masses as ranking the whole row, for peaked rows, flat rows that need every widening, and
    vocabularies smaller than the first width; each row as alone in a batch. Float64 logits: no
    ties in rank and no mass within rounding of top_p, so the verdict holds on any processor."""
    def by_sorting(logits, top_p):
        probs = torch.softmax(logits, -1)
        ranked, order = torch.sort(probs, -1, descending=True)
        ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked >= top_p, 0.0)
        kept = torch.zeros_like(probs).scatter(-1, order, ranked)
        return kept / kept.sum(-1, keepdim=True)

    g = torch.Generator().manual_seed(7)
    for vocab in (5, 100, 49152):
        scales = torch.tensor([0.01, 0.5, 2.0, 4.0, 8.0, 30.0])  # flat (nucleus ~ the vocabulary) .. one-hot
        logits = torch.randn(len(scales), vocab, generator=g, dtype=torch.float64) * scales[:, None]
        for top_p in (0.5, 0.9, 0.95, 0.999):
            got, want = sampling_probs(logits, 1.0, top_p=top_p), by_sorting(logits, top_p)
            assert torch.equal(got > 0, want > 0), (vocab, top_p)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            for i in range(len(scales)):
                assert torch.equal(sampling_probs(logits[i], 1.0, top_p=top_p), got[i])
    widest = (by_sorting(torch.randn(1, 49152, generator=g, dtype=torch.float64) * 0.01, 0.95) > 0).sum()
    assert widest > 8 * 1024  # the flat row went past every topk width, to the full sort


def test_sample_with_uniform_never_returns_zero_mass():
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0], dtype=torch.float64)
    draws = torch.linspace(0, 1 - 1e-16, 1001, dtype=torch.float64)
    tokens = {int(sample_with_uniform(probs, d)) for d in draws}
    assert tokens == {1, 3}
    batch = sample_with_uniform(probs.expand(1001, 5), draws)
    assert set(batch.tolist()) == {1, 3}
    assert int((batch == 1).sum()) in range(295, 306)
