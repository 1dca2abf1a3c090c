"""Read a model's structure: no-split classes, repeated blocks and stacks.

Pure functions over an ``nn.Module``; none of them mutates the model.

:func:`no_split_classes`
    The classes the model declares unsplittable (``_no_split_modules``), over every sub-model
    (:func:`declared_no_split` is the same rule over any modules).
:func:`infer_blocks`
    The classes of the repeated blocks, inferred from the structure, for models that declare none.
:func:`find_layers`
    The repeated stacks, ``(container name, [block names])``, without hard-coded paths.
:func:`require_module`
    The check of their argument, also used by :func:`allocator.model.unwrap.unwrap` (the model under its wrappers)
    and :mod:`allocator.parallel`.

Glossary
--------
container
    An ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` (or a subclass).
block
    A child of a container that has at least one sibling of the same class with the same parameter names
    and shapes (or, for a container holding two of the class, one whose parameters are among the other's:
    a T5 stack of two blocks, the first owning the relative-attention table); its class is a *block class*.
stack
    A container holding blocks, with every child of a block class (so a first layer that owns an extra
    relative-position table, as in T5, still belongs to the stack).

:mod:`allocator.model` builds on this module (it reads the declarations, and infers blocks when there are none), so
it imports nothing of the package but its errors; ``torch`` is imported where first needed, as in the graph, so that
``import allocator`` stays light.

``no_split_classes`` looks into every sub-model:

>>> import torch.nn as nn
>>> class Tower(nn.Module):
...     _no_split_modules = ["EncoderLayer"]
>>> class VisionLanguageModel(nn.Module):
...     _no_split_modules = ["DecoderLayer"]
...     def __init__(self):
...         super().__init__()
...         self.vision_tower = Tower()
>>> sorted(no_split_classes(VisionLanguageModel()))  # llava: the LLM's layer and the CLIP tower's
['DecoderLayer', 'EncoderLayer']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidModel

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["declared_no_split", "find_layers", "infer_blocks", "no_split_classes", "require_module"]


def _nn():
    """``torch.nn``, imported on first use."""
    import torch.nn

    return torch.nn


def _containers() -> tuple[type, ...]:
    """The container classes whose children may be blocks: ``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``."""
    nn = _nn()
    return nn.ModuleList, nn.Sequential, nn.ModuleDict


def require_module(model, caller: str) -> None:
    """Raise :class:`~allocator.errors.InvalidModel` unless ``model`` is an ``nn.Module``.

    Parameters
    ----------
    model : object
        What the caller was given.
    caller : str
        The public function's name, for the message.

    Raises
    ------
    InvalidModel
        If ``model`` is not a ``torch.nn.Module``; the message names ``caller`` and what it got.

    Examples
    --------
    >>> require_module("gpt2", "find_layers")
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidModel: find_layers() expects a torch.nn.Module, got str; pass the model itself.
    """
    if not isinstance(model, _nn().Module):
        raise InvalidModel(f"{caller}() expects a torch.nn.Module, got {type(model).__name__}; pass the model itself.")


# ------------------------------------------------------------------------------------------ declared no-split
def no_split_classes(model) -> set[str]:
    """``_no_split_modules`` of the model and of every sub-model, united.

    >>> import torch.nn as nn
    >>> class Tower(nn.Module):
    ...     _no_split_modules = ["Block"]
    >>> no_split_classes(nn.Sequential(Tower()))
    {'Block'}
    """
    return declared_no_split(model.modules())


_NOT_FOUND = object()


def declared_no_split(modules) -> set[str]:
    """Each module's ``_no_split_modules`` (its own attribute, else its class's), united: :func:`no_split_classes` over
    any iterable of modules (the graph's reader passes each module object once)."""
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


# ---------------------------------------------------------------------------------------- repeated blocks
@dataclass(frozen=True, slots=True)
class _Stack:
    """One stack: the container's name, its blocks' keys in the container (definition order) and their class."""

    container: str
    keys: tuple[str, ...]
    block_class: type

    def blocks(self) -> list[str]:
        """The blocks' names, as ``model.named_modules()`` gives them."""
        return [f"{self.container}.{k}" if self.container else k for k in self.keys]


def _parameter_signature() -> Callable[[nn.Module], int]:
    """A function giving each module an integer that is equal for two modules iff their parameter names and
    shapes (``named_parameters`` with duplicates) are equal; ``0`` means "no parameter".

    Each distinct (own parameter shapes, children's signatures) pair is interned once, so signing every
    module of a model costs O(modules + parameters) in total, however deep the nesting.
    """
    interned: dict[tuple, int] = {}
    memo: dict[int, int] = {}

    def sign(module: nn.Module) -> int:
        key = id(module)
        if key in memo:
            return memo[key]
        memo[key] = 0  # a back-reference (cycle) reads as "no parameter" instead of recursing forever
        own = tuple((name, tuple(p.shape)) for name, p in module._parameters.items() if p is not None)
        children = tuple(
            (name, s) for name, child in module._modules.items() if child is not None and (s := sign(child))
        )
        memo[key] = interned.setdefault((own, children), len(interned) + 1) if own or children else 0
        return memo[key]

    return sign


def _block_classes(container: nn.Module, sign: Callable[[nn.Module], int]) -> list[type]:
    """Classes having ≥ 2 children of ``container`` with equal signatures, in order of first appearance; or, when no
    two of a class are equal, whose first two children's parameters (names and shapes) are one within the other.

    The second rule finds stacks of two whose first block owns an extra tensor (T5's relative-attention table, in an
    encoder of two blocks); with three or more blocks the others are equal and the first rule finds them. Children
    that own no parameter, and plain containers (a ``Sequential`` of ``Sequential`` blocks), never make a block
    class: the search goes on inside them instead. Once a class repeats, its further children are not signed (they
    cannot change the answer), so a stack of identical blocks costs two signatures, not one per block.
    """
    containers = _containers()
    counts: dict[tuple[type, int], int] = {}
    repeated: set[type] = set()
    first_two: dict[type, list[nn.Module]] = {}
    for child in container._modules.values():
        cls = type(child)
        if child is None or cls in repeated or cls in containers:
            continue
        signature = sign(child)
        if signature:
            count = counts[cls, signature] = counts.get((cls, signature), 0) + 1
            if count == 2:
                repeated.add(cls)
            elif len(pair := first_two.setdefault(cls, [])) < 2:
                pair.append(child)
    for cls, pair in first_two.items():
        if cls not in repeated and len(pair) == 2 and _nested(*pair):
            repeated.add(cls)
    return list(dict.fromkeys(type(c) for c in container._modules.values() if type(c) in repeated))


def _nested(a: nn.Module, b: nn.Module) -> bool:
    """Whether the parameters (names and shapes) of one of ``a`` and ``b`` are among the other's."""
    def shapes(module):
        return {(name, tuple(p.shape)) for name, p in module.named_parameters(remove_duplicate=False)}

    first, second = shapes(a), shapes(b)
    return first <= second or second <= first


def _stacks(model: nn.Module) -> list[_Stack]:
    """The outermost stacks of ``model`` in definition (preorder) order; blocks are not searched inside."""
    sign = _parameter_signature()
    containers = _containers()
    found: list[_Stack] = []
    pending: list[tuple[str, nn.Module]] = [("", model)]
    visited: set[int] = set()
    while pending:
        name, module = pending.pop()
        if id(module) in visited:  # shared sub-module (or cycle): its first path is the one reported
            continue
        visited.add(id(module))
        classes = _block_classes(module, sign) if isinstance(module, containers) else []
        keys: dict[type, list[str]] = {cls: [] for cls in classes}  # the blocks of each class, in order
        children = []
        for k, child in module._modules.items():  # one pass: a container may hold 100k blocks
            if type(child) in keys:
                keys[type(child)].append(k)
            elif child is not None:
                children.append((k, child))
        found.extend(_Stack(name, tuple(keys[cls]), cls) for cls in classes)
        pending.extend((f"{name}.{k}" if name else k, c) for k, c in reversed(children))
    return found


def infer_blocks(model: nn.Module) -> set[str]:
    """Class names of the outermost repeated blocks of a model, inferred from its structure.

    Meant for models that declare no ``_no_split_modules`` (wav2vec2, custom modules): the result can be
    passed as ``no_split_module_classes``. Declarations are ignored; see :func:`no_split_classes` for them.

    Parameters
    ----------
    model : torch.nn.Module
        Any module; it is only read. Pass ``unwrap(model)`` for a wrapped model, otherwise the wrappers
        around each layer (``CheckpointWrapper``, nested FSDP) are what repeats.

    Returns
    -------
    set of str
        ``type(block).__name__`` of every block of every stack (see :func:`find_layers`); empty when nothing
        repeats.

    Raises
    ------
    InvalidModel
        ``model`` is not an ``nn.Module``.

    Notes
    -----
    The rule: walking the module tree from the root, the children of each container (``nn.ModuleList``,
    ``nn.Sequential``, ``nn.ModuleDict``) are grouped by (class, parameter names and shapes). A group of two
    or more children that own parameters makes its class a block class, unless the class is a plain
    container (then the search goes on inside). The walk does not enter blocks, so the ``Linear`` s of a
    layer, or the experts ``ModuleList`` of an MoE layer, are never reported: only the outermost level.
    Parameter-free repeats (activations, dropouts) are ignored. A repeated ``Linear`` directly in a container
    (a DETR box head) is a block too, which is harmless: a ``Linear`` has no sub-module to split.

    Complexity: O(modules + parameters) time and memory; each module's parameter signature is computed
    at most once, bottom-up, and interned as an integer, and a container's children of a class stop being
    signed once two of them match (a stack of identical blocks signs two of them). Where no two children of a
    class match, the parameters of its first two are listed once more (the second rule), so a parameter is
    read at most once per container above it.

    Examples
    --------
    >>> import torch.nn as nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)
    >>> infer_blocks(nn.Sequential(nn.Embedding(10, 8), Block(), Block(), Block(), nn.Linear(8, 10)))
    {'Block'}
    """
    require_module(model, "infer_blocks")
    return {stack.block_class.__name__ for stack in _stacks(model)}


def find_layers(model: nn.Module) -> list[tuple[str, list[str]]]:
    """The repeated stacks of a model: each container of blocks with the names of its blocks.

    Parameters
    ----------
    model : torch.nn.Module
        Any module; it is only read. Pass ``unwrap(model)`` for a wrapped model.

    Returns
    -------
    list of (str, list of str)
        Every stack, ``(container name, [block names])``, in definition order (the order of
        ``model.named_modules()``), names as in ``model.named_modules()`` (``""`` is the model itself).
        Encoder-decoders give two stacks (T5: ``encoder.block`` then ``decoder.block``, also with two blocks
        each), a VLM its vision tower's and its language model's. A container holding blocks of two classes
        appears once per class. Callers that want one stack pick it (the longest, or by name): the result is
        never just the last or largest.

    Raises
    ------
    InvalidModel
        ``model`` is not an ``nn.Module``.

    Notes
    -----
    Stacks are found by the rule of :func:`infer_blocks`, which is never told a path. A stack lists every
    child of the block class, including those whose parameters differ from the others' (T5's first block
    owns the relative-attention table, DeepSeek's first layer is dense). A stack of two blocks whose first
    differs is found when one block's parameters are among the other's (T5); two blocks that differ
    otherwise (a dense and an MoE layer) are not a stack. Nested stacks are not reported
    (experts inside a layer); stacks inside non-repeated stages are (Swin's ``layers.<i>.blocks``).

    Complexity: O(modules + parameters).

    Examples
    --------
    >>> import torch.nn as nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = nn.Embedding(10, 4)
    ...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    >>> find_layers(Net())
    [('layers', ['layers.0', 'layers.1', 'layers.2'])]
    """
    require_module(model, "find_layers")
    return [(stack.container, stack.blocks()) for stack in _stacks(model)]
