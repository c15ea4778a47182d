"""The engine when a worker fails: a draft level is dropped for the rest of the request (and the
greedy output does not change); the authority failing raises WorkerError with the committed part."""
from __future__ import annotations

import networkx as nx
import pytest

from cascade import Cascade
from cascade.engine import Engine, Request
from cascade.errors import WorkerError
from cascade.sampling import Sampling
from conftest import write_topology
from policies.fixed import FixedPolicy
from table_worker import FailingTableWorker


VOCAB = 12


def engine(fail: dict[str, int]) -> Engine:
    names = ["tiny", "small", "large"]
    graph = nx.DiGraph([("tiny", "small"), ("small", "large"), ("tiny", "large")])
    workers = {n: FailingTableWorker(VOCAB, seed=i, scale=3.0, fail_after=fail.get(n, 10**9))
               for i, n in enumerate(names)}
    return Engine(graph, "large", workers, FixedPolicy(lookahead={"tiny": 2, "small": 4}))


@pytest.mark.parametrize("down", ["tiny", "small"])
def test_draft_level_down_is_skipped_and_output_unchanged(down):
    request = Request([1, 2, 3], max_new_tokens=40, sampling=Sampling(temperature=0.0))
    reference = engine({}).generate(request)
    failing = engine({down: 5})
    state = failing.generate(request)
    assert state.generated == reference.generated
    assert len(state.stats.notes) == 1 and repr(down) in state.stats.notes[0]
    # after the failure the level took no part: its calls stopped at the failing one
    assert failing.workers[down].calls == 5
    assert state.stats.new_tokens == 40
    # the rest of the hierarchy kept verifying
    assert failing.workers["large"].calls > 1


def test_draft_level_down_sampling_is_still_seeded():
    request = Request([4, 5], max_new_tokens=30, sampling=Sampling(temperature=1.0), seed=11)
    a = engine({"small": 3}).generate(request)
    b = engine({"small": 3}).generate(request)
    assert a.generated == b.generated and len(a.generated) == 30


def test_authority_down_raises_with_committed_prefix():
    request = Request([1, 2, 3], max_new_tokens=40, sampling=Sampling(temperature=0.0))
    reference = engine({}).generate(request)
    failing = engine({"large": 4})
    with pytest.raises(WorkerError) as info:
        failing.generate(request)
    err = info.value
    assert err.level == "large"
    assert 0 < len(err.partial) < 40
    assert err.partial == reference.generated[: len(err.partial)]


def test_cascade_hands_back_a_partial_generation(tmp_path):
    levels = [{"name": n, "kind": "test_engine_faults:FailingTableWorker",
               "params": {"vocab_size": VOCAB, "seed": i, "scale": 3.0,
                          **({"fail_after": 3} if n == "large" else {})}}
              for i, n in enumerate(["small", "large"])]
    path = write_topology(tmp_path / "t.yaml", {"levels": levels,
                                                "policy": {"name": "fixed", "params": {"lookahead": 3}}})
    with Cascade.from_topology(path) as c:
        with pytest.raises(WorkerError) as info:
            c.generate([1, 2], max_new_tokens=50, temperature=0.0)
    partial = info.value.partial
    assert partial.finish_reason == "error" and partial.stats.authority_passes == 3
    assert 3 <= len(partial.token_ids) < 50 and partial.text == ""  # no tokenizer: token ids only
