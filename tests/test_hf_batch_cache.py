"""The HF worker's persistent batched cache: a row's logits equal the sequence's solo logits
(float64, to ~1e-10) through ragged rollbacks, joins, leaves, idle rows, subsets and compaction."""
from __future__ import annotations

import random

import pytest
import torch

from told import Told
from workers.hf import HFWorker

TOL = 1e-10


@pytest.fixture(scope="module")
def model(family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float64).eval()


def solo_logits(model, tokens: list[int], n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -n:]


def check(worker, model, seq_ids, token_ids, nums):
    got = worker.score(seq_ids, token_ids, nums)
    assert len(got) == len(seq_ids)
    for toks, n, logits in zip(token_ids, nums, got):
        assert logits.shape == (n, worker.vocab_size)
        torch.testing.assert_close(logits, solo_logits(model, list(toks), n), rtol=0, atol=TOL)


def test_pool_is_used_for_llama_batches_and_a_solo_sequence_joins_it(model):
    worker = HFWorker(model)
    check(worker, model, ["a"], [[1, 2, 3]], [1])  # alone: its own cache (faster at batch 1)
    check(worker, model, ["a"], [[1, 2, 3, 4, 5]], [2])
    assert worker._pool is not None and not worker._pool.row_of and "a" in worker._caches.seqs
    check(worker, model, ["a", "b"], [[1, 2, 3, 4, 5, 6], [7, 8]], [1, 2])  # batched: the pool
    assert set(worker._pool.row_of) == {"a", "b"} and not worker._caches.seqs
    check(worker, model, ["a"], [[1, 2, 3, 4, 9]], [1])  # alone again, but the pool holds it
    assert "a" not in worker._caches.seqs


@pytest.mark.parametrize("lean", [True, False])
def test_a_solo_sequences_cache_grows_in_place_through_rollbacks(model, lean):
    """A solo sequence's cache writes each pass into buffers it keeps (no copy of the whole cache
    a pass, as transformers' DynamicLayer makes), grows them when full and rolls back by its
    length: the logits stay the sequence's own, on the lean forward and on transformers'."""
    worker = HFWorker(model, lean=lean)
    vocab = worker.vocab_size
    rng = random.Random(3)
    toks = [rng.randrange(vocab) for _ in range(5)]
    check(worker, model, ["a"], [toks], [1])
    layer = worker._caches.seqs["a"].cache.layers[0]
    assert type(layer).__name__ == "BufferLayer"
    buffers, grown = layer.kbuf, 0
    for step in range(40):
        cut = rng.randrange(0, 4)  # a rejected block rolls back
        if cut and len(toks) > cut + 1:
            del toks[-cut:]
        width = rng.randrange(1, 9)
        toks.extend(rng.randrange(vocab) for _ in range(width))
        check(worker, model, ["a"], [toks], [width])
        assert layer.length == len(toks) <= layer.capacity
        if layer.kbuf is not buffers:
            buffers, grown = layer.kbuf, grown + 1
    assert len(toks) > 100 and 1 <= grown <= 3  # doubling: a few growths, not one a pass


def test_ragged_batches_equal_solo(model, tokenizer):
    worker = Told(HFWorker(model))  # as the engine drives it
    vocab = worker.vocab_size
    rng = random.Random(0)
    seqs = {s: [rng.randrange(vocab) for _ in range(rng.randrange(3, 20))] for s in "abcd"}
    # prefill of different lengths, several positions each
    check(worker, model, list(seqs), list(seqs.values()), [1, 3, 2, 1])
    for step in range(25):
        ids = list(seqs)
        rng.shuffle(ids)  # call order changes
        nums = []
        for s in ids:
            toks = seqs[s]
            cut = rng.randrange(0, 4)  # roll back up to 3 tokens (a rejected block)
            if cut and len(toks) > cut + 1:
                del toks[-cut:]
            grow = rng.randrange(1, 6)  # then a new block of ragged length
            toks.extend(rng.randrange(vocab) for _ in range(grow))
            nums.append(rng.randrange(1, grow + 1))
        check(worker, model, ids, [seqs[s] for s in ids], nums)
    pool = worker._pool
    assert pool.used <= pool.capacity
    # every row's bookkeeping matches its tokens
    for s, r in pool.row_of.items():
        assert len(pool.cols[r]) == int(pool.valid[r].sum())


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "transformers-forward"])
def test_subsets_idle_rows_joins_and_leaves(model, lean):
    worker = Told(HFWorker(model, lean=lean))  # as the engine drives it
    assert (worker.lean is not None) == lean
    vocab = worker.vocab_size
    rng = random.Random(1)
    seqs = {f"s{i}": [rng.randrange(vocab) for _ in range(rng.randrange(2, 12))] for i in range(12)}
    check(worker, model, list(seqs), list(seqs.values()), [1] * len(seqs))
    next_id = len(seqs)
    for step in range(40):
        # a random subset takes part: large subsets run every row, small ones are gathered
        ids = rng.sample(list(seqs), rng.choice([1, 2, 3, len(seqs) // 2, len(seqs)]))
        for s in ids:
            toks = seqs[s]
            cut = rng.randrange(0, 3)
            if cut and len(toks) > cut + 1:
                del toks[-cut:]
            toks.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
        check(worker, model, ids, [seqs[s] for s in ids], [1] * len(ids))
        if step % 7 == 3:  # some leave, others join (reusing rows, or new rows)
            gone = rng.sample(list(seqs), 3)
            worker.release(gone)
            for s in gone:
                del seqs[s]
            for _ in range(rng.choice([1, 3, 5])):
                seqs[f"s{next_id}"] = [rng.randrange(vocab) for _ in range(rng.randrange(2, 12))]
                next_id += 1
    worker.release(list(seqs))
    assert worker._pool.row_of == {} and worker._pool.kbufs is None


def test_compaction_keeps_logits(model):
    worker = HFWorker(model)
    vocab = worker.vocab_size
    rng = random.Random(2)
    base = {s: [rng.randrange(vocab) for _ in range(5 + 3 * i)] for i, s in enumerate("xyz")}
    check(worker, model, list(base), list(base.values()), [1, 1, 1])
    compacted = 0
    for step in range(60):
        # draft 6 tokens one at a time, then reject all but one: holes pile up
        drafts = {s: list(t) for s, t in base.items()}
        for _ in range(6):
            for s in drafts:
                drafts[s].append(rng.randrange(vocab))
            before = worker._pool.used
            check(worker, model, list(drafts), list(drafts.values()), [1, 1, 1])
            compacted += worker._pool.used < before
        for s in base:
            base[s].append(drafts[s][len(base[s])])
    assert compacted, "expected the holes to be compacted at least once"
    pool = worker._pool
    assert pool.used < 3 * max(len(c) for c in pool.cols)


def test_pool_equals_per_sequence_caches(model):
    """The pool and the per-sequence fallback give the same logits."""
    pooled = HFWorker(model)
    legacy = HFWorker(model)
    legacy._pool = None  # no pool: every sequence in its own cache
    rng = random.Random(3)
    vocab = pooled.vocab_size
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in (4, 9, 6)]
    for step in range(10):
        for t in seqs:
            t.append(rng.randrange(vocab))
        a = pooled.score(["p", "q", "r"], seqs, [2, 1, 2])
        b = legacy.score(["p", "q", "r"], seqs, [2, 1, 2])
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=TOL)


def test_a_long_prompt_joining_a_running_batch_is_prefilled_alone(model):
    worker = HFWorker(model)
    vocab = worker.vocab_size
    rng = random.Random(4)
    seqs = {f"r{i}": [rng.randrange(vocab) for _ in range(6)] for i in range(6)}
    check(worker, model, list(seqs), list(seqs.values()), [1] * 6)
    widths = []
    forward = worker._pool._forward

    def spy(rows, news, nums, subset=None):
        widths.append((len(rows), max(len(n) for n in news)))
        return forward(rows, news, nums, subset)

    worker._pool._forward = spy
    seqs["new"] = [rng.randrange(vocab) for _ in range(40)]
    for s in seqs:
        if s != "new":
            seqs[s].append(rng.randrange(vocab))
    check(worker, model, list(seqs), list(seqs.values()), [1] * 6 + [3])
    assert widths == [(1, 37), (7, 3)]  # the newcomer's prefill alone, then everyone narrow
    for _ in range(3):
        for s in seqs:
            seqs[s].append(rng.randrange(vocab))
        check(worker, model, list(seqs), list(seqs.values()), [1] * 7)


def test_newcomers_are_prefilled_into_columns_their_rows_do_not_use(model):
    """Sequences joining a running batch are prefilled by themselves into columns before
    ``used`` that their rows do not hold: the pool gains no columns (no holes for the others),
    and every row's logits stay the solo ones."""
    worker = HFWorker(model)
    vocab = worker.vocab_size
    rng = random.Random(5)
    seqs = {f"r{i}": [rng.randrange(vocab) for _ in range(8 + i)] for i in range(6)}
    check(worker, model, list(seqs), list(seqs.values()), [1] * 6)
    for _ in range(40):  # run for a while: ~50 columns in use
        for s in seqs:
            seqs[s].append(rng.randrange(vocab))
        check(worker, model, list(seqs), list(seqs.values()), [1] * 6)
    pool = worker._pool
    worker.release(["r1", "r4"])
    del seqs["r1"], seqs["r4"]
    before = pool.used
    seqs["new1"] = [rng.randrange(vocab) for _ in range(30)]
    seqs["new2"] = [rng.randrange(vocab) for _ in range(19)]  # two at once, of different lengths
    for s in seqs:
        if not s.startswith("new"):
            seqs[s].append(rng.randrange(vocab))
    check(worker, model, list(seqs), list(seqs.values()), [1, 1, 1, 1, 2, 3])
    assert pool.used == before + 3  # only the common pass's window (the newcomers' tails)
    for s in ("new1", "new2"):
        r = pool.row_of[s]
        assert pool.cols[r][0] < before and len(pool.cols[r]) == len(seqs[s])
    for _ in range(5):
        for s in seqs:
            seqs[s].extend(rng.randrange(vocab) for _ in range(2))
        check(worker, model, list(seqs), list(seqs.values()), [2] * 6)
    for s, r in pool.row_of.items():
        assert len(pool.cols[r]) == int(pool.valid[r].sum())


def test_a_draining_batch_drops_its_free_rows(model):
    """Rows left free by finished sequences, with nobody joining, stop taking part in passes
    once they are a quarter of the rows; a row freed and refilled in one call stays."""
    worker = HFWorker(model)
    vocab = worker.vocab_size
    rng = random.Random(6)
    seqs = {f"r{i}": [rng.randrange(vocab) for _ in range(5 + 2 * i)] for i in range(8)}
    check(worker, model, list(seqs), list(seqs.values()), [1] * 8)
    pool = worker._pool
    worker.release(["r0"])  # replaced at once (steady serving): the row is reused
    del seqs["r0"]
    seqs["n0"] = [rng.randrange(vocab) for _ in range(4)]
    check(worker, model, list(seqs), list(seqs.values()), [1] * 8)
    assert len(pool.rows) == 8
    worker.release(["r3"])  # one free row of 8: kept (a newcomer may take it)
    del seqs["r3"]
    check(worker, model, list(seqs), list(seqs.values()), [1] * 7)
    assert len(pool.rows) == 8
    worker.release(["r5"])  # two of 8: dropped
    del seqs["r5"]
    for step in range(3):
        for s in seqs:
            seqs[s].append(rng.randrange(vocab))
        check(worker, model, list(seqs), list(seqs.values()), [1] * 6)
    assert len(pool.rows) == 6 and None not in pool.rows


def test_greedy_rows_sample_their_hot_token_for_any_uniform():
    """Sampling.draw (the engine's and Worker.draft's draw) takes argmax for greedy rows: what
    inverse-CDF sampling gives."""
    from cascade.sampling import Sampling
    from cascade.verify import sample_with_uniform

    logits = torch.randn(64, 50, dtype=torch.float64)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the first argmax
    greedy = Sampling(temperature=0.0)
    probs = greedy.probs(logits)
    for u in (0.0, 0.5, 1 - 2 ** -53):
        uniforms = torch.full((64,), u, dtype=torch.float64)
        assert torch.equal(sample_with_uniform(probs, uniforms), probs.argmax(-1))
        assert torch.equal(greedy.draw(probs, uniforms), probs.argmax(-1))
    assert int(probs[3].argmax()) == 7
