"""Where an offloaded module's weights are made ready: the main device of the offload runtime.

:class:`HostDevice` (a CPU main device: views into the mapped files, read ahead by the kernel or a thread),
:class:`StreamDevice` (a GPU: copies from pinned host memory on a side stream, an event per module, over the CUDA
backend) and :class:`StandInDevice` (the same stream logic over a CPU stand-in backend that logs what it is asked to
do, so that the scheduling is tested without a GPU). Each has ``stage(slots, ahead=)`` and ``ready(handle)``; the
two stream devices also say where a tensor is and move values between the CPU and the main device
(``on_main``, ``to_host``, ``to_main``, ``pinned``), which is how the hybrid hook moves activations and KV caches.

On the stand-in, a tensor "on the accelerator" is a ``StandInTensor`` (a tag: the memory is RAM; see
:func:`on_stand_in`). Its weights are staged as such, what is computed with one is one (torch's subclass rule),
``to_host`` returns plain copies and ``to_main`` tagged copies, so tests see where the KV cache, the inputs and the
outputs of every hook are. A plain tensor is in RAM or was never moved (a module not offloaded computes on plain
weights): :meth:`StandInDevice.put` places inputs on the stand-in as a user sends them to the main device. On a GPU
the same four calls are accelerate's ``send_to_device``, ``tensor.device`` and a pinned ``torch.empty``: nothing is
tagged there.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

__all__ = ["HostDevice", "StandInDevice", "StreamDevice", "on_stand_in", "prefetch_executor", "to_host", "to_main"]


def _convert(value, meta):
    """The value as accelerate's ``set_module_tensor_to_device`` makes it: cast to the placeholder's dtype."""
    return value if value.dtype == meta.dtype else value.to(meta.dtype)


_TAG: list = []


def _tag_class():
    """The :class:`StandInTensor` class, made on first use (the runtime imports torch only where it runs)."""
    if not _TAG:
        import torch

        class StandInTensorClass(torch.Tensor):
            """A tensor on the stand-in accelerator (its memory is RAM); what torch computes with one is one."""

        StandInTensorClass.__name__ = StandInTensorClass.__qualname__ = "StandInTensor"
        _TAG.append(StandInTensorClass)
    return _TAG[0]


def on_stand_in(tensor) -> bool:
    """Whether ``tensor`` is on the stand-in accelerator (a :class:`StandInTensor`)."""
    return bool(_TAG) and isinstance(tensor, _TAG[0])


def _walk(value, tensor_fn, skip_keys=None):
    """``value`` with ``tensor_fn`` applied to each tensor in it (tuples, lists, dicts, as accelerate's
    ``send_to_device`` walks them; ``skip_keys`` of dicts left as they are)."""
    import torch

    if isinstance(value, torch.Tensor):
        return tensor_fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a named tuple
        return type(value)(*(_walk(v, tensor_fn, skip_keys) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_walk(v, tensor_fn, skip_keys) for v in value)
    if isinstance(value, dict):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
        return type(value)({k: v if k in skip else _walk(v, tensor_fn, skip_keys) for k, v in value.items()})
    return value


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

    def copy_into(self, host, out):
        """Copy ``host`` into ``out`` (RAM to RAM)."""
        return out.copy_(host)


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

    def on_main(self, tensor) -> bool:
        return tensor.device.type != "cpu"

    def to_host(self, value, skip_keys=None):
        from accelerate.utils import send_to_device

        return send_to_device(value, "cpu", skip_keys=skip_keys)

    def to_main(self, value, target, skip_keys=None):
        from accelerate.utils import send_to_device

        return send_to_device(value, target, skip_keys=skip_keys)

    def pinned(self, shape, dtype):
        return self.torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy_into(self, host, out):
        pinned = host if host.is_pinned() else host.pin_memory()
        return out.copy_(pinned, non_blocking=True)   # on the compute stream: ordered before the kernels using it


class _StandInBackend:
    """A CPU stand-in for a GPU: 'copies' are clones, streams and events log what they are asked to do."""

    #: its "device" memory is RAM: every accelerator of a plan run on it is the CPU
    on_host = True

    def __init__(self):
        self.log: list[tuple] = []
        self.staged = 0
        self.side = _StandInStream(self.log, "side")
        self.compute = _StandInStream(self.log, "compute")

    def event(self, label):
        return _StandInEvent(self.log, label)

    def current(self):
        return self.compute

    def copy(self, host):
        self.staged += host.numel() * host.element_size()   # a module's weights "copied to the GPU"
        return host.clone().as_subclass(_tag_class())

    def copy_into(self, host, out):
        self.log.append(("copy", host.numel() * host.element_size()))
        return out.copy_(host)

    def used_on(self, tensor, stream):
        pass

    def on_main(self, tensor) -> bool:
        return on_stand_in(tensor)

    def to_host(self, value, skip_keys=None):
        """Plain copies of the tagged tensors of ``value`` (a device-to-host copy); plain tensors as they are."""
        import torch

        return _walk(value, lambda t: t.as_subclass(torch.Tensor).clone() if on_stand_in(t) else t, skip_keys)

    def to_main(self, value, target, skip_keys=None):
        """Tagged copies of the plain tensors of ``value`` (a host-to-device copy: later writes to the source, such
        as a staging buffer's next use, do not reach them); tagged tensors as they are."""
        tag = _tag_class()
        return _walk(value, lambda t: t if on_stand_in(t) else t.clone().as_subclass(tag), skip_keys)

    def pinned(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype)


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
        #: moves between the CPU and the main device (calls of :meth:`to_host` and :meth:`to_main` that moved a
        #: tensor: one per part and direction where a hook moves a part's inputs or output together), by
        #: ``(what, direction)``: ``what`` is ``"activations"`` (inputs and outputs) or ``"cache"`` (a KV cache
        #: layer), ``direction`` ``"to_host"`` or ``"to_main"``; a tensor already where it goes is not counted
        self.moves: Counter = Counter()
        #: the tensors those moves carried, and their bytes, by the same keys
        self.moved_tensors: Counter = Counter()
        self.moved_bytes: Counter = Counter()

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

    def copy_into(self, host, out):
        """Copy ``host`` (expert slices) into ``out`` on the device, ordered before what the compute stream runs
        next; the stand-in logs ``("copy", bytes)``."""
        return self.backend.copy_into(host, out)

    def on_main(self, tensor) -> bool:
        """Whether ``tensor`` is on the main device."""
        return self.backend.on_main(tensor)

    def to_host(self, value, skip_keys=None, *, what: str = "activations"):
        """``value`` with its tensors on the CPU (those that cross counted in :attr:`moves` under ``what``)."""
        self._count(value, skip_keys, (what, "to_host"), on_main=True)
        return self.backend.to_host(value, skip_keys)

    def to_main(self, value, target, skip_keys=None, *, what: str = "activations"):
        """``value`` with its tensors on ``target`` (the hook's execution device or its input's device); those that
        cross counted in :attr:`moves` under ``what``."""
        self._count(value, skip_keys, (what, "to_main"), on_main=False)
        return self.backend.to_main(value, target, skip_keys)

    def _count(self, value, skip_keys, key: tuple, *, on_main: bool) -> None:
        crossing = [0, 0]

        def count(tensor):
            if self.backend.on_main(tensor) == on_main:
                crossing[0] += 1
                crossing[1] += tensor.numel() * tensor.element_size()
            return tensor

        _walk(value, count, skip_keys)
        if crossing[0]:
            self.moves[key] += 1
            self.moved_tensors[key] += crossing[0]
            self.moved_bytes[key] += crossing[1]

    def pinned(self, shape, dtype):
        """An empty host buffer the device copies from asynchronously (pinned on a GPU)."""
        return self.backend.pinned(shape, dtype)

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

    def put(self, value):
        """``value`` placed on the stand-in accelerator, as a user sends inputs to the main device."""
        return self.backend.to_main(value, None)

    @property
    def staged(self) -> int:
        """Bytes of weights staged ("copied to the GPU") so far; the expert slices' copies are in :attr:`log`."""
        return self.backend.staged


def to_host(device, value):
    """``value`` with its tensors in RAM, in one move: through ``device`` where it is a :class:`StreamDevice` (the
    move counted in its :attr:`StreamDevice.moves`; plain copies on the stand-in), else ``tensor.to("cpu")``."""
    if isinstance(device, StreamDevice):
        return device.to_host(value)
    return _walk(value, lambda t: t.to("cpu"))


def to_main(device, value, target):
    """``value`` with its tensors on the main device ``target``, in one move (:func:`to_host`'s other direction)."""
    if isinstance(device, StreamDevice):
        return device.to_main(value, target)
    return _walk(value, lambda t: t.to(target))


def _one_intra_op_thread() -> None:
    import torch

    torch.get_num_threads()   # torch sets a thread's count from the default at its first use: that first
    torch.set_num_threads(1)


def prefetch_executor() -> ThreadPoolExecutor:
    """The prefetch thread (:class:`allocator.offload.Attached`'s executor), staging on one intra-op thread: its
    parallel regions would otherwise start a second team of torch's threads beside the compute thread's and, on a
    busy machine, wait for a descheduled one (docs/runtime.md, "Threads"). ``torch.set_num_threads`` on that thread
    also makes 1 the default of threads started later and MKL's count: the calling thread's count is set again,
    unchanged, to put those back."""
    import torch

    threads = torch.get_num_threads()
    executor = ThreadPoolExecutor(1, thread_name_prefix="allocator-prefetch", initializer=_one_intra_op_thread)
    executor.submit(int).result()   # the thread is started and set before this thread's count is put back
    torch.set_num_threads(threads)
    return executor
