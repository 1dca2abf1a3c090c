"""Decoder layers split under our runtime: the attention, with its KV cache, on the main device; the MLP where its
weights live (issue #49).

Under ``runtime="allocator"`` with one accelerator and a generation budget, an offloaded layer decodes where its
weights live, and its KV cache, read whole at every decoding step, lives in RAM with it
(:func:`allocator.evaluate.compute.decide`). A layer may instead be split (:func:`allocator.model.split.find_splits`):
its attention side on the main device, where its cache is read at the accelerator's bandwidth, and its MLP in RAM,
computed there (the runtime moves the activations at the boundary). Finer units also pack the main device better:
the next layer's attention fits in room its whole layer did not.

:func:`split` weighs, after the whole-layer plan is made (and grown, :func:`allocator.strategies.grow.grow`), the
plans that move the attention side of the first ``k`` offloaded layers onto the main device while the MLPs of the
last ``d`` resident layers leave it, for every ``d`` with the most ``k`` the verdict keeps valid. The one verdict
(:func:`allocator.judge.verdict.verdict`) judges and prices each; the plan with the fastest estimated decoding step
(the step ``generate`` repeats) is kept where it beats the whole-layer plan and keeps at least its bytes (weights and
KV cache) on the main device and the contract; otherwise the whole-layer plan is kept. Either way a ``"sublayer"``
decision says why, with the estimates. In a mixture of experts the far side is the routed experts, already placed
per expert (:mod:`allocator.strategies.experts`): a layer the fill left whole in RAM may get its near side
(attention, norms, router, shared experts) onto the main device, its routed experts left as placed.
"""

from __future__ import annotations

from dataclasses import replace

from ..budgets import normalize_map
from ..evaluate.memory import device_of
from ..evaluate.units import problem_groups
from ..judge.contract import contract_violations
from ..judge.verdict import Verdict, verdict
from ..placement import Decision, Placement
from ..problem import Problem
from .kit import sole_accelerator

__all__ = ["split", "main_bytes", "split_layers", "with_parts"]


def main_bytes(v: Verdict, main) -> int:
    """Bytes a decoding step reads on the main device: the model's weights held there and the KV cache there."""
    return int(v.resident.get(main, 0)) + int(v.parts.get(main, {}).get("cache", 0))


def split_layers(problem: Problem, device_map) -> list[str]:
    """The layers of ``problem.splits`` that ``device_map`` splits (their far side written apart from the layer)."""
    device_map = normalize_map(device_map)
    return [s.layer for s in problem.splits if s.far in device_map and s.layer not in device_map]


def split(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with the attention side of decoder layers on its main device and their MLPs offloaded, where the
    verdict says a decoding step is faster so (module docstring); ``placement`` with a ``"sublayer"`` decision that
    says why not otherwise; ``placement`` itself where no layer can be split (accelerate's hooks, no generation
    budget, not one accelerator, no layer offloaded).

    Notes
    -----
    O(r + o) verdicts for r resident and o offloaded layers: the most attention sides that fit never falls when one
    more MLP leaves the main device, so one pass over ``d`` carries ``k`` forward.
    """
    if (not problem.splits or problem.runtime.name != "allocator" or problem.generation is None
            or placement.accelerates):
        return placement
    device_map, main = sole_accelerator(placement)
    if main is None:
        return placement
    before = verdict(problem, placement)
    if not before.valid or "decode" not in before.steps:
        return placement
    near = {s.layer: {device_of(n, device_map) for n in s.near} for s in problem.splits}
    where = {s.layer: device_of(s.far, device_map) for s in problem.splits}
    resident = [s for s in problem.splits if not s.moe and near[s.layer] == {main} and where[s.layer] == main]
    offloaded = [s for s in problem.splits if len(near[s.layer]) == 1 and near[s.layer] <= {"cpu", "disk"}
                 and where[s.layer] in ("cpu", "disk")]
    if not offloaded:
        return placement
    broken = {v.kind for v in contract_violations(problem, device_map, exempt=placement.exempt)}
    best, tried, valid = None, 0, 0
    k = 0
    for d in range(len(resident) + 1):
        while k < len(offloaded):
            candidate = _candidate(problem, placement, device_map, main, resident[len(resident) - d:],
                                   offloaded[:k + 1], where)
            tried += 1
            judged = verdict(problem, candidate)
            if not judged.valid:
                break
            k, valid = k + 1, valid + 1
            if main_bytes(judged, main) >= main_bytes(before, main) and not (
                    {v.kind for v in contract_violations(problem, candidate.device_map, exempt=placement.exempt)}
                    - broken):
                seconds = judged.steps["decode"].seconds
                if best is None or seconds < best[0]:
                    best = (seconds, d, k, candidate, judged)
        if k == len(offloaded):
            break
    return _said(problem, placement, before, best, main, tried, valid)


def _said(problem: Problem, placement: Placement, before: Verdict, best, main, tried: int, valid: int) -> Placement:
    """The placement kept, with its ``"sublayer"`` decision."""
    facts = {"decode_whole": before.steps["decode"].seconds, "prefill_whole": before.steps["prefill"].seconds,
             "bytes_whole": main_bytes(before, main), "tried": tried, "valid": valid,
             "context": problem.generation.budget.max_length}
    if best is None:   # nothing valid, or nothing that keeps the bytes on the main device and the contract
        said = Decision("sublayer", devices=(main,), bound="budget" if not valid else "floor",
                        facts={**facts, "reason": "none-fits" if not valid else "fewer-bytes"})
        return replace(placement, decisions=placement.decisions + (said,))
    seconds, demoted, moved, candidate, judged = best
    facts.update(decode=seconds, prefill=judged.steps["prefill"].seconds, bytes=main_bytes(judged, main),
                 layers=demoted + moved, demoted=demoted, moved=moved,
                 cache=int(judged.parts.get(main, {}).get("cache", 0)),
                 cache_whole=int(before.parts.get(main, {}).get("cache", 0)))
    if seconds >= before.steps["decode"].seconds:
        said = Decision("sublayer", devices=(main,), bound="estimate", facts={**facts, "reason": "slower"})
        return replace(placement, decisions=placement.decisions + (said,))
    cut = set(split_layers(problem, candidate.device_map))
    names = tuple(name for s in problem.splits if s.layer in cut for name in s.near)
    said = Decision("sublayer", devices=(main,), units=names, bytes=facts["bytes"] - facts["bytes_whole"],
                    bound="estimate", facts={**facts, "reason": "faster"})
    return replace(candidate, decisions=candidate.decisions + (said,))


def _candidate(problem: Problem, placement: Placement, device_map: dict, main, demoted, moved, where) -> Placement:
    """``placement`` with the MLP of each layer of ``demoted`` (resident) moved to RAM and the attention side of each
    layer of ``moved`` (offloaded) moved onto ``main``."""
    parts = {}
    for s in (*demoted, *moved):   # the far side stays where it is offloaded; a resident MLP leaves for RAM
        parts.update(dict.fromkeys(s.near, main))
        parts[s.far] = "cpu" if where[s.layer] == main else where[s.layer]
    return replace(placement, device_map=with_parts(problem, device_map, parts,
                                                    {s.layer for s in (*demoted, *moved)}))


def with_parts(problem: Problem, device_map, parts: dict, layers: set) -> dict:
    """``device_map`` with ``layers`` (of ``problem.splits``) written per part as ``parts`` says (part name ->
    device): the map written per unit where it must be (no key under another key), then cleaned as the options
    say."""
    device_map = normalize_map(device_map)
    order = problem.graph.node_index
    by_layer: dict = {}
    for name in sorted(parts, key=lambda n: order.get(n, -1)):
        by_layer.setdefault(_layer_of(name, layers), []).append(name)
    expanded = {}
    for g in problem_groups(problem).records():
        for u in g.units:
            if u.name in layers:   # the layer's parts where the layer was, in model order
                expanded.update((name, parts[name]) for name in by_layer.get(u.name, ()))
            elif _layer_of(u.name, layers) is None and device_of(u.name, device_map) is not None:
                expanded[u.name] = device_of(u.name, device_map)   # (a unit mapped finer keeps its keys)
    expanded.update(parts)
    covers = {""}
    for name in expanded:   # every module above a written key
        while name:
            name = name.rpartition(".")[0]
            if name in covers:
                break
            covers.add(name)
    uncovered = {k: v for k, v in device_map.items() if k not in covers and device_of(k, expanded) is None}
    return problem.cleaned({**uncovered, **expanded})


def _layer_of(name: str, layers: set) -> str | None:
    """The one of ``layers`` that is ``name`` or above it, or ``None``."""
    while name:
        if name in layers:
            return name
        name = name.rpartition(".")[0]
    return None
