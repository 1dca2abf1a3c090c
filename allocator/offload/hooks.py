"""The offload runtime on a model: :class:`OffloadHook` in place of accelerate's offloading hooks, the
:class:`Attached` runtime they call, and :func:`attach` / :func:`detach` / :func:`dispatch` that put it on and take
it off.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from ..errors import InvalidOption, InvalidRuntime, warn_caller
from ..report.runtime import Runtime
from .devices import HostDevice, StandInDevice, StreamDevice, prefetch_executor
from .expert_cache import ExpertCache
from .buffers import FetchBuffers
from .experts import ExpertsHook, Traffic, register, routed_layers
from .files import MappedFiles, source_of
from .handover import carry, end, hooked, removed, set_experts_implementation
from .heap import trim_heap
from .hybrid import HybridHook, layer_hooks, make_layer_hooks, wrap_units
from .passthrough import put_back, take_passthrough_hooks
from .scheduler import OffloadedModule, Scheduler, Slot

__all__ = ["Attached", "OffloadHook", "attach", "detach", "dispatch", "has_offload_hooks", "runtime_of"]


class OffloadHook:
    """Replaces one offloading ``AlignDevicesHook``: its module's weights fetched together, possibly ahead."""

    no_grad = False

    def __init__(self, runtime: Attached, unit: OffloadedModule):
        self.runtime, self.unit = runtime, unit
        h = unit.original
        self.execution_device, self.io_same_device, self.skip_keys = h.execution_device, h.io_same_device, h.skip_keys
        self.input_device = None

    def init_hook(self, module):
        return module

    def detach_hook(self, module):   # accelerate's remove_hook_from_module: the runtime ends with its last hook
        removed(self.runtime, module)
        return self.unit.original.detach_hook(module)

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import find_device, send_to_device

        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        self.runtime.load(self.unit)
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device, skip_keys=self.skip_keys)

    def post_forward(self, module, output):
        from accelerate.utils import send_to_device

        self.runtime.drop(self.unit)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output


def _offload_hooks(model):
    """(module name, module, the hook's container, its index there or None, accelerate's offloading hook)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    for name, module in model.named_modules():
        top = getattr(module, "_hf_hook", None)
        hooks = top.hooks if isinstance(top, SequentialHook) else [top]
        for i, h in enumerate(hooks):
            if isinstance(h, AlignDevicesHook) and h.offload and h.weights_map is not None:
                yield name, module, top, (i if isinstance(top, SequentialHook) else None), h


def has_offload_hooks(model) -> bool:
    """Whether ``model`` runs offloaded modules through accelerate's hooks (that :func:`attach` would replace)."""
    return any(True for _ in _offload_hooks(model))


def _slots(module, hook, files: MappedFiles) -> list[Slot]:
    import torch
    from accelerate.utils import named_module_tensors

    slots = []
    for name, tensor in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                             recurse=hook.place_submodules, remove_non_persistent=True):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        is_param = attr in owner._parameters
        if is_param and type(owner._parameters[attr]) is not torch.nn.Parameter:
            raise InvalidRuntime(
                f"{name!r} is a {type(owner._parameters[attr]).__name__}: the allocator runtime streams plain "
                f"parameters only; keep accelerate's hooks (runtime='accelerate') for quantized models.")
        if tensor.device.type != "meta":
            raise InvalidRuntime(f"{name!r} of an offloaded module is on {tensor.device}, not meta: the model's "
                                 f"hooks are not accelerate's offloading hooks at rest; attach after loading.")
        slots.append(Slot(owner, attr, is_param, tensor, source_of(hook.weights_map, name, files)))
    return slots


class Attached:
    """The runtime attached to one model: its units, the mapped files, the device and the prefetch thread.

    Attributes
    ----------
    units : list of OffloadedModule
        The offloaded modules, in module order.
    files : MappedFiles
        Every checkpoint file read, mapped once.
    prefetch : int
        How many units ahead the weights are made ready.
    held, peak_held : int
        Bytes of offloaded weights materialised now (running or prefetched, and fetched expert slices in
        :attr:`fetch_buffers`), and the most at once.
    fetches : int
        Units staged (inline or ahead).
    experts : dict
        ``id(module) -> RoutedExperts`` for the offloaded experts modules run expert by expert
        (:mod:`allocator.offload.experts`); they are not units.
    traffic : Traffic
        What those moved: bytes copied and read, activations moved, experts run.
    plan : Runtime or None
        What the plan decided for this runtime (:attr:`allocator.Plan.runtime`), ``None`` when attached without one.
    cache : ExpertCache or None
        The cache of recently routed experts on the main device (``Runtime.expert_cache`` slots,
        :mod:`allocator.offload.expert_cache`); ``None`` without one.
    fetch_buffers : FetchBuffers
        The buffers fetched expert slices are copied into, one per device shared by all layers
        (:class:`allocator.offload.experts.FetchBuffers`): ``fetch_buffers.nbytes(device)`` is what they hold there.
    installed : list
        ``(module, hook)`` for each hook :func:`attach` put on; the runtime ends when accelerate's
        ``remove_hook_from_module`` has taken the last off (:mod:`allocator.offload.handover`).
    passthrough : tuple of Passthrough
        On a CPU main device, accelerate's hooks that only send CPU tensors to the CPU, taken off while attached
        (:mod:`allocator.offload.passthrough`); :func:`detach` puts them back.
    """

    def __init__(self, model, *, prefetch: int, device, experts=None, expert_mode="auto", plan=None):
        self.model = model
        self.plan = plan
        self.prefetch = prefetch
        self.files = MappedFiles()
        self.units: list[OffloadedModule] = []
        self.traffic = Traffic()
        self.experts: dict = {}
        self.cache = None
        self.installed: list = []   # (module, the runtime's hook on it), as attach put them on
        self.passthrough = ()   # the hooks that do nothing on a CPU main device, off while attached (passthrough.py)
        self.fetch_buffers = FetchBuffers(self._count)   # counted in held while an experts module runs
        if experts is not None:
            placed, resident_on, layout = experts
            hooks = [(name, module, h) for name, module, _, _, h in _offload_hooks(model)]
            slots = plan.expert_cache if plan is not None else 0
            self.cache = ExpertCache(slots) if slots else None
            self.experts = routed_layers(model, hooks, placed, resident_on, device=device, files=self.files,
                                         mode=expert_mode, traffic=self.traffic, layout=layout, cache=self.cache,
                                         buffers=self.fetch_buffers,
                                         threshold=plan.threshold if plan is not None else 1)
        for name, module, _, _, h in _offload_hooks(model):
            if id(module) in self.experts:
                continue
            unit = OffloadedModule(len(self.units), name, module, h)
            unit.slots = _slots(module, h, self.files)
            self.units.append(unit)
        self.device = device
        self.scheduler = Scheduler(len(self.units))
        self.live: dict[tuple, list] = {}        # source key -> [tensor, users]
        self.pending: dict[int, Future] = {}     # unit -> staged handle (prefetched)
        self.held = self.peak_held = self.fetches = 0
        self.lock = threading.Lock()
        self.threaded = getattr(device, "threaded", True)
        self.executor = prefetch_executor() if prefetch and self.threaded else None

    @property
    def state(self) -> dict:
        """What this runtime runs, as data: the prefetch depth, the device's kind, the offloaded units in order, and
        per experts module run expert by expert its experts' devices, the resident ones, the mode (the plan's per
        phase) and the calls run in each mode per phase (``"used"``: ``{phase: {mode: calls}}``)."""
        return {"prefetch": self.prefetch, "device": type(self.device).__name__,
                "units": [u.name for u in self.units],
                "experts": {r.layer.experts: {"where": tuple(r.where), "resident": tuple(sorted(r.rows)),
                                              "mode": r.mode if isinstance(r.mode, str) else dict(r.mode),
                                              "used": {phase: dict(row) for phase, row in r.used.items()}}
                            for r in self.experts.values()},
                "expert_cache": self.cache.slots if self.cache is not None else 0}

    # --- accounting -------------------------------------------------------------------------------------------
    def _count(self, nbytes: int) -> None:
        with self.lock:
            self.held += nbytes
            self.peak_held = max(self.peak_held, self.held)

    def _stage(self, unit: OffloadedModule, ahead: bool):
        slots = [s for s in unit.slots if s.source.key not in self.live] if not ahead else unit.slots
        handle = self.device.stage(slots, ahead=ahead)
        counted = sum({s.source.key: s.nbytes for s in slots}.values())
        self._count(counted)
        with self.lock:
            self.fetches += 1
        return handle, counted

    # --- what the hooks call ----------------------------------------------------------------------------------
    def load(self, unit: OffloadedModule) -> None:
        """Set ``unit``'s tensors on its module (prefetched or fetched now), then prefetch what follows."""
        import torch

        self.scheduler.arrive(unit.index)
        future = self.pending.pop(unit.index, None)
        handle, counted = future.result() if future is not None else self._stage(unit, ahead=False)
        tensors = self.device.ready(handle)
        duplicate, seen = 0, set()
        for s in unit.slots:
            key = s.source.key
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [tensors[key], 0]
            elif key in tensors and key not in seen:
                duplicate += s.nbytes      # fetched while a tied user already holds it: keep the one in use
            seen.add(key)
            entry[1] += 1
            if s.is_param:
                s.owner._parameters[s.attr] = torch.nn.Parameter(entry[0], requires_grad=s.meta.requires_grad)
            else:
                s.owner._buffers[s.attr] = entry[0]
        self._count(-duplicate)
        if self.executor is not None:
            self._prefetch(unit.index)
        elif self.prefetch:    # read-ahead only: the kernel fetches the pages, nothing is held early
            for u in self.scheduler.ahead(unit.index, self.prefetch):
                self.device.advise(self.units[u].slots)

    def _prefetch(self, index: int) -> None:
        ahead = self.scheduler.ahead(index, self.prefetch)
        for u in [u for u in self.pending if u not in ahead]:      # a wrong guess: drop what it staged
            _, counted = self.pending.pop(u).result()
            self._count(-counted)
        for u in ahead:
            if u not in self.pending and not self._is_live(self.units[u]):
                self.pending[u] = self.executor.submit(self._stage, self.units[u], True)

    def _is_live(self, unit: OffloadedModule) -> bool:
        return bool(unit.slots) and all(s.source.key in self.live for s in unit.slots)

    def drop(self, unit: OffloadedModule) -> None:
        """Put ``unit``'s meta placeholders back; a tensor goes when its last user is done."""
        freed = 0
        for s in unit.slots:
            if s.is_param:
                s.owner._parameters[s.attr] = s.meta
            else:
                s.owner._buffers[s.attr] = s.meta
            entry = self.live[s.source.key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[s.source.key]
                freed += s.nbytes
        self._count(-freed)

    def evict(self) -> None:
        """Drop the pages of every mapped file from this process (:meth:`MappedFile.evict`), experts' included."""
        for f in list(self.files.open.values()):
            f.evict()
        for routed in self.experts.values():
            routed.evict()

    def close(self) -> None:
        """Wait for the prefetch thread, release what it staged."""
        for u in list(self.pending):
            try:
                _, counted = self.pending.pop(u).result()
                self._count(-counted)
            except Exception:   # noqa: BLE001 - closing: the error already reached a forward or never matters
                pass
        if self.executor is not None:
            self.executor.shutdown(wait=True)

    def release(self) -> None:
        """Let go of everything the runtime holds (:func:`detach` calls it): the prefetch thread, the fetch buffers,
        the resident experts' copies and those elsewhere, the expert cache's entries, the mapped files (and with
        them the private pages of experts kept in place) and its references to the model and its modules. Its
        :attr:`traffic` and :attr:`state` stay readable, so a caller who keeps this object keeps none of the model's
        memory."""
        self.close()
        self.fetch_buffers.clear()
        if self.cache is not None:
            self.cache.entries.clear()
        for routed in self.experts.values():
            routed.release()
        self.live.clear()
        self.files.close()
        self.model, self.passthrough = None, ()
        for unit in self.units:   # the modules and accelerate's hooks (back on the model): names stay for state
            unit.module, unit.original, unit.slots = None, None, []


def _device_for(model, device):
    if device is not None and not isinstance(device, str):
        return device
    if device == "stand-in":
        return StandInDevice()
    execution = {str(h.execution_device) for *_, h in _offload_hooks(model)}
    main = device or (execution.pop() if len(execution) == 1 else None)
    if main is None:
        raise InvalidRuntime(f"offloaded modules execute on several devices {sorted(execution)}; pass device=.")
    main = str(main)
    if main == "cpu":
        return HostDevice()
    if main.isdigit() or main.startswith("cuda"):
        return StreamDevice.cuda(int(main) if main.isdigit() else main)
    raise InvalidRuntime(f"the allocator runtime streams to 'cpu' or CUDA devices, not {main!r}; "
                         f"keep runtime='accelerate' there.")


def _plan_map(plan):
    return getattr(plan, "device_map", plan)


def _runtime_in(plan) -> Runtime | None:
    """The :class:`Runtime` a plan decided (a :class:`allocator.Plan`, a saved plan, or the runtime itself); ``None``
    for a bare device map or no plan."""
    if plan is None or isinstance(plan, Runtime):
        return plan
    runtime = getattr(plan, "runtime", None)
    return runtime if isinstance(runtime, Runtime) else None


def _experts_of(spec: Runtime | None, experts):
    """``(experts module -> device of each expert, the main device, the plan's layout of each experts module)`` for
    :class:`Attached`, or ``None`` without expert awareness. The layout is ``{"runs_on": device, "fetch_chunk": n}``
    per experts module (:attr:`allocator.report.runtime.Runtime.runs_on`, ``fetch_chunk``)."""
    if experts is False:
        return None
    if experts is None or experts is True:
        if spec is None:
            return {}, None, {}
        layout = {name: {"runs_on": spec.runs_on.get(name, spec.main_device),
                         "fetch_chunk": spec.fetch_chunk.get(name)} for name in spec.experts}
        return dict(spec.experts), spec.main_device, layout
    return dict(experts), "main", {}


def runtime_of(model) -> Attached | None:
    """The allocator runtime attached to ``model`` (by :func:`attach`, :func:`dispatch` or
    ``patch(runtime="allocator")``), with its :attr:`Attached.traffic` and :attr:`Attached.state`; ``None`` where
    accelerate's hooks (or none) run it, and where its hooks were taken off (accelerate's
    ``remove_hook_from_submodules``, as PEFT does before it dispatches a wrapped model again: the runtime ends)."""
    runtime = getattr(model, "_allocator_runtime", None)
    if runtime is not None and not hooked(runtime.installed):
        end(runtime)
        return None
    return runtime


def attach(model, plan=None, *, prefetch: int | None = None, device=None, experts=None,
           expert_mode: str | None = None) -> Attached:
    """Replace accelerate's offloading hooks on ``model`` with the allocator runtime.

    Parameters
    ----------
    model : torch.nn.Module
        A model loaded with offloading by ``from_pretrained(device_map=...)``, ``dispatch_model`` or
        ``load_checkpoint_and_dispatch`` (its offloaded modules have accelerate's ``AlignDevicesHook``).
    plan : allocator.Plan, saved plan, Runtime or dict, optional
        The plan it was loaded with (or its saved data read by ``Plan.from_dict``, or only its
        :attr:`allocator.Plan.runtime`), or the device map; with a map, ``model.hf_device_map`` must be that map.
        The plan's runtime (:class:`allocator.report.runtime.Runtime`) decides what runs: the prefetch depth, the
        resident experts, the expert mode per layer; the keywords below override it.
    prefetch : int, optional
        Offloaded units made ready ahead of the one running (0: none). Default: what the plan decided
        (``Runtime.prefetch``: 0 for a plan made for accelerate's hooks); 1 without a plan.
    device : optional
        ``None`` (from the hooks' execution device: :class:`HostDevice` for ``cpu``, CUDA streams for a GPU),
        ``"stand-in"`` (:class:`StandInDevice`) or a device object with ``stage`` / ``ready``.
    experts : bool or dict, optional
        Mixtures of experts (:mod:`allocator.offload.experts`): by default (``None`` or ``True``) every offloaded
        fused experts module runs only the experts its router picks, through transformers' ``ExpertsInterface``
        (``"allocator"``), those the plan keeps resident (``Plan.experts``) from the main device; ``False`` streams
        such modules whole like any other; a dict like ``Plan.experts`` with ``"main"`` for resident experts
        overrides the plan's.
    expert_mode : str, optional
        How an offloaded expert the router picks runs: ``"auto"`` (fetched, or computed on the CPU where its weights
        are in RAM and that is estimated cheaper for the tokens routed to it), ``"fetch"`` or ``"compute"``, in every
        phase. Default: the plan's per layer and phase (``Runtime.expert_mode``, run as written), ``"auto"`` for a
        layer it does not name or without a plan.

    Returns
    -------
    Attached
        The runtime; :func:`detach` (or ``Attached.close``) ends it.

    Warns
    -----
    UserWarning
        ``prefetch`` is more than the plan reserved for and the device holds modules ahead (a thread or a GPU).

    Raises
    ------
    InvalidRuntime
        The model has no offloading hooks, is already attached, was loaded with another map than ``plan``'s, or
        streams tensors this runtime does not (quantized parameters).
    InvalidOption
        ``prefetch`` is not a non-negative integer.
    """
    if runtime_of(model) is not None:
        raise InvalidRuntime("this model already runs the allocator runtime; detach(model) first.")
    if plan is not None and not isinstance(plan, Runtime):
        expected, loaded = dict(_plan_map(plan)), getattr(model, "hf_device_map", None)
        if loaded is not None and dict(loaded) != expected:
            raise InvalidRuntime(f"the model was loaded with device_map {loaded}, not the plan's {expected}; "
                                 f"load it with plan.device_map.")
    spec = _runtime_in(plan)
    if prefetch is None:   # what the plan decided: none under accelerate's hooks
        prefetch = 1 if spec is None else spec.prefetch
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise InvalidOption(f"prefetch must be a non-negative integer, got {prefetch!r}.")
    if not has_offload_hooks(model):
        raise InvalidRuntime("the model has no offloaded modules (no accelerate AlignDevicesHook with offload=True):"
                             " load it with a device_map that puts something on 'disk' (or 'cpu' with a GPU).")
    device = _device_for(model, device)
    if experts is False and spec is not None and spec.experts and prefetch and getattr(device, "threaded", True):
        warn_caller(f"attach(experts=False, prefetch={prefetch}) streams experts modules whole and may hold them "
                    "ahead, but the plan (runtime='allocator') reserved no prefetch for them; attach with experts "
                    "awareness (the default) or prefetch=0.")
    if spec is not None and prefetch > spec.prefetch and getattr(device, "threaded", True):
        warn_caller(f"attach(prefetch={prefetch}) holds up to {prefetch} offloaded modules ahead on the main device, "
                    f"beyond what the plan reserved (prefetch={spec.prefetch}); plan with "
                    f"runtime='allocator', prefetch={prefetch} so that its budget counts them.")
    mode = expert_mode if expert_mode is not None else (dict(spec.expert_mode) if spec is not None else "auto")
    runtime = Attached(model, prefetch=prefetch, device=device, experts=_experts_of(spec, experts),
                       expert_mode=mode, plan=spec)
    hooks = {id(u.original): OffloadHook(runtime, u) for u in runtime.units}
    wrap_units(hooks, getattr(plan, "hybrid", None))   # units the plan computes on the CPU in some phase
    boundaries = layer_hooks(model, getattr(plan, "hybrid", None), runtime.units)   # offload hooks on leaves
    for _, module, _, _, h in list(_offload_hooks(model)):
        routed = runtime.experts.get(id(module))
        if routed is not None:
            hooks[id(h)] = ExpertsHook(routed, h)
            module._allocator_experts = routed
    if runtime.experts:
        register()
        runtime.experts_implementation = set_experts_implementation(model, "allocator")
    for _, module, top, i, h in list(_offload_hooks(model)):
        carry(hooks[id(h)], h)   # what code written for accelerate's hooks reads of them (handover.py: PEFT)
        runtime.installed.append((module, hooks[id(h)]))
        if i is None:
            module._hf_hook = hooks[id(h)]
        else:
            top.hooks = type(top.hooks)(hooks[id(x)] if x is h else x for x in top.hooks)   # tuple or list
    runtime.layers = make_layer_hooks(boundaries, runtime, getattr(plan.hybrid, "threshold", 1)) if boundaries else []
    for module, hook, _ in runtime.layers:   # a layer whose leaves carry the offload hooks: computed there as one
        module._hf_hook = hook
        runtime.installed.append((module, hook))
    if isinstance(device, HostDevice):   # every module executes on the CPU: its hooks there only walk arguments
        runtime.passthrough = take_passthrough_hooks(model)
    model._allocator_runtime = runtime
    trim_heap()   # what the load freed goes back to the system now, not at the next allocation (docs/runtime.md)
    return runtime


def detach(model) -> None:
    """Put accelerate's offloading hooks back where :func:`attach` replaced them, and stop the prefetch thread."""
    from accelerate.hooks import SequentialHook

    runtime = runtime_of(model)
    if runtime is None:
        raise InvalidRuntime("this model does not run the allocator runtime (attach(model, plan) first).")
    for _, module in model.named_modules():
        routed = module.__dict__.get("_allocator_experts")
        hook = getattr(module, "_hf_hook", None)
        if routed is not None and isinstance(hook, ExpertsHook):
            module._hf_hook = hook.original
        elif routed is not None and isinstance(hook, SequentialHook):
            top = hook
            top.hooks = type(top.hooks)(x.original if isinstance(x, ExpertsHook) else x for x in top.hooks)
    for module, hook, original in getattr(runtime, "layers", ()):
        if module.__dict__.get("_hf_hook") is hook:
            module._hf_hook = original
    for unit in runtime.units:
        top = unit.module._hf_hook
        if isinstance(top, SequentialHook):
            ours = (OffloadHook, HybridHook)
            top.hooks = type(top.hooks)(unit.original if isinstance(x, ours) and x.unit is unit else x
                                        for x in top.hooks)   # tuple or list, as accelerate made it
        elif isinstance(top, (OffloadHook, HybridHook)):
            unit.module._hf_hook = unit.original
    end(runtime, put_back=put_back)
    runtime.release()
    trim_heap()   # the runtime's buffers and the load's freed chunks back to the system (docs/runtime.md)


def dispatch(model, plan, checkpoint, *, offload_folder=None, offload_buffers: bool = False,
             prefetch: int | None = None, device=None, **kwargs):
    """``accelerate.load_checkpoint_and_dispatch`` with ``plan``'s map, then :func:`attach`: for plain ``nn.Module``
    users. ``kwargs`` go to accelerate. Returns the model (its runtime is ``model._allocator_runtime``)."""
    from accelerate import load_checkpoint_and_dispatch

    model = load_checkpoint_and_dispatch(model, checkpoint, device_map=dict(_plan_map(plan)),
                                         offload_folder=offload_folder, offload_buffers=offload_buffers, **kwargs)
    attach(model, plan, prefetch=prefetch, device=device)
    return model
