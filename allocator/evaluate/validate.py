"""One checker for every runtime rule a device map must respect (see :mod:`allocator.evaluate.memory`).

:func:`normalize_map` and :func:`format_bytes` are :mod:`allocator.budgets`'s, re-exported here, where callers found
them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import filterfalse

import numpy as np

from ..memo import Key
from ..budgets import format_bytes, normalize_map
from ..gc_pause import gc_paused
from ..problem import PlanOptions, Problem, build_problem
from ..rules.dispatch import ambiguous_main_device, device_objects, hooks_attach, moves, must_cover, nested_keys
from ..rules.loaders import loads_device_objects, loads_disk_only, reads_disk_buffers, tie_loads
from .runs import columns, devices_in
from .memory import (
    Memory, device_of, executes_on, extra_by_device, fetch_reserves, main_device, map_runs, offloaded_devices, peaks,
    prefetch_of,
)

__all__ = ["Violation", "budget_violations", "check", "experts_apart", "peak_parts", "routed_spans", "split_kept",
           "validate", "normalize_map", "format_bytes"]

CHECKED = Key("check")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule. ``kind`` is one of ``coverage``, ``nested``, ``main-device``, ``unknown-device``,
    ``no-split``, ``tied``, ``unhooked``, ``budget``, ``device-object``, and on ``loader="accelerate"`` also
    ``disk-only`` and ``unread-buffer`` (:mod:`allocator.rules` says which loading path each comes from).
    ``what`` says what is broken, ``fix`` how to mend it; ``message`` is both."""

    kind: str
    what: str
    fix: str = ""

    @property
    def message(self) -> str:
        """What is broken, then how to mend it (``"what; fix"``)."""
        return f"{self.what}; {self.fix}" if self.fix else self.what

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def check(problem: Problem, device_map: Mapping) -> tuple[list[Violation], Memory]:
    """Violations of ``device_map`` for ``problem``, and the memory it needs at runtime.

    Notes
    -----
    O(k log k) for k map entries, plus the tensors of offloaded runs that are not whole subtrees (once per graph,
    O(nodes + tensors) for its :class:`allocator.evaluate.runs.Columns`). The last few results are remembered
    (:meth:`allocator.memo.Derived.recent`); each call returns its own copies.
    """
    violations, memory = problem.derived.recent(CHECKED, device_map, lambda: _check(problem, device_map))
    return list(violations), replace(memory, peak=dict(memory.peak), generation=dict(memory.generation))


def _check(problem: Problem, device_map: Mapping) -> tuple[list[Violation], Memory]:
    g = problem.graph
    found: list[Violation] = []
    spelled = ambiguous_main_device(device_map.values()) if isinstance(device_map, Mapping) else None
    objects = device_objects(device_map.values()) if isinstance(device_map, Mapping) else []
    if objects and not loads_device_objects(problem.placing.loader, device_map.values()):
        found.append(Violation("device-object", f"the map's values include {objects}: "
                               f"{_loader(problem.placing.loader)} hands them to safetensors' safe_open, which "
                               "takes device strings and indices only", "map to 'cpu', 'disk' and integer "
                               "accelerator indices, as allocator's plans do."))
    device_map = normalize_map(device_map)
    if spelled is not None:
        found.append(Violation("main-device", f"the accelerators are spelled {list(spelled)}: dispatch_model makes "
                               "the first of a set of them the main device (where offloaded modules run and stream "
                               "their weights), and for strings that order changes with PYTHONHASHSEED",
                               "write integer "
                               f"indices ({sorted({normalize_map({'': v})[''] for v in spelled}, key=str)}), as "
                               "allocator's plans do."))
    lone = set(filterfalse(g.node_index.__contains__, device_map))   # keys that name no module (no Python step)
    unknown = [key for key in device_map if key and key in lone and key not in g.tensor_index] if lone else []
    if unknown:   # both loaders ignore them (check_device_map warns): a warning, not a violation
        log.warning("device map keys %s name no module or tensor of %s; they are ignored", unknown[:3], g.model_class)
    runs = map_runs(g, device_map)
    found += _coverage(problem, runs)
    found += _nested(device_map, set(unknown))
    found += _loader_rules(problem, device_map, runs)
    found += _no_split(problem, runs, main_device(set(device_map.values())))
    found += _unhooked(problem, device_map, lone)
    found += _ties(problem, device_map, runs)
    memory = peaks(g, runs, device_map.values(), offload_buffers=problem.placing.offload_buffers,
                   prefetch=prefetch_of(problem.runtime), skip=routed_spans(problem))
    for device, nbytes in fetch_reserves(problem, device_map).items():   # routed experts fetched off the main device
        memory.peak[device] = memory.peak.get(device, 0) + nbytes
    found += budget_violations(problem, memory, memory.peak, set(device_map.values()))
    return found, memory


def budget_violations(problem: Problem, memory: Memory, peak: Mapping, placed: set) -> list[Violation]:
    """Devices whose ``peak`` (bytes per device: :func:`check`'s, or the whole verdict's with what the runtime adds,
    :func:`allocator.judge.verdict.verdict`) is over their budget, or that hold bytes without one. ``memory`` says
    what the main device's streamed chain, prefetch and generation bytes are; ``placed`` the devices of the map."""
    found = []
    for device, used in peak.items():
        if device == "cpu" and "cpu" not in problem.budgets.order and "cpu" not in placed:
            continue   # no RAM budget, as in accelerate: unchecked, and explain says so (report/explain.unbudgeted_ram)
        if device not in problem.budgets.order or (device != "disk" and problem.budgets.limit(device) is None):
            found.append(Violation("unknown-device", f"device {device!r} has no budget in max_memory",
                                   "give it one or map nothing there."))
            continue
        limit = problem.budgets.limit(device)
        if limit is not None and used > limit:
            found.append(_over_budget(device, used, limit, memory))
    return found


def _over_budget(device, used: int, limit: int, memory: Memory) -> Violation:
    """The ``budget`` violation of ``device``: what it needs, of which what streams, prefetches and generates."""
    extra = ""
    if device == memory.main and memory.streamed:
        extra = f", of which {format_bytes(memory.streamed)} streams offloaded weights of {list(memory.chain)}"
        if memory.prefetch:
            extra += f" and {format_bytes(memory.prefetch)} holds the runtime's prefetch"
    if memory.generation.get(device):
        extra += (f"{', and' if extra else ', of which'} {format_bytes(memory.generation[device])} is for "
                  "generate (KV cache, logits, activations)")
    short = used - limit
    exact = f" ({short} B)" if short >= 1024 else ""
    return Violation("budget", f"device {device!r} needs {format_bytes(used)} ({used} B){extra} but its budget is "
                     f"{format_bytes(limit)} ({limit} B)", f"raise it by {format_bytes(short)}{exact} or move modules "
                     "off it.")


def _flags(problem: Problem):
    """``(is_param, persistent)`` of every tensor as numpy bool arrays (the graph's
    :class:`allocator.evaluate.runs.Columns`)."""
    cols = columns(problem.graph)
    return cols.is_param, cols.persistent


def _count(mask: np.ndarray, runs, keep) -> tuple[int, list[int]]:
    """How many tensors of ``mask`` lie in the runs for which ``keep(run)`` holds, and the first three."""
    total, first = 0, []
    for run in runs:
        if keep(run):
            hits = np.flatnonzero(mask[run.start:run.end])
            total += len(hits)
            first += (hits[:3 - len(first)] + run.start).tolist() if len(first) < 3 else []
    return total, first


def _coverage(problem: Problem, runs) -> list[Violation]:
    """Tensors the map gives no device: only parameters and persistent buffers must have one
    (:func:`allocator.rules.dispatch.must_cover`)."""
    if all(run.device is not None for run in runs):
        return []
    is_param, persistent = _flags(problem)
    count, first = _count(must_cover(is_param, persistent), runs, lambda run: run.device is None)
    if not count:
        return []
    names = [problem.graph.tensors.name[t] for t in first]
    return [Violation("coverage", f"{count} tensors have no device, e.g. {names}", "map them or a parent module.")]


def _nested(device_map: dict, unknown: set) -> list[Violation]:
    """Keys under another key of another device (:func:`allocator.rules.dispatch.nested_keys`)."""
    pairs = [(a, b) for a, b in nested_keys([k for k in device_map if k not in unknown])
             if device_map[a] != device_map[b]]
    if not pairs:
        return []
    shown = ", ".join(f"{b!r} ({device_map[b]!r}) under {a or '<root>'!r} ({device_map[a]!r})" for a, b in pairs[:3])
    return [Violation("nested", f"{len(pairs)} keys lie under another key of another device, e.g. {shown}: both "
                      "loaders fail on them", "map the outer module's other children instead of the outer module.")]


def _loader_rules(problem: Problem, device_map: dict, runs) -> list[Violation]:
    """What the loading path (``problem.placing.loader``) cannot load: a map on disk alone, persistent buffers on disk
    that are never read (:func:`allocator.rules.loaders.loads_disk_only`,
    :func:`allocator.rules.loaders.reads_disk_buffers`)."""
    placing = problem.placing
    found = []
    if set(device_map.values()) == {"disk"} and not loads_disk_only(placing.loader):
        found.append(Violation("disk-only", f"every key is mapped to 'disk': {_loader(placing.loader)} cannot open "
                               "the checkpoint for that device", "keep at least one module on 'cpu' (or load with "
                               "from_pretrained, loader='transformers')."))
    if not reads_disk_buffers(placing.loader, placing.offload_buffers) and "disk" in device_map.values():
        is_param, persistent = _flags(problem)
        count, first = _count(persistent & ~is_param, runs, lambda run: run.device == "disk")
        if count:
            names = [problem.graph.tensors.name[t] for t in first]
            found.append(Violation("unread-buffer", f"{count} persistent buffers are mapped to disk, e.g. {names}: "
                                   f"{_loader(placing.loader)} never reads them without offload_buffers=True (they "
                                   "keep their __init__ values)", "pass offload_buffers=True or map their modules to "
                                   "another device."))
    return found


def _ties(problem: Problem, device_map: dict, runs) -> list[Violation]:
    """Tie groups the loading path cannot load where the map puts them (:func:`allocator.rules.loaders.tie_loads`)."""
    g, loader = problem.graph, problem.placing.loader
    groups = g.all_tie_groups()
    if not groups:
        return []
    found = []
    storage, index = g.tensors.storage, g.tensor_index
    for group in groups:
        # the name whose memory the others share (what the checkpoint stores) first
        group = sorted(group, key=lambda n: n not in index or storage[index[n]] != index[n])
        where = {n: device_of(n, device_map) for n in group}
        devices = [d for d in where.values() if d is not None]
        if len(set(devices)) <= 1 and "disk" not in devices:
            continue
        others = loader == "accelerate" and set(devices) == {"cpu", "disk"} and _disk_weights_outside(problem, runs,
                                                                                                     group)
        if tie_loads(loader, devices, others):
            continue
        if len(set(devices)) > 1:
            found.append(Violation("tied", f"tied tensors are split across devices: {where}", f"{_loader(loader)} "
                                   "loads them wrong there; map them to one device."))
        else:
            found.append(Violation("tied", f"tied tensors are all on disk: {where}", "the checkpoint stores the tie "
                                   f"once and {_loader(loader)} finds only that name on disk; map them to 'cpu' or "
                                   "load with from_pretrained (loader='transformers')."))
    return found


def _disk_weights_outside(problem: Problem, runs, group) -> bool:
    """Whether the map sends a checkpoint tensor outside ``group`` to disk (what accelerate's loader writes)."""
    is_param, persistent = _flags(problem)
    written = moves(is_param, persistent, problem.placing.offload_buffers).copy()
    index = problem.graph.tensor_index
    for name in group:
        if name in index:
            written[index[name]] = False
    return _count(written, runs, lambda run: run.device == "disk")[0] > 0


def _unhooked(problem: Problem, device_map: dict, lone) -> list[Violation]:
    """Offloaded tensors named by their own key that move with their module (parameters; persistent buffers with
    ``offload_buffers``): ``dispatch_model`` hooks modules named in the map, never single tensors, so such a tensor
    is never loaded (it stays on meta: wrong outputs, or a device error). Buffers that do not move are loaded where
    their module runs."""
    g = problem.graph
    main = main_device(device_map.values())
    offloaded = offloaded_devices(main) if hooks_attach(device_map.values()) else ()
    ob = problem.placing.offload_buffers
    t = g.tensors
    bad = [k for k, d in device_map.items() if k in lone and d in offloaded and k in g.tensor_index
           and moves(t.is_param[g.tensor_index[k]], t.persistent[g.tensor_index[k]], ob)] if lone else []
    if not bad:
        return []
    return [Violation("unhooked", f"{len(bad)} offloaded tensors are mapped on their own, e.g. {bad[:3]}: accelerate "
                      "hooks only modules named in the map, so they would never be loaded; map their module instead.")]


def executing_devices(devices, main) -> set:
    """The devices that execute the modules mapped to ``devices`` under ``main``: an offloaded module executes on the
    main device (:func:`allocator.rules.dispatch.executes_on`)."""
    hooks = hooks_attach(set(devices))
    offloaded = offloaded_devices(main) if hooks else frozenset()
    return {executes_on(d, main, offloaded, hooks) for d in devices}


def _no_split(problem: Problem, runs: list, main=None) -> list[Violation]:
    """No-split modules whose tensors are on more than one device (the outermost of nested ones). A block kept whole
    only because the model declares nothing (an inferred block, :func:`allocator.model.blocks.infer_blocks`) may be
    split where the runtime allows it: between the device that executes it and offload (accelerate's hooks stream
    the offloaded children's weights to that device), never across two devices that execute.

    Only a module that straddles a boundary between runs can be split, so the candidates are the no-split
    ancestors of the modules at each boundary: O(runs x depth), not O(no-split modules). A plan for the allocator
    runtime may offload the routed experts of a layer whose other parts are resident on the main device
    (:func:`experts_apart`): all of it still executes there, so that layer is not split."""
    g = problem.graph
    cols = columns(g)
    no_split = g.no_split
    candidates = set()
    for run in runs[1:]:
        node = cols.module[run.start]
        while node >= 0 and cols.first[node] == run.start:  # starts at the boundary: does not straddle it
            node = cols.parent[node]
        while node >= 0:
            if g.nodes.cls[node] in no_split:
                candidates.add(node)
            node = cols.parent[node]
    mixed = sorted(i for i in candidates if len(devices_in(runs, cols.first[i], cols.last[i], limit=2)) > 1
                   and not experts_apart(problem, runs, cols.first[i], cols.last[i], main))
    if mixed and g.no_split != g.no_split_declared:   # inferred blocks: split where the runtime allows
        main = main_device({r.device for r in runs if r.device is not None})
        mixed = [i for i in mixed if g.nodes.cls[i] in g.no_split_declared
                 or len(executing_devices(devices_in(runs, cols.first[i], cols.last[i]), main)) > 1]
    if mixed and problem.splits:   # our runtime runs a layer split at its parts (issue #49)
        mixed = [i for i in mixed if not split_kept(problem, runs, g.nodes.name[i])]
    out, split = [], set(mixed)
    for i in mixed:
        parent = cols.parent[i]
        while parent >= 0 and parent not in split:
            parent = cols.parent[parent]
        if parent < 0:
            node = g.nodes[i]
            devices = devices_in(runs, cols.first[i], cols.last[i])
            out.append(Violation(
                "no-split", f"{node.name or '<root>'} ({node.cls}) is split across {sorted(map(str, devices))}."
            ))
    return out


def split_kept(problem: Problem, runs: list, layer: str) -> bool:
    """Whether ``layer`` is one of ``problem.splits`` (our runtime, :func:`allocator.model.split.find_splits`) split
    as our runtime runs it: its far side (the MLP, or the routed experts) whole on RAM or disk, everything else on one
    other device."""
    split = next((s for s in problem.splits if s.layer == layer), None)
    if split is None:
        return False
    g = problem.graph
    cols = columns(g)
    node, far = g.node_index[layer], g.node_index.get(split.far)
    if far is None:
        return False
    far_on = devices_in(runs, cols.first[far], cols.last[far])
    near_on = (devices_in(runs, cols.first[node], cols.first[far]) | devices_in(runs, cols.last[far], cols.last[node]))
    return len(far_on) == 1 and len(near_on) == 1 and far_on <= {"cpu", "disk"} and far_on != near_on


def routed_spans(problem: Problem) -> tuple:
    """The tensor ranges of the experts modules the allocator runtime runs expert by expert
    (:func:`allocator.offload.experts.routed_layers`: fused, no tensors shared between experts), which it never
    makes ready ahead; empty unless ``problem.moe`` (``runtime="allocator"``)."""
    if not problem.moe:
        return ()
    g = problem.graph
    cols = columns(g)
    return tuple((cols.first[g.node_index[m.experts]], cols.last[g.node_index[m.experts]]) for m in problem.moe
                 if m.kind == "fused" and not m.common and m.experts in g.node_index)


def experts_apart(problem: Problem, runs: list, start: int, end: int, main) -> bool:
    """Whether tensors ``start:end`` all execute on one device, with routed experts modules (``problem.moe``, read
    with ``runtime="allocator"``) apart from the rest: the tensors outside experts modules on one device, those inside
    on that device or offloaded (:func:`allocator.rules.dispatch.offloaded_devices`). accelerate's hooks run an
    offloaded module on the main device; the allocator runtime runs the routed experts of a fused experts module for
    the device of its layer (:func:`allocator.evaluate.experts.runs_on`), so a layer resident on another accelerator
    may offload those (not list-type experts, which accelerate's hooks stream to the main device)."""
    if not problem.moe or main is None:
        return False
    g = problem.graph
    cols = columns(g)
    every = [(cols.first[g.node_index[m.experts]], cols.last[g.node_index[m.experts]]) for m in problem.moe
             if m.experts in g.node_index]
    away = offloaded_devices(main)
    rest = _apart(runs, start, end, every, away)[0]
    if len(rest) > 1:
        return False
    executes = next(iter(rest)) if rest and not rest <= away else main
    rest, experts_on = _apart(runs, start, end, every if executes == main else routed_spans(problem), away)
    return len(rest) <= 1 and experts_on <= {executes}


def _apart(runs: list, start: int, end: int, inside: list, away) -> tuple[set, set]:
    """The devices of tensors ``start:end`` outside the ``inside`` ranges, and those inside them not in ``away``."""
    rest, experts_on = set(), set()
    for run in runs:
        a, b = max(run.start, start), min(run.end, end)
        if a >= b:
            continue
        if any(lo <= a and b <= hi for lo, hi in inside):
            if run.device not in away:
                experts_on.add(run.device)
        else:
            rest.add(run.device)
    return rest, experts_on


def peak_parts(problem: Problem, device_map: Mapping, memory: Memory) -> dict:
    """Per device of ``memory.peak`` (from :func:`check`): ``weights``, ``cache``, ``logits`` and ``activations``
    bytes, summing to the peak (``weights`` includes buffers and the streaming reserve; the others come from the
    problem's generation budget and are zero without one)."""
    graph, needs = problem.graph, problem.generation
    device_map = normalize_map(device_map)
    devices = map_runs(graph, device_map)
    used = set(device_map.values())
    hooks = hooks_attach(used)
    offloaded = offloaded_devices(memory.main) if hooks else frozenset()
    out = {}
    cache = logits = {}
    if needs is not None:
        cache = extra_by_device(graph, devices, needs.cache, memory.main, offloaded, hooks)
        logits = extra_by_device(graph, devices, needs.logits, memory.main, offloaded, hooks)
    executing = {executes_on(d, memory.main, offloaded, hooks) for d in used} | {memory.main}
    for device, peak in memory.peak.items():
        parts = {"cache": cache.get(device, 0), "logits": logits.get(device, 0), "activations": 0}
        if needs is not None and device in executing and device != "disk":
            parts["activations"] = graph.workspace
            if device == memory.main:
                parts["logits"] += graph.main_workspace
        parts = {"weights": peak - sum(parts.values()), **parts}
        out[device] = parts
    return out


@gc_paused()
def _loader(loader: str) -> str:
    """``"transformers' loader"`` or ``"accelerate's loader"``."""
    return "transformers' loader" if loader == "transformers" else f"{loader}'s loader"


def validate(model, device_map, max_memory=None, *, options: PlanOptions | None = None, **keywords
             ) -> list[Violation]:
    """Every way ``device_map`` breaks accelerate's runtime rules for ``model`` under ``max_memory``, on the loading
    path ``loader`` names (:mod:`allocator.rules`).

    Checks coverage (every parameter and persistent buffer has a device; keys that name nothing are logged as a
    warning, as both loaders ignore them), no key nested under a key of another device, no-split modules kept whole,
    tie groups where the loader loads them, what the loader cannot load from disk (``loader="accelerate"``: a map on
    disk alone, persistent buffers on disk without ``offload_buffers``), and each device's peak memory during a forward
    within its budget — the main device's peak including the buffers of offloaded modules and the largest chain of
    streamed weights.

    Parameters
    ----------
    model : torch.nn.Module
    device_map : dict
        Module or tensor names to devices, as accepted by ``dispatch_model``.
    max_memory : dict, optional
        Budgets as accelerate accepts them; the machine's memory when omitted.
    options : PlanOptions, optional
        How the model is read and run, as for :func:`allocator.plan`: ``no_split_module_classes`` (united with the
        model's own ``_no_split_modules`` and its sub-models'), ``offload_buffers`` (as passed to
        ``dispatch_model``), ``loader`` (``"transformers"`` or ``"accelerate"``), ``dtype``, ``special_dtypes``,
        ``generation`` (also count what ``generate`` needs where it
        runs: KV cache, logits, activations).
    **keywords
        Fields of :class:`PlanOptions`, one by one (they override those of ``options``).

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
    return check(build_problem(model, max_memory, options=options, **keywords), device_map)[0]
