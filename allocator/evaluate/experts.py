"""What the routed experts of a plan for the allocator runtime cost and hold: an MoE layer's step priced from the
experts its router picks (top-k of E), not from all of them.

:func:`allocator.evaluate.cost.estimate` prices a device map: an offloaded experts module is streamed whole at every
forward, as accelerate's hooks do. Where a placement says where each expert lives
(:attr:`allocator.placement.Placement.experts`, made by :mod:`allocator.strategies.experts`), :func:`routed_cost`
replaces that module's term by the expected cost of the experts routed in one forward of ``T`` tokens: expert ``e``
with share ``s_e`` of the layer's routings and ``k`` experts per token is hit with probability
``1 - (1 - min(1, k s_e))^T``; a hit expert that is resident is read where it lives; one that is not is either
fetched to the main device (its bytes copied, as :func:`allocator.evaluate.cost.copy_seconds` prices them) or, from
RAM to an accelerator main device, computed on the CPU (its activations moved instead) — whichever is cheaper, as
the runtime chooses per call. Plans without experts placement are priced by ``estimate`` alone, unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace

from ..budgets import is_accelerator, normalize_map
from ..placement import Placement
from ..problem import Problem
from ..profile import flop_seconds, read_rates
from .cost import Cost, copy_seconds, read_seconds
from .memory import device_of, main_device, offloaded_devices
from .runs import columns

__all__ = ["expert_bytes", "expert_numel", "expert_shares", "resident_bytes", "routed_cost", "step_tokens"]

log = logging.getLogger(__name__)


def _span(problem: Problem, layer) -> tuple[int, int]:
    g = problem.graph
    cols = columns(g)
    node = g.node_index[layer.experts]
    return cols.first[node], cols.last[node]


def expert_bytes(problem: Problem, layer) -> int:
    """Bytes of one expert of ``layer`` (a :class:`allocator.model.experts.MoELayer`) as the plan counts them (under
    ``dtype``): the experts module's tensors over ``E`` (tensors its children share between experts spread)."""
    a, b = _span(problem, layer)
    return int(sum(problem.graph.tensors.nbytes[a:b])) // layer.num_experts


def expert_numel(problem: Problem, layer) -> int:
    """Parameter elements of one expert of ``layer``."""
    a, b = _span(problem, layer)
    return int(sum(problem.graph.tensors.numel[a:b])) // layer.num_experts


def expert_shares(problem: Problem, layer) -> tuple[float, ...]:
    """Each expert's share of ``layer``'s routings: the problem's expert profile, else uniform."""
    profile = problem.expert_profile
    if profile is not None and layer.experts in profile.counts:
        row = profile.shares(layer.experts)
        if len(row) == layer.num_experts:
            return row
        log.warning("the expert profile has %d experts for %s, the model %d: uniform use assumed there", len(row),
                    layer.experts, layer.num_experts)
    return tuple(1.0 / layer.num_experts for _ in range(layer.num_experts))


def resident_bytes(problem: Problem, placement: Placement) -> dict:
    """Bytes of fused experts the runtime keeps resident away from their module's device, per device (experts of a
    ``ModuleList`` are modules of the map, counted by it)."""
    out: dict = {}
    for layer in problem.moe:
        where = placement.experts.get(layer.experts)
        if where is None or layer.kind != "fused":
            continue
        size = expert_bytes(problem, layer)
        home = device_of(layer.experts, placement.device_map)
        for device in where:
            if device != home:
                out[device] = out.get(device, 0) + size
    return out


def step_tokens(problem: Problem) -> int:
    """Tokens one priced forward routes: the elements of the counted ``input_ids`` (batch x sequence; one per
    sequence for a decoding step), else of those of ``PlanOptions.inputs``, else ``Profile.tokens``."""
    counted = problem.flops
    inputs = counted.inputs if counted is not None else problem.cost.inputs
    if isinstance(inputs, Mapping):
        for name, shape in inputs.items():
            shape = tuple(getattr(shape, "shape", shape))
            if name.endswith("input_ids") and shape:
                return max(1, math.prod(shape))
    return problem.profile.tokens


def _hit(share: float, k: int, tokens: int) -> float:
    return 1.0 - (1.0 - min(1.0, k * share)) ** tokens


def routed_cost(problem: Problem, placement: Placement, base: Cost) -> Cost:
    """``base`` (the estimate of ``placement``'s map) with each offloaded experts module's whole-module term replaced
    by the expected cost of its routed experts (module docstring); ``base`` itself for a placement without experts.

    Notes
    -----
    O(experts). The whole module's term removed is priced as ``estimate`` prices a module without counted FLOPs
    (``2 * tokens`` FLOP per element); where FLOPs were counted at the inputs the two differ by that module's
    counted-versus-rule difference.
    """
    if not placement.experts:
        return base
    profile = problem.profile
    device_map = normalize_map(placement.device_map)
    main = main_device(set(device_map.values()))
    offloaded = offloaded_devices(main)
    run_on = "cpu" if not is_accelerator(main) else main
    tokens = step_tokens(problem)
    runtime = problem.runtime.name
    seconds, streamed, disk = base.seconds, float(base.streamed_bytes), float(base.disk_bytes)
    for layer in problem.moe:
        where = placement.experts.get(layer.experts)
        home = device_of(layer.experts, device_map)
        if where is None or home not in offloaded:
            continue
        a, b = _span(problem, layer)
        whole = int(sum(problem.graph.tensors.nbytes[a:b]))
        count = b - a
        numel = int(sum(problem.graph.tensors.numel[a:b]))
        seconds -= read_seconds(profile, run_on, whole, numel) + copy_seconds(profile, main, home, whole, count,
                                                                              runtime=runtime)
        streamed -= whole
        disk -= whole if home == "disk" else 0
        size, elements = expert_bytes(problem, layer), expert_numel(problem, layer)
        per_tensor = count / layer.num_experts
        k = layer.top_k or 1
        hidden = layer.hidden
        for share, device in zip(expert_shares(problem, layer), where):
            hit = _hit(share, k, tokens)
            if not hit:
                continue
            routed = tokens * k * min(1.0, share) if share * k < 1 else tokens
            compute = max(hit * size * read_rates(profile, run_on)[0],
                          2 * routed * elements * flop_seconds(profile, run_on))
            if device == main or device not in offloaded:
                seconds += compute
                continue
            fetch = compute + copy_seconds(profile, main, device, int(hit * size), max(1, round(hit * per_tensor)),
                                           runtime=runtime)
            where_it_lives = math.inf
            if device == "cpu" and run_on != "cpu":
                moved = 2 * routed * hidden * 2   # activations there and back (2-byte elements)
                where_it_lives = (max(hit * size / profile.cpu_memory, 2 * routed * elements * flop_seconds(profile,
                                                                                                              "cpu"))
                                  + moved / profile.host_to_device)
            if fetch <= where_it_lives:
                seconds += fetch
                streamed += hit * size
                disk += hit * size if device == "disk" else 0
            else:
                seconds += where_it_lives
    return replace(base, seconds=seconds, streamed_bytes=round(streamed), disk_bytes=round(disk))

