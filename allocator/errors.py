"""Typed errors. Every error derives from ``ValueError`` and says what was wrong and how to fix it."""

from __future__ import annotations

__all__ = [
    "AllocatorError",
    "BrokenContract",
    "InvalidBudget",
    "InvalidDeviceMap",
    "InvalidModel",
    "InvalidOption",
    "InfeasiblePlacement",
    "UnsupportedByAccelerate",
]


class AllocatorError(ValueError):
    """Base class of every error raised by ``allocator``."""


class InvalidBudget(AllocatorError):
    """A ``max_memory`` entry is malformed: unknown device, bad size string, negative or non-finite size."""


class InvalidDeviceMap(AllocatorError):
    """A ``device_map`` given to :func:`allocator.validate` is not a mapping of names to devices."""


class InvalidModel(AllocatorError):
    """The model cannot be planned (not an ``nn.Module``, a cycle in its module graph, ...)."""


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


class BrokenContract(AllocatorError):
    """A strategy returned a plan that breaks the contract of ``device_map="auto"`` (main device, accelerators in
    index order, never below accelerate: :mod:`allocator.strategies.contract`); ``objective="latency"`` accepts it."""
