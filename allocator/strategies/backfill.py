"""``backfill``: first-fit over the ordered devices, so a later unit may go back to an earlier device with room.

The reserve on the main device is static, as in accelerate, but measured right: the largest streamed size of any
group that may be offloaded, raised to what the offloaded groups really stream together (nested hooks) if needed.
Every device that could be main is tried (the first accelerator, or a later one with the earlier ones left empty, or
cpu) and the valid plan the cost model estimates fastest is kept (:func:`allocator.judge.ranking.best_of`).

Notes
-----
O(m · g) for m main candidates and g tie groups. Deterministic.
"""

from __future__ import annotations

from ..judge.ranking import best_fill
from ..placement import Placement
from ..problem import Problem
from ..search.fills import backfill_candidates

__all__ = ["place"]


def place(problem: Problem) -> Placement:
    """Place by first fit with a static streaming reserve (the largest streamed size of an offloadable group)."""
    return best_fill(problem, backfill_candidates, "backfill")
