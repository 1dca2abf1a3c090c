"""The composition (``allocator.plan``): one options object, a checked result from every strategy, one ranking of
candidates (``best_valid``), and what a problem derives kept with it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

import allocator
from allocator import InvalidOption, InvalidPlacement, PlanOptions
from allocator.memo import Key
from allocator.placement import Placement
from allocator.judge.ranking import best_valid, score
from allocator.report.decisions import outcome

LAYER = 64 * 64 * 4 + 64 * 4   # bytes of one nn.Linear(64, 64)


def stack(n=4):
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


# -- PlanOptions ----------------------------------------------------------------------------------------------------

def test_plan_options_are_keyword_only_frozen_and_slotted():
    with pytest.raises(TypeError):
        PlanOptions(True)  # noqa: FBT003 - keyword-only
    options = PlanOptions(offload_buffers=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.offload_buffers = False
    assert not hasattr(options, "__dict__")
    assert pickle.loads(pickle.dumps(options)) == options


@pytest.mark.parametrize("bad, match", [
    ({"offload_buffers": "yes"}, "offload_buffers must be True or False"),
    ({"strict": 1}, "strict must be True or False"),
    ({"objective": "fastest"}, "objective must be one of"),
    ({"profile": {"cpu_flops": 1}}, "profile must be an allocator.Profile"),
    ({"generation": 128}, "generation must be an allocator.GenerationBudget"),
    ({"size_fn": 3}, "size_fn must be callable"),
])
def test_bad_options_raise_a_typed_error_naming_the_field(bad, match):
    with pytest.raises(InvalidOption, match=match):
        PlanOptions(**bad)
    with pytest.raises(InvalidOption, match=match):
        allocator.plan(stack(), {"cpu": 10**6}, **bad)


def test_an_unknown_keyword_names_the_fields_to_choose_from():
    with pytest.raises(InvalidOption, match=r"unknown options \['offload_buffer'\].*offload_buffers"):
        allocator.plan(stack(), {"cpu": 10**6}, offload_buffer=True)
    with pytest.raises(InvalidOption, match="unknown options"):
        allocator.validate(stack(), {"": "cpu"}, {"cpu": 10**6}, offload_buffer=True)
    with pytest.raises(InvalidOption, match="must be an allocator.PlanOptions"):
        allocator.plan(stack(), {"cpu": 10**6}, options={"offload_buffers": True})


def test_options_object_and_keywords_give_the_same_plan_and_keywords_win():
    model, budget = stack(6), {0: 3 * LAYER, "cpu": 10**6}
    by_keywords = allocator.plan(model, budget, strategy="reserve", offload_buffers=True, clean_result=False)
    options = PlanOptions(offload_buffers=True, clean_result=False)
    by_object = allocator.plan(model, budget, strategy="reserve", options=options)
    assert by_object.device_map == by_keywords.device_map
    assert by_object.problem.options == dataclasses.replace(options, dtype=torch.float32)  # the model's, resolved
    overridden = allocator.plan(model, budget, strategy="reserve", options=options, clean_result=True)
    assert overridden.problem.options.clean_result and overridden.problem.options.offload_buffers
    assert options.clean_result is False   # the caller's options are never changed


def test_validate_and_build_problem_take_the_same_options():
    model = stack(2)
    options = PlanOptions(offload_buffers=True)
    assert allocator.build_problem(model, {"cpu": 10**6}, options=options).options == dataclasses.replace(
        options, dtype=torch.float32)   # the model's dtype, resolved once; the rest as given
    assert allocator.validate(model, {"0": "cpu", "1": "disk"}, {"cpu": 2 * LAYER}, options=options) == []
    assert [v.kind for v in allocator.validate(model, {"0": "cpu", "1": "disk"}, {"cpu": LAYER // 2},
                                               options=options)] == ["budget"]


def test_patch_keeps_one_options_object_and_refuses_per_call_options():
    pytest.importorskip("transformers")
    with allocator.patch(strategy="reserve", offload_buffers=True) as handle:
        assert handle.options == PlanOptions(offload_buffers=True)
    with pytest.raises(InvalidOption, match="come from each call"):
        allocator.patch(hf_quantizer=object())
    with pytest.raises(InvalidOption, match="unknown options"):
        allocator.patch(offload_buffer=True)


# -- the composition checks every strategy --------------------------------------------------------------------------

def test_a_strategy_returning_an_invalid_map_raises_a_typed_error():
    model, budget = stack(4), {"cpu": 2 * LAYER}

    def overflowing(problem):
        return Placement({"": "cpu"}, "overflowing")

    with pytest.raises(InvalidPlacement, match="'overflowing' returned a map that breaks the runtime rules: budget") \
            as caught:
        allocator.plan(model, budget, strategy=overflowing)
    assert [v.kind for v in caught.value.violations] == ["budget"]
    with pytest.raises(InvalidPlacement):   # the contract does not matter: the rules come first
        allocator.plan(model, budget, strategy=overflowing, objective="latency")


def test_sequential_is_exempt_it_reproduces_accelerate_violations_included():
    class Scaled(nn.Module):   # a parameter of the root between two layers
        def __init__(self):
            super().__init__()
            self.a, self.scale, self.b = nn.Linear(64, 64), nn.Parameter(torch.ones(64, 64)), nn.Linear(64, 64)

    model = Scaled()
    budget = {0: LAYER, "cpu": LAYER}   # accelerate sends everything to disk, more than RAM can stream at once
    theirs = allocator.plan(model, budget, strategy="sequential")
    assert theirs.device_map == {"": "disk"} and [v.kind for v in theirs.violations] == ["budget"]
    fallback = allocator.plan(model, budget)   # no valid plan exists: accelerate's map comes back, flagged
    assert fallback.strategy == "sequential (no valid auto plan)" and fallback.device_map == theirs.device_map
    with pytest.raises(allocator.InfeasiblePlacement):
        allocator.plan(model, budget, strict=True)


def test_a_strategy_returning_something_else_than_a_placement_is_refused():
    with pytest.raises(InvalidOption, match="returned dict, expected allocator.Placement"):
        allocator.plan(stack(), {"cpu": 10**6}, strategy=lambda problem: {"": "cpu"})


# -- best_valid -----------------------------------------------------------------------------------------------------

def test_best_valid_keeps_the_best_valid_candidate_and_says_what_became_of_the_others():
    model, budget = stack(4), {0: 3 * LAYER + 100, "cpu": 10**6}   # two layers resident and one streamed
    problem = allocator.build_problem(model, budget)

    def infeasible():
        raise allocator.InfeasiblePlacement("nothing fits")

    maps = {
        "all-cpu": {"": "cpu"},                              # valid, breaks rule 1 (a GPU was offered)
        "overflow": {"": 0},                                 # breaks the budget
        "two-on-0": {"0": 0, "1": 0, "2": "cpu", "3": "cpu"},
        "one-on-0": {"0": 0, "1": "cpu", "2": "cpu", "3": "cpu"},
    }
    candidates = [("raises", infeasible)] + [(name, lambda m=m, n=name: Placement(m, n)) for name, m in maps.items()]
    found = best_valid(problem, candidates)
    keys = {name: score(problem, m) for name, m in maps.items() if not allocator.validate(model, m, budget)}
    assert found.name == max(("two-on-0", "one-on-0"), key=keys.__getitem__) == "two-on-0"
    why = {t.name: outcome(t) for t in found.tried}
    assert why["raises"] == "finds no plan (InfeasiblePlacement)"
    assert why["overflow"].startswith("is invalid: it breaks a runtime rule (budget)")
    assert why["all-cpu"].startswith("breaks the contract: it runs on 'cpu'")
    assert [t.name for t in found.tried if t.eligible] == ["two-on-0", "one-on-0"]
    # a continuation keeps the winner unless beaten; a tie goes to the earlier candidate
    again = best_valid(problem, [("same", lambda: Placement(maps["two-on-0"], "same"))], than=found)
    assert again.name == "two-on-0" and len(again.tried) == len(found.tried) + 1
    latency = dataclasses.replace(problem, options=dataclasses.replace(problem.options, objective="latency"))
    assert "all-cpu" in {t.name for t in best_valid(latency, candidates).tried if t.eligible}


# -- what a problem derives is its own ------------------------------------------------------------------------------

def test_a_problem_owns_what_is_derived_from_it():
    problem = allocator.build_problem(stack(), {0: 2 * LAYER, "cpu": 10**6})
    calls, x = [], Key("x")
    assert problem.derived.once(x, lambda: calls.append(1) or 7) == 7
    assert problem.derived.once(x, lambda: calls.append(1) or 8) == 7 and calls == [1]
    other = dataclasses.replace(problem, budgets=allocator.build_problem(stack(), {"cpu": 10**6}).budgets)
    assert other.derived is not problem.derived and other.derived.once(x, lambda: 9) == 9
    assert problem.derived.once(Key("x"), lambda: 10) == 10   # another module's "x" is another value
    with pytest.raises(TypeError, match="memo.Key"):   # a value is never named by a bare string
        problem.derived.once("x", lambda: 11)
    assert problem == dataclasses.replace(problem)   # derived values take no part in equality


def test_a_callers_map_is_cleaned_as_the_options_say():
    model = stack(4)

    def per_layer(problem):
        return Placement({str(i): "cpu" for i in range(4)}, "per-layer")

    assert allocator.plan(model, {"cpu": 10**6}, strategy=per_layer).device_map == {"": "cpu"}
    assert allocator.plan(model, {"cpu": 10**6}, strategy=per_layer, clean_result=False).device_map == \
        {str(i): "cpu" for i in range(4)}


def test_the_docs_show_the_kit_example_as_it_is_tested():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    example = (root / "examples" / "kit_strategy.py").read_text().rstrip()
    assert f"```python\n{example}\n```" in (root / "docs" / "strategies.md").read_text()
    body = example.split('"""', 2)[2].splitlines()
    code = [line for line in body if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 30, f"examples/kit_strategy.py has {len(code)} lines of code; a strategy is an ordering"


def test_the_accelerate_drop_in_plans_for_accelerates_loader(monkeypatch):
    import allocator.integrations.accelerate as api

    seen = []
    real = api.plan

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(result.problem.options.loader)
        return result

    monkeypatch.setattr(api, "plan", spy)
    api.infer_auto_device_map(stack(), {"cpu": 10**6})
    api.infer_auto_device_map(stack(), {"cpu": 10**6}, loader="transformers")
    assert seen == ["accelerate", "transformers"]
