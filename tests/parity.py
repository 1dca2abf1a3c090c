"""Run accelerate's infer_auto_device_map and ours on the same inputs, as a user calls each."""

from __future__ import annotations

import copy

import accelerate.utils
import allocator
from allocator.errors import UnsupportedByAccelerate


def both(model, max_memory, **kwargs):
    """(accelerate's map or its exception type, our sequential map or the exception, the problem) for the same
    arguments.

    Each function gets exactly the caller's arguments (``no_split_module_classes`` among them, or not at all): no
    list derived from the model is handed to either. Ours gets the caller's own ``max_memory`` dict (a mutation check
    on it sees what ours did); accelerate gets a copy taken before, as it converts string budgets in place. The problem
    returned is read as :func:`allocator.plan` reads the model (the declared no-split classes too), so that the rules
    ``check`` finds broken in accelerate's map include splitting a class the model declares.
    """
    theirs_memory = copy.deepcopy(max_memory)
    try:
        ours = allocator.infer_auto_device_map(model, max_memory, strategy="sequential", **kwargs)
    except UnsupportedByAccelerate as err:
        ours = err
    try:
        theirs = dict(accelerate.utils.infer_auto_device_map(model, theirs_memory, **kwargs))
    except (IndexError, AttributeError, ValueError) as err:
        theirs = type(err)
    problem = allocator.build_problem(model, copy.deepcopy(max_memory),
                                      no_split_module_classes=kwargs.get("no_split_module_classes"))
    return theirs, ours, problem
