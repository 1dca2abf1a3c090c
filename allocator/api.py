"""The composition: :func:`plan` builds the problem once, runs a strategy, then checks, explains and prices its
placement once (:func:`allocator.report.plan.finish`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

from .errors import AllocatorError, BrokenContract, InfeasiblePlacement, InvalidPlacement, warn_caller
from .evaluate.cost import priced
from .evaluate.memory import main_device, prefetch_of
from .judge.verdict import is_valid, verdict
from .gc_pause import gc_paused
from .placement import Decision, Placement
from .problem import PlanOptions, Problem, build_problem
from .report.decisions import sentence
from .report.minimum import empty_before_main, minimum_budget_error
from .report.plan import Plan, finish
from .strategies import BUILT_IN, resolve, run
from .judge.contract import contract_violations
from .strategies.experts import place_experts
from .strategies.grow import grow
from .strategies.split import split
from .judge.witness import witness

__all__ = ["plan", "planned"]

log = logging.getLogger("allocator")


def plan(model, max_memory: Mapping | None = None, *, strategy="auto", options: PlanOptions | None = None,
         **keywords) -> Plan:
    """Decide where every part of ``model`` lives.

    Parameters
    ----------
    model : torch.nn.Module
        Any module, on the meta device or not. Never modified.
    max_memory : dict, optional
        Budgets as accelerate accepts them (``{0: "10GiB", "cpu": "30GiB"}``); this machine's memory if omitted.
        Never modified.
    strategy : str or callable
        A name in :data:`allocator.STRATEGIES`, ``"auto"``, or ``place(problem) -> Placement``
        (:mod:`allocator.strategies.kit` has what a strategy is built from).
    options : PlanOptions, optional
        How the model is read (``no_split_module_classes``, ``dtype``, ``special_dtypes``, ``tied_parameters``,
        ``hf_quantizer``, ``size_fn``, ``infer_no_split``), how the plan will run (``loader``, ``runtime``,
        ``prefetch``, ``offload_buffers``, ``clean_result``, ``fallback_allocation``, ``profile``, ``generation``) and
        what decides (``objective``, ``strict``); each field is documented on :class:`PlanOptions`.
    **keywords
        Fields of :class:`PlanOptions`, one by one (they override those of ``options``):
        ``plan(model, budgets, offload_buffers=True)``.

    Returns
    -------
    Plan

    Raises
    ------
    InvalidBudget, InvalidOption, InvalidModel, UnsupportedByAccelerate
    InfeasiblePlacement
        With ``strict=True`` (or ``strategy="sequential"`` where accelerate fails) when no valid plan exists: the
        message and ``minimum`` give the smallest budget that works.
    InvalidPlacement
        A strategy other than ``sequential`` (the caller's, or a bug in a built-in one) returned a map that breaks a
        runtime rule.
    BrokenContract
        Such a strategy returned a valid map that breaks the contract of ``device_map="auto"``.

    Notes
    -----
    The whole composition: the model is read once into a frozen :class:`Problem` (the strategy never touches it),
    the strategy returns a placement, which is checked here against the runtime rules and the contract, then priced.
    ``sequential`` reproduces accelerate, so its maps are returned as they are, with their violations. accelerate's
    warnings and log lines (buffers of offloaded modules that fit no accelerator, devices left empty for want of
    memory) are emitted for the plan returned, with accelerate's wording.

    Examples
    --------
    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16.25 KiB per layer
    >>> p = plan(model, {0: 40_000, "cpu": 100_000}, strategy="sequential")
    >>> p.device_map
    {'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
    >>> p.valid
    True
    """
    options = PlanOptions.of(options, **keywords)
    resolve(strategy)   # an unknown strategy is refused before the model is read
    with gc_paused():  # planning makes many acyclic objects; each collection would walk the model and graph too
        problem = build_problem(model, max_memory, options=options)   # 1. the model, read once
        return planned(problem, strategy)                             # 2.-5.


def planned(problem: Problem, strategy="auto") -> Plan:
    """Steps 2-5 of :func:`plan` on a problem built already: the plan of ``strategy`` for it.

    Parameters
    ----------
    problem : Problem
        From :func:`allocator.problem.build_problem` (the model read once).
    strategy : str or callable
        As in :func:`plan`.

    Returns
    -------
    Plan

    Raises
    ------
    InfeasiblePlacement, InvalidPlacement, BrokenContract
        As :func:`plan`.

    Notes
    -----
    A second strategy planned on the same problem reads the model no more and shares what the problem derived (the
    witness, the fills): the integrations plan ``balanced``, then the contract's plan where ``balanced`` offloads, on
    the problem of one load. ``plan(model, budgets, strategy=s)`` is ``planned(build_problem(model, budgets), s)``.
    """
    name, place = resolve(strategy)
    builtin = place in BUILT_IN   # a strategy registered later is cleaned and judged like a callable
    with gc_paused():
        problem, placement = _prefetched(problem, lambda at: _placement(at, strategy, builtin))   # 2.-4.
        result = finish(problem, placement, asked=name)              # 5. checked, priced once
    for v in result.violations:  # only accelerate's algorithm returns these; Plan.violations carries them
        log.info("plan by %s breaks a runtime rule: %s", result.strategy, v)
    _report(result.placement)
    return result


def _placement(problem: Problem, strategy, builtin: bool) -> Placement:
    """Steps 2-4 of :func:`plan` for one problem: the witness, the strategy's placement (or accelerate's), the rules
    and the contract checked, and why accelerators before the main device hold nothing."""
    witness(problem)             # 2. accelerate's map, the contract's main device and floor: each made once
    placement = _placed(problem, strategy, builtin)              # 3. the strategy's placement, or accelerate's
    placement = place_experts(problem, placement)                # 3b. routed experts as units (our runtime only)
    placement = grow(problem, placement)                         # 3c. room our runtime's decisions leave, used
    placement = split(problem, placement)                        # 3d. layers split where decoding is faster
    _check_rules_and_contract(problem, placement)                # 4. the runtime rules and the contract, once
    return empty_before_main(problem, placement)


def _prefetched(problem: Problem, place) -> tuple[Problem, Placement]:
    """Under our runtime (``runtime="allocator"``) the prefetch depth is part of the plan: the plan without prefetch
    is always made, and the deepest depth up to :data:`allocator.evaluate.memory.PLANNED_PREFETCH` whose plan keeps
    as many bytes on the fastest tier and streams no more than it is kept; 0 on a CPU main device unless a measured
    profile is given (prefetch there competes with the forward for the same cores and memory bandwidth). Asking for
    our runtime never gives a worse placement than not asking. A depth the caller gives (``prefetch=k``) is planned
    as given; under accelerate's hooks, one plan."""
    asked = prefetch_of(problem.runtime)
    if not asked or problem.runtime.prefetch is not None:   # accelerate's hooks, or the depth the caller chose
        return problem, place(problem)
    at = {depth: problem.with_options(prefetch=depth) for depth in range(asked + 1)}
    plain = place(at[0])
    base = priced(at[0], plain.device_map)
    if main_device(plain.device_map.values()) == "cpu" and not problem.cost.measured:
        return at[0], _said(plain, "cpu-main", 0, asked)
    for depth in range(asked, 0, -1):
        try:
            deeper = place(at[depth])
        except AllocatorError as err:   # no plan at this depth: a shallower one is tried, and said
            log.debug("no plan with prefetch %d: %s", depth, err)
            continue
        cost = priced(at[depth], deeper.device_map)
        if (cost.resident_fast, -cost.streamed_bytes) >= (base.resident_fast, -base.streamed_bytes) \
                and is_valid(at[depth], deeper.device_map):
            return at[depth], _said(deeper, "deepest", depth, asked)
    return at[0], _said(plain, "no-deeper", 0, asked)


def _said(placement: Placement, reason: str, depth: int, asked: int) -> Placement:
    """``placement`` with the ``"runtime"`` decision of its prefetch depth (``reason``: why that depth)."""
    said = Decision("runtime", bound="budget", facts={"reason": reason, "prefetch": depth, "asked": asked})
    return replace(placement, decisions=placement.decisions + (said,))


def _placed(problem: Problem, strategy, builtin: bool) -> Placement:
    """The strategy's placement — a caller's cleaned as the options say, and exempt from nothing (a caller lifts the
    contract with ``objective="latency"``) — or, where the strategy finds none, accelerate's own map, flagged
    (unless ``strict``)."""
    try:
        placement = run(strategy, problem)
    except InfeasiblePlacement as err:
        error = err if err.minimum is not None else minimum_budget_error(problem, strategy)
        placement = None if problem.deciding.strict else _accelerate_instead(problem, resolve(strategy)[0], error)
        if placement is None:
            raise error from None
        return placement
    if builtin:   # the built-in strategies return their maps cleaned already (the invariant tests check it)
        return placement
    return replace(placement, device_map=problem.cleaned(placement.device_map), exempt=frozenset())


def _check_rules_and_contract(problem: Problem, placement: Placement) -> None:
    """Raise a typed error naming what ``placement`` breaks: a runtime rule (:class:`InvalidPlacement`) or the contract
    (:class:`BrokenContract`). accelerate's own map is returned as it is (its violations flagged in the plan). A map
    short of the contract's floor is logged, not refused: rules 1 and 2 come first, and the strategies fall short of
    the floor only where they must."""
    if placement.accelerates:
        return
    violations = list(verdict(problem, placement).violations)   # the one verdict: every byte the runtime holds
    if violations:
        raise InvalidPlacement(
            f"strategy {placement.strategy!r} returned a map that breaks the runtime rules: "
            f"{'; '.join(map(str, violations[:3]))}{' ...' if len(violations) > 3 else ''} "
            "A strategy must return a valid map or raise InfeasiblePlacement; allocator.validate and "
            "allocator.strategies.kit.check say what is wrong with a map.", violations=violations)
    broken = contract_violations(problem, placement.device_map, exempt=placement.exempt)
    for v in broken:
        if v.kind == "contract-floor":
            log.warning("plan by %s: %s", placement.strategy, v.message)
    broken = [v for v in broken if v.kind != "contract-floor"]
    if broken:
        raise BrokenContract(
            f"strategy {placement.strategy!r} returned a plan that breaks the contract of device_map='auto': "
            f"{'; '.join(map(str, broken))} Pass objective='latency' to accept such plans.")


def _accelerate_instead(problem: Problem, name: str, error: InfeasiblePlacement) -> Placement | None:
    """Where no valid plan exists, accelerate's own map (the witness's ``sequential`` placement), flagged, as
    accelerate and transformers would load it: ``from_pretrained(device_map="auto")`` keeps working where it did.
    ``None`` where accelerate has no map either, or the caller asked for ``sequential`` itself."""
    theirs = witness(problem).accelerate
    if name == "sequential" or theirs is None:
        return None
    fallback = Decision("fallback", bound="budget", facts={"reason": "infeasible", "strategy": name,
                                                            "error": str(error)})
    return replace(theirs, strategy=f"sequential (no valid {name} plan)", decisions=(fallback,) + theirs.decisions,
                   diagnostics=theirs.diagnostics + (("warning", sentence(fallback)),))


def _report(placement: Placement) -> None:
    """accelerate's warnings and log lines for the plan returned (the strategy's diagnostics)."""
    for level, message in placement.diagnostics:
        if level == "warning":
            warn_caller(message)
        else:
            log.info("%s", message)
