"""Provenance (``provenance=True``): per step, the path, the blocks verified and the level each
committed token came from, recorded by the engine without changing what it generates.

Table workers (tests/table_worker.py) drive the real engine cheaply; the served version is
tested in tests/serve/test_playground.py."""
from __future__ import annotations

import pytest

from cascade import Cascade, RequestError
from cascade.stats import BlockOutcome, StepProvenance, cut_provenance
from draws import PROMPT, table_topology

CHAIN = {"name": "fixed", "params": {"lookahead": 3}}  # tiny -> small -> medium -> large


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    with Cascade.from_topology(table_topology(tmp_path_factory.mktemp("prov"), 4, CHAIN)) as c:
        yield c


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_recording_changes_no_token(chain, temperature):
    for seed in range(6):
        off = chain.generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=seed)
        on = chain.generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=seed, provenance=True)
        assert on.token_ids == off.token_ids  # no extra random draws
        assert on.stats.edges == off.stats.edges
        assert off.provenance is None and on.provenance


def test_steps_account_for_every_token_and_block(chain):
    g = chain.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=3, provenance=True)
    assert [t for step in g.provenance for t in step.tokens] == g.token_ids
    assert len(g.provenance) == g.stats.steps
    edges: dict[str, list[int]] = {}
    for step in g.provenance:
        assert step.path == ("tiny", "small", "medium", "large")
        assert len(step.origins) == len(step.tokens)
        assert set(step.origins) <= set(step.path)
        # the authority runs one round: the accepted prefix keeps its origins, its own token ends the step
        assert step.origins[-1] == "large" and "large" not in step.origins[:-1]
        if step.blocks:  # (none where the budget left was one token: the authority sampled it alone)
            top = step.blocks[-1]
            assert (top.proposer, top.verifier) == ("medium", "large") and top.accepted == len(step.tokens) - 1
        else:
            assert step.origins == ("large",)
        for b in step.blocks:
            e = edges.setdefault(f"{b.proposer}->{b.verifier}", [0, 0, 0])
            e[0] += 1
            e[1] += b.proposed
            e[2] += b.accepted
    assert edges == {k: [e.blocks, e.proposed, e.accepted] for k, e in g.stats.edges.items()}
    assert len({o for step in g.provenance for o in step.origins}) >= 2


def test_two_levels_origins_are_the_accepted_prefix_then_the_authority(tmp_path):
    with Cascade.from_topology(table_topology(tmp_path, 2, CHAIN)) as c:
        g = c.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=5, provenance=True)
    assert len(g.provenance) > 5
    for step in g.provenance:
        accepted = sum(b.accepted for b in step.blocks)  # one block, or none for a last single token
        assert len(step.blocks) <= 1
        assert step.origins == ("medium",) * accepted + ("large",)


def test_requests_in_one_batch_with_their_own_policies(chain):
    alone = {spec: chain.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=9, policy=spec).token_ids
             for spec in ("fixed:lookahead=2", "fixed:path=[medium, large],lookahead=4")}
    batch = chain.batch()
    states = {spec: batch.add(chain.request(PROMPT, 20, temperature=1.0, seed=9, provenance=True, policy=spec))
              for spec in alone}
    plain = batch.add(chain.request(PROMPT, 20, temperature=1.0, seed=9))
    while batch.active:
        batch.step()
    for spec, state in states.items():
        assert state.generated == alone[spec]
    assert {s.path for s in states["fixed:path=[medium, large],lookahead=4"].provenance} == {("medium", "large")}
    assert plain.provenance is None
    assert plain.generated == chain.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=9).token_ids


def test_bad_values_are_refused_naming_the_parameter(chain):
    with pytest.raises(RequestError, match=r"^provenance: "):
        chain.generate(PROMPT, max_new_tokens=4, provenance="yes")
    with pytest.raises(RequestError, match=r"^policy: "):
        chain.request(PROMPT, 4, policy="no-such-policy")


def test_cut_provenance_keeps_the_steps_of_the_kept_tokens():
    blocks = (BlockOutcome("tiny", "large", 3, 2),)
    steps = [StepProvenance(("tiny", "large"), (1, 2, 3), ("tiny", "tiny", "large"), blocks),
             StepProvenance(("large",), (4,), ("large",), ())]
    assert cut_provenance(steps, 4) == steps
    assert cut_provenance(steps, 2) == [StepProvenance(("tiny", "large"), (1, 2), ("tiny", "tiny"), blocks)]
    assert cut_provenance(steps, 0) == []
