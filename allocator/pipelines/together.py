""":func:`plan_together`: several models that run one after another on one machine, placed together (issue #47).

Assisted generation runs a target model and a draft model in turns: the draft proposes ``k`` tokens, the target checks
them in one forward. Both stay loaded and both keep a KV cache for the whole generation, but only one runs at a time.
So on each device the memory is

    the weights and caches both keep there (what persists) + the largest of what each needs while it runs there
    (its activations, logits, streaming reserve, fetch buffers),

and planning each model alone (as two ``from_pretrained`` calls do) either starves the second of what the first took,
or over-commits where both count the whole budget. Here each model is planned by :func:`allocator.plan` (its own
verdict: every byte its runtime holds) over the room the ones before it keep, the joint peak is judged as above, and
both orders are tried: the joint plan kept is the valid one with the faster assisted step (an *estimate*: one decode
step of the target plus ``assistant_tokens`` of the draft), then more bytes on the fastest tier.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ..api import plan
from ..budgets import canonical, format_bytes, parse_budgets
from ..errors import InfeasiblePlacement, InvalidOption

__all__ = ["JointPlan", "kept_bytes", "plan_together", "running_bytes"]

log = logging.getLogger("allocator.pipelines")

PERSISTENT = ("weights", "experts", "expert_cache", "cache")
"""Parts of a model's peak (:data:`allocator.judge.verdict.PARTS`) held for as long as it is loaded and generating;
the others (streaming reserve, fetch buffers, logits, activations) only while it runs."""


@dataclass(frozen=True)
class JointPlan:
    """Where each of several models lives, placed together.

    Attributes
    ----------
    plans : dict
        Name -> its :class:`allocator.Plan` (``plans["model"].device_map`` is what its ``from_pretrained`` takes).
    peak : dict
        Bytes per device: what every model keeps there plus the largest of what one needs while it runs. Estimates
        of bytes, on the meta device.
    budgets : dict
        Bytes per device given.
    order : tuple of str
        The order the models were planned in (each over the room the ones before it keep).
    given : dict
        Name -> the budgets it was planned over.
    step_seconds : float or None
        Estimated seconds of one assisted step (one decode step of the target, ``assistant_tokens`` of the draft),
        with a generation budget and two models; ``None`` otherwise. An estimate.
    """

    plans: dict
    peak: dict
    budgets: dict
    order: tuple
    given: dict
    step_seconds: float | None = None

    @property
    def valid(self) -> bool:
        """Every model's plan valid and every device's joint peak within its budget."""
        return all(p.valid for p in self.plans.values()) and not self.over()

    def over(self) -> dict:
        """Devices whose joint peak is over budget: device -> bytes over."""
        return {d: self.peak[d] - limit for d, limit in self.budgets.items()
                if limit is not None and self.peak.get(d, 0) > limit}

    def resident_fast(self) -> int:
        """Bytes of all the models on the fastest tier."""
        return sum(p.cost.resident_fast for p in self.plans.values())

    def explain(self) -> str:
        """Each model's main device and bytes per device, the joint peak per device against its budget, and the
        assisted step's estimate."""
        lines = [f"{len(self.plans)} models placed together, planned in the order {list(self.order)} "
                 "(each over the room the ones before it keep)"]
        for name, p in self.plans.items():
            held = ", ".join(f"{d}: {format_bytes(p.resident(d))}" for d in p.problem.budgets.order
                             if p.resident(d))
            lines.append(f"  {name}: {p.problem.graph.model_class}, main device {p.main_device!r}; {held}")
        for d, limit in self.budgets.items():
            if self.peak.get(d):
                share = f" of {format_bytes(limit)} ({self.peak[d] / limit:.0%})" if limit else ""
                lines.append(f"  {d!s:>5}: joint peak {format_bytes(self.peak[d])}{share} (what every model keeps "
                             "there + the most one needs while it runs; an estimate)")
        if self.step_seconds is not None:
            lines.append(f"  estimated {self.step_seconds * 1e3:.3f} ms per assisted step")
        lines += [f"  over budget on {d!r} by {format_bytes(n)}" for d, n in self.over().items()]
        return "\n".join(lines)


def plan_together(models: Mapping, max_memory: Mapping, *, generation=None, assistant_tokens: int = 5,
                  **options) -> JointPlan:
    """Place several models that run one after another (a target and its draft model) over one machine's budgets.

    Parameters
    ----------
    models : dict
        Name -> model (meta device is fine), e.g. ``{"model": target, "assistant_model": draft}``; the first is the
        target. Never modified.
    max_memory : dict
        Budgets for all of them together, as accelerate accepts them.
    generation : GenerationBudget or dict, optional
        The generation budget (one for all, or name -> budget): each model's KV cache, logits and activations.
    assistant_tokens : int
        Tokens the draft proposes per assisted step (transformers' ``num_assistant_tokens``, 20 by default there; 5
        here prices a short speculation).
    **options
        :class:`allocator.PlanOptions` fields for every model (``runtime``, ``dtype``, ...).

    Returns
    -------
    JointPlan

    Raises
    ------
    InvalidOption
        Fewer than one model, or a generation budget named for a model not given.
    InfeasiblePlacement
        No order places every model (``strict=True``); without it, the best joint plan found comes back with
        ``valid`` False and what is over budget said.

    Examples
    --------
    >>> import torch.nn as nn
    >>> both = {"model": nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "assistant_model": nn.Linear(64, 64)}
    >>> joint = plan_together(both, {0: 30_000, "cpu": 100_000})
    >>> joint.valid, sorted(joint.plans), joint.peak[0] <= 30_000
    (True, ['assistant_model', 'model'], True)
    """
    if not models:
        raise InvalidOption("plan_together needs at least one model: {'model': target, 'assistant_model': draft}.")
    names = list(models)
    budgets = _limits(max_memory)
    generations = _generations(generation, names)
    strict = options.get("strict", False)
    unlimited = {k: v for k, v in max_memory.items() if budgets.get(canonical(k), 0) is None}
    found = [_joint(models, order, budgets, generations, assistant_tokens, options, unlimited)
             for order in _orders(names)]
    valid = [j for j in found if j is not None and j.valid]
    if valid:
        return min(valid, key=_rank)
    if strict or not any(j is not None for j in found):
        raise InfeasiblePlacement(f"no order of {names} places them together within {max_memory}: give more "
                                  "memory, a smaller draft, or let them stream (offload to 'cpu' or 'disk').")
    best = min((j for j in found if j is not None), key=lambda j: sum(j.over().values()))
    log.warning("no joint plan of %s keeps every budget: %s", names, best.over())
    return best


def _rank(joint: JointPlan) -> tuple:
    """Lower is better: the assisted step's estimate where there is one (a draft left to run on the CPU while the
    target fills the GPU makes every step slow, whatever the bytes), then more bytes on the fastest tier."""
    return (joint.step_seconds if joint.step_seconds is not None else 0.0, -joint.resident_fast())


def _limits(max_memory: Mapping) -> dict:
    """Bytes per canonical device (``None``: no limit, disk)."""
    budgets = parse_budgets(dict(max_memory))
    return {d: budgets.limit(d) for d in budgets.order}


def _generations(generation, names: list) -> dict:
    if isinstance(generation, Mapping):
        unknown = set(generation) - set(names)
        if unknown:
            raise InvalidOption(f"generation budgets for {sorted(unknown)}, which are not among the models {names}.")
        return {n: generation.get(n) for n in names}
    return {n: generation for n in names}


def _orders(names: list) -> list:
    """The orders tried: as given, and reversed (the draft first keeps it whole on the accelerator, the target first
    gives it the most room)."""
    return [tuple(names)] + ([tuple(reversed(names))] if len(names) > 1 else [])


def _joint(models, order, budgets: dict, generations: dict, assistant_tokens: int, options: dict, unlimited: dict):
    """The joint plan of ``order``, or ``None`` where a model finds no plan in what the earlier ones keep;
    ``unlimited`` holds the budgets without a limit (disk), passed on as the caller wrote them."""
    kept = {d: 0 for d in budgets}          # what the models planned so far keep on each device
    running = {d: 0 for d in budgets}       # the most one of them needs there while it runs
    plans, given = {}, {}
    for name in order:
        room = {d: (None if limit is None else max(limit - kept.get(d, 0), 0)) for d, limit in budgets.items()}
        p = None
        for _ in range(3):   # shrink where an earlier model's run needs more than this one leaves
            asked = {_key(d): v for d, v in room.items() if v is not None}
            asked.update({d: v for d, v in unlimited.items()})
            try:
                p = plan(models[name], asked, generation=generations[name], **options)
            except InfeasiblePlacement as err:
                log.debug("no plan of %s in %s: %s", name, room, err)
                return None
            over = {d: kept_bytes(p, d) + max(running.get(d, 0), running_bytes(p, d)) - room[d]
                    for d in budgets if room.get(d) is not None}
            over = {d: n for d, n in over.items() if n > 0}
            if not over:
                break
            room = {d: (v if d not in over else max(v - over[d], 0)) for d, v in room.items()}
        given[name] = room
        plans[name] = p
        for d in budgets:
            kept[d] = kept.get(d, 0) + kept_bytes(p, d)
            running[d] = max(running.get(d, 0), running_bytes(p, d))
    peak = {d: kept[d] + running[d] for d in budgets if kept[d] or running[d]}
    return JointPlan(plans={n: plans[n] for n in models}, peak=peak, budgets=budgets, order=tuple(order),
                     given=given, step_seconds=_step(plans, list(models), assistant_tokens))


def _key(device):
    """A budget key as :func:`allocator.plan` takes it."""
    return canonical(device)


def kept_bytes(p, device) -> int:
    """Bytes plan ``p`` keeps on ``device`` for as long as the model is loaded (:data:`PERSISTENT` parts)."""
    return sum(p.parts.get(device, {}).get(k, 0) for k in PERSISTENT)


def running_bytes(p, device) -> int:
    """Bytes plan ``p`` needs on ``device`` only while the model runs (the other parts of its verdict)."""
    return sum(v for k, v in p.parts.get(device, {}).items() if k not in PERSISTENT)


def _step(plans: dict, names: list, assistant_tokens: int) -> float | None:
    """One decode step of the target (it checks the proposed tokens in one forward) plus ``assistant_tokens`` decode
    steps of the draft: an estimate, with a generation budget and two models."""
    if len(names) != 2 or any("decode" not in plans[n].costs for n in names):
        return None
    target, draft = names
    return plans[target].costs["decode"].seconds + assistant_tokens * plans[draft].costs["decode"].seconds
