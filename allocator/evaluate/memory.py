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
  an accelerator is main; with ``cpu`` as main they are streamed into RAM like any offloaded weight, and a tensor
  cast to a smaller ``dtype`` than it is stored in is read whole first: :func:`allocator.rules.dispatch.read_copy`).
- A map with one device other than disk gets no hooks: everything lives on that device.

The rules themselves, one function each, are in :mod:`allocator.rules` (re-exported here); this module says what they
mean as memory: the runs of a map, its peaks, its streamed chain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..memo import Key
from ..budgets import Device, is_accelerator
from ..model.graph import ModelGraph
from ..rules.dispatch import (
    device_of, executes_on, hooks_attach, main_device, moves, moves_with_weights, offloaded_devices,
)
from .runs import Run, columns, expand, first_device, pieces, runs

__all__ = ["Memory", "device_of", "executes_on", "expert_cache_reserve", "extra_by_device", "fetch_chunk",
           "fetch_reserves", "main_device",
           "map_runs", "moves", "moves_with_weights", "tensor_devices", "offloaded_devices", "peaks", "prefetch_of",
           "prefetch_reserve", "runs_on", "streamed_chain", "streams_held", "workspace"]

RUNS = Key("runs")


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
    prefetch: int = 0
    """Of the main device's ``peak``, the bytes the allocator runtime's prefetch holds beyond ``streamed``
    (:func:`prefetch_reserve`); 0 under accelerate's hooks."""


def extra_by_device(graph: ModelGraph, found: list, node_bytes: Mapping[int, int], main: Device, offloaded,
                    hooks: bool) -> dict:
    """Bytes per device of ``node_bytes`` (node -> bytes that live where the node executes), for a map's runs
    (:func:`map_runs`): a node executes where the first tensor of its subtree on the map is."""
    cols = columns(graph)
    out: dict = {}
    for node, nbytes in node_bytes.items():
        device = first_device(found, cols.first[node], cols.last[node])
        if device is not None and nbytes:
            home = executes_on(device, main, offloaded, hooks)
            out[home] = out.get(home, 0) + nbytes
    return out


def map_runs(graph: ModelGraph, device_map: Mapping[str, Device]) -> list[Run]:
    """:func:`allocator.evaluate.runs.runs` of a map; the last few results are remembered with the graph
    (:meth:`allocator.memo.Derived.recent`)."""
    return graph.derived.recent(RUNS, device_map, lambda: runs(graph, device_map))


def tensor_devices(graph: ModelGraph, device_map: Mapping[str, Device]) -> list:
    """The device of every tensor of the graph, in graph order: :func:`device_of` for each tensor name (``None``
    where the map does not cover it). Returns a new list."""
    return expand(map_runs(graph, device_map))


def streamed_chain(graph: ModelGraph, found: list[Run], offloaded, *, offload_buffers: bool = False,
                   read_copies: bool = False) -> tuple[int, list[int]]:
    """The largest sum of streamed bytes along a root-to-leaf chain when the tensors of ``found`` (runs) on
    ``offloaded`` devices are streamed, and that chain's nodes that stream something.

    A node's hook streams its own moving tensors; hooks of nested modules are active together. An offloaded run is
    cut into whole subtrees (:func:`allocator.evaluate.runs.pieces`), whose chains are known
    (:class:`allocator.evaluate.runs.Moving`),
    and loose tensors, whose modules stream them on top of the chains below. On a tie the chain that comes first
    in model order wins. With ``read_copies`` a hook also holds the copy it reads a cast tensor into
    (:func:`allocator.rules.dispatch.read_copy`; the main device is the CPU).

    Notes
    -----
    O(p x depth) for p pieces of the offloaded runs.
    """
    cols = columns(graph)
    mov = cols.moving(offload_buffers, read_copies)
    parent = cols.parent
    subtrees: list[int] = []
    loose: dict[int, int] = {}   # module -> bytes its hook streams (those of its tensors that are offloaded)
    for run in found:
        if run.device not in offloaded or mov.sum_nbytes[run.end] == mov.sum_nbytes[run.start]:
            continue
        if run.node >= 0:
            subtrees.append(run.node)
            continue
        nodes, tensors = pieces(cols, run.start, run.end)
        subtrees += nodes[mov.chain_array()[nodes] != 0].tolist()
        for tensor in tensors[mov.held_array()[tensors] != 0].tolist():
            module = cols.module[tensor]
            loose[module] = loose.get(module, 0) + mov.held[tensor]

    def above(node: int) -> int:   # what loose hooks of the node's ancestors stream
        total, node = 0, parent[node]
        while node >= 0:
            total += loose.get(node, 0)
            node = parent[node]
        return total

    # every chain ends in a subtree or at a loose module; the first in model order among the largest wins
    best, top = 0, -1
    if loose:
        for node, value in sorted([(node, mov.chain[node]) for node in subtrees] + list(loose.items())):
            value += above(node)
            if value > best:
                best, top = value, node
    elif subtrees:
        subtrees.sort()
        values = mov.chain_array()[subtrees]
        k = int(np.argmax(values))   # the first of the largest
        if values[k] > 0:
            best, top = int(values[k]), subtrees[k]
    if top < 0:
        return 0, []
    chain, node = [], top
    while node >= 0:               # the loose ancestors, and the end itself
        if node in loose:
            chain.append(node)
        node = parent[node]
    chain.reverse()
    if top not in loose:           # down the subtree along its largest chain
        node = top
        while node >= 0:
            if mov.own[node]:
                chain.append(node)
            node = mov.next_in_chain(node)
    return best, chain


PLANNED_PREFETCH = 1
"""The depth :func:`allocator.plan` tries first when ``PlanOptions.prefetch`` is left to it (``None``), and the depth
a problem built with ``prefetch=None`` reserves for."""


def prefetch_of(runtime) -> int:
    """How many offloaded modules ``runtime`` (a problem's :class:`allocator.problem.slices.RuntimeOptions`) makes
    ready ahead: its ``prefetch`` with ``runtime="allocator"`` (:data:`PLANNED_PREFETCH` where it is left to the
    plan), 0 with accelerate's hooks."""
    if runtime.name != "allocator":
        return 0
    return PLANNED_PREFETCH if runtime.prefetch is None else runtime.prefetch


def streams_held(runtime, reserve: int) -> int:
    """What a streaming reserve ``reserve`` (the largest chain a fill may stream) costs on the main device under
    ``runtime`` (a problem's :class:`allocator.problem.slices.RuntimeOptions`): ``reserve`` for accelerate's hooks,
    ``(1 + prefetch) * reserve`` for the allocator runtime, since each module made ready ahead streams at most one
    chain's worth. An upper bound of :func:`prefetch_reserve` plus the chain, so that a fill charging it stays valid;
    works on CP-SAT expressions."""
    return reserve * (1 + prefetch_of(runtime))


def prefetch_reserve(graph: ModelGraph, found: list[Run], offloaded, k: int, *, offload_buffers: bool = False,
                     read_copies: bool = False, skip: tuple = ()) -> int:
    """Bytes the allocator runtime holds on the main device beyond the streamed chain when it makes ``k`` offloaded
    modules ready ahead: the ``k`` largest amounts a single hook streams (its module's own offloaded tensors).
    Tensors in the ``skip`` ranges (``(start, end)`` tensor indices: experts modules the runtime runs expert by
    expert, :mod:`allocator.offload.experts`, never made ready ahead) are not counted.

    The runtime follows the execution order it observes (which differs from module order, and from one forward to
    the next in ``generate``), so the reserve is the largest ``k`` whatever the order, not the largest window of
    ``k`` consecutive modules in one assumed order.

    Notes
    -----
    O(t) for t offloaded tensors.
    """
    if k <= 0 or not offloaded:
        return 0
    cols = columns(graph)
    mov = cols.moving(offload_buffers, read_copies)
    held, module = mov.held_array(), cols.module_array()
    if skip:
        held = held.copy()
        for a, b in skip:
            held[a:b] = 0
    per: dict[int, int] = {}
    for run in found:
        if run.device not in offloaded or mov.sum_nbytes[run.end] == mov.sum_nbytes[run.start]:
            continue
        part = held[run.start:run.end]
        hits = np.flatnonzero(part)
        for m, nbytes in zip(module[run.start:run.end][hits].tolist(), part[hits].tolist()):
            per[m] = per.get(m, 0) + nbytes
    return sum(sorted(per.values(), reverse=True)[:k])


def peaks(graph: ModelGraph, found: list[Run], map_devices, *, offload_buffers: bool = False,
          prefetch: int = 0, skip: tuple = ()) -> Memory:
    """Bytes each device holds at its peak during a forward, under accelerate's runtime.

    Parameters
    ----------
    found : list of Run
        The map's runs (:func:`map_runs`); uncovered tensors are ignored.
    map_devices : iterable
        The values of the device map (they decide the main device and whether hooks are attached).
    prefetch : int
        Offloaded modules the runtime makes ready ahead (:func:`prefetch_of`): their bytes are held on the main device
        on top of the streamed chain (:func:`prefetch_reserve`).
    skip : tuple
        Tensor ranges the runtime never makes ready ahead (:func:`prefetch_reserve`): the experts modules it runs
        expert by expert. On a CPU main device it reads their routed experts in place from the mapped files
        (:attr:`allocator.offload.experts.RoutedExperts.in_place`), so they are not part of the streamed chain either.

    Returns
    -------
    Memory
    """
    used = set(map_devices)
    main = main_device(used)
    hooks = hooks_attach(used)
    offloaded = offloaded_devices(main) if hooks else frozenset()
    resident: dict = {d: 0 for d in used}
    resident.setdefault(main, 0)
    cols = columns(graph)
    moving = cols.moving(offload_buffers).sum_counted
    counted = cols.sum_counted
    for run in found:
        device, a, b = run.device, run.start, run.end
        if device is None:
            continue
        if device in offloaded:
            weights = moving[b] - moving[a]
            resident[main] += counted[b] - counted[a] - weights  # buffers of offloaded modules go to the main device
            home = "cpu" if device == "cpu" else "disk"        # offloaded cpu weights stay in RAM; disk is mapped
            resident[home] = resident.get(home, 0) + weights
        else:
            home = "mps" if device == "cpu" and main == "mps" and hooks else device
            resident[home] = resident.get(home, 0) + counted[b] - counted[a]
    # every name of a shared tensor is copied by its own hook, so the chain counts nbytes, not counted bytes; on a
    # CPU main device the routed experts (skip) are read in place from the mapped files: nothing of them is staged
    streaming = _cut(found, skip) if main == "cpu" and skip else found
    reserve, chain = streamed_chain(graph, streaming, offloaded, offload_buffers=offload_buffers,
                                    read_copies=main == "cpu")
    ahead = prefetch_reserve(graph, found, offloaded, prefetch, offload_buffers=offload_buffers,
                             read_copies=main == "cpu", skip=skip)
    resident[main] = resident.get(main, 0) + reserve + ahead
    generation = _generation_bytes(graph, found, main, offloaded, hooks)
    for device, nbytes in generation.items():
        resident[device] = resident.get(device, 0) + nbytes
    return Memory(peak=resident, main=main, streamed=reserve, chain=tuple(graph.nodes.name[i] for i in chain),
                  generation=generation, prefetch=ahead)


def _cut(found: list[Run], spans: tuple) -> list[Run]:
    """``found`` without the tensors of ``spans`` (``(start, end)`` tensor ranges): runs cut around them."""
    out = []
    for run in found:
        pieces_of = [(run.start, run.end)]
        for a, b in spans:
            pieces_of = [p for s, e in pieces_of for p in ((s, min(e, a)), (max(s, b), e)) if p[0] < p[1]] \
                if a < run.end and b > run.start else pieces_of
        whole = pieces_of == [(run.start, run.end)]
        out += [run] if whole else [Run(s, e, run.device) for s, e in pieces_of]
    return out


def workspace(graph: ModelGraph, *, main: bool) -> int:
    """Bytes a generation budget needs on a device that runs part of the model beyond its units' own (activations;
    on the main device also the next-token scores); 0 without a generation budget."""
    return graph.workspace + (graph.main_workspace if main else 0)


def _generation_bytes(graph: ModelGraph, found: list[Run], main: Device, offloaded, hooks: bool) -> dict:
    """Generation bytes per device: each node's extra where it executes, the workspace on every executing device."""
    if not (graph.extra or graph.workspace or graph.main_workspace):
        return {}
    out = extra_by_device(graph, found, graph.extra, main, offloaded, hooks)
    executing = {executes_on(run.device, main, offloaded, hooks) for run in found if run.device is not None} | {main}
    for device in executing - {"disk"}:
        out[device] = out.get(device, 0) + workspace(graph, main=device == main)
    return out


def runs_on(problem, device_map: Mapping) -> dict:
    """Experts module name -> the device its routed experts run for (the device of its layer, where the runtime
    computes resident experts and brings fetched ones): the device of the layer's router where that is an
    accelerator, else the main device (offloaded modules execute there). Only fused experts modules offloaded by
    ``device_map`` (those :mod:`allocator.offload.experts` runs expert by expert) are named."""
    main = main_device(set(device_map.values()))
    offloaded = offloaded_devices(main)
    out = {}
    for layer in problem.moe:
        if layer.kind != "fused" or layer.common or layer.experts not in problem.graph.node_index:
            continue
        if device_of(layer.experts, device_map) not in offloaded:
            continue
        router = device_of(layer.router or layer.block, device_map)
        out[layer.experts] = router if router is not None and is_accelerator(router) else main
    return out


def fetch_chunk(layer) -> int:
    """Experts the runtime fetches into one reused buffer at a time for ``layer`` (an
    :class:`allocator.model.experts.MoELayer`) on an accelerator other than the main device: those a decoding step of
    4 sequences can route (``4 * top_k``), at most all of them; a longer call fetches in turns of that many."""
    return max(1, min(layer.num_experts, 4 * (layer.top_k or 1)))


def fetch_reserves(problem, device_map: Mapping) -> dict:
    """Bytes the runtime holds on each accelerator other than the main device for the routed experts it fetches
    there (:func:`runs_on`): the largest :func:`fetch_chunk` of experts among the layers that run there. The main
    device's share is in the streamed chain (:func:`allocator.evaluate.memory.peaks`)."""
    main = main_device(set(device_map.values()))
    layers = {m.experts: m for m in problem.moe}
    cols = columns(problem.graph)
    out: dict = {}
    for name, device in runs_on(problem, device_map).items():
        if device == main:
            continue
        layer = layers[name]
        node = problem.graph.node_index[name]
        whole = int(sum(problem.graph.tensors.nbytes[cols.first[node]:cols.last[node]]))
        out[device] = max(out.get(device, 0), whole // layer.num_experts * fetch_chunk(layer))
    return out


def expert_cache_reserve(problem, device_map: Mapping) -> tuple[int, int]:
    """``(slots, bytes)`` of the allocator runtime's cache of recently routed experts on the main device
    (:mod:`allocator.offload.expert_cache`) for ``device_map``: ``PlanOptions.expert_cache`` slots, each the size of
    the largest expert among the layers whose routed experts run on the main device (:func:`runs_on`); ``(0, 0)``
    where no such layer exists or no cache is asked for. The plan adds these bytes to the main device's peak
    (:func:`allocator.report.plan.finish`) and takes them from the room its resident experts may use
    (:mod:`allocator.strategies.experts`), so the runtime never holds more than the plan counted."""
    slots = problem.runtime.expert_cache if problem.runtime.name == "allocator" else 0
    if not slots or not problem.moe:
        return 0, 0
    main = main_device(set(device_map.values()))
    layers = {m.experts: m for m in problem.moe}
    cols = columns(problem.graph)
    size = 0
    for name, device in runs_on(problem, device_map).items():
        if device != main:
            continue
        node = problem.graph.node_index[name]
        whole = int(sum(problem.graph.tensors.nbytes[cols.first[node]:cols.last[node]]))
        size = max(size, whole // layers[name].num_experts)
    return (slots, slots * size) if size else (0, 0)
