"""The seating and charging rules of first fit, stated once: :class:`Room`, the free bytes of each device a fill may
use, group by group.

``backfill`` and ``reserve`` (:mod:`allocator.search.first_fit`) seat every group with :meth:`Room.seat` — long
stretches at once with :func:`allocator.evaluate.kernels.fit_stretch`, its vectorised form, tested against it — and a
new
strategy can seat groups with it in any order it likes.
"""

from __future__ import annotations

import math

from ..budgets import Device
from ..problem import Problem
from ..rules.dispatch import offloaded_devices
from ..evaluate.memory import streams_held, workspace
from ..evaluate.units import Groups

__all__ = ["Room"]


class Room:
    """What is still free on each device while groups are seated under a main device and a streaming reserve.

    ``devices`` are the devices a group may go to, the main device first: with an accelerator as main, that
    accelerator and the ones after it, then cpu and disk; with cpu as main, cpu and disk (devices without a budget
    left out). ``free[j]`` is what device ``j`` still holds (``math.inf`` without a limit). ``targets[j]`` says
    whether ``j`` is an offload target (cpu and disk with an accelerator as main; disk with cpu as main): a group
    sent there executes on the main device. ``charges[j]`` says whether an offloaded group's weights count on
    target ``j``: always on cpu, on disk only when disk has a budget.

    The rules :meth:`seat` applies to a group (its bytes as in :class:`allocator.evaluate.units.Group`):

    - a device that executes (not a target) takes the group's whole ``size``;
    - a target takes its ``offload`` bytes (where it charges them), and its ``pinned`` bytes (buffers that stay,
      generation bytes) go to the main device, which must have room for them too;
    - a group that *must stay* (:meth:`must_stay`: its streamed chain passes the reserve, or it holds a lone tensor,
      which accelerate's hooks cannot load) is never offloaded;
    - a group the loading path would not load right from disk (``disk_ok=False``:
      :func:`allocator.evaluate.units.disk_loadable`) is never sent to disk.

    :meth:`of` makes the room of a fill: the main device keeps the reserve free for streamed weights, every device
    that executes keeps its generation workspace, and the main device holds back (:meth:`hold`) the pinned bytes of
    every group that may be offloaded until that group is seated (any of them may end up pinned there).

    Examples
    --------
    Two groups of 8 bytes (6 of weights, 2 of buffers) that may be offloaded, on an accelerator with 10 bytes and a
    cpu with 100:

    >>> room = Room(devices=[0, "cpu"], free=[10, 100], targets=[False, True], charges=[False, True])
    >>> room.hold(2 + 2)    # their buffers may both end up on the main device
    >>> room.seat(size=8, offload=6, pinned=2, stays=False)   # fits on device 0
    0
    >>> room.seat(size=8, offload=6, pinned=2, stays=False)   # 2 bytes left on 0: offloaded, its buffers on 0
    1
    >>> room.free
    [0, 94]
    >>> room.seat(size=8, offload=6, pinned=0, stays=True)    # must stay, and no device that executes has room
    -1
    """

    __slots__ = ("devices", "free", "targets", "charges", "reserve", "disk")

    def __init__(self, devices: list, free: list, targets: list[bool], charges: list[bool], reserve: float = 0):
        self.devices, self.free, self.targets, self.charges = list(devices), list(free), list(targets), list(charges)
        self.reserve = reserve
        self.disk = self.devices.index("disk") if "disk" in self.devices else -1   # -1: no disk

    @classmethod
    def of(cls, problem: Problem, main: Device, reserve: int, found: Groups) -> Room | None:
        """The room of a fill of ``found`` under ``main`` and ``reserve``; ``None`` when the main device cannot keep
        the reserve and its workspace free."""
        b = problem.budgets
        if main == "cpu":
            devices = ["cpu", "disk"]
        else:
            devices = [d for d in b.accelerators if b.order.index(d) >= b.order.index(main)] + ["cpu", "disk"]
        devices = [d for d in devices if d in b.order]   # main first
        offloaded = offloaded_devices(main)
        free = [b.limit(d) if b.limit(d) is not None else math.inf for d in devices]
        free[0] -= streams_held(problem.runtime, reserve)   # with prefetch, the modules made ready ahead too
        # Generation: every device that runs something holds activations; the main device also the next-token scores.
        # A device left with negative room gets nothing, so it runs nothing and needs no workspace.
        for j, d in enumerate(devices):
            if d not in offloaded:
                free[j] -= workspace(problem.graph, main=d == main)
        if free[0] < 0:
            return None
        charges = [d == "cpu" or b.limit("disk") is not None for d in devices]
        room = cls(devices, free, [d in offloaded for d in devices], charges, reserve)
        stays = cls.must_stay(found.array("stream"), found.array("resident_only"), reserve)
        room.hold(int(found.array("pinned")[~stays].sum()) if len(stays) else 0)
        return room

    def hold(self, pinned: int) -> None:
        """Hold back ``pinned`` bytes on the main device: the pinned bytes of every group still to seat that may be
        offloaded (any of them may end up there). :meth:`seat` gives a group's back when it seats it."""
        self.free[0] -= pinned

    @staticmethod
    def must_stay(stream, resident_only, reserve):
        """Whether a group cannot be offloaded: its streamed chain passes the reserve, or it holds a lone tensor
        (element-wise on arrays)."""
        return (stream > reserve) | resident_only

    def fits(self, j: int, size: int, offload: int, pinned: int, stays: bool, disk_ok: bool = True) -> bool:
        """Whether device ``j`` takes the group, its held-back pinned bytes already given back to the main device."""
        need, main = self.charge(j, size, offload, pinned)
        if self.targets[j]:
            return not stays and (disk_ok or j != self.disk) and self.free[j] >= need and self.free[0] >= main
        return self.free[j] >= need

    def charge(self, j: int, size: int, offload: int, pinned: int) -> tuple[int, int]:
        """What the group takes from device ``j`` and, besides, from the main device: a device that executes takes its
        whole size; a target its offloaded bytes (where it charges them), the main device its pinned bytes."""
        if not self.targets[j]:
            return size, 0
        return (offload if self.charges[j] else 0), pinned

    def take(self, j: int, size: int, offload: int, pinned: int) -> None:
        """Charge the group to device ``j`` (:meth:`fits` said yes)."""
        need, main = self.charge(j, size, offload, pinned)
        self.free[j] -= need
        self.free[0] -= main

    def seat(self, size: int, offload: int, pinned: int, stays: bool, low: int = 0, high: int | None = None,
             disk_ok: bool = True) -> int:
        """Seat a group on the first device that takes it (:meth:`fits`, :meth:`take`); its index in ``devices``, or
        -1 when none does (nothing is charged). Devices that execute are taken only from index ``low`` to ``high``.

        A group that may be offloaded gives back its held-back pinned bytes first (:meth:`of`)."""
        free, charges = self.free, self.charges
        if not stays:
            free[0] += pinned
        # :meth:`fits` and :meth:`take` of each device in turn, written out (this runs once per group); a test checks
        # that the two agree
        for j, target in enumerate(self.targets):
            if target:
                if stays or (j == self.disk and not disk_ok):
                    continue
                need = offload if charges[j] else 0
                if free[j] >= need and free[0] >= pinned:
                    free[j] -= need
                    free[0] -= pinned
                    return j
            elif low <= j and (high is None or j <= high) and free[j] >= size:
                free[j] -= size
                return j
        if not stays:
            free[0] -= pinned
        return -1

    def seat_group(self, group, low: int = 0, high: int | None = None, disk_ok: bool = True) -> int:
        """:meth:`seat` of a :class:`allocator.evaluate.units.Group` record (``disk_ok``: its entry of
        :func:`allocator.evaluate.units.disk_loadable`)."""
        stays = self.must_stay(group.stream, group.resident_only, self.reserve)
        return self.seat(group.size, group.offload, group.pinned, stays, low, high, disk_ok)
