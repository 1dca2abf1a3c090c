"""The placement problem: the model graph, the budgets and the options, built once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .budgets import Budgets, parse_budgets
from .cost_profile import Profile
from .errors import InvalidOption
from .generation import GenerationBudget, GenerationNeeds, generation_needs
from .gc_pause import gc_paused
from .graph import ModelGraph, build_graph

__all__ = ["OBJECTIVES", "Options", "Problem", "build_problem"]

log = logging.getLogger(__name__)

OBJECTIVES = ("contract", "latency")
"""Values of :attr:`Options.objective`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """How a plan will be run and reported."""

    offload_buffers: bool = False
    """Buffers of offloaded modules are offloaded too (else they live on the main device)."""
    fallback_allocation: bool = False
    """accelerate's BFS fallback when a device would stay empty (``sequential`` only)."""
    clean_result: bool = True
    """Merge map entries whose children all share one device."""
    objective: str = "contract"
    """What decides between valid plans. ``"contract"`` (the default): only plans that keep what every
    ``device_map="auto"`` user relies on (:mod:`allocator.contract`: the first accelerator that can hold anything is
    the main device, accelerators used in index order, never fewer bytes on them than accelerate's own valid map),
    ranked by the cost model among themselves. ``"latency"``: the cost model's estimate alone decides, over every
    device that could be main (the CPU included) and in any order of accelerators."""

    def __post_init__(self):
        for name in ("offload_buffers", "fallback_allocation", "clean_result"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidOption(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.objective not in OBJECTIVES:
            raise InvalidOption(f"objective must be one of {list(OBJECTIVES)}, got {self.objective!r}.")

    @property
    def contract(self) -> bool:
        """Whether plans must keep accelerate's conventions (``objective="contract"``)."""
        return self.objective == "contract"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Problem:
    """A model graph, ordered device budgets with their bandwidth profile, and options.

    Strategies read it and return a placement.
    """

    graph: ModelGraph
    budgets: Budgets
    options: Options
    profile: Profile = field(default_factory=Profile)
    generation: GenerationNeeds | None = None
    """What a generation budget adds (already folded into ``graph``; kept for reports)."""


def quantizer_size_fn(model, hf_quantizer):
    """A ``size_fn`` from a transformers ``HfQuantizer`` (its ``param_element_size``), or ``None``."""
    if hf_quantizer is None or not hasattr(hf_quantizer, "param_element_size"):
        return None

    def size(name, tensor):
        if not getattr(tensor, "is_floating_point", lambda: False)():
            return None
        return int(tensor.numel() * hf_quantizer.param_element_size(model, name, tensor))

    return size


def _note_missing_accelerators(budgets: Budgets) -> None:
    """Plans may target another machine (accelerate's own tests plan for GPUs on CPU-only hosts): say so, once."""
    indices = [d for d in budgets.accelerators if isinstance(d, int)]
    if not indices:
        return
    try:
        import torch

        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver: planning does not need it
        present = 0
    missing = [d for d in indices if d >= present]
    if missing:
        log.info("planning for accelerators %s that this machine does not have (it has %d); the plan is for a machine "
                 "that has them, and dispatching it here will fail", missing, present)


def build_problem(
    model,
    max_memory: Mapping | None = None,
    *,
    no_split_module_classes: Iterable[str] | str | None = None,
    dtype=None,
    special_dtypes: Mapping | None = None,
    tied_parameters: Sequence[Sequence[str]] | None = None,
    hf_quantizer=None,
    size_fn=None,
    discover_no_split: bool = True,
    infer_no_split: bool = True,
    profile: Profile | None = None,
    generation: GenerationBudget | None = None,
    **options,
) -> Problem:
    """Build the :class:`Problem` once: introspect the model, parse budgets, check options.

    ``generation`` (a :class:`allocator.GenerationBudget`) adds the KV cache, logits and activations of ``generate``
    to the graph (:mod:`allocator.generation`). ``options`` are the fields of :class:`Options`. ``hf_quantizer``
    supplies sizes (``param_element_size``) and may shrink budgets (``adjust_max_memory``) as transformers does.
    Nothing given is modified.

    Examples
    --------
    >>> import torch.nn as nn
    >>> p = build_problem(nn.Linear(4, 4), {"cpu": 100})
    >>> p.graph.total, p.budgets.order
    (80, ('cpu', 'disk'))
    """
    if size_fn is None:
        size_fn = quantizer_size_fn(model, hf_quantizer)
    with gc_paused():  # the graph's records are acyclic: collections while they are built only walk them in vain
        graph = build_graph(
            model, dtype=dtype, special_dtypes=special_dtypes, no_split_module_classes=no_split_module_classes,
            discover_no_split=discover_no_split, infer_no_split=infer_no_split, tied_parameters=tied_parameters,
            size_fn=size_fn,
        )
        needs = None
        if generation is not None:
            needs = generation_needs(model, graph, generation, dtype=dtype)
            graph = dataclasses.replace(graph, extra=needs.node_bytes(), workspace=needs.activations,
                                        main_workspace=needs.scores)
    budgets = parse_budgets(max_memory)
    _note_missing_accelerators(budgets)
    if hf_quantizer is not None and hasattr(hf_quantizer, "adjust_max_memory"):
        adjusted = hf_quantizer.adjust_max_memory(dict(budgets.limits))
        # bytes already (bitsandbytes returns 0.9 x each as a float): with a unit, so no small-bare-number warning
        budgets = parse_budgets({d: f"{int(v)}B" if isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and v == v and abs(v) != float("inf") else v for d, v in adjusted.items()})
    if profile is not None and not isinstance(profile, Profile):
        raise InvalidOption(f"profile must be an allocator.Profile, got {type(profile).__name__}.")
    return Problem(graph=graph, budgets=budgets, options=Options(**options), profile=profile or Profile(),
                   generation=needs)
