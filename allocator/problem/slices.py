"""The options of a plan, one slice per concern (torchtitan's habit: each step gets its own config slice).

A :class:`~allocator.problem.Problem` holds one frozen slice of its :class:`~allocator.problem.PlanOptions` per
concern, made once when the problem is made (:data:`SLICES`); the layers below the composition read the slice of
their concern (``problem.cost.optimize``, ``problem.runtime.prefetch``) and never the whole options. A slice's fields
are the :class:`~allocator.problem.PlanOptions` fields of the same names (``RuntimeOptions.name`` is
``PlanOptions.runtime``), documented there once.

- ``problem.reading`` (:class:`ReadOptions`): how the model is read; the builder
  (:func:`allocator.problem.build_problem`) and ``fit``.
- ``problem.placing`` (:class:`PlaceOptions`): the loading path and what the map loads and needs
  (``evaluate/``), accelerate's fill, cleaning.
- ``problem.deciding`` (:class:`DecideOptions`): the contract and what decides; the judge (witness, contract,
  ranking) and the strategies that keep the contract.
- ``problem.cost`` (:class:`CostOptions`): how plans are priced; the cost model and the ranking.
- ``problem.runtime`` (:class:`RuntimeOptions`): what streams offloaded weights and what it holds; memory, the
  experts pass, the report of the runtime.

``PlanOptions.generation`` is a slice of its own already (a :class:`~allocator.model.generation.GenerationBudget`),
read where the problem is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from ..model.expert_profile import ExpertProfile
from ..profile import Profile

__all__ = ["CostOptions", "DecideOptions", "PlaceOptions", "ReadOptions", "RuntimeOptions", "SLICES", "option_of"]


def option_of(slice_field) -> str:
    """The :class:`~allocator.problem.PlanOptions` field (or property) a slice's field is read from: its own name
    unless its metadata names another (``{"option": "runtime"}``)."""
    return slice_field.metadata.get("option", slice_field.name)


class _Slice:
    """What every slice does: it is made from the options, field by field."""

    __slots__ = ()

    @classmethod
    def of(cls, options):
        """The slice of ``options`` (an :class:`allocator.PlanOptions`)."""
        return cls(**{f.name: getattr(options, option_of(f)) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ReadOptions(_Slice):
    """How the model is read into its graph: the :class:`~allocator.problem.PlanOptions` fields of these names."""

    no_split_module_classes: Iterable[str] | str | None
    dtype: object
    special_dtypes: Mapping | None
    tied_parameters: Sequence[Sequence[str]] | None
    hf_quantizer: object
    size_fn: Callable | None
    discover_no_split: bool
    infer_no_split: bool


@dataclass(frozen=True, slots=True)
class PlaceOptions(_Slice):
    """What the map is for and how it is made and returned: the loading path, what ``dispatch_model`` does with
    offloaded buffers, accelerate's fallback, cleaning (the :class:`~allocator.problem.PlanOptions` fields of these
    names)."""

    loader: str
    offload_buffers: bool
    fallback_allocation: bool
    clean_result: bool


@dataclass(frozen=True, slots=True)
class DecideOptions(_Slice):
    """What decides between valid plans, what the contract compares with, and what happens where none exists
    (the :class:`~allocator.problem.PlanOptions` fields and property of these names)."""

    objective: str
    contract: bool
    """``PlanOptions.contract``: whether plans keep accelerate's conventions (``objective="contract"``)."""
    strict: bool
    baseline: Mapping | None


@dataclass(frozen=True, slots=True)
class CostOptions(_Slice):
    """How plans are priced (the :class:`~allocator.problem.PlanOptions` fields of these names)."""

    profile: Profile | None
    """``PlanOptions.profile`` as given: ``None`` where the documented defaults price the plan
    (``Problem.profile`` is the profile in use)."""
    inputs: Mapping | str | None
    optimize: str

    @property
    def measured(self) -> bool:
        """Whether a measured profile was given (the estimate then ranks plans before bytes)."""
        return self.profile is not None


@dataclass(frozen=True, slots=True)
class RuntimeOptions(_Slice):
    """What streams the offloaded weights and what it holds (the :class:`~allocator.problem.PlanOptions` fields of
    these names; ``name`` is ``PlanOptions.runtime``)."""

    name: str = field(metadata={"option": "runtime"})
    prefetch: int | None
    expert_cache: int
    expert_profile: ExpertProfile | str | None
    split_layers: bool


SLICES: dict[str, type] = {"reading": ReadOptions, "placing": PlaceOptions, "deciding": DecideOptions,
                           "cost": CostOptions, "runtime": RuntimeOptions}
"""The slices a :class:`~allocator.problem.Problem` holds, by attribute name."""
