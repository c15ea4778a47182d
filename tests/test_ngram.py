"""The n-gram level (prompt lookup): what it proposes, and how a stop rule ends its blocks."""
from __future__ import annotations

import torch

from cascade.sampling import Sampling
from policies.stops import CalibratedStop, ConfidenceStop, EntropyStop
from workers.ngram import NGramWorker

TEXT = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6]  # "5 6" recurs: the continuation is 7 8 9 ...


def draft(worker, rows, budget, stop=None):
    return worker.draft([str(i) for i in range(len(rows))], rows, [budget] * len(rows), Sampling(),
                        [torch.zeros(0)] * len(rows), stop)


def test_it_proposes_the_continuation_of_the_longest_recent_match():
    worker = NGramWorker(32, max_ngram=3, min_ngram=1)
    assert worker.lookup(TEXT, 4) == [7, 8, 9, 10]
    assert worker.lookup([1, 2, 3], 4) == []  # no earlier occurrence
    assert NGramWorker(32, max_ngram=3, min_ngram=3).lookup(TEXT, 4) == []  # "5 6" is only a 2-gram
    (d,) = draft(worker, [TEXT], 6)
    assert d.tokens == [7, 8, 9, 10, 11, 12] and not d.stopped_early and d.forward_passes == 0
    assert torch.equal(d.probs.argmax(-1), torch.tensor(d.tokens)) and d.probs.sum().item() == 6
    assert d.confidence == [1.0] * 6


def test_a_calibrated_stop_ends_its_blocks_where_more_tokens_stop_paying():
    """Its tokens have probability 1, so a confidence or entropy stop never fires; ``auto``'s
    calibrated stop reads the n-gram level's measured acceptance and cuts a long block."""
    worker = NGramWorker(32, max_ngram=3, min_ngram=1)
    table = lambda p: (p,) * 12  # noqa: E731 - one acceptance whatever the bin
    for never in (ConfidenceStop(0.5), EntropyStop(0.5), CalibratedStop(table(0.9), table(0.9), 0.0)):
        (d,) = draft(worker, [TEXT], 6, never)
        assert len(d.tokens) == 6 and not d.stopped_early
    # survival 0.6, 0.3, 0.15: below 0.2 after the third token
    (d,) = draft(worker, [TEXT], 6, CalibratedStop(table(0.6), table(0.5), 0.2))
    assert d.tokens == [7, 8, 9] and d.stopped_early and d.probs.shape == (3, 32)
    # a block the match ends before the stop would is not cut by it
    (d,) = draft(worker, [[1, 2, 3, 1, 2]], 6, CalibratedStop(table(0.9), table(0.9), 0.2))
    assert d.tokens == [3, 1, 2] and not d.stopped_early
    # rows of a batch go on or stop together, as a model drafter's do: the sum of survivals
    rows = [TEXT, [1, 2, 3, 4, 5, 6, 7, 1, 2]]
    long, short = draft(worker, rows, 6, CalibratedStop(table(0.6), table(0.5), 0.2))
    assert long.tokens == [7, 8, 9] and short.tokens == [3, 4, 5]
    assert draft(worker, [TEXT, [9, 8]], 6, CalibratedStop(table(0.6), table(0.5), 0.2))[0].tokens == [7, 8]
