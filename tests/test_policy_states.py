"""The cost-model policies' decisions, pinned: `cost-aware`, `escalation` and `auto` driven through
fixed, seeded sequences of contexts and feedback (greedy and sampled requests, batch sizes, a level
going down, prompt lookup without a match, trees, stand-ins, a text that changes half-way), every
plan they return compared with the one recorded in ``policy_states.json``.

The fixture pins behaviour across refactors of the policies' internals: a change that moves a
decision must say so by regenerating it (``python tests/test_policy_states.py``) and explaining why.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import networkx as nx
import pytest

from policies import make_policy
from policies.base import EdgeOutcome, PassCost, PlanContext, StepFeedback, StepPlan
from policies.estimates import tree_passes
from policies.stops import CalibratedStop

FIXTURE = Path(__file__).with_name("policy_states.json")

# level -> (seconds per pass, per position per sequence, per sequence of the batch)
COSTS = {"ngram": (2e-5, 0.0, 0.0), "tiny": (0.001, 0.00002, 0.0001), "small": (0.003, 0.0001, 0.0003),
         "large": (0.010, 0.0012, 0.0006)}
# edge -> acceptance per token (greedy, sampled); prompt lookup's depends on the request
RATES = {("tiny", "small"): (0.75, 0.6), ("tiny", "large"): (0.55, 0.35), ("small", "large"): (0.7, 0.5)}


def graph(edges, ngram=()):
    g = nx.DiGraph(edges)
    for n in ngram:
        g.nodes[n]["kind"] = "ngram"
    return g


FULL = graph([("ngram", "large"), ("tiny", "small"), ("small", "large"), ("tiny", "large")], ngram=("ngram",))
LOOKUP = graph([("ngram", "large"), ("tiny", "large")], ngram=("ngram",))
CHAIN = graph([("tiny", "small"), ("small", "large")])

SCENARIOS = {
    "escalation": ("escalation", {"warmup": 2, "probe_every": 16, "probe_backoff": 4, "confident": 0.6,
                                  "trees": [[2, 2]], "seed": 3}, FULL, 180),
    # drafters that do not pay: the authority decodes alone, and a request's lookup probe waits for a match
    "escalation-alone": ("escalation", {"probe_every": 64, "seed": 6}, LOOKUP, 200,
                         {"hard": 0.15, "batches": (1,), "repeats": 0.2}),
    "auto": ("auto", {"probe_every": 24, "seed": 1}, FULL, 180),
    "auto-budget": ("auto", {"verify_budget": 12, "stop_threshold": 0.3, "explore": 0.1, "probe_every": 12,
                             "seed": 5}, LOOKUP, 150),
    "auto-no-stop": ("auto", {"stop": False, "trees": [], "stand_in": False, "confident": 0.5, "probe_every": 20,
                              "explore": 0.05, "seed": 2}, FULL, 150),
    "escalation-defaults": ("escalation", {}, LOOKUP, 150),
    "cost-aware": ("cost-aware", {"explore": 0.1, "verify_budget": 16, "seed": 4}, CHAIN, 100),
}


def seconds(level: str, batch: int, width: int) -> float:
    per_pass, per_position, per_row = COSTS[level]
    return per_pass + per_row * batch + per_position * batch * width


def edge_outcome(rng, proposer, verifier, proposed, rate, first, tree=None):
    if tree is not None:  # a tree: which rank matched at each depth, until none did
        ranks = []
        for width in tree[:proposed]:
            if rng.random() >= min(0.95, rate * (1 + 0.4 * (width - 1))):
                break
            ranks.append(rng.randrange(width))
        return EdgeOutcome(proposer, verifier, proposed, len(ranks), None, tree_passes(tree)[1], tuple(ranks))
    accepted = 0
    while accepted < proposed and rng.random() < rate:
        accepted += 1
    confidence = tuple(round(rng.random(), 3) for _ in range(proposed)) if first and proposed else None
    return EdgeOutcome(proposer, verifier, proposed, accepted, confidence)


def feedback(rng, plan: StepPlan, c: PlanContext, request: dict) -> tuple[StepFeedback, dict[str, int]]:
    """One sequence's outcome of ``plan``, and the widths each level's passes scored."""
    path, edges, widths = plan.path, [], {}
    proposer = path[0]
    proposed = plan.lookahead.get(path[0], 0)
    if proposer == "ngram" and rng.random() < request["no_match"]:
        proposed = 0
        stand_in = plan.stand_in.get("ngram")
        if stand_in is not None:
            proposer, proposed = stand_in, plan.lookahead.get(stand_in, 0)
    if proposed and plan.stop.get(proposer) is not None:
        proposed = rng.randint(1, proposed)
    for i, (below, level) in enumerate(zip(path, path[1:])):
        below = proposer if i == 0 else below
        if i:
            proposed = plan.lookahead.get(below, 0)
        rate = request["lookup"] if below == "ngram" else RATES[below, level][c.sampled]
        e = edge_outcome(rng, below, level, proposed, rate * request["text"], i == 0, plan.tree.get(below))
        edges.append(e)
        widths[below] = max(widths.get(below, 1), 1)
        widths[level] = (e.candidates or e.proposed) + 1
    widths.setdefault(path[-1], 1)
    first = edges[0].confidence if edges else None
    # as the engine reports them: the first level's passes (one per drafted token or tree depth),
    # and each level's time as this sequence's share of the batch's passes
    passes = {n: 1 for n in widths}
    if edges:
        passes[proposer] = max(1, len(plan.tree.get(proposer, ())) or edges[0].proposed)
    b = c.batch_size
    return StepFeedback(plan, tuple(edges), {n: seconds(n, b, w) * passes[n] / b for n, w in widths.items()},
                        passes, 1 + (edges[-1].accepted if edges else 0),
                        sum(first) / len(first) if first else None, sampled=c.sampled), widths


def describe(plan: StepPlan) -> str:
    """A plan in one line: path, lookahead, stop rules, tree, stand-in."""
    parts = [">".join(plan.path), ",".join(f"{n}={k}" for n, k in sorted(plan.lookahead.items()))]
    for level, rule in sorted(plan.stop.items()):
        assert isinstance(rule, CalibratedStop), rule
        parts.append(f"stop:{level}:{rule.threshold:.9g}:{sum(rule.first):.9g}:{sum(rule.later):.9g}")
    parts += [f"tree:{n}:{list(w)}" for n, w in sorted(plan.tree.items())]
    parts += [f"stand_in:{n}:{s}" for n, s in sorted(plan.stand_in.items())]
    return " ".join(parts)


def drive(name: str) -> list[str]:
    """Every plan the scenario's policy returns, as :func:`describe` writes it."""
    policy_name, params, g, steps, *options = SCENARIOS[name]
    options = options[0] if options else {}
    hard = options.get("hard", 1.0)
    policy = make_policy(policy_name, params)
    policy.bind(g, "large")
    rng = random.Random(name)
    plans, step, request = [], 0, None
    for n in range(steps):
        if request is None or step >= request["length"]:
            repeats = rng.random() < options.get("repeats", 0.5)
            request = {"length": rng.randint(8, 40), "sampled": rng.random() < 0.4,
                       "batch": rng.choice(options.get("batches", (1, 1, 1, 2, 4, 8))), "lookup": 0.9 if repeats else 0.1,
                       "no_match": 0.2 if repeats else 0.85}
            step = 0
        request["text"] = hard if n < steps // 2 else hard / 2  # half-way the text gets harder for every drafter
        available = frozenset(g.nodes)
        if "small" in g and 60 <= n < 70:
            available -= {"small"}
        c = PlanContext(g, "large", 100, step, available, batch_size=request["batch"], sampled=request["sampled"])
        plan = policy.plan(c)
        plans.append(describe(plan))
        passes: dict[str, int] = {}
        for _ in range(c.batch_size):
            fb, widths = feedback(rng, plan, c, request)
            policy.observe(fb)
            for level, width in widths.items():
                passes[level] = max(passes.get(level, 1), width)
        for level, width in passes.items():
            b = c.batch_size
            policy.observe_pass(PassCost(level, b, 1, b * width, seconds(level, b, width)))
        step += 1
    return plans


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_same_feedback_gives_the_same_plans(name):
    expected = json.loads(FIXTURE.read_text())[name]
    plans = drive(name)
    first = next((i for i, (a, b) in enumerate(zip(plans, expected)) if a != b), None)
    assert first is None and len(plans) == len(expected), (
        f"plan {first} of {len(expected)}: {plans[first] if first is not None else len(plans)} "
        f"!= {expected[first] if first is not None else ''}")


def test_the_scenarios_cover_the_policies_states():
    """The fixture is only as good as what it drives: probes, explores, trees, stand-ins, stops
    and both regimes all occur."""
    recorded = json.loads(FIXTURE.read_text())
    every = [p for plans in recorded.values() for p in plans]
    assert any("tree:" in p for p in every) and any("stand_in:" in p for p in every)
    assert any("stop:" in p for p in every)
    assert len({p.split()[0] for p in recorded["escalation"]}) >= 5  # every path of FULL, probed


if __name__ == "__main__":  # regenerate the fixture (only for a change that is meant to move decisions)
    FIXTURE.write_text(json.dumps({name: drive(name) for name in sorted(SCENARIOS)}, indent=0) + "\n")
