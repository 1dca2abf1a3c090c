"""The strategy kit: everything a new strategy is built from, public and documented.

A strategy is a function ``place(problem) -> Placement`` (:func:`allocator.plan` takes it as ``strategy=``). It
reads the frozen :class:`Problem` — never the model — and returns an assignment; :func:`allocator.plan` then cleans
the map, checks it against the runtime rules and the contract of ``device_map="auto"`` (raising
:class:`allocator.InvalidPlacement` or :class:`allocator.BrokenContract` when it breaks them) and prices it.

The shortest way: **a strategy is an ordering.** :func:`fill` seats the tie groups in the order a strategy gives
(its priority: what should stay on the fastest tier first), under every main device the contract allows, keeping the
contract's index order and raising or shrinking the streaming reserve to its fixed point; it returns the best valid
plan of those fills and accelerate's own map. The pieces it is made of, for a strategy that needs more:

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
A complete strategy: the largest groups first (first-fit decreasing).

>>> import torch.nn as nn
>>> import allocator
>>> from allocator.strategies import kit
>>> def largest_first(problem):
...     groups = kit.tie_groups(problem)
...     return kit.fill(problem, sorted(range(len(groups)), key=lambda k: -groups[k].size), name="largest_first")
>>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])   # 16.25 KiB per layer
>>> allocator.plan(model, {0: 40_000, "cpu": 10**6}, strategy=largest_first).device_map
{'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..budgets import Device, is_accelerator, normalize_map
from ..evaluate.memory import offloaded_devices
from ..evaluate.cost import Cost, estimate
from ..errors import InfeasiblePlacement
from ..placement import Placement
from ..problem import Problem
from ..judge.witness import accelerate_placement, index_ordered, main_candidates
from ..judge.ranking import best_valid as rank
from ..search.first_fit import Streams, fill as first_fit, largest_stream
from ..search.room import Room
from ..evaluate.units import Group, Groups, problem_groups
from ..evaluate.validate import Violation
from ..judge.verdict import violations as broken_rules

__all__ = ["Cost", "Group", "Groups", "InfeasiblePlacement", "Placement", "Problem", "Room", "Violation",
           "accelerate_placement", "best_valid", "check", "device_map", "estimate", "fill", "main_candidates", "seat",
           "sole_accelerator", "tie_groups"]

#: How many times :func:`fill` redoes a fill with the streaming reserve of the one before (its fixed point).
ROUNDS = 8


def sole_accelerator(placement: Placement) -> tuple[dict, Device | None]:
    """``placement``'s map, normalised, and the one accelerator it uses (``None`` where it uses none or several):
    where the passes that fill our runtime's main device (``grow``, ``split``) start."""
    device_map = normalize_map(placement.device_map)
    accelerators = {d for d in device_map.values() if is_accelerator(d)}
    return device_map, (next(iter(accelerators)) if len(accelerators) == 1 else None)


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
    return problem.cleaned(placed)


def check(problem: Problem, placed) -> list[Violation]:
    """The runtime rules ``placed`` (a device map) breaks for ``problem``: empty when it is valid
    (:func:`allocator.evaluate.validate.check`, without its memory report)."""
    return broken_rules(problem, placed)


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
                                  + "; ".join(f"{t.name} ({t.outcome}{f': {t.detail}' if t.detail else ''})"
                                              for t in found.tried))
    return found.placement


def fill(problem: Problem, order: Sequence[int], *, name: str = "custom") -> Placement:
    """The best valid plan that seats the tie groups (:func:`tie_groups`) in ``order``, and accelerate's own map.

    Under each main device the contract allows (:func:`main_candidates`), the groups are seated by :func:`seat` with
    the streaming reserve first set to the largest stream of a group that may be offloaded, then to what the
    offloaded groups of the last fill really stream together (a parent's hook stays active while its children run)
    until it holds (at most :data:`ROUNDS` fills). Every fill that streams no more than its reserve is a candidate;
    :func:`best_valid` keeps the best of them and of accelerate's map, so the plan never keeps fewer bytes on the
    fastest tier than accelerate's where that map keeps the contract.

    Parameters
    ----------
    problem : Problem
    order : sequence of int
        Every group index once: the strategy's priority (earlier groups get the fastest devices with room).
    name : str
        The strategy's name, for the placement and the decisions.

    Raises
    ------
    ValueError
        ``order`` is not a permutation of the group indices.
    InfeasiblePlacement
        No fill and no accelerate map is valid (:func:`allocator.plan` adds the smallest budget that works).
    """
    groups = tie_groups(problem)
    order = [int(k) for k in order]
    if sorted(order) != list(range(len(groups))):
        raise ValueError(f"fill needs every group index once: {len(groups)} groups, got {len(order)} indices.")
    streams = Streams(problem, groups)
    candidates = [("accelerate", lambda: accelerate_placement(problem))]
    for main in main_candidates(problem):
        reserve, tried = largest_stream(groups), set()
        for _ in range(ROUNDS):
            seats = seat(problem, groups, order, main, reserve)
            if seats is None or reserve in tried:
                break
            tried.add(reserve)
            actual = streams.reserve(seats, offloaded_devices(main))
            if actual <= reserve:
                placed = device_map(problem, groups, seats)
                candidates.append((f"{name}, main {main!r}, reserve {reserve} B",
                                   lambda placed=placed: Placement(placed, name)))
            reserve = actual
    return best_valid(problem, candidates)


def seat(problem: Problem, found: Groups, order: Sequence[int], main: Device, reserve: int) -> list | None:
    """The device of each group (in group order) when seated one by one in ``order`` by :meth:`Room.seat` under
    ``main`` and ``reserve``, or ``None`` when one fits nowhere: the one fill
    (:func:`allocator.search.first_fit.fill`) with ``order`` as its priority. Groups that must stay resident
    (:meth:`Room.must_stay`) are seated first, then the others, each part in ``order``. Under the contract, the
    devices that execute are used in index order along the model: a group never goes to an executing device before
    one that a group earlier in the model went to, nor after one that a later group went to.

    Notes
    -----
    O(g log g) for g groups: the bounds come from two Fenwick trees over model positions.
    """
    return first_fit(problem, found, main, reserve, ordered=index_ordered(problem), priority=order)
