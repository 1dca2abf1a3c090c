"""Make transformers' ``from_pretrained(device_map="auto")`` and accelerate's ``load_checkpoint_and_dispatch`` plan
with :func:`allocator.plan`. :func:`patch` swaps the module attributes through which those two entry points turn a
*string* ``device_map`` into a dict; everything else (loading, offloading, hooks) stays theirs. Only attributes that
exist in the installed versions are touched:

- ``transformers.integrations.accelerate._get_device_map`` and ``transformers.modeling_utils._get_device_map``
  (transformers 5: ``modeling_utils`` imports the function by name and ``from_pretrained`` calls it there);
- ``transformers.modeling_utils.get_balanced_memory`` and ``.infer_auto_device_map`` (transformers 4, which imports
  accelerate's functions into ``modeling_utils`` and calls them from ``from_pretrained``);
- ``accelerate.big_modeling.get_balanced_memory`` and ``.infer_auto_device_map`` (``load_checkpoint_and_dispatch``
  calls them from that namespace);
- in every other loaded library (and each imported later), each attribute that *is* accelerate's
  ``get_balanced_memory`` or ``infer_auto_device_map`` (``dispatch_model`` too under ``runtime="allocator"``), found
  by identity (:func:`allocator.integrations.library.bound_by_name`): ``peft.peft_model`` today.

Each replacement plans for the loading path that calls it (``loader="accelerate"`` in ``accelerate.big_modeling``,
``"transformers"`` elsewhere); the library's own map (``library.baseline_map``) stays the library's.

transformers 5's ``_get_device_map(model, device_map, max_memory, hf_quantizer)`` is replaced whole: it sees the
mode and the user's ``max_memory``. In the other namespaces a mode reaches the planner in two calls: the
replacement ``get_balanced_memory`` returns the user's budgets untouched and records the mode; the next
replacement ``infer_auto_device_map`` in that namespace plans for it (no recorded mode: the caller skipped
balancing, which is what ``device_map="sequential"`` does). A model's ``_no_placement_params`` are honoured as
:mod:`allocator.integrations.placement_params` says. The patch rebinds module attributes, so it is process-global:
every thread sees it, and it is not locked.
"""

from __future__ import annotations

import weakref
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ..api import planned
from ..budgets import canonical, is_accelerator
from ..errors import InvalidOption
from ..gc_pause import gc_paused
from ..logs import shown
from ..offload import attach, has_offload_hooks, runtime_of
from ..problem import OPTION_NAMES, PlanOptions, build_problem, present_budgets, quantizer_size_fn
from ..strategies import resolve
from .diffusers import diffusers_swaps
from .ledger import Ledger
from .library import (AfterImport, Unchecked, accelerate_functions, baseline_map, bound_by_name, named,
                      optional_import, unless_baseline, user_budgets)
from .placement_params import leave_out, name_list, tensors_to_escape, without_sizes

__all__ = ["MODE_TO_STRATEGY", "Patch", "patch", "unpatch"]

log = logging.getLogger("allocator.integrations.transformers")

MODE_TO_STRATEGY: dict[str, str | None] = {"auto": None, "balanced": "balanced", "balanced_low_0": "balanced_low_0",
                                           "sequential": "sequential"}
"""String ``device_map`` modes to the strategy that plans them; ``None`` means the strategy given to :func:`patch`.

``"balanced"`` and ``"balanced_low_0"`` are the strategies of those names (:mod:`allocator.strategies.balanced`:
an exact contiguous min-max split over the accelerators, the first one kept light for ``_low_0``) over the budgets the
user gave, not over transformers' balanced budgets. ``"sequential"`` is accelerate's algorithm, output for output.
On ``from_pretrained``, ``"auto"`` over several accelerators: see :func:`patch` (docs/contract.md has the table).
"""

_RESERVED = frozenset({"model", "max_memory", "strategy", "hf_quantizer", "loader"})
_LOADER_OF = {"accelerate.big_modeling": "accelerate"}
"""The loading path whose map each patched namespace builds (:attr:`allocator.PlanOptions.loader`): accelerate's
``load_checkpoint_and_dispatch`` calls ``infer_auto_device_map`` from ``accelerate.big_modeling``; transformers' own
namespaces (``_get_device_map``, transformers 4's ``modeling_utils``) load with ``from_pretrained``."""
_OWN_NAMESPACES = ("accelerate", "allocator")
"""Not searched for accelerate's functions by name: accelerate's public API, which users call, and ours."""
_ACTIVE: list[Patch] = []
"""Live patches, oldest first. Process-global; not locked."""
_AFTER_IMPORT = AfterImport(lambda module: [handle._adopt(module) for handle in list(_ACTIVE)])
"""On ``sys.meta_path`` while a patch is live: a module imported then is searched by each live patch, oldest first."""


@dataclass(frozen=True, slots=True)
class _Swap:
    module: object
    attribute: str
    replacement: Callable

    @property
    def name(self) -> str:
        return f"{self.module.__name__}.{self.attribute}"


class Patch:
    """A live patch made by :func:`patch`: a context manager, and a handle whose :meth:`unpatch` restores.

    Attributes
    ----------
    strategy : str or callable
        Plans ``device_map="auto"`` (see :data:`MODE_TO_STRATEGY` for the other modes).
    options : PlanOptions
        What :func:`allocator.plan` is given for every map (with each call's quantizer, no-split classes and what
        accelerate's ``infer_auto_device_map`` is called with).
    attach_options : dict
        ``runtime="allocator"``: what :func:`allocator.offload.attach` is given beside the plan (``device``).
    patched : tuple of str
        ``"module.attribute"`` for every attribute replaced.
    """

    def __init__(self, strategy, options: PlanOptions, attach_options: Mapping | None = None):
        self.strategy = strategy
        self.options = options
        self.attach_options = dict(attach_options or {})   # for allocator.offload.attach: only the device
        self._pending: dict[str, str] = {}
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (its plan, the map loaded)
        self.diffusion = None   # the DiffusionBudget pipelines loaded under the patch are planned at
        self.ledger = Ledger()   # what the loads of this patch still need: a later load without max_memory plans after
        self._swaps: list[_Swap] = []
        self._saved: list[object] = []

    @property
    def patched(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._swaps)

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return (f"<allocator.integrations.transformers.Patch strategy={self.strategy!r} {state}: "
                f"{', '.join(self.patched)}>")

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc) -> bool:
        self.unpatch()
        return False

    def _apply(self, swaps: list[_Swap]) -> None:
        try:
            self._swap_in(swaps)
        except BaseException:
            self._restore()
            raise
        _ACTIVE.append(self)
        _AFTER_IMPORT.install()
        log.debug("patched %s", ", ".join(self.patched))

    def _swap_in(self, swaps: list[_Swap]) -> None:
        for swap in swaps:
            self._saved.append(getattr(swap.module, swap.attribute))
            setattr(swap.module, swap.attribute, swap.replacement)
            self._swaps.append(swap)

    def _adopt(self, module) -> None:
        """``module`` was imported while this patch is on: patch what it imported of accelerate by name."""
        self._swap_in(self._swaps_by_name(self._swaps, [(module.__name__, module)]))

    def _restore(self) -> None:
        for swap, saved in reversed(list(zip(self._swaps, self._saved))):
            current = getattr(swap.module, swap.attribute)
            if current is not swap.replacement:
                log.warning("%s was replaced by %r while allocator's patch was on; restoring what allocator found "
                            "there, which drops that replacement", swap.name, current)
            setattr(swap.module, swap.attribute, saved)

    def unpatch(self) -> None:
        """Put back what this patch replaced; idempotent.

        Unpatching an outer patch while an inner one is live hands the outer one's saved originals to the inner
        one, so that the inner one's exit restores the originals, not this patch.
        """
        if self not in _ACTIVE:
            return
        index = _ACTIVE.index(self)
        # Every patch of a process swaps the same attributes (it imports what it patches), so the one above
        # takes over exactly what this one saved.
        if index == len(_ACTIVE) - 1:
            self._restore()
        else:
            above = _ACTIVE[index + 1]
            mine = {(id(s.module), s.attribute): saved for s, saved in zip(self._swaps, self._saved)}
            above._saved = [mine.get((id(s.module), s.attribute), saved)
                            for s, saved in zip(above._swaps, above._saved)]
        del _ACTIVE[index]
        if not _ACTIVE:
            _AFTER_IMPORT.remove()
        log.debug("unpatched %s", ", ".join(self.patched))

    # -- planning -------------------------------------------------------------------------------------------------

    def _device_map(self, model, budgets: Mapping, mode: str, *, hf_quantizer=None, no_split=None,
                    runtime: Mapping | None = None, verbose: bool = False) -> dict:
        """Plan ``model`` for ``mode`` over ``budgets`` (less the accelerators absent at load time); honour
        transformers' ``_no_placement_params``."""
        budgets = present_budgets(budgets)
        no_split = sorted(set(name_list(no_split)) | set(name_list(self.options.no_split_module_classes)))
        runtime = {k: v for k, v in (runtime or {}).items() if v is not None}
        kept = {canonical(d) for d in budgets} | {"cpu", "disk"}
        if not {canonical(d) for d in runtime.get("baseline", {}).values()} <= kept:
            del runtime["baseline"]   # transformers' own map uses a device that is not there: that load fails
        options = replace(self.options, **runtime, no_split_module_classes=no_split, hf_quantizer=hf_quantizer)
        strategy = self._strategy_for(mode, budgets, options.loader)
        with gc_paused():
            problem = build_problem(model, dict(budgets), options=options)   # the model read once per load
        result = planned(problem, strategy)
        if strategy == "balanced" and MODE_TO_STRATEGY[mode] is None and not all(
                is_accelerator(d) for d in result.device_map.values()):
            strategy = self.strategy   # the model does not fit on the accelerators: the contract's plan, same problem
            result = planned(problem, strategy)
        escaped = tensors_to_escape(model, result, no_split)
        if escaped:
            base = options.size_fn if options.size_fn is not None else quantizer_size_fn(model, hf_quantizer)
            result = planned(without_sizes(problem, escaped, base), strategy)   # the graph's sizes, not a new read
            device_map = leave_out(model, result.device_map, escaped)
            log.info("%s: left %s out of the device map (_no_placement_params: they do not fit an accelerator); "
                     "transformers loads them in RAM", type(model).__name__, escaped)
        else:
            device_map = result.device_map
        self._plans[model] = (result, dict(device_map))   # what the runtime attached after loading runs
        self.ledger.add(result, type(model).__name__)
        model._allocator_plan = result   # plan_of(model): kept by the model it was made for, as its runtime is
        if log.isEnabledFor(logging.INFO):
            resident = {d: result.resident(d) for d in result.problem.budgets.order}
            log.info("device_map=%r for %s planned by %s; resident bytes %s", mode, type(model).__name__,
                     result.strategy, {d: b for d, b in resident.items() if b})
        if verbose:
            log.info("%s", result.explain())
        return device_map

    def _strategy_for(self, mode: str, budgets: Mapping, loader: str | None):
        """:data:`MODE_TO_STRATEGY`; on ``from_pretrained`` ``"auto"`` over several accelerators is ``balanced`` under
        the default strategy (transformers balances; a strategy given to :func:`patch` plans it as given)."""
        named = MODE_TO_STRATEGY[mode]
        if named is not None:
            return named
        accelerators = [d for d, size in budgets.items() if is_accelerator(d) and size > 0]
        if loader == "transformers" and self.strategy == "auto" and len(accelerators) > 1:
            return "balanced"
        return self.strategy

    def _get_device_map(self, original):
        """transformers 5's ``_get_device_map(model, device_map, max_memory, hf_quantizer)``."""
        from transformers.integrations.accelerate import get_max_memory

        def _get_device_map(model, device_map, max_memory, hf_quantizer, *args, **kwargs):
            if not (isinstance(device_map, str) and device_map in MODE_TO_STRATEGY):
                return original(model, device_map, max_memory, hf_quantizer, *args, **kwargs)
            budgets = self.ledger.left(user_budgets(get_max_memory, max_memory, device_map), shared=max_memory is None)
            given = dict(max_memory) if isinstance(max_memory, Mapping) else max_memory   # theirs converts in place
            quantizer = None if hf_quantizer is None else Unchecked(hf_quantizer)
            theirs = baseline_map(lambda: original(model, device_map, given, quantizer, *args, **kwargs), model,
                                  "transformers' own _get_device_map")
            result = self._device_map(model, budgets, device_map, hf_quantizer=hf_quantizer,
                                      no_split=getattr(model, "_no_split_modules", None),
                                      runtime={"loader": "transformers", "baseline": theirs})
            if hf_quantizer is not None:
                hf_quantizer.validate_environment(device_map=result)
            return result

        return named(_get_device_map, original)

    def _get_balanced_memory(self, original, namespace: str):
        """accelerate's ``get_balanced_memory``: the user's budgets, and the mode for the next map."""
        from accelerate.utils import get_max_memory

        def get_balanced_memory(model, max_memory=None, no_split_module_classes=None, dtype=None,
                                special_dtypes=None, low_zero=False, **_):
            mode = "balanced_low_0" if low_zero else "auto"
            self._pending[namespace] = mode
            return user_budgets(get_max_memory, max_memory, mode)

        return named(unless_baseline(get_balanced_memory, original), original)

    def _infer_auto_device_map(self, original, namespace: str):
        """accelerate's ``infer_auto_device_map``, planning for the mode recorded by ``get_balanced_memory``."""
        from accelerate.utils import get_max_memory

        def infer_auto_device_map(model, max_memory=None, no_split_module_classes=None, dtype=None,
                                  special_dtypes=None, verbose=False, clean_result=True, offload_buffers=False,
                                  fallback_allocation=False, *, tied_parameters=None, hf_quantizer=None, **_):
            mode = self._pending.pop(namespace, "sequential")
            budgets = get_max_memory(dict(max_memory) if max_memory is not None else None)
            runtime = {"dtype": dtype, "special_dtypes": special_dtypes, "clean_result": clean_result,
                       "offload_buffers": offload_buffers, "fallback_allocation": fallback_allocation,
                       "loader": _LOADER_OF.get(namespace, "transformers")}
            if tied_parameters is not None:
                runtime["tied_parameters"] = tied_parameters
            with shown(verbose):  # accelerate prints its decisions with verbose=True: make ours visible
                return self._device_map(model, budgets, mode, hf_quantizer=hf_quantizer,
                                        no_split=no_split_module_classes, runtime=runtime, verbose=verbose)

        return named(unless_baseline(infer_auto_device_map, original), original)

    def _dispatch_model(self, original):
        """accelerate's ``dispatch_model``, then (``runtime="allocator"``) our offload runtime in place of its
        offloading hooks (:func:`allocator.offload.attach`)."""

        def dispatch_model(model, *args, **kwargs):
            result = original(model, *args, **kwargs)
            if has_offload_hooks(model) and runtime_of(model) is None:
                planned, loaded = self._plans.get(model, (None, None))
                # the plan's map as loaded: the plan itself (attach checks the map); a map with tensors left out
                # (_no_placement_params): its runtime; no plan of ours (a dict map): the runtime's defaults
                given = getattr(model, "hf_device_map", None)
                same = planned is not None and (given is None or dict(given) == planned.device_map)
                spec = planned if same else planned.runtime if planned is not None and given == loaded else None
                runtime = attach(model, spec, **self.attach_options)
                log.info("%s runs the allocator offload runtime (prefetch=%d, %d experts modules expert by expert)",
                         type(model).__name__, runtime.prefetch, len(runtime.experts))
            return result

        replacement = named(dispatch_model, original)
        replacement.__doc__ = (f"allocator.integrations.transformers's replacement of "
                               f"{getattr(original, '__module__', '?')}.dispatch_model: "
                               "accelerate's, then allocator.offload.attach (runtime='allocator').")
        replacement.__wrapped__ = original   # inspect.signature (transformers reads it) sees accelerate's
        return replacement

    def _swaps_for_installed(self) -> list[_Swap]:
        swaps: list[_Swap] = []
        if self.options.runtime == "allocator":   # from_pretrained and load_checkpoint_and_dispatch dispatch here
            for name in ("transformers.integrations.accelerate", "accelerate.big_modeling"):
                module = optional_import(name)
                if module is not None and hasattr(module, "dispatch_model"):
                    swaps.append(_Swap(module, "dispatch_model", self._dispatch_model(module.dispatch_model)))
        tia = optional_import("transformers.integrations.accelerate")
        modeling_utils = optional_import("transformers.modeling_utils")
        if tia is not None and hasattr(tia, "_get_device_map"):  # transformers 5
            replacement = self._get_device_map(tia._get_device_map)
            swaps.append(_Swap(tia, "_get_device_map", replacement))
            if modeling_utils is not None and hasattr(modeling_utils, "_get_device_map"):
                swaps.append(_Swap(modeling_utils, "_get_device_map", replacement))
        for module in (modeling_utils, optional_import("accelerate.big_modeling")):  # transformers 4 / accelerate
            if all(hasattr(module, name) for name in ("get_balanced_memory", "infer_auto_device_map")):
                swaps.append(_Swap(module, "get_balanced_memory",
                                   self._get_balanced_memory(module.get_balanced_memory, module.__name__)))
                swaps.append(_Swap(module, "infer_auto_device_map",
                                   self._infer_auto_device_map(module.infer_auto_device_map, module.__name__)))
        first = [_Swap(*swap) for swap in   # diffusers' from_pretrained (allocator.integrations.diffusers)
                 diffusers_swaps(self._device_map, self._dispatch_model, self.options.runtime,
                                 self.attach_options.get("device"), self.diffusion)]
        return first + swaps + self._swaps_by_name(first + swaps)

    def _swaps_by_name(self, made: list[_Swap], modules=None) -> list[_Swap]:
        """Every other loaded library (of ``modules``: all) that imports accelerate's planning functions by name
        (PEFT's ``peft_model``, transformers' ``integrations.peft``, ...): found by identity, not from a list
        (:func:`bound_by_name`); a library imported later is reached when it is imported (:data:`_AFTER_IMPORT`)."""
        functions = accelerate_functions(dispatch=self.options.runtime == "allocator")
        done = {(id(s.module), s.attribute) for s in made}
        factories = {"get_balanced_memory": self._get_balanced_memory,
                     "infer_auto_device_map": self._infer_auto_device_map,
                     "dispatch_model": lambda original, _: self._dispatch_model(original)}
        return [_Swap(module, attribute, factories[attribute](getattr(module, attribute), module.__name__))
                for module, attribute in bound_by_name(functions, skip=_OWN_NAMESPACES, modules=modules)
                if (id(module), attribute) not in done]


def patch(strategy="auto", *, options: PlanOptions | None = None, offload_device=None, diffusion=None,
          **keywords) -> Patch:
    """Plan the string device maps of ``from_pretrained`` and ``load_checkpoint_and_dispatch`` with the planner.

    The patch is on from this call until :meth:`Patch.unpatch`, :func:`unpatch` or the end of a ``with`` block
    (also when the block raises). Under it, ``from_pretrained(device_map="auto" | "balanced" | "balanced_low_0" |
    "sequential", max_memory=...)`` (transformers 5 and 4) and accelerate's ``load_checkpoint_and_dispatch(
    device_map=...)`` get their map from the planner, and so does every library that imports accelerate's planning
    functions by name (PEFT's ``PeftModel.from_pretrained(base, adapter, max_memory=..., offload_folder=...)`` on an
    offloaded base: module docstring); dict maps and everything after the map are untouched.

    Parameters
    ----------
    strategy : str or callable
        Plans ``device_map="auto"``: a name in :data:`allocator.STRATEGIES` or ``place(problem) -> Placement``.
    options : PlanOptions, optional
        Given to :func:`allocator.plan` for every map (its ``hf_quantizer`` is each call's).
    offload_device : optional
        With ``runtime="allocator"``: the runtime's device, as :func:`allocator.offload.attach` takes it (``None``:
        from the hooks' execution device; ``"stand-in"``: :class:`allocator.offload.StandInDevice`). What the runtime
        does otherwise is the plan's (:attr:`allocator.Plan.runtime`): every model ``dispatch_model`` offloads is
        attached with the plan made for its map, so ``expert_profile=``, ``prefetch=`` and ``generation=`` reach it.
    diffusion : DiffusionBudget, optional
        The sizes a pipeline loaded by ``DiffusionPipeline.from_pretrained(device_map="balanced")`` runs at: the
        ``budget`` of its :func:`allocator.plan_pipeline` (default: the pipeline's default size, said in a decision).
    **keywords
        Fields of :class:`allocator.PlanOptions`, one by one (they override those of ``options``):
        ``offload_buffers`` (pass ``True`` when you pass it to ``from_pretrained``, which does not tell its map
        builder), ``no_split_module_classes`` (united with the model's), ``dtype``, ``special_dtypes``,
        ``clean_result``, ``fallback_allocation``, ``tied_parameters``,
        ``size_fn``, ``infer_no_split``, ``profile``, ``runtime`` and ``prefetch`` (``runtime="allocator"``: the maps
        reserve the prefetch of :mod:`allocator.offload`, and every model ``dispatch_model`` offloads, from
        ``from_pretrained`` or ``load_checkpoint_and_dispatch``, runs our offload runtime instead of accelerate's
        hooks, ``prefetch`` modules ahead), ``expert_profile`` and ``expert_cache`` (slots for recently routed
        experts on the main device, :mod:`allocator.offload.expert_cache`), ``generation`` (an
        :class:`allocator.GenerationBudget`: room for ``generate``'s KV cache, logits and activations),
        ``objective`` (``"contract"``, the default, or ``"latency"``: see :func:`allocator.plan`), ``strict``
        (``True``: raise where no valid plan exists, instead of
        loading accelerate's own map as transformers would). What accelerate's ``infer_auto_device_map`` is called with
        (``offload_buffers``, ``clean_result``, ``fallback_allocation``, and ``dtype`` / ``special_dtypes`` when
        not ``None``) wins over these: it describes how the model will really be loaded.

    Returns
    -------
    Patch
        A handle and context manager.

    Raises
    ------
    InvalidOption
        Unknown strategy or option, or neither transformers nor accelerate is installed. Nothing is patched then.

    Notes
    -----
    What the planner is given, per mode and per caller:

    - Modes map to strategies through :data:`MODE_TO_STRATEGY`. ``"balanced"`` and ``"balanced_low_0"`` are planned
      by the ``balanced`` and ``balanced_low_0`` strategies over the user's ``max_memory``, not over transformers' /
      accelerate's ``get_balanced_memory`` (which caps every GPU but the last at 1/n of the model plus 1.25× the
      largest layer, and can spill to RAM a model the GPUs hold together). accelerate and transformers 4 call
      ``get_balanced_memory(low_zero=False)`` for both ``"auto"`` and ``"balanced"``, so on those routes the two
      cannot be told apart: both get the patch's ``strategy``; ``low_zero=True`` gets ``balanced_low_0``.
    - On ``from_pretrained``, ``"auto"`` over several accelerators is a balanced split, as transformers makes it:
      with the default strategy, ``balanced`` plans it where the model fits on the accelerators; rule 3 against
      transformers' own map includes the least free memory on any accelerator. Accelerators absent at load time are
      left out with one warning (:func:`allocator.problem.present_budgets`).
    - Budgets are the user's ``max_memory`` as the library normalises it (its ``get_max_memory``, so a budget
      transformers would reject is rejected the same way). Without ``max_memory`` the machine's free memory is
      used as the library reads it, and, as the library does for every mode but ``"sequential"``, 90% of the only
      accelerator when there is exactly one. A quantizer's ``adjust_max_memory`` applies inside :func:`plan`.
    - ``no_split_module_classes`` is ``model._no_split_modules`` (transformers 5) or what the caller passes, united
      (by :func:`allocator.plan`) with the ``_no_split_modules`` every sub-model declares: a caller of
      ``load_checkpoint_and_dispatch`` who passes none still gets the declared blocks kept whole, where accelerate
      would split them (so ``"sequential"`` equals accelerate's map given the same no-split classes);
      tied parameters come from ``model.all_tied_weights_keys`` / shared tensors (read by the graph builder), and
      as transformers 5 plans before it ties, a model whose declared ties are not made yet is planned as a copy
      of its module tree (sharing every tensor) with the ties made, i.e. as it will run;
      ``hf_quantizer`` sizes tensors by ``param_element_size`` and ``validate_environment(device_map=...)`` is called
      on the result, as transformers does.
    - ``_no_placement_params`` (names relative to a no-split block, e.g. ``"ple.ple_embedding.ngram_embedding.weight"``)
      are matched as transformers matches them: ``f"{block}.{name}"`` for every module of a no-split class. When the
      budgets hold an accelerator and the plan leaves such a tensor off every accelerator, it is left out of the
      plan (sized 0, so it takes no budget) and out of the map (keys covering it are split into its siblings);
      transformers then loads it in RAM (its ``get_device`` falls back to ``"cpu"``) and skips accelerate's
      ``check_device_map`` for models that declare the attribute; the model's own code moves its inputs to that
      tensor, as the models declaring it do. Without accelerators, or when the plan puts it on one, it is planned
      like any tensor. transformers decides differently (it escapes only a no-split block that fits neither the
      current accelerator nor the next, empty one); here the test is where the plan puts the tensor.
    - ``_skip_keys_device_placement`` names forward arguments (caches) the hooks must not move; it does not affect
      placement, and transformers passes it to ``dispatch_model`` itself, which the patch does not touch.

    The patch is process-global and not thread-safe: it rebinds module attributes, so every thread sees it, and
    two threads patching and unpatching concurrently may interleave. Patches nest: an inner patch's exit
    restores the outer patch, and unpatching an outer patch first leaves the inner one to restore the originals.

    Examples
    --------
    accelerate's ``load_checkpoint_and_dispatch`` looks ``infer_auto_device_map`` up in ``accelerate.big_modeling``:

    >>> import accelerate.big_modeling as big_modeling
    >>> original = big_modeling.infer_auto_device_map
    >>> with patch(strategy="reserve") as p:
    ...     swapped = "accelerate.big_modeling.infer_auto_device_map" in p.patched
    ...     print(big_modeling.infer_auto_device_map is original, swapped)
    False True
    >>> big_modeling.infer_auto_device_map is original
    True

    As a plain call:

    >>> handle = patch()
    >>> handle.active
    True
    >>> handle.unpatch()
    >>> handle.active, big_modeling.infer_auto_device_map is original
    (False, True)
    """
    resolve(strategy)
    fixed = sorted(set(keywords) & _RESERVED)
    if fixed:
        raise InvalidOption(f"patch() got options {fixed}, which come from each call; choose from "
                            f"{sorted(set(OPTION_NAMES) - _RESERVED)}.")
    options = PlanOptions.of(options, **keywords)
    handle = Patch(strategy, options, {"device": offload_device} if offload_device is not None else None)
    handle.diffusion = diffusion
    swaps = handle._swaps_for_installed()
    if not swaps:
        raise InvalidOption("nothing to patch: neither transformers nor accelerate is importable; "
                            "pip install 'allocator[hf]'.")
    handle._apply(swaps)
    return handle


def unpatch() -> Patch | None:
    """Undo the most recent live :func:`patch`; return it, or ``None`` when none is live.

    Examples
    --------
    >>> p = patch()
    >>> unpatch() is p, unpatch()
    (True, None)
    """
    if not _ACTIVE:
        return None
    handle = _ACTIVE[-1]
    handle.unpatch()
    return handle
