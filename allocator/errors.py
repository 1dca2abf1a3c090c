"""Typed errors. Every error derives from ``ValueError`` and says what was wrong and how to fix it.

Likely mistakes that accelerate accepts (a budget of 64 bytes, gigabits) are kept and warned about with
:func:`warn_caller`, a ``UserWarning`` pointing at the caller's line.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = [
    "AllocatorError",
    "BrokenContract",
    "InvalidBudget",
    "InvalidDeviceMap",
    "InvalidModel",
    "InvalidOption",
    "InvalidPlacement",
    "InvalidRuntime",
    "NoPlan",
    "PlanModelMismatch",
    "InfeasiblePlacement",
    "UnsupportedByAccelerate",
    "warn_caller",
    "MAX_MESSAGE",
    "one_line",
    "cause_line",
]


class AllocatorError(ValueError):
    """Base class of every error raised by ``allocator``."""


class InvalidBudget(AllocatorError):
    """A ``max_memory`` entry is malformed: unknown device, bad size string, negative or non-finite size."""


class InvalidDeviceMap(AllocatorError):
    """A ``device_map`` given to :func:`allocator.validate` is not a mapping of names to devices."""


class InvalidModel(AllocatorError):
    """The model cannot be planned (not an ``nn.Module``, a cycle in its module graph, ...)."""


class PlanModelMismatch(InvalidModel):
    """A saved plan (:meth:`allocator.Plan.from_dict`) was made for another model: its class, parameter count, a
    tensor's shape or the digest of tensor names and shapes differ from the model given.

    Attributes
    ----------
    saved, given : dict
        The plan's ``"model"`` record and the given model's, as :meth:`allocator.Plan.to_dict` writes them.
    """

    def __init__(self, message: str, *, saved=None, given=None):
        super().__init__(message)
        self.saved = dict(saved or {})
        self.given = dict(given or {})


class InvalidOption(AllocatorError):
    """An option (dtype, special_dtypes, no-split classes, strategy, ...) is malformed."""


class InfeasiblePlacement(AllocatorError):
    """No placement respects the budgets.

    Attributes
    ----------
    device : int | str | None
        The device whose budget is too small.
    minimum : int | None
        The smallest budget in bytes on ``device`` with which a plan exists (when it could be computed).
    """

    def __init__(self, message: str, *, device=None, minimum: int | None = None):
        super().__init__(message)
        self.device = device
        self.minimum = minimum


class UnsupportedByAccelerate(AllocatorError):
    """accelerate's own algorithm fails on this input; ``strategy="sequential"`` reproduces that failure."""


class InvalidPlacement(AllocatorError):
    """A strategy returned a map that breaks accelerate's runtime rules (only ``sequential``, which reproduces
    accelerate, may).

    Attributes
    ----------
    violations : tuple of Violation
        What the map breaks, as :func:`allocator.validate` reports it.
    """

    def __init__(self, message: str, *, violations=()):
        super().__init__(message)
        self.violations = tuple(violations)


class InvalidRuntime(AllocatorError):
    """:func:`allocator.offload.attach` cannot run this model: no offloading hooks to replace, a tensor class it does
    not stream (quantized parameters), or a model already attached."""


class NoPlan(AllocatorError):
    """:func:`allocator.plan_of` has no plan for this model: it was not loaded under :func:`allocator.patch` with a
    string ``device_map`` (a dict map, or no patch, plans nothing)."""


class BrokenContract(AllocatorError):
    """A strategy returned a plan that breaks the contract of ``device_map="auto"`` (main device, accelerators in
    index order, never below accelerate: :mod:`allocator.judge.contract`); ``objective="latency"`` accepts it."""


#: Libraries between a user's line and this package (``from_pretrained`` calls the planner through transformers'
#: and accelerate's code): a warning points past their frames too.
BETWEEN = ("transformers", "accelerate", "torch")


def _library_dirs() -> list[str]:
    dirs = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in BETWEEN:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return dirs


def warn_caller(message: str) -> None:
    """A ``UserWarning`` attributed to the first caller outside this package and the libraries that call it
    (:data:`BETWEEN`): the user's line that passed the input, also through ``from_pretrained``."""
    dirs = _library_dirs()
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(tuple(dirs)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


MAX_MESSAGE = 400
"""The longest text :func:`one_line` keeps by default (characters)."""


def one_line(text, limit: int = MAX_MESSAGE) -> str:
    """``text`` (an error, a message) on one line, cut to ``limit`` characters: how a message from another library
    is quoted inside ours, and how the command line prints an error.

    >>> one_line("a\\n  b")
    'a b'
    >>> len(one_line("x" * 1000))
    400
    """
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_CAUSE = 200
"""The longest text :func:`cause_line` keeps by default (characters)."""


def cause_line(err: BaseException, limit: int = MAX_CAUSE) -> str:
    """Another library's error named in one short line inside our message: its type and first line, and where that
    line only announces a list (it ends with ``:``), the last line too; cut after the last sentence that fits, without
    its full stop (our message goes on). The whole error stays the ``__cause__`` of ours
    (``raise InvalidModel(...) from err``), for a traceback; the command line prints our one line.

    >>> cause_line(ValueError("Couldn't build it from one of:\\n(1) a file,\\n(2) a class.\\nInstall sentencepiece."))
    "ValueError: Couldn't build it from one of: ... Install sentencepiece"
    >>> cause_line(KeyError("weight_map"))
    "KeyError: 'weight_map'"
    >>> len(cause_line(OSError("x" * 1000)))
    200
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} ... {lines[-1]}"
    text = one_line(f"{type(err).__name__}: {text}" if text else type(err).__name__, 10 * limit)
    if len(text) > limit and text.rfind(". ", 0, limit) > 0:   # whole sentences where they fit
        text = text[:text.rfind(". ", 0, limit) + 1]
    text = one_line(text, limit)
    return text[:-1] if text.endswith(".") and not text.endswith("...") else text   # ours goes on after it
