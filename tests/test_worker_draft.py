"""Worker.draft, the batched draft loop every backend shares: stop rules per row and per batch."""
from __future__ import annotations

import torch

from cascade.sampling import Sampling
from policies.estimates import BINS, confidence_bin
from policies.stops import CalibratedStop, ConfidenceStop
from table_worker import TableWorker


def draft(stop, rows=16, max_tokens=12, seed=0):
    worker = TableWorker(vocab_size=6, seed=4, scale=1.5)
    g = torch.Generator().manual_seed(seed)
    prompts = [[i % 6] for i in range(rows)]
    uniforms = [torch.rand(max_tokens, generator=g, dtype=torch.float64) for _ in range(rows)]
    drafts = worker.draft([f"s{i}" for i in range(rows)], prompts, [max_tokens] * rows, Sampling(temperature=1.0),
                          uniforms, stop)
    return drafts, worker.calls


def test_a_per_row_stop_ends_each_block_on_its_own():
    drafts, calls = draft(ConfidenceStop(0.3))
    lengths = [len(d.tokens) for d in drafts]
    assert len(set(lengths)) > 1  # ragged blocks
    assert calls == max(lengths)  # one pass per column, shared by the rows still drafting
    for d in drafts:  # each block ends at its first unsure token, or at the budget
        assert d.stopped_early == (d.confidence[-1] < 0.3)
        assert all(p >= 0.3 for p in d.confidence[:-1])


def test_a_batch_stop_ends_the_blocks_together():
    later = tuple(0.4 if lo < 0.3 else 0.97 for lo in BINS)
    rule = CalibratedStop(tuple(0.9 for _ in BINS), later, threshold=0.3)
    drafts, calls = draft(rule)
    lengths = {len(d.tokens) for d in drafts}
    assert len(lengths) == 1 and lengths.pop() == calls < 12  # same length for all, cut before the budget
    assert all(d.stopped_early for d in drafts)
    # the stop came at the first column where the rows' survivals summed below threshold per row
    survival = torch.ones(len(drafts))
    alone_would_stop = set()
    for j in range(calls):
        table = rule.first if j == 0 else later
        survival *= torch.tensor([table[confidence_bin(d.confidence[j])] for d in drafts])
        assert (survival.sum() < 0.3 * len(drafts)) == (j == calls - 1)
        alone_would_stop |= {b for b in range(len(drafts)) if survival[b] < 0.3 and j < calls - 1}
    assert alone_would_stop  # some rows went on past their own stop: the batch decided
