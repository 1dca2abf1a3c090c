"""``backfill``: first-fit over the ordered devices, so a later unit may go back to an earlier device with room.

The reserve on the main device is static, as in accelerate, but measured right: the largest streamed size of any
group that may be offloaded, raised to what the offloaded groups really stream together (nested hooks) if needed.
Every device that could be main is tried (the first accelerator, or a later one with the earlier ones left empty, or
cpu) and the valid plan the cost model estimates fastest is kept (:func:`allocator.strategies.ranking.best_of`).

Notes
-----
O(m · g) for m main candidates and g tie groups. Deterministic.
"""

from __future__ import annotations

from ..placement import Placement
from ..problem import Problem
from ..evaluate.units import problem_groups
from ..evaluate.validate import format_bytes
from .first_fit import Filled, Streams, fill_to_fixed_point, largest_stream
from .ranking import best_of
from .witness import fill_memo, main_candidates

__all__ = ["place"]


def place(problem: Problem) -> Placement:
    """Place by first fit with a static streaming reserve (the largest streamed size of an offloadable group)."""
    found = problem_groups(problem)
    start = largest_stream(found)
    candidates, streams, memo = [], Streams(problem, found), fill_memo(problem)
    for main in main_candidates(problem):
        where, reserve = fill_to_fixed_point(problem, found, main, start, streams=streams, memo=memo)
        if where is not None:
            note = f"main device {main!r}, streaming reserve {format_bytes(reserve)}"
            candidates.append(Filled(problem, found, where, reserve, note))
    return best_of(problem, candidates, "backfill")
