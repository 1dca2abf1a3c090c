"""Units: the finest pieces a plan may place, and the tie groups that bind them together.

A unit is a module that cannot be split (a leaf or a no-split class), or a direct tensor of a module that is
split. Units partition the model's tensors; tied units form one *group* that goes to a single device. A group with a
tensor unit may only be resident (accelerators, or cpu when cpu is main): accelerate hooks modules, not tensors.

Both are stored as columns (:class:`Units`, :class:`Groups`), as the graph is: a flat stack of 200k modules has
200k units and 200k groups, and a record object for each would cost their construction and a visit by every garbage
collection while the plan is made. ``units[k]`` / ``groups[k]`` still give the records (:class:`Unit`,
:class:`Group`), built when asked for; strategies that loop over every group read the columns.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..memo import Key
from ..model.graph import ModelGraph
from ..problem import Problem
from ..model.table import Record, Table, frozen, new_row, picklable, same
from .kernels import key_ranges
from ..rules.dispatch import device_of, moves
from ..rules.loaders import loads_from_disk
from .runs import as_array, as_ints, columns

__all__ = ["Unit", "Group", "Units", "Groups", "units", "groups", "problem_groups", "disk_loadable", "unit_flops",
           "tensor_flops", "boundary_bytes"]

GROUPS = Key("groups")
DISK_LOADABLE = Key("disk_loadable")


class Unit(Record):
    """A piece a plan places whole: a module that is not split, or a direct tensor of one that is.

    An immutable record (:class:`allocator.model.table.Record`, a tuple with named fields)."""

    __slots__ = ()
    _defaults = {"numel": 0}

    name: str
    node: int          # graph node index, or -1 for a tensor unit
    size: int          # counted bytes of its tensors, plus generation bytes (``ModelGraph.extra``) of its nodes
    offload: int       # bytes that leave the main device when it is offloaded (weights, +buffers with offload_buffers)
    pinned: int        # bytes that stay on the main device when it is offloaded (its buffers, its generation bytes)
    stream: int        # largest chain of weights its hooks materialise at once on the main device
    numel: int         # parameter elements (counted once), for the compute term of the cost model (default 0)


class Group(Record):
    """Units that must share a device, in model order (an immutable record, as :class:`Unit`).

    ``resident_only``: holds a lone tensor (a direct tensor of a split module), so it cannot be offloaded, since
    accelerate's hooks load modules named in the map, never lone tensors."""

    __slots__ = ()
    _defaults = {"numel": 0, "resident_only": False}

    units: tuple[Unit, ...]
    size: int
    offload: int
    pinned: int
    stream: int
    numel: int
    resident_only: bool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)


class _Arrays(Table):
    """A table whose columns are also given as numpy arrays, each made once (:meth:`array`)."""

    __slots__ = ()
    _kinds: ClassVar[dict[str, type]] = {}   # columns that are not integers: their numpy dtype

    def __init__(self, *columns):
        super().__init__(*columns)
        object.__setattr__(self, "_arrays", {})

    def array(self, column: str) -> np.ndarray:
        """A column as a numpy array: int64 (Python ints where a value passes int64), or the dtype of ``_kinds``."""
        cache = self._arrays
        if column not in cache:
            values = getattr(self, column)
            cache[column] = np.array(values, dtype=self._kinds[column]) if column in self._kinds else as_array(values)
        return cache[column]


class Units(_Arrays):
    """The units of a graph in definition order, one column per field of :class:`Unit`; ``units[k]`` is a
    :class:`Unit`. The ``tensor`` column holds the tensor index of a tensor unit (-1 for a module unit)."""

    __slots__ = ("name", "node", "size", "offload", "pinned", "stream", "numel", "tensor", "_arrays")
    _columns: ClassVar[tuple[str, ...]] = __slots__[:-1]
    _what = "units"

    _kinds = {"name": object}

    def spans(self, graph: ModelGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The units that hold tensors, in model order, as ``(positions, lo, hi, order)``: each one's tensors are
        ``lo`` to ``hi - 1``, and ``order`` is its order as a key of :func:`allocator.evaluate.runs.runs` (a module
        unit's node; the node count plus a tensor unit's tensor). ``graph`` is the one the units were made from; made
        once.
        """
        if "spans" not in self._arrays:
            node = self.array("node")
            order = np.where(node >= 0, node, len(graph.nodes) + self.array("tensor"))
            first, last, _ = columns(graph).arrays()
            lo, hi = key_ranges(first, last, order, len(graph.nodes))
            keep = np.flatnonzero(lo < hi)
            self._arrays["spans"] = keep, lo[keep], hi[keep], order[keep]
        return self._arrays["spans"]

    def _row(self, k: int) -> Unit:
        return new_row(Unit, (self.name[k], self.node[k], self.size[k], self.offload[k], self.pinned[k],
                               self.stream[k], self.numel[k]))


class Groups(_Arrays):
    """Tie groups of units, ordered by their first unit, one column per field of :class:`Group` but ``units``;
    ``groups[k]`` is a :class:`Group`. Group ``k`` holds the units ``members[start[k]:start[k + 1]]`` (indices into
    ``units``, the last group's run ends at ``len(members)``), in model order."""

    __slots__ = ("size", "offload", "pinned", "stream", "numel", "resident_only", "start", "members", "units",
                 "_arrays")
    _columns: ClassVar[tuple[str, ...]] = __slots__[:7]
    _what = "groups"
    _kinds = {"resident_only": bool}

    def __init__(self, units: Units, members, *columns):
        super().__init__(*columns)
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "members", frozen(members))

    def records(self) -> tuple[Group, ...]:
        """Every group as a :class:`Group` record, made once (for strategies that visit groups one by one)."""
        if "records" not in self._arrays:
            self._arrays["records"] = tuple(self)
        return self._arrays["records"]

    def counts(self) -> np.ndarray:
        """How many units each group holds."""
        return np.diff(np.append(self.array("start"), len(self.members)))

    def unit_groups(self) -> np.ndarray:
        """The group of each unit (int64, one entry per unit), made once."""
        if "unit_groups" not in self._arrays:
            out = np.empty(len(self.members), dtype=np.int64)
            out[self.array("members")] = np.repeat(np.arange(len(self)), self.counts())
            self._arrays["unit_groups"] = out
        return self._arrays["unit_groups"]

    def member_range(self, k: int) -> range:
        """Positions in ``members`` of group ``k``'s units."""
        return range(self.start[k], self.start[k + 1] if k + 1 < len(self) else len(self.members))

    def _row(self, k: int) -> Group:
        found = self.units
        return new_row(Group, (tuple(found[self.members[j]] for j in self.member_range(k)), self.size[k],
                                self.offload[k], self.pinned[k], self.stream[k], self.numel[k],
                                self.resident_only[k]))

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return super().__eq__(other) and self.units == other.units and same(self.members, other.members)

    def __hash__(self) -> int:
        return hash(self.units)

    def __reduce__(self):
        return type(self), (self.units, picklable(self.members),
                            *(picklable(getattr(self, c)) for c in self._columns))


def units(g: ModelGraph, offload_buffers: bool = False, read_copies: bool = False) -> Units:
    """The finest legal units, in definition order (a preorder walk that stops at every node that is not split,
    and takes the direct tensors of every node that is).

    A module unit's sizes are sums over its subtree, read from the graph's prefix sums
    (:class:`allocator.evaluate.runs.Columns`): ``extra`` generation bytes (:attr:`ModelGraph.extra`) live where the
    unit executes, so they count in its size and, like its buffers, stay on the main device when it is offloaded
    (``pinned``). ``read_copies``: the streamed chains count the copies hooks read cast tensors into
    (:func:`allocator.rules.dispatch.read_copy`; :attr:`allocator.problem.Problem.read_copies`).

    Notes
    -----
    O(nodes + tensors) numpy work, once the graph's columns exist (built once per graph); no object per unit.
    """
    cols = columns(g)
    mov = cols.moving(offload_buffers, read_copies)
    nodes = g.nodes
    n = len(nodes)
    if not n:
        return Units((), (), (), (), (), (), (), ())
    end = as_array(nodes.end)
    no_split = g.no_split
    split = (end > np.arange(1, n + 1)) & ~np.fromiter(map(no_split.__contains__, nodes.cls), dtype=bool, count=n)
    # reached: every proper ancestor is split (levels run deepest first, so read them from the root down)
    reached = np.zeros(n, dtype=bool)
    reached[0] = True
    parents = cols.parent_array
    for level in reversed(cols.levels[:-1]):
        reached[level] = reached[parents[level]] & split[parents[level]]
    module_units = np.flatnonzero(reached & ~split)
    owner = cols.module_array()
    tensor_units = np.flatnonzero((reached & split)[owner]) if len(owner) else np.zeros(0, dtype=np.int64)
    first, last, _ = cols.arrays()
    # definition order: by first tensor position, then by node (an empty module before the tensors of a later
    # module that start where it stands; a split module's own tensors come before its children's)
    position = np.concatenate([first[module_units], tensor_units])
    by_node = np.concatenate([module_units, owner[tensor_units]])
    order = np.lexsort((by_node, position))
    m = len(module_units)

    def column(module_values, tensor_values):
        values = np.concatenate([np.asarray(module_values), np.asarray(tensor_values)])[order]
        return as_ints(values) if values.dtype != object else values.tolist()

    a, b = first[module_units], last[module_units]
    sum_counted, moving_counted = as_array(cols.sum_counted), as_array(mov.sum_counted)
    sum_extra = as_array(cols.sum_extra)
    extra = sum_extra[end[module_units]] - sum_extra[module_units]
    module_offload = moving_counted[b] - moving_counted[a]
    counted = as_array(cols.counted)[tensor_units]
    persistent, tensor_names = g.tensors.persistent, g.tensors.name
    tensor_moves = moves(cols.is_param[tensor_units],
                         np.array([persistent[t] for t in tensor_units.tolist()], dtype=bool), offload_buffers)
    zero = np.zeros(len(tensor_units), dtype=counted.dtype)
    names = np.concatenate([np.array(nodes.name, dtype=object)[module_units],
                            np.array([tensor_names[t] for t in tensor_units.tolist()], dtype=object)])[order]
    subtree = sum_counted[b] - sum_counted[a]   # the module's counted bytes (ModelGraph.size)
    found = Units(
        names.tolist(),
        column(module_units, np.full(len(tensor_units), -1)),
        column(subtree + extra, counted),
        column(module_offload, np.where(tensor_moves, counted, zero)),
        column(subtree - module_offload + extra, np.where(tensor_moves, zero, counted)),
        column(as_array(mov.chain)[module_units],
               np.where(tensor_moves, mov.held_array()[tensor_units], zero)),
        column(as_array(cols.sum_numel)[b] - as_array(cols.sum_numel)[a], as_array(cols.numel)[tensor_units]),
        column(np.full(m, -1), tensor_units),
    )
    found._arrays["name"] = names
    return found


def groups(g: ModelGraph, offload_buffers: bool = False, read_copies: bool = False) -> Groups:
    """Units united by tie groups (shared tensors and declared ties), ordered by their first unit.

    Built once per graph and setting (every strategy asks, ``auto`` several times); immutable, so shared.
    """
    read_copies = read_copies and bool(g.stored)
    return g.derived.once(GROUPS(offload_buffers, read_copies),
                          lambda: _groups(g, offload_buffers, read_copies))


def problem_groups(problem: Problem) -> Groups:
    """:func:`groups` of a problem's graph under its options (``offload_buffers``) and
    :attr:`~allocator.problem.Problem.read_copies`: the units every strategy places."""
    return groups(problem.graph, problem.placing.offload_buffers, problem.read_copies)


def disk_loadable(problem: Problem) -> np.ndarray:
    """Whether the loading path (``problem.placing.loader``) loads every tensor of each group of :func:`problem_groups`
    right from disk (:func:`allocator.rules.loaders.loads_from_disk`): on accelerate's path not a tied tensor, nor a
    persistent buffer without ``offload_buffers=True``. A numpy bool array in group order, made once per problem."""
    return problem.derived.once(DISK_LOADABLE, lambda: _disk_loadable(problem))


def _disk_loadable(problem: Problem) -> np.ndarray:
    found, placing, g = problem_groups(problem), problem.placing, problem.graph
    if placing.loader == "transformers" or not len(found):
        return np.ones(len(found), dtype=bool)
    cols = columns(g)
    tied = np.zeros(len(cols.is_param), dtype=bool)
    index = g.tensor_index
    tied[[index[n] for group in g.all_tie_groups() for n in group if n in index]] = True
    loads = np.fromiter((loads_from_disk(placing.loader, p, q, t, placing.offload_buffers)
                         for p, q, t in zip(cols.is_param.tolist(), cols.persistent.tolist(), tied.tolist())),
                        dtype=bool, count=len(tied))
    bad = np.concatenate([[0], np.cumsum(~loads)])
    unit = found.units
    node, tensor = unit.array("node"), unit.array("tensor")
    first, last, _ = cols.arrays()
    a = np.where(node >= 0, first[np.maximum(node, 0)], tensor)
    b = np.where(node >= 0, last[np.maximum(node, 0)], tensor + 1)
    per_group = np.zeros(len(found), dtype=np.int64)
    np.add.at(per_group, found.unit_groups(), bad[b] - bad[a])
    return per_group == 0


def _groups(g: ModelGraph, offload_buffers: bool, read_copies: bool) -> Groups:
    found = units(g, offload_buffers, read_copies)
    n = len(found)
    node = found.array("node")
    if not g.all_tie_groups():  # every unit is a group of its own
        every = as_ints(np.arange(n, dtype=np.int64))
        return Groups(found, every, found.size, found.offload, found.pinned, found.stream, found.numel,
                      (node < 0).tolist(), every)
    label = _tie_roots(found, g.all_tie_groups())
    # groups in the order of their first unit: number each root by where it first appears
    roots, first_seen, label = np.unique(label, return_index=True, return_inverse=True)
    rank = np.empty(len(roots), dtype=np.int64)
    rank[np.argsort(first_seen, kind="stable")] = np.arange(len(roots))
    label = rank[label]
    members = np.argsort(label, kind="stable")
    count = np.bincount(label, minlength=len(roots))
    start = np.concatenate([[0], np.cumsum(count)[:-1]])

    def total(values, at=np.add.at):
        values = as_array(values)
        out = np.zeros(len(roots), dtype=values.dtype) if values.dtype != object else np.array([0] * len(roots),
                                                                                             dtype=object)
        at(out, label, values)
        return as_ints(out) if out.dtype != object else out.tolist()

    resident_only = np.zeros(len(roots), dtype=bool)
    np.logical_or.at(resident_only, label, node < 0)
    return Groups(found, as_ints(members), total(found.size), total(found.offload), total(found.pinned),
                  total(found.stream, np.maximum.at), total(found.numel), resident_only.tolist(), as_ints(start))


def _tie_roots(found: Units, tie_groups) -> np.ndarray:
    """For each unit, a representative of the units it is tied to (union-find over the tie groups; a tied name
    belongs to the unit that is it or holds it)."""
    position = {name: k for k, name in enumerate(found.name)}
    parent = list(range(len(found)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for group in tie_groups:
        members = [k for k in (device_of(n, position) for n in group) if k is not None]   # longest prefix
        for k in members[1:]:
            parent[root(k)] = root(members[0])
    return np.array([root(k) for k in range(len(found))], dtype=np.int64)


def unit_flops(g: ModelGraph, node_flops) -> np.ndarray:
    """FLOPs per unit of :func:`units` (in its order), from exclusive FLOPs per node (``node_flops``, one entry per
    graph node, as :func:`allocator.model.flops.node_flops` gives them): each node's are charged to the unit that
    executes them. A node inside a module unit (a parameterless one too: attention scores, activations) charges that
    unit; a split node's own ops charge the unit of its first direct tensor, or else its first child's unit. They sum to
    the total.

    Notes
    -----
    O(nodes) numpy work, plus a slice per module unit.
    """
    found = units(g)
    owner = np.full(len(g.nodes), -1, dtype=np.int64)
    node, tensor = found.array("node"), found.array("tensor")
    end = as_array(g.nodes.end)
    for k in np.flatnonzero(node >= 0).tolist():   # module units never nest: each owns its subtree
        owner[node[k]:end[node[k]]] = k
    of_tensor = np.full(len(g.tensors), -1, dtype=np.int64)
    of_tensor[tensor[tensor >= 0]] = np.flatnonzero(tensor >= 0)
    first = as_array(g.nodes.first)
    own = as_array(g.nodes.n_params) + as_array(g.nodes.n_buffers)
    for i in np.flatnonzero(owner < 0)[::-1].tolist():   # split nodes, children before parents
        owner[i] = of_tensor[first[i]] if own[i] else owner[i + 1]
    out = np.zeros(len(found), dtype=np.int64)
    np.add.at(out, owner, np.asarray(node_flops, dtype=np.int64))
    return out


def tensor_flops(g: ModelGraph, node_flops) -> np.ndarray:
    """:func:`unit_flops` spread over the tensors (float64, one entry per tensor), where the cost model's per-tensor
    prefix sums read them: a unit's over its parameters in proportion to their elements (its first tensor when it
    has no parameter elements); a unit without tensors runs where its input comes from, so its FLOPs go to the
    tensor before it in model order (the first tensor when none is)."""
    found, per_unit = units(g), unit_flops(g, node_flops)
    cols = columns(g)
    out = np.zeros(len(g.tensors), dtype=np.float64)
    if not len(out):
        return out
    numel = as_array(cols.numel).astype(np.float64)
    keep, lo, hi, _ = found.spans(g)
    for k, a, b in zip(keep.tolist(), lo.tolist(), hi.tolist()):
        share = numel[a:b].sum()
        if share > 0:
            out[a:b] += per_unit[k] * (numel[a:b] / share)
        else:
            out[a] += per_unit[k]
    empty = np.setdiff1d(np.flatnonzero(per_unit), keep)
    first, _, _ = cols.arrays()
    for k in empty.tolist():
        out[max(int(first[found.array("node")[k]]) - 1, 0)] += per_unit[k]
    return out


def boundary_bytes(g: ModelGraph, node_bytes) -> np.ndarray:
    """Activation bytes crossing each boundary between tensors in model order (int64, one more entry than the
    tensors): at ``t``, what the outermost module whose tensors end right before tensor ``t`` returned
    (``node_bytes``, one entry per graph node: :attr:`allocator.model.flops.FlopCount.output_bytes` by
    :func:`allocator.model.flops.node_values`); the root is never counted, and 0 where no module with an output ends.

    A change of executing device between consecutive pieces of a plan moves that output; the cost model charges it
    (:func:`allocator.evaluate.cost.change_seconds`).

    Notes
    -----
    O(nodes) numpy work.
    """
    cols = columns(g)
    first, last, _ = cols.arrays()
    out_bytes = np.asarray(node_bytes, dtype=np.int64)
    found = np.zeros(len(g.tensors) + 1, dtype=np.int64)
    keep = np.flatnonzero((out_bytes > 0) & (last > first))
    keep = keep[keep > 0]   # not the root: its output leaves the model
    if len(keep):
        ends, at = np.unique(last[keep], return_index=True)   # nodes in preorder: the first is the outermost
        found[ends] = out_bytes[keep[at]]
    return found
