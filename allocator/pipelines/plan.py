""":func:`plan_pipeline`: a diffusion pipeline's components placed over the devices as one problem.

diffusers' ``DiffusionPipeline.from_pretrained(device_map="balanced")`` deals whole components over the GPUs by size
(``pipeline_loading_utils._assign_components_to_devices``: a zig-zag over the GPUs, largest component first); one
larger than the GPU it is dealt to goes to the CPU whole, to be streamed whole onto GPU 0 when it runs. Here the
components are taken in the order of the bytes they would stream per image if offloaded (runs per image × bytes: the
denoiser runs every step, a text encoder once per prompt, the VAE once per image), so the one that runs most gets the
accelerators first; each is placed whole on the accelerator it fits most tightly, else given a map of its own by
:func:`allocator.plan` over the room the components before it left (split over the GPUs, or offloaded block by
block).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..api import plan
from ..budgets import format_bytes, is_accelerator, parse_budgets
from ..placement import Decision
from .components import Component, read_components, runs_per_image

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
        Bytes per device: the sum over the components of each one's peak there (weights and streaming reserves;
        activations not counted). An estimate, from sizes; nothing was timed or loaded.
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
                 "sizes and peaks are estimates from the configs):"]
        for device, used in self.peak.items():
            budget = self.budgets.get(device)
            lines.append(f"  {device}: {format_bytes(used)}"
                         + (f" of {format_bytes(budget)}" if budget is not None else ""))
        lines += [f"  {name}: {self.execution[name]}, computes on {self.runs_on[name]}"
                  for name in self.components if name in self.execution]
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
        }


def plan_pipeline(source, max_memory: Mapping, *, dtype=None, steps: int = 28, prompts: int = 1, images: int = 1,
                  strategy="auto") -> PipelinePlan:
    """Place a diffusion pipeline's components over the devices as one problem.

    Parameters
    ----------
    source : str, os.PathLike or DiffusionPipeline
        A pipeline folder (``model_index.json`` and a ``config.json`` per component: each component is built on the
        meta device; nothing is downloaded and no weights are read), or a loaded pipeline.
    max_memory : mapping
        Budgets as accelerate accepts them (``{0: "16GiB", 1: "16GiB", "cpu": "64GiB"}``). Never modified.
    dtype : torch.dtype or str, optional
        The dtype the components load in (``torch_dtype=`` of ``from_pretrained``); default: as stored.
    steps, prompts, images : int
        Denoising steps per image, prompts and images per call: how often each component runs per image
        (:func:`allocator.pipelines.runs_per_image`), which decides who gets the accelerators first.
    strategy : str or callable
        The strategy of :func:`allocator.plan` for a component given a map of its own.

    Returns
    -------
    PipelinePlan

    Notes
    -----
    Greedy over components (a pipeline has a handful): components in decreasing runs × bytes; each placed whole on
    the accelerator with the least room that holds it, else planned by :func:`allocator.plan` over the room left
    (every accelerator, the CPU, the disk), which splits it over the GPUs or offloads it block by block. A
    component's peak is charged to each device it uses, so the sum of peaks stays within each budget (components
    run one after another, so this over-counts the streaming reserves). Activations are not counted.
    """
    budgets = parse_budgets(max_memory)
    components = read_components(source)
    runs = {n: runs_per_image(n, steps=steps, prompts=prompts, images=images) for n in components}
    sizes = {n: _size(c, dtype) for n, c in components.items()}
    room = {d: budgets.limit(d) for d in budgets.order if budgets.limit(d) is not None}
    accelerators = [d for d in budgets.order if is_accelerator(d) and room.get(d, 0) > 0]
    peak = dict.fromkeys(room, 0)
    placed, plans, decisions, unplaced, planned_over = {}, {}, [], [], {}
    for name in sorted(components, key=lambda n: (-runs[n] * sizes[n], n)):
        fits = [d for d in accelerators or [d for d in ("cpu",) if d in room] if sizes[name] <= room[d]]
        if fits:
            device = min(fits, key=lambda d: (room[d], budgets.order.index(d)))
            placed[name] = device
            room[device] -= sizes[name]
            peak[device] += sizes[name]
            decisions.append(Decision("pipeline", f"{name} ({format_bytes(sizes[name])}, runs {runs[name]:g}× per "
                                      f"image) whole on {device}", devices=(device,), units=(name,),
                                      bytes=sizes[name], bound="budget"))
            continue
        given = {d: r for d, r in room.items() if r > 0}
        result = plan(components[name].model, given, strategy=strategy, dtype=dtype, loader=components[name].loader)
        if not result.valid:
            unplaced.append(name)
            decisions.append(Decision("pipeline", f"{name} ({format_bytes(sizes[name])}) fits in none of the room "
                                      f"left ({_rooms(given)})", units=(name,), bytes=sizes[name], bound="budget"))
            continue
        placed[name], plans[name], planned_over[name] = dict(result.device_map), result, given
        for device, used in result.peak.items():
            room[device] = room.get(device, 0) - used
            peak[device] = peak.get(device, 0) + used
        used_on = sorted({v for v in result.device_map.values()}, key=budgets.order.index)
        decisions.append(Decision("pipeline", f"{name} ({format_bytes(sizes[name])}, runs {runs[name]:g}× per image) "
                                  f"fits no accelerator whole: its own map over {used_on} ({result.strategy})",
                                  devices=tuple(used_on), units=(name,), bytes=sizes[name], bound="budget"))
    if any(isinstance(w, Mapping) for w in placed.values()):
        decisions.append(Decision("pipeline", "diffusers' pipeline loading gives a component one device "
                                  "({'': device}); a component with a map of its own loads under allocator.patch() "
                                  "(its from_pretrained gets the map) or by loading it alone with device_map=",
                                  units=tuple(n for n, w in placed.items() if isinstance(w, Mapping))))
    execution = {n: ("split" if isinstance(w, Mapping) else "cpu" if w in ("cpu", "disk") else "resident")
                 for n, w in placed.items()}
    runs_on = {n: (plans[n].main_device if isinstance(w, Mapping) else w) for n, w in placed.items()}
    return PipelinePlan({n: placed[n] for n in components if n in placed}, plans, sizes, runs,
                        {d: b for d, b in peak.items() if b}, {d: budgets.limit(d) for d in room},
                        tuple(decisions), None if dtype is None else str(dtype).removeprefix("torch."),
                        tuple(unplaced), planned_over, {n: execution[n] for n in components if n in execution},
                        {n: runs_on[n] for n in components if n in runs_on})


def _size(component: Component, dtype) -> int:
    """Bytes of the component under ``dtype``, as :func:`allocator.plan` counts them (one device, the CPU)."""
    return plan(component.model, {"cpu": 1 << 62}, strategy="sequential", dtype=dtype,
                loader=component.loader).resident("cpu")


def _rooms(room: Mapping) -> str:
    return ", ".join(f"{d}: {format_bytes(b)}" for d, b in room.items())
