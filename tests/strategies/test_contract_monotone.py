"""The contract, exact where users meet it: an extra accelerator never hurts, more budget never puts less on the
GPU, plain bytes rank first where the estimate was never measured, and asking for our runtime never gives a worse
placement than not asking."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import allocator
from allocator.evaluate.cost import estimate
from allocator.model import zoo
from allocator.judge.witness import admits, exact_admits, witness


def accelerator_bytes(plan) -> int:
    return sum(plan.resident(d) for d in plan.problem.budgets.accelerators)


def total_of(model) -> int:
    return allocator.build_problem(model, {"cpu": 0}).graph.total


@pytest.fixture(scope="module")
def llama8b():
    return zoo.build("llama-8b")


def test_a_second_smaller_gpu_keeps_gpu_0_the_main_device(llama8b):
    """Offering GPU 1 (smaller than GPU 0) used to make no fill admit GPU 0, so the plan ran on the CPU."""
    one = allocator.plan(llama8b, {0: "1.1GiB", "cpu": "64GiB"}, dtype="bfloat16")
    two = allocator.plan(llama8b, {0: "1.1GiB", 1: "0.5GiB", "cpu": "64GiB"}, dtype="bfloat16")
    assert one.main_device == 0
    assert two.main_device == 0, two.explain()
    assert accelerator_bytes(two) >= accelerator_bytes(one)
    assert two.cost.seconds <= estimate(two.problem, one.device_map).seconds * (1 + 1e-9)


@pytest.mark.parametrize("name", ["t5-base", "segformer-b0", "gpt2", "bert-base", "qwen3-moe-30b-a3b"])
def test_an_extra_accelerator_never_lowers_the_bytes_on_accelerators(name):
    model = zoo.build(name)
    total = total_of(model)
    for first in (0.3, 0.6, 0.9):
        one = allocator.plan(model, {0: int(total * first), "cpu": 2 * total})
        for second in (0.03, 0.1, 0.3):
            two = allocator.plan(model, {0: int(total * first), 1: int(total * second), "cpu": 2 * total})
            where = f"{name} {first} + {second}"
            assert two.valid, where
            assert accelerator_bytes(two) >= accelerator_bytes(one), where
            if one.main_device == two.main_device:
                assert two.cost.seconds <= estimate(two.problem, one.device_map).seconds * (1 + 1e-9) or \
                    accelerator_bytes(two) > accelerator_bytes(one), where


@pytest.mark.parametrize("name", ["segformer-b0", "llama-3.2-1b", "t5-base", "swin-tiny", "wav2vec2-base"])
def test_more_budget_never_puts_less_on_the_gpu(name):
    model = zoo.build(name)
    total = total_of(model)
    last = 0
    for tenth in range(1, 11):
        plan = allocator.plan(model, {0: int(total * tenth / 10), "cpu": 2 * total})
        assert plan.valid
        now = plan.resident(0) if 0 in plan.peak else 0
        assert now >= last, f"{name}: {tenth * 10} % keeps {now} B on the GPU, less than {last} B at {tenth - 1}0 %"
        last = now


def test_segformer_keeps_most_of_the_model_on_a_gpu_of_90_percent():
    """The estimate used to prefer streaming the large stage (an unmeasured per-tensor latency) over keeping it."""
    model = zoo.build("segformer-b0")
    total = total_of(model)
    plan = allocator.plan(model, {0: int(total * 0.9), "cpu": 2 * total})
    assert plan.resident(0) > 0.8 * total
    choice = plan.placement.of_kind("choice")
    assert choice and choice[0].bound == "bytes"   # the decision says bytes decided, not the estimate


def test_a_measured_profile_lets_the_estimate_decide():
    model = zoo.build("segformer-b0")
    total = total_of(model)
    budget = {0: int(total * 0.6), "cpu": 2 * total}
    measured = allocator.plan(model, budget, profile=allocator.Profile())
    assert measured.placement.of_kind("choice")[0].bound == "estimate"
    others = [allocator.plan(model, budget, strategy=s, profile=allocator.Profile()) for s in ("sequential", "reserve")]
    assert all(measured.cost.seconds <= o.cost.seconds * (1 + 1e-9) for o in others if o.valid)


def stack(n: int = 6, width: int = 64) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def test_the_witness_is_decided_exactly_where_fills_find_nothing():
    model = stack()
    layer = 64 * 64 * 4 + 64 * 4
    # GPU 0 can hold a layer only with nothing streamed through it: every other layer on GPU 1
    problem = allocator.build_problem(model, {0: layer + 8, 1: 6 * layer, "cpu": 10**6})
    assert exact_admits(problem, 0) is True
    assert admits(problem, 0)
    assert witness(problem).main == 0
    tiny = allocator.build_problem(model, {0: layer // 2, 1: 6 * layer, "cpu": 10**6})
    assert exact_admits(tiny, 0) is False    # proven: not even one layer fits
    assert witness(tiny).main == 1


def test_our_runtime_never_plans_a_worse_placement_than_accelerates_hooks():
    """A Llama at 40 % RAM: asking for runtime='allocator' used to double the streaming reserve and find no plan."""
    model = zoo.build("llama-3.2-1b")
    total = total_of(model)
    for budget in ({"cpu": int(total * 0.4)}, {0: int(total * 0.4), "cpu": 2 * total}):
        plain = allocator.plan(model, budget)
        ours = allocator.plan(model, budget, runtime="allocator")   # the depth left to the plan
        assert ours.valid and not ours.strategy.startswith("sequential (no valid")
        cost, base = ours.cost, plain.cost
        assert (cost.resident_fast, -cost.streamed_bytes) >= (base.resident_fast, -base.streamed_bytes)
        assert ours.placement.of_kind("runtime") and ours.problem.options.prefetch is not None
        if ours.main_device == "cpu":
            assert ours.problem.options.prefetch == 0   # no measured profile: no prefetch on the CPU


def test_warnings_point_at_the_callers_line():
    model = stack(n=2, width=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        allocator.plan(model, {"cpu": 100})   # no valid plan: accelerate's map comes back, with a warning
    mine = [w for w in caught if "accelerate's own map is returned" in str(w.message)]
    assert mine and mine[0].filename == __file__
