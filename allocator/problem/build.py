"""The placement problem: the model graph, the budgets and the options, built once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..budgets import Budgets, canonical, parse_budgets
from ..profile import Profile
from ..errors import InvalidOption, warn_caller
from ..model.flops import FlopCount, count_flops, default_inputs, node_flops
from ..model.generation import GenerationNeeds, generation_needs
from ..gc_pause import gc_paused
from ..model import ModelGraph, build_graph
from ..model.expert_profile import ExpertProfile
from ..model.experts import MoELayer
from ..model.families import family_of
from ..model.split import LayerSplit, find_splits
from ..model.read import ModelIdentity, identify
from ..memo import Derived
from ..placement import clean_device_map
from .options import PlanOptions
from .slices import (SLICES, CostOptions, DecideOptions, PlaceOptions, ReadOptions,
                     RuntimeOptions)

__all__ = ["absent_accelerators", "accelerators_up_to", "present_budgets", "Problem", "build_problem",
           "step_problem", "decode_inputs", "quantizer_size_fn"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Problem:
    """A model graph, ordered device budgets with their bandwidth profile, and the options.

    Strategies read it and return a placement. What is derived from it (accelerate's own map, the contract's
    floor, the last maps checked and priced) is kept in :attr:`derived` and goes with it.
    """

    graph: ModelGraph
    budgets: Budgets
    options: PlanOptions = field(default_factory=PlanOptions)
    profile: Profile = field(default_factory=Profile)
    """The bandwidths used (``options.profile``, or the documented defaults)."""
    generation: GenerationNeeds | None = None
    """What a generation budget adds (already folded into ``graph``; kept for reports)."""
    flops: FlopCount | None = None
    """The FLOPs counted at ``options.inputs`` (``None`` without inputs; kept for reports, complete or not)."""
    node_flops: tuple[int, ...] | None = None
    """Exclusive FLOPs per graph node, from :attr:`flops` where that count is complete; ``None`` otherwise, and the
    cost model's compute term is ``2 · params · tokens``."""
    steps: Mapping[str, FlopCount] = field(default_factory=dict)
    """The counts of each forward (:data:`STEPS`) where they were made: ``"prefill"`` at ``inputs``, and with a
    generation budget ``"decode"`` (:func:`step_problem`). :attr:`flops` is the one ``options.optimize`` names."""
    moe: tuple[MoELayer, ...] = ()
    """The mixture-of-experts layers (the model family's ``experts`` hook, by default
    :func:`allocator.model.experts.find_experts`), read only with
    ``runtime="allocator"``: under accelerate's hooks experts move with their module, so plans never look at them."""
    expert_profile: ExpertProfile | None = None
    """``options.expert_profile``, loaded; ``None`` assumes uniform use."""
    splits: tuple[LayerSplit, ...] = ()
    """The no-split layers our runtime may run split, attention side apart from MLP side
    (:func:`allocator.model.split.find_splits`), read only with ``runtime="allocator"`` and ``split_layers``:
    accelerate's hooks run each layer on one device, so their plans never look at them."""
    identity: ModelIdentity | None = None
    """The model the problem was built for (class, parameters, a digest of its tensors' names and shapes,
    :func:`allocator.model.read.identify`), as a saved plan records it."""
    derived: Derived = field(default_factory=Derived, init=False, repr=False, compare=False)
    """Values that follow from this problem, made once (:class:`allocator.memo.Derived`)."""
    reading: ReadOptions = field(init=False, repr=False, compare=False)
    """How the model was read (:mod:`allocator.problem.slices`: each slice made once from :attr:`options`; the
    layers below the composition read their slice, never :attr:`options`)."""
    placing: PlaceOptions = field(init=False, repr=False, compare=False)
    """The loading path, offloaded buffers, accelerate's fallback, cleaning."""
    deciding: DecideOptions = field(init=False, repr=False, compare=False)
    """The objective (``deciding.contract``), ``strict``, the baseline."""
    cost: CostOptions = field(init=False, repr=False, compare=False)
    """How plans are priced: the profile as given, the inputs, the forward priced."""
    runtime: RuntimeOptions = field(init=False, repr=False, compare=False)
    """What streams offloaded weights (``runtime.name``), prefetch, the expert cache and profile."""

    def __post_init__(self):
        for name, kind in SLICES.items():   # once per problem: a replace() with other options makes new ones
            object.__setattr__(self, name, kind.of(self.options))

    def with_options(self, **changes) -> Problem:
        """This problem with ``changes`` to its options (:meth:`PlanOptions.of`) and their slices made anew; what
        was built from the options (the graph, the FLOP counts) is kept as built, so change only what decides, costs
        or runs a plan (``objective``, ``prefetch``)."""
        return dataclasses.replace(self, options=PlanOptions.of(self.options, **changes))

    @property
    def read_copies(self) -> bool:
        """Whether streamed chains count the copies hooks read cast tensors into
        (:func:`allocator.rules.dispatch.read_copy`):
        where the CPU is the only device that can be main (no accelerator budget) and ``dtype`` casts some tensor.
        With an accelerator main the copy is made in host RAM or on the accelerator by path; it is not counted."""
        return bool(self.graph.stored) and not self.budgets.accelerators

    def cleaned(self, device_map: Mapping) -> dict:
        """``device_map`` as the options say to return it: entries whose children share a device merged
        (:func:`allocator.placement.clean_device_map`) under ``clean_result``, else as it is (a new dict)."""
        return clean_device_map(device_map) if self.placing.clean_result else dict(device_map)


def quantizer_size_fn(model, hf_quantizer):
    """A ``size_fn`` from a transformers ``HfQuantizer`` (its ``param_element_size``), or ``None``."""
    if hf_quantizer is None or not hasattr(hf_quantizer, "param_element_size"):
        return None

    def size(name, tensor):
        if not getattr(tensor, "is_floating_point", lambda: False)():
            return None
        return int(tensor.numel() * hf_quantizer.param_element_size(model, name, tensor))

    return size


def absent_accelerators(devices) -> list:
    """The accelerators among ``devices`` (budget keys as :func:`allocator.budgets.canonical` spells them) that this
    process cannot reach now: an index at or above the count of visible accelerators, ``"mps"`` where MPS is not
    available. A broken driver counts as none present.

    >>> absent_accelerators(["cpu", "disk"])
    []
    """
    try:
        import torch

        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "device_count"):
            present = torch.accelerator.device_count()
        else:
            present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    except Exception:  # a broken driver: planning does not need it
        present, mps = 0, False
    return [d for d in devices if (isinstance(d, int) and d >= present) or (d == "mps" and not mps)]


def present_budgets(budgets: Mapping) -> dict:
    """``budgets`` without the accelerators this process cannot reach at load time
    (:func:`allocator.problem.absent_accelerators`), with one warning naming them: a load that works unpatched (where
    transformers' map leaves them empty) never fails under the patch. A copy; the caller's dict is not changed."""
    absent = absent_accelerators([canonical(d) for d in budgets])
    if not absent:
        return dict(budgets)
    warn_caller(f"max_memory names accelerator(s) {absent} that this machine does not have at load time; allocator "
                f"plans without them (a map that used them could not be loaded here). Leave them out of max_memory "
                f"to silence this, or plan for another machine with allocator.plan().")
    return {d: size for d, size in budgets.items() if canonical(d) not in absent}


def _note_missing_accelerators(budgets: Budgets) -> None:
    """Plans may target another machine (accelerate's own tests plan for GPUs on CPU-only hosts): say so, once. The
    loaders under :func:`allocator.patch` leave such devices out, with a warning, before planning."""
    missing = absent_accelerators(budgets.accelerators)
    if missing:
        log.info("planning for accelerators %s that this machine does not have; the plan is for a machine that has "
                 "them, and dispatching it here will fail", missing)


def build_problem(model, max_memory: Mapping | None = None, *, options: PlanOptions | None = None,
                  **keywords) -> Problem:
    """Build the :class:`Problem` once: introspect the model, parse budgets, check options.

    ``options`` (a :class:`PlanOptions`) says how the model is read and the plan run; ``keywords`` are its fields,
    given one by one (they override those of ``options``). With a ``generation`` budget the graph also holds the KV
    cache, logits and activations of ``generate`` (:mod:`allocator.model.generation`). An ``hf_quantizer`` supplies
    sizes (``param_element_size``) and may shrink budgets (``adjust_max_memory``) as transformers does. Nothing given is
    modified.

    Examples
    --------
    >>> import torch.nn as nn
    >>> p = build_problem(nn.Linear(4, 4), {"cpu": 100})
    >>> p.graph.total, p.budgets.order
    (80, ('cpu', 'disk'))
    """
    options = PlanOptions.of(options, **keywords)
    identity = identify(model)
    if options.dtype is None and identity.dtype is not None:   # resolved once: what the plan counts, and records
        options = dataclasses.replace(options, dtype=identity.dtype)
    size_fn = options.size_fn if options.size_fn is not None else quantizer_size_fn(model, options.hf_quantizer)
    family = family_of(model)   # what the model's family adds: no-split classes, ties, cache layers, experts
    with gc_paused():  # the graph's records are acyclic: collections while they are built only walk them in vain
        graph = build_graph(
            model, dtype=options.dtype, special_dtypes=options.special_dtypes,
            no_split_module_classes=options.no_split_module_classes, discover_no_split=options.discover_no_split,
            infer_no_split=options.infer_no_split, tied_parameters=options.tied_parameters, size_fn=size_fn,
            declared_as_shared=options.loader == "transformers",   # from_pretrained ties them after it plans
            family=family,
        )
        needs = None
        if options.generation is not None:
            needs = generation_needs(model, graph, options.generation, dtype=options.dtype, family=family)
            graph = dataclasses.replace(graph, extra=needs.node_bytes(), workspace=needs.activations,
                                        main_workspace=needs.scores)
    counted, per_node = _count(model, graph, _inputs(model, options))
    steps = {} if counted is None else {"prefill": counted}
    if counted is not None and needs is not None and "input_ids" in "".join(counted.inputs):
        decode, _ = _count(model, graph, decode_inputs(counted.inputs))
        steps["decode"] = dataclasses.replace(decode, written=_with_cache_reads(decode.written, graph, needs))
    if options.optimize == "decode":
        if "decode" not in steps:
            raise InvalidOption(f"optimize='decode' needs token inputs to count a decoding step; got inputs "
                                f"{dict(counted.inputs)}.")
        counted = steps["decode"]
        per_node = node_flops(counted, graph) if counted.complete else None
    budgets = parse_budgets(max_memory)
    _note_missing_accelerators(budgets)
    quantizer = options.hf_quantizer
    if quantizer is not None and hasattr(quantizer, "adjust_max_memory"):
        adjusted = quantizer.adjust_max_memory(dict(budgets.limits))
        # bytes already (bitsandbytes returns 0.9 x each as a float): with a unit, so no small-bare-number warning
        budgets = parse_budgets({d: f"{int(v)}B" if isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and v == v and abs(v) != float("inf") else v for d, v in adjusted.items()})
    moe = family.experts(model) if options.runtime == "allocator" else ()
    splits = find_splits(model, graph.no_split) if options.runtime == "allocator" and options.split_layers else ()
    expert_profile = options.expert_profile
    if expert_profile is not None and not isinstance(expert_profile, ExpertProfile):
        expert_profile = ExpertProfile.load(expert_profile)
    return Problem(graph=graph, budgets=budgets, options=options, profile=options.profile or Profile(),
                   generation=needs, flops=counted, node_flops=per_node, steps=steps, moe=moe,
                   expert_profile=expert_profile, identity=identity, splits=splits)


def decode_inputs(inputs: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shapes of one decoding step: each ``*input_ids`` (and its ``*attention_mask``) one token long, the rest
    as given.

    >>> decode_inputs({"input_ids": (4, 512), "decoder_input_ids": (4, 64)})
    {'input_ids': (4, 1), 'decoder_input_ids': (4, 1)}
    """
    return {k: (v[0], 1) if ("input_ids" in k or "attention_mask" in k) and len(v) == 2 else tuple(v)
            for k, v in inputs.items()}


def _with_cache_reads(written: Mapping[str, int], graph: ModelGraph, needs: GenerationNeeds) -> dict[str, int]:
    """``written`` plus the KV cache each layer reads at a decoding step: all of it, at the budget's longest context
    (the step that costs most), on the key and value projections that hold it."""
    out = dict(written)
    for node, nbytes in needs.cache.items():
        name = graph.nodes.name[node]
        out[name] = out.get(name, 0) + nbytes
    return out


def accelerators_up_to(problem: Problem, last) -> Problem:
    """``problem`` with the accelerators after ``last`` (in index order) left out of its budgets: the plans of the
    result are plans of ``problem`` that leave those accelerators empty. What follows from the graph is kept.

    >>> import torch.nn as nn
    >>> problem = build_problem(nn.Linear(4, 4), {0: 100, 1: 100, "cpu": 1000})
    >>> accelerators_up_to(problem, 0).budgets.order
    (0, 'cpu', 'disk')
    """
    accelerators = problem.budgets.accelerators
    dropped = set(accelerators[accelerators.index(last) + 1:])
    if not dropped:
        return problem
    order = tuple(d for d in problem.budgets.order if d not in dropped)
    limits = {d: n for d, n in problem.budgets.limits.items() if d not in dropped}
    return dataclasses.replace(problem, budgets=Budgets(order=order, limits=limits))


def step_problem(problem: Problem, step: str) -> Problem:
    """``problem`` priced for ``step`` (one of :data:`STEPS`): its FLOP count swapped for that forward's.

    Raises
    ------
    InvalidOption
        That forward was not counted (no ``inputs``; ``"decode"`` without a generation budget or token inputs).
    """
    if step not in problem.steps:
        raise InvalidOption(f"no count of the {step!r} forward: counted {sorted(problem.steps) or 'none'}; pass "
                            "inputs=..., and generation=GenerationBudget(...) for 'decode'.")
    counted = problem.steps[step]
    if counted is problem.flops:
        return problem
    return dataclasses.replace(problem, flops=counted,
                               node_flops=node_flops(counted, problem.graph) if counted.complete else None)


def _inputs(model, options: PlanOptions):
    """What :attr:`PlanOptions.inputs` counts for ``model``: ``"auto"`` resolved (``"default"`` under
    ``objective="latency"`` where the config gives defaults, else ``None``)."""
    if options.inputs != "auto":
        return options.inputs
    if options.objective != "latency":
        return None
    try:
        default_inputs(model)
    except InvalidOption:
        return None
    return "default"


def _count(model, graph: ModelGraph, inputs) -> tuple[FlopCount | None, tuple[int, ...] | None]:
    """The FLOP count at ``inputs`` and its exclusive FLOPs per node (``None`` where it is incomplete)."""
    if inputs is None:
        return None, None
    counted = count_flops(model, None if isinstance(inputs, str) else inputs)   # None: default_inputs, so marked
    if not counted.complete:
        log.warning("FLOPs at inputs %s are not all counted (%s); the compute term keeps 2 x params x tokens",
                    dict(counted.inputs), counted.reason())
        return counted, None
    log.info("FLOPs counted on the meta device at inputs %s: %.3g", dict(counted.inputs), counted.total)
    return counted, node_flops(counted, graph)
