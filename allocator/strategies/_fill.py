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
from ..runtime import offloaded_devices, stream_reserve
from ..units import Group

__all__ = ["fill", "fill_to_fixed_point", "full_reserve", "main_candidates"]


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
            room[d] -= problem.graph.workspace
    room[main] -= problem.graph.main_workspace
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
        for name in group.names:
            placed[name] = d
    return placed


def full_reserve(problem: Problem) -> int:
    """The reserve that streams anything: the largest chain if every weight were offloaded."""
    g = problem.graph
    return stream_reserve(g, ["disk"] * len(g.tensors), {"disk"}, offload_buffers=problem.options.offload_buffers)


def _actual_reserve(problem: Problem, placed: dict, main: Device) -> int:
    g = problem.graph
    position = {name: device for name, device in placed.items()}
    devices = []
    for t in g.tensors:
        name = t.name
        while name not in position and name:
            name = name.rpartition(".")[0]
        devices.append(position.get(name))
    return stream_reserve(g, devices, offloaded_devices(main), offload_buffers=problem.options.offload_buffers)


def fill_to_fixed_point(problem: Problem, groups: list[Group], main: Device, reserve: int, rounds: int = 8):
    """``fill`` then raise the reserve to what the offloaded units really stream together (a parent's hook stays
    active while its children run), until it holds. Returns ``(placed, reserve)`` or ``(None, reserve)``."""
    for _ in range(rounds):
        placed = fill(problem, groups, main, reserve)
        if placed is None:
            return None, reserve
        actual = _actual_reserve(problem, placed, main)
        if actual <= reserve:
            return placed, reserve
        reserve = actual
    return None, reserve
