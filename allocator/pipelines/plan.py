""":func:`plan_pipeline`: a diffusion pipeline's components placed over the devices as one problem (issue #47).

diffusers' ``DiffusionPipeline.from_pretrained(device_map="balanced")`` deals whole components over the GPUs by size
(``pipeline_loading_utils._assign_components_to_devices``: a zig-zag over the GPUs, largest component first); one
larger than the GPU it is dealt to goes to the CPU whole, to be streamed whole onto GPU 0 when it runs, and nothing
counts what a component needs while it runs. Here each component's activations are counted at
the :class:`allocator.DiffusionBudget`'s sizes, and how each one runs is chosen together
(:mod:`allocator.pipelines.choose`):
whole on an accelerator, moved onto one from RAM when it runs (model offload), computed on the CPU where it lives, or
with a map of its own planned by :func:`allocator.plan` over the room the others leave. Each device holds what every
component keeps there plus the most one needs while it runs there; the choice kept is the cheapest estimate per image
(runs x the price of one run, plus the bytes moved), or under ``balanced`` the most even spread among the cheapest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..api import plan
from ..budgets import canonical, format_bytes, format_ms, parse_budgets
from ..errors import InvalidOption
from ..placement import Decision
from ..profile import Profile
from .budget import DiffusionBudget, activation_peaks, component_kind, denoiser_tokens, vae_factors
from .choose import Need, choose, whole_options
from .components import Component, pipeline_class, read_components, runs_per_image

__all__ = ["EXECUTIONS", "PipelinePlan", "plan_pipeline"]

EXECUTIONS = ("resident", "moved", "split", "cpu")
"""How a component runs: whole where it lives (``"resident"``), moved whole from RAM onto the device it runs on and
back (``"moved"``, model offload), with a map of its own (``"split"``), or computed on the CPU where it lives
(``"cpu"``)."""

log = logging.getLogger("allocator.pipelines")


@dataclass(frozen=True)
class PipelinePlan:
    """Where each component of a pipeline lives.

    Attributes
    ----------
    components : dict
        Component name to a device (``0``, ``"cpu"``: loaded whole there) or to a device map of its own.
    plans : dict
        The :class:`allocator.Plan` of each component given a map of its own.
    sizes : dict
        Bytes of each component under the plan's dtype.
    runs : dict
        Runs per image of each component (what decided who gets the accelerators first).
    peak : dict
        Bytes per device: what every component keeps there plus the most one of them needs while it runs there (its
        activations at the budget's sizes, a moved component's weights, a map's streaming reserve). An estimate,
        from the configs; nothing was timed or loaded.
    budgets : dict
        Bytes per device given (``"disk"`` only where the caller gave it).
    decisions : tuple of Decision
        Of kind ``"pipeline"``, in the order they were made.
    dtype : str or None
        The dtype the sizes are counted in.
    unplaced : tuple of str
        Components no room left could hold (the plan is then not valid).
    given : dict
        For each component with a map of its own, the budgets it was planned over (the room the components before it
        left): what its ``from_pretrained`` gets as ``max_memory`` under :func:`allocator.patch`.
    execution : dict
        Component name to how it runs (:data:`EXECUTIONS`): ``"resident"`` (whole on its device, computes there),
        ``"moved"`` (lives in RAM, moved whole onto ``runs_on[name]`` when it runs and back after, as diffusers'
        ``enable_model_cpu_offload`` does), ``"split"`` (a device map of its own, run by the plan's runtime) or
        ``"cpu"`` (computes on the CPU, where it lives).
    runs_on : dict
        Component name to the device it computes on (for ``"split"``: its plan's main device).
    activations : dict
        Component name to its activation peak in bytes while it runs at the budget's sizes (an estimate,
        :mod:`allocator.pipelines.budget`).
    seconds : dict
        Component name to its estimated seconds per image (runs x one run where it computes, plus the bytes moved).
    budget : DiffusionBudget or None
        The sizes the activations were counted at.
    """

    components: dict
    plans: dict
    sizes: dict
    runs: dict
    peak: dict
    budgets: dict
    decisions: tuple = ()
    dtype: str | None = None
    unplaced: tuple = field(default=())
    given: dict = field(default_factory=dict)
    execution: dict = field(default_factory=dict)
    runs_on: dict = field(default_factory=dict)
    activations: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    budget: DiffusionBudget | None = None

    @property
    def price(self) -> float:
        """Estimated seconds per image: the sum over components of runs x the price of one run (an estimate)."""
        return sum(self.seconds.values())

    @property
    def valid(self) -> bool:
        """Every component placed, every plan of its own valid, and every device's peak within its budget."""
        return (not self.unplaced and all(p.valid for p in self.plans.values())
                and all(used <= self.budgets[d] for d, used in self.peak.items() if d in self.budgets))

    def on(self, name: str) -> set:
        """The devices component ``name`` occupies."""
        where = self.components[name]
        return set(where.values()) if isinstance(where, Mapping) else {where}

    def explain(self) -> str:
        """The placement as text: per-device peak against budget, then each decision."""
        lines = [f"pipeline plan ({'valid' if self.valid else 'INVALID'}; dtype {self.dtype or 'as stored'}; "
                 "sizes, peaks and seconds are estimates from the configs):"]
        if self.budget is not None:
            b = self.budget
            lines.append(f"  at {b.width}x{b.height}, {b.frames} frame(s), batch {b.batch}, {b.steps} steps")
        for device, used in self.peak.items():
            budget = self.budgets.get(device)
            lines.append(f"  {device}: joint peak {format_bytes(used)}"
                         + (f" of {format_bytes(budget)} ({used / budget:.0%})" if budget else ""))
        for name in self.components:
            if name in self.execution:
                lines.append(f"  {name}: {self.execution[name]}, computes on {self.runs_on[name]}; "
                             f"{format_bytes(self.sizes[name])} weights, {format_bytes(self.activations.get(name, 0))}"
                             f" activations, runs {self.runs[name]:g}x per image"
                             + (f", {format_ms(self.seconds[name])} per image" if name in self.seconds else ""))
        if self.seconds:
            lines.append(f"  estimated {format_ms(self.price)} per image")
        lines += [f"  - {d.text}" for d in self.decisions]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready data: each component's device or map, sizes, runs, peaks, budgets and decisions."""
        return {
            "schema": "allocator.pipeline_plan/1", "valid": self.valid, "dtype": self.dtype,
            "components": {n: ({k: str(v) for k, v in w.items()} if isinstance(w, Mapping) else str(w))
                           for n, w in self.components.items()},
            "sizes": dict(self.sizes), "runs": dict(self.runs),
            "peak": {str(d): b for d, b in self.peak.items()}, "budgets": {str(d): b for d, b in self.budgets.items()},
            "decisions": [{"kind": d.kind, "text": d.text, "devices": [str(x) for x in d.devices],
                           "units": list(d.units), "bytes": d.bytes, "bound": d.bound} for d in self.decisions],
            "unplaced": list(self.unplaced),
            "execution": dict(self.execution), "runs_on": {n: str(d) for n, d in self.runs_on.items()},
            "activations": dict(self.activations), "seconds": dict(self.seconds), "price_seconds": self.price,
            "budget": None if self.budget is None else {f: getattr(self.budget, f) for f in (
                "height", "width", "frames", "batch", "steps", "guidance", "text_tokens")},
        }


def plan_pipeline(source, max_memory: Mapping, *, budget: DiffusionBudget | None = None, dtype=None,
                  steps: int | None = None, prompts: int = 1, images: int = 1, strategy="auto",
                  balanced: bool = False,
                  profile: Profile | None = None) -> PipelinePlan:
    """Place a diffusion pipeline's components over the devices as one problem, with room for each one to run.

    Parameters
    ----------
    source : str, os.PathLike or DiffusionPipeline
        A pipeline folder (``model_index.json`` and a ``config.json`` per component: each component is built on the
        meta device; nothing is downloaded and no weights are read), or a loaded pipeline.
    max_memory : mapping
        Budgets as accelerate accepts them (``{0: "16GiB", 1: "16GiB", "cpu": "64GiB"}``). Never modified.
    budget : DiffusionBudget, optional
        The sizes the pipeline runs at: each component's activations are counted there, and its ``steps`` set how
        often the denoiser runs. Default: the pipeline's default image size (the denoiser's ``sample_size`` times
        the VAE's factor, else 1024x1024), batch 1, ``steps``.
    dtype : torch.dtype or str, optional
        The dtype the components load in (``torch_dtype=`` of ``from_pretrained``); default: as stored.
    steps : int, optional
        Denoising steps per image where no ``budget`` is given (default 28); with a budget, its ``steps``.
    prompts, images : int
        Prompts and images per call: with the steps, how often each component runs per image
        (:func:`allocator.pipelines.runs_per_image`).
    strategy : str or callable
        The strategy of :func:`allocator.plan` for a component given a map of its own.
    balanced : bool
        As ``device_map="balanced"``: among the choices priced within 5 % of the cheapest, the one whose fullest
        accelerator is least full (spread over the GPUs); else the cheapest.
    profile : Profile, optional
        The rates the prices are estimated with (:class:`allocator.Profile`; default: its documented defaults).

    Returns
    -------
    PipelinePlan

    Raises
    ------
    InvalidOption
        ``steps`` given with a ``budget`` whose steps differ.

    Notes
    -----
    Each component is offered every way to run whole (resident on each accelerator, moved onto each from RAM,
    computed on the CPU); a component no accelerator holds whole gets a map of its own over the room the others
    keep. The choices are judged together by the joint rule (per device, what all keep plus the most one needs
    while it runs), best estimate first; at most :data:`allocator.pipelines.choose.REALIZED` of them plan maps of
    their own (one :func:`allocator.plan` each). ``O(k^c)`` choices for ``c`` components of ``k`` options each
    (``k <= 2·accelerators + 1``; a pipeline has at most six components).
    """
    limits = parse_budgets(max_memory)
    budgets = {d: limits.limit(d) for d in limits.order if limits.limit(d) is not None}
    unlimited = {k: v for k, v in max_memory.items() if canonical(k) not in budgets}
    components = read_components(source)
    denoiser = next((c.model for n, c in components.items() if component_kind(n, c.model) == "denoiser"), None)
    vae = next((c.model for n, c in components.items() if component_kind(n, c.model) == "vae"), None)
    decisions = []
    if budget is not None and steps is not None and steps != budget.steps:
        raise InvalidOption(f"plan_pipeline got steps={steps} and a budget with steps={budget.steps}; give the steps "
                            "once, in DiffusionBudget(..., steps=).")
    if budget is None:
        side = _default_side(denoiser, vae)
        steps = 28 if steps is None else steps
        budget = DiffusionBudget(side, side, steps=steps)
        decisions.append(Decision("pipeline", f"no DiffusionBudget given: activations counted at {side}x{side}, "
                                  f"batch 1, {steps} steps (the pipeline's default size); pass budget= for yours"))
    kind = pipeline_class(source)
    acts = activation_peaks(components, budget, dtype=dtype, pipeline_class=kind)
    runs = {n: runs_per_image(n, steps=budget.steps, prompts=prompts, images=images) for n in components}
    sizes = {n: _size(c, dtype) for n, c in components.items()}
    needs = {n: Need(n, sizes[n], acts[n], runs[n], _tokens(n, c.model, vae, budget, kind), c.model, c.loader)
             for n, c in components.items()}
    profile = profile or Profile()
    best, judged = choose(needs, budgets, unlimited, profile, {"strategy": strategy, "dtype": dtype},
                          balanced=balanced)
    chosen = best or (min(judged, key=lambda c: sum(c.over.values())) if judged else None)
    options = chosen.ways if chosen is not None else {}
    unplaced = tuple(n for n in components if n not in options or (best is None and n in _over(chosen)))
    decisions += [_decision(needs[n], options[n], needs, budgets, profile) for n in components if n in options]
    if best is None:
        over = f" (the least over is by {_rooms(chosen.over)})" if chosen is not None and chosen.over else ""
        decisions.append(Decision("pipeline", f"no choice keeps every device within its budget{over}; no room for "
                                  f"{list(unplaced)} with their activations at this budget's sizes: give more memory, "
                                  "a smaller DiffusionBudget, or a disk to offload to", units=unplaced,
                                  bound="budget"))
    maps = [n for n, o in options.items() if o.execution == "split"]
    if maps:
        decisions.append(Decision("pipeline", "diffusers' pipeline loading gives a component one device "
                                  "({'': device}); a component with a map of its own loads under allocator.patch() "
                                  "(its from_pretrained gets the map) or by loading it alone with device_map=",
                                  units=tuple(maps)))
    order = list(components)
    return PipelinePlan({n: options[n].placed for n in order if n in options},
                        {n: options[n].plan for n in maps}, sizes, runs,
                        dict(chosen.peak) if chosen is not None else {}, budgets, tuple(decisions),
                        None if dtype is None else str(dtype).removeprefix("torch."), unplaced,
                        {n: options[n].given for n in maps},
                        {n: options[n].execution for n in order if n in options},
                        {n: options[n].runs_on for n in order if n in options},
                        acts, {n: options[n].seconds for n in order if n in options}, budget)


def _over(choice) -> set:
    if choice is None:
        return set()
    return {n for n, o in choice.ways.items() if set(o.kept) & set(choice.over) or set(o.running) & set(choice.over)}


def _decision(need: Need, option, needs: dict, budgets: Mapping, profile) -> Decision:
    """How ``need`` runs and why, with the numbers; for a rarely run component moved or left on the CPU, the price
    of the other way."""
    head = (f"{need.name} ({format_bytes(need.size)}, activations {format_bytes(need.activations)}, runs "
            f"{need.runs:g}x per image) ")
    if option.execution == "split":
        how = (f"with a map of its own over {sorted({str(d) for d in option.placed.values()})}, computing on "
               f"{option.runs_on}")
    else:
        how = {"resident": f"whole on {option.runs_on}", "cpu": "whole in RAM, computed on the CPU",
               "moved": f"in RAM, moved whole onto {option.runs_on} when it runs and back after"}[option.execution]
    text = f"{head}{how}: {format_ms(option.seconds)} per image (estimate)"
    if option.execution == "moved":
        text += f", {format_ms(option.moved_seconds)} of it moving {format_bytes(need.size)} over the host link"
    if option.execution in ("moved", "cpu"):
        other = [o for o in whole_options(need, budgets, profile) if o.execution != option.execution
                 and o.execution in ("moved", "cpu")]
        if other:
            alt = min(other, key=lambda o: o.seconds)
            text += (f"; {'computed on the CPU' if alt.execution == 'cpu' else f'moved onto {alt.runs_on}'} it "
                     f"would take {format_ms(alt.seconds)}")
    devices = tuple(option.kept) if option.execution != "split" else tuple(sorted(set(option.placed.values()), key=str))
    return Decision("pipeline", text, devices=devices, units=(need.name,), bytes=need.size, bound="budget")


def _tokens(name: str, model, vae, budget: DiffusionBudget, kind) -> int:
    """Tokens one run of the component computes with (its price): the denoiser's latent tokens (x the guidance
    batch), a text encoder's length, the VAE's latent positions (x the batch and frames)."""
    role = component_kind(name, model)
    if role == "denoiser":
        return budget.batch * budget.guided(kind) * denoiser_tokens(model, vae, budget)
    if role == "text_encoder":
        return budget.batch * budget.text_tokens
    spatial, _ = vae_factors(vae)
    return budget.batch * budget.frames * (budget.height // spatial) * (budget.width // spatial)


def _default_side(denoiser, vae) -> int:
    """diffusers' default image side: the denoiser's ``sample_size`` (latent) times the VAE's spatial factor; 1024
    where the config has none."""
    config = getattr(denoiser, "config", None) or {}
    sample = config.get("sample_size") if isinstance(config, Mapping) else getattr(config, "sample_size", None)
    if not isinstance(sample, int) or vae is None:
        return 1024
    blocks = getattr(vae, "config", {}).get("block_out_channels") or ()
    return sample * 2 ** max(len(blocks) - 1, 0) if blocks else 1024


def _size(component: Component, dtype) -> int:
    """Bytes of the component under ``dtype``, as :func:`allocator.plan` counts them (one device, the CPU)."""
    return plan(component.model, {"cpu": 1 << 62}, strategy="sequential", dtype=dtype,
                loader=component.loader).resident("cpu")


def _rooms(room: Mapping) -> str:
    return ", ".join(f"{d}: {format_bytes(b)}" for d, b in room.items())
