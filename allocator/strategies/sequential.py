"""``sequential``: accelerate 1.15's ``infer_auto_device_map``, reproduced output for output.

The baseline every other strategy is measured against, and the safe switch. It walks the model's top-level
entries in order with one device pointer that only moves forward; a module that does not fit is split into
its direct parameters and children unless it is a leaf or a no-split class; on the *main devices* (the first
accelerator and ``cpu``, or ``mps``, or ``cpu`` alone) it reserves room for the largest remaining no-split
layer. Tied modules are placed with the module that ties them. Its quirks are kept on purpose (tie groups
are matched by substring, direct buffers of a split module are not mapped, budgets of ``disk`` are ignored),
because this strategy's job is to say exactly what accelerate would do.

Notes
-----
Complexity: O(n · r) for n entries and r recomputations of the largest layer (as accelerate), with the
per-node largest layer memoised. Without tie groups, entries that fit one after another are taken a stretch at a
time (:func:`allocator.evaluate.kernels.in_a_row`: the same decisions, without a Python step per entry).

Deterministic for a given model in a given process; accelerate's tie-group order comes from a set of names, so with
several tie groups it can depend on ``PYTHONHASHSEED`` — this strategy follows it (the builder records the groups in
accelerate's order).
"""

from __future__ import annotations

import bisect
import logging
from operator import itemgetter

import numpy as np

from ..errors import UnsupportedByAccelerate
from ..evaluate.kernels import Stretches, in_a_row, vectorised
from ..placement import Placement, clean_device_map
from ..problem import Problem
from ..rules.versions import accelerate_at_least
from ..evaluate.runs import as_array, columns
from ..evaluate.validate import format_bytes

__all__ = ["place"]

log = logging.getLogger(__name__)


class _Tree:
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

    def max_layer(self, entries) -> tuple[float, _Names]:
        size, found = self.fold(entries)
        return size, _Names(found)

    def fold(self, entries: list) -> tuple[float, list[int]]:
        """``_fold`` of :meth:`layer` over ``entries``; with many, the entries that are a layer of their own
        (tensors, leaves, no-split modules) are read from numpy columns instead of one call each."""
        found = self._columns(entries) if entries and vectorised(len(entries)) else None
        if found is None:   # few entries, or sizes a float64 may not hold exactly
            return _fold(self.layer(e) for e in entries)
        idx, sizes, places, _ = found
        whole = (idx < 0) | self._arrays()[1][np.maximum(idx, 0)]
        below: dict[int, list[int]] = {}
        for k in np.flatnonzero(~whole).tolist():   # split modules: their own (memoised) fold
            sizes[k], below[k] = self.layer(entries[k])
        best = sizes.max()
        if best <= 0:   # _fold keeps its initial 0 and gathers every entry
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

    def in_a_row(self, batch: list, names: _Names, room) -> tuple[int, int]:
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


class _Queue:
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


class _Names:
    """The entries realising the largest layer (by place in :meth:`_Tree.span`'s order); only emptiness and removal
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


def _fold(results) -> tuple[float, list]:
    best, names = 0, []
    for size, found in results:
        if size > best:
            best, names = size, list(found)
        elif size == best:
            names.extend(found)
    return best, names


def _tie_partners(name: str, tied_groups) -> list[str]:
    """Parameters tied to something inside ``name`` but outside it, matched by substring as accelerate does."""
    key = name + "."
    groups = [g for g in tied_groups if any(key in k + "." for k in g) and not all(key in k + "." for k in g)]
    return [p for g in groups for p in g if key not in p + "."]


def _with_ties(tree: _Tree, partners, module_size, entries):
    """``get_module_size_with_ties``: the size with the modules holding tied partners, and those entries."""
    if not partners:
        return module_size, []
    # accelerate 1.16 also matches a partner that is an entry itself (a parameter placed on its own); 1.15 raises.
    exact = accelerate_at_least((1, 16))
    found = []
    for p in partners:
        match = next((e for e in entries if (exact and p == e[0]) or p.startswith(e[0] + ".")), None)
        if match is None:
            raise UnsupportedByAccelerate(
                f"accelerate's infer_auto_device_map fails here (IndexError): the tied parameter {p!r} is not under "
                "any entry still to place. Use another strategy, or pass tied_parameters explicitly."
            )
        found.append(match)
    total = module_size
    for p, (n, _) in zip(partners, found):
        total += tree.size(n) - tree.size(p)
    return total, found


def _fallback(tree: _Tree, entries, limit, tied_groups):
    """accelerate's ``fallback_allocate``: first entry (depth first) that fits ``limit``, taken out of ``entries``."""
    if not isinstance(limit, int):
        raise UnsupportedByAccelerate(
            "accelerate's fallback_allocate fails on a fractional size limit (models with bool tensors); "
            "disable fallback_allocation or use another strategy."
        )
    if limit < 0:
        return None, entries
    search = list(entries)
    found = None
    while search:
        entry = search.pop(0)
        size, _ = _with_ties(tree, _tie_partners(entry[0], tied_groups), tree.size(entry[0]), search)
        if size <= limit:
            found = entry
            break
        if not tree.children(entry) or tree.no_split(entry):
            continue
        search = tree.split(entry) + search
    if found is None:
        return None, entries
    name = found[0]
    entries = list(entries)
    names = [n for n, _ in entries]
    for dot in [i for i, c in enumerate(name) if c == "."]:
        parent = name[:dot]
        if parent in names:
            k = names.index(parent)
            entries = entries[:k] + tree.split(entries[k]) + entries[k + 1:]
            names = [n for n, _ in entries]
    if name not in names:
        raise UnsupportedByAccelerate(f"accelerate's fallback_allocate fails here (ValueError on {name!r}).")
    return entries.pop(names.index(name)), entries


def place(problem: Problem) -> Placement:
    """Place like accelerate's ``infer_auto_device_map``.

    Parameters
    ----------
    problem : Problem

    Returns
    -------
    Placement
        ``device_map`` is exactly accelerate's (cleaned when ``problem.options.clean_result``).

    Raises
    ------
    UnsupportedByAccelerate
        Where accelerate itself raises on this input.
    """
    g, budgets, opts = problem.graph, problem.budgets, problem.options
    tree = _Tree(problem)
    devices = list(budgets.order)
    limits = budgets.limits
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main_devices = ["mps"] if "mps" in gpus else ([gpus[0], "cpu"] if gpus else ["cpu"])
    tied_groups = [list(group) for group in g.tied_groups]

    nodes, tensor_names = g.nodes, g.tensors.name
    params = range(nodes.first[0], nodes.first[0] + nodes.n_params[0])   # the root's (no record: 200k children)
    buffers = range(params.stop, params.stop + nodes.n_buffers[0])
    entries = [(tensor_names[t], ~t) for t in params]
    entries += tree.children(("", 0))
    entries += [(tensor_names[t], ~t) for t in buffers]

    device_map: dict = {}
    current = 0
    used = {d: 0 for d in devices}
    minimum: dict = {}
    notes: list[str] = []
    max_layer, max_names = tree.max_layer(entries)
    entries = _Queue(entries)

    # Without tie groups, entries that fit one after another are taken a stretch at a time (the same steps, at C
    # speed); a stretch that stays short hands over to single steps for a while, as in backfill's first fit.
    pace = Stretches(len(entries), enabled=not tied_groups)
    while entries:
        if not pace.steps(1) and len(entries) > 1 and current < len(devices):
            device = devices[current]
            room = None if device == "disk" else \
                limits[device] - (max_layer if device in main_devices else 0) - used[device]
            if room is None or isinstance(room, int):
                batch = entries.peek(pace.window)
                count, total = tree.in_a_row(batch, max_names, room)
                if count:
                    entries.drop(count)
                    used[device] += total
                    names = [e[0] for e in batch[:count]]
                    device_map.update(dict.fromkeys(names, device))
                    notes += [f"{name} -> {device}" for name in names]
                pace.stretched(count, len(batch))
                continue
        pace.stepped()
        entry = entries.pop()
        name = entry[0]
        max_names.discard(*tree.span(entry))
        if not max_names:
            max_layer, max_names = tree.max_layer(entries.modules())
        module_size = tree.entry_size(entry)
        partners = _tie_partners(name, tied_groups) if tied_groups else ()

        device = devices[current]
        limit = limits[device] if device != "disk" else None
        reserved = 0
        if device in main_devices:
            limit = limit - max_layer
            reserved = max_layer
        size_with_ties, tied_entries = _with_ties(tree, partners, module_size, entries.in_order()) if partners \
            else (module_size, ())

        if limit is None or used[device] + size_with_ties <= limit:
            used[device] += size_with_ties
            device_map[name] = device
            for tied in tied_entries:
                if tied in entries:
                    entries.remove(tied)
                device_map[tied[0]] = device
            notes.append(f"{name} -> {device}" + (f" with {[e[0] for e in tied_entries]}" if tied_entries else ""))
            continue

        if partners and used[device] + module_size <= limit:
            split = False
            for tied in tied_entries:
                if tied[1] < 0:   # a parameter entry (accelerate >= 1.16 matches those): it has no named_children
                    raise UnsupportedByAccelerate(
                        f"accelerate's infer_auto_device_map fails here (AttributeError): the tied parameter "
                        f"{tied[0]!r} is an entry of its own and cannot be split to make room for {name!r}. Use "
                        "another strategy, or pass tied_parameters explicitly.")
                if not tree.children(tied) or tree.no_split(tied):
                    continue
                entries.replace(tied, tree.split(tied))
                entries.push([entry])
                max_layer, max_names = tree.max_layer(entries.modules())
                split = True
                break
            if split:
                continue

        if used[device] + module_size >= limit:
            if tree.children(entry) and not tree.no_split(entry):
                entries.push(tree.split(entry))
                max_layer, max_names = tree.max_layer(entries.modules())
                continue

        if used[device] == 0 and opts.fallback_allocation and device != "disk":
            fallback_limit = limits[device] - max(max_layer, size_with_ties)
            found, rest = _fallback(tree, entries.in_order(), fallback_limit - used[device], tied_groups)
            if found is not None:
                entries = _Queue([found, entry] + rest)
                continue

        if used[device] == 0:
            minimum[device] = size_with_ties + reserved
        used[device] += reserved
        notes.append(f"{device} full at {name} ({format_bytes(reserved)} kept free for the largest layer, as "
                     "accelerate does); next device")
        current += 1
        entries.push([entry])

    diagnostics = []
    warning = _buffer_warning(problem, device_map, used)
    if warning:
        diagnostics.append(("warning", warning))
    if minimum:
        diagnostics.append(("info", insufficient_memory(minimum)))
    if opts.clean_result:
        device_map = clean_device_map(device_map)
    return Placement(device_map=device_map, strategy="sequential", notes=tuple(notes), diagnostics=tuple(diagnostics))


def insufficient_memory(minimum) -> str:
    """accelerate's log line for devices that got nothing, with the bytes that would have taken a module there
    (``infer_auto_device_map``, accelerate/utils/modeling.py; tests look for "insufficient memory")."""
    devices = "\n".join(f"  - {device}: {need} bytes required" for device, need in minimum.items())
    return ("Based on the current allocation process, no modules could be assigned to the following devices due to "
            f"insufficient memory:\n{devices}\nThese minimum requirements are specific to this allocation attempt and "
            "may vary. Consider increasing the available memory for these devices to at least the specified minimum, "
            "or adjusting the model config.")


def _buffer_warning(problem: Problem, device_map: dict, used: dict) -> str | None:
    """accelerate's warning when the buffers of modules mapped to cpu/disk (which stay on the main device) fit no
    accelerator's remaining budget (``infer_auto_device_map``, accelerate/utils/modeling.py); ``None`` when they do."""
    g, budgets = problem.graph, problem.budgets
    if problem.options.offload_buffers or not budgets.accelerators:
        return None
    t = g.tensors
    buffer = np.where(~np.asarray(t.is_param, dtype=bool) & (as_array(t.canonical) == np.arange(len(t.name))),
                      np.asarray(t.nbytes_accelerate, dtype=float), 0.0)
    below = np.concatenate([[0.0], np.cumsum(buffer)])
    cols, total = columns(g), 0
    for name, device in device_map.items():
        node = g.node_index.get(name) if device in ("cpu", "disk") else None
        if node is not None:
            total += below[cols.last[node]] - below[cols.first[node]]
    if total <= 0:
        return None
    for gpu in budgets.accelerators:
        if budgets.limit(gpu) >= total + used.get(gpu, 0):
            return None
    return (f"Current model requires {int(total)} bytes of buffer for offloaded layers, which seems does not fit any "
            "GPU's remaining memory. If you are experiencing a OOM later, please consider using offload_buffers=True.")

