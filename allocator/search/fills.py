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

from collections.abc import Iterable, Iterator

from ..budgets import Device
from ..evaluate.units import Groups, problem_groups
from ..problem import Problem
from .first_fit import Filled, Streams, fill_to_fixed_point, largest_stream, reserve_sizes

__all__ = ["backfill_candidates", "fixed_point_fills", "reserve_candidates"]


def fixed_point_fills(problem: Problem, found: Groups, main: Device, starts: Iterable[int], memo: dict, *,
                      ordered: bool, streams: Streams | None = None) -> Iterator[Filled]:
    """The one fill (:func:`allocator.search.first_fit.fill`) under ``main`` from each reserve of ``starts``, raised
    to its fixed point (:func:`allocator.search.first_fit.fill_to_fixed_point`), as candidates in the order of
    ``starts``; a start whose fill fits nowhere yields nothing. Starts that settle on one reserve yield one object
    (the judge checks it once). ``memo``: the fills already made for this problem, by (main, reserve); ``ordered``:
    the judge's index order (:func:`allocator.search.first_fit.fill`). Lazy: the witness stops at the first valid
    one."""
    streams = streams or Streams(problem, found)
    made: dict = {}
    for start in starts:
        where, reserve = fill_to_fixed_point(problem, found, main, start, streams=streams, memo=memo, ordered=ordered)
        if where is None:
            continue
        if reserve not in made:
            made[reserve] = Filled(problem, found, where, reserve, main)
        yield made[reserve]


def reserve_candidates(problem: Problem, mains: Iterable[Device], memo: dict, *, ordered: bool) -> list[Filled]:
    """First fit under every streaming reserve that some unit's offload would need, for each main device in
    ``mains`` (:func:`fixed_point_fills`); ``memo`` holds the fills already made for this problem, by (main,
    reserve). A fill reached from two starts is listed twice (one object): the judge checks it once. ``mains`` and
    ``ordered`` (index order along the model, :func:`allocator.search.first_fit.fill`) are the judge's bounds,
    passed as data."""
    found = problem_groups(problem)
    sizes, streams = reserve_sizes(problem, found), Streams(problem, found)
    return [candidate for main in mains
            for candidate in fixed_point_fills(problem, found, main, sizes, memo, ordered=ordered, streams=streams)]


def backfill_candidates(problem: Problem, mains: Iterable[Device], memo: dict, *, ordered: bool) -> list[Filled]:
    """First fit with a static streaming reserve (the largest streamed size of an offloadable group, raised to its
    fixed point), one fill per main device in ``mains`` (``ordered``: as :func:`reserve_candidates`)."""
    found = problem_groups(problem)
    start, streams = [largest_stream(found)], Streams(problem, found)
    return [candidate for main in mains
            for candidate in fixed_point_fills(problem, found, main, start, memo, ordered=ordered, streams=streams)]
