"""The smallest budgets that work: what an error says when no plan fits, and what an accelerator left empty would
need to be the main device (:func:`empty_before_main`, :func:`why_empty`). Each is a bisection over one budget, the
others unchanged."""

from __future__ import annotations

from dataclasses import replace

from ..budgets import Budgets, Device
from ..errors import InfeasiblePlacement
from ..evaluate.memory import main_device, streams_held, workspace
from ..evaluate.units import problem_groups
from ..evaluate.validate import format_bytes
from ..judge.verdict import is_valid, memory
from ..placement import Decision, Placement
from ..problem import Problem
from ..strategies import run
from ..search.bisection import boundary
from ..search.first_fit import full_reserve
from ..search.accelerate import insufficient_memory
from ..judge.witness import contract_main

__all__ = ["empty_before_main", "main_minimum", "minimum_budget_error", "minimum_ram_error", "smallest", "why_empty",
           "with_budget"]


def with_budget(problem: Problem, device, nbytes: int) -> Problem:
    """The problem with ``device``'s budget set to ``nbytes`` (a new problem: what is derived from it is made anew)."""
    limits = dict(problem.budgets.limits)
    limits[device] = nbytes
    named = set(problem.budgets.order) | {device}
    order = tuple(d for d in problem.budgets.order if d not in ("cpu", "disk")) + \
        tuple(d for d in ("cpu", "disk") if d in named or d == "disk")
    return replace(problem, budgets=Budgets(order=order, limits={d: limits[d] for d in order if d in limits}))


def _with_ram(problem: Problem, ram: int) -> Problem:
    return with_budget(problem, "cpu", ram)


def smallest(works, low: int, high: int) -> int:
    """The smallest budget in ``(low, high]`` for which ``works(budget)`` holds, to 1 % (bisection; ``works(high)``
    is known to hold, ``works(low)`` not): the one bisection (:func:`allocator.search.bisection.boundary`). Every
    minimum below is found by it."""
    return boundary(works, high, low, precision=100)


def _feasible(problem: Problem, strategy) -> bool:
    try:
        placement = run(strategy, problem)
    except InfeasiblePlacement:
        return False
    return is_valid(problem, placement.device_map)


def main_minimum(problem: Problem, device) -> int:
    """The smallest budget on accelerator ``device`` with which it admits a valid plan as the main device, to 1 %
    (:func:`smallest`, the bisection of the error messages).

    The accelerators before ``device`` are given no room while it is searched: with more room on ``device`` alone, an
    earlier accelerator may become the main device instead (it then streams nothing, the rest resident on
    ``device``), so the question asked of ``device`` is whether it admits a plan, not whether it wins over them.
    Bounded by the model's bytes: the whole model resident on ``device`` plus its largest streamed chain and, with a
    generation budget, all that generate needs on the main device is always enough."""
    g = problem.graph
    accelerators = problem.budgets.accelerators
    alone = problem
    for before in accelerators[:accelerators.index(device)]:
        alone = with_budget(alone, before, 0)
    low = problem.budgets.limit(device) or 0
    high = max(low + 1, g.total + full_reserve(problem) + workspace(g, main=True) + sum(g.extra.values()) + 1)

    def works(nbytes: int) -> bool:
        return contract_main(with_budget(alone, device, nbytes)) == device

    return smallest(works, low, high)


def minimum_budget_error(problem: Problem, strategy) -> InfeasiblePlacement:
    """The error for a budget no plan fits, with the smallest budget that works: RAM's (:func:`minimum_ram_error`),
    or the first accelerator's where ``max_memory`` gives no RAM (nothing can then be offloaded to it)."""
    if "cpu" in problem.budgets.order or not problem.budgets.accelerators:
        return minimum_ram_error(problem, strategy)
    device = problem.budgets.accelerators[0]
    low = problem.budgets.limit(device) or 0
    high = max(low + 1, problem.graph.total + full_reserve(problem) + 1)   # above the budget that failed
    g = problem.graph
    if not _feasible(with_budget(problem, device, high), strategy):
        return InfeasiblePlacement(
            f"no placement of {g.model_class} fits the budgets {dict(problem.budgets.limits)}, even with "
            f"{format_bytes(high)} on accelerator {device!r}; give max_memory a 'cpu' budget or try strategy='auto'.")
    high = smallest(lambda nbytes: _feasible(with_budget(problem, device, nbytes), strategy), low, high)
    return InfeasiblePlacement(
        f"no placement of {g.model_class} fits the budgets {dict(problem.budgets.limits)}: max_memory has no 'cpu' "
        f"budget, so nothing can be offloaded to RAM; the smallest budget found to work on accelerator {device!r} "
        f"with the others unchanged is {format_bytes(high)} ({high} B); raise max_memory[{device!r}] to at least that, "
        "or give RAM a budget.",
        device=device, minimum=high,
    )

def minimum_ram_error(problem: Problem, strategy) -> InfeasiblePlacement:
    """The error for a budget no plan fits, with the smallest RAM budget (other budgets unchanged) that works.

    Found by bisection between the given RAM and a budget that certainly works (the peak of streaming
    everything from disk, or the whole model in RAM), to 1 %; the strategy is run at each step, so the
    stated minimum is one the strategy really plans for while 1 % less fails. Where feasibility is not monotone in
    the budget (``sequential``, and so ``auto``, can fail at a budget between two that work), the search goes on
    below any budget found to work 1 % under the answer, so the answer is a local minimum: it works, 1 % less does
    not, though a much smaller budget may work again.
    """
    g = problem.graph
    low = problem.budgets.limit("cpu") or 0
    relaxed = _with_ram(problem, 2**62)
    candidates = [memory(relaxed, {"": "disk"}).peak.get("cpu", 0), memory(relaxed, {"": "cpu"}).peak["cpu"]]
    # above the budget that failed: a strategy whose feasibility is not monotone (auto, ilp) may plan at a smaller
    # one, but the advice is a budget that works from the one given
    high, ceiling = max(min(candidates), low + 1), max(4 * max(candidates), 2 * low) + 1
    while not _feasible(_with_ram(problem, high), strategy):
        low, high = high, 2 * high + 1
        if high > ceiling:
            return InfeasiblePlacement(
                f"no placement of {g.model_class} fits the budgets {dict(problem.budgets.limits)}, and strategy "
                f"{strategy!r} finds none even with {format_bytes(ceiling)} of RAM; try strategy='auto'.")
    generation = ", and what generate needs on the devices that run the model" if problem.generation else ""
    floor = low  # the caller's budget, or the last one the doubling found failing
    for _ in range(16):
        high = smallest(lambda ram: _feasible(_with_ram(problem, ram), strategy), low, high)
        # Feasibility need not be monotone in the budget (accelerate's algorithm, inside "auto", is not): search on
        # below a budget that works 1 % under the one found, so that the stated minimum really has 1 % less failing.
        below = high - max(1, high // 100)
        if below <= floor or not _feasible(_with_ram(problem, below), strategy):
            break
        high, low = below, floor
    return InfeasiblePlacement(
        f"no placement of {g.model_class} fits the budgets {dict(problem.budgets.limits)}: the smallest RAM budget "
        f"found to work with the other budgets unchanged is {format_bytes(high)} ({high} B) on 'cpu' (buffers of "
        f"offloaded modules plus the weights streamed at once{generation} must fit there); raise max_memory['cpu'] to "
        "at least that"
        f"{', or give accelerators more room' if problem.budgets.accelerators else ''}.",
        device="cpu", minimum=high,
    )


def why_empty(problem: Problem, device: Device) -> str:
    """A sentence saying why an accelerator before the contract's main device holds nothing."""
    b = problem.budgets
    limit = b.limit(device) or 0
    if limit == 0:
        return f"accelerator {device!r} has a budget of 0"
    need = streams_held(problem.runtime, full_reserve(problem))
    smallest = min((s for s in problem_groups(problem).size if s), default=0)
    g = problem.graph
    generate = g.workspace + g.main_workspace
    return (f"accelerator {device!r} ({format_bytes(limit)}) admits no valid plan as the main device: it would hold "
            f"at least one unit (the smallest is {format_bytes(smallest)}) plus the weights streamed through it at "
            f"once (up to {format_bytes(need)}) and the buffers of offloaded modules"
            + (f", and what generate needs on the main device ({format_bytes(generate)} of activations and "
               "next-token scores, plus the KV cache of the layers it runs)" if generate else ""))


def empty_before_main(problem: Problem, placement: Placement) -> Placement:
    """Under the contract, say why accelerators before the main device hold nothing: a ``"not-main"``
    :class:`~allocator.placement.Decision` each, with the budget that would make it the main device
    (:func:`main_minimum`), and accelerate's "insufficient memory" log line. A placement exempt from rule 1 is
    returned as it is."""
    if not problem.deciding.contract or "main" in placement.exempt:
        return placement
    main = main_device(placement.device_map.values())
    accelerators = problem.budgets.accelerators
    empty = accelerators[:accelerators.index(main)] if main in accelerators else accelerators
    if not empty:
        return placement
    minimum = {d: main_minimum(problem, d) for d in empty}
    said = tuple(Decision("not-main",
                          f"{why_empty(problem, d)}; it needs at least {format_bytes(minimum[d])} to admit one",
                          devices=(d,), bytes=minimum[d], bound="main") for d in empty)
    return replace(placement, decisions=placement.decisions + said,
                   diagnostics=placement.diagnostics + (("info", insufficient_memory(minimum)),))
