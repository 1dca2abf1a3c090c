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
the runtime chooses per call. With an expert cache of ``N`` slots on the main device (``expert_cache=N``), a fetched
expert is found there with the probability Che's approximation gives it (:func:`che_hit_rates`, from the same
shares; :func:`cache_hit_rate` is the share of lookups it serves) and then costs its read on the main device only.
Plans without experts placement are priced by ``estimate`` alone, unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

from ..budgets import is_accelerator, normalize_map
from ..placement import Placement
from ..problem import Problem
from ..profile import flop_seconds, read_rates
from .cost import Cost, copy_seconds, read_seconds
from .memory import device_of, expert_cache_reserve, main_device, offloaded_devices
from .runs import columns

__all__ = ["cache_hit_rate", "che_hit_rates", "expert_bytes", "expert_numel", "expert_shares", "resident_bytes",
           "routed_cost", "step_tokens"]

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


def che_hit_rates(rates, slots: int) -> list[float]:
    """Per item, the probability that a request finds it in a least-recently-used cache of ``slots`` items, by Che's
    approximation, in steps: ``rates[i]`` is the probability that item ``i`` is requested in one step.

    Che's approximation (H. Che, Y. Tung and Z. Wang, "Hierarchical Web caching systems: modeling, design and
    experimental results", IEEE JSAC 20(7), 2002; its accuracy shown by C. Fricker, P. Robert and J. Roberts, "A
    versatile and accurate approximation for LRU cache performance", ITC 24, 2012) for independent requests: an LRU
    cache of ``C`` items behaves as if each item stayed a fixed *characteristic time* ``tau`` after its last request,
    where ``tau`` solves ``sum_j (1 - (1 - q_j)^tau) = C`` (the expected number of distinct items requested in
    ``tau`` steps). Here time is counted in steps (a decoding step requests each layer's routed experts once, the
    layers in order), so an item requested again ``g`` steps later has seen about ``D(g)`` other items in between
    and is found iff ``g <= floor(tau)``: ``h_i = 1 - (1 - q_i)^floor(tau)``. A cache smaller than the items one step
    requests (``tau < 1``) is cycled through by the layers and finds nothing; one that holds every item that is ever
    requested finds every request after the first.

    >>> che_hit_rates([1.0, 1.0, 0.5, 0.0], 2)     # two certain items per step fill two slots: nothing kept longer
    [0.0, 0.0, 0.0, 0.0]
    >>> [round(h, 3) for h in che_hit_rates([0.9, 0.1, 0.1, 0.1], 3)]
    [1.0, 0.651, 0.651, 0.651]
    >>> che_hit_rates([0.5, 0.5, 0.0], 2)          # every item that is ever requested fits
    [1.0, 1.0, 0.0]

    Notes
    -----
    O(n log(1/eps)) for n items: a bisection on ``tau``. Independent requests are an assumption: routing that
    follows the text (the same experts for runs of tokens) hits more than this, routing that alternates less.
    """
    rates = [min(max(float(q), 0.0), 1.0) for q in rates]
    live = [q for q in rates if q > 0]
    if slots <= 0 or not live:
        return [0.0] * len(rates)
    if slots >= len(live):
        return [1.0 if q > 0 else 0.0 for q in rates]
    certain = sum(1 for q in live if q >= 1.0)
    if certain >= slots:
        return [0.0] * len(rates)

    def distinct(tau: float) -> float:
        return sum(1.0 - (1.0 - q) ** tau for q in live)

    lo, hi = 0.0, 1.0
    while distinct(hi) < slots and hi < 1e12:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if distinct(mid) < slots else (lo, mid)
    steps = math.floor(lo + 1e-9)
    return [1.0 - (1.0 - q) ** steps if q > 0 else 0.0 for q in rates]


def cache_hit_rate(problem: Problem, placement: Placement) -> float | None:
    """The estimated share of the lookups of non-resident routed experts that the expert cache
    (``PlanOptions.expert_cache`` slots, :func:`allocator.evaluate.memory.expert_cache_reserve`) serves, in one
    forward of :func:`step_tokens` tokens, from the routing shares (:func:`expert_shares`: the expert profile, else
    uniform) by :func:`che_hit_rates`; ``None`` where the plan has no cache or no expert the runtime fetches. The
    figure ``benchmarks/moe.py`` measures as ``hit_rate`` (``Traffic.cache_hits`` over hits and misses)."""
    terms = _routed_terms(problem, placement)
    if terms is None:
        return None
    cacheable = [t for t in terms if t.cacheable]
    slots = expert_cache_reserve(problem, normalize_map(placement.device_map))[0]
    if not slots or not cacheable:
        return None
    hits = che_hit_rates([t.routed for t in cacheable], slots)
    total = sum(t.routed for t in cacheable)
    return sum(t.routed * h for t, h in zip(cacheable, hits)) / total if total else None


class _Term(NamedTuple):
    """One expert's part of a forward's price: the probability it is routed, its seconds read where it computes
    (``compute``), the seconds added when it is not found in the cache (``miss``: fetched, or computed where it lives),
    its bytes fetched, and whether the runtime's cache may hold it (a non-resident expert fetched to the main
    device)."""

    routed: float
    compute: float
    miss: float
    fetched: float
    disk: bool
    cacheable: bool


def _devices(placement: Placement) -> tuple:
    """``placement``'s map (normalised), its main device, the devices offloaded from it and where offloaded units
    compute (the CPU for a CPU main device, else the main device)."""
    device_map = normalize_map(placement.device_map)
    main = main_device(set(device_map.values()))
    return device_map, main, offloaded_devices(main), "cpu" if not is_accelerator(main) else main


def _routed_terms(problem: Problem, placement: Placement) -> list[_Term] | None:
    """Per routed expert of each offloaded experts module the placement places expert by expert, its
    :class:`_Term`; ``None`` for a placement without experts."""
    if not placement.experts:
        return None
    profile = problem.profile
    device_map, main, offloaded, run_on = _devices(placement)
    tokens = step_tokens(problem)
    runtime = problem.runtime.name
    terms = []
    for layer in problem.moe:
        where = placement.experts.get(layer.experts)
        home = device_of(layer.experts, device_map)
        if where is None or home not in offloaded:
            continue
        a, b = _span(problem, layer)
        size, elements = expert_bytes(problem, layer), expert_numel(problem, layer)
        per_tensor = (b - a) / layer.num_experts
        k = layer.top_k or 1
        for share, device in zip(expert_shares(problem, layer), where):
            hit = _hit(share, k, tokens)
            if not hit:
                continue
            routed = tokens * k * min(1.0, share) if share * k < 1 else tokens
            compute = max(hit * size * read_rates(profile, run_on)[0],
                          2 * routed * elements * flop_seconds(profile, run_on))
            if device == main or device not in offloaded:
                terms.append(_Term(hit, compute, 0.0, 0.0, False, False))
                continue
            fetch = copy_seconds(profile, main, device, int(hit * size), max(1, round(hit * per_tensor)),
                                 runtime=runtime)
            where_it_lives = math.inf
            if device == "cpu" and run_on != "cpu":
                moved = 2 * routed * layer.hidden * 2   # activations there and back (2-byte elements)
                where_it_lives = (max(hit * size / profile.cpu_memory,
                                      2 * routed * elements * flop_seconds(profile, "cpu"))
                                  + moved / profile.host_to_device) - compute
            if fetch <= where_it_lives:
                terms.append(_Term(hit, compute, fetch, hit * size, device == "disk", True))
            else:
                terms.append(_Term(hit, compute, where_it_lives, 0.0, False, False))
    return terms


def routed_cost(problem: Problem, placement: Placement, base: Cost) -> Cost:
    """``base`` (the estimate of ``placement``'s map) with each offloaded experts module's whole-module term replaced
    by the expected cost of its routed experts (module docstring); ``base`` itself for a placement without experts.
    With an expert cache (``PlanOptions.expert_cache``), a fetched expert is found there with the probability
    :func:`che_hit_rates` gives it, and then costs only its read on the main device, neither copied nor read from
    where it lives.

    Notes
    -----
    O(experts). The whole module's term removed is priced as ``estimate`` prices a module without counted FLOPs
    (``2 * tokens`` FLOP per element); where FLOPs were counted at the inputs the two differ by that module's
    counted-versus-rule difference.
    """
    terms = _routed_terms(problem, placement)
    if terms is None:
        return base
    profile = problem.profile
    device_map, main, offloaded, run_on = _devices(placement)
    runtime = problem.runtime.name
    seconds, streamed, disk = base.seconds, float(base.streamed_bytes), float(base.disk_bytes)
    for layer in problem.moe:
        home = device_of(layer.experts, device_map)
        if placement.experts.get(layer.experts) is None or home not in offloaded:
            continue
        a, b = _span(problem, layer)
        whole = int(sum(problem.graph.tensors.nbytes[a:b]))
        numel = int(sum(problem.graph.tensors.numel[a:b]))
        seconds -= read_seconds(profile, run_on, whole, numel) + copy_seconds(profile, main, home, whole, b - a,
                                                                              runtime=runtime)
        streamed -= whole
        disk -= whole if home == "disk" else 0
    slots = expert_cache_reserve(problem, device_map)[0]
    cacheable = [t for t in terms if t.cacheable]
    found = iter(che_hit_rates([t.routed for t in cacheable], slots) if slots else [0.0] * len(cacheable))
    for t in terms:
        kept = next(found) if t.cacheable else 0.0
        seconds += t.compute + (1.0 - kept) * t.miss
        streamed += (1.0 - kept) * t.fetched
        disk += (1.0 - kept) * t.fetched if t.disk else 0.0
    return replace(base, seconds=seconds, streamed_bytes=round(streamed), disk_bytes=round(disk))
