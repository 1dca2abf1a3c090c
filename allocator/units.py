"""Units: the finest pieces a plan may place, and the tie groups that bind them together.

A unit is a module that cannot be split (a leaf or a no-split class), or a direct tensor of a module that is
split. Units partition the model's tensors; tied units form one *group* that goes to a single device. A group with a
tensor unit may only be resident (accelerators, or cpu when cpu is main): accelerate hooks modules, not tensors.
"""

from __future__ import annotations

from .graph import ModelGraph, _new_row, _Record
from .gc_pause import gc_paused
from .runs import columns
from .runtime import moves_with_weights

__all__ = ["Unit", "Group", "units", "groups"]


class Unit(_Record):
    """A piece a plan places whole: a module that is not split, or a direct tensor of one that is.

    An immutable record (:class:`allocator.graph._Record`, a tuple with named fields): a flat stack of 200k modules
    has 200k units, and a tuple builds several times faster than a slotted dataclass."""

    __slots__ = ()
    _defaults = {"numel": 0}

    name: str
    node: int          # graph node index, or -1 for a tensor unit
    size: int          # counted bytes of its tensors, plus generation bytes (``ModelGraph.extra``) of its nodes
    offload: int       # bytes that leave the main device when it is offloaded (weights, +buffers with offload_buffers)
    pinned: int        # bytes that stay on the main device when it is offloaded (its buffers, its generation bytes)
    stream: int        # largest chain of weights its hooks materialise at once on the main device
    numel: int         # parameter elements (counted once), for the compute term of the cost model (default 0)


class Group(_Record):
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


def _tensor_unit(g: ModelGraph, t: int, offload_buffers: bool) -> Unit:
    tensor = g.tensors[t]
    moves = moves_with_weights(tensor, offload_buffers)
    counted = tensor.counted
    return Unit(tensor.name, -1, counted, counted if moves else 0, 0 if moves else counted,
                tensor.nbytes if tensor.is_param or moves else 0,
                tensor.numel if tensor.is_param and tensor.counted else 0)


def units(g: ModelGraph, offload_buffers: bool = False) -> list[Unit]:
    """The finest legal units, in definition order.

    A module unit's sizes are sums over its subtree, read from the graph's prefix sums
    (:class:`allocator.runs.Columns`): ``extra`` generation bytes (:attr:`ModelGraph.extra`) live where the unit
    executes, so they count in its size and, like its buffers, stay on the main device when it is offloaded
    (``pinned``).

    Notes
    -----
    O(units) once the graph's columns exist (O(nodes + tensors), built once per graph).
    """
    cols = columns(g)
    mov = cols.moving(offload_buffers)
    out: list[Unit] = []
    stack = [0]
    while stack:
        i = stack.pop()
        if g.is_splittable(i):
            out.extend(_tensor_unit(g, t, offload_buffers) for t in g.nodes.tensors_of(i))
            stack.extend(reversed(g.nodes.children(i)))
        else:
            a, b = cols.first[i], cols.last[i]
            offload = mov.sum_counted[b] - mov.sum_counted[a]
            extra = cols.sum_extra[cols.end[i]] - cols.sum_extra[i]
            pinned = cols.sum_counted[b] - cols.sum_counted[a] - offload + extra
            out.append(_new_row(Unit, (g.nodes.name[i], i, g.size[i] + extra, offload, pinned, mov.chain[i],
                                       cols.sum_numel[b] - cols.sum_numel[a])))
    return out


def groups(g: ModelGraph, offload_buffers: bool = False) -> list[Group]:
    """Units united by tie groups (shared tensors and declared ties), ordered by their first unit.

    Built once per graph and setting (every strategy asks, ``auto`` several times); each call returns a new list.
    """
    cache = columns(g).cache
    if ("groups", offload_buffers) not in cache:
        cache["groups", offload_buffers] = _groups(g, offload_buffers)
    return list(cache["groups", offload_buffers])


@gc_paused()
def _groups(g: ModelGraph, offload_buffers: bool) -> list[Group]:
    found = units(g, offload_buffers)
    if not g.all_tie_groups():  # every unit is a group of its own
        return [_new_row(Group, ((u,), u.size, u.offload, u.pinned, u.stream, u.numel, u.node < 0)) for u in found]
    position = {u.name: k for k, u in enumerate(found)}
    parent = list(range(len(found)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def unit_of(name: str) -> int | None:
        while True:
            if name in position:
                return position[name]
            if not name:
                return None
            name = name.rpartition(".")[0]

    for group in g.all_tie_groups():
        members = [k for k in (unit_of(n) for n in group) if k is not None]
        for k in members[1:]:
            parent[root(k)] = root(members[0])
    bucket: dict[int, list[Unit]] = {}
    for k, u in enumerate(found):
        bucket.setdefault(root(k), []).append(u)
    return [
        _new_row(Group, ((us[0],), us[0].size, us[0].offload, us[0].pinned, us[0].stream, us[0].numel, us[0].node < 0))
        if len(us) == 1 else
        Group(tuple(us), sum(u.size for u in us), sum(u.offload for u in us), sum(u.pinned for u in us),
              max(u.stream for u in us), sum(u.numel for u in us), any(u.node < 0 for u in us))
        for _, us in sorted(bucket.items(), key=lambda kv: position[kv[1][0].name])
    ]
