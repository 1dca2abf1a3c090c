"""``backfill``: first-fit over the ordered devices, so a later unit may go back to an earlier device with room.

The reserve on the main device is static, as in accelerate, but measured right: the largest chain of weights that
offloading everything would stream at once. Every device that could be main is tried (the first accelerator, or a later one with the
earlier ones left empty, or cpu) and the plan that keeps the most bytes on the fastest tier is kept.

Notes
-----
O(m · g) for m main candidates and g tie groups. Deterministic.
"""

from __future__ import annotations

from ..placement import Placement
from ..problem import Problem
from ..units import groups
from ._fill import fill, full_reserve, main_candidates
from ._select import best_of

__all__ = ["place"]


def place(problem: Problem, **_) -> Placement:
    """Place by first fit with a static streaming reserve (the largest chain offloading everything would stream)."""
    found = groups(problem.graph, problem.options.offload_buffers)
    reserve = full_reserve(problem)
    candidates = []
    for main in main_candidates(problem):
        placed = fill(problem, found, main, reserve)
        if placed is not None:
            candidates.append((placed, f"main {main!r}, reserve {reserve} B"))
    return best_of(problem, candidates, "backfill")
