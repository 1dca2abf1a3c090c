"""The strategy kit: everything a new strategy is built from, public and documented.

A strategy is a function ``place(problem) -> Placement`` (:func:`allocator.plan` takes it as ``strategy=``). It
reads the frozen :class:`Problem` — never the model — and returns an assignment; :func:`allocator.plan` then cleans
the map, checks it against the runtime rules and the contract of ``device_map="auto"`` (raising
:class:`allocator.InvalidPlacement` or :class:`allocator.BrokenContract` when it breaks them) and prices it. The
pieces, bottom up:

- :func:`tie_groups`: what gets placed — the model's units (modules that are not split, lone tensors of split ones)
  united by ties into groups, in model order, each with its ``size``, ``offload`` and ``pinned`` bytes and its
  ``stream`` (the weights its hooks materialise at once on the main device);
- :func:`main_candidates`: the devices worth trying as the main device (the contract's one, or every one that
  could be under ``objective="latency"``);
- :class:`Room`: the free bytes of each device under a main device and a streaming reserve, with the seating and
  charging rules stated once (``Room.seat``);
- :func:`device_map`: a device per group as the map ``from_pretrained`` takes;
- :func:`check`: the runtime rules a map breaks; :func:`estimate`: the cost model's estimate of a map;
- :func:`best_valid`: the best of several candidate placements (valid, keeping the contract, fastest estimated),
  and :func:`accelerate_placement`: accelerate's own placement, a candidate that keeps accelerate's bytes.

Examples
--------
A complete strategy: first fit in model order under each main device, accelerate's map as a fallback candidate.

>>> import torch.nn as nn
>>> import allocator
>>> from allocator.strategies import kit
>>> def first_fit(problem):
...     groups = kit.tie_groups(problem)
...     reserve = max((g.stream for g in groups), default=0)
...     candidates = [("accelerate", lambda: kit.accelerate_placement(problem))]
...     for main in kit.main_candidates(problem):
...         room = kit.Room.of(problem, main, reserve, groups)
...         seats = [room.seat_group(g) for g in groups] if room else [-1]
...         if -1 not in seats:
...             placed = kit.device_map(problem, groups, [room.devices[j] for j in seats])
...             candidates.append((f"main {main!r}", lambda placed=placed: kit.Placement(placed, "first_fit")))
...     return kit.best_valid(problem, candidates)
>>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])   # 16.25 KiB per layer
>>> allocator.plan(model, {0: 40_000, "cpu": 10**6}, strategy=first_fit).device_map
{'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..budgets import Device
from ..evaluate.cost import Cost, estimate
from ..errors import InfeasiblePlacement
from ..placement import Placement, clean_device_map
from ..problem import Problem
from .contract import accelerate_placement, main_candidates
from .ranking import best_valid as rank
from .room import Room
from ..evaluate.units import Group, Groups, problem_groups
from ..evaluate.validate import Violation, check as check_map

__all__ = ["Cost", "Group", "Groups", "InfeasiblePlacement", "Placement", "Problem", "Room", "Violation",
           "accelerate_placement", "best_valid", "check", "device_map", "estimate", "main_candidates", "tie_groups"]


def tie_groups(problem: Problem) -> Groups:
    """The tie groups of the problem's model in model order (a group sits at its first unit): a table whose rows
    are :class:`Group` records (``units``, ``size``, ``offload``, ``pinned``, ``stream``, ``numel``,
    ``resident_only``), under the problem's ``offload_buffers``. Made once per graph."""
    return problem_groups(problem)


def device_map(problem: Problem, found: Groups, devices: Sequence[Device]) -> dict:
    """The device map that puts every unit of group ``k`` of ``found`` on ``devices[k]``, cleaned as the problem's
    options say (``clean_result``)."""
    if len(devices) != len(found):
        raise ValueError(f"device_map needs one device per group: {len(found)} groups, {len(devices)} devices.")
    placed = {name: device for group, device in zip(found, devices) for name in group.names}
    return clean_device_map(placed) if problem.options.clean_result else placed


def check(problem: Problem, placed) -> list[Violation]:
    """The runtime rules ``placed`` (a device map) breaks for ``problem``: empty when it is valid
    (:func:`allocator.evaluate.validate.check`, without its memory report)."""
    return check_map(problem, placed)[0]


def best_valid(problem: Problem, candidates: Iterable[tuple[str, Callable[[], Placement]]]) -> Placement:
    """The best of ``candidates`` (``(name, make)`` pairs, ``make()`` returning a :class:`Placement` or raising an
    :class:`allocator.AllocatorError`) that keeps the runtime rules and the contract: first those that keep at least
    accelerate's bytes on the fastest tier, then the lowest estimated seconds per forward; the earlier on a tie.

    Raises
    ------
    InfeasiblePlacement
        When no candidate is valid (:func:`allocator.plan` adds the smallest budget that works).
    """
    found = rank(problem, candidates)
    if found.placement is None:
        raise InfeasiblePlacement(f"no candidate plan of {problem.graph.model_class} is valid under these budgets: "
                                  + "; ".join(f"{t.name} {t.why}" for t in found.tried))
    return found.placement
