"""Hostile inputs: each gets a typed error that says the fix (or a documented, logged behaviour), and the model
(parameters, devices, hooks) and the caller's dicts are unchanged afterwards. Rows mirror docs/contract.md."""

import copy
import logging

import pytest
import torch
from torch import nn

import allocator
from allocator.errors import InvalidBudget, InvalidDeviceMap, InvalidModel, InvalidOption


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("count", torch.zeros(4, dtype=torch.int8))
        self.register_buffer("mask", torch.ones(32, dtype=torch.bool))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 32, bias=False)


def snapshot(model):
    return {
        "params": {n: (p.device, p.dtype, p.shape, p.data_ptr() if p.device.type != "meta" else 0)
                   for n, p in model.named_parameters(remove_duplicate=False)},
        "buffers": {n: (b.device, b.dtype) for n, b in model.named_buffers()},
        "hooks": {n: (getattr(m, "_hf_hook", None), m.forward) for n, m in model.named_modules()},
        "modules": [id(m) for m in model.modules()],
    }


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Net()


def planned_unchanged(model, budget, **kwargs):
    before, given = snapshot(model), copy.deepcopy(budget)
    try:
        return allocator.plan(model, budget, **kwargs)
    finally:
        assert snapshot(model) == before
        assert budget == given


@pytest.mark.parametrize("budget,match", [
    ({"cpu": -1}, "negative"), ({"cpu": "-1GiB"}, "negative"), ({"cpu": float("nan")}, "finite"),
    ({"cpu": float("inf")}, "finite"), ({"cpu": "10XB"}, "not a size"), ({"cpu": None}, "must be"),
    ({"cpu": True}, "boolean"), ({"tpu": 10}, "unknown device"), ({"cuda:x": 10}, "unknown device"),
    ({-1: 10}, "negative"), ({0: 10, "cuda:0": 10}, "twice"), ([("cpu", 10)], "dict"), ("10GiB", "dict"),
])
def test_bad_budgets(model, budget, match):
    with pytest.raises(InvalidBudget, match=match):
        planned_unchanged(model, budget)


def test_zero_budget_means_nothing_there(model):
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    plan = planned_unchanged(model, {0: 0, "cpu": 4 * total})
    assert 0 not in plan.device_map.values() and plan.valid


@pytest.mark.parametrize("kwargs,error,match", [
    ({"special_dtypes": {"nope.weight": "float16"}}, InvalidOption, "special_dtypes"),
    ({"dtype": "float17"}, InvalidOption, "dtype"),
    ({"dtype": 3}, InvalidOption, "dtype"),
    ({"strategy": "fastest"}, InvalidOption, "unknown strategy"),
    ({"no_split_module_classes": [3]}, InvalidOption, "class names"),
    ({"size_fn": lambda name, t: -1}, InvalidOption, "size_fn"),
    ({"tied_parameters": [["embed.weight", "nope"]]}, InvalidOption, "unknown tensors"),
    ({"profile": {"tokens": 1}}, InvalidOption, "Profile"),
])
def test_bad_options(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        planned_unchanged(model, {"cpu": 10**6}, **kwargs)


def test_unknown_no_split_names_warn_but_plan(model, caplog):
    with caplog.at_level(logging.WARNING, logger="allocator"):
        plan = planned_unchanged(model, {"cpu": 10**6}, no_split_module_classes=["Blokc"])
    assert plan.valid and "'Blokc' matches no module" in caplog.text


def test_not_a_model_and_cycles():
    with pytest.raises(InvalidModel, match="nn.Module"):
        allocator.plan({"weight": 1}, {"cpu": 10})
    loop = nn.Sequential(nn.Linear(2, 2))
    loop.add_module("again", loop)
    with pytest.raises(InvalidModel, match="cycle"):
        allocator.plan(loop, {"cpu": 10})


def test_empty_model_gets_an_empty_map():
    assert allocator.plan(nn.Module(), {"cpu": 10}).device_map == {}


def test_already_dispatched_model_is_planned_from_its_sizes(model, tmp_path):
    from accelerate import dispatch_model

    reference = allocator.plan(model, {"cpu": 10**6})
    dispatch_model(model, {"embed": "cpu", "blocks": "disk", "head": "cpu"}, offload_dir=str(tmp_path))
    assert model.blocks[0].fc.weight.device.type == "meta"  # offloaded by the hooks
    plan = planned_unchanged(model, {"cpu": 10**6})
    assert plan.device_map == reference.device_map and plan.valid


def test_parameters_on_real_devices_and_int_bool_tensors(model):
    problem = allocator.build_problem(model, {"cpu": 10**6}, dtype=torch.float16)
    block = problem.graph.node_index["blocks.0"]
    # fp16 weights (272 params x 2 B), int8 buffer kept at 1 B, bool buffer 1 B per element (accelerate says 1/8)
    assert problem.graph.size[block] == 272 * 2 + 4 + 32
    assert problem.graph.size_accelerate[block] == 272 * 2 + 4 + 4
    assert planned_unchanged(model, {"cpu": 10**6}, dtype=torch.float16).valid


def test_ties_across_a_no_split_boundary_stay_together(model):
    model.head.weight = model.embed.weight  # 32 x 16, outside any block
    model.blocks[2].fc.weight = nn.Parameter(torch.empty(16, 16))
    model.blocks[2].fc.weight = model.blocks[0].fc.weight  # across two no-split blocks
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    for budget in ({0: total // 3, "cpu": 4 * total}, {0: total // 2, 1: total // 2, "cpu": 4 * total}):
        for strategy in ("auto", "backfill", "reserve", "ilp"):
            plan = planned_unchanged(model, budget, strategy=strategy)
            assert plan.valid, plan.violations
            devices = {k: allocator.evaluate.memory.device_of(k, plan.device_map)
                       for k in ("blocks.0.fc.weight", "blocks.2.fc.weight")}
            assert len(set(devices.values())) == 1


def test_missing_accelerator_is_a_note_when_planning_and_an_error_when_dispatching(model, caplog):
    absent = max(3, torch.cuda.device_count())   # an index this machine has no accelerator for, GPUs or not
    with caplog.at_level(logging.INFO, logger="allocator"):
        plan = planned_unchanged(model, {absent: 10**6, "cpu": 10**6})
    assert plan.device_map == {"": absent} and "does not have" in caplog.text
    from accelerate import dispatch_model

    with pytest.raises(RuntimeError, match="accelerator|CUDA|cuda"):
        dispatch_model(model, plan.device_map)


def test_malformed_device_maps_for_validate(model):
    with pytest.raises(InvalidDeviceMap, match="dict"):
        allocator.validate(model, ["cpu"], {"cpu": 10})
    with pytest.raises(InvalidDeviceMap, match="names"):
        allocator.validate(model, {1: "cpu"}, {"cpu": 10})
    with pytest.raises(InvalidDeviceMap, match="unknown device"):
        allocator.validate(model, {"": "tpu"}, {"cpu": 10})
