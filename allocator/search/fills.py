"""The fills of ``reserve`` and ``backfill`` as candidate generators: first fit under each main device a strategy may
use, with a streaming reserve raised to its fixed point. A strategy hands the candidates to the judge
(:func:`allocator.judge.ranking.best_of`); ``ilp`` and ``balanced`` use the same generators for their warm start and
their offloading split, so no strategy runs another.

Notes
-----
``reserve``: O(m · s · g) for m main devices, s distinct streamed sizes (capped at 64, the largest kept) and g groups;
``backfill``: O(m · g). Deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..budgets import Device
from ..evaluate.units import problem_groups
from ..problem import Problem
from .first_fit import Filled, Streams, fill_to_fixed_point, largest_stream, reserve_sizes

__all__ = ["backfill_candidates", "reserve_candidates"]


def reserve_candidates(problem: Problem, mains: Iterable[Device], memo: dict) -> list[Filled]:
    """First fit under every streaming reserve that some unit's offload would need, for each main device in
    ``mains``; ``memo`` holds the fills already made for this problem, by (main, reserve). A fill reached from two
    starts is listed twice (one object): the judge checks it once."""
    found = problem_groups(problem)
    sizes = reserve_sizes(problem, found)
    candidates, streams, made = [], Streams(problem, found), {}
    for main in mains:
        for start in sizes:
            where, reserve = fill_to_fixed_point(problem, found, main, start, streams=streams, memo=memo)
            if where is not None:
                if (main, reserve) not in made:   # several starts may settle on one reserve: one candidate
                    made[main, reserve] = Filled(problem, found, where, reserve, main)
                candidates.append(made[main, reserve])
    return candidates


def backfill_candidates(problem: Problem, mains: Iterable[Device], memo: dict) -> list[Filled]:
    """First fit with a static streaming reserve (the largest streamed size of an offloadable group, raised to its
    fixed point), one fill per main device in ``mains``."""
    found = problem_groups(problem)
    start = largest_stream(found)
    candidates, streams = [], Streams(problem, found)
    for main in mains:
        where, reserve = fill_to_fixed_point(problem, found, main, start, streams=streams, memo=memo)
        if where is not None:
            candidates.append(Filled(problem, found, where, reserve, main))
    return candidates
