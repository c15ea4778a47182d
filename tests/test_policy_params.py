"""Policy parameters: one validated model per policy, one parser (``policies.from_spec``) at
every boundary, one error naming the policy and the field; a policy object serves one topology."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cascade import Cascade, RequestError, TopologyError, load_topology
from cascade.cli import main
from conftest import write_topology
from policies import REGISTRY, Policy, PolicyError, from_spec, make_policy, parse_policy_spec, resolve
from policies.adaptive import AutoPolicy, ConfidencePolicy, CostAwarePolicy, EscalationPolicy
from policies.fixed import FixedPolicy

# (policy, params, field the error names): one row per kind of constraint
BAD = [
    ("fixed", {"lookahead": -1}, "lookahead"),  # ge
    ("fixed", {"lookahead": {"tiny": 2, "small": -1}}, "lookahead.small"),  # a per-level mapping's value
    ("fixed", {"lookahead": 3.0}, "lookahead"),  # a float is not an integer
    ("fixed", {"lookahead": "3"}, "lookahead"),  # nor is a string
    ("fixed", {"lookahead": True}, "lookahead"),  # nor a bool
    ("fixed", {"path": []}, "path"),  # min_length
    ("fixed", {"path": "tiny"}, "path"),  # a list
    ("fixed", {"nonsense": 1}, "nonsense"),  # extra="forbid"
    ("confidence", {"lookahead": 0}, "lookahead"),  # ge 1
    ("confidence", {"lookahead": 65}, "lookahead"),  # le 64
    ("confidence", {"threshold": 1.5}, "threshold"),  # le 1
    ("confidence", {"mode": "sometimes"}, "mode"),  # one of token, block
    ("entropy", {"rate": -0.1}, "rate"),  # ge 0
    ("cost-aware", {"verify_budget": 0}, "verify_budget"),  # ge 1 or null
    ("cost-aware", {"prior": float("nan")}, "prior"),  # non-finite
    ("escalation", {"pool_weight": float("inf")}, "pool_weight"),  # non-finite
    ("escalation", {"probe_backoff": 0}, "probe_backoff"),
    ("escalation", {"probe_retries": -1}, "probe_retries"),
    ("escalation", {"contender_margin": float("nan")}, "contender_margin"),
    ("auto", {"reprice_every": 0}, "reprice_every"),
    ("cost-aware", {"regime_carry": -1.0}, "regime_carry"),
    ("cost-aware", {"explore_steps": 0}, "explore_steps"),
    ("auto", {"explore_lookahead": 65}, "explore_lookahead"),
    ("escalation", {"path": ["tiny", "large"]}, "path"),  # escalation chooses the path itself
    ("auto", {"stop": 1}, "stop"),  # a strict bool
    ("auto", {"stop_threshold": 2}, "stop_threshold"),
    ("auto", {"warmup": -1}, "warmup"),
    ("auto", {"price_lookahead": np.float64(12.0)}, "price_lookahead"),
]


@pytest.mark.parametrize("name,params,field", BAD, ids=[f"{n}-{f}" for n, _, f in BAD])
def test_a_bad_parameter_is_one_error_naming_policy_and_field(name, params, field):
    with pytest.raises(PolicyError) as info:
        make_policy(name, params)
    message = str(info.value)
    assert message.startswith(f"params.{field}: "), message
    assert f"policy {name!r}" in message, message
    # the same from a spec mapping and from keyword arguments
    with pytest.raises(PolicyError, match=rf"^params\.{field}: "):
        from_spec({"name": name, "params": params})
    with pytest.raises(PolicyError, match=rf"^params\.{field}: "):
        resolve(name)(**params)


def test_defaults_and_numpy_integers():
    auto = AutoPolicy()
    esc, cost = EscalationPolicy(), CostAwarePolicy()
    a, e, c = auto.params, esc.params, cost.params
    assert (a.max_lookahead, a.explore, auto.estimates.prior, auto.estimates.decay) == (32, 0.0, 0.7, 0.999)
    assert (a.warmup, a.probe_every, a.probe_backoff, a.price_lookahead, a.stop) == (2, 128, 8, 12, True)
    assert (e.max_lookahead, e.explore, esc.estimates.prior, e.draft_margin, e.confident) == (8, 0.05, 0.7, 0.1, None)
    assert (c.max_lookahead, c.explore, cost.estimates.prior, c.verify_budget) == (8, 0.1, 0.6, None)
    assert FixedPolicy().lookahead_for("tiny") == 4
    conf = ConfidencePolicy()
    assert (conf.lookahead, conf.threshold, conf.mode) == (8, 0.4, "token")
    # integer-like numpy scalars count as integers, and come out as ints
    fixed = FixedPolicy(lookahead={"tiny": np.int64(3)})
    assert fixed.lookahead_for("tiny") == 3 and type(fixed.lookahead_for("tiny")) is int
    assert type(AutoPolicy(max_lookahead=np.int32(16), seed=np.uint8(3)).params.max_lookahead) is int


def test_construction_is_keyword_only_from_one_params_model():
    params = AutoPolicy.Params(max_lookahead=16, warmup=0)
    assert AutoPolicy(params).params is params and AutoPolicy(params).params.max_lookahead == 16
    with pytest.raises(PolicyError, match="^params: ConfidencePolicy takes keyword arguments"):
        ConfidencePolicy(8)  # positional values no longer bind by position
    with pytest.raises(PolicyError, match="^params: AutoPolicy takes keyword arguments"):
        AutoPolicy(params, warmup=1)
    with pytest.raises(PolicyError, match="^params: EscalationPolicy takes"):
        EscalationPolicy(params)  # another policy's model
    # the fixed policy's lookahead stays positional, as before
    assert FixedPolicy({"tiny": 2}, path=["tiny", "large"]).params == FixedPolicy.Params(
        lookahead={"tiny": 2}, path=["tiny", "large"])


def test_from_spec_round_trips():
    for name in REGISTRY:
        policy = from_spec(name)
        assert type(policy) is resolve(name) and policy.params == resolve(name)().params
        values = policy.params.model_dump(exclude_none=True)
        text = name + ":" + ",".join(f"{k}={json.dumps(v)}" for k, v in values.items())
        assert from_spec(text).params == policy.params, text
        assert from_spec({"name": name, "params": values}).params == policy.params
    spec = "fixed:lookahead={tiny: 3, small: 5},path=[tiny, small, large]"
    assert from_spec(spec).params == FixedPolicy(lookahead={"tiny": 3, "small": 5},
                                                 path=["tiny", "small", "large"]).params
    assert from_spec({"name": "fixed", "params": parse_policy_spec(spec)[1]}).params == from_spec(spec).params
    assert from_spec("policies.adaptive:ConfidencePolicy:threshold=0.3").threshold == 0.3
    policy = AutoPolicy()
    assert from_spec(policy) is policy  # a Policy passes through


@pytest.mark.parametrize("spec,start", [
    ("nosuch", "name: unknown policy 'nosuch'"),
    ("", "name: empty policy name"),
    ({"name": "fixed", "parms": {}}, "parms: unknown field"),
    ({"name": 3}, "name: expected a policy name"),
    ({"name": "fixed", "params": [1]}, "params: expected a mapping"),
    (3, "name: expected a spec string"),
    ("fixed:lookahead=3,path", "params: expected key=value"),
    ("fixed:lookahead=3,lookahead=4", "params.lookahead: given twice"),
    ("fixed:lookahead=[&a 1, *a]", "params.lookahead: cannot parse"),  # YAML aliases refused
    ("auto:prior=.inf", "params.prior: Input should be a finite number"),
])
def test_from_spec_refuses_bad_specs(spec, start):
    with pytest.raises(PolicyError) as info:
        from_spec(spec)
    assert str(info.value).startswith(start), str(info.value)


def table_level(name, seed):
    return {"name": name, "kind": "table_worker:TableWorker", "params": {"vocab_size": 6, "seed": seed}}


def table_file(tmp_path, name="t.yaml", **extra):
    data = {"levels": [table_level("a", 1), table_level("b", 2), table_level("c", 3)], **extra}
    return write_topology(tmp_path / name, data)


def test_the_api_takes_spec_strings(tmp_path):
    with Cascade.from_topology(table_file(tmp_path)) as c:
        def greedy(policy):
            return c.generate([0, 1], max_new_tokens=24, temperature=0.0, policy=policy).token_ids

        want = greedy(FixedPolicy(lookahead={"a": 2, "b": 4}))
        assert greedy("fixed:lookahead={a: 2, b: 4}") == want
        assert greedy({"name": "fixed", "params": {"lookahead": {"a": 2, "b": 4}}}) == want
        assert greedy("fixed:path=[c]") == want  # the authority alone: exact
        assert greedy("auto") == want
        with pytest.raises(RequestError, match=r"^policy: params\.lookahead: .*policy 'fixed'"):
            greedy("fixed:lookahead=-1")
        with pytest.raises(RequestError, match=r"^policy: params\.lookahead: unknown level"):
            greedy("fixed:lookahead={zz: 2}")
        batch = c.batch(policy="fixed:lookahead=2")
        state = batch.add(c.request([0, 1], max_new_tokens=8, temperature=0.0))
        while batch.active:
            batch.step()
        assert state.generated == want[:8]


def test_from_topology_applies_keyword_params_to_the_files_policy(tmp_path):
    path = table_file(tmp_path, policy={"name": "fixed", "params": {"path": ["b", "c"]}})
    with Cascade.from_topology(path, lookahead=3) as c:
        assert c.engine.policy.params == FixedPolicy.Params(lookahead=3, path=["b", "c"])
    with Cascade.from_topology(path, policy="auto", max_lookahead=10) as c:
        assert isinstance(c.engine.policy, AutoPolicy) and c.engine.policy.params.max_lookahead == 10
    with pytest.raises(RequestError, match=r"^policy: params\.lookahead: .*policy 'fixed', got -1"):
        Cascade.from_topology(path, lookahead=-1)
    with pytest.raises(RequestError, match=r"^policy: params\.nonsense: unknown parameter"):
        Cascade.from_topology(path, nonsense=1)
    with pytest.raises(RequestError, match=r"^lookahead: policy parameters as keywords need a policy name"):
        Cascade.from_topology(path, policy=FixedPolicy(), lookahead=3)


def test_one_policy_object_serves_one_topology(tmp_path):
    chain = table_file(tmp_path, "chain.yaml")
    dag = table_file(tmp_path, "dag.yaml", edges=[["a", "c"], ["b", "c"]])
    policy = FixedPolicy(lookahead=3)
    with Cascade.from_topology(chain, policy=policy) as c1:
        want = c1.generate([0], max_new_tokens=16, temperature=0.0).token_ids
        # the same graph (another cascade of the same file): the policy works there too
        with Cascade.from_topology(chain, policy=policy) as c2:
            assert c2.generate([0], max_new_tokens=16, temperature=0.0).token_ids == want
        with pytest.raises(RequestError, match="^policy: bind: this 'fixed' policy object already serves another"):
            Cascade.from_topology(dag, policy=policy)
        with Cascade.from_topology(dag) as c3:
            with pytest.raises(RequestError, match="^policy: bind: .*give each cascade its own"):
                c3.generate([0], max_new_tokens=4, policy=policy)
            assert c3.generate([0], max_new_tokens=16, temperature=0.0, policy="fixed:lookahead=3").token_ids == want


@pytest.mark.parametrize("policy,ngram,where", [
    ({"name": "fixed", "params": {"lookahead": -1}}, {}, "policy.params.lookahead: "),
    ({"name": "fixed", "params": {"lookahead": {"zz": 2}}}, {}, "policy.params.lookahead: unknown level"),
    ({"name": "fixed", "params": {"path": ["a", "c"]}}, {}, "policy.params.path: 'a' -> 'c' is not an edge"),
    ({"name": "nosuch"}, {}, "policy.name: unknown policy 'nosuch'"),
    ({"name": "auto", "params": {"prior": float("inf")}}, {}, "policy.params.prior: "),
    ({"name": "fixed"}, {"min_ngram": 0}, "levels[0].params.min_ngram: "),
    ({"name": "fixed"}, {"min_ngram": 4, "max_ngram": 2}, "levels[0].params: min_ngram (4) must be <="),
    ({"name": "fixed"}, {"longest": 2}, "levels[0].params.longest: unknown field"),
])
def test_validate_refuses_bad_policy_and_ngram_params(tmp_path, capsys, policy, ngram, where):
    levels = [table_level("a", 1), table_level("b", 2), table_level("c", 3)]
    if ngram:
        levels.insert(0, {"name": "ng", "kind": "ngram", "params": ngram})
    path = write_topology(tmp_path / "bad.yaml", {"levels": levels, "policy": policy})
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: {where}"), str(info.value)
    assert main(["validate", str(path)]) != 0
    assert f"{path}: {where}" in capsys.readouterr().err
