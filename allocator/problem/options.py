"""What a plan is made with besides the model, the budgets and the strategy: :class:`PlanOptions`, one object the
public API takes, built and checked once. The layers below read it only through the per-concern slices of
:mod:`allocator.problem.slices`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..budgets import normalize_map
from ..errors import InvalidOption
from ..model.expert_profile import ExpertProfile
from ..model.generation import GenerationBudget
from ..profile import Profile
from ..rules.loaders import LOADERS

__all__ = ["OBJECTIVES", "OPTION_NAMES", "Options", "PlanOptions", "RUNTIMES", "STEPS"]

OBJECTIVES = ("contract", "latency")
"""Values of :attr:`PlanOptions.objective`."""
STEPS = ("prefill", "decode")
"""Values of :attr:`PlanOptions.optimize`: the forward that objectives price."""

RUNTIMES = ("accelerate", "allocator")
"""Values of :attr:`PlanOptions.runtime`: what streams offloaded weights (accelerate's hooks, or
:mod:`allocator.offload`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """Everything a plan is made with besides the model, the budgets and the strategy: one object, built and checked
    once, read by :func:`allocator.plan`, :func:`allocator.infer_auto_device_map`, :func:`allocator.validate`,
    :func:`build_problem` and :func:`allocator.patch` (each also takes these fields as keywords).

    Examples
    --------
    >>> options = PlanOptions(offload_buffers=True, objective="latency")
    >>> options.contract
    False
    >>> PlanOptions(objective="fastest")
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidOption: objective must be one of ['contract', 'latency'], got 'fastest'.
    """

    # how the model is read
    no_split_module_classes: Iterable[str] | str | None = None
    """Module classes never split across devices, united with ``_no_split_modules`` of the model and every
    sub-model."""
    dtype: object = None
    """The dtype weights will be loaded in (``torch.float16``, ``"bfloat16"``); the model's own when ``None``, which
    :func:`build_problem` resolves to that dtype where the model's floating tensors share one (``Problem.options.dtype``
    and a saved plan's ``options.dtype`` then name it; ``None`` stays only for a model of several floating dtypes)."""
    special_dtypes: Mapping | None = None
    """Per-tensor dtypes overriding ``dtype`` (accelerate's argument)."""
    tied_parameters: Sequence[Sequence[str]] | None = None
    """Tie groups to use instead of the ones found from shared tensors."""
    hf_quantizer: object = None
    """transformers' ``HfQuantizer``: sizes of quantized weights (``param_element_size``), budgets it shrinks."""
    size_fn: Callable | None = None
    """``size_fn(name, tensor) -> bytes or None``: the size of a tensor as loaded (``None``: the usual rule)."""
    discover_no_split: bool = True
    """Collect ``_no_split_modules`` from every sub-model, not only the root's."""
    infer_no_split: bool = True
    """When nothing is declared, keep the model's repeated blocks whole (logged)."""
    # how the plan will run
    offload_buffers: bool = False
    """Buffers of offloaded modules are offloaded too (else they live on the main device)."""
    fallback_allocation: bool = False
    """accelerate's BFS fallback when a device would stay empty (``sequential`` only)."""
    clean_result: bool = True
    """Merge map entries whose children all share one device."""
    profile: Profile | str | os.PathLike | None = None
    """Bandwidths of the machine the plan will run on (:meth:`allocator.Profile.measure`), or the path of a JSON
    file that holds them (``allocator profile --out FILE``), loaded once here (:meth:`allocator.Profile.load`);
    documented defaults when ``None``."""
    generation: GenerationBudget | None = None
    """Room for ``generate`` (KV cache, logits, activations) on the devices where they live."""
    loader: str = "transformers"
    """The loading path the map is for, one of :data:`allocator.rules.loaders.LOADERS`: ``"transformers"`` (the default:
    ``from_pretrained(device_map=...)``, what :func:`allocator.patch` plans for it) or ``"accelerate"``
    (``load_checkpoint_and_dispatch`` / ``dispatch_model``). They load weights differently, so some maps work on one
    path only (:mod:`allocator.rules`)."""
    runtime: str = "accelerate"
    """What streams the offloaded weights at each forward, one of :data:`RUNTIMES`: ``"accelerate"`` (its hooks, one
    module's weights at a time) or ``"allocator"`` (:func:`allocator.offload.attach`, which makes the next
    ``prefetch`` offloaded modules' weights ready while one runs). The plan reserves what the runtime holds."""
    prefetch: int | None = None
    """With ``runtime="allocator"``: offloaded modules made ready ahead of the running one (0: none). The main device
    then keeps room for the streamed chain plus the ``prefetch`` largest offloaded modules
    (:func:`allocator.evaluate.memory.prefetch_reserve`); ignored with ``runtime="accelerate"``. ``None`` (the
    default): :func:`allocator.plan` chooses the depth, up to :data:`allocator.evaluate.memory.PLANNED_PREFETCH`:
    the deepest that keeps the placement of the plan without prefetch, and 0 on a CPU main device unless a measured
    ``profile`` is given. A depth given here is planned as given."""
    expert_cache: int = 0
    """With ``runtime="allocator"`` on a mixture of experts: slots on the main device for a cache of recently routed
    experts (least recently used out first; :mod:`allocator.offload.expert_cache`), each the size of the largest
    expert. Its bytes are part of the main device's peak and come out of the room the plan would give resident
    experts (the least used per byte), never out of the parts that run for every token. 0 (the default): no cache;
    the plan is the one without this option."""
    split_layers: bool = True
    """With ``runtime="allocator"``, an accelerator as main device and a ``generation`` budget: a decoder layer may
    be split into its attention side (with its KV cache, norms, and in a mixture of experts the router and shared
    experts) and its MLP (:func:`allocator.model.split.find_splits`), each on a device of its own, where the estimated
    decoding step is faster for it (:mod:`allocator.strategies.split`). ``False``: layers stay whole, as under
    accelerate's hooks (which never split them)."""
    expert_profile: ExpertProfile | str | os.PathLike | None = None
    """With ``runtime="allocator"`` on a mixture of experts: how often each expert is routed on the user's data
    (:func:`allocator.profile_experts`, or the path of a profile it saved); the most used experts per byte stay
    resident. ``None``: every expert of a layer is assumed equally used."""
    inputs: Mapping | str | None = "auto"
    """The inputs of one forward, as shapes (``{"input_ids": (1, 512)}``, ``{"pixel_values": (1, 3, 512, 512)}``) or
    tensors, or ``"default"`` for :func:`allocator.model.flops.default_inputs` of the model's config. The problem
    builder then counts FLOPs per module on the meta device (:func:`allocator.model.flops.count_flops`) and the cost
    model's compute term uses them instead of ``2 · params · tokens``; where the count is incomplete (the forward fails
    on meta, an op has no FLOP formula, more than :data:`allocator.model.flops.MAX_OPS` ops) it keeps that rule, and
    logs why. ``None``: nothing is counted. ``"auto"`` (the default): ``"default"`` where the estimate alone decides
    (``objective="latency"``) and the config gives defaults, else ``None`` (under the contract the estimate only ranks
    plans that keep it, and counting adds 0.1-1 s to a plan)."""
    # what decides
    objective: str = "contract"
    """What decides between valid plans. ``"contract"`` (the default): only plans that keep what every
    ``device_map="auto"`` user relies on (:mod:`allocator.judge.contract`: the first accelerator that can hold
    anything is the main device, accelerators used in index order, never fewer bytes on them than accelerate's own
    valid map), ranked by the cost model among themselves. ``"latency"``: the cost model's estimate alone decides,
    over every device that could be main (the CPU included) and in any order of accelerators."""
    optimize: str = "prefill"
    """Which forward the objectives price, one of :data:`STEPS`: ``"prefill"`` (the default: one forward at
    ``inputs``) or ``"decode"`` (one decoding step of ``generate``: one token per sequence, counted at ``inputs`` with
    each ``*input_ids`` one token long, plus reading the whole KV cache of the ``generation`` budget where its layers
    execute). ``"decode"`` needs ``inputs`` and ``generation``."""
    strict: bool = False
    """Where no valid plan exists: ``False`` returns accelerate's own map, flagged, as ``device_map="auto"`` would;
    ``True`` raises :class:`allocator.InfeasiblePlacement` with the smallest budget that works."""
    baseline: Mapping | None = None
    """The device map the user gets today on the loading path the plan is for, where it is not accelerate's
    ``infer_auto_device_map`` on this model: on ``from_pretrained``, the map transformers' own ``_get_device_map``
    returns (:func:`allocator.patch` passes it). Where it is valid, rule 3 of the contract keeps at least its bytes on
    the fastest tier and streams no more per forward, and it is a candidate plan. ``None``: accelerate's map
    (``sequential``) is the baseline."""

    def __post_init__(self):
        for name in ("discover_no_split", "infer_no_split", "offload_buffers", "fallback_allocation", "clean_result",
                     "strict", "split_layers"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidOption(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.loader not in LOADERS:
            raise InvalidOption(f"loader must be one of {list(LOADERS)}, got {self.loader!r}.")
        if self.baseline is not None:   # a copy in canonical devices: the caller's dict is never changed
            object.__setattr__(self, "baseline", normalize_map(self.baseline))
        if self.runtime not in RUNTIMES:
            raise InvalidOption(f"runtime must be one of {list(RUNTIMES)}, got {self.runtime!r}.")
        if self.expert_profile is not None and not isinstance(self.expert_profile, (ExpertProfile, str, os.PathLike)):
            raise InvalidOption(f"expert_profile must be an allocator.ExpertProfile or the path of one it saved, got "
                                f"{type(self.expert_profile).__name__}.")
        if self.prefetch is not None and (not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool)
                                          or self.prefetch < 0):
            raise InvalidOption(f"prefetch must be a non-negative integer (offloaded modules made ready ahead), got "
                                f"{self.prefetch!r}.")
        if not isinstance(self.expert_cache, int) or isinstance(self.expert_cache, bool) or self.expert_cache < 0:
            raise InvalidOption(f"expert_cache must be a non-negative integer (expert slots on the main device), got "
                                f"{self.expert_cache!r}.")
        if self.objective not in OBJECTIVES:
            raise InvalidOption(f"objective must be one of {list(OBJECTIVES)}, got {self.objective!r}.")
        if isinstance(self.profile, (str, os.PathLike)):
            object.__setattr__(self, "profile", Profile.load(self.profile))   # once: a replace() keeps the Profile
        if self.profile is not None and not isinstance(self.profile, Profile):
            raise InvalidOption(f"profile must be an allocator.Profile or the path of one, got "
                                f"{type(self.profile).__name__}.")
        if self.generation is not None and not isinstance(self.generation, GenerationBudget):
            raise InvalidOption(f"generation must be an allocator.GenerationBudget, got "
                                f"{type(self.generation).__name__}.")
        if self.inputs is not None and not (self.inputs in ("auto", "default") if isinstance(self.inputs, str) else
                                            isinstance(self.inputs, Mapping) and bool(self.inputs)
                                            and all(isinstance(k, str) for k in self.inputs)):
            raise InvalidOption(f"inputs must map forward argument names to shapes or tensors, or be 'default' or "
                                f"'auto', got {self.inputs!r}; e.g. inputs={{'input_ids': (1, 512)}}.")
        if self.optimize not in STEPS:
            raise InvalidOption(f"optimize must be one of {list(STEPS)}, got {self.optimize!r}.")
        if self.optimize == "decode" and (self.inputs in (None, "auto") or self.generation is None):
            raise InvalidOption("optimize='decode' prices one decoding step: it needs inputs (e.g. "
                                "inputs={'input_ids': (1, 512)} or 'default') and generation=GenerationBudget(...).")
        if self.size_fn is not None and not callable(self.size_fn):
            raise InvalidOption(f"size_fn must be callable as size_fn(name, tensor), got {self.size_fn!r}.")

    @classmethod
    def of(cls, options: PlanOptions | None = None, **changes) -> PlanOptions:
        """``options`` (the defaults when ``None``) with ``changes``; unknown names raise :class:`InvalidOption`."""
        if options is not None and not isinstance(options, PlanOptions):
            raise InvalidOption(f"options must be an allocator.PlanOptions, got {type(options).__name__}.")
        unknown = sorted(set(changes) - set(OPTION_NAMES))
        if unknown:
            raise InvalidOption(f"unknown options {unknown}; choose from {list(OPTION_NAMES)} (allocator.PlanOptions).")
        if options is None:
            return cls(**changes)
        return dataclasses.replace(options, **changes) if changes else options

    @property
    def contract(self) -> bool:
        """Whether plans must keep accelerate's conventions (``objective="contract"``)."""
        return self.objective == "contract"


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlanOptions))
"""The fields of :class:`PlanOptions`, in order."""

Options = PlanOptions
"""The name :class:`PlanOptions` had before it held every option (kept for callers of ``allocator.Options``)."""

