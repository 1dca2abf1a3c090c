"""The witness: what the contract of ``device_map="auto"`` needs to know before any strategy runs, computed once
per problem by :func:`witness` — accelerate's own placement (``sequential``), whether its map is valid, the contract's
main device (rule 1) and its floor (rule 3).

:func:`allocator.plan` computes it as the step between building the problem and running the strategy; the strategies
and the checker (:mod:`allocator.judge.contract`) read it and never compute it again (it is kept on the problem,
:attr:`allocator.problem.Problem.derived`).

Each part is computed when first asked for (a ``sequential`` plan never asks for the main device). The main device is
the first accelerator, by index, on which a valid plan executes: accelerate's own valid map has
it as main, or one of ``reserve``'s fills with it as the main device (every streaming reserve that some unit's offload
would need, each raised to its fixed point) gives a valid map that uses it; else ``"cpu"``.

Notes
-----
O(a · s · g) for the main device (a accelerators, s candidate reserves, g groups), one run of ``sequential``.
"""

from __future__ import annotations

from functools import cached_property

from ..memo import Key
from ..budgets import Device
from ..errors import AllocatorError
from ..evaluate.cost import priced
from ..evaluate.memory import main_device, map_runs
from ..evaluate.tiers import fast_bytes, order_violations
from ..evaluate.units import problem_groups
from .verdict import headroom, is_valid
from ..placement import Placement
from ..problem import Problem, accelerators_up_to
from ..search import accelerate
from ..search.cpsat import MAX_UNITS, coarsen, model_inputs, solve_for_main
from ..search.fills import fixed_point_fills
from ..search.first_fit import every_main, full_reserve, reserve_sizes

__all__ = ["EXACT_SECONDS", "Witness", "accelerate_map", "accelerate_placement", "admits", "contract_main",
           "admission", "exact_admits", "fill_memo", "floor", "index_ordered", "main_candidates", "witness"]

WITNESS = Key("witness")
FILLS = Key("fill_memo")

EXACT_SECONDS = 0.5
"""Deterministic seconds CP-SAT gets to decide whether an accelerator can be the main device, where no fill found a
plan for it (:func:`exact_admits`)."""


class Witness:
    """What every contract plan is judged against (:func:`witness`). Each part is computed the first time it is
    asked for, and once: ``sequential`` strategies never pay for the main device's search, and a plan under
    ``objective="latency"`` never asks for it."""

    def __init__(self, problem: Problem):
        self.problem = problem

    @cached_property
    def _sequential(self) -> tuple[Placement | None, AllocatorError | None]:
        try:
            return accelerate.place(self.problem), None
        except AllocatorError as err:
            return None, err

    @property
    def accelerate(self) -> Placement | None:
        """``sequential``'s placement (accelerate's algorithm), or ``None`` where it fails (:attr:`error`)."""
        return self._sequential[0]

    @property
    def error(self) -> AllocatorError | None:
        """What ``sequential`` raised, where it failed."""
        return self._sequential[1]

    @property
    def baseline(self) -> dict | None:
        """The map the user gets today on this path: ``PlanOptions.baseline`` where given (transformers' own map on
        ``from_pretrained``), else accelerate's (``sequential``'s); ``None`` where that fails."""
        if self.problem.deciding.baseline is not None:
            return dict(self.problem.deciding.baseline)
        return None if self.accelerate is None else dict(self.accelerate.device_map)

    @cached_property
    def valid_map(self) -> dict | None:
        """The baseline where it keeps the runtime rules, else ``None``."""
        theirs = self.baseline
        if theirs is None or not is_valid(self.problem, theirs):
            return None
        return theirs

    @cached_property
    def streamed(self) -> int | None:
        """Rule 3: the bytes the valid baseline streams per forward (``None`` where it is not valid)."""
        return None if self.valid_map is None else priced(self.problem, self.valid_map).streamed_bytes

    @cached_property
    def headroom(self) -> int | None:
        """Rule 3 on ``from_pretrained``: the least free memory transformers' own valid map leaves on any accelerator,
        where it keeps the whole model on the accelerators (:func:`allocator.judge.verdict.headroom`); ``None``
        elsewhere (no transformers map given, not valid, or something offloaded)."""
        if self.problem.deciding.baseline is None or self.valid_map is None:
            return None
        return headroom(self.problem, self.valid_map)

    @cached_property
    def _main(self) -> tuple[Device, dict | None]:
        return _first_main(self.problem, self.valid_map)

    @property
    def main(self) -> Device:
        """Rule 1: the first accelerator that admits a valid plan as the main device, else ``"cpu"``."""
        return self._main[0]

    @property
    def main_plan(self) -> dict | None:
        """A valid map with :attr:`main` as its main device that keeps the contract's index order, where the search
        for the main device found one (accelerate's own, a fill's or CP-SAT's); ``None`` for ``"cpu"``. Every
        strategy may fall back to it: the main device the contract requires is never one no strategy can use."""
        return self._main[1]

    @cached_property
    def _floor(self) -> tuple[int, dict | None]:
        valid = self.valid_map
        if valid is None:
            return 0, None
        found = map_runs(self.problem.graph, valid)
        keeps = main_device(valid.values()) == self.main and not order_violations(self.problem, found)
        return fast_bytes(self.problem, found), valid if keeps else None

    @property
    def floor(self) -> int:
        """Rule 3: the bytes the valid baseline keeps on the fastest tier (0 where it is not valid)."""
        return self._floor[0]

    @property
    def fallback(self) -> dict | None:
        """The valid baseline where it also keeps rules 1 and 2: a plan every strategy may fall back to."""
        return self._floor[1]


def witness(problem: Problem) -> Witness:
    """The witness of ``problem``, made once (the problem is frozen, so it does not change)."""
    return problem.derived.once(WITNESS, lambda: Witness(problem))


def _first_main(problem: Problem, valid: dict | None) -> tuple[Device, dict | None]:
    theirs = main_device(valid.values()) if valid is not None else None
    for device in problem.budgets.accelerators:
        if device == theirs:   # the baseline's own plan proves it, where it keeps rule 2 too
            ordered = not order_violations(problem, map_runs(problem.graph, valid))
            return device, valid if ordered else admission(problem, device)
        if (problem.budgets.limit(device) or 0) > 0 or not problem.graph.total:
            found = admission(problem, device)
            if found is not None:
                return device, found
    return "cpu", None


def admits(problem: Problem, main: Device) -> bool:
    """Whether a valid plan that keeps the contract's index order has ``main`` as its main device
    (:func:`admission` finds one)."""
    return admission(problem, main) is not None


def admission(problem: Problem, main: Device) -> dict | None:
    """A valid map that keeps the contract's index order with ``main`` as its main device, or ``None``.

    First by ``reserve``'s fills — over every accelerator the budgets offer, then over ``main`` and the accelerators
    up to each later one (a plan that leaves the later ones empty is a plan here too, so offering one more
    accelerator never loses a main device the fills found without it); then, where no fill finds one, exactly, by the
    CP-SAT model with ``main`` as main device (:func:`exact_admits`)."""
    later = problem.budgets.accelerators[problem.budgets.accelerators.index(main):]
    for last in [later[-1], *later[:-1]]:
        found = _fills_admit(accelerators_up_to(problem, last), main)
        if found is not None:
            return found
    return _exact(problem, main)[1]


def _fills_admit(problem: Problem, main: Device) -> dict | None:
    found = problem_groups(problem)
    starts = [full_reserve(problem), *reserve_sizes(problem, found)]
    tried = set()
    for candidate in fixed_point_fills(problem, found, main, starts, fill_memo(problem),
                                       ordered=index_ordered(problem)):
        if id(candidate) in tried:
            continue
        tried.add(id(candidate))
        if candidate.main != main:
            continue
        device_map = problem.cleaned(candidate.device_map())
        if is_valid(problem, device_map):
            return device_map
    return None


def exact_admits(problem: Problem, main: Device, seconds: float = EXACT_SECONDS) -> bool | None:
    """Whether some valid plan that keeps the contract's index order has ``main`` as its main device, decided by the
    CP-SAT model (:func:`allocator.search.cpsat.solve_for_main` with no bound on its objective): ``True`` with a
    plan found (and checked by :func:`allocator.evaluate.validate.check`), ``False`` when CP-SAT proves none exists,
    ``None`` when it cannot tell within ``seconds`` of deterministic time, OR-Tools is not installed, or the groups had
    to be merged to stay under :data:`allocator.search.cpsat.MAX_UNITS` and the merged model has no plan."""
    return _exact(problem, main, seconds)[0]


def _exact(problem: Problem, main: Device, seconds: float = EXACT_SECONDS) -> tuple[bool | None, dict | None]:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return None, None
    found, merged = coarsen(list(problem_groups(problem).records()), MAX_UNITS)
    tensors, sequence, ends = model_inputs(problem, found)
    solved = solve_for_main(problem, found, tensors, sequence, main, problem.profile, seconds, None, None, 0, ends,
                            ordered=index_ordered(problem))
    if solved.placed is None:
        return (False if solved.proven and not merged else None), None
    placed = problem.cleaned(solved.placed)
    if main_device(placed.values()) != main or not is_valid(problem, placed):
        return None, None
    return True, placed


def accelerate_placement(problem: Problem) -> Placement:
    """``sequential``'s placement of this problem (the witness's); raises what ``sequential`` raises."""
    found = witness(problem)
    if found.error is not None:
        raise found.error
    return found.accelerate


def contract_main(problem: Problem) -> Device:
    """Rule 1's main device (:attr:`Witness.main`)."""
    return witness(problem).main


def floor(problem: Problem) -> int:
    """Rule 3's bytes on the fastest tier (:attr:`Witness.floor`)."""
    return witness(problem).floor


def accelerate_map(problem: Problem) -> dict | None:
    """accelerate's map where it is valid and keeps rules 1 and 2 (:attr:`Witness.fallback`)."""
    return witness(problem).fallback


def main_candidates(problem: Problem) -> list[Device]:
    """The devices a strategy tries as main: :func:`contract_main` alone under the contract; every device that could
    be main (:func:`allocator.search.first_fit.every_main`) under ``objective="latency"``."""
    return [contract_main(problem)] if problem.deciding.contract else every_main(problem)


def index_ordered(problem: Problem) -> bool:
    """Rule 2 as a bound for proposers (the fills, the CP-SAT model, the strategies): whether the devices that execute
    must be used in index order along the model — under the contract, not under ``objective="latency"``."""
    return problem.deciding.contract


def fill_memo(problem: Problem) -> dict:
    """The fills already made for this problem, by (main, reserve), shared by the witness and the fill strategies."""
    return problem.derived.once(FILLS, dict)
