"""The reader: one walk of an ``nn.Module`` into the columns of a :class:`~allocator.model.graph.ModelGraph`.

This is the only module of the package that reads the model's children, parameters and buffers; :func:`build_graph`
hands what the walk found to the package's rules: sizes (:mod:`~allocator.model.sizes`), ties
(:mod:`~allocator.model.ties`) and no-split classes (:mod:`~allocator.model.no_split`), the declared ties and no-split
classes as the model's family says (:func:`allocator.model.families.family_of`: by default the declarations and
repeated blocks of :mod:`allocator.model.blocks`). Strategies read the frozen graph and never the model.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from ..errors import InvalidModel, InvalidOption
from ..gc_pause import gc_paused
from .families import Family, family_of
from .graph import ModelGraph, Nodes, TensorIndex, Tensors
from .no_split import Walked, given_classes, keep_whole, warn_unmatched
from .sizes import PerElement, SizeFn, SizeOf, as_dtype, dtype_bytes, size_rule, subtree_sizes
from .table import Paths, frozen
from .ties import declared_storage, declared_tied_groups, find_tied, given_ties, shared_tied_groups

__all__ = ["build_graph", "ModelIdentity", "identify"]

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

    def __init__(self, model, size_of: SizeOf, per_element: PerElement | None, careful: bool = False,
                 casts: bool = False):
        self.size_of = size_of          # (name, tensor, numel) -> (bytes, accelerate's bytes)
        self.per_element = per_element  # the same by dtype alone, when no tensor has a size of its own
        self.casts = casts              # a target dtype decides sizes: note what tensors are stored as (``stored``)
        self.stored: dict[int, int] = {}  # tensor -> bytes at its own dtype, where the target dtype makes it smaller
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

    def unique_modules(self) -> Iterator:
        """Each module object the walk met, once (at its first path), in preorder of those paths."""
        return (self.modules[i] for i in self.first_node_of.values())

    def _walk(self, model) -> None:
        """Visit every path in preorder from an explicit stack (a model may nest deeper than Python's recursion limit).

        Each module visited goes through four steps: *the node* (its path, class and parent; an alias when the
        object was met under another path, :meth:`_repeated`), *its tables* (children, parameters, buffers: read
        directly from a plain class, else as torch's generators yield them, :meth:`_tables`), *its tensors*
        (:meth:`_tensor_step`), and *its children*, pushed on the stack. An entry to visit is
        ``(parent, name, module)``; a node with children goes back on the stack under them as ``(node, None, None)``,
        and popped again, its subtree is complete and its ``end`` is known.
        """
        names, modules, parents, end = self.names, self.modules, self.parents, self.end
        first_node_of, classes, careful = self.first_node_of, self.classes, self.careful
        add_cls, add_alias, add_end = self.cls.append, self.alias_of.append, end.append
        read_tensors = self._tensor_step()
        stack: list[tuple] = [(-1, "", model)]
        # The node, tables and children steps are inlined: this loop is most of the time of reading a large model.
        while stack:
            parent, name, module = stack.pop()
            if name is None:  # (node, None, None): its subtree is complete
                end[parent] = len(names)
                continue

            # the node
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

            # its tables
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

            # its tensors
            prefix = f"{name}." if name else ""
            read_tensors(i, prefix, module, params, buffers)

            # its children
            if children:
                add_end(-1)
                stack.append((i, None, None))
                stack.extend(reversed([(i, prefix + local, child)  # reversed: the first child pops next
                                       for local, child in children if child is not None]))
            else:
                add_end(i + 1)

    def _tensor_step(self) -> Callable[[int, str, object, Iterable, Iterable], None]:
        """The walk's tensors step, ``read(i, prefix, module, params, buffers)``: node ``i``'s direct parameters,
        then its buffers (``(local name, tensor)`` pairs, ``None`` skipped), appended to the tensor columns, and the
        node's ``first``, ``n_params``, ``n_buffers`` and direct counted sizes.

        A tensor is counted unless it is a second name of an object met before (``canonical`` is that first name's
        index). A closure over the columns' bound ``append`` methods, made once per walk: a method would look them up
        again at every module.
        """
        add_first, add_n_params, add_n_buffers = self.first.append, self.n_params.append, self.n_buffers.append
        add_size, add_size_accelerate = self.size.append, self.size_accelerate.append
        module_of = self.t_module
        add_module, add_local, add_param, add_persistent, add_numel, add_nbytes, add_accel, add_canonical = (
            module_of.append, self.t_local.append, self.t_is_param.append, self.t_persistent.append,
            self.t_numel.append, self.t_nbytes.append, self.t_nbytes_accelerate.append, self.t_canonical.append)
        size_of, per_element, casts, stored = self.size_of, self.per_element, self.casts, self.stored
        known = per_element.known if per_element is not None else None  # bytes per element by dtype, when enough
        kinds = ((True, self.seen_params), (False, self.seen_buffers))

        def read(i: int, prefix: str, module, params: Iterable, buffers: Iterable) -> None:
            count = start = len(module_of)  # tensors so far
            add_first(start)
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
                    keeps = local in non_persistent   # in no checkpoint: no loader casts it (``SizeOf``)
                    if known is not None:
                        per = known.get(tensor.dtype) or per_element(tensor.dtype)
                        nbytes, nbytes_accel = numel * per[0], numel * per[1]
                        if keeps and per_element.casts:
                            nbytes = numel * dtype_bytes(tensor.dtype)[0]
                    else:
                        nbytes, nbytes_accel = size_of(prefix + local, tensor, numel, keeps)
                    if casts and not keeps and tensor.is_floating_point():
                        own = numel * dtype_bytes(tensor.dtype)[0]
                        if own > nbytes:
                            stored[count] = own
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

        return read

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


def _read_model(model, size_of: SizeOf, by_dtype: PerElement | None, casts: bool) -> _Reader:
    """Read the model, again carefully where the fast read was not exact."""
    read = _Reader(model, size_of, by_dtype, casts=casts)
    if not read.exact:
        read = _Reader(model, size_of, by_dtype, careful=True, casts=casts)
    return read


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
    declared_as_shared: bool = False,
    family: Family | None = None,
) -> ModelGraph:
    """Extract a :class:`~allocator.model.graph.ModelGraph` from ``model`` (any ``nn.Module``, meta device included).

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
        (:func:`allocator.model.blocks.infer_blocks`); logged. ``sequential`` ignores them, as accelerate does.
    tied_parameters : list of list of str, optional
        Replaces the tie groups found from shared tensors.
    size_fn : callable, optional
        ``size_fn(name, tensor) -> bytes or None`` for quantized weights; ``None`` falls back to the dtype rule.
    declared_as_shared : bool
        Read transformers' declared tied keys (``all_tied_weights_keys``) as shared tensors, as the model will be
        once ``from_pretrained`` has tied them (it plans before it ties): the graph of a model with its ties only
        declared is then the graph of the same model tied.
    family : Family, optional
        The model's family (:func:`allocator.model.families.family_of`, the default): its hooks say what the model
        declares unsplittable, which blocks are inferred, and which ties are declared.

    Raises
    ------
    InvalidModel, InvalidOption

    Notes
    -----
    Complexity: O(modules + tensors) time and memory (a module object under several paths counts once per path):
    one walk of the module tree, a second where a module lists an object twice, and
    :func:`~allocator.model.blocks.infer_blocks` when it runs. The cyclic garbage collector is paused meanwhile.
    """
    require_module(model)
    family = family_of(model) if family is None else family
    given = given_classes(no_split_module_classes)
    target = as_dtype(dtype, "dtype") if dtype is not None else None
    special = {key: as_dtype(value, f"special_dtypes[{key!r}]") for key, value in (special_dtypes or {}).items()}
    size_of, by_dtype = size_rule(target, special, size_fn)

    with gc_paused():
        # a floating target is a cast the loaders make (an integer one sizes quantized weights: no cast is read)
        casts = target is not None and target.is_floating_point and size_fn is None
        read = _read_model(model, size_of, by_dtype, casts=casts)
        found = None
        if discover_no_split:
            found = set(family.no_split(model, Walked(read.unique_modules(), read.classes, per_module=read.own_no_split,
                                                      ask_torch=read.repeats)))
        no_split, declared_classes = keep_whole(model, given, found, infer=infer_no_split,
                                                infer_with=family.infer_no_split)
        nodes = Nodes(read.names, read.cls, read.parents, read.alias_of, read.first, read.n_params, read.n_buffers,
                      read.end)
        node_index = dict(zip(nodes.name, range(len(nodes))))  # zip: no Python loop
        module, local = frozen(read.t_module), tuple(read.t_local)
        names = Paths(nodes.name, module, local)
        tensor_index = TensorIndex(node_index, nodes, local, names)
        declared = family.tied_keys(model)
        storage = read.t_canonical[:]   # a copy
        moved = declared_storage(declared, storage, tensor_index)
        unknown_special = [k for k in special if k not in tensor_index]
        if unknown_special:
            raise InvalidOption(
                f"special_dtypes names tensors the model does not have: {sorted(unknown_special)[:5]}; "
                "use full parameter names as in model.named_parameters()."
            )
        canonical = read.t_canonical[:] if declared_as_shared and moved else read.t_canonical
        for k, root in moved.items():  # a declared tie's target is counted no more: it uses its source's memory
            read.size[read.t_module[k]] -= read.t_nbytes[k]  # int bytes: exact whatever the order
            storage[k] = root
            if canonical is not read.t_canonical:   # and, read as shared, it is the same tensor as its source
                canonical[k] = root
                read.size_accelerate[read.t_module[k]] -= read.t_nbytes_accelerate[k]
        size, size_acc = subtree_sizes(read.size, read.size_accelerate, read.parents)
        tensors = Tensors(names, module, local, read.t_is_param, read.t_persistent, read.t_numel,
                          read.t_nbytes, read.t_nbytes_accelerate, canonical, storage)
        tied = _tie_groups(model, read, names, tensor_index, tied_parameters)
        already = {n for g in tied for n in g}
        declared_ties = [g for g in declared_tied_groups(declared, tensor_index) if not set(g) <= already]
        if declared_as_shared and tied_parameters is None:
            tied, declared_ties = _united(tied + declared_ties), []
        if given:
            warn_unmatched(given, read.classes, type(model).__name__)
        graph = ModelGraph(
            nodes=nodes, tensors=tensors, size=size, size_accelerate=size_acc,
            no_split=frozenset(no_split), no_split_declared=declared_classes, tied_groups=tuple(tied),
            declared_ties=tuple(declared_ties), node_index=node_index, tensor_index=tensor_index,
            model_class=type(model).__name__, stored=read.stored,
        )
        del read  # free the walk's lists now: the collection that resuming the collector starts skips them
        return graph


def _united(groups: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Tie groups that share a name merged into one (in the order of their first group)."""
    out: list[list[str]] = []
    for group in groups:
        hits = [g for g in out if set(g) & set(group)]
        merged = [n for g in hits for n in g] + [n for n in group if not any(n in g for g in hits)]
        out = [g for g in out if g not in hits] + [merged]
    return [tuple(dict.fromkeys(g)) for g in out]


def _tie_groups(model, read: _Reader, names: Sequence[str], tensor_index: Mapping[str, int],
                tied_parameters: Sequence[Sequence[str]] | None) -> list[tuple[str, ...]]:
    """The caller's ``tied_parameters``, else shared tensors grouped as accelerate's ``find_tied_parameters`` does:
    from the walk's columns, or from torch's generators where the walk's tables and theirs may differ."""
    if tied_parameters is not None:
        return given_ties(tied_parameters, tensor_index)
    if read.repeats:
        all_params = [(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)]
        return find_tied(all_params, {name: id(p) for name, p in model.named_parameters()})
    if read.shared_params:
        return shared_tied_groups(names, read.t_is_param, read.t_canonical)
    return []


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What a plan records of the model it was made for (``Plan.to_dict()["model"]``).

    ``digest`` is the SHA-256 (hex) of one line per parameter, then per buffer, in ``named_parameters()`` then
    ``named_buffers()`` order (shared tensors once, as those generators yield them): ``"p"`` or ``"b"``, the full name
    and the shape, tab-separated. It covers the architecture as the planner sees it (names, shapes, which are
    parameters), not the dtypes (the plan's ``options.dtype`` says those) nor the values: the same across processes
    and machines for the same model class and config.
    """

    model_class: str
    parameters: int
    """Elements of the model's parameters, each shared tensor once (``sum(p.numel() for p in model.parameters())``)."""
    digest: str
    dtype: object = None
    """The one floating dtype of the model's parameters and buffers, ``None`` where they have several or none."""
    shapes: tuple = ()
    """``(name, shape)`` of each parameter, then each buffer, in the digest's order: what a saved plan compares
    tensor by tensor, without relying on :attr:`digest` (``Plan.to_dict()["model"]["shapes"]``)."""


def require_module(model) -> None:
    """Raise :class:`InvalidModel` unless ``model`` is a ``torch.nn.Module``: the first check of every walk."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidModel(f"expected a torch.nn.Module, got {type(model).__name__}.")


def identify(model) -> ModelIdentity:
    """The :class:`ModelIdentity` of ``model`` (one walk over its parameters and buffers; O(tensors)).

    >>> import torch.nn as nn
    >>> found = identify(nn.Linear(4, 2))
    >>> found.model_class, found.parameters, str(found.dtype), len(found.digest)
    ('Linear', 10, 'torch.float32', 64)
    """
    require_module(model)
    digest = hashlib.sha256()
    parameters = 0
    dtypes = set()
    shapes = []
    for kind, members in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, tensor in members:
            if tensor is None:
                continue
            digest.update(f"{kind}\t{name}\t{tuple(tensor.shape)}\n".encode())
            shapes.append((name, tuple(tensor.shape)))
            if kind == "p":
                parameters += tensor.numel()
            if tensor.is_floating_point():
                dtypes.add(tensor.dtype)
    return ModelIdentity(type(model).__name__, parameters, digest.hexdigest(),
                         next(iter(dtypes)) if len(dtypes) == 1 else None, tuple(shapes))
