"""The judge's verdict on a map: the runtime rules it breaks and the memory it needs, from the one validator.

Every map a strategy, the judge, the report or the composition weighs is checked here
(:func:`allocator.evaluate.validate.check`): this module is the judge's one door to it, so a candidate is judged
once per problem and map (``check`` remembers its last results on the problem, :meth:`allocator.memo.Derived.recent`)
and no other layer above ``evaluate/`` calls the validator on its own. It also holds what the contract reads of a
map's memory (:func:`headroom`, the second half of rule 3).

Examples
--------
>>> import torch.nn as nn
>>> from allocator.problem import build_problem
>>> problem = build_problem(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {0: 1000, 1: 1000})
>>> is_valid(problem, {"": 0}), [v.kind for v in violations(problem, {"0": 0})]
(True, ['coverage'])
>>> memory(problem, {"0": 0, "1": 1}).peak
{0: 288, 1: 288}
"""

from __future__ import annotations

from collections.abc import Mapping

from ..budgets import is_accelerator
from ..evaluate.memory import Memory
from ..evaluate.validate import Violation, check
from ..problem import Problem

__all__ = ["headroom", "is_valid", "judged", "memory", "violations"]


def judged(problem: Problem, device_map: Mapping) -> tuple[list[Violation], Memory]:
    """The runtime rules ``device_map`` breaks for ``problem`` and the memory it needs at runtime
    (:func:`allocator.evaluate.validate.check`; each call returns its own copies)."""
    return check(problem, device_map)


def violations(problem: Problem, device_map: Mapping) -> list[Violation]:
    """The runtime rules ``device_map`` breaks (empty where it is valid)."""
    return check(problem, device_map)[0]


def is_valid(problem: Problem, device_map: Mapping) -> bool:
    """Whether ``device_map`` keeps every runtime rule."""
    return not check(problem, device_map)[0]


def memory(problem: Problem, device_map: Mapping) -> Memory:
    """What ``device_map`` needs at runtime: peaks per device, main device, streaming reserve and its chain."""
    return check(problem, device_map)[1]


def headroom(problem: Problem, device_map) -> int | None:
    """The least free memory a map leaves on any budgeted accelerator at its peak (budget minus peak, an empty
    accelerator leaving its whole budget), where the map keeps every tensor on the accelerators; else ``None`` (the
    headroom half of rule 3 applies only where the model fits on the accelerators).

    >>> import torch.nn as nn
    >>> from allocator.problem import build_problem
    >>> problem = build_problem(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {0: 1000, 1: 1000})
    >>> headroom(problem, {"0": 0, "1": 1}), headroom(problem, {"": 0}), headroom(problem, {"0": 0, "1": "cpu"})
    (712, 424, None)
    """
    if not all(is_accelerator(d) for d in device_map.values()):
        return None
    peak = memory(problem, device_map).peak
    limits = [(d, problem.budgets.limit(d)) for d in problem.budgets.accelerators]
    free = [limit - peak.get(d, 0) for d, limit in limits if limit is not None]
    return min(free) if free else None
