"""What :func:`allocator.patch` needs of any library it plugs into (transformers, accelerate, diffusers): import it
where installed, ask its own planner for the map the user gets unpatched, name a replacement after the function it
replaces, and read the user's budgets as the library normalises them. One place for each, used by every
integration module."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable, Mapping

from ..budgets import is_accelerator, warn_misread
from ..errors import cause_line

__all__ = ["Unchecked", "baseline_map", "named", "optional_import", "user_budgets"]

log = logging.getLogger("allocator.integrations")


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
    try:
        found = call()
    except Exception as err:   # noqa: BLE001 - any failure of their planner only drops the baseline, and is said
        log.info("%s fails for %s (%s): planning without its map as the floor", planner, type(model).__name__,
                 cause_line(err))
        return None
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
