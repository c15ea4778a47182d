"""Each policy's decision rule on synthetic statistics, and its parameter checks."""
from __future__ import annotations

import networkx as nx
import pytest
import torch

from policies import PolicyError, make_policy, parse_policy_spec
from policies.adaptive import (
    AutoPolicy, ConfidencePolicy, CostAwarePolicy, EntropyPolicy, EscalationPolicy, Realized, Regime,
)
from policies.base import DraftStep, EdgeOutcome, PassCost, PlanContext, StepFeedback, StepPlan, draft_step
from policies.estimates import (BINS, Calibration, EdgeAcceptance, Estimates, LevelCost, TreeAcceptance, batch_bucket,
                                confidence_bin, tree_passes)
from policies.fixed import FixedPolicy
from policies.stops import CalibratedStop, ConfidenceStop, EntropyStop

CHAIN = nx.DiGraph([("tiny", "small"), ("small", "large")])
DAG = nx.DiGraph([("tiny", "small"), ("small", "large"), ("tiny", "large")])


def ctx(graph=CHAIN, available=None, remaining=100):
    return PlanContext(graph, "large", remaining, 0, frozenset(available or graph.nodes))


def bound(policy, graph=CHAIN):
    policy.bind(graph, "large")
    return policy


def feedback(plan, edges, seconds, passes, confidence=None, sampled=False):
    return StepFeedback(plan, tuple(EdgeOutcome(*e) for e in edges), seconds, passes, 1, confidence, sampled=sampled)


def step(token_prob=0.9, block_prob=0.9, entropy=0.1, index=0):
    return DraftStep(index, token_prob, block_prob, max_prob=max(token_prob, 0.5), entropy=entropy)


def test_fixed_path_and_lookahead():
    plan = bound(FixedPolicy({"tiny": 2, "small": 5})).plan(ctx())
    assert plan.path == ("tiny", "small", "large") and plan.lookahead == {"tiny": 2, "small": 5}
    # a level that is down drops out of the path
    assert bound(FixedPolicy(3)).plan(ctx(available={"small", "large"})).path == ("small", "large")


def test_fixed_rejects_bad_params():
    with pytest.raises(PolicyError, match="lookahead"):
        FixedPolicy(-1)
    with pytest.raises(PolicyError, match="path"):
        bound(FixedPolicy(3, path=["tiny", "large"]))  # not an edge of the chain


def test_confidence_stop_rules():
    assert ConfidenceStop(0.5).should_stop(step(token_prob=0.4))
    assert not ConfidenceStop(0.5).should_stop(step(token_prob=0.6))
    assert ConfidenceStop(0.5, "block").should_stop(step(token_prob=0.9, block_prob=0.45))
    plan = bound(ConfidencePolicy(lookahead=6, threshold=0.3)).plan(ctx())
    assert plan.lookahead == {"tiny": 6, "small": 6}
    assert plan.stop["tiny"] == ConfidenceStop(0.3, "token")
    with pytest.raises(PolicyError, match="threshold"):
        ConfidencePolicy(threshold=1.5)
    with pytest.raises(PolicyError, match="mode"):
        ConfidencePolicy(mode="sometimes")


def test_draft_step_reads_the_models_own_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    s = draft_step(0, logits, 1, prev_block_prob=0.5)
    assert s.token_prob == pytest.approx(0.2) and s.max_prob == pytest.approx(0.7)
    assert s.block_prob == pytest.approx(0.1)
    assert s.entropy == pytest.approx(-(0.7 * torch.log(torch.tensor(0.7)) + 0.2 * torch.log(torch.tensor(0.2))
                                        + 0.1 * torch.log(torch.tensor(0.1))).item(), rel=1e-5)


def test_entropy_stop_and_online_threshold():
    assert EntropyStop(0.5).should_stop(step(entropy=1.0))  # exp(-1) = 0.37 < 0.5
    assert not EntropyStop(0.5).should_stop(step(entropy=0.5))  # exp(-0.5) = 0.61
    policy = bound(EntropyPolicy(threshold=0.4, target=0.75, rate=0.1))
    plan = policy.plan(ctx())
    policy.observe(feedback(plan, [("tiny", "small", 4, 4)], {}, {}))  # all accepted: draft further
    assert policy.threshold < 0.4
    lowered = policy.threshold
    policy.observe(feedback(plan, [("tiny", "small", 4, 0)], {}, {}))  # all rejected: stop sooner
    assert policy.threshold > lowered


def test_edge_acceptance_per_position():
    acc = EdgeAcceptance(prior=0.5, prior_weight=0.0, decay=1.0)
    acc.observe(proposed=4, accepted=2)  # positions 0, 1 accepted, 2 rejected, 3 never examined
    acc.observe(proposed=4, accepted=4)
    assert acc.seen == [2, 2, 2, 1] and acc.accepted == [2, 2, 1, 1]
    assert acc.rate(2) == 0.5 and acc.rate(3) == 1.0 and acc.rate(10) == 1.0


def test_path_cost_follows_the_speedup_equation():
    est = Estimates(prior=0.0)
    est.costs = {}
    for level, seconds in {"tiny": 0.001, "large": 0.010}.items():
        est.costs.setdefault(level, __import__("policies.estimates", fromlist=["LevelCost"]).LevelCost()).observe(seconds, 1)
    edge = est.edge("tiny", "large")
    edge.prior, edge.prior_weight = 0.8, 1e9  # acceptance 0.8 at every position
    per_token, lookahead = est.path_cost(("tiny", "large"), max_lookahead=8)
    k = lookahead["tiny"]
    expected = (1 - 0.8 ** (k + 1)) / (1 - 0.8)
    assert per_token == pytest.approx((k * 0.001 + 0.010) / expected)
    # the chosen k is the best over 1..8, and beats plain decoding (k = 0: 10 ms per token)
    best = min((j * 0.001 + 0.010) / ((1 - 0.8 ** (j + 1)) / 0.2) for j in range(1, 9))
    assert per_token == pytest.approx(best) and per_token < 0.010
    # a draft that is never accepted does not pay: k = 0
    edge.prior = 0.0
    assert est.path_cost(("tiny", "large"), 8)[1]["tiny"] == 0


def measured_costs(est, seconds=(("ngram", 0.0), ("tiny", 0.002), ("large", 0.010))):
    """Each level's pass measured at widths 1-5 (an n-gram level's at no cost, in no pass)."""
    for level, cost in seconds:
        for width in (1, 2, 3, 4, 5):
            for _ in range(10):
                est.costs.setdefault(level, LevelCost()).observe_pass(1 if cost else 0, width, cost, rows=1)


def teach(policy, plan_path, edges, seconds, rounds=60, confidence=None):
    plan = StepPlan(plan_path, {n: 4 for n in plan_path[:-1]})
    for _ in range(rounds):
        policy.observe(feedback(plan, edges, seconds, {k: 1 for k in seconds}, confidence))


def test_cost_aware_lengthens_lookahead_when_acceptance_is_high():
    seconds = {"tiny": 0.001, "small": 0.003, "large": 0.02}
    high = bound(CostAwarePolicy(explore=0.0))
    teach(high, ("tiny", "small", "large"), [("tiny", "small", 8, 8), ("small", "large", 8, 8)], seconds)
    low = bound(CostAwarePolicy(explore=0.0))
    teach(low, ("tiny", "small", "large"), [("tiny", "small", 8, 1), ("small", "large", 8, 1)], seconds)
    hi_plan, lo_plan = high.plan(ctx()), low.plan(ctx())
    assert hi_plan.lookahead["small"] == 8 and lo_plan.lookahead["small"] < 4


def test_escalation_skips_a_level_that_does_not_pay():
    policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9), DAG)
    seconds = {"tiny": 0.001, "small": 0.008, "large": 0.010}
    # small is nearly as slow as large and adds little acceptance: tiny -> large direct wins
    teach(policy, ("tiny", "small", "large"), [("tiny", "small", 4, 2), ("small", "large", 4, 2)], seconds)
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 3)], seconds)
    assert policy.plan(ctx(DAG)).path == ("tiny", "large")


def test_escalation_goes_through_the_middle_when_drafts_are_unsure():
    policy = bound(EscalationPolicy(explore=0.0, confident=0.8, warmup=0, probe_every=10**9, pool_weight=0,
                                    switch_margin=0.0), DAG)
    seconds = {"tiny": 0.001, "small": 0.002, "large": 0.02}
    # confident context: tiny is right about the large model; unsure: only small is
    teach(policy, ("tiny", "large"), [("tiny", "large", 6, 6)], seconds, confidence=0.95)
    teach(policy, ("tiny", "small", "large"), [("tiny", "small", 6, 6), ("small", "large", 6, 6)], seconds,
          confidence=0.95)
    policy.observe(feedback(StepPlan(("tiny", "large"), {"tiny": 4}), [("tiny", "large", 4, 0)], seconds,
                            {k: 1 for k in seconds}, confidence=0.3))
    teach(policy, ("tiny", "large"), [("tiny", "large", 6, 0)], seconds, confidence=0.3)
    teach(policy, ("tiny", "small", "large"), [("tiny", "small", 6, 4), ("small", "large", 6, 6)], seconds,
          confidence=0.3)
    assert policy.plan(ctx(DAG)).path == ("tiny", "small", "large")  # last context: unsure
    policy.observe(feedback(StepPlan(("tiny", "large"), {"tiny": 4}), [], seconds, {}, confidence=0.95))
    assert policy.plan(ctx(DAG)).path == ("tiny", "large")


def test_escalation_reprices_every_few_plans():
    """Pricing every path is a millisecond of Python per step: prices are reused for
    ``reprice_every`` plans at one batch size (a new batch size is priced at once), and what
    was learnt meanwhile takes effect at the next pricing."""
    policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, pool_weight=0), DAG)
    seconds = {"tiny": 0.001, "small": 0.008, "large": 0.010}
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 4)], seconds)
    teach(policy, ("tiny", "small", "large"), [("tiny", "small", 4, 2), ("small", "large", 4, 2)], seconds)
    calls = []
    path_cost = policy.estimates.path_cost
    policy.estimates.path_cost = lambda *a, **k: calls.append(k.get("batch")) or path_cost(*a, **k)
    paths = len(policy._candidates(ctx(DAG)))
    assert policy.plan(ctx(DAG)).path == ("tiny", "large")
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 0)], seconds, rounds=200)  # tiny -> large now fails
    chosen = [policy.plan(ctx(DAG)).path for _ in range(policy.params.reprice_every)]
    assert len(calls) == 2 * paths  # priced at the first plan and again after reprice_every plans
    assert chosen[0] == ("tiny", "large") and chosen[-1] != ("tiny", "large")
    policy.plan(PlanContext(DAG, "large", 100, 0, frozenset(DAG.nodes), batch_size=8))
    assert len(calls) == 3 * paths and calls[-1] == 8


def test_escalation_prices_afresh_after_a_probe_round():
    """A probe round teaches every path at once: the first plan after it does not reuse prices
    from before the round (in short runs that choice sets the path for a long while)."""
    policy = bound(EscalationPolicy(explore=0.0, warmup=1, probe_every=10**9), DAG)
    calls = []
    path_cost = policy.estimates.path_cost
    policy.estimates.path_cost = lambda *a, **k: calls.append(1) or path_cost(*a, **k)
    paths = len(policy._candidates(ctx(DAG)))
    kinds = [policy._choose(ctx(DAG), 8)[2] for _ in range(paths + 2)]
    assert kinds == ["probe"] * paths + ["exploit"] * 2
    assert len(calls) == 2 * paths  # at the first plan, and afresh after the round's last probe


def test_verification_budget_shrinks_speculation_under_load():
    policy = bound(CostAwarePolicy(explore=0.0, verify_budget=64))
    seconds = {"tiny": 0.001, "small": 0.003, "large": 0.02}
    teach(policy, ("tiny", "small", "large"), [("tiny", "small", 8, 8), ("small", "large", 8, 8)], seconds)

    def plan_at(batch):
        return policy.plan(PlanContext(CHAIN, "large", 100, 0, frozenset(CHAIN.nodes), batch_size=batch))

    assert plan_at(1).lookahead["small"] == 8
    assert plan_at(16).lookahead["small"] == 3  # 64 // 16 - 1
    assert plan_at(64).path == ("large",)  # no speculation: plain batched decoding
    with pytest.raises(PolicyError, match="verify_budget"):
        CostAwarePolicy(verify_budget=0)


def test_level_cost_learns_pass_and_position_costs_per_batch_size():
    cost = LevelCost()
    for batch in (1, 16):
        for width in (1, 9, 2, 33, 5):  # 10 ms per pass + 0.6 ms per sequence in it + 0.4 ms per position
            cost.observe_pass(1, batch * width, 0.010 + 0.0006 * batch + 0.0004 * batch * width, rows=batch)
    assert cost.model(1).fit == pytest.approx((0.0106, 0.0004), rel=1e-3)
    assert cost.model(16).fit == pytest.approx((0.0196, 0.0004), rel=1e-3)
    assert cost.model(20).fit == cost.model(16).fit and cost.model(64).fit == cost.model(16).fit  # nearest measured batch size
    # a sequence of 16 shares the pass's fixed cost and pays its own positions
    assert cost.per_sequence(16, 3) == pytest.approx(0.0196 / 16 + 0.0012, rel=1e-3)
    cost.observe_pass(1, 4, 5.0, rows=1)  # a call stalled by something else is clipped, not trusted
    assert cost.model(1).fit[0] < 0.05
    cost.observe_pass(1, 200, 9.0, rows=1)  # a prompt's prefill is not a decoding pass: not fitted
    assert cost.model(1).fit[0] < 0.05
    before = cost.model(16).fit  # nor is a pass in which a request joins a running batch with its prompt
    cost.observe_pass(1, 16 * 2 + 60, 0.5, rows=16, catch_up=60)
    assert cost.model(16).fit == before


def test_a_width_no_longer_chosen_is_priced_by_the_passes_run_now():
    """Passes measured late in a long request (one position 57 ms, two 60 ms), then a short
    request decoding alone (one position 45 ms): two positions are priced at the curve's measured
    ratio to one position now (60 * 45 / 57), not at the 60 ms left in their bucket, which would
    keep drafting priced out until a probe."""
    cost = LevelCost()
    for _ in range(15):
        cost.observe_pass(1, 1, 0.057, rows=1)
        cost.observe_pass(1, 2, 0.060, rows=1)
        cost.observe_pass(1, 4, 0.062, rows=1)
    assert cost.per_sequence(1, 2) == pytest.approx(0.060)
    for _ in range(15):
        cost.observe_pass(1, 1, 0.045, rows=1)
    assert cost.per_sequence(1, 1) == pytest.approx(0.045)
    assert cost.per_sequence(1, 2) == pytest.approx(0.060 * 45 / 57)
    assert cost.per_sequence(1, 4) == pytest.approx(0.062 * 45 / 57)
    for _ in range(15):  # measured again: as measured
        cost.observe_pass(1, 2, 0.050, rows=1)
    assert cost.per_sequence(1, 2) == pytest.approx(0.050)


def test_a_batch_that_has_only_decoded_prices_wider_passes_by_a_measured_shape():
    """At batch 4 every pass so far scored one position per sequence (4 positions, 45 ms): its
    line's split of a pass into fixed and per-position cost is arbitrary and priced 8 positions
    at about twice 4. Batch 1 measured the shape (4 positions 44 ms, 8 positions 45 ms, 16 46 ms):
    wider passes at batch 4 are priced by that ratio, and speculation that pays is chosen."""
    cost = LevelCost()
    for _ in range(10):
        for width, seconds in {1: 0.041, 2: 0.043, 4: 0.044, 8: 0.045, 16: 0.046}.items():
            cost.observe_pass(1, width, seconds, rows=1)
    for _ in range(20):
        cost.observe_pass(1, 4, 0.045, rows=4)  # batch 4, one position each
    assert cost.per_sequence(4, 1) == pytest.approx(0.045 / 4)
    assert cost.per_sequence(4, 2) == pytest.approx(0.045 * 45 / 44 / 4)
    assert cost.per_sequence(4, 4) == pytest.approx(0.045 * 46 / 44 / 4)
    assert cost.per_sequence(4, 8) == pytest.approx(cost.model(4).pass_seconds(32) / 4)  # measured nowhere: the line
    est = Estimates()
    est.costs["large"], est.costs["tiny"] = cost, LevelCost(seconds=1e-4)
    edge = est.edge("tiny", "large")
    edge.prior, edge.prior_weight = 0.5, 1e9
    assert est.path_cost(("tiny", "large"), 4, batch=4)[1]["tiny"] >= 2
    for _ in range(20):  # measured at batch 4 (1.14x for 8 positions, as SmolLM2's): its own shape
        cost.observe_pass(1, 8, 0.045 * 1.14, rows=4)
    assert cost.per_sequence(4, 2) == pytest.approx(0.045 * 1.14 / 4)


# One float32 pass of SmolLM2-135M-Instruct on an AVX2 EPYC core by positions scored (ms, the
# lean forward after a 200-token prefix, 2026-12-03): the second position costs most of a pass
# (the matrix kernel changes with the rows), the next ones little.
CPU_CURVE = {1: 0.065, 2: 0.125, 4: 0.125, 8: 0.142, 16: 0.187, 33: 0.300}


def test_pass_cost_is_measured_by_width_not_assumed_linear():
    cost = LevelCost()
    for _ in range(5):
        for width, seconds in CPU_CURVE.items():
            cost.observe_pass(1, width, seconds, rows=1)
    cost.observe_pass(1, 4, 0.9, rows=1)  # a stalled pass moves no median
    model = cost.model(1)
    for width, seconds in CPU_CURVE.items():
        assert cost.per_sequence(1, width) == pytest.approx(seconds)
    assert cost.per_sequence(1, 3) == pytest.approx(0.125)  # between measured widths: interpolated
    assert cost.per_sequence(1, 12) == pytest.approx((0.142 + 0.187) / 2)
    assert cost.per_sequence(1, 65) == pytest.approx(0.300 + model.fit[1] * 32)  # beyond: the line's slope
    a, b = model.fit  # the line through the same passes prices the authority alone 70% too dear
    assert a + b > 1.5 * CPU_CURVE[1]
    # priced with the measured curve, a block of drafts is long or nothing: the second position
    # is dear, the ones after it nearly free
    est = Estimates()
    est.costs["large"], est.costs["tiny"] = cost, LevelCost(seconds=1e-6)
    edge = est.edge("tiny", "large")
    edge.prior, edge.prior_weight = 0.7, 1e9
    per_token, lookahead = est.path_cost(("tiny", "large"), 12)
    assert lookahead["tiny"] >= 6 and per_token < CPU_CURVE[1]
    edge.prior = 0.35
    assert est.path_cost(("tiny", "large"), 12)[1]["tiny"] == 0


def test_an_ngram_level_is_not_pooled_with_model_drafters():
    """Prompt lookup proposes only where the text repeats, and is accepted there far more often
    than a small model: its few measurements are not shrunk towards the models' rate."""
    est = Estimates(prior=0.5, pool_weight=20)
    est.kinds = {"ngram": "ngram", "tiny": "hf", "small": "hf", "large": "hf"}
    for level in ("ngram", "tiny", "small"):
        est.costs[level] = LevelCost(seconds=1e-6)
    est.costs["large"] = LevelCost()
    for width in (1, 2, 3, 4, 5) * 5:  # 10 ms for one position, 4 ms more for each other
        est.costs["large"].observe_pass(1, width, 0.006 + 0.004 * width, rows=1)
    for _ in range(200):
        est.edge("tiny", "large").observe(4, 0)  # the model drafter: rejected
    for proposer in ("ngram", "small"):
        for _ in range(3):
            est.edge(proposer, "large").observe(4, 4)  # three blocks, accepted whole
    assert est.path_cost(("ngram", "large"), 4)[1]["ngram"] >= 2
    assert est.path_cost(("small", "large"), 4)[1]["small"] == 0  # a model: shrunk towards the models' rate
    est.pool_weight = 0
    assert est.path_cost(("small", "large"), 4)[1]["small"] > 0
    est.pool_weight, est.kinds = 20, {}  # kinds unknown: one pool, as before
    assert est.path_cost(("ngram", "large"), 4)[1]["ngram"] == 0


def test_an_edge_is_not_pooled_with_itself():
    """Prompt lookup is the only n-gram edge into the authority: its pool would be its own
    rounds, so one rejected block counted ``pool_weight`` times over and priced it at zero
    acceptance for the rest of the run (SmolLM2 in bf16, 2026-12-04: a 4-position pass costing
    1.15x one, `auto` decoding alone on prompts where fixed prompt lookup paid). One unlucky
    round now moves its estimate as one round does, and a pool is worth no more than the other
    edges have seen."""
    est = Estimates(prior=0.7, pool_weight=20)
    est.kinds = {"ngram": "ngram", "tiny": "hf", "large": "hf"}
    est.costs["ngram"] = LevelCost(seconds=1e-6)
    est.costs["large"] = LevelCost()
    for width in (1, 2, 3, 4, 5) * 5:  # 40 ms for one position, 2 ms more for each other
        est.costs["large"].observe_pass(1, width, 0.038 + 0.002 * width, rows=1)
    est.edge("ngram", "large").observe(4, 0)  # one block, rejected at its first token
    assert est.path_cost(("ngram", "large"), 4)[1]["ngram"] > 0
    est.edge("tiny", "large").observe(4, 0)  # one model round: pooled with weight 1, not 20
    est.edge("small", "large")
    est.kinds["small"] = "hf"
    assert est.path_cost(("small", "large"), 4)[1]["small"] > 0
    for _ in range(200):
        est.edge("tiny", "large").observe(4, 0)  # now the pool has seen plenty
    assert est.path_cost(("small", "large"), 4)[1]["small"] == 0


def test_a_probe_in_which_nothing_was_proposed_is_taken_again():
    """Prompt lookup proposes nothing where the text does not repeat; a probe of its path then
    measured nothing, and is retried (up to probe_retries) until something is proposed."""
    graph = nx.DiGraph([("ngram", "large")])
    policy = bound(EscalationPolicy(explore=0.0, warmup=1, probe_every=10**9, probe_retries=3), graph)

    def plan_and_answer(proposed):
        path, lookahead, kind, _ = policy._choose(ctx(graph), 8)
        policy.observe(feedback(StepPlan(path, lookahead), [("ngram", "large", proposed, 0)] if len(path) > 1 else [],
                                {}, {}))
        return path, kind

    steps = [plan_and_answer(0) for _ in range(6)]
    probes = [path for path, kind in steps if kind == "probe"]
    assert probes.count(("ngram", "large")) == 1 + 3 and probes.count(("large",)) == 1  # retried 3 times
    policy = bound(EscalationPolicy(explore=0.0, warmup=1, probe_every=10**9), graph)
    steps = [plan_and_answer(2) for _ in range(4)]
    assert [kind for _, kind in steps][:2] == ["probe", "probe"] and [kind for _, kind in steps][2:] == ["exploit"] * 2


def test_speculation_stops_paying_under_load():
    """Same acceptance, same models: at batch 1 drafting pays; in a large batch, where each
    drafted position costs the authority nearly what decoding a token costs, it does not."""
    est = Estimates(prior=0.6)
    est.edge("tiny", "large").prior_weight = 1e9
    for level, (per_pass, per_row, per_position) in {"tiny": (0.001, 0.00002, 0.00001),
                                                     "large": (0.010, 0.0006, 0.0012)}.items():
        cost = est.costs.setdefault(level, LevelCost())
        for batch in (1, 4, 16, 64):
            for width in (1, 2, 8):
                cost.observe_pass(1, batch * width, per_pass + per_row * batch + per_position * batch * width,
                                  rows=batch)
    assert est.path_cost(("tiny", "large"), 8, batch=1)[1]["tiny"] >= 2
    assert est.path_cost(("tiny", "large"), 8, batch=64)[1]["tiny"] == 0
    policy = bound(CostAwarePolicy(explore=0.0), nx.DiGraph([("tiny", "large")]))
    policy.regimes[False] = Regime({False: est})
    at = lambda b: policy.plan(PlanContext(policy.graph, "large", 100, 0, frozenset({"tiny", "large"}), batch_size=b))
    assert at(1).path == ("tiny", "large") and at(64).path == ("large",)


def test_escalation_drafts_only_for_a_clear_gain():
    """A path that drafts must be priced ``draft_margin`` cheaper than the authority alone."""
    graph = nx.DiGraph([("tiny", "large")])

    def choice(margin, acceptance):
        policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, draft_margin=margin), graph)
        est = policy.estimates
        for level, seconds in (("tiny", 0.0), ("large", 0.010)):  # tiny free; large 10 ms whatever the width
            for width in (1, 2):
                for _ in range(10):
                    est.costs.setdefault(level, LevelCost()).observe_pass(1, width, seconds, rows=1)
        edge = est.edge("tiny", "large")
        edge.prior, edge.prior_weight = acceptance, 1e9
        return policy.plan(PlanContext(graph, "large", 100, 0, frozenset(graph.nodes))).path

    # a block of 1 accepted 9% of the time: 1.09 tokens per large pass, priced 8% cheaper
    assert choice(0.0, 0.09) == ("tiny", "large")
    assert choice(0.1, 0.09) == ("large",)  # not a clear gain
    assert choice(0.1, 0.5) == ("tiny", "large")  # a third cheaper: drafting pays clearly


def test_calibration_maps_confidence_to_acceptance():
    cal = Calibration(prior=0.5, prior_weight=0.0, decay=1.0)
    for _ in range(10):  # confident tokens accepted, unsure ones (p < 0.02) rejected
        cal.observe((0.9, 0.9, 0.01, 0.9), accepted=2, after_full=True)
    later = cal.table(Calibration.LATER)
    assert later[confidence_bin(0.9)] == 1.0 and later[confidence_bin(0.01)] == 0.0
    assert cal.table(Calibration.FIRST_AFTER_FULL)[confidence_bin(0.9)] == 1.0
    assert cal.seen[Calibration.LATER][confidence_bin(0.9)] == 10  # position 3 was never examined


def test_calibrated_stop_multiplies_measured_acceptance():
    first = tuple(0.9 for _ in BINS)
    later = tuple(0.5 if lo < 0.3 else 0.95 for lo in BINS)
    rule = CalibratedStop(first, later, threshold=0.4)
    logits = torch.log(torch.tensor([0.8, 0.1, 0.1]))
    s0 = draft_step(0, logits, 0)  # p = 0.8: survival 0.9
    assert not rule.should_stop(s0) and s0.memo == pytest.approx(0.9)
    s1 = draft_step(1, logits, 0, previous=s0)  # 0.9 * 0.95
    assert not rule.should_stop(s1)
    s2 = draft_step(2, logits, 1, previous=s1)  # p = 0.1: 0.855 * 0.5 = 0.43 > 0.4
    assert not rule.should_stop(s2)
    s3 = draft_step(3, logits, 2, previous=s2)  # 0.43 * 0.5 < 0.4: stop
    assert rule.should_stop(s3) and s3.memo == pytest.approx(0.9 * 0.95 * 0.5 * 0.5)


def test_calibrated_stop_decides_a_batch_together():
    """Rows share the verifier's width: they go on while their survivals sum to at least
    threshold per row of the batch, and then all stop; a lone row is should_stop."""
    rule = CalibratedStop(tuple(0.9 for _ in BINS), tuple(0.5 if lo < 0.3 else 0.95 for lo in BINS), threshold=0.5)
    sure = torch.log(torch.tensor([0.8, 0.1, 0.1]))
    s = [draft_step(0, sure, 0), draft_step(0, sure, 1), draft_step(0, sure, 1)]  # survivals 0.9 each
    assert rule.stop_batch(s, 3) == [False] * 3
    # the next column: 0.855, 0.45, 0.45 -> sum 1.755 >= 1.5: the unsure rows go on with the sure one
    s = [draft_step(1, sure, 0, previous=s[0]), draft_step(1, sure, 1, previous=s[1]),
         draft_step(1, sure, 1, previous=s[2])]
    assert rule.stop_batch(s, 3) == [False] * 3
    assert rule.should_stop(s[1])  # alone, an unsure row would have stopped (0.45 < 0.5)
    # one row ended its block (budget): it adds nothing but still counts: 0.81 + 0.43 < 0.5 * 3
    s = [draft_step(2, sure, 0, previous=s[0]), draft_step(2, sure, 0, previous=s[1])]
    assert rule.stop_batch(s, 3) == [True, True]
    lone = draft_step(0, sure, 1)
    assert rule.stop_batch([lone], 1) == [False]  # 0.9
    assert rule.stop_batch([draft_step(1, sure, 1, previous=lone)], 1) == [True]  # 0.9 * 0.5 < 0.5


def test_auto_drafts_long_blocks_cut_by_a_calibrated_stop():
    graph = nx.DiGraph([("tiny", "large")])

    def taught(**params):
        policy = bound(AutoPolicy(warmup=0, probe_every=10**9, **params), graph)
        plan = StepPlan(("tiny", "large"), {"tiny": 4})
        for _ in range(100):  # confident tokens are accepted, the unsure last one is not
            policy.observe(StepFeedback(plan, (EdgeOutcome("tiny", "large", 4, 3, (0.9, 0.9, 0.9, 0.01)),),
                                        {"tiny": 0.001, "large": 0.010}, {"tiny": 4, "large": 1}, 4))
        return policy.plan(PlanContext(graph, "large", 100, 0, frozenset(graph.nodes)))

    step_plan = taught(max_lookahead=24)
    assert step_plan.path == ("tiny", "large") and step_plan.lookahead["tiny"] == 24
    rule = step_plan.stop["tiny"]
    assert isinstance(rule, CalibratedStop) and 0.02 <= rule.threshold <= 0.9
    assert rule.later[confidence_bin(0.9)] > 0.9 and rule.later[confidence_bin(0.01)] < 0.1
    assert taught(stop_threshold=0.25).stop["tiny"].threshold == 0.25
    off = taught(stop=False)
    assert off.stop == {} and 1 <= off.lookahead["tiny"] <= 8  # the cost model's lookahead alone


def test_escalation_probes_every_path_in_its_warm_up():
    policy = bound(EscalationPolicy(explore=0.0, warmup=2, probe_every=10**9), DAG)
    paths = [policy.plan(ctx(DAG)).path for _ in range(8)]
    candidates = {("large",), ("tiny", "large"), ("small", "large"), ("tiny", "small", "large")}
    assert set(paths[:4]) == candidates and set(paths[4:]) == candidates  # each round, every path once


def test_rarely_tried_edges_shrink_towards_the_verifiers_pooled_acceptance():
    est = Estimates(prior=0.5, pool_weight=20)
    for level, seconds in {"small": 0.005, "large": 0.010}.items():
        est.costs[level] = LevelCost(seconds=seconds)
    for _ in range(200):
        est.edge("tiny", "large").observe(1, 1)  # tiny's drafts: always accepted
    est.edge("small", "large").observe(1, 0)  # small: one unlucky round
    pooled = est.path_cost(("small", "large"), 1)
    est.pool_weight = 0
    alone = est.path_cost(("small", "large"), 1)
    assert pooled[1]["small"] == 1 and alone[1]["small"] == 0  # one round does not condemn it


def test_registry_and_spec_parsing():
    assert parse_policy_spec("fixed") == ("fixed", {})
    assert parse_policy_spec("fixed:lookahead=3") == ("fixed", {"lookahead": 3})
    assert parse_policy_spec("fixed:lookahead={tiny: 2, small: 4},path=[tiny, small, large]") == (
        "fixed", {"lookahead": {"tiny": 2, "small": 4}, "path": ["tiny", "small", "large"]})
    assert parse_policy_spec("policies.adaptive:ConfidencePolicy:threshold=0.3") == (
        "policies.adaptive:ConfidencePolicy", {"threshold": 0.3})
    for name in ("fixed", "confidence", "entropy", "cost-aware", "escalation", "auto"):
        assert make_policy(name).name == name
    assert isinstance(make_policy("policies.adaptive:ConfidencePolicy", {"threshold": 0.2}), ConfidencePolicy)
    with pytest.raises(PolicyError, match="params"):
        make_policy("fixed", {"nonsense": 1})
    with pytest.raises(PolicyError, match="name: unknown policy"):
        make_policy("nope")


def test_escalation_backs_off_its_probes_while_the_choice_holds():
    """Probe rounds cost steps on slower paths: a round that leaves the chosen path as it was
    doubles the interval to the next (up to probe_backoff x probe_every); a change of path
    brings it back to probe_every."""
    policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=4, probe_backoff=4, pool_weight=0), DAG)
    seconds = {"tiny": 0.001, "small": 0.008, "large": 0.010}
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 4)], seconds)
    teach(policy, ("tiny", "small", "large"), [("tiny", "small", 4, 2), ("small", "large", 4, 2)], seconds)

    def round_starts(plans):
        kinds = [policy._choose(ctx(DAG), 8)[2] for _ in range(plans)]
        return [i for i, k in enumerate(kinds) if k == "probe" and (i == 0 or kinds[i - 1] != "probe")]

    starts = round_starts(80)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == [8, 16, 16, 16, 16], starts  # 4, then doubled per unchanged round, capped at 4 x 4
    assert policy.regimes[False].current[frozenset(DAG.nodes)] == ("tiny", "large")
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 0)], seconds, rounds=200)  # the text changes
    starts = round_starts(40)
    assert policy.regimes[False].current[frozenset(DAG.nodes)] != ("tiny", "large")
    # the switch brought the interval back to 4: a round at once, then 8, 16 again (not 16, 16)
    assert [b - a for a, b in zip(starts, starts[1:])] == [8, 16], starts
    with pytest.raises(PolicyError, match="probe_backoff"):
        EscalationPolicy(probe_backoff=0)


def test_tree_acceptance_is_counted_by_depth_and_rank():
    acc = TreeAcceptance(decay=1.0)
    acc.observe((2, 2, 1), (1, 0))  # second choice at depth 0, first at 1, no match at depth 2
    assert acc.seen == [[1, 1], [1, 0], [1]] and acc.hits == [[0, 1], [1, 0], [0]]
    acc.observe((2, 2, 1), ())  # neither candidate at depth 0
    assert acc.seen[0] == [2, 2] and acc.hits[0] == [0, 1]
    acc.prior_weight = 0.0
    assert acc.rate(0, 1, 0.5) == 0.5 and acc.rate(0, 0, 0.5) == 0.0 and acc.rate(1, 0, 0.5) == 1.0
    assert tree_passes((2, 2, 1)) == ([1, 2, 4], 10)


def _tree_estimates(est, per_position):
    """tiny: 1 ms a pass; large: 10 ms plus ``per_position`` per scored position. tiny's first
    choice is large's token half the time, its second 40% of the time."""
    for level, (fixed, each) in {"tiny": (0.001, 0.0), "large": (0.010, per_position)}.items():
        for width in (1, 2, 4, 8, 16, 32, 64):
            for _ in range(5):
                est.costs.setdefault(level, LevelCost()).observe_pass(1, width, fixed + each * width, rows=1)
    edge = est.edge("tiny", "large")
    edge.prior, edge.prior_weight = 0.5, 1e9
    tree = est.tree("tiny", "large")
    tree.later_prior, tree.prior_weight = 0.8, 1e9


def test_path_cost_prices_a_tree_by_its_passes_and_acceptance_by_rank():
    est = Estimates()
    _tree_estimates(est, 0.0)
    cost, lookahead = est.path_cost(("tiny", "large"), 8, tree=(2, 2, 1, 1))
    # depths of width 2 are passed with 0.5 + 0.4, of width 1 with 0.5
    expected = 1 + 0.9 + 0.81 + 0.81 * 0.5 + 0.81 * 0.25
    drafting = 4 * 0.001  # passes over 1, 2, 4 and 4 positions
    assert cost == pytest.approx((drafting + 0.010) / expected, rel=1e-3) and lookahead == {"tiny": 4}
    chain, _ = est.path_cost(("tiny", "large"), 8)
    assert cost < chain  # verification is flat: the tree's second choices pay


def test_auto_takes_a_tree_only_where_it_pays():
    graph = nx.DiGraph([("tiny", "large")])

    def plan(per_position):
        policy = bound(AutoPolicy(warmup=0, probe_every=10**9), graph)
        _tree_estimates(policy.estimates, per_position)
        return policy.plan(PlanContext(graph, "large", 100, 0, frozenset(graph.nodes)))

    flat = plan(0.0)  # a flat verifier (weights streamed once, as a real authority on a GPU)
    assert flat.path == ("tiny", "large") and flat.tree["tiny"] in ((2, 2, 1, 1), (3, 2, 2, 1)) and not flat.stop
    steep = plan(0.002)  # every position costs the verifier a fifth of a pass: no tree
    assert steep.tree == {}
    ngram = bound(AutoPolicy(warmup=0, probe_every=10**9), nx.DiGraph([("ng", "large")]))
    ngram.graph.nodes["ng"]["kind"] = "ngram"  # a level that cannot score is never asked for a tree
    assert ngram._shapes(PlanContext(ngram.graph, "large", 100, 0, frozenset({"ng", "large"})), ("ng", "large")) == [None]


def test_probes_under_load_take_the_shape_priced_there_and_only_contenders():
    """At one sequence a round's probes of a path take its chain and each tree in turn (a new
    request's own probe only the shape priced cheapest), and every other round probes every path; at more than one sequence a probe takes only the shape priced
    cheapest there, and rounds only the contenders: a probe pays for every sequence of the
    batch (a tree's nodes, each of them, and a lagging level's catch-up), while what it
    measures, acceptance, is the same at any batch size."""
    graph = nx.DiGraph([("tiny", "large")])
    policy = bound(AutoPolicy(warmup=0, probe_every=10**9, trees=[[2, 2, 1, 1]]), graph)
    _tree_estimates(policy.estimates, 0.002)  # every position costs the verifier: the chain is priced cheapest

    def probes(batch, by_request=False):
        shapes = []
        for _ in range(4):
            policy.probes.queue = [("tiny", "large")]
            if by_request:  # queued by a new request (_new_request), not by a round
                policy.probes.requests = {("tiny", "large")}
            plan = policy.plan(PlanContext(graph, "large", 100, 0, frozenset(graph.nodes), batch_size=batch))
            shapes.append(plan.tree.get("tiny"))
        return shapes

    assert probes(1) == [None, (2, 2, 1, 1), None, (2, 2, 1, 1)]
    assert probes(4) == [None] * 4
    # a request's own probe asks how its text accepts, which the cheapest shape measures
    assert probes(1, by_request=True) == [None] * 4
    priced = {("large",): (1.0, {}, None), ("tiny", "large"): (2.0, {"tiny": 1}, None)}
    policy.probes.rounds = 1  # past the warm-up: an even round takes every path at one sequence
    assert sorted(policy._probe_round(priced, 1)) == [("large",), ("tiny", "large")]
    policy.probes.rounds = 1
    assert policy._probe_round(priced, 4) == [("large",)]


def test_tree_outcomes_teach_the_tree_estimates_not_the_chains():
    est = Estimates(decay=1.0)
    plan = StepPlan(("tiny", "large"), {"tiny": 3}, {}, {"tiny": (2, 2, 1)})
    est.observe(StepFeedback(plan, (EdgeOutcome("tiny", "large", 3, 2, None, 10, (1, 1)),), {}, {}, 3))
    assert est.tree("tiny", "large").hits == [[0, 1], [0, 1], [0]] and est.edge("tiny", "large").seen == []


def test_a_new_request_measures_prompt_lookup_afresh():
    """Prompt lookup's acceptance belongs to the request. After requests where it failed, a new
    request (its step drops back) probes the n-gram path at once — retrying where there was no
    match — and its estimate keeps its mean but only ``lookup_carry`` observations of it, so the
    new request's own blocks win it back within a few steps; a drafter's estimate is untouched."""
    graph = nx.DiGraph([("ngram", "large"), ("tiny", "large")])
    graph.nodes["ngram"]["kind"] = "ngram"
    policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, lookup_carry=4.0), graph)
    est = policy.estimates
    measured_costs(est)
    for _ in range(40):  # earlier requests: prompt lookup rejected, tiny so-so
        est.observe(feedback(StepPlan(("ngram", "large"), {"ngram": 3}), [("ngram", "large", 3, 0)], {}, {}))
        est.observe(feedback(StepPlan(("tiny", "large"), {"tiny": 3}), [("tiny", "large", 3, 1)], {}, {}))
    lookup, tiny = est.edge("ngram", "large"), est.edge("tiny", "large")
    tiny_before, mean_before = list(tiny.seen), lookup.accepted[0] / lookup.seen[0]

    def plan(step, proposed=0, accepted=0):
        path, lookahead, kind, _ = policy._choose(PlanContext(graph, "large", 100, step, frozenset(graph.nodes)), 8)
        edges = [("ngram", "large", proposed, accepted)] if path[0] == "ngram" else []
        policy.observe(feedback(StepPlan(path, lookahead), edges, {}, {}))
        return path, kind

    assert plan(50)[0] != ("ngram", "large") and plan(51)[0] != ("ngram", "large")  # the old request: not lookup
    # a new request: probed at once; no match twice (retried), then a block accepted whole
    assert plan(0) == (("ngram", "large"), "probe")
    assert lookup.seen[0] == pytest.approx(4.0, rel=0.03)  # 4 observations' worth (decayed by the probe's empty block)
    assert lookup.accepted[0] / lookup.seen[0] == pytest.approx(mean_before)
    assert tiny.seen == tiny_before
    assert plan(1) == (("ngram", "large"), "probe")
    assert plan(2, 3, 3) == (("ngram", "large"), "probe")
    steps = [plan(3 + i, 3, 3) for i in range(4)]
    assert steps[-1] == (("ngram", "large"), "exploit")  # its own blocks decide now
    # the same request carries on: no further probe of its own
    assert all(kind == "exploit" for _, kind in steps[1:])


def test_a_new_request_measures_a_priced_out_drafter_afresh():
    """A drafter priced out on earlier texts (its path drafting nothing: lookahead 0) is neither
    chosen nor named to stand in, so only sparse probe rounds would ever measure it again. A new
    request probes its path at once and keeps its estimate's mean with only ``lookup_carry``
    observations of it, so that the request's own blocks decide: here its probe's block is
    accepted and prices it back in. A drafter priced in is left as it was. Without the
    re-measuring it stays priced out, whatever the new text."""
    graph = nx.DiGraph([("tiny", "large"), ("small", "large")])

    def run(remeasure: bool):
        policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, lookup_carry=4.0,
                                        pool_weight=0.0), graph)
        est = policy.estimates
        for level, seconds in (("tiny", 0.002), ("small", 0.004), ("large", 0.010)):
            for width in (1, 2, 3, 4, 5):
                for _ in range(10):
                    est.costs.setdefault(level, LevelCost()).observe_pass(1, width, seconds, rows=1)
        for _ in range(40):  # earlier texts: tiny's blocks rejected, small's accepted half the time
            est.observe(feedback(StepPlan(("tiny", "large"), {"tiny": 3}), [("tiny", "large", 3, 0)], {}, {}))
            est.observe(feedback(StepPlan(("small", "large"), {"small": 2}), [("small", "large", 2, 1)], {}, {}))
        tiny, small = est.edge("tiny", "large"), est.edge("small", "large")
        if not remeasure:
            policy._new_request = lambda *args: None

        def plan(step):
            path, lookahead, kind, _ = policy._choose(PlanContext(graph, "large", 100, step, frozenset(graph.nodes)), 8)
            edges = [(path[0], "large", lookahead[path[0]], lookahead[path[0]])] if len(path) > 1 else []
            policy.observe(feedback(StepPlan(path, lookahead), edges, {}, {}))  # this text: every block accepted
            return path, kind

        assert plan(50)[0] == ("small", "large")  # the old text: tiny priced out, small decoding
        tiny_mean, small_before = tiny.accepted[0] / tiny.seen[0], list(small.seen)
        first = plan(0)  # a new request
        if remeasure:  # lookup_carry observations of the old mean, then the probe's accepted block
            assert tiny.seen[0] == pytest.approx(4.0 * 0.98 + 1.0)
            assert tiny.accepted[0] == pytest.approx(4.0 * tiny_mean * 0.98 + 1.0)
            assert small.seen == small_before  # priced in: left as it was
        c = PlanContext(graph, "large", 100, 1, frozenset(graph.nodes))
        return first, policy._price_paths(c, policy._candidates(c), 8, policy._estimates())[("tiny", "large")][1]

    first, lookahead = run(remeasure=True)
    assert first == (("tiny", "large"), "probe")
    assert lookahead["tiny"] >= 1  # its own block priced it back in: it may be chosen (or stand in) again
    first, lookahead = run(remeasure=False)
    assert first[0] != ("tiny", "large") and lookahead["tiny"] == 0  # without: out for the whole request


def test_greedy_and_sampled_steps_keep_their_own_estimates():
    """Prompt lookup accepted whole when decoding greedily and rejected when sampling (as on
    SmolLM2, 0.59 against 0.17): each regime is priced with its own blocks — greedy steps keep
    prompt lookup, sampled ones leave it for the drafter — and the sampled regime, first seen,
    starts from the greedy estimates carried over as ``regime_carry`` observations, costs
    shared. With one set of estimates for both, the greedy blocks keep the sampled steps on
    prompt lookup."""
    graph = nx.DiGraph([("ngram", "large"), ("tiny", "large")])
    graph.nodes["ngram"]["kind"] = "ngram"

    def run(apart: bool):
        policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, pool_weight=0.0), graph)
        if not apart:  # one regime under both names
            policy.regimes[True] = policy.regimes[False]
        greedy = policy.estimates
        measured_costs(greedy)
        steps = iter(range(10**6))  # one request: the step never drops back

        def plan(sampled, lookup_accepts=None):
            c = PlanContext(graph, "large", 100, next(steps), frozenset(graph.nodes), sampled=sampled)
            path, lookahead, kind, _ = policy._choose(c, 8)
            if lookup_accepts is not None:  # teach: both drafters' blocks this step
                for path, accepted in ((("ngram", "large"), lookup_accepts), (("tiny", "large"), 1)):
                    policy.observe(feedback(StepPlan(path, {path[0]: 3}), [(path[0], "large", 3, accepted)], {}, {},
                                            sampled=sampled))
            return path

        for _ in range(40):
            plan(False, lookup_accepts=3)
        lookup = greedy.edge("ngram", "large")
        lookup_mean = lookup.accepted[0] / lookup.seen[0]
        assert plan(False) == ("ngram", "large")
        plan(True)  # the first sampled step
        if apart:
            sampled = policy.estimates
            assert sampled is not greedy and sampled.costs is greedy.costs
            lookup = sampled.edge("ngram", "large")
            assert lookup.seen[0] == pytest.approx(policy.params.regime_carry)
            assert lookup.accepted[0] / lookup.seen[0] == pytest.approx(lookup_mean)
        for _ in range(40):
            plan(True, lookup_accepts=0)
        return plan(True), plan(False)

    assert run(apart=True) == (("tiny", "large"), ("ngram", "large"))
    assert run(apart=False) == (("ngram", "large"), ("ngram", "large"))  # the sampled steps misled


def test_a_request_s_lookup_probe_waits_for_its_first_match_while_the_authority_decodes_alone():
    """Where the policy decodes with the authority alone, a new request's probe of prompt
    lookup that finds no match is retried past ``probe_retries`` — each retry is the
    authority's one-token step anyway — until the request's text first repeats; where a
    drafter is decoding instead, retries stop at ``probe_retries``."""
    graph = nx.DiGraph([("ngram", "large"), ("tiny", "large")])
    graph.nodes["ngram"]["kind"] = "ngram"

    def run(tiny_accepts: int):
        policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, lookup_carry=4.0), graph)
        est = policy.estimates
        measured_costs(est)
        for _ in range(40):  # earlier requests: prompt lookup rejected
            est.observe(feedback(StepPlan(("ngram", "large"), {"ngram": 3}), [("ngram", "large", 3, 0)], {}, {}))
            est.observe(feedback(StepPlan(("tiny", "large"), {"tiny": 3}), [("tiny", "large", 3, tiny_accepts)], {}, {}))

        def plan(step, proposed=0, accepted=0):
            path, lookahead, kind, _ = policy._choose(PlanContext(graph, "large", 100, step, frozenset(graph.nodes)), 8)
            edges = [("ngram", "large", proposed, accepted)] if path[0] == "ngram" else []
            if path[0] == "tiny":
                edges = [("tiny", "large", lookahead["tiny"], min(tiny_accepts, lookahead["tiny"]))]
            policy.observe(feedback(StepPlan(path, lookahead), edges, {}, {}))
            return path, kind

        current = [plan(50), plan(51)][-1][0]
        steps = [plan(i) for i in range(20)]  # a new request whose text does not repeat for 20 steps
        return current, steps, plan(20, 3, 3)

    current, steps, matched = run(tiny_accepts=0)  # tiny useless: the authority decodes alone
    assert current == ("large",)
    assert steps[0] == (("tiny", "large"), "probe")  # priced out: the new request measures it once
    assert all(s == (("ngram", "large"), "probe") for s in steps[1:])
    assert matched == (("ngram", "large"), "probe")  # the first match is measured
    current, steps, matched = run(tiny_accepts=3)  # tiny decoding: retries cost its blocks
    assert current == ("tiny", "large")
    assert steps[:9] == [(("ngram", "large"), "probe")] * 9 and steps[9][0] == ("tiny", "large")


def test_auto_names_a_stand_in_when_it_takes_prompt_lookup():
    """Prompt lookup is priced by its acceptance where it proposes: when `auto` takes it, the
    model drafter whose own edge beats the authority alone drafts the steps it has no match for
    (`stand_in`); a drafter that does not pay is not named, and `stand_in: false` names none."""
    graph = nx.DiGraph([("ngram", "large"), ("tiny", "large")])
    seconds = {"ngram": 1e-6, "tiny": 0.001, "large": 0.040}
    plans = {}
    for accepted, enabled in ((3, True), (0, True), (3, False)):
        policy = bound(AutoPolicy(explore=0.0, warmup=0, probe_every=10**9, stand_in=enabled), graph)
        for estimates in policy.regimes[False].contexts.values():
            estimates.kinds = {"ngram": "ngram", "tiny": "hf", "large": "hf"}
        teach(policy, ("ngram", "large"), [("ngram", "large", 4, 4)], seconds)
        teach(policy, ("tiny", "large"), [("tiny", "large", 4, accepted)], seconds)
        plans[accepted, enabled] = policy.plan(ctx(graph))
    assert all(p.path == ("ngram", "large") for p in plans.values())
    assert plans[3, True].stand_in == {"ngram": "tiny"} and plans[3, True].lookahead["tiny"] >= 1
    assert "tiny" in plans[3, True].stop  # its own calibrated stop
    assert plans[0, True].stand_in == {} and plans[3, False].stand_in == {}


def test_under_load_a_stand_in_needs_its_own_chain_measured_no_dearer_than_the_authority():
    """At more than one sequence a stand-in's first block after prompt lookup drafted makes it
    catch up on every sequence of the batch (no price holds that), so it is named only where its
    own chain has measured, at that batch size, no dearer a token than the authority alone; at
    one sequence its price suffices, as before."""
    graph = nx.DiGraph([("ngram", "large"), ("tiny", "large")])
    seconds = {"ngram": 1e-6, "tiny": 0.001, "large": 0.040}
    policy = bound(AutoPolicy(explore=0.0, warmup=0, probe_every=10**9), graph)
    for estimates in policy.regimes[False].contexts.values():
        estimates.kinds = {"ngram": "ngram", "tiny": "hf", "large": "hf"}
    teach(policy, ("ngram", "large"), [("ngram", "large", 4, 4)], seconds)
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 3)], seconds)

    def plan(batch):
        c = PlanContext(graph, "large", 100, 0, frozenset(graph.nodes), batch_size=batch)
        return policy.plan(c)

    assert plan(1).stand_in == {"ngram": "tiny"}
    assert plan(4).path == ("ngram", "large") and plan(4).stand_in == {}  # not measured at 4 sequences
    bucket = batch_bucket(4)
    policy.realized[False, bucket, ("large",)] = Realized(seconds=0.010 * 32, tokens=32, steps=32)
    policy.realized[False, bucket, ("tiny", "large")] = Realized(seconds=0.012 * 32, tokens=32, steps=32)
    policy.regimes[False].prices.clear()
    assert plan(4).stand_in == {}  # measured dearer than the authority alone there
    policy.realized[False, bucket, ("tiny", "large")] = Realized(seconds=0.008 * 32, tokens=32, steps=32)
    assert plan(4).stand_in == {"ngram": "tiny"}


def test_a_stand_in_that_beats_the_authority_by_less_than_the_draft_margin_still_stands_in():
    """The stand-in is measured at every step it drafts, so it needs only to beat the authority
    alone: with `draft_margin` on top, a drafter priced a few percent cheaper (an unlucky early
    estimate of one that pays) was turned off for good. A path chosen over the authority still
    needs the margin."""
    graph = nx.DiGraph([("ngram", "large"), ("tiny", "large")])
    seconds = {"ngram": 1e-6, "tiny": 0.006, "large": 0.040}
    policy = bound(AutoPolicy(explore=0.0, warmup=0, probe_every=10**9, draft_margin=0.1), graph)
    for estimates in policy.regimes[False].contexts.values():
        estimates.kinds = {"ngram": "ngram", "tiny": "hf", "large": "hf"}
    teach(policy, ("ngram", "large"), [("ngram", "large", 4, 4)], seconds)
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 1)], seconds, rounds=12)
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 0)], seconds, rounds=48)
    estimates = policy._estimates()
    drafting = estimates.path_cost(("tiny", "large"), 12)[0]
    alone = estimates.path_cost(("large",), 12)[0]
    assert alone / (1 + policy.params.draft_margin) < drafting < alone  # cheaper, by less than the margin
    plan = policy.plan(ctx(graph))
    assert plan.path == ("ngram", "large") and plan.stand_in == {"ngram": "tiny"}
    # as a path of its own against the authority alone, the margin still holds it back
    alone_graph = nx.DiGraph([("tiny", "large")])
    policy = bound(AutoPolicy(explore=0.0, warmup=0, probe_every=10**9, draft_margin=0.1, trees=[]), alone_graph)
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 1)], seconds, rounds=12)
    teach(policy, ("tiny", "large"), [("tiny", "large", 4, 0)], seconds, rounds=48)
    assert policy.plan(ctx(alone_graph)).path == ("large",)


def test_drafting_that_measures_dearer_than_the_authority_alone_gives_way_to_it():
    """The price is a model; what a drafting path's steps cost per committed token, measured at the
    batch size (after ``realized_after`` sequence-steps, steps in which a level caught up left
    out), decides between it and the authority alone."""
    graph = nx.DiGraph([("tiny", "large")])

    def run(realized_after, step_seconds, catch_up=0, steps=40, retry=0, lookup=False, wall=None):
        g = graph.copy()
        if lookup:  # tiny is prompt lookup, and it is the level that catches up
            g.nodes["tiny"]["kind"] = "ngram"
        policy = bound(EscalationPolicy(explore=0.0, warmup=0, probe_every=10**9, realized_after=realized_after,
                                        realized_retry=retry), g)
        est = policy.estimates
        for level, seconds in (("tiny", 0.0), ("large", 0.010)):  # priced: tiny free, large flat in width
            for width in (1, 2, 3):
                for _ in range(10):
                    est.costs.setdefault(level, LevelCost()).observe_pass(1, width, seconds, rows=1)
        edge = est.edge("tiny", "large")
        edge.prior, edge.prior_weight = 0.5, 1e9  # priced a third cheaper than the authority alone
        c = PlanContext(g, "large", 100, 0, frozenset(g.nodes))
        paths = []
        for _ in range(steps):
            plan = policy.plan(c)
            paths.append(plan.path)
            policy.observe_pass(PassCost("tiny" if lookup else "large", 1, 1, 2, 0.010, catch_up=catch_up))
            drafting = len(plan.path) > 1
            # each step commits one token (the drafts are never accepted): a drafting one in
            # step_seconds, the authority's alone in its pass's 10 ms
            policy.observe(StepFeedback(plan, (EdgeOutcome("tiny", "large", 1, 0),) if drafting else (),
                                        {"large": step_seconds if drafting else 0.010}, {"large": 1}, 1,
                                        seconds=(wall if drafting else 0.010) if wall else None))
        return paths

    dear = run(16, 0.030)  # each drafting step really costs 30 ms a token: 3x the authority alone
    assert all(p == ("tiny", "large") for p in dear[:16]) and all(p == ("large",) for p in dear[20:])
    assert all(p == ("tiny", "large") for p in run(0, 0.030))  # off: the price alone decides
    assert all(p == ("tiny", "large") for p in run(16, 0.008))  # measured cheaper than alone: kept
    assert all(p == ("tiny", "large") for p in run(16, 0.030, catch_up=100))  # catching up: not counted
    # prompt lookup catches up for nothing (no pass): its steps count, and it gives way
    lookup = run(16, 0.030, catch_up=100, lookup=True)
    assert all(p == ("tiny", "large") for p in lookup[:16]) and all(p == ("large",) for p in lookup[20:])
    # the step's wall time is what counts where the engine timed it: the levels' seconds leave out
    # its own work around the passes (here 25 of a drafting step's 30 ms)
    timed = run(16, 0.005, wall=0.030)
    assert all(p == ("tiny", "large") for p in timed[:16]) and all(p == ("large",) for p in timed[20:])
    # with realized_retry, a path that gave way is measured afresh after that many sequence-steps
    # of waiting, and gives way again where it still measures dearer, waiting twice as long
    drafted = [len(p) > 1 for p in run(16, 0.030, steps=400, retry=64)]
    starts = [i for i, d in enumerate(drafted) if d and (i == 0 or not drafted[i - 1])]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) == 3 and 60 <= gaps[0] <= 100 and 1.6 * gaps[0] <= gaps[1] <= 2.4 * gaps[0]
