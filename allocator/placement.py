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

    Returns a new dict; the argument is not modified.

    >>> clean_device_map({"a.x": 0, "a.y": 0, "b": "cpu"})
    {'b': 'cpu', 'a': 0}
    """
    result = dict(device_map)
    _clean(result, module_name)
    return result


def _clean(device_map: dict, module_name: str) -> None:
    prefix = "" if module_name == "" else f"{module_name}."
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module_name] = values[0]
    children = [k for k in device_map if k.startswith(prefix) and len(k) > len(module_name)]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    for child in sorted({".".join(k.split(".")[:depth]) for k in children}):
        _clean(device_map, child)
