"""The vectorised kernels of the planner, each next to the plain-Python loop it must agree with.

Readable modules say what they compute and call these; a kernel says how fast. Every kernel ``k`` has a reference
``k_reference`` written as the obvious loop; ``tests/evaluate/test_kernels.py`` checks they agree on random inputs.
Where numpy's fixed cost per call loses to the loop on small inputs, the function readable modules call (``k``)
picks one or the other, here and only here (:func:`vectorised`).

- run carving (:func:`key_runs`): a device map's keys as runs of tensors; keys side by side
  (:func:`side_by_side`, the usual map) are merged in numpy;
- the first fit's stretch (:func:`fit_stretch`): how many groups in a row go to one device, under the seating rules
  of :class:`allocator.search.room.Room`;
- accelerate's stretch (:func:`in_a_row`): how many entries in a row ``sequential`` places on its current device;
- the stream reserve (:func:`stream_reserve`): what offloaded units stream at once on the main device;
- the members of seated groups (:func:`group_map`): a fill's unit map;
- :class:`Stretches`: when a loop that seats items one at a time tries a stretch (both stretches above).

This module imports numpy only: it sits below every module of the package.
"""

from __future__ import annotations

import bisect
import math
from operator import itemgetter, ne
from typing import NamedTuple

import numpy as np

__all__ = ["Run", "NUMPY_FROM", "vectorised", "key_ranges", "key_runs", "key_runs_vectorised", "key_runs_reference",
           "carve", "side_by_side", "side_by_side_vectorised", "side_by_side_reference", "fit_stretch",
           "fit_stretch_reference", "stretchable", "in_a_row", "in_a_row_reference", "stream_reserve",
           "stream_reserve_reference", "group_map", "group_map_vectorised", "group_map_reference", "Stretches"]


class Run(NamedTuple):
    """Tensors ``start`` to ``end - 1`` (graph order) live on ``device`` (``None``: the map does not cover them).

    ``node`` is the module whose whole subtree the run is, when it comes from one map key with no key below it;
    else -1."""

    start: int
    end: int
    device: object
    node: int = -1


#: From this many entries (map keys, units, groups, queued entries) work goes through numpy; below, plain loops.
NUMPY_FROM = 512


def vectorised(n: int) -> bool:
    """Whether ``n`` entries go through numpy: numpy's fixed cost per call is larger than a loop over a few hundred."""
    return n >= NUMPY_FROM


# ---------------------------------------------------------------------------------------------------------- runs

def key_ranges(first: np.ndarray, last: np.ndarray, order: np.ndarray, tensor_order: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The tensors ``[lo, hi)`` that keys cover, given by their order (a node index, or ``tensor_order`` plus a tensor
    index; -1 for a key that names nothing, whose range is meaningless); ``first`` / ``last``: each node's first tensor
    and one past its subtree's last (:class:`allocator.evaluate.runs.Columns`)."""
    is_tensor = order >= tensor_order
    at = np.where(is_tensor | (order < 0), 0, order)
    return np.where(is_tensor, order - tensor_order, first[at]), np.where(is_tensor, order - tensor_order + 1, last[at])


def key_runs(order: list, devices: list, first, last, tensors: int, tensor_order: int) -> list[Run]:
    """The runs of map keys, given by their order (as :func:`key_ranges`) and devices, covering every tensor in order;
    neighbours on one device merged; a key below another carves its range out of the enclosing one (the deepest key
    wins). ``first`` / ``last``: int64 columns (``array('q')`` or numpy) of each node's tensor range."""
    found = key_runs_vectorised if vectorised(len(order)) else key_runs_reference
    return found(order, devices, first, last, tensors, tensor_order)


def key_runs_reference(order: list, devices: list, first, last, tensors: int, tensor_order: int) -> list[Run]:
    """:func:`key_runs`, one key at a time: the keys that cover tensors as spans, sorted, then carved."""
    spans = []
    for i, device in zip(order, devices):
        if i >= tensor_order:
            t = i - tensor_order
            spans.append((t, -t - 1, i, device))
        elif i >= 0 and first[i] < last[i]:
            spans.append((first[i], -last[i], i, device))
    spans.sort()
    return carve(spans, tensors, tensor_order)


def key_runs_vectorised(order: list, devices: list, first, last, tensors: int, tensor_order: int) -> list[Run]:
    """:func:`key_runs` with the ranges and the sort in numpy, and keys side by side merged by :func:`side_by_side`."""
    order = np.asarray(order, dtype=np.int64)
    lo, hi = key_ranges(_int64(first), _int64(last), order, tensor_order)
    keep = np.flatnonzero((order >= 0) & (lo < hi))   # a module with no tensors covers nothing
    # by start, the longer first, then the shallower (an ancestor's index is lower): enclosing keys come first
    ranked = keep
    if len(keep) > 1 and not (lo[keep[1:]] > lo[keep[:-1]]).all():   # keys in model order need no sort
        ranked = keep[np.lexsort((order[keep], -hi[keep], lo[keep]))]
    lo, hi, order = lo[ranked], hi[ranked], order[ranked]
    if len(ranked) != len(devices) or ranked is not keep:
        devices = list(itemgetter(*ranked.tolist())(devices)) if len(ranked) > 1 else [devices[k] for k in ranked]
    if len(ranked) < 2 or (lo[1:] >= hi[:-1]).all():  # no key below another: the usual map
        return side_by_side_vectorised(lo, hi, order, devices, tensors, tensor_order)
    return carve(list(zip(lo.tolist(), (-hi).tolist(), order.tolist(), devices)), tensors, tensor_order)


def carve(spans: list[tuple], tensors: int, tensor_order: int) -> list[Run]:
    """The runs of sorted spans ``(start, -end, order, device)`` (by start, the longer first, then the shallower): a
    span below another carves its range out of the enclosing one; gaps are runs of ``None``."""
    out: list[list] = []
    stack: list = []   # the keys enclosing the position: [end, device, order, carved]
    pos = 0

    def emit(end: int, device, node: int) -> None:
        nonlocal pos
        if pos < end:
            if out and out[-1][2] == device and type(out[-1][2]) is type(device):
                out[-1][1], out[-1][3] = end, -1   # merged: no longer one key's subtree
            else:
                out.append([pos, end, device, node])
            pos = end

    def close() -> None:
        end, device, order, carved = stack.pop()
        emit(end, device, -1 if carved or order >= tensor_order else order)

    for start, negative_end, order, device in spans:
        while stack and stack[-1][0] <= start:
            close()
        if stack:
            stack[-1][3] = True    # a key below it: the enclosing key's runs are not its whole subtree
            emit(start, stack[-1][1], -1)
        else:
            emit(start, None, -1)
        stack.append([-negative_end, device, order, False])
    while stack:
        close()
    emit(tensors, None, -1)
    return [Run(*run) for run in out]


def side_by_side(lo: np.ndarray, hi: np.ndarray, order: np.ndarray, devices: list, tensors: int,
                 tensor_order: int) -> list[Run]:
    """The runs of sorted key ranges ``[lo, hi)`` none of which encloses another (``order`` as in :func:`key_ranges`):
    a run starts at a gap or where the device changes (its type too: ``True == 1``, but ``True`` is no device); a run
    of one module key is that key's subtree."""
    found = side_by_side_vectorised if vectorised(len(lo)) else side_by_side_reference
    return found(lo, hi, order, devices, tensors, tensor_order)


def side_by_side_reference(lo, hi, order, devices: list, tensors: int, tensor_order: int) -> list[Run]:
    """:func:`side_by_side`, one key at a time."""
    out: list[list] = []
    pos = 0
    for start, end, i, device in zip(_ints(lo), _ints(hi), _ints(order), devices):
        if start > pos:
            out.append([pos, start, None, -1])
        elif out and out[-1][2] == device and type(out[-1][2]) is type(device):
            out[-1][1], out[-1][3], pos = end, -1, end
            continue
        out.append([start, end, device, i if i < tensor_order else -1])
        pos = end
    if pos < tensors:
        out.append([pos, tensors, None, -1])
    return [Run(*run) for run in out]


def side_by_side_vectorised(lo: np.ndarray, hi: np.ndarray, order: np.ndarray, devices: list, tensors: int,
                            tensor_order: int) -> list[Run]:
    """:func:`side_by_side` with the run heads found in numpy."""
    if not len(lo):
        return [Run(0, tensors, None, -1)] if tensors else []
    if set(map(type, devices)) <= {int, str}:   # the usual map: no device equals one of another type
        changed = np.fromiter(map(ne, devices[1:], devices), dtype=bool, count=len(devices) - 1)
    else:
        kinds = list(zip(map(type, devices), devices))
        changed = np.fromiter(map(ne, kinds[1:], kinds), dtype=bool, count=len(kinds) - 1)
    gap = np.empty(len(lo), dtype=bool)
    gap[0] = lo[0] > 0
    gap[1:] = lo[1:] > hi[:-1]
    new = gap.copy()
    new[0] = True
    new[1:] |= changed
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:], len(lo)) - 1
    node = np.where((heads == tails) & (order[heads] < tensor_order), order[heads], -1)
    out: list[Run] = []
    pos = 0
    for h, t, n, g in zip(heads.tolist(), tails.tolist(), node.tolist(), gap[heads].tolist()):
        start = int(lo[h])
        if g:
            out.append(Run(pos, start, None, -1))
        pos = int(hi[t])
        out.append(Run(start, pos, devices[h], n))
    if pos < tensors:
        out.append(Run(pos, tensors, None, -1))
    return out


# ----------------------------------------------------------------------------------------------- first fit

def stretchable(*columns: np.ndarray) -> bool:
    """Whether :func:`fit_stretch` may run on these columns: int64, with a total far inside int64 (its prefix sums
    are then exact)."""
    if not all(c.dtype == np.int64 for c in columns):
        return False
    return sum(int(c.sum()) for c in columns) < 2**60


def fit_stretch(room, stay: np.ndarray, pinned: np.ndarray, size: np.ndarray, offload: np.ndarray, j: int,
                disk_ok: np.ndarray | None = None) -> int:
    """Seat as many of the groups given by the columns (seating order; :func:`stretchable`) as go, one after another,
    to device ``j`` of ``room`` (:class:`allocator.search.room.Room`), charging ``room.free``; how many went.
    ``disk_ok``: which groups may go to disk (all where ``None``).

    Assuming every group goes to ``j``, the rule each must pass (every earlier device refuses it, ``j`` takes it) is a
    comparison against prefix sums; the stretch ends at the first group that fails it.
    """
    free = [_clamped(r) for r in room.free]
    targets, charges = room.targets, room.charges
    back = np.where(stay, 0, pinned)          # what each gives back to the main device before it is seated
    if targets[j]:
        if free[0] < 0:
            return 0
        main = free[0] + back   # groups sent to a target give their pinned bytes back, then take them
        need = offload if charges[j] else np.zeros_like(offload)
        ok = ~stay & (free[j] - (np.cumsum(need) - need) >= need)
        if j == room.disk and disk_ok is not None:
            ok &= disk_ok   # disk is last: no later device changes the rule
    elif j == 0:
        net = back - size
        main = free[0] + np.cumsum(net) - net + back
        ok = main >= size
    else:
        main = free[0] + np.cumsum(back)
        ok = free[j] - (np.cumsum(size) - size) >= size
    for i in range(j):   # every earlier device refuses
        if i == 0:
            ok &= main < size
        elif targets[i]:
            ok &= stay | (free[i] < (offload if charges[i] else 0)) | (main < pinned)
        else:
            ok &= free[i] < size
    count = len(ok) if ok.all() else int(np.argmin(ok))
    if count:
        if targets[j]:
            room.free[j] -= int(need[:count].sum())
        elif j == 0:
            room.free[0] += int(net[:count].sum())
        else:
            room.free[0] += int(back[:count].sum())
            room.free[j] -= int(size[:count].sum())
    return count


def fit_stretch_reference(room, stay, pinned, size, offload, j: int, disk_ok=None) -> int:
    """:func:`fit_stretch` as :meth:`allocator.search.room.Room.seat` of one group after another."""
    count = 0
    disk = _ints(disk_ok) if disk_ok is not None else [True] * len(stay)
    for s, p, n, o, d in zip(_ints(stay), _ints(pinned), _ints(size), _ints(offload), disk):
        before = list(room.free)
        if room.seat(n, o, p, bool(s), disk_ok=bool(d)) != j:
            room.free[:] = before
            break
        count += 1
    return count


def _clamped(room):
    """A room as numpy compares it with int64 prefix sums below 2**60: exact, or clamped far beyond them."""
    return min(max(room, -2**62), 2**62) if room != math.inf else room


class Stretches:
    """When a loop that seats items one at a time (the first fit's groups, ``sequential``'s entries) tries a stretch
    at once instead: :data:`FIRST` items at first, doubled while whole stretches go; after a stretch that stops early,
    a single step (the item it stopped at), or :data:`BURST` more when it was shorter than :data:`SHORT` and so not
    worth its numpy calls. Only from :data:`NUMPY_FROM` items on. The items are seated the same either way."""

    FIRST = 64   # items in a first stretch
    SHORT = 16   # a stretch shorter than this is not worth the numpy calls
    BURST = 64   # single steps after a short stretch

    __slots__ = ("window", "pause")

    def __init__(self, n: int, enabled: bool = True):
        self.window = self.FIRST
        self.pause = 0 if enabled and vectorised(n) else math.inf   # single steps still to take

    def steps(self, left: int) -> int:
        """How many single steps to take now, at most ``left``; 0: try a stretch of ``window`` items."""
        return min(left, self.pause) if self.pause > 0 else 0

    def stretched(self, count: int, tried: int) -> None:
        """A stretch of ``tried`` items seated ``count`` of them."""
        if count == tried:
            self.window *= 2
        else:
            self.window = self.FIRST
            self.pause = 1 + (self.BURST if count < self.SHORT else 0)

    def stepped(self, count: int = 1) -> None:
        """``count`` single steps were taken."""
        self.pause -= count


# ---------------------------------------------------------------------------------------------- sequential

def in_a_row(sizes: np.ndarray, low: np.ndarray, high: np.ndarray, places: np.ndarray, live: int, room) -> int:
    """How many entries accelerate's loop places one after another on its current device: entry ``k`` (``sizes``,
    float64) covers the places ``low[k]`` to ``high[k] - 1``; it stops before the first that does not fit in ``room``
    (``None``: no limit) and before the one under which the count of ``places`` (sorted; ``live`` of them are alive)
    reaches ``live`` (the largest layer is then recomputed). 0 where sizes are not integers held exactly.

    Places under the first k entries are counted whether alive or not (a place dies only under a taken entry, or more
    where an entry was put back after its places were dropped): counting those too only stops earlier."""
    if not len(sizes) or not (sizes == np.floor(sizes)).all() or float(np.abs(sizes).sum()) >= 2**62:
        return 0
    under = np.cumsum(np.searchsorted(places, high) - np.searchsorted(places, low))
    ok = under < live
    if room is not None:
        ok &= np.cumsum(sizes.astype(np.int64)) <= room
    return len(ok) if ok.all() else int(np.argmin(ok))


def in_a_row_reference(sizes, low, high, places, live: int, room) -> int:
    """:func:`in_a_row`, one entry at a time."""
    sizes = [float(s) for s in sizes]
    if any(s != math.floor(s) for s in sizes) or sum(abs(s) for s in sizes) >= 2**62:
        return 0
    places = _ints(places)
    under, total = 0, 0
    for k, (size, a, b) in enumerate(zip(sizes, _ints(low), _ints(high))):
        under += bisect.bisect_left(places, b) - bisect.bisect_left(places, a)
        total += int(size)
        if under >= live or room is not None and total > room:
            return k
    return len(sizes)


# ------------------------------------------------------------------------------------------- stream reserve

def stream_reserve(off: np.ndarray, is_module: np.ndarray, parent: np.ndarray, stream: np.ndarray, levels: list,
                   nodes: int) -> int:
    """The streamed chain of the offloaded units (``off``, one flag per unit): an offloaded module unit adds its own
    chain (``stream``) below its parent, an offloaded tensor unit adds its bytes to its module (``parent``); chains
    are then folded up the split nodes, one ``(level, parents)`` pair of ``levels`` at a time, deepest first. A module
    unit without parent is the whole model."""
    if not len(off):
        return 0
    zero = np.zeros(nodes, dtype=stream.dtype)
    below, own = zero, zero.copy()
    modules = off & is_module
    top = stream[modules & (parent < 0)]
    top = max(top.tolist(), default=0)
    modules &= parent >= 0
    np.maximum.at(below, parent[modules], stream[modules])
    tensors = off & ~is_module
    np.add.at(own, parent[tensors], stream[tensors])
    for level, parents in levels:
        np.maximum.at(below, parents, own[level] + below[level])
    return max(top, int(own[0] + below[0]) if nodes else 0)


def stream_reserve_reference(off, is_module, parent, stream, levels: list, nodes: int) -> int:
    """:func:`stream_reserve`, one unit and one node at a time."""
    below, own, top = [0] * nodes, [0] * nodes, 0
    for o, m, p, s in zip(_ints(off), _ints(is_module), _ints(parent), _ints(stream)):
        if not o:
            continue
        if not m:
            own[p] += s
        elif p < 0:
            top = max(top, s)
        else:
            below[p] = max(below[p], s)
    for level, parents in levels:
        for node, p in zip(_ints(level), _ints(parents)):
            below[p] = max(below[p], own[node] + below[node])
    return max(top, own[0] + below[0] if nodes else 0)


# ------------------------------------------------------------------------------------------------ group map

def group_map(order: np.ndarray, where: list, names: np.ndarray, members: np.ndarray, start: np.ndarray) -> dict:
    """Unit name -> device of its group, groups taken in ``order``: group ``k`` (device ``where[k]``) holds the units
    ``members[start[k]:start[k + 1]]`` (the last one's run ends with ``members``), named by ``names``."""
    found = group_map_vectorised if vectorised(len(order)) else group_map_reference
    return found(order, where, names, members, start)


def group_map_reference(order, where: list, names, members, start) -> dict:
    """:func:`group_map`, one group at a time."""
    members, start = _ints(members), _ints(start) + [len(members)]
    out = {}
    for k in _ints(order):
        for j in range(start[k], start[k + 1]):
            out[names[members[j]]] = where[k]
    return out


def group_map_vectorised(order: np.ndarray, where: list, names: np.ndarray, members: np.ndarray,
                         start: np.ndarray) -> dict:
    """:func:`group_map` with the members gathered in numpy."""
    count = np.diff(np.append(start, len(members)))[order]
    # the members of the groups one after another: each group's run of ``members``, in ``order``
    at = np.repeat(start[order] - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    devices = np.empty(len(where), dtype=object)
    devices[:] = where
    return dict(zip(names[members[at]].tolist(), np.repeat(devices[order], count).tolist()))


def _ints(values) -> list:
    """Values as a list of Python scalars."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _int64(column) -> np.ndarray:
    """An int64 column as a numpy array (a view of an ``array('q')``)."""
    if isinstance(column, np.ndarray):
        return column
    try:
        return np.frombuffer(column, dtype=np.int64)
    except (TypeError, ValueError):
        return np.array(column, dtype=np.int64)

