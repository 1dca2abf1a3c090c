"""The graph's records and tables, and :class:`ModelGraph`: what strategies read.

Storage
-------
A graph is stored as columns (:class:`Nodes`, :class:`Tensors`): one tuple, or read-only int64 buffer, per field,
one entry per module path or tensor, in preorder. A large model then holds a few dozen Python objects besides its
strings instead of one record per module and per tensor: cheaper to build, a fraction of the memory, and nothing for
the caller's garbage collections to walk. ``graph.nodes[i]`` / ``graph.tensors[k]`` still give the records
(:class:`ModuleNode`, :class:`TensorNode`), built when asked for; loops over a whole model read the columns
(``graph.nodes.parent``, ``graph.tensors.nbytes``), numpy reads the int64 ones without a copy. The record and table
machinery is :mod:`allocator.model.table`'s; :mod:`allocator.model.read` fills the columns from a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..memo import Derived
from .sizes import subtree_sizes
from .table import Record, Table, new_row

__all__ = ["TensorNode", "ModuleNode", "Nodes", "Tensors", "TensorIndex", "ModelGraph", "zeroed"]


class TensorNode(Record):
    """One parameter or buffer."""

    __slots__ = ()
    _defaults = {"storage": -1, "_index": -1}

    name: str            # full path, e.g. "model.layers.0.mlp.up_proj.weight"
    module: int          # index of the owning node
    local: str           # name inside the owning module
    is_param: bool
    persistent: bool     # False for non-persistent buffers (never offloaded by accelerate)
    numel: int
    nbytes: int          # real bytes under dtype / special_dtypes / quantizer (bool and int keep their size)
    nbytes_accelerate: float  # bytes as accelerate counts them (a bool element is 1/8 byte there)
    canonical: int       # index of the first tensor that is the same object (itself if unshared): accelerate's view
    storage: int         # index of the tensor whose memory this one uses: ``canonical``, or a declared tie's source
    _index: int          # this tensor's own index in ``ModelGraph.tensors``

    @property
    def counted(self) -> int:
        """Bytes this name contributes to sizes (0 when it shares another tensor's memory)."""
        return self.nbytes if self.storage == self._index else 0


class ModuleNode(Record):
    """One module, by path."""

    __slots__ = ()

    name: str
    cls: str                      # class name, as no-split matching uses it
    parent: int                   # -1 for the root
    children: tuple[int, ...]     # named_children order
    params: tuple[int, ...]       # direct parameters, named_parameters(recurse=False) order
    buffers: tuple[int, ...]      # direct buffers, named_buffers(recurse=False) order
    alias_of: int                 # first node of the same module object, or -1


class Nodes(Table):
    """The modules of a graph in preorder, stored as columns; ``nodes[i]`` is node ``i`` as a :class:`ModuleNode`.

    Each column is a tuple with one entry per node: ``name``, ``cls``, ``parent``, ``alias_of`` (as in
    :class:`ModuleNode`), ``first`` (the index of the node's first direct tensor: its parameters, then its buffers,
    follow those of the nodes before it), ``n_params``, ``n_buffers`` (how many direct tensors of each kind), and
    ``end`` (one past the last node of its subtree: the subtree of ``i`` is nodes ``i`` to ``end[i] - 1``).

    Why columns: a large model has hundreds of thousands of modules; a record object per module costs its
    construction, its memory, and a visit by every garbage collection of the caller's process for as long as the
    graph lives. Loops over every node read the columns; a record is built when asked for.

    >>> import torch.nn as nn
    >>> from allocator.model import build_graph
    >>> g = build_graph(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    >>> g.nodes.name, g.nodes.children(0), list(g.nodes.end), g.nodes[1].params
    (('', '0', '1'), (1, 2), [3, 2, 3], (0, 1))
    >>> g.tensors.name[1], g.tensors.nbytes[1], g.tensors[1].counted
    ('0.bias', 8, 8)
    """

    __slots__ = ("name", "cls", "parent", "alias_of", "first", "n_params", "n_buffers", "end")
    _columns = __slots__
    _what = "modules"

    def _row(self, i: int) -> ModuleNode:
        first = self.first[i]
        params = first + self.n_params[i]
        return new_row(ModuleNode, (self.name[i], self.cls[i], self.parent[i], self.children(i),
                                     tuple(range(first, params)), tuple(range(params, params + self.n_buffers[i])),
                                     self.alias_of[i]))

    def children(self, i: int) -> tuple[int, ...]:
        """Node ``i``'s children, in ``named_children`` order: its first child is ``i + 1``, each next one starts
        where the subtree of the one before ends. O(children)."""
        end = self.end
        stop, j, out = end[i], i + 1, []
        while j < stop:
            out.append(j)
            j = end[j]
        return tuple(out)

    def tensors_of(self, i: int) -> range:
        """The indices of node ``i``'s direct tensors (parameters, then buffers)."""
        first = self.first[i]
        return range(first, first + self.n_params[i] + self.n_buffers[i])


class Tensors(Table):
    """The parameters and buffers of a graph in node preorder, stored as columns (one tuple per field of
    :class:`TensorNode` but ``_index``); ``tensors[k]`` is tensor ``k`` as a :class:`TensorNode`."""

    __slots__ = ("name", "module", "local", "is_param", "persistent", "numel", "nbytes", "nbytes_accelerate",
                 "canonical", "storage")
    _columns = __slots__
    _what = "tensors"

    def _row(self, k: int) -> TensorNode:
        return new_row(TensorNode, (self.name[k], self.module[k], self.local[k], self.is_param[k], self.persistent[k],
                                     self.numel[k], self.nbytes[k], self.nbytes_accelerate[k], self.canonical[k],
                                     self.storage[k], k))


_SCAN = 16  # a module with more direct tensors than this (a large ParameterList) is looked up in a table


class TensorIndex(Mapping):
    """Tensor name -> index, without a table of its own: a name is its module's path, a dot and its local name, so
    it is found among the direct tensors of the node its prefix names (O(direct tensors of that node)).
    ``TensorIndex(node_index, nodes, local, name)`` reads the node index and the tensors' ``local`` and ``name``
    columns; it copies none of them.

    A module whose own tensor names hold a dot (possible only through a class that overrides ``named_parameters``)
    breaks the rule; where any does, a full table is built once on the first miss. So is it for a name in a module
    with many direct tensors (a large ``ParameterList``), which a scan would make quadratic."""

    __slots__ = ("_node_index", "_nodes", "_local", "_name", "_dotted", "_table")

    def __init__(self, node_index: Mapping[str, int], nodes: Nodes, local: Sequence[str], name: Sequence[str]):
        self._node_index, self._nodes, self._local, self._name = node_index, nodes, local, name
        self._dotted = "." in "".join(local)   # some local name holds a dot: only a table finds it
        self._table: dict[str, int] | None = None   # name -> index, built when first needed

    def __getitem__(self, name):
        found = self.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def get(self, name, default=None):
        if type(name) is not str:
            return default
        module, _, local = name.rpartition(".")
        i = self._node_index.get(module)
        if i is not None:
            own = self._nodes.tensors_of(i)
            if len(own) <= _SCAN:
                locals_ = self._local
                for k in own:
                    if locals_[k] == local:
                        return k
                if not self._dotted:
                    return default
        elif not self._dotted:
            return default
        if self._table is None:
            self._table = dict(zip(self._name, range(len(self))))
        return self._table.get(name, default)

    def __contains__(self, name) -> bool:
        return self.get(name) is not None

    def __iter__(self):
        return iter(self._name)

    def __len__(self) -> int:
        return len(self._name)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class ModelGraph:
    """Frozen description of a model for planning.

    ``nodes`` and ``tensors`` are stored as columns (:class:`Nodes`, :class:`Tensors`): ``graph.nodes.parent[i]``
    reads a column, ``graph.nodes[i]`` builds node ``i``'s record. ``size[i]`` / ``size_accelerate[i]`` are the
    counted bytes of node ``i``'s subtree (accelerate's ``compute_module_sizes``); ``direct_param_bytes(i)`` is the
    streamed size of node ``i`` alone (its direct parameters).
    """

    nodes: Nodes
    tensors: Tensors
    size: tuple[int, ...]
    size_accelerate: tuple[float, ...]
    no_split: frozenset[str]     # what plans keep whole: declared, or inferred blocks when nothing is declared
    no_split_declared: frozenset[str]  # the caller's united with every sub-model's ``_no_split_modules``
    tied_groups: tuple[tuple[str, ...], ...]  # shared tensors, in accelerate's find_tied_parameters order
    declared_ties: tuple[tuple[str, ...], ...]  # the model's declared tied keys not already shared
    node_index: Mapping[str, int] = field(repr=False)
    tensor_index: Mapping[str, int] = field(repr=False)  # a view over the columns, not a table (TensorIndex)
    model_class: str = ""
    extra: Mapping[int, int] = field(default_factory=dict, repr=False)
    """Bytes that live where a node *executes*, beyond its tensors (a generation budget's KV cache and logits,
    :mod:`allocator.model.generation`): on its device when resident, on the main device when offloaded — like the
    buffers of an offloaded module. Empty without a generation budget."""
    workspace: int = 0
    """Bytes every device that executes part of the model needs for activations (0 without a generation budget)."""
    main_workspace: int = 0
    """Bytes the main device needs on top of ``workspace`` (generate's float32 next-token scores live there)."""
    stored: Mapping[int, int] = field(default_factory=dict, repr=False)
    """Tensor -> its bytes at the dtype the model holds it in, for the checkpoint tensors ``dtype`` makes smaller: what
    a checkpoint saved from the model as given stores, and what a loader reads before it casts
    (:func:`allocator.rules.dispatch.read_copy`). Empty without ``dtype``. Non-persistent buffers are in no checkpoint
    and no loader casts them: they keep their own dtype's bytes in ``tensors.nbytes`` (llama's float32 ``inv_freq``)."""
    derived: Derived = field(default_factory=Derived, init=False, repr=False, compare=False)
    """What follows from the graph alone, made once (its columns, the units' groups, the runs of the last maps):
    :class:`allocator.memo.Derived`."""

    @property
    def total(self) -> int:
        """Counted bytes of the whole model."""
        return self.size[0]

    def is_splittable(self, node: int) -> bool:
        """A node can be split into its children unless it is a leaf or a no-split class."""
        nodes = self.nodes
        return nodes.end[node] > node + 1 and nodes.cls[node] not in self.no_split

    def direct_param_bytes(self, node: int) -> int:
        """Real bytes of a node's direct parameters (what its offload hook streams)."""
        first = self.nodes.first[node]
        return sum(self.tensors.nbytes[first:first + self.nodes.n_params[node]])

    def all_tie_groups(self) -> tuple[tuple[str, ...], ...]:
        """Shared tensors and declared ties together: every group must live on one device."""
        return self.tied_groups + self.declared_ties


def zeroed(graph: ModelGraph, names: Iterable[str]) -> ModelGraph:
    """``graph`` with the tensors ``names`` counted as 0 bytes, as a read of the model with a ``size_fn`` that gives
    them 0 would make it (transformers' ``_no_placement_params`` left out of the map), without reading the model again.

    The tensor columns ``nbytes`` and ``nbytes_accelerate`` get zeros at those tensors; the nodes' sizes are summed
    again from the columns (a tensor counts where it is its own storage, and for accelerate where it is its own
    canonical name, as :func:`allocator.model.build_graph` counts them). Everything else is shared with ``graph``; what
    was derived from it is not (a new graph derives its own).

    Notes
    -----
    O(nodes + tensors). Sizes are integers (accelerate's are floats whose sum may differ in the last bit from a
    read's, which sums them in another order, where a ``size_fn`` gives fractional bytes).

    >>> import torch.nn as nn
    >>> from allocator.model import build_graph
    >>> g = zeroed(build_graph(nn.Sequential(nn.Linear(2, 2))), ["0.weight"])
    >>> g.total, g.tensors.nbytes[0], g.tensors.nbytes[1]
    (8, 0, 8)
    """
    zero = {graph.tensor_index[name] for name in names}
    if not zero:
        return graph
    t, nodes = graph.tensors, graph.nodes
    nbytes = [0 if k in zero else b for k, b in enumerate(t.nbytes)]
    accelerate = [0 if k in zero else b for k, b in enumerate(t.nbytes_accelerate)]
    direct, direct_accelerate = [], []
    for i in range(len(nodes)):
        own = nodes.tensors_of(i)
        direct.append(sum(nbytes[k] for k in own if t.storage[k] == k))
        direct_accelerate.append(sum(accelerate[k] for k in own if t.canonical[k] == k))
    size, size_accelerate = subtree_sizes(direct, direct_accelerate, nodes.parent)
    tensors = Tensors(t.name, t.module, t.local, t.is_param, t.persistent, t.numel, nbytes, accelerate, t.canonical,
                      t.storage)
    return dataclasses.replace(graph, tensors=tensors, size=size, size_accelerate=size_accelerate)
