"""Cost model: what a placement costs per forward pass, in bytes moved and estimated seconds.

Per forward, in model order, every unit reads its weights where it executes; an offloaded unit first pays the
copy to the main device (host to device for ``cpu``; a disk read, then host to device, for ``disk``) and a fixed
latency per tensor its hooks stream (more from disk: accelerate opens the checkpoint for each tensor; more to an
accelerator: accelerate empties the CUDA cache for each); a change of executing device between consecutive units
pays an activation transfer plus a fixed latency. The first-order effect: bytes kept resident on accelerators are
bytes not copied at every forward.

Where FLOPs were counted at the user's inputs (:mod:`allocator.model.flops`, ``PlanOptions.inputs``), the compute term
is the counted FLOPs of each unit, plus the work of :data:`allocator.profile.COUNTED` at
:func:`allocator.profile.counted_rates`: each op it dispatches a fixed cost on the executing device, the bytes
its ops without a FLOP formula write memory traffic at the executing device's memory rate (functions per element,
:data:`allocator.model.flops.POINTWISE`, at the CPU's ``cpu_pointwise``; interpolations across memory layouts at
``cpu_strided``), and a change of device moves the output of the module before it
(:func:`allocator.evaluate.units.boundary_bytes`) instead of the fixed ``Profile.activation_bytes``. Without a complete
count: ``2 * tokens`` FLOP per parameter element, no op term, the fixed activation.

Default bandwidths are named constants with their source in :mod:`allocator.profile`;
:meth:`Profile.measure` measures this machine. :func:`read_rates` and :func:`read_seconds` (the read-or-compute
term) are that module's, re-exported here.

One path prices a map: each tensor's read-or-compute seconds are computed once, for every tensor at once
(:func:`tensor_reads`, from :func:`read_seconds`), and what a hook streams from the same columns
(:class:`allocator.evaluate.runs.Moving`, :func:`copy_seconds`); :func:`estimate_runs` sums them over a map's runs,
and :func:`device_seconds` (the CP-SAT objective's price of each tensor on a device) adds them elementwise. A new
term goes into :func:`read_seconds` or :func:`copy_seconds`, and both follow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..memo import Key
from ..budgets import Device, normalize_map
from ..profile import COUNTED, Profile, read_rates, read_seconds
from ..model.flops import node_values
from ..problem import Problem
from .runs import FEMTO, Run, columns
from .memory import executes_on, main_device, map_runs, offloaded_devices
from .tiers import fast_tier
from .units import boundary_bytes, tensor_flops

__all__ = ["Profile", "Cost", "estimate", "estimate_runs", "read_rates", "read_seconds", "copy_seconds",
           "tensor_seconds", "device_seconds", "tensor_reads", "change_seconds", "counted_flops", "counted_work",
           "boundaries", "least_seconds"]

TENSOR_FLOPS = Key("tensor flops")
TENSOR_WORK = Key("tensor work")
BOUNDARY_BYTES = Key("boundary bytes")
READS = Key("reads")
TENSOR_READS = Key("tensor reads")
DEVICE_SECONDS = Key("device seconds")
PRICED = Key("priced")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Cost:
    """What a placement costs per forward pass."""

    seconds: float          # estimated seconds per forward
    streamed_bytes: int     # weights copied to the main device per forward
    disk_bytes: int         # of which read from disk
    device_changes: int     # changes of executing device along the model
    resident_fast: int      # bytes resident on the fastest tier


def copy_seconds(profile: Profile, main, device, offload: int, tensors: int, *, runtime: str = "accelerate") -> float:
    """Seconds to stream ``offload`` bytes in ``tensors`` tensors from ``device`` to ``main`` at a forward: host to
    device for ``cpu``; disk read, then host to device, for ``disk`` (only the disk read when the CPU is main); a
    fixed latency per tensor. Linear in both.

    With accelerate's hooks (``runtime="accelerate"``) the per-tensor latency is the hook's path
    (``offload_tensor_latency`` to the CPU, ``accelerator_tensor_latency`` to an accelerator: an ``empty_cache`` per
    tensor), plus ``disk_tensor_latency`` from disk (a ``safe_open`` per tensor). With :mod:`allocator.offload`
    (``runtime="allocator"``) every file is mapped once, so there is no per-tensor open, and no cache is emptied:
    ``offload_tensor_latency`` per tensor on any main device, an upper bound of its swap (not measured on its own);
    its bytes are staged as :class:`allocator.offload.StreamDevice` stages them, read from the mapped (pageable)
    weights into pinned memory at ``cpu_memory``, then copied at ``pinned_host_to_device`` (accelerate's hooks copy
    pageable memory at ``host_to_device``).

    ``offload`` and ``tensors`` are numbers, or numpy arrays of one entry per tensor (elementwise:
    :func:`device_seconds`)."""
    seconds = 0.0
    run_on = executes_on(device, main)
    ours = runtime == "allocator"
    hook = profile.offload_tensor_latency if run_on == "cpu" or ours else profile.accelerator_tensor_latency
    if device == "disk":
        seconds += offload / profile.disk_read
        seconds += tensors * (hook if ours else profile.disk_tensor_latency + hook)
    if device in ("cpu", "disk") and run_on != "cpu" and not (device == "cpu" and main == "mps"):
        # accelerate's hooks copy pageable memory; ours stages the mapped weights into pinned memory, then copies
        seconds += (offload / profile.cpu_memory + offload / profile.pinned_host_to_device if ours
                    else offload / profile.host_to_device)
        if device == "cpu":
            seconds += tensors * hook
    return seconds


def tensor_seconds(problem: Problem, main, profile: Profile, tensor, device) -> float:
    """Seconds one tensor of the graph costs per forward on ``device`` with ``main`` as the main device: its entry of
    :func:`device_seconds`."""
    return device_seconds(problem, main, profile, device)[problem.graph.tensor_index[tensor.name]]


def device_seconds(problem: Problem, main, profile: Profile, device) -> list[float]:
    """Seconds each tensor of the graph costs per forward on ``device`` with ``main`` as the main device, one per
    tensor: its term of :func:`estimate_runs`, from the same columns (its read-or-compute seconds where it executes,
    :func:`tensor_reads`, plus :func:`copy_seconds` of what its hook streams, ``Moving``, elementwise). The sum over
    a map's tensors plus its changes of device is :func:`estimate` (to float rounding); the CP-SAT model
    (``ilp``, the witness) prices its groups with it, so its objective is the estimate. Made once per problem,
    main device, device and profile."""
    return problem.derived.once(DEVICE_SECONDS(main, device, profile),
                                lambda: _device_seconds(problem, main, profile, device))


def _device_seconds(problem: Problem, main, profile: Profile, device) -> list[float]:
    cpu, accelerator = tensor_reads(problem, profile)
    seconds = cpu if executes_on(device, main) == "cpu" else accelerator
    if device in offloaded_devices(main):
        mov = columns(problem.graph).moving(problem.placing.offload_buffers)
        nbytes = np.asarray(mov.nbytes_array(), dtype=np.float64)
        count = np.diff(np.asarray(mov.sum_count, dtype=np.float64))
        seconds = seconds + copy_seconds(profile, main, device, nbytes, count, runtime=problem.runtime.name)
    return seconds.tolist()


def tensor_reads(problem: Problem, profile: Profile) -> tuple:
    """Each tensor's read-or-compute seconds on the CPU and on an accelerator under ``profile``
    (:meth:`allocator.evaluate.runs.Columns.read_seconds`, with the counted FLOPs and work where there are some): the
    one per-tensor term :func:`tensor_seconds` reads and :func:`estimate_runs` sums (as femtosecond prefix sums,
    :meth:`allocator.evaluate.runs.Columns.reads`). Made once per
    graph and profile without counted FLOPs, else once per problem and profile."""
    cols = columns(problem.graph)
    flops = counted_flops(problem)
    if flops is None:
        return cols.read_seconds(profile)
    return problem.derived.once(TENSOR_READS(profile), lambda: cols.read_seconds(profile, flops,
                                                                                counted_work(problem)))


def counted_flops(problem: Problem):
    """The counted FLOPs per tensor (:func:`allocator.evaluate.units.tensor_flops` of ``problem.node_flops``), or
    ``None`` where nothing was counted: the compute term is then ``2 * tokens`` FLOP per parameter element."""
    if problem.node_flops is None:
        return None
    return problem.derived.once(TENSOR_FLOPS, lambda: tensor_flops(problem.graph, problem.node_flops))


def counted_work(problem: Problem):
    """The work each tensor's unit does beyond its FLOPs, one array per kind of
    :data:`allocator.profile.COUNTED` (those fields of :class:`allocator.model.flops.FlopCount`, spread over the
    tensors as :func:`allocator.evaluate.units.tensor_flops` spreads FLOPs), or ``None`` where the FLOP count is not
    complete."""
    if problem.node_flops is None:
        return None
    return problem.derived.once(TENSOR_WORK, lambda: tuple(
        tensor_flops(problem.graph, node_values(getattr(problem.flops, kind), problem.graph)) for kind in COUNTED))


def boundaries(problem: Problem):
    """Activation bytes crossing each boundary between tensors (:func:`allocator.evaluate.units.boundary_bytes` of the
    counted outputs), or ``None`` where the FLOP count is not complete: a change then moves
    ``Profile.activation_bytes``."""
    if problem.node_flops is None:
        return None
    return problem.derived.once(BOUNDARY_BYTES, lambda: boundary_bytes(
        problem.graph, node_values(problem.flops.output_bytes, problem.graph)))


def _reads(problem: Problem, profile: Profile) -> tuple:
    """The graph's per-tensor read-or-compute prefix sums under ``profile``
    (:meth:`allocator.evaluate.runs.Columns.reads`),
    with the counted FLOPs where there are some; made once per problem and profile."""
    cols = columns(problem.graph)
    flops = counted_flops(problem)
    if flops is None:
        return cols.reads(profile)
    return problem.derived.once(READS(profile), lambda: cols.reads(profile, flops, counted_work(problem)))


def change_seconds(profile: Profile, nbytes: int | None = None) -> float:
    """Seconds of one change of executing device that moves ``nbytes`` of activations (``activation_bytes`` of
    ``profile`` when ``None`` or 0: nothing was counted there)."""
    return (nbytes or profile.activation_bytes) / profile.device_to_device + profile.switch_latency


def least_seconds(problem: Problem, changes: int) -> float:
    """A lower bound of the estimate (:func:`estimate_runs`, the problem's profile) of every plan whose main device is
    an accelerator and that changes executing device at least ``changes`` times.

    Notes
    -----
    With an accelerator as main device every tensor is read at the accelerator's rate wherever it lives (an offloaded
    one is copied in first), so the read term is the same for every such plan, exactly (femtosecond integers); copies
    only add; each change costs at least :func:`change_seconds` of the smallest activation crossing a boundary. The
    sum is made in the order :func:`estimate_runs` makes it, so, floating-point addition being monotone, no such plan
    is estimated below it. A plan that keeps every byte on the accelerators, with no copy and the fewest changes at
    the cheapest boundaries, is estimated at exactly this.
    """
    profile = problem.profile
    accelerator_reads = _reads(problem, profile)[1]
    crossing = boundaries(problem)
    smallest = None
    if crossing is not None and len(crossing):
        found = np.asarray(crossing)
        crossed = found[found > 0]
        smallest = int(crossed.min()) if len(crossed) else None
        if smallest is not None and len(crossed) < len(found) and profile.activation_bytes < smallest:
            smallest = None   # a boundary where nothing was counted moves the fixed activation
    step = change_seconds(profile, smallest)
    change_time = 0.0
    for _ in range(changes):
        change_time += step
    seconds = (accelerator_reads[-1] - accelerator_reads[0]) / FEMTO + 0   # no copies
    seconds += change_time
    return seconds


def estimate(problem: Problem, device_map, profile: Profile | None = None) -> Cost:
    """The :class:`Cost` of ``device_map`` for ``problem`` under ``profile`` (the problem's when omitted).

    Examples
    --------
    >>> import torch.nn as nn
    >>> from allocator.problem import build_problem
    >>> p = build_problem(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), {0: 10**6, "cpu": 10**6})
    >>> estimate(p, {"0": 0, "1": "cpu"}).streamed_bytes, estimate(p, {"": 0}).streamed_bytes
    (263168, 0)
    """
    device_map = normalize_map(device_map)
    # the main device as validate.check's memory.main, without the check
    return estimate_runs(problem, map_runs(problem.graph, device_map), main_device(set(device_map.values())), profile)


def priced(problem: Problem, device_map) -> Cost:
    """``estimate(problem, device_map)`` under the problem's profile; the last few results are remembered on the
    problem (:meth:`allocator.memo.Derived.recent`)."""
    return problem.derived.recent(PRICED, device_map, lambda: estimate(problem, device_map))


def estimate_runs(problem: Problem, found: list[Run], main: Device, profile: Profile | None = None) -> Cost:
    """:func:`estimate` of a map given by its runs (:func:`allocator.evaluate.memory.map_runs`) and its main device
    (:func:`allocator.evaluate.memory.main_device` of its values): strategies price candidate plans without building
    them.

    Notes
    -----
    O(runs), plus O(tensors) numpy work the first time a graph is priced under a profile.
    """
    profile = profile or problem.profile
    g = problem.graph
    cols = columns(g)
    mov = cols.moving(problem.placing.offload_buffers)
    cpu_reads, accelerator_reads = _reads(problem, profile)
    offloaded = offloaded_devices(main)
    tier = fast_tier(problem.budgets)
    reads = 0          # femtoseconds, exact: the same whichever runs a map is cut into
    moved: dict = {}   # offloaded device -> [bytes, tensors] streamed from it
    streamed = disk = fast = changes = 0
    crossing = boundaries(problem)
    change_time = 0.0
    last, last_end = None, 0
    for run in found:
        d, a, b = run.device, run.start, run.end
        if d is None:
            continue
        run_on = executes_on(d, main, offloaded)
        prefix = cpu_reads if run_on == "cpu" else accelerator_reads
        reads += prefix[b] - prefix[a]
        if d in offloaded:
            nbytes = mov.sum_nbytes[b] - mov.sum_nbytes[a]
            totals = moved.setdefault(d, [0, 0])
            totals[0] += nbytes
            totals[1] += mov.sum_count[b] - mov.sum_count[a]
            streamed += nbytes
            disk += nbytes if d == "disk" else 0
        if d in tier and not (d == "cpu" and main != "cpu"):
            fast += cols.sum_counted[b] - cols.sum_counted[a]
        if cols.sum_weighted[b] > cols.sum_weighted[a]:  # tensors without bytes do not change the device
            if last is not None and run_on != last:
                changes += 1
                change_time += change_seconds(profile, None if crossing is None else int(crossing[last_end]))
            last, last_end = run_on, b
    runtime = problem.runtime.name
    seconds = reads / FEMTO + sum(copy_seconds(profile, main, d, nbytes, count, runtime=runtime)
                                  for d, (nbytes, count) in moved.items())
    seconds += change_time
    return Cost(seconds=seconds, streamed_bytes=streamed, disk_bytes=disk, device_changes=changes, resident_fast=fast)
