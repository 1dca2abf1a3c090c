"""``sequential``: accelerate's ``infer_auto_device_map``, reproduced output for output (the algorithm is
:mod:`allocator.search.accelerate`). The judge's witness runs it once per problem as the baseline; this strategy
proposes that run, so asking for ``sequential`` never runs accelerate's algorithm twice.

Notes
-----
The witness's run: O(1) once the witness has it, else accelerate's algorithm once (its complexity is in
:mod:`allocator.search.accelerate`). Deterministic.
"""

from __future__ import annotations

from ..judge.witness import accelerate_placement
from ..placement import Placement
from ..problem import Problem

__all__ = ["place"]


def place(problem: Problem) -> Placement:
    """accelerate's placement of ``problem`` (the witness's); raises what accelerate's algorithm raises
    (:class:`allocator.InfeasiblePlacement`, :class:`allocator.UnsupportedByAccelerate`)."""
    return accelerate_placement(problem)
