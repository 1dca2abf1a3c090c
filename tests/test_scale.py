"""Complexity guards: large module trees plan in time and memory roughly linear in their size.

Generous bounds, in CPU time (less sensitive than wall time to other processes on a shared machine) and the best of
two runs, so that they never flake on a loaded 2-core machine; the timed targets live in
``benchmarks/planning_speed.py``, not here. A quadratic step anywhere in build -> strategy -> check -> cost (as
``units`` was, O(units x nodes), and ``clean_device_map`` before it) fails the exponent checks by a wide margin:
4x the modules then costs 16x, where the bound allows 4^1.6 = 9.2x.
"""

import gc
import math
import time
import tracemalloc

import pytest
from torch import nn

import allocator
from allocator.strategies import STRATEGIES
from planning_speed import build  # benchmarks/ is on the tests' path (pyproject.toml)

GREEDY = ("sequential", "backfill", "reserve")


def model(family: str, modules: int) -> nn.Module:
    """The benchmark's models (``benchmarks/planning_speed.py``): a ModuleList-of-experts MoE or a flat stack."""
    return build(family, modules)[0]


def budget(m: nn.Module) -> dict:
    total = allocator.build_problem(m, {"cpu": 0}).graph.total
    return {0: total // 2, "cpu": total}


def cpu_seconds(fn, repeats: int = 2) -> float:
    best = math.inf
    for _ in range(repeats):
        gc.collect()
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


# Bytes only: with the per-tensor latency of accelerate's hooks, thousands of tiny layers run faster from RAM on the
# CPU, and the test wants the GPU used.
BYTES_ONLY = allocator.Profile(offload_tensor_latency=0, disk_tensor_latency=0, accelerator_tensor_latency=0)


def plan_all(m: nn.Module, limits: dict) -> None:
    problem = allocator.build_problem(m, limits, profile=BYTES_ONLY)
    for name in GREEDY:
        assert 0 in STRATEGIES[name](problem).device_map.values()
    assert allocator.plan(m, limits, strategy="reserve", profile=BYTES_ONLY).valid


@pytest.mark.parametrize("family", ["flat", "moe"])
def test_20k_modules_plan_in_about_linear_time(family):
    small, large = model(family, 5_000), model(family, 20_000)
    seconds = cpu_seconds(lambda: plan_all(large, budget(large)))
    ratio = seconds / cpu_seconds(lambda: plan_all(small, budget(small)))
    # ~1-3 s of CPU on 2 busy cores; before the linear units / check / walk, the flat model took minutes
    assert seconds < 60
    assert ratio < 4 ** 1.6, f"4x the modules took {ratio:.1f}x the time: super-linear"


def test_peak_memory_grows_linearly():
    def peak(m: nn.Module) -> int:
        limits = budget(m)
        gc.collect()
        tracemalloc.start()
        try:
            plan_all(m, limits)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    ratio = peak(model("flat", 6_000)) / peak(model("flat", 1_500))
    assert ratio < 4 * 1.25, f"4x the modules took {ratio:.1f}x the peak memory"
