"""Where an offloaded module's weights are made ready: the main device of the offload runtime.

:class:`HostDevice` (a CPU main device: views into the mapped files, read ahead by the kernel or a thread),
:class:`StreamDevice` (a GPU: copies from pinned host memory on a side stream, an event per module, over the CUDA
backend) and :class:`StandInDevice` (the same stream logic over a CPU stand-in backend that logs what it is asked to
do, so that the scheduling is tested without a GPU). Each has ``stage(slots, ahead=)`` and ``ready(handle)``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

__all__ = ["HostDevice", "StandInDevice", "StreamDevice", "prefetch_executor"]


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
        return host.clone()

    def copy_into(self, host, out):
        self.log.append(("copy", host.numel() * host.element_size()))
        return out.copy_(host)

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

    def copy_into(self, host, out):
        """Copy ``host`` (expert slices) into ``out`` on the device, ordered before what the compute stream runs
        next; the stand-in logs ``("copy", bytes)``."""
        return self.backend.copy_into(host, out)

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

    @property
    def staged(self) -> int:
        """Bytes of weights staged ("copied to the GPU") so far; the expert slices' copies are in :attr:`log`."""
        return self.backend.staged


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
