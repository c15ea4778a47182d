"""Chunked prefill (cascade/engine.py ``Batch``, ``Engine.prefill``; ``Worker.prefill``): a long
prompt is computed a chunk per batch step beside the other requests' steps, and its tokens are
those it gets in one piece — greedy, seeded, across drafters, a feature head and trees."""
from __future__ import annotations

import networkx as nx
import pytest
import torch

from cascade import Cascade
from cascade.engine import Engine, Request
from cascade.errors import TopologyError, WorkerError
from cascade.sampling import Sampling
from cascade.topology import topology_from_dict
from conftest import family_topology, make_llama, write_topology
from head_util import copy_head
from hf_util import TEXT, reference_greedy
from policies.fixed import FixedPolicy
from table_worker import FailingTableWorker

LOOKAHEAD = {"ngram": 3, "tiny": 3, "small": 5, "medium": 7}


def long_prompt(tokenizer, n: int = 150) -> list[int]:
    ids = tokenizer.encode(TEXT * 4)
    assert len(ids) >= n
    return ids[:n]


def family_cascade(family, tmp_path, chunk, levels=("tiny", "small", "medium", "large"), ngram=True, name="t.yaml"):
    data = family_topology(family, list(levels), ngram=ngram,
                           policy={"name": "fixed", "params": {"lookahead": {
                               k: v for k, v in LOOKAHEAD.items() if k in levels or (ngram and k == "ngram")}}})
    return Cascade.from_topology(write_topology(tmp_path / name, {**data, "prefill_chunk": chunk}))


class Spy:
    """Wraps a worker's ``prefill`` and ``score``: how many prompt positions each call handed it."""

    def __init__(self, worker):
        self.prefills: list[list[int]] = []
        self.scores = 0
        prefill, score = worker.prefill, worker.score

        def spy_prefill(seq_ids, token_ids):
            self.prefills.append([len(t) for t in token_ids])
            return prefill(seq_ids, token_ids)

        def spy_score(*args, **kwargs):
            self.scores += 1
            return score(*args, **kwargs)

        worker.prefill, worker.score = spy_prefill, spy_score


def test_a_short_request_steps_beside_a_long_prompts_prefill(family, tokenizer, tmp_path):
    """The short request joins one step after the long one and commits tokens at once, while
    the long prompt is still being prefilled a chunk per step; both get the authority's tokens."""
    long, short = long_prompt(tokenizer), tokenizer.encode("def push(self, item):\n")
    chunk = 16
    with family_cascade(family, tmp_path, chunk) as c:
        spies = {n: Spy(c.workers[n]) for n in ("tiny", "large")}
        batch = c.batch()
        a = batch.add(c.request(long, max_new_tokens=24, temperature=0.0))
        batch.step()
        b = batch.add(c.request(short, max_new_tokens=24, temperature=0.0))
        first_short = first_long = None
        steps = 0
        while batch.active:
            steps += 1
            for state, new in batch.step():
                if state is b and new and first_short is None:
                    first_short = steps
                if state is a and new and first_long is None:
                    first_long = steps
        # the long prompt's chunks: one per step, each at most a chunk, the last chunk left to its first step
        assert spies["large"].prefills == [[n] for n in range(chunk, len(long), chunk)]
        assert spies["tiny"].prefills == spies["large"].prefills  # every level with a cache
        assert first_short == 1
        assert first_long == len(spies["large"].prefills)  # after its last chunk, at its first step
        assert first_short < first_long
    assert a.generated == reference_greedy(family / "large", long, 24)
    assert b.generated == reference_greedy(family / "large", short, 24)


def test_the_long_request_computes_its_prompt_once(family, tokenizer, tmp_path):
    """Chunks go into the pool and stay there: over the whole request the authority computes
    the prompt's positions once (what the policy is told it computed), as in one piece."""
    from policies.base import PassCost

    class Counting(FixedPolicy):
        def observe_pass(self, cost: PassCost) -> None:
            if cost.level == "large":
                computed.append(cost.tokens)
            super().observe_pass(cost)

    long = long_prompt(tokenizer)
    totals = {}
    for chunk in (None, 16):
        computed: list[int] = []
        with family_cascade(family, tmp_path, chunk, levels=("small", "large"), ngram=False,
                            name=f"t{chunk}.yaml") as c:
            g = c.generate(long, max_new_tokens=20, temperature=0.0, policy=Counting(lookahead={"small": 4}))
            assert g.token_ids == reference_greedy(family / "large", long, 20)
        totals[chunk] = sum(computed)
    assert totals[16] == totals[None]


@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_greedy_identity_across_chunk_boundaries(family, tokenizer, tmp_path, chunk):
    """Long and short prompts batched, every level of the family and prompt lookup: chunk sizes
    that cut the prompt anywhere give the authority's tokens, and the one-piece ones."""
    prompts = [long_prompt(tokenizer, 150), tokenizer.encode("class Stack:\n"), long_prompt(tokenizer, 61)]
    want = [reference_greedy(family / "large", p, 32) for p in prompts]
    with family_cascade(family, tmp_path, chunk) as c:
        assert [g.token_ids for g in c.generate(prompts, max_new_tokens=32, temperature=0.0, batch_size=3)] == want
        assert c.generate(prompts[0], max_new_tokens=32, temperature=0.0).token_ids == want[0]


def test_seeded_samples_are_unchanged(family, tokenizer, tmp_path):
    """At T = 0.8 with a seed, a long prompt chunked gives the tokens it gives in one piece (float64
    levels), alone and beside a short request."""
    prompts = [long_prompt(tokenizer, 120), tokenizer.encode("def pop(self):\n")]
    got = {}
    for chunk in (None, 16):
        with family_cascade(family, tmp_path, chunk, name=f"s{chunk}.yaml") as c:
            alone = c.generate(prompts[0], max_new_tokens=40, temperature=0.8, seed=1234).token_ids
            both = c.generate(prompts, max_new_tokens=40, temperature=0.8, seed=1234, batch_size=2)
            got[chunk] = (alone, [g.token_ids for g in both])
    assert got[16] == got[None]
    assert len(got[16][0]) == 40


@pytest.fixture(scope="module")
def head_models(tmp_path_factory, tokenizer):
    """A 1-layer float64 authority (512 positions), an independent drafter and a perturbed copy
    of the authority's layer as a feature head (tests/head_util.py)."""
    root = tmp_path_factory.mktemp("chunk-heads")
    vocab = len(tokenizer)
    auth = make_llama(root / "auth", vocab, seed=1, hidden=32, layers=1, logit_scale=30.0,
                      dtype=torch.float64, tokenizer=tokenizer)
    make_llama(root / "tiny", vocab, seed=4, hidden=16, layers=1, logit_scale=30.0, dtype=torch.float64,
               tokenizer=tokenizer)
    copy_head(auth, noise=0.3, seed=5).save_pretrained(root / "noisy")
    return root


@pytest.mark.parametrize("policy", [{"lookahead": {"head": 4}, "path": ["head", "auth"]},
                                    {"lookahead": {"head": 3, "tiny": 5}, "path": ["head", "tiny", "auth"]},
                                    {"lookahead": {"tiny": 4}, "path": ["tiny", "auth"], "tree": {"tiny": [2, 2]}},
                                    {"lookahead": {"head": 4}, "path": ["head", "auth"], "tree": {"head": [2, 2]}}],
                         ids=["head", "head-tiny", "tiny-tree", "head-tree"])
def test_greedy_identity_with_a_feature_head(head_models, tokenizer, tmp_path, policy):
    """The head reads the authority's features of the prompt, computed a chunk at a time (kept as
    each chunk's pass ran): greedy identity, chains and trees, alone and batched."""
    levels = [{"name": "ngram", "kind": "ngram"},
              {"name": "head", "kind": "head", "model": str(head_models / "noisy"), "features_of": "auth"},
              {"name": "tiny", "model": str(head_models / "tiny"), "dtype": "float64", "device": "cpu"},
              {"name": "auth", "model": str(head_models / "auth"), "dtype": "float64", "device": "cpu"}]
    edges = [["ngram", "auth"], ["head", "auth"], ["head", "tiny"], ["tiny", "auth"]]
    topo = write_topology(tmp_path / "h.yaml", {"levels": levels, "edges": edges, "prefill_chunk": 13,
                                                "policy": {"name": "fixed", "params": policy}})
    prompts = [long_prompt(tokenizer, 140), tokenizer.encode("class Stack:\n"), long_prompt(tokenizer, 40)]
    want = [reference_greedy(head_models / "auth", p, 30) for p in prompts]
    with Cascade.from_topology(topo) as c:
        spy = Spy(c.workers["head"])
        assert c.generate(prompts[0], max_new_tokens=30, temperature=0.0).token_ids == want[0]
        got = c.generate(prompts, max_new_tokens=30, temperature=0.0, batch_size=3)
        assert [g.token_ids for g in got] == want
        assert spy.prefills == []  # a head catches up from its source's features when it drafts
        # the features the head read were those the chunks' passes kept: the authority computed
        # the long prompt once (its pool row and features were never dropped and recomputed)
        assert c.workers["auth"].cached_sequences() == 0
        drafter = "head" if "head" in policy["path"] else "tiny"
        assert got[0].stats.edges[f"{drafter}->{policy['path'][1]}"].proposed > 0


def test_a_feature_head_reads_the_features_the_chunks_kept(head_models, tokenizer, tmp_path):
    """The authority computes each prompt position once though the head asks for the prompt's
    features before the authority's first step scores its last chunk (the hand-off computes it)."""
    from policies.base import PassCost

    class Counting(FixedPolicy):
        def observe_pass(self, cost: PassCost) -> None:
            if cost.level == "auth":
                computed.append(cost.tokens)
            super().observe_pass(cost)

    levels = [{"name": "head", "kind": "head", "model": str(head_models / "noisy"), "features_of": "auth"},
              {"name": "auth", "model": str(head_models / "auth"), "dtype": "float64", "device": "cpu"}]
    prompt = long_prompt(tokenizer, 140)
    totals = {}
    for chunk in (None, 13):
        computed: list[int] = []
        topo = write_topology(tmp_path / f"h{chunk}.yaml", {"levels": levels, "prefill_chunk": chunk})
        with Cascade.from_topology(topo) as c:
            spy = Spy(c.workers["auth"])
            g = c.generate(prompt, max_new_tokens=20, temperature=0.0, policy=Counting(lookahead={"head": 4}))
            assert g.token_ids == reference_greedy(head_models / "auth", prompt, 20)
        totals[chunk] = sum(computed)
    assert totals[13] == totals[None]
    assert len(spy.prefills) == 140 // 13


def table_engine(fail: dict[str, int], chunk: int) -> Engine:
    graph = nx.DiGraph([("tiny", "large")])
    workers = {n: FailingTableWorker(12, seed=i, scale=3.0, fail_after=fail.get(n, 10**9))
               for i, n in enumerate(["tiny", "large"])}
    return Engine(graph, "large", workers, FixedPolicy(lookahead={"tiny": 3}), prefill_chunk=chunk)


def test_a_draft_level_failing_during_prefill_is_left_out():
    request = Request(list(range(12)) * 5, max_new_tokens=30, sampling=Sampling(temperature=0.0))
    reference = table_engine({}, None).generate(request)
    state = table_engine({"tiny": 1}, 8).generate(request)
    assert state.generated == reference.generated
    assert len(state.stats.notes) == 1 and "'tiny'" in state.stats.notes[0]


def test_the_authority_failing_during_prefill_ends_the_request():
    engine = table_engine({"large": 2}, 8)
    with pytest.raises(WorkerError) as info:
        engine.generate(Request(list(range(12)) * 5, max_new_tokens=30, sampling=Sampling(temperature=0.0)))
    assert info.value.level == "large" and info.value.partial == []


@pytest.mark.parametrize("value", [0, -3, 2.5, "big", True])
def test_a_bad_prefill_chunk_is_refused(value):
    graph = nx.DiGraph([("tiny", "large")])
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(graph, "large", {"tiny": FailingTableWorker(), "large": FailingTableWorker()}, FixedPolicy(3),
               prefill_chunk=value)
    levels = [{"name": n, "kind": "test_engine_faults:FailingTableWorker"} for n in ("tiny", "large")]
    with pytest.raises(TopologyError, match="prefill_chunk"):
        topology_from_dict({"levels": levels, "prefill_chunk": value})
    assert topology_from_dict({"levels": levels}).spec.prefill_chunk == 256
    assert topology_from_dict({"levels": levels, "prefill_chunk": None}).spec.prefill_chunk is None
