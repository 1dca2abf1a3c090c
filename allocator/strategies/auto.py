"""``auto``: the best valid plan among the fast strategies.

Runs ``sequential`` (accelerate), ``backfill`` and ``reserve`` and keeps the valid plan with the most bytes on the
fastest tier, then the fewest changes of executing device. Because accelerate's own map is a candidate, the result
never keeps fewer bytes on the fastest tier than ``sequential`` wherever ``sequential``'s map is valid, and it is
never invalid: when nothing fits, :class:`allocator.InfeasiblePlacement` says the minimum budget.

Notes
-----
The sum of its candidates' costs. Deterministic.
"""

from __future__ import annotations

import logging

from ..errors import AllocatorError
from ..placement import Placement
from ..problem import Problem
from ..validate import check
from . import backfill, reserve, sequential
from ._select import infeasible, score

__all__ = ["place"]

log = logging.getLogger(__name__)
CANDIDATES = {"sequential": sequential.place, "reserve": reserve.place, "backfill": backfill.place}


def place(problem: Problem, **_) -> Placement:
    """The best valid plan of ``sequential``, ``reserve`` and ``backfill``."""
    best, tried = None, []
    for name, strategy in CANDIDATES.items():
        try:
            placement = strategy(problem)
        except AllocatorError as err:
            tried.append(f"{name}: {type(err).__name__}")
            continue
        if check(problem, placement.device_map)[0]:
            tried.append(f"{name}: invalid")
            continue
        key = score(problem, placement.device_map)
        tried.append(f"{name}: {key[0]} B fast, {-key[1]} changes")
        if best is None or key > best[0]:
            best = (key, placement)
    if best is None:
        raise infeasible(problem)
    placement = best[1]
    if "cpu" in placement.device_map.values() and not set(placement.device_map.values()) - {"cpu", "disk"} \
            and problem.budgets.accelerators:
        log.info("no accelerator plan fits; running everything from RAM (cpu as main device)")
    return Placement(device_map=placement.device_map, strategy=f"auto:{placement.strategy}",
                     notes=(f"candidates: {'; '.join(tried)}",) + placement.notes)
