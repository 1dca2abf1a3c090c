"""Room the runtime's own decisions leave on the main device, used (issue #46).

A strategy fills the accelerators under the runtime rules of :func:`allocator.evaluate.validate.check`, where a unit
offloaded to RAM executes on the main device and so keeps its KV cache there. Under our runtime with an accelerator as
main device and a generation budget, the plan's verdict (:func:`allocator.judge.verdict.verdict`) then lets offloaded
units decode where their weights live, with their cache in RAM (:func:`allocator.evaluate.compute.decide`): the main
device's peak falls, and room the plan's own rules would let a unit use stays empty (llama-70b in bf16 on 24 GiB +
192 GiB at 32k tokens: 3.9 GiB resident, peak 13.1 of 24 GiB). :func:`grow` moves the first offloaded tie groups in
model order onto the main device while the verdict of the grown placement stays valid, so the plan keeps more bytes
on the fastest tier; every candidate is judged by the one verdict, nothing is charged beside it.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np

from ..evaluate.memory import device_of
from ..evaluate.units import problem_groups
from ..judge.verdict import verdict
from ..placement import Decision, Placement
from ..problem import Problem
from .kit import sole_accelerator
from ..search.bisection import boundary

__all__ = ["grow"]


def grow(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with the first offloaded tie groups in model order moved onto its main device, as many as the
    verdict keeps valid, where the plan is for our runtime with a generation budget, one accelerator and no routed
    experts placed; ``placement`` itself otherwise, or where nothing more fits.

    Notes
    -----
    O(log g) verdicts for g offloaded groups: the count is found by bisection on the prefix of them (a longer prefix
    needs more of the main device, weights and their KV cache).
    """
    if (problem.runtime.name != "allocator" or problem.generation is None or placement.accelerates
            or placement.experts):
        return placement
    device_map, main = sole_accelerator(placement)
    if main is None:
        return placement
    before = verdict(problem, placement)
    limit = problem.budgets.limit(main)
    if before.hybrid is None or not before.valid or limit is None or before.peak.get(main, 0) >= limit:
        return placement
    groups = problem_groups(problem).records()
    offloaded = [g for g in groups if all(device_of(u.name, device_map) in ("cpu", "disk") for u in g.units)]
    if not offloaded:
        return placement
    room = limit - before.peak[main]
    sizes = np.cumsum([g.size for g in offloaded])
    most = bisect.bisect_right(sizes.tolist(), room)   # weights alone bound how many could fit
    lo = boundary(lambda k: verdict(problem, _moved(problem, placement, device_map, offloaded[:k], main)).valid,
                  0, most + 1)   # the longest prefix whose grown placement is valid
    if lo == 0:
        return placement
    best = _moved(problem, placement, device_map, offloaded[:lo], main)
    moved = offloaded[:lo]
    said = Decision("grow", devices=(main,), units=tuple(u.name for g in moved for u in g.units),
                    bytes=int(sum(g.size for g in moved)), bound="budget",
                    facts={"groups": lo, "room": int(room), "peak": int(before.peak[main])})
    return replace(best, decisions=best.decisions + (said,))


def _moved(problem: Problem, placement: Placement, device_map: dict, groups, main) -> Placement:
    """``placement`` with every unit of ``groups`` on ``main``: the map written per unit where it must be, then
    cleaned as the options say."""
    names = {u.name for g in groups for u in g.units}
    expanded = {}
    for g in problem_groups(problem).records():
        for u in g.units:
            expanded[u.name] = main if u.name in names else device_of(u.name, device_map)
    covers = {name.rpartition(".")[0] for name in expanded}
    while len(covers) > 1 or (covers and "" not in covers):   # every module above a unit
        covers |= {name.rpartition(".")[0] for name in covers}
        if "" in covers and all(name.rpartition(".")[0] in covers for name in covers if name):
            break
    uncovered = {k: v for k, v in device_map.items() if k not in covers and device_of(k, expanded) is None}
    return replace(placement, device_map=problem.cleaned({**uncovered, **expanded}))
