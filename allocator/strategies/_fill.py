"""First-fit over ordered devices with an explicit main device and streaming reserve (shared by backfill and reserve).

Given the main device ``M`` and a reserve ``R`` kept free on it for streamed weights, every tie group in model
order goes to the first device with room: accelerators from ``M`` on (earlier ones stay empty, else they would
become main), then cpu, then disk. A group may be offloaded only if the weights its hooks materialise at once fit
in ``R``; its buffers are charged to ``M``. Groups whose streamed chain exceeds ``R`` must stay resident, so they
are seated first, as are lone tensors (accelerate cannot offload a tensor on its own). The result is always re-checked by :func:`allocator.validate.check`.
"""

from __future__ import annotations

import math

from ..budgets import Device
from ..problem import Problem
from ..runs import columns
from ..runtime import offloaded_devices, workspace
from ..units import Group

__all__ = ["Streams", "fill", "fill_to_fixed_point", "full_reserve", "main_candidates"]


def main_candidates(problem: Problem) -> list[Device]:
    """Every device worth trying as main: an accelerator (the ones before it left empty) whose budget is larger than
    every earlier accelerator's — otherwise relabelling the plan onto an earlier one gives the same plan with a lower
    index — then cpu."""
    b = problem.budgets
    out, best = [], 0
    for d in b.accelerators:
        limit = b.limit(d) or 0
        if limit > best:
            out.append(d)
            best = limit
    return out + (["cpu"] if "cpu" in b.order else [])


def fill(problem: Problem, groups: list[Group], main: Device, reserve: int) -> dict | None:
    """Group name -> device, or ``None`` when some group fits nowhere under this main device and reserve."""
    b = problem.budgets
    if main == "cpu":
        devices = ["cpu", "disk"]
    else:
        devices = [d for d in b.accelerators if b.order.index(d) >= b.order.index(main)] + ["cpu", "disk"]
    devices = [d for d in devices if d in b.order]
    targets = {"disk"} if main in ("cpu", "mps") else {"cpu", "disk"}
    room = {d: (b.limit(d) if b.limit(d) is not None else math.inf) for d in devices}
    room[main] -= reserve
    # Generation: every device that runs something holds activations; the main device also the next-token scores.
    # A device left with negative room gets nothing, so it runs nothing and needs no workspace.
    for d in devices:
        if d not in targets:
            room[d] -= workspace(problem.graph, main=d == main)
    if room[main] < 0:
        return None
    placed: dict = {}
    # Groups too large to stream through the reserve must stay resident: seat them first, then fill in order.
    must_stay = [grp for grp in groups if grp.stream > reserve or grp.resident_only]
    rest = [grp for grp in groups if grp.stream <= reserve and not grp.resident_only]
    # Buffers of groups still to place may all end up pinned on the main device: hold room for them until then.
    room[main] -= sum(grp.pinned for grp in rest)
    for group in must_stay + rest:
        stays = group.stream > reserve or group.resident_only
        if not stays:
            room[main] += group.pinned
        for d in devices:
            if d in targets:
                if stays:
                    continue
                need = group.offload if d == "cpu" else (group.offload if b.limit("disk") is not None else 0)
                if room[d] >= need and room[main] >= group.pinned:
                    room[d] -= need
                    room[main] -= group.pinned
                    break
            elif room[d] >= group.size:
                room[d] -= group.size
                break
        else:
            return None
        for unit in group.units:
            placed[unit.name] = d
    return placed


def full_reserve(problem: Problem) -> int:
    """The reserve that streams anything: the largest chain if every weight were offloaded."""
    return columns(problem.graph).moving(problem.options.offload_buffers).chain[0] if problem.graph.nodes else 0


class Streams:
    """What the offloaded units of a unit map stream at once on the main device, from the units alone.

    Equal to :func:`allocator.runtime.streamed_chain` of the map, in O(units + split nodes) instead
    of O(nodes + tensors): an offloaded module unit adds its own chain below its (split) parent, an offloaded tensor
    unit adds its bytes to its module; chains are then folded up the split nodes.
    """

    def __init__(self, problem: Problem, groups: list[Group]):
        g = problem.graph
        parents = g.nodes.parent
        self.modules: list[tuple[str, int, int]] = []   # (unit name, parent node or -1, its chain)
        self.tensors: list[tuple[str, int, int]] = []   # (unit name, its module, bytes streamed)
        split: set[int] = set()
        for group in groups:
            for unit in group.units:
                if unit.node >= 0:
                    parent = parents[unit.node]
                    self.modules.append((unit.name, parent, unit.stream))
                else:
                    parent = g.tensors.module[g.tensor_index[unit.name]]
                    self.tensors.append((unit.name, parent, unit.stream))
                while parent >= 0 and parent not in split:
                    split.add(parent)
                    parent = parents[parent]
        self.split = sorted(split, reverse=True)  # children before parents (preorder indices, reversed)
        self.parent = {i: parents[i] for i in self.split}

    def reserve(self, placed: dict, offloaded) -> int:
        below: dict[int, int] = dict.fromkeys(self.split, 0)
        own: dict[int, int] = dict.fromkeys(self.split, 0)
        top = 0  # a module unit that is the whole model
        for name, parent, chain in self.modules:
            if chain and placed[name] in offloaded:
                if parent < 0:
                    top = max(top, chain)
                elif chain > below[parent]:
                    below[parent] = chain
        for name, module, nbytes in self.tensors:
            if nbytes and placed[name] in offloaded:
                own[module] += nbytes
        for i in self.split:
            best = own[i] + below[i]
            parent = self.parent[i]
            if parent < 0:
                top = max(top, best)
            elif best > below[parent]:
                below[parent] = best
        return top


def fill_to_fixed_point(problem: Problem, groups: list[Group], main: Device, reserve: int, rounds: int = 8,
                        streams: Streams | None = None, memo: dict | None = None):
    """``fill`` then raise the reserve to what the offloaded units really stream together (a parent's hook stays
    active while its children run), until it holds. Returns ``(placed, reserve)`` or ``(None, reserve)``.

    ``streams`` (:class:`Streams` of these groups) and ``memo`` (a dict kept across calls with the same groups) only
    save work: a fill for a (main, reserve) already tried is not redone."""
    streams = streams or Streams(problem, groups)
    offloaded = offloaded_devices(main)
    memo = {} if memo is None else memo
    for _ in range(rounds):
        key = (main, reserve)
        if key not in memo:
            placed = fill(problem, groups, main, reserve)
            memo[key] = placed, (None if placed is None else streams.reserve(placed, offloaded))
        placed, actual = memo[key]
        if placed is None:
            return None, reserve
        if actual <= reserve:
            return placed, reserve
        reserve = actual
    return None, reserve
