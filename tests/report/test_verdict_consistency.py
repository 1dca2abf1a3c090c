"""One plan says one thing (issue #46): over zoo models x budgets (one GPU, two GPUs, RAM only) x runtime
(``accelerate``, ``allocator``) x generation (none, ``GenerationBudget(1, 4096)``) x ``expert_cache`` (0, and N for
mixtures of experts), every plan's ``repr``, ``explain()``, ``to_dict()`` and the CLI's table give the same resident,
peak, reserve and estimate per device, from its one verdict; each device's parts sum to its peak; ``valid`` implies
every peak within its budget; each byte of the model is counted once, where the runtime holds it; a plan with a
generation budget prices prefill and decode under either runtime, decode never above prefill; ``estimate.seconds``
is the step ``estimate.step`` names.

Each property was broken on purpose once (the parts left without the runtime's reserves, an expert cache added after
the check, the resident bytes counted on the map only, the decode step priced from the whole experts module) and
these tests failed; see the closing note of issue #46."""

from __future__ import annotations

import itertools
import json
import re
import warnings

import pytest

import allocator
from allocator.budgets import format_bytes
from allocator.cli import render
from allocator.evaluate.validate import peak_parts
from allocator.judge.verdict import PARTS, memory
from allocator.model import zoo

pytest.importorskip("transformers")

MODELS = ("llama-3.2-1b", "gpt2", "qwen3-moe-30b-a3b", "mixtral-8x7b")
MOE = {"qwen3-moe-30b-a3b", "mixtral-8x7b"}
BUDGETS = {"gpu": {0: .30, "cpu": 2.0}, "2gpu": {0: .20, 1: .20, "cpu": 2.0}, "ram": {"cpu": .30}}
GENERATION = allocator.GenerationBudget(1, 4096)


@pytest.fixture(scope="module")
def built():
    return {name: zoo.build(name) for name in MODELS}


def _cases():
    for name, budget, runtime, generation in itertools.product(MODELS, BUDGETS, ("accelerate", "allocator"),
                                                                (False, True)):
        caches = (0, 16) if name in MOE and runtime == "allocator" else (0,)
        for cache in caches:
            yield pytest.param(name, budget, runtime, generation, cache,
                               id=f"{name}-{budget}-{runtime}-{'gen' if generation else 'fwd'}-cache{cache}")


def mapped_cache(p, device) -> int:
    """The KV cache the validator counts on ``device`` for ``p``'s map (where units execute, before our runtime's
    compute plan moves it)."""
    return peak_parts(p.problem, p.device_map, memory(p.problem, p.device_map)).get(device, {}).get("cache", 0)


def _plan(model, budget: str, runtime: str, generation: bool, cache: int):
    total = allocator.build_problem(model, {"cpu": 10 ** 15}).graph.total
    shares = BUDGETS[budget]
    budgets = {d: int(v * total) for d, v in shares.items()}
    options = {"runtime": runtime}
    if cache:
        options["expert_cache"] = cache
    if generation:
        options["generation"] = GENERATION
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return allocator.plan(model, budgets, **options)


@pytest.mark.slow
@pytest.mark.parametrize("name,budget,runtime,generation,cache", list(_cases()))
def test_one_plan_says_one_thing(built, name, budget, runtime, generation, cache):
    p = _plan(built[name], budget, runtime, generation, cache)
    data = json.loads(json.dumps(p.to_dict()))
    devices = [d for d in p.problem.budgets.order if d in p.peak]
    # each device's parts sum to its peak, in the plan and in its data
    for d in devices:
        assert set(p.parts[d]) == set(PARTS)
        assert sum(p.parts[d].values()) == p.peak[d], (d, p.parts[d], p.peak[d])
        key = str(d)
        assert sum(data["parts"][key].values()) == data["peak"][key] == p.peak[d]
        assert data["resident"][key] == p.resident(d)
    # the peak is the map's memory under the runtime rules (the validator's, computed apart) plus what our runtime
    # holds beside the map: resident experts, the expert cache, the KV cache moved to where units decode
    mapped = memory(p.problem, p.device_map).peak
    for d in devices:
        added = p.parts[d]["experts"] + p.parts[d]["expert_cache"]
        if p.hybrid is None:
            assert p.peak[d] == mapped.get(d, 0) + added, (d, p.peak[d], mapped.get(d, 0), p.parts[d])
        else:
            assert p.peak[d] - added - p.parts[d]["cache"] == mapped.get(d, 0) - mapped_cache(p, d)
    # valid means every byte the runtime holds is within its budget
    assert data["valid"] == p.valid
    if p.valid:
        for d in devices:
            limit = p.problem.budgets.limit(d)
            assert limit is None or p.peak[d] <= limit, (d, p.peak[d], limit)
    # each byte of the model counted once, where the runtime holds it
    assert sum(p.resident(d) for d in p.problem.budgets.order) == p.problem.graph.total
    assert all(p.resident(d) >= 0 for d in p.problem.budgets.order)
    fast = allocator.evaluate.tiers.fast_tier(p.problem.budgets)
    assert p.cost.resident_fast == sum(p.resident(d) for d in p.problem.budgets.order if d in fast)
    # the estimate: one of the steps; prefill and decode priced with a generation budget, decode never above prefill
    estimate = data["estimate"]
    assert estimate["seconds"] == estimate["steps"][estimate["step"]] == p.cost.seconds
    assert all(seconds > 0 for seconds in estimate["steps"].values()), estimate["steps"]
    if generation:
        assert set(estimate["steps"]) == {"prefill", "decode"}
        assert estimate["steps"]["decode"] <= estimate["steps"]["prefill"] * (1 + 1e-9), estimate["steps"]
    # repr, explain and the CLI's table say the same resident, peak and estimate per device
    text, line, table = p.explain(), repr(p), render.device_table(p)
    ms = f"{p.cost.seconds * 1e3:.3f} ms"
    assert f"estimated {ms}" in line and f"estimated {ms}" in text and ms in table
    for d in devices:
        said = f"{d}: resident {format_bytes(p.resident(d))}, peak {format_bytes(p.peak[d])}"
        assert said in line, (said, line)
        assert re.search(rf"\b{re.escape(str(d))}: resident {re.escape(format_bytes(p.resident(d)))}, peak "
                         rf"{re.escape(format_bytes(p.peak[d]))}", text), (d, text[:2000])
        row = next(r for r in table.splitlines() if r.split()[0] == str(d))
        assert render.format_size(p.resident(d)) in row and render.format_size(p.peak[d]) in row
        assert render.format_size(p.parts[d]["reserve"]) in row
    if p.streamed:
        assert f"streaming reserve {format_bytes(p.streamed)}" in text or p.streamed == p.parts[p.main_device][
            "reserve"] - p.prefetch


def test_an_expert_cache_counts_before_valid_is_decided():
    """The expert cache is in the main device's parts and peak from the one verdict, so a budget too small for it is
    judged with it (not added after the check)."""
    model = zoo.build("qwen3-moe-30b-a3b")
    total = allocator.build_problem(model, {"cpu": 10 ** 15}).graph.total
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = allocator.plan(model, {0: int(.3 * total), "cpu": 2 * total}, runtime="allocator", expert_cache=64)
    main = p.main_device
    assert p.parts[main]["expert_cache"] > 0
    assert p.peak[main] == sum(p.parts[main].values())
    assert p.runtime.buffers["expert_cache"] == p.parts[main]["expert_cache"]
    assert p.peak[main] <= p.problem.budgets.limit(main)


def test_experts_kept_in_ram_are_counted_in_ram():
    """A plan for our runtime that keeps routed experts in RAM while their modules are mapped to disk says RAM holds
    them: resident, to_dict and the estimate's fastest-tier bytes count them where they are."""
    model = zoo.build("mixtral-8x7b")
    total = allocator.build_problem(model, {"cpu": 10 ** 15}).graph.total
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = allocator.plan(model, {"cpu": int(.3 * total), "disk": 10 * total}, runtime="allocator")
    in_ram = sum(1 for row in p.experts.values() for d in row if d == "cpu")
    on_disk_modules = [k for k in p.experts if p.device_map.get(k) == "disk"
                       or p.device_map.get(k.rsplit(".", 2)[0]) == "disk"]
    if not in_ram or not on_disk_modules:
        pytest.skip("this budget keeps no expert of a disk-mapped module in RAM")
    dense = allocator.plan(model, {"cpu": int(.3 * total), "disk": 10 * total})
    assert p.resident("cpu") > 0 and p.parts["cpu"]["experts"] > 0
    assert p.resident("disk") + p.resident("cpu") == total
    assert p.cost.resident_fast == p.resident("cpu")
    assert dense.resident("disk") >= p.resident("disk")
