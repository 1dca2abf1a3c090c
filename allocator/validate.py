"""One checker for every runtime rule a device map must respect (see :mod:`allocator.runtime`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .budgets import normalize_device
from .errors import InvalidBudget, InvalidDeviceMap
from .problem import Problem, build_problem
from .runtime import Memory, Recent, device_of, main_device, offloaded_devices, peaks, tensor_devices

__all__ = ["Violation", "check", "validate", "normalize_map"]


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule. ``kind`` is one of ``coverage``, ``unknown-key``, ``unknown-device``, ``no-split``,
    ``tied``, ``unhooked``, ``budget``."""

    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def normalize_map(device_map) -> dict:
    """A copy of ``device_map`` with devices in canonical form; a typed error if it is not a device map."""
    if not isinstance(device_map, Mapping):
        raise InvalidDeviceMap(
            f"device_map must be a dict of module names to devices, got {type(device_map).__name__}."
        )
    out = {}
    seen: dict = {}  # (type, value) -> canonical device: a map has few distinct values
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise InvalidDeviceMap(f"device_map keys are module names (str); got {key!r}.")
        try:
            out[key] = seen[type(value), value]
            continue
        except (KeyError, TypeError):  # new, or unhashable
            pass
        try:
            out[key] = normalize_device(value)
        except InvalidBudget as err:
            raise InvalidDeviceMap(f"device_map[{key!r}]: {err}") from None
        try:
            seen[type(value), value] = out[key]
        except TypeError:
            pass
    return out


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


_CHECKED = Recent()


def check(problem: Problem, device_map: Mapping) -> tuple[list[Violation], Memory]:
    """Violations of ``device_map`` for ``problem``, and the memory it needs at runtime.

    Notes
    -----
    O(nodes + tensors + map entries). The last few results are remembered (:class:`Recent`); each call returns
    its own copies.
    """
    known, key = _CHECKED.get(problem, device_map)
    if known is None:
        known = _check(problem, device_map)
        _CHECKED.put(problem, key, known)
    violations, memory = known
    return list(violations), replace(memory, peak=dict(memory.peak), generation=dict(memory.generation))


def _check(problem: Problem, device_map: Mapping) -> tuple[list[Violation], Memory]:
    g = problem.graph
    device_map = normalize_map(device_map)
    found: list[Violation] = []
    for key in device_map:
        if key and key not in g.node_index and key not in g.tensor_index:
            found.append(Violation("unknown-key", f"{key!r} names no module or tensor of {g.model_class}."))
    devices = tensor_devices(g, device_map)
    missing = [t.name for t, d in zip(g.tensors, devices) if d is None] if None in devices else []
    if missing:
        found.append(Violation(
            "coverage", f"{len(missing)} tensors have no device, e.g. {missing[:3]}; map them or a parent module."
        ))
    found += _no_split(problem, devices)
    found += _unhooked(problem, device_map)
    for group in g.all_tie_groups():
        where = {n: device_of(n, device_map) for n in group}
        if len(set(where.values()) - {None}) > 1:
            found.append(Violation("tied", f"tied tensors are split across devices: {where}."))
    memory = peaks(g, devices, device_map.values(), offload_buffers=problem.options.offload_buffers)
    for device, used in memory.peak.items():
        if device not in problem.budgets.order or (device != "disk" and problem.budgets.limit(device) is None):
            found.append(Violation("unknown-device", f"device {device!r} has no budget in max_memory."))
            continue
        limit = problem.budgets.limit(device)
        if limit is not None and used > limit:
            extra = ""
            if device == memory.main and memory.streamed:
                extra = f", of which {_fmt(memory.streamed)} streams offloaded weights of {list(memory.chain)}"
            if memory.generation.get(device):
                extra += f"{', and' if extra else ', of which'} {_fmt(memory.generation[device])} is for generate " \
                         "(KV cache, logits, activations)"
            found.append(Violation(
                "budget", f"device {device!r} needs {_fmt(used)} ({used} B){extra} but its budget is "
                f"{_fmt(limit)} ({limit} B); raise it by {used - limit} B or move modules off it."
            ))
    return found, memory


def _unhooked(problem: Problem, device_map: dict) -> list[Violation]:
    """Offloaded tensors named by their own key: ``dispatch_model`` hooks modules named in the map, never single
    tensors, so such a tensor is never loaded (it stays on meta: wrong outputs, or a device error)."""
    g = problem.graph
    main = main_device(device_map.values())
    offloaded = offloaded_devices(main) if len(set(device_map.values())) > 1 or "disk" in device_map.values() else ()
    bad = [k for k, d in device_map.items() if d in offloaded and k in g.tensor_index and k not in g.node_index]
    if not bad:
        return []
    return [Violation("unhooked", f"{len(bad)} offloaded tensors are mapped on their own, e.g. {bad[:3]}: accelerate "
                      "hooks only modules named in the map, so they would never be loaded; map their module instead.")]


_MIXED = object()  # a subtree whose tensors are on more than one device


def _no_split(problem: Problem, devices: list) -> list[Violation]:
    g = problem.graph
    nodes, no_split = g.nodes, g.no_split
    # Per node: None (no tensor with a device below it), its one device, or _MIXED; bottom-up in one pass.
    where: list = [None] * len(nodes)
    for t, d in zip(g.tensors, devices):
        if d is not None:
            m = t.module
            if where[m] is None:
                where[m] = d
            elif where[m] is not _MIXED and where[m] != d:
                where[m] = _MIXED
    for i in range(len(nodes) - 1, 0, -1):
        d = where[i]
        if d is not None:
            p = nodes[i].parent
            if where[p] is None:
                where[p] = d
            elif where[p] is not _MIXED and where[p] != d:
                where[p] = _MIXED
    out = []
    for i, node in enumerate(nodes):
        if node.cls in no_split and where[i] is _MIXED:
            parent, outer = node.parent, True
            while parent >= 0:
                if nodes[parent].cls in no_split and where[parent] is _MIXED:
                    outer = False
                    break
                parent = nodes[parent].parent
            if outer:
                out.append(Violation(
                    "no-split", f"{node.name or '<root>'} ({node.cls}) is split across "
                    f"{sorted(map(str, _devices_under(g, i, devices)))}."
                ))
    return out


def _devices_under(g, node: int, devices: list) -> set:
    """The devices of the tensors in a node's subtree."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        found.update(devices[t] for t in g.nodes[n].params + g.nodes[n].buffers if devices[t] is not None)
        stack.extend(g.nodes[n].children)
    return found


def validate(model, device_map, max_memory=None, *, no_split_module_classes=None, offload_buffers=False,
             dtype=None, special_dtypes=None, generation=None) -> list[Violation]:
    """Every way ``device_map`` breaks accelerate's runtime rules for ``model`` under ``max_memory``.

    Checks coverage (every tensor has a device, every key names something), no-split modules kept whole,
    tied tensors together, and each device's peak memory during a forward within its budget — the main
    device's peak including the buffers of offloaded modules and the largest chain of streamed weights.

    Parameters
    ----------
    model : torch.nn.Module
    device_map : dict
        Module or tensor names to devices, as accepted by ``dispatch_model``.
    max_memory : dict, optional
        Budgets as accelerate accepts them; the machine's memory when omitted.
    no_split_module_classes : list of str, optional
        United with the model's own ``_no_split_modules`` (and its sub-models').
    offload_buffers : bool
        As passed to ``dispatch_model``.
    generation : GenerationBudget, optional
        Also count what ``generate`` needs where it runs: KV cache, logits, activations
        (:mod:`allocator.generation`).

    Returns
    -------
    list of Violation
        Empty when the map is valid.

    Examples
    --------
    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # 288 bytes per layer
    >>> validate(model, {"0": "cpu", "1": "disk"}, {"cpu": 600})
    []
    >>> [v.kind for v in validate(model, {"0": "cpu", "1": "disk"}, {"cpu": 500})]
    ['budget']
    """
    problem = build_problem(
        model, max_memory, no_split_module_classes=no_split_module_classes, offload_buffers=offload_buffers,
        dtype=dtype, special_dtypes=special_dtypes, generation=generation,
    )
    return check(problem, device_map)[0]
