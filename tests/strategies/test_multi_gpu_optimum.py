"""On several accelerators, ``auto``'s exact candidate: CP-SAT solves for the fastest plan among those that keep
the best candidate's bytes on the fastest tier, so the judge's ranking (bytes first without a measured profile)
picks it where it wins (issue 38)."""

import pytest
from torch import nn

import allocator
from allocator.evaluate.cost import estimate
from allocator.model import zoo
from allocator.strategies import ilp

pytest.importorskip("ortools")


@pytest.fixture(scope="module")
def clip_two_gpus():
    """CLIP on two GPUs of 37.5 % of the model each: the heuristic fills keep 73.0 % on the GPUs at an estimated
    57.2 ms; a plan that keeps as many bytes runs in 41.2 ms (estimates, default Profile)."""
    model = zoo.build("clip-vit-base")
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    budget = {0: int(total * .375), 1: int(total * .375), "cpu": 2 * total}
    return model, budget, allocator.build_problem(model, budget)


@pytest.mark.slow
def test_auto_reaches_the_optimum_at_its_bytes_on_two_gpus(clip_two_gpus):
    model, budget, problem = clip_two_gpus
    plan = allocator.plan(model, budget)
    mine = estimate(problem, plan.device_map)
    best = ilp.place(problem, time_limit=5.0, keep=mine.resident_fast)
    theirs = estimate(problem, best.device_map)
    assert best.optimal
    assert theirs.resident_fast >= mine.resident_fast
    assert mine.seconds <= theirs.seconds * 1.01, (mine.seconds, theirs.seconds)
    assert not allocator.contract_violations(problem, plan.device_map)


def test_keep_is_a_floor_of_bytes_on_the_fastest_tier():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])   # 16.25 KiB per layer
    layer = 64 * 64 * 4 + 64 * 4
    budget = {0: 3 * layer, 1: 2 * layer, "cpu": 10 * layer}
    problem = allocator.build_problem(model, budget)
    free = estimate(problem, ilp.place(problem).device_map)
    kept = estimate(problem, ilp.place(problem, keep=free.resident_fast).device_map)
    assert kept.resident_fast >= free.resident_fast
    with pytest.raises(allocator.InfeasiblePlacement):
        ilp.place(problem, keep=6 * layer, hint=None)   # more than the accelerators can hold with a reserve
