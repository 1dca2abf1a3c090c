"""accelerate's runtime rules (see :mod:`allocator.runtime`) as small functions of a map's devices and a tensor's
flags, one helper per rule: the main device, the offloaded devices, the device of a name, what moves with an offloaded
module, where a module executes.

They import nothing of the package but the ``Device`` type, so every layer that evaluates maps (:mod:`allocator.runs`,
:mod:`allocator.runtime`, :mod:`allocator.validate`, :mod:`allocator.cost`, the strategies) can use them;
:mod:`allocator.runtime` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping

from .budgets import Device

__all__ = ["main_device", "offloaded_devices", "device_of", "moves_with_weights", "moves", "executes_on"]


def main_device(devices) -> Device:
    """The device offloaded modules execute on, exactly as ``dispatch_model`` picks it.

    ``devices`` are the values of a device map. Integer indices give the lowest index for small indices; the
    expression is kept literal so that it matches accelerate in the same process.

    >>> main_device([1, "cpu", 0]), main_device(["cpu", "disk"])
    (0, 'cpu')
    """
    non_offloaded = set(devices) - {"cpu", "disk"}
    return list(non_offloaded)[0] if non_offloaded else "cpu"


def offloaded_devices(main: Device) -> frozenset:
    """The map values whose weights are streamed to ``main`` at each forward."""
    return frozenset({"disk"}) if main in ("cpu", "mps") else frozenset({"cpu", "disk"})


def device_of(name: str, device_map: Mapping[str, Device]) -> Device | None:
    """The device of a module or tensor name by longest-prefix match (``None`` where the map does not cover it).

    >>> device_of("layers.1.mlp.weight", {"layers.1": 0, "": "cpu"})
    0
    """
    while True:
        if name in device_map:
            return device_map[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


def moves_with_weights(tensor, offload_buffers: bool) -> bool:
    """A tensor leaves the main device with its offloaded module: parameters, and persistent buffers when
    ``offload_buffers`` (non-persistent buffers always stay)."""
    return moves(tensor.is_param, tensor.persistent, offload_buffers)


def moves(is_param, persistent, offload_buffers: bool):
    """:func:`moves_with_weights` from a tensor's flags, or from whole columns of them (numpy bool arrays of
    :class:`allocator.graph.Tensors` columns, elementwise)."""
    return is_param | (offload_buffers & persistent)


def executes_on(device: Device, main: Device, offloaded, hooks: bool) -> Device:
    """Where a module mapped to ``device`` runs: the main device when offloaded; ``mps`` for ``cpu`` modules when
    ``mps`` is main (they move there at dispatch); else its own device.

    >>> executes_on("cpu", 0, {"cpu", "disk"}, True), executes_on(1, 0, {"cpu", "disk"}, True)
    (0, 1)
    """
    if device in offloaded:
        return main
    if device == "cpu" and main == "mps" and hooks:
        return "mps"
    return device
