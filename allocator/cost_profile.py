"""The bandwidth profile of the machine a plan runs on: named defaults with their sources, or measured."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass

from .errors import InvalidOption

__all__ = ["Profile", "read_rates", "flop_seconds"]

log = logging.getLogger(__name__)

GB = 1e9
#: HBM2e read bandwidth of an NVIDIA A100 40GB: 1,555 GB/s (NVIDIA A100 datasheet).
ACCELERATOR_MEMORY = 1555 * GB
#: Pageable host-to-device copies over PCIe 4.0 x16 reach roughly a third of the 32 GB/s link (pinned memory
#: gets ~25 GB/s); accelerate's offload hooks copy from pageable memory (CUDA C++ Best Practices Guide, "Pinned
#: memory"; PCI-SIG PCIe 4.0 specification for the link rate).
HOST_TO_DEVICE = 10 * GB
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Bandwidths (bytes/s) and latencies (s) of the machine a plan will run on."""

    accelerator_memory: float = ACCELERATOR_MEMORY
    """Reading resident weights on an accelerator."""
    host_to_device: float = HOST_TO_DEVICE
    """Copying offloaded weights from RAM to the accelerator (pageable memory)."""
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

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not value >= 0 or value == float("inf"):
                raise InvalidOption(f"Profile.{field.name} must be a finite number >= 0, got {value!r}.")
        for name in ("accelerator_memory", "host_to_device", "disk_read", "cpu_memory", "device_to_device",
                     "accelerator_flops", "cpu_flops"):
            if getattr(self, name) == 0:
                raise InvalidOption(f"Profile.{name} is a bandwidth and must be > 0.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
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
    def measure(cls, *, size: int = 64 * 2**20, repeats: int = 3) -> "Profile":
        """Measure this machine: RAM copy and disk read always, host-to-device and accelerator memory where CUDA exists.

        Disk reads use a temporary file evicted from the page cache with ``posix_fadvise`` where available. The
        per-tensor latencies time accelerate's own hooks (when accelerate and safetensors import) on 64 tiny
        ``Linear`` layers, page cache warm: weights served from RAM (to the accelerator where CUDA exists) for
        ``offload_tensor_latency``, from a safetensors file minus that for ``disk_tensor_latency``.
        Unmeasured fields keep their defaults.
        """
        import numpy as np

        values = {}
        buf = np.ones(size // 8, dtype=np.float64)
        values["cpu_memory"] = _best(lambda: buf.copy(), size, repeats)
        a = np.ones((512, 1024), dtype=np.float32)
        w = np.ones((1024, 1024), dtype=np.float32)
        values["cpu_flops"] = _best(lambda: a @ w, 2 * 512 * 1024 * 1024, repeats)
        with tempfile.NamedTemporaryFile(delete=False) as fh:
            fh.write(buf.tobytes())
            path = fh.name
        try:
            values["disk_read"] = _best(lambda: _read_uncached(path), size, repeats)
        finally:
            os.unlink(path)
        try:
            values.update(_tensor_latencies(repeats))
        except ImportError as err:
            log.warning("could not time accelerate's offload hooks (%s); keeping default per-tensor latencies", err)
        try:
            import torch

            if torch.cuda.is_available():
                host = torch.ones(size // 4)
                dev = host.to("cuda")
                torch.cuda.synchronize()
                values["host_to_device"] = _best(lambda: (host.to("cuda"), torch.cuda.synchronize()), size, repeats)
                values["accelerator_memory"] = 2 * _best(lambda: (dev.clone(), torch.cuda.synchronize()), size, repeats)
                m = torch.ones((4096, 4096), device="cuda")
                values["accelerator_flops"] = _best(lambda: (m @ m, torch.cuda.synchronize()), 2 * 4096**3, repeats)
        except Exception as err:  # a broken driver must not break planning; say so
            log.warning("could not measure the accelerator (%s); keeping default bandwidths", err)
        return cls(**values)


def read_rates(profile: Profile, run_on) -> tuple[float, float]:
    """Seconds per byte read and per parameter element computed with (``2 * tokens`` FLOP) on ``run_on``."""
    if run_on == "cpu":
        return 1 / profile.cpu_memory, 2 * profile.tokens / profile.cpu_flops
    return 1 / profile.accelerator_memory, 2 * profile.tokens / profile.accelerator_flops


def flop_seconds(profile: Profile, run_on) -> float:
    """Seconds per FLOP on ``run_on``: the compute term where FLOPs are counted (:mod:`allocator.flops`)."""
    return 1 / (profile.cpu_flops if run_on == "cpu" else profile.accelerator_flops)


def _best(fn, size: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return size / max(best, 1e-9)


def _read_uncached(path: str) -> None:
    with open(path, "rb") as fh:
        if hasattr(os, "posix_fadvise"):
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
    """Seconds per tensor of accelerate's offload hooks: the hook path from RAM, and the extra of a disk read.

    Times forwards of ``layers`` ``Linear(4, 4)`` (bytes negligible) dispatched by ``accelerate.dispatch_model``:
    without hooks, with every layer offloaded and its weights served from a state dict in RAM, and served from a
    safetensors file (what ``from_pretrained`` sets up); the differences divided by the tensor count. With CUDA,
    the hook path is timed with the accelerator as the main device (it then includes the copy's launch).
    """
    import torch
    from accelerate import dispatch_model
    from safetensors.torch import save_file

    def build(to=None, **dispatch):
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)]).eval()
        if to is not None:
            dispatch_model(model, {str(i): to for i in range(layers)}, **dispatch)
        return model

    def seconds(model, device="cpu") -> float:
        x = torch.ones(1, 4, device=device)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        return 1 / _best(lambda: (model(x), sync()), 1, max(repeats, 3))

    state = {k: v.contiguous() for k, v in build().state_dict().items()}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder, _without_meta_device_warning():
        path = os.path.join(folder, "weights.safetensors")
        save_file(state, path)
        plain = seconds(build())
        from_ram = seconds(build("disk", main_device="cpu", state_dict=state, offload_index={k: {} for k in state}))
        from_disk = seconds(build("disk", main_device="cpu", offload_index={
            k: {"safetensors_file": path, "weight_name": k} for k in state}))
        values = {"disk_tensor_latency": max(from_disk - from_ram, 0.0) / len(state),
                  "offload_tensor_latency": max(from_ram - plain, 0.0) / len(state)}
        if torch.cuda.is_available():
            plain = seconds(build().to("cuda"), "cuda")
            to_device = seconds(build("cpu", main_device=0), "cuda")
            values["offload_tensor_latency"] = max(to_device - plain, 0.0) / len(state)
    return values
