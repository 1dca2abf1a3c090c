"""First-fit over ordered devices with an explicit main device and streaming reserve (shared by backfill and reserve).

Given the main device ``M`` and a reserve ``R`` kept free on it for streamed weights, every tie group in model
order goes to the first device with room: accelerators from ``M`` on (earlier ones stay empty, else they would
become main), then cpu, then disk. A group may be offloaded only if the weights its hooks materialise at once fit
in ``R``; its buffers are charged to ``M``. Groups whose streamed chain exceeds ``R`` must stay resident, so they
are seated first, as are lone tensors (accelerate cannot offload a tensor on its own). The result is always
re-checked by :func:`allocator.validate.check`.

The fill reads the group columns (:class:`allocator.units.Groups`) and answers with a device per group; long
stretches of groups that go to one device are seated at once with numpy (:class:`_FirstFit`), so a flat stack of
200k layers fills in tens of milliseconds.
"""

from __future__ import annotations

import math

import numpy as np

from ..budgets import Device
from ..problem import Problem
from ..runs import NUMPY_FROM, Run, as_array, columns, side_by_side_runs
from ..runtime import main_device, map_runs, offloaded_devices, workspace
from ..units import Groups

__all__ = ["Filled", "Streams", "every_main", "fill", "fill_to_fixed_point", "full_reserve", "reserve_sizes",
           "unit_map"]

#: At most this many candidate reserves (:func:`reserve_sizes`): the smallest and the largest ones are kept.
MAX_RESERVES = 64


def every_main(problem: Problem) -> list[Device]:
    """Every device worth trying as main when the contract is lifted (``objective="latency"``): an accelerator (the
    ones before it left empty) whose budget is larger than every earlier accelerator's — otherwise relabelling the plan
    onto an earlier one gives the same plan with a lower index — then cpu."""
    b = problem.budgets
    out, best = [], 0
    for d in b.accelerators:
        limit = b.limit(d) or 0
        if limit > best:
            out.append(d)
            best = limit
    return out + (["cpu"] if "cpu" in b.order else [])


def fill(problem: Problem, found: Groups, main: Device, reserve: int) -> list | None:
    """The device of each group (in group order), or ``None`` when some group fits nowhere under this main device and
    reserve. :func:`unit_map` turns the answer into a map of unit names.

    Notes
    -----
    O(groups x devices), one pass over the group columns; no object per group.
    """
    b = problem.budgets
    if main == "cpu":
        devices = ["cpu", "disk"]
    else:
        devices = [d for d in b.accelerators if b.order.index(d) >= b.order.index(main)] + ["cpu", "disk"]
    devices = [d for d in devices if d in b.order]   # main first
    targets = offloaded_devices(main)
    room = [b.limit(d) if b.limit(d) is not None else math.inf for d in devices]
    room[0] -= reserve
    # Generation: every device that runs something holds activations; the main device also the next-token scores.
    # A device left with negative room gets nothing, so it runs nothing and needs no workspace.
    for j, d in enumerate(devices):
        if d not in targets:
            room[j] -= workspace(problem.graph, main=d == main)
    if room[0] < 0:
        return None
    # what an offloaded group takes from its target: its weights on cpu, and on disk only when disk has a budget
    charges = [d == "cpu" or b.limit("disk") is not None for d in devices]
    order, stays = _seating(found, reserve)
    # Buffers of groups still to place may all end up pinned on the main device: hold room for them until then.
    room[0] -= int(found.array("pinned")[~stays].sum()) if len(stays) else 0
    offloads = [d in targets for d in devices]
    # the contract: accelerators in index order along the model (only matters with two or more that execute)
    monotone = problem.options.contract and offloads.count(False) > 1
    chosen = _FirstFit(found, order, stays, room, offloads, charges, monotone=monotone).run()
    if chosen is None:
        return None
    where = np.empty(len(chosen), dtype=np.int64)
    where[order] = chosen
    return list(map(devices.__getitem__, where.tolist()))


class _FirstFit:
    """First fit of groups, in seating order, over devices ``0..D-1`` (0 is the main device); the rules of
    :func:`fill`, one group at a time in :meth:`step`.

    Long stretches of groups that all go to one device are seated at once with numpy (:meth:`stretch`): assuming
    the next groups go where the last one went, the rule each must pass (every earlier device refuses it, that
    device takes it) is a comparison against prefix sums; the stretch ends at the first group that fails it, which
    :meth:`step` then seats. Where stretches stay short, a burst of single steps runs before the next try, so the
    worst case stays that of the plain loop. Below :data:`allocator.runs.NUMPY_FROM` groups, single steps only.
    """

    BURST = 64     # single steps after a short stretch
    SHORT = 16     # a stretch shorter than this is not worth the numpy calls

    def __init__(self, found: Groups, order: np.ndarray, stays: np.ndarray, room: list, offloads: list[bool],
                 charges: list[bool], *, monotone: bool = False):
        self.room, self.offloads, self.charges = room, offloads, charges
        arrays = [found.array(c) for c in ("pinned", "size", "offload")]
        self.order = order
        self.stay = stays[order]
        self.pinned, self.size, self.offload = (a[order] for a in arrays)
        self.monotone = monotone
        # numpy stretches need int64 sums: the model's total well inside int64
        total = sum(int(a.sum()) for a in arrays) if len(order) else 0
        self.vector = (all(a.dtype == np.int64 for a in arrays) and total < 2**60 and len(order) >= NUMPY_FROM
                       and not monotone)
        self._lists: list | None = None   # the columns as Python lists, for single steps (made on the first)

    def run(self) -> list[int] | None:
        """The device index of each group in seating order, or ``None`` when one fits nowhere."""
        if self.monotone:
            return self.run_in_index_order()
        n = len(self.stay)
        chosen: list[int] = []
        pos, last, window = 0, -1, 64
        while pos < n:
            if last >= 0 and self.vector:
                stop = min(n, pos + window)
                count = self.stretch(pos, stop, last)
                chosen += [last] * count
                pos += count
                if pos == stop:
                    window *= 2
                    continue
                window = 64
                if count < self.SHORT:   # not paying: single steps for a while
                    for _ in range(min(self.BURST, n - pos - 1)):
                        last = self.step(pos)
                        if last < 0:
                            return None
                        chosen.append(last)
                        pos += 1
            last = self.step(pos)
            if last < 0:
                return None
            chosen.append(last)
            pos += 1
        return chosen

    def step(self, k: int, low: int = 0, high: int | None = None) -> int:
        """Seat group ``k`` (seating order) on the first device with room; its index, or -1. Devices that execute
        (not offload targets) are taken only from index ``low`` to ``high``."""
        if self._lists is None:
            self._lists = [self.stay.tolist(), self.pinned.tolist(), self.size.tolist(), self.offload.tolist()]
        stays, pinned, sizes, offloads = self._lists
        stay, p, size, offload = stays[k], pinned[k], sizes[k], offloads[k]
        room = self.room
        if not stay:
            room[0] += p
        for j, target in enumerate(self.offloads):
            if target:
                if stay:
                    continue
                need = offload if self.charges[j] else 0
                if room[j] >= need and room[0] >= p:
                    room[j] -= need
                    room[0] -= p
                    return j
            elif low <= j and (high is None or j <= high) and room[j] >= size:
                room[j] -= size
                return j
        if not stay:
            room[0] -= p
        return -1

    def run_in_index_order(self) -> list[int] | None:
        """:meth:`run` with the executing devices (the main device and the accelerators after it) used in index order
        along the model: a group never goes to an executing device before one that an earlier group (in model order)
        went to. Groups that must stay are seated first, in model order, each on the first executing device from the
        last one used; then the others, in model order, each between the executing devices of the groups that must
        stay before and after it. Single steps (no numpy stretches)."""
        n, stay = len(self.stay), self.stay.tolist()
        model = self.order.tolist()                 # seat -> group (model order)
        chosen: list[int] = []
        top = 0
        first_free = stay.count(True)               # seats of the groups that must stay come first
        for k in range(first_free):
            top = self.step(k, low=top)
            if top < 0:
                return None
            chosen.append(top)
        # executing device of the nearest group that must stay, before (max so far) and after (min from there)
        below = [0] * (len(model) + 1)
        above: list = [None] * (len(model) + 1)
        for k in range(first_free):
            below[model[k] + 1] = chosen[k]
            above[model[k]] = chosen[k]
        for g in range(1, len(model) + 1):
            below[g] = max(below[g], below[g - 1])
        for g in range(len(model) - 1, -1, -1):
            if above[g] is None:
                above[g] = above[g + 1]
        top = 0
        for k in range(first_free, n):
            g = model[k]
            j = self.step(k, low=max(top, below[g]), high=above[g + 1])
            if j < 0:
                return None
            if not self.offloads[j]:
                top = j
            chosen.append(j)
        return chosen

    def stretch(self, a: int, b: int, j: int) -> int:
        """Seat as many of groups ``a..b-1`` as go, one after another, to device ``j``; how many went."""
        room = [_clamped(r) for r in self.room]
        stay, pinned, size, offload = self.stay[a:b], self.pinned[a:b], self.size[a:b], self.offload[a:b]
        back = np.where(stay, 0, pinned)          # what each gives back to the main device before it is seated
        if self.offloads[j]:
            if room[0] < 0:
                return 0
            main = room[0] + back   # groups sent to a target give their pinned bytes back, then take them
            need = offload if self.charges[j] else np.zeros_like(offload)
            ok = ~stay & (room[j] - (np.cumsum(need) - need) >= need)
        elif j == 0:
            net = back - size
            main = room[0] + np.cumsum(net) - net + back
            ok = main >= size
        else:
            main = room[0] + np.cumsum(back)
            ok = room[j] - (np.cumsum(size) - size) >= size
        for i in range(j):   # every earlier device refuses
            if i == 0:
                ok &= main < size
            elif self.offloads[i]:
                ok &= stay | (room[i] < (offload if self.charges[i] else 0)) | (main < pinned)
            else:
                ok &= room[i] < size
        count = len(ok) if ok.all() else int(np.argmin(ok))
        if count:
            if self.offloads[j]:
                self.room[j] -= int(need[:count].sum())
            elif j == 0:
                self.room[0] += int(net[:count].sum())
            else:
                self.room[0] += int(back[:count].sum())
                self.room[j] -= int(size[:count].sum())
        return count


def _clamped(room):
    """A room as numpy compares it with int64 prefix sums below 2**60: exact, or clamped far beyond them."""
    return min(max(room, -2**62), 2**62) if room != math.inf else room


def _seating(found: Groups, reserve: int) -> tuple[np.ndarray, np.ndarray]:
    """The order :func:`fill` seats groups in — those that must stay resident first (their streamed chain passes
    the reserve, or they hold a lone tensor), then the rest, each in model order — and which must stay."""
    stays = (found.array("stream") > reserve) | found.array("resident_only")
    return np.concatenate([np.flatnonzero(stays), np.flatnonzero(~stays)]), stays


def unit_map(found: Groups, where: list, reserve: int) -> dict:
    """Unit name -> device from :func:`fill`'s answer, keys in the order the groups were seated."""
    order, _ = _seating(found, reserve)
    if len(order) < NUMPY_FROM:
        names, members, out = found.units.name, found.members, {}
        if len(members) == len(found):   # every group is one unit (no ties)
            return {names[members[k]]: where[k] for k in order.tolist()}
        for k in order.tolist():
            for j in found.member_range(k):
                out[names[members[j]]] = where[k]
        return out
    start = found.array("start")
    count = found.counts()[order]
    # the members of the seated groups one after another: each group's run of ``members``, in seating order
    at = np.repeat(start[order] - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    names = found.units.array("name")[found.array("members")[at]]
    devices = np.empty(len(where), dtype=object)
    devices[:] = where
    return dict(zip(names.tolist(), np.repeat(devices[order], count).tolist()))


class Filled:
    """A fill's answer as a candidate plan: the device of each group (``where``, from :func:`fill`), the reserve it
    was made under and a note saying which. Its unit map and the map's runs are made when first asked for:
    :func:`allocator.strategies.ranking.best_of` ranks and prices candidates from their runs and builds the map of the
    one it keeps."""

    __slots__ = ("problem", "found", "where", "reserve", "note", "_runs")

    def __init__(self, problem: Problem, found: Groups, where: list, reserve: int, note: str):
        self.problem, self.found, self.where, self.reserve, self.note = problem, found, where, reserve, note
        self._runs = None

    @property
    def main(self) -> Device:
        """The main device of the unit map (:func:`allocator.runtime.main_device` of its values)."""
        return main_device(set(self.where))

    def device_map(self) -> dict:
        """The unit map (:func:`unit_map`), a new dict at each call."""
        return unit_map(self.found, self.where, self.reserve)

    def runs(self) -> list[Run]:
        """The runs of the unit map (equal to :func:`allocator.runtime.map_runs` of :meth:`device_map`), made once.

        Units partition the tensors and none holds another, so the runs are the units that hold tensors, in model
        order, merged where neighbours share a device; from :data:`allocator.runs.NUMPY_FROM` units on they are
        made from the units' tensor ranges with numpy, without the map.
        """
        if self._runs is None:
            graph, found = self.problem.graph, self.found
            if len(found.units) < NUMPY_FROM:
                self._runs = map_runs(graph, self.device_map())
            else:
                keep, lo, hi, order = found.units.spans(graph)
                devices = np.empty(len(self.where), dtype=object)
                devices[:] = self.where
                self._runs = side_by_side_runs(lo, hi, order, devices[found.unit_groups()[keep]].tolist(),
                                               len(columns(graph).module), len(graph.nodes))
        return self._runs


def reserve_sizes(problem: Problem, found: Groups) -> list[int]:
    """Every streaming reserve worth a fill, ascending: 0, each group's streamed size, and the reserve that streams
    anything (at most :data:`MAX_RESERVES`: the smallest and the largest)."""
    sizes = sorted({*found.stream, 0, full_reserve(problem)})
    if len(sizes) > MAX_RESERVES:
        sizes = sizes[:1] + sizes[-(MAX_RESERVES - 1):]
    return sizes


def full_reserve(problem: Problem) -> int:
    """The reserve that streams anything: the largest chain if every weight were offloaded."""
    return columns(problem.graph).moving(problem.options.offload_buffers).chain[0] if problem.graph.nodes else 0


class Streams:
    """What the offloaded units of a fill stream at once on the main device, from the units alone.

    Equal to :func:`allocator.runtime.streamed_chain` of the unit map, without building it: an offloaded module unit
    adds its own chain below its (split) parent, an offloaded tensor unit adds its bytes to its module; chains are
    then folded up the split nodes, a level of the tree at a time.
    """

    def __init__(self, problem: Problem, found: Groups):
        g = problem.graph
        cols = columns(g)
        u = found.units
        node, tensor = as_array(u.node), as_array(u.tensor)
        self.is_module = node >= 0
        module = cols.module_array()
        self.parent = np.where(self.is_module, cols.parent_array[np.maximum(node, 0)],
                               module[np.maximum(tensor, 0)] if len(module) else -1) if len(u) else node
        self.stream = as_array(u.stream)
        self.group = found.unit_groups()
        # split nodes: every ancestor of a unit, folded a level at a time from the deepest
        split = np.zeros(len(g.nodes), dtype=bool)
        split[self.parent[self.parent >= 0]] = True
        self.levels = []
        for level in cols.levels[:-1]:   # deepest first, the root's level left out
            level = level[split[level]]
            if len(level):
                split[cols.parent_array[level]] = True
                self.levels.append((level, cols.parent_array[level]))
        self.nodes = len(g.nodes)

    def reserve(self, where: list, offloaded) -> int:
        """The streamed chain of the units of groups whose device in ``where`` (:func:`fill`) is ``offloaded``."""
        if not len(self.group):
            return 0
        flags = {d: d in offloaded for d in set(where)}
        off = np.fromiter(map(flags.__getitem__, where), dtype=bool, count=len(where))[self.group]
        zero = np.zeros(self.nodes, dtype=self.stream.dtype)
        below, own = zero, zero.copy()
        modules = off & self.is_module
        top = self.stream[modules & (self.parent < 0)]
        top = max(top.tolist(), default=0)   # a module unit that is the whole model
        modules &= self.parent >= 0
        np.maximum.at(below, self.parent[modules], self.stream[modules])
        tensors = off & ~self.is_module
        np.add.at(own, self.parent[tensors], self.stream[tensors])
        for level, parents in self.levels:
            np.maximum.at(below, parents, own[level] + below[level])
        return max(top, int(own[0] + below[0]) if self.nodes else 0)


def fill_to_fixed_point(problem: Problem, found: Groups, main: Device, reserve: int, rounds: int = 8,
                        streams: Streams | None = None, memo: dict | None = None):
    """``fill`` then raise the reserve to what the offloaded units really stream together (a parent's hook stays
    active while its children run), until it holds. Returns ``(where, reserve)`` (``where``: :func:`fill`'s device of
    each group; :func:`unit_map` of both is the plan) or ``(None, reserve)``.

    ``streams`` (:class:`Streams` of these groups) and ``memo`` (a dict kept across calls with the same groups) only
    save work: a fill for a (main, reserve) already tried is not redone."""
    streams = streams or Streams(problem, found)
    offloaded = offloaded_devices(main)
    memo = {} if memo is None else memo
    for _ in range(rounds):
        key = (main, reserve)
        if key not in memo:
            where = fill(problem, found, main, reserve)
            memo[key] = where, (None if where is None else streams.reserve(where, offloaded))
        where, actual = memo[key]
        if where is None:
            return None, reserve
        if actual <= reserve:
            return where, reserve
        reserve = actual
    return None, reserve
