"""Planning time (issue 46): ``auto`` makes no candidate that could not rank above the best so far, and its plans are
the ones it makes with every candidate; one ``plan()`` reads the model once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import allocator
from allocator.judge import ranking
from allocator.judge.contract import contract_violations
from allocator.judge.ranking import ceiling, score
from allocator.judge.verdict import is_valid
from allocator.strategies import auto, ilp

pytest.importorskip("ortools")

LAYER = 64 * 64 * 4 + 64 * 4   # bytes of one nn.Linear(64, 64)


def stack(sizes):
    """Linear layers of the given widths, one after another (each ``w × w`` plus its bias)."""
    return nn.Sequential(*[nn.Linear(w, w) for w in sizes])


MODELS = {"even": [64] * 8, "uneven": [32, 64, 96, 64, 32, 128, 64, 32]}
# budgets in layers of 64 x 64 (16.25 KiB): everything fits on one GPU, on two, on three, or not at all
BUDGETS = {
    "one-gpu-fits": {0: 9.5, 1: 9.5, "cpu": 40},
    "one-gpu-just": {0: 8.6, 1: 8.0, "cpu": 40},
    "two-gpus": {0: 5.0, 1: 5.0, "cpu": 40},
    "three-gpus": {0: 3.2, 1: 3.2, 2: 3.2, "cpu": 40},
    "three-uneven": {0: 2.0, 1: 5.5, 2: 1.2, "cpu": 40},
    "offloads": {0: 2.5, 1: 2.5, "cpu": 40},
    "three-last-small": {0: 2.5, 1: 3.0, 2: 0.5, "cpu": 40},
    "four-offloads": {0: 1.5, 1: 1.5, 2: 1.5, 3: 1.5, "cpu": 40},
}


def _budget(name):
    return {d: int(v * LAYER) for d, v in BUDGETS[name].items()}


def _every_candidate(monkeypatch):
    """``auto`` as it was before the gates: every candidate made."""
    monkeypatch.setattr(auto, "ceiling", lambda problem: None)
    monkeypatch.setattr(auto, "_fewer_could_win", lambda problem, found: True)
    monkeypatch.setattr(auto, "_solved", lambda found: False)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_no_valid_plan_ranks_above_the_ceiling(model, budget):
    module = stack(MODELS[model])
    problem = allocator.build_problem(module, _budget(budget))
    top = ceiling(problem)
    if top is None:
        return
    for strategy in ("sequential", "reserve", "backfill", "balanced", "ilp", "auto"):
        device_map = allocator.plan(module, _budget(budget), strategy=strategy).device_map
        if not is_valid(problem, device_map):
            continue
        kinds = {v.kind for v in contract_violations(problem, device_map)}
        if kinds - {"contract-floor"}:
            continue
        assert (not kinds, *score(problem, device_map)) <= top, (strategy, device_map)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_auto_plans_what_it_plans_with_every_candidate_made(model, budget, monkeypatch):
    gated = allocator.plan(stack(MODELS[model]), _budget(budget))
    with monkeypatch.context() as patched:
        _every_candidate(patched)
        every = allocator.plan(stack(MODELS[model]), _budget(budget))
    assert list(gated.device_map.items()) == list(every.device_map.items())
    assert gated.strategy == every.strategy
    assert gated.cost == every.cost


def test_a_model_that_fits_on_the_accelerators_is_planned_without_a_solve(monkeypatch):
    """Every byte fits on GPU 0: accelerate's map keeps all of it there with no change of device, which no plan beats
    (the ceiling): neither ``ilp`` nor the plan without the last accelerator is made."""
    solves = []
    monkeypatch.setattr(ilp, "place", lambda *a, **k: solves.append("ilp"))
    fewer = []
    real = auto._without_last
    monkeypatch.setattr(auto, "_without_last", lambda problem: fewer.append(1) or real(problem))
    budget = _budget("one-gpu-fits")
    plan = allocator.plan(stack(MODELS["even"]), budget)
    assert set(plan.device_map.values()) == {0}
    assert plan.strategy == "auto:sequential"
    assert solves == [] and fewer == []
    problem = allocator.build_problem(stack(MODELS["even"]), budget)
    assert (True, *score(problem, plan.device_map)) == ceiling(problem)


@pytest.mark.parametrize("budget", BUDGETS)
def test_with_counted_flops_no_plan_ranks_above_the_ceiling_and_the_plan_is_kept(budget, monkeypatch):
    """With the FLOPs counted at the inputs, a change of device moves the output that crosses its boundary: the
    ceiling charges the smallest; the gated plan is the one made with every candidate. (Layers of 64 x 96 weigh
    about a 64 x 64 layer and a half: the budgets hold fewer of them.)"""
    inputs = {"input": (4, 64)}
    module = nn.Sequential(*[nn.Linear(64, 96) if i % 2 == 0 else nn.Linear(96, 64) for i in range(8)])   # outputs
    # of 96 and 64 features by turns: the boundaries after the second of each pair move less
    problem = allocator.build_problem(module, _budget(budget), inputs=inputs)
    gated = allocator.plan(module, _budget(budget), inputs=inputs)
    top = ceiling(problem)
    if top is not None:
        assert (True, *score(problem, gated.device_map)) <= top
        ilp_map = allocator.plan(module, _budget(budget), inputs=inputs, strategy="ilp").device_map
        if is_valid(problem, ilp_map) and not contract_violations(problem, ilp_map):
            assert (True, *score(problem, ilp_map)) <= top
    with monkeypatch.context() as patched:
        _every_candidate(patched)
        every = allocator.plan(module, _budget(budget), inputs=inputs)
    assert list(gated.device_map.items()) == list(every.device_map.items()) and gated.cost == every.cost


def test_the_plan_without_the_last_accelerator_is_made_only_where_it_could_keep_as_many_bytes(monkeypatch):
    fewer = []
    real = auto._without_last
    monkeypatch.setattr(auto, "_without_last", lambda problem: fewer.append(problem) or real(problem))
    allocator.plan(stack(MODELS["even"]), _budget("offloads"))   # 2.5 + 2.5 layers: GPU 0 alone holds fewer
    assert fewer == []
    allocator.plan(stack(MODELS["even"]), _budget("three-last-small"))   # GPU 2 holds no layer: 0 and 1 might do
    assert len(fewer) == 1


def test_one_plan_reads_the_model_once(monkeypatch):
    from allocator.problem import build

    reads = []
    real = build.build_graph
    monkeypatch.setattr(build, "build_graph", lambda *a, **k: reads.append(1) or real(*a, **k))
    for budget in BUDGETS:
        reads.clear()
        allocator.plan(stack(MODELS["uneven"]), _budget(budget))
        assert len(reads) == 1, budget
    reads.clear()
    allocator.plan(stack(MODELS["uneven"]), _budget("offloads"), runtime="allocator")   # prefetch depths
    assert len(reads) == 1


def test_ceiling_needs_as_many_accelerators_as_hold_the_model():
    problem = allocator.build_problem(stack([64] * 8), _budget("three-gpus"))
    assert ceiling(problem)[-1] == -2    # 8 layers over 3.2 layers each: three GPUs, two changes
    assert ceiling(allocator.build_problem(stack([64] * 8), _budget("offloads"))) is None   # 5 layers of room
    latency = allocator.build_problem(stack([64] * 8), _budget("three-gpus"), objective="latency")
    assert ranking.estimate_decides(latency) and ceiling(latency) is None


def test_the_second_ilp_runs_only_where_the_first_won_without_a_proof(monkeypatch):
    """Two GPUs of 2.5 layers: the first ``ilp`` wins, proven optimal, so the second (at its bytes) is not made; the
    same plan, the first not proven, makes the second."""
    from dataclasses import replace

    calls = []
    real = ilp.place

    def counted(problem, **keywords):
        calls.append(keywords.get("keep", 0))
        return real(problem, **keywords)

    monkeypatch.setattr(ilp, "place", counted)
    plan = allocator.plan(stack(MODELS["even"]), _budget("offloads"))
    assert plan.strategy == "auto:ilp" and plan.placement.optimal and len(calls) == 1
    calls.clear()
    monkeypatch.setattr(ilp, "place", lambda problem, **k: replace(counted(problem, **k), optimal=False))
    assert allocator.plan(stack(MODELS["even"]), _budget("offloads")).device_map == plan.device_map
    assert len(calls) == 2 and calls[1] > 0


# budgets in layers of 1024 x 1024 (4 MiB: streaming costs more than a change of device), with three or four
# executing accelerators, where some identical layers are offloaded
BLOCK_BUDGETS = {
    "four-even": {0: 2.5, 1: 2.5, 2: 2.5, 3: 1.5, "cpu": 40},
    "four-uneven": {0: 3.5, 1: 1.2, 2: 2.2, 3: 1.1, "cpu": 40},
    "three-ram-short": {0: 3.5, 1: 2.2, 2: 1.2, "cpu": 6.5},
    "three-disk": {0: 2.5, 1: 2.2, 2: 2.2, "cpu": 2.5, "disk": 40},
}
WIDE = 1024 * 1024 * 4 + 1024 * 4


@pytest.mark.parametrize("budget", BLOCK_BUDGETS)
@pytest.mark.parametrize("ends", [False, True], ids=["plain", "larger-ends"])
def test_one_block_of_offloaded_layers_keeps_the_optimum(budget, ends, monkeypatch):
    """With more than two executing accelerators, a run of identical layers keeps its offloaded layers in one block
    (``cpsat.offloaded_block``) and the hint is rearranged to match (``cpsat.block_run``): the optimum is the one
    found without either, proven both ways."""
    from allocator.search import cpsat

    widths = ([768] if ends else []) + [1024] * 10 + ([896] if ends else [])
    with torch.device("meta"):
        model = stack(widths)
    problem = allocator.build_problem(model, {d: int(v * WIDE) for d, v in BLOCK_BUDGETS[budget].items()})
    blocked = ilp.place(problem, time_limit=20.0)
    with monkeypatch.context() as patched:
        patched.setattr(cpsat, "offloaded_block", lambda *a, **k: [])
        patched.setattr(cpsat, "block_run", lambda hint, *a, **k: hint)
        free = ilp.place(problem, time_limit=20.0)
    assert blocked.optimal and free.optimal
    mine, theirs = (p.decisions[0].facts["seconds"] for p in (blocked, free))
    assert mine == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    kept = set(blocked.device_map.values())
    assert kept & {"cpu", "disk"} and len(kept - {"cpu", "disk"}) > 2   # offloads, and runs on 3+ accelerators


def test_the_hint_of_a_run_is_rearranged_into_one_block_with_no_more_changes():
    """``cpsat.block_run``: the same devices, resident layers in index order, the offloaded ones (RAM, then disk) in
    one block where the changes of executing device cost least."""
    from allocator.evaluate.units import problem_groups
    from allocator.search import cpsat

    with torch.device("meta"):
        model = stack([1024] * 10)
    problem = allocator.build_problem(model, {d: int(v * WIDE) for d, v in BLOCK_BUDGETS["four-even"].items()})
    found = list(problem_groups(problem).records())
    _, sequence, _ = cpsat.model_inputs(problem, found)
    run = list(sequence)
    change_of = dict.fromkeys(zip(sequence, sequence[1:]), 1)   # every change costs one
    hint = dict(zip(map(str, range(10)), [1, "cpu", 2, "disk", "cpu", 2, 0, "cpu", 3, 1]))
    hint["0"], hint["6"] = 0, 1   # resident layers in index order: 0, 1, 1, 2, 2, 3
    out = cpsat.block_run(hint, found, sequence, run, [0, 1, 2, 3], ("cpu", "disk"), 0, change_of)

    def changes(device_map):
        runs_on = [0 if device_map[str(i)] in ("cpu", "disk") else device_map[str(i)] for i in range(10)]
        return sum(a != b for a, b in zip(runs_on, runs_on[1:]))

    devices = [out[str(i)] for i in range(10)]
    assert sorted(map(str, devices)) == sorted(map(str, hint.values()))
    assert devices == ["cpu", "cpu", "cpu", "disk", 0, 1, 1, 2, 2, 3]   # the first of the cheapest gaps
    assert changes(out) < changes(hint)


@pytest.mark.parametrize("name,fractions", [
    ("gemma3-4b", {0: .25, 1: .10, 2: .20, 3: .05, "cpu": 2}),             # two runs: vision and language layers
    ("qwen3-moe-30b-a3b", {0: .15, 1: .15, 2: .15, 3: .15, "cpu": 2}),
], ids=["gemma3-4b-uneven", "qwen3-moe-4gpu"])
def test_the_warm_start_stays_a_complete_solution_with_blocks(name, fractions, monkeypatch):
    """With the block of offloaded layers on four GPUs, the hint still gives every variable a value and, fixed to it,
    the model is feasible (CP-SAT starts from it at once): the blocks' booleans are hinted run by run, and the
    contract's levels from the hint as rearranged."""
    from ortools.sat.python import cp_model

    from allocator.model import zoo

    solve, seen = cp_model.CpSolver.Solve, []

    def fixed(self, model, *args, **kwargs):
        proto = model.Proto()
        hinted = sorted(set(proto.solution_hint.vars))
        if hinted:
            assert hinted == list(range(len(proto.variables)))
            self.parameters.fix_variables_to_their_hinted_value = True
        status = solve(self, model, *args, **kwargs)
        if hinted:
            seen.append(status)
        return status

    monkeypatch.setattr(cp_model.CpSolver, "Solve", fixed)
    model = zoo.build(name)
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    problem = allocator.build_problem(model, {d: int(total * f) for d, f in fractions.items()})
    ilp.place(problem, hint=ilp._heuristic(problem, problem.profile))
    assert seen and all(status == cp_model.OPTIMAL for status in seen), seen
