"""The routed experts of an offloaded mixture-of-experts layer, moved only when the router picks them.

transformers 5 dispatches a fused experts module's forward through ``ExpertsInterface``
(``transformers.integrations.moe``): :func:`register` adds ``"allocator"`` to it, and :func:`allocator.offload.attach`
selects it (``set_experts_implementation``) for the experts modules a plan offloads, whose accelerate hook it replaces
by an :class:`ExpertsHook` that moves the inputs but no weights. At each call, :class:`RoutedExperts` takes the
experts the router picked (``top_k_index``) and, per expert:

- a *resident* expert (``Plan.experts`` puts it on the main device) runs from its slices, copied there once at
  :func:`attach`;
- an offloaded expert is either *fetched* — its slices only, the fetched experts of a layer in one gather per tensor
  from the memory-mapped file (or accelerate's RAM copy) into a reused buffer on the main device; on a CPU main
  device the slices are views into the mapping, read in by the kernel, and nothing is copied — or *computed where its
  weights live* (from RAM with an accelerator main device: the call's activations move to the CPU once and the sum
  of those experts' outputs back once, not the weights), chosen per call from the tokens routed to it
  (``mode="auto"``, by the profile's rates), or always one way (``"fetch"``, ``"compute"``).

Each expert runs through the model's own eager experts forward (the function ``use_experts_implementation`` wrapped)
on a view holding that expert alone, and the outputs are added in the order the eager forward adds them, so the
result is the eager implementation's within float tolerance on the same device (the matrix products run over
per-expert views rather than eager's shapes, and may round differently on some CPUs; greedy tokens agree).
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import InvalidRuntime
from ..model.experts import MoELayer
from ..model.families import family_of
from ..profile import Profile
from .buffers import FetchBuffers
from .expert_cache import ExpertCache, in_place, look_up, store
from .expert_hook import ExpertsHook
from .expert_traffic import Traffic
from .expert_modes import computes_here, computes_there, phase_mode
from .expert_pages import Residency, runs_of
from .files import MappedFiles, source_of
from .hybrid import part_to_host, part_to_main

__all__ = ["MODES", "NAME", "ExpertsHook", "RoutedExperts", "Traffic", "eager_forward", "experts_forward",
           "register", "routed_layers"]

log = logging.getLogger(__name__)

NAME = "allocator"
"""The name of our experts implementation in transformers' ``ExpertsInterface``."""
MODES = ("auto", "fetch", "compute")
"""How an offloaded expert that the router picks runs: chosen per call, always fetched, or computed where its
weights live wherever they live in RAM and the main device is an accelerator."""


def eager_forward(module):
    """The eager forward of an experts module: the function ``use_experts_implementation`` wrapped (its
    ``__wrapped__``), found on the class or a base class."""
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None and hasattr(forward, "__wrapped__"):
            return forward.__wrapped__
    return type(module).forward


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The ``"allocator"`` experts implementation: :meth:`RoutedExperts.forward` where :func:`attach` set one on
    this module, else the eager forward (experts resident whole run as they would)."""
    routed = getattr(self, "_allocator_experts", None)
    if routed is None:
        return eager_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    return routed.forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Add :func:`experts_forward` to transformers' ``ALL_EXPERTS_FUNCTIONS`` under :data:`NAME` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)


class _One:
    """The experts module as its eager forward sees it, with the given tensors for its fused parameters (one
    expert's ``[1, ...]`` views by default, ``num_experts`` 1); everything else read from the module."""

    def __init__(self, module, tensors: dict, experts: int = 1):
        self.__dict__.update(tensors)
        self.__dict__["num_experts"] = experts
        self.__dict__["_module"] = module

    def __getattr__(self, name):
        return getattr(self.__dict__["_module"], name)


@dataclass
class RoutedExperts:
    """One offloaded fused experts module under the runtime: where each expert lives and how it runs when routed.

    Attributes
    ----------
    layer : MoELayer
    sources : dict
        Parameter name -> :class:`allocator.offload.files.TensorSource` of the whole ``[E, ...]`` tensor.
    metas : dict
        Parameter name -> its meta placeholder (the dtype the module runs in).
    where : tuple
        The device of each expert (``Plan.experts``): the main device for resident ones.
    main : str
        The main device, as a torch device string (``"cpu"`` for :class:`allocator.offload.StandInDevice`).
    device : object
        The runtime's device (:class:`allocator.offload.HostDevice` for a CPU main device, where offloaded slices are
        used in place; else one with ``copy_into``, through which fetched slices are copied).
    resident : dict
        Parameter name -> ``[R, ...]`` tensor of the resident experts' slices on the main device.
    rows : dict
        Expert -> its row in :attr:`resident`.
    home : object
        The plan's device of the layer (:attr:`allocator.report.runtime.Runtime.runs_on`), where resident experts
        run and fetched ones are brought; :attr:`main` is its torch device.
    remote : dict
        Expert -> ``(torch device, row)`` for experts resident on another accelerator (their slices in
        :attr:`remote_tensors`): computed there or fetched, as the mode says.
    chunk : int or None
        Offloaded experts fetched into the reused buffer at a time (``None``: all routed ones at once).
    cache : ExpertCache or None
        The runtime's cache of recently routed experts (:mod:`.expert_cache`), for a layer run on the main device.
    mode, threshold, used
        The plan's mode (one, or ``{phase: mode}``), the tokens of a decode call, the calls run per phase and mode
        (:mod:`.expert_modes`).
    buffers : FetchBuffers
        Where fetched slices are copied, shared with the other layers the runtime fetches for.
    pages : Residency or None
        Asks which routed experts' pages are in memory before they are read ahead (:mod:`.expert_pages`), shared by
        the runtime's layers; ``None``: every routed expert's slices are read ahead unasked.
    views : dict
        Parameter name -> the ``[E, ...]`` host tensor (:meth:`host`), made once: a view into the mapping stays valid
        while the file is mapped, and :meth:`release` lets go of it.
    whole : _One or None
        The module with those views for its parameters, as the eager forward sees it where :attr:`in_place`.
    """

    layer: MoELayer
    sources: dict
    metas: dict
    where: tuple
    main: str
    device: object
    traffic: Traffic
    mode: str | Mapping = "auto"
    profile: Profile = field(default_factory=Profile)
    resident: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    buffers: FetchBuffers = field(default_factory=FetchBuffers)
    home: object = None
    remote: dict = field(default_factory=dict)
    remote_tensors: dict = field(default_factory=dict)
    chunk: int | None = None
    cache: ExpertCache | None = None
    threshold: int = 1
    used: dict = field(default_factory=dict)
    pages: Residency | None = None
    views: dict = field(default_factory=dict)
    whole: object = field(default=None, repr=False)

    @cached_property
    def accelerator(self) -> bool:
        """Whether the main device is an accelerator (or its stand-in): fetched slices are copied there."""
        return getattr(self.device, "kind", "cpu") != "cpu"

    def host(self, name: str):
        """Parameter ``name`` as a ``[E, ...]`` host tensor: a view into the mapped file, or accelerate's RAM copy
        (made at the first call, then reused)."""
        view = self.views.get(name)
        if view is None:
            view = self.views[name] = self.sources[name].host()
        return view

    def evict(self) -> None:
        """This layer's pages were dropped from the process: ask which are in memory before the next read-ahead."""
        if self.pages is not None:
            self.pages.forget()

    def release(self) -> None:
        """Let go of every tensor this layer holds: resident copies, those on other accelerators, host views."""
        self.resident.clear()
        self.remote_tensors.clear()
        self.views.clear()
        self.whole = None
        self.__dict__.pop("_mapped", None)

    def random_access(self) -> None:
        """Tell the kernel the experts' files are read at random (``MADV_RANDOM``): no read-ahead around a routed
        expert's slices, which would read its neighbours too; each fetch asks for its own slices
        (:meth:`_advise`)."""
        for source in self.sources.values():
            mm = source.file.mm if source.file is not None else None
            if mm is not None and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)

    def _advise(self, experts: list[int]) -> None:
        """Start reading ``experts``' slices of every file-backed tensor (``MADV_WILLNEED``, asynchronous): one call
        per run of consecutive experts, not one per expert, and only for runs with a page not in memory where
        :attr:`pages` can tell (:mod:`.expert_pages`)."""
        if self.pages is not None:
            experts = self.pages.stale(self.layer.experts, experts)
        if not experts:
            return
        runs = runs_of(experts)
        for file, address, tensors in self._files():
            spans = sorted((start + a * per, start + b * per) for start, per in tensors for a, b in runs)
            if self.pages is not None:
                spans = self.pages.missing(file.path, address, spans)
            for a, b in spans:
                file.advise(a, b)

    def _files(self) -> list:
        """Per mapped file of the file-backed tensors: ``(file, address of its first byte, [(start, bytes per
        expert) of each tensor]``), made once."""
        files = self.__dict__.get("_mapped")
        if files is None:
            by_file: dict = {}
            for n, s in self.sources.items():
                if s.file is not None:
                    entry = by_file.setdefault(id(s.file), (s.file, self.host(n).data_ptr() - s.start, []))
                    entry[2].append((s.start, (s.end - s.start) // self.layer.num_experts))
            files = self.__dict__["_mapped"] = list(by_file.values())
        return files

    def _cast(self, tensor, name: str):
        meta = self.metas[name]
        return tensor if tensor.dtype == meta.dtype else tensor.to(meta.dtype)

    @cached_property
    def in_place(self) -> bool:
        """Whether every expert runs from views of its tensors' files, in one eager call: a CPU main device, every
        tensor file-backed in the dtype the module runs in. Resident experts are then held in place
        (:meth:`allocator.offload.files.MappedFile.keep`)."""
        return not self.accelerator and all(
            s.file is not None and s.dtype == self.metas[n].dtype for n, s in self.sources.items())

    def keep(self, experts: list[int]) -> None:
        """Hold ``experts``' slices on the main device (the resident ones): in place in the private mapping of their
        files where :attr:`in_place`, else copied there once."""
        import torch

        if not experts:
            return
        self.rows = {e: i for i, e in enumerate(experts)}
        if self.in_place:
            for source in self.sources.values():
                per = (source.end - source.start) // self.layer.num_experts
                for e in experts:
                    source.file.keep(source.start + e * per, source.start + (e + 1) * per)
            return
        index = torch.tensor(experts, dtype=torch.long)
        for name in self.sources:
            self.resident[name] = self._cast(self.host(name).index_select(0, index), name).to(self.main)

    def keep_elsewhere(self, where: dict, torch_device) -> None:
        """Hold the experts resident on other accelerators there (``where``: expert -> plan device;
        ``torch_device`` maps a plan device to a torch device), and the slices of experts the plan keeps in RAM
        (``"cpu"``) of a module read from its file in this process's memory (:meth:`MappedFile.keep`), so that
        they are read from RAM, not the disk."""
        import torch

        by_device: dict = {}
        for e, d in where.items():
            by_device.setdefault(d, []).append(e)
        for d, experts in by_device.items():
            target = torch_device(d)
            index = torch.tensor(experts, dtype=torch.long)
            for name in self.sources:
                self.remote_tensors[(d, name)] = self._cast(self.host(name).index_select(0, index), name).to(target)
            self.remote.update({e: (d, target, i) for i, e in enumerate(experts)})
        if not self.accelerator:
            return
        ram = [e for e, d in enumerate(self.where) if d == "cpu"]
        for source in self.sources.values():
            if source.file is None:
                continue
            per = (source.end - source.start) // self.layer.num_experts
            for e in ram:
                source.file.keep(source.start + e * per, source.start + (e + 1) * per)

    def _fetch(self, experts: list[int]) -> dict:
        """The slices of ``experts`` on the main device: one gather per tensor into a reused buffer (views into the
        mapping on a CPU main device, where nothing is copied)."""
        import torch

        out = {}
        index = torch.tensor(experts, dtype=torch.long)
        self._advise(experts)
        for name in self.sources:
            host = self.host(name)
            per = host[0].numel() * self.metas[name].element_size()
            self.traffic.read += per * len(experts)
            if not self.accelerator:
                out[name] = {e: self._cast(host[e:e + 1], name) for e in experts}
                continue
            staged = self._cast(host.index_select(0, index), name)
            copied = self.device.copy_into(staged, self.buffers.take(self.main, name, staged, len(experts)))
            self.traffic.copied += staged.numel() * staged.element_size()
            out[name] = {e: copied[i:i + 1] for i, e in enumerate(experts)}
        return out

    def forward(self, module, hidden_states, top_k_index, top_k_weights):
        """The eager forward's result (module docstring)."""
        eager = eager_forward(module)
        self.traffic.calls += 1
        phase, mode = phase_mode(self.mode, self.threshold, math.prod(hidden_states.shape[:-1]))
        row = self.used.setdefault(phase, {})
        row[mode] = row.get(mode, 0) + 1   # the mode each phase ran in, as the plan wrote it
        count = self.layer.num_experts
        # the routed experts, ascending, from one list: torch.unique would add a sort, copies and allocations per
        # layer, each a parallel region of torch's intra-op pool (docs/runtime.md, "Threads")
        hit = {e for e in top_k_index.reshape(-1).tolist() if 0 <= e < count}
        if self.in_place:   # one eager call over views of the whole tensors: only the routed slices are read
            rows, traffic = self.rows, self.traffic
            away = sorted(hit - rows.keys())
            traffic.routed += len(hit)
            traffic.resident += len(hit) - len(away)
            away = away if self.cache is None else in_place(self, away)   # cache hits: nothing read
            self._advise(away)
            traffic.fetched += len(away)
            traffic.read += len(away) * self.expert_bytes
            return eager(self._whole(module), hidden_states, top_k_index, top_k_weights)
        hit = sorted(hit)
        try:
            return self._routed(module, eager, hidden_states, top_k_index, top_k_weights, hit, mode)
        finally:
            self.buffers.release(self.main)

    @cached_property
    def expert_bytes(self) -> int:
        """Bytes of one expert's slices as the module runs them (:func:`bytes_per_expert`)."""
        return bytes_per_expert(self)

    def _whole(self, module) -> _One:
        """The module as the eager forward sees it with every tensor the whole ``[E, ...]`` host view (made once)."""
        if self.whole is None or self.whole.__dict__["_module"] is not module:
            self.whole = _One(module, {n: self.host(n) for n in self.sources}, self.layer.num_experts)
        return self.whole

    def _routed(self, module, eager, hidden_states, top_k_index, top_k_weights, hit: list, mode: str):
        """:meth:`forward` expert by expert (not :attr:`in_place`): resident, cached, remote, computed where it
        lives, or fetched in turns into :attr:`buffers`, as ``mode`` (this call's phase's) says."""
        import torch

        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            positions = {e: torch.where(top_k_index == e) for e in hit}
        away = [e for e in hit if e not in self.rows]
        cached = {} if self.cache is None else look_up(self, [e for e in away if e not in self.remote])
        away = [e for e in away if e not in cached]
        here = [e for e in away if e not in self.remote and computes_here(self, e, int(positions[e][0].numel()), mode)]
        there = [e for e in away if e in self.remote and computes_there(self, e, int(positions[e][0].numel()), mode)]
        to_fetch = [e for e in away if e not in here and e not in there and e not in self.remote]
        chunk = self.chunk or max(len(to_fetch), 1)
        fetched: dict = {}
        # experts computed where they live (issue #49): the inputs moved to RAM once, the outputs summed there
        host = part_to_host(self, hidden_states, top_k_index, top_k_weights) if here and self.accelerator else None
        for e in hit:   # in the eager forward's order: experts ascending
            token_idx, top_k_pos = positions[e]
            moved_to = None
            if e in self.rows:
                tensors = {n: t[self.rows[e]:self.rows[e] + 1] for n, t in self.resident.items()}
                self.traffic.resident += 1
            elif e in cached:   # a copy on the main device, kept after an earlier call fetched it
                tensors = cached[e]
            elif e in self.remote:
                d, target, row = self.remote[e]
                tensors = {n: self.remote_tensors[(d, n)][row:row + 1] for n in self.sources}
                if e in there:
                    moved_to = target
                    self.traffic.remote += 1
                else:   # fetched from the accelerator that holds it to the layer's
                    tensors = {n: t.to(self.main) for n, t in tensors.items()}
                    self.traffic.peer += sum(t.numel() * t.element_size() for t in tensors.values())
                    self.traffic.fetched += 1
            elif e in here:
                tensors = {n: self._cast(self.host(n)[e:e + 1], n) for n in self.sources}
                moved_to = "cpu"
                self.traffic.computed += 1
            else:
                if e not in fetched.get(next(iter(self.sources)), {}):   # the next turn into the reused buffer
                    start = to_fetch.index(e)
                    fetched = self._fetch(to_fetch[start:start + chunk])
                    if self.cache is not None:
                        store(self, fetched)
                tensors = {n: fetched[n][e] for n in self.sources}
                self.traffic.fetched += 1
            self.traffic.routed += 1
            if host is not None and e in here:   # from the inputs in RAM: host = [states, index, weights, out]
                token_idx, top_k_pos = torch.where(host[1] == e)
                out = eager(_One(module, tensors), host[0][token_idx], torch.zeros_like(token_idx)[:, None],
                            host[2][token_idx, top_k_pos, None])
                host[3].index_add_(0, token_idx, out.to(host[3].dtype))
                continue
            states = hidden_states[token_idx]
            weights = top_k_weights[token_idx, top_k_pos, None]
            if moved_to is not None:
                states, weights = states.to(moved_to), weights.to(moved_to)
                self.traffic.activations += 2 * states.numel() * states.element_size() + weights.numel() * \
                    weights.element_size()
            index = torch.zeros((states.shape[0], 1), dtype=top_k_index.dtype, device=states.device)
            out = eager(_One(module, tensors), states, index, weights)
            final.index_add_(0, token_idx, out.to(final.device, final.dtype))
        return final if host is None else final + part_to_main(self, host[3], final.device)


def routed_layers(model, hooks, placed, resident_on, *, device, files: MappedFiles, mode="auto",
                  traffic: Traffic | None = None, layout: Mapping | None = None,
                  cache: ExpertCache | None = None, buffers: FetchBuffers | None = None, threshold: int = 1) -> dict:
    """For each offloaded fused experts module of ``model`` that the runtime can run expert by expert: its
    :class:`RoutedExperts`, keyed by ``id(module)``. ``hooks`` are ``(name, module, hook)`` of accelerate's
    offloading hooks; ``placed`` maps experts module names to the device of each expert (``Plan.experts``), those on
    ``resident_on`` (the plan's main device) being kept on the main device; experts of modules it does not name are
    all offloaded. ``mode`` is one of :data:`MODES` for every module, or a dict of them per experts module name
    (``Runtime.expert_mode``; ``"auto"`` for a module it does not name). ``layout`` gives per experts module name
    the plan's ``{"runs_on": device, "fetch_chunk": n}`` (:attr:`allocator.report.runtime.Runtime.runs_on`): the
    layer's device, where resident experts run (default ``resident_on``); experts on another accelerator are kept
    there. ``cache`` (:mod:`.expert_cache`) serves the layers run on the main device; ``buffers`` (a
    :class:`FetchBuffers`, a new one by default) is where every layer's fetched slices are copied.

    A module is left to whole-module streaming where its children hold tensors (a norm shared by its experts), its
    hook streams tensors of other modules, or it runs in a dtype its file does not hold as float.
    """
    modes = dict(mode) if isinstance(mode, Mapping) else {}
    named = [m for v in modes.values() for m in ([v] if isinstance(v, str) else v.values())]
    for m in (set(named) if isinstance(mode, Mapping) else {mode}):
        if m not in MODES:
            raise InvalidRuntime(f"experts mode must be one of {list(MODES)}, got {m!r}.")
    layers = {m.experts: m for m in family_of(model).experts(model) if m.kind == "fused" and not m.common}
    traffic = traffic if traffic is not None else Traffic()
    buffers = buffers if buffers is not None else FetchBuffers()
    pages = Residency()   # one mincore buffer for every layer (.expert_pages)
    out = {}
    for name, module, hook in hooks:
        layer = layers.get(name)
        if layer is None or hook.place_submodules:
            continue
        sources, metas = {}, {}
        for pname in layer.params:
            meta = module._parameters[pname]
            if meta is None or meta.device.type != "meta":
                break
            sources[pname], metas[pname] = source_of(hook.weights_map, pname, files), meta
        else:
            plan = (layout or {}).get(name, {})
            home = plan.get("runs_on", resident_on)
            main = str(hook.execution_device) if home in (None, "main", resident_on) else _torch(home, device)
            main = f"cuda:{main}" if main.isdigit() else main
            where = placed.get(name, ("offloaded",) * layer.num_experts)
            routed = RoutedExperts(layer, sources, metas, tuple(where), main, device, traffic,
                                   modes.get(name, "auto") if isinstance(mode, Mapping) else mode, home=home,
                                   chunk=plan.get("fetch_chunk"), buffers=buffers, threshold=threshold,
                                   cache=cache if cache is not None and home in (None, "main", resident_on) else None,
                                   pages=pages)
            routed.keep([e for e, d in enumerate(where) if home is not None and d == home])
            routed.keep_elsewhere({e: d for e, d in enumerate(where) if isinstance(d, int) and not isinstance(
                d, bool) and d != home}, lambda d: _torch(d, device))
            routed.random_access()
            out[id(module)] = routed
    if out:
        log.info("allocator runtime: %d experts modules run expert by expert (%s resident experts)", len(out),
                 sum(len(r.rows) for r in out.values()))
    return out


def _torch(plan_device, device) -> str:
    """The torch device of a plan's accelerator index for the runtime's ``device``: ``cuda:i`` on a GPU, ``cpu``
    for a device whose copies stay in RAM (:class:`allocator.offload.StandInDevice`, :class:`HostDevice`)."""
    if getattr(device, "kind", "cpu") == "cpu" or getattr(getattr(device, "backend", None), "on_host", False):
        return "cpu"
    return f"cuda:{plan_device}"


def bytes_per_expert(routed: RoutedExperts) -> int:
    """Bytes of one expert's slices as the module runs them."""
    return sum(math.prod(m.shape[1:]) * m.element_size() for m in routed.metas.values())
