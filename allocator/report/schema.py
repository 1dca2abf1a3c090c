"""The plan as data: a stable JSON schema (:data:`SCHEMA`) written by :meth:`allocator.Plan.to_dict` and read back
by :meth:`allocator.Plan.from_dict`.

The object holds what a plan decided and what it costs, so it can be inspected, passed to other tools, or checked
against a model before anything is loaded::

    {"schema": "allocator.plan/3",
     "model": {"class": "LlamaForCausalLM", "parameters": 8030261248, "bytes": 16060522496, "hash": "sha256:9f2c...",
               "shapes": {"model.embed_tokens.weight": [128256, 4096], ...}},
     "device_map": {"model.embed_tokens": 0, ..., "lm_head": "cpu"},
     "main_device": 0,
     "strategy": "auto:reserve", "asked": "auto", "base": "reserve", "exempt": [], "optimal": null,
     "valid": true,
     "budgets": {"0": 25769803776, "cpu": 68719476736, "disk": null},
     "resident": {"0": ...}, "peak": {"0": ...}, "parts": {"0": {"weights": ..., "cache": ...}},
     "reserve_bytes": ..., "prefetch_reserve_bytes": 0,
     "estimate": {"seconds": ..., "streamed_per_forward_bytes": ..., "disk_bytes": ..., "device_changes": ...,
                  "resident_fast": ..., "steps": {"prefill": ...}},
     "options": {"objective": "contract", "dtype": "bfloat16", "generation": {...}, ...},
     "decisions": [{"kind": "kept", "text": "...", "devices": [0], "units": [], "bytes": null, "bound": "",
                    "facts": {...}}],
     "violations": [{"kind": "budget", "message": "..."}],
     "experts": null,
     "runtime": {"name": "allocator", "main_device": 0, "prefetch": 1, "experts": {}, "expert_mode": {},
                 "threshold": 1, "buffers": {"streamed": ..., "prefetch": ..., "experts": ..., "expert_cache": 0},
                 "expert_cache": 0, "runs_on": {}, "fetch_chunk": {}},
     "compute": {"model.layers.20": {"prefill": 0, "decode": "cpu"}, ...},
     "hybrid": {"threshold": 1, "tokens": {"prefill": 511, "decode": 1}, "cache_moved": ...}}

Devices are written as JSON allows keys: accelerator indices as strings (``"0"``); as map *values* they stay integers
(``0``), as ``device_map=`` takes them. ``budgets`` lists every device in the plan's order, ``null`` for no limit.
``compute`` is where each offloaded unit computes per phase (:attr:`allocator.Plan.compute`: unit -> {phase:
device}) in a plan for the allocator runtime with an accelerator as main device, ``null`` otherwise; ``hybrid`` holds
what the runtime needs besides it (:class:`allocator.evaluate.compute.ComputePlan`: ``threshold``, the most tokens of
a decode call, the tokens per step of each phase, the KV cache bytes moved to RAM), ``null`` where ``compute`` is.
``experts`` is where each routed expert lives in a plan for the allocator runtime on a mixture of experts
(:attr:`allocator.Plan.experts`: experts module -> the device of each expert, written as map values are), which a
device map cannot name; ``null`` otherwise. ``options.expert_profile`` holds the profile the plan was made with.
``runtime`` is what the runtime does as the plan decided it (:class:`allocator.report.runtime.Runtime`):
:func:`allocator.offload.attach` reads it, and the compute map (``SavedPlan.hybrid``), from a plan or a saved plan
alike: both attach the same runtime.
A reader refuses another major version; fields it does not know are kept (``SavedPlan.data``). Every field, its
unit and an example: ``docs/schema.md`` (checked against :func:`plan_to_dict` by ``tests/report/test_schema_doc.py``).

Version 2 renamed what version 1 called ``streamed`` (the streaming reserve) to ``reserve_bytes``, ``prefetch`` (the
prefetch reserve, not the ``options.prefetch`` depth) to ``prefetch_reserve_bytes``, and ``estimate.streamed_bytes``
(bytes streamed per forward) to ``estimate.streamed_per_forward_bytes``, and added ``model.parameters`` and
``model.hash``. :func:`read` still reads ``/1`` (only the map, budgets, options and decisions are read back, which
kept their names); a ``/1`` plan carries no hash, so it is checked against the model by its budgets alone.

Version 3 added ``hybrid`` (the threshold and tokens of the compute map, which a ``/2`` reader could not attach: its
saved plans ran every offloaded unit streamed) and ``model.shapes`` (each tensor's shape, compared with the model's
on its own, beside ``model.hash``). :func:`read` still reads ``/2``: its compute map's threshold is the one
:func:`allocator.evaluate.compute.phase_tokens` gives under its saved options, and its model is compared by class,
parameters and hash.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

from ..errors import InvalidOption, PlanModelMismatch
from ..evaluate.compute import ComputePlan
from ..model import as_dtype
from ..model.expert_profile import ExpertProfile
from ..model.generation import GenerationBudget
from ..placement import Decision, Placement
from ..problem import PlanOptions, Problem, build_problem
from ..profile import Profile
from .runtime import Runtime
from .decisions import sentence

__all__ = ["SCHEMA", "READS", "SavedPlan", "plan_to_dict", "model_record", "read", "rebuild", "device_key",
           "device_of"]

SCHEMA = "allocator.plan/3"
"""The schema's name and major version: a reader of ``/3`` reads every ``/3`` object."""
READS = ("allocator.plan/1", "allocator.plan/2", SCHEMA)
"""The versions :func:`read` reads (module notes: what changed from ``/1``)."""

#: Options written under ``"options"`` as they are (booleans, names, integers).
PLAIN_OPTIONS = ("objective", "optimize", "loader", "runtime", "prefetch", "expert_cache", "offload_buffers",
                 "discover_no_split", "infer_no_split", "fallback_allocation", "clean_result", "split_layers")
#: Options that cannot be written as JSON; a plan made with them is re-validated only when they are passed again.
UNSAVED = ("hf_quantizer", "size_fn")


def device_key(device) -> str:
    """A device as a JSON key: ``0`` -> ``"0"``, ``"cpu"`` -> ``"cpu"``."""
    return str(device)


def device_of(key: str):
    """A device from a JSON key: ``"0"`` -> ``0``, ``"cpu"`` -> ``"cpu"``."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _dtype_text(dtype) -> str | None:
    return None if dtype is None else str(as_dtype(dtype, "dtype")).removeprefix("torch.")


def _shapes(inputs):
    """``PlanOptions.inputs`` as JSON: names to shapes (lists), or the string or ``None`` as given."""
    if inputs is None or isinstance(inputs, str):
        return inputs
    return {k: list(getattr(v, "shape", v)) for k, v in inputs.items()}


def _expert_profile(value):
    """``PlanOptions.expert_profile`` as JSON: the profile's counts and tokens, or the path given, or ``None``."""
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, ExpertProfile):
        return None if value is None else str(value)
    return {"counts": {k: list(v) for k, v in value.counts.items()}, "tokens": value.tokens}


def _options(options: PlanOptions) -> dict:
    out = {name: getattr(options, name) for name in PLAIN_OPTIONS}
    gen = options.generation
    out.update(
        dtype=_dtype_text(options.dtype),
        special_dtypes=None if options.special_dtypes is None else {
            k: _dtype_text(v) for k, v in options.special_dtypes.items()},
        no_split_module_classes=(None if options.no_split_module_classes is None else
                                 [options.no_split_module_classes] if isinstance(options.no_split_module_classes, str)
                                 else list(options.no_split_module_classes)),
        tied_parameters=None if options.tied_parameters is None else [list(g) for g in options.tied_parameters],
        inputs=_shapes(options.inputs),
        generation=None if gen is None else {
            "batch_size": gen.batch_size, "max_length": gen.max_length, "dtype": _dtype_text(gen.dtype),
            "prompt_length": gen.prompt_length, "max_new_tokens": gen.max_new_tokens},
        profile=None if options.profile is None else options.profile.to_dict(),
        expert_profile=_expert_profile(options.expert_profile),
        not_saved=[name for name in UNSAVED if getattr(options, name) is not None],
    )
    return out


def plan_to_dict(plan) -> dict:
    """The :class:`allocator.Plan` ``plan`` as a JSON-ready dict of :data:`SCHEMA` (module notes)."""
    problem: Problem = plan.problem
    budgets = problem.budgets
    devices = [d for d in budgets.order if d in plan.peak or d in budgets.limits or d == "disk"]
    return {
        "schema": SCHEMA,
        "model": model_record(problem),
        "device_map": dict(plan.device_map),
        "main_device": plan.main_device,
        "strategy": plan.strategy,
        "asked": plan.asked,
        "base": plan.placement.base,
        "exempt": sorted(plan.placement.exempt),
        "optimal": plan.optimal,
        "valid": plan.valid,
        "budgets": {device_key(d): budgets.limit(d) for d in budgets.order},
        "resident": {device_key(d): plan.resident(d) for d in devices},
        "peak": {device_key(d): int(v) for d, v in plan.peak.items()},
        "parts": {device_key(d): {k: int(v) for k, v in parts.items()} for d, parts in plan.parts.items()},
        "reserve_bytes": plan.streamed,
        "prefetch_reserve_bytes": plan.prefetch,
        "estimate": {**_estimate(plan.cost), "step": plan.priced_step, "steps": _steps(plan)},
        "generation": None if problem.generation is None else problem.generation.summary(),
        "options": _options(problem.options),
        "decisions": [_decision(d) for d in plan.placement.decisions],
        "violations": [{"kind": v.kind, "message": v.message} for v in plan.violations],
        "experts": {name: list(row) for name, row in plan.experts.items()} or None,
        "runtime": plan.runtime.to_dict(),
        "compute": plan.compute or None,
        "hybrid": _hybrid(plan.hybrid),
    }


def _hybrid(hybrid: ComputePlan | None) -> dict | None:
    """``hybrid``: what the runtime reads of a compute map besides where each unit computes (module notes)."""
    if hybrid is None:
        return None
    return {"threshold": int(hybrid.threshold), "tokens": {k: int(v) for k, v in hybrid.tokens.items()},
            "cache_moved": int(hybrid.cache_moved)}


def _steps(plan) -> dict:
    """``estimate.steps``: seconds of one step of each phase as the plan runs (:attr:`allocator.Plan.costs`: prefill,
    and with a generation budget decode); ``estimate.seconds`` is the one ``estimate.step`` names."""
    return {step: cost.seconds for step, cost in plan.costs.items()}


def model_record(problem: Problem) -> dict:
    """The model a problem was built for, as a plan records it: class, parameters, bytes under the plan's options, and
    ``"sha256:"`` + the digest of its tensors' names and shapes, and those shapes by tensor name
    (:class:`allocator.model.read.ModelIdentity`)."""
    identity = problem.identity
    return {"class": problem.graph.model_class,
            "parameters": None if identity is None else identity.parameters,
            "bytes": problem.graph.total,
            "hash": None if identity is None else f"sha256:{identity.digest}",
            "shapes": None if identity is None else {name: list(shape) for name, shape in identity.shapes}}


def _estimate(cost) -> dict:
    """:class:`allocator.evaluate.cost.Cost` as JSON, the bytes streamed per forward named as such."""
    return {("streamed_per_forward_bytes" if k == "streamed_bytes" else k): v
            for k, v in dataclasses.asdict(cost).items()}


def _same_model(saved: Mapping, problem: Problem) -> None:
    """Raise :class:`PlanModelMismatch` where the saved plan's model record names another model than ``problem``'s:
    its class and parameters, its tensors' shapes one by one (``/3``), and its hash (``/2`` on); each check stands on
    its own. A record with neither shapes nor hash (schema ``/1``) is not compared."""
    record = saved.get("model")
    if not isinstance(record, Mapping) or not (record.get("hash") or record.get("shapes")):
        return
    given = model_record(problem)
    shapes = record.get("shapes")
    shape = _first_other_shape(shapes, given["shapes"] or {}) if isinstance(shapes, Mapping) else None
    same = all(record.get(k) == given[k] for k in ("class", "parameters")) and shape is None and (
        not record.get("hash") or record["hash"] == given["hash"])
    if same:
        return

    def said(r):
        parameters = r.get("parameters")
        count = f"{parameters:,} parameters" if isinstance(parameters, int) else "parameters unknown"
        return f"{r.get('class')}, {count}, {str(r.get('hash'))[:19]}"

    raise PlanModelMismatch(f"this plan is for {said(record)} but the model is {said(given)}"
                            + (f" ({shape})" if shape else "") + "; make a new plan with allocator.plan(model, ...).",
                            saved=record, given=given)


def _first_other_shape(saved: Mapping, given: Mapping) -> str | None:
    """The first tensor whose shape differs between a saved plan's model and the model given, in words; ``None``
    where every tensor has the same shape in both."""
    for name in dict.fromkeys([*saved, *given]):
        if name not in given:
            return f"{name!r} is not in the model"
        if name not in saved:
            return f"the plan's model has no {name!r}"
        if list(saved[name]) != list(given[name]):
            return f"{name!r} is {list(given[name])} in the model, {list(saved[name])} in the plan"
    return None


def _decision(decision: Decision) -> dict:
    """A :class:`allocator.placement.Decision` as JSON: its fields, devices and units as lists, the fields of its
    kind (``facts``), and its sentence (``text``, :func:`allocator.report.decisions.sentence`)."""
    return {"kind": decision.kind, "text": sentence(decision), "devices": list(decision.devices),
            "units": list(decision.units), "bytes": decision.bytes, "bound": decision.bound,
            "facts": _json(dict(decision.facts))}


def _json(value):
    """``value`` with its tuples as lists, as JSON reads it back."""
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return value


def _decision_of(data: Mapping) -> Decision:
    """A decision read back: from its kind and fields where it has ``facts`` (its sentence is made from them again),
    else with its saved ``text``."""
    facts = data.get("facts") or {}
    return Decision(str(data.get("kind", "split")), "" if facts else str(data.get("text", "")),
                    devices=tuple(data.get("devices", ())), units=tuple(data.get("units", ())),
                    bytes=data.get("bytes"), bound=str(data.get("bound", "")), facts=dict(facts))


@dataclasses.dataclass(frozen=True, slots=True)
class SavedPlan:
    """A plan read back from its dict (:func:`read`), without a model: the data as saved, with the device map and
    the main device as ``device_map=`` takes them. :meth:`allocator.Plan.from_dict` given the model re-validates
    it into a :class:`allocator.Plan`.

    Examples
    --------
    >>> saved = read({"schema": SCHEMA, "device_map": {"": 0}, "main_device": 0, "budgets": {"0": 100}})
    >>> saved.device_map, saved.main_device, saved.budgets
    ({'': 0}, 0, {0: 100})
    """

    data: Mapping

    @property
    def device_map(self) -> dict:
        return dict(self.data["device_map"])

    @property
    def main_device(self):
        return self.data["main_device"]

    @property
    def budgets(self) -> dict:
        """Device -> bytes (``None`` for no limit), in the plan's order."""
        return {device_of(k): v for k, v in self.data["budgets"].items()}

    @property
    def peak(self) -> dict:
        return {device_of(k): v for k, v in self.data.get("peak", {}).items()}

    @property
    def runtime(self) -> Runtime:
        """What the runtime does (:class:`allocator.report.runtime.Runtime`); a plan saved before this section
        existed reads as accelerate's hooks, or the allocator runtime with its saved prefetch."""
        data = self.data.get("runtime")
        if data is None:
            options = self.data.get("options") or {}
            name = options.get("runtime", "accelerate")
            return Runtime(name=name, main_device=self.main_device, prefetch=int(options.get("prefetch") or 0),
                           experts={k: tuple(v) for k, v in (self.data.get("experts") or {}).items()})
        return Runtime.from_dict(data)

    @property
    def hybrid(self) -> ComputePlan | None:
        """Where each offloaded unit computes per phase, as the runtime reads it (:attr:`allocator.Plan.hybrid`, its
        per-unit prices left out: ``choices`` is empty); ``None`` without a compute map. A ``/2`` plan's threshold
        and tokens follow from its saved options (module notes)."""
        compute = self.data.get("compute")
        if not compute:
            return None
        devices = {unit: {phase: device for phase, device in phases.items()} for unit, phases in compute.items()}
        saved = self.data.get("hybrid")
        if saved is None:   # schema /2 (read() refuses a /3 plan without it)
            tokens = _phase_tokens(self.data.get("options") or {})
            return ComputePlan(devices=devices, tokens=tokens, threshold=tokens["decode"], choices=())
        return ComputePlan(devices=devices, tokens={k: int(v) for k, v in saved["tokens"].items()},
                           threshold=int(saved["threshold"]), choices=(), cache_moved=int(saved.get("cache_moved", 0)))

    def to_dict(self) -> dict:
        """The data as saved (a copy)."""
        return copy.deepcopy(dict(self.data))


def read(data: Mapping) -> SavedPlan:
    """``data`` checked as a plan of a version this reader reads (:data:`READS`).

    Raises
    ------
    InvalidOption
        Not a mapping, another schema or version, or no ``device_map``, ``main_device`` or ``budgets``.
    """
    hint = "write one with Plan.to_dict() or 'allocator plan MODEL --json FILE'"
    if not isinstance(data, Mapping):
        raise InvalidOption(f"a saved plan is a JSON object, got {type(data).__name__}; {hint}.")
    name = data.get("schema")
    if not isinstance(name, str) or name.partition("/")[0] != SCHEMA.partition("/")[0]:
        raise InvalidOption(f"not an allocator plan (its 'schema' is {name!r}, expected {SCHEMA!r}); {hint}.")
    if name not in READS:
        raise InvalidOption(f"plan schema {name!r} is not read by this version of allocator (it reads "
                            f"{' and '.join(map(repr, READS))}); plan again with this version.")
    missing = [k for k in ("device_map", "main_device", "budgets") if k not in data]
    if missing or not isinstance(data["device_map"], Mapping) or not isinstance(data["budgets"], Mapping):
        raise InvalidOption(f"the saved plan has no {', '.join(missing) or 'valid device_map or budgets'}; {hint}.")
    hybrid = data.get("hybrid")
    if name == SCHEMA and data.get("compute") and not (
            isinstance(hybrid, Mapping) and {"threshold", "tokens"} <= set(hybrid)):
        raise InvalidOption(f"the saved plan has a compute map but no 'hybrid' section with its threshold and tokens "
                            f"(schema {SCHEMA}); {hint}.")
    return SavedPlan(copy.deepcopy(dict(data)))


def _phase_tokens(options: Mapping) -> dict:
    """Tokens per step of each phase under a ``/2`` plan's saved options, as
    :func:`allocator.evaluate.compute.phase_tokens` makes them from the problem."""
    gen = options.get("generation")
    if gen is None:
        profile = options.get("profile")
        tokens = (Profile() if profile is None else Profile.from_dict(profile)).tokens
        return {"prefill": tokens, "decode": 1}
    prompt = gen.get("prompt_length") or gen["max_length"] - 1
    return {"prefill": gen["batch_size"] * prompt, "decode": gen["batch_size"]}


def rebuild(saved: SavedPlan, model, **keywords) -> tuple[Problem, Placement]:
    """The problem the saved plan was made for, built again for ``model`` under its saved budgets and options
    (``keywords``: fields of :class:`PlanOptions` that override them, e.g. the ``size_fn`` of a quantized model),
    and its placement as saved."""
    options = dict(saved.data.get("options") or {})
    missing = [name for name in options.get("not_saved", ()) if name not in keywords]
    if missing:
        raise InvalidOption(f"the plan was made with {', '.join(missing)}, which JSON cannot hold; pass them again, "
                            f"e.g. Plan.from_dict(data, model, {missing[0]}=...).")
    gen = options.get("generation")
    profile = options.get("profile")
    fields = {name: options[name] for name in PLAIN_OPTIONS if name in options}
    fields.update(
        dtype=options.get("dtype"), special_dtypes=options.get("special_dtypes"),
        no_split_module_classes=options.get("no_split_module_classes"),
        tied_parameters=options.get("tied_parameters"),
        inputs=({k: tuple(v) for k, v in options["inputs"].items()} if isinstance(options.get("inputs"), Mapping)
                else options.get("inputs", "auto")),
        generation=None if gen is None else GenerationBudget(
            gen["batch_size"], gen["max_length"], gen.get("dtype"), prompt_length=gen.get("prompt_length"),
            max_new_tokens=gen.get("max_new_tokens")),
        profile=None if profile is None else Profile.from_dict(profile),
        expert_profile=_expert_profile_of(options.get("expert_profile")),
    )
    fields.update(keywords)
    max_memory = {d: v for d, v in saved.budgets.items() if v is not None}
    problem = build_problem(model, max_memory, options=PlanOptions.of(None, **fields))
    _same_model(saved.data, problem)
    decisions = tuple(_decision_of(d) if isinstance(d, Mapping) else Decision("split", str(d))
                      for d in saved.data.get("decisions") or ())
    placement = Placement(device_map=saved.device_map, strategy=str(saved.data.get("strategy", "saved")),
                          decisions=decisions, optimal=saved.data.get("optimal"), base=str(saved.data.get("base", "")),
                          exempt=frozenset(saved.data.get("exempt", ())),
                          experts={k: tuple(v) for k, v in (saved.data.get("experts") or {}).items()})
    return problem, placement


def _expert_profile_of(value):
    if isinstance(value, Mapping):
        return ExpertProfile({k: tuple(v) for k, v in value["counts"].items()}, tokens=int(value.get("tokens", 0)))
    return value
