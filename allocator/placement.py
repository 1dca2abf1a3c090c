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


def clean_device_map(device_map: Mapping[str, Device], module_name: str = "") -> dict:
    """Group entries whose keys under one prefix all share a device (accelerate's ``clean_device_map``).

    Same result as accelerate's, in O(total length of the names) instead of its O(keys x prefixes): from the top,
    a module whose keys strictly under it (at least two) all map to one device is replaced by a single entry.
    Returns a new dict; the argument is not modified.

    >>> clean_device_map({"a.x": 0, "a.y": 0, "b": "cpu"})
    {'a': 0, 'b': 'cpu'}
    """
    root: dict = {}  # trie: component -> (children, key at this node or None)
    for key in device_map:
        node = root
        parts = key.split(".") if key else []
        for part in parts:
            node = node.setdefault(part, {})
        node[_KEY] = key
    result: dict = {}
    _collapse(root, module_name, device_map, result, top=True)
    return result


_KEY = object()  # marks the map key that ends at a trie node


def _under(node: dict, device_map) -> tuple[set, int]:
    """Devices and number of keys strictly below a trie node."""
    devices, count, stack = set(), 0, [v for k, v in node.items() if k is not _KEY]
    while stack:
        child = stack.pop()
        if _KEY in child:
            devices.add(device_map[child[_KEY]])
            count += 1
        stack.extend(v for k, v in child.items() if k is not _KEY)
    return devices, count


def _collapse(node: dict, name: str, device_map, result: dict, top: bool = False) -> None:
    devices, count = _under(node, device_map)
    if top and not name:
        # accelerate looks at every key from the root (the root's own key included)
        if _KEY in node:
            devices.add(device_map[node[_KEY]])
            count += 1
    if len(devices) == 1 and count > 1:
        result[name] = next(iter(devices))
        return
    if _KEY in node and not (top and not name and len(devices) == 1 and count > 1):
        result[node[_KEY]] = device_map[node[_KEY]]
    for part, child in node.items():
        if part is _KEY:
            continue
        _collapse(child, f"{name}.{part}" if name else part, device_map, result)
