"""Where each offloaded unit computes, per phase of ``generate``: on the main device with its weights streamed, or
where its weights live (the CPU, reading RAM or the memory-mapped file) with its activations moved (issue #40).

Only a plan for the allocator runtime (``runtime="allocator"``) with an accelerator as main device has a choice: on a
CPU main device an offloaded unit already computes where its weights are read, and accelerate's hooks always stream.
For each unit of the map on ``"cpu"`` or ``"disk"`` and each phase (``prefill``: the prompt's tokens; ``decode``: one
token per sequence, :func:`phase_tokens`), the cost model prices one step both ways from the profile:

- streamed: the unit's bytes staged as the runtime stages them (:class:`allocator.offload.StreamDevice`: the
  mapped, pageable weights copied into pinned memory at ``cpu_memory``, then to the accelerator at
  ``pinned_host_to_device``; from disk first at ``disk_read``), a fixed latency per tensor, then read or computed
  on the accelerator (``accelerator_memory``, ``accelerator_flops``), its KV cache read there;
- where it lives: the bytes read from RAM (``cpu_memory``; from the file at ``disk_read``) or computed at
  ``cpu_flops``, whichever is slower, its KV cache read from RAM, and the activations moved both ways (``2 x
  tokens x activation bytes per token``, pinned staging) with two changes of device.

The cheaper wins. An offloaded experts module of a mixture of experts is not such a unit: every phase prices its
routed experts by the one formula of :mod:`allocator.evaluate.experts` (top-k x tokens of them, read or computed
where each lives, or fetched), and the plan decides per experts layer and phase whether they are fetched or computed
where they live (:attr:`ComputePlan.experts`, ``Runtime.expert_mode``). A unit that computes on the CPU at decode
keeps its KV cache in RAM (counted in RAM's peak, not the main device's: :func:`cache_moves`), and only while RAM has
room for it. Everything here is an *estimate*.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..budgets import Device, is_accelerator, normalize_map
from ..problem import Problem, step_problem
from .cost import copy_seconds
from .experts import expert_modes, routed_layers, routed_seconds
from .runs import columns

__all__ = ["PHASES", "PhaseChoice", "ComputePlan", "phase_tokens", "unit_stats", "decide", "step_seconds",
           "cache_moves", "cache_seconds", "crossings", "hybrid_seconds", "phase_problem"]

PHASES = ("prefill", "decode")
"""The phases of ``generate`` a unit gets a compute device for."""


@dataclass(frozen=True, slots=True)
class PhaseChoice:
    """The choice for one unit in one phase, with the figures that made it (all estimates)."""

    unit: str
    phase: str
    device: Device          # the main device (weights streamed) or "cpu" (computed where the weights live)
    source: str             # where the weights live: "cpu" or "disk"
    tokens: int             # tokens per step of the phase
    nbytes: int             # the unit's weights
    cache_bytes: int        # its KV cache
    streamed_seconds: float  # one step with the weights streamed to the main device
    local_seconds: float    # one step computed where the weights live


@dataclass(frozen=True, slots=True)
class ComputePlan:
    """Where each offloaded unit computes per phase, as the runtime reads it.

    Attributes
    ----------
    devices : dict
        unit (a device-map key) -> {phase: device}.
    tokens : dict
        phase -> tokens per step that priced it.
    threshold : int
        A call with at most this many tokens is a ``decode`` call, more a ``prefill`` call.
    choices : tuple of PhaseChoice
    cache_moved : int
        KV cache bytes held in RAM instead of on the main device (units computing on the CPU at decode).
    experts : dict
        Experts module -> {phase: ``"fetch"`` or ``"compute"``}: how the offloaded routed experts of each MoE layer
        run in each phase (:func:`allocator.evaluate.experts.expert_modes`); such modules are not units of
        :attr:`devices` (the runtime runs them expert by expert).
    """

    devices: Mapping
    tokens: Mapping
    threshold: int
    choices: tuple
    cache_moved: int = 0
    experts: Mapping = field(default_factory=dict)

    def to_dict(self) -> dict:
        """unit -> {phase: device}, JSON-ready (devices as the map writes them)."""
        return {unit: dict(phases) for unit, phases in self.devices.items()}


def phase_tokens(problem: Problem) -> dict:
    """Tokens per step of each phase: with a generation budget, ``batch x prompt`` for prefill (the prompt defaults to
    ``max_length - 1``) and ``batch`` for decode; without one, ``Profile.tokens`` and 1."""
    needs = problem.generation
    if needs is None:
        return {"prefill": problem.profile.tokens, "decode": 1}
    budget = needs.budget
    prompt = budget.prompt_length or budget.max_length - 1
    return {"prefill": budget.batch_size * prompt, "decode": budget.batch_size}


def unit_stats(problem: Problem, device_map: Mapping) -> dict:
    """Per key of ``device_map``: ``[bytes, parameter elements, tensors, KV cache bytes]`` of what it holds (a
    tensor counted once where it shares memory with another)."""
    g = problem.graph
    keys = set(device_map)
    out = {key: [0, 0, 0, 0] for key in device_map}

    def owner(name: str):
        return _owner(name, keys)

    t = g.tensors
    for k in range(len(t.name)):
        key = owner(t.name[k])
        if key is None or t.storage[k] != k:
            continue
        row = out[key]
        row[0] += t.nbytes[k]
        row[1] += t.numel[k] if t.is_param[k] else 0
        row[2] += 1
    cache = problem.generation.cache if problem.generation is not None else {}
    for node, nbytes in cache.items():
        key = owner(g.nodes.name[node])
        if key is not None:
            out[key][3] += nbytes
    return out


def _owner(name: str, keys) -> str | None:
    """The key of ``keys`` (a device map's) that is ``name`` or its closest ancestor."""
    while True:
        if name in keys:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def _routed_apart(problem: Problem, device_map: Mapping, stats: dict, experts: Mapping | None) -> tuple[dict, set]:
    """``stats`` (:func:`unit_stats`) without the experts modules priced from their routed experts
    (:func:`allocator.evaluate.experts.routed_layers`), and the keys they emptied: the runtime runs those modules
    expert by expert, not as units."""
    g = problem.graph
    t, cols = g.tensors, columns(g)
    keys = set(device_map)
    out = {key: list(row) for key, row in stats.items()}
    touched = set()
    for layer in routed_layers(problem, device_map, experts):
        key = _owner(layer.experts, keys)
        node = g.node_index[layer.experts]
        for k in range(cols.first[node], cols.last[node]):
            if t.storage[k] == k:
                out[key][0] -= t.nbytes[k]
                out[key][1] -= t.numel[k] if t.is_param[k] else 0
                out[key][2] -= 1
        touched.add(key)
    return out, {key for key in touched if not any(out[key][:3])}


def _activation_per_token(problem: Problem) -> float:
    """Activation bytes one token carries across a unit boundary (``Profile.activation_bytes`` per
    ``Profile.tokens``: the named default's hidden width and dtype)."""
    p = problem.profile
    return p.activation_bytes / p.tokens


def _streamed(problem: Problem, stats, source: str, tokens: int, phase: str, main: Device,
              runtime: str = "allocator") -> float:
    """One step of the unit with its weights streamed to ``main`` as ``runtime`` streams them (the copy priced by
    :func:`allocator.evaluate.cost.copy_seconds`, the one copy formula), then read or computed there."""
    p = problem.profile
    nbytes, numel, tensors, cache = stats
    seconds = copy_seconds(p, main, source, nbytes, tensors, runtime=runtime)
    seconds += max(nbytes / p.accelerator_memory, 2 * tokens * numel / p.accelerator_flops)
    if phase == "decode":
        seconds += cache / p.accelerator_memory
    return seconds


def _local(problem: Problem, stats, source: str, tokens: int, phase: str, crossings: int = 1) -> float:
    p = problem.profile
    nbytes, numel, _, cache = stats
    read = nbytes / (p.disk_read if source == "disk" else p.cpu_memory)
    seconds = max(read, 2 * tokens * numel / p.cpu_flops)
    if phase == "decode":
        seconds += cache / p.cpu_memory
    moved = 2 * tokens * _activation_per_token(problem) * crossings
    return seconds + moved / p.pinned_host_to_device + 2 * crossings * p.switch_latency


def crossings(problem: Problem, unit: str) -> int:
    """How many times the runtime moves the activations of ``unit``, computed on the CPU, each way per call: once
    (its boundary), or, for a module list or dict (``model.layers`` offloaded whole), once per child that holds
    tensors, as :func:`allocator.offload.hybrid.layer_hooks` puts a boundary on each child (issue #49: the price
    counts the moves the runtime makes)."""
    nodes = problem.graph.nodes
    i = problem.graph.node_index.get(unit)
    if i is None or nodes.cls[i] not in ("ModuleList", "ModuleDict"):
        return 1
    end, held = nodes.end, [a + b for a, b in zip(nodes.n_params, nodes.n_buffers)]
    return max(1, sum(1 for c in nodes.children(i) if any(held[j] for j in range(c, end[c]))))


def decide(problem: Problem, device_map: Mapping, main: Device, ram_room: int | None = None, *,
           experts: Mapping | None = None) -> ComputePlan | None:
    """The :class:`ComputePlan` of ``device_map`` for ``problem``, or ``None`` where there is no choice (accelerate's
    hooks, a CPU main device, nothing offloaded). ``ram_room``: bytes RAM can still take (``None``: no limit) for
    the KV cache of units that compute on the CPU at decode; a unit whose cache does not fit decodes on the main
    device. ``experts``: where each routed expert lives (``Placement.experts``; ``None``: every expert where its
    module is); an offloaded experts module is decided per layer and phase from its routed experts
    (:attr:`ComputePlan.experts`), not as a unit.

    Notes
    -----
    O(tensors + cache nodes). The choices are estimates from ``problem.profile``.
    """
    if problem.runtime.name != "allocator" or not is_accelerator(main):
        return None
    device_map = normalize_map(device_map)
    offloaded = [k for k, d in device_map.items() if d in ("cpu", "disk")]
    if not offloaded:
        return None
    stats, apart = _routed_apart(problem, device_map, unit_stats(problem, device_map), experts)
    tokens = phase_tokens(problem)
    devices, choices, moved = {}, [], 0
    for unit in (u for u in offloaded if u not in apart):
        source = device_map[unit]
        row = {}
        for phase in PHASES:
            streamed = _streamed(problem, stats[unit], source, tokens[phase], phase, main)
            local = _local(problem, stats[unit], source, tokens[phase], phase, crossings(problem, unit))
            device = "cpu" if local < streamed else main
            if phase == "decode" and device == "cpu" and stats[unit][3]:
                if ram_room is not None and moved + stats[unit][3] > ram_room:
                    device = main        # its KV cache would not fit in RAM
                else:
                    moved += stats[unit][3]
            row[phase] = device
            choices.append(PhaseChoice(unit, phase, device, source, tokens[phase], stats[unit][0], stats[unit][3],
                                       streamed, local))
        devices[unit] = row
    return ComputePlan(devices=devices, tokens=tokens, threshold=tokens["decode"], choices=tuple(choices),
                       cache_moved=moved, experts=expert_modes(problem, device_map, experts, tokens))


def step_seconds(problem: Problem, device_map: Mapping, main: Device, phase: str, compute: ComputePlan | None,
                 *, runtime: str | None = None, experts: Mapping | None = None) -> float:
    """Estimated seconds of one step of ``phase`` (all its tokens) for ``device_map``: resident units read or
    computed where they are, offloaded ones as ``compute`` says (streamed where it is ``None``); ``runtime=
    "accelerate"`` prices streaming as accelerate's hooks do it (pageable copies, a cache emptied per tensor).

    Under the allocator runtime an offloaded experts module is priced from its routed experts in this phase's tokens
    (:func:`allocator.evaluate.experts.routed_seconds`: the formula of every phase), run as ``compute.experts``
    says (fetched where ``compute`` is ``None``); ``experts``: where each expert lives (``Placement.experts``;
    ``None``: every expert where its module is)."""
    p = problem.profile
    device_map = normalize_map(device_map)
    tokens = phase_tokens(problem)[phase]
    stats_of, apart = unit_stats(problem, device_map), set()
    seconds = 0.0
    if runtime != "accelerate" and problem.runtime.name == "allocator" and routed_layers(problem, device_map, experts):
        modes = ({name: row.get(phase) for name, row in compute.experts.items()} if compute is not None else
                 {layer.experts: "fetch" for layer in routed_layers(problem, device_map, experts)})
        seconds += sum(routed_seconds(problem, device_map, experts, tokens, modes).values())
        stats_of, apart = _routed_apart(problem, device_map, stats_of, experts)
    for unit, stats in stats_of.items():
        if unit in apart:
            continue
        d = device_map[unit]
        nbytes, numel, tensors, cache = stats
        if d in ("cpu", "disk") and is_accelerator(main):
            if compute is not None and compute.devices.get(unit, {}).get(phase) == "cpu":
                seconds += _local(problem, stats, d, tokens, phase, crossings(problem, unit))
            else:
                seconds += _streamed(problem, stats, d, tokens, phase, main,
                                     "accelerate" if runtime == "accelerate" else "allocator")
        elif is_accelerator(d):
            seconds += max(nbytes / p.accelerator_memory, 2 * tokens * numel / p.accelerator_flops)
            seconds += cache / p.accelerator_memory if phase == "decode" else 0
        else:   # the CPU (or disk) as main device
            seconds += max(nbytes / p.cpu_memory, 2 * tokens * numel / p.cpu_flops)
            seconds += cache / p.cpu_memory if phase == "decode" else 0
    return seconds


def cache_moves(compute: ComputePlan | None, main: Device) -> dict:
    """Bytes per device the compute plan moves in ``generate``'s peak: the KV cache of units that compute on the CPU
    at decode leaves the main device for RAM."""
    if compute is None or not compute.cache_moved:
        return {}
    return {main: -compute.cache_moved, "cpu": compute.cache_moved}


def phase_problem(problem: Problem, phase: str) -> Problem:
    """``problem`` priced for one step of ``phase``: the counted forward of that step where FLOPs were counted
    (:func:`allocator.problem.step_problem`), else, with a generation budget, the profile's tokens per forward set to
    the phase's (:func:`phase_tokens`: ``batch x prompt`` for prefill, ``batch`` for decode; without a generation
    budget, ``problem`` itself for prefill and one token for decode)."""
    if phase in problem.steps:
        return step_problem(problem, phase)
    if problem.generation is None and phase == "prefill":
        return problem
    tokens = max(1, phase_tokens(problem)[phase])
    return replace(problem, profile=replace(problem.profile, tokens=tokens))


def cache_seconds(problem: Problem, phase: str, cache: Mapping) -> float:
    """Seconds one step of ``phase`` spends on the KV cache (``cache``: bytes per device where the units that own it
    compute), where the FLOP count does not hold it already: a decoding step reads the whole cache; a prefill writes
    the prompt's share of it (``prompt / max_length``). 0 without a generation budget or where ``phase`` was
    counted (its count reads the cache: :func:`allocator.problem.step_problem`)."""
    needs = problem.generation
    if needs is None or phase in problem.steps:
        return 0.0
    p = problem.profile
    share = 1.0
    if phase == "prefill":
        budget = needs.budget
        share = (budget.prompt_length or budget.max_length - 1) / budget.max_length
    return sum(share * nbytes / (p.accelerator_memory if is_accelerator(d) else p.cpu_memory)
               for d, nbytes in cache.items() if d != "disk")


def hybrid_seconds(compute: ComputePlan | None, phase: str, routed=()) -> float:
    """What computing units where their weights live changes in one step of ``phase``, against streaming them to
    the main device (negative: the plan chose it because it is cheaper), from the choices that made the compute
    plan; units in ``routed`` (experts modules run expert by expert, priced from their routed experts by
    :func:`allocator.evaluate.experts.routed_cost`) are left out, their price already being the routed one."""
    if compute is None:
        return 0.0
    return sum(c.local_seconds - c.streamed_seconds for c in compute.choices
               if c.phase == phase and c.device == "cpu" and c.unit not in routed)
