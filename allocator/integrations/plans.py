"""The plan behind a load under :func:`allocator.patch`: :func:`plan_of` (issue #46). The patch keeps the
:class:`allocator.Plan` it placed a model with on that model (``_allocator_plan``, as the runtime keeps itself:
:func:`allocator.offload.runtime_of`); this reads it."""

from __future__ import annotations

from ..errors import NoPlan

__all__ = ["plan_of"]


def plan_of(model):
    """The :class:`allocator.Plan` that placed ``model`` in a load under :func:`allocator.patch` (either runtime):
    ``plan_of(model).explain()`` says why; its ``device_map`` is ``model.hf_device_map`` (where
    ``_no_placement_params`` left no tensor out of the map).

    Raises
    ------
    NoPlan
        ``model`` was not loaded under :func:`allocator.patch` with a string ``device_map``.

    Examples
    --------
    >>> import torch.nn as nn
    >>> plan_of(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    allocator.errors.NoPlan: no plan placed this Linear: ...
    """
    found = getattr(model, "_allocator_plan", None)
    if found is None:
        raise NoPlan(f"no plan placed this {type(model).__name__}: it was not loaded under allocator.patch() with a "
                     "string device_map; load it inside 'with allocator.patch():' with device_map='auto', or make "
                     "its plan with allocator.plan(model, max_memory).")
    return found
