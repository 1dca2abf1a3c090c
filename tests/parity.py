"""Run accelerate's infer_auto_device_map and ours on the same inputs."""

from __future__ import annotations

import copy

import accelerate.utils
import allocator
from allocator.errors import UnsupportedByAccelerate


def both(model, max_memory, **kwargs):
    """(accelerate's map or its exception type, our sequential map or the exception) for the same inputs.

    The no-split classes given to accelerate are the effective ones our builder found (the caller's united with
    every sub-model's ``_no_split_modules``; never the inferred blocks), so both algorithms see the same input.
    """
    problem = allocator.build_problem(model, max_memory, no_split_module_classes=kwargs.get("no_split_module_classes"))
    no_split = sorted(problem.graph.no_split_declared)
    acc_kwargs = dict(kwargs, no_split_module_classes=no_split)
    try:
        theirs = accelerate.utils.infer_auto_device_map(model, copy.deepcopy(max_memory), **acc_kwargs)
        theirs = dict(theirs)
    except (IndexError, AttributeError, ValueError) as err:
        theirs = type(err)
    try:
        ours = allocator.infer_auto_device_map(model, dict(max_memory), strategy="sequential", **kwargs)
    except UnsupportedByAccelerate as err:
        ours = err
    return theirs, ours, problem
