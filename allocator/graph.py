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


@dataclass(frozen=True, slots=True)
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


def _walk(model) -> tuple[list, list]:
    """Preorder ``named_children`` walk by path: [(name, module, parent_index)], object ids per node."""
    nodes: list[tuple[str, object, int]] = [("", model, -1)]
    stack = [(0, iter(model.named_children()), {id(model)})]
    while stack:
        index, children, on_path = stack[-1]
        step = next(children, None)
        if step is None:
            stack.pop()
            continue
        local, child = step
        if id(child) in on_path:
            raise InvalidModel(
                f"module {nodes[index][0] or '<root>'!r} contains itself through child {local!r}: "
                "a cycle in the module graph cannot be placed; remove the back-reference."
            )
        name = f"{nodes[index][0]}.{local}" if nodes[index][0] else local
        nodes.append((name, child, index))
        if len(nodes) > _MAX_NODES:
            raise InvalidModel(f"more than {_MAX_NODES} module paths: shared sub-modules explode the tree.")
        stack.append((len(nodes) - 1, iter(child.named_children()), on_path | {id(child)}))
    return nodes, [id(m) for _, m, _ in nodes]


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


def _share_declared_ties(model, tensors: list[TensorNode]) -> list[TensorNode]:
    """Point each declared tie target (transformers' ``all_tied_weights_keys``: target -> source) at its source's
    memory. transformers plans a device map before it ties weights, so the two are separate objects then, but they
    share memory once loaded."""
    import dataclasses

    out = [dataclasses.replace(t, storage=t.canonical) for t in tensors]
    declared = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(declared, Mapping):
        return out
    index = {t.name: t._index for t in out}
    for target, source in declared.items():
        if target in index and source in index:
            root = out[index[source]].storage
            i = index[target]
            if out[i].storage == i and root != i:
                out[i] = dataclasses.replace(out[i], storage=root)
    return out


def _find_tied(all_params: list[tuple[str, object]], unique: dict[str, object]) -> list[tuple[str, ...]]:
    """accelerate's ``find_tied_parameters``, same grouping and the same group order."""
    tied_names = {n for n, _ in all_params} - set(unique)
    by_name = dict(all_params)
    groups: dict[str, list[str]] = {}
    for tied in tied_names:
        param = by_name[tied]
        for name, candidate in unique.items():
            if candidate is param:
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
    found: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
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
    if discover_no_split:
        no_split |= no_split_classes(model)
    declared_no_split = frozenset(no_split)
    if infer_no_split and not no_split:
        from .introspect import infer_blocks

        no_split = infer_blocks(model)
        if no_split:
            log.info("%s declares no no-split classes; keeping its repeated blocks %s whole "
                     "(pass no_split_module_classes, or infer_no_split=False, to change this)",
                     type(model).__name__, sorted(no_split))
    target = _as_dtype(dtype, "dtype") if dtype is not None else None
    special = {}
    for key, value in (special_dtypes or {}).items():
        special[key] = _as_dtype(value, f"special_dtypes[{key!r}]")

    walked, object_ids = _walk(model)
    first_node_of: dict[int, int] = {}
    nodes_children: list[list[int]] = [[] for _ in walked]
    for i, (_, _, parent) in enumerate(walked):
        if parent >= 0:
            nodes_children[parent].append(i)

    tensors: list[TensorNode] = []
    seen_storage: dict[tuple[int, bool], int] = {}
    node_params: list[tuple[int, ...]] = []
    node_buffers: list[tuple[int, ...]] = []
    for i, (name, module, _) in enumerate(walked):
        first_node_of.setdefault(object_ids[i], i)
        prefix = f"{name}." if name else ""
        own: list[list[int]] = [[], []]
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        members = [(True, n, t) for n, t in module.named_parameters(recurse=False)]
        members += [(False, n, t) for n, t in module.named_buffers(recurse=False)]
        for is_param, local, tensor in members:
            full = prefix + local
            numel = tensor.numel()
            real, accel = _tensor_bytes(full, tensor, target, special, size_fn, numel)
            index = len(tensors)
            key = (id(tensor), is_param)
            canonical = seen_storage.setdefault(key, index)
            tensors.append(TensorNode(
                name=full, module=i, local=local, is_param=is_param,
                persistent=is_param or local not in non_persistent, numel=numel,
                nbytes=real, nbytes_accelerate=accel, canonical=canonical, _index=index,
            ))
            own[0 if is_param else 1].append(index)
        node_params.append(tuple(own[0]))
        node_buffers.append(tuple(own[1]))

    tensors = _share_declared_ties(model, tensors)
    unknown_special = set(special) - {t.name for t in tensors}
    if unknown_special:
        raise InvalidOption(
            f"special_dtypes names tensors the model does not have: {sorted(unknown_special)[:5]}; "
            "use full parameter names as in model.named_parameters()."
        )

    nodes = tuple(
        ModuleNode(
            name=name, cls=type(module).__name__, parent=parent, children=tuple(nodes_children[i]),
            params=node_params[i], buffers=node_buffers[i],
            alias_of=-1 if first_node_of[object_ids[i]] == i else first_node_of[object_ids[i]],
        )
        for i, (name, module, parent) in enumerate(walked)
    )
    size = [0] * len(nodes)
    size_acc = [0] * len(nodes)
    for t in tensors:
        if t.storage == t._index:
            size[t.module] += t.nbytes
        if t.canonical == t._index:
            size_acc[t.module] += t.nbytes_accelerate
    for i in range(len(nodes) - 1, 0, -1):  # preorder: children come after parents
        size[nodes[i].parent] += size[i]
        size_acc[nodes[i].parent] += size_acc[i]

    tensor_index = {t.name: t._index for t in tensors}
    if tied_parameters is not None:
        tied = []
        for group in tied_parameters:
            missing = [n for n in group if n not in tensor_index]
            if missing:
                raise InvalidOption(f"tied_parameters names unknown tensors {missing[:5]}.")
            if len(group) > 1:
                tied.append(tuple(group))
    else:
        all_params = list(model.named_parameters(remove_duplicate=False))
        tied = _find_tied(all_params, dict(model.named_parameters()))
    already = {n for g in tied for n in g}
    declared_ties = [g for g in _declared_tied_groups(model, set(tensor_index)) if not set(g) <= already]
    if no_split_module_classes:
        present = {n.cls for n in nodes}
        for c in sorted(set(no_split_module_classes) - present):
            log.warning("no-split class %r matches no module of %s; check the spelling.", c, type(model).__name__)
    return ModelGraph(
        nodes=nodes, tensors=tuple(tensors), size=tuple(size), size_accelerate=tuple(size_acc),
        no_split=frozenset(no_split), no_split_declared=declared_no_split, tied_groups=tuple(tied), declared_ties=tuple(declared_ties),
        node_index={n.name: i for i, n in enumerate(nodes)}, tensor_index=tensor_index,
        model_class=type(model).__name__,
    )


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
