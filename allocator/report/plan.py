"""What :func:`allocator.plan` returns: a :class:`Plan`, a placement with what it costs at runtime, made by
:func:`finish` (check, peaks and price, once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..budgets import Device, canonical
from ..evaluate.cost import Cost
from ..evaluate.memory import map_runs
from ..evaluate.validate import Violation, format_bytes
from ..judge.verdict import Verdict, verdict
from ..placement import Placement
from ..problem import Problem
from ..evaluate.compute import ComputePlan   # issue #40: where units compute
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
    verdict: Verdict | None = None

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
        offloaded unit streamed: ``{"hybrid": {...}, "stream": {...}}``; empty without a compute plan. Estimates, from
        the plan's one price per phase (:attr:`costs`)."""
        if self.hybrid is None:
            return {}
        return {"hybrid": {phase: cost.seconds for phase, cost in self.verdict.steps.items()},
                "stream": dict(self.verdict.stream_steps)}
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
        """The estimate of one step of each phase (``"prefill"``, and with a generation budget ``"decode"``: one
        decoding step), as :class:`Cost`, from the plan's verdict; :attr:`cost` is the one ``options.optimize``
        names."""
        return dict(self.verdict.steps)

    @property
    def priced_step(self) -> str:
        """The phase :attr:`cost` is the estimate of (``"prefill"`` or ``"decode"``): :attr:`cost` is that step of
        :attr:`costs`, not a number of its own."""
        return self.verdict.optimize if self.verdict.optimize in self.verdict.steps else "prefill"

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
        """Counted bytes of the model that live on ``device`` (not counting the streaming reserve), each byte once,
        where the runtime holds it: routed experts kept in RAM are RAM's, not the disk's their module is mapped to."""
        return int(self.verdict.resident.get(canonical(device), 0))   # the caller's spelling: "cuda:0" is 0

    def __repr__(self) -> str:
        """One line: strategy, main device, estimate, resident and peak bytes per device (the rest: ``explain()``)."""
        budgets = self.problem.budgets
        devices = "; ".join(
            f"{d}: resident {format_bytes(self.resident(d))}, peak {format_bytes(self.peak[d])}"
            + (f" of {format_bytes(budgets.limit(d))}" if budgets.limit(d) is not None else "")
            for d in budgets.order if d in self.peak)
        state = "valid" if self.valid else f"{len(self.violations)} violation(s)"
        return (f"<Plan {self.strategy} for {self.problem.graph.model_class}: main device {self.main_device!r}, "
                f"estimated {self.cost.seconds * 1e3:.3f} ms {self.priced_phrase()}, {state}; {devices}>")

    def priced_phrase(self) -> str:
        """What :attr:`cost` is the estimate of: ``"per forward"``, or with a generation budget ``"per prefill step"``
        / ``"per decode step"`` (:attr:`priced_step`)."""
        return "per forward" if self.problem.generation is None else f"per {self.priced_step} step"

    def explain(self) -> str:
        """The plan as text: per-device bytes against budgets, which objective decided, then why — the main device,
        what each device holds and why not more (or why nothing), why units are offloaded, the streaming reserve and
        the offloaded modules that set it, which candidate won and by what margin — then the strategy's decisions
        (at most 200)."""
        g, budgets = self.problem.graph, self.problem.budgets
        lines = [f"strategy {self.strategy} for {g.model_class} ({format_bytes(g.total)}); main device "
                 f"{self.main_device!r}",
                 f"  estimated {self.cost.seconds * 1e3:.3f} ms {self.priced_phrase()}, "
                 f"{format_bytes(self.cost.streamed_bytes)} streamed {self.priced_phrase()}, "
                 f"{self.cost.device_changes} device changes"
                 + ("" if self.optimal is None else (", proven optimal" if self.optimal else ", not proven optimal")),
                 f"  {self.compute_term()}"]
        if len(self.costs) > 1:
            lines.append(f"  {self.per_step()}; objectives price the {self.problem.cost.optimize}")
        for device in budgets.order:
            if device not in self.peak:
                continue
            limit = budgets.limit(device)
            share = f" of {format_bytes(limit)} ({self.peak[device] / limit:.0%})" if limit else ""
            lines.append(f"  {device!s:>5}: resident {format_bytes(self.resident(device))}, peak "
                         f"{format_bytes(self.peak[device])}{share}")
            parts = self.parts.get(device, {})
            if any(v for k, v in parts.items() if k != "weights"):
                lines.append("         = " + " + ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in
                                                        parts.items() if v or k == "weights"))
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
        tier, and this plan's); under ``"latency"`` that the contract was lifted (explaining never plans again)."""
        problem = self.problem
        if problem.deciding.contract:
            need = floor(problem)
            have = fast_bytes(problem, map_runs(problem.graph, self.device_map))
            return ("objective contract: main device the first accelerator that admits a plan "
                    f"({contract_main(problem)!r}), accelerators in index order, at least accelerate's bytes on "
                    f"them ({format_bytes(need)}, this plan {format_bytes(have)}); the cost model ranks the plans that "
                    "keep it")
        line = ("objective latency: the cost model's estimate alone decided; the contract's rules (main device, index "
                "order, accelerate's bytes on the accelerators) were lifted")
        if self.placement.accelerates:
            return line
        return line + f"; the contract would make main device {contract_main(problem)!r}"

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
    """The plan of a placement: its verdict (:func:`allocator.judge.verdict.verdict`: the runtime rules, every byte
    the runtime holds per device, where units compute, one price per phase), computed once, and the runtime it
    decides; ``asked`` names the strategy the caller asked for."""
    judged_once = verdict(problem, placement)
    memory = judged_once.memory
    return Plan(
        device_map=dict(placement.device_map), peak=judged_once.peak, strategy=placement.strategy,
        main_device=memory.main, streamed=memory.streamed, violations=judged_once.violations, problem=problem,
        placement=placement, cost=judged_once.cost, parts=judged_once.parts, prefetch=memory.prefetch, asked=asked,
        hybrid=judged_once.hybrid, verdict=judged_once,
        runtime=decide_runtime(problem, placement, memory, judged_once.parts.get(memory.main, {}).get("experts", 0),
                               judged_once.expert_cache),
    )
