"""accelerate's view of a model, for :mod:`allocator.search.accelerate`: the entries it walks (top-level
modules, split into parameters and children as it splits them), their sizes by accelerate's accounting, and the
largest remaining no-split layer it reserves room for, memoised per node.

Notes
-----
The largest layer below a node is computed once per node (O(nodes)); :meth:`EntryTree.in_a_row` takes a stretch of
entries that fit one after another at once (:func:`allocator.evaluate.kernels.in_a_row`).
"""

from __future__ import annotations

import bisect
from operator import itemgetter

import numpy as np

from ..evaluate.kernels import in_a_row, vectorised
from ..evaluate.runs import as_array
from ..problem import Problem

__all__ = ["EntryQueue", "EntryTree", "LargestNames", "fold_largest"]


class EntryTree:
    """Name-level view of the graph with accelerate's size accounting and memoised largest layers."""

    def __init__(self, problem: Problem):
        g = problem.graph
        self.g = g
        self.no_split_classes = g.no_split_declared  # accelerate sees only what is declared, never inferred blocks
        self._layer: dict[int, tuple[float, list[int]]] = {}
        self._first, self._end, self._module = g.nodes.first, g.nodes.end, g.tensors.module
        self._cache = None

    def entry_size(self, entry) -> float:
        """:meth:`size` of an entry, from its index (the same value, without looking its name up)."""
        idx = entry[1]
        if idx >= 0:
            return self.g.size_accelerate[idx]
        t = ~idx
        tensors = self.g.tensors
        return tensors.nbytes_accelerate[t] if tensors.canonical[t] == t else 0

    def span(self, entry) -> tuple[int, int]:
        """Where an entry and everything under it (the names ``name`` and ``name.``...) sit in one order of every
        module and tensor: preorder, each module followed by its own tensors, then its children. Node ``i`` sits at
        ``i + first[i]`` (the nodes and tensors before it); tensor ``t`` of module ``m`` at ``m + 1 + t``."""
        idx = entry[1]
        if idx >= 0:
            end = self._end[idx]   # the subtree's tensors end where the next node's start (or at the last tensor)
            return idx + self._first[idx], end + (self._first[end] if end < len(self._end) else len(self._module))
        t = ~idx
        at = self._module[t] + 1 + t
        return at, at + 1

    def size(self, name: str) -> float:
        """accelerate's ``module_sizes[name]`` (0 for a name it does not know): a tensor's bytes unless it shares an
        earlier tensor's storage, else the module's subtree; looked up, never tabulated (O(1) per name)."""
        i = self.g.node_index.get(name)  # a module and a tensor never share a name (torch refuses the attribute)
        if i is not None:
            return self.g.size_accelerate[i]
        k = self.g.tensor_index.get(name)
        if k is not None:
            tensors = self.g.tensors
            return tensors.nbytes_accelerate[k] if tensors.canonical[k] == k else 0
        return 0

    def children(self, entry) -> list:
        """``named_children`` of a module entry (tensors have none)."""
        _, idx = entry
        names = self.g.nodes.name
        return [] if idx < 0 else [(names[c], c) for c in self.g.nodes.children(idx)]

    def split(self, entry) -> list:
        """What accelerate puts in place of a split module: direct parameters, then children."""
        name, idx = entry
        nodes, names = self.g.nodes, self.g.tensors.name
        params = [(names[t], ~t) for t in range(nodes.first[idx], nodes.first[idx] + nodes.n_params[idx])]
        return params + self.children(entry)

    def no_split(self, entry) -> bool:
        _, idx = entry
        return idx >= 0 and self.g.nodes.cls[idx] in self.no_split_classes

    def layer(self, entry) -> tuple[float, list[int]]:
        """Largest no-split layer under an entry and all entries that reach it (``get_max_layer_size``), these by
        their place in :meth:`span`'s order."""
        idx = entry[1]
        nodes = self.g.nodes
        if idx < 0 or nodes.end[idx] == idx + 1 or nodes.cls[idx] in self.no_split_classes:
            return self.entry_size(entry), [self.span(entry)[0]]
        if idx not in self._layer:
            self._layer[idx] = self.fold(self.children(entry))
        return self._layer[idx]

    def max_layer(self, entries) -> tuple[float, LargestNames]:
        size, found = self.fold(entries)
        return size, LargestNames(found)

    def fold(self, entries: list) -> tuple[float, list[int]]:
        """``fold_largest`` of :meth:`layer` over ``entries``; with many, the entries that are a layer of their own
        (tensors, leaves, no-split modules) are read from numpy columns instead of one call each."""
        found = self._columns(entries) if entries and vectorised(len(entries)) else None
        if found is None:   # few entries, or sizes a float64 may not hold exactly
            return fold_largest(self.layer(e) for e in entries)
        idx, sizes, places, _ = found
        whole = (idx < 0) | self._arrays()[1][np.maximum(idx, 0)]
        below: dict[int, list[int]] = {}
        for k in np.flatnonzero(~whole).tolist():   # split modules: their own (memoised) fold
            sizes[k], below[k] = self.layer(entries[k])
        best = sizes.max()
        if best <= 0:   # fold_largest keeps its initial 0 and gathers every entry
            best, at = 0, np.arange(len(entries))
        else:
            at = np.flatnonzero(sizes == best)
            first_best = entries[int(at[0])]
            best = self.layer(first_best)[0] if int(at[0]) in below else self.entry_size(first_best)
        if not below:
            return best, places[at].tolist()
        found: list[int] = []
        for k in at.tolist():
            if k in below:
                found += below[k]
            else:
                found.append(int(places[k]))
        return best, found

    def in_a_row(self, batch: list, names: LargestNames, room) -> tuple[int, int]:
        """How many of ``batch`` (the next queued entries) accelerate's loop would place one after another on the
        current device with ``room`` bytes left under its limit (``None``: no limit) and no tie groups, and their
        total size: it stops before the first that does not fit and before the one whose removal empties ``names``
        (the largest layer is then recomputed); :func:`allocator.evaluate.kernels.in_a_row`. ``(0, 0)`` where sizes are
        not
        integers held exactly.
        """
        found = self._columns(batch)
        if found is None:
            return 0, 0
        _, sizes, low, high = found
        count = in_a_row(sizes, low, high, names.array(), len(names), room)
        if not count:
            return 0, 0
        sizes = sizes[:count].astype(np.int64)
        # drop the places of the taken entries, one call per stretch of adjacent spans
        cut = np.flatnonzero(low[1:count] != high[:count - 1]) + 1
        for a, b in zip(np.append(0, cut).tolist(), np.append(cut, count).tolist()):
            names.discard(int(low[a]), int(high[b - 1]))
        return count, int(sizes.sum())

    def _columns(self, entries: list):
        """``(index, size, low, high)`` of every entry as numpy arrays: :meth:`entry_size` (float64) and
        :meth:`span`, vectorised; ``None`` where :meth:`_arrays` is."""
        arrays = self._arrays()
        if arrays is None:
            return None
        size_of, _, first, module, tensor_size = arrays
        idx = np.fromiter(map(itemgetter(1), entries), dtype=np.int64, count=len(entries))
        node = idx >= 0
        at, t = np.where(node, idx, 0), np.where(node, 0, ~idx)
        sizes = np.where(node, size_of[at], tensor_size[t] if len(tensor_size) else 0.0)
        # node i and its subtree's tensors, or one tensor
        end = as_array(self._end)[at]
        past = np.append(first, len(module))
        low = np.where(node, idx + first[at], module[t] + 1 + t if len(module) else 0)
        return idx, sizes, low, np.where(node, end + past[end], low + 1)

    def _arrays(self):
        """Columns for :meth:`fold` (sizes as float64, exact below 2**53), made once; ``None`` if a size is not."""
        if self._cache is None:
            g = self.g
            size_of = np.array(g.size_accelerate, dtype=np.float64)
            tensors = g.tensors
            canonical = as_array(tensors.canonical)
            tensor_size = np.where(canonical == np.arange(len(canonical)),
                                   np.array(tensors.nbytes_accelerate, dtype=np.float64), 0.0)
            n = len(g.nodes)
            end = as_array(self._end)
            whole_node = (end == np.arange(1, n + 1)) | np.fromiter(map(self.no_split_classes.__contains__,
                                                                        g.nodes.cls), dtype=bool, count=n)
            exact = (size_of.max(initial=0) < 2**53) and (tensor_size.max(initial=0) < 2**53)
            self._cache = (size_of, whole_node, as_array(self._first), as_array(self._module), tensor_size) \
                if exact else False
        return self._cache or None


class EntryQueue:
    """accelerate's list of entries to treat, stored reversed so that taking the next one is O(1)."""

    def __init__(self, entries):
        self._rev = list(reversed(entries))

    def __bool__(self) -> bool:
        return bool(self._rev)

    def __contains__(self, entry) -> bool:
        return entry in self._rev

    def pop(self):
        return self._rev.pop()

    def push(self, front: list) -> None:
        """Put ``front`` before every entry, in its order."""
        self._rev.extend(reversed(front))

    def remove(self, entry) -> None:
        self._rev.remove(entry)

    def __len__(self) -> int:
        return len(self._rev)

    def peek(self, count: int) -> list:
        """The next ``count`` entries (fewer when the queue is shorter), in order."""
        return self._rev[:-count - 1:-1]

    def drop(self, count: int) -> None:
        """Take the next ``count`` entries off."""
        del self._rev[len(self._rev) - count:]

    def replace(self, entry, by: list) -> None:
        j = self._rev.index(entry)
        self._rev[j:j + 1] = list(reversed(by))

    def in_order(self) -> list:
        return list(reversed(self._rev))

    def modules(self) -> list:
        return [e for e in self._rev if e[1] >= 0]


class LargestNames:
    """The entries realising the largest layer (by place in :meth:`EntryTree.span`'s order); only emptiness and removal
    of what sits under a taken entry matter.

    Sorted places and a live flag for each: removing an entry's places is two bisects and one slice of the flags,
    counted and cleared at C speed (deleting from the middle of a list of n places would cost O(n) each time:
    quadratic on a flat stack).
    """

    def __init__(self, places):
        self._sorted = sorted(places)
        self._alive = bytearray(b"\x01") * len(self._sorted)
        self._live = len(self._sorted)
        self._array = None

    def __bool__(self) -> bool:
        return self._live > 0

    def __len__(self) -> int:
        return self._live

    def array(self) -> np.ndarray:
        """The places, sorted, as an int64 array (made once)."""
        if self._array is None:
            self._array = np.array(self._sorted, dtype=np.int64)
        return self._array

    def discard(self, low: int, high: int) -> None:
        """Drop the places ``low`` to ``high - 1`` (an entry and what is under it, or a stretch of adjacent entries):
        O(log n) plus a C-speed pass over the places in the range."""
        places = self._sorted
        i = bisect.bisect_left(places, low)
        j = bisect.bisect_left(places, high, i)
        if i < j:
            self._live -= self._alive.count(1, i, j)
            self._alive[i:j] = bytes(j - i)


def fold_largest(results) -> tuple[float, list]:
    best, names = 0, []
    for size, found in results:
        if size > best:
            best, names = size, list(found)
        elif size == best:
            names.extend(found)
    return best, names
