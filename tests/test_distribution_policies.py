"""Exactness under every adaptive policy: the distribution test of test_distribution.py with
the policy in control (separate file so that pytest-xdist runs it beside the engine cases)."""
from __future__ import annotations

from collections import Counter

import pytest

from cascade import Cascade
from conftest import write_topology
from draws import BATCH, MAX_NEW, PROMPT, SCALE, VOCAB, exact_pairs
from stats_util import chi_square_pvalue, total_variation

SPLIT_ACROSS_WORKERS = True  # long independent draws: one by one to a free worker (conftest.py)


ADAPTIVE = [
    # (policy, params): every adaptive policy in control, with low thresholds so that
    # confidence stops really fire on these tables, over a DAG with a shortcut edge.
    ("confidence", {"lookahead": 3, "threshold": 0.5}),
    ("confidence", {"lookahead": 3, "threshold": 0.3, "mode": "block"}),
    ("entropy", {"lookahead": 3, "threshold": 0.4}),
    ("cost-aware", {"max_lookahead": 3, "explore": 0.3}),
    ("escalation", {"max_lookahead": 3, "explore": 0.3}),
    ("auto", {"max_lookahead": 3, "explore": 0.3, "stop_threshold": 0.8, "warmup": 1, "probe_every": 4}),
]
AUTO = ADAPTIVE[-1][1]


# The policies are drawn 64 requests at a time (a third of the cost of one at a time), and
# `auto`, the default, one at a time as well: a lone request is how most users meet it.
@pytest.mark.parametrize("name,params,batch_size", [(n, p, BATCH) for n, p in ADAPTIVE] + [("auto", AUTO, 1)],
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(ADAPTIVE)] + ["auto-alone"])
def test_joint_distribution_under_adaptive_policies(tmp_path, name, params, batch_size):
    """Adaptive stopping is a stopping time of the proposer and path/lookahead choices depend
    only on earlier steps, so the output stays exact: the same bound holds. Batched, the stop
    rules of `confidence` and `entropy` end each row's block on its own; `auto`'s decides for
    the rows of a draft call together, and the plans of `cost-aware`, `escalation` and `auto`
    are the group's, learned from every row's past. A row's block length and path then depend
    on the other rows' drafts and past, never on its own verification draws, so each row is
    still an exact sample, independent of the others given the policy's state."""
    n = 100_000
    policy = {"name": name, "params": params}
    levels = [{"name": nm, "kind": "table_worker:TableWorker",
               "params": {"vocab_size": VOCAB, "seed": 10 + i, "scale": SCALE}}
              for i, nm in enumerate(["small", "medium", "large"])]
    data = {"levels": levels, "policy": policy,
            "edges": [["small", "medium"], ["medium", "large"], ["small", "large"]]}
    topo = str(write_topology(tmp_path / "adaptive.yaml", data))
    with Cascade.from_topology(topo) as c:
        # the speculative rule (an unseeded request's default), where the policy's stops matter
        results = c.generate([PROMPT] * n, max_new_tokens=MAX_NEW, seed=21, temperature=1.0, batch_size=batch_size,
                             coupling="residual")
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    expected = exact_pairs(3, 1.0, 0, 1.0)
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue)
    assert total_variation(counts, expected, n) < 0.012
    # the policy really steered: stops fired, or more than one path was taken
    total = results[0].stats
    for g in results[1:20000]:
        total.merge(g.stats)
    stops = sum(s.early_stops for s in total.levels.values())
    if name in ("confidence", "entropy"):
        assert stops > 100, total
    if name == "auto":  # fewer: where it prices trees cheaper (no stop) it takes them
        assert stops > 20, total
    if name in ("escalation", "auto"):  # more than one path was taken
        assert len(total.edges) >= 2 and all(e.proposed > 0 for e in total.edges.values()), total
    if name == "auto" and batch_size == 1:  # its probes drafted trees too (AutoParams.trees), verified by
        # the tree rule (at more than one sequence a probe takes only the shape priced cheapest
        # there: batched trees under the tree rule are tests/test_distribution_trees.py's)
        assert sum(e.tree_nodes for e in total.edges.values()) > 100, total
    if name == "cost-aware":  # its lookahead put drafts in front of the verifier
        assert sum(e.proposed for e in total.edges.values()) > 100, total
