"""What the runtime does, as the plan decided it: :class:`Runtime`, the ``runtime`` section of a plan's data.

The plan decides, once, everything the offload runtime (:func:`allocator.offload.attach`) then does: which runtime
streams offloaded weights, how many offloaded modules it makes ready ahead, which routed experts it keeps resident,
how each offloaded expert it runs is served, and the bytes it may hold on the main device for all of that. The runtime
reads this object and re-derives none of it from options; :meth:`Runtime.to_dict` / :meth:`Runtime.from_dict` carry
it in :meth:`allocator.Plan.to_dict` (``"runtime"``), so a saved plan attaches the same runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..budgets import Device, normalize_map
from ..errors import InvalidOption
from ..evaluate.compute import phase_tokens
from ..evaluate.experts import expert_modes
from ..evaluate.memory import fetch_chunk, prefetch_of, runs_on

__all__ = ["EXPERT_MODES", "Runtime", "decide_runtime"]

#: How an offloaded expert the router picks runs (:mod:`allocator.offload.experts`): fetched to the main device,
#: computed where its weights are, or chosen per call from the cost model (``"auto"``: only where the caller asks;
#: a plan decides ``"fetch"`` or ``"compute"`` per layer and phase).
EXPERT_MODES = ("auto", "fetch", "compute")


@dataclass(frozen=True, slots=True)
class Runtime:
    """The runtime a plan decided.

    Attributes
    ----------
    name : str
        ``"allocator"`` (:mod:`allocator.offload`) or ``"accelerate"`` (accelerate's hooks, which this plan leaves
        as they are).
    main_device : int or str
        Where offloaded modules execute; experts placed there are resident.
    prefetch : int
        Offloaded modules made ready ahead of the running one (0 under accelerate's hooks).
    experts : dict
        Experts module name -> the device of each expert (``Plan.experts``): those on ``main_device`` are kept
        resident, the others are read when routed.
    expert_mode : dict
        Experts module name -> {phase: mode}: how the offloaded routed experts of that layer run in each phase of
        ``generate`` (``"prefill"``, ``"decode"``), ``"fetch"`` or ``"compute"`` (where they live), decided from the
        cost model's one formula for routed experts (:func:`allocator.evaluate.experts.expert_modes`); the runtime
        runs it as written. A mode of :data:`EXPERT_MODES` for every phase is accepted too.
    threshold : int
        A call of an experts module with at most this many tokens is in the ``"decode"`` phase, a longer one in
        ``"prefill"`` (the decode step's tokens, :func:`allocator.evaluate.compute.phase_tokens`).
    buffers : dict
        Bytes the runtime may hold on the main device beyond resident weights: ``"streamed"`` (the largest
        offloaded chain at once), ``"prefetch"`` (modules made ready ahead), ``"experts"`` (routed experts resident
        there), ``"expert_cache"`` (recently routed experts kept, :attr:`expert_cache`).
    expert_cache : int
        Routed experts the runtime keeps on the main device after they ran (0: none).
    runs_on : dict
        Experts module name -> the device its layer executes on, where the runtime computes the experts resident
        there and brings fetched ones (:func:`allocator.evaluate.memory.runs_on`): the main device, or another
        accelerator holding that layer. An expert resident on a third accelerator is computed there (the
        activations moved) or fetched, chosen per call.
    fetch_chunk : dict
        Experts module name -> how many offloaded experts one fetch gathers into its reused buffer on a device other
        than the main device (:func:`allocator.evaluate.memory.fetch_chunk`); absent: all routed ones at once.
    """

    name: str = "accelerate"
    main_device: Device | None = None
    prefetch: int = 0
    experts: Mapping = field(default_factory=dict)
    expert_mode: Mapping = field(default_factory=dict)
    threshold: int = 1
    buffers: Mapping = field(default_factory=dict)
    expert_cache: int = 0
    runs_on: Mapping = field(default_factory=dict)
    fetch_chunk: Mapping = field(default_factory=dict)

    @property
    def streams(self) -> bool:
        """Whether the allocator runtime, not accelerate's hooks, runs the offloaded modules."""
        return self.name == "allocator"

    @property
    def resident(self) -> dict:
        """Experts module name -> the indices of the experts kept on the main device."""
        return {name: tuple(e for e, d in enumerate(row) if d == self.main_device)
                for name, row in self.experts.items()}

    def to_dict(self) -> dict:
        """JSON-ready data (devices as map values are written: ``0``, ``"cpu"``, ``"disk"``)."""
        return {"name": self.name, "main_device": self.main_device, "prefetch": self.prefetch,
                "experts": {k: list(v) for k, v in self.experts.items()},
                "expert_mode": {k: v if isinstance(v, str) else dict(v) for k, v in self.expert_mode.items()},
                "threshold": self.threshold, "buffers": {k: int(v) for k, v in self.buffers.items()},
                "expert_cache": self.expert_cache, "runs_on": dict(self.runs_on),
                "fetch_chunk": {k: int(v) for k, v in self.fetch_chunk.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> Runtime:
        """The runtime saved by :meth:`to_dict`.

        Raises
        ------
        InvalidOption
            Not such data (an unknown runtime or expert mode, a negative depth).
        """
        if not isinstance(data, Mapping):
            raise InvalidOption(f"a plan's 'runtime' is a JSON object, got {type(data).__name__}; plan again.")
        out = cls(name=str(data.get("name", "accelerate")), main_device=data.get("main_device"),
                  prefetch=int(data.get("prefetch", 0)),
                  experts={k: tuple(v) for k, v in (data.get("experts") or {}).items()},
                  expert_mode={k: v if isinstance(v, str) else dict(v)
                               for k, v in (data.get("expert_mode") or {}).items()},
                  threshold=int(data.get("threshold", 1)),
                  buffers={k: int(v) for k, v in (data.get("buffers") or {}).items()},
                  expert_cache=int(data.get("expert_cache", 0)), runs_on=dict(data.get("runs_on") or {}),
                  fetch_chunk={k: int(v) for k, v in (data.get("fetch_chunk") or {}).items()})
        bad = sorted({m for v in out.expert_mode.values() for m in ([v] if isinstance(v, str) else v.values())
                      if m not in EXPERT_MODES})
        if out.name not in ("allocator", "accelerate") or bad or out.prefetch < 0 or out.expert_cache < 0:
            raise InvalidOption(f"the plan's runtime section is not one this version reads ({dict(data)!r}); "
                                f"plan again with this version.")
        return out


def decide_runtime(problem, placement, memory, experts_bytes: int = 0, cache: tuple = (0, 0)) -> Runtime:
    """The :class:`Runtime` of a checked placement: ``memory`` is its :class:`allocator.evaluate.memory.Memory`
    (main device, streamed chain, prefetch reserve), ``experts_bytes`` the routed experts resident on the main
    device, ``cache`` the expert cache's ``(slots, bytes)`` there
    (:func:`allocator.evaluate.memory.expert_cache_reserve`). The experts mode of each offloaded experts layer per
    phase is the cheaper by :func:`allocator.evaluate.experts.expert_modes` at each phase's tokens."""
    runtime = problem.runtime
    if runtime.name != "allocator":
        return Runtime(name=runtime.name, main_device=memory.main)
    experts = {k: tuple(v) for k, v in placement.experts.items()}
    layers = {m.experts: m for m in problem.moe}
    runs = {k: v for k, v in runs_on(problem, normalize_map(placement.device_map)).items() if k in experts}
    tokens = phase_tokens(problem)
    return Runtime(name="allocator", main_device=memory.main, prefetch=prefetch_of(runtime), experts=experts,
                   expert_mode=expert_modes(problem, placement.device_map, placement.experts, tokens),
                   threshold=tokens["decode"],
                   buffers={"streamed": memory.streamed, "prefetch": memory.prefetch, "experts": experts_bytes,
                            "expert_cache": int(cache[1])},
                   expert_cache=int(cache[0]), runs_on=runs,
                   fetch_chunk={k: fetch_chunk(layers[k]) for k, d in runs.items() if d != memory.main})
