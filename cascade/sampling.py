"""Sampling: a request's parameters, declared once, and the math that turns a level's rows into tokens.

- **Parameters.** Each sampling parameter's type, range and meaning is declared here once
  (:data:`Temperature`, :data:`TopK`, :data:`TopP`, :data:`Seed`, :data:`CouplingName`) and
  reused by :class:`Sampling` (what a level samples with), :class:`SamplingOverride` (a draft
  level's own), :class:`SamplingParams` (what a request asks for: ``Cascade.generate``'s keyword
  arguments, :class:`cascade.validation.GenerationParams`, the HTTP request,
  :mod:`cascade.serve.protocol`) and the Ray wire (``Sampling.model_dump()``).
- **Warping.** :func:`sampling_probs`: temperature, then top-k, then top-p.
- **Drawing.** How a row and a draw give a token, for each coupling: by inverse CDF with a
  uniform from the request's generator (``"residual"``), or by the exponential race with noise
  keyed by (seed, position) (``"gumbel"``). A :class:`Coupling` holds each one's draws, its
  draw and which acceptance rule verifies it; :attr:`Sampling.rule` is the one place it is chosen.

No models, no caches, no Ray here; acceptance is :mod:`cascade.verify`.
"""
from __future__ import annotations

import abc
from typing import Annotated, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

# -- the parameters, declared once ------------------------------------------------------------------

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes 64 bits; prompt i of a list uses seed + i

Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False,
                                     description="0 = greedy (argmax); >0 divides the logits.")]
TopK = Annotated[int, Field(ge=0, description="Keep the k most likely tokens; 0 = off.")]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False,
                              description="Keep the smallest set of mass >= top_p; 1 = off.")]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT, description="Seeds the request's generator (and its keyed noise).")]
CouplingName = Literal["residual", "gumbel"]
COUPLING_HELP = (
    "How drafts and verifiers share randomness. 'residual': the speculative rule (accept with "
    "min(1, target/draft), else resample the residual): the most acceptance, but a seed's tokens "
    "depend on where blocks fall. 'gumbel': per-position noise keyed by (seed, position), the same "
    "at every level: a seed gives the same tokens whatever the policy, batch or backend, for "
    "somewhat lower acceptance. Unset: 'gumbel' for a request with a seed (a seed means the same "
    "tokens), else 'residual' (resolved when the request starts: Engine.start)."
)


class Sampling(BaseModel):
    """How a level turns logits into the distribution it samples from, and how it draws.

    The authority always samples with the user's parameters; drafts use them too unless their
    level overrides some fields (``LevelSpec.sampling``). Exactness holds either way because
    verification sees the distribution each draft really sampled from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf would sample noise

    temperature: Temperature = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    coupling: CouplingName | None = Field(None, description=COUPLING_HELP)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def rule(self) -> "Coupling":
        """The coupling this sampling draws with (unset: residual, the rule of an unseeded request)."""
        return COUPLINGS[self.coupling or "residual"]

    def for_seed(self, seed: int | None) -> "Sampling":
        """This sampling with its coupling decided: an explicit one is kept; unset, a request
        with a seed gets 'gumbel' (its tokens then follow the seed alone, whatever the policy,
        batch or backend) and one without gets 'residual' (the most acceptance)."""
        if self.coupling is not None:
            return self
        return self.model_copy(update={"coupling": "residual" if seed is None else "gumbel"})

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [..., vocab]
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)

    def draws(self, seed: int, generator: torch.Generator, start: int, n: int) -> torch.Tensor:  # [n] float64
        """A sequence's randomness for its positions ``start .. start + n - 1`` (see :class:`Coupling`)."""
        return self.rule.draws(seed, generator, start, n)

    def draw(self, probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:  # [n, vocab], [n] -> [n]
        """One token per row of ``probs`` (rows of :meth:`probs`) with the row's draw. Greedy rows
        are one-hot, for which every coupling draws the hot token: taken directly (no cumulative
        sum over the vocabulary)."""
        if self.greedy:
            return probs.argmax(-1)
        return self.rule.draw(probs, draws)


class SamplingOverride(BaseModel):
    """Per-level overrides for a draft's sampling; unset fields follow the request."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf would sample noise

    temperature: Temperature | None = Field(None, description="Draft temperature; 0 = greedy drafts.")
    top_k: TopK | None = Field(None, description="Draft top-k; 0 = off.")
    top_p: TopP | None = Field(None, description="Draft top-p; 1 = off.")

    def apply(self, base: Sampling) -> Sampling:
        changes = self.model_dump(exclude_none=True)
        return base.model_copy(update=changes) if changes else base


class SamplingParams(BaseModel):
    """A request's sampling parameters as asked for: unset ones follow the topology's
    ``sampling`` (:meth:`resolve`); an unset seed is drawn when the request starts."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    temperature: Temperature | None = Field(None, description="0 = greedy; unset: the topology's.")
    top_k: TopK | None = Field(None, description="0 = off; unset: the topology's.")
    top_p: TopP | None = Field(None, description="1 = off; unset: the topology's.")
    seed: Seed | None = Field(None, description="Seeds the request's generator; unset: drawn.")
    coupling: CouplingName | None = Field(None, description=COUPLING_HELP)

    def resolve(self, defaults: Sampling) -> Sampling:
        """The sampling to run with: the parameters given, the rest from ``defaults``."""
        changes = self.model_dump(include=set(Sampling.model_fields), exclude_none=True)
        return defaults.model_copy(update=changes) if changes else defaults


# -- warping -------------------------------------------------------------------------------------------

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
    if temperature == 0:  # written in place: one_hot would build an int64 row first
        hot = logits.new_zeros(logits.shape, dtype=dtype)
        return hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # divided in place where the cast made a copy (the same quotients as a new tensor)
    logits = logits.to(dtype).div_(temperature) if logits.dtype != dtype else logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs.reshape(-1, vocab), top_p).reshape(probs.shape)
    return probs


NUCLEUS_FIRST_K = 128  # the ranks a nucleus is first looked for in; 8x more each time they fall short


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:  # [n, vocab] -> [n, vocab]
    """Top-p: keep a token while the mass ranked strictly above it is below ``top_p`` (the
    smallest set reaching ``top_p``, never an empty one), renormalised.

    Sorting a whole row of a large vocabulary on one CPU thread costs more than a small model's
    forward pass (docs/results-log.md), and a verifier warps every position of a block. The nucleus lies inside the ``k`` most
    likely tokens as soon as their mass reaches ``top_p`` (a token ranked lower has at least that
    much above it), so each row is ranked with ``topk`` over 128, then 1,024, 8,192 ... tokens,
    and sorted whole only where even those fall short."""
    vocab = probs.shape[-1]
    out = torch.zeros_like(probs)
    rows = torch.arange(probs.shape[0], device=probs.device)
    part, k = probs, NUCLEUS_FIRST_K
    while rows.numel():
        if k < vocab:
            ranked, order = torch.topk(part, k, dim=-1)  # sorted, most likely first
            mass = ranked.cumsum(-1)
            found = mass[:, -1] >= top_p
            ranked, order, mass = ranked[found], order[found], mass[found]
        else:
            ranked, order = torch.sort(part, dim=-1, descending=True)
            mass, found = ranked.cumsum(-1), torch.ones_like(rows, dtype=torch.bool)
        kept = ranked.masked_fill(mass - ranked >= top_p, 0.0)
        out[rows[found].unsqueeze(-1), order] = kept / kept.sum(-1, keepdim=True)
        rows, k = rows[~found], k * 8
        part = probs[rows]
    return out


# -- drawing: the two couplings -------------------------------------------------------------------------

class Coupling(abc.ABC):
    """How a request's levels share randomness: the draws a sequence consumes at its positions,
    how a row and its draw give a token, and (``keyed``) which acceptance rule verifies."""

    #: True: a level's token at a position is decided by the position's key alone, so a verifier
    #: keeps drafts while they equal its own draws (cascade.verify.verify_block_keyed); False:
    #: the speculative rule over the rows the drafts were sampled from (cascade.verify.verify_block)
    keyed: bool

    @abc.abstractmethod
    def draws(self, seed: int, generator: torch.Generator, start: int, n: int) -> torch.Tensor:  # [n] float64
        """The randomness of a sequence's positions ``start .. start + n - 1``."""

    @abc.abstractmethod
    def draw(self, probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:  # [n, vocab], [n] -> [n] long
        """One token per row, with the row's draw."""


class ResidualCoupling(Coupling):
    """The speculative rule's own coupling: uniforms from the request's generator, consumed in
    order, a token by inverse CDF."""

    keyed = False

    def draws(self, seed, generator, start, n):
        return torch.rand(n, generator=generator, dtype=torch.float64)

    def draw(self, probs, draws):
        return sample_with_uniform(probs, draws)


# The residual coupling couples a draft and its verifier optimally per token, but the draws it
# consumes depend on where blocks start and end, so a seed reproduces tokens only when every
# decision about blocks does. Here every position of a sequence has its own noise, generated from
# (the request's seed, the position) alone, and every level samples by the exponential race
# (Gumbel-max) with that same noise: ``token = argmax_v probs[v] / E_v``, ``E_v ~ Exp(1)`` i.i.d.
# A verifier keeps the drafted tokens while they equal its own sample at each position and then
# emits its own sample. So the committed token at each position is the authority's own sample
# with that position's noise: an exact sample (the noise of a position is independent of the
# tokens before it), and the same tokens for a seed whatever the path, lookahead, batch or backend.

class KeyedCoupling(Coupling):
    """``coupling="gumbel"``: a position's draw is its key, a function of (seed, position) alone,
    so block boundaries cannot move it; a token is the race winner with the key's noise."""

    keyed = True

    def draws(self, seed, generator, start, n):
        return position_keys(seed, range(start, start + n))

    def draw(self, probs, draws):
        return sample_with_keys(probs, draws)


#: the one place the coupling is chosen (Sampling.rule)
COUPLINGS: dict[str, Coupling] = {"residual": ResidualCoupling(), "gumbel": KeyedCoupling()}


def sample_with_uniform(
    probs: torch.Tensor,  # [..., vocab], rows need not be normalised
    uniforms: torch.Tensor,  # [...], in [0, 1)
) -> torch.Tensor:  # [...] long
    """Inverse-CDF sampling: the token whose cumulative-mass interval contains ``u * total``.

    A token of zero mass has an empty interval and can never be returned.

    Where a batch's mass sits on few tokens (top-p, top-k, one-hot greedy rows, a draft
    vocabulary) the cumulative sums run over those tokens alone (:func:`_sample_sparse`, the
    same tokens bit for bit), not over every row's whole vocabulary in float64.
    """
    rows = probs.reshape(-1, probs.shape[-1])
    if _sparse(rows):
        row, token = rows.nonzero(as_tuple=True)
        counts = torch.bincount(row, minlength=rows.shape[0])
        if bool((counts > 0).all()):
            return _sample_sparse(rows, row, token, counts, uniforms.reshape(-1)).reshape(probs.shape[:-1])
    cdf = probs.to(torch.float64).cumsum(-1)
    point = uniforms.to(torch.float64).unsqueeze(-1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, point, right=True).squeeze(-1)
    if idx.dim() == 0:  # one row
        if int(idx) < probs.shape[-1]:
            return idx
        return (probs > 0).nonzero()[-1, 0]
    # u * total can round up to total itself; fall back to the last token with mass.
    if not bool((idx >= probs.shape[-1]).any()):
        return idx
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_positive)


def _sample_sparse(
    rows: torch.Tensor,  # [n, vocab]
    row: torch.Tensor,  # [m]: the row of each entry with mass, rows in order
    token: torch.Tensor,  # [m]: its token, ascending within a row
    counts: torch.Tensor,  # [n]: entries with mass per row, each >= 1
    uniforms: torch.Tensor,  # [n]
) -> torch.Tensor:  # [n] long
    """:func:`sample_with_uniform` over each row's tokens with mass, packed left
    (:func:`_packed`). A running float64 sum is unchanged by the zeros it skips (x + 0 == x), so
    every cumulative sum and total is the dense one, and the first entry whose sum exceeds
    ``u * total`` is the dense search's token; past the last (the point rounded up to the
    total) it is the last token with mass, as the dense fallback."""
    mass, tokens = _packed(row, token, counts, rows[row, token].to(torch.float64))
    cdf = mass.cumsum(-1)
    point = uniforms.to(device=cdf.device, dtype=torch.float64).unsqueeze(-1) * cdf[:, -1:]
    at = torch.searchsorted(cdf, point, right=True).squeeze(-1)
    return tokens.gather(-1, torch.minimum(at, counts - 1).unsqueeze(-1)).squeeze(-1)


def _packed(
    row: torch.Tensor,  # [m]: rows in order
    token: torch.Tensor,  # [m]: ascending within a row
    counts: torch.Tensor,  # [n]: entries per row
    values: torch.Tensor,  # [m] float64
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, most] float64 (zero-padded), [n, most] long
    """Each row's entries moved left into a ``[n, most]`` block, in token order, with their
    tokens beside them: a scan or an argmax over a row's block meets its entries in the order
    it meets them over the whole row."""
    starts = counts.cumsum(0) - counts
    col = torch.arange(row.numel(), device=row.device) - starts[row]
    shape = (counts.shape[0], int(counts.max()))
    packed = torch.zeros(shape, dtype=torch.float64, device=values.device)
    packed[row, col] = values
    tokens = torch.zeros(shape, dtype=torch.long, device=row.device)
    tokens[row, col] = token
    return packed, tokens


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
    return _noise_at(keys.to(torch.int64).reshape(-1, 1), torch.arange(vocab, dtype=torch.int64), vocab)


def _noise_at(keys: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # int64, broadcast -> float64
    """:func:`race_noise` at the given (key, token) pairs only: entry ``v`` of a key's noise
    depends on ``(k, v)`` alone, so any subset of a row is computed exactly as the whole row."""
    z = _splitmix64_tensor(keys * vocab + tokens)
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
    A token of zero mass never wins (its ratio is 0, and some token has mass).

    Only tokens with mass can win, so where a row's mass sits on few tokens (top-p, top-k, a
    draft vocabulary) the noise is computed there alone (:func:`_noise_at`, the same values),
    several times cheaper than over the whole vocabulary (docs/results-log.md).
    The winner is the same either way (zero-mass tokens hold ratio 0 in both)."""
    rows = probs.reshape(-1, probs.shape[-1])
    keys = keys.reshape(-1)
    if not _sparse(rows):
        ratios = rows.to(torch.float64) / race_noise(keys, rows.shape[-1]).to(rows.device)
    else:  # the noise on the CPU, as race_noise computes it
        row, token = rows.nonzero(as_tuple=True)
        where = keys.cpu().to(torch.int64)[row.cpu()], token.cpu()
        noise = _noise_at(*where, rows.shape[-1]).to(rows.device)
        counts = torch.bincount(row, minlength=rows.shape[0])
        if bool((counts > 0).all()):  # each row's race over its tokens with mass alone (_packed)
            ratios, tokens = _packed(row, token, counts, rows[row, token].to(torch.float64) / noise)
            return tokens.gather(-1, ratios.argmax(-1, keepdim=True)).reshape(probs.shape[:-1])
        ratios = torch.zeros(rows.shape, dtype=torch.float64, device=rows.device)
        ratios[row, token] = rows[row, token].to(torch.float64) / noise
    return ratios.argmax(-1).reshape(probs.shape[:-1])


#: the race computes noise over the tokens with mass alone where they are under 1/this of the rows
SPARSE_RACE_FRACTION = 4


def _sparse(rows: torch.Tensor) -> bool:
    """Whether the tokens with mass are under ``1 / SPARSE_RACE_FRACTION`` of ``rows``' entries:
    counted without listing them (listing every entry of dense rows costs more than sampling them)."""
    return int(torch.count_nonzero(rows)) * SPARSE_RACE_FRACTION < rows.numel()
