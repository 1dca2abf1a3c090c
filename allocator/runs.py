"""Device maps as *runs*: ranges of consecutive tensors, in graph order, that share one device.

Nodes are numbered in preorder and every node's direct tensors come right after those of the nodes before it, so
the subtree of a node owns one contiguous range of tensor indices. A device map (each key a module or a tensor,
the longest prefix winning) therefore cuts the tensors into at most ``2k + 1`` runs for ``k`` keys, and sums over a
run come from prefix sums over the tensors. :class:`Columns` holds those prefix sums, built once per graph;
evaluating a map (:mod:`allocator.validate`, :mod:`allocator.cost`) then costs O(k log k) plus the work proportional
to what is offloaded, instead of O(nodes + tensors) for every candidate map of every strategy.
"""

from __future__ import annotations

import weakref
from array import array
from bisect import bisect_right
from collections.abc import Mapping
from itertools import accumulate, repeat
from operator import itemgetter, ne
from typing import NamedTuple

import numpy as np

from .cost_profile import read_rates
from .gc_pause import gc_paused
from .graph import ModelGraph
from .rules import moves

__all__ = ["Run", "Columns", "Moving", "columns", "runs", "key_ranges", "side_by_side_runs", "pieces", "expand",
           "devices_in", "first_device", "as_array", "as_ints", "NUMPY_FROM", "FEMTO"]


class Run(NamedTuple):
    """Tensors ``start`` to ``end - 1`` (graph order) live on ``device`` (``None``: the map does not cover them).

    ``node`` is the module whose whole subtree the run is, when it comes from one map key with no key below it;
    else -1."""

    start: int
    end: int
    device: object
    node: int = -1


class Columns:
    """Per-graph columns and prefix sums over the tensors, for evaluating maps run by run.

    Prefix sums ``P`` have one more entry than the tensors: the sum over tensors ``a`` to ``b - 1`` is
    ``P[b] - P[a]``. Everything that depends on ``offload_buffers`` (which tensors move with their module) or on a
    cost profile is built on first use and kept.

    Per node: ``first`` (its first own tensor; one more entry, the tensor count), ``last`` (one past the last tensor
    of its subtree), ``parent``, ``end`` (as :class:`allocator.graph.Nodes`), ``parent_array`` (``parent`` as an int64
    numpy array) and ``levels`` (node indices by depth, deepest first). Per tensor: ``module``, ``nbytes``,
    ``counted``, ``numel`` and ``is_param`` (a numpy bool array), with the prefix sums ``sum_counted``,
    ``sum_weighted``, ``sum_numel``; ``sum_extra`` over nodes.
    """

    @gc_paused()
    def __init__(self, graph: ModelGraph):
        nodes, tensors = graph.nodes, graph.tensors   # columns (allocator.graph.Nodes, Tensors)
        n = len(nodes)
        # node i's own tensors are first[i] to first[i + 1] - 1: its builder reads each node's parameters, then
        # buffers, in preorder, so they start where those of the nodes before it end
        first = np.append(as_array(nodes.first), len(tensors))
        self.first = as_ints(first)
        self.parent = nodes.parent
        self.parent_array = as_array(nodes.parent)
        self.levels = _levels(self.parent_array)
        self.end = nodes.end   # the node after a node's subtree
        self.last = as_ints(first[as_array(nodes.end)])    # one past the last tensor of a subtree
        self.module = tensors.module
        self.nbytes = tensors.nbytes
        storage, nbytes = as_array(tensors.storage), as_array(tensors.nbytes)
        counted = np.where(storage == np.arange(len(storage)), nbytes, 0)   # 0 for a second name of shared memory
        self.counted = as_ints(counted)
        self.sum_counted = _prefix(counted)
        self.sum_weighted = _prefix(nbytes > 0)  # tensors with bytes
        # parameter elements, counted once: the compute term of the cost model
        is_param = np.array(tensors.is_param, dtype=bool)
        numel = np.where(is_param & (np.asarray(counted) != 0), as_array(tensors.numel), 0).astype(np.int64)
        self.numel = as_ints(numel)
        self.sum_numel = _prefix(numel)
        self.is_param = is_param
        extra = [0] * n
        for node, nbytes in (graph.extra or {}).items():
            extra[node] += nbytes
        self.sum_extra = _prefix(extra)   # over nodes: a subtree is nodes i to end[i] - 1
        self._graph = weakref.ref(graph)
        self._moving: dict = {}
        self._reads: dict = {}
        self.cache: dict = {}   # the arrays below, made when first asked for

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``first`` (without its last entry), ``last`` and ``parent`` as int64 numpy arrays, one entry per node."""
        found = self.cache.get("arrays")
        if found is None:
            found = self.cache["arrays"] = (as_array(self.first)[:-1], as_array(self.last), self.parent_array)
        return found

    def module_array(self) -> np.ndarray:
        """The ``module`` of each tensor as an int64 numpy array."""
        found = self.cache.get("module")
        if found is None:
            found = self.cache["module"] = as_array(self.module)
        return found

    def moving(self, offload_buffers: bool) -> Moving:
        """What moves with an offloaded module under ``offload_buffers``."""
        found = self._moving.get(offload_buffers)
        if found is None:
            found = self._moving[offload_buffers] = Moving(self, self._graph(), offload_buffers)
        return found

    def reads(self, profile) -> tuple[list[int], list[int]]:
        """Prefix sums of each tensor's read-or-compute time in femtoseconds (``allocator.cost.read_seconds``, from
        :func:`allocator.cost_profile.read_rates`), on the CPU and on an accelerator. Integers, so that a sum does
        not depend on how a map cuts it into runs."""
        found = self._reads.get(profile)
        if found is None:
            nbytes, numel = np.array(self.nbytes, dtype=np.float64), np.frombuffer(self.numel, dtype=np.int64) \
                .astype(np.float64)
            found = []
            for on in ("cpu", 0):
                per_byte, per_element = read_rates(profile, on)
                # read_seconds of each tensor, vectorised (the same float64 products, so the same values)
                femtos = np.rint(np.maximum(nbytes * per_byte, numel * per_element) * FEMTO)
                found.append(_prefix(femtos.astype(np.int64)))
            found = self._reads[profile] = tuple(found)
        return found


FEMTO = 1e15


def _levels(parents: np.ndarray) -> list:
    """Node indices by depth, deepest first (the root's level last): tree sums and maxima run a level at a time."""
    depth = np.zeros(len(parents), dtype=np.int64)
    if len(parents) > 1:
        while True:   # one pass per level of the tree: a node is one deeper than its parent
            deeper = depth.copy()
            deeper[1:] = depth[parents[1:]] + 1
            if np.array_equal(deeper, depth):
                break
            depth = deeper
    order = np.argsort(-depth, kind="stable")
    bounds = np.flatnonzero(np.diff(depth[order])) + 1
    return np.split(order, bounds)


def as_array(column) -> np.ndarray:
    """An integer column as a numpy array: a view of an int64 buffer (no copy), else converted; of Python ints
    (``dtype=object``) where a value does not fit in an int64 (a size_fn may say anything)."""
    if isinstance(column, array) and column.typecode == "q" or isinstance(column, memoryview) and column.format == "q":
        return np.frombuffer(column, dtype=np.int64)
    try:
        return np.array(column, dtype=np.int64)
    except OverflowError:
        return np.array(column, dtype=object)


def as_ints(values: np.ndarray):
    """Integers for indexing from Python: an int64 ``array`` (Python ints out, no object per entry kept), or a
    list where the values are not int64."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        return array("q", values.tobytes())
    return list(values)


def _prefix(values):
    """``[0, v0, v0 + v1, ...]`` (read as Python ints); summed by numpy unless an int64 could overflow."""
    if not len(values):
        return array("q", [0])
    if not isinstance(values, np.ndarray) or values.dtype == object:
        try:
            values = np.array(values, dtype=np.int64)
        except OverflowError:
            return [0, *accumulate(values)]
    if values.dtype == bool:
        values = values.astype(np.int64)
    if int(values.max()) > 2**62 // len(values):
        return [0, *accumulate(values.tolist())]
    out = np.empty(len(values) + 1, dtype=np.int64)
    out[0] = 0
    np.cumsum(values, out=out[1:])
    return as_ints(out)


class Moving:
    """Columns of the tensors that leave the main device with their offloaded module (``moves_with_weights``)."""

    @gc_paused()
    def __init__(self, cols: Columns, graph: ModelGraph, offload_buffers: bool):
        persistent = np.array(graph.tensors.persistent, dtype=bool)
        moving = moves(cols.is_param, persistent, offload_buffers)   # the rule, applied to whole columns
        nbytes = np.where(moving, as_array(cols.nbytes), 0)   # what each hook copies
        self.nbytes = as_ints(nbytes)
        self.sum_nbytes = _prefix(nbytes)
        self.sum_count = _prefix(moving)
        self.sum_counted = _prefix(np.where(moving, as_array(cols.counted), 0))
        # What each node's hook streams (its own tensors: first[i] to first[i + 1] - 1), and the streamed chain of
        # each subtree were all of it offloaded: its own plus the largest chain among its children, level by level.
        sums = np.array(self.sum_nbytes, dtype=object) if isinstance(self.sum_nbytes, list) else \
            np.frombuffer(self.sum_nbytes, dtype=np.int64)
        first = np.frombuffer(cols.first, dtype=np.int64)
        own = sums[first[1:]] - sums[first[:-1]]
        chain, below = own.copy(), np.zeros_like(own)
        for level in cols.levels:   # deepest first
            chain[level] += below[level]
            if level is not cols.levels[-1]:
                np.maximum.at(below, cols.parent_array[level], chain[level])
        self.own = as_ints(own)
        self.chain = as_ints(chain)
        self._chain, self._nbytes = chain, nbytes
        self._nodes = graph.nodes

    def chain_array(self) -> np.ndarray:
        """``chain`` as a numpy array (int64, or Python ints where a value passes int64)."""
        return self._chain

    def nbytes_array(self) -> np.ndarray:
        """``nbytes`` as a numpy array (int64, or Python ints where a value passes int64)."""
        return self._nbytes

    def next_in_chain(self, node: int) -> int:
        """The child that continues a subtree's largest chain (the first on a tie, as ``max`` over children), or -1."""
        children = self._nodes.children(node)
        return max(children, key=self.chain.__getitem__) if children else -1


def columns(graph: ModelGraph) -> Columns:
    """The :class:`Columns` of a graph, built once and kept with it (``graph.derived``)."""
    return graph.derived.once("columns", lambda: Columns(graph))


#: From this many entries (map keys here, groups in :mod:`allocator.strategies.first_fit`) work goes through numpy;
#: below, plain loops: numpy's fixed cost per call is larger than the whole loop over a few hundred entries.
NUMPY_FROM = 512


@gc_paused()
def runs(graph: ModelGraph, device_map: Mapping) -> list[Run]:
    """The runs of a device map, covering every tensor in order; neighbours on one device are merged; keys that
    name nothing are ignored.

    Notes
    -----
    O(k log k) for k keys: a key is a module's subtree or one tensor, and a key below another carves its range out
    of the enclosing one (the deepest key wins, as in :func:`allocator.runtime.device_of`). From
    :data:`NUMPY_FROM` keys on, the keys are looked up once each and the rest runs in numpy.
    """
    cols = columns(graph)
    tensor_order = len(graph.nodes)  # a tensor key is deeper than any module key with the same range
    if len(device_map) < NUMPY_FROM:
        return _carve(_spans(graph, cols, device_map, tensor_order), len(cols.module), tensor_order)
    keys = list(device_map)
    devices = list(device_map.values())
    order = np.fromiter(map(graph.node_index.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
    is_node = order >= 0
    if not is_node.all():
        tensor_index = graph.tensor_index
        for k in np.flatnonzero(~is_node).tolist():
            t = tensor_index.get(keys[k])
            if t is not None:
                order[k] = tensor_order + t
    lo, hi = key_ranges(cols, order, tensor_order)
    keep = np.flatnonzero((order >= 0) & (lo < hi))   # a module with no tensors covers nothing
    # by start, the longer first, then the shallower (an ancestor's index is lower): enclosing keys come first
    ranked = keep
    if len(keep) > 1 and not (lo[keep[1:]] > lo[keep[:-1]]).all():   # keys in model order need no sort
        ranked = keep[np.lexsort((order[keep], -hi[keep], lo[keep]))]
    lo, hi, order = lo[ranked], hi[ranked], order[ranked]
    if len(ranked) != len(devices) or ranked is not keep:
        devices = list(itemgetter(*ranked.tolist())(devices)) if len(ranked) > 1 else [devices[k] for k in ranked]
    if len(ranked) < 2 or (lo[1:] >= hi[:-1]).all():  # no key below another: the usual map
        return side_by_side_runs(lo, hi, order, devices, len(cols.module), tensor_order)
    return _carve(list(zip(lo.tolist(), (-hi).tolist(), order.tolist(), devices)), len(cols.module), tensor_order)


def key_ranges(cols: Columns, order: np.ndarray, tensor_order: int) -> tuple[np.ndarray, np.ndarray]:
    """The tensors ``[lo, hi)`` that keys cover, given by their order (a node index, or ``tensor_order`` plus a tensor
    index; -1 for a key that names nothing, whose range is meaningless)."""
    first, last, _ = cols.arrays()
    is_tensor = order >= tensor_order
    at = np.where(is_tensor | (order < 0), 0, order)
    return np.where(is_tensor, order - tensor_order, first[at]), np.where(is_tensor, order - tensor_order + 1, last[at])


def _spans(graph: ModelGraph, cols: Columns, device_map: Mapping, tensor_order: int) -> list[tuple]:
    """``(start, -end, order, device)`` of every key that covers tensors, enclosing keys first (by start, the longer
    first, then the shallower: an ancestor's index is lower; ``order`` is unique, so devices are never compared)."""
    first, last = cols.first, cols.last
    node_index, tensor_index = graph.node_index, graph.tensor_index
    spans = []
    for key, device in device_map.items():
        i = node_index.get(key)
        if i is not None:
            if first[i] < last[i]:
                spans.append((first[i], -last[i], i, device))
        else:
            t = tensor_index.get(key)
            if t is not None:
                spans.append((t, -t - 1, tensor_order + t, device))
    spans.sort()
    return spans


def _carve(spans: list[tuple], tensors: int, tensor_order: int) -> list[Run]:
    """:func:`runs` of sorted spans (:func:`_spans`): a key below another carves its range out of the enclosing one."""
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


def side_by_side_runs(lo: np.ndarray, hi: np.ndarray, order: np.ndarray, devices: list, tensors: int,
                      tensor_order: int) -> list[Run]:
    """:func:`runs` of sorted key ranges none of which encloses another: a run starts at a gap or where the device
    changes (its type too: ``True == 1``, but ``True`` is no device); a run of one key is that key's subtree."""
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


def pieces(cols: Columns, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The tensors ``start`` to ``end - 1`` as the largest whole subtrees they hold and the tensors left over:
    ``(nodes, tensors)``, each in model order. A tensor is left over when its module's subtree is not wholly inside.

    Notes
    -----
    O(nodes whose tensors start in the range) numpy work: nodes are in preorder, so those are one slice of them; a
    whole subtree is one whose parent is not whole.
    """
    first, last, parent = cols.arrays()
    lo, hi = np.searchsorted(first, [start, end])
    nodes = np.arange(lo, hi)
    whole = (last[lo:hi] <= end) & (first[lo:hi] < last[lo:hi])
    up = parent[lo:hi]
    inner = (up >= lo) & (up < hi)
    up_whole = np.zeros(hi - lo, dtype=bool)
    up_whole[inner] = whole[up[inner] - lo]
    tensors = np.arange(start, end)
    module = cols.module_array()[start:end]
    in_whole = (module >= lo) & (module < hi)
    in_whole[in_whole] = whole[module[in_whole] - lo]
    return nodes[whole & ~up_whole], tensors[~in_whole]


def expand(found: list[Run]) -> list:
    """One device per tensor, in graph order, from runs."""
    out: list = []
    for run in found:
        out += [run.device] * (run.end - run.start)
    return out


def devices_in(found: list[Run], start: int, end: int, limit: int | None = None) -> set:
    """The devices of the tensors ``start`` to ``end - 1`` (``None`` left out); at most ``limit`` of them."""
    k = max(bisect_right(found, start, key=_run_start) - 1, 0)
    out: set = set()
    while k < len(found) and found[k].start < end and (limit is None or len(out) < limit):
        if found[k].device is not None and found[k].end > start:
            out.add(found[k].device)
        k += 1
    return out


def first_device(found: list[Run], start: int, end: int):
    """The device of the first covered tensor among ``start`` to ``end - 1``, or ``None``."""
    k = max(bisect_right(found, start, key=_run_start) - 1, 0)
    while k < len(found) and found[k].start < end:
        if found[k].device is not None and found[k].end > start:
            return found[k].device
        k += 1
    return None


def _run_start(run: Run) -> int:
    return run.start
