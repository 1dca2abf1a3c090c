"""Experts as units of placement, for plans the allocator runtime runs (``runtime="allocator"``).

A device map names modules, so it cannot split a fused experts parameter; accelerate's hooks move whole modules, so
under ``runtime="accelerate"`` plans stay as the strategy made them. Under our runtime (:mod:`allocator.offload`,
which fetches only the experts a router picks), :func:`place_experts` turns the strategy's (dense) placement into
one where what runs for every token comes first and the routed experts after it:

1. every routed experts module leaves the accelerators for RAM (``"cpu"``), or disk where RAM is short (with a CPU
   main device: disk), mapped as a whole, so the map stays one that transformers and accelerate load;
2. what the dense map offloaded besides experts (attention, norms, routers, shared experts of later layers) moves to
   the last accelerator it used (to the CPU main device where there is no accelerator), as far as its budget goes;
3. the room left on the main device holds the experts most used per byte, resident (global top-k per byte of
   :meth:`allocator.model.expert_profile.ExpertProfile.shares`, uniform without a profile); the runtime keeps their
   slices there and fetches or computes the others where they live when routed.

The result carries where each expert lives (:attr:`allocator.placement.Placement.experts`) and a ``"experts"``
:class:`~allocator.placement.Decision` as data (its facts; :mod:`allocator.report.decisions` says it). It is kept
only when it keeps the runtime rules and at least the dense plan's bytes on the fastest tier as accelerate's map (the
contract's floor, resident experts counted); otherwise the dense placement is returned, with a decision saying why. The
decision states both estimates (:func:`allocator.evaluate.experts.routed_cost`): at a prefill of hundreds of tokens
every expert is routed and the two are close; a decoding step routes ``k`` of ``E``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from ..budgets import Device, format_bytes, is_accelerator, normalize_map
from ..evaluate.cost import priced
from ..evaluate.experts import expert_bytes, expert_shares, routed_cost, step_tokens
from ..errors import InvalidOption
from ..evaluate.memory import device_of, expert_cache_reserve, map_runs, offloaded_devices, tensor_devices
from ..evaluate.runs import columns
from ..evaluate.tiers import accelerator_sequence, fast_bytes, fast_tier
from ..placement import Decision, Placement
from ..problem import Problem, step_problem
from ..judge.verdict import is_valid, judged
from ..judge.contract import floor_shortfall
from ..search.bisection import boundary

__all__ = ["place_experts"]

log = logging.getLogger(__name__)


def place_experts(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with the routed experts as units of placement, where the plan is for the allocator runtime
    (module docstring); ``placement`` itself otherwise (accelerate's runtime, no mixture of experts, accelerate's own
    map).

    Notes
    -----
    O(k log k · log m) for k map entries and m modules moved (a bisection of :func:`allocator.evaluate.validate.check`
    calls), plus O(E log E) over all experts for the resident ones.

    Examples
    --------
    >>> import torch, torch.nn as nn
    >>> from allocator.problem import build_problem
    >>> from allocator.strategies import run
    >>> class Experts(nn.Module):       # 8 experts fused in 3D parameters, 16 KiB each
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Parameter(torch.empty(8, 64, 32)), nn.Parameter(torch.empty(8, 32, 64))
    >>> class Layer(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn, self.gate, self.experts = nn.Linear(32, 32), nn.Linear(32, 8, bias=False), Experts()
    >>> model = nn.Sequential(*[Layer() for _ in range(8)])
    >>> problem = build_problem(model, {"cpu": 450_000}, runtime="allocator")
    >>> placed = place_experts(problem, run("reserve", problem))
    >>> placed.device_map["0.attn"], placed.device_map["0.experts"], placed.experts["0.experts"][:3]
    ('cpu', 'disk', ('cpu', 'cpu', 'cpu'))
    >>> sum(row.count("cpu") for row in placed.experts.values())    # three resident experts per layer
    24
    """
    if not problem.moe or problem.runtime.name != "allocator" or placement.accelerates:
        return placement
    layers = [m for m in problem.moe if m.experts in problem.graph.node_index]
    dense = normalize_map(placement.device_map)
    violations, memory = judged(problem, dense)
    if violations or not layers:
        return placement
    main = memory.main
    units, homes = _units(problem, dense, layers)
    # every experts module is read from its file (mapped to disk): the runtime keeps each expert where the plan
    # puts it (an accelerator, RAM, or the file), so an expert is counted once, where it lives
    found = _with_experts_away(problem, units, homes, layers, main, "disk")
    if found is None:
        return _kept(placement, **_why_not(problem, units, homes, layers))
    moved, mapped, moved_to = found
    memory = judged(problem, mapped)[1]
    holders = [d for d in problem.budgets.accelerators if problem.budgets.limit(d) is not None] or [main]
    if is_accelerator(main) and problem.budgets.limit("cpu") is not None:
        holders.append("cpu")   # then RAM (the runtime holds those slices there), then disk
    rooms = {d: max(problem.budgets.limit(d) - memory.peak.get(d, 0), 0) if problem.budgets.limit(d) is not None
             else 0 for d in holders}
    rooms[main] = _cache_room(problem, mapped, main, rooms.get(main, 0))
    experts, held = _residents(problem, layers, mapped, rooms)
    tier = fast_tier(problem.budgets)
    resident, chosen = sum(b for b, _ in held.values()), sum(n for _, n in held.values())
    slots, cached = expert_cache_reserve(problem, mapped)   # experts the cache holds on the main device, as residents
    have = fast_bytes(problem, map_runs(problem.graph, mapped)) + sum(b for d, (b, _) in held.items() if d in tier) \
        + (cached if main in tier else 0)
    short = floor_shortfall(problem, have)   # rule 3, with the experts the runtime keeps on the fastest tier counted
    if short:
        return _kept(placement, reason="floor", bytes=short)
    worse = _worse(problem, placement, dense, mapped, experts, have, cached if main == "cpu" else 0)
    if worse:
        return _kept(placement, **worse)
    result = replace(placement, device_map=problem.cleaned(mapped), experts=experts,
                     exempt=placement.exempt | {"floor"})
    ours, theirs = routed_cost(problem, result, priced(problem, result.device_map)), priced(problem, dense)
    facts = {"reason": "placed", "layers": len(layers), "main": main, "moved": moved, "moved_to": moved_to,
             "chosen": chosen, "total": sum(m.num_experts for m in layers),
             "profiled": problem.expert_profile is not None,
             "held": [[d, b, n] for d, (b, n) in held.items() if n], "cache_slots": slots, "cache_bytes": cached,
             "others": sorted({d for row in experts.values() for d in row if d not in held}, key=str),
             "tokens": step_tokens(problem), "seconds": ours.seconds, "streamed": ours.streamed_bytes,
             "dense_seconds": theirs.seconds, "dense_streamed": theirs.streamed_bytes}
    decision = Decision("experts", devices=tuple(d for d, (_, n) in held.items() if n) or (main,),
                        units=tuple(m.experts for m in layers), bytes=resident, bound="budget", facts=facts)
    return replace(result, decisions=placement.decisions + (decision,))


def _cache_room(problem: Problem, mapped: dict, main: Device, room: int) -> int:
    """The room left to resident experts on the main device once the expert cache the caller asked for
    (``PlanOptions.expert_cache``, :func:`allocator.evaluate.memory.expert_cache_reserve`) has its slots: the cache
    takes room from resident experts only, after every part that runs for every token is placed.

    Raises
    ------
    InvalidOption
        The slots do not fit in the room the every-token parts leave on the main device.
    """
    slots, nbytes = expert_cache_reserve(problem, mapped)
    if nbytes <= room:
        return room - nbytes
    fit = room // (nbytes // slots)
    raise InvalidOption(f"expert_cache={slots} needs {format_bytes(nbytes)} on the main device {main!r}, which has "
                        f"{format_bytes(room)} left after the parts that run for every token: pass expert_cache="
                        f"{fit} or less, or raise {main!r}'s budget by {format_bytes(nbytes - room)}.")


def _disk_bytes(problem: Problem, device_map: dict, experts: dict) -> int:
    """Bytes the map leaves on disk, less the routed experts kept resident elsewhere (``experts``: module -> the
    device of each expert), which the runtime reads from there."""
    g = problem.graph
    on_disk = np.fromiter((d == "disk" for d in tensor_devices(g, device_map)), dtype=bool, count=len(g.tensors.nbytes))
    total = int(np.asarray(g.tensors.nbytes)[on_disk].sum())
    for m in problem.moe:
        row = experts.get(m.experts)
        if row is not None and m.kind == "fused" and device_of(m.experts, device_map) == "disk":
            total -= sum(1 for d in row if d != "disk") * expert_bytes(problem, m)
    return total


def _worse(problem: Problem, placement: Placement, dense: dict, mapped: dict, experts: dict, have: int,
           cached: int = 0) -> dict:
    """Why the expert-granular map is worse than the dense one it came from (more bytes on disk, fewer on the fastest
    tier, or a slower estimate), as the facts of the ``"experts"`` decision; ``{}`` where it is not. Asking for our
    runtime never places worse than not asking. ``cached``: bytes of disk experts the expert cache holds in RAM (a
    CPU main device), counted as resident ones are on the tiers (the estimate prices its hits,
    :func:`allocator.evaluate.experts.routed_cost`)."""
    ours_disk, dense_disk = _disk_bytes(problem, mapped, experts) - cached, _disk_bytes(problem, dense, {})
    if ours_disk > dense_disk:
        return {"reason": "disk", "bytes": ours_disk, "dense_bytes": dense_disk}
    dense_fast = fast_bytes(problem, map_runs(problem.graph, dense))
    if have < dense_fast:
        return {"reason": "fast", "bytes": dense_fast - have}
    if "decode" not in problem.steps:   # no decoding step counted: both estimates are stated in the decision
        return {}
    step = step_problem(problem, "decode")
    candidate = replace(placement, device_map=problem.cleaned(mapped), experts=experts)
    ours, theirs = routed_cost(step, candidate, priced(step, candidate.device_map)), priced(step, dense)
    if ours.seconds > theirs.seconds * (1 + 1e-9):
        return {"reason": "slower", "seconds": ours.seconds, "dense_seconds": theirs.seconds}
    return {}


def _kept(placement: Placement, **facts) -> Placement:
    """``placement`` with an ``"experts"`` decision saying why the experts stay in their layers (``facts``, with
    ``reason``: ``"floor"``, ``"disk"``, ``"fast"``, ``"slower"``, ``"rule"``, ``"no-map"``)."""
    decision = Decision("experts", bound="budget", facts={"kept": True, **facts})
    return replace(placement, decisions=placement.decisions + (decision,))


def _units(problem: Problem, dense: dict, layers) -> tuple[list, list]:
    """The map's entries at the granularity the step moves: ``(key, device, is_experts)`` in model order — each
    experts module whole, every other module with direct tensors on its own (a tensor of the root by name)."""
    g = problem.graph
    cols = columns(g)
    devices = tensor_devices(g, dense)
    spans = sorted((cols.first[g.node_index[m.experts]], cols.last[g.node_index[m.experts]], m.experts)
                   for m in layers)
    units, homes = [], []
    t, n, s = 0, len(devices), 0
    while t < n:
        if s < len(spans) and spans[s][0] == t:
            start, end, name = spans[s]
            units.append((name, True))
            homes.append(devices[start])
            t, s = max(end, t + 1), s + 1
            continue
        node = g.tensors.module[t]
        name = g.nodes.name[node]
        if not name:
            units.append((g.tensors.name[t], False))
            homes.append(devices[t])
            t += 1
            continue
        last = cols.first[node] + g.nodes.n_params[node] + g.nodes.n_buffers[node]
        units.append((name, False))
        homes.append(devices[t])
        t = max(last, t + 1)
    return units, homes


def _target(problem: Problem, dense: dict, main: Device) -> Device:
    """Where offloaded parts that run for every token go: the last accelerator the dense map uses (index order
    holds), the main device where it uses none."""
    sequence = accelerator_sequence(problem, map_runs(problem.graph, dense))
    return sequence[-1] if sequence else main


def _targets(units, homes, offloaded, last: Device) -> list:
    """Per unit, where an offloaded every-token part goes: the accelerator of the last resident every-token part
    before it (index order holds along the model), the first accelerator the map uses before any; ``last`` (the
    main device) where the map uses none."""
    resident = [h for (_, is_experts), h in zip(units, homes) if not is_experts and h not in offloaded]
    current = resident[0] if resident else last
    out = []
    for (_, is_experts), home in zip(units, homes):
        if not is_experts and home not in offloaded:
            current = home
        out.append(current)
    return out


def _map(units, devices) -> dict:
    return {name: device for (name, _), device in zip(units, devices) if device is not None}


def _with_experts_away(problem: Problem, units, homes, layers, main: Device, away: Device):
    """The map with every experts module on ``away`` (the last ones on disk where RAM is short) and the largest
    prefix of the other offloaded units moved to the target device that keeps every runtime rule; ``None`` where no
    such map exists. Returns ``(units moved, map, the devices they moved to)``."""
    offloaded = offloaded_devices(main)
    targets = _targets(units, homes, offloaded, _target(problem, dict(zip((u for u, _ in units), homes)), main))
    experts_at = [i for i, (_, is_experts) in enumerate(units) if is_experts]

    def devices(on_away: int, moved: int) -> list:
        out = list(homes)
        for j, i in enumerate(experts_at):
            out[i] = away if j < on_away else "disk"
        count = 0
        for i, (_, is_experts) in enumerate(units):
            if not is_experts and out[i] in offloaded:
                if count >= moved:
                    break
                out[i] = targets[i]
                count += 1
        return out

    def valid(on_away: int, moved: int) -> bool:
        return is_valid(problem, _map(units, devices(on_away, moved)))

    on_away = _largest(len(experts_at), lambda k: valid(k, 0)) if away != "disk" else len(experts_at)
    if on_away is None:
        return None
    movable = sum(1 for i, (_, e) in enumerate(units) if not e and homes[i] in offloaded)
    moved = _largest(movable, lambda m: valid(on_away, m))
    if moved is None:
        return None
    out = devices(on_away, moved)
    moved_to = sorted({out[i] for i, (_, e) in enumerate(units) if not e and out[i] != homes[i]}, key=str)
    return moved, _map(units, out), moved_to


def _why_not(problem: Problem, units, homes, layers) -> dict:
    """The real reason no map with the experts modules apart exists, as the decision's facts: the first rule the map
    with every experts module on disk and nothing else moved breaks."""
    out = [("disk" if is_experts else home) for (_, is_experts), home in zip(units, homes)]
    violations = judged(problem, _map(units, out))[0]
    if not violations:
        return {"reason": "no-map"}
    first = violations[0]
    return {"reason": "rule", "rule": first.kind, "violation": str(first)}


def _largest(n: int, ok) -> int | None:
    """The largest ``k`` in ``0..n`` with ``ok(k)``, bisecting (``ok`` assumed to hold up to a point); ``None`` when
    ``ok(0)`` fails."""
    if ok(n):
        return n
    if not ok(0):
        return None
    return boundary(ok, 0, n)


def _residents(problem: Problem, layers, mapped: dict, rooms: dict) -> tuple[dict, dict]:
    """Each experts module's devices per expert, and per device of ``rooms`` (free bytes per accelerator in index
    order, or the CPU main device) the resident bytes and count: the experts with the most expected routings per
    byte (``top_k`` x share / bytes), each on the first device in order where it still fits; ties go round the
    layers (expert index first), so uniform use spreads residents evenly."""
    sizes = [expert_bytes(problem, m) for m in layers]
    value, order_layer, order_expert = [], [], []
    for li, m in enumerate(layers):
        shares = np.asarray(expert_shares(problem, m), dtype=float)
        # ModuleList experts are modules of the map: they stay with it (the runtime keeps fused slices only)
        value.append(shares * (m.top_k or 1) / max(sizes[li], 1) if m.kind == "fused" else np.full(m.num_experts, -1.0))
        order_layer.append(np.full(m.num_experts, li))
        order_expert.append(np.arange(m.num_experts))
    value, order_layer, order_expert = map(np.concatenate, (value, order_layer, order_expert))
    order = np.lexsort((order_layer, order_expert, -value))
    rows = [[device_of(m.experts, mapped)] * m.num_experts for m in layers]
    free = dict(rooms)
    held = {d: (0, 0) for d in rooms}
    for k in order:
        li, e = int(order_layer[k]), int(order_expert[k])
        if value[k] < 0:
            continue
        device = next((d for d in free if free[d] >= sizes[li]), None)
        if device is None:
            if all(free[d] < min(sizes) for d in free):
                break
            continue
        rows[li][e] = device
        free[device] -= sizes[li]
        held[device] = (held[device][0] + sizes[li], held[device][1] + 1)
    return {m.experts: tuple(row) for m, row in zip(layers, rows)}, held
