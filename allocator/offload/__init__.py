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

The plan decides what this runtime does (:attr:`allocator.Plan.runtime`: prefetch depth, resident experts, expert mode
per layer, the buffers it holds); :func:`attach` reads it from the plan, ``patch(runtime="allocator")`` passes the plan
it made, and :func:`runtime_of` returns the runtime attached to a model with its traffic.

Mixtures of experts: an offloaded fused experts module runs expert by expert (:mod:`.experts`, registered with
transformers' ``ExpertsInterface`` as ``"allocator"``): only the experts its router picks are read, resident ones
(``Plan.experts``) from the main device, the others fetched or computed where their weights live; with
``Plan.runtime.expert_cache`` slots, the last ones routed are kept on the main device (:mod:`.expert_cache`).

The runtime is four modules: :mod:`.files` (the mapped files and where each tensor's bytes are), :mod:`.devices`
(the main devices that make weights ready), :mod:`.scheduler` (the tensors and modules moved, and their order) and
:mod:`.hooks` (the hooks on the model, :func:`attach`, :func:`detach`, :func:`dispatch`), with :mod:`.experts` and
:mod:`.expert_cache` beside them; :func:`detach` lets go of everything the runtime held, and :mod:`.heap` gives what
glibc keeps of freed memory back to the system at :func:`attach` and :func:`detach`. :mod:`.moved` moves a pipeline's
components that live in RAM whole onto their device when they run (model offload, as a pipeline plan says).
"""

from __future__ import annotations

from .devices import HostDevice, StandInDevice, StreamDevice
from .experts import ExpertsHook, RoutedExperts, Traffic
from .files import MappedFile
from .hybrid import HybridHook
from .hooks import Attached, OffloadHook, attach, detach, dispatch, has_offload_hooks, runtime_of
from .scheduler import Scheduler

__all__ = [
    "Attached",
    "ExpertsHook",
    "HostDevice",
    "HybridHook",
    "MappedFile",
    "OffloadHook",
    "RoutedExperts",
    "Scheduler",
    "StandInDevice",
    "StreamDevice",
    "Traffic",
    "attach",
    "detach",
    "dispatch",
    "has_offload_hooks",
    "runtime_of",
]
