"""Ranking plans by the cost model: the lowest estimated seconds per forward, then the most bytes on the fastest
tier, then the fewest changes of executing device."""

from __future__ import annotations

from ..cost import Cost, estimate
from ..errors import InfeasiblePlacement
from ..placement import Placement, clean_device_map
from ..problem import Problem
from ..runs import columns
from ..runtime import Recent, map_runs
from ..validate import _fmt, check

__all__ = ["score", "priced", "best_of", "infeasible"]

#: How many valid candidates (by bytes on the fastest tier) ``best_of`` prices with the cost model.
PRICED = 8


_PRICED = Recent()


def priced(problem: Problem, device_map) -> Cost:
    """``estimate(problem, device_map)`` under the problem's profile; the last few results are remembered."""
    cost, key = _PRICED.get(problem, device_map)
    if cost is None:
        cost = estimate(problem, device_map)
        _PRICED.put(problem, key, cost)
    return cost


def score(problem: Problem, device_map) -> tuple[float, int, int]:
    """Ranking key of a valid device map; higher is better: (-seconds, resident fast bytes, -device changes)."""
    cost = priced(problem, device_map)
    return -cost.seconds, cost.resident_fast, -cost.device_changes


def _quick(problem: Problem, placed) -> int:
    """Bytes a unit map keeps on the fastest tier (orders the checks), from its runs (:func:`map_runs`, which the
    check and the price of the map then find made)."""
    fast = set(problem.budgets.accelerators) or {"cpu"}
    counted = columns(problem.graph).sum_counted
    return sum(counted[run.end] - counted[run.start] for run in map_runs(problem.graph, placed) if run.device in fast)


def best_of(problem: Problem, candidates, strategy: str) -> Placement:
    """The best valid candidate ``(unit map, note)`` by the cost model; raises when none is valid.

    Candidates are checked in decreasing order of bytes on the fastest tier; the first :data:`PRICED` valid ones are
    priced with :func:`allocator.cost.estimate`.
    """
    ranked = sorted(((_quick(problem, placed), k) for k, (placed, _) in enumerate(candidates)), reverse=True)
    # With at most PRICED candidates every valid one is priced, so only a candidate that would become the best needs
    # its check (the same answer, one check instead of one per candidate); with more, the first PRICED valid ones
    # (in ranked order) are priced, so each is checked on the way.
    lazy = len(candidates) <= PRICED
    best, priced = None, 0
    for _, k in ranked:
        if priced >= PRICED:
            break
        placed, note = candidates[k]
        device_map = clean_device_map(placed) if problem.options.clean_result else dict(placed)
        if lazy:
            key = score(problem, device_map)
            if best is not None and key <= best[0] or check(problem, device_map)[0]:
                continue
        else:
            if check(problem, device_map)[0]:
                continue
            priced += 1
            key = score(problem, device_map)
        if best is None or key > best[0]:
            best = (key, device_map, note)
    if best is None:
        raise infeasible(problem)
    key, device_map, note = best
    return Placement(device_map=device_map, strategy=strategy,
                     notes=(f"{note}: estimated {-key[0] * 1e3:.3f} ms per forward, {_fmt(key[1])} on the "
                            f"fastest tier, {-key[2]} device changes",))


def infeasible(problem: Problem) -> InfeasiblePlacement:
    """The error a strategy raises when no candidate is valid (``allocator.plan`` adds the minimum budget)."""
    return InfeasiblePlacement(
        f"no placement of {problem.graph.model_class} fits these budgets {dict(problem.budgets.limits)}."
    )
