"""Distilling drafters from what ``cascade record`` wrote: the authority's own conversations and its
top-k next-token log-probabilities at every position, so training needs no teacher pass.

``cascade distill --records DIR --draft-vocab N --size S --out OUT`` (:mod:`cascade.train.distill`)
trains a student whose vocabulary is a trimmed *draft vocabulary* (:mod:`workers.draft_vocab`): the
``N`` authority tokens that carry most of the authority's recorded probability mass, plus OTHER
for the rest. The loss is the KL divergence from the teacher to the student on the partition
{each recorded top-k token inside the draft vocabulary, everything else}: the only part of the
teacher's distribution that was recorded, and exactly what a student with that vocabulary can
match. Shards are split by index into training and held-out ones (every ``held_out_every``-th).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Records:
    """Recorded conversations packed into one stream: ``tokens[i]`` and, for the position that
    predicts ``tokens[i + 1]``, the teacher's top-k (``topk_ids[i]`` = -1 where there is none:
    the last token of each conversation)."""

    tokens: torch.Tensor  # [n] int64
    topk_ids: torch.Tensor  # [n, k] int64, -1 = no row
    topk_logp: torch.Tensor  # [n, k] float16
    meta: dict

    @property
    def authority(self) -> str:
        return self.meta["model"]


def load_records(folder: str | Path, held_out: bool, held_out_every: int = 20) -> Records:
    """The training shards (``held_out=False``) or the held-out ones, packed."""
    folder = Path(folder)
    meta_path = folder / "record.json"
    if not meta_path.is_file():
        raise SystemExit(f"cascade distill: {folder} has no record.json (write it with cascade record)")
    meta = json.loads(meta_path.read_text())
    chosen = record_shards(folder, held_out, held_out_every)
    tokens, ids, logp = [], [], []
    for path in chosen:
        shard = torch.load(path, weights_only=False)
        if "topk_ids" not in shard:
            raise SystemExit(f"cascade distill: {path} holds token ids alone (recorded with --top-k 0): a drafter, "
                             "and a draft vocabulary chosen from records, need the top-k; cascade record --keep KEPT "
                             "--out OTHER scores kept ids (one pass a shard)")
        start = 0
        rows = 0
        k = shard["topk_ids"].shape[1]
        for length in shard["lengths"].tolist():
            tokens.append(shard["tokens"][start:start + length].long())
            ids.append(shard["topk_ids"][rows:rows + length - 1].long())
            ids.append(torch.full((1, k), -1, dtype=torch.long))
            logp.append(shard["topk_logprobs"][rows:rows + length - 1])
            logp.append(torch.zeros(1, k, dtype=torch.float16))
            start += length
            rows += length - 1
    return Records(torch.cat(tokens), torch.cat(ids), torch.cat(logp), meta)


def record_shards(folder: str | Path, held_out: bool, held_out_every: int = 20) -> list[Path]:
    """The training shards' paths (``held_out=False``) or the held-out ones': every
    ``held_out_every``-th shard is held out; with fewer shards than that, the last one."""
    folder = Path(folder)
    shards = sorted(folder.glob("shard-*.pt"))
    last = min(held_out_every, len(shards)) - 1
    chosen = [s for i, s in enumerate(shards) if (i % held_out_every == last) == held_out]
    if not chosen:
        raise SystemExit(f"cascade distill: {folder}: no {'held-out' if held_out else 'training'} shards "
                         f"among {len(shards)} (every {held_out_every}th is held out; record at least two)")
    return chosen


def choose_draft_vocab(records: Records, size: int, authority_vocab: int, always=()) -> tuple[list[int], float]:
    """The ``size`` authority tokens with the most recorded teacher probability mass (``always``
    first), and the share of the recorded mass they cover."""
    mass = torch.zeros(authority_vocab, dtype=torch.float64)
    valid = records.topk_ids >= 0
    mass.index_add_(0, records.topk_ids[valid], records.topk_logp[valid].double().exp())
    for t in always:
        mass[t] = float("inf")
    ids = mass.topk(min(size, authority_vocab)).indices.tolist()
    finite = mass.clone()
    finite[torch.isinf(finite)] = 0
    covered = float(finite[ids].sum() / finite.sum()) if finite.sum() > 0 else 1.0
    return ids, covered


@dataclass
class RecordBatch:
    """Windows of the stream in draft ids, with the teacher's top-k mapped to draft ids (-1: no
    row or outside the draft vocabulary) and its log-probabilities."""

    x: torch.Tensor  # [batch, seq_len] draft ids
    topk_ids: torch.Tensor  # [batch, seq_len, k]
    topk_logp: torch.Tensor  # [batch, seq_len, k] float32
    has_row: torch.Tensor  # [batch, seq_len] bool: the teacher has a distribution here

    def to(self, device) -> "RecordBatch":
        return RecordBatch(self.x.to(device), self.topk_ids.to(device), self.topk_logp.to(device),
                           self.has_row.to(device))

    def input_tokens(self) -> int:
        return int(self.has_row.sum())


class RecordSampler:
    """``batch(step)``: a pure function of the seed and the step, like the corpus samplers."""

    def __init__(self, records: Records, vocab, seq_len: int, batch_size: int, seed: int = 0):
        if records.tokens.numel() <= seq_len:
            raise SystemExit(f"cascade distill: the records hold {records.tokens.numel()} tokens, "
                             f"fewer than --seq-len {seq_len}")
        table = torch.tensor(vocab.to_draft(range(vocab.authority_vocab_size)), dtype=torch.long)
        self.x = table[records.tokens]
        ids = records.topk_ids
        mapped = torch.where(ids >= 0, table[ids.clamp(min=0)], torch.full_like(ids, -1))
        self.ids = torch.where(mapped == vocab.other, torch.full_like(mapped, -1), mapped)
        self.has_row = ids[:, 0] >= 0
        self.logp = records.topk_logp
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(self, step: int) -> RecordBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.x.numel() - self.seq_len, (self.batch_size,), generator=g)
        return self._windows(starts)

    def _windows(self, starts) -> RecordBatch:
        idx = starts[:, None] + torch.arange(self.seq_len)
        return RecordBatch(self.x[idx], self.ids[idx], self.logp[idx].float(), self.has_row[idx])

    def all_windows(self, max_windows: int = 64):
        """Consecutive windows from the start (held-out evaluation)."""
        n = min(max_windows, self.x.numel() // self.seq_len)
        starts = torch.arange(n) * self.seq_len
        for i in range(0, n, 8):
            yield self._windows(starts[i:i + 8])


def record_loss(logits: torch.Tensor, batch: RecordBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL on the partition {recorded top-k tokens in the draft vocabulary, the rest}, the student's
    top-1 agreement with the teacher's) — both means over positions with a teacher row.
    ``logits`` [batch, seq_len, draft size + 1], float32; the last column (OTHER) is never predicted."""
    logits = logits.clone()
    logits[..., -1] = float("-inf")
    student = torch.log_softmax(logits, -1)
    inside = batch.topk_ids >= 0
    teacher_p = batch.topk_logp.exp() * inside
    student_logp = student.gather(-1, batch.topk_ids.clamp(min=0))
    student_in = (student_logp.exp() * inside).sum(-1)
    teacher_rest = (1 - teacher_p.sum(-1)).clamp(min=0)
    student_rest = (1 - student_in).clamp(min=1e-6)
    cross = -(teacher_p * student_logp.masked_fill(~inside, 0)).sum(-1) - teacher_rest * student_rest.log()
    entropy = -(teacher_p * batch.topk_logp.masked_fill(~inside, 0)).sum(-1) - teacher_rest * teacher_rest.clamp(min=1e-6).log()
    kl = (cross - entropy)[batch.has_row].mean()
    top1 = (student.argmax(-1) == batch.topk_ids[..., 0])[batch.has_row].float().mean()
    return kl, top1


def evaluate(model, sampler: RecordSampler) -> dict:
    """Held-out KL, top-1 agreement and the expected acceptance at T = 1 of one drafted token,
    sum(min(teacher, student)) over the recorded top-k (a lower bound)."""
    model.eval()
    device = next(model.parameters()).device
    kls, top1s, accept, n = 0.0, 0.0, 0.0, 0
    with torch.no_grad():
        for batch in sampler.all_windows():
            batch = batch.to(device)
            logits = model(input_ids=batch.x).logits.float()
            kl, top1 = record_loss(logits, batch)
            logits[..., -1] = float("-inf")
            q = torch.softmax(logits, -1).gather(-1, batch.topk_ids.clamp(min=0)) * (batch.topk_ids >= 0)
            overlap = torch.minimum(q, batch.topk_logp.exp()).sum(-1)[batch.has_row]
            rows = int(batch.has_row.sum())
            kls += kl.item() * rows
            top1s += top1.item() * rows
            accept += overlap.sum().item()
            n += rows
    return {"kl": kls / max(1, n), "top1_agreement": top1s / max(1, n), "expected_acceptance_t1": accept / max(1, n),
            "positions": n}
