import math

import pytest

import allocator
from allocator.budgets import normalize_device, parse_budgets, parse_size
from allocator.errors import InvalidBudget


@pytest.mark.parametrize("text,expected", [
    ("10GiB", 10 * 2**30), ("500MB", 500 * 10**6), ("1.5GiB", int(1.5 * 2**30)), ("4Gb", 4 * 10**9 // 8),
    ("12KiB", 12 * 1024), ("7", 7), (1234, 1234), ("0", 0), ("2 GB", 2 * 10**9),
])
def test_parse_size_accepts_what_accelerate_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", -5, "ten", "10XB", "", float("nan"), float("inf"), True, None, [1]])
def test_parse_size_rejects_with_a_fix(bad):
    with pytest.raises(InvalidBudget, match=r"size|bytes|negative|finite|boolean|must"):
        parse_size(bad)


@pytest.mark.parametrize("key,expected", [
    (0, 0), ("cuda:1", 1), ("xpu:0", 0), ("npu:2", 2), ("mps", "mps"), ("CPU", "cpu"), ("disk", "disk"), ("3", 3),
])
def test_device_keys(key, expected):
    assert normalize_device(key) == expected


def test_torch_device_keys():
    import torch

    assert normalize_device(torch.device("cuda", 1)) == 1
    assert normalize_device(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", -1, 1.5, False])
def test_unknown_devices_are_typed_errors(bad):
    with pytest.raises(InvalidBudget, match="device"):
        normalize_device(bad)


def test_order_and_disk_and_no_mutation():
    given = {"cpu": "1GiB", "cuda:1": "2GB", 0: 100, "disk": "1TB"}
    snapshot = dict(given)
    b = parse_budgets(given)
    assert b.order == (0, 1, "cpu", "disk")
    assert b.limit(0) == 100 and b.limit("disk") == 10**12
    assert given == snapshot


def test_duplicate_device_and_wrong_type():
    with pytest.raises(InvalidBudget, match="twice"):
        parse_budgets({0: 1, "cuda:0": 2})
    with pytest.raises(InvalidBudget, match="dict"):
        parse_budgets([("cpu", 1)])


def test_default_budget_is_this_machine():
    b = parse_budgets(None)
    assert "cpu" in b.order and b.limit("cpu") > 0


def test_errors_are_value_errors():
    for cls in (allocator.InvalidBudget, allocator.InfeasiblePlacement, allocator.InvalidOption,
                allocator.InvalidModel, allocator.InvalidDeviceMap, allocator.UnsupportedByAccelerate):
        assert issubclass(cls, ValueError)
    assert math.isfinite(parse_size(0))
