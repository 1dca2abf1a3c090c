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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import InvalidModel, InvalidOption

__all__ = ["ModuleNode", "TensorNode", "ModelGraph", "build_graph", "dtype_bytes"]

log = logging.getLogger(__name__)

SizeFn = Callable[[str, object], "int | None"]


@dataclass(frozen=True, slots=True)
class TensorNode:
    """One parameter or buffer."""

    name: str            # full path, e.g. "model.layers.0.mlp.up_proj.weight"
    module: int          # index of the owning node
    local: str           # name inside the owning module
    is_param: bool
    persistent: bool     # False for non-persistent buffers (never offloaded by accelerate)
    numel: int
    nbytes: int          # real bytes under dtype / special_dtypes / quantizer (bool and int keep their size)
    nbytes_accelerate: float  # bytes as accelerate counts them (a bool element is 1/8 byte there)
    canonical: int       # index of the first tensor that is the same object (itself if unshared): accelerate's view
    storage: int = -1    # index of the tensor whose memory this one uses: ``canonical``, or a declared tie's source

    @property
    def counted(self) -> int:
        """Bytes this name contributes to sizes (0 when it shares another tensor's memory)."""
        return self.nbytes if self.storage == self._index else 0

    _index: int = -1


@dataclass(frozen=True, slots=True)
class ModuleNode:
    """One module, by path."""

    name: str
    cls: str                      # class name, as no-split matching uses it
    parent: int                   # -1 for the root
    children: tuple[int, ...]     # named_children order
    params: tuple[int, ...]       # direct parameters, named_parameters(recurse=False) order
    buffers: tuple[int, ...]      # direct buffers, named_buffers(recurse=False) order
    alias_of: int                 # first node of the same module object, or -1


@dataclass(frozen=True, slots=True, weakref_slot=True)
class ModelGraph:
    """Frozen description of a model for planning.

    ``size[i]`` / ``size_accelerate[i]`` are the counted bytes of node ``i``'s subtree (accelerate's
    ``compute_module_sizes``); ``stream[i]`` is the streamed size of node ``i`` alone (its direct parameters).
    """

    nodes: tuple[ModuleNode, ...]
    tensors: tuple[TensorNode, ...]
    size: tuple[int, ...]
    size_accelerate: tuple[float, ...]
    no_split: frozenset[str]     # what plans keep whole: declared, or inferred blocks when nothing is declared
    no_split_declared: frozenset[str]  # the caller's united with every sub-model's ``_no_split_modules``
    tied_groups: tuple[tuple[str, ...], ...]  # shared tensors, in accelerate's find_tied_parameters order
    declared_ties: tuple[tuple[str, ...], ...]  # the model's declared tied keys not already shared
    node_index: Mapping[str, int] = field(repr=False)
    tensor_index: Mapping[str, int] = field(repr=False)
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
        n = self.nodes[node]
        return bool(n.children) and n.cls not in self.no_split

    def direct_param_bytes(self, node: int) -> int:
        """Real bytes of a node's direct parameters (what its offload hook streams)."""
        return sum(self.tensors[t].nbytes for t in self.nodes[node].params)

    def all_tie_groups(self) -> tuple[tuple[str, ...], ...]:
        """Shared tensors and declared ties together: every group must live on one device."""
        return self.tied_groups + self.declared_ties


def _slot_constructor(cls):
    """A positional constructor (every field, in order) for a frozen slotted dataclass that fills the slots directly.

    The generated ``__init__`` sets each field through ``object.__setattr__``, which doubles the cost of building the
    hundreds of thousands of nodes of a large model. Generated from the fields, as dataclasses generates ``__init__``.
    """
    import dataclasses

    found = dataclasses.fields(cls)
    if any(f.default_factory is not dataclasses.MISSING for f in found) or hasattr(cls, "__post_init__"):
        return cls
    fields = [f.name for f in found]
    namespace = {"_new": object.__new__, "_cls": cls, **{f"_set{k}": getattr(cls, n).__set__ for k, n in enumerate(fields)}}
    params = []
    for k, f in enumerate(found):
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            namespace[f"_default{k}"] = f.default
            params.append(f"{f.name}=_default{k}")
    lines = [f"def make({', '.join(params)}):", "    self = _new(_cls)"]
    lines += [f"    _set{k}(self, {n})" for k, n in enumerate(fields)]
    exec("\n".join(lines + ["    return self"]), namespace)  # noqa: S102 - source built from field names only
    return namespace["make"]


_new_tensor = _slot_constructor(TensorNode)
_new_module = _slot_constructor(ModuleNode)


# ----------------------------------------------------------------------------------------------- sizes
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _as_dtype(dtype, what: str):
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


def dtype_bytes(dtype) -> tuple[int, float]:
    """(real bytes per element, bytes per element as accelerate's ``dtype_byte_size`` says).

    >>> import torch
    >>> dtype_bytes(torch.bool), dtype_bytes(torch.float16)
    ((1, 0.125), (2, 2))
    """
    found = _DTYPE_BYTES.get(dtype)
    if found is None:
        found = _DTYPE_BYTES[dtype] = _dtype_bytes(dtype)
    return found


_DTYPE_BYTES: dict = {}  # dtype -> dtype_bytes(dtype); torch dtypes are few and immutable


def _dtype_bytes(dtype) -> tuple[int, float]:
    import torch

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
    parameters and buffers (``named_parameters(recurse=False)``, ``named_buffers(recurse=False)``) into tensors.

    The fast pass reads each module's ``_modules``, ``_parameters`` and ``_buffers`` directly, skipping ``None`` but
    not repeated objects. Where a table repeats an object (torch's generators yield it once), ``exact`` is False and
    the builder reads again with ``careful=True``, which drops repeats as torch does. ``repeats`` says that torch's
    own generators must be asked about shared parameters (a class overrides them, or a table repeats an object).
    """

    def __init__(self, model, size_of, per_element: _PerElement | None, careful: bool = False):
        self.size_of = size_of          # (name, tensor, numel) -> (bytes, accelerate's bytes)
        self.per_element = per_element  # the same by dtype alone, when no tensor has a size of its own
        self.careful = careful
        self.names: list[str] = [""]
        self.modules: list = [model]
        self.parents: list[int] = [-1]
        self.params: list[tuple[int, ...]] = []
        self.buffers: list[tuple[int, ...]] = []
        self.tensors: list[TensorNode] = []
        self.objects: list = []          # the tensor object of each TensorNode
        self.seen_params: dict[int, int] = {}   # id of a parameter -> its first tensor index
        self.seen_buffers: dict[int, int] = {}
        self.exact = True
        self.repeats = False
        self.shared_params = False       # some parameter object has two names
        self.nodes: list[ModuleNode | None] = [None]  # each built once its children are known
        self.first_node_of: dict[int, int] = {id(model): 0}  # module object -> its first node
        names, modules, parents, nodes, first_node_of = self.names, self.modules, self.parents, self.nodes, \
            self.first_node_of
        alias_of = [-1]
        on_path = {id(model)}
        stack = [(0, self._read(0, model), [])]
        while stack:
            index, children, kids = stack[-1]
            step = next(children, None)
            if step is None:
                stack.pop()
                module = modules[index]
                on_path.discard(id(module))
                nodes[index] = _new_module(names[index], type(module).__name__, parents[index], tuple(kids),
                                           self.params[index], self.buffers[index], alias_of[index])
                continue
            local, child = step
            if child is None:
                continue
            if id(child) in on_path:
                raise InvalidModel(
                    f"module {names[index] or '<root>'!r} contains itself through child {local!r}: "
                    "a cycle in the module graph cannot be placed; remove the back-reference."
                )
            new = len(names)
            if new >= _MAX_NODES:
                raise InvalidModel(f"more than {_MAX_NODES} module paths: shared sub-modules explode the tree.")
            names.append(f"{names[index]}.{local}" if names[index] else local)
            modules.append(child)
            parents.append(index)
            nodes.append(None)
            kids.append(new)
            first = first_node_of.setdefault(id(child), new)
            if first != new:
                alias_of.append(first)
                if parents[first] == index:
                    self.exact = False  # one module lists a child twice: named_children yields it once
            else:
                alias_of.append(-1)
            on_path.add(id(child))
            stack.append((new, self._read(new, child), []))

    def _read(self, i: int, module):
        """Read a module's direct tensors; return an iterator over its children."""
        plain = _PLAIN.get(type(module))
        if plain is None:
            plain = _plain(type(module))
        if not plain:
            self.repeats = True
            params = module.named_parameters(recurse=False)
            buffers = module.named_buffers(recurse=False)
            children = module.named_children()
        elif self.careful:
            params, repeated = _unique_items(module._parameters)
            buffers = _unique_items(module._buffers)[0]
            children, again = _unique_items(module._modules)
            self.repeats |= repeated or again
        else:
            params = module._parameters.items() if module._parameters else ()
            buffers = module._buffers.items() if module._buffers else ()
            children = module._modules.items() if module._modules else ()
        name = self.names[i]
        prefix = f"{name}." if name else ""
        self.params.append(self._tensors(i, prefix, params, True, ()) if params else ())
        self.buffers.append(
            self._tensors(i, prefix, buffers, False, getattr(module, "_non_persistent_buffers_set", set()))
            if buffers else ())
        return iter(children)

    def _tensors(self, i: int, prefix: str, members, is_param: bool, non_persistent) -> tuple[int, ...]:
        tensors, objects, size_of, per_element = self.tensors, self.objects, self.size_of, self.per_element
        known = per_element.known if per_element is not None else None
        seen = self.seen_params if is_param else self.seen_buffers
        first = len(tensors)
        for local, tensor in members:
            if tensor is None:
                continue
            index = len(tensors)
            canonical = seen.setdefault(id(tensor), index)
            if canonical != index:
                if tensors[canonical].module == i:
                    self.exact = False   # one module lists the object twice: torch's generators yield it once
                if is_param:
                    self.shared_params = True
            full = prefix + local
            numel = tensor.numel()
            if known is not None:
                per = known.get(tensor.dtype) or per_element(tensor.dtype)
                real, accel = numel * per[0], numel * per[1]
            else:
                real, accel = size_of(full, tensor, numel)
            tensors.append(_new_tensor(full, i, local, is_param, is_param or local not in non_persistent, numel, real,
                                       accel, canonical, canonical, index))
            objects.append(tensor)
        return tuple(range(first, len(tensors)))


def _read_model(model, size_of, by_dtype) -> _Reader:
    """Read the model, again carefully where the fast read was not exact. The cyclic garbage collector is paused
    meanwhile: the read creates hundreds of thousands of acyclic objects, and each collection it would trigger walks
    the model's own objects too (10-20 % of the read on a 50k-module model)."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        read = _Reader(model, size_of, by_dtype)
        if not read.exact:
            read = _Reader(model, size_of, by_dtype, careful=True)
        return read
    finally:
        if enabled:
            gc.enable()


def _declared_tied_groups(model, names: set[str]) -> list[tuple[str, ...]]:
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


def _share_declared_ties(model, storage: list[int], index: Mapping[str, int]) -> None:
    """Point each declared tie target (transformers' ``all_tied_weights_keys``: target -> source) at its source's
    memory, in ``storage`` (tensor index -> index of the tensor whose memory it uses). transformers plans a device
    map before it ties weights, so the two are separate objects then, but they share memory once loaded."""
    declared = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(declared, Mapping):
        return
    for target, source in declared.items():
        if target in index and source in index:
            root = storage[index[source]]
            i = index[target]
            if storage[i] == i and root != i:
                storage[i] = root


def _find_tied(all_params: list[tuple[str, object]], unique: dict[str, object]) -> list[tuple[str, ...]]:
    """accelerate's ``find_tied_parameters``, same grouping and the same group order (the tied names are visited in
    the iteration order of the same set, built the same way)."""
    tied_names = {n for n, _ in all_params} - set(unique)
    if not tied_names:
        return []
    by_name = dict(all_params)
    first_name = {}
    for name, candidate in unique.items():  # unique holds each object once: its first name
        first_name.setdefault(id(candidate), name)
    groups: dict[str, list[str]] = {}
    for tied in tied_names:
        name = first_name.get(id(by_name[tied]))
        if name is not None:
            groups.setdefault(name, []).append(tied)
    return [tuple(sorted([w] + list(set(t)))) for w, t in groups.items()]


def no_split_classes(model) -> set[str]:
    """``_no_split_modules`` of the model and of every sub-model, united.

    >>> import torch.nn as nn
    >>> class Tower(nn.Module):
    ...     _no_split_modules = ["Block"]
    >>> no_split_classes(nn.Sequential(Tower()))
    {'Block'}
    """
    return _declared_no_split(model.modules())


_NOT_FOUND = object()


def _declared_no_split(modules) -> set[str]:
    found: set[str] = set()
    by_class: dict[type, object] = {}
    for module in modules:
        declared = module.__dict__.get("_no_split_modules", _NOT_FOUND)
        if declared is _NOT_FOUND:
            cls = type(module)
            declared = by_class.get(cls, _NOT_FOUND)
            if declared is _NOT_FOUND:
                declared = getattr(cls, "_no_split_modules", None)
                if hasattr(type(declared), "__get__"):  # a property or other descriptor: ask the instance
                    declared = getattr(module, "_no_split_modules", None)
                else:
                    by_class[cls] = declared
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
    target = _as_dtype(dtype, "dtype") if dtype is not None else None
    special = {}
    for key, value in (special_dtypes or {}).items():
        special[key] = _as_dtype(value, f"special_dtypes[{key!r}]")

    per_element = _PerElement(target)


    def size_of(name, tensor, numel):
        if size_fn is None and name not in special:
            real, accel = per_element(tensor.dtype)
            return numel * real, numel * accel
        return _tensor_bytes(name, tensor, target, special, size_fn, numel)

    by_dtype = per_element if size_fn is None and not special else None

    read = _read_model(model, size_of, by_dtype)
    modules, tensors, nodes, first_node_of = read.modules, read.tensors, tuple(read.nodes), read.first_node_of

    if discover_no_split:
        no_split |= _declared_no_split(modules[i] for i in first_node_of.values()) if not read.repeats \
            else no_split_classes(model)
    declared_no_split = frozenset(no_split)
    if infer_no_split and not no_split:
        from .introspect import infer_blocks

        no_split = infer_blocks(model)
        if no_split:
            log.info("%s declares no no-split classes; keeping its repeated blocks %s whole "
                     "(pass no_split_module_classes, or infer_no_split=False, to change this)",
                     type(model).__name__, sorted(no_split))

    tensor_index = {t.name: k for k, t in enumerate(tensors)}
    if isinstance(getattr(model, "all_tied_weights_keys", None), Mapping):
        import dataclasses

        storage = [t.storage for t in tensors]
        _share_declared_ties(model, storage, tensor_index)
        for k, root in enumerate(storage):
            if root != tensors[k].storage:
                tensors[k] = dataclasses.replace(tensors[k], storage=root)
    tensors = tuple(tensors)
    unknown_special = set(special) - tensor_index.keys()
    if unknown_special:
        raise InvalidOption(
            f"special_dtypes names tensors the model does not have: {sorted(unknown_special)[:5]}; "
            "use full parameter names as in model.named_parameters()."
        )

    size = [0] * len(nodes)
    size_acc = [0] * len(nodes)
    for k, t in enumerate(tensors):
        if t.storage == k:
            size[t.module] += t.nbytes
        if t.canonical == k:
            size_acc[t.module] += t.nbytes_accelerate
    parents = read.parents
    for i in range(len(nodes) - 1, 0, -1):  # preorder: children come after parents
        size[parents[i]] += size[i]
        size_acc[parents[i]] += size_acc[i]

    if tied_parameters is not None:
        tied = []
        for group in tied_parameters:
            missing = [n for n in group if n not in tensor_index]
            if missing:
                raise InvalidOption(f"tied_parameters names unknown tensors {missing[:5]}.")
            if len(group) > 1:
                tied.append(tuple(group))
    elif read.repeats:  # the walk's tables and torch's generators may differ: ask torch
        all_params = list(model.named_parameters(remove_duplicate=False))
        tied = _find_tied(all_params, dict(model.named_parameters()))
    elif read.shared_params:
        # named_parameters(remove_duplicate=False) is this walk's parameters in order; named_parameters() keeps
        # the first name of each object (a module under a second path is skipped whole, and its parameters were
        # all seen under the first).
        objects = read.objects
        all_params = [(t.name, objects[k]) for k, t in enumerate(tensors) if t.is_param]
        unique = {t.name: objects[k] for k, t in enumerate(tensors) if t.is_param and t.canonical == k}
        tied = _find_tied(all_params, unique)
    else:
        tied = []
    already = {n for g in tied for n in g}
    declared_ties = [g for g in _declared_tied_groups(model, set(tensor_index)) if not set(g) <= already]
    if no_split_module_classes:
        present = {n.cls for n in nodes}
        for c in sorted(set(no_split_module_classes) - present):
            log.warning("no-split class %r matches no module of %s; check the spelling.", c, type(model).__name__)
    return ModelGraph(
        nodes=nodes, tensors=tensors, size=tuple(size), size_accelerate=tuple(size_acc),
        no_split=frozenset(no_split), no_split_declared=declared_no_split, tied_groups=tuple(tied), declared_ties=tuple(declared_ties),
        node_index={n.name: i for i, n in enumerate(nodes)}, tensor_index=tensor_index,
        model_class=type(model).__name__,
    )


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
        return numel * real, numel * acc
    if target is None or _keeps_dtype(tensor.dtype):
        return numel * own_real, numel * own_acc
    t_real, t_acc = dtype_bytes(target)
    return numel * min(t_real, own_real), numel * min(t_acc, own_acc)
