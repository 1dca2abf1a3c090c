"""Device maps as *runs*: ranges of consecutive tensors, in graph order, that share one device.

Nodes are numbered in preorder and every node's direct tensors come right after those of the nodes before it, so
the subtree of a node owns one contiguous range of tensor indices. A device map (each key a module or a tensor,
the longest prefix winning) therefore cuts the tensors into at most ``2k + 1`` runs for ``k`` keys, and sums over a
run come from prefix sums over the tensors. :class:`Columns` holds those prefix sums, built once per graph;
evaluating a map (:mod:`allocator.evaluate.validate`, :mod:`allocator.evaluate.cost`) then costs O(k log k) plus the
work proportional to what is offloaded, instead of O(nodes + tensors) for every candidate map of every strategy.
"""

from __future__ import annotations

import weakref
from array import array
from bisect import bisect_right
from collections.abc import Mapping
from itertools import accumulate, repeat

import numpy as np

from ..memo import Key
from ..profile import read_seconds
from ..model import ModelGraph
from .kernels import Run, key_runs
from ..rules.dispatch import moves, read_copy

__all__ = ["Run", "Columns", "Moving", "columns", "runs", "key_orders", "pieces", "expand", "devices_in",
           "first_device", "as_array", "as_ints", "FEMTO"]

COLUMNS = Key("columns")


class Columns:
    """Per-graph columns and prefix sums over the tensors, for evaluating maps run by run.

    Prefix sums ``P`` have one more entry than the tensors: the sum over tensors ``a`` to ``b - 1`` is
    ``P[b] - P[a]``. Everything that depends on ``offload_buffers`` (which tensors move with their module) or on a
    cost profile is built on first use and kept.

    Per node: ``first`` (its first own tensor; one more entry, the tensor count), ``last`` (one past the last tensor
    of its subtree), ``parent``, ``end`` (as :class:`allocator.model.Nodes`), ``parent_array`` (``parent`` as an int64
    numpy array) and ``levels`` (node indices by depth, deepest first). Per tensor: ``module``, ``nbytes``,
    ``counted``, ``numel``, ``is_param`` and ``persistent`` (numpy bool arrays), with the prefix sums ``sum_counted``,
    ``sum_weighted``, ``sum_numel``; ``sum_extra`` over nodes.
    """

    def __init__(self, graph: ModelGraph):
        nodes, tensors = graph.nodes, graph.tensors   # columns (allocator.model.Nodes, Tensors)
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
        self.persistent = np.array(tensors.persistent, dtype=bool)
        extra = [0] * n
        for node, nbytes in (graph.extra or {}).items():
            extra[node] += nbytes
        self.sum_extra = _prefix(extra)   # over nodes: a subtree is nodes i to end[i] - 1
        self._graph = weakref.ref(graph)
        self._moving: dict = {}
        self._reads: dict = {}
        self._seconds: dict = {}
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

    def moving(self, offload_buffers: bool, read_copies: bool = False) -> Moving:
        """What moves with an offloaded module under ``offload_buffers``; with ``read_copies``, what its hook holds
        counts the copy it reads a cast tensor into (:func:`allocator.rules.dispatch.read_copy`)."""
        key = offload_buffers, read_copies and bool(self._graph().stored)
        found = self._moving.get(key)
        if found is None:
            found = self._moving[key] = Moving(self, self._graph(), *key)
        return found

    def read_seconds(self, profile, flops=None, counted=None) -> tuple[np.ndarray, np.ndarray]:
        """Each tensor's read-or-compute seconds (:func:`allocator.profile.read_seconds`, elementwise over the
        columns) on the CPU and on an accelerator, as float64 arrays: the one per-tensor term that :meth:`reads`
        sums for the estimate and ``allocator.evaluate.cost.device_seconds`` adds to for the CP-SAT objective.

        ``flops`` (FLOPs per tensor, float64, :func:`allocator.evaluate.units.tensor_flops`) replaces the parameter
        rule's compute term, and ``counted`` (per tensor, spread the same way, one array per kind of
        :data:`allocator.profile.COUNTED`) adds that work at :func:`allocator.profile.counted_rates`; those
        arrays are not kept here (the problem keeps them), the others once per profile."""
        if flops is None:
            found = self._seconds.get(profile)
            if found is None:
                found = self._seconds[profile] = self._seconds_of(profile, None, ())
            return found
        return self._seconds_of(profile, np.asarray(flops, dtype=np.float64),
                                [np.asarray(v, dtype=np.float64) for v in counted or ()])

    def _seconds_of(self, profile, flops, counted) -> tuple:
        nbytes = np.array(self.nbytes, dtype=np.float64)
        numel = np.frombuffer(self.numel, dtype=np.int64).astype(np.float64)
        return tuple(read_seconds(profile, on, nbytes, numel, flops, counted) for on in ("cpu", 0))

    def reads(self, profile, flops=None, counted=None) -> tuple[list[int], list[int]]:
        """Prefix sums of :meth:`read_seconds` in femtoseconds, on the CPU and on an accelerator. Integers, so that
        a sum does not depend on how a map cuts it into runs; Python ints where a time passes an int64 (9,223 s)."""
        if flops is not None:
            return tuple(_femtos(seconds) for seconds in self.read_seconds(profile, flops, counted))
        found = self._reads.get(profile)
        if found is None:
            found = self._reads[profile] = tuple(_femtos(seconds) for seconds in self.read_seconds(profile))
        return found


def _femtos(seconds: np.ndarray):
    """The prefix sums of ``seconds`` (float64, one per tensor), each rounded to femtoseconds first."""
    femtos = np.rint(seconds * FEMTO)
    wide = len(femtos) and femtos.max() >= 2.0**62   # astype would wrap: exact Python ints instead
    return _prefix([int(f) for f in femtos] if wide else femtos.astype(np.int64))


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
    """Columns of the tensors that leave the main device with their offloaded module (``moves_with_weights``).

    ``nbytes`` is what each hook copies (the cost model's streamed bytes); ``held`` what it holds at its peak:
    ``nbytes``, plus with ``read_copies`` the copy of a cast tensor as stored
    (:func:`allocator.rules.dispatch.read_copy`).
    ``own`` and ``chain`` (the streaming reserve) are sums of ``held``."""

    def __init__(self, cols: Columns, graph: ModelGraph, offload_buffers: bool, read_copies: bool = False):
        moving = moves(cols.is_param, cols.persistent, offload_buffers)   # the rule, applied to whole columns
        nbytes = np.where(moving, as_array(cols.nbytes), 0)   # what each hook copies
        self.nbytes = as_ints(nbytes)
        self.sum_nbytes = _prefix(nbytes)
        self.sum_count = _prefix(moving)
        self.sum_counted = _prefix(np.where(moving, as_array(cols.counted), 0))
        held = nbytes
        if read_copies and graph.stored:
            held = nbytes.copy() if nbytes.dtype != object else nbytes.astype(object)
            for tensor, stored in graph.stored.items():
                if moving[tensor]:
                    held[tensor] += read_copy(stored, int(nbytes[tensor]))
        self.held = as_ints(held)
        self._held = held
        # What each node's hook holds (its own tensors: first[i] to first[i + 1] - 1), and the streamed chain of
        # each subtree were all of it offloaded: its own plus the largest chain among its children, level by level.
        sum_held = self.sum_nbytes if held is nbytes else _prefix(held)
        sums = np.array(sum_held, dtype=object) if isinstance(sum_held, list) else \
            np.frombuffer(sum_held, dtype=np.int64)
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

    def held_array(self) -> np.ndarray:
        """``held`` as a numpy array (int64, or Python ints where a value passes int64)."""
        return self._held

    def next_in_chain(self, node: int) -> int:
        """The child that continues a subtree's largest chain (the first on a tie, as ``max`` over children), or -1."""
        children = self._nodes.children(node)
        return max(children, key=self.chain.__getitem__) if children else -1


def columns(graph: ModelGraph) -> Columns:
    """The :class:`Columns` of a graph, built once and kept with it (``graph.derived``)."""
    return graph.derived.once(COLUMNS, lambda: Columns(graph))


def runs(graph: ModelGraph, device_map: Mapping) -> list[Run]:
    """The runs of a device map, covering every tensor in order; neighbours on one device are merged; keys that
    name nothing are ignored.

    Notes
    -----
    O(k log k) for k keys: a key is a module's subtree or one tensor, and a key below another carves its range out
    of the enclosing one (the deepest key wins, as in :func:`allocator.evaluate.memory.device_of`); the carving is
    :func:`allocator.evaluate.kernels.key_runs`.
    """
    cols = columns(graph)
    tensor_order = len(graph.nodes)  # a tensor key is deeper than any module key with the same range
    return key_runs(key_orders(graph, device_map), list(device_map.values()), cols.first, cols.last, len(cols.module),
                    tensor_order)


def key_orders(graph: ModelGraph, keys) -> list[int]:
    """Each key's order as :func:`allocator.evaluate.kernels.key_ranges` reads it: its node index, or the node count
    plus its
    tensor index; -1 for a key that names nothing."""
    order = list(map(graph.node_index.get, keys, repeat(-1)))
    if -1 in order:
        tensor_index, tensor_order = graph.tensor_index, len(graph.nodes)
        for k, key in enumerate(keys):
            if order[k] == -1:
                t = tensor_index.get(key)
                if t is not None:
                    order[k] = tensor_order + t
    return order


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
