"""How each component of a pipeline runs, chosen together: the options of one component (whole on an accelerator,
moved onto one from RAM when it runs, computed on the CPU where it lives, or a map of its own planned by
:func:`allocator.plan`), the joint peak of a choice, and the small search over choices (a pipeline has at most a
handful of components).

The joint rule is :mod:`allocator.pipelines.together`'s: components run one after another, so a device holds what
every component keeps there (its weights, or its resident part) plus the largest of what one of them needs while it
runs there (its activations at the :class:`allocator.DiffusionBudget`'s sizes, a moved component's weights, a map's
streaming reserve). A map of its own is judged on its own verdict (:mod:`allocator.judge.verdict` ``PARTS``).

The price of a choice is the sum over components of runs x the price of one run where it computes (an estimate:
``allocator.profile.read_seconds`` at the component's tokens), plus, for a moved component, its bytes over the
host-to-device link once per image.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..api import plan
from ..budgets import is_accelerator
from ..errors import InfeasiblePlacement
from ..profile import read_seconds
from .together import kept_bytes, running_bytes

__all__ = ["Choice", "Need", "Option", "choose", "joint_peak", "whole_options"]

log = logging.getLogger("allocator.pipelines")

REALIZED = 4
"""Choices of whole options whose components with a map of their own are then planned (each a call of
:func:`allocator.plan`), best estimate first."""
MAX_CHOICES = 20_000
"""Choices of whole options judged at most: beyond it (many components over many accelerators), each component's
dearest options are left out first."""
NEAR = 1.05
"""Under ``balanced``, choices priced within this factor of the cheapest count as equally fast: the most even
spread of them wins."""


@dataclass(frozen=True)
class Need:
    """What one component is, for the choice: its bytes, its activation peak while it runs, how often it runs per
    image, the tokens one run computes, and its module (for a map of its own)."""

    name: str
    size: int
    activations: int
    runs: float
    tokens: int
    model: object = None
    loader: str = "accelerate"


@dataclass(frozen=True)
class Option:
    """One way a component runs: ``execution`` (:data:`allocator.pipelines.plan.EXECUTIONS`), the device it
    computes on, what it keeps per device, what it needs per device while it runs, and seconds per image (an
    estimate). ``placed``: what its loading gets (a device, or its map); ``plan`` and ``given`` for a map of its
    own."""

    name: str
    execution: str
    runs_on: object
    kept: dict
    running: dict
    seconds: float
    placed: object
    plan: object = None
    given: dict = field(default_factory=dict)
    moved_seconds: float = 0.0


@dataclass(frozen=True)
class Choice:
    """One option per component (``ways``: name -> :class:`Option`), and the joint peak per device."""

    ways: dict
    peak: dict
    over: dict

    @property
    def valid(self) -> bool:
        return not self.over and all(o.plan is None or o.plan.valid for o in self.ways.values())

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.ways.values())

    def fill(self, budgets: Mapping) -> float:
        """The largest share of an accelerator's budget the joint peak takes."""
        return max((self.peak.get(d, 0) / b for d, b in budgets.items() if is_accelerator(d) and b), default=0.0)

    def on_accelerators(self) -> int:
        return sum(b for o in self.ways.values() for d, b in o.kept.items() if is_accelerator(d))


def step_seconds(profile, device, need: Need) -> float:
    """Seconds of one run of the whole component computing on ``device`` (reading its weights there, or computing
    ``2 · params · tokens`` FLOP, the larger)."""
    numel = need.size // 2 or 1
    return read_seconds(dataclasses.replace(profile, tokens=max(need.tokens, 1)), device, need.size, numel)


def whole_options(need: Need, budgets: Mapping, profile) -> list:
    """The options that keep ``need`` whole: resident on each accelerator, moved onto each from RAM, computed on the
    CPU. Options that cannot fit their device alone are left out."""
    accelerators = [d for d, b in budgets.items() if is_accelerator(d) and b]
    ram = "cpu" in budgets and (budgets["cpu"] is None or budgets["cpu"] > 0)
    found = []
    for device in accelerators:
        run = need.runs * step_seconds(profile, device, need)
        if need.size + need.activations <= budgets[device]:
            found.append(Option(need.name, "resident", device, {device: need.size}, {device: need.activations}, run,
                                device))
            if ram:
                move = need.size / profile.host_to_device
                found.append(Option(need.name, "moved", device, {"cpu": need.size},
                                    {device: need.size + need.activations}, run + move, "cpu", moved_seconds=move))
    if ram:
        found.append(Option(need.name, "cpu", "cpu", {"cpu": need.size}, {"cpu": need.activations},
                            need.runs * step_seconds(profile, "cpu", need), "cpu"))
    return found


def split_option(need: Need, room: Mapping, unlimited: Mapping, options: dict, profile) -> Option | None:
    """``need`` given a map of its own by :func:`allocator.plan` over ``room`` (what the others leave), or ``None``
    where no valid plan exists there, or none that uses an accelerator. Its activations are charged to its main device
    while it runs; one run is priced as computing whole on the main device plus the bytes its map streams there
    (the plan is made with the default profile, so a patched ``from_pretrained`` over the same budgets makes the same
    map)."""
    asked = {d: int(b) for d, b in room.items() if b is not None and b > 0}
    asked.update(unlimited)
    if not any(is_accelerator(d) for d in asked):
        return None
    try:
        result = plan(need.model, asked, loader=need.loader, strict=True, **options)   # a trial: no warning
    except InfeasiblePlacement as err:
        log.debug("no map of its own for %s in %s: %s", need.name, asked, err)
        return None
    if not result.valid or not any(is_accelerator(d) for d in result.device_map.values()):
        return None
    devices = {d for d in result.device_map.values()}
    kept = {d: kept_bytes(result, d) for d in devices | set(result.parts)}
    running = {d: running_bytes(result, d) for d in devices | set(result.parts)}
    running[result.main_device] = running.get(result.main_device, 0) + need.activations
    main = result.main_device
    step = step_seconds(profile, main, need)
    if len(devices) == 1:   # all of it on one accelerator: whole there
        return Option(need.name, "resident", main, {main: need.size}, {main: need.activations}, need.runs * step, main)
    streamed = result.cost.streamed_bytes / profile.host_to_device
    return Option(need.name, "split", main, {d: b for d, b in kept.items() if b},
                  {d: b for d, b in running.items() if b}, need.runs * (step + streamed), dict(result.device_map),
                  result, dict(asked))


def joint_peak(options, budgets: Mapping) -> Choice:
    """The joint peak of one option per component: per device, what all keep plus the most one needs while it
    runs; and what is over budget."""
    kept, running = {}, {}
    for o in options.values():
        for d, b in o.kept.items():
            kept[d] = kept.get(d, 0) + b
        for d, b in o.running.items():
            running[d] = max(running.get(d, 0), b)
    peak = {d: kept.get(d, 0) + running.get(d, 0) for d in set(kept) | set(running)}
    over = {d: peak[d] - budgets[d] for d in peak if budgets.get(d) is not None and peak[d] > budgets[d]}
    return Choice(dict(options), {d: b for d, b in peak.items() if b}, over)


def choose(needs: dict, budgets: Mapping, unlimited: Mapping, profile, options: dict, *, balanced: bool):
    """The best choice of one option per component (``None`` where nothing is valid), and the choices with maps of
    their own that were planned (the least over budget of them is what an invalid plan reports).

    Components that fit no accelerator whole get a map of their own (planned over what the others leave, up to
    :data:`REALIZED` choices of the others) or are computed on the CPU, and a component left on the CPU is offered
    a map too; the valid choice
    kept is the cheapest (then more bytes on the accelerators, then the most even spread), or under ``balanced``
    the most even spread among those within :data:`NEAR` of the cheapest."""
    whole = _pruned({n: whole_options(need, budgets, profile) for n, need in needs.items()})
    accelerators = {d: b for d, b in budgets.items() if is_accelerator(d) and b}
    big = [n for n, need in needs.items()
           if not any(o.execution in ("resident", "moved") for o in whole[n]) and accelerators]
    rest = [n for n in needs if n not in big]
    ranked = sorted((joint_peak({n: o for n, o in zip(rest, combo)}, budgets)
                     for combo in itertools.product(*(whole[n] for n in rest))),
                    key=lambda c: _estimate(c, [needs[n] for n in big], budgets, profile))
    realized = []
    for base in ranked[:REALIZED] if big else ranked[:1]:
        for cap in _caps(base, [needs[n] for n in big], budgets, balanced) if big else (1.0,):
            found = _with_maps(base, [needs[n] for n in big], budgets, unlimited, profile, options, cap)
            if found is not None:
                realized.append(found)
    if big:   # each of them computed on the CPU instead, where RAM holds it
        realized += [joint_peak({n: o for n, o in zip(needs, combo)}, budgets)
                     for combo in itertools.product(*(whole[n] for n in needs))]
    valid = [c for c in realized if c.valid] or [c for c in ranked if c.valid and not big]
    if not valid:
        return None, realized or ranked[:1]
    best = _best(valid, needs, budgets, balanced)
    best = _improve(best, needs, budgets, unlimited, profile, options, balanced)
    return best, realized


def _pruned(whole: dict) -> dict:
    """``whole`` with each component's dearest options left out, one at a time from the component with the most,
    until at most :data:`MAX_CHOICES` choices remain."""
    kept = {n: sorted(options, key=lambda o: o.seconds) for n, options in whole.items()}
    while math.prod(max(len(o), 1) for o in kept.values()) > MAX_CHOICES:
        most = max(kept, key=lambda n: len(kept[n]))
        if len(kept[most]) <= 2:
            break
        kept[most] = kept[most][:-1]
    return kept


def _best(valid: list, needs: dict, budgets: Mapping, balanced: bool) -> Choice:
    """The choice kept: first, the fewest components that run more than once per image (the denoiser) computing on
    the CPU, as the contract's first rule keeps a model off the CPU while an accelerator can run it; then the
    cheapest (more bytes on the accelerators, then the most even spread), or under ``balanced`` the most even
    spread among those within :data:`NEAR` of the cheapest."""
    def on_cpu(c: Choice) -> int:
        return sum(1 for n, o in c.ways.items() if o.execution == "cpu" and needs[n].runs > 1)

    if balanced:
        cheapest = min(c.seconds for c in valid)
        return min(valid, key=lambda c: (on_cpu(c), c.seconds > cheapest * NEAR, round(c.fill(budgets), 4),
                                         c.seconds))
    return min(valid, key=lambda c: (on_cpu(c), c.seconds, -c.on_accelerators(), c.fill(budgets)))


def _estimate(choice: Choice, big: list, budgets: Mapping, profile) -> tuple:
    """How a choice of whole options ranks before the components without one are planned: the room its peak leaves
    on the accelerators must hold what of theirs is not streamed; the rest streams at every run."""
    if choice.over:
        return (1, sum(choice.over.values()), 0.0)
    left = sum(max(b - choice.peak.get(d, 0), 0) for d, b in budgets.items() if is_accelerator(d) and b)
    seconds = choice.seconds
    for need in big:
        streamed = max(need.size + need.activations - left, 0)
        seconds += need.runs * streamed / profile.host_to_device
        left = max(left - need.size, 0)
    return (0, 0, seconds)


def _caps(base: Choice, extra: list, budgets: Mapping, balanced: bool) -> tuple:
    """Shares of each accelerator's budget a map of its own may fill: all of it; under ``balanced`` also the even
    share of what the pipeline needs on the accelerators (``base``'s peak there and the ``extra`` components'
    bytes), and 90 %."""
    if not balanced:
        return (1.0,)
    accelerators = {d: b for d, b in budgets.items() if is_accelerator(d) and b}
    need = sum(base.peak.get(d, 0) for d in accelerators) + sum(n.size for n in extra)
    even = min(1.0, need / sum(accelerators.values()) + 0.02)
    return tuple(sorted({round(even, 4), 0.9, 1.0}))


def _with_maps(base: Choice, big: list, budgets: Mapping, unlimited: Mapping, profile, options: dict, cap: float):
    """``base`` with each of ``big`` given a map of its own in turn over the room the choice so far keeps (an
    accelerator's room at most ``cap`` of its budget), shrunk where an earlier component's run needs more than the
    map leaves (as :func:`allocator.plan_together` does)."""
    chosen = dict(base.ways)
    capped = {d: (b * cap if b is not None and is_accelerator(d) else b) for d, b in budgets.items()}
    for need in sorted(big, key=lambda n: -n.runs * n.size):
        kept = {d: sum(o.kept.get(d, 0) for o in chosen.values()) for d in budgets}
        room = {d: (None if b is None else (b * cap if is_accelerator(d) else b) - kept[d])
                for d, b in budgets.items()}
        found = None
        for _ in range(3):
            found = split_option(need, room, unlimited, options, profile)
            if found is None:
                return None
            over = joint_peak({**chosen, need.name: found}, capped).over
            if not over:
                break
            room = {d: (v if d not in over or v is None else v - over[d]) for d, v in room.items()}
        chosen[need.name] = found
    return joint_peak(chosen, budgets)


def _improve(best: Choice, needs: dict, budgets, unlimited, profile, options, balanced) -> Choice:
    """Offer a map of its own (part on an accelerator, the rest streamed) to a component the choice computes on the
    CPU or moves at every image, and under ``balanced`` to the two largest components kept whole: planned over the
    room the others keep, kept where the choice then ranks better."""
    largest = sorted(needs, key=lambda n: -needs[n].size)[:2]
    for name in sorted(needs, key=lambda n: -needs[n].size):
        option = best.ways[name]
        if option.execution == "split" or needs[name].model is None or not (
                option.execution in ("cpu", "moved") or (balanced and name in largest)):
            continue
        others = joint_peak({n: o for n, o in best.ways.items() if n != name}, budgets)
        trials = [_with_maps(others, [needs[name]], budgets, unlimited, profile, options, cap)
                  for cap in _caps(others, [needs[name]], budgets, balanced)]
        best = _best([best] + [t for t in trials if t is not None and t.valid], needs, budgets, balanced)
    return best
