"""``auto``: the best valid plan by the cost model among the fast strategies and a time-boxed ``ilp``.

Runs ``sequential`` (accelerate), ``reserve`` and ``backfill``, then ``ilp`` warm-started from the best of them
within a small deterministic budget (when OR-Tools imports and the model has at most ``ilp.MAX_UNITS`` groups), and
keeps the valid plan with the lowest estimated seconds per forward among those that keep the contract
(:mod:`allocator.strategies.contract`; every valid plan under ``objective="latency"``). Because accelerate's own map
is a candidate where it keeps the contract, the result is never estimated slower than ``sequential`` there, never
keeps fewer bytes on the accelerators than it wherever its map is valid, and it is never invalid: when nothing fits,
:class:`allocator.InfeasiblePlacement` says the minimum budget.

Notes
-----
The sum of its candidates' costs; ``ilp`` gets ``ILP_SECONDS`` of deterministic time, the ``ilp`` strategy's own
default, so that from the same warm start it returns the same plan. Deterministic.
"""

from __future__ import annotations

import logging

from ..errors import AllocatorError
from ..placement import Placement
from ..problem import Problem
from ..units import groups
from ..validate import check
from . import backfill, ilp, reserve, sequential
from ._select import infeasible, score
from .contract import contract_violations

__all__ = ["place"]

log = logging.getLogger(__name__)
CANDIDATES = {"sequential": sequential.place, "reserve": reserve.place, "backfill": backfill.place}
ILP_SECONDS = ilp.TIME_LIMIT


def _ilp_available(problem: Problem) -> bool:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return len(groups(problem.graph, problem.options.offload_buffers)) <= ilp.MAX_UNITS


def place(problem: Problem, **_) -> Placement:
    """The best valid plan of ``sequential``, ``reserve``, ``backfill`` and a time-boxed ``ilp``."""
    best, tried = None, []

    def consider(name, run):
        nonlocal best
        try:
            placement = run()
        except AllocatorError as err:
            tried.append(f"{name}: {type(err).__name__}")
            return
        if check(problem, placement.device_map)[0]:
            tried.append(f"{name}: invalid")
            return
        broken = {v.kind for v in contract_violations(problem, placement.device_map, strategy="auto")}
        if broken - {"contract-floor"}:
            tried.append(f"{name}: breaks the contract")
            return
        # plans that reach accelerate's bytes first; below them only where no candidate does (contract.floor)
        key = (not broken, *score(problem, placement.device_map))
        tried.append(f"{name}: {-key[1] * 1e3:.3f} ms" + (" (below accelerate's bytes)" if broken else ""))
        if best is None or key > best[0]:
            best = (key, placement)

    for name, strategy in CANDIDATES.items():
        consider(name, lambda strategy=strategy: strategy(problem))
    if _ilp_available(problem):
        hint = best[1].device_map if best else None
        consider("ilp", lambda: ilp.place(problem, time_limit=ILP_SECONDS, hint=hint))
    if best is None:
        raise infeasible(problem)
    placement = best[1]
    used = set(placement.device_map.values())
    if problem.budgets.accelerators and not used - {"cpu", "disk"}:
        log.info("no accelerator plan is valid or faster; running everything from RAM (cpu as main device)")
    return Placement(device_map=placement.device_map, strategy=f"auto:{placement.strategy}",
                     notes=(f"candidates: {'; '.join(tried)}",) + placement.notes, optimal=placement.optimal)
