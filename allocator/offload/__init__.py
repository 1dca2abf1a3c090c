"""Our offload runtime: the weights a plan streams, fetched per module in one call, a unit or more ahead.

accelerate's ``AlignDevicesHook`` streams an offloaded module's weights at every forward one tensor at a time, and
for disk weights opens the safetensors file (``safe_open``) for each tensor. :func:`attach` replaces the offloading
hooks of a loaded model (``from_pretrained(device_map=...)``, ``dispatch_model``, ``load_checkpoint_and_dispatch``)
with :class:`OffloadHook`, which computes the same thing differently:

- each checkpoint file is opened and memory-mapped once (:class:`MappedFile` for safetensors files, the ``.dat``
  files of accelerate's offload folder alike); a module's tensors are views into the mapping, made in one call;
- a :class:`Scheduler` learns which offloaded module runs after which (from module order at first, then from what
  ran) and, while module ``u`` runs, the next ``prefetch`` modules' weights are made ready: on a CPU main device
  (:class:`HostDevice`) the kernel reads their pages ahead (or, with ``thread=True``, a background thread reads
  them in and makes the views); on a GPU (:class:`StreamDevice` with CUDA streams) a background thread copies them
  from pinned host memory on a side stream, the compute stream waiting on an event for what it uses.
  :class:`StandInDevice` is the same stream logic with a CPU stand-in for the GPU, so the scheduling is exercised
  without one.
- tied parameters materialised by two modules at once are fetched once and shared.

The memory of the prefetch is part of the plan: ``PlanOptions(runtime="allocator", prefetch=k)`` makes the main
device reserve, on top of the streamed chain, the ``k`` largest amounts one offloaded module streams
(:func:`allocator.evaluate.memory.prefetch_reserve`). :func:`detach` puts accelerate's hooks back.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import InvalidOption, InvalidRuntime, warn_caller
from ..evaluate.memory import prefetch_of
from ..model.safetensors import SAFETENSORS_DTYPES, safetensors_header

__all__ = [
    "Attached",
    "HostDevice",
    "MappedFile",
    "OffloadHook",
    "Scheduler",
    "StandInDevice",
    "StreamDevice",
    "attach",
    "detach",
    "dispatch",
    "has_offload_hooks",
]

PAGE = mmap.PAGESIZE
class MappedFile:
    """One file memory-mapped once (copy on write: views are writable, the file is never changed).

    Parameters
    ----------
    path : str
        A safetensors file, or (``raw=True``) a headerless ``.dat`` file of accelerate's offload folder.
    """

    def __init__(self, path: str, *, raw: bool = False):
        self.path = path
        self.base, self.entries = (0, {}) if raw else safetensors_header(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def span(self, name: str) -> tuple[int, int]:
        """The absolute byte range of tensor ``name``."""
        start, end = self.entries[name]["data_offsets"]
        return self.base + start, self.base + end

    def view(self, start: int, end: int, dtype, shape):
        """A tensor over bytes ``start:end`` of the mapping, without a copy where the offset is aligned."""
        import torch

        count = (end - start) // dtype.itemsize
        if count == 0 or self.mm is None:
            return torch.empty(shape, dtype=dtype)
        if start % dtype.itemsize:
            return torch.frombuffer(bytearray(self.mm[start:end]), dtype=dtype).reshape(shape)
        return torch.frombuffer(self.mm, dtype=dtype, count=count, offset=start).reshape(shape)

    def tensor(self, name: str):
        """Tensor ``name`` of a safetensors file, a view into the mapping."""
        import torch

        entry = self.entries[name]
        return self.view(*self.span(name), getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]]), entry["shape"])

    def evict(self) -> None:
        """Drop this mapping's pages from the process (``MADV_DONTNEED``: they are read again from the file when
        touched), so that the kernel may drop them from the page cache too (cold-cache measurements)."""
        if self.mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mm.madvise(mmap.MADV_DONTNEED)

    def advise(self, start: int, end: int) -> None:
        """Ask the kernel to read ``start:end`` in (asynchronous read-ahead)."""
        if self.mm is None or end <= start or not hasattr(mmap, "MADV_WILLNEED"):
            return
        lo = start - start % PAGE
        self.mm.madvise(mmap.MADV_WILLNEED, lo, end - lo)

    def page_in(self, start: int, end: int) -> None:
        """Read ``start:end`` in now: the kernel's read-ahead, then one byte touched per page."""
        if self.mm is None or end <= start:
            return
        self.advise(start, end)
        lo = start - start % PAGE
        memoryview(self.mm)[lo:end:PAGE].tobytes()


class _Files:
    """Every file a runtime reads, each mapped once and kept."""

    def __init__(self):
        self.open: dict[tuple[str, bool], MappedFile] = {}
        self.lock = threading.Lock()

    def get(self, path: str, raw: bool = False) -> MappedFile:
        with self.lock:
            key = (os.path.realpath(path), raw)
            if key not in self.open:
                self.open[key] = MappedFile(path, raw=raw)
            return self.open[key]


@dataclass(frozen=True)
class _Source:
    """Where one offloaded tensor's bytes are: a mapped file range, or a tensor already in RAM."""

    key: tuple                      # shared by tied tensors: one fetch, one copy
    file: MappedFile | None = None
    start: int = 0
    end: int = 0
    dtype: object = None            # stored dtype
    shape: tuple = ()
    ram: object = None              # a host tensor (accelerate's state_dict for cpu-offloaded weights)

    def host(self):
        return self.ram if self.file is None else self.file.view(self.start, self.end, self.dtype, self.shape)

    def page_in(self) -> None:
        if self.file is not None:
            self.file.page_in(self.start, self.end)

    def advise(self) -> None:
        if self.file is not None:
            self.file.advise(self.start, self.end)


def _source(weights_map: Mapping, name: str, files: _Files) -> _Source:
    """The source of tensor ``name`` of accelerate's (prefixed) ``weights_map``, read like ``weights_map[name]``."""
    import torch
    from accelerate.utils.offload import OffloadedWeightsLoader, PrefixedDataset

    loader, full = weights_map, name
    if isinstance(loader, PrefixedDataset):
        loader, full = loader.dataset, loader.prefix + name
    if not isinstance(loader, OffloadedWeightsLoader) or full in loader.state_dict:
        value = weights_map[name]
        return _Source(key=("ram", id(value)), ram=value)
    if full not in loader.index:
        raise InvalidRuntime(
            f"accelerate's offload index has no {full!r} (a tied weight load_checkpoint_and_dispatch did not store; "
            f"accelerate's own hooks fail on it at the first forward): load the model with from_pretrained.")
    info = loader.index[full]
    if info.get("safetensors_file") is not None:
        f = files.get(info["safetensors_file"])
        entry_name = info.get("weight_name", full)
        entry = f.entries[entry_name]
        start, end = f.span(entry_name)
        return _Source(key=(f.path, entry_name), file=f, start=start, end=end,
                       dtype=getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]]), shape=tuple(entry["shape"]))
    path = os.path.join(loader.save_folder, f"{full}.dat")
    f = files.get(path, raw=True)
    shape = tuple(info["shape"])
    dtype = getattr(torch, info["dtype"])
    return _Source(key=(f.path,), file=f, start=0, end=dtype.itemsize * max(1, math.prod(shape)), dtype=dtype,
                   shape=shape)


@dataclass
class _Slot:
    """One tensor a hook streams: where it is set on the module, its meta placeholder, where its bytes are."""

    owner: object
    attr: str
    is_param: bool
    meta: object
    source: _Source

    @property
    def nbytes(self) -> int:
        return self.meta.numel() * self.meta.element_size()


@dataclass
class _Unit:
    """One offloaded module: accelerate's hook it replaces and the tensors it streams."""

    index: int
    name: str
    module: object
    original: object                 # accelerate's AlignDevicesHook
    slots: list[_Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _convert(value, meta):
    """The value as accelerate's ``set_module_tensor_to_device`` makes it: cast to the placeholder's dtype."""
    return value if value.dtype == meta.dtype else value.to(meta.dtype)


class HostDevice:
    """CPU main device: a module's weights are views into the mapped files.

    Ahead of a module (``prefetch``), by default the kernel is asked to read its byte ranges in
    (``madvise(MADV_WILLNEED)``, asynchronous read-ahead, no thread and nothing materialised early); with
    ``thread=True`` a background thread reads the pages in and makes the views ahead (the runtime then holds them).
    """

    kind = "cpu"

    def __init__(self, *, thread: bool = False):
        self.threaded = thread

    def advise(self, slots) -> None:
        """Start the kernel's read-ahead of ``slots``' bytes."""
        for s in slots:
            s.source.advise()

    def stage(self, slots, *, ahead: bool):
        """Make ``slots``' tensors ready; on the prefetch thread (``ahead``) also read their pages in."""
        if ahead:
            for s in slots:
                s.source.page_in()
        return {s.source.key: _convert(s.source.host(), s.meta) for s in slots}

    def ready(self, handle):
        return handle


class _StandInStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        assert event.recorded, f"wait on an event never recorded ({event.label})"
        self.log.append(("wait", self.name, event.label))


class _StandInEvent:
    def __init__(self, log, label):
        self.log, self.label, self.recorded = log, label, False

    def record(self, stream):
        self.recorded = True
        self.log.append(("record", stream.name, self.label))

    def synchronize(self):
        pass


class _CudaBackend:
    """CUDA streams and events for :class:`StreamDevice`."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.side = torch.cuda.Stream(self.device)

    def event(self, label):
        return self.torch.cuda.Event()

    def current(self):
        return self.torch.cuda.current_stream(self.device)

    def copy(self, host):
        torch = self.torch
        pinned = host if host.is_pinned() else host.pin_memory()
        with torch.cuda.stream(self.side):
            return pinned.to(self.device, non_blocking=True)

    def used_on(self, tensor, stream):
        tensor.record_stream(stream)


class _StandInBackend:
    """A CPU stand-in for a GPU: 'copies' are clones, streams and events log what they are asked to do."""

    def __init__(self):
        self.log: list[tuple] = []
        self.side = _StandInStream(self.log, "side")
        self.compute = _StandInStream(self.log, "compute")

    def event(self, label):
        return _StandInEvent(self.log, label)

    def current(self):
        return self.compute

    def copy(self, host):
        return host.clone()

    def used_on(self, tensor, stream):
        pass


class StreamDevice:
    """A GPU main device: weights copied from pinned host memory on a side stream, an event per module.

    ``stage`` (on the prefetch thread, or inline without prefetch) issues the module's copies on the side stream and
    records an event after them; ``ready`` (on the compute thread, before the module runs) makes the compute stream
    wait for that event only, and marks the tensors used there so the allocator does not reuse them early.
    """

    kind = "stream"
    threaded = True

    def __init__(self, backend):
        self.backend = backend

    @classmethod
    def cuda(cls, device) -> StreamDevice:
        return cls(_CudaBackend(device))

    def stage(self, slots, *, ahead: bool):
        b = self.backend
        label = slots[0].source.key if slots else ()
        out = {}
        for s in slots:   # cast on the host: a cast on the device would run outside the side stream
            out[s.source.key] = b.copy(_convert(s.source.host(), s.meta))
        event = b.event(label)
        event.record(b.side)
        return out, event

    def ready(self, handle):
        tensors, event = handle
        stream = self.backend.current()
        stream.wait_event(event)
        for t in tensors.values():
            self.backend.used_on(t, stream)
        return tensors


class StandInDevice(StreamDevice):
    """:class:`StreamDevice` over a CPU stand-in: its ``log`` lists the copies, records and waits in order."""

    def __init__(self):
        super().__init__(_StandInBackend())

    @property
    def log(self) -> list[tuple]:
        return self.backend.log


class Scheduler:
    """Which offloaded unit runs after which: module order at first, then what really ran (learnt at every step,
    so ``generate``'s repeated decoder passes and an encoder that runs once are both followed).

    Examples
    --------
    >>> s = Scheduler(4)          # before anything ran: module order, wrapping round
    >>> s.ahead(2, 2)
    [3, 0]
    >>> for unit in (0, 2, 1, 0):   # what really ran: 0, then 2, then 1, then 0 again
    ...     s.arrive(unit)
    >>> s.ahead(0, 2)
    [2, 1]
    """

    def __init__(self, n: int):
        self.after = {i: i + 1 for i in range(n - 1)}
        if n:
            self.after[n - 1] = 0
        self.last: int | None = None

    def arrive(self, unit: int) -> None:
        if self.last is not None and self.last != unit:
            self.after[self.last] = unit
        self.last = unit

    def ahead(self, unit: int, k: int) -> list[int]:
        """The next ``k`` distinct units expected after ``unit``."""
        out, u = [], unit
        for _ in range(k):
            u = self.after.get(u)
            if u is None or u == unit or u in out:
                break
            out.append(u)
        return out


class OffloadHook:
    """Replaces one offloading ``AlignDevicesHook``: its module's weights fetched together, possibly ahead."""

    no_grad = False

    def __init__(self, runtime: Attached, unit: _Unit):
        self.runtime, self.unit = runtime, unit
        h = unit.original
        self.execution_device, self.io_same_device, self.skip_keys = h.execution_device, h.io_same_device, h.skip_keys
        self.input_device = None

    def init_hook(self, module):
        return module

    def detach_hook(self, module):
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


def _slots(module, hook, files: _Files) -> list[_Slot]:
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
        slots.append(_Slot(owner, attr, is_param, tensor, _source(hook.weights_map, name, files)))
    return slots


class Attached:
    """The runtime attached to one model: its units, the mapped files, the device and the prefetch thread.

    Attributes
    ----------
    units : list
        The offloaded modules, in module order.
    prefetch : int
        How many units ahead the weights are made ready.
    held, peak_held : int
        Bytes of offloaded weights materialised now (running or prefetched), and the most at once.
    fetches : int
        Units staged (inline or ahead).
    """

    def __init__(self, model, *, prefetch: int, device):
        self.model = model
        self.prefetch = prefetch
        self.files = _Files()
        self.units: list[_Unit] = []
        for name, module, _, _, h in _offload_hooks(model):
            unit = _Unit(len(self.units), name, module, h)
            unit.slots = _slots(module, h, self.files)
            self.units.append(unit)
        self.device = device
        self.scheduler = Scheduler(len(self.units))
        self.live: dict[tuple, list] = {}        # source key -> [tensor, users]
        self.pending: dict[int, Future] = {}     # unit -> staged handle (prefetched)
        self.held = self.peak_held = self.fetches = 0
        self.lock = threading.Lock()
        self.threaded = getattr(device, "threaded", True)
        self.executor = (ThreadPoolExecutor(1, thread_name_prefix="allocator-prefetch")
                         if prefetch and self.threaded else None)

    # --- accounting -------------------------------------------------------------------------------------------
    def _count(self, nbytes: int) -> None:
        with self.lock:
            self.held += nbytes
            self.peak_held = max(self.peak_held, self.held)

    def _stage(self, unit: _Unit, ahead: bool):
        slots = [s for s in unit.slots if s.source.key not in self.live] if not ahead else unit.slots
        handle = self.device.stage(slots, ahead=ahead)
        counted = sum({s.source.key: s.nbytes for s in slots}.values())
        self._count(counted)
        with self.lock:
            self.fetches += 1
        return handle, counted

    # --- what the hooks call ----------------------------------------------------------------------------------
    def load(self, unit: _Unit) -> None:
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

    def _is_live(self, unit: _Unit) -> bool:
        return bool(unit.slots) and all(s.source.key in self.live for s in unit.slots)

    def drop(self, unit: _Unit) -> None:
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
        """Drop the pages of every mapped file from this process (:meth:`MappedFile.evict`)."""
        for f in list(self.files.open.values()):
            f.evict()

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


def attach(model, plan=None, *, prefetch: int | None = None, device=None) -> Attached:
    """Replace accelerate's offloading hooks on ``model`` with the allocator runtime.

    Parameters
    ----------
    model : torch.nn.Module
        A model loaded with offloading by ``from_pretrained(device_map=...)``, ``dispatch_model`` or
        ``load_checkpoint_and_dispatch`` (its offloaded modules have accelerate's ``AlignDevicesHook``).
    plan : allocator.Plan or dict, optional
        The plan (or device map) it was loaded with; when given, ``model.hf_device_map`` must be that map, and the
        plan's runtime decides the default prefetch.
    prefetch : int, optional
        Offloaded units made ready ahead of the one running (0: none). Default: what the plan reserved
        (``prefetch`` with ``runtime="allocator"``, 0 for a plan made for accelerate's hooks), else 1.
    device : optional
        ``None`` (from the hooks' execution device: :class:`HostDevice` for ``cpu``, CUDA streams for a GPU),
        ``"stand-in"`` (:class:`StandInDevice`) or a device object with ``stage`` / ``ready``.

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
    if getattr(model, "_allocator_runtime", None) is not None:
        raise InvalidRuntime("this model already runs the allocator runtime; detach(model) first.")
    if plan is not None:
        expected, loaded = dict(_plan_map(plan)), getattr(model, "hf_device_map", None)
        if loaded is not None and dict(loaded) != expected:
            raise InvalidRuntime(f"the model was loaded with device_map {loaded}, not the plan's {expected}; "
                                 f"load it with plan.device_map.")
    options = getattr(getattr(plan, "problem", None), "options", None)
    if prefetch is None:   # what the plan reserved for: none under accelerate's hooks
        prefetch = 1 if options is None else prefetch_of(options)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise InvalidOption(f"prefetch must be a non-negative integer, got {prefetch!r}.")
    if not has_offload_hooks(model):
        raise InvalidRuntime("the model has no offloaded modules (no accelerate AlignDevicesHook with offload=True):"
                             " load it with a device_map that puts something on 'disk' (or 'cpu' with a GPU).")
    device = _device_for(model, device)
    if options is not None and prefetch > prefetch_of(options) and getattr(device, "threaded", True):
        warn_caller(f"attach(prefetch={prefetch}) holds up to {prefetch} offloaded modules ahead on the main device, "
                    f"beyond what the plan reserved (prefetch={prefetch_of(options)}); plan with "
                    f"runtime='allocator', prefetch={prefetch} so that its budget counts them.")
    runtime = Attached(model, prefetch=prefetch, device=device)
    hooks = {id(u.original): OffloadHook(runtime, u) for u in runtime.units}
    for _, module, top, i, h in list(_offload_hooks(model)):
        if i is None:
            module._hf_hook = hooks[id(h)]
        else:
            top.hooks = type(top.hooks)(hooks[id(x)] if x is h else x for x in top.hooks)   # tuple or list
    model._allocator_runtime = runtime
    return runtime


def detach(model) -> None:
    """Put accelerate's offloading hooks back where :func:`attach` replaced them, and stop the prefetch thread."""
    from accelerate.hooks import SequentialHook

    runtime = getattr(model, "_allocator_runtime", None)
    if runtime is None:
        raise InvalidRuntime("this model does not run the allocator runtime (attach(model, plan) first).")
    runtime.close()
    for unit in runtime.units:
        top = unit.module._hf_hook
        if isinstance(top, SequentialHook):
            top.hooks = type(top.hooks)(unit.original if isinstance(x, OffloadHook) and x.unit is unit else x
                                        for x in top.hooks)   # tuple or list, as accelerate made it
        elif isinstance(top, OffloadHook):
            unit.module._hf_hook = unit.original
    del model._allocator_runtime


def dispatch(model, plan, checkpoint, *, offload_folder=None, offload_buffers: bool = False,
             prefetch: int | None = None, device=None, **kwargs):
    """``accelerate.load_checkpoint_and_dispatch`` with ``plan``'s map, then :func:`attach`: for plain ``nn.Module``
    users. ``kwargs`` go to accelerate. Returns the model (its runtime is ``model._allocator_runtime``)."""
    from accelerate import load_checkpoint_and_dispatch

    model = load_checkpoint_and_dispatch(model, checkpoint, device_map=dict(_plan_map(plan)),
                                         offload_folder=offload_folder, offload_buffers=offload_buffers, **kwargs)
    attach(model, plan, prefetch=prefetch, device=device)
    return model
