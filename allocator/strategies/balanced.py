"""``balanced`` and ``balanced_low_0``: the model cut into contiguous runs over the accelerators, the fullest device
as empty as it can be.

transformers' ``device_map="balanced"`` caps every GPU but the last at ``total / n + 1.25 × the largest layer`` and
then fills greedily, reserving the largest layer on GPU 0: the loads come out uneven, and a model that fits the GPUs
together can spill to RAM (huggingface/transformers#46823, accelerate#1888). Here the split is exact.

What is balanced
----------------
The tie groups of :func:`allocator.evaluate.units.groups`, in model order (a group sits at its first unit), are cut into
one contiguous run per accelerator, in the budgets' order. A tied head that is defined last but tied to the embeddings
travels with the embeddings' group: "contiguous" is over groups, so the partition is contiguous in model order except
for units pulled by a tie. The objective is the largest *fill*, ``peak / budget``, over the accelerators, and it is
minimised exactly over all contiguous splits that fit the budgets:

- With equal budgets that is the largest peak in bytes: the split is the optimal contiguous min-max partition.
- With unequal budgets each device is loaded in proportion to its budget. What a device needs at runtime beyond the
  weights (activations, the KV cache of the layers it executes) grows with the layers it holds, so the batch that
  fits is set by the largest fill, not by the largest peak in bytes, nor by a fixed headroom. The fill is searched as
  ``t / B`` for integers ``t`` and ``B`` the largest budget: the device with the largest budget is loaded to the
  optimum to the byte, the others to within ``1 / B`` of the optimal fill.

Among the optimal splits, one that gives every accelerator a group is preferred, with the earliest devices as light
as possible (cuts as early as possible, the first first): GPU 0 also holds the inputs and what ``generate()`` adds.
When no optimal split gives every accelerator something (fewer groups than accelerators, or a budget too small for
the group at its position), the last accelerators are left empty, and the plan's decisions say so. Then adjacent devices
are evened out: two neighbours are re-split while that lowers the larger of their two fills, so devices that the
largest fill does not constrain are not left uneven (the largest fill never rises).

``balanced_low_0`` keeps the first accelerator as light as possible (transformers' meaning, for ``generate()``): its
run is the shortest prefix with which the rest of the model fits the other accelerators, which are then balanced as
above. When the others hold the whole model it gets nothing.

Peaks are the validator's (:func:`allocator.evaluate.validate.check`): with everything on accelerators, a device's peak
is the bytes resident there (with a generation budget, the groups' sizes include the KV cache of the layers they hold,
and each device also keeps the activations' workspace, the first one the next-token scores too). When the accelerators
together cannot hold the model, the plan with the most bytes resident is ``reserve``'s (size-aware streaming reserve,
every possible main device); the groups it keeps on accelerators are then re-split by the same rule over the main device
and the ones after it, with the main device charged what the validator charges it beyond its own groups (the buffers of
offloaded groups and the streaming reserve) and kept non-empty so that it stays the main device. The same groups stay
resident, so no resident byte is lost; the re-split is kept only if it is valid and not less balanced (for
``balanced_low_0``: not heavier on the main device) than ``reserve``'s own split.

Notes
-----
O(n · g · (log B + log g)) for ``n`` accelerators, ``g`` groups and ``B`` the largest budget,
plus ``reserve`` when something must be offloaded. Deterministic. Every result passes
:func:`allocator.evaluate.validate.check`; when no plan fits, :class:`allocator.InfeasiblePlacement` (from ``reserve``).

Examples
--------
>>> import torch.nn as nn
>>> import allocator
>>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16.25 KiB per layer
>>> budgets = {0: 60_000, 1: 60_000, 2: 60_000, "cpu": 10**6}  # room for 3 layers each
>>> allocator.plan(model, budgets, strategy="balanced").device_map
{'0': 0, '1': 0, '2': 1, '3': 1, '4': 2, '5': 2}
>>> allocator.plan(model, budgets, strategy="balanced_low_0").device_map
{'0': 1, '1': 1, '2': 1, '3': 2, '4': 2, '5': 2}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fractions import Fraction

from ..budgets import Device
from ..search.partition import least_feasible, parts, prefix_sums, reachable, split
from ..placement import Decision, Placement
from ..problem import Problem
from ..evaluate.memory import device_of, main_device, workspace
from ..evaluate.units import Group, problem_groups
from ..judge.verdict import judged, memory as needs
from ..judge.ranking import best_fill
from ..search.fills import reserve_candidates
from ..judge.contract import required_main

__all__ = ["place", "place_low_0"]

log = logging.getLogger(__name__)


def place(problem: Problem) -> Placement:
    """Contiguous split over the accelerators minimising the largest ``peak / budget``; offload only when the
    accelerators together cannot hold the model."""
    return _place(problem, low_0=False)


def place_low_0(problem: Problem) -> Placement:
    """As :func:`place`, with the first accelerator holding as little as possible and the others balanced."""
    return _place(problem, low_0=True)


def load(group: Group) -> int:
    """Bytes a group adds to the peak of the accelerator it is resident on."""
    return group.size


def _workspace(problem: Problem, count: int) -> list[int]:
    """What each of ``count`` accelerators needs beyond its groups when it runs something, the first being the main
    device: a generation budget's activations everywhere, and its next-token scores on the main device."""
    return [workspace(problem.graph, main=True)] + [workspace(problem.graph, main=False)] * (count - 1)


# -- splitting ----------------------------------------------------------------------------------------------------

def _balance(loads: Sequence[int], budgets: Sequence[int], offsets: Sequence[int], first_min: int) -> list[int] | None:
    """Cuts of ``loads`` over the devices minimising the largest ``(offset + part) / budget`` within the budgets, or
    ``None``. The first part holds at least ``first_min`` items; a split giving every part an item is preferred; then
    adjacent parts are evened out (:func:`_smooth`)."""
    n = len(budgets)
    some = [first_min] + [0] * (n - 1)
    found = _min_max(loads, budgets, offsets, some)
    if found is None:
        return None
    t, limits = found
    cuts = split(loads, limits(t), [1] * n, late=False) if len(loads) >= n else None
    if cuts is None:
        cuts = split(loads, limits(t), some, late=True)
    return _smooth(loads, budgets, offsets, cuts)


def _min_max(loads: Sequence[int], budgets: Sequence[int], offsets: Sequence[int], mins: Sequence[int]):
    """``(t, limits)`` for the least ``t`` such that a split with part ``j`` at most
    ``limits(t)[j] = t · budgets[j] // max(budgets) - offsets[j]`` exists (the least largest fill, as
    ``t / max(budgets)``), or ``None``."""
    scale = max(budgets)

    def limits(t: int) -> list[int]:
        return [(t * b // scale if scale else 0) - o for b, o in zip(budgets, offsets)]

    prefix = prefix_sums(loads)
    t = least_feasible(lambda t: reachable(prefix, limits(t), mins) is not None, 0, scale)
    return None if t is None else (t, limits)


def _smooth(loads: Sequence[int], budgets: Sequence[int], offsets: Sequence[int], cuts: list[int]) -> list[int]:
    """Re-split adjacent parts while that lowers the larger fill of the two.

    The largest fill never rises, non-empty parts stay non-empty, and each accepted step lowers the fills sorted in
    decreasing order lexicographically, so it ends; sweeps are capped at ``4 n`` all the same. Among optimal splits
    it evens out the ones the min-max leaves uneven (4 GPUs holding embeddings | 2 layers | 4 layers | head get
    3 | 3 layers), which matters for what grows with the layers a device runs (KV cache, activations).
    """
    cuts, prefix, n = list(cuts), prefix_sums(loads), len(budgets)

    def fill(j: int, a: int, b: int) -> Fraction:
        return Fraction(prefix[b] - prefix[a] + offsets[j], budgets[j])

    for _ in range(4 * n):
        changed = False
        for j in range(n - 1):
            if not budgets[j] or not budgets[j + 1]:
                continue
            a, m, e = ([0, *cuts, len(loads)])[j:j + 3]
            mins = [int(m > a), int(e > m)]
            found = _min_max(loads[a:e], budgets[j:j + 2], offsets[j:j + 2], mins)
            if found is None:
                continue
            t, limits = found
            c = a + split(loads[a:e], limits(t), mins, late=False)[0]
            if max(fill(j, a, c), fill(j + 1, c, e)) < max(fill(j, a, m), fill(j + 1, m, e)):
                cuts[j], changed = c, True
        if not changed:
            break
    return cuts


def _low_first(loads: Sequence[int], budgets: Sequence[int], offsets: Sequence[int],
               first_min: int) -> list[int] | None:
    """Cuts with the first part as short as possible (at least ``first_min`` items) such that the rest fits the other
    devices, which are then balanced; ``None`` when nothing fits."""
    if len(budgets) == 1:
        return _balance(loads, budgets, offsets, first_min)
    room = [b - o for b, o in zip(budgets[1:], offsets[1:])]
    # The rest fits for every k from some k0 on (a shorter suffix of a contiguous split is one): bisect for k0.
    k = least_feasible(lambda k: split(loads[k:], room, [0] * len(room)) is not None, first_min, len(loads))
    if k is None or sum(loads[:k]) + offsets[0] > budgets[0]:
        return None
    return [k] + [k + c for c in _balance(loads[k:], budgets[1:], offsets[1:], 0)]


# -- plans --------------------------------------------------------------------------------------------------------

def _place(problem: Problem, *, low_0: bool) -> Placement:
    name = "balanced_low_0" if low_0 else "balanced"
    found = problem_groups(problem).records()
    accelerators = list(problem.budgets.accelerators)
    main = required_main(problem) if accelerators and not low_0 and found else None
    if main is not None:
        # the contract's main device (the judge's): the first accelerator that admits a plan, so it holds a group
        accelerators = accelerators[accelerators.index(main):] if main in accelerators else []
    if accelerators:
        placement = _all_resident(problem, found, accelerators, low_0, name, first_min=int(main is not None))
        if placement is not None:
            return placement
    return _with_offload(problem, found, low_0, name)


def _all_resident(problem: Problem, found: list[Group], devices: list[Device], low_0: bool, name: str, *,
                  first_min: int):
    budgets = [problem.budgets.limit(d) or 0 for d in devices]
    loads = [load(g) for g in found]
    splitter = _low_first if low_0 else _balance
    cuts = splitter(loads, budgets, _workspace(problem, len(devices)), first_min)
    if cuts is None:
        return None
    placed = {}
    for device, run in zip(devices, parts(cuts, len(found))):
        for k in run:
            placed.update(dict.fromkeys(found[k].names, device))
    notes = [_split(devices, "contiguous", groups=len(found), low_0=low_0)]
    notes += _empty_notes(devices, cuts, len(found), low_0)
    return _checked(problem, placed, name, notes)


def _empty_notes(devices: list[Device], cuts: Sequence[int], count: int, low_0: bool) -> list[Decision]:
    out = []
    for j, (device, run) in enumerate(zip(devices, parts(cuts, count))):
        if len(run):
            continue
        if j == 0 and low_0:
            reason, bound = "kept-free", "main"
        elif count < len(devices):
            reason, bound = "fewer-groups", ""
        else:
            reason, bound = "unbalanced", "budget"
        out.append(Decision("empty", devices=(device,), bound=bound,
                            facts={"reason": reason, "groups": count, "accelerators": len(devices)}))
    return out


def _with_offload(problem: Problem, found: list[Group], low_0: bool, name: str) -> Placement:
    """``reserve``'s plan (the most bytes resident), its accelerator groups re-split by the balanced rule."""
    # reserve's plan; InfeasiblePlacement when nothing fits (allocator.plan adds the minimum budget)
    base = best_fill(problem, reserve_candidates, "reserve")
    if not problem.budgets.accelerators:
        return _relabel(problem, base, name, "no-accelerator")
    main = main_device(base.device_map.values())
    devices = [d for d in problem.budgets.accelerators if isinstance(d, int) and isinstance(main, int) and d >= main]
    if len(devices) < 2:
        return _relabel(problem, base, name, "one-accelerator", main=main)
    where = [device_of(g.names[0], base.device_map) for g in found]
    resident = [k for k, d in enumerate(where) if d in devices]
    memory = needs(problem, base.device_map)
    extra = memory.peak[main] - sum(load(found[k]) for k in resident if where[k] == main)
    budgets = [problem.budgets.limit(d) or 0 for d in devices]
    splitter = _low_first if low_0 else _balance
    offsets = [extra] + _workspace(problem, len(devices))[1:]  # the main device's peak already holds its own
    cuts = splitter([load(found[k]) for k in resident], budgets, offsets, 1)
    if cuts is None:
        return _relabel(problem, base, name, "no-split-fits", groups=len(resident))
    placed = {}
    for k, device in enumerate(where):
        if device is not None:   # a group the base map leaves out (a non-persistent buffer) stays out
            placed.update(dict.fromkeys(found[k].names, device))
    for device, run in zip(devices, parts(cuts, len(resident))):
        for i in run:
            placed.update(dict.fromkeys(found[resident[i]].names, device))
    said = _split(devices, "re-split", nbytes=extra, groups=len(resident), main=main)
    balanced = _checked(problem, placed, name, [said])
    if balanced is None or not _no_worse(problem, balanced, base, main, low_0):
        return _relabel(problem, base, name, "not-more-balanced")
    return Placement(device_map=balanced.device_map, strategy=name, exempt=_exempt(name),
                     decisions=balanced.decisions + _idle(problem, balanced.device_map, "after-main-unbalanced"))


def _exempt(name: str) -> frozenset:
    """``balanced_low_0`` keeps GPU 0 light on purpose: rule 1 of the contract does not apply to it."""
    return frozenset({"main"}) if name == "balanced_low_0" else frozenset()


def _split(devices, reason: str, nbytes: int | None = None, **facts) -> Decision:
    """A ``"split"`` decision of this strategy (``facts["method"]`` is ``"balanced"``): how it cut the model over
    ``devices``, the case ``reason`` names."""
    return Decision("split", devices=tuple(devices), bytes=None if nbytes is None else int(nbytes),
                    facts={"reason": reason, "method": "balanced", **facts})


def _idle(problem: Problem, device_map, why_after: str) -> tuple[Decision, ...]:
    """A decision naming the accelerators that get nothing in a plan with offloaded groups, and why (``why_after``:
    the reason of those after the main device)."""
    used = set(device_map.values())
    idle = [d for d in problem.budgets.accelerators if d not in used]
    main = main_device(used)
    if not idle:
        return ()
    if main in ("cpu", "disk"):
        return (Decision("empty", devices=tuple(idle), bound="main", facts={"reason": "cpu-main"}),)
    before = [d for d in idle if isinstance(d, int) and isinstance(main, int) and d < main]
    after = [d for d in idle if d not in before]
    out = []
    if before:
        out.append(Decision("empty", devices=tuple(before), bound="main", facts={"reason": "before-main",
                                                                                  "main": main}))
    if after:
        out.append(Decision("empty", devices=tuple(after), facts={"reason": why_after}))
    return tuple(out)


def _fill(problem: Problem, device_map, device: Device | None = None) -> float:
    """The largest ``peak / budget`` over the accelerators (or ``device``'s), by the validator's rules."""
    peak = needs(problem, device_map).peak
    fills = [peak[d] / (problem.budgets.limit(d) or 1) for d in peak
             if d in problem.budgets.accelerators and (device is None or d == device)]
    return max(fills, default=0.0)


def _no_worse(problem: Problem, new: Placement, old: Placement, main: Device, low_0: bool) -> bool:
    focus = main if low_0 else None
    return _fill(problem, new.device_map, focus) <= _fill(problem, old.device_map, focus)


def _relabel(problem: Problem, base: Placement, name: str, reason: str, **facts) -> Placement:
    """``reserve``'s plan kept as it is, with why (``reason``: the case of the ``"split"`` decision)."""
    return Placement(device_map=base.device_map, strategy=name, optimal=None, exempt=_exempt(name),
                     decisions=(_split(problem.budgets.accelerators, reason, **facts),) + base.decisions
                     + _idle(problem, base.device_map, "after-main-reserve-fits"))


def _checked(problem: Problem, placed: dict, name: str, notes: list[Decision]) -> Placement | None:
    """The placement of a unit map if the validator accepts it, with each accelerator's peak in the notes."""
    device_map = problem.cleaned(placed)
    violations, memory = judged(problem, device_map)
    if violations:  # the split's loads disagree with the validator's peaks: fall back rather than return it
        log.debug("balanced split rejected by the validator: %s", violations[:3])
        return None
    shown = [d for d in problem.budgets.accelerators if d in memory.peak]
    peaks = [[d, int(memory.peak[d]), problem.budgets.limit(d)] for d in shown]
    return Placement(device_map=device_map, strategy=name, exempt=_exempt(name),
                     decisions=tuple(notes) + (Decision("peaks", devices=tuple(shown), facts={"peaks": peaks}),))
