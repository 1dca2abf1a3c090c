"""A strategy's answer: a device map, with the notes that explain it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .budgets import Device

__all__ = ["Placement", "clean_device_map"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each entry of the model goes.

    ``device_map`` maps module or tensor names (``""`` for the whole model) to a device: an accelerator index,
    ``"mps"``, ``"cpu"`` or ``"disk"``. ``notes`` are the strategy's decisions in order, for ``explain()``.
    """

    device_map: Mapping[str, Device]
    strategy: str
    notes: tuple[str, ...] = ()
    optimal: bool | None = None
    """``True`` when the strategy proved no valid plan has a lower estimated cost (``ilp``); ``None`` if unknown."""
    diagnostics: tuple[tuple[str, str], ...] = ()
    """``(level, message)`` pairs that :func:`allocator.plan` reports for the plan it returns: ``"warning"``
    (``warnings.warn``, as accelerate warns) or ``"info"`` (a log line at INFO, as accelerate logs)."""


def clean_device_map(device_map: Mapping[str, Device], module_name: str = "") -> dict:
    """Group entries whose keys under one prefix all share a device (accelerate's ``clean_device_map``).

    Same result as accelerate's, in O(total length of the names) instead of its O(keys x prefixes): from the top,
    a module whose keys strictly under it (at least two) all map to one device is replaced by a single entry.
    Returns a new dict; the argument is not modified.

    >>> clean_device_map({"a.x": 0, "a.y": 0, "b": "cpu"})
    {'a': 0, 'b': 'cpu'}
    """
    if not module_name and "" not in device_map and "." not in "".join(device_map):
        # one level of names (a flat stack): all of them become "" when they share one device, else nothing merges
        devices = set(device_map.values())
        return {"": next(iter(devices))} if len(devices) == 1 and len(device_map) > 1 else dict(device_map)
    root: dict = {}  # trie: component -> (children, key at this node or None)
    for key in device_map:
        node = root
        parts = key.split(".") if key else []
        for part in parts:
            node = node.setdefault(part, {})
        node[_KEY] = key
    below = _below(root, device_map)
    result: dict = {}
    _collapse(root, module_name, device_map, below, result, top=True)
    return result


_KEY = object()    # marks the map key that ends at a trie node
_NONE = object()   # no key below a trie node
_MIXED = object()  # keys below a trie node map to more than one device


def _merge(a, b):
    if b is _NONE:
        return a
    if a is _NONE:
        return b
    return a if a == b else _MIXED


def _below(root: dict, device_map) -> dict:
    """For every trie node (by id): (the one device of the keys strictly below it, or _NONE / _MIXED; their number),
    children before parents."""
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(child for part, child in node.items() if part is not _KEY)
    below: dict = {}
    for node in reversed(order):  # every child was reached after its parent
        device, count = _NONE, 0
        for part, child in node.items():
            if part is _KEY:
                continue
            if _KEY in child:
                device = _merge(device, device_map[child[_KEY]])
                count += 1
            child_device, child_count = below[id(child)]
            if child_count:
                device = _merge(device, child_device)
                count += child_count
        below[id(node)] = (device, count)
    return below


def _collapse(node: dict, name: str, device_map, below: dict, result: dict, top: bool = False) -> None:
    device, count = below[id(node)]
    if top and not name and _KEY in node:
        # accelerate looks at every key from the root (the root's own key included)
        device = _merge(device, device_map[node[_KEY]])
        count += 1
    if device is not _NONE and device is not _MIXED and count > 1:
        result[name] = device
        return
    if _KEY in node:
        result[node[_KEY]] = device_map[node[_KEY]]
    for part, child in node.items():
        if part is _KEY:
            continue
        _collapse(child, f"{name}.{part}" if name else part, device_map, below, result)
