"""Make diffusers' ``ModelMixin.from_pretrained(device_map="auto" | "balanced" | "balanced_low_0" | "sequential")``
plan with :func:`allocator.plan`, for :func:`allocator.patch`.

diffusers 0.42 turns a string ``device_map`` into a dict in ``diffusers.models.model_loading_utils
._determine_device_map(model, device_map, max_memory, torch_dtype, keep_in_fp32_modules, hf_quantizer)``, which calls
accelerate's ``get_balanced_memory`` and ``infer_auto_device_map`` imported by name into that module.
``ModelMixin.from_pretrained`` (``diffusers.models.modeling_utils``) and the single-file loader
(``diffusers.loaders.single_file_model``) import ``_determine_device_map`` by name and call it there, so those two
attributes are the ones replaced: the replacement sees the mode and the user's ``max_memory`` (as transformers 5's
``_get_device_map`` replacement does), and calls diffusers' own function, unpatched, for the map the user gets
today: the floor of the contract's rule 3 on this path (``PlanOptions.baseline``).

How diffusers loads a map (checked by real loads in ``tests/integrations/test_diffusers_patch.py``): every tensor
of the checkpoint goes where ``_determine_param_device`` says (``load_model_dict_into_meta``), ``"disk"`` tensors are
written to ``offload_folder`` by accelerate's ``offload_weight``, and ``dispatch_model(model, device_map,
offload_dir, offload_index)`` is called from ``diffusers.models.modeling_utils``. That is accelerate's
``load_checkpoint_and_dispatch`` path in all that a plan's rules read (nothing tied after loading), so maps are
planned for ``loader="accelerate"``. Under ``runtime="allocator"`` that ``dispatch_model`` is replaced as well,
with the one that attaches :mod:`allocator.offload`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from ..offload import StandInDevice
from ..offload.moved import ModelMoves, compute_on_cpu
from ..errors import InvalidOption
from ..pipelines import DiffusionBudget, plan_pipeline
from .library import baseline_map, optional_import, user_budgets

__all__ = ["MODEL_NAMESPACES", "PINNED", "diffusers_swaps", "pipeline_swaps"]

log = logging.getLogger("allocator.integrations.diffusers")

MODES = ("auto", "balanced", "balanced_low_0", "sequential")
MODEL_NAMESPACES = ("diffusers.models.modeling_utils", "diffusers.loaders.single_file_model")
"""Where diffusers calls ``_determine_device_map`` by name (0.42: ``ModelMixin.from_pretrained`` and
``FromOriginalModelMixin.from_single_file``)."""


def diffusers_swaps(plan_map: Callable, wrap_dispatch: Callable, runtime: str | None,
                    device=None, diffusion=None) -> list[tuple[object, str, Callable]]:
    """``(module, attribute, replacement)`` for every diffusers attribute :func:`allocator.patch` replaces; empty
    where diffusers is not installed.

    Parameters
    ----------
    plan_map : callable
        ``plan_map(model, budgets, mode, *, hf_quantizer, no_split, runtime) -> dict``: the patch's planner.
    wrap_dispatch : callable
        ``wrap_dispatch(dispatch_model) -> dispatch_model`` that attaches the allocator runtime.
    runtime : str or None
        The patch's ``PlanOptions.runtime``.
    device : optional
        The patch's ``offload_device``: ``"stand-in"`` moves the components a pipeline plan moves
        (:mod:`allocator.offload.moved`) onto :class:`allocator.offload.StandInDevice`.
    diffusion : DiffusionBudget or None
        The patch's ``diffusion``: the sizes a pipeline loaded under it is planned at.

    Raises
    ------
    InvalidOption
        ``diffusion`` is not an :class:`allocator.DiffusionBudget`.
    """
    if diffusion is not None and not isinstance(diffusion, DiffusionBudget):
        raise InvalidOption(f"patch(diffusion=...) takes an allocator.DiffusionBudget, got {type(diffusion).__name__}"
                            "; e.g. allocator.DiffusionBudget(1024, 1024).")
    swaps = []
    for name in MODEL_NAMESPACES:
        module = optional_import(name)
        if module is None or not hasattr(module, "_determine_device_map"):
            continue
        swaps.append((module, "_determine_device_map",
                      _determine_device_map(module._determine_device_map, plan_map)))
        if runtime == "allocator" and hasattr(module, "dispatch_model"):
            swaps.append((module, "dispatch_model", wrap_dispatch(module.dispatch_model)))
    return swaps + pipeline_swaps(plan_pipeline, device, diffusion)


def _determine_device_map(original: Callable, plan_map: Callable) -> Callable:
    """diffusers' ``_determine_device_map``, planning the string modes with the patch's planner."""
    from accelerate.utils import get_max_memory

    def _determine_device_map(model, device_map, max_memory, torch_dtype, keep_in_fp32_modules=(),
                              hf_quantizer=None):
        if not (isinstance(device_map, str) and device_map in MODES):
            return original(model, device_map, max_memory, torch_dtype, keep_in_fp32_modules, hf_quantizer)
        if PINNED:   # a pipeline component planned by allocator.plan_pipeline
            return dict(PINNED[-1])
        budgets = user_budgets(get_max_memory, max_memory, device_map)
        given = dict(max_memory) if isinstance(max_memory, Mapping) else max_memory   # theirs converts in place
        theirs = baseline_map(lambda: original(model, device_map, given, torch_dtype, list(keep_in_fp32_modules),
                                               hf_quantizer), model, "diffusers' own _determine_device_map")
        special = _special_dtypes(model, torch_dtype, keep_in_fp32_modules, hf_quantizer)
        target = torch_dtype if hf_quantizer is None else hf_quantizer.adjust_target_dtype(torch_dtype)
        return plan_map(model, budgets, device_map, hf_quantizer=hf_quantizer,
                        no_split=model._get_no_split_modules(device_map),
                        runtime={"loader": "accelerate", "baseline": theirs, "dtype": target,
                                 "special_dtypes": special or None})

    _determine_device_map.__doc__ = (f"allocator's replacement of {getattr(original, '__module__', '?')}"
                                     "._determine_device_map: plans string device maps with allocator.plan "
                                     "(see allocator.integrations.diffusers).")
    _determine_device_map.__allocator_original__ = original
    return _determine_device_map


def _special_dtypes(model, torch_dtype, keep_in_fp32_modules, hf_quantizer) -> dict:
    """The tensors diffusers loads in another dtype than ``torch_dtype``, as its ``_determine_device_map`` lists them
    (0.42: the quantizer's, then float32 for ``keep_in_fp32_modules``, matched as substrings of the name)."""
    import torch

    special = {}
    if hf_quantizer is not None:
        special.update(hf_quantizer.get_special_dtypes_update(model, torch_dtype))
    special.update({name: torch.float32 for name, _ in model.named_parameters()
                    if any(m in name for m in keep_in_fp32_modules)})
    return special


# -- pipelines ----------------------------------------------------------------------------------------------------

def pipeline_swaps(plan_pipeline: Callable, device=None, diffusion=None) -> list[tuple[object, str, Callable]]:
    """``(module, attribute, replacement)`` for ``DiffusionPipeline.from_pretrained(device_map="balanced")``:
    ``_get_final_device_map`` (component -> device) from :func:`allocator.plan_pipeline`, and ``load_sub_model``
    giving a component with a map of its own that map, and a component the plan moves (``execution[name] ==
    "moved"``) a hook that moves it onto ``runs_on[name]`` when it runs (:mod:`allocator.offload.moved`; onto
    :class:`allocator.offload.StandInDevice` where ``device == "stand-in"``). Both functions are imported by name
    into ``diffusers.pipelines.pipeline_utils`` (0.42). The pipeline is planned as ``"balanced"`` asks (components
    spread over the GPUs, ``plan_pipeline(balanced=True)``) at the sizes of ``diffusion`` (a
    :class:`allocator.DiffusionBudget`; ``None``: the pipeline's default size)."""
    module = optional_import("diffusers.pipelines.pipeline_utils")
    if module is None or not all(hasattr(module, n) for n in ("_get_final_device_map", "load_sub_model")):
        return []
    own = Loading(device)   # what the pipeline being loaded gets: maps of its own, moves
    return [(module, "_get_final_device_map", _final_device_map(module._get_final_device_map, plan_pipeline, own,
                                                                 diffusion)),
            (module, "load_sub_model", _load_sub_model(module.load_sub_model, own))]


PINNED: list = []
"""The map of the component being loaded by :func:`_load_sub_model` (at most one): diffusers' ``_determine_device_map``
replacement returns it for that load. Process-global, as the patch is."""


class Loading:
    """What the pipeline being loaded gets from its plan, beyond the one device diffusers gives each component.

    Attributes
    ----------
    maps : dict
        Component -> (its own map, the budgets it was planned over).
    moved : dict
        Component -> the device it is moved onto when it runs (it loads on the CPU).
    on_cpu : set
        Components computed on the CPU, where they live.
    moves : ModelMoves or None
        The moves of this pipeline's components, made at its first moved component.
    """

    def __init__(self, device=None):
        self.device = device
        self.maps: dict = {}
        self.moved: dict = {}
        self.on_cpu: set = set()
        self.moves: ModelMoves | None = None

    def start(self, plan) -> dict:
        """Read ``plan`` (a :class:`allocator.PipelinePlan`); return component -> the one device diffusers loads it
        on (a moved component: the CPU, where it lives)."""
        self.clear()
        execution, runs_on = getattr(plan, "execution", {}), getattr(plan, "runs_on", {})
        for name, where in plan.components.items():
            if isinstance(where, Mapping):
                self.maps[name] = (dict(where), dict(plan.given[name]))
            elif execution.get(name) == "moved":
                self.moved[name] = runs_on[name]
            elif execution.get(name) == "cpu":
                self.on_cpu.add(name)
        if self.moved:
            log.info("diffusers' pipeline loading gives a component one device; %s live in RAM and are moved whole "
                     "onto the device they run on when they run, by allocator.offload.moved",
                     {n: d for n, d in self.moved.items()})
        return {n: ("cpu" if n in self.moved else w) for n, w in plan.components.items()
                if not isinstance(w, Mapping)}

    def clear(self) -> None:
        """Nothing planned: the pipeline being loaded is diffusers' own business."""
        self.maps.clear()
        self.moved.clear()
        self.on_cpu.clear()
        self.moves = None

    @property
    def in_ram(self) -> set:
        """Components loaded in RAM with no map: moved, or computed on the CPU."""
        return set(self.moved) | self.on_cpu

    def loaded(self, name: str, component):
        """``component`` (loaded in RAM) with its hooks: a :class:`MoveHook`, or :func:`compute_on_cpu`'s."""
        if component is None:
            return component
        if self.moves is None:   # one per pipeline: which moved component is on each device
            self.moves = ModelMoves(StandInDevice() if self.device == "stand-in" else None)
        if name in self.on_cpu:
            compute_on_cpu(name, component, self.moves.device)
        else:
            self.moves.add(name, component, self.moved[name])
        return component


def _final_device_map(original: Callable, plan_pipeline: Callable, own: Loading, diffusion=None) -> Callable:
    def _get_final_device_map(device_map, pipeline_class, passed_class_obj, init_dict, library, max_memory,
                              **kwargs):
        own.clear()
        folder, dtype = kwargs.get("cached_folder"), kwargs.get("dtype")
        if device_map != "balanced" or passed_class_obj or isinstance(dtype, Mapping) or folder is None:
            return original(device_map, pipeline_class, passed_class_obj, init_dict, library, max_memory, **kwargs)
        from accelerate.utils import get_max_memory

        result = plan_pipeline(folder, get_max_memory(dict(max_memory) if max_memory else None), dtype=dtype,
                               budget=diffusion, balanced=True)
        if not result.valid or not any(isinstance(d, int) for d in result.budgets):
            log.warning("allocator.plan_pipeline finds no valid placement for %s (%s); diffusers' own placement is "
                        "used", pipeline_class.__name__, result.explain())
            return original(device_map, pipeline_class, passed_class_obj, init_dict, library, max_memory, **kwargs)
        log.info("%s", result.explain())
        return own.start(result)

    _get_final_device_map.__allocator_original__ = original
    return _get_final_device_map


def _load_sub_model(original: Callable, own: Loading) -> Callable:
    """diffusers' ``load_sub_model``; a component with a map of its own is loaded with ``device_map="auto"`` and the
    budgets it was planned over: diffusers' pipeline loading passes one device per component (``{"": device}``,
    and a dict without ``""`` fails in ``load_sub_model``), so the mode goes through ``from_pretrained`` to the
    patched planner; a diffusers component gets exactly the map planned (:data:`PINNED`), a transformers one the
    patch's plan over the same budgets. A moved component, or one computed on the CPU, is loaded in RAM without a map
    and given its hooks (:meth:`Loading.loaded`): diffusers loads a component dealt ``{"": "cpu"}`` with hooks that
    copy it whole onto GPU 0 at every call and drop it after (``load_sub_model``, ``dispatch_model(force_hooks=True,
    main_device=0)``), which is neither where the plan computes it nor how long it stays there."""

    def load_sub_model(*args, **kwargs):
        name = kwargs.get("name")
        if name in own.in_ram:   # into RAM with no hooks: diffusers' {"": "cpu"} would stream it onto GPU 0 per call
            return own.loaded(name, original(*args, **{**kwargs, "device_map": None}))
        if name not in own.maps:
            return original(*args, **kwargs)
        device_map, budgets = own.maps[name]
        PINNED.append(device_map)
        try:
            return original(*args, **{**kwargs, "device_map": "auto", "max_memory": budgets})
        finally:
            PINNED.clear()

    load_sub_model.__allocator_original__ = original
    return load_sub_model
