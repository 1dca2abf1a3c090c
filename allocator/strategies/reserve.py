"""``reserve``: size-aware reservation — keep free on the main device only what the offloaded units stream.

accelerate reserves the largest layer of the whole model. Here the reserve ``R`` is a choice: with a smaller ``R``
only units whose streamed chain fits ``R`` may be offloaded, the rest must stay resident, and the room ``R``
frees on the main device holds more of the model. Every distinct streamed size is a candidate ``R`` (the fixed
point of "reserve the largest streamed size among what is actually offloaded"), for every device that could be
main; the valid plan the cost model estimates fastest wins (:func:`allocator.strategies.ranking.best_of`).

Notes
-----
O(m · s · g) for m main candidates, s distinct streamed sizes (capped at 64, the largest kept) and g groups.
Deterministic.
"""

from __future__ import annotations

from ..placement import Placement
from ..problem import Problem
from ..evaluate.units import problem_groups
from ..evaluate.validate import format_bytes
from .first_fit import Filled, Streams, fill_to_fixed_point, reserve_sizes
from .ranking import best_of
from .witness import fill_memo, main_candidates

__all__ = ["place"]


def place(problem: Problem) -> Placement:
    """Place by first fit, trying every streaming reserve that some unit's offload would need."""
    found = problem_groups(problem)
    sizes = reserve_sizes(problem, found)
    candidates, streams, memo, made = [], Streams(problem, found), fill_memo(problem), {}
    for main in main_candidates(problem):
        for start in sizes:
            where, reserve = fill_to_fixed_point(problem, found, main, start, streams=streams, memo=memo)
            if where is not None:
                if (main, reserve) not in made:   # several starts may settle on one reserve: one candidate
                    note = f"main device {main!r}, streaming reserve {format_bytes(reserve)}"
                    made[main, reserve] = Filled(problem, found, where, reserve, note)
                candidates.append(made[main, reserve])
    return best_of(problem, candidates, "reserve")
