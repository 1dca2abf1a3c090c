"""transformers' ``_no_placement_params``: tensors inside no-split blocks that a model lets the loader keep out of
the device map (transformers then loads them in RAM), so that the rest of each block may still fit an accelerator.

The patch (:mod:`allocator.integrations.transformers`) plans as usual; when the plan leaves such tensors off every
accelerator (:func:`tensors_to_escape`), it plans again with their sizes counted as zero (:func:`zero_size_for`), on
the problem it has, its graph with those sizes zeroed (:func:`without_sizes`: the model is read once per load), and
removes them from the map (:func:`leave_out`). These functions only read the model.
"""

from __future__ import annotations

import logging
import dataclasses
from collections.abc import Iterable, Mapping

from ..budgets import is_accelerator
from ..evaluate.memory import device_of, tensor_devices
from ..model.graph import zeroed
from ..problem import PlanOptions, Problem

__all__ = ["leave_out", "name_list", "no_placement_tensors", "tensors_to_escape", "without_sizes", "zero_size_for"]

log = logging.getLogger(__name__)


def name_list(classes) -> list[str]:
    """``classes`` as a list of names: ``None`` gives ``[]``, a string ``[classes]``, any other iterable its items
    (how transformers and accelerate accept ``no_split_module_classes`` and ``_no_placement_params``)."""
    if classes is None:
        return []
    if isinstance(classes, str):
        return [classes]
    return list(classes)


def no_placement_tensors(model, no_split: Iterable[str]) -> list[str]:
    """Full names of the tensors named by ``model._no_placement_params`` inside blocks of a no-split class."""
    relative = name_list(getattr(model, "_no_placement_params", None))
    if not relative:
        return []
    tensors = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    no_split = set(no_split)
    found = {
        f"{block}.{name}" if block else name
        for block, module in model.named_modules()
        if type(module).__name__ in no_split
        for name in relative
        if (f"{block}.{name}" if block else name) in tensors
    }
    if not found:
        log.info("%s declares _no_placement_params %s but no no-split block holds them; planned as usual",
                 type(model).__name__, relative)
    return sorted(found)


def tensors_to_escape(model, result, no_split) -> list[str]:
    """The no-placement tensors that ``result`` (a plan of ``model``) leaves off every accelerator, when the budgets
    have one; ``[]`` otherwise."""
    candidates = no_placement_tensors(model, no_split)
    if not candidates or not any(is_accelerator(d) for d in result.problem.budgets.limits):
        return []
    graph = result.problem.graph
    devices = dict(zip(graph.tensors.name, tensor_devices(graph, result.device_map)))
    return [name for name in candidates if not is_accelerator(devices[name])]


def zero_size_for(names: Iterable[str], base):
    """A ``size_fn`` that counts the tensors ``names`` as 0 bytes and every other tensor as ``base`` does (``None``:
    as the planner would without a ``size_fn``)."""
    names = frozenset(names)

    def size(name, tensor):
        if name in names:
            return 0
        return base(name, tensor) if base is not None else None

    return size


def without_sizes(problem: Problem, names: Iterable[str], base) -> Problem:
    """``problem`` as :func:`allocator.problem.build_problem` would build it with ``size_fn=zero_size_for(names,
    base)``, from the graph it holds (:func:`allocator.model.graph.zeroed`): the model is not read again. What was
    derived from ``problem`` (the witness, the fills) is made anew for the new sizes."""
    names = list(names)
    options = PlanOptions.of(problem.options, size_fn=zero_size_for(names, base))
    return dataclasses.replace(problem, graph=zeroed(problem.graph, names), options=options)


def leave_out(model, device_map: Mapping, tensors: Iterable[str]) -> dict:
    """``device_map`` with no key covering ``tensors``: each covering key is replaced, in place, by entries for
    everything under it but the tensor (parameters, sub-modules, buffers: accelerate's order), on the key's device."""
    items = list(device_map.items())
    for tensor in tensors:
        position = device_of(tensor, {k: i for i, (k, _) in enumerate(items)})  # of the longest key covering it
        if position is not None:
            key, device = items[position]
            items[position:position + 1] = [] if key == tensor else _all_but(model, key, device, tensor)
    return dict(items)


def _all_but(model, prefix: str, device, tensor: str) -> list[tuple[str, object]]:
    """Entries on ``device`` for everything under module ``prefix`` but ``tensor`` (recursing down its path)."""
    module = model.get_submodule(prefix)
    on_path = (tensor[len(prefix) + 1:] if prefix else tensor).split(".")[0]
    entries = []
    for name, _ in [*module.named_parameters(recurse=False), *module.named_children(),
                    *module.named_buffers(recurse=False)]:
        full = f"{prefix}.{name}" if prefix else name
        if name != on_path:
            entries.append((full, device))
        elif full != tensor:
            entries += _all_but(model, full, device, tensor)
    return entries
