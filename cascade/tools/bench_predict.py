"""``cascade bench``'s predicted speedups: what a cascade configuration's measured acceptance per
draft position and seconds per forward pass of each level predict (cascade/DESIGN.md §4, composed
up the hierarchy by ``Estimates.path_cost``), for the path its steps mostly took."""
from __future__ import annotations

from cascade.tools.bench_records import ConfigReport, Sample


def predicted_seconds_per_token(path: tuple[str, ...], stats, max_lookahead: int = 8) -> float | None:
    """Seconds per committed token that the measured acceptance and costs (a ``RequestStats``)
    predict for this path, with the best lookahead per edge."""
    from policies.estimates import EdgeAcceptance, Estimates, LevelCost

    est = Estimates()
    for level, s in stats.levels.items():
        if s.forward_passes:
            est.costs[level] = LevelCost(seconds=s.seconds / s.forward_passes)
    if path[0] not in est.costs:  # a free proposer (n-gram): no forward passes
        est.costs[path[0]] = LevelCost(seconds=1e-6)
    for below, level in zip(path, path[1:]):
        e = stats.edges.get(f"{below}->{level}")
        if e is None:
            return None
        acc = EdgeAcceptance(prior=0.0, prior_weight=0.0, decay=1.0)
        acc.seen = [float(x) for x in e.examined_by_position]
        acc.accepted = [float(x) for x in e.accepted_by_position] + [0.0] * (len(acc.seen) - len(e.accepted_by_position))
        est.edges[(below, level)] = acc
    per_token, _ = est.path_cost(path, max_lookahead)
    return per_token


def main_path(stats) -> tuple[str, ...]:
    """The path a configuration's steps mostly took (a ``RequestStats``): from the authority down,
    the proposer of each level's most verified blocks. A policy that chooses paths (``auto``)
    probes the others now and then, too briefly for their measurements to predict anything."""
    edges = [(*key.split("->"), e.blocks) for key, e in stats.edges.items() if e.blocks]
    path = [stats.authority]
    while True:
        blocks = {below: n for below, above, n in edges if above == path[0] and below not in path}
        if not blocks:
            return tuple(path)
        path.insert(0, max(blocks, key=blocks.get))


def cascade_fields(rep: ConfigReport, graph, path: tuple[str, ...], xs: list[Sample], plain_spt: float) -> None:
    """Acceptance, time per level and the predicted speedup of a cascade configuration."""
    from cascade.stats import RequestStats

    tokens = sum(s.tokens for s in xs)
    rep.edges = [f"{a}->{b}" for a, b in graph.edges]
    merged = RequestStats(path[-1])
    for s in xs:
        merged.merge(s.stats)
    rep.acceptance = {k: e.acceptance_rate for k, e in merged.edges.items()}
    rep.acceptance_by_position = {k: e.conditional_acceptance() for k, e in merged.edges.items()}
    rep.level_seconds_per_token = {k: v.seconds / tokens for k, v in merged.levels.items()}
    wall = sum(s.seconds for s in xs)
    rep.orchestration_seconds_per_token = (wall - sum(v.seconds for v in merged.levels.values())) / tokens
    taken = main_path(merged)
    predicted = predicted_seconds_per_token(taken, merged) if len(taken) > 1 else None
    if predicted:
        rep.predicted_path = list(taken)
        rep.predicted_speedup = plain_spt / predicted
        rep.measured_over_predicted = (plain_spt / (wall / tokens)) / rep.predicted_speedup
