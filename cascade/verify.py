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
    draft_probs: Sequence[torch.Tensor | None],  # per row: [n_b, vocab]; None when n_b == 0
    target_probs: Sequence[torch.Tensor],  # per row: [n_b + 1, vocab]
    uniforms: Sequence[torch.Tensor],  # per row: [n_b + 1]
) -> list[Verdict]:
    """Verify several sequences' blocks (ragged lengths), one verdict each: :func:`verify_block`
    for every row, the same tokens bit for bit, in a few tensor operations for the whole batch
    (a batch's small per-row operations cost more than the arithmetic)."""
    if len(target_probs) < 2:  # nothing to batch
        return [verify_block(*row) for row in zip(draft_tokens, draft_probs, target_probs, uniforms)]
    ns = [len(t) for t in draft_tokens]
    starts = [0]
    for n in ns[:-1]:
        starts.append(starts[-1] + n + 1)
    targets = torch.cat(list(target_probs))  # [sum(n_b + 1), vocab]
    # step 1, every row at once: u * d < t (verify_block says why no division)
    accepted = list(ns)
    drafted = [b for b, n in enumerate(ns) if n]
    draft_offset: dict[int, int] = {}
    drafts = None
    if drafted:
        drafts = torch.cat([draft_probs[b] for b in drafted])  # [sum(n_b), vocab]
        flat_tokens = torch.as_tensor([x for b in drafted for x in draft_tokens[b]], dtype=torch.long)
        target_rows = torch.as_tensor([starts[b] + j for b in drafted for j in range(ns[b])], dtype=torch.long)
        target_at = targets[target_rows, flat_tokens].tolist()
        draft_at = drafts[torch.arange(len(flat_tokens)), flat_tokens].tolist()
        draws = torch.cat([uniforms[b][:ns[b]] for b in drafted]).tolist()
        k = 0
        for b in drafted:
            draft_offset[b] = k
            n, a = ns[b], 0
            while a < n and draft_at[k + a] > 0 and draws[k + a] * draft_at[k + a] < target_at[k + a]:
                a += 1
            accepted[b] = a
            k += n
    # steps 2 and 3: each row's emitted token from its residual (rejected) or its last row (bonus)
    rows = targets[torch.as_tensor([s + a for s, a in zip(starts, accepted)], dtype=torch.long)]
    rejected = [b for b, (a, n) in enumerate(zip(accepted, ns)) if a < n]
    if rejected:
        at = torch.as_tensor(rejected, dtype=torch.long)
        rows = rows.to(torch.promote_types(rows.dtype, drafts.dtype))
        from_draft = drafts[torch.as_tensor([draft_offset[b] + accepted[b] for b in rejected], dtype=torch.long)]
        mass = (rows[at] - from_draft).clamp(min=0)
        # as residual(): an all-zero residual (rounding) falls back to the target row
        rows[at] = torch.where(mass.sum(-1, keepdim=True) > 0, mass, rows[at])
    last = torch.stack([u[n] for u, n in zip(uniforms, ns)])
    emitted = sample_with_uniform(rows, last).tolist()
    return [Verdict(a, int(x), a == n) for a, n, x in zip(accepted, ns, emitted)]


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
