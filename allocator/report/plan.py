"""What :func:`allocator.plan` returns: a :class:`Plan`, a placement with what it costs at runtime, made by
:func:`finish` (check, peaks and price, once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..budgets import ByDevice, Device, canonical
from ..errors import AllocatorError
from ..evaluate.cost import Cost
from ..evaluate.memory import expert_cache_reserve, map_runs
from ..evaluate.runs import columns
from ..evaluate.validate import Violation, format_bytes, peak_parts
from ..judge.verdict import judged
from ..placement import Placement
from ..problem import Problem, step_problem
from ..strategies import STRATEGIES, run
from ..evaluate.cost import priced
from ..evaluate.compute import ComputePlan, cache_moves, decide, step_seconds   # issue #40: where units compute
from ..evaluate.experts import resident_bytes, routed_cost
from ..evaluate.tiers import fast_bytes
from ..judge.witness import contract_main, floor
from .decisions import lines as decision_lines
from .explain import reasons
from .runtime import Runtime, decide_runtime
from .schema import plan_to_dict, read, rebuild

__all__ = ["Plan", "finish"]


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
    asked : str
        The strategy the caller asked for (``"auto"``, where :attr:`strategy` says ``"auto:reserve"``); the name of a
        caller's function.
    runtime : Runtime
        What the runtime does, decided here (:class:`allocator.report.runtime.Runtime`): which runtime, prefetch
        depth, resident experts, expert mode per layer, the buffers it holds. :func:`allocator.offload.attach` reads
        it; :meth:`to_dict` carries it.
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
    runtime: Runtime = field(default_factory=Runtime)
    asked: str = ""
    hybrid: ComputePlan | None = None

    @property
    def compute(self) -> dict:
        """Where each offloaded unit computes per phase (``{"model.layers.20": {"prefill": 0, "decode": "cpu"}}``),
        in a plan for the allocator runtime with an accelerator as main device (:mod:`allocator.evaluate.compute`);
        empty otherwise. :func:`allocator.offload.attach` runs it as written."""
        return {} if self.hybrid is None else self.hybrid.to_dict()

    @property
    def phase_steps(self) -> dict:
        """Estimated seconds of one step of each phase (``"prefill"``: the prompt; ``"decode"``: one token per
        sequence) as this plan runs (offloaded units where :attr:`compute` says), and, under ``"stream"``, with every
        offloaded unit streamed: ``{"hybrid": {...}, "stream": {...}}``; empty without a compute plan. Estimates."""
        if self.hybrid is None:
            return {}
        main = self.main_device
        return {kind: {phase: step_seconds(self.problem, self.device_map, main, phase,
                                           self.hybrid if kind == "hybrid" else None) for phase in self.hybrid.tokens}
                for kind in ("hybrid", "stream")}

    @property
    def optimal(self) -> bool | None:
        """Whether the strategy proved no valid plan is estimated faster (``ilp``); ``None`` when unknown."""
        return self.placement.optimal

    @property
    def valid(self) -> bool:
        return not self.violations

    @property
    def experts(self) -> dict:
        """Where each routed expert lives, per experts module of a mixture of experts (``{"model.layers.0.mlp.experts":
        (0, 0, "cpu", ...)}``), in a plan for the allocator runtime (``runtime="allocator"``,
        :mod:`allocator.strategies.experts`); empty otherwise. The device map holds each such module whole where its
        non-resident experts stay; the runtime (:func:`allocator.offload.attach`) keeps the resident ones' slices on
        their device, counted in :attr:`peak`."""
        return dict(self.placement.experts)

    @property
    def costs(self) -> dict:
        """The estimate of each forward that was counted (``"prefill"``, and with a generation budget ``"decode"``:
        one decoding step), as :class:`Cost`; ``{"prefill": cost}`` when nothing was counted. :attr:`cost` is the
        one ``options.optimize`` names."""
        steps = self.problem.steps or {"prefill": None}
        return {step: self.cost if step == self.problem.cost.optimize else
                _priced(step_problem(self.problem, step), self.placement) for step in steps}

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
        if self.problem.cost.optimize == "decode":
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
            lines.append(f"  {self.per_step()}; objectives price the {self.problem.cost.optimize}")
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
        why = reasons(self)
        lines.append("why:")
        lines += [f"  - {sentence}" for sentence in why.lines]
        notes = [line for decision in self.placement.decisions if id(decision) not in why.said
                 for line in decision_lines(decision)]
        if notes:
            lines.append(f"decisions of {self.placement.algorithm}:")
        lines += [f"  - {note}" for note in notes[:200]]
        if len(notes) > 200:
            lines.append(f"  ... {len(notes) - 200} more decisions")
        return "\n".join(lines)


    def _objective(self) -> str:
        """Which objective decided: under ``"contract"`` its main device and floor (accelerate's bytes on the fastest
        tier, and this plan's); under ``"latency"`` what the contract would have chosen instead."""
        problem = self.problem
        if problem.deciding.contract:
            need = floor(problem)
            have = fast_bytes(problem, map_runs(problem.graph, self.device_map))
            return ("objective contract: main device the first accelerator that admits a plan "
                    f"({contract_main(problem)!r}), accelerators in index order, at least accelerate's bytes on "
                    f"them ({format_bytes(need)}, this plan {format_bytes(have)}); the cost model ranks the plans that "
                    "keep it")
        line = "objective latency: the cost model's estimate alone decided"
        fell_back = self.placement.accelerates and self.asked != "sequential"   # accelerate's map, as no plan fits
        if self.asked not in STRATEGIES or fell_back:
            return line
        contract = self.problem.with_options(objective="contract")
        try:
            other = finish(contract, run(self.asked, contract))
        except AllocatorError:
            return line + "; no plan keeps the contract"
        if other.main_device == self.main_device:
            return line + f"; the contract gives the same main device ({self.main_device!r})"
        gain = other.cost.seconds / self.cost.seconds - 1 if self.cost.seconds else 0.0
        return (line + f"; the contract would make main device {other.main_device!r} "
                f"(estimated {other.cost.seconds * 1e3:.3f} ms per forward, {gain:+.0%} against this plan)")

    def to_dict(self) -> dict:
        """The plan as JSON-ready data of a stable schema (:mod:`allocator.report.schema`): device map, main device,
        budgets, peaks and their parts per device, the options (dtype, objective, generation budget), the estimate
        with its terms, the decisions and violations.

        >>> import json, torch.nn as nn, allocator
        >>> p = allocator.plan(nn.Linear(4, 4), {0: 1000})
        >>> data = p.to_dict()
        >>> data["schema"], data["device_map"], data["main_device"], data["peak"]
        ('allocator.plan/3', {'': 0}, 0, {'0': 80})
        >>> data["model"]["class"], data["model"]["parameters"], data["options"]["dtype"]
        ('Linear', 20, 'float32')
        >>> allocator.Plan.from_dict(json.loads(json.dumps(data))).to_dict() == data
        True
        """
        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, data, model=None, **keywords):
        """A plan saved by :meth:`to_dict`. Without ``model``, the data checked against the schema
        (:class:`allocator.report.schema.SavedPlan`); with it, a :class:`Plan` of the saved map re-validated against
        that model under the saved budgets and options (``keywords``: :class:`allocator.PlanOptions` fields that
        override them): its ``violations`` say what no longer holds.

        Raises
        ------
        InvalidOption
            Not a plan of a schema version this reader reads (``allocator.plan/3``, ``/2`` and ``/1``).
        PlanModelMismatch
            ``model`` is not the model the plan was made for (its class, parameter count, a tensor's shape or the
            hash of tensor names and shapes differ): make a new plan for it.
        """
        saved = read(data)
        if model is None:
            return saved
        return finish(*rebuild(saved, model, **keywords), asked=str(saved.data.get("asked", "")))


def finish(problem: Problem, placement: Placement, *, asked: str = "") -> Plan:
    """The plan of a placement: its map checked against the runtime rules, its peaks and parts per device, and its
    estimate, each computed once; ``asked`` names the strategy the caller asked for."""
    violations, memory = judged(problem, placement.device_map)
    parts = peak_parts(problem, placement.device_map, memory)
    resident = resident_bytes(problem, placement)
    for device, nbytes in resident.items():   # experts the runtime keeps resident
        memory.peak[device] = memory.peak.get(device, 0) + nbytes
        row = parts.setdefault(device, {"weights": 0})
        row["weights"] = row.get("weights", 0) + nbytes
    cache = expert_cache_reserve(problem, placement.device_map) if placement.experts else (0, 0)
    if cache[1]:   # the runtime's cache of recently routed experts, on the main device
        memory.peak[memory.main] = memory.peak.get(memory.main, 0) + cache[1]
        row = parts.setdefault(memory.main, {"weights": 0})
        row["weights"] = row.get("weights", 0) + cache[1]   # "weights" holds the runtime's reserves
    hybrid = _hybrid(problem, placement, memory, parts)   # issue #40: allocator runtime, accelerator main only
    return Plan(
        device_map=dict(placement.device_map), peak=ByDevice(memory.peak), strategy=placement.strategy,
        main_device=memory.main, streamed=memory.streamed, violations=tuple(violations), problem=problem,
        placement=placement, cost=_priced(problem, placement), parts=ByDevice(parts),
        prefetch=memory.prefetch, asked=asked, hybrid=hybrid,
        runtime=decide_runtime(problem, placement, memory, resident.get(memory.main, 0), cache),
    )


def _hybrid(problem: Problem, placement: Placement, memory, parts: dict) -> ComputePlan | None:
    """Where offloaded units compute per phase (:func:`allocator.evaluate.compute.decide`); the KV cache of those
    computing on the CPU at decode moves from the main device's peak to RAM's (``memory.peak`` and ``parts``
    updated in place: both were made here)."""
    limit = problem.budgets.limit("cpu")
    room = None if limit is None else max(limit - memory.peak.get("cpu", 0), 0)
    hybrid = decide(problem, placement.device_map, memory.main, room)
    for device, delta in cache_moves(hybrid, memory.main).items():
        memory.peak[device] = memory.peak.get(device, 0) + delta
        row = parts.setdefault(device, {"weights": 0, "cache": 0, "logits": 0, "activations": 0})
        row["cache"] = row.get("cache", 0) + delta
    return hybrid


def _priced(problem: Problem, placement: Placement):
    """The estimate of ``placement``: of its map (:func:`allocator.evaluate.cost.priced`), with the routed experts
    in place of whole experts modules where it places experts (:func:`allocator.evaluate.experts.routed_cost`)."""
    return routed_cost(problem, placement, priced(problem, placement.device_map))
