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
request, seeded) and any backend reproduces the same tokens from the same seed. How rows are
warped and drawn from is :mod:`cascade.sampling`. No models, no caches, no Ray here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cascade.sampling import sample_with_uniform


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
    recovered_from = residual(target_probs[accepted], draft_probs[accepted])
    return Verdict(accepted, int(sample_with_uniform(recovered_from, uniforms[n])), False)


def residual(
    target_row: torch.Tensor,  # [vocab]
    draft_row: torch.Tensor,  # [vocab]
) -> torch.Tensor:  # [vocab], not normalised
    """Where a rejection sends the mass: ``max(0, target_row - draft_row)``, up to its total (a
    recovered token is drawn from it; :mod:`cascade.tree` tries the next sibling against it)."""
    dtype = torch.promote_types(target_row.dtype, draft_row.dtype)
    if target_row.dtype != dtype:
        target_row = target_row.to(dtype)
    mass = (target_row - draft_row).clamp(min=0)
    # The residual is all zeros only through rounding (target == draft at this row); the
    # target row is then the right distribution to fall back to. (A sum of non-negative
    # numbers is 0 only if all are.)
    if not float(mass.sum()) > 0:
        return target_row
    return mass


def verify_blocks(
    draft_tokens: Sequence[Sequence[int]],  # per row: [n_b]
    draft_probs: Sequence[torch.Tensor | None],  # per row: [n_b, vocab]
    target_probs: Sequence[torch.Tensor],  # per row: [n_b + 1, vocab]
    uniforms: Sequence[torch.Tensor],  # per row: [n_b + 1]
) -> list[Verdict]:
    """Verify several sequences' blocks (ragged lengths), one verdict each."""
    return [verify_block(*row) for row in zip(draft_tokens, draft_probs, target_probs, uniforms)]


# -- the keyed coupling (``Sampling.coupling == "gumbel"``, cascade/sampling.py) -----------------------
#
# Every level draws a position's token by the race with that position's noise (``KeyedCoupling``),
# so a verifier's output is its own draw whatever was proposed: it keeps the drafted tokens while
# they equal its draws. Given the keys both levels' rows are one-hot at their draws, and this is
# the rule above for one-hot rows (DESIGN.md §2, rule 4).


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
