"""What accelerate's ``dispatch_model`` does with a device map, as memory: the rules a plan must respect.

Checked against accelerate 1.15 (``big_modeling.dispatch_model``, ``hooks.AlignDevicesHook``):

- The main device is ``list(set(values) - {"cpu", "disk"})[0]``, or ``"cpu"`` when there is no accelerator.
- Offloaded devices are ``{"disk"}`` when the main device is ``"cpu"`` or ``"mps"``, else ``{"cpu", "disk"}``.
  With ``"mps"`` as main, ``"cpu"`` modules are not offloaded: their weights move to ``mps`` at dispatch.
- An offloaded module with direct tensors gets a hook that copies its direct parameters (and persistent
  buffers with ``offload_buffers=True``) to the main device before its forward and drops them after. A
  parent's hook stays active while its children run, so the room needed is the largest sum along a chain.
- Buffers of offloaded modules move to the main device at dispatch unless ``offload_buffers=True``;
  non-persistent buffers always do.
- Offloaded ``cpu`` weights stay in RAM; ``disk`` weights are memory-mapped (no RAM budget is used while
  an accelerator is main; with ``cpu`` as main they are streamed into RAM like any offloaded weight).
- A map with one device other than disk gets no hooks: everything lives on that device.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from .budgets import Device
from .graph import ModelGraph

__all__ = ["Memory", "Recent", "device_of", "executes_on", "extra_by_device", "main_device", "moves_with_weights",
           "stream_reserve", "tensor_devices", "offloaded_devices", "peaks", "streamed_chain", "workspace"]


@dataclass(frozen=True, slots=True)
class Memory:
    """Memory a device map needs at runtime.

    ``peak`` is bytes per device at its highest point during a forward (the main device's includes
    ``streamed``); ``chain`` names the offloaded modules whose weights are materialised together at that point.
    """

    peak: Mapping
    main: Device
    streamed: int
    chain: tuple[str, ...]
    generation: Mapping = field(default_factory=dict)
    """Of ``peak``, the bytes per device a generation budget adds (KV cache, logits, activations)."""


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
    return tensor.is_param or (offload_buffers and tensor.persistent)


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


def _node_device(graph: ModelGraph, devices: list, node: int) -> Device | None:
    """The device of a node's first tensor, itself or below it (``None`` when it has none on the map)."""
    stack = [node]
    while stack:
        n = stack.pop()
        for t in graph.nodes[n].params + graph.nodes[n].buffers:
            if devices[t] is not None:
                return devices[t]
        stack.extend(reversed(graph.nodes[n].children))
    return None


def extra_by_device(graph: ModelGraph, devices: list, node_bytes: Mapping[int, int], main: Device, offloaded,
                    hooks: bool) -> dict:
    """Bytes per device of ``node_bytes`` (node -> bytes that live where the node executes)."""
    out: dict = {}
    for node, nbytes in node_bytes.items():
        device = _node_device(graph, devices, node)
        if device is not None and nbytes:
            home = executes_on(device, main, offloaded, hooks)
            out[home] = out.get(home, 0) + nbytes
    return out


class Recent:
    """The last few results of a linear-time evaluation of device maps for a problem or graph (tensor devices,
    :func:`allocator.validate.check`, the cost model).

    A plan is checked by its strategy, again by ``auto`` and again by ``plan``; the later times are a lookup.
    Problems and graphs are held weakly; a map is matched by its items in order, so a map changed in place is
    evaluated again.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self._entries: list = []

    def get(self, problem, device_map: Mapping):
        """``(value or None, key)``; pass the key to :meth:`put`. Anything but a mapping is never remembered (its
        evaluation raises the typed error)."""
        if not isinstance(device_map, Mapping):
            return None, None
        key = tuple(device_map.items())
        for ref, known, value in reversed(self._entries):
            if ref() is problem and known == key:
                return value, key
        return None, key

    def put(self, problem, key, value) -> None:
        if key is None:
            return
        self._entries = (self._entries + [(weakref.ref(problem), key, value)])[-self.size:]


_DEVICES = Recent()


def tensor_devices(graph: ModelGraph, device_map: Mapping[str, Device]) -> list:
    """The device of every tensor of the graph, in graph order: :func:`device_of` for each tensor name, found in
    one walk down the module tree (a node inherits its parent's device unless the map names it), O(nodes + tensors).
    The last few results are remembered (:class:`Recent`); each call returns a new list.
    """
    known, key = _DEVICES.get(graph, device_map)
    if known is None:
        known = _tensor_devices(graph, device_map)
        _DEVICES.put(graph, key, known)
    return list(known)


def _tensor_devices(graph: ModelGraph, device_map: Mapping[str, Device]) -> list:
    tensors = graph.tensors
    if not device_map:
        return [None] * len(tensors)
    get = device_map.get
    missing = _MISSING
    inherited = []  # per node
    for node in graph.nodes:
        device = get(node.name, missing)
        if device is missing:
            device = inherited[node.parent] if node.parent >= 0 else None
        inherited.append(device)
    tensor_index = graph.tensor_index
    if not any(key in tensor_index for key in device_map):  # no tensor named on its own: each takes its module's
        return [inherited[t.module] for t in tensors]
    out = []
    for t in tensors:
        device = get(t.name, missing)
        out.append(inherited[t.module] if device is missing else device)
    return out


_MISSING = object()


def streamed_chain(graph: ModelGraph, streamed: list[int]) -> tuple[int, list[int]]:
    """Largest sum of ``streamed[node]`` along a root-to-leaf chain, and that chain's nodes with bytes.

    ``streamed[node]`` is what the node's own hook copies in (0 when it is not offloaded).
    """
    nodes = graph.nodes
    best = list(streamed)
    below = [0] * len(nodes)   # largest best[] among a node's children (best[] is never negative)
    for i in range(len(nodes) - 1, -1, -1):  # preorder: children come after their parent
        best[i] += below[i]
        parent = nodes[i].parent
        if parent >= 0 and best[i] > below[parent]:
            below[parent] = best[i]
    chain, i = [], 0
    while True:
        if streamed[i]:
            chain.append(i)
        children = nodes[i].children
        if not children:
            break
        i = max(children, key=lambda c: best[c])
    return best[0], chain


def stream_reserve(graph: ModelGraph, devices: list, offloaded, *, offload_buffers: bool = False) -> int:
    """Bytes the main device must keep free for streaming when tensors on ``offloaded`` devices are streamed."""
    streamed = [0] * len(graph.nodes)
    for t, device in zip(graph.tensors, devices):
        if device in offloaded and moves_with_weights(t, offload_buffers):
            streamed[t.module] += t.nbytes
    return streamed_chain(graph, streamed)[0]


def peaks(graph: ModelGraph, devices: list, map_devices, *, offload_buffers: bool = False) -> Memory:
    """Bytes each device holds at its peak during a forward, under accelerate's runtime.

    Parameters
    ----------
    devices : list
        One device per tensor (as from :func:`tensor_devices`); uncovered tensors are ignored.
    map_devices : iterable
        The values of the device map (they decide the main device and whether hooks are attached).

    Returns
    -------
    Memory
    """
    used = set(map_devices)
    main = main_device(used)
    hooks = len(used) > 1 or "disk" in used
    offloaded = offloaded_devices(main) if hooks else frozenset()
    resident: dict = {d: 0 for d in used}
    resident.setdefault(main, 0)
    streamed = [0] * len(graph.nodes)
    for t, device in zip(graph.tensors, devices):
        if device is None:
            continue
        off = device in offloaded
        if off:
            moves = moves_with_weights(t, offload_buffers)
            if moves:
                streamed[t.module] += t.nbytes  # every name of a shared tensor is copied by its own hook
        if t.storage != t._index:
            continue
        if off:
            if not moves:
                home = main                 # buffers of offloaded modules go to the main device
            elif device == "cpu":
                home = "cpu"                # offloaded cpu weights stay in RAM
            else:
                home = "disk"               # memory-mapped
        elif device == "cpu" and main == "mps" and hooks:
            home = "mps"
        else:
            home = device
        resident[home] = resident.get(home, 0) + t.nbytes
    reserve, chain = streamed_chain(graph, streamed)
    resident[main] = resident.get(main, 0) + reserve
    generation = _generation_bytes(graph, devices, main, offloaded, hooks)
    for device, nbytes in generation.items():
        resident[device] = resident.get(device, 0) + nbytes
    return Memory(peak=resident, main=main, streamed=reserve, chain=tuple(graph.nodes[i].name for i in chain),
                  generation=generation)


def workspace(graph: ModelGraph, *, main: bool) -> int:
    """Bytes a generation budget needs on a device that runs part of the model beyond its units' own (activations;
    on the main device also the next-token scores); 0 without a generation budget."""
    return graph.workspace + (graph.main_workspace if main else 0)


def _generation_bytes(graph: ModelGraph, devices: list, main: Device, offloaded, hooks: bool) -> dict:
    """Generation bytes per device: each node's extra where it executes, the workspace on every executing device."""
    if not (graph.extra or graph.workspace or graph.main_workspace):
        return {}
    out = extra_by_device(graph, devices, graph.extra, main, offloaded, hooks)
    executing = {executes_on(d, main, offloaded, hooks) for d in devices if d is not None} | {main}
    for device in executing - {"disk"}:
        out[device] = out.get(device, 0) + workspace(graph, main=device == main)
    return out
