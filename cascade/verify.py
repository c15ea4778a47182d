"""The exact acceptance rule of speculative sampling, as pure tensor functions.

Names, by role (never ``p``/``q``):

- ``draft_probs``: the distribution each proposed token was *really* sampled from, by the
  proposing level (after its own temperature/top-k/top-p; one-hot for greedy or n-gram drafts).
- ``target_probs``: the verifying level's sampling distribution at the same positions, plus one
  more row for the position after the block.
- ``accepted``: how many leading proposed tokens are kept.
- ``recovered``: the token emitted at the first rejection, sampled from
  ``normalize(max(0, target_probs[j] - draft_probs[j]))``.
- ``bonus``: the token emitted when the whole block is accepted, sampled from
  ``target_probs[n]`` (the verifier computed that row anyway).

Randomness is passed in as uniforms in [0, 1) so that the caller owns the generator (one per
request, seeded) and any backend reproduces the same tokens from the same seed. No models, no
caches, no Ray here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def sampling_probs(
    logits: torch.Tensor,  # [..., vocab]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., vocab]
    """The distribution a level samples from: temperature, then top-k, then top-p.

    ``temperature == 0`` means greedy: a one-hot row at the (first) argmax. ``top_k == 0`` and
    ``top_p == 1`` switch those filters off. Computed in at least float32.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass ranked strictly above it is below top_p: the smallest
        # set reaching top_p, and never an empty one.
        mass_above = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_above >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_with_uniform(
    probs: torch.Tensor,  # [..., vocab], rows need not be normalised
    uniforms: torch.Tensor,  # [...], in [0, 1)
) -> torch.Tensor:  # [...] long
    """Inverse-CDF sampling: the token whose cumulative-mass interval contains ``u * total``.

    A token of zero mass has an empty interval and can never be returned.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    point = uniforms.to(torch.float64).unsqueeze(-1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, point, right=True).squeeze(-1)
    if idx.dim() == 0:  # one row: the common case, kept cheap
        if int(idx) < probs.shape[-1]:
            return idx
        return (probs > 0).nonzero()[-1, 0]
    # u * total can round up to total itself; fall back to the last token with mass.
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_positive)


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block: keep ``accepted`` drafted tokens, then emit ``next_token``."""

    accepted: int
    next_token: int
    bonus: bool  # True: all drafted tokens accepted and next_token is the bonus token


def verify_block(
    draft_tokens: torch.Tensor | list[int],  # [n] long
    draft_probs: torch.Tensor | None,  # [n, vocab]; None when n == 0
    target_probs: torch.Tensor,  # [n + 1, vocab]
    uniforms: torch.Tensor,  # [n + 1]: n accept/reject draws, then one for the emitted token
) -> Verdict:
    """Verify one proposed block with the exact rule (cascade/DESIGN.md §2).

    1. Accept ``x_j`` with probability ``min(1, target[j, x_j] / draft[j, x_j])``, in order.
    2. At the first rejection ``j``: emit a recovered token from
       ``normalize(max(0, target[j] - draft[j]))`` and discard the rest.
    3. All accepted: emit a bonus token from ``target[n]``.
    Greedy is the same rule with one-hot rows.
    """
    tokens = torch.as_tensor(draft_tokens, dtype=torch.long)
    n = tokens.shape[0]
    accepted = 0
    if n:
        positions = torch.arange(n)
        target_at = target_probs[positions, tokens].tolist()
        draft_at = draft_probs[positions, tokens].tolist()
        draws = uniforms[:n].tolist()
        # u < min(1, t/d)  <=>  u * d < t: no division, and a token the drafter gave no mass
        # (impossible for a real sample) is rejected.
        while accepted < n and draft_at[accepted] > 0 and draws[accepted] * draft_at[accepted] < target_at[accepted]:
            accepted += 1
    # The emitted token gets its own draw (the last one): reusing the draw that rejected x_j
    # would correlate the two, since that draw is conditioned to lie above the acceptance ratio.
    if accepted == n:
        return Verdict(n, int(sample_with_uniform(target_probs[n], uniforms[n])), True)
    target_row = target_probs[accepted].to(torch.promote_types(target_probs.dtype, draft_probs.dtype))
    residual = (target_row - draft_probs[accepted]).clamp(min=0)
    # The residual is all zeros only through rounding (target == draft at this row); the
    # target row is then the right distribution to fall back to.
    if not bool((residual > 0).any()):
        residual = target_row
    return Verdict(accepted, int(sample_with_uniform(residual, uniforms[n])), False)


def verify_blocks(
    draft_tokens: Sequence[Sequence[int]],  # per row: [n_b]
    draft_probs: Sequence[torch.Tensor | None],  # per row: [n_b, vocab]
    target_probs: Sequence[torch.Tensor],  # per row: [n_b + 1, vocab]
    uniforms: Sequence[torch.Tensor],  # per row: [n_b + 1]
) -> list[Verdict]:
    """Verify several sequences' blocks (ragged lengths), one verdict each."""
    return [verify_block(*row) for row in zip(draft_tokens, draft_probs, target_probs, uniforms)]


# -- position-keyed randomness (``Sampling.coupling == "gumbel"``) ---------------------------------
#
# The default rule above couples a draft and its verifier optimally per token, but the draws it
# consumes depend on where blocks start and end, so a seed reproduces tokens only when every
# decision about blocks does. Here every position of a sequence has its own noise, generated from
# (the request's seed, the position) alone, and every level samples by the exponential race
# (Gumbel-max) with that same noise: ``token = argmax_v probs[v] / E_v``, ``E_v ~ Exp(1)`` i.i.d.
# A verifier keeps the drafted tokens while they equal its own sample at each position and then
# emits its own sample. So the committed token at each position is the authority's own sample
# with that position's noise: an exact sample (the noise of a position is independent of the
# tokens before it), and the same tokens for a seed whatever the path, lookahead, batch or backend.

_KEY_MASK = (1 << 53) - 1  # a key travels in a uniform's float64 slot: it must stay an exact integer
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_keys(seed: int, positions: Sequence[int]) -> torch.Tensor:  # -> [n] float64, integer-valued
    """One key per (seed, position) pair, in ``[0, 2**53)``: splitmix64 of the seed's own
    splitmix64 plus the position, so nearby seeds and positions give unrelated keys."""
    base = _splitmix64(seed & _MASK64)
    return torch.tensor([float(_splitmix64((base + p) & _MASK64) & _KEY_MASK) for p in positions],
                        dtype=torch.float64)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:  # [n] -> [n, vocab] float64
    """Each key's ``Exp(1)`` noise over the vocabulary: entry ``v`` of key ``k`` is ``-log u`` for
    the uniform ``u`` that splitmix64 of ``(k, v)`` gives. Integer arithmetic on the CPU, so
    every machine and backend computes the same noise."""
    z = keys.to(torch.int64).reshape(-1, 1) * vocab + torch.arange(vocab, dtype=torch.int64)
    z = _splitmix64_tensor(z)
    uniforms = ((z >> 11) & _KEY_MASK).to(torch.float64).add_(0.5).mul_(2.0**-53)  # in (0, 1)
    return uniforms.log_().neg_()


def _splitmix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` on int64 tensors (two's complement wrap-around; logical right shifts)."""
    def shr(x: torch.Tensor, s: int) -> torch.Tensor:
        return (x >> s) & ((1 << (64 - s)) - 1)

    z = z + _signed(0x9E3779B97F4A7C15)
    z = (z ^ shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ shr(z, 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def sample_with_keys(
    probs: torch.Tensor,  # [n, vocab] or [vocab], rows need not be normalised
    keys: torch.Tensor,  # [n] or [] float64 position keys
) -> torch.Tensor:  # [n] or [] long
    """The exponential race: ``argmax_v probs[v] / E_v`` with the keys' noise; ``P(v) = probs[v] / sum``.
    A token of zero mass never wins (its ratio is 0, and some token has mass)."""
    rows = probs.reshape(-1, probs.shape[-1])
    noise = race_noise(keys.reshape(-1), rows.shape[-1]).to(rows.device)
    winners = (rows.to(torch.float64) / noise).argmax(-1)
    return winners.reshape(probs.shape[:-1])


def verify_block_keyed(
    draft_tokens: Sequence[int],  # [n]
    target_tokens: Sequence[int],  # [n + 1]: the verifier's own samples (sample_with_keys) at each position
) -> Verdict:
    """Keep the drafted tokens while they equal the verifier's own keyed samples, then emit the
    verifier's sample at the first difference (or the bonus position). No draft distribution is
    needed: the verifier's output is its own sample, whatever was proposed."""
    n = len(draft_tokens)
    accepted = 0
    while accepted < n and int(draft_tokens[accepted]) == int(target_tokens[accepted]):
        accepted += 1
    return Verdict(accepted, int(target_tokens[accepted]), accepted == n)
