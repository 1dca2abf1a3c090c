"""No-split classes: which modules plans keep whole on one device.

The caller's ``no_split_module_classes``, united with the ``_no_split_modules`` every sub-model declares; when nothing
is declared, the model's repeated blocks (:func:`allocator.model.blocks.infer_blocks`). What a module declares and
which blocks repeat is :mod:`allocator.model.blocks`'s to say; this module unites the answers, read from the modules
:mod:`allocator.model.read`'s walk met (:class:`Walked`) where the walk was exact, from the model otherwise.
:func:`discovered` and :func:`~allocator.model.blocks.infer_blocks` are the default hooks of a model family
(:class:`allocator.model.families.Family`); a family may replace either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import InvalidOption
from .blocks import declared_no_split, infer_blocks, no_split_classes

__all__ = ["Walked", "given_classes", "discovered", "keep_whole", "warn_unmatched"]

log = logging.getLogger(__name__)


def given_classes(no_split_module_classes: Iterable[str] | str | None) -> set[str]:
    """The caller's class names (one name, or several) as a set; raises :class:`~allocator.errors.InvalidOption`
    for anything but names."""
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    given = set()
    for c in no_split_module_classes or ():
        if not isinstance(c, str):
            raise InvalidOption(f"no_split_module_classes must hold class names (str), got {c!r}.")
        given.add(c)
    return given


@dataclass(frozen=True, slots=True)
class Walked:
    """What the reader's walk of a model met, for a family's no-split discovery
    (:attr:`allocator.model.families.Family.no_split`): it may read these, or the model itself.

    Attributes
    ----------
    modules : iterable
        Each module object of the model once (iterated at most once).
    classes : iterable of type
        The classes of those modules, each once.
    per_module : bool
        Some module holds ``_no_split_modules`` of its own, so each module must be asked, not only its class.
    ask_torch : bool
        The walk's tables may differ from torch's generators: ask ``model.modules()`` instead of ``modules``.
    """

    modules: Iterable = ()
    classes: Iterable[type] = ()
    per_module: bool = False
    ask_torch: bool = True


def discovered(model, walked: Walked = Walked()) -> set[str]:
    """Every sub-model's ``_no_split_modules``, united (:func:`~allocator.model.blocks.no_split_classes`).

    Read from ``walked.modules`` (each module object of ``model`` once) and from their ``walked.classes``: each class
    is asked once unless some module declares its own (``per_module``) or a class declares through a descriptor, where
    each module is asked (a slow ``__dict__`` lookup per module). With ``ask_torch`` (the walk's tables may differ
    from torch's generators, or there was no walk: the default), ``model.modules()`` is asked instead.
    """
    if walked.ask_torch:
        return no_split_classes(model)
    if walked.per_module:
        return declared_no_split(walked.modules)
    found: set[str] = set()
    for cls in walked.classes:
        declared = getattr(cls, "_no_split_modules", None)
        if hasattr(type(declared), "__get__"):  # a property or other descriptor: ask the instances
            return declared_no_split(walked.modules)
        if declared:
            found.update(str(c) for c in declared)
    return found


def keep_whole(model, given: set[str], found: set[str] | None, *, infer: bool,
               infer_with: Callable[..., set[str]] = infer_blocks) -> tuple[set[str], frozenset[str]]:
    """(what plans keep whole, what is declared): ``given`` united with ``found`` (what the sub-models declare, or
    None when not discovered); when that is empty and ``infer``, the blocks ``infer_with(model)`` infers (the model
    family's rule, :attr:`allocator.model.families.Family.infer_no_split`), logged."""
    no_split = set(given)
    if found is not None:
        no_split |= found
    declared = frozenset(no_split)
    if infer and not no_split:
        no_split = set(infer_with(model))
        if no_split:
            log.info("%s declares no no-split classes; keeping its repeated blocks %s whole "
                     "(pass no_split_module_classes, or infer_no_split=False, to change this)",
                     type(model).__name__, sorted(no_split))
    return no_split, declared


def warn_unmatched(given: Iterable[str], classes: Iterable[type], model_class: str) -> None:
    """Warn about each given class name that matches no module class (a misspelling, most often)."""
    present = {cls.__name__ for cls in classes}
    for c in sorted(set(given) - present):
        log.warning("no-split class %r matches no module of %s; check the spelling.", c, model_class)
