"""Ranking plans: the most bytes resident on the fastest tier, then the fewest changes of executing device."""

from __future__ import annotations

from ..errors import InfeasiblePlacement
from ..placement import Placement, clean_device_map
from ..problem import Problem
from ..runtime import tensor_devices
from ..validate import _fmt, check

__all__ = ["score", "best_of", "infeasible"]


def score(problem: Problem, device_map) -> tuple[int, int]:
    """(bytes resident on the fastest tier, minus the number of executing-device changes); higher is better.

    The fastest tier is the accelerators, or cpu where the budgets name none.
    """
    g = problem.graph
    fast = set(problem.budgets.accelerators) or {"cpu"}
    devices = tensor_devices(g, device_map)
    main = check(problem, device_map)[1].main
    resident = sum(t.counted for t, d in zip(g.tensors, devices) if d in fast and not (d == "cpu" and main != "cpu"))
    changes, last = 0, None
    for t, d in zip(g.tensors, devices):
        if not t.counted:
            continue
        run_on = d if d not in ("cpu", "disk") else main
        changes += last is not None and run_on != last
        last = run_on
    return resident, -changes


def _quick(problem: Problem, placed) -> int:
    """Bytes a unit map keeps on the fastest tier, from the unit names alone (an upper bound used to order checks)."""
    g = problem.graph
    fast = set(problem.budgets.accelerators) or {"cpu"}
    total = 0
    for name, device in placed.items():
        if device in fast:
            i = g.node_index.get(name)
            total += g.size[i] if i is not None else g.tensors[g.tensor_index[name]].counted
    return total


def best_of(problem: Problem, candidates, strategy: str) -> Placement:
    """The best valid candidate ``(unit map, note)``, cleaned as the options say; raises when none is valid.

    Candidates are checked in decreasing order of their bytes on the fastest tier; once one is valid, only the
    others with as many bytes are still checked (for fewer device changes).
    """
    ranked = sorted(((_quick(problem, placed), k) for k, (placed, _) in enumerate(candidates)), reverse=True)
    best = None
    for quick, k in ranked:
        if best is not None and quick < best[0][0]:
            break
        placed, note = candidates[k]
        device_map = clean_device_map(placed) if problem.options.clean_result else dict(placed)
        if check(problem, device_map)[0]:
            continue
        key = score(problem, device_map)
        if best is None or key > best[0]:
            best = (key, device_map, note)
    if best is None:
        raise infeasible(problem)
    key, device_map, note = best
    return Placement(device_map=device_map, strategy=strategy,
                     notes=(f"{note}: {_fmt(key[0])} on the fastest tier, {-key[1]} device changes",))


def infeasible(problem: Problem) -> InfeasiblePlacement:
    """The error a strategy raises when no candidate is valid (``allocator.plan`` adds the minimum budget)."""
    return InfeasiblePlacement(
        f"no placement of {problem.graph.model_class} fits these budgets {dict(problem.budgets.limits)}."
    )
