"""The "why" of :meth:`allocator.Plan.explain`: sentences that say why each device holds what it holds.

For a plan, in this order: why its main device is the main device; for each device, what it holds and why not more
(the room its peak leaves against the units placed after it, and what moving the first one that would fit there
would break or cost) or why nothing (an accelerator before the main device cannot be main; one after it is not
needed, or too small); why units are offloaded and which budgets are full; the streaming reserve and the offloaded
modules that set it. Sizes are written with :func:`allocator.evaluate.validate.format_bytes`.

Notes
-----
O(units) for the layout of the groups, plus, per device whose room would hold a unit placed after it, one check and
one estimate of the plan with that unit moved (:func:`allocator.evaluate.validate.check`,
:func:`allocator.evaluate.cost.estimate`:
O(keys)); models with more than :data:`MOVES_UP_TO` units are described without moving anything.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..budgets import format_ms, is_accelerator
from ..rules.dispatch import hooks_attach
from ..evaluate.memory import map_runs, offloaded_devices, prefetch_of
from ..evaluate.cost import priced
from ..report.minimum import why_empty
from .decisions import balances, follows_accelerate, sentence
from .phases import compute_sentences, expert_mode_sentences, experts_sentence
from ..judge.contract import contract_violations
from ..evaluate.units import problem_groups
from ..evaluate.validate import format_bytes
from ..judge.verdict import memory, violations as broken_rules

__all__ = ["Why", "reasons", "unbudgeted_ram", "MOVES_UP_TO"]

MOVES_UP_TO = 20_000
"""Above this many units, :func:`reasons` does not try a moved unit to say what moving it would break or cost."""


class _Layout:
    """Where each tie group of a plan lives (the device of its first unit that holds tensors; ``None`` for groups
    without tensors), in group order (model order)."""

    def __init__(self, plan):
        g = plan.problem.graph
        self.plan = plan
        self.found = found = problem_groups(plan.problem)
        keep, lo, _, _ = found.units.spans(g)
        found_runs = map_runs(g, plan.device_map)
        self.where: list = [None] * len(found)
        if found_runs and len(keep):
            starts = np.array([r.start for r in found_runs], dtype=np.int64)
            at = np.searchsorted(starts, lo, side="right") - 1
            devices = [found_runs[i].device for i in at.tolist()]
            for k, device in zip(found.unit_groups()[keep].tolist()[::-1], devices[::-1]):
                self.where[k] = device
        self.size = found.array("size")
        self.offload = found.array("offload")
        self.main = plan.main_device
        used = set(plan.device_map.values())
        self.offloaded = offloaded_devices(self.main) if hooks_attach(used) else frozenset()
        order = plan.problem.budgets.order
        self.rank = {d: i for i, d in enumerate(order)}
        self._unit_map = False   # not made yet
        self._on: dict = {}
        for k, device in enumerate(self.where):
            if device is not None:
                self._on.setdefault(device, []).append(k)

    def name(self, k: int) -> str:
        found = self.found
        return found.units.name[found.array("members")[found.array("start")[k]]]

    def on(self, device) -> list[int]:
        """The groups on ``device``, in model order."""
        return self._on.get(device, [])

    def after(self, device) -> list[int]:
        """Groups on devices after ``device`` in the budgets' order (later accelerators, then cpu, then disk), in
        model order."""
        rank = self.rank.get(device, -1)
        later = [d for d in self._on if d != device and self.rank.get(d, -1) > rank]
        if len(later) == 1:
            return self._on[later[0]]
        return sorted(k for d in later for k in self._on[d])

    def increment(self, k: int, device) -> int:
        """Bytes that moving group ``k`` onto ``device`` adds to its peak: an offloaded group's weights only (its
        buffers already sit on the main device) when it moves to the main device or another offload device."""
        if self.where[k] in self.offloaded and (device == self.main or device in self.offloaded):
            return int(self.offload[k])
        return int(self.size[k])

    def unit_map(self) -> dict | None:
        """The plan as a map of unit names (made once), or ``None`` where that map is not the same placement or the
        model has more than :data:`MOVES_UP_TO` units."""
        if self._unit_map is False:
            self._unit_map = None
            found, g = self.found, self.plan.problem.graph
            if len(found.units) <= MOVES_UP_TO:
                group_of = found.unit_groups().tolist()
                names = found.units.name
                placed = {names[j]: self.where[group_of[j]] for j in range(len(names))
                          if self.where[group_of[j]] is not None}
                runs_of = [tuple(r[:3]) for r in map_runs(g, placed)]
                if runs_of == [tuple(r[:3]) for r in map_runs(g, self.plan.device_map)]:
                    self._unit_map = placed
        return self._unit_map



def _share(nbytes: int, total: int) -> str:
    return f"{nbytes / total * 100:.1f} % of the model" if total else "none of the model"


def _units(n: int) -> str:
    return f"{n} unit{'' if n == 1 else 's'}"


def _strategy(plan) -> str:
    return plan.placement.algorithm


def _main_sentence(plan, layout: _Layout) -> str:
    p, main = plan.problem, plan.main_device
    budgets = p.budgets
    if plan.placement.accelerates:
        return (f"main device {main!r}: accelerate's rule, the lowest accelerator index in its map"
                if is_accelerator(main) else
                "main device 'cpu': accelerate's map puts nothing on an accelerator, so the CPU runs the model")
    if "main" in plan.placement.exempt:
        return (f"main device {main!r}: {_strategy(plan)} keeps the first accelerator as light as possible on purpose "
                "(the contract's rule 1 does not apply to it)")
    if not p.deciding.contract:
        return f"main device {main!r}: under objective latency the cost model's estimate alone chose it"
    if is_accelerator(main):
        return (f"main device {main!r}: inputs go there and offloaded modules execute there; the contract makes it "
                "the first accelerator that admits a plan (one that holds a unit plus the weights streamed through it)")
    if budgets.accelerators:
        return ("main device 'cpu': no accelerator admits a valid plan (each would need room for a unit plus the "
                "weights streamed through it), so the CPU runs the model")
    return ("main device 'cpu': max_memory offers no accelerator, so the CPU runs the model"
            + (", reading what is on disk into RAM at each forward" if layout.on("disk") else ""))


def _moved(plan, layout: _Layout, k: int, device) -> str:
    """What moving group ``k`` onto ``device`` would break or cost: a clause."""
    placed = layout.unit_map()
    if placed is None:
        return f"{_strategy(plan)} placed it on {layout.where[k]!r}"
    found = layout.found
    moved = dict(placed)
    for j in found.member_range(k):
        moved[found.units.name[found.array("members")[j]]] = device
    problem = plan.problem
    violations = broken_rules(problem, moved)
    if violations:
        return f"moving it there breaks a runtime rule ({violations[0].kind}: {violations[0].what})"
    broken = [v for v in contract_violations(problem, moved, exempt=plan.placement.exempt)
              if v.kind != "contract-floor"]
    if broken:
        if broken[0].kind == "contract-order":
            return ("it runs after units on a higher accelerator index, and the contract keeps accelerators in index "
                    "order along the model")
        return "moving it there would change the main device, which the contract fixes"
    seconds = priced(problem, moved).seconds
    if seconds >= plan.cost.seconds * (1 - 1e-9):
        text = (f"moving it there is estimated {format_ms(seconds)} per forward, no faster than this plan "
                f"({format_ms(plan.cost.seconds)})")
        if balances(plan.placement):
            text += "; balanced evens out the accelerators' peak / budget instead of filling them in order"
        return text
    why = ("accelerate's algorithm keeps room for the largest layer and never returns to a device it has left"
           if follows_accelerate(plan.placement) else f"{_strategy(plan)} did not find that plan")
    return f"moving it there is valid and estimated faster ({format_ms(seconds)} per forward): {why}"


def _room(plan, layout: _Layout, device, full: set) -> str:
    """Why ``device`` holds no more: a clause starting with ``"; "`` (empty when nothing is placed after it)."""
    parts = _room_parts(plan, layout, device, full)
    if parts is None:
        return ""
    is_full, clause = parts
    return f"; it is full: {clause}" if is_full else f"; {clause}"


def _room_parts(plan, layout: _Layout, device, full: set) -> tuple[bool, str] | None:
    """Why ``device`` holds no more: whether it is full, and the clause that says why; ``None`` when nothing is
    placed after it."""
    later = layout.after(device)
    limit = plan.problem.budgets.limit(device)
    if not later or limit is None:
        return None
    room = limit - plan.peak.get(device, 0)
    need = {k: layout.increment(k, device) for k in later}
    smallest = min(later, key=need.__getitem__)
    if need[smallest] > room:
        full.add(device)
        left = format_bytes(max(room, 0))
        if len(later) == 1:
            text = (f"the only unit placed after it, '{layout.name(smallest)}', needs "
                    f"{format_bytes(need[smallest])}, more than the {left} left")
        else:
            text = (f"the {left} left hold none of the {_units(len(later))} placed after it (the "
                    f"smallest, '{layout.name(smallest)}', needs {format_bytes(need[smallest])})")
        if device == layout.main and plan.streamed and need[smallest] <= room + plan.streamed:
            text += f"; it would fit without the {format_bytes(plan.streamed)} streaming reserve"
        return True, text
    first = next(k for k in later if need[k] <= room)
    then = f"'{layout.name(first)}' ({format_bytes(need[first])}, on {layout.where[first]!r})"
    if later[0] != first:
        return False, (f"of the {_units(len(later))} placed after it, the first in model order, "
                       f"'{layout.name(later[0])}' ({format_bytes(need[later[0]])}), does not fit the "
                       f"{format_bytes(room)} left; {then} would, but "
                       f"{_moved(plan, layout, first, device)}")
    return False, f"the {format_bytes(room)} left would hold {then}, but {_moved(plan, layout, first, device)}"


def _holding(plan, layout: _Layout, device, full: set) -> str:
    total = plan.problem.graph.total
    held, count = plan.resident(device), len(layout.on(device))
    text = f"{device!r} holds {format_bytes(held)} ({_share(held, total)}, {_units(count)})"
    whole = not layout.after(device) and held == total
    if whole:
        text += ": the whole model"
    if device in layout.offloaded:
        text += f", offloaded: executed on {layout.main!r}"
    elif device == layout.main:
        parts = plan.parts.get(device, {})
        experts = parts.get("experts", 0)
        extra = [("streaming reserve", plan.streamed),
                 ("prefetch of the allocator runtime", plan.prefetch),
                 ("experts the allocator runtime keeps resident", experts),
                 ("expert cache of the allocator runtime", parts.get("expert_cache", 0)),
                 ("fetch buffers of the allocator runtime", parts.get("fetch", 0)),
                 ("buffers of offloaded modules", parts.get("weights", 0) - (held - experts)),
                 ("for generate", sum(parts.get(k, 0) for k in ("cache", "logits", "activations")))]
        extra = [(what, n) for what, n in extra if n > 0]
        if extra:
            text += (f"; its peak {format_bytes(plan.peak[device])} is that plus "
                     + " + ".join(f"{format_bytes(n)} {what}" for what, n in extra))
    return text if whole else text + _room(plan, layout, device, full)


def _ranked_apart(plan, choice) -> str:
    """Where the plan's estimate is not the figure its candidates were ranked by (their maps priced alone, one forward
    at the profile's tokens): a clause giving the plan's and what it counts beyond, so one text never states two
    estimates of one plan unexplained."""
    ranked = next((t.get("seconds") for t in choice.facts.get("tried", ()) if t.get("name") ==
                   choice.facts.get("winner")), None)
    if ranked is None or abs(ranked - plan.cost.seconds) <= 5e-7 * max(ranked, plan.cost.seconds, 1e-9):
        return ""
    counted = [what for what, yes in (("the routed experts where they live", plan.placement.experts),
                                      (f"the {plan.priced_step} step of the generation budget",
                                       plan.problem.generation is not None),
                                      ("the units computed where their weights live", plan.hybrid is not None)) if yes]
    return (f" (candidates are ranked on their maps alone, one forward at the profile's tokens; this plan's estimate, "
            f"{format_ms(plan.cost.seconds)} {plan.priced_phrase()}, also counts "
            f"{' and '.join(counted) or 'the runtime'})")


def _said(plan, kind: str, device, used: set) -> str | None:
    """The sentence of the first decision of ``kind`` about ``device``, marked as said (by identity: left out of the
    list of decisions that follows the "why"); ``None`` where the strategy made none."""
    found = plan.placement.of_kind(kind, device)
    if not found:
        return None
    used.add(id(found[0]))
    return sentence(found[0])


def _empty(plan, layout: _Layout, device, full: set, used: set) -> tuple[str, str] | None:
    """Why ``device`` holds nothing: the sentence, and the reason after ``"holds nothing: "`` (``""`` where the
    sentence says why in another shape); ``None`` where there is nothing to say."""
    p = plan.problem
    main = layout.main
    accelerators = p.budgets.accelerators

    def because(clause: str) -> tuple[str, str]:
        return f"{device!r} holds nothing: {clause}", clause

    if device in accelerators and (main not in accelerators or accelerators.index(device) < accelerators.index(main)):
        said = _said(plan, "not-main", device, used)
        if said is not None:
            return because(said)
        if plan.placement.accelerates:
            full_at = plan.placement.of_kind("full", device)
            return because("accelerate's algorithm moved past it"
                           + (f" ({sentence(full_at[0])})" if full_at else ""))
        if "main" in plan.placement.exempt:
            return because(f"{_strategy(plan)} keeps the first accelerator free for generate()")
        if not p.deciding.contract:
            return because(f"under objective latency the estimate chose main device {main!r}, and anything on "
                           f"{device!r} would make it the main device")
        return because(why_empty(p, device))
    if device == "disk":
        return None
    if device == "cpu" and p.budgets.limit("cpu") is None:
        return because("max_memory gives no RAM budget, so offloaded units go to disk, as in accelerate") \
            if layout.on("disk") else None
    if not layout.after(device):
        return because("the model fits on the devices before it")
    parts = _room_parts(plan, layout, device, full)
    said = _said(plan, "empty", device, used)
    if parts is not None and parts[0]:   # full: the room is the reason
        clause = parts[1] + (f"; {said}" if said is not None else "")
        return because(clause)
    text = f"{device!r} holds nothing" + (f"; {parts[1]}" if parts is not None else "") \
        + (f"; {said}" if said is not None else "")
    return text, ""


def _offloaded(plan, layout: _Layout, full: set) -> str | None:
    offload = [d for d in plan.problem.budgets.order if d in layout.offloaded and layout.on(d)]
    if not offload:
        return None
    total = plan.problem.graph.total
    held = sum(plan.resident(d) for d in offload)
    count = sum(len(layout.on(d)) for d in offload)
    hosts = [d for d in plan.problem.budgets.order if d not in layout.offloaded and layout.on(d)
             and plan.problem.budgets.limit(d) is not None]
    room = {d: plan.problem.budgets.limit(d) - plan.peak.get(d, 0) for d in hosts}
    moved = [k for d in offload for k in layout.on(d)]
    fits = [k for k in moved if any(layout.increment(k, d) <= room[d] for d in hosts)]
    one = count == 1
    text = (f"{_units(count)} ({format_bytes(held)}, {_share(held, total)}) {'is' if one else 'are'} offloaded to "
            f"{' and '.join(map(repr, offload))}: {'it executes' if one else 'they execute'} on {layout.main!r}, "
            f"{'its' if one else 'their'} weights copied there at each forward "
            f"({format_bytes(plan.cost.streamed_bytes)} per forward)")
    if not hosts:
        return text
    left = ", ".join(f"{format_bytes(max(room[d], 0))} on {d!r}" for d in hosts)
    if not fits:
        return text + f"; the budgets bound: {'it does not fit' if one else 'none of them fits'} the room left ({left})"
    smallest = min(fits, key=lambda k: int(layout.size[k]))
    return (text + f"; by size alone {len(fits)} of them would fit the room left ({left}; the smallest, "
            f"'{layout.name(smallest)}', {format_bytes(int(layout.size[smallest]))}): the sentences above say why "
            "they stay offloaded" if full != set(hosts) else
            text + f"; {len(fits)} of them would fit the room left ({left}) by size alone")


def _reserve(plan) -> str | None:
    if not plan.streamed:
        return None
    chain = memory(plan.problem, plan.device_map).chain
    if not chain:
        who = ""
    elif len(chain) == 1:
        who = f", set by '{chain[0]}'"
    else:
        who = f", set by {', '.join(repr(c) for c in chain)} together (nested hooks are active at once)"
    ahead = ""
    if plan.prefetch:
        k = prefetch_of(plan.problem.runtime)
        ahead = (f"; and {format_bytes(plan.prefetch)} for the allocator runtime's prefetch (the {k} largest "
                 f"offloaded module{'s' if k > 1 else ''}, made ready while another runs)")
    return (f"streaming reserve on {plan.main_device!r}: {format_bytes(plan.streamed)}, kept free there for the "
            f"offloaded weights materialised at once{who}{ahead}")


def unbudgeted_ram(plan) -> str | None:
    """The sentence that says RAM's peak is checked against nothing, or ``None`` where RAM has a budget or holds
    nothing. Issue #46: RAM holds a peak (the CPU is the main device: the weights streamed from disk run there) but
    ``max_memory`` gives it no budget, so nothing checks that peak; as in accelerate, which counts no RAM for a
    ``max_memory`` without ``"cpu"`` (only ``max_memory=None`` reads this machine's)."""
    used = plan.peak.get("cpu", 0)
    if "cpu" in plan.problem.budgets.limits or not used:
        return None
    what = [name for name, part in (("weights and buffers", "weights"), ("weights streamed in", "reserve"),
                                     ("KV cache", "cache"), ("logits", "logits"), ("activations", "activations"))
            if plan.parts.get("cpu", {}).get(part)]
    role = " (the main device)" if plan.main_device == "cpu" else ""
    return (f"RAM is not budgeted: 'cpu'{role} holds {format_bytes(used)} at its peak ({', '.join(what) or 'weights'})"
            ", but max_memory has no 'cpu' entry, so that peak is checked against nothing (accelerate does not count "
            "it either); give max_memory a 'cpu' budget to check it, or leave max_memory out to plan against this "
            "machine's free RAM")


class Why(NamedTuple):
    """The "why" of a plan (:func:`reasons`): its sentences, the decisions they already say (by ``id``: left out of
    the list of decisions that follows them), and for each device that holds nothing, its sentence and the reason
    after ``"holds nothing: "`` (``""`` where the sentence says why in another shape)."""

    lines: list[str]
    said: set[int]
    empty: dict


def reasons(plan) -> Why:
    """The sentences of the "why" section of ``plan.explain()``, with the decisions they already say and why each
    empty device holds nothing (:class:`Why`)."""
    layout = _Layout(plan)
    used: set[int] = set()
    full: set = set()
    empty: dict = {}
    out = [_main_sentence(plan, layout)]
    budgets = plan.problem.budgets
    if not plan.problem.graph.total:
        out.append("the model has no weights to place")
    experts_on = {d for row in plan.placement.experts.values() for d in row}
    for device in budgets.order if plan.problem.graph.total else ():
        if device not in budgets.limits and not layout.on(device) and not plan.peak.get(device):
            continue
        if layout.on(device) and plan.resident(device):
            out.append(_holding(plan, layout, device, full))
        elif device in experts_on:
            out.append(f"{device!r} holds {format_bytes(plan.resident(device))} of experts modules (the routed "
                       "experts below)")
        else:
            said = _empty(plan, layout, device, full, used)
            if said:
                out.append(said[0])
                empty[device] = said
    out += [s for s in (_offloaded(plan, layout, full), _reserve(plan), unbudgeted_ram(plan),
                        experts_sentence(plan, used)) if s]
    out += compute_sentences(plan)   # where offloaded units compute, per phase
    out += expert_mode_sentences(plan)   # how each experts layer's offloaded experts run, per phase
    choice = plan.placement.of_kind("choice")
    if choice:
        out.append(sentence(choice[0]) + _ranked_apart(plan, choice[0]))
        used.add(id(choice[0]))
    return Why(out, used, empty)
