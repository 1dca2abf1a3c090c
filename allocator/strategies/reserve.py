"""``reserve``: size-aware reservation — keep free on the main device only what the offloaded units stream.

accelerate reserves the largest layer of the whole model. Here the reserve ``R`` is a choice: with a smaller ``R``
only units whose streamed chain fits ``R`` may be offloaded, the rest must stay resident, and the room ``R``
frees on the main device holds more of the model. Every distinct streamed size is a candidate ``R`` (the fixed
point of "reserve the largest streamed size among what is actually offloaded"), for every device that could be
main; the valid plan the cost model estimates fastest wins (:func:`allocator.judge.ranking.best_of`).

Notes
-----
O(m · s · g) for m main candidates, s distinct streamed sizes (capped at 64, the largest kept) and g groups.
Deterministic.
"""

from __future__ import annotations

from ..judge.ranking import best_fill
from ..placement import Placement
from ..problem import Problem
from ..search.fills import reserve_candidates

__all__ = ["place"]


def place(problem: Problem) -> Placement:
    """Place by first fit, trying every streaming reserve that some unit's offload would need."""
    return best_fill(problem, reserve_candidates, "reserve")
