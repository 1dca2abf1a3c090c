"""The judge's verdict on a map: the runtime rules it breaks and the memory it needs, from the one validator.

Every map a strategy, the judge, the report or the composition weighs is checked here
(:func:`allocator.evaluate.validate.check`): this module is the judge's one door to it, so a candidate is judged
once per problem and map (``check`` remembers its last results on the problem, :meth:`allocator.memo.Derived.recent`)
and no other layer above ``evaluate/`` calls the validator on its own. It also holds what the contract reads of a
map's memory (:func:`headroom`, the second half of rule 3).

Examples
--------
>>> import torch.nn as nn
>>> from allocator.problem import build_problem
>>> problem = build_problem(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {0: 1000, 1: 1000})
>>> is_valid(problem, {"": 0}), [v.kind for v in violations(problem, {"0": 0})]
(True, ['coverage'])
>>> memory(problem, {"0": 0, "1": 1}).peak
{0: 288, 1: 288}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..budgets import ByDevice, is_accelerator, normalize_map
from ..evaluate.compute import (
    PHASES, ComputePlan, cache_moves, cache_seconds, decide, hybrid_seconds, phase_problem,
)
from ..evaluate.cost import Cost, priced
from ..evaluate.experts import moved_bytes, routed_cost
from ..evaluate.memory import Memory, expert_cache_reserve, fetch_reserves, map_runs
from ..evaluate.runs import columns
from ..evaluate.tiers import fast_tier
from ..evaluate.validate import Violation, budget_violations, check, peak_parts
from ..memo import Key
from ..placement import Placement
from ..problem import Problem

__all__ = ["PARTS", "Verdict", "headroom", "is_valid", "judged", "memory", "verdict", "violations"]

VERDICT = Key("verdict")

PARTS = ("weights", "experts", "expert_cache", "fetch", "reserve", "cache", "logits", "activations")
"""What a device's peak is made of, in :attr:`Verdict.parts`: the model's weights held there (with the buffers of
offloaded modules), routed experts the allocator runtime keeps there away from their module's device, its cache of
recently routed experts, its fetch buffers for experts routed to a device other than the main one, the streaming
reserve (the largest chain of offloaded weights streamed at once, and the modules made ready ahead), and with a
generation budget the KV cache (where the unit that owns it computes at decode), the logits and the activations."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The one verdict on a placement, computed once (:func:`verdict`) and read by everything that says something
    about the plan (``repr``, ``explain()``, ``to_dict()``, the CLI) and by the runtime (:class:`allocator.Plan`).

    Attributes
    ----------
    violations : tuple of Violation
        Every runtime rule broken, budgets judged on :attr:`peak` (every byte the runtime will hold).
    peak : dict
        Bytes per device at its peak, every term counted: the sum of that device's :attr:`parts`.
    parts : dict
        Per device, its peak by :data:`PARTS`.
    resident : dict
        Counted bytes of the model held per device, each byte once, where the runtime holds it (routed experts
        kept away from their module's device counted where they are kept, not where the map puts the module).
    memory : Memory
        The map's memory under the runtime rules (:func:`allocator.evaluate.validate.check`): main device, the
        streamed chain, the prefetch reserve.
    expert_cache : tuple
        ``(slots, bytes)`` of the allocator runtime's expert cache on the main device.
    hybrid : ComputePlan or None
        Where offloaded units compute per phase (:func:`allocator.evaluate.compute.decide`).
    steps : dict
        Phase -> :class:`Cost` of one step: ``"prefill"``, and with a generation budget or a compute plan
        ``"decode"`` too (one token per sequence).
    stream_steps : dict
        Phase -> seconds of one step with every offloaded unit streamed (what :attr:`hybrid` is weighed against).
    optimize : str
        The phase :attr:`cost` prices (``PlanOptions.optimize``).
    """

    violations: tuple
    peak: Mapping
    parts: Mapping
    resident: Mapping
    memory: Memory
    expert_cache: tuple
    hybrid: ComputePlan | None
    steps: Mapping
    stream_steps: Mapping
    optimize: str

    @property
    def valid(self) -> bool:
        """Every rule kept and every byte the runtime holds within its device's budget."""
        return not self.violations

    @property
    def cost(self) -> Cost:
        """The estimate of the step :attr:`optimize` names: one of :attr:`steps`, never a third number."""
        return self.steps[self.optimize] if self.optimize in self.steps else next(iter(self.steps.values()))


def verdict(problem: Problem, placement: Placement) -> Verdict:
    """The :class:`Verdict` on ``placement`` for ``problem``: the runtime rules, the memory per device with every
    term the chosen runtime holds (resident weights, resident experts, the expert cache, fetch buffers, the streaming
    and prefetch reserve, the KV cache where each unit computes at decode, logits and activations), where offloaded
    units compute per phase, one price per phase, and whether every byte is within its budget. Nothing is added to it
    afterwards. The last few verdicts are remembered on the problem (:meth:`allocator.memo.Derived.recent`), so the
    composition's checks and the plan read the same one.

    Examples
    --------
    >>> import torch.nn as nn
    >>> from allocator.placement import Placement
    >>> from allocator.problem import build_problem
    >>> problem = build_problem(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {0: 600, "cpu": 1000})
    >>> v = verdict(problem, Placement({"0": 0, "1": "cpu"}, strategy="example"))
    >>> v.valid, dict(v.peak), v.parts[0]["weights"], v.parts[0]["reserve"], dict(v.resident)
    (True, {0: 576, 'cpu': 288}, 288, 288, {0: 288, 'cpu': 288})
    """
    experts = tuple(sorted((k, tuple(v)) for k, v in placement.experts.items()))
    key = {**placement.device_map, "\0experts": experts} if experts else placement.device_map
    return problem.derived.recent(VERDICT, key, lambda: _verdict(problem, placement))


def _verdict(problem: Problem, placement: Placement) -> Verdict:
    device_map = normalize_map(placement.device_map)
    found, memory = check(problem, device_map)
    parts = _parts(problem, placement, device_map, memory)
    cache = expert_cache_reserve(problem, device_map) if placement.experts else (0, 0)
    if cache[1]:
        parts.setdefault(memory.main, dict.fromkeys(PARTS, 0))["expert_cache"] += cache[1]
    ram = problem.budgets.limit("cpu")
    room = None if ram is None else max(ram - sum(parts.get("cpu", {}).values()), 0)
    hybrid = decide(problem, device_map, memory.main, room, experts=placement.experts)
    before = {d: row["cache"] for d, row in parts.items() if row["cache"]}
    for device, delta in cache_moves(hybrid, memory.main).items():   # the KV cache of units decoding on the CPU
        parts.setdefault(device, dict.fromkeys(PARTS, 0))["cache"] += delta
    peak = {d: sum(row.values()) for d, row in parts.items()}
    rules = [v for v in found if v.kind not in ("budget", "unknown-device")]
    rules += budget_violations(problem, memory, peak, set(device_map.values()))
    resident = _resident(problem, placement, device_map)
    steps, stream = _steps(problem, placement, hybrid, resident, before)
    return Verdict(violations=tuple(rules), peak=ByDevice(peak), parts=ByDevice(parts), resident=ByDevice(resident),
                   memory=memory, expert_cache=cache, hybrid=hybrid, steps=steps, stream_steps=stream,
                   optimize=problem.cost.optimize)


def _parts(problem: Problem, placement: Placement, device_map: dict, memory: Memory) -> dict:
    """Per device, :data:`PARTS` of the map's memory (:func:`allocator.evaluate.validate.peak_parts` split into the
    model's weights, the streaming reserve and the fetch buffers) and the routed experts kept away from their
    module's device."""
    out = {}
    fetch = fetch_reserves(problem, device_map)
    for device, row in peak_parts(problem, device_map, memory).items():
        reserve = memory.streamed + memory.prefetch if device == memory.main else 0
        out[device] = {"weights": row["weights"] - reserve - fetch.get(device, 0), "experts": 0, "expert_cache": 0,
                       "fetch": fetch.get(device, 0), "reserve": reserve, "cache": row["cache"],
                       "logits": row["logits"], "activations": row["activations"]}
    for device, nbytes in moved_bytes(problem, placement).items():
        if nbytes > 0:
            out.setdefault(device, dict.fromkeys(PARTS, 0))["experts"] += nbytes
    return out


def _resident(problem: Problem, placement: Placement, device_map: dict) -> dict:
    """Counted bytes of the model per device, each byte once, where the runtime holds it."""
    counted = columns(problem.graph).sum_counted
    out: dict = {}
    for run in map_runs(problem.graph, device_map):
        if run.device is not None:
            out[run.device] = out.get(run.device, 0) + int(counted[run.end] - counted[run.start])
    for device, delta in moved_bytes(problem, placement).items():
        out[device] = out.get(device, 0) + delta
    return out


def _steps(problem: Problem, placement: Placement, hybrid, resident: dict, cache: dict) -> tuple[dict, dict]:
    """One :class:`Cost` per phase, from the one cost formula (:func:`allocator.evaluate.cost.priced` of the phase's
    problem, routed experts priced as routed, :func:`allocator.evaluate.experts.routed_cost`), with the KV cache's
    reads where the count does not hold them and the units computed where their weights live as :attr:`hybrid`
    says; and the seconds of each phase with every offloaded unit streamed."""
    phases = PHASES if problem.generation is not None or hybrid is not None else ("prefill",)
    fast = fast_tier(problem.budgets)
    kept = sum(n for d, n in resident.items() if d in fast)
    steps, stream = {}, {}
    for phase in phases:
        at = phase_problem(problem, phase)
        cost = routed_cost(at, placement, priced(at, placement.device_map))
        streamed = cost.seconds + cache_seconds(at, phase, cache)
        stream[phase] = streamed
        steps[phase] = replace(cost, seconds=streamed + hybrid_seconds(hybrid, phase, placement.experts),
                               resident_fast=kept)
    return steps, stream


def judged(problem: Problem, device_map: Mapping) -> tuple[list[Violation], Memory]:
    """The runtime rules ``device_map`` breaks for ``problem`` and the memory it needs at runtime
    (:func:`allocator.evaluate.validate.check`; each call returns its own copies)."""
    return check(problem, device_map)


def violations(problem: Problem, device_map: Mapping) -> list[Violation]:
    """The runtime rules ``device_map`` breaks (empty where it is valid)."""
    return check(problem, device_map)[0]


def is_valid(problem: Problem, device_map: Mapping) -> bool:
    """Whether ``device_map`` keeps every runtime rule."""
    return not check(problem, device_map)[0]


def memory(problem: Problem, device_map: Mapping) -> Memory:
    """What ``device_map`` needs at runtime: peaks per device, main device, streaming reserve and its chain."""
    return check(problem, device_map)[1]


def headroom(problem: Problem, device_map) -> int | None:
    """The least free memory a map leaves on any budgeted accelerator at its peak (budget minus peak, an empty
    accelerator leaving its whole budget), where the map keeps every tensor on the accelerators; else ``None`` (the
    headroom half of rule 3 applies only where the model fits on the accelerators).

    >>> import torch.nn as nn
    >>> from allocator.problem import build_problem
    >>> problem = build_problem(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {0: 1000, 1: 1000})
    >>> headroom(problem, {"0": 0, "1": 1}), headroom(problem, {"": 0}), headroom(problem, {"0": 0, "1": "cpu"})
    (712, 424, None)
    """
    if not all(is_accelerator(d) for d in device_map.values()):
        return None
    peak = memory(problem, device_map).peak
    limits = [(d, problem.budgets.limit(d)) for d in problem.budgets.accelerators]
    free = [limit - peak.get(d, 0) for d, limit in limits if limit is not None]
    return min(free) if free else None
