"""The model graph: everything a strategy needs to know about a model, extracted once.

This is the only module (with :mod:`allocator.problem`) that touches ``torch.nn``. Strategies read the
frozen :class:`ModelGraph` and never the model.

Glossary
--------
node
    A module reached by ``named_children`` recursion from the root, named by its path (``""`` is the root).
    A module object reachable under two paths gives two nodes, exactly as ``named_children`` walks it.
tensor
    A parameter or buffer, named by its full path. When one tensor object has several names (tied weights),
    only its first name in ``named_parameters()`` order is *counted*; the others have ``counted == 0``,
    which is how accelerate's ``compute_module_sizes`` accounts shared storage.
streamed size
    The bytes a module's offload hook copies to the main device at its forward: its direct parameters (and
    direct persistent buffers with ``offload_buffers=True``). Hooks of nested modules are active together, so
    the room a subtree needs for streaming is the largest *sum along a root-to-leaf chain* (see
    :func:`allocator.runtime.streamed_chain`).

Storage
-------
A graph is stored as columns (:class:`Nodes`, :class:`Tensors`): one tuple, or read-only int64 buffer, per field,
one entry per module path or tensor, in preorder. A 200k-module model then holds a few dozen Python objects
besides its strings instead of one record per module and per tensor: cheaper to build, a fraction of the memory, and
nothing for the caller's garbage collections to walk. ``graph.nodes[i]`` / ``graph.tensors[k]`` still give the
records (:class:`ModuleNode`, :class:`TensorNode`), built when asked for; loops over a whole model read the columns
(``graph.nodes.parent``, ``graph.tensors.nbytes``), numpy reads the int64 ones without a copy. The record and table
machinery is :mod:`allocator.table`'s.
"""

from __future__ import annotations

import logging
import math
from array import array
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import InvalidModel, InvalidOption
from .gc_pause import gc_paused
from .introspect import declared_no_split, infer_blocks, no_split_classes
from .table import Paths, Record, Table, frozen, new_row

__all__ = ["ModuleNode", "TensorNode", "Nodes", "Tensors", "ModelGraph", "build_graph", "as_dtype", "dtype_bytes",
           "no_split_classes"]

log = logging.getLogger(__name__)

SizeFn = Callable[[str, object], "int | None"]


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


class _TensorIndex(Mapping):
    """Tensor name -> index, without a table of its own: a name is its module's path, a dot and its local name, so
    it is found among the direct tensors of the node its prefix names (O(direct tensors of that node)).

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
    tensor_index: Mapping[str, int] = field(repr=False)  # a view over the columns, not a table (_TensorIndex)
    model_class: str = ""
    extra: Mapping[int, int] = field(default_factory=dict, repr=False)
    """Bytes that live where a node *executes*, beyond its tensors (a generation budget's KV cache and logits,
    :mod:`allocator.generation`): on its device when resident, on the main device when offloaded — like the
    buffers of an offloaded module. Empty without a generation budget."""
    workspace: int = 0
    """Bytes every device that executes part of the model needs for activations (0 without a generation budget)."""
    main_workspace: int = 0
    """Bytes the main device needs on top of ``workspace`` (generate's float32 next-token scores live there)."""

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


# ----------------------------------------------------------------------------------------------- sizes
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_SUB_BYTE = {f"torch.{sign}int{bits}": bits for sign in ("", "u") for bits in range(1, 8)}
"""torch's sub-byte integer dtypes (``torch.int4``, ``torch.uint2``, ...) -> bits per element. torch reports an
element size of 1 byte for them; stored, they are packed (``int4``: two per byte)."""


def as_dtype(dtype, what: str):
    """``dtype`` as a ``torch.dtype``: a dtype, or its name (``"float16"``, ``"torch.bfloat16"``); ``what`` names it in
    the :class:`~allocator.errors.InvalidOption` raised for anything else.

    >>> as_dtype("bfloat16", "dtype")
    torch.bfloat16
    """
    import torch

    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise InvalidOption(f"{what}: {dtype!r} is not a torch dtype; use e.g. 'float16' or torch.bfloat16.")
        return value
    if not isinstance(dtype, torch.dtype):
        raise InvalidOption(f"{what}: expected a torch.dtype or its name, got {type(dtype).__name__} {dtype!r}.")
    return dtype


def dtype_bytes(dtype) -> tuple[float, float]:
    """(real bytes per element, bytes per element as accelerate's ``dtype_byte_size`` says).

    Sub-byte integers are packed: ``int4`` is half a byte, as accelerate counts its ``CustomDtype.INT4`` (its
    ``dtype_byte_size(torch.int4)`` says 0, ``4 // 8``). Every other dtype has a whole number of bytes.

    >>> import torch
    >>> dtype_bytes(torch.bool), dtype_bytes(torch.float16), dtype_bytes(torch.int4)
    ((1, 0.125), (2, 2), (0.5, 0.5))
    """
    found = _DTYPE_BYTES.get(dtype)
    if found is None:
        found = _DTYPE_BYTES[dtype] = _dtype_bytes(dtype)
    return found


_DTYPE_BYTES: dict = {}  # dtype -> dtype_bytes(dtype); torch dtypes are few and immutable


def _dtype_bytes(dtype) -> tuple[float, float]:
    import torch

    bits = _SUB_BYTE.get(str(dtype))
    if bits is not None:
        return bits / 8, bits / 8
    real = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return real, 1 / 8
    if dtype in [getattr(torch, n) for n in _FLOAT8 if hasattr(torch, n)]:
        return real, 1
    return real, real


def _keeps_dtype(dtype) -> bool:
    """Integer and bool tensors are not converted by ``dtype`` (accelerate's ``set_module_tensor_to_device``)."""
    return str(dtype).startswith(("torch.uint", "torch.int", "torch.bool"))


# ----------------------------------------------------------------------------------------------- builder
_MAX_NODES = 5_000_000


_PLAIN: dict[type, bool] = {}


def _plain(cls) -> bool:
    """Whether a module class lists its children and tensors as ``nn.Module`` does, so that its ``_modules``,
    ``_parameters`` and ``_buffers`` can be read directly instead of through the (much slower) generators."""
    found = _PLAIN.get(cls)
    if found is None:
        import torch

        base = torch.nn.Module
        found = _PLAIN[cls] = all(getattr(cls, name, None) is getattr(base, name)
                                  for name in ("named_children", "named_parameters", "named_buffers", "_named_members"))
    return found


def _unique_items(table) -> tuple[list, bool]:
    """Items of a module's ``_modules`` / ``_parameters`` / ``_buffers`` without ``None`` and without repeated objects
    (first name kept), as ``named_children`` / ``named_*(recurse=False)`` yield them; and whether one was repeated."""
    items = [(k, v) for k, v in table.items() if v is not None]
    if len(items) > 1 and len({id(v) for _, v in items}) < len(items):
        seen: set[int] = set()
        return [(k, v) for k, v in items if not (id(v) in seen or seen.add(id(v)))], True
    return items, False


class _Reader:
    """One preorder walk of the model by path (``named_children`` recursion), reading every module's direct
    parameters and buffers (``named_parameters(recurse=False)``, ``named_buffers(recurse=False)``) into columns.

    The fast pass reads each module's ``_modules``, ``_parameters`` and ``_buffers`` directly, skipping ``None`` but
    not repeated objects. Where a table repeats an object (torch's generators yield it once), ``exact`` is False and
    the builder reads again with ``careful=True``, which drops repeats as torch does. ``repeats`` says that torch's
    own generators must be asked about shared parameters (a class overrides them, or a table repeats an object).

    ``size`` and ``size_accelerate`` hold each node's *direct* counted bytes (its own tensors that are not another
    tensor's second name), summed in tensor order. The node columns are those of :class:`Nodes`; the tensor columns
    those of :class:`Tensors` but ``storage`` (which starts as ``canonical``).

    Complexity: O(modules + tensors) time and memory, where a module object under ``a`` paths counts ``a`` times
    (``named_children`` recursion walks it under each), plus the depth of each repeated path (the cycle check).
    """

    def __init__(self, model, size_of, per_element: _PerElement | None, careful: bool = False):
        self.size_of = size_of          # (name, tensor, numel) -> (bytes, accelerate's bytes)
        self.per_element = per_element  # the same by dtype alone, when no tensor has a size of its own
        self.careful = careful
        # per node, preorder: the columns of Nodes
        self.names: list[str] = []
        self.cls: list[str] = []
        self.parents = array("q")   # int64 columns: no object per entry, handed to numpy without a copy
        self.alias_of = array("q")
        self.first = array("q")
        self.n_params = array("q")
        self.n_buffers = array("q")
        self.end = array("q")
        self.modules: list = []
        self.size: list[int] = []
        self.size_accelerate: list[float] = []
        # per tensor: the columns of Tensors but storage
        self.t_module = array("q")
        self.t_local: list[str] = []
        self.t_is_param: list[bool] = []
        self.t_persistent: list[bool] = []
        self.t_numel = array("q")
        self.t_nbytes = array("q") if per_element is not None else []  # a size_fn may say anything, however large
        self.t_nbytes_accelerate: list[float] = []
        self.t_canonical = array("q")
        self.seen_params: dict[int, int] = {}   # id of a parameter -> its first tensor index
        self.seen_buffers: dict[int, int] = {}
        self.first_node_of: dict[int, int] = {}  # id of a module object -> its first node
        self.classes: dict[type, bool] = {}      # each module class met -> whether it is plain (see _plain)
        self.own_no_split = False        # some module has a ``_no_split_modules`` attribute of its own
        self.exact = True
        self.repeats = False
        self.shared_params = False       # some parameter object has two names
        self._walk(model)

    def _walk(self, model) -> None:
        """Visit every path in preorder from an explicit stack (a model may nest deeper than Python's recursion limit),
        reading each node's direct tensors as it is visited.

        An entry to visit is ``(parent, name, module)``. A node with children goes back on the stack under them as
        ``(node, None, None)``; popped again, its subtree is complete and its ``end`` is known.

        One loop with every column's ``append`` bound once: this walk is most of the time of planning a large model,
        and a method call per module (with its own lookups) costs a third more.
        """
        names, modules, parents, end = self.names, self.modules, self.parents, self.end
        first_node_of, classes, careful = self.first_node_of, self.classes, self.careful
        add_cls, add_alias, add_end = self.cls.append, self.alias_of.append, end.append
        add_first, add_n_params, add_n_buffers = self.first.append, self.n_params.append, self.n_buffers.append
        add_size, add_size_accelerate = self.size.append, self.size_accelerate.append
        module_of = self.t_module
        add_module, add_local, add_param, add_persistent, add_numel, add_nbytes, add_accel, add_canonical = (
            module_of.append, self.t_local.append, self.t_is_param.append, self.t_persistent.append,
            self.t_numel.append, self.t_nbytes.append, self.t_nbytes_accelerate.append, self.t_canonical.append)
        size_of, per_element = self.size_of, self.per_element
        known = per_element.known if per_element is not None else None  # bytes per element by dtype, when enough
        kinds = ((True, self.seen_params), (False, self.seen_buffers))
        count = 0  # tensors so far
        stack: list[tuple] = [(-1, "", model)]
        while stack:
            parent, name, module = stack.pop()
            if name is None:  # (node, None, None): its subtree is complete
                end[parent] = len(names)
                continue
            i = len(names)
            if i >= _MAX_NODES:
                raise InvalidModel(f"more than {_MAX_NODES} module paths: shared sub-modules explode the tree.")
            first = first_node_of.setdefault(id(module), i)
            add_alias(-1 if first == i else self._repeated(module, first, parent, name))
            names.append(name)
            modules.append(module)
            parents.append(parent)
            cls = type(module)
            add_cls(cls.__name__)
            prefix = f"{name}." if name else ""

            plain = classes.get(cls)
            if plain is None:
                plain = classes[cls] = _plain(cls)
            state = module.__dict__  # one attribute lookup (nn.Module's are slow) for the tables and the no-split check
            if "_no_split_modules" in state:
                self.own_no_split = True
            if plain and not careful:
                params, buffers, children = state["_parameters"], state["_buffers"], state["_modules"]
                params, buffers, children = params and params.items(), buffers and buffers.items(), children.items()
            else:
                params, buffers, children = self._tables(module, plain)

            add_first(count)
            start = count
            real = accel = 0  # counted bytes, added in tensor order: parameters, then buffers
            n_params = 0
            for (is_param, seen), members in zip(kinds, (params, buffers)):
                if not members:
                    continue
                non_persistent = () if is_param else getattr(module, "_non_persistent_buffers_set", ())
                for local, tensor in members:
                    if tensor is None:
                        continue
                    canonical = seen.setdefault(id(tensor), count)
                    numel = tensor.numel()
                    if known is not None:
                        per = known.get(tensor.dtype) or per_element(tensor.dtype)
                        nbytes, nbytes_accel = numel * per[0], numel * per[1]
                    else:
                        nbytes, nbytes_accel = size_of(prefix + local, tensor, numel)
                    if canonical == count:  # counted: its storage is its own (until declared ties are shared)
                        real += nbytes
                        accel += nbytes_accel
                    else:  # a second name of an object
                        if module_of[canonical] == i:
                            self.exact = False   # one module lists the object twice: torch's generators yield it once
                        if is_param:
                            self.shared_params = True
                    add_module(i)
                    add_local(local)
                    add_param(is_param)
                    add_persistent(is_param or local not in non_persistent)
                    add_numel(numel)
                    add_nbytes(nbytes)
                    add_accel(nbytes_accel)
                    add_canonical(canonical)
                    count += 1
                if is_param:
                    n_params = count - start
            add_n_params(n_params)
            add_n_buffers(count - start - n_params)
            add_size(real)
            add_size_accelerate(accel)

            if children:
                add_end(-1)
                stack.append((i, None, None))
                stack.extend(reversed([(i, prefix + local, child)  # reversed: the first child pops next
                                       for local, child in children if child is not None]))
            else:
                add_end(i + 1)

    def _repeated(self, module, first: int, parent: int, name: str) -> int:
        """``first``, for a new node that is an alias of node ``first``; refuses a module that contains itself."""
        if self.parents[first] == parent:
            self.exact = False  # one module lists a child twice: named_children yields it once
        ancestor = parent
        while ancestor >= 0:
            if self.modules[ancestor] is module:
                local = name[len(self.names[parent]) + 1:] if self.names[parent] else name
                raise InvalidModel(
                    f"module {self.names[parent] or '<root>'!r} contains itself through child {local!r}: "
                    "a cycle in the module graph cannot be placed; remove the back-reference."
                )
            ancestor = self.parents[ancestor]
        return first

    def _tables(self, module, plain: bool) -> tuple[list, list, list]:
        """A module's (name, object) parameters, buffers and children as torch's generators yield them."""
        if plain:  # careful: drop repeated objects, as the generators do
            params, repeated = _unique_items(module._parameters)
            buffers = _unique_items(module._buffers)[0]
            children, again = _unique_items(module._modules)
            self.repeats |= repeated or again
            return params, buffers, children
        self.repeats = True
        return (list(module.named_parameters(recurse=False)), list(module.named_buffers(recurse=False)),
                list(module.named_children()))


def _read_model(model, size_of, by_dtype) -> _Reader:
    """Read the model, again carefully where the fast read was not exact."""
    read = _Reader(model, size_of, by_dtype)
    if not read.exact:
        read = _Reader(model, size_of, by_dtype, careful=True)
    return read


def _declared_tied_groups(model, names: Container[str]) -> list[tuple[str, ...]]:
    """Groups from the model's declared tied keys (transformers' ``all_tied_weights_keys``)."""
    declared = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(declared, Mapping):
        return []
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for target, source in declared.items():
        if isinstance(target, str) and isinstance(source, str) and target in names and source in names:
            parent[find(target)] = find(source)
    groups: dict[str, list[str]] = {}
    for key in parent:
        groups.setdefault(find(key), []).append(key)
    return [tuple(sorted(g)) for g in groups.values() if len(g) > 1]


def _declared_storage(model, storage: Sequence[int], index: Mapping[str, int]) -> dict[int, int]:
    """Point each declared tie target (transformers' ``all_tied_weights_keys``: target -> source) at its source's
    memory: tensor index -> index of the tensor whose memory it uses, for the targets whose ``storage`` changes.
    transformers plans a device map before it ties weights, so the two are separate objects then, but they share
    memory once loaded."""
    declared = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(declared, Mapping):
        return {}
    moved: dict[int, int] = {}
    for target, source in declared.items():
        if target in index and source in index:
            root = moved.get(index[source], storage[index[source]])
            i = index[target]
            if moved.get(i, storage[i]) == i and root != i:
                moved[i] = root
    return moved


def _find_tied(all_params: list[tuple[str, Hashable]], unique: dict[str, Hashable]) -> list[tuple[str, ...]]:
    """accelerate's ``find_tied_parameters``, same grouping and the same group order (the tied names are visited in
    the iteration order of the same set, built the same way). Parameters are given by name and identity: a key
    equal for two names exactly when they are the same object (its ``id``, or its first tensor index)."""
    tied_names = {n for n, _ in all_params} - set(unique)
    if not tied_names:
        return []
    by_name = dict(all_params)
    first_name = {}
    for name, identity in unique.items():  # unique holds each object once: its first name
        first_name.setdefault(identity, name)
    groups: dict[str, list[str]] = {}
    for tied in tied_names:
        name = first_name.get(by_name[tied])
        if name is not None:
            groups.setdefault(name, []).append(tied)
    return [tuple(sorted([w] + list(set(t)))) for w, t in groups.items()]


def _read_no_split(read: _Reader) -> set[str]:
    """:func:`~allocator.introspect.declared_no_split` over the modules the walk met (each object once), asking each
    class once when no module declares its own and no class declares through a descriptor (the per-module rule costs
    a slow ``__dict__`` lookup per module)."""
    unique = (read.modules[i] for i in read.first_node_of.values())
    if read.own_no_split:
        return declared_no_split(unique)
    found: set[str] = set()
    for cls in read.classes:
        declared = getattr(cls, "_no_split_modules", None)
        if hasattr(type(declared), "__get__"):  # a property or other descriptor: ask the instances
            return declared_no_split(unique)
        if declared:
            found.update(str(c) for c in declared)
    return found


def build_graph(
    model,
    *,
    dtype=None,
    special_dtypes: Mapping[str, object] | None = None,
    no_split_module_classes: Iterable[str] | str | None = None,
    discover_no_split: bool = True,
    infer_no_split: bool = True,
    tied_parameters: Sequence[Sequence[str]] | None = None,
    size_fn: SizeFn | None = None,
) -> ModelGraph:
    """Extract a :class:`ModelGraph` from ``model`` (any ``nn.Module``, meta device included).

    Parameters
    ----------
    model : torch.nn.Module
        Never modified.
    dtype : torch.dtype or str, optional
        Floating tensors are counted at ``min(dtype, own)`` bytes per element; int and bool keep their size.
    special_dtypes : dict, optional
        Full tensor name to dtype, overriding ``dtype``.
    no_split_module_classes : list of str, optional
        Class names never split across devices. United with ``_no_split_modules`` of every sub-model when
        ``discover_no_split``.
    infer_no_split : bool
        When nothing is declared, keep the model's repeated blocks whole
        (:func:`allocator.introspect.infer_blocks`); logged. ``sequential`` ignores them, as accelerate does.
    tied_parameters : list of list of str, optional
        Replaces the tie groups found from shared tensors.
    size_fn : callable, optional
        ``size_fn(name, tensor) -> bytes or None`` for quantized weights; ``None`` falls back to the dtype rule.

    Raises
    ------
    InvalidModel, InvalidOption

    Notes
    -----
    Complexity: O(modules + tensors) time and memory (a module object under several paths counts once per path):
    one walk of the module tree, a second where a module lists an object twice, and
    :func:`~allocator.introspect.infer_blocks` when it runs. The cyclic garbage collector is paused meanwhile.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidModel(f"expected a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    no_split = set()
    for c in no_split_module_classes or ():
        if not isinstance(c, str):
            raise InvalidOption(f"no_split_module_classes must hold class names (str), got {c!r}.")
        no_split.add(c)
    target = as_dtype(dtype, "dtype") if dtype is not None else None
    special = {}
    for key, value in (special_dtypes or {}).items():
        special[key] = as_dtype(value, f"special_dtypes[{key!r}]")

    per_element = _PerElement(target)

    def size_of(name, tensor, numel):
        if size_fn is None and name not in special:
            real, accel = per_element(tensor.dtype)
            return _whole(numel * real), numel * accel
        return _tensor_bytes(name, tensor, target, special, size_fn, numel)

    packed = target is not None and str(target) in _SUB_BYTE  # bytes per tensor rounded up: not by dtype alone
    by_dtype = per_element if size_fn is None and not special and not packed else None

    with gc_paused():
        read = _read_model(model, size_of, by_dtype)
        no_split, declared_classes = _no_split(model, read, no_split, discover_no_split, infer_no_split)
        nodes = Nodes(read.names, read.cls, read.parents, read.alias_of, read.first, read.n_params, read.n_buffers,
                      read.end)
        node_index = dict(zip(nodes.name, range(len(nodes))))  # zip: no Python loop
        module, local = frozen(read.t_module), tuple(read.t_local)
        names = Paths(nodes.name, module, local)
        tensor_index = _TensorIndex(node_index, nodes, local, names)
        storage = read.t_canonical[:]   # a copy
        moved = _declared_storage(model, storage, tensor_index)
        unknown_special = [k for k in special if k not in tensor_index]
        if unknown_special:
            raise InvalidOption(
                f"special_dtypes names tensors the model does not have: {sorted(unknown_special)[:5]}; "
                "use full parameter names as in model.named_parameters()."
            )
        size, size_acc = _sizes(read, storage, moved)
        tensors = Tensors(names, module, local, read.t_is_param, read.t_persistent, read.t_numel,
                          read.t_nbytes, read.t_nbytes_accelerate, read.t_canonical, storage)
        tied = _tied_groups(model, read, names, tensor_index, tied_parameters)
        already = {n for g in tied for n in g}
        declared_ties = [g for g in _declared_tied_groups(model, tensor_index) if not set(g) <= already]
        if no_split_module_classes:
            present = {cls.__name__ for cls in read.classes}
            for c in sorted(set(no_split_module_classes) - present):
                log.warning("no-split class %r matches no module of %s; check the spelling.", c, type(model).__name__)
        graph = ModelGraph(
            nodes=nodes, tensors=tensors, size=size, size_accelerate=size_acc,
            no_split=frozenset(no_split), no_split_declared=declared_classes, tied_groups=tuple(tied),
            declared_ties=tuple(declared_ties), node_index=node_index, tensor_index=tensor_index,
            model_class=type(model).__name__,
        )
        del read  # free the walk's lists now: the collection that resuming the collector starts skips them
        return graph


def _no_split(model, read: _Reader, given: set[str], discover: bool, infer: bool) -> tuple[set[str], frozenset[str]]:
    """(what plans keep whole, what is declared): the caller's classes united with every sub-model's
    ``_no_split_modules`` when ``discover``; when nothing is declared and ``infer``, the inferred blocks."""
    no_split = set(given)
    if discover:
        no_split |= _read_no_split(read) if not read.repeats else no_split_classes(model)
    declared = frozenset(no_split)
    if infer and not no_split:
        no_split = infer_blocks(model)
        if no_split:
            log.info("%s declares no no-split classes; keeping its repeated blocks %s whole "
                     "(pass no_split_module_classes, or infer_no_split=False, to change this)",
                     type(model).__name__, sorted(no_split))
    return no_split, declared


def _sizes(read: _Reader, storage: list[int], moved: Mapping[int, int]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Counted bytes of every node's subtree (real, accelerate's), from the read's direct sizes, after pointing the
    tensors in ``moved`` (index -> the tensor whose memory it uses) at their declared tie's source in ``storage``.

    A moved tensor was counted (its storage was its own) and is not any more. Sums run in accelerate's order:
    each node's tensors in order, then each subtree into its parent, last node first. O(nodes + moved).
    """
    size, size_acc = read.size, read.size_accelerate
    for k, root in moved.items():
        size[read.t_module[k]] -= read.t_nbytes[k]  # int bytes: exact whatever the order
        storage[k] = root
    for i, parent in zip(range(len(size) - 1, 0, -1), reversed(read.parents)):  # preorder: children after parents
        size[parent] += size[i]
        size_acc[parent] += size_acc[i]
    return tuple(size), tuple(size_acc)


def _tied_groups(model, read: _Reader, names: Sequence[str], tensor_index: Mapping[str, int],
                 tied_parameters: Sequence[Sequence[str]] | None) -> list[tuple[str, ...]]:
    """The caller's ``tied_parameters``, else shared tensors grouped as accelerate's ``find_tied_parameters`` does."""
    if tied_parameters is not None:
        tied = []
        for group in tied_parameters:
            missing = [n for n in group if n not in tensor_index]
            if missing:
                raise InvalidOption(f"tied_parameters names unknown tensors {missing[:5]}.")
            if len(group) > 1:
                tied.append(tuple(group))
        return tied
    if read.repeats:  # the walk's tables and torch's generators may differ: ask torch
        all_params = [(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)]
        return _find_tied(all_params, {name: id(p) for name, p in model.named_parameters()})
    if read.shared_params:
        # named_parameters(remove_duplicate=False) is this walk's parameters in order; named_parameters() keeps
        # the first name of each object (a module under a second path is skipped whole, and its parameters were
        # all seen under the first). Two parameters are one object exactly when they have the same canonical.
        canonical = read.t_canonical
        params = [k for k, is_param in enumerate(read.t_is_param) if is_param]
        unique = {names[k]: canonical[k] for k in params if canonical[k] == k}
        return _find_tied([(names[k], canonical[k]) for k in params], unique)
    return []


class _PerElement:
    """Bytes per element of a tensor dtype under the ``dtype`` rule (real, accelerate's), memoised per dtype."""

    def __init__(self, target):
        self.target = target
        self.known: dict = {}

    def __call__(self, dtype) -> tuple[int, float]:
        found = self.known.get(dtype)
        if found is None:
            own_real, own_acc = dtype_bytes(dtype)
            if self.target is None or _keeps_dtype(dtype):
                found = own_real, own_acc
            else:
                t_real, t_acc = dtype_bytes(self.target)
                found = min(t_real, own_real), min(t_acc, own_acc)
            self.known[dtype] = found
        return found


def _tensor_bytes(name, tensor, target, special, size_fn, numel) -> tuple[int, float]:
    if size_fn is not None:
        custom = size_fn(name, tensor)
        if custom is not None:
            if not isinstance(custom, (int, float)) or custom < 0 or custom != custom:
                raise InvalidOption(f"size_fn returned {custom!r} for {name!r}; it must return bytes >= 0 or None.")
            return int(custom), custom
    own_real, own_acc = dtype_bytes(tensor.dtype)
    if name in special:
        real, acc = dtype_bytes(special[name])
        return _whole(numel * real), numel * acc
    if target is None or _keeps_dtype(tensor.dtype):
        return _whole(numel * own_real), numel * own_acc
    t_real, t_acc = dtype_bytes(target)
    return _whole(numel * min(t_real, own_real)), numel * min(t_acc, own_acc)


def _whole(nbytes: float) -> int:
    """Whole bytes: a packed (sub-byte) tensor's last byte is stored whole."""
    return nbytes if isinstance(nbytes, int) else math.ceil(nbytes)
