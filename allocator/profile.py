"""The bandwidth profile of the machine a plan runs on: named defaults with their sources, or measured."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from .errors import InvalidOption, cause_line

__all__ = ["Profile", "read_rates", "flop_seconds", "COUNTED", "counted_rates", "read_seconds"]

log = logging.getLogger(__name__)

GB = 1e9
#: HBM2e read bandwidth of an NVIDIA A100 40GB: 1,555 GB/s (NVIDIA A100 datasheet).
ACCELERATOR_MEMORY = 1555 * GB
#: Pageable host-to-device copies over PCIe 4.0 x16 reach roughly a third of the 32 GB/s link (pinned memory
#: gets ~25 GB/s); accelerate's offload hooks copy from pageable memory (CUDA C++ Best Practices Guide, "Pinned
#: memory"; PCI-SIG PCIe 4.0 specification for the link rate).
HOST_TO_DEVICE = 10 * GB
#: Pinned host-to-device copies over PCIe 4.0 x16: ~25 GB/s of the 32 GB/s link (CUDA C++ Best Practices Guide,
#: "Pinned memory"); the allocator runtime's copies and its activation staging buffers are pinned.
PINNED_HOST_TO_DEVICE = 25 * GB
#: Sequential read of a PCIe 4.0 NVMe SSD (e.g. Samsung 980 PRO datasheet: 7 GB/s); halved for 4 KiB-page
#: memory-mapped reads through the page cache.
DISK_READ = 3.5 * GB
#: One-socket DDR4-3200 dual channel: 51.2 GB/s peak, ~20 GB/s for a single-threaded copy or a CPU forward's reads
#: (JEDEC DDR4 standard; STREAM benchmark figures for a single thread).
CPU_MEMORY = 20 * GB
#: Device-to-device over PCIe without NVLink (same link as HOST_TO_DEVICE, pinned buffers).
DEVICE_TO_DEVICE = 20 * GB
#: A change of executing device: a synchronising copy and a kernel launch, ~10-20 us (CUDA launch latency).
SWITCH_LATENCY = 20e-6
#: Activations moved at a change of device: batch 1 x 512 tokens x 4096 hidden x 2 bytes.
ACTIVATION_BYTES = 4 * 2**20
#: Tokens (or patches) per forward: a 512-token prompt. Set 1 to model one decoding step, where reading weights
#: dominates and running on the CPU can beat streaming weights over PCIe.
TOKENS = 512
#: Per tensor streamed to the main device at each forward, whatever its size: accelerate's ``AlignDevicesHook``
#: fetches each offloaded tensor from its weights map and swaps it in with ``set_module_tensor_to_device`` (then
#: back to meta after the module ran). 66 us measured on the machine of ``benchmarks/results/latency.md`` (x86_64,
#: 2 shared cores, accelerate 1.15): 64 ``Linear(4, 4)`` (128 tensors) hooked with their weights served from a
#: state dict in RAM, forward time minus the same model without hooks, per tensor (``Profile.measure`` repeats
#: it, and with an accelerator as the target when CUDA exists; a small copy to an accelerator adds its launch).
OFFLOAD_TENSOR_LATENCY = 66e-6
#: Per tensor read from disk at each forward, on top of :data:`OFFLOAD_TENSOR_LATENCY` and the bytes: accelerate's
#: ``OffloadedWeightsLoader.__getitem__`` opens the safetensors checkpoint (``safe_open``: header parse, mmap) for
#: *each* tensor. Measured as above with the weights served from a safetensors file (page cache warm): 352 us per
#: tensor in all, minus the 66 us hook path. The least-squares fit of benchmarks/results/latency.md over whole
#: models gives 0.35-0.8 ms per disk tensor in all.
DISK_TENSOR_LATENCY = 286e-6
#: Dense TF32 tensor-core throughput of an NVIDIA A100: 156 TFLOPS (NVIDIA A100 datasheet).
ACCELERATOR_FLOPS = 156e12
#: FP32 throughput of a 16-core AVX-512 server CPU: 16 cores x 2.0 GHz x 32 FLOP/cycle ~ 1 TFLOPS.
CPU_FLOPS = 1e12
#: Reading a file whose pages are in the page cache: a copy out of RAM, at :data:`CPU_MEMORY`'s rate.
DISK_READ_WARM = CPU_MEMORY
#: Per aten op a CPU forward dispatches, whatever its size: PyTorch's eager dispatcher and a tiny kernel, ~2 us
#: (measured on the machine of ``benchmarks/results/latency.md`` by ``Profile.measure``: 1.96 us per op of an
#: ``add, view, t, mul, contiguous`` chain on a 4-element tensor, torch 2.13, x86_64).
CPU_OP_LATENCY = 2e-6
#: Per op on an accelerator: a CUDA kernel launch from eager PyTorch, ~5 us (NVIDIA's CUDA C++ Best Practices
#: Guide gives launch overheads of a few microseconds; PyTorch's eager dispatcher adds about as much on top).
ACCELERATOR_OP_LATENCY = 5e-6
#: Per tensor accelerate's hooks move to an accelerator per forward: ``set_module_tensor_to_device`` (accelerate
#: 1.15-1.16, ``clear_cache=True``) calls ``torch.cuda.empty_cache()`` for every tensor and copies from pageable
#: memory (a synchronising copy). Conservative until measured (``Profile.measure`` times it where CUDA exists):
#: 200 us, three times the 66 us of :data:`OFFLOAD_TENSOR_LATENCY`'s CPU-to-CPU path.
ACCELERATOR_TENSOR_LATENCY = 200e-6

#: Bytes per second the CPU writes evaluating a function per element (activations, norms, softmax): ~3 GB/s, a
#: third of a copy (measured on the machine of ``benchmarks/results/latency.md`` by ``Profile.measure``: 3.3 GB/s
#: for ``gelu``, 3.4 for ``softmax``, 4.3 for ``layer_norm`` on 4 MiB float32 tensors, one thread, torch 2.13).
CPU_POINTWISE = 3e9
#: Bytes per second the CPU writes interpolating across memory layouts (``allocator.model.flops.RESAMPLE`` with a
#: non-contiguous input and a contiguous output, as SegFormer's decode head does): ~0.4 GB/s, a tenth of
#: :data:`CPU_POINTWISE` (measured on the same machine by ``Profile.measure``: a bilinear resize of a
#: ``(1, 4096, 256).permute(0, 2, 1).reshape(1, -1, 64, 64)`` float32 view to 128 x 128, 39 ms, one thread, torch
#: 2.13; the same resize of a contiguous or channels-last tensor takes 1.6-6 ms).
CPU_STRIDED = 4e8

_RATES = ("accelerator_memory", "host_to_device", "pinned_host_to_device", "disk_read", "disk_read_warm", "cpu_memory",
          "device_to_device",
          "accelerator_flops", "cpu_flops", "cpu_pointwise", "cpu_strided")


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Bandwidths (bytes/s) and latencies (s) of the machine a plan will run on."""

    accelerator_memory: float = ACCELERATOR_MEMORY
    """Reading resident weights on an accelerator."""
    host_to_device: float = HOST_TO_DEVICE
    """Copying offloaded weights from RAM to the accelerator (pageable memory)."""
    pinned_host_to_device: float = PINNED_HOST_TO_DEVICE
    """Copying from pinned host memory to the accelerator (the allocator runtime's copies and activation staging);
    not measured without an accelerator (``Profile.measure`` keeps the named default)."""
    disk_read: float = DISK_READ
    """Reading offloaded weights from disk."""
    cpu_memory: float = CPU_MEMORY
    """Reading weights in RAM when the CPU executes."""
    device_to_device: float = DEVICE_TO_DEVICE
    """Moving activations between accelerators (or between an accelerator and the host)."""
    switch_latency: float = SWITCH_LATENCY
    """Fixed cost of a change of executing device."""
    offload_tensor_latency: float = OFFLOAD_TENSOR_LATENCY
    """Fixed cost per offloaded tensor streamed to the main device per forward (the hook's fetch and swap)."""
    disk_tensor_latency: float = DISK_TENSOR_LATENCY
    """Further fixed cost per tensor read from disk per forward (accelerate opens the checkpoint per tensor)."""
    activation_bytes: int = ACTIVATION_BYTES
    """Activation bytes moved at each change of executing device."""
    tokens: int = TOKENS
    """Tokens per forward: each parameter costs ``2 * tokens`` FLOP where it executes."""
    accelerator_flops: float = ACCELERATOR_FLOPS
    """Arithmetic throughput of an accelerator (FLOP/s)."""
    cpu_flops: float = CPU_FLOPS
    """Arithmetic throughput of the CPU (FLOP/s)."""
    disk_read_warm: float = DISK_READ_WARM
    """Reading offloaded weights from disk when their pages are in the page cache (:attr:`disk_read` is the cold
    rate, what the estimate charges)."""
    cpu_op_latency: float = CPU_OP_LATENCY
    """Fixed cost of each op the CPU executes (where ops were counted, :mod:`allocator.model.flops`)."""
    accelerator_op_latency: float = ACCELERATOR_OP_LATENCY
    """Fixed cost of each op an accelerator executes (a kernel launch)."""
    accelerator_tensor_latency: float = ACCELERATOR_TENSOR_LATENCY
    """Fixed cost per offloaded tensor streamed to an accelerator main device per forward (the hook's copy and its
    ``empty_cache``); :attr:`offload_tensor_latency` is the same path with the CPU as the main device."""
    cpu_pointwise: float = CPU_POINTWISE
    """Bytes per second the CPU writes evaluating a function per element (``allocator.model.flops.POINTWISE`` ops; an
    accelerator's are charged at :attr:`accelerator_memory`)."""
    cpu_strided: float = CPU_STRIDED
    """Bytes per second the CPU writes interpolating across memory layouts (``allocator.model.flops.FlopCount.strided``;
    an accelerator's are charged at :attr:`accelerator_memory`)."""
    spread: Mapping = field(default_factory=dict, compare=False, repr=False)
    """Measured fields only (:meth:`measure`): field name -> relative spread of its repeats, ``(max - min) /
    median`` (0.1: the repeats lay within 10 % of the median). Not part of equality."""

    def __post_init__(self):
        for name in _NUMBERS:
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not value >= 0 or value == float("inf"):
                raise InvalidOption(f"Profile.{name} must be a finite number >= 0, got {value!r}.")
        for name in _RATES:
            if getattr(self, name) == 0:
                raise InvalidOption(f"Profile.{name} is a bandwidth and must be > 0.")
        if not isinstance(self.spread, Mapping) or not all(
                k in _NUMBERS and isinstance(v, (int, float)) and v >= 0 for k, v in self.spread.items()):
            raise InvalidOption(f"Profile.spread must map field names to relative spreads >= 0, got {self.spread!r}.")
        object.__setattr__(self, "spread", MappingProxyType(dict(self.spread)))   # frozen: no one edits it later

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (``spread`` a plain dict, empty unless measured)."""
        out = {name: getattr(self, name) for name in _NUMBERS}
        out["spread"] = dict(self.spread)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """The profile of :meth:`to_dict`'s fields; a field missing (a file written before it existed) keeps its
        default."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            known = [f.name for f in dataclasses.fields(cls)]
            raise InvalidOption(f"unknown Profile fields {sorted(unknown)}; known: {known}.")
        return cls(**data)

    @classmethod
    def load(cls, path) -> "Profile":
        """The profile stored in ``path`` (a JSON object of fields, as ``allocator profile --out`` writes it).

        Raises
        ------
        InvalidOption
            The file cannot be read, is not JSON, not an object, or has unknown or invalid fields.
        """
        try:
            with open(path) as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise InvalidOption(f"cannot read profile {path}: {reason}; write one with 'allocator profile --out FILE'."
                                ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidOption(f"profile {path} is not JSON ({err}); write one with 'allocator profile --out FILE'."
                                ) from None
        if not isinstance(data, dict):
            raise InvalidOption(f"profile {path} holds a JSON {type(data).__name__}, expected an object of Profile "
                                "fields.")
        try:
            return cls.from_dict(data)
        except InvalidOption as err:
            raise InvalidOption(f"profile {path}: {err}") from None

    @classmethod
    def measure(cls, *, size: int = 64 * 2**20, repeats: int = 5, folder=None) -> "Profile":
        """Measure this machine; each rate or latency is the median of ``repeats`` timings, its relative spread in
        :attr:`spread`.

        Always: RAM (a copy of ``size`` bytes), the CPU's FLOP rate (``F.linear`` in float32, a 512 x 2048 by
        2048 x 2048 product like a real layer's, at ``torch.get_num_threads()`` threads), the per-op cost of the
        CPU (a chain of tiny ops), its rate of functions per element (``gelu``, ``softmax``, ``layer_norm`` on 4 MiB),
        disk reads of a ``size``-byte file in ``folder`` (a temporary folder when
        ``None``): written, ``fsync``-ed, then dropped from the page cache with ``posix_fadvise(DONTNEED)`` before
        each cold read (:attr:`disk_read`, where ``posix_fadvise`` exists; else the reads are warm) and read again
        with the pages kept (:attr:`disk_read_warm`). The per-tensor latencies time accelerate's own hooks (when
        accelerate and safetensors import) on 64 tiny ``Linear`` layers: weights served from RAM for
        :attr:`offload_tensor_latency`, from a safetensors file minus that for :attr:`disk_tensor_latency`, to the
        accelerator for :attr:`accelerator_tensor_latency` where CUDA exists; there also host-to-device, accelerator
        memory, FLOP rate and per-kernel latency. Unmeasured fields keep their defaults.

        Raises
        ------
        InvalidOption
            ``size`` is below 8 bytes, ``repeats`` below 1, or ``folder`` is not a folder.
        """
        import numpy as np
        import torch
        import torch.nn.functional as F

        if not (isinstance(size, int) and size >= 8 and isinstance(repeats, int) and repeats >= 1):
            raise InvalidOption(f"Profile.measure needs size >= 8 bytes and repeats >= 1, got size={size!r}, "
                                f"repeats={repeats!r}.")
        if folder is not None and not os.path.isdir(folder):
            raise InvalidOption(f"Profile.measure folder {folder} is not a folder; pass an existing one (where the "
                                "disk test file is written).")
        timed: dict = {}
        buf = np.ones(max(size // 8, 1), dtype=np.float64)
        timed["cpu_memory"] = _rate(lambda: buf.copy(), buf.nbytes, repeats)
        x, w = torch.ones(512, 2048), torch.ones(2048, 2048)
        with torch.no_grad():
            timed["cpu_flops"] = _rate(lambda: F.linear(x, w), 2 * 512 * 2048 * 2048, repeats)
        timed["cpu_op_latency"] = _latency(_tiny_ops(torch.ones(4)), _TINY_OPS, repeats)
        with torch.no_grad():
            timed["cpu_pointwise"] = _rate(_pointwise(torch.ones(1024, 1024)), 3 * 4 * 2**20, repeats)
            view = torch.ones(1, 64 * 64, 256).permute(0, 2, 1).reshape(1, -1, 64, 64)   # not contiguous
            timed["cpu_strided"] = _rate(lambda: F.interpolate(view, size=(128, 128), mode="bilinear"),
                                         256 * 128 * 128 * 4, repeats)
        timed.update(_disk(buf, folder, repeats))
        try:
            timed.update(_tensor_latencies(repeats))
        except ImportError as err:
            log.warning("could not time accelerate's offload hooks (%s); keeping default per-tensor latencies",
                        cause_line(err))
        try:
            if torch.cuda.is_available():
                timed.update(_accelerator(size, repeats))
        except Exception as err:  # a broken driver must not break planning; say so
            log.warning("could not measure the accelerator (%s); keeping default bandwidths", cause_line(err))
        return cls(**{k: v for k, (v, _) in timed.items()}, spread={k: s for k, (_, s) in timed.items()})


_NUMBERS = tuple(f.name for f in dataclasses.fields(Profile) if f.name != "spread")
_TINY_OPS = 5   # aten ops of one _tiny_ops call


def _tiny_ops(x):
    def run():
        return ((x + 1).view(2, 2).t() * 2).contiguous()
    return run


def _pointwise(x):
    """Three functions per element of a 4 MiB float32 tensor, each writing its 4 MiB: ``gelu``, ``softmax``,
    ``layer_norm``."""
    import torch.nn.functional as F

    def run():
        F.gelu(x)
        x.softmax(-1)
        F.layer_norm(x, x.shape[-1:])
    return run


def _accelerator(size: int, repeats: int) -> dict:
    import torch

    sync = torch.cuda.synchronize
    host = torch.ones(max(size // 4, 1))
    dev = host.to("cuda")
    m = torch.ones((4096, 4096), device="cuda")
    sync()
    pinned = host.pin_memory()
    return {"host_to_device": _rate(lambda: (host.to("cuda"), sync()), host.nbytes, repeats),
            "pinned_host_to_device": _rate(lambda: (pinned.to("cuda", non_blocking=True), sync()), host.nbytes,
                                           repeats),
            "accelerator_memory": _rate(lambda: (dev.clone(), sync()), 2 * dev.nbytes, repeats),   # read + write
            "accelerator_flops": _rate(lambda: (m @ m, sync()), 2 * 4096**3, repeats),
            "accelerator_op_latency": _latency(_then(_tiny_ops(torch.ones(4, device="cuda")), sync), _TINY_OPS,
                                               repeats)}


def _then(fn, after):
    def run():
        fn()
        after()
    return run


def _disk(buf, folder, repeats: int) -> dict:
    """Cold and warm read rates of a file of ``buf``'s bytes written (and ``fsync``-ed) in ``folder``."""
    fd, path = tempfile.mkstemp(dir=folder, prefix="allocator-profile-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(buf.tobytes())
            fh.flush()
            os.fsync(fh.fileno())   # dirty pages cannot be dropped: flush them first, so the cold read is cold
        cold = _rate(lambda: _read(path, drop=True), buf.nbytes, repeats)
        warm = _rate(lambda: _read(path, drop=False), buf.nbytes, repeats)
    finally:
        os.unlink(path)
    return {"disk_read": cold, "disk_read_warm": warm}


def read_rates(profile: Profile, run_on) -> tuple[float, float]:
    """Seconds per byte read and per parameter element computed with (``2 * tokens`` FLOP) on ``run_on``."""
    if run_on == "cpu":
        return 1 / profile.cpu_memory, 2 * profile.tokens / profile.cpu_flops
    return 1 / profile.accelerator_memory, 2 * profile.tokens / profile.accelerator_flops


def flop_seconds(profile: Profile, run_on) -> float:
    """Seconds per FLOP on ``run_on``: the compute term where FLOPs are counted (:mod:`allocator.model.flops`)."""
    return 1 / (profile.cpu_flops if run_on == "cpu" else profile.accelerator_flops)


COUNTED = ("ops", "written", "pointwise", "strided")
"""The work a complete FLOP count adds to a unit's compute term, by :class:`allocator.model.flops.FlopCount` field, in
the order the cost model sums it: ops dispatched, bytes written by ops without a FLOP formula, bytes written by
functions per element, bytes written by interpolations across memory layouts (:func:`counted_rates`)."""


def counted_rates(profile: Profile, run_on) -> tuple[float, float, float, float]:
    """Seconds per unit of each kind of :data:`COUNTED` on ``run_on``: per op (a fixed launch cost, whatever its
    size), per byte written (the memory rate), per byte of a function per element (``cpu_pointwise``), per byte of an
    interpolation across memory layouts (``cpu_strided``). An accelerator writes all three at its memory rate."""
    if run_on == "cpu":
        return (profile.cpu_op_latency, 1 / profile.cpu_memory, 1 / profile.cpu_pointwise, 1 / profile.cpu_strided)
    per_byte = 1 / profile.accelerator_memory
    return profile.accelerator_op_latency, per_byte, per_byte, per_byte


def read_seconds(profile: Profile, run_on, nbytes, numel, flops=None, counted: tuple = ()):
    """Seconds to read ``nbytes`` of weights where they execute (``run_on``), or to compute with ``numel`` of them
    (``2 * tokens`` FLOP each, :func:`read_rates`; ``flops`` FLOPs instead where they were counted): the larger;
    plus the ``counted`` work (one amount per kind of :data:`COUNTED`: ops, bytes written, bytes of functions per
    element, bytes interpolated across memory layouts) at :func:`counted_rates`.

    The cost model's one read-or-compute term: of one piece of the model (numbers in, a float out), or of every
    tensor of a graph at once (numpy float64 arrays of one entry per tensor in, elementwise, the same float64
    products: :meth:`allocator.evaluate.runs.Columns.read_seconds`, which both the estimate and the CP-SAT objective
    sum)."""
    per_byte, per_element = read_rates(profile, run_on)
    compute = numel * per_element if flops is None else flops * flop_seconds(profile, run_on)
    seconds = np.maximum(nbytes * per_byte, compute)
    for amount, rate in zip(counted, counted_rates(profile, run_on)):
        seconds = seconds + amount * rate
    return seconds if isinstance(seconds, np.ndarray) else float(seconds)


def _timings(fn, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        found.append(max(time.perf_counter() - start, 1e-9))
    return found


def _rate(fn, size: float, repeats: int) -> tuple[float, float]:
    """``size`` per median second of ``fn``, and the relative spread of the repeats ((max - min) / median)."""
    seconds = _timings(fn, repeats)
    median = statistics.median(seconds)
    return size / median, (max(seconds) - min(seconds)) / median


def _latency(fn, count: int, repeats: int, calls: int = 200) -> tuple[float, float]:
    """Median seconds per one of the ``count`` ops of ``fn``, over ``calls`` calls a repeat, and the spread."""
    def many():
        for _ in range(calls):
            fn()
    rate, spread = _rate(many, calls * count, repeats)
    return 1 / rate, spread


def _read(path: str, drop: bool) -> None:
    with open(path, "rb") as fh:
        if drop and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while fh.read(2**22):
            pass


class _DropMetaDeviceWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Some parameters are on the meta device")


@contextlib.contextmanager
def _without_meta_device_warning():
    """Drop dispatch_model's "Some parameters are on the meta device because they were offloaded ..." while the
    timing models are dispatched: they are offloaded on purpose, and the line would reach the user's stderr."""
    logger, drop = logging.getLogger("accelerate.big_modeling"), _DropMetaDeviceWarning()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _tensor_latencies(repeats: int, layers: int = 64) -> dict:
    """Seconds per tensor of accelerate's offload hooks, with their spreads: the hook path from RAM, the extra of a
    disk read, and (with CUDA) the path to the accelerator.

    Times forwards of ``layers`` ``Linear(4, 4)`` (bytes negligible) dispatched by ``accelerate.dispatch_model``:
    without hooks, with every layer offloaded and its weights served from a state dict in RAM, and served from a
    safetensors file (what ``from_pretrained`` sets up); the differences of the i-th repeats divided by the tensor
    count. With CUDA, the same model offloaded to the CPU with the accelerator as the main device
    (``accelerator_tensor_latency``: the copy, its launch and accelerate's ``empty_cache``).
    """
    import torch
    from accelerate import dispatch_model
    from safetensors.torch import save_file

    def build(to=None, **dispatch):
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)]).eval()
        if to is not None:
            dispatch_model(model, {str(i): to for i in range(layers)}, **dispatch)
        return model

    def seconds(model, device="cpu") -> list[float]:
        x = torch.ones(1, 4, device=device)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        return _timings(lambda: (model(x), sync()), max(repeats, 3))

    def per_tensor(more: list[float], less: list[float]) -> tuple[float, float]:
        diffs = [max(a - b, 0.0) / len(state) for a, b in zip(more, less)]
        median = statistics.median(diffs)
        return median, (max(diffs) - min(diffs)) / median if median > 0 else 0.0

    state = {k: v.contiguous() for k, v in build().state_dict().items()}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder, _without_meta_device_warning():
        path = os.path.join(folder, "weights.safetensors")
        save_file(state, path)
        plain = seconds(build())
        from_ram = seconds(build("disk", main_device="cpu", state_dict=state, offload_index={k: {} for k in state}))
        from_disk = seconds(build("disk", main_device="cpu", offload_index={
            k: {"safetensors_file": path, "weight_name": k} for k in state}))
        values = {"disk_tensor_latency": per_tensor(from_disk, from_ram),
                  "offload_tensor_latency": per_tensor(from_ram, plain)}
        if torch.cuda.is_available():
            plain = seconds(build().to("cuda"), "cuda")
            to_device = seconds(build("cpu", main_device=0), "cuda")
            values["accelerator_tensor_latency"] = per_tensor(to_device, plain)
    return values
