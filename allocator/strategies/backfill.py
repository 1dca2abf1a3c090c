"""``backfill``: first-fit over the ordered devices, so a later unit may go back to an earlier device with room.

The reserve on the main device is static, as in accelerate, but measured right: the largest chain of weights any
tie group would stream. Every device that could be main is tried (the first accelerator, or a later one with the
earlier ones left empty, or cpu) and the plan that keeps the most bytes on the fastest tier is kept.

Notes
-----
O(m · g) for m main candidates and g tie groups. Deterministic.
"""

from __future__ import annotations

from ..placement import Placement
from ..problem import Problem
from ..units import groups
from ._fill import fill, main_candidates
from ._select import best_of

__all__ = ["place"]


def place(problem: Problem, **_) -> Placement:
    """Place by first fit with a static streaming reserve (the largest streamed chain of any group)."""
    found = groups(problem.graph, problem.options.offload_buffers)
    reserve = max((grp.stream for grp in found), default=0)
    candidates = []
    for main in main_candidates(problem):
        placed = fill(problem, found, main, reserve)
        if placed is not None:
            candidates.append((placed, f"main {main!r}, reserve {reserve} B"))
    return best_of(problem, candidates, "backfill")
