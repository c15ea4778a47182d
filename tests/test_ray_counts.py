"""The Ray wire's counts, without a cluster: the proxies (:class:`RayWorker`, :class:`RayHeadWorker`)
call :class:`LevelActor` objects in this process, over the local backend's workers.

Each call sends a sequence's tokens past a count: the engine's count of what the level holds
(``Worker.hold``), as far as the actor was sent the sequence, or after a hand-off the sequence
handed over. Checked on every call while the path changes every step (each level's record goes
stale, rolls back, is handed over again): the actor rebuilds exactly the sequence the engine
asked for, and was sent exactly the tokens it did not have (no more than a diff against its
last sequence would send). A count that is too high rebuilds a wrong sequence: the check sees
it (the negative control); one past what the actor has is a resync, and the output stays.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cascade import Cascade
from cascade.backends.ray import LevelActor, RayHeadWorker, RayWorker
from cascade.engine import Request
from cascade.sampling import Sampling
from head_util import HEAD_LOOKAHEAD as LOOKAHEAD
from head_util import ray_head_topology
from hf_util import prompts_from_text, reference_greedy
from policies.fixed import FixedPolicy

# every path the topology has, with trees where a model level starts one: one per step, in turn
PATHS = [(["head", "auth"], {}), (["tiny", "auth"], {}), (["ngram", "tiny", "auth"], {}),
         (["head", "tiny", "auth"], {}), (["head", "auth"], {"head": [2, 2, 1]}), (["ngram", "auth"], {}),
         (["thead", "tiny", "auth"], {}), (["tiny", "auth"], {"tiny": [2, 2]}), (["head", "auth"], {}),
         (["thead", "tiny", "auth"], {"thead": [2, 1]})]


class Turns(FixedPolicy):
    """:class:`FixedPolicy` over :data:`PATHS` in turn, one step each."""

    def __init__(self, **params):
        super().__init__(lookahead=LOOKAHEAD, **params)
        self.turns = [FixedPolicy(lookahead=LOOKAHEAD, path=path, tree=tree) for path, tree in PATHS]
        self.step = 0

    def bind(self, graph, authority) -> None:
        super().bind(graph, authority)
        for turn in self.turns:
            turn.bind(graph, authority)

    def plan(self, ctx):
        self.step += 1
        return self.turns[self.step % len(self.turns)].plan(ctx)


@pytest.fixture(scope="module")
def head_topo(tmp_path_factory, tokenizer):
    """tests/head_util.py's heads topology (run here over the local backend's workers)."""
    return ray_head_topology(tmp_path_factory.mktemp("ray-counts"), tokenizer)


@pytest.fixture(scope="module")
def local(head_topo):
    """tests/test_ray.py's head topology, in process: ``head`` reads ``auth``, ``thead`` reads ``tiny``."""
    with Cascade.from_topology(head_topo, backend="local") as c:
        yield c, Path(head_topo).parent / "auth"


def _actor(name: str, workers: dict) -> LevelActor:
    """A :class:`LevelActor` over workers already built (its constructor would build them)."""
    actor = LevelActor.__new__(LevelActor)
    actor.build = SimpleNamespace(level=SimpleNamespace(name=name))
    actor.failed, actor.worker, actor.workers = None, workers[name], workers
    actor.tokens = {n: {} for n in workers}
    actor._samplings = {}
    return actor


def _info(worker) -> dict:
    return {"vocab_size": worker.vocab_size, "context_length": getattr(worker, "context_length", None),
            "can_score": worker.can_score, "drafts_trees": worker.drafts_trees}


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture
def remote(local, monkeypatch):
    """The local cascade with ``auth`` (``head`` in its actor) and ``tiny`` (``thead`` in its actor)
    behind proxies; every call checked. Per sequence and call: (level, method, kept, what a diff
    against the actor's last sequence would keep, tokens sent)."""
    c, _ = local
    w = c.engine.workers
    actors = {"auth": _actor("auth", {"auth": w["auth"], "head": w["head"]}),
              "tiny": _actor("tiny", {"tiny": w["tiny"], "thead": w["thead"]})}
    proxies = {"auth": RayWorker("auth", actors["auth"], _info(w["auth"])),
               "tiny": RayWorker("tiny", actors["tiny"], _info(w["tiny"])),
               "head": RayHeadWorker("head", actors["auth"], _info(w["head"]), "auth"),
               "thead": RayHeadWorker("thead", actors["tiny"], _info(w["thead"]), "tiny")}
    checks = []
    asking = RayWorker._call_seqs

    def call_seqs(self, method, seq_ids, token_ids, *args):
        self.asked = [list(t) for t in token_ids]
        return asking(self, method, seq_ids, token_ids, *args)

    def call(self, method, seq_ids, keeps, suffixes, held, *args):
        self.wire.calls += 1
        record = self.actor.tokens[self.name]
        before = [record.get(s) for s in seq_ids]
        out = getattr(self.actor, method)(seq_ids, keeps, suffixes, held, *args, level=self.name)
        if out is not None:
            for s, keep, had, asked in zip(seq_ids, keeps, before, self.asked):
                assert record[s] == asked, f"{self.name}.{method}: the actor rebuilt another sequence"
                checks.append((self.name, method, keep, _common(had or [], asked), len(asked) - keep))
        return out

    monkeypatch.setattr(RayWorker, "_call_seqs", call_seqs)
    monkeypatch.setattr(RayWorker, "_call", call)
    saved = dict(w)
    c.engine.workers.update(proxies)
    try:
        yield c, proxies, actors, checks
    finally:
        c.engine.workers.update(saved)


def test_every_call_sends_what_the_actor_lacks(remote, local, tokenizer):
    c, proxies, _, checks = remote
    _, auth_dir = local
    prompts = prompts_from_text(tokenizer, 2)
    got = c.generate(prompts, max_new_tokens=40, temperature=0.0, policy=Turns(), batch_size=2)
    assert [g.token_ids for g in got] == [reference_greedy(auth_dir, p, 40) for p in prompts]
    sampled = dict(max_new_tokens=40, temperature=0.9, seed=3, batch_size=2)
    got = c.generate(prompts, policy=Turns(), **sampled)
    c.engine.workers.update({name: proxies[name].actor.workers[name] for name in proxies})  # in process
    assert [g.token_ids for g in got] == [g.token_ids for g in c.generate(prompts, policy=Turns(), **sampled)]
    # each call kept exactly the prefix the actor already had: no token sent twice, none missing
    assert all(keep == common for _, _, keep, common, _ in checks)
    methods = {(name, method) for name, method, *_ in checks}
    assert {("head", "hand_features"), ("head", "draft"), ("head", "draft_tree"), ("thead", "hand_features"),
            ("tiny", "draft_tree"), ("auth", "score_tree_probs"), ("tiny", "score_probs")} <= methods
    # a head drafts a block from the sequence its hand-off just sent: it sends nothing
    assert all(sent == 0 for name, method, *_, sent in checks if name.endswith("head") and method == "draft")
    assert all(w.wire.resyncs == 0 for w in proxies.values())


def test_a_count_past_the_actors_sequence_is_caught(remote, tokenizer, monkeypatch):
    """Negative control: the engine's count ignored (the proxy keeps all it ever sent): the actor
    rebuilds a sequence with a rolled-back block in it, and the check says so."""
    c, _, _, _ = remote
    monkeypatch.setattr(RayWorker, "hold", lambda self, seq_ids, held: self._held.update(
        {s: 10**9 for s in seq_ids}))
    with pytest.raises(AssertionError, match="rebuilt another sequence"):
        c.generate(prompts_from_text(tokenizer, 2), max_new_tokens=40, temperature=0.0, policy=Turns(),
                   batch_size=2)


def test_an_actor_that_lost_its_sequences_gets_them_whole(remote, local, tokenizer):
    """The actors forget everything mid-generation (a restart): the next calls' counts exceed what
    they hold, each asks for the whole sequence once, and the output does not change."""
    c, proxies, actors, checks = remote
    _, auth_dir = local
    prompt = prompts_from_text(tokenizer, 1)[0]
    engine, saved = c.engine, c.engine.policy
    engine.policy = policy = Turns()
    policy.bind(engine.graph, engine.authority)
    try:
        state = engine.start(Request(prompt, 40, Sampling(temperature=0.0)))
        for step, _ in enumerate(engine.run(state)):
            if step == 3:
                for actor in actors.values():
                    for name, worker in actor.workers.items():
                        worker.release([state.seq_id])
                        actor.tokens[name].clear()
    finally:
        engine.policy = saved
    assert state.generated == reference_greedy(auth_dir, prompt, 40)
    assert sum(w.wire.resyncs for w in proxies.values()) >= 2
    assert all(keep == common for _, _, keep, common, _ in checks)
