"""The public entry points: ``plan`` and an ``infer_auto_device_map`` with accelerate's signature.

The whole composition: build the problem once -> run a strategy -> check the result -> a device map.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .budgets import Budgets, ByDevice, Device, canonical
from .cost import Cost
from .errors import AllocatorError, BrokenContract, InfeasiblePlacement, InvalidPlacement
from .explain import reasons
from .gc_pause import gc_paused
from .logs import shown
from .placement import Placement, clean_device_map
from .problem import PlanOptions, Problem, build_problem, step_problem
from .strategies import STRATEGIES, resolve, run
from .strategies.ranking import priced
from .runs import columns
from .runtime import main_device, map_runs, workspace
from .strategies.first_fit import full_reserve
from .strategies.contract import contract_main, contract_violations, fast_bytes, floor, why_empty
from .strategies.sequential import insufficient_memory
from .validate import Violation, check, format_bytes, peak_parts

__all__ = ["Plan", "plan", "infer_auto_device_map"]

log = logging.getLogger("allocator")


@dataclass(frozen=True, slots=True)
class Plan:
    """A placement with what it costs at runtime.

    Attributes
    ----------
    device_map : dict
        Accepted as ``device_map=`` by ``from_pretrained``, ``dispatch_model`` and ``load_checkpoint_and_dispatch``.
    peak : dict
        Bytes per device at the peak of a forward (main device: resident + offloaded buffers + streamed chain), and
        with a generation budget at the peak of ``generate`` (plus KV cache, logits and activations). Keyed by the
        canonical devices of the map (``0``, ``"cpu"``) and answering to the caller's spelling (``peak["cuda:0"]``,
        :class:`allocator.budgets.ByDevice`); so do ``parts`` and :meth:`resident`.
    strategy : str
        The strategy that produced it.
    main_device : int or str
        Where offloaded modules execute.
    streamed : int
        Bytes kept free on the main device for offloaded weights streamed at once.
    parts : dict
        Per device, what its peak is made of: ``weights`` (with buffers and the streaming reserve), and with a
        generation budget ``cache``, ``logits`` and ``activations``; the parts sum to ``peak``.
    violations : tuple of Violation
        Broken runtime rules (only ``sequential`` may return a map with violations: it reproduces accelerate).
    cost : Cost
        The cost model's estimate per forward (seconds, streamed bytes, device changes).
    prefetch : int
        Bytes kept free on the main device, beyond ``streamed``, for the offloaded modules the allocator runtime makes
        ready ahead (``runtime="allocator"``, :mod:`allocator.offload`); 0 under accelerate's hooks.
    """

    device_map: dict
    peak: dict
    strategy: str
    main_device: Device
    streamed: int
    violations: tuple[Violation, ...]
    problem: Problem
    placement: Placement
    cost: Cost
    parts: dict = field(default_factory=dict)
    prefetch: int = 0

    @property
    def optimal(self) -> bool | None:
        """Whether the strategy proved no valid plan is estimated faster (``ilp``); ``None`` when unknown."""
        return self.placement.optimal

    @property
    def valid(self) -> bool:
        return not self.violations

    @property
    def costs(self) -> dict:
        """The estimate of each forward that was counted (``"prefill"``, and with a generation budget ``"decode"``:
        one decoding step), as :class:`Cost`; ``{"prefill": cost}`` when nothing was counted. :attr:`cost` is the
        one ``options.optimize`` names."""
        steps = self.problem.steps or {"prefill": None}
        return {step: self.cost if step == self.problem.options.optimize else
                priced(step_problem(self.problem, step), self.device_map) for step in steps}

    @property
    def inputs(self) -> dict | None:
        """The shapes of the forward the cost model counted (``PlanOptions.inputs``, or the config's defaults), or
        ``None`` where nothing was counted."""
        counted = self.problem.flops
        return None if counted is None else dict(counted.inputs)

    def compute_term(self) -> str:
        """One line: whether the estimate's compute term is counted (FLOPs, ops and activations at the inputs) or
        estimated (``2 * params * tokens``), and why."""
        counted = self.problem.flops
        tokens = self.problem.profile.tokens
        if counted is None:
            return (f"compute term estimated: 2 x params x {tokens} tokens (no inputs; pass inputs={{'input_ids': "
                    f"(1, 512)}} or inputs='default' to count FLOPs on the meta device)")
        shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in counted.inputs.items())
        source = "the config's defaults" if counted.defaults else "the inputs given"
        if self.problem.options.optimize == "decode":
            source = f"one decoding step of {source}, the whole KV cache read"
        if self.problem.node_flops is None:
            return (f"compute term estimated: 2 x params x {tokens} tokens; the count at {shapes} ({source}) is "
                    f"incomplete: {counted.reason()}")
        return (f"compute term counted at {shapes} ({source}): {counted.total / 1e9:.3g} GFLOP, "
                f"{sum(counted.ops.values())} ops, activations at each device change")

    def per_step(self) -> str:
        """``"per step: prefill 1.234 ms, decode 0.123 ms"``: the estimate of each counted forward (:attr:`costs`)."""
        return "per step: " + ", ".join(f"{step} {cost.seconds * 1e3:.3f} ms" for step, cost in self.costs.items())

    def resident(self, device: Device) -> int:
        """Counted bytes of the model that live on ``device`` (not counting the streaming reserve)."""
        counted = columns(self.problem.graph).sum_counted
        device = canonical(device)   # the caller's spelling: "cuda:0" is 0
        return sum(counted[r.end] - counted[r.start] for r in map_runs(self.problem.graph, self.device_map)
                   if r.device == device)

    def __repr__(self) -> str:
        """One line: strategy, main device, estimate, resident and peak bytes per device (the rest: ``explain()``)."""
        budgets = self.problem.budgets
        devices = "; ".join(
            f"{d}: resident {format_bytes(self.resident(d))}, peak {format_bytes(self.peak[d])}"
            + (f" of {format_bytes(budgets.limit(d))}" if budgets.limit(d) is not None else "")
            for d in budgets.order if d in self.peak)
        state = "valid" if self.valid else f"{len(self.violations)} violation(s)"
        return (f"<Plan {self.strategy} for {self.problem.graph.model_class}: main device {self.main_device!r}, "
                f"estimated {self.cost.seconds * 1e3:.3f} ms per forward, {state}; {devices}>")

    def explain(self) -> str:
        """The plan as text: per-device bytes against budgets, which objective decided, then why — the main device,
        what each device holds and why not more (or why nothing), why units are offloaded, the streaming reserve and
        the offloaded modules that set it, which candidate won and by what margin — then the strategy's decisions
        (at most 200)."""
        g, budgets = self.problem.graph, self.problem.budgets
        lines = [f"strategy {self.strategy} for {g.model_class} ({format_bytes(g.total)}); main device "
                 f"{self.main_device!r}",
                 f"  estimated {self.cost.seconds * 1e3:.3f} ms per forward, {format_bytes(self.cost.streamed_bytes)} "
                 f"streamed per forward, {self.cost.device_changes} device changes"
                 + ("" if self.optimal is None else (", proven optimal" if self.optimal else ", not proven optimal")),
                 f"  {self.compute_term()}"]
        if len(self.problem.steps) > 1:
            lines.append(f"  {self.per_step()}; objectives price the {self.problem.options.optimize}")
        for device in budgets.order:
            if device not in self.peak:
                continue
            limit = budgets.limit(device)
            share = f" of {format_bytes(limit)} ({self.peak[device] / limit:.0%})" if limit else ""
            lines.append(f"  {device!s:>5}: resident {format_bytes(self.resident(device))}, peak "
                         f"{format_bytes(self.peak[device])}{share}")
            parts = self.parts.get(device, {})
            if any(parts.get(k) for k in ("cache", "logits", "activations")):
                lines.append("         = " + " + ".join(f"{k} {format_bytes(parts[k])}" for k in
                                                        ("weights", "cache", "logits", "activations")))
        lines.append(f"  {self._objective()}")
        if self.problem.generation is not None:
            lines.append(f"  {self.problem.generation.summary()}")
        lines += [f"  violation {v}" for v in self.violations]
        why, said = reasons(self)
        lines.append("why:")
        lines += [f"  - {sentence}" for sentence in why]
        notes = [note for note in self.placement.notes if note not in said]
        if notes:
            lines.append(f"decisions of {self.strategy.split(':')[-1]}:")
        lines += [f"  - {note}" for note in notes[:200]]
        if len(notes) > 200:
            lines.append(f"  ... {len(notes) - 200} more decisions")
        return "\n".join(lines)


    def _objective(self) -> str:
        """Which objective decided: under ``"contract"`` its main device and floor (accelerate's bytes on the fastest
        tier, and this plan's); under ``"latency"`` what the contract would have chosen instead."""
        problem = self.problem
        if problem.options.contract:
            need = floor(problem)
            have = fast_bytes(problem, map_runs(problem.graph, self.device_map))
            return ("objective contract: main device the first accelerator that admits a plan "
                    f"({contract_main(problem)!r}), accelerators in index order, at least accelerate's bytes on "
                    f"them ({format_bytes(need)}, this plan {format_bytes(have)}); the cost model ranks the plans that "
                    "keep it")
        line = "objective latency: the cost model's estimate alone decided"
        name = self.strategy.split(":")[0]
        if name not in STRATEGIES:
            return line
        options = replace(self.problem.options, objective="contract")
        try:
            other = _finish(replace(self.problem, options=options), run(name, replace(self.problem, options=options)))
        except AllocatorError:
            return line + "; no plan keeps the contract"
        if other.main_device == self.main_device:
            return line + f"; the contract gives the same main device ({self.main_device!r})"
        gain = other.cost.seconds / self.cost.seconds - 1 if self.cost.seconds else 0.0
        return (line + f"; the contract would make main device {other.main_device!r} "
                f"(estimated {other.cost.seconds * 1e3:.3f} ms per forward, {gain:+.0%} against this plan)")


def _finish(problem: Problem, placement: Placement) -> Plan:
    violations, memory = check(problem, placement.device_map)
    parts = peak_parts(problem, placement.device_map, memory)
    return Plan(
        device_map=dict(placement.device_map), peak=ByDevice(memory.peak), strategy=placement.strategy,
        main_device=memory.main, streamed=memory.streamed, violations=tuple(violations), problem=problem,
        placement=placement, cost=priced(problem, placement.device_map), parts=ByDevice(parts),
        prefetch=memory.prefetch,
    )


def _with_budget(problem: Problem, device, nbytes: int) -> Problem:
    """The problem with ``device``'s budget set to ``nbytes`` (a new problem: what is derived from it is made anew)."""
    limits = dict(problem.budgets.limits)
    limits[device] = nbytes
    named = set(problem.budgets.order) | {device}
    order = tuple(d for d in problem.budgets.order if d not in ("cpu", "disk")) + \
        tuple(d for d in ("cpu", "disk") if d in named or d == "disk")
    return replace(problem, budgets=Budgets(order=order, limits={d: limits[d] for d in order if d in limits}))


def _with_ram(problem: Problem, ram: int) -> Problem:
    return _with_budget(problem, "cpu", ram)


def _feasible(problem: Problem, strategy) -> bool:
    try:
        placement = run(strategy, problem)
    except InfeasiblePlacement:
        return False
    return not check(problem, placement.device_map)[0]


def main_minimum(problem: Problem, device) -> int:
    """The smallest budget on accelerator ``device`` (others unchanged) with which the contract makes it the main
    device, to 1 % (bisection; the model's size plus its largest streamed chain and, with a generation budget, all
    that generate needs on the main device suffice: the upper end is doubled until it works)."""
    g = problem.graph
    low = problem.budgets.limit(device) or 0
    high = max(low + 1, g.total + full_reserve(problem) + workspace(g, main=True) + sum(g.extra.values()) + 1)
    for _ in range(8):
        if contract_main(_with_budget(problem, device, high)) == device:
            break
        low, high = high, 2 * high
    while high - low > max(1, high // 100):
        middle = (low + high) // 2
        if contract_main(_with_budget(problem, device, middle)) == device:
            high = middle
        else:
            low = middle
    return high


def minimum_budget_error(problem: Problem, strategy) -> InfeasiblePlacement:
    """The error for a budget no plan fits, with the smallest budget that works: RAM's (:func:`minimum_ram_error`),
    or the first accelerator's where ``max_memory`` gives no RAM (nothing can then be offloaded to it)."""
    if "cpu" in problem.budgets.order or not problem.budgets.accelerators:
        return minimum_ram_error(problem, strategy)
    device = problem.budgets.accelerators[0]
    low, high = problem.budgets.limit(device) or 0, problem.graph.total + full_reserve(problem) + 1
    g = problem.graph
    if not _feasible(_with_budget(problem, device, high), strategy):
        return InfeasiblePlacement(
            f"no placement of {g.model_class} fits the budgets {dict(problem.budgets.limits)}, even with "
            f"{format_bytes(high)} on accelerator {device!r}; give max_memory a 'cpu' budget or try strategy='auto'.")
    while high - low > max(1, high // 100):
        middle = (low + high) // 2
        if _feasible(_with_budget(problem, device, middle), strategy):
            high = middle
        else:
            low = middle
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
    candidates = [check(relaxed, {"": "disk"})[1].peak.get("cpu", 0), check(relaxed, {"": "cpu"})[1].peak["cpu"]]
    high, ceiling = min(candidates), 4 * max(candidates) + 1
    while not _feasible(_with_ram(problem, high), strategy):
        low, high = high, 2 * high + 1
        if high > ceiling:
            return InfeasiblePlacement(
                f"no placement of {g.model_class} fits the budgets {dict(problem.budgets.limits)}, and strategy "
                f"{strategy!r} finds none even with {format_bytes(ceiling)} of RAM; try strategy='auto'.")
    generation = ", and what generate needs on the devices that run the model" if problem.generation else ""
    floor = low  # the caller's budget, or the last one the doubling found failing
    for _ in range(16):
        while high - low > max(1, high // 100):
            middle = (low + high) // 2
            if _feasible(_with_ram(problem, middle), strategy):
                high = middle
            else:
                low = middle
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
        (:mod:`allocator.kit` has what a strategy is built from).
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
    resolve(strategy)
    with gc_paused():  # planning makes many acyclic objects; each collection would walk the model and graph too
        problem = build_problem(model, max_memory, options=options)
        placement, accelerates = _placed(problem, strategy)
        placement = _cleaned(problem, strategy, placement)
        if not accelerates:
            _check_rules_and_contract(problem, placement, _builtin_name(strategy))
        result = _finish(problem, _with_empty_notes(problem, placement))
    for v in result.violations:  # only accelerate's algorithm returns these; Plan.violations carries them
        log.info("plan by %s breaks a runtime rule: %s", result.strategy, v)
    _report(result.placement)
    return result


def _placed(problem: Problem, strategy) -> tuple[Placement, bool]:
    """The strategy's placement and whether it is accelerate's (``sequential``, whose maps are accelerate's,
    violations included); where the strategy finds none, accelerate's own map, flagged (unless ``strict``)."""
    try:
        return run(strategy, problem), resolve(strategy)[1] is STRATEGIES["sequential"]
    except InfeasiblePlacement as err:
        error = err if err.minimum is not None else minimum_budget_error(problem, strategy)
        placement = None if problem.options.strict else _accelerate_instead(problem, strategy, error)
        if placement is None:
            raise error from None
        return placement, True


def _cleaned(problem: Problem, strategy, placement: Placement) -> Placement:
    """A caller's strategy's map cleaned as the options say (``clean_result``: entries whose children share a device
    merged). The built-in strategies return their maps cleaned already (the invariant tests check it), so they are
    not walked again."""
    if not problem.options.clean_result or _builtin_name(strategy):
        return placement
    return replace(placement, device_map=clean_device_map(placement.device_map))


def _builtin_name(strategy) -> str:
    """The name of a built-in strategy (the contract exempts ``balanced_low_0`` from rule 1); ``""`` for a caller's."""
    name, fn = resolve(strategy)
    return name if STRATEGIES.get(name) is fn else ""


def _check_rules_and_contract(problem: Problem, placement: Placement, name: str) -> None:
    """Raise a typed error naming what ``placement`` breaks: a runtime rule (:class:`InvalidPlacement`) or the contract
    (:class:`BrokenContract`). A map short of the contract's floor is logged, not refused: rules 1 and 2 come first,
    and the strategies fall short of the floor only where they must."""
    violations = check(problem, placement.device_map)[0]
    if violations:
        raise InvalidPlacement(
            f"strategy {placement.strategy!r} returned a map that breaks the runtime rules: "
            f"{'; '.join(map(str, violations[:3]))}{' ...' if len(violations) > 3 else ''} "
            "A strategy must return a valid map or raise InfeasiblePlacement; allocator.validate and "
            "allocator.kit.check say what is wrong with a map.", violations=violations)
    broken = contract_violations(problem, placement.device_map, strategy=name)
    for v in broken:
        if v.kind == "contract-floor":
            log.warning("plan by %s: %s", placement.strategy, v.message)
    broken = [v for v in broken if v.kind != "contract-floor"]
    if broken:
        raise BrokenContract(
            f"strategy {placement.strategy!r} returned a plan that breaks the contract of device_map='auto': "
            f"{'; '.join(map(str, broken))} Pass objective='latency' to accept such plans.")


def _accelerate_instead(problem: Problem, strategy, error: InfeasiblePlacement) -> Placement | None:
    """Where no valid plan exists, accelerate's own map (``sequential``), flagged, as accelerate and transformers
    would load it: ``from_pretrained(device_map="auto")`` keeps working where it did. ``None`` where accelerate has
    no map either, or the caller asked for ``sequential`` itself."""
    name = resolve(strategy)[0]
    if name == "sequential":
        return None
    try:
        theirs = run("sequential", problem)
    except AllocatorError:
        return None
    message = (f"{error} No valid plan exists, so accelerate's own map is returned, as device_map='auto' would "
               "return it: it breaks these budgets at runtime (Plan.valid is False, Plan.violations says how); "
               "pass strict=True to raise instead.")
    return replace(theirs, strategy=f"sequential (no valid {name} plan)", notes=(message,) + theirs.notes,
                   diagnostics=theirs.diagnostics + (("warning", message),))


def _report(placement: Placement) -> None:
    """accelerate's warnings and log lines for the plan returned (the strategy's diagnostics)."""
    for level, message in placement.diagnostics:
        if level == "warning":
            warnings.warn(message, UserWarning, stacklevel=3)
        else:
            log.info("%s", message)


def _with_empty_notes(problem: Problem, placement: Placement) -> Placement:
    """Under the contract, say why accelerators before the main device hold nothing: a note, and accelerate's
    "insufficient memory" log line with the budget that would let each hold a unit."""
    if not problem.options.contract or placement.strategy.startswith(("sequential", "balanced_low_0")):
        return placement
    main = main_device(placement.device_map.values())
    accelerators = problem.budgets.accelerators
    empty = accelerators[:accelerators.index(main)] if main in accelerators else accelerators
    if not empty:
        return placement
    minimum = {d: main_minimum(problem, d) for d in empty}
    notes = tuple(f"{why_empty(problem, d)}; it needs at least {format_bytes(minimum[d])}" for d in empty)
    return replace(placement, notes=placement.notes + notes,
                   diagnostics=placement.diagnostics + (("info", insufficient_memory(minimum)),))


def infer_auto_device_map(
    model,
    max_memory: Mapping | None = None,
    no_split_module_classes=None,
    dtype=None,
    special_dtypes=None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    tied_parameters=None,
    hf_quantizer=None,
    no_placement_params=None,
    strategy="auto",
    objective: str = "contract",
    loader: str = "accelerate",
) -> dict:
    """Drop-in for accelerate's ``infer_auto_device_map``: the same arguments, the same dict shape.

    Its maps are for accelerate's loading path (``loader="accelerate"``: ``dispatch_model``,
    ``load_checkpoint_and_dispatch``), where accelerate's own function sends them; pass ``loader="transformers"`` for a
    map given to ``from_pretrained``.

    ``strategy="sequential"`` returns exactly accelerate's map. ``verbose`` logs the decisions at INFO on
    the ``allocator`` logger, made visible for the call (:func:`allocator.logs.shown`: to stderr when logging is
    not configured, else to the configured handlers), where accelerate prints them. ``no_placement_params``
    (transformers' argument, names relative to a no-split block) is accepted for signature compatibility;
    :func:`allocator.hf.patch` is where it acts.

    Examples
    --------
    accelerate's answer for two 288-byte layers and 400 bytes of RAM: everything on disk, because RAM is the main
    device and keeps 288 bytes free for the largest layer, leaving 112 for the first.

    >>> import torch.nn as nn
    >>> infer_auto_device_map(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {"cpu": 400}, strategy="sequential")
    {'': 'disk'}
    """
    options = PlanOptions(no_split_module_classes=no_split_module_classes, dtype=dtype, special_dtypes=special_dtypes,
                          offload_buffers=offload_buffers, clean_result=clean_result,
                          fallback_allocation=fallback_allocation, tied_parameters=tied_parameters,
                          hf_quantizer=hf_quantizer, objective=objective, loader=loader)
    with shown(verbose):  # the INFO records of this call reach stderr, or the handlers the caller configured
        result = plan(model, max_memory, strategy=strategy, options=options)
        if no_placement_params:
            log.debug("no_placement_params %s are handled by allocator.hf.patch, not here",
                      sorted(no_placement_params)[:5])
        if verbose:
            log.info("%s", result.explain())
    return result.device_map
