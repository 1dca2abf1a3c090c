"""What :func:`allocator.patch` needs of any library it plugs into (transformers, accelerate, diffusers): import it
where installed, ask its own planner for the map the user gets unpatched, name a replacement after the function it
replaces, and read the user's budgets as the library normalises them. One place for each, used by every
integration module."""

from __future__ import annotations

import contextvars
import importlib
import importlib.abc
import logging
import math
import sys
import threading
from importlib.machinery import SourceFileLoader, SourcelessFileLoader
from collections.abc import Callable, Mapping

from ..budgets import is_accelerator, warn_misread
from ..errors import cause_line

__all__ = ["AfterImport", "Unchecked", "accelerate_functions", "baseline_map", "bound_by_name", "named",
           "optional_import", "original_of", "unless_baseline", "user_budgets"]

log = logging.getLogger("allocator.integrations")

_BASELINE = contextvars.ContextVar("allocator_baseline", default=False)
"""True while :func:`baseline_map` runs a library's own planner: accelerate's functions are accelerate's then."""


def optional_import(name: str):
    """The module ``name``, or ``None`` where it (or the library it belongs to) is not installed.

    >>> optional_import("json").__name__, optional_import("no_such_library_here")
    ('json', None)
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def baseline_map(call: Callable[[], object], model, planner: str) -> dict | None:
    """The map the library's own ``planner`` returns (``call()``): what the user gets unpatched, the floor of the
    contract's rule 3 on that path (``PlanOptions.baseline``). ``None`` where that planner fails (said at INFO): the
    plan then keeps accelerate's floor, and the user gets a plan where unpatched they got an error.

    >>> baseline_map(lambda: {"": 0}, None, "theirs"), baseline_map(lambda: 1 / 0, None, "theirs")
    ({'': 0}, None)
    """
    token = _BASELINE.set(True)
    try:
        found = call()
    except Exception as err:   # noqa: BLE001 - any failure of their planner only drops the baseline, and is said
        log.info("%s fails for %s (%s): planning without its map as the floor", planner, type(model).__name__,
                 cause_line(err))
        return None
    finally:
        _BASELINE.reset(token)
    return dict(found) if isinstance(found, Mapping) else None


class Unchecked:
    """A quantizer as transformers' own planner sees it, without its ``validate_environment``: the baseline map is
    computed, never loaded, so only the plan returned is validated (once)."""

    def __init__(self, quantizer):
        self._quantizer = quantizer

    def __getattr__(self, name):
        return getattr(self._quantizer, name)

    def validate_environment(self, *args, **kwargs) -> None:
        return None


def named(replacement: Callable, original: Callable) -> Callable:
    """``replacement`` under the name, qualified name and a docstring of ``original``, which it keeps as
    ``__allocator_original__`` (what the patch restores)."""
    replacement.__name__ = getattr(original, "__name__", replacement.__name__)
    replacement.__qualname__ = getattr(original, "__qualname__", replacement.__qualname__)
    replacement.__doc__ = (f"allocator's replacement of {getattr(original, '__module__', '?')}.{replacement.__name__}: "
                           "plans string device maps with allocator.plan (see allocator.patch).")
    replacement.__allocator_original__ = original
    return replacement


def unless_baseline(replacement: Callable, original: Callable) -> Callable:
    """``replacement``, except while :func:`baseline_map` runs a library's own planner, which then calls
    ``original``: that planner may call accelerate's functions from a namespace the patch rebinds (diffusers'
    ``_determine_device_map`` from ``diffusers.models.model_loading_utils``), and its map must stay its own.
    ``inspect.signature`` of the result is ``original``'s (diffusers reads it)."""

    def call(*args, **kwargs):
        return (original if _BASELINE.get() else replacement)(*args, **kwargs)

    call.__wrapped__ = original
    return call


def accelerate_functions(*, dispatch: bool) -> dict[str, Callable]:
    """Name -> accelerate's own ``get_balanced_memory`` and ``infer_auto_device_map`` (and, with ``dispatch``,
    ``dispatch_model``): what :func:`bound_by_name` looks for; empty where accelerate is not installed."""
    modeling, big_modeling = optional_import("accelerate.utils.modeling"), optional_import("accelerate.big_modeling")
    if modeling is None or big_modeling is None:
        return {}
    functions = {name: getattr(modeling, name) for name in ("get_balanced_memory", "infer_auto_device_map")}
    if dispatch:
        functions["dispatch_model"] = original_of(big_modeling.dispatch_model)
    return functions


def original_of(function):
    """The function a chain of replacements made by :func:`named` replaces (``function`` itself where none)."""
    while callable(getattr(function, "__allocator_original__", None)):
        function = function.__allocator_original__
    return function


def bound_by_name(functions: Mapping[str, Callable], *, skip: tuple[str, ...] = (),
                  modules=None) -> list[tuple[object, str]]:
    """``(module, attribute)`` for every loaded module that binds one of ``functions`` (attribute name -> the
    library's function) by that name: ``from accelerate import infer_auto_device_map`` in PEFT's ``peft_model``,
    whether the attribute is the function itself or a replacement of it (:func:`original_of`, a patch already on).
    Modules named in ``skip`` (with their submodules) and ``__main__`` are left out; ``modules``: ``(name, module)``
    pairs to search instead of ``sys.modules`` (in import order).

    >>> import json, types
    >>> fake = types.ModuleType("fake_library")
    >>> fake.dumps = json.dumps
    >>> sys.modules["fake_library"] = fake
    >>> [(m.__name__, a) for m, a in bound_by_name({"dumps": json.dumps}, skip=("json",))]
    [('fake_library', 'dumps')]
    >>> del sys.modules["fake_library"]
    """
    found = []
    for name, module in list(sys.modules.items()) if modules is None else modules:
        if name == "__main__" or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        found.extend((module, attribute) for attribute, function in functions.items()
                     if attribute in namespace and original_of(namespace[attribute]) is function)
    return found


def user_budgets(get_max_memory, max_memory, mode: str) -> dict:
    """The library's normalisation of ``max_memory`` (a copy: accelerate converts strings in place), with its 90%
    rule for a single accelerator when the user set nothing, and without its balancing. The caller's strings are
    read first, for the warnings the library's conversion does not give (a lower-case "b" is bits, a fractional
    float). Floats (transformers' 90% of the free RAM, a user's float already warned about) are rounded down to
    bytes: the library compares them with whole byte counts."""
    warn_misread(max_memory)
    budgets = {d: math.floor(v) if isinstance(v, float) and math.isfinite(v) and v >= 0 else v
               for d, v in get_max_memory(dict(max_memory) if max_memory is not None else None).items()}
    if max_memory is None and mode != "sequential":
        accelerators = [d for d, size in budgets.items() if is_accelerator(d) and size > 0]
        if len(accelerators) == 1 and isinstance(accelerators[0], int):
            budgets[accelerators[0]] = int(budgets[accelerators[0]] * 0.9)
    return budgets


class _Loader:
    """A module's own loader, and ``callback(module)`` once the module has run (where it still runs, its own loader
    is put back on it)."""

    def __init__(self, loader, callback: Callable):
        self._loader, self._callback = loader, callback

    def __getattr__(self, name):   # what else of the loader its module reads (get_data, get_resource_reader, ...)
        if name == "_loader":   # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        try:
            self._callback(module)
        except Exception as err:   # noqa: BLE001 - the user's import must not fail for the patch: said, not raised
            log.warning("allocator could not patch %s after its import (%s: %s); import it before allocator.patch()",
                        module.__name__, type(err).__name__, err)


class AfterImport(importlib.abc.MetaPathFinder):
    """A finder first on ``sys.meta_path`` from :meth:`install` to :meth:`remove` that calls ``callback(module)``
    after each pure-Python module imported meanwhile has run (what a patch must reach of libraries imported after
    it began). It finds nothing itself: it asks the finders after it, in order, and wraps the loader of a source or
    bytecode module; extension, built-in and frozen modules and namespace packages load as they would."""

    def __init__(self, callback: Callable):
        self.callback = callback
        self._asking = threading.local()

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path=None, target=None):
        if getattr(self._asking, "now", False):
            return None
        self._asking.now = True
        spec = None
        try:
            for finder in list(sys.meta_path):
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._asking.now = False
        if spec is not None and type(spec.loader) in (SourceFileLoader, SourcelessFileLoader):
            spec.loader = _Loader(spec.loader, self.callback)
        return spec
