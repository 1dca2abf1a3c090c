"""What the routed experts of a plan for the allocator runtime cost and hold: an MoE layer's step priced from the
experts its router picks (top-k of E), not from all of them.

:func:`allocator.evaluate.cost.estimate` prices a device map: an offloaded experts module is streamed whole at every
forward, as accelerate's hooks do. Where a placement says where each expert lives
(:attr:`allocator.placement.Placement.experts`, made by :mod:`allocator.strategies.experts`), :func:`routed_cost`
replaces that module's term by the expected cost of the experts routed in one forward of ``T`` tokens, and
:func:`allocator.evaluate.compute.step_seconds` prices each phase of ``generate`` with the same terms
(:func:`routed_seconds`). One formula (:func:`layer_terms`, each expert by :func:`expert_seconds`): expert ``e``
with share ``s_e`` of the layer's routings and ``k`` experts per token is hit with probability
``1 - (1 - min(1, k s_e))^T``; a hit expert that is resident is read where it lives; the offloaded ones of a layer
are either all fetched to the main device (their bytes copied, as :func:`allocator.evaluate.cost.copy_seconds`
prices them) or, from RAM to an accelerator main device, computed on the CPU (their activations moved instead),
whichever is cheaper for the layer in that phase (:func:`layer_mode`): the plan decides it per layer and phase
(:func:`expert_modes`, ``Runtime.expert_mode``) and the runtime runs it as written. With an expert cache of ``N``
slots on the main device (``expert_cache=N``), a fetched expert is found there with the probability Che's
approximation gives it (:func:`che_hit_rates`, from the same shares; :func:`cache_hit_rate` is the share of lookups
it serves) and then costs its read on the main device only.
Plans without experts placement are priced by ``estimate`` alone, unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

from ..budgets import normalize_map
from ..placement import Placement
from ..problem import Problem
from .cost import Cost, copy_seconds, read_seconds
from .memory import device_of, executes_on, expert_cache_reserve, main_device, offloaded_devices
from .runs import columns

__all__ = ["DECIDED", "cache_hit_rate", "che_hit_rates", "expert_bytes", "expert_modes", "expert_numel",
           "expert_seconds", "expert_shares", "layer_mode", "layer_terms", "moved_bytes", "resident_bytes",
           "routed_cost", "routed_layers", "routed_seconds", "step_tokens"]

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


def moved_bytes(problem: Problem, placement: Placement) -> dict:
    """Bytes of fused routed experts per device that the allocator runtime keeps away from their module's device:
    positive where they are kept, negative on the module's device (what the map puts there that is held elsewhere).
    Experts of a ``ModuleList`` are modules of the map, counted by it."""
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
                out[home] = out.get(home, 0) - size
    return out


def resident_bytes(problem: Problem, placement: Placement) -> dict:
    """Bytes of fused experts the runtime keeps resident away from their module's device, per device
    (:func:`moved_bytes`' positive side)."""
    return {d: n for d, n in moved_bytes(problem, placement).items() if n > 0}


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
    """One expert's part of a step's price: the probability it is routed, its seconds read or computed where its layer
    runs (``compute``), the seconds added when it is not found in the cache (``miss``: its fetch, or the difference
    when it is computed where it lives), its bytes fetched, and whether the runtime's cache may hold it (a
    non-resident expert fetched to the main device)."""

    routed: float
    compute: float
    miss: float
    fetched: float
    disk: bool
    cacheable: bool


#: How the runtime runs the offloaded routed experts of a layer in a phase, as a plan decides it
#: (:func:`expert_modes`): fetched to where the layer runs, or computed where their weights live.
DECIDED = ("fetch", "compute")


def expert_seconds(profile, lives, runs_on, nbytes, tensors, elements, tokens, token_bytes, *, calls: float = 1.0,
                   runtime: str = "allocator") -> tuple[float, float]:
    """Seconds of one routed expert in one step, ``(fetched, computed where it lives)``: the one formula the plan's
    prices (:func:`routed_cost`, :func:`routed_seconds`), its decisions (:func:`expert_modes`) and the runtime's
    ``mode="auto"`` (:mod:`allocator.offload.experts`) use.

    ``lives``: the device of its weights; ``runs_on``: where its layer runs (the main device, ``"cpu"`` for a CPU
    main device); ``nbytes``, ``tensors``, ``elements``: what it reads (expected values in a plan: the probability it
    is routed times one expert's); ``tokens``: tokens routed to it (``2 x tokens x elements`` FLOP);
    ``token_bytes``: one token's activation (moved there and back when it computes elsewhere); ``calls``: the
    times it runs (its probability of being routed, in a plan), each computed elsewhere paying two changes of
    device.

    - where it lives is where its layer runs (resident), or a CPU main device (read in place from RAM or the mapped
      file): its read-or-compute term there (:func:`allocator.profile.read_seconds`), plus the disk read; both ways
      the same;
    - in RAM or on disk, an accelerator main device: fetched is the copy (:func:`allocator.evaluate.cost.copy_seconds`)
      then the term on the main device; computed where it lives is the term on the CPU plus its activations moved
      both ways (``host_to_device``) and two changes of device; an expert on disk is always fetched;
    - on another accelerator: fetched is copied at ``device_to_device``, else computed there with the activations
      moved at that rate.
    """
    flops = 2 * tokens * elements
    there = read_seconds(profile, runs_on, nbytes, elements, flops)
    offloaded = lives in ("cpu", "disk")
    if lives == runs_on or (offloaded and runs_on == "cpu"):
        extra = copy_seconds(profile, runs_on, lives, nbytes, tensors, runtime=runtime) if lives == "disk" else 0.0
        return there + extra, there + extra
    moved = 2 * tokens * token_bytes
    if offloaded:
        fetched = there + copy_seconds(profile, runs_on, lives, nbytes, tensors, runtime=runtime)
        if lives == "disk":
            return fetched, fetched
        local = read_seconds(profile, "cpu", nbytes, elements, flops)
        return fetched, local + moved / profile.host_to_device + 2 * calls * profile.switch_latency
    local = read_seconds(profile, lives, nbytes, elements, flops)
    return (there + nbytes / profile.device_to_device,
            local + moved / profile.device_to_device + 2 * calls * profile.switch_latency)


def _devices(device_map: Mapping) -> tuple:
    """``device_map`` normalised, its main device, the devices offloaded from it and where offloaded units compute
    (the CPU for a CPU main device, else the main device)."""
    device_map = normalize_map(device_map)
    main = main_device(set(device_map.values()))
    return device_map, main, offloaded_devices(main), executes_on("disk", main)


def routed_layers(problem: Problem, device_map: Mapping, experts: Mapping | None = None) -> list:
    """The MoE layers of ``problem`` priced from their routed experts in ``device_map``: those whose experts module is
    offloaded (``experts``, the placement's experts, names only some where given; every such layer otherwise)."""
    device_map, _, offloaded, _ = _devices(device_map)
    return [layer for layer in problem.moe if device_of(layer.experts, device_map) in offloaded
            and layer.experts in problem.graph.node_index and (not experts or layer.experts in experts)]


def layer_terms(problem: Problem, layer, device_map: Mapping, where, tokens: int, mode: str) -> list[_Term]:
    """Per routed expert of ``layer`` (a :class:`allocator.model.experts.MoELayer` whose experts module
    ``device_map`` offloads), its :class:`_Term` in a step of ``tokens`` tokens with the layer's offloaded experts run
    as ``mode`` says (:data:`DECIDED`); ``where`` is the device of each expert (``None``: all where their module
    is). Expert ``e`` with share ``s_e`` of the routings (:func:`expert_shares`) and ``k`` experts per token is
    routed in the step with probability ``1 - (1 - min(1, k s_e))^T`` (so the experts routed are ``top-k x tokens``
    at most, and at most all of them), to ``T k s_e`` tokens; its seconds are :func:`expert_seconds`'s."""
    profile = problem.profile
    device_map, _, offloaded, run_on = _devices(device_map)
    home = device_of(layer.experts, device_map)
    where = tuple(where) if where is not None else (home,) * layer.num_experts
    a, b = _span(problem, layer)
    size, elements = expert_bytes(problem, layer), expert_numel(problem, layer)
    per_tensor = (b - a) / layer.num_experts
    token_bytes = layer.hidden * size / max(elements, 1)
    k = layer.top_k or 1
    fused = layer.kind == "fused"   # list experts are modules of the map: their hooks always fetch
    terms, seen = [], {}
    for share, device in zip(expert_shares(problem, layer), where):
        key = (share, device)
        if key not in seen:   # experts of one share and device cost the same: priced once
            seen[key] = _term(profile, share, device, tokens, k, size, elements, per_tensor, token_bytes, run_on,
                              device in offloaded, "compute" if mode == "compute" and fused else "fetch")
        if seen[key] is not None:
            terms.append(seen[key])
    return terms


def _term(profile, share, device, tokens, k, size, elements, per_tensor, token_bytes, run_on, offloaded, mode):
    """One expert's :class:`_Term` (:func:`layer_terms`); ``None`` where it is never routed."""
    hit = _hit(share, k, tokens)
    if not hit:
        return None
    routed = tokens * min(1.0, k * share)
    fetched, local = expert_seconds(profile, device, run_on, hit * size, hit * per_tensor, hit * elements, routed,
                                    token_bytes, calls=hit)
    if device == run_on:   # resident (in RAM, for a CPU main device)
        return _Term(hit, fetched, 0.0, 0.0, False, False)
    base = read_seconds(profile, run_on, hit * size, hit * elements, 2 * routed * elements)
    if mode == "compute" and device != "disk":
        return _Term(hit, base, local - base, 0.0, False, False)
    return _Term(hit, base, fetched - base, hit * size if offloaded else 0.0, device == "disk", offloaded)


def _layer_seconds(terms) -> float:
    return sum(t.compute + t.miss for t in terms)


def layer_mode(problem: Problem, layer, device_map: Mapping, where, tokens: int) -> tuple[str, dict]:
    """The mode a plan decides for ``layer`` in a step of ``tokens`` tokens (the cheaper of :data:`DECIDED` by
    :func:`layer_terms`, fetched on a tie) and the seconds of each, without the expert cache."""
    seconds = {mode: _layer_seconds(layer_terms(problem, layer, device_map, where, tokens, mode)) for mode in DECIDED}
    return ("compute" if seconds["compute"] < seconds["fetch"] else "fetch"), seconds


def expert_modes(problem: Problem, device_map: Mapping, experts: Mapping | None, phases: Mapping) -> dict:
    """Experts module -> {phase: mode}: per offloaded experts layer (:func:`routed_layers`) and phase (``phases``:
    phase -> tokens per step), fetched or computed where the experts live (:func:`layer_mode`). ``experts``: where
    each expert lives (``Placement.experts``; ``None``: all where their module is)."""
    experts = experts or {}
    return {layer.experts: {phase: layer_mode(problem, layer, device_map, experts.get(layer.experts), tokens)[0]
                            for phase, tokens in phases.items()}
            for layer in routed_layers(problem, device_map, experts)}


def routed_seconds(problem: Problem, device_map: Mapping, experts: Mapping | None, tokens: int,
                   modes: Mapping | None = None) -> dict:
    """Experts module -> seconds of its routed experts in one step of ``tokens`` tokens, each offloaded experts layer
    run as ``modes`` says (experts module -> mode; the cheaper where it names none), without the expert cache."""
    experts, modes = experts or {}, modes or {}
    out = {}
    for layer in routed_layers(problem, device_map, experts):
        where = experts.get(layer.experts)
        mode = modes.get(layer.experts) or layer_mode(problem, layer, device_map, where, tokens)[0]
        out[layer.experts] = _layer_seconds(layer_terms(problem, layer, device_map, where, tokens, mode))
    return out


def _routed_terms(problem: Problem, placement: Placement) -> list[_Term] | None:
    """Per routed expert of each offloaded experts module the placement places expert by expert, its
    :class:`_Term` in one forward of :func:`step_tokens` tokens, each layer in the mode the plan decides for it;
    ``None`` for a placement without experts."""
    if not placement.experts:
        return None
    tokens = step_tokens(problem)
    terms = []
    for layer in routed_layers(problem, placement.device_map, placement.experts):
        where = placement.experts[layer.experts]
        mode = layer_mode(problem, layer, placement.device_map, where, tokens)[0]
        terms += layer_terms(problem, layer, placement.device_map, where, tokens, mode)
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
    device_map, main, offloaded, run_on = _devices(placement.device_map)
    runtime = problem.runtime.name
    seconds, streamed, disk = base.seconds, float(base.streamed_bytes), float(base.disk_bytes)
    for layer in routed_layers(problem, device_map, placement.experts):
        home = device_of(layer.experts, device_map)
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
